//! Unit tests of the sim driver: lifecycle rules and the world's test controls
//! (`lifecycle.rs`), the fault knobs (`faults.rs`), and the helpers both share (here).

mod faults;
mod lifecycle;

use futures::StreamExt;
use uuid::Uuid;

use super::*;

fn create_req(id: Uuid, workspace: &str, name: &str, generation: u64) -> pb::CreateRequest {
    pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: id.to_string(),
        workspace: workspace.to_string(),
        name: name.to_string(),
        spec: Some(pb::SandboxSpec {
            command: vec!["sleep".into(), "3600".into()],
            ..Default::default()
        }),
        generation,
        stopped: false,
    }
}

fn start_req(id: Uuid, generation: u64) -> pb::StartRequest {
    pb::StartRequest {
        run_env: Default::default(),
        sandbox_id: id.to_string(),
        generation,
    }
}

fn stop_req(id: Uuid) -> pb::StopRequest {
    pb::StopRequest {
        sandbox_id: id.to_string(),
        grace_period_ms: 0,
    }
}

fn get_req(id: Uuid) -> pb::GetRequest {
    pb::GetRequest {
        sandbox_id: id.to_string(),
    }
}

fn delete_req(id: Uuid) -> pb::DeleteRequest {
    pb::DeleteRequest {
        sandbox_id: id.to_string(),
    }
}

fn driver() -> SimDriver {
    SimDriver::new(SimWorld::new(), SimFaults::default())
}

fn state(snapshot: &pb::Snapshot) -> pb::State {
    pb::State::try_from(snapshot.state).unwrap()
}

/// Runs `argv` in sandbox `id`: (stdout, stderr, exit code).
async fn exec(driver: &SimDriver, id: Uuid, argv: &[&str]) -> (String, String, i32) {
    let req = pb::ExecRequest {
        sandbox_id: id.to_string(),
        command: argv.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    };
    let mut stream = driver.exec(req).await.unwrap();
    let (mut out, mut err, mut code) = (Vec::new(), Vec::new(), None);
    while let Some(item) = stream.next().await {
        match item.unwrap().chunk.unwrap() {
            pb::exec_output::Chunk::Stdout(b) => out.extend(b),
            pb::exec_output::Chunk::Stderr(b) => err.extend(b),
            pb::exec_output::Chunk::Exit(e) => code = Some(e.code),
        }
    }
    (
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
        code.expect("no exit chunk"),
    )
}

async fn log_lines(driver: &SimDriver, id: Uuid, tail: u32) -> Vec<String> {
    let req = pb::LogsRequest {
        sandbox_id: id.to_string(),
        follow: false,
        tail_lines: tail,
        ..Default::default()
    };
    let chunks: Vec<_> = driver.logs(req).await.unwrap().collect().await;
    let text: String = chunks
        .into_iter()
        .map(|c| String::from_utf8(c.unwrap().data).unwrap())
        .collect();
    text.lines().map(str::to_string).collect()
}
