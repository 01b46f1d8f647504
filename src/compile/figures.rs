//! How `xtrain compile` prints a compiler's figures: sizes, times, and the per-device memory of a
//! compiled step, the same lines for this machine's plugin and for a `--target`'s.

use crate::program::StepSpec;

use crate::words::gib;

/// Per-device figures, the same lines for every plugin: device memory (what must fit), host
/// memory where the program offloads (per device and per host), and whether it fits.
pub fn print_memory(
    m: &pjrt::MemoryStats,
    available: Option<i64>,
    devices_per_host: i64,
    spec: &StepSpec,
) {
    crate::say!(
        "per device: arguments {}, outputs {} ({} aliased to arguments), temporaries {}, code {}",
        gib(m.argument_bytes),
        gib(m.output_bytes),
        gib(m.alias_bytes),
        gib(m.temp_bytes),
        gib(m.generated_code_bytes)
    );
    if m.host_total_bytes() > 0 {
        crate::say!(
            "in host memory, per device: arguments {}, temporaries {}; per host ({devices_per_host} \
             device(s)): {}",
            gib(m.host_argument_bytes),
            gib(m.host_temp_bytes),
            gib(m.host_total_bytes() * devices_per_host)
        );
    }
    let fits = match available {
        Some(have) if m.total_bytes() <= have => format!(" of {}: fits", gib(have)),
        Some(have) => format!(
            " of {}: does not fit ({})",
            gib(have),
            crate::device::memory::fit::fit_advice(m.total_bytes(), Some(have), spec)
        ),
        None => String::new(),
    };
    crate::say!(
        "per device total (arguments + non-aliased outputs + temporaries): {}{fits}",
        gib(m.total_bytes())
    );
}
