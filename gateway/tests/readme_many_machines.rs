//! The README's "Many machines", run as pasted: the ```sh block after that heading is
//! extracted from README.md and only what a test must change is rewritten — `SBX_HOME` (a temp
//! dir), the database (a PostgreSQL server of the test's own: its URL and password) and the
//! nodes' ports (free ones) — then it runs under `bash -euo pipefail` with the binaries this
//! test was built with first on PATH, in its own process group (killed whole however the test
//! ends). The test then deletes the two sandboxes it made through the gateway, so no workload
//! or cgroup is left. So the README cannot drift from what sbx does.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{DataDir, SBX, readme, sh_block_after, workload_pids_in};
use sbx_storage::conformance::postgres_server::TestPostgres;

const HEADING: &str = "## Many machines";

/// How long the whole block may take.
const LIMIT: Duration = Duration::from_secs(120);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Rewrites the block for the test; panics when it no longer has what is rewritten.
fn rewrite(block: &str, home: &Path, url: &str, password: &str, ports: [u16; 2]) -> String {
    let mut saw = [false; 4];
    let mut lines = Vec::new();
    for line in block.lines() {
        let line = if line.starts_with("export SBX_HOME=") {
            saw[0] = true;
            format!("export SBX_HOME={}", home.display())
        } else if line.starts_with("export SBX_STORE_PASSWORD=") {
            saw[1] = true;
            format!("export SBX_STORE_PASSWORD='{password}'")
        } else if line.contains("postgres://sbx@127.0.0.1:5432/sbx") {
            saw[2] = true;
            line.replace("postgres://sbx@127.0.0.1:5432/sbx", url)
        } else if line.contains("7701") {
            saw[3] = true;
            line.replace("7701", &ports[0].to_string())
                .replace("7702", &ports[1].to_string())
        } else {
            line.replace("7702", &ports[1].to_string())
        };
        lines.push(line);
    }
    assert_eq!(
        saw, [true; 4],
        "the block changed; look at this test:\n{block}"
    );
    lines.join("\n") + "\n"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_machines_runs_as_pasted() {
    let block = sh_block_after(&readme(), HEADING);
    let server = TestPostgres::start().expect("a PostgreSQL server");
    server.create_database("sbx").await.unwrap();
    let tmp = DataDir::new();
    let home = tmp.path().join("home");
    let script = rewrite(
        &block,
        &home,
        &server.url("sbx"),
        server.password(),
        [free_port(), free_port()],
    );
    let script_path = tmp.path().join("many.sh");
    std::fs::write(&script_path, &script).unwrap();
    let bin_dir = Path::new(SBX).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let cleanup = tmp.path().join("cleanup.sh");
    std::fs::write(
        &cleanup,
        format!(
            "export SBX_ENDPOINT=unix://{}/gateway/sbxd.sock\nsbx sandbox delete web\nsbx \
             sandbox delete db\n",
            home.display()
        ),
    )
    .unwrap();
    // The block and the cleanup in one group: the gateway and the nodes it started stay up
    // for the cleanup, and go with the group.
    let both = tmp.path().join("both.sh");
    std::fs::write(&both, format!("{script}\nbash -eu {}\n", cleanup.display())).unwrap();
    let run = common::run_script(&both, tmp.path(), &[("PATH", &path)], LIMIT);
    let report = format!(
        "script:\n{script}\nstdout:\n{}\nstderr:\n{}\ngateway log:\n{}",
        run.out,
        run.err,
        std::fs::read_to_string(home.join("gateway.log")).unwrap_or_default()
    );
    let status = run
        .status
        .unwrap_or_else(|| panic!("the block ran over {LIMIT:?}\n{report}"));
    assert!(status.success(), "the block failed: {status}\n{report}");
    // `sbx node list` names both nodes, each Ready, and the cordoned local.
    let listed: Vec<&str> = run.out.lines().collect();
    for name in ["a", "b"] {
        assert!(
            listed
                .iter()
                .any(|l| l.starts_with(&format!("{name} ")) && l.contains("Ready")),
            "node {name} listed Ready\n{report}"
        );
    }
    assert!(
        listed
            .iter()
            .any(|l| l.starts_with("local ") && l.contains("yes")),
        "local listed cordoned\n{report}"
    );
    // Nothing left on either node.
    for node in ["node-a", "node-b"] {
        let sandboxes = home.join(node).join("sandboxes");
        if let Ok(entries) = std::fs::read_dir(&sandboxes) {
            for e in entries.flatten() {
                let id = e.file_name().to_string_lossy().to_string();
                assert!(
                    workload_pids_in(&home.join(node), &id).is_empty(),
                    "a workload left on {node}\n{report}"
                );
            }
        }
    }
    eprintln!("the block took {:?}", run.took);
}
