//! How far apart two names are, for the "did you mean" of a refused name (a mesh axis, a
//! sharding rule's logical axis, a recipe key): one edit distance for every message.

/// Levenshtein distance: the fewest single-character insertions, deletions and substitutions
/// that make `a` into `b`.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(super::edit_distance("lora-rank", "lora-r"), 3);
        assert_eq!(super::edit_distance("lr", "lr"), 0);
        assert_eq!(super::edit_distance("fdsp", "fsdp"), 2);
        assert_eq!(super::edit_distance("", "abc"), 3);
    }
}
