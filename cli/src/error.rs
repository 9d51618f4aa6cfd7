//! The one error type of the `sbx` CLI, its words (a failed call's depend on how the gateway
//! was dialled: [`CliError::message`]) and the exit status each ends `sbx` with ([`outcome`]).

use std::time::Duration;

use sbx_proto::names::NameError;
use tonic_types::StatusExt;

use super::transport::{Transport, tcp_mismatch_hint};

/// Everything that makes an `sbx` command fail. Each is printed as one line,
/// `error: <message>`, and the CLI exits with status 1 — except the argument-parsing variants
/// ([`CliError::InvalidName`], [`CliError::InvalidSize`], [`CliError::InvalidCpu`],
/// [`CliError::InvalidKeyValue`]), which
/// clap reports as usage errors with status 2, and those whose doc names their status
/// ([`CliError::NotATerminal`] 2, [`CliError::ExecTimedOut`] 124, 130 for interrupts).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A workspace or sandbox name given on the command line breaks the DNS-1123 label rule.
    /// Expected on user typos; nothing is sent to the gateway.
    #[error("{source}")]
    InvalidName {
        #[source]
        source: NameError,
    },

    /// An image reference given on the command line breaks the reference rule.
    #[error("{source}")]
    InvalidImageReference {
        #[source]
        source: sbx_proto::image_ref::ImageRefError,
    },

    /// The file or directory to import cannot be read (or a directory cannot be tarred).
    #[error("cannot read {path}: {cause}")]
    ImportSource { path: String, cause: String },

    /// A pull stream ended without the image the contract promises as its last message.
    #[error("the pull of {reference} ended without an image")]
    PullWithoutImage { reference: String },

    /// A build stream ended without the image it promises last.
    #[error("the build of {context} ended without an image")]
    BuildWithoutImage { context: String },

    /// A `--memory` SIZE is not a number with an optional known unit suffix. The message
    /// leaves the input out: clap prints it beside the flag (`invalid value '12Q' for
    /// '--memory <SIZE>': …`).
    #[error("{}", sbx_proto::quantity::SIZE_HELP)]
    InvalidSize { input: String },

    /// A `--cpu` quantity is neither cores (at most 3 decimals) nor whole millicores with `m`.
    #[error("{}", sbx_proto::quantity::CPU_HELP)]
    InvalidCpu { input: String },

    /// A `--timeout` is not a duration.
    #[error("expected seconds (30) or a duration (30s, 2m, 1h, 1m30s), up to 10 days")]
    InvalidDuration { input: String },

    /// A lifetime's duration (`--ttl`, `--idle-timeout`, `--delete-after`) is not one.
    #[error(
        "expected a duration of 0 or more: seconds (30) or 30s, 10m, 2h, 7d, 1d12h; got {input:?}"
    )]
    InvalidLifetime { input: String },

    /// A `--label`/`--env` argument is not `KEY=VALUE` with a non-empty key.
    #[error("expected KEY=VALUE with a non-empty KEY, got {input:?}")]
    InvalidKeyValue { input: String },

    /// The same `--label` or `--env` key was given twice; we refuse rather than guess which wins.
    #[error("{flag} {key:?} given more than once")]
    DuplicateKey { flag: &'static str, key: String },

    /// `--endpoint` is not a URI tonic can dial.
    #[error("invalid endpoint {endpoint:?}: {cause}")]
    InvalidEndpoint { endpoint: String, cause: String },

    /// The TCP/HTTP2 connection to the gateway could not be made (gateway down, wrong port,
    /// connect timeout).
    #[error("cannot reach sbxd at {endpoint}: {cause}")]
    Unreachable { endpoint: String, cause: String },

    /// No setting named the gateway and no default socket answered: every place looked at,
    /// in order, with what each held.
    #[error(
        "no sbxd found; looked, in order, at: {looked}. Start sbxd (`systemctl start sbxd`, \
         or `sbxd serve`), or name a gateway with --endpoint, SBX_ENDPOINT or a context \
         (`sbx config`); `sbx wait --for serving` waits for one to serve"
    )]
    NoGateway { looked: String },

    /// A token (from `source_name`: `--token`, `SBX_TOKEN`, a context) cannot be sent. The
    /// message never holds the token.
    #[error("the token from {source_name} cannot be used: {why}")]
    InvalidToken { source_name: String, why: String },

    /// The TLS settings of an https endpoint are incomplete or unusable (the message names
    /// the file).
    #[error("TLS: {0}")]
    Tls(String),

    /// The config file (`sbx config`, contexts) cannot be read, parsed or written; `cause`
    /// says which line when it does not parse.
    #[error("config file {}: {cause}", path.display())]
    Config {
        path: std::path::PathBuf,
        cause: String,
    },

    /// A context named (`--context`, `current-context`, `sbx config use-context`) is not in
    /// the config file; `known` lists the ones that are.
    #[error("no context {name:?} in {}: {}", path.display(), known_contexts(known))]
    NoSuchContext {
        name: String,
        path: std::path::PathBuf,
        known: Vec<String>,
    },

    /// The gateway answered an RPC with a non-OK status. Its Display is the gateway's words;
    /// [`CliError::message`] adds what the transport dialled tells.
    #[error("{}", describe_status(.0, None))]
    Rpc(#[from] tonic::Status),

    /// While waiting for Ready, the sandbox entered phase Error.
    #[error("sandbox {name:?} failed: {}", failure(reason, message))]
    SandboxFailed {
        name: String,
        reason: String,
        message: String,
    },

    /// While waiting, someone else changed the sandbox's desired state (stopped, started or
    /// deleted it), so it will never reach the goal on its own.
    #[error("sandbox {name:?} will not become {goal}: it is {phase} (desired state {desired})")]
    SandboxAbandoned {
        name: String,
        goal: &'static str,
        phase: String,
        desired: String,
    },

    /// While waiting for Ready or Stopped, the sandbox was deleted.
    #[error("sandbox {name:?} (id {id}) was deleted while waiting for it to become {goal}")]
    SandboxGone {
        name: String,
        id: String,
        goal: &'static str,
    },

    /// The sandbox did not reach the goal within `--timeout`. It is left as it is.
    #[error(
        "sandbox {name:?} not {goal} after {}s (last phase {phase}); it was left as it is — \
         see `sbx sandbox get --id {id}`",
        timeout.as_secs()
    )]
    WaitTimeout {
        name: String,
        id: String,
        goal: &'static str,
        phase: String,
        timeout: Duration,
    },

    /// `sbx wait --for serving` gave up: the gateway did not answer SERVING in time.
    #[error("{what} not serving after {}s: {last}", timeout.as_secs())]
    NotServing {
        what: String,
        timeout: Duration,
        last: String,
    },

    /// An `--addr-file` exists but cannot be read.
    #[error("cannot read the address file {path}: {cause}")]
    AddrFile { path: String, cause: String },

    /// `sbx sandbox cp` or `port-forward` was asked for something it cannot do. Exit
    /// status 2, as for other usage errors.
    #[error("{0}")]
    Usage(String),

    /// A local path of a copy cannot be read or written.
    #[error("{}: {source}", path.display())]
    LocalPath {
        path: std::path::PathBuf,
        source: std::io::Error,
    },

    /// Something inside the CLI broke (a helper thread that panicked).
    #[error("internal error: {0}")]
    Internal(String),

    /// `sbx wait` was given a combination it cannot wait on.
    #[error("{0}")]
    WaitUsage(String),

    /// The user pressed Ctrl-C while the CLI waited for Ready. The sandbox is left as it is.
    #[error(
        "interrupted while waiting for sandbox {name:?} to become {goal}; it was left as it is \
         — see `sbx sandbox get --id {id}`"
    )]
    Interrupted {
        name: String,
        id: String,
        goal: &'static str,
    },

    /// CreateSandbox answered a sandbox without an id. The CLI then cannot follow the sandbox
    /// safely (a name may come to mean another sandbox), so it stops; a gateway bug.
    #[error("the gateway created sandbox {name:?} but answered no id; not waiting for it")]
    CreatedWithoutId { name: String },

    /// A watch stream failed after some events; says where to resume.
    #[error("{}", watch_broken(*last_seen, status, None))]
    WatchBroken {
        last_seen: u64,
        status: tonic::Status,
    },

    /// An exec stream ended without the final exit message the contract promises (the gateway
    /// went away mid-stream, or it is buggy).
    #[error("exec stream ended without an exit status")]
    ExecWithoutExit,

    /// `sbx sandbox exec -t` with a stdin that is not a terminal (a pipe, a file, /dev/null):
    /// there is no terminal to make raw or to take the size of. Exit status 2, as a usage
    /// error, as `docker exec -t` does.
    #[error(
        "the input device is not a TTY: -t needs sbx's stdin to be a terminal; drop -t (and \
         keep -i to pipe stdin to the command)"
    )]
    NotATerminal,

    /// Something local an exec needs could not be set up: raw mode on the terminal for -it,
    /// the signal handlers, the thread that reads stdin for -i.
    #[error("cannot {what}: {cause}")]
    ExecSetup {
        what: &'static str,
        cause: std::io::Error,
    },

    /// Three interrupts and still no exit from the gateway: sbx stops waiting. The command
    /// was sent SIGKILL on the second one, so it is most likely gone. Exit status 130.
    #[error("interrupted three times; stopped waiting for the command's exit status")]
    ExecAbandoned,

    /// The command ran longer than `--timeout` and was killed. Exit status 124, as
    /// `timeout(1)` does.
    #[error("the command timed out after {seconds} s")]
    ExecTimedOut { seconds: u32 },

    /// The exec stream failed after it had started: the command's exit status is unknown
    /// (the command was ended with the stream).
    #[error("{}", exec_broken(.0, None))]
    ExecBroken(tonic::Status),

    /// A create's image is not in the gateway's store and its pull failed: the pull's error,
    /// and the images the store has that a typo may have meant.
    #[error(
        "image {image:?} is not in the gateway's store and could not be pulled: \
         {cause}{}; `sbx image list` shows what the store has",
        sbx_proto::names::did_you_mean(similar)
    )]
    ImageUnavailable {
        image: String,
        cause: String,
        similar: Vec<String>,
    },

    /// The gateway kept answering with the same page token, which would loop for ever.
    #[error("the gateway returned page token {token:?} twice; giving up listing")]
    PageTokenRepeated { token: String },

    /// Rendering an object as JSON or YAML failed (not expected with the types we render).
    #[error("cannot render output: {0}")]
    Render(String),

    /// Writing to stdout/stderr failed (for example a closed pipe).
    #[error("cannot write output: {0}")]
    Io(#[from] std::io::Error),
}

impl CliError {
    /// The one line this error is printed as, the command having dialled the gateway `via`
    /// (`None`: it dialled nothing): its Display, and for a failed call also what the
    /// transport tells (a TLS connection the gateway closed: the client certificate; plain
    /// HTTP/2 to a TLS listener: https).
    pub fn message(&self, via: Option<Transport>) -> String {
        match self {
            CliError::Rpc(status) => describe_status(status, via),
            CliError::WatchBroken { last_seen, status } => watch_broken(*last_seen, status, via),
            CliError::ExecBroken(status) => exec_broken(status, via),
            other => other.to_string(),
        }
    }
}

/// [`CliError::WatchBroken`]'s words.
fn watch_broken(last_seen: u64, status: &tonic::Status, via: Option<Transport>) -> String {
    format!(
        "{} (watch ended after resource version {last_seen}; resume with --resource-version \
         {last_seen})",
        describe_status(status, via)
    )
}

/// [`CliError::ExecBroken`]'s words.
fn exec_broken(status: &tonic::Status, via: Option<Transport>) -> String {
    format!(
        "the exec stream broke before the command's exit status arrived: {}",
        describe_status(status, via)
    )
}

/// The exit status of a process killed by SIGPIPE, used when stdout is closed under us
/// (`sbx sandbox watch | head -1`): quiet, as other Unix tools are.
const BROKEN_PIPE_EXIT: u8 = 141;

/// The conventional exit status after SIGINT (128 + 2), for a Ctrl-C while waiting for Ready.
const INTERRUPTED_EXIT: u8 = 130;

/// The exit status of a command killed by `--timeout`, as timeout(1) has it.
const TIMED_OUT_EXIT: u8 = 124;

/// The exit code and the stderr line (if any) for a command's result: `Ok(code)` → `code`;
/// a closed stdout → [`BROKEN_PIPE_EXIT`], silently; Ctrl-C while waiting → [`INTERRUPTED_EXIT`]
/// and `error: …`; a usage error (arguments that do not go together, a duration that is none,
/// a command given by hand) → 2, as clap's own; any other error → 1 and `error: …`. `via` is
/// how the command dialled the gateway (`None`: it did not), which the words of a failed call
/// depend on ([`CliError::message`]).
pub fn outcome(result: Result<u8, CliError>, via: Option<Transport>) -> (u8, Option<String>) {
    let line = |err: &CliError| Some(format!("error: {}", err.message(via)));
    match result {
        Ok(code) => (code, None),
        Err(CliError::Io(err)) if err.kind() == std::io::ErrorKind::BrokenPipe => {
            (BROKEN_PIPE_EXIT, None)
        }
        Err(
            err @ (CliError::Usage(_)
            | CliError::NotATerminal
            | CliError::InvalidLifetime { .. }
            | CliError::InvalidDuration { .. }),
        ) => (2, line(&err)),
        Err(err @ CliError::ExecTimedOut { .. }) => (TIMED_OUT_EXIT, line(&err)),
        Err(err @ (CliError::Interrupted { .. } | CliError::ExecAbandoned)) => {
            (INTERRUPTED_EXIT, line(&err))
        }
        Err(err) => (1, line(&err)),
    }
}

/// What to do about UNAUTHENTICATED: the ways to give the CLI a credential.
pub const CREDENTIAL_HINT: &str = "pass --token or set SBX_TOKEN, or save one: `sbx config \
    set-context NAME --endpoint URL --token … --use`";

/// What to do about IMAGE_NOT_FOUND: the two ways an image gets into the store.
pub const IMAGE_HINT: &str = "pull it from a registry with `sbx image pull REF`, or load a \
    tar with `sbx image import FILE --name REF`; `sbx image list` shows what the store has";

/// The contexts there are, for [`CliError::NoSuchContext`].
fn known_contexts(known: &[String]) -> String {
    if known.is_empty() {
        "it has none (create one with `sbx config set-context NAME --endpoint URL …`)".to_string()
    } else {
        format!("the contexts there are {}", known.join(", "))
    }
}

/// One line for a failed RPC: `REASON: message` when the status carries a
/// `google.rpc.ErrorInfo`, else the message (or the code's description when it is empty).
/// UNAUTHENTICATED adds how to give a credential ([`CREDENTIAL_HINT`]); PERMISSION_DENIED
/// says so before the gateway's message (which names the workspace and the role needed).
/// `via` is how the call's gateway was dialled (`None`: not known, the gateway's words
/// alone): over TCP, a failure the transport explains gets the hint that mends it.
pub fn describe_status(status: &tonic::Status, via: Option<Transport>) -> String {
    let message = if status.message().is_empty() {
        status.code().description().to_string()
    } else {
        status.message().to_string()
    };
    let message = say_once(&message);
    let message = match status.get_details_error_info() {
        Some(info) if info.reason == "WORKSPACE_NOT_EMPTY" => {
            format!("{}: {}", info.reason, name_the_cascade_flag(&message))
        }
        Some(info) if info.reason == "IMAGE_NOT_FOUND" => {
            format!("{}: {message} ({IMAGE_HINT})", info.reason)
        }
        Some(info) if !info.reason.is_empty() => say_once(&format!("{}: {message}", info.reason)),
        _ => message,
    };
    // One style for what the gateway refused: `REASON: message`, the reason the gateway's
    // (ErrorInfo) or, without one, the code's name.
    let reasoned = |code: &str| match has_reason_prefix(&message) {
        true => message.clone(),
        false => say_once(&format!("{code}: {message}")),
    };
    match status.code() {
        tonic::Code::Unauthenticated => {
            format!("{} ({CREDENTIAL_HINT})", reasoned("UNAUTHENTICATED"))
        }
        tonic::Code::PermissionDenied => reasoned("PERMISSION_DENIED"),
        // With TLS 1.3 a gateway that refuses the client's certificate does so after the
        // handshake seemed to succeed: the first call sees only the connection go.
        tonic::Code::Unknown | tonic::Code::Unavailable | tonic::Code::Cancelled
            if via == Some(Transport::Tls) && dropped_connection(status) =>
        {
            format!(
                "{message} (the gateway closed the TLS connection: is the client certificate \
                 (--tls-cert) one signed by its client CA, and is there one if it asks for it?)"
            )
        }
        // Plain HTTP/2 to a TLS listener: the connection is made, the first call fails.
        _ if via.is_some_and(Transport::is_tcp) => {
            match tcp_mismatch_hint(&message, via == Some(Transport::Tls)) {
                Some(hint) => format!("{message} ({hint})"),
                None => message,
            }
        }
        _ => message,
    }
}

/// Whether `message` starts with a reason as the gateway names them (`SANDBOX_NOT_FOUND:`).
fn has_reason_prefix(message: &str) -> bool {
    message.split_once(": ").is_some_and(|(head, _)| {
        head.len() >= 3
            && head
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b == b'_' || b.is_ascii_digit())
    })
}

/// Whether a status is the transport's: the connection went, nobody answered.
fn dropped_connection(status: &tonic::Status) -> bool {
    let text = status.message().to_ascii_lowercase();
    [
        "transport error",
        "connection",
        "operation was canceled",
        "broken pipe",
    ]
    .iter()
    .any(|said| text.contains(said))
}

/// The gateway says "delete with cascade"; the CLI's way to do that is a flag, so the message
/// names it.
fn name_the_cascade_flag(message: &str) -> String {
    const FLAG: &str = "`sbx workspace delete --cascade`";
    if message.contains("delete with cascade") {
        message.replace("delete with cascade", &format!("use {FLAG}"))
    } else if message.contains("--cascade") {
        message.to_string()
    } else {
        format!("{message} (delete its sandboxes first, or use {FLAG})")
    }
}

/// Why a sandbox failed, in one phrase: the reason (left out when it is only the phase's name,
/// "Error", which "failed" already says) and the message, each part said once.
fn failure(reason: &str, message: &str) -> String {
    let text = match (reason, message) {
        (r, m) if r.is_empty() || r.eq_ignore_ascii_case("error") => m.to_string(),
        (r, "") => r.to_string(),
        (r, m) => format!("{r}: {m}"),
    };
    say_once(&text)
}

/// `text` with each `: `-separated part said once: a part that only restates an earlier one
/// is dropped. Layers of the gateway each prefix what they pass on, which made lines like
/// `failed precondition: failed precondition: …` and `main process exited with status 3: the
/// main process exited with code 3`. Restating means: equal after lower-casing, dropping a
/// leading "the " (or "driver "), reading "code" as "status", and a reason's underscores as
/// spaces — so `DRIVER_FAILED_PRECONDITION: failed precondition: …` says it once too.
pub fn say_once(text: &str) -> String {
    fn gist(part: &str) -> String {
        let lower = part.trim().to_lowercase().replace('_', " ");
        let bare = lower.strip_prefix("the ").unwrap_or(&lower);
        let bare = bare.strip_prefix("driver ").unwrap_or(bare);
        bare.replace(" code ", " status ")
    }
    let mut kept: Vec<&str> = Vec::new();
    let mut gists: Vec<String> = Vec::new();
    for part in text.split(": ") {
        let g = gist(part);
        if !g.is_empty() && gists.contains(&g) {
            continue;
        }
        gists.push(g);
        kept.push(part);
    }
    kept.join(": ")
}

/// A cause with its whole source chain, `outer: inner: innermost`, skipping repeats (tonic's
/// transport error says only "transport error" at the top; the useful part is deeper).
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut current = Some(err);
    while let Some(e) = current {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        current = e.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;
    use tonic_types::{ErrorDetails, StatusExt};

    fn check(status: tonic::Status, expected: &str) {
        assert_eq!(CliError::Rpc(status).to_string(), expected);
    }

    #[test]
    fn rpc_errors_name_the_reason_when_present() {
        check(
            tonic::Status::with_error_details(
                Code::NotFound,
                "sandbox \"x\" not found in workspace \"default\"",
                ErrorDetails::with_error_info(
                    "SANDBOX_NOT_FOUND",
                    "sbx.v1",
                    std::collections::HashMap::new(),
                ),
            ),
            "SANDBOX_NOT_FOUND: sandbox \"x\" not found in workspace \"default\"",
        );
        check(
            tonic::Status::new(Code::FailedPrecondition, "workspace is terminating"),
            "workspace is terminating",
        );
        check(
            tonic::Status::new(Code::Unavailable, ""),
            "The service is currently unavailable",
        );
    }

    #[test]
    fn credential_errors_say_what_to_do() {
        let text = CliError::Rpc(tonic::Status::unauthenticated("no credential")).to_string();
        assert_eq!(
            text,
            format!("UNAUTHENTICATED: no credential ({CREDENTIAL_HINT})")
        );
        assert!(
            text.contains("--token") && text.contains("SBX_TOKEN"),
            "{text}"
        );
        assert!(text.contains("sbx config set-context"), "{text}");
        let text = CliError::Rpc(tonic::Status::unauthenticated("")).to_string();
        assert!(text.starts_with("UNAUTHENTICATED: "), "{text}");
        check(
            tonic::Status::permission_denied(
                "role viewer in workspace \"prod\" cannot create sandboxes (needs editor)",
            ),
            "PERMISSION_DENIED: role viewer in workspace \"prod\" cannot create sandboxes \
             (needs editor)",
        );
        // A message that says it already is not repeated.
        check(
            tonic::Status::permission_denied("permission denied: needs admin"),
            "PERMISSION_DENIED: needs admin",
        );
        let none = CliError::NoSuchContext {
            name: "prod".into(),
            path: "/c.toml".into(),
            known: vec!["dev".into(), "lab".into()],
        };
        assert_eq!(
            none.to_string(),
            "no context \"prod\" in /c.toml: the contexts there are dev, lab"
        );
    }

    /// The hint a failed call gets from its transport comes from what the command dialled,
    /// given as data: a dropped TLS connection names the client certificate, plain HTTP/2 to a
    /// TLS listener names https; over the socket, or not knowing, the gateway's words alone.
    #[test]
    fn a_failed_calls_words_say_what_its_transport_tells() {
        let dropped = CliError::Rpc(tonic::Status::unavailable("transport error: broken pipe"));
        let tls = dropped.message(Some(Transport::Tls));
        assert!(
            tls.contains("client CA") && tls.contains("--tls-cert"),
            "{tls}"
        );
        for via in [None, Some(Transport::Unix), Some(Transport::Tcp)] {
            assert_eq!(
                dropped.message(via),
                "transport error: broken pipe",
                "{via:?}"
            );
        }
        assert_eq!(dropped.to_string(), "transport error: broken pipe");
        let plain = CliError::ExecBroken(tonic::Status::unknown("h2 protocol error: http2 error"));
        assert!(
            plain.message(Some(Transport::Tcp)).contains("https://"),
            "{plain}"
        );
        assert!(!plain.message(Some(Transport::Unix)).contains("https://"));
        let watch = CliError::WatchBroken {
            last_seen: 3,
            status: tonic::Status::unknown("h2 protocol error: http2 error"),
        };
        let text = watch.message(Some(Transport::Tcp));
        assert!(
            text.contains("https://") && text.ends_with("resume with --resource-version 3)"),
            "{text}"
        );
        // A refusal reads the same on every transport.
        let refused = CliError::Rpc(tonic::Status::permission_denied("needs admin"));
        assert_eq!(
            refused.message(Some(Transport::Tls)),
            refused.message(Some(Transport::Unix))
        );
    }

    #[test]
    fn each_thing_is_said_once() {
        assert_eq!(
            say_once("main process exited with status 3: the main process exited with code 3"),
            "main process exited with status 3"
        );
        assert_eq!(
            say_once("failed precondition: failed precondition: image busybox is in use"),
            "failed precondition: image busybox is in use"
        );
        // Different statuses, and parts that merely share words, are kept.
        assert_eq!(
            say_once("main process exited with status 3: the main process exited with code 4"),
            "main process exited with status 3: the main process exited with code 4"
        );
        assert_eq!(say_once("a: b: c"), "a: b: c");
        assert_eq!(
            say_once("DRIVER_FAILED_PRECONDITION: failed precondition: sandbox x is not running"),
            "DRIVER_FAILED_PRECONDITION: sandbox x is not running"
        );
        assert_eq!(
            say_once("DRIVER_UNAVAILABLE: driver unavailable: no agent"),
            "DRIVER_UNAVAILABLE: no agent"
        );
        let failed = CliError::SandboxFailed {
            name: "web".into(),
            reason: "ExitedNonZero".into(),
            message: "main process exited with status 3: the main process exited with code 3"
                .into(),
        };
        assert_eq!(
            failed.to_string(),
            "sandbox \"web\" failed: ExitedNonZero: main process exited with status 3"
        );
        let failed = CliError::SandboxFailed {
            name: "web".into(),
            reason: "Error".into(),
            message: "main process exited with status 3".into(),
        };
        assert_eq!(
            failed.to_string(),
            "sandbox \"web\" failed: main process exited with status 3"
        );
        check(
            tonic::Status::new(
                Code::FailedPrecondition,
                "failed precondition: failed precondition: x",
            ),
            "failed precondition: x",
        );
    }

    #[test]
    fn image_not_found_says_how_images_get_in() {
        let status = tonic::Status::with_error_details(
            Code::NotFound,
            "image \"debian:bookworm\" not found",
            ErrorDetails::with_error_info(
                "IMAGE_NOT_FOUND",
                "sbx.v1",
                std::collections::HashMap::new(),
            ),
        );
        check(
            status,
            &format!("IMAGE_NOT_FOUND: image \"debian:bookworm\" not found ({IMAGE_HINT})"),
        );
    }

    #[test]
    fn workspace_not_empty_names_the_cascade_flag() {
        let status = |message: &str| {
            tonic::Status::with_error_details(
                Code::FailedPrecondition,
                message,
                ErrorDetails::with_error_info(
                    "WORKSPACE_NOT_EMPTY",
                    "sbx.v1",
                    std::collections::HashMap::new(),
                ),
            )
        };
        check(
            status(
                "workspace \"a\" still has 2 sandbox(es); delete them first or delete with cascade",
            ),
            "WORKSPACE_NOT_EMPTY: workspace \"a\" still has 2 sandbox(es); delete them first or \
             use `sbx workspace delete --cascade`",
        );
        check(
            status("workspace \"a\" is not empty"),
            "WORKSPACE_NOT_EMPTY: workspace \"a\" is not empty (delete its sandboxes first, or \
             use `sbx workspace delete --cascade`)",
        );
    }

    #[test]
    fn exec_errors_say_what_happened_and_what_to_do() {
        assert_eq!(
            CliError::ExecTimedOut { seconds: 7 }.to_string(),
            "the command timed out after 7 s"
        );
        let not_a_tty = CliError::NotATerminal.to_string();
        assert!(
            not_a_tty.contains("not a TTY") && not_a_tty.contains("drop -t"),
            "{not_a_tty}"
        );
        assert_eq!(
            CliError::ExecBroken(tonic::Status::unavailable("connection reset")).to_string(),
            "the exec stream broke before the command's exit status arrived: connection reset"
        );
    }

    #[test]
    fn a_broken_watch_says_where_to_resume() {
        let err = CliError::WatchBroken {
            last_seen: 41,
            status: tonic::Status::unavailable("connection reset"),
        };
        assert_eq!(
            err.to_string(),
            "connection reset (watch ended after resource version 41; resume with \
             --resource-version 41)"
        );
    }

    #[derive(Debug, thiserror::Error)]
    #[error("{text}")]
    struct Layer {
        text: &'static str,
        #[source]
        inner: Option<Box<Layer>>,
    }

    #[test]
    fn error_chain_joins_sources_without_repeats() {
        let err = Layer {
            text: "transport error",
            inner: Some(Box::new(Layer {
                text: "tcp connect error: Connection refused",
                inner: Some(Box::new(Layer {
                    text: "Connection refused",
                    inner: None,
                })),
            })),
        };
        assert_eq!(
            error_chain(&err),
            "transport error: tcp connect error: Connection refused"
        );
    }

    #[test]
    fn outcomes() {
        assert_eq!(outcome(Ok(0), None), (0, None));
        assert_eq!(outcome(Ok(42), None), (42, None));
        let pipe = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        assert_eq!(
            outcome(Err(CliError::Io(pipe)), None),
            (BROKEN_PIPE_EXIT, None)
        );
        let interrupted = CliError::Interrupted {
            name: "web".into(),
            id: "id-1".into(),
            goal: "Ready",
        };
        let (code, message) = outcome(Err(interrupted), None);
        assert_eq!(code, 130);
        assert!(message.unwrap().contains("--id id-1"));
        assert_eq!(
            outcome(
                Err(CliError::Rpc(tonic::Status::not_found("no such sandbox"))),
                Some(Transport::Tls)
            ),
            (1, Some("error: no such sandbox".to_string()))
        );
    }
}
