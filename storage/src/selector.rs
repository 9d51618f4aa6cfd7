//! Label selectors (`k=v,k2!=v2,k3,!k4`) and the label rules they rely on. No IO here.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::error::StoreError;

/// The longest label key or value, in bytes.
pub const MAX_LABEL_LEN: usize = 63;

/// One requirement of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    /// `k=v` (or `k==v`): the label is present with exactly this value.
    Equals { key: String, value: String },
    /// `k!=v`: the label is absent or has another value.
    NotEquals { key: String, value: String },
    /// `k`: the label is present, with any value.
    Exists { key: String },
    /// `!k`: the label is absent.
    NotExists { key: String },
}

impl Requirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Requirement::Equals { key, value } => labels.get(key) == Some(value),
            Requirement::NotEquals { key, value } => labels.get(key) != Some(value),
            Requirement::Exists { key } => labels.contains_key(key),
            Requirement::NotExists { key } => !labels.contains_key(key),
        }
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Requirement::Equals { key, value } => write!(f, "{key}={value}"),
            Requirement::NotEquals { key, value } => write!(f, "{key}!={value}"),
            Requirement::Exists { key } => write!(f, "{key}"),
            Requirement::NotExists { key } => write!(f, "!{key}"),
        }
    }
}

/// A conjunction of label requirements; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

impl LabelSelector {
    /// The selector that matches every record.
    pub fn everything() -> LabelSelector {
        LabelSelector::default()
    }

    /// A selector from requirements already built (each key and value is checked).
    pub fn from_requirements(requirements: Vec<Requirement>) -> Result<LabelSelector, StoreError> {
        for req in &requirements {
            match req {
                Requirement::Equals { key, value } | Requirement::NotEquals { key, value } => {
                    check_key(key).and_then(|_| check_value(value))
                }
                Requirement::Exists { key } | Requirement::NotExists { key } => check_key(key),
            }
            .map_err(|reason| {
                StoreError::invalid(format!("label selector term {req}: {reason}"))
            })?;
        }
        Ok(LabelSelector { requirements })
    }

    /// Parses `k=v,k2==v2,k3!=v3,k4,!k5`. Whitespace around terms is ignored; an empty (or
    /// all-blank) string is the selector that matches everything.
    pub fn parse(text: &str) -> Result<LabelSelector, StoreError> {
        if text.trim().is_empty() {
            return Ok(LabelSelector::everything());
        }
        let mut requirements = Vec::new();
        for (index, raw) in text.split(',').enumerate() {
            let term = raw.trim();
            let err = |reason: String| {
                StoreError::invalid(format!(
                    "label selector {text:?}, term {} ({term:?}): {reason}",
                    index + 1
                ))
            };
            if term.is_empty() {
                return Err(err("empty term".into()));
            }
            let req = if let Some((key, value)) = term.split_once("!=") {
                Requirement::NotEquals {
                    key: key.trim().to_string(),
                    value: value.trim().to_string(),
                }
            } else if let Some((key, value)) = term.split_once("==") {
                Requirement::Equals {
                    key: key.trim().to_string(),
                    value: value.trim().to_string(),
                }
            } else if let Some((key, value)) = term.split_once('=') {
                Requirement::Equals {
                    key: key.trim().to_string(),
                    value: value.trim().to_string(),
                }
            } else if let Some(key) = term.strip_prefix('!') {
                Requirement::NotExists {
                    key: key.trim().to_string(),
                }
            } else {
                Requirement::Exists {
                    key: term.to_string(),
                }
            };
            match &req {
                Requirement::Equals { key, value } | Requirement::NotEquals { key, value } => {
                    check_key(key).and_then(|_| check_value(value))
                }
                Requirement::Exists { key } | Requirement::NotExists { key } => check_key(key),
            }
            .map_err(err)?;
            requirements.push(req);
        }
        Ok(LabelSelector { requirements })
    }

    /// Whether `labels` meet every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }

    /// Whether this selector matches everything.
    pub fn is_everything(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn requirements(&self) -> &[Requirement] {
        &self.requirements
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, req) in self.requirements.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{req}")?;
        }
        Ok(())
    }
}

impl FromStr for LabelSelector {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LabelSelector::parse(s)
    }
}

/// Checks a set of labels before it is stored: every key and value must be selectable.
pub fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), StoreError> {
    for (key, value) in labels {
        check_key(key)
            .and_then(|_| check_value(value))
            .map_err(|reason| StoreError::invalid(format!("label {key:?}={value:?}: {reason}")))?;
    }
    Ok(())
}

fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("label key is empty".into());
    }
    if key.len() > MAX_LABEL_LEN {
        return Err(format!(
            "label key is {} bytes, over the limit of {MAX_LABEL_LEN}",
            key.len()
        ));
    }
    if let Some(ch) = key
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/')))
    {
        return Err(format!(
            "label key {key:?} has {ch:?}; keys use letters, digits, '-', '_', '.', '/'"
        ));
    }
    Ok(())
}

fn check_value(value: &str) -> Result<(), String> {
    if value.len() > MAX_LABEL_LEN {
        return Err(format!(
            "label value is {} bytes, over the limit of {MAX_LABEL_LEN}",
            value.len()
        ));
    }
    if let Some(ch) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "label value {value:?} has {ch:?}; values use letters, digits, '-', '_', '.'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Parses `selector` and checks it against each label set: `expected[i]` is whether
    /// `sets[i]` matches.
    fn check(selector: &str, sets: &[&[(&str, &str)]], expected: &[bool]) {
        let sel = LabelSelector::parse(selector).unwrap();
        for (set, want) in sets.iter().zip(expected) {
            assert_eq!(sel.matches(&labels(set)), *want, "{selector:?} on {set:?}");
        }
        let reparsed = LabelSelector::parse(&sel.to_string()).unwrap();
        assert_eq!(reparsed, sel, "display of {selector:?} parses back");
    }

    const SETS: &[&[(&str, &str)]] = &[
        &[],
        &[("app", "web")],
        &[("app", "db"), ("tier", "gold")],
        &[("app", "web"), ("tier", "gold")],
    ];

    #[test]
    fn selectors_match_as_documented() {
        check("", SETS, &[true, true, true, true]);
        check("  ", SETS, &[true, true, true, true]);
        check("app=web", SETS, &[false, true, false, true]);
        check("app==web", SETS, &[false, true, false, true]);
        check("app!=web", SETS, &[true, false, true, false]);
        check("tier", SETS, &[false, false, true, true]);
        check("!tier", SETS, &[true, true, false, false]);
        check("app=web, tier", SETS, &[false, false, false, true]);
        check("app=web,!tier", SETS, &[false, true, false, false]);
        check("app=", SETS, &[false, false, false, false]);
    }

    #[test]
    fn display_is_canonical() {
        let sel = LabelSelector::parse(" a == 1 , !b,c , d!=x").unwrap();
        assert_eq!(sel.to_string(), "a=1,!b,c,d!=x");
        assert_eq!(sel.requirements().len(), 4);
    }

    #[test]
    fn parse_errors_name_the_term() {
        for (text, needle) in [
            ("a=b,,c", "term 2"),
            ("=v", "key is empty"),
            ("!", "key is empty"),
            ("a b=c", "' '"),
            ("a=b c", "' '"),
            ("a=b=c", "'='"),
        ] {
            match LabelSelector::parse(text) {
                Err(StoreError::Invalid { reason }) => {
                    assert!(reason.contains(needle), "{text:?}: {reason}")
                }
                other => panic!("{text:?} should be refused, got {other:?}"),
            }
        }
    }

    #[test]
    fn label_rules() {
        assert!(validate_labels(&labels(&[("app", "web"), ("a.b/c", "")])).is_ok());
        assert!(validate_labels(&labels(&[("", "x")])).is_err());
        assert!(validate_labels(&labels(&[("k", "a,b")])).is_err());
        assert!(validate_labels(&labels(&[("k", &"v".repeat(64))])).is_err());
    }
}
