//! Quantities as people write them (the Kubernetes spellings), shared by the CLI's flags and
//! the drivers' own (`--log-max`): a decimal number with an optional unit — Ki, Mi, Gi, Ti
//! (powers of 1024) or K/k, M, G, T (powers of 1000); no unit means bytes. A fraction of a
//! byte is rounded up, as Kubernetes does (`0.1Ki` = 103 bytes).
//!
//! CPU: cores as a decimal (`2`, `0.5`, `1.25`; at most 3 decimals, since the API counts
//! millicores) or millicores with `m` (`500m`).
//!
//! The `*_arg` functions are clap value parsers for the daemon's flags (the CLI wraps the
//! same parsers in its own error type); clap prints the value beside the flag, so their
//! messages ([`SIZE_HELP`], [`CPU_HELP`]) say only what is accepted.

/// The memory unit suffixes and their multipliers, in the order the help lists them.
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

/// A non-negative decimal `123` or `1.25` as (digits without the point, decimals), e.g.
/// `1.25` → (125, 2). `None` for anything else (signs, exponents, blanks, `.5`, `5.`), or more
/// than 18 decimals.
pub fn parse_decimal(text: &str) -> Option<(u128, u32)> {
    let (whole, fraction) = match text.split_once('.') {
        Some((whole, fraction)) if !fraction.is_empty() => (whole, fraction),
        Some(_) => return None,
        None => (text, ""),
    };
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !all_digits(whole) || !all_digits(fraction) || fraction.len() > 18 {
        return None;
    }
    let digits: u128 = format!("{whole}{fraction}").parse().ok()?;
    Some((digits, fraction.len() as u32))
}

/// Splits `input` where its number ends (the first byte that is neither a digit nor `.`).
pub fn split_number(input: &str) -> (&str, &str) {
    let end = input
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(input.len());
    input.split_at(end)
}

/// `input` in bytes (see the module docs); `None` when it is not a size or overflows 64 bits.
pub fn parse_bytes(input: &str) -> Option<u64> {
    let (number, suffix) = split_number(input);
    let multiplier = UNITS
        .iter()
        .find(|(unit, _)| *unit == suffix)
        .map(|(_, m)| u128::from(*m))?;
    let (digits, decimals) = parse_decimal(number)?;
    let bytes = digits
        .checked_mul(multiplier)?
        .div_ceil(10u128.pow(decimals));
    u64::try_from(bytes).ok()
}

/// What a size may be, for an error about one that is not.
pub const SIZE_HELP: &str = "expected bytes, or a number with a unit: Ki, Mi, Gi, Ti (powers of \
     1024) or K, M, G, T (powers of 1000), e.g. 512Mi, 1.5Gi, 1G";

/// What a CPU quantity may be, for an error about one that is not.
pub const CPU_HELP: &str =
    "expected cores (2, 0.5, at most 3 decimals) or millicores (500m), up to 4294967 cores";

/// A CPU quantity in millicores (see the module docs); `None` when it is not one or
/// overflows 32 bits.
pub fn parse_millicores(input: &str) -> Option<u32> {
    let (number, suffix) = split_number(input);
    let (digits, decimals) = parse_decimal(number)?;
    let millis = match suffix {
        "m" if decimals == 0 => digits,
        "" if decimals <= 3 => digits * 10u128.pow(3 - decimals),
        _ => return None,
    };
    u32::try_from(millis).ok()
}

/// [`parse_bytes`] as a clap value parser.
pub fn size_arg(input: &str) -> Result<u64, String> {
    parse_bytes(input).ok_or_else(|| SIZE_HELP.to_string())
}

/// [`parse_millicores`] as a clap value parser.
pub fn cpu_arg(input: &str) -> Result<u32, String> {
    parse_millicores(input).ok_or_else(|| CPU_HELP.to_string())
}

/// Bytes for humans, in powers of 1024: `512B`, `1.5KiB`, `4.2MiB`, `1.0GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes}B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1}{}", UNITS[unit])
}
