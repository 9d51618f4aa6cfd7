//! A fuzzer for the gateway's request surface (issue 13): property tests over the actor API's
//! validators in process, then well-typed requests and raw bytes against one real sbxd (the
//! sim driver, `SBX_AUTH=none`).
//!
//! Why: every request field has a bound (`sbx_actors::limits`, docs/SPECIFICATION.md
//! "Limits"), and every refusal must reach a client as an answer it can use — a known code, an
//! ErrorInfo, an error far below the 16 KiB of headers a stock gRPC client accepts. Hand-written
//! cases cover the bounds someone thought of; these cover what a client can send at all: any
//! Unicode up to 10 KiB (NULs and control characters included) in names, selectors near and off
//! their grammar, specs at, just under and just past every bound, and byte strings that are no
//! request at all or a request with bytes flipped and cut.
//!
//! What is asserted:
//! - in process: a validator never panics, accepts exactly what the documented limits allow
//!   (each bound also checked at and one past it), and refuses with INVALID_ARGUMENT, an
//!   ErrorInfo of domain sbx.dev, a message under `MAX_ERROR_MESSAGE_BYTES` before any cut, that
//!   quotes no run of more than `ERROR_QUOTE_CHARS` characters of the value;
//! - over the wire: every answer's code is one the method may give (never INTERNAL or
//!   UNKNOWN), every error carries an ErrorInfo, an answer's metadata stays under 16 KiB, no
//!   call hangs past 10 s, sbxd's health is SERVING after every batch of cases and its log
//!   never says "panicked".
//!
//! Profiles: 256 cases per property by default (the CI profile: the whole file takes about
//! 20 s on 2 cores in a debug build); `SBX_FUZZ_CASES=N` runs N per property (3,000 take about
//! 2 minutes; past 5 minutes a test needs nextest's `--profile soak`, which never kills it;
//! `--no-capture` shows the answers by method and code). A failing case is shrunk and saved to
//! `gateway/tests/fuzz.proptest-regressions`, which every run replays first.

mod common;

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{DataDir, Sbxd};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use prost::Message;
use prost::bytes::{Buf, BufMut};
use sbx_actors::limits::{self, ERROR_QUOTE_CHARS, MAX_ERROR_MESSAGE_BYTES};
use sbx_actors::validate;
use sbx_actors::{ActorError, SandboxSelector, WorkspaceSelector};
use sbx_gateway::grpc::actor_error_to_status;
use sbx_proto::v1::gateway_service_client::GatewayServiceClient;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::workspace_service_client::WorkspaceServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, DeleteSandboxRequest, DeleteWorkspaceRequest,
    ExecRequest, GetGatewayInfoRequest, GetSandboxRequest, GetWorkspaceRequest,
    ListSandboxesRequest, ListWorkspacesRequest, Resources, RestartSandboxRequest, SandboxRef,
    SandboxSpec, StartSandboxRequest, StopSandboxRequest, Tty, WatchSandboxesRequest, WorkspaceRef,
};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::HeaderMap;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::StatusExt;

/// Cases per property unless `SBX_FUZZ_CASES` says otherwise.
const DEFAULT_CASES: u32 = 256;
/// Where proptest keeps shrunk failures (relative to the package, where tests run).
const REGRESSIONS: &str = "tests/fuzz.proptest-regressions";
/// The response metadata a stock gRPC client accepts (grpc-go, grpcio: 16 KiB).
const MAX_RESPONSE_METADATA: usize = 16 * 1024;
/// How long one call may take before it counts as a hang.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stream that keeps going (a watch) is read before it counts as answered.
const STREAM_READ: Duration = Duration::from_millis(200);
/// Health is checked after every this many wire cases.
const HEALTH_EVERY: u32 = 32;

fn cases() -> u32 {
    match std::env::var("SBX_FUZZ_CASES") {
        Ok(text) => text
            .parse()
            .unwrap_or_else(|_| panic!("SBX_FUZZ_CASES={text:?} is not a number of cases")),
        Err(_) => DEFAULT_CASES,
    }
}

fn config() -> Config {
    Config {
        cases: cases(),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(REGRESSIONS))),
        ..Config::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Strategies

/// Label key characters (the store's rule) and label value characters.
const KEY_CHARS: &[u8] = b"abcXYZ019-_./";
const VALUE_CHARS: &[u8] = b"abcXYZ019-_.";
/// Characters no label key allows that leave a selector's structure alone (no `,` `=` `!`).
const BAD_KEY_CHARS: &[char] = &[' ', ':', '@', 'é', '\0', '*', '\u{1b}', '#', '+', '"'];
/// The same for values (`/` is a key character only).
const BAD_VALUE_CHARS: &[char] = &[' ', ':', '@', 'é', '\0', '*', '/', '"', '\n'];

/// Lengths at, one under and one past `bound`, 0, and anything up to two past.
fn around(bound: usize) -> BoxedStrategy<usize> {
    prop_oneof![
        2 => Just(bound),
        2 => Just(bound + 1),
        1 => Just(bound.saturating_sub(1)),
        1 => Just(0),
        3 => 0..=bound + 2,
    ]
    .boxed()
}

/// `len` bytes of characters from `alphabet` (ASCII): a short random seed repeated, so a
/// 128 KiB string costs what a short one does to generate.
fn ascii(
    alphabet: &'static [u8],
    len: impl Strategy<Value = usize> + 'static,
) -> BoxedStrategy<String> {
    (
        len,
        prop::collection::vec(prop::sample::select(alphabet), 1..16),
    )
        .prop_map(|(len, seed)| seed.iter().cycle().take(len).map(|&b| b as char).collect())
        .boxed()
}

/// Any text: any Unicode scalar values (NULs, controls, surrogates' neighbours), short or
/// up to about 10 KiB, or one character repeated to around a bound.
fn wild() -> BoxedStrategy<String> {
    prop_oneof![
        4 => prop::collection::vec(any::<char>(), 0..80).prop_map(String::from_iter),
        1 => prop::collection::vec(any::<char>(), 0..2500).prop_map(String::from_iter),
        1 => (any::<char>(), 0..10_240usize).prop_map(|(c, n)| c.to_string().repeat(n)),
    ]
    .boxed()
}

/// `left`, one of `bad`, `right`: a string broken in its middle.
fn broken(alphabet: &'static [u8], bad: &'static [char]) -> BoxedStrategy<String> {
    (
        ascii(alphabet, 1..20usize),
        prop::sample::select(bad),
        ascii(alphabet, 1..20usize),
    )
        .prop_map(|(l, c, r)| format!("{l}{c}{r}"))
        .boxed()
}

/// Workspace and sandbox names: valid ones, ones just off the rule (length 63/64, edges,
/// capitals, underscores), and anything at all.
fn names() -> BoxedStrategy<String> {
    prop_oneof![
        3 => "[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?",
        2 => "[a-zA-Z0-9_.-]{0,70}",
        2 => ascii(b"ab9-", around(limits::MAX_NAME_BYTES)),
        3 => wild(),
    ]
    .boxed()
}

/// Whether `name` is a DNS-1123 label, as docs/SPECIFICATION.md states the rule: 1 to 63
/// of `a-z`, `0-9`, `-`, not starting or ending with `-`.
fn is_dns_label(name: &str) -> bool {
    let b = name.as_bytes();
    (1..=limits::MAX_NAME_BYTES).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// A label key and whether the rule allows it.
fn label_key() -> BoxedStrategy<(String, bool)> {
    prop_oneof![
        4 => ascii(KEY_CHARS, 1..=limits::MAX_LABEL_BYTES).prop_map(|k| (k, true)),
        1 => ascii(KEY_CHARS, around(limits::MAX_LABEL_BYTES))
            .prop_map(|k| { let ok = (1..=limits::MAX_LABEL_BYTES).contains(&k.len()); (k, ok) }),
        1 => broken(KEY_CHARS, BAD_KEY_CHARS).prop_map(|k| (k, false)),
        1 => Just((String::new(), false)),
    ]
    .boxed()
}

/// A label value and whether the rule allows it.
fn label_value() -> BoxedStrategy<(String, bool)> {
    prop_oneof![
        4 => ascii(VALUE_CHARS, 0..=limits::MAX_LABEL_BYTES).prop_map(|v| (v, true)),
        1 => ascii(VALUE_CHARS, around(limits::MAX_LABEL_BYTES))
            .prop_map(|v| { let ok = v.len() <= limits::MAX_LABEL_BYTES; (v, ok) }),
        1 => broken(VALUE_CHARS, BAD_VALUE_CHARS).prop_map(|v| (v, false)),
    ]
    .boxed()
}

/// Optional blanks, which a selector ignores around terms, keys and values.
fn blank() -> BoxedStrategy<&'static str> {
    prop_oneof![6 => Just(""), 1 => Just(" "), 1 => Just("\t "),].boxed()
}

/// One selector term (`k=v`, `k==v`, `k!=v`, `k`, `!k`, blanks around) and whether the
/// grammar allows it.
fn term() -> BoxedStrategy<(String, bool)> {
    (
        label_key(),
        label_value(),
        0..5u8,
        blank(),
        blank(),
        blank(),
    )
        .prop_map(|((k, k_ok), (v, v_ok), form, b1, b2, b3)| match form {
            0 => (format!("{b1}{k}{b2}={b3}{v}{b1}"), k_ok && v_ok),
            1 => (format!("{b1}{k}{b2}=={b3}{v}{b1}"), k_ok && v_ok),
            2 => (format!("{b1}{k}{b2}!={b3}{v}{b1}"), k_ok && v_ok),
            3 => (format!("{b1}{k}{b3}"), k_ok),
            _ => (format!("{b1}!{b2}{k}{b3}"), k_ok),
        })
        .boxed()
}

/// A selector from the grammar: its text, whether every term is valid, and how many terms it
/// has. Padded with blanks (which change its length, not its meaning) to around the byte bound
/// when `pad` says.
#[derive(Debug, Clone)]
struct GrammarSelector {
    text: String,
    terms_valid: bool,
    terms: usize,
}

fn grammar_selector() -> BoxedStrategy<GrammarSelector> {
    (
        prop_oneof![
            3 => prop::collection::vec(term(), 0..8),
            1 => prop::collection::vec(term(), 60..70),
        ],
        prop::option::weighted(0.3, around(limits::MAX_SELECTOR_BYTES)),
    )
        .prop_map(|(terms, pad)| {
            let mut text = terms
                .iter()
                .map(|(t, _)| t.as_str())
                .collect::<Vec<_>>()
                .join(",");
            if let Some(target) = pad
                && target > text.len()
            {
                text.push_str(&" ".repeat(target - text.len()));
            }
            GrammarSelector {
                terms_valid: terms.iter().all(|(_, ok)| *ok),
                terms: terms.len(),
                text,
            }
        })
        .boxed()
}

/// `text` with a few characters put in at arbitrary places.
fn mutated(text: impl Strategy<Value = String> + 'static) -> BoxedStrategy<String> {
    (
        text,
        prop::collection::vec((any::<Index>(), any::<char>()), 1..4),
    )
        .prop_map(|(text, edits)| {
            let mut chars: Vec<char> = text.chars().collect();
            for (at, c) in edits {
                let i = at.index(chars.len() + 1);
                chars.insert(i, c);
            }
            chars.into_iter().collect()
        })
        .boxed()
}

/// A label map whose entries are near the rule: special entries (near the key and value
/// bounds, broken, empty) and plain ones to around the count bound.
fn label_map() -> BoxedStrategy<HashMap<String, String>> {
    (
        prop::collection::vec((label_key(), label_value()), 0..4),
        prop_oneof![3 => 0..8usize, 1 => around(limits::MAX_LABELS)],
    )
        .prop_map(|(special, count)| {
            let mut map: HashMap<String, String> =
                special.into_iter().map(|((k, _), (v, _))| (k, v)).collect();
            let mut i = 0;
            while map.len() < count {
                map.insert(format!("l{i}"), "v".into());
                i += 1;
            }
            map
        })
        .boxed()
}

fn label_key_ok(k: &str) -> bool {
    (1..=limits::MAX_LABEL_BYTES).contains(&k.len())
        && k.bytes()
            .all(|b| KEY_CHARS.contains(&b) || b.is_ascii_alphanumeric())
}

fn label_value_ok(v: &str) -> bool {
    v.len() <= limits::MAX_LABEL_BYTES
        && v.bytes()
            .all(|b| VALUE_CHARS.contains(&b) || b.is_ascii_alphanumeric())
}

/// What docs/SPECIFICATION.md allows of a label map.
fn labels_ok(labels: &HashMap<String, String>) -> bool {
    labels.len() <= limits::MAX_LABELS
        && labels
            .iter()
            .all(|(k, v)| label_key_ok(k) && label_value_ok(v))
}

/// An argv near its bounds: a few special arguments (near the one-argument bound, with a NUL,
/// empty, wild), plain ones to around the count bound, and padding to around the total bound.
fn argv() -> BoxedStrategy<Vec<String>> {
    let special = prop_oneof![
        3 => "[a-z/]{1,12}",
        1 => ascii(b"xyz", around(limits::MAX_ARG_BYTES)),
        1 => Just("a\0b".to_string()),
        1 => Just(String::new()),
        1 => wild(),
    ];
    (
        prop::collection::vec(special, 0..4),
        prop_oneof![4 => Just(0usize), 1 => around(limits::MAX_ARGS)],
        prop::option::weighted(0.2, around(limits::MAX_ARGV_BYTES)),
    )
        .prop_map(|(mut argv, count, total)| {
            while argv.len() < count {
                argv.push("x".into());
            }
            if let Some(target) = total {
                pad_to(&mut argv, target, |a| a.len() + 1);
            }
            argv
        })
        .boxed()
}

/// Appends arguments of at most `MAX_ARG_BYTES` until `size(argv)` reaches `target` (or
/// overshoots by the least it can).
fn pad_to(argv: &mut Vec<String>, target: usize, size: impl Fn(&String) -> usize) {
    let mut total: usize = argv.iter().map(&size).sum();
    while total + 1 < target && argv.len() < limits::MAX_ARGS {
        let len = (target - total - 1).min(limits::MAX_ARG_BYTES);
        argv.push("p".repeat(len));
        total += len + 1;
    }
}

fn argv_ok(argv: &[String]) -> bool {
    argv.len() <= limits::MAX_ARGS
        && argv.iter().map(|a| a.len() + 1).sum::<usize>() <= limits::MAX_ARGV_BYTES
        && argv
            .iter()
            .all(|a| a.len() <= limits::MAX_ARG_BYTES && !a.contains('\0'))
}

/// An environment near its bounds, like [`argv`].
fn env() -> BoxedStrategy<HashMap<String, String>> {
    let name = prop_oneof![
        4 => "[A-Z_][A-Z0-9_]{0,12}",
        1 => Just(String::new()),
        1 => Just("A=B".to_string()),
        1 => Just("N\0L".to_string()),
        1 => wild(),
    ];
    let value = prop_oneof![
        4 => "[ -~]{0,20}",
        1 => ascii(b"v", around(limits::MAX_ENV_VALUE_BYTES)),
        1 => Just("a\0b".to_string()),
        1 => wild(),
    ];
    (
        prop::collection::vec((name, value), 0..4),
        prop_oneof![4 => Just(0usize), 1 => around(limits::MAX_ENV_VARS)],
        prop::option::weighted(0.2, around(limits::MAX_ENV_BYTES)),
    )
        .prop_map(|(special, count, total)| {
            let mut env: HashMap<String, String> = special.into_iter().collect();
            let mut i = 0;
            while env.len() < count {
                env.insert(format!("E{i}"), String::new());
                i += 1;
            }
            if let Some(target) = total {
                let mut size: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
                let mut i = 0;
                while size + 6 < target && env.len() < limits::MAX_ENV_VARS {
                    let key = format!("P{i}");
                    let len = (target - size - key.len() - 2).min(limits::MAX_ENV_VALUE_BYTES);
                    size += key.len() + len + 2;
                    env.insert(key, "p".repeat(len));
                    i += 1;
                }
            }
            env
        })
        .boxed()
}

fn env_ok(env: &HashMap<String, String>) -> bool {
    env.len() <= limits::MAX_ENV_VARS
        && env
            .iter()
            .map(|(k, v)| k.len() + v.len() + 2)
            .sum::<usize>()
            <= limits::MAX_ENV_BYTES
        && env.iter().all(|(k, v)| {
            !k.is_empty()
                && !k.contains(['=', '\0'])
                && !v.contains('\0')
                && v.len() <= limits::MAX_ENV_VALUE_BYTES
        })
}

fn memory() -> BoxedStrategy<u64> {
    let min = limits::MIN_MEMORY_BYTES;
    prop_oneof![
        Just(0),
        Just(1),
        Just(min - 1),
        Just(min),
        Just(min + 1),
        any::<u64>()
    ]
    .boxed()
}

/// A sandbox spec with every part near its bounds.
fn spec() -> BoxedStrategy<SandboxSpec> {
    (
        prop_oneof![
            2 => Just(vec!["sleep".to_string(), "1000".to_string()]),
            3 => argv(),
        ],
        env(),
        label_map(),
        prop_oneof![
            4 => Just(String::new()),
            1 => ascii(b"img", around(limits::MAX_IMAGE_REF_BYTES)),
            1 => wild(),
        ],
        prop::option::of((any::<u32>(), memory())),
        prop_oneof![6 => Just(String::new()), 1 => Just("sim".to_string()), 1 => wild()],
    )
        .prop_map(
            |(command, env, labels, image, resources, driver)| SandboxSpec {
                command,
                env,
                labels,
                image,
                driver,
                resources: resources.map(|(cpu_millis, memory_bytes)| Resources {
                    cpu_millis,
                    memory_bytes,
                    disk_bytes: 0,
                }),
                image_digest: String::new(),
                network: None,
                node: String::new(),
                node_selector: Default::default(),
                lifetime: None,
            },
        )
        .boxed()
}

fn spec_bounds_ok(spec: &SandboxSpec) -> bool {
    argv_ok(&spec.command)
        && env_ok(&spec.env)
        && labels_ok(&spec.labels)
        && spec.image.len() <= limits::MAX_IMAGE_REF_BYTES
        && spec
            .resources
            .as_ref()
            .is_none_or(|r| r.memory_bytes == 0 || r.memory_bytes >= limits::MIN_MEMORY_BYTES)
        && spec.encoded_len() <= limits::MAX_SPEC_BYTES
}

/// UUIDs, near-UUIDs and anything else.
fn ids() -> BoxedStrategy<String> {
    prop_oneof![
        2 => any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).to_string()),
        1 => any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).simple().to_string()),
        1 => "[0-9a-fA-F-]{30,40}",
        2 => wild(),
    ]
    .boxed()
}

// ---------------------------------------------------------------------------------------------
// Refusals

/// Whether `message` holds a run of more than `ERROR_QUOTE_CHARS` consecutive characters of
/// `value` as an error quotes them (`{:?}`-escaped) — an echo longer than the quote every error
/// is allowed. (Raw, a value of 65 backslashes would match the 128 of its escaped quote.)
fn over_quotes(message: &str, value: &str) -> bool {
    let n = ERROR_QUOTE_CHARS + 1;
    if message.chars().count() < n {
        return false;
    }
    let bounds: Vec<usize> = value
        .char_indices()
        .map(|(i, _)| i)
        .chain([value.len()])
        .collect();
    bounds.windows(n + 1).any(|w| {
        let quoted = format!("{:?}", &value[w[0]..w[n]]);
        message.contains(&quoted[1..quoted.len() - 1])
    })
}

/// Checks a validator's refusal of `values`: INVALID_ARGUMENT with an ErrorInfo of domain
/// sbx.dev, a message shorter than `MAX_ERROR_MESSAGE_BYTES` as the validator wrote it (before
/// the status layer's cut), quoting no more than `ERROR_QUOTE_CHARS` characters of any value.
fn check_refusal(err: &ActorError, values: &[&str]) -> Result<(), TestCaseError> {
    let text = err.to_string();
    let short = limits::truncate(&text, 400);
    prop_assert!(
        text.len() < MAX_ERROR_MESSAGE_BYTES,
        "a {}-byte message: {short}",
        text.len()
    );
    let status = actor_error_to_status(err);
    prop_assert_eq!(status.code(), Code::InvalidArgument, "{}", short);
    let info = status.get_details_error_info();
    prop_assert!(info.is_some(), "no ErrorInfo: {short}");
    prop_assert_eq!(info.unwrap().domain, "sbx.dev");
    for value in values {
        prop_assert!(
            !over_quotes(&text, value),
            "the message quotes more than {ERROR_QUOTE_CHARS} characters of the value: {short}"
        );
    }
    Ok(())
}

/// Checks a validator's answer against the oracle `expected_ok`: accepted exactly when it says,
/// and refused as [`check_refusal`] says.
fn check_verdict<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, ActorError>,
    expected_ok: bool,
    values: &[&str],
) -> Result<(), TestCaseError> {
    match result {
        Ok(_) => prop_assert!(expected_ok, "{what}: accepted what the limits refuse"),
        Err(err) => {
            let short = limits::truncate(&err.to_string(), 400).into_owned();
            prop_assert!(
                !expected_ok,
                "{what}: refused what the limits allow: {short}"
            );
            check_refusal(&err, values)?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// In process: the validators

proptest! {
    #![proptest_config(config())]

    #[test]
    fn names_are_dns_labels_and_refusals_are_short(name in names()) {
        let ok = is_dns_label(&name);
        check_verdict("name", validate::name("sandbox", &name), ok, &[&name])?;
        // The same through a reference, as every sandbox and workspace call sees it.
        let r = SandboxRef { id: String::new(), workspace: String::new(), name: name.clone() };
        check_verdict("sandbox ref", SandboxSelector::from_ref(&r), ok, &[&name])?;
        let r = WorkspaceRef { id: String::new(), name: name.clone() };
        check_verdict("workspace ref", WorkspaceSelector::from_ref(&r), ok, &[&name])?;
    }

    #[test]
    fn references_take_an_id_or_a_name(id in ids(), workspace in names(), name in names()) {
        let r = SandboxRef { id: id.clone(), workspace: workspace.clone(), name: name.clone() };
        let ok = if id.is_empty() {
            is_dns_label(&name) && (workspace.is_empty() || is_dns_label(&workspace))
        } else {
            uuid::Uuid::parse_str(&id).is_ok()
        };
        check_verdict("sandbox ref", SandboxSelector::from_ref(&r), ok, &[&id, &workspace, &name])?;
        let ok = uuid::Uuid::parse_str(&id).is_ok();
        check_verdict("id", validate::parse_id("sandbox", &id), ok, &[&id])?;
    }

    #[test]
    fn grammar_selectors_parse_exactly_when_valid_and_in_bounds(s in grammar_selector()) {
        let text = &s.text;
        let in_bounds = text.len() <= limits::MAX_SELECTOR_BYTES
            && text.split(',').count() <= limits::MAX_SELECTOR_TERMS;
        let ok = in_bounds && (text.trim().is_empty() || s.terms_valid);
        let parsed = validate::selector(text);
        if let Ok(selector) = &parsed
            && !text.trim().is_empty()
        {
            prop_assert_eq!(selector.requirements().len(), s.terms, "{:?}", text);
        }
        check_verdict("selector", parsed, ok, &[text])?;
    }

    #[test]
    fn any_selector_is_answered_without_panic(
        text in prop_oneof![wild(), mutated(grammar_selector().prop_map(|s| s.text))]
    ) {
        if let Err(err) = validate::selector(&text) {
            check_refusal(&err, &[&text])?;
        }
    }

    #[test]
    fn labels_are_held_to_their_bounds(labels in label_map()) {
        let ok = labels_ok(&labels);
        let values: Vec<&str> = labels.iter().flat_map(|(k, v)| [k.as_str(), v]).collect();
        check_verdict("labels", validate::labels(&labels), ok, &values)?;
    }

    #[test]
    fn wild_labels_are_answered_without_panic(
        labels in prop::collection::hash_map(wild(), wild(), 0..4)
    ) {
        if let Err(err) = validate::labels(&labels) {
            let values: Vec<&str> = labels.iter().flat_map(|(k, v)| [k.as_str(), v]).collect();
            check_refusal(&err, &values)?;
        }
    }

    #[test]
    fn specs_are_held_to_every_bound(spec in spec()) {
        let ok = spec_bounds_ok(&spec);
        let mut values: Vec<&str> = spec.command.iter().map(String::as_str).collect();
        values.extend(spec.env.iter().flat_map(|(k, v)| [k.as_str(), v]));
        values.extend(spec.labels.iter().flat_map(|(k, v)| [k.as_str(), v]));
        values.push(&spec.image);
        check_verdict("spec", validate::spec_bounds(&spec), ok, &values)?;
        if ok {
            // The command check that follows the image's resolution: an empty command, or an
            // empty first argument, is refused without an image that runs.
            let runs = spec.command.first().is_some_and(|a| !a.is_empty());
            check_verdict("spec command", validate::spec(&spec, None), runs, &values)?;
        }
    }

    #[test]
    fn execs_are_held_to_the_same_bounds(
        command in argv(),
        env in env(),
        workdir in prop_oneof![
            3 => Just(String::new()),
            2 => "/[a-z/]{0,20}",
            1 => ascii(b"/d", around(limits::MAX_PATH_BYTES)),
            1 => wild(),
        ],
    ) {
        let ok = command.first().is_some_and(|a| !a.is_empty())
            && argv_ok(&command)
            && env_ok(&env)
            && (workdir.is_empty()
                || (workdir.starts_with('/')
                    && !workdir.contains('\0')
                    && workdir.len() <= limits::MAX_PATH_BYTES));
        let mut values: Vec<&str> = command.iter().map(String::as_str).collect();
        values.extend(env.iter().flat_map(|(k, v)| [k.as_str(), v]));
        values.push(&workdir);
        check_verdict("exec", validate::exec(&command, &env, &workdir), ok, &values)?;
    }

    #[test]
    fn page_tokens_are_held_to_their_bound(
        token in prop_oneof![ascii(b"tok", around(limits::MAX_PAGE_TOKEN_BYTES)), wild()]
    ) {
        let ok = token.len() <= limits::MAX_PAGE_TOKEN_BYTES;
        check_verdict("page token", validate::page_token(&token), ok, &[&token])?;
    }
}

/// Each bound at its limit (accepted) and one past it (refused, as [`check_refusal`] says).
#[test]
fn every_bound_holds_at_its_limit_and_one_past() {
    let base = || SandboxSpec {
        command: vec!["sleep".into(), "1".into()],
        ..Default::default()
    };
    let with = |f: &dyn Fn(&mut SandboxSpec)| {
        let mut s = base();
        f(&mut s);
        s
    };
    let labels = |n: usize, key: usize, value: usize| -> HashMap<String, String> {
        (0..n)
            .map(|i| (format!("{i:a>key$}"), "v".repeat(value)))
            .collect()
    };
    let env_of = |n: usize, value: usize| -> HashMap<String, String> {
        (0..n)
            .map(|i| (format!("V{i}"), "v".repeat(value)))
            .collect()
    };
    // The whole spec at exactly MAX_SPEC_BYTES, each part inside its own bound: 64 labels at
    // their longest, a long image reference and command, and one env value grown to fit.
    let at_size = |extra: usize| {
        let mut s = with(&|s| {
            s.command = vec!["c".repeat(limits::MAX_ARG_BYTES); 3];
            s.command.push("c".repeat(32_000));
            s.env = env_of(3, 32_000);
            s.labels = labels(
                limits::MAX_LABELS,
                limits::MAX_LABEL_BYTES,
                limits::MAX_LABEL_BYTES,
            );
            s.image = "i".repeat(1000);
        });
        let mut grow = 20_000;
        for _ in 0..4 {
            s.env.insert("V3".into(), "g".repeat(grow));
            let size = s.encoded_len();
            if size == limits::MAX_SPEC_BYTES + extra {
                break;
            }
            grow = grow + limits::MAX_SPEC_BYTES + extra - size;
        }
        assert_eq!(s.encoded_len(), limits::MAX_SPEC_BYTES + extra);
        assert!(argv_ok(&s.command) && env_ok(&s.env) && labels_ok(&s.labels));
        s
    };
    let memory = |bytes| {
        with(&|s| {
            s.resources = Some(Resources {
                cpu_millis: 0,
                memory_bytes: bytes,
                disk_bytes: 0,
            })
        })
    };
    let spec_cases: Vec<(&str, SandboxSpec, SandboxSpec)> = vec![
        (
            "argument count",
            with(&|s| s.command = vec!["x".into(); limits::MAX_ARGS]),
            with(&|s| s.command = vec!["x".into(); limits::MAX_ARGS + 1]),
        ),
        (
            "one argument",
            with(&|s| s.command = vec!["z".repeat(limits::MAX_ARG_BYTES)]),
            with(&|s| s.command = vec!["z".repeat(limits::MAX_ARG_BYTES + 1)]),
        ),
        (
            "argv total",
            // 4 × (32767 + its NUL) = 131072.
            with(&|s| s.command = vec!["y".repeat(limits::MAX_ARG_BYTES - 1); 4]),
            with(&|s| {
                s.command = vec!["y".repeat(limits::MAX_ARG_BYTES - 1); 4];
                s.command[3].push('y');
            }),
        ),
        (
            "environment count",
            with(&|s| s.env = env_of(limits::MAX_ENV_VARS, 0)),
            with(&|s| s.env = env_of(limits::MAX_ENV_VARS + 1, 0)),
        ),
        (
            "one environment value",
            with(&|s| s.env = env_of(1, limits::MAX_ENV_VALUE_BYTES)),
            with(&|s| s.env = env_of(1, limits::MAX_ENV_VALUE_BYTES + 1)),
        ),
        (
            "environment total",
            // 4 × ("Vi" + 32764 + '=' + NUL) = 131072.
            with(&|s| s.env = env_of(4, limits::MAX_ENV_BYTES / 4 - 4)),
            with(&|s| {
                s.env = env_of(4, limits::MAX_ENV_BYTES / 4 - 4);
                s.env.get_mut("V0").unwrap().push('v');
            }),
        ),
        (
            "label count",
            with(&|s| s.labels = labels(limits::MAX_LABELS, 3, 1)),
            with(&|s| s.labels = labels(limits::MAX_LABELS + 1, 3, 1)),
        ),
        (
            "label key",
            with(&|s| s.labels = labels(1, limits::MAX_LABEL_BYTES, 1)),
            with(&|s| s.labels = labels(1, limits::MAX_LABEL_BYTES + 1, 1)),
        ),
        (
            "label value",
            with(&|s| s.labels = labels(1, 1, limits::MAX_LABEL_BYTES)),
            with(&|s| s.labels = labels(1, 1, limits::MAX_LABEL_BYTES + 1)),
        ),
        (
            "image reference",
            with(&|s| s.image = "i".repeat(limits::MAX_IMAGE_REF_BYTES)),
            with(&|s| s.image = "i".repeat(limits::MAX_IMAGE_REF_BYTES + 1)),
        ),
        (
            "memory",
            memory(limits::MIN_MEMORY_BYTES),
            memory(limits::MIN_MEMORY_BYTES - 1),
        ),
        ("spec size", at_size(0), at_size(1)),
    ];
    for (what, at, past) in &spec_cases {
        let values: Vec<&str> = past
            .command
            .iter()
            .map(String::as_str)
            .chain(past.env.values().map(String::as_str))
            .chain(past.labels.keys().map(String::as_str))
            .chain([past.image.as_str()])
            .collect();
        validate::spec_bounds(at).unwrap_or_else(|e| panic!("{what} at its limit: {e}"));
        let err = validate::spec_bounds(past).expect_err(what);
        check_refusal(&err, &values).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    assert!(
        validate::spec_bounds(&memory(0)).is_ok(),
        "memory 0: no limit"
    );

    // Bounds outside the spec: names, selectors, page tokens, an exec's working directory.
    let name_at = "n".repeat(limits::MAX_NAME_BYTES);
    let name_past = "n".repeat(limits::MAX_NAME_BYTES + 1);
    let select_at = format!("a{}", " ".repeat(limits::MAX_SELECTOR_BYTES - 1));
    let select_past = format!("a{}", " ".repeat(limits::MAX_SELECTOR_BYTES));
    let terms_at = vec!["a"; limits::MAX_SELECTOR_TERMS].join(",");
    let terms_past = vec!["a"; limits::MAX_SELECTOR_TERMS + 1].join(",");
    let token_at = "t".repeat(limits::MAX_PAGE_TOKEN_BYTES);
    let token_past = "t".repeat(limits::MAX_PAGE_TOKEN_BYTES + 1);
    let dir_at = format!("/{}", "d".repeat(limits::MAX_PATH_BYTES - 1));
    let dir_past = format!("/{}", "d".repeat(limits::MAX_PATH_BYTES));
    let exec = |dir: &str| validate::exec(&["true".to_string()], &HashMap::new(), dir);
    /// What is bounded, its answer at the limit, one past it, and the value past it.
    type Case<'a> = (
        &'a str,
        Result<(), ActorError>,
        Result<(), ActorError>,
        &'a str,
    );
    let other_cases: Vec<Case> = vec![
        (
            "name",
            validate::name("sandbox", &name_at),
            validate::name("sandbox", &name_past),
            &name_past,
        ),
        (
            "selector bytes",
            validate::selector(&select_at).map(drop),
            validate::selector(&select_past).map(drop),
            &select_past,
        ),
        (
            "selector terms",
            validate::selector(&terms_at).map(drop),
            validate::selector(&terms_past).map(drop),
            &terms_past,
        ),
        (
            "page token",
            validate::page_token(&token_at),
            validate::page_token(&token_past),
            &token_past,
        ),
        (
            "exec working directory",
            exec(&dir_at),
            exec(&dir_past),
            &dir_past,
        ),
    ];
    for (what, at, past, value) in other_cases {
        at.unwrap_or_else(|e| panic!("{what} at its limit: {e}"));
        let err = past.expect_err(what);
        check_refusal(&err, &[value]).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

/// What the fuzzer found, kept as cases: errors that quoted far more of a value than
/// `ERROR_QUOTE_CHARS` — a selector (the store's parse error quoted the whole selector and the
/// term, 256 bytes of it after the cut), a spec's driver name (in full: any length), a page token
/// (the store's cursor error, up to 1 KiB) and a copy's path (100 characters).
#[test]
fn regressions_errors_quote_values_short() {
    let sixty_five_zeros = "0".repeat(65);
    let padded = format!("a a={}", " ".repeat(limits::MAX_SELECTOR_BYTES - 4));
    let long_term = format!("{}=,{}=", "a".repeat(37), "a".repeat(64));
    for text in [&sixty_five_zeros, &padded, &long_term] {
        let err = validate::selector(text).expect_err(text);
        check_refusal(&err, &[text]).unwrap_or_else(|e| panic!("selector {text:?}: {e}"));
    }
}

// ---------------------------------------------------------------------------------------------
// Over the wire

/// A pool of names, so that well-typed calls often meet what earlier calls made.
const WORKSPACES: &[&str] = &["default", "fz-a", "fz-b"];
const SANDBOXES: &[&str] = &["s1", "s2", "s3"];

/// Ids the gateway answered with so far (created workspaces and sandboxes), so that calls by
/// id meet real objects too.
#[derive(Default)]
struct Seen {
    workspaces: Mutex<Vec<String>>,
    sandboxes: Mutex<Vec<String>>,
}

impl Seen {
    fn pick(list: &Mutex<Vec<String>>, at: &Index) -> String {
        let list = list.lock().unwrap();
        if list.is_empty() {
            String::new()
        } else {
            list[at.index(list.len())].clone()
        }
    }
}

/// How a well-typed request names its object.
#[derive(Debug, Clone)]
enum Target {
    /// One of the ids the gateway gave out (none yet: an empty reference).
    Seen(Index),
    /// By name from the pool.
    Pool { workspace: Index, name: Index },
    /// Anything.
    Given {
        id: String,
        workspace: String,
        name: String,
    },
}

fn target() -> BoxedStrategy<Target> {
    prop_oneof![
        2 => any::<Index>().prop_map(Target::Seen),
        3 => (any::<Index>(), any::<Index>())
            .prop_map(|(workspace, name)| Target::Pool { workspace, name }),
        2 => (prop_oneof![3 => Just(String::new()), 1 => ids()], names(), names())
            .prop_map(|(id, workspace, name)| Target::Given { id, workspace, name }),
    ]
    .boxed()
}

fn pool_or(pool: &'static [&'static str]) -> BoxedStrategy<String> {
    prop_oneof![3 => prop::sample::select(pool).prop_map(str::to_string), 1 => names()].boxed()
}

fn selector_text() -> BoxedStrategy<String> {
    prop_oneof![
        3 => Just(String::new()),
        3 => grammar_selector().prop_map(|s| s.text),
        1 => wild(),
    ]
    .boxed()
}

fn page_token() -> BoxedStrategy<String> {
    prop_oneof![
        4 => Just(String::new()),
        1 => ascii(b"tok", around(limits::MAX_PAGE_TOKEN_BYTES)),
        1 => wild(),
    ]
    .boxed()
}

/// A spec inside every bound, labelled from a small pool (so that selectors match some).
fn plain_spec() -> BoxedStrategy<SandboxSpec> {
    (
        prop::collection::hash_map("app|tier|team", "web|db|a", 0..3),
        prop::option::of(Just(Resources {
            cpu_millis: 500,
            memory_bytes: limits::MIN_MEMORY_BYTES,
            disk_bytes: 0,
        })),
    )
        .prop_map(|(labels, resources)| SandboxSpec {
            command: vec!["sleep".into(), "1000".into()],
            labels,
            resources,
            ..Default::default()
        })
        .boxed()
}

/// One well-typed request to one unary RPC of the gateway, workspace and sandbox services.
#[derive(Debug, Clone)]
enum Call {
    GatewayInfo,
    CreateWorkspace(CreateWorkspaceRequest),
    GetWorkspace(Target),
    ListWorkspaces(ListWorkspacesRequest),
    DeleteWorkspace(Target, bool),
    CreateSandbox(Box<CreateSandboxRequest>),
    GetSandbox(Target),
    ListSandboxes(ListSandboxesRequest),
    StartSandbox(Target),
    StopSandbox(Target),
    RestartSandbox(Target),
    DeleteSandbox(Target),
}

fn call() -> BoxedStrategy<Call> {
    let create_workspace = (pool_or(WORKSPACES), label_map())
        .prop_map(|(name, labels)| Call::CreateWorkspace(CreateWorkspaceRequest { name, labels }));
    let list_workspaces = (selector_text(), any::<u32>(), page_token()).prop_map(
        |(label_selector, page_size, page_token)| {
            Call::ListWorkspaces(ListWorkspacesRequest {
                label_selector,
                page_size,
                page_token,
            })
        },
    );
    let create_sandbox = (
        prop_oneof![2 => Just(String::new()), 2 => pool_or(WORKSPACES)],
        pool_or(SANDBOXES),
        prop::option::weighted(0.9, prop_oneof![3 => plain_spec(), 2 => spec()]),
        any::<bool>(),
    )
        .prop_map(|(workspace, name, spec, stopped)| {
            Call::CreateSandbox(Box::new(CreateSandboxRequest {
                providers: Default::default(),
                workspace,
                name,
                spec,
                stopped,
            }))
        });
    let list_sandboxes = (
        prop_oneof![2 => Just(String::new()), 2 => pool_or(WORKSPACES)],
        any::<bool>(),
        selector_text(),
        any::<u32>(),
        page_token(),
    )
        .prop_map(
            |(workspace, all_workspaces, label_selector, page_size, page_token)| {
                Call::ListSandboxes(ListSandboxesRequest {
                    workspace,
                    all_workspaces,
                    label_selector,
                    page_size,
                    page_token,
                })
            },
        );
    prop_oneof![
        1 => Just(Call::GatewayInfo),
        3 => create_workspace,
        2 => target().prop_map(Call::GetWorkspace),
        2 => list_workspaces,
        1 => (target(), any::<bool>()).prop_map(|(t, cascade)| Call::DeleteWorkspace(t, cascade)),
        5 => create_sandbox,
        2 => target().prop_map(Call::GetSandbox),
        2 => list_sandboxes,
        2 => target().prop_map(Call::StartSandbox),
        2 => target().prop_map(Call::StopSandbox),
        2 => target().prop_map(Call::RestartSandbox),
        2 => target().prop_map(Call::DeleteSandbox),
    ]
    .boxed()
}

/// Every method path of the gateway, workspace and sandbox services, and two that are none.
const PATHS: &[&str] = &[
    "/sbx.v1.GatewayService/GetGatewayInfo",
    "/sbx.v1.WorkspaceService/CreateWorkspace",
    "/sbx.v1.WorkspaceService/GetWorkspace",
    "/sbx.v1.WorkspaceService/ListWorkspaces",
    "/sbx.v1.WorkspaceService/DeleteWorkspace",
    "/sbx.v1.SandboxService/CreateSandbox",
    "/sbx.v1.SandboxService/GetSandbox",
    "/sbx.v1.SandboxService/ListSandboxes",
    "/sbx.v1.SandboxService/StartSandbox",
    "/sbx.v1.SandboxService/StopSandbox",
    "/sbx.v1.SandboxService/RestartSandbox",
    "/sbx.v1.SandboxService/DeleteSandbox",
    "/sbx.v1.SandboxService/WatchSandboxes",
    "/sbx.v1.SandboxService/Exec",
    "/sbx.v1.SandboxService/Logs",
    "/sbx.v1.SandboxService/CopyFromSandbox",
    "/sbx.v1.SandboxService/CopyToSandbox",
    "/sbx.v1.SandboxService/PortForward",
    "/sbx.v1.SandboxService/NoSuchMethod",
    "/no.such.Service/Method",
];

/// The codes `path` may answer with. Every method may refuse a request that does not decode
/// (INVALID_ARGUMENT) or is over the decode limit (RESOURCE_EXHAUSTED); beyond that, what its
/// contract says. Never INTERNAL or UNKNOWN: those are sbxd's bugs, not the caller's mistakes.
fn allowed(path: &str) -> Vec<Code> {
    use Code::*;
    let method = path.rsplit('/').next().unwrap_or_default();
    let mut codes = vec![Ok, InvalidArgument, ResourceExhausted];
    codes.extend_from_slice(match method {
        "GetGatewayInfo" | "ListWorkspaces" => &[],
        // A name taken; a name of a workspace being deleted.
        "CreateWorkspace" => &[AlreadyExists, FailedPrecondition],
        "GetWorkspace" => &[NotFound],
        // Not empty without cascade; already terminating.
        "DeleteWorkspace" => &[NotFound, FailedPrecondition],
        // No such workspace or image; the name taken; the workspace terminating.
        "CreateSandbox" => &[NotFound, AlreadyExists, FailedPrecondition],
        // A name in several workspaces is FAILED_PRECONDITION (AMBIGUOUS_NAME).
        "GetSandbox" | "StartSandbox" | "StopSandbox" | "RestartSandbox" | "DeleteSandbox"
        | "ListSandboxes" => &[NotFound, FailedPrecondition],
        // A resource version older than the history, or newer than the newest.
        "WatchSandboxes" => &[NotFound, OutOfRange],
        "Logs" => &[NotFound, FailedPrecondition],
        // An exec on a terminal where the driver has none is UNIMPLEMENTED, one past its
        // timeout_seconds DEADLINE_EXCEEDED (the contract's words, sbx.proto).
        "Exec" => &[
            NotFound,
            FailedPrecondition,
            Unimplemented,
            DeadlineExceeded,
        ],
        // Copy and port-forward are driver capabilities (GatewayInfo's `copy`,
        // `port_forward`): UNIMPLEMENTED where the driver has none.
        "CopyFromSandbox" | "CopyToSandbox" | "PortForward" => {
            &[NotFound, FailedPrecondition, Unimplemented]
        }
        _ => &[Unimplemented],
    });
    codes
}

/// The bytes a status takes in a response's headers or trailers: grpc-status, grpc-message
/// (percent-encoded), grpc-status-details-bin (base64) and any other metadata it came with.
fn status_bytes(status: &Status) -> usize {
    let mut headers = HeaderMap::new();
    // A status whose message tonic cannot put in a header would be sbxd's bug too.
    if status.add_header(&mut headers).is_err() {
        return usize::MAX;
    }
    headers_bytes(&headers) + headers_bytes(&status.metadata().clone().into_headers())
}

fn headers_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum()
}

/// What a call got: OK with this many bytes of metadata, or a status.
type Answer = Result<usize, Status>;

fn check_answer(path: &str, answer: &Answer) -> Result<(), TestCaseError> {
    match answer {
        Ok(bytes) => prop_assert!(
            *bytes < MAX_RESPONSE_METADATA,
            "{path}: {bytes} bytes of response metadata"
        ),
        Err(status) => {
            let message = limits::truncate(status.message(), 400);
            prop_assert!(
                allowed(path).contains(&status.code()),
                "{path} answered {:?}, which it may not: {message}",
                status.code()
            );
            let info = status.get_details_error_info();
            prop_assert!(
                info.is_some(),
                "{path}: {:?} without an ErrorInfo: {message}",
                status.code()
            );
            prop_assert_eq!(info.unwrap().domain, "sbx.dev", "{}", path);
            let bytes = status_bytes(status);
            prop_assert!(
                bytes < MAX_RESPONSE_METADATA,
                "{path}: {bytes} bytes of error metadata: {message}"
            );
        }
    }
    Ok(())
}

/// Fails when an error quotes more than `ERROR_QUOTE_CHARS` characters of one of `values`.
fn check_quotes(path: &str, answer: &Answer, values: &[String]) -> Result<(), TestCaseError> {
    if let Err(status) = answer {
        for value in values {
            prop_assert!(
                !over_quotes(status.message(), value),
                "{path}: the error quotes more than {ERROR_QUOTE_CHARS} characters of a value: {}",
                limits::truncate(status.message(), 400)
            );
        }
    }
    Ok(())
}

/// The clients of one sbxd, and what it answered so far.
struct Wire {
    channel: Channel,
    seen: Seen,
    /// Answers by method and code, printed after each property (what the cases reached).
    tally: Mutex<BTreeMap<String, BTreeMap<String, u32>>>,
}

impl Wire {
    fn count(&self, path: &str, answer: &Answer) {
        let code = match answer {
            Ok(_) => "Ok".to_string(),
            Err(status) => format!("{:?}", status.code()),
        };
        let method = path.rsplit('/').next().unwrap_or(path).to_string();
        let mut tally = self.tally.lock().unwrap();
        *tally.entry(method).or_default().entry(code).or_default() += 1;
    }

    /// Prints the tally and starts a new one.
    fn report(&self, what: &str) {
        let tally = std::mem::take(&mut *self.tally.lock().unwrap());
        for (method, codes) in tally {
            eprintln!("{what}: {method}: {codes:?}");
        }
    }

    fn reference(&self, target: &Target, of_workspace: bool) -> (String, String, String) {
        match target {
            Target::Seen(at) => {
                let list = if of_workspace {
                    &self.seen.workspaces
                } else {
                    &self.seen.sandboxes
                };
                (Seen::pick(list, at), String::new(), String::new())
            }
            Target::Pool { workspace, name } => {
                let ws = WORKSPACES[workspace.index(WORKSPACES.len())];
                let name = if of_workspace {
                    ws
                } else {
                    SANDBOXES[name.index(SANDBOXES.len())]
                };
                (String::new(), ws.to_string(), name.to_string())
            }
            Target::Given {
                id,
                workspace,
                name,
            } => (id.clone(), workspace.clone(), name.clone()),
        }
    }

    fn sandbox_ref(&self, target: &Target) -> Option<SandboxRef> {
        let (id, workspace, name) = self.reference(target, false);
        Some(SandboxRef {
            id,
            workspace,
            name,
        })
    }

    fn workspace_ref(&self, target: &Target) -> Option<WorkspaceRef> {
        let (id, _, name) = self.reference(target, true);
        Some(WorkspaceRef { id, name })
    }

    /// Sends `call` and answers its path and what came back.
    async fn send(&self, call: &Call) -> (String, Answer) {
        fn answer<T>(r: Result<tonic::Response<T>, Status>) -> (Answer, Option<T>) {
            match r {
                Ok(response) => {
                    let bytes = headers_bytes(&response.metadata().clone().into_headers());
                    (Ok(bytes), Some(response.into_inner()))
                }
                Err(status) => (Err(status), None),
            }
        }
        let mut ws = WorkspaceServiceClient::new(self.channel.clone());
        let mut sb = SandboxServiceClient::new(self.channel.clone());
        let record = |list: &Mutex<Vec<String>>, id: Option<String>| {
            if let Some(id) = id {
                list.lock().unwrap().push(id);
            }
        };
        macro_rules! on_ref {
            ($method:ident, $request:ident, $target:expr) => {{
                let request = $request {
                    sandbox: self.sandbox_ref($target),
                };
                answer(sb.$method(request).await).0
            }};
        }
        let result = match call {
            Call::GatewayInfo => {
                let mut gw = GatewayServiceClient::new(self.channel.clone());
                answer(gw.get_gateway_info(GetGatewayInfoRequest {}).await).0
            }
            Call::CreateWorkspace(req) => {
                let (a, w) = answer(ws.create_workspace(req.clone()).await);
                record(&self.seen.workspaces, w.map(|w| w.id));
                a
            }
            Call::GetWorkspace(t) => {
                let workspace = self.workspace_ref(t);
                answer(ws.get_workspace(GetWorkspaceRequest { workspace }).await).0
            }
            Call::ListWorkspaces(req) => answer(ws.list_workspaces(req.clone()).await).0,
            Call::DeleteWorkspace(t, cascade) => {
                let req = DeleteWorkspaceRequest {
                    workspace: self.workspace_ref(t),
                    cascade: *cascade,
                };
                answer(ws.delete_workspace(req).await).0
            }
            Call::CreateSandbox(req) => {
                let (a, s) = answer(sb.create_sandbox(req.as_ref().clone()).await);
                record(&self.seen.sandboxes, s.map(|s| s.id));
                a
            }
            Call::ListSandboxes(req) => answer(sb.list_sandboxes(req.clone()).await).0,
            // Each of these is a SandboxRef in field 1, each its own message type.
            Call::GetSandbox(t) => on_ref!(get_sandbox, GetSandboxRequest, t),
            Call::StartSandbox(t) => on_ref!(start_sandbox, StartSandboxRequest, t),
            Call::StopSandbox(t) => on_ref!(stop_sandbox, StopSandboxRequest, t),
            Call::RestartSandbox(t) => on_ref!(restart_sandbox, RestartSandboxRequest, t),
            Call::DeleteSandbox(t) => on_ref!(delete_sandbox, DeleteSandboxRequest, t),
        };
        (call_path(call).to_string(), result)
    }

    /// The strings `call` sends, which no error may quote more than a short prefix of.
    fn values(&self, call: &Call) -> Vec<String> {
        let labels = |l: &HashMap<String, String>| -> Vec<String> {
            l.iter().flat_map(|(k, v)| [k.clone(), v.clone()]).collect()
        };
        let target = |t: &Target, of_workspace| {
            let (id, workspace, name) = self.reference(t, of_workspace);
            vec![id, workspace, name]
        };
        match call {
            Call::GatewayInfo => vec![],
            Call::CreateWorkspace(r) => [vec![r.name.clone()], labels(&r.labels)].concat(),
            Call::GetWorkspace(t) | Call::DeleteWorkspace(t, _) => target(t, true),
            Call::ListWorkspaces(r) => vec![r.label_selector.clone(), r.page_token.clone()],
            Call::CreateSandbox(r) => {
                let mut values = vec![r.workspace.clone(), r.name.clone()];
                if let Some(spec) = &r.spec {
                    values.extend(spec.command.iter().cloned());
                    values.extend(labels(&spec.env));
                    values.extend(labels(&spec.labels));
                    values.extend([spec.image.clone(), spec.driver.clone()]);
                }
                values
            }
            Call::ListSandboxes(r) => vec![
                r.workspace.clone(),
                r.label_selector.clone(),
                r.page_token.clone(),
            ],
            Call::GetSandbox(t)
            | Call::StartSandbox(t)
            | Call::StopSandbox(t)
            | Call::RestartSandbox(t)
            | Call::DeleteSandbox(t) => target(t, false),
        }
    }

    /// The protobuf bytes `call` sends, for raw cases to start from.
    fn encode(&self, call: &Call) -> Vec<u8> {
        match call {
            Call::GatewayInfo => GetGatewayInfoRequest {}.encode_to_vec(),
            Call::CreateWorkspace(r) => r.encode_to_vec(),
            Call::GetWorkspace(t) => GetWorkspaceRequest {
                workspace: self.workspace_ref(t),
            }
            .encode_to_vec(),
            Call::ListWorkspaces(r) => r.encode_to_vec(),
            Call::DeleteWorkspace(t, cascade) => DeleteWorkspaceRequest {
                workspace: self.workspace_ref(t),
                cascade: *cascade,
            }
            .encode_to_vec(),
            Call::CreateSandbox(r) => r.encode_to_vec(),
            Call::ListSandboxes(r) => r.encode_to_vec(),
            // Start, stop, restart, delete and get are all a SandboxRef in field 1.
            Call::GetSandbox(t)
            | Call::StartSandbox(t)
            | Call::StopSandbox(t)
            | Call::RestartSandbox(t)
            | Call::DeleteSandbox(t) => GetSandboxRequest {
                sandbox: self.sandbox_ref(t),
            }
            .encode_to_vec(),
        }
    }

    /// Sends `body` as the one message of a call to `path`, with a codec that passes bytes
    /// as they are; reads a streamed answer for at most [`STREAM_READ`] (a watch that keeps
    /// streaming is an answer).
    async fn send_raw(&self, path: &str, body: Vec<u8>) -> Answer {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
        let path = PathAndQuery::from_str(path).expect("a method path");
        let request = tonic::Request::new(futures::stream::iter([body]));
        let response = grpc.streaming(request, path, RawCodec).await?;
        let bytes = headers_bytes(&response.metadata().clone().into_headers());
        let mut stream = response.into_inner();
        let deadline = Instant::now() + STREAM_READ;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, stream.message()).await {
                Err(_) => return Ok(bytes),
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => {
                    let trailers = stream.trailers().await?.unwrap_or_default();
                    return Ok(bytes + headers_bytes(&trailers.into_headers()));
                }
                Ok(Err(status)) => return Err(status),
            }
        }
    }
}

/// A codec that sends and receives message bodies as they are: the raw cases' bytes reach
/// sbxd's decoder untouched (tonic still frames them).
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

#[derive(Debug)]
struct RawEncoder;

#[derive(Debug)]
struct RawDecoder;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let bytes = src.copy_to_bytes(src.remaining());
        Ok(Some(bytes.to_vec()))
    }
}

/// A raw case: bytes for a method path — random bytes, protobuf-shaped junk (every wire type,
/// lengths past the end), or a well-typed request's bytes with some flipped, put in or cut.
#[derive(Debug, Clone)]
enum Raw {
    Bytes(Vec<u8>),
    /// The first message of a streaming RPC, well typed.
    Stream(Streamed),
    Mutated {
        call: Call,
        flips: Vec<(Index, u8)>,
        cut: Option<Index>,
    },
}

fn raw() -> BoxedStrategy<(Index, Raw)> {
    let junk = prop_oneof![
        3 => prop::collection::vec(any::<u8>(), 0..512),
        // Field tags of every wire type, each with a varint that may claim more than follows.
        2 => prop::collection::vec((1u32..20, 0u32..8, any::<u64>()), 0..8).prop_map(|fields| {
            let mut out = Vec::new();
            for (field, wire, n) in fields {
                prost::encoding::encode_varint(u64::from(field << 3 | wire), &mut out);
                prost::encoding::encode_varint(n % 300, &mut out);
                out.extend(std::iter::repeat_n(b'a', (n % 40) as usize));
            }
            out
        }),
    ];
    let mutated = (
        call(),
        prop::collection::vec((any::<Index>(), any::<u8>()), 0..4),
        prop::option::of(any::<Index>()),
    )
        .prop_map(|(call, flips, cut)| Raw::Mutated { call, flips, cut });
    (
        any::<Index>(),
        prop_oneof![
            2 => junk.prop_map(Raw::Bytes),
            3 => mutated,
            3 => streamed().prop_map(Raw::Stream),
        ],
    )
        .boxed()
}

/// The first (for most, the only) message of a streaming RPC.
#[derive(Debug, Clone)]
enum Streamed {
    Watch(WatchSandboxesRequest),
    Logs {
        sandbox: Target,
        follow: bool,
        tail_lines: u32,
    },
    /// The exec's request; its sandbox is the target's.
    Exec(Target, Box<ExecRequest>),
    CopyFrom(Target, String),
    CopyTo(Target, String),
    PortForward(Target, u32),
}

fn sandbox_path() -> BoxedStrategy<String> {
    prop_oneof![
        2 => Just("/sandbox".to_string()),
        2 => "/[a-z/]{0,20}",
        1 => ascii(b"/d", around(limits::MAX_PATH_BYTES)),
        1 => wild(),
    ]
    .boxed()
}

fn streamed() -> BoxedStrategy<Streamed> {
    let watch = (
        prop_oneof![2 => Just(String::new()), 2 => pool_or(WORKSPACES)],
        any::<bool>(),
        selector_text(),
        prop_oneof![3 => Just(0u64), 1 => 0..64u64, 1 => any::<u64>()],
    )
        .prop_map(
            |(workspace, all_workspaces, label_selector, resource_version)| {
                Streamed::Watch(WatchSandboxesRequest {
                    workspace,
                    all_workspaces,
                    label_selector,
                    resource_version,
                })
            },
        );
    let logs = (target(), any::<bool>(), any::<u32>()).prop_map(|(sandbox, follow, tail_lines)| {
        Streamed::Logs {
            sandbox,
            follow,
            tail_lines,
        }
    });
    let exec = (
        target(),
        prop_oneof![
            3 => prop::sample::select(vec![
                vec!["echo".to_string(), "hi".to_string()],
                vec!["exit".to_string(), "3".to_string()],
                vec!["cat".to_string()],
            ]),
            1 => argv(),
        ],
        prop_oneof![3 => Just(HashMap::new()), 1 => env()],
        prop_oneof![3 => Just(0u32), 1 => any::<u32>()],
        prop_oneof![3 => Just(String::new()), 1 => sandbox_path()],
        any::<bool>(),
        prop::bool::weighted(0.2),
        // Who it runs as: none, root, a name the sandbox lacks, or any text (bounded and
        // refused by the actors, or by the agent naming it).
        prop_oneof![
            3 => Just(String::new()),
            1 => prop::sample::select(vec!["root".to_string(), "0:0".to_string(), "nobody-here".to_string()]),
            1 => ".{0,300}",
        ],
    )
        .prop_map(
            |(sandbox, command, env, timeout_seconds, workdir, stdin, tty, user)| {
                let request = ExecRequest {
                    sandbox: None,
                    command,
                    env,
                    timeout_seconds,
                    workdir,
                    stdin,
                    tty: tty.then(Tty::default),
                    user,
                };
                Streamed::Exec(sandbox, Box::new(request))
            },
        );
    prop_oneof![
        2 => watch,
        2 => logs,
        3 => exec,
        1 => (target(), sandbox_path()).prop_map(|(t, p)| Streamed::CopyFrom(t, p)),
        1 => (target(), sandbox_path()).prop_map(|(t, p)| Streamed::CopyTo(t, p)),
        1 => (target(), prop_oneof![Just(80u32), any::<u32>()])
            .prop_map(|(t, port)| Streamed::PortForward(t, port)),
    ]
    .boxed()
}

impl Streamed {
    fn path(&self) -> &'static str {
        let method = match self {
            Streamed::Watch(_) => "WatchSandboxes",
            Streamed::Logs { .. } => "Logs",
            Streamed::Exec(..) => "Exec",
            Streamed::CopyFrom(..) => "CopyFromSandbox",
            Streamed::CopyTo(..) => "CopyToSandbox",
            Streamed::PortForward(..) => "PortForward",
        };
        PATHS
            .iter()
            .find(|p| p.ends_with(&format!("/{method}")))
            .expect("a streaming method path")
    }

    fn encode(&self, wire: &Wire) -> Vec<u8> {
        use sbx_proto::v1::{
            CopyFromSandboxRequest, CopyToSandboxInput, CopyToSandboxStart, ExecInput, ExecRequest,
            LogsRequest, PortForwardInput, PortForwardStart, copy_to_sandbox_input, exec_input,
            port_forward_input,
        };
        match self {
            Streamed::Watch(r) => r.encode_to_vec(),
            Streamed::Logs {
                sandbox,
                follow,
                tail_lines,
            } => LogsRequest {
                sandbox: wire.sandbox_ref(sandbox),
                follow: *follow,
                tail_lines: *tail_lines,
                ..Default::default()
            }
            .encode_to_vec(),
            Streamed::Exec(sandbox, request) => ExecInput {
                input: Some(exec_input::Input::Start(ExecRequest {
                    sandbox: wire.sandbox_ref(sandbox),
                    ..(**request).clone()
                })),
            }
            .encode_to_vec(),
            Streamed::CopyFrom(t, path) => CopyFromSandboxRequest {
                sandbox: wire.sandbox_ref(t),
                path: path.clone(),
            }
            .encode_to_vec(),
            Streamed::CopyTo(t, path) => CopyToSandboxInput {
                input: Some(copy_to_sandbox_input::Input::Start(CopyToSandboxStart {
                    sandbox: wire.sandbox_ref(t),
                    path: path.clone(),
                })),
            }
            .encode_to_vec(),
            Streamed::PortForward(t, port) => PortForwardInput {
                input: Some(port_forward_input::Input::Start(PortForwardStart {
                    sandbox: wire.sandbox_ref(t),
                    port: *port,
                })),
            }
            .encode_to_vec(),
        }
    }

    /// The strings it sends, which no error may quote more than a short prefix of.
    fn values(&self, wire: &Wire) -> Vec<String> {
        let target = |t: &Target| {
            let (id, workspace, name) = wire.reference(t, false);
            vec![id, workspace, name]
        };
        match self {
            Streamed::Watch(r) => vec![r.workspace.clone(), r.label_selector.clone()],
            Streamed::Logs { sandbox, .. } => target(sandbox),
            Streamed::Exec(sandbox, r) => {
                let mut values = target(sandbox);
                values.extend(r.command.iter().cloned());
                values.extend(r.env.iter().flat_map(|(k, v)| [k.clone(), v.clone()]));
                values.push(r.workdir.clone());
                values.push(r.user.clone());
                values
            }
            Streamed::CopyFrom(t, path) | Streamed::CopyTo(t, path) => {
                [target(t), vec![path.clone()]].concat()
            }
            Streamed::PortForward(t, _) => target(t),
        }
    }
}

impl Raw {
    fn bytes(&self, wire: &Wire) -> Vec<u8> {
        match self {
            Raw::Bytes(b) => b.clone(),
            Raw::Stream(streamed) => streamed.encode(wire),
            Raw::Mutated { call, flips, cut } => {
                let mut b = wire.encode(call);
                for (at, x) in flips {
                    if !b.is_empty() {
                        let i = at.index(b.len());
                        b[i] ^= x;
                    }
                }
                if let Some(at) = cut {
                    b.truncate(at.index(b.len() + 1));
                }
                b
            }
        }
    }

    /// The path a mutated request goes to: its own half the time (so that it gets past the
    /// decoder), any other otherwise.
    fn path(&self, at: &Index) -> &'static str {
        let own = match self {
            Raw::Mutated { call, .. } => Some(call_path(call)),
            Raw::Stream(streamed) => return streamed.path(),
            Raw::Bytes(_) => None,
        };
        let i = at.index(PATHS.len() * 2);
        match own {
            Some(own) if i >= PATHS.len() => own,
            _ => PATHS[i % PATHS.len()],
        }
    }
}

fn call_path(call: &Call) -> &'static str {
    let i = match call {
        Call::GatewayInfo => 0,
        Call::CreateWorkspace(_) => 1,
        Call::GetWorkspace(_) => 2,
        Call::ListWorkspaces(_) => 3,
        Call::DeleteWorkspace(..) => 4,
        Call::CreateSandbox(_) => 5,
        Call::GetSandbox(_) => 6,
        Call::ListSandboxes(_) => 7,
        Call::StartSandbox(_) => 8,
        Call::StopSandbox(_) => 9,
        Call::RestartSandbox(_) => 10,
        Call::DeleteSandbox(_) => 11,
    };
    PATHS[i]
}

/// `call`'s output, or None when it takes longer than [`CALL_TIMEOUT`].
fn within<F: std::future::Future>(rt: &tokio::runtime::Runtime, call: F) -> Option<F::Output> {
    rt.block_on(async { tokio::time::timeout(CALL_TIMEOUT, call).await.ok() })
}

/// Fails unless sbxd answers SERVING and its log has no panic.
fn check_alive(
    rt: &tokio::runtime::Runtime,
    sbxd: &Sbxd,
    after: &str,
) -> Result<(), TestCaseError> {
    let log = sbxd.log_text();
    if let Some(at) = log.find("panicked") {
        let start = log[..at].rfind('\n').map_or(0, |i| i + 1);
        let end = (at + 2000).min(log.len());
        let end = (end..=log.len())
            .find(|&i| log.is_char_boundary(i))
            .unwrap();
        return Err(TestCaseError::fail(format!(
            "sbxd panicked {after}:\n{}",
            &log[start..end]
        )));
    }
    let healthy = within(rt, sbxd.assert_healthy()).is_some();
    prop_assert!(healthy, "sbxd's health check timed out {after}");
    Ok(())
}

fn wire_config() -> Config {
    Config {
        // Shrinking replays cases against a live sbxd: bounded in time, not just count.
        max_shrink_time: 60_000,
        ..config()
    }
}

/// Runs `property` over `strategy` with the wire profile, checking sbxd's health after every
/// [`HEALTH_EVERY`] cases; panics with the shrunk case when one fails.
fn run_wire<S: Strategy>(
    what: &str,
    rt: &tokio::runtime::Runtime,
    sbxd: &Sbxd,
    strategy: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let began = Instant::now();
    let count = Cell::new(0u32);
    let mut runner = TestRunner::new(wire_config());
    let result = runner.run(&strategy, |value| {
        property(value)?;
        count.set(count.get() + 1);
        if count.get().is_multiple_of(HEALTH_EVERY) {
            check_alive(rt, sbxd, &format!("after {} {what} cases", count.get()))?;
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{what}: {e}\nsbxd's log ends:\n{}", log_tail(sbxd));
    }
    if let Err(e) = check_alive(rt, sbxd, &format!("after the {what} cases")) {
        panic!("{e}");
    }
    eprintln!("{what}: {} cases in {:.1?}", count.get(), began.elapsed());
}

fn log_tail(sbxd: &Sbxd) -> String {
    let log = sbxd.log_text();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// One sbxd for the whole binary (a single test, so that nextest's process per test does not
/// start one per property): well-typed requests to every unary RPC, then raw bytes to every
/// method path, then messages over the decode limit.
#[test]
fn sbxd_answers_any_request_with_an_expected_code() {
    let data = DataDir::new();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let sbxd = Sbxd::start(data.path(), "sim", &[]);
    let wire = Wire {
        channel: rt.block_on(sbxd.channel()),
        seen: Seen::default(),
        tally: Mutex::default(),
    };

    let calls = prop::collection::vec(call(), 1..12);
    run_wire("well-typed", &rt, &sbxd, calls, |calls| {
        for call in &calls {
            let Some((path, answer)) = within(&rt, wire.send(call)) else {
                return Err(TestCaseError::fail(format!(
                    "{} did not answer within {CALL_TIMEOUT:?}",
                    call_path(call)
                )));
            };
            wire.count(&path, &answer);
            check_answer(&path, &answer)?;
            check_quotes(&path, &answer, &wire.values(call))?;
        }
        Ok(())
    });
    wire.report("well-typed");

    run_wire("raw", &rt, &sbxd, raw(), |(at, raw)| {
        let path = raw.path(&at);
        let body = raw.bytes(&wire);
        let Some(answer) = within(&rt, wire.send_raw(path, body)) else {
            return Err(TestCaseError::fail(format!(
                "{path} did not answer within {CALL_TIMEOUT:?}"
            )));
        };
        wire.count(path, &answer);
        check_answer(path, &answer)?;
        if let Raw::Stream(streamed) = &raw {
            check_quotes(path, &answer, &streamed.values(&wire))?;
        }
        Ok(())
    });
    wire.report("raw");

    // Regressions: errors that quoted a spec's driver name in full, a page token (the store's
    // cursor error) up to 1 KiB, and 100 characters of a copy's path.
    let long = "d".repeat(1000);
    let found: Vec<(Call, Option<Streamed>)> = vec![
        (
            Call::CreateSandbox(Box::new(CreateSandboxRequest {
                name: "s1".into(),
                spec: Some(SandboxSpec {
                    command: vec!["sleep".into(), "1".into()],
                    driver: long.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            })),
            None,
        ),
        (
            Call::ListWorkspaces(ListWorkspacesRequest {
                page_token: long.clone(),
                ..Default::default()
            }),
            None,
        ),
        (
            Call::GatewayInfo,
            Some(Streamed::CopyFrom(
                Target::Given {
                    id: String::new(),
                    workspace: String::new(),
                    name: "s1".into(),
                },
                long.clone(),
            )),
        ),
    ];
    for (call, streamed) in found {
        let (path, answer, values) = match &streamed {
            None => {
                let (path, answer) = within(&rt, wire.send(&call)).expect("an answer");
                (path, answer, wire.values(&call))
            }
            Some(s) => {
                let body = s.encode(&wire);
                let answer = within(&rt, wire.send_raw(s.path(), body)).expect("an answer");
                (s.path().to_string(), answer, s.values(&wire))
            }
        };
        let status = answer.as_ref().expect_err(&path);
        assert_eq!(status.code(), Code::InvalidArgument, "{path}: {status:?}");
        if let Err(e) = check_answer(&path, &answer).and(check_quotes(&path, &answer, &values)) {
            panic!("{e}");
        }
    }

    // Over the decode limit, to every path: RESOURCE_EXHAUSTED with REQUEST_TOO_LARGE (an
    // unknown method is UNIMPLEMENTED before anything is decoded).
    let huge = vec![0x0a_u8; limits::MAX_MESSAGE_BYTES + 1];
    for path in PATHS {
        let answer = within(&rt, wire.send_raw(path, huge.clone()))
            .unwrap_or_else(|| panic!("{path} did not answer a 4 MiB message"));
        if let Err(e) = check_answer(path, &answer) {
            panic!("{e}");
        }
        let status = answer.expect_err(path);
        let reason = status.get_details_error_info().unwrap().reason;
        if path.ends_with("/NoSuchMethod") || path.starts_with("/no.such.") {
            assert_eq!(status.code(), Code::Unimplemented, "{path}: {status:?}");
        } else {
            assert_eq!(
                (status.code(), reason.as_str()),
                (Code::ResourceExhausted, "REQUEST_TOO_LARGE"),
                "{path}"
            );
        }
    }
    if let Err(e) = check_alive(&rt, &sbxd, "after the oversize messages") {
        panic!("{e}");
    }
}
