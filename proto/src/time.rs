//! Times as the gateway's APIs write them: RFC 3339 in UTC with all nine digits of the
//! nanoseconds (`2026-03-01T10:22:22.000000001Z`), the form E2B's SDKs parse and the agent's
//! log records carry. The calendar is prost-types' (the `Timestamp` the contracts use, which
//! the CLI prints too); this only fixes the fraction at nine digits, where `Timestamp`'s own
//! text drops zeros (`.5Z`, none at all on a whole second).

use std::time::{SystemTime, UNIX_EPOCH};

/// `time` in RFC 3339 UTC with nine fractional digits; a time before 1970 is written as
/// 1970's start.
pub fn rfc3339_nanos(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let whole = prost_types::Timestamp {
        seconds: i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
        nanos: 0,
    };
    // On a whole second `Timestamp` writes `YYYY-MM-DDTHH:MM:SSZ`.
    let text = whole.to_string();
    let seconds = text.strip_suffix('Z').unwrap_or(&text);
    format!("{seconds}.{:09}Z", since.subsec_nanos())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(secs: u64, nanos: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, nanos)
    }

    #[test]
    fn times_are_rfc3339_utc_with_nine_digits() {
        let cases = [
            (at(0, 0), "1970-01-01T00:00:00.000000000Z"),
            (at(0, 5), "1970-01-01T00:00:00.000000005Z"),
            (at(0, 500_000_000), "1970-01-01T00:00:00.500000000Z"),
            // A leap day of a century's leap year, its last second, and the day after.
            (
                at(951_868_799, 123_456_789),
                "2000-02-29T23:59:59.123456789Z",
            ),
            (at(951_868_800, 0), "2000-03-01T00:00:00.000000000Z"),
            // 2100 is no leap year: Feb 28 is followed by Mar 1.
            (at(4_107_542_400, 1), "2100-03-01T00:00:00.000000001Z"),
            (at(1_767_225_600, 0), "2026-01-01T00:00:00.000000000Z"),
            (
                UNIX_EPOCH - Duration::from_secs(5),
                "1970-01-01T00:00:00.000000000Z",
            ),
        ];
        for (time, want) in cases {
            assert_eq!(rfc3339_nanos(time), want, "{time:?}");
        }
    }

    /// The text the gateway wrote before this took over from the agent's own formatter (its
    /// log records' stamps) is the same to the byte, from 1970 to 2300: 20,000 times spread
    /// over the range by a fixed linear congruential sequence, and a whole second
    /// every 30.5 days.
    #[test]
    fn the_same_text_as_the_agents_log_stamps() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let span = 10_413_792_000u64; // 2300-01-01
        for _ in 0..20_000 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let time = at((x >> 11) % span, (x % 1_000_000_000) as u32);
            assert_eq!(
                rfc3339_nanos(time),
                sbx_agent::log::rfc3339_nanos(time),
                "{time:?}"
            );
        }
        for month in 0..(330 * 12) {
            let days = month * 30 + month / 2;
            let time = at(days * 86_400, 0);
            assert_eq!(rfc3339_nanos(time), sbx_agent::log::rfc3339_nanos(time));
        }
    }
}
