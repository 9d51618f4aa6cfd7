//! Exec input that breaks the stream's rules, through sbxd's API (sim driver): each is refused
//! with INVALID_ARGUMENT and its ErrorInfo — a stream without its request first, a second
//! request, a resize without a terminal, a signal number that is none — and a terminal asked
//! of a driver without one is UNIMPLEMENTED before anything runs. The server stays healthy.

mod common;

use std::time::Duration;

use common::{DataDir, Sbxd, assert_status};
use futures::StreamExt;
use sbx_proto::v1::exec_input::Input;
use sbx_proto::v1::exec_output::Chunk;
use sbx_proto::v1::{
    CreateSandboxRequest, ExecInput, ExecRequest, SandboxRef, SandboxSpec, TerminalSize, Tty,
};
use tonic::Code;

fn cat_with_stdin() -> ExecRequest {
    ExecRequest {
        sandbox: Some(SandboxRef {
            name: "box".into(),
            ..Default::default()
        }),
        command: vec!["cat".into()],
        stdin: true,
        ..Default::default()
    }
}

fn start(req: ExecRequest) -> ExecInput {
    ExecInput {
        input: Some(Input::Start(req)),
    }
}

/// Runs an exec with `messages` as its whole input; the status it ends with, or the exit
/// code and the stdout it produced.
async fn run(d: &Sbxd, messages: Vec<ExecInput>) -> Result<(i32, Vec<u8>), tonic::Status> {
    let mut sb = d.sandboxes().await;
    // The input stays open after the messages (a client that keeps its stream): only the
    // gateway's refusal can end the exec.
    let input = futures::stream::iter(messages).chain(futures::stream::pending());
    let mut out = sb.exec(input).await?.into_inner();
    let mut stdout = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let next = tokio::time::timeout_at(deadline, out.message())
            .await
            .expect("the exec neither ended nor was refused within 10 s")?;
        match next.and_then(|m| m.chunk) {
            Some(Chunk::Stdout(b)) => stdout.extend(b),
            Some(Chunk::Exit(e)) => return Ok((e.code, stdout)),
            Some(Chunk::Stderr(_)) => {}
            None => panic!("the exec stream ended without its exit"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_input_that_breaks_the_rules_is_refused_with_its_reason() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let mut sb = d.sandboxes().await;
    sb.create_sandbox(CreateSandboxRequest {
        providers: Default::default(),
        workspace: String::new(),
        name: "box".into(),
        spec: Some(SandboxSpec {
            command: vec!["sleep".into(), "1000".into()],
            ..Default::default()
        }),
        stopped: false,
    })
    .await
    .unwrap();
    common::eventually(Duration::from_secs(10), "box Ready", || {
        let mut sb = sb.clone();
        async move {
            let got = sb
                .get_sandbox(sbx_proto::v1::GetSandboxRequest {
                    sandbox: Some(SandboxRef {
                        name: "box".into(),
                        ..Default::default()
                    }),
                })
                .await
                .ok()?
                .into_inner();
            (got.phase == sbx_proto::v1::Phase::Ready as i32).then_some(())
        }
    })
    .await;

    // The rules kept: stdin in, its end, the same bytes out.
    let fine = run(
        &d,
        vec![
            start(cat_with_stdin()),
            ExecInput {
                input: Some(Input::Stdin(b"hello".to_vec())),
            },
            ExecInput {
                input: Some(Input::CloseStdin(true)),
            },
        ],
    )
    .await
    .unwrap();
    assert_eq!(fine, (0, b"hello".to_vec()));

    let data_first = vec![ExecInput {
        input: Some(Input::Stdin(b"x".to_vec())),
    }];
    let second_start = vec![start(cat_with_stdin()), start(cat_with_stdin())];
    let resize = vec![
        start(cat_with_stdin()),
        ExecInput {
            input: Some(Input::Resize(TerminalSize { rows: 10, cols: 10 })),
        },
    ];
    let bad_signal = vec![
        start(cat_with_stdin()),
        ExecInput {
            input: Some(Input::Signal(0)),
        },
    ];
    for (what, messages, says) in [
        ("input before the request", data_first, "start"),
        ("a second request", second_start, "second request"),
        ("a resize without a tty", resize, "without a terminal"),
        ("signal 0", bad_signal, "1..=64"),
    ] {
        let status = run(&d, messages)
            .await
            .expect_err(&format!("{what} was not refused"));
        assert_status(&status, Code::InvalidArgument, "INVALID_ARGUMENT");
        assert!(status.message().contains(says), "{what}: {status:?}");
    }

    // A terminal from a driver that has none: said before anything runs.
    let tty = ExecRequest {
        tty: Some(Tty {
            rows: 24,
            cols: 80,
            term: "xterm".into(),
        }),
        ..cat_with_stdin()
    };
    let status = run(&d, vec![start(tty)]).await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    assert!(status.message().contains("terminal"), "{status:?}");

    d.assert_healthy().await;
}
