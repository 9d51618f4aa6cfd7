//! Every `sbx` command against the real sbxd with the process driver: workspace
//! create/get/list/delete [--cascade]; sandbox create [--detach]/get/list/stop/start/restart/
//! delete/exec/logs/watch; -o table/json/yaml. Every sandbox made here is deleted, and the
//! test checks that its workload is gone.

mod common;

use std::time::Duration;

use common::{CliStream, DataDir, Sbxd, all_workload_pids, sbx, workload_pids};
use serde_json::Value;

fn field<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("no string {key:?} in {v}"))
}

/// Polls `sbx sandbox get --id ID -o json` until the phase is `phase` (at most 30 s).
fn wait_phase(endpoint: &str, id: &str, phase: &str) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let v = sbx(endpoint, &["sandbox", "get", "--id", id, "-o", "json"]).json();
        if v["phase"] == phase {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "sandbox {id} not {phase}: {v}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn every_cli_command_against_sbxd() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "process", &[]);
    let ep = d.endpoint();
    let ep = ep.as_str();

    // ---- workspaces ----------------------------------------------------------------------
    let alpha = sbx(
        ep,
        &["workspace", "create", "alpha", "-l", "team=a", "-o", "json"],
    )
    .json();
    assert_eq!(field(&alpha, "name"), "alpha");
    assert_eq!(alpha["labels"]["team"], "a");
    let alpha_id = field(&alpha, "id").to_string();
    sbx(ep, &["ws", "create", "beta"]).ok();
    let yaml = sbx(ep, &["workspace", "get", "alpha", "-o", "yaml"]);
    assert!(yaml.ok().contains("name: alpha"), "{yaml:?}");
    let table = sbx(ep, &["workspace", "get", "--id", &alpha_id]);
    assert!(
        table.ok().contains("alpha") && table.stdout.contains("NAME"),
        "{table:?}"
    );
    let all = sbx(ep, &["workspace", "list", "-o", "json"]).json();
    let names: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|w| field(w, "name"))
        .collect();
    for n in ["default", "alpha", "beta"] {
        assert!(names.contains(&n), "{names:?}");
    }
    let selected = sbx(ep, &["workspace", "list", "-l", "team=a", "-o", "json"]).json();
    assert_eq!(selected.as_array().unwrap().len(), 1, "{selected}");
    let deleted = sbx(ep, &["workspace", "delete", "beta", "-o", "json"]).json();
    assert_eq!(deleted["deleted"], true);
    let gone = sbx(ep, &["workspace", "get", "beta"]);
    assert_eq!(gone.code, 1);
    assert!(gone.stderr.contains("WORKSPACE_NOT_FOUND"), "{gone:?}");

    // ---- sandbox create (waiting, detached) ---------------------------------------------
    let web = sbx(
        ep,
        &[
            "sandbox",
            "create",
            "-w",
            "alpha",
            "-n",
            "web",
            "-l",
            "app=web",
            "-e",
            "GREETING=hi",
            "-o",
            "json",
            "--",
            "sh",
            "-c",
            "echo started-$GREETING; exec sleep 1000",
        ],
    )
    .json();
    assert_eq!(field(&web, "phase"), "Ready");
    assert_eq!(web["generation"], 1);
    let web_id = field(&web, "id").to_string();
    let bg = sbx(
        ep,
        &[
            "sandbox", "create", "-w", "alpha", "-n", "bg", "--detach", "-o", "json", "--",
            "sleep", "1000",
        ],
    )
    .json();
    let bg_id = field(&bg, "id").to_string();
    assert!(
        ["Provisioning", "Ready"].contains(&field(&bg, "phase")),
        "detach answers at once: {bg}"
    );
    wait_phase(ep, &bg_id, "Ready");
    assert_eq!(workload_pids(data.path(), &web_id).len(), 1);
    assert_eq!(workload_pids(data.path(), &bg_id).len(), 1);

    // ---- get / list ---------------------------------------------------------------------
    let got = sbx(ep, &["sandbox", "get", "-w", "alpha", "web", "-o", "json"]).json();
    assert_eq!(field(&got, "id"), web_id);
    let yaml = sbx(ep, &["sandbox", "get", "--id", &bg_id, "-o", "yaml"]);
    assert!(yaml.ok().contains("name: bg"), "{yaml:?}");
    let table = sbx(ep, &["sandbox", "list", "-w", "alpha"]);
    let out = table.ok();
    assert!(
        out.contains("NAME") && out.contains("web") && out.contains("bg"),
        "{out}"
    );
    let everywhere = sbx(ep, &["sandbox", "list", "-A", "-o", "json"]).json();
    assert_eq!(everywhere.as_array().unwrap().len(), 2, "{everywhere}");
    let by_label = sbx(
        ep,
        &["sb", "ls", "-w", "alpha", "-l", "app=web", "-o", "json"],
    )
    .json();
    assert_eq!(by_label.as_array().unwrap().len(), 1, "{by_label}");
    // Not in default: found nowhere by name alone, with a hint where it is.
    let miss = sbx(ep, &["sandbox", "get", "web"]);
    assert_eq!(miss.code, 1);
    assert!(miss.stderr.contains("SANDBOX_NOT_FOUND") && miss.stderr.contains("alpha"));

    // ---- exec / logs --------------------------------------------------------------------
    let run = sbx(
        ep,
        &[
            "sandbox",
            "exec",
            "-w",
            "alpha",
            "web",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; echo kept > /sandbox/file; exit 3",
        ],
    );
    assert_eq!(run.code, 3, "{run:?}");
    assert_eq!(run.stdout, "out\n");
    assert_eq!(run.stderr, "err\n");
    let logs = sbx(ep, &["sandbox", "logs", "-w", "alpha", "web"]);
    assert!(logs.ok().contains("started-hi"), "{logs:?}");
    let tail = sbx(ep, &["sandbox", "logs", "--id", &web_id, "--tail", "1"]);
    assert_eq!(tail.ok().trim(), "started-hi");

    // ---- watch, stop, start, restart ----------------------------------------------------
    let watch = CliStream::start(ep, &["sandbox", "watch", "-w", "alpha", "-o", "json"]);
    let mut initial = Vec::new();
    for _ in 0..2 {
        let line = watch
            .next_line(Duration::from_secs(10))
            .expect("initial events");
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["type"], "Added", "{v}");
        initial.push(v["sandbox"]["name"].as_str().unwrap().to_string());
    }
    initial.sort();
    assert_eq!(initial, ["bg", "web"]);

    let stopped = sbx(ep, &["sandbox", "stop", "-w", "alpha", "web", "-o", "json"]).json();
    assert_eq!(field(&stopped, "phase"), "Stopped");
    assert!(
        workload_pids(data.path(), &web_id).is_empty(),
        "stop ends the workload"
    );
    let again = sbx(ep, &["sandbox", "stop", "--id", &web_id, "-o", "json"]).json();
    assert_eq!(field(&again, "phase"), "Stopped", "stop is idempotent");
    watch.wait_for(Duration::from_secs(10), |l| {
        l.contains("\"Stopped\"") && l.contains("\"web\"")
    });
    sbx(ep, &["sandbox", "start", "-w", "alpha", "web"]).ok();
    let started = wait_phase(ep, &web_id, "Ready");
    assert_eq!(started["generation"], 2, "a start is a new generation");
    sbx(ep, &["sandbox", "restart", "--id", &web_id]).ok();
    let restarted = wait_phase(ep, &web_id, "Ready");
    assert_eq!(restarted["generation"], 3);
    watch.wait_for(Duration::from_secs(10), |l| {
        l.contains("\"generation\":3") || l.contains("\"generation\": 3")
    });
    // The persistent directory survived stop, start and restart.
    let cat = sbx(
        ep,
        &[
            "sandbox",
            "exec",
            "--id",
            &web_id,
            "--",
            "cat",
            "/sandbox/file",
        ],
    );
    assert_eq!(cat.ok(), "kept\n");
    drop(watch);

    // ---- delete ---------------------------------------------------------------------------
    let out = sbx(ep, &["sandbox", "delete", "-w", "alpha", "bg"]);
    assert!(out.ok().contains("deleted"), "{out:?}");
    let absent = sbx(ep, &["sandbox", "delete", "--id", &bg_id, "-o", "json"]).json();
    assert_eq!(
        absent["deleted"], false,
        "deleting an absent id deletes nothing"
    );
    assert!(workload_pids(data.path(), &bg_id).is_empty());
    let refused = sbx(ep, &["workspace", "delete", "alpha"]);
    assert_eq!(refused.code, 1);
    assert!(
        refused.stderr.contains("WORKSPACE_NOT_EMPTY"),
        "{refused:?}"
    );
    let cascade = sbx(
        ep,
        &["workspace", "delete", "alpha", "--cascade", "-o", "yaml"],
    );
    assert!(cascade.ok().contains("deleted: true"), "{cascade:?}");
    assert!(
        workload_pids(data.path(), &web_id).is_empty(),
        "cascade deleted the workload"
    );
    let none = sbx(ep, &["sandbox", "list", "-A", "-o", "json"]).json();
    assert_eq!(none.as_array().unwrap().len(), 0, "{none}");
    assert_eq!(
        all_workload_pids(data.path()),
        Vec::<i32>::new(),
        "leaked workloads"
    );
}

/// `sbx sandbox logs -f` streams output written after it started.
#[test]
fn logs_follow_streams_new_output() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "process", &[]);
    let ep = d.endpoint();
    let ticker = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "ticker",
            "-o",
            "json",
            "--",
            "sh",
            "-c",
            "i=0; while [ $i -lt 600 ]; do echo tick-$i; i=$((i+1)); sleep 0.1; done; sleep 1000",
        ],
    )
    .json();
    let id = field(&ticker, "id").to_string();
    let follow = CliStream::start(&ep, &["sandbox", "logs", "-f", "ticker"]);
    let first = follow.wait_for(Duration::from_secs(10), |l| l.starts_with("tick-"));
    let first: u32 = first["tick-".len()..].parse().unwrap();
    // A line written at least a second after the first one seen arrives while following.
    let later = format!("tick-{}", first + 10);
    follow.wait_for(Duration::from_secs(20), |l| l == later);
    drop(follow);
    let deleted = sbx(&ep, &["sandbox", "delete", "--id", &id, "-o", "json"]).json();
    assert_eq!(deleted["deleted"], true);
    assert_eq!(
        all_workload_pids(data.path()),
        Vec::<i32>::new(),
        "leaked workloads"
    );
}
