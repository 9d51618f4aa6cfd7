//! Protobuf → printed text, as data: what every noun prints (`cmd/*`'s views) and the shared
//! pieces of `crate::output` they are made of.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use sbx_proto::Timestamp;
use sbx_proto::v1::{
    DesiredState, EventType, Image, Phase, Resources, Sandbox, SandboxEvent, SandboxSpec,
    Workspace, WorkspacePhase,
};
use serde_json::json;

use crate::cmd::image::{render_image, render_images, short_digest};
use crate::cmd::sandbox::view::{
    refusal_lines, render_sandbox, render_sandboxes, sandbox_table, sandbox_view,
};
use crate::cmd::sandbox::watch::{event_type_name, render_event, watch_header};
use crate::cmd::workspace::{render_workspace, workspace_phase_name};
use crate::output::*;

/// 2026-11-29T10:00:00Z.
const T0: i64 = 1_795_946_400;

fn at(seconds: i64) -> Option<Timestamp> {
    Some(Timestamp { seconds, nanos: 0 })
}

fn now_plus(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(T0 as u64 + secs)
}

fn sandbox(name: &str, phase: Phase) -> Sandbox {
    Sandbox {
        id: format!("id-{name}"),
        workspace: "default".into(),
        workspace_id: "ws-1".into(),
        name: name.into(),
        spec: Some(SandboxSpec {
            command: vec!["sleep".into(), "60".into()],
            env: HashMap::from([("B".into(), "2".into()), ("A".into(), "1".into())]),
            labels: HashMap::from([("app".into(), "web".into())]),
            resources: Some(Resources {
                cpu_millis: 250,
                memory_bytes: 64 << 20,
                disk_bytes: 0,
            }),
            driver: "process".into(),
            image: String::new(),
            image_digest: String::new(),
            network: None,
            node: String::new(),
            node_selector: HashMap::new(),
            lifetime: None,
        }),
        desired_state: DesiredState::Running as i32,
        phase: phase as i32,
        reason: String::new(),
        message: String::new(),
        generation: 3,
        created_at: at(T0),
        updated_at: Some(Timestamp {
            seconds: T0 + 5,
            nanos: 250_000_000,
        }),
        resource_version: 17,
        network_denied: 0,
        network_last_denial: None,
        expires_at: None,
        finished_at: None,
        next: None,
        exit_code: None,
        exit_signal: 0,
        node: String::new(),
        node_id: String::new(),
        budget_refusals: None,
    }
}

fn check(got: String, expected: &str) {
    assert_eq!(
        got, expected,
        "\n--- got ---\n{got}\n--- expected ---\n{expected}"
    );
}

#[test]
fn enum_names_are_camel_case() {
    let cases: &[(String, &str)] = &[
        (phase_name(Phase::Ready as i32), "Ready"),
        (phase_name(Phase::Provisioning as i32), "Provisioning"),
        (phase_name(Phase::Unspecified as i32), "Unspecified"),
        (phase_name(99), "Unknown(99)"),
        (desired_state_name(DesiredState::Stopped as i32), "Stopped"),
        (
            workspace_phase_name(WorkspacePhase::Terminating as i32),
            "Terminating",
        ),
        (event_type_name(EventType::Modified as i32), "Modified"),
        (
            camel_case_enum("PHASE_SOME_LONG_NAME", "PHASE_"),
            "SomeLongName",
        ),
    ];
    for (got, expected) in cases {
        assert_eq!(got, expected);
    }
}

#[test]
fn ages() {
    let cases: &[(u64, &str)] = &[
        (0, "0s"),
        (119, "119s"),
        (120, "2m"),
        (7199, "119m"),
        (7200, "2h"),
        (48 * 3600 - 1, "47h"),
        (48 * 3600, "2d"),
        (400 * 86_400, "400d"),
    ];
    for (secs, expected) in cases {
        assert_eq!(age(now_plus(*secs), at(T0).as_ref()), *expected, "{secs}s");
    }
    // A creation time in the future (clock skew) is not a negative age.
    assert_eq!(age(now_plus(0), at(T0 + 30).as_ref()), "0s");
    assert_eq!(age(now_plus(0), None), "-");
}

#[test]
fn sandbox_json_has_the_documented_fields() {
    let mut sb = sandbox("web", Phase::Error);
    sb.reason = "ExitedNonZero".into();
    sb.message = "exit status 3".into();
    sb.exit_code = Some(3);
    let got: serde_json::Value =
        serde_json::from_str(&render_sandbox(OutputFormat::Json, &sb, now_plus(0)).unwrap())
            .unwrap();
    assert_eq!(
        got,
        json!({
            "id": "id-web",
            "name": "web",
            "workspace": "default",
            "workspace_id": "ws-1",
            "phase": "Error",
            "desired_state": "Running",
            "reason": "ExitedNonZero",
            "message": "exit status 3",
            "generation": 3,
            "created_at": "2026-11-29T10:00:00Z",
            "updated_at": "2026-11-29T10:00:05.250Z",
            "resource_version": 17,
            "labels": {"app": "web"},
            "command": ["sleep", "60"],
            "env": {"A": "1", "B": "2"},
            "image": "",
            "image_digest": "",
            "driver": "process",
            "cpu_millis": 250,
            "memory_bytes": 67108864,
            "disk_bytes": 0,
            "exit_code": 3,
        })
    );
}

#[test]
fn yaml_has_the_same_structure_as_json() {
    let sb = sandbox("web", Phase::Ready);
    let yaml = render_sandbox(OutputFormat::Yaml, &sb, now_plus(0)).unwrap();
    let from_yaml: serde_json::Value = serde_yaml::from_str(&yaml).unwrap();
    let from_json: serde_json::Value =
        serde_json::from_str(&render_sandbox(OutputFormat::Json, &sb, now_plus(0)).unwrap())
            .unwrap();
    assert_eq!(from_yaml, from_json);
    assert!(yaml.contains("phase: Ready\n"), "{yaml}");
}

#[test]
fn lists_are_arrays() {
    let list = [sandbox("a", Phase::Ready), sandbox("b", Phase::Stopped)];
    let got: serde_json::Value =
        serde_json::from_str(&render_sandboxes(OutputFormat::Json, &list, now_plus(0)).unwrap())
            .unwrap();
    let names: Vec<&str> = got
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a", "b"]);
    check(
        render_sandboxes(OutputFormat::Json, &[], now_plus(0)).unwrap(),
        "[]\n",
    );
    check(
        render_sandboxes(OutputFormat::Table, &[], now_plus(0)).unwrap(),
        "",
    );
}

#[test]
fn sandbox_table_is_aligned() {
    let mut failing = sandbox("a-much-longer-name", Phase::Error);
    failing.reason = "ExitedNonZero".into();
    failing.generation = 12;
    check(
        sandbox_table(
            &[sandbox("web", Phase::Ready), failing],
            now_plus(90),
            OutputFormat::Table.into(),
        ),
        "\
WORKSPACE   NAME                 ID                      PHASE   REASON          GEN   AGE
default     web                  id-web                  Ready   -               3     90s
default     a-much-longer-name   id-a-much-longer-name   Error   ExitedNonZero   12    90s
",
    );
}

#[test]
fn workspace_outputs() {
    let ws = Workspace {
        id: "w-1".into(),
        name: "team-a".into(),
        labels: HashMap::from([("env".into(), "prod".into())]),
        phase: WorkspacePhase::Active as i32,
        created_at: at(T0),
        updated_at: at(T0),
        resource_version: 4,
        default_network: None,
        default_lifetime: None,
        default_resources: None,
    };
    check(
        render_workspace(OutputFormat::Table, &ws, now_plus(3 * 3600)).unwrap(),
        "NAME     ID    PHASE    AGE\nteam-a   w-1   Active   3h\n",
    );
    let got: serde_json::Value =
        serde_json::from_str(&render_workspace(OutputFormat::Json, &ws, now_plus(0)).unwrap())
            .unwrap();
    assert_eq!(
        got,
        json!({
            "id": "w-1", "name": "team-a", "phase": "Active", "labels": {"env": "prod"},
            "created_at": "2026-11-29T10:00:00Z", "updated_at": "2026-11-29T10:00:00Z",
            "resource_version": 4,
        })
    );
}

#[test]
fn deletes() {
    let deleted = DeletedView {
        deleted: true,
        id: Some("id-web".into()),
    };
    let absent = DeletedView {
        deleted: false,
        id: None,
    };
    let render = |format: OutputFormat, view: &DeletedView| {
        render_deleted(format, view, "sandbox \"web\"", "sandbox/web").unwrap()
    };
    check(
        render(OutputFormat::Json, &deleted),
        "{\n  \"deleted\": true,\n  \"id\": \"id-web\"\n}\n",
    );
    check(
        render(OutputFormat::Yaml, &absent),
        "deleted: false\nid: null\n",
    );
    check(
        render(OutputFormat::Table, &deleted),
        "sandbox \"web\" deleted\n",
    );
    check(
        render(OutputFormat::Table, &absent),
        "sandbox \"web\" not found; nothing deleted\n",
    );
    check(render(OutputFormat::Name, &deleted), "sandbox/web\n");
    check(render(OutputFormat::Name, &absent), "");
}

/// `-o wide` adds driver, image and labels; `-o name` is `sandbox/NAME` per line;
/// `--no-headers` leaves the header out; an Error sandbox shows its message (truncated), not
/// a reason that repeats the phase.
#[test]
fn wide_name_no_headers_and_error_messages() {
    let mut failing = sandbox("bad", Phase::Error);
    failing.reason = "Error".into();
    failing.message =
        "main process exited with status 3 after writing a very long line to stderr".into();
    let mut imaged = sandbox("web", Phase::Ready);
    if let Some(spec) = imaged.spec.as_mut() {
        spec.image = "busybox".into();
        spec.labels.insert("tier".into(), "front".into());
    }
    let both = [imaged, failing];
    let wide = Style {
        format: OutputFormat::Wide,
        headers: true,
    };
    check(
        render_sandboxes(wide, &both, now_plus(90)).unwrap(),
        "\
WORKSPACE   NAME   ID       PHASE   REASON                                                         GEN   AGE   DRIVER    IMAGE     LABELS
default     web    id-web   Ready   -                                                              3     90s   process   busybox   app=web,tier=front
default     bad    id-bad   Error   main process exited with status 3 after writing a very long…   3     90s   process   -         app=web
",
    );
    check(
        render_sandboxes(OutputFormat::Name, &both, now_plus(0)).unwrap(),
        "sandbox/web\nsandbox/bad\n",
    );
    let bare = Style {
        format: OutputFormat::Table,
        headers: false,
    };
    let rows = render_sandboxes(bare, &both[..1], now_plus(90)).unwrap();
    check(rows, "default   web   id-web   Ready   -   3   90s\n");
}

/// Cells with wide (CJK) and combining characters are aligned by display width.
#[test]
fn unicode_cells_line_up() {
    let table = render_table(
        &["A", "B"],
        &[
            vec!["日本".into(), "x".into()],
            vec!["e\u{301}".into(), "y".into()],
        ],
        OutputFormat::Table.into(),
    );
    check(table, "A      B\n日本   x\ne\u{301}      y\n");
}

#[test]
fn watch_events_are_one_line_each() {
    let event = SandboxEvent {
        r#type: EventType::Modified as i32,
        sandbox: Some(sandbox("web", Phase::Stopping)),
        resource_version: 18,
    };
    check(
        watch_header(),
        "TYPE      NAME                           PHASE         GEN   RV\n",
    );
    check(
        render_event(OutputFormat::Table, &event, false).unwrap(),
        "Modified  web                            Stopping      3     18\n",
    );
    check(
        render_event(OutputFormat::Table, &event, true).unwrap(),
        "Modified  default/web                    Stopping      3     18\n",
    );
    let mut denied = event.clone();
    if let Some(s) = denied.sandbox.as_mut() {
        s.network_denied = 7;
        s.network_last_denial = Some(sbx_proto::v1::NetworkDenial {
            destination: "10.1.2.3\x1b[2J".into(),
            protocol: "tcp".into(),
            port: 81,
            packets: 3,
        });
    }
    check(
        render_event(OutputFormat::Table, &denied, false).unwrap(),
        "Modified  web                            Stopping      3     18  denied 7, last 10.1.2.3?[2J:81/tcp\n",
    );
    let line = render_event(OutputFormat::Json, &event, false).unwrap();
    assert_eq!(line.matches('\n').count(), 1, "{line}");
    let got: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(got["type"], "Modified");
    assert_eq!(got["resource_version"], 18);
    assert_eq!(got["sandbox"]["phase"], "Stopping");
    let yaml = render_event(OutputFormat::Yaml, &event, false).unwrap();
    assert!(yaml.starts_with("---\ntype: Modified\n"), "{yaml}");
}

#[test]
fn missing_spec_and_timestamps_render() {
    let bare = Sandbox {
        name: "bare".into(),
        ..Sandbox::default()
    };
    let view = sandbox_view(&bare);
    assert_eq!(view.phase, "Unspecified");
    assert_eq!(view.created_at, None);
    assert!(view.command.is_empty());
    check(
        sandbox_table(&[bare], now_plus(0), OutputFormat::Table.into()),
        "WORKSPACE   NAME   ID   PHASE         REASON   GEN   AGE\n\
         -           bare        Unspecified   -        0     -\n",
    );
}

fn image() -> Image {
    Image {
        id: "img-1".into(),
        name: "docker.io/library/busybox:latest".into(),
        digest: format!("sha256:{}", "ab".repeat(32)),
        config: Some(sbx_proto::v1::ImageConfig {
            cmd: vec!["sh".into()],
            env: vec!["PATH=/bin".into()],
            ..Default::default()
        }),
        layers: vec![sbx_proto::v1::ImageLayer {
            digest: format!("sha256:{}", "cd".repeat(32)),
            size: 1536,
        }],
        size: 1536,
        os: "linux".into(),
        architecture: "amd64".into(),
        created_at: at(T0),
        updated_at: at(T0),
        resource_version: 9,
        workspace: String::new(),
        unpacked_size: 0,
        build_cache: Vec::new(),
    }
}

#[test]
fn images_render_as_a_table_and_as_data() {
    // A gateway's image (every workspace's: `*`), not measured yet (`-`); a workspace's,
    // measured.
    let mut own = image();
    own.name = "docker.io/library/app:v1".into();
    own.workspace = "team".into();
    own.unpacked_size = 5 << 20;
    check(
        render_images(OutputFormat::Table, &[image(), own], now_plus(90)).unwrap(),
        "WORKSPACE   NAME                               DIGEST                SIZE     UNPACKED   ID      AGE\n\
         *           docker.io/library/busybox:latest   sha256:abababababab   1.5KiB   -          img-1   90s\n\
         team        docker.io/library/app:v1           sha256:abababababab   1.5KiB   5.0MiB     img-1   90s\n",
    );
    assert_eq!(
        render_images(OutputFormat::Table, &[], now_plus(0)).unwrap(),
        ""
    );
    let value: serde_json::Value =
        serde_json::from_str(&render_image(OutputFormat::Json, &image(), now_plus(0)).unwrap())
            .unwrap();
    assert_eq!(value["cmd"], json!(["sh"]));
    assert_eq!(value["layers"][0]["size"], 1536);
    assert_eq!(value["digest"], image().digest.as_str());
    assert_eq!(value["created_at"], "2026-11-29T10:00:00Z");
    assert_eq!(value["workspace"], "");
    assert_eq!(value["unpacked_size"], 0);
    let yaml = render_image(OutputFormat::Yaml, &image(), now_plus(0)).unwrap();
    assert!(
        yaml.contains("name: docker.io/library/busybox:latest"),
        "{yaml}"
    );
}

#[test]
fn sizes_and_digests_read_short() {
    assert_eq!(human_bytes(0), "0B");
    assert_eq!(human_bytes(1023), "1023B");
    assert_eq!(human_bytes(1024), "1.0KiB");
    assert_eq!(human_bytes(5 << 20), "5.0MiB");
    assert_eq!(human_bytes(3 << 30), "3.0GiB");
    assert_eq!(
        short_digest("sha256:0123456789abcdef"),
        "sha256:0123456789ab"
    );
    assert_eq!(short_digest("sha256:01"), "sha256:01");
    assert_eq!(short_digest("other"), "other");
}

#[test]
fn a_sandbox_shows_its_image_and_pinned_digest() {
    let mut sb = sandbox("web", Phase::Ready);
    let digest = format!("sha256:{}", "ef".repeat(32));
    let spec = sb.spec.as_mut().unwrap();
    spec.image = "busybox".into();
    spec.image_digest = digest.clone();
    let table = render_sandbox(OutputFormat::Table, &sb, now_plus(5)).unwrap();
    assert!(
        table.contains(&format!("\nIMAGE: busybox ({digest})\n")),
        "{table}"
    );
    let value: serde_json::Value =
        serde_json::from_str(&render_sandbox(OutputFormat::Json, &sb, now_plus(5)).unwrap())
            .unwrap();
    assert_eq!(value["image_digest"], digest.as_str());
    // Without a pin, the table is the list's.
    let plain = render_sandbox(
        OutputFormat::Table,
        &sandbox("db", Phase::Ready),
        now_plus(5),
    );
    assert!(!plain.unwrap().contains("IMAGE"));
}

#[test]
fn pull_progress_lines_skip_partial_byte_counts() {
    use crate::cmd::image::pull::progress_line;
    use sbx_proto::v1::pull_progress::Event;
    use sbx_proto::v1::{PullLayerBytes, PullLayerDone, PullProgress, PullResolved};
    let p = |event| PullProgress { event: Some(event) };
    let layer = format!("sha256:{}", "12".repeat(32));
    assert_eq!(
        progress_line(&p(Event::Resolved(PullResolved {
            digest: "sha256:m".into(),
            layers: 2,
            total_bytes: 2048,
        }))),
        Some("resolved sha256:m: 2 layer(s), 2.0KiB".into())
    );
    let bytes = |done| {
        p(Event::Layer(PullLayerBytes {
            digest: layer.clone(),
            done,
            total: 4096,
        }))
    };
    assert_eq!(progress_line(&bytes(1024)), None);
    assert_eq!(
        progress_line(&bytes(4096)),
        Some("layer sha256:121212121212: fetched 4.0KiB".into())
    );
    assert_eq!(
        progress_line(&p(Event::Cached(PullLayerDone {
            digest: layer.clone(),
            size: 10,
        }))),
        Some("layer sha256:121212121212: already present (10B)".into())
    );
    assert_eq!(
        progress_line(&p(Event::Unpacked(PullLayerDone {
            digest: layer.clone(),
            size: 0,
        }))),
        Some("layer sha256:121212121212: unpacked".into())
    );
    assert_eq!(progress_line(&PullProgress { event: None }), None);
}

#[test]
fn a_sandbox_says_what_its_network_lets_it_reach_and_what_was_refused() {
    use sbx_proto::v1::{NetworkDenial, NetworkMode, NetworkPolicy};
    let mut sb = sandbox("web", Phase::Ready);
    let table = render_sandbox(OutputFormat::Table, &sb, now_plus(5)).unwrap();
    assert!(
        table.contains("NETWORK: none: loopback only (no address; no name resolves"),
        "{table}"
    );
    sb.spec.as_mut().unwrap().network = Some(NetworkPolicy {
        mode: NetworkMode::Policy as i32,
        allow: Vec::new(),
    });
    sb.network_denied = 2;
    sb.network_last_denial = Some(NetworkDenial {
        destination: "deb.debian.org".into(),
        protocol: "dns".into(),
        port: 0,
        packets: 2,
    });
    let table = render_sandbox(OutputFormat::Table, &sb, now_plus(5)).unwrap();
    assert!(table.contains("NETWORK: an address, no egress"), "{table}");
    assert!(
        table.contains(
            "DENIED: 2 in the last 10 minutes, last deb.debian.org/dns: not in its allowlist \
             (admit it: sbx sandbox network allow web deb.debian.org:PORT)"
        ),
        "{table}"
    );
    sb.spec.as_mut().unwrap().network.as_mut().unwrap().allow = vec!["10.0.0.1:80".into()];
    let table = render_sandbox(OutputFormat::Table, &sb, now_plus(5)).unwrap();
    assert!(table.contains("NETWORK: allows 10.0.0.1:80\n"), "{table}");
}

/// What the host refused a sandbox past its budgets: one line naming each non-zero count and
/// the flag behind it, in the text and in JSON; nothing at all when nothing was refused.
#[test]
fn budget_refusals_render_only_when_something_was_refused() {
    let mut sb = Sandbox {
        name: "busy".into(),
        ..Sandbox::default()
    };
    assert_eq!(refusal_lines(&sb), "");
    sb.budget_refusals = Some(sbx_proto::v1::BudgetRefusals::default());
    assert_eq!(refusal_lines(&sb), "");
    sb.budget_refusals = Some(sbx_proto::v1::BudgetRefusals {
        ptys: 472,
        dns_queries: 9,
        ..Default::default()
    });
    check(
        refusal_lines(&sb),
        "REFUSED: past its budgets on this host: 472 terminals (sbxd --max-ptys), 9 DNS queries \
         (the resolver's budget per sandbox)\n",
    );
    let json = serde_json::to_value(sandbox_view(&sb)).unwrap();
    assert_eq!(json["budget_refusals"]["ptys"], 472);
    assert_eq!(json["budget_refusals"]["pids"], 0);
    sb.budget_refusals = None;
    let json = serde_json::to_value(sandbox_view(&sb)).unwrap();
    assert!(json.get("budget_refusals").is_none(), "{json}");
}
