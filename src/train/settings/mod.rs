//! The settings that define a run, by the flag that sets them (`lora-alpha`, `lr`, `steps`, ...),
//! as recorded in every checkpoint (`trainer_state.json`) and as a program dir fixes them. A
//! resumed run (`--resume`) or a run of a compiled program (`--program`) takes every recorded
//! value for a flag left at its default, and refuses a flag given with another value, naming
//! both: a run never continues with another alpha, schedule or batch than the one it started
//! with, and never trains another rank than the one its program was built for.
//!
//! The flags' names are written once, as the fields of [`RunSettings`] (every setting of a run)
//! and `ProgramSettings` (those a program dir fixes); values are compared by flag in their JSON
//! form, and one is taken by replacing it in the run's settings and applying them back
//! ([`RunSettings::apply_to`]), so that no function maps names to fields by hand.

mod program;
mod resume_paths;
mod run;
mod settle;

pub use resume_paths::take_recorded_paths;
pub use run::{of_run, show, RunSettings, LAYOUT_AND_REPORTING, PATH_FLAGS};
pub use settle::{recorded_in, settle, Pinned};

#[cfg(test)]
mod tests;
