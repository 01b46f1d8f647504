//! How xtrain words numbers, durations, sizes and lists in its messages, the same way in every
//! stage: `1 device` and `4 devices`, `processes 1-3, 7`, `30 s`, `1.50 GiB`. Any stage may use it
//! (it uses none of them), so that a count is never written by hand as `1 devices` or
//! `device(s)`.

use std::time::Duration;

/// `device` for 1, `devices` otherwise; English plurals of the nouns xtrain counts (`process` ->
/// `processes`, `entry` -> `entries`).
pub fn plural(n: usize, noun: &str) -> String {
    if n == 1 {
        return noun.to_string();
    }
    let ends = |s: &str| noun.ends_with(s);
    if ends("s") || ends("x") || ends("z") || ends("ch") || ends("sh") {
        format!("{noun}es")
    } else if let Some(stem) = noun
        .strip_suffix('y')
        .filter(|s| !s.ends_with(['a', 'e', 'o', 'u']))
    {
        format!("{stem}ies")
    } else {
        format!("{noun}s")
    }
}

/// `1 device`, `4 devices`, `0 processes`: a count and its noun.
pub fn count(n: usize, noun: &str) -> String {
    format!("{n} {}", plural(n, noun))
}

/// `device 3`, `devices 0-3`: a run of consecutive indices (the first and last of `of`).
pub fn span(of: &[usize], noun: &str) -> String {
    match (of.first(), of.last()) {
        (Some(a), Some(b)) if a != b => format!("{} {a}-{b}", plural(2, noun)),
        (Some(a), _) => format!("{noun} {a}"),
        _ => format!("no {}", plural(0, noun)),
    }
}

/// Indices as runs, ascending and each once, whatever order they come in: `1-3, 7, 9-999`
/// (two in a row are listed, `4, 5`). A list of 65,536 process ids with a few missing stays a
/// line.
pub fn ranges(ids: &[usize]) -> String {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for id in sorted {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == id => *end = id,
            _ => runs.push((id, id)),
        }
    }
    let runs: Vec<String> = runs
        .iter()
        .map(|&(a, b)| match b - a {
            0 => a.to_string(),
            1 => format!("{a}, {b}"),
            _ => format!("{a}-{b}"),
        })
        .collect();
    runs.join(", ")
}

/// `process 3`, `processes 1-3, 7`: a noun and the indices it names, as [`ranges`].
pub fn ids(noun: &str, ids: &[usize]) -> String {
    format!("{} {}", plural(ids.len(), noun), ranges(ids))
}

/// `30 s`, `1.5 s`: a duration as a person reads it (to the millisecond).
pub fn secs(d: Duration) -> String {
    format!("{} s", (d.as_secs_f64() * 1000.0).round() / 1000.0)
}

/// `1.234 s`, `3.000 ms`, `2.00 us`: seconds, or milliseconds and microseconds for small ones (a
/// compiler's estimate of a step).
pub fn duration(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.2} us", s * 1e6)
    }
}

/// `1:05:03`, `4:07`: a wall-clock span, to the second.
pub fn clock(s: f64) -> String {
    let s = s.round() as i64;
    match s >= 3600 {
        true => format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60),
        false => format!("{}:{:02}", s / 60, s % 60),
    }
}

/// `n` bytes as GiB, two decimals; MiB or KiB for small figures (a tiny test model's), so that
/// no figure reads 0.00.
pub fn gib(n: i64) -> String {
    let x = n as f64;
    if x.abs() >= (1u64 << 30) as f64 / 100.0 {
        format!("{:.2} GiB", x / (1u64 << 30) as f64)
    } else if x.abs() >= (1u64 << 20) as f64 / 100.0 {
        format!("{:.2} MiB", x / (1u64 << 20) as f64)
    } else {
        format!("{:.2} KiB", x / 1024.0)
    }
}

/// `x` with `places` decimals, never `-0.0000`: a figure that rounds to zero is shown as zero,
/// whatever side of it the float noise fell (a DPO margin at step 1, where the policy is the
/// reference).
pub fn fixed(x: f64, places: usize) -> String {
    let s = format!("{x:.places$}");
    match s.strip_prefix('-') {
        Some(rest) if rest.chars().all(|c| c == '0' || c == '.') => rest.to_string(),
        _ => s,
    }
}

/// This machine's host name (`gethostname`), or None where it cannot be read. Messages say `?`
/// for None; a file name says something else.
pub fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or fails.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(0);
    match std::str::from_utf8(&buf[..end]) {
        Ok(h) if ok && !h.is_empty() => Some(h.to_string()),
        _ => None,
    }
}

/// This machine's host name for a message: `?` where it cannot be read.
pub fn host() -> String {
    hostname().unwrap_or_else(|| "?".into())
}

/// Text from a peer (a host name, a setting's value, a key), as it may be printed: control
/// characters and escape sequences escaped (`\u{1b}`), at most `max` characters kept.
pub fn escaped(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max)
        .flat_map(|c| {
            let keep = !c.is_control() && c != '\u{2028}' && c != '\u{2029}';
            let one: Vec<char> = match keep {
                true => vec![c],
                false => c.escape_default().collect(),
            };
            one
        })
        .collect();
    if text.chars().nth(max).is_some() {
        out.push_str("...");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_figure_that_rounds_to_zero_has_no_sign() {
        assert_eq!(fixed(-1.2e-7, 4), "0.0000");
        assert_eq!(fixed(1.2e-7, 4), "0.0000");
        assert_eq!(fixed(-0.00006, 4), "-0.0001");
        assert_eq!(fixed(-2.5, 1), "-2.5");
        assert_eq!(fixed(f64::NAN, 2), "NaN");
    }

    #[test]
    fn counts_and_plurals() {
        assert_eq!(count(1, "device"), "1 device");
        assert_eq!(count(4, "device"), "4 devices");
        assert_eq!(count(0, "process"), "0 processes");
        assert_eq!(count(1, "process"), "1 process");
        assert_eq!(count(2, "batch"), "2 batches");
        assert_eq!(count(3, "entry"), "3 entries");
        assert_eq!(count(3, "key"), "3 keys");
        assert_eq!(plural(2, "host"), "hosts");
    }

    #[test]
    fn spans_and_ranges() {
        assert_eq!(span(&[0, 1, 2, 3], "device"), "devices 0-3");
        assert_eq!(span(&[3], "device"), "device 3");
        assert_eq!(span(&[], "device"), "no devices");
        assert_eq!(ranges(&[1, 2, 3, 7, 9, 10]), "1-3, 7, 9, 10");
        assert_eq!(ranges(&[7, 1, 3, 2, 3]), "1-3, 7");
        assert_eq!(ranges(&[]), "");
        assert_eq!(ids("process", &[2]), "process 2");
        assert_eq!(ids("process", &[1, 2]), "processes 1, 2");
        let many: Vec<usize> = (1..65_536).filter(|p| *p != 500).collect();
        assert_eq!(ids("process", &many), "processes 1-499, 501-65535");
    }

    #[test]
    fn a_peers_text_is_escaped_and_cut() {
        assert_eq!(escaped("node-07", 255), "node-07");
        assert_eq!(escaped("a\u{1b}[2Jb\n", 255), "a\\u{1b}[2Jb\\n");
        assert_eq!(escaped("abcdef", 3), "abc...");
    }

    #[test]
    fn durations_and_sizes() {
        assert_eq!(secs(Duration::from_millis(300)), "0.3 s");
        assert_eq!(secs(Duration::from_secs(30)), "30 s");
        assert_eq!(duration(1.5), "1.500 s");
        assert_eq!(duration(0.003), "3.000 ms");
        assert_eq!(duration(2e-6), "2.00 us");
        assert_eq!(clock(247.0), "4:07");
        assert_eq!(clock(3903.0), "1:05:03");
        assert_eq!(gib(3 << 30), "3.00 GiB");
        assert_eq!(gib(5 << 20), "5.00 MiB");
        assert_eq!(gib(2048), "2.00 KiB");
        assert!(!host().is_empty());
    }
}
