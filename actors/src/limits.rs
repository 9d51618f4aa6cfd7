//! The limits of every request field: one table, checked once at the actor API's entry points
//! (`validate.rs`), quoted by docs/SPECIFICATION.md ("Limits", which a test below keeps in step
//! with this file).
//!
//! Why bounds at all: an unbounded field costs the gateway memory and CPU for every copy it
//! keeps (the store, the watch history, every list and watch that evaluates it), and an error
//! that echoes it can outgrow what a client accepts — a stock gRPC client refuses more than
//! 16 KiB of response headers, and a 5,000-character name once made an error that large (the
//! client saw RESOURCE_EXHAUSTED and lost the reason). So every error quotes at most
//! [`ERROR_QUOTE_CHARS`] characters of a bad value ([`quote`]), and the status layer caps any
//! message at [`MAX_ERROR_MESSAGE_BYTES`] and any ErrorInfo metadata value at
//! [`MAX_ERROR_METADATA_VALUE_BYTES`], whatever path built it.
//!
//! The argv and environment bounds keep a workload's `execve` inside the kernel's ARG_MAX
//! (2 MiB on Linux with the default 8 MiB stack: a quarter of `RLIMIT_STACK`) with room to
//! spare: argv 128 KiB + the spec's environment 128 KiB + an exec's environment 128 KiB is
//! 384 KiB, and no single string reaches MAX_ARG_STRLEN (128 KiB), so an accepted command never
//! ends in E2BIG.

/// A workspace or sandbox name, in bytes (DNS-1123 label).
pub const MAX_NAME_BYTES: usize = sbx_proto::names::MAX_NAME_LEN;
/// Labels on one object (a sandbox's spec or a workspace).
pub const MAX_LABELS: usize = 64;
/// A label key or value, in bytes: the store's rule (every key and value must be selectable).
pub const MAX_LABEL_BYTES: usize = sbx_storage::MAX_LABEL_LEN;
/// Arguments in a command (a spec's or an exec's).
pub const MAX_ARGS: usize = 4096;
/// One argument, in bytes.
pub const MAX_ARG_BYTES: usize = 32 * 1024;
/// A whole command, in bytes (each argument plus its NUL).
pub const MAX_ARGV_BYTES: usize = 128 * 1024;
/// Environment variables (a spec's or an exec's).
pub const MAX_ENV_VARS: usize = 1024;
/// The longest exec user (`NAME:GROUP`): Linux names are at most 32 bytes each; room to spare.
pub const MAX_USER_BYTES: usize = 256;
/// One environment variable's value, in bytes.
pub const MAX_ENV_VALUE_BYTES: usize = 32 * 1024;
/// A whole environment, in bytes (each `NAME=value` plus its NUL).
pub const MAX_ENV_BYTES: usize = 128 * 1024;
/// A sandbox spec as a whole, protobuf-encoded, in bytes: it is stored, kept in the watch
/// history and sent with every list and event.
pub const MAX_SPEC_BYTES: usize = 256 * 1024;
/// An image reference in a spec, in bytes.
pub const MAX_IMAGE_REF_BYTES: usize = 1024;
/// A label selector, in bytes.
pub const MAX_SELECTOR_BYTES: usize = 4 * 1024;
/// Terms (comma-separated requirements) in a label selector.
pub const MAX_SELECTOR_TERMS: usize = 64;
/// Items in one page of a list; a larger page size is served as this many.
pub const MAX_PAGE_SIZE: u32 = 1000;
/// A page token, in bytes (tokens the gateway hands out are far shorter).
pub const MAX_PAGE_TOKEN_BYTES: usize = 1024;
/// A path inside a sandbox (an exec's working directory, a copy's path), in bytes: PATH_MAX.
pub const MAX_PATH_BYTES: usize = 4096;
/// The smallest memory limit (0 means none): below it not even a shell starts (a static
/// busybox sh needs about 1 MiB resident, the runtime's init and the agent more).
pub const MIN_MEMORY_BYTES: u64 = 4 << 20;
/// The smallest disk limit (0 means none): the filesystem made for it (ext4, with its
/// journal) and an image's first writes need this much.
pub const MIN_DISK_BYTES: u64 = 32 << 20;
/// One gRPC message to the workspace, sandbox and gateway services, in bytes (tonic's
/// default, made explicit): a spec is at most [`MAX_SPEC_BYTES`], stream chunks are 64 KiB.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;
/// One gRPC message to the image service, in bytes: an import chunk is at most 4 MiB (the CLI
/// sends 1 MiB) plus its framing.
pub const MAX_IMAGE_MESSAGE_BYTES: usize = 8 << 20;
/// Credentials of one provider, in bytes (each `NAME=value` plus its NUL).
pub const MAX_CREDENTIAL_BYTES: usize = 64 * 1024;
/// Config entries of one provider, in bytes (each key and value).
pub const MAX_PROVIDER_CONFIG_BYTES: usize = 64 * 1024;
/// Providers attached to one sandbox.
pub const MAX_ATTACHMENTS: usize = 16;
/// Settings of one sandbox.
pub const MAX_SETTINGS: usize = 16_384;
/// One setting's value, in bytes.
pub const MAX_SETTING_VALUE_BYTES: usize = 4 * 1024;
/// All settings of one sandbox, in bytes (each key and value).
pub const MAX_SETTINGS_BYTES: usize = 384 * 1024;
/// What a run or an exec gets on top of its spec's environment — attached providers'
/// credentials and settings as variables — in bytes (each `NAME=value` plus its NUL); a start
/// or exec over it is refused, naming the cause.
pub const MAX_RUN_ENV_BYTES: usize = 512 * 1024;
/// Service endpoints of one sandbox.
pub const MAX_SERVICES: usize = 64;
/// How much of a bad value an error message quotes, in characters.
pub const ERROR_QUOTE_CHARS: usize = sbx_proto::quote::QUOTE_CHARS;
/// The longest error message sbxd sends, in bytes; longer ones are cut.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 1024;
/// The longest value in an error's ErrorInfo metadata, in bytes; longer ones are cut.
pub const MAX_ERROR_METADATA_VALUE_BYTES: usize = 256;

// Checked when the crate builds: argv, a spec's env and an exec's env together stay well inside
// ARG_MAX (2 MiB with the default 8 MiB stack), one string inside MAX_ARG_STRLEN (128 KiB),
// and a spec at its bound fits in one message.
const _: () = {
    assert!(MAX_ARGV_BYTES + 2 * MAX_ENV_BYTES <= (2 << 20) / 4);
    assert!(MAX_ARGV_BYTES + 2 * MAX_ENV_BYTES + MAX_RUN_ENV_BYTES <= (2 << 20) / 2);
    assert!(MAX_ARG_BYTES < 128 * 1024 && MAX_ENV_VALUE_BYTES < 128 * 1024);
    assert!(MAX_SPEC_BYTES < MAX_MESSAGE_BYTES);
};

/// Every limit by its constant's name, with its value as docs/SPECIFICATION.md writes it.
pub const TABLE: &[(&str, u64)] = &[
    ("MAX_NAME_BYTES", MAX_NAME_BYTES as u64),
    ("MAX_LABELS", MAX_LABELS as u64),
    ("MAX_LABEL_BYTES", MAX_LABEL_BYTES as u64),
    ("MAX_ARGS", MAX_ARGS as u64),
    ("MAX_ARG_BYTES", MAX_ARG_BYTES as u64),
    ("MAX_ARGV_BYTES", MAX_ARGV_BYTES as u64),
    ("MAX_ENV_VARS", MAX_ENV_VARS as u64),
    ("MAX_ENV_VALUE_BYTES", MAX_ENV_VALUE_BYTES as u64),
    ("MAX_ENV_BYTES", MAX_ENV_BYTES as u64),
    ("MAX_SPEC_BYTES", MAX_SPEC_BYTES as u64),
    ("MAX_IMAGE_REF_BYTES", MAX_IMAGE_REF_BYTES as u64),
    ("MAX_SELECTOR_BYTES", MAX_SELECTOR_BYTES as u64),
    ("MAX_SELECTOR_TERMS", MAX_SELECTOR_TERMS as u64),
    ("MAX_PAGE_SIZE", MAX_PAGE_SIZE as u64),
    ("MAX_PAGE_TOKEN_BYTES", MAX_PAGE_TOKEN_BYTES as u64),
    ("MAX_PATH_BYTES", MAX_PATH_BYTES as u64),
    ("MIN_MEMORY_BYTES", MIN_MEMORY_BYTES),
    ("MIN_DISK_BYTES", MIN_DISK_BYTES),
    ("MAX_CREDENTIAL_BYTES", MAX_CREDENTIAL_BYTES as u64),
    (
        "MAX_PROVIDER_CONFIG_BYTES",
        MAX_PROVIDER_CONFIG_BYTES as u64,
    ),
    ("MAX_ATTACHMENTS", MAX_ATTACHMENTS as u64),
    ("MAX_SETTINGS", MAX_SETTINGS as u64),
    ("MAX_SETTING_VALUE_BYTES", MAX_SETTING_VALUE_BYTES as u64),
    ("MAX_SETTINGS_BYTES", MAX_SETTINGS_BYTES as u64),
    ("MAX_RUN_ENV_BYTES", MAX_RUN_ENV_BYTES as u64),
    ("MAX_SERVICES", MAX_SERVICES as u64),
    ("MAX_MESSAGE_BYTES", MAX_MESSAGE_BYTES as u64),
    ("MAX_IMAGE_MESSAGE_BYTES", MAX_IMAGE_MESSAGE_BYTES as u64),
    ("ERROR_QUOTE_CHARS", ERROR_QUOTE_CHARS as u64),
    ("MAX_ERROR_MESSAGE_BYTES", MAX_ERROR_MESSAGE_BYTES as u64),
    (
        "MAX_ERROR_METADATA_VALUE_BYTES",
        MAX_ERROR_METADATA_VALUE_BYTES as u64,
    ),
];

pub use sbx_proto::quote::{prefix, quote};

/// `text` cut to at most `max` bytes at a character boundary, with `…` at the cut (the result
/// is then at most `max` bytes, `…` included).
pub fn truncate(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let ellipsis = '…'.len_utf8();
    let mut cut = max.saturating_sub(ellipsis);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut]).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_are_short_escaped_and_say_the_length() {
        assert_eq!(quote("web"), "\"web\"");
        let long = "a".repeat(5000);
        let q = quote(&long);
        assert_eq!(q, format!("\"{}\"… (5000 bytes)", "a".repeat(64)));
        // Escaped: a NUL or a newline never reaches a message raw.
        assert_eq!(quote("a\0b\n"), "\"a\\0b\\n\"");
        // Characters, not bytes: a cut never splits one.
        let wide = "é".repeat(100);
        assert!(quote(&wide).starts_with(&format!("\"{}\"…", "é".repeat(64))));
        assert_eq!(prefix(&long), format!("{}…", "a".repeat(64)));
        assert_eq!(prefix("web"), "web");
    }

    #[test]
    fn truncate_keeps_within_the_bound() {
        assert_eq!(truncate("short", 10), "short");
        let wide = "é".repeat(1000);
        let cut = truncate(&wide, 101);
        assert!(cut.len() <= 101, "{}", cut.len());
        assert!(cut.ends_with('…'));
        assert_eq!(truncate(&"x".repeat(2000), 1024).len(), 1024);
    }

    /// docs/SPECIFICATION.md's Limits section lists every constant with its value, so the doc
    /// cannot drift from the code.
    #[test]
    fn the_specification_lists_every_limit() {
        let spec = include_str!("../../docs/SPECIFICATION.md");
        let section = spec
            .split("\n## Limits\n")
            .nth(1)
            .expect("docs/SPECIFICATION.md has a '## Limits' section")
            .split("\n## ")
            .next()
            .unwrap();
        for (name, value) in TABLE {
            let row = format!("| `{name}` | {value} |");
            assert!(
                section.contains(&row),
                "the Limits section of docs/SPECIFICATION.md lacks the row {row:?}"
            );
        }
        let rows = section.lines().filter(|l| l.starts_with("| `")).count();
        assert_eq!(
            rows,
            TABLE.len(),
            "a row names a limit the code does not have"
        );
    }
}
