//! `--remat auto` and `--offload auto`: the remat and offload choices tried in order
//! (`program::fit_choices`) until one fits, the same loop for a run on a real device
//! (`offload::choose`) and for `xtrain compile --check --target` (each choice compiled for every
//! target). What a choice is built into and how it is checked are the caller's.

use crate::program::{Offload, Remat};

/// A remat policy and what is kept in host memory.
pub type Choice = (Remat, Offload);

/// Try `choices` in order until one is taken. `build` makes a choice's step (its spec and
/// program, and whatever else the caller keeps of it); `take` checks it against the memory it
/// must fit and says whether to take it. `take` is told the choice that comes next (None for the
/// last), so that it can say what is tried next, or take the last choice whether or not it fits.
/// Returns the choice taken and its step; None where every choice was checked and none taken.
pub fn first_that_fits<T>(
    choices: &[Choice],
    mut build: impl FnMut(Choice) -> anyhow::Result<T>,
    mut take: impl FnMut(&mut T, Choice, Option<Choice>) -> anyhow::Result<bool>,
) -> anyhow::Result<Option<(Choice, T)>> {
    for (k, &choice) in choices.iter().enumerate() {
        let mut step = build(choice)?;
        if take(&mut step, choice, choices.get(k + 1).copied())? {
            return Ok(Some((choice, step)));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHOICES: [Choice; 3] = [
        (Remat::SaveProj, Offload::NONE),
        (Remat::Layer, Offload::NONE),
        (Remat::Layer, Offload::AUTO_ORDER[1]),
    ];

    /// Choices are built and checked in order, each told the next, until one is taken.
    #[test]
    fn takes_the_first_choice_that_fits_in_order() {
        let mut seen = Vec::new();
        let taken = first_that_fits(
            &CHOICES,
            |c| Ok(c.0.name()),
            |built, c, next| {
                seen.push((*built, next));
                Ok(c.0 == Remat::Layer)
            },
        )
        .unwrap();
        assert_eq!(taken, Some((CHOICES[1], "layer")));
        assert_eq!(
            seen,
            [("save-proj", Some(CHOICES[1])), ("layer", Some(CHOICES[2]))]
        );
    }

    #[test]
    fn none_taken_is_none_and_errors_stop_the_loop() {
        let mut built = 0;
        let none = first_that_fits(
            &CHOICES,
            |_| {
                built += 1;
                Ok(())
            },
            |_, _, _| Ok(false),
        );
        assert!(none.unwrap().is_none());
        assert_eq!(built, 3);
        let failed = first_that_fits(&CHOICES, |_| Ok(()), |_, _, _| anyhow::bail!("no"));
        assert_eq!(failed.unwrap_err().to_string(), "no");
    }
}
