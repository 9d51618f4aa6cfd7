//! Naming rules for workspaces and sandboxes.
//!
//! A name is a DNS-1123 label: 1 to 63 characters, lowercase ASCII letters, digits and `-`,
//! starting and ending with a letter or digit. The rule is checked at every boundary that
//! accepts a name — the public API, the actor API and the store — so a record with an empty or
//! malformed name can never be written.

/// The longest name accepted, in bytes (the DNS-1123 label limit).
pub const MAX_NAME_LEN: usize = 63;

/// The workspace that an empty workspace name in a request stands for.
pub const DEFAULT_WORKSPACE: &str = "default";

/// The rule, in words, for error messages.
pub const NAME_RULE: &str = "a name must be 1 to 63 characters of lowercase letters (a-z), \
digits (0-9) and '-', and must start and end with a letter or digit";

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NameError {
    Empty,
    TooLong { len: usize },
    BadCharacter { ch: char, index: usize },
    BadEdge,
}

impl std::fmt::Display for NameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NameError::Empty => write!(f, "name is empty; {NAME_RULE}"),
            NameError::TooLong { len } => {
                write!(
                    f,
                    "name is {len} bytes long, over the limit of {MAX_NAME_LEN}; {NAME_RULE}"
                )
            }
            NameError::BadCharacter { ch, index } => {
                write!(f, "name has {ch:?} at position {index}; {NAME_RULE}")
            }
            NameError::BadEdge => write!(f, "name starts or ends with '-'; {NAME_RULE}"),
        }
    }
}

impl std::error::Error for NameError {}

/// Checks `name` against the DNS-1123 label rule.
pub fn validate_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong { len: name.len() });
    }
    if let Some((index, ch)) = name
        .chars()
        .enumerate()
        .find(|(_, c)| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Err(NameError::BadCharacter { ch, index });
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Err(NameError::BadEdge);
    }
    Ok(())
}

/// The workspace a request means: an empty name stands for [`DEFAULT_WORKSPACE`].
pub fn workspace_or_default(workspace: &str) -> &str {
    if workspace.is_empty() {
        DEFAULT_WORKSPACE
    } else {
        workspace
    }
}

/// The most edits (insertions, deletions, substitutions) between a name and one
/// [`similar`] offers in its place.
pub const SIMILAR_EDITS: usize = 2;

/// The `candidates` within [`SIMILAR_EDITS`] of `name` (a typo's "did you mean"; two
/// swapped letters are one edit), and fewer edits than the shorter of the two has letters (so
/// `db` is not offered for `web`), nearest first (then by name), at most three, never `name`
/// itself.
pub fn similar<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut near: Vec<(usize, &str)> = candidates
        .into_iter()
        .filter(|c| *c != name)
        .map(|c| (strsim::osa_distance(name, c), c))
        .filter(|(edits, c)| {
            *edits <= SIMILAR_EDITS && *edits < name.chars().count().min(c.chars().count())
        })
        .collect();
    near.sort();
    near.dedup();
    near.into_iter()
        .take(3)
        .map(|(_, c)| c.to_string())
        .collect()
}

/// `similar`'s names as the end of a message: nothing, ` (did you mean "web"?)`, or
/// ` (did you mean "web" or "web2"?)`.
pub fn did_you_mean(similar: &[String]) -> String {
    let quoted: Vec<String> = similar.iter().map(|s| format!("{s:?}")).collect();
    match quoted.as_slice() {
        [] => String::new(),
        [one] => format!(" (did you mean {one}?)"),
        [rest @ .., last] => format!(" (did you mean {} or {last}?)", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_within_two_edits_is_offered_nearest_first() {
        let names = ["web", "web-2", "worker", "db", "wbe"];
        assert_eq!(similar("weeb", names), vec!["web", "wbe"]);
        assert_eq!(similar("web", names), vec!["wbe", "web-2"]);
        assert_eq!(similar("wrker", names), vec!["worker"]);
        assert!(similar("postgres", names).is_empty());
        assert_eq!(did_you_mean(&[]), "");
        assert_eq!(did_you_mean(&["web".into()]), " (did you mean \"web\"?)");
        assert_eq!(
            did_you_mean(&["a".into(), "b".into(), "c".into()]),
            " (did you mean \"a\", \"b\" or \"c\"?)"
        );
    }

    fn check(name: &str, expected: Result<(), NameError>) {
        assert_eq!(validate_name(name), expected, "name {name:?}");
    }

    #[test]
    fn names() {
        check("demo", Ok(()));
        check("a", Ok(()));
        check("0", Ok(()));
        check("web-1", Ok(()));
        check(&"a".repeat(63), Ok(()));
        check("", Err(NameError::Empty));
        check(&"a".repeat(64), Err(NameError::TooLong { len: 64 }));
        check("Demo", Err(NameError::BadCharacter { ch: 'D', index: 0 }));
        check("a_b", Err(NameError::BadCharacter { ch: '_', index: 1 }));
        check("a.b", Err(NameError::BadCharacter { ch: '.', index: 1 }));
        check("é", Err(NameError::BadCharacter { ch: 'é', index: 0 }));
        check("a b", Err(NameError::BadCharacter { ch: ' ', index: 1 }));
        check("-a", Err(NameError::BadEdge));
        check("a-", Err(NameError::BadEdge));
        check("-", Err(NameError::BadEdge));
    }

    #[test]
    fn empty_workspace_is_default() {
        assert_eq!(workspace_or_default(""), "default");
        assert_eq!(workspace_or_default("alpha"), "alpha");
    }

    #[test]
    fn error_messages_state_the_rule() {
        for err in [
            NameError::Empty,
            NameError::TooLong { len: 70 },
            NameError::BadCharacter { ch: 'X', index: 2 },
            NameError::BadEdge,
        ] {
            assert!(err.to_string().contains("1 to 63 characters"), "{err}");
        }
    }
}
