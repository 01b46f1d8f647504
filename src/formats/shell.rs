//! Paths and values written into a command the user is to paste into a shell (`continue with
//! `xtrain train --resume ...``): quoted where the shell would otherwise split or expand them.

use std::borrow::Cow;
use std::path::Path;

/// `s` as one shell word: as it is when every character is one the shell takes literally
/// (letters, digits and `@%+=:,./-_`), else in single quotes, each `'` in it written `'\''`.
pub fn word(s: &str) -> Cow<'_, str> {
    let plain = |c: char| c.is_ascii_alphanumeric() || "@%+=:,./-_".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        Cow::Borrowed(s)
    } else {
        Cow::Owned(format!("'{}'", s.replace('\'', r"'\''")))
    }
}

/// Path `p` as one shell word ([`word`]).
pub fn path(p: &Path) -> String {
    word(&p.to_string_lossy()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::word;

    #[test]
    fn a_word_is_quoted_only_where_the_shell_would_change_it() {
        assert_eq!(word("runs/x/checkpoint-3"), "runs/x/checkpoint-3");
        assert_eq!(word("/abs/a_b.c@d%e+f=g:h,i"), "/abs/a_b.c@d%e+f=g:h,i");
        assert_eq!(word("my runs/x"), "'my runs/x'");
        assert_eq!(word("it's"), r"'it'\''s'");
        assert_eq!(word("$HOME/*"), "'$HOME/*'");
        assert_eq!(word("~/x"), "'~/x'");
        assert_eq!(word("a;b&c|d"), "'a;b&c|d'");
        assert_eq!(word(""), "''");
        assert_eq!(word("é"), "'é'");
    }
}
