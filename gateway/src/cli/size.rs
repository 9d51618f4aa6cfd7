//! Parsing of `--memory` SIZE arguments: `64Mi`, `1Gi`, `500M`, `1G`, plain bytes.

use super::error::CliError;

/// The accepted unit suffixes and their multipliers. Binary (Ki…) before decimal (K…) does not
/// matter for correctness since we match the whole suffix, but it reads in the order of the help.
const UNITS: &[(&str, u64)] = &[
    ("", 1),
    ("Ki", 1 << 10),
    ("Mi", 1 << 20),
    ("Gi", 1 << 30),
    ("Ti", 1 << 40),
    ("K", 1_000),
    ("k", 1_000),
    ("M", 1_000_000),
    ("G", 1_000_000_000),
    ("T", 1_000_000_000_000),
];

/// Parses a memory size into bytes. A whole number, optionally followed by one unit suffix
/// (Ki, Mi, Gi, Ti = powers of 1024; K/k, M, G, T = powers of 1000). `0` means no limit.
pub fn parse_size(input: &str) -> Result<u64, CliError> {
    let invalid = || CliError::InvalidSize {
        input: input.to_string(),
    };
    let digits_end = input
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(input.len());
    let (digits, suffix) = input.split_at(digits_end);
    if digits.is_empty() {
        return Err(invalid());
    }
    let multiplier = UNITS
        .iter()
        .find(|(unit, _)| *unit == suffix)
        .map(|(_, m)| *m)
        .ok_or_else(invalid)?;
    let number: u64 = digits.parse().map_err(|_| invalid())?;
    number.checked_mul(multiplier).ok_or_else(invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(input: &str, expected: Option<u64>) {
        match (parse_size(input), expected) {
            (Ok(got), Some(want)) => assert_eq!(got, want, "input {input:?}"),
            (Err(err), None) => {
                assert!(
                    matches!(&err, CliError::InvalidSize { input: i } if i == input),
                    "input {input:?}: {err:?}"
                );
                assert!(err.to_string().contains("64Mi"), "{err}");
            }
            (got, want) => panic!("input {input:?}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn sizes() {
        check("64Mi", Some(64 * 1024 * 1024));
        check("1Gi", Some(1 << 30));
        check("500M", Some(500_000_000));
        check("1G", Some(1_000_000_000));
        check("4096", Some(4096));
        check("0", Some(0));
        check("2Ki", Some(2048));
        check("3k", Some(3000));
        check("1Ti", Some(1 << 40));
        check("18446744073709551615", Some(u64::MAX));
        check("", None);
        check("Mi", None);
        check("1.5Gi", None);
        check("64MB", None);
        check("64mi", None);
        check("-1", None);
        check(" 64Mi", None);
        check("64 Mi", None);
        check("18446744073709551616", None);
        check("17179869184Gi", None);
    }
}
