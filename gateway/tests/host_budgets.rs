//! What every sandbox on a host shares, tried from inside default (`oci`) sandboxes the way an
//! attacker would, through the real sbxd and `sbx`: ptys (a sandbox holds at most
//! `--max-ptys` in each of its two devpts instances, and the host's own `openpty()` keeps
//! working), processes over all sandboxes together (`--oci-pids-total`), and socket families
//! (`AF_VSOCK` and the other unused ones refused by the seccomp profile). Each refusal shows in
//! `sbx sandbox get`. Needs root, runc, busybox-static and a C compiler with a static libc
//! (the probes are small C programs built here, copied in with `sbx sandbox cp`).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{DriverWorld, eventually};
use futures::StreamExt;
use sbx_proto::v1::{ExecRequest, SandboxRef, Tty, exec_output};

/// `gateway/tests/probes/NAME.c` built as a static executable into `dir` (gcc and libc6-dev,
/// which .ci/run installs: a machine without them fails the test, saying so).
fn probe(name: &str, dir: &Path) -> Option<PathBuf> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/probes/{name}.c"));
    let out = dir.join(name);
    let built = std::process::Command::new("cc")
        .args(["-static", "-O1", "-o"])
        .arg(&out)
        .arg(&source)
        .output()
        .unwrap_or_else(|e| panic!("no C compiler (apt-get install gcc libc6-dev): {e}"));
    assert!(
        built.status.success(),
        "cc -static {name}.c (apt-get install gcc libc6-dev): {}",
        String::from_utf8_lossy(&built.stderr)
    );
    Some(out)
}

/// Copies `file` into the sandbox `name` at /sandbox/ (it keeps its name and mode).
fn put(world: &DriverWorld, name: &str, file: &Path) {
    world
        .sbx(&[
            "sandbox",
            "cp",
            file.to_str().unwrap(),
            &format!("{name}:/sandbox/"),
        ])
        .ok();
}

/// The sandbox's record as `sbx sandbox get -o json` gives it, and its text form.
fn get(world: &DriverWorld, name: &str) -> (serde_json::Value, String) {
    let json = world.sbx(&["sandbox", "get", name, "-o", "json"]).json();
    let text = world.sbx(&["sandbox", "get", name]).ok().to_string();
    (json, text)
}

/// The probe's answers are what the sandbox's seccomp profile says: the families programs use
/// open; AF_VSOCK (as the plain number and with high bits set), AF_PACKET and AF_ALG are
/// refused with EAFNOSUPPORT. The host, where the same probe runs, opens AF_VSOCK (so the
/// refusal is the sandbox's, not the kernel's).
#[test]
fn a_sandbox_cannot_open_a_vsock_or_another_unused_socket_family() {
    let dir = tempfile::tempdir().unwrap();
    let Some(sockets) = probe("sockets", dir.path()) else {
        return;
    };
    let host = std::process::Command::new(&sockets).output().unwrap();
    let host = String::from_utf8_lossy(&host.stdout).into_owned();
    let world = DriverWorld::with_flags("oci", "vsock", &["--network-cidr", "off"]);
    world
        .sbx(&["sandbox", "create", "-n", "att", "--", "sleep", "3600"])
        .ok();
    put(&world, "att", &sockets);
    let inside = world
        .sbx(&["sandbox", "exec", "att", "--", "/sandbox/sockets"])
        .ok()
        .to_string();
    world.finish();
    for family in ["unix", "inet", "inet6", "netlink"] {
        assert!(
            inside.contains(&format!("{family} opened")),
            "a sandbox must open {family}: {inside}"
        );
    }
    let refused = "refused: Address family not supported by protocol";
    for family in ["vsock", "vsock-high-bits", "packet", "alg"] {
        assert!(
            inside.contains(&format!("{family} {refused}")),
            "a sandbox must not open {family}: {inside}"
        );
    }
    if host.contains("vsock opened") {
        eprintln!("the host opens AF_VSOCK; the sandbox does not");
    } else {
        eprintln!("this kernel has no AF_VSOCK for the host either: {host}");
    }
}

/// A workload that opens 600 ptys gets `--max-ptys` (here 40) from its own /dev/pts and as
/// many from the exec instance, never more; the host's own `openpty()` works meanwhile; with
/// the exec instance spent, an exec asking for a terminal is refused saying why, and
/// `sbx sandbox get` counts the refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_holds_at_most_its_ptys_and_the_hosts_own_terminals_still_open() {
    let dir = tempfile::tempdir().unwrap();
    let Some(ptys) = probe("ptys", dir.path()) else {
        return;
    };
    let world = DriverWorld::with_flags(
        "oci",
        "ptys",
        &["--network-cidr", "off", "--max-ptys", "40"],
    );
    world
        .sbx(&["sandbox", "create", "-n", "pty", "--", "sleep", "3600"])
        .ok();
    put(&world, "pty", &ptys);
    // Both instances, each held open by a background process of the sandbox's own, in a
    // session of its own with its stdio on files: the exec that starts them ends while they
    // hold, and what it leaves in its process group or on its pipes is ended with it (they
    // were, under load, before the operator's exec below).
    let hold = "cd /sandbox; (setsid ./ptys /dev/ptmx 600 3600 > own.out 2>&1 < /dev/null &); \
                (setsid ./ptys /dev/.sbx-pts/ptmx 600 3600 > exec.out 2>&1 < /dev/null &); \
                for i in $(seq 100); do [ -s own.out ] && [ -s exec.out ] && break; sleep 0.1; done; \
                cat own.out exec.out";
    let said = world
        .sbx(&["sandbox", "exec", "pty", "--", "sh", "-c", hold])
        .ok()
        .to_string();
    let counts: Vec<u32> = said
        .lines()
        .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(counts.len(), 2, "{said}");
    assert!(
        counts.iter().all(|&n| n <= 40),
        "a sandbox held more than its 40 ptys in an instance: {said}"
    );
    assert!(
        said.lines().all(|l| l.ends_with("No space left on device")),
        "each instance ends with ENOSPC: {said}"
    );
    // The host's own terminals.
    // The host's own terminals: an open of the host's /dev/ptmx makes a pty (openpty's first
    // step).
    let host = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/ptmx");
    assert!(host.is_ok(), "the host's openpty failed: {host:?}");
    drop(host);
    // An operator's exec asking for a terminal: refused, with the reason and the flag.
    let mut sandboxes = world.sbxd.sandboxes().await;
    let id = world.sbx(&["sandbox", "get", "pty", "-o", "json"]).json()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let tried = sandboxes
        .exec(
            ExecRequest {
                sandbox: Some(SandboxRef {
                    id: id.clone(),
                    ..Default::default()
                }),
                command: vec!["true".into()],
                tty: Some(Tty {
                    rows: 24,
                    cols: 80,
                    term: String::new(),
                }),
                ..Default::default()
            }
            .alone(),
        )
        .await;
    let refusal = match tried {
        Err(status) => status.message().to_string(),
        Ok(reply) => {
            let mut stream = reply.into_inner();
            let mut said = String::new();
            while let Some(item) = tokio::time::timeout(Duration::from_secs(20), stream.next())
                .await
                .expect("the exec answers")
            {
                match item {
                    Err(status) => {
                        said = status.message().to_string();
                        break;
                    }
                    Ok(out) => {
                        if let Some(exec_output::Chunk::Exit(e)) = out.chunk {
                            panic!("the exec got a terminal past the budget: {e:?}");
                        }
                    }
                }
            }
            said
        }
    };
    assert!(
        refusal.contains("pty budget is spent") && refusal.contains("--max-ptys"),
        "{refusal}"
    );
    let (json, text) = eventually(Duration::from_secs(20), "the refusal in the record", || {
        let (json, text) = get(&world, "pty");
        async move {
            (json["budget_refusals"]["ptys"].as_u64().unwrap_or(0) > 0).then_some((json, text))
        }
    })
    .await;
    assert!(text.contains("REFUSED:"), "{text}");
    assert!(
        text.contains("terminals (sbxd --max-ptys)"),
        "{text}\n{json}"
    );
    world.finish();
}

/// Two sandboxes of 120 processes each under a gateway whose sandboxes may run 150 together:
/// each forks 200 (a probe that leaves the exec's session, so its children stay), the parent
/// cgroup never holds more than 150, the forks past it are refused, and the refusals show on
/// the sandboxes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sandbox_together_stays_within_the_gateways_pids_total() {
    if !Path::new("/sys/fs/cgroup/pids/cgroup.procs").exists() {
        eprintln!("skipped: no cgroup v1 pids hierarchy here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(forks) = probe("forks", dir.path()) else {
        return;
    };
    let world = DriverWorld::with_flags(
        "oci",
        "pids",
        &[
            "--network-cidr",
            "off",
            "--oci-pids-limit",
            "120",
            "--oci-pids-total",
            "150",
        ],
    );
    let parent = world.cgroup_parent.clone().unwrap();
    let cgroup = Path::new("/sys/fs/cgroup/pids").join(&parent);
    let mut made = Vec::new();
    for name in ["bomb-a", "bomb-b"] {
        world
            .sbx(&["sandbox", "create", "-n", name, "--", "sleep", "3600"])
            .ok();
        put(&world, name, &forks);
        let said = world
            .sbx(&[
                "sandbox",
                "exec",
                name,
                "--",
                "sh",
                "-c",
                "/sandbox/forks 200 600 > /sandbox/out & \
                 for i in $(seq 100); do [ -s /sandbox/out ] && break; sleep 0.1; done; \
                 cat /sandbox/out",
            ])
            .ok()
            .to_string();
        made.push(said.trim().to_string());
    }
    assert_eq!(
        std::fs::read_to_string(cgroup.join("pids.max"))
            .unwrap()
            .trim(),
        "150",
        "the parent's cap"
    );
    let current: u64 = std::fs::read_to_string(cgroup.join("pids.current"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    eprintln!("forks made/refused: {made:?}; {current} processes under the parent");
    let counts: Vec<(u64, u64)> = made
        .iter()
        .map(|l| {
            let mut w = l.split_whitespace().map(|n| n.parse::<u64>().unwrap());
            (w.next().unwrap(), w.next().unwrap())
        })
        .collect();
    assert!(counts[0].0 >= 100, "the first bomb did not fork: {made:?}");
    assert!(
        counts.iter().all(|(_, refused)| *refused > 0),
        "a bomb forked all it asked for: {made:?}"
    );
    assert!(
        current <= 150,
        "the sandboxes together run {current} processes, past the 150 total"
    );
    assert!(
        counts[0].0 + counts[1].0 <= 150,
        "the bombs made {made:?}, past the 150 total"
    );
    let refused = eventually(
        Duration::from_secs(20),
        "the refusals in the records",
        || {
            let a = get(&world, "bomb-a").0["budget_refusals"]["pids"]
                .as_u64()
                .unwrap_or(0);
            let b = get(&world, "bomb-b").0["budget_refusals"]["pids"]
                .as_u64()
                .unwrap_or(0);
            async move { (a + b > 0).then_some(a + b) }
        },
    )
    .await;
    eprintln!("{refused} forks refused, as the records say");
    world.finish();
}
