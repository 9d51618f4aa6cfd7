//! Providers, settings and service endpoints end to end: the real sbxd with the process
//! driver, driven by the real `sbx` CLI. A credential reaches the workload's and an exec's
//! environment and no output, watch or log line; a provider in use is not deleted unless
//! forced, and one re-made under the same name is another provider; settings reach the
//! environment, are checked, and die with their sandbox; a workspace delete names every
//! blocker.

mod common;

use std::time::{Duration, Instant};

use common::{CliRun, CliStream, DataDir, Sbxd, sbx};

/// How long a workload may take to write what it saw (a process sandbox starts in ~50 ms).
const SEEN_WITHIN: Duration = Duration::from_secs(10);

fn start() -> (DataDir, Sbxd) {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "process", &[]);
    (data, d)
}

/// `sbx sandbox exec NAME -- sh -c SCRIPT`, its stdout trimmed.
fn sh(e: &str, sandbox: &str, script: &str) -> String {
    sbx(e, &["sandbox", "exec", sandbox, "--", "sh", "-c", script])
        .ok()
        .trim()
        .to_string()
}

/// What the workload wrote to /sandbox/seen, once it has (bounded by [`SEEN_WITHIN`]).
fn seen(e: &str, sandbox: &str) -> String {
    let began = Instant::now();
    loop {
        let run = sbx(
            e,
            &["sandbox", "exec", sandbox, "--", "cat", "/sandbox/seen"],
        );
        if run.code == 0 {
            return run.stdout.trim().to_string();
        }
        assert!(
            began.elapsed() < SEEN_WITHIN,
            "the workload of {sandbox} wrote no /sandbox/seen: {run:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn refused(run: &CliRun) -> &str {
    assert_ne!(run.code, 0, "expected a refusal: {run:?}");
    &run.stderr
}

/// A value nobody else prints: 32 random hex digits.
fn secret() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// `sbx provider create NAME --type generic --credential CRED`.
fn create_provider(e: &str, name: &str, cred: &str) {
    sbx(
        e,
        &[
            "provider",
            "create",
            name,
            "--type",
            "generic",
            "--credential",
            cred,
        ],
    )
    .ok();
}

const WRITE_TOKEN: &str = "echo \"$TOKEN\" > /sandbox/seen; exec sleep 1000";

#[test]
fn a_credential_reaches_the_workload_and_execs_and_no_output_or_log() {
    let (_data, d) = start();
    let e = &d.endpoint();
    let value = secret();
    let watch = CliStream::start(e, &["sandbox", "watch", "-o", "json"]);
    // Through --credential-env, so the value is on no command line.
    let made = common::run_bounded(
        std::process::Command::new(common::SBX)
            .args([
                "provider",
                "create",
                "p",
                "--type",
                "generic",
                "--credential-env",
                "TOKEN",
                "--config",
                "region=eu",
                "-o",
                "json",
            ])
            .env("SBX_ENDPOINT", e)
            .env("TOKEN", &value),
        "sbx provider create",
    );
    let made = made.json();
    assert_eq!(made["credentials"][0]["name"], "TOKEN", "{made}");
    assert_eq!(
        made["credentials"][0]["fingerprint"].as_str().map(str::len),
        Some(16)
    );
    sbx(
        e,
        &[
            "sandbox",
            "create",
            "sb",
            "--provider",
            "p",
            "--",
            "sh",
            "-c",
            WRITE_TOKEN,
        ],
    )
    .ok();
    assert_eq!(seen(e, "sb"), value, "the workload's environment");
    assert_eq!(
        sh(e, "sb", "echo \"$TOKEN\""),
        value,
        "an exec's environment"
    );
    let attached = sbx(e, &["sandbox", "provider", "list", "sb", "-o", "json"]).json();
    assert_eq!(attached[0]["provider_name"], "p", "{attached}");

    let table = sbx(e, &["provider", "list"]).ok().to_string();
    assert!(
        table.contains("TOKEN") && table.contains("generic"),
        "{table}"
    );
    let mut outputs = vec![("provider list table", table)];
    for args in [
        &["provider", "get", "p", "-o", "json"][..],
        &["provider", "get", "p", "-o", "yaml"],
        &["provider", "list", "-o", "json"],
        &["provider", "list", "-A", "-o", "json"],
        &["sandbox", "get", "sb", "-o", "json"],
        &["sandbox", "list", "-o", "json"],
        &["sandbox", "provider", "list", "sb", "-o", "json"],
    ] {
        let run = sbx(e, args);
        outputs.push((args.join(" ").leak(), format!("{}{}", run.ok(), run.stderr)));
    }
    // The watch saw the sandbox come up; read what it printed so far.
    watch.wait_for(Duration::from_secs(10), |l| l.contains("\"sb\""));
    let mut watched = String::new();
    while let Some(line) = watch.next_line(Duration::from_millis(300)) {
        watched.push_str(&line);
    }
    outputs.push(("sandbox watch", watched));
    outputs.push(("sbxd's log", d.log_text()));
    assert!(
        d.log_text().contains("sbx::audit") && d.log_text().contains("create provider"),
        "the log holds the audit lines"
    );
    for (what, text) in outputs {
        assert!(
            !text.contains(&value),
            "the credential's value is in {what}:\n{text}"
        );
    }
    sbx(e, &["sandbox", "delete", "sb"]).ok();
}

#[test]
fn a_provider_in_use_is_kept_unless_forced_and_a_new_one_of_its_name_is_another() {
    let (_data, d) = start();
    let e = &d.endpoint();
    let old = secret();
    let cred = format!("TOKEN={old}");
    create_provider(e, "p", &cred);
    sbx(
        e,
        &[
            "sandbox",
            "create",
            "sb",
            "--provider",
            "p",
            "--",
            "sleep",
            "1000",
        ],
    )
    .ok();
    assert_eq!(sh(e, "sb", "echo \"$TOKEN\""), old);

    let kept = sbx(e, &["provider", "delete", "p"]);
    let said = refused(&kept);
    assert!(
        said.contains("PROVIDER_IN_USE") && said.contains("default/sb"),
        "{kept:?}"
    );
    assert_eq!(
        sbx(e, &["provider", "get", "p", "-o", "json"]).json()["name"],
        "p"
    );

    let forced = sbx(e, &["provider", "delete", "p", "--force"]);
    assert!(
        forced.ok().contains("detached from sandbox default/sb"),
        "{forced:?}"
    );
    let gone = sbx(e, &["provider", "get", "p"]);
    assert!(refused(&gone).contains("NOT_FOUND"), "{gone:?}");
    let none = sbx(e, &["sandbox", "provider", "list", "sb", "-o", "json"]).json();
    assert_eq!(none, serde_json::json!([]));

    // Same name, another provider: the sandbox referred to the old one by id.
    let cred = format!("TOKEN={}", secret());
    create_provider(e, "p", &cred);
    sbx(e, &["sandbox", "restart", "sb"]).ok();
    assert_eq!(
        sh(e, "sb", "echo \"[$TOKEN]\""),
        "[]",
        "the re-made provider reached the old sandbox"
    );

    // Update: a rotated value reaches the next exec of a sandbox attached now.
    sbx(e, &["sandbox", "provider", "attach", "sb", "p"]).ok();
    let rotated = secret();
    let cred = format!("TOKEN={rotated}");
    let before = sbx(e, &["provider", "get", "p", "-o", "json"]).json();
    let after = sbx(
        e,
        &[
            "provider",
            "update",
            "p",
            "--credential",
            &cred,
            "-o",
            "json",
        ],
    )
    .json();
    assert_ne!(
        before["credentials"][0]["fingerprint"], after["credentials"][0]["fingerprint"],
        "a rotation changes the fingerprint"
    );
    assert_eq!(sh(e, "sb", "echo \"$TOKEN\""), rotated);
    sbx(e, &["sandbox", "provider", "detach", "sb", "p"]).ok();
    assert_eq!(
        sh(e, "sb", "echo \"[$TOKEN]\""),
        "[]",
        "a detached provider still reaches execs"
    );
    sbx(e, &["sandbox", "delete", "sb"]).ok();
}

#[test]
fn settings_reach_the_environment_are_checked_and_die_with_their_sandbox() {
    let (_data, d) = start();
    let e = &d.endpoint();
    sbx(e, &["sandbox", "create", "s", "--", "sleep", "1000"]).ok();
    sbx(
        e,
        &["setting", "set", "s", "approval-mode=suggest", "note=hi"],
    )
    .ok();
    assert_eq!(sh(e, "s", "echo $SBX_SETTING_APPROVAL_MODE"), "suggest");
    let table = sbx(e, &["setting", "list", "s"]).ok().to_string();
    let rows: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        [
            vec!["KEY", "VALUE"],
            vec!["approval-mode", "suggest"],
            vec!["note", "hi"]
        ],
        "{table}"
    );
    let got = sbx(e, &["setting", "get", "s", "approval-mode", "-o", "json"]).json();
    assert_eq!(got["value"], "suggest");
    let bad = sbx(e, &["setting", "set", "s", "approval-mode=yolo"]);
    assert!(refused(&bad).contains("INVALID_ARGUMENT"), "{bad:?}");
    assert_eq!(
        sh(e, "s", "echo $SBX_SETTING_APPROVAL_MODE"),
        "suggest",
        "a refused set changed it"
    );
    sbx(e, &["setting", "delete", "s", "note"]).ok();
    let missing = sbx(e, &["setting", "get", "s", "note"]);
    assert!(
        refused(&missing).contains("SETTING_NOT_FOUND"),
        "{missing:?}"
    );

    let exposed = sbx(
        e,
        &["service", "expose", "s", "--port", "8080", "-o", "json"],
    )
    .json();
    assert_eq!(exposed["name"], "web");
    assert_eq!(exposed["port"], 8080);
    let listed = sbx(e, &["service", "list", "s"]).ok().to_string();
    assert!(
        listed.contains("web") && listed.contains("8080"),
        "{listed}"
    );

    // A new sandbox of the same name has none of the old one's settings or endpoints.
    sbx(e, &["sandbox", "delete", "s"]).ok();
    sbx(e, &["sandbox", "create", "s", "--", "sleep", "1000"]).ok();
    assert_eq!(
        sbx(e, &["setting", "list", "s", "-o", "json"]).json(),
        serde_json::json!([])
    );
    assert_eq!(
        sbx(e, &["service", "list", "s", "-o", "json"]).json(),
        serde_json::json!([])
    );
    assert_eq!(
        sbx(e, &["service", "list", "-o", "json"]).json(),
        serde_json::json!([])
    );
    assert_eq!(sh(e, "s", "echo \"[$SBX_SETTING_APPROVAL_MODE]\""), "[]");
    sbx(e, &["sandbox", "delete", "s"]).ok();
}

#[test]
fn a_workspace_delete_names_every_blocker_and_cascades() {
    let (_data, d) = start();
    let e = &d.endpoint();
    sbx(e, &["workspace", "create", "w"]).ok();
    sbx(
        e,
        &[
            "provider",
            "create",
            "-w",
            "w",
            "keys",
            "--type",
            "generic",
            "--credential",
            "A=b",
        ],
    )
    .ok();
    sbx(
        e,
        &["sandbox", "create", "-w", "w", "box", "--", "sleep", "1000"],
    )
    .ok();
    sbx(
        e,
        &[
            "service", "expose", "-w", "w", "box", "--port", "80", "--name", "api",
        ],
    )
    .ok();
    let blocked = sbx(e, &["workspace", "delete", "w"]);
    let said = refused(&blocked);
    for blocker in ["box", "keys", "api"] {
        assert!(
            said.contains(blocker),
            "{blocker} is not named: {blocked:?}"
        );
    }
    assert_eq!(
        sbx(e, &["workspace", "get", "w", "-o", "json"]).json()["name"],
        "w"
    );
    sbx(e, &["workspace", "delete", "w", "--cascade"]).ok();
    let gone = sbx(e, &["workspace", "get", "w"]);
    assert!(refused(&gone).contains("WORKSPACE_NOT_FOUND"), "{gone:?}");
    assert_eq!(
        sbx(e, &["provider", "list", "-A", "-o", "json"]).json(),
        serde_json::json!([])
    );
}
