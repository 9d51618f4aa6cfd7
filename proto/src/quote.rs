//! How an error quotes a bad value: at most [`QUOTE_CHARS`] characters of it, so that an error
//! about a huge input stays small (a stock gRPC client refuses more than 16 KiB of response
//! headers). Shared by the gateway's validators and the drivers' own errors.

/// How much of a bad value an error message quotes, in characters.
pub const QUOTE_CHARS: usize = 64;

/// The first [`QUOTE_CHARS`] characters of `value`, followed by `…` when there is more.
/// Unquoted: for messages that quote it themselves (`{:?}`).
pub fn prefix(value: &str) -> String {
    match value.char_indices().nth(QUOTE_CHARS) {
        None => value.to_string(),
        Some((cut, _)) => format!("{}…", &value[..cut]),
    }
}

/// A bad value as an error message quotes it: escaped (`{:?}`), at most [`QUOTE_CHARS`]
/// characters of it, and its length when it was cut (`"aaaa…" (5000 bytes)`).
pub fn quote(value: &str) -> String {
    match value.char_indices().nth(QUOTE_CHARS) {
        None => format!("{value:?}"),
        Some((cut, _)) => format!("{:?}… ({} bytes)", &value[..cut], value.len()),
    }
}
