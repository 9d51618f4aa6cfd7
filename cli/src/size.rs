//! Resource quantities as people write them (the Kubernetes spellings), turned into what the
//! API carries: `--cpu` in thousandths of a core (`cpu_millis`), `--memory` in bytes.
//!
//! - CPU: cores as a decimal (`2`, `0.5`, `1.25`; at most 3 decimals, since the API counts
//!   millicores) or millicores with `m` (`500m`). `0` means no limit.
//! - Memory: a decimal number with an optional unit: Ki, Mi, Gi, Ti (powers of 1024) or K/k, M,
//!   G, T (powers of 1000); no unit means bytes. A fraction of a byte is rounded up, as
//!   Kubernetes does (`0.1Ki` = 103 bytes). `0` means no limit.
//!
//! - Durations (`--timeout`): seconds as a bare number (`30`) or with a unit, as `kubectl`
//!   and `timeout(1)` write them: `30s`, `2m`, `1h`, combined `1m30s`.
//!
//! The parsers are clap value parsers: clap prints the value given beside the flag
//! (`invalid value '12Q' for '--memory <SIZE>': …`), so the messages here say only what is
//! accepted.

use super::error::CliError;

/// Parses a memory size into bytes (see the module doc).
pub fn parse_size(input: &str) -> Result<u64, CliError> {
    sbx_proto::quantity::parse_bytes(input).ok_or_else(|| CliError::InvalidSize {
        input: input.to_string(),
    })
}

/// Parses a CPU quantity into millicores (see the module doc).
pub fn parse_cpu(input: &str) -> Result<u32, CliError> {
    sbx_proto::quantity::parse_millicores(input).ok_or_else(|| CliError::InvalidCpu {
        input: input.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `parse(input)` is `expected`, or (for `None`) an error about `input` whose text
    /// contains `hint`.
    fn check_with<T: PartialEq + std::fmt::Debug>(
        parse: fn(&str) -> Result<T, CliError>,
        hint: &str,
        input: &str,
        expected: Option<T>,
    ) {
        match (parse(input), expected) {
            (Ok(got), Some(want)) => assert_eq!(got, want, "input {input:?}"),
            (Err(err), None) => {
                assert!(
                    matches!(&err, CliError::InvalidSize { input: i } | CliError::InvalidCpu { input: i } if i == input),
                    "input {input:?}: {err:?}"
                );
                assert!(err.to_string().contains(hint), "{err}");
            }
            (got, want) => panic!("input {input:?}: got {got:?}, want {want:?}"),
        }
    }

    fn check(input: &str, expected: Option<u64>) {
        check_with(parse_size, "512Mi", input, expected);
    }

    fn check_cpu(input: &str, expected: Option<u32>) {
        check_with(parse_cpu, "500m", input, expected);
    }

    #[test]
    fn sizes() {
        check("64Mi", Some(64 * 1024 * 1024));
        check("512Mi", Some(512 << 20));
        check("1Gi", Some(1 << 30));
        check("1.5Gi", Some(3 << 29));
        check("0.5Ki", Some(512));
        check("0.1Ki", Some(103));
        check("500M", Some(500_000_000));
        check("1G", Some(1_000_000_000));
        check("2.5G", Some(2_500_000_000));
        check("4096", Some(4096));
        check("0", Some(0));
        check("2Ki", Some(2048));
        check("3k", Some(3000));
        check("1Ti", Some(1 << 40));
        check("18446744073709551615", Some(u64::MAX));
        check("", None);
        check("Mi", None);
        check(".5Gi", None);
        check("5.Gi", None);
        check("1.2.3", None);
        check("12Q", None);
        check("64MB", None);
        check("64mi", None);
        check("64m", None);
        check("-1", None);
        check(" 64Mi", None);
        check("64 Mi", None);
        check("1e9", None);
        check("18446744073709551616", None);
        check("17179869184Gi", None);
    }

    #[test]
    fn cpus() {
        check_cpu("2", Some(2000));
        check_cpu("0.5", Some(500));
        check_cpu("1.25", Some(1250));
        check_cpu("0.001", Some(1));
        check_cpu("500m", Some(500));
        check_cpu("1500m", Some(1500));
        check_cpu("0", Some(0));
        check_cpu("0m", Some(0));
        check_cpu("4294967295m", Some(u32::MAX));
        check_cpu("4294967296m", None);
        check_cpu("4294968", None);
        check_cpu("0.0005", None);
        check_cpu("1.5m", None);
        check_cpu("", None);
        check_cpu("m", None);
        check_cpu("-1", None);
        check_cpu("2 cores", None);
        check_cpu("2c", None);
        check_cpu("500M", None);
    }
}

/// A duration in whole seconds: `30` (seconds), `30s`, `2m`, `1h`, or a combination
/// (`1h2m3s`); at most 10 days.
pub fn parse_secs(input: &str) -> Result<u64, CliError> {
    parse_secs_up_to(input, MAX_SECS)
}

/// A lifetime's duration (`--ttl`, `--idle-timeout`, `--delete-after`, `sbx sandbox ttl`): as
/// [`parse_secs`], with days too (`7d`, `1d12h`), up to 100 years (the gateway refuses what is
/// past its `--max-ttl`, naming the field). A negative one is refused here.
pub fn parse_lifetime(input: &str) -> Result<u64, CliError> {
    parse_secs_up_to(input, 100 * 365 * 86_400).map_err(|_| CliError::InvalidLifetime {
        input: input.to_string(),
    })
}

fn parse_secs_up_to(input: &str, max: u64) -> Result<u64, CliError> {
    let bad = || CliError::InvalidDuration {
        input: input.to_string(),
    };
    let text = input.trim();
    if text.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = text.parse::<u64>() {
        return (secs <= max).then_some(secs).ok_or_else(bad);
    }
    let mut total: u64 = 0;
    let mut digits = String::new();
    let mut last_unit = u64::MAX;
    for c in text.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            'd' => 86_400,
            'h' => 3600,
            'm' => 60,
            's' => 1,
            _ => return Err(bad()),
        };
        // Each unit once, largest first (`1m30s`, not `30s1m`).
        if digits.is_empty() || unit >= last_unit {
            return Err(bad());
        }
        last_unit = unit;
        let n: u64 = digits.parse().map_err(|_| bad())?;
        total = total
            .checked_add(n.checked_mul(unit).ok_or_else(bad)?)
            .ok_or_else(bad)?;
        digits.clear();
    }
    if !digits.is_empty() || total > max {
        return Err(bad());
    }
    Ok(total)
}

/// [`parse_secs`] for a flag the API carries as 32 bits.
pub fn parse_secs_u32(input: &str) -> Result<u32, CliError> {
    parse_secs(input).map(|s| s as u32)
}

/// The longest duration a `--timeout` takes: 10 days.
const MAX_SECS: u64 = 10 * 24 * 3600;

#[cfg(test)]
mod duration_tests {
    use super::*;

    #[test]
    fn durations_parse_as_people_write_them() {
        for (input, secs) in [
            ("30", 30),
            ("0", 0),
            ("30s", 30),
            ("2m", 120),
            ("1h", 3600),
            ("1m30s", 90),
            ("1h2m3s", 3723),
        ] {
            assert_eq!(parse_secs(input).unwrap(), secs, "{input}");
        }
        for bad in [
            "",
            "s",
            "1x",
            "30s1m",
            "1m1m",
            "-1",
            "1.5s",
            "999999999h",
            "11d",
            "1h1d",
        ] {
            assert!(parse_secs(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_secs("1d2h").unwrap(), 93_600);
        // A lifetime takes days and more than 10 of them, never a negative or a fraction.
        assert_eq!(parse_lifetime("30d").unwrap(), 30 * 86_400);
        assert_eq!(parse_lifetime("0").unwrap(), 0);
        for bad in ["-5m", "-1", "1.5h", "101000d", "ten minutes"] {
            assert!(
                matches!(parse_lifetime(bad), Err(CliError::InvalidLifetime { .. })),
                "{bad}"
            );
        }
        assert_eq!(parse_secs_u32("2m").unwrap(), 120);
    }
}
