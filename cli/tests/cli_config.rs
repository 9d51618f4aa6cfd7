//! The real `sbx` binary against a small gRPC server of the test's own on a Unix socket in a
//! temp dir (the health service, behind an interceptor that records each call's
//! `authorization` header and, when told to, answers UNAUTHENTICATED): the token from the
//! flag, the environment and a context reaches the server, by the documented precedence;
//! contexts are kept in the config file; the errors say what to do.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SBX: &str = env!("CARGO_BIN_EXE_sbx");

/// How long one `sbx` run may take before the test fails.
const RUN_LIMIT: Duration = Duration::from_secs(20);

/// What the server saw and how it answers.
#[derive(Default)]
struct Seen {
    /// The `authorization` header of each call, in order (None: absent).
    headers: Vec<Option<String>>,
    /// When set, calls without `Bearer <this>` answer UNAUTHENTICATED.
    required: Option<String>,
}

struct TestServer {
    socket: PathBuf,
    seen: Arc<Mutex<Seen>>,
    runtime: tokio::runtime::Runtime,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl TestServer {
    fn start(dir: &Path) -> TestServer {
        let socket = dir.join("sbxd.sock");
        let seen = Arc::new(Mutex::new(Seen::default()));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let listener = {
            let _entered = runtime.enter();
            tokio::net::UnixListener::bind(&socket).unwrap()
        };
        let record = seen.clone();
        let check = move |request: tonic::Request<()>| {
            let header = request
                .metadata()
                .get("authorization")
                .map(|v| v.to_str().unwrap_or("<not ascii>").to_string());
            let mut seen = record.lock().unwrap();
            seen.headers.push(header.clone());
            match &seen.required {
                Some(token) if header.as_deref() != Some(&format!("Bearer {token}")) => Err(
                    tonic::Status::unauthenticated("missing or invalid bearer token"),
                ),
                _ => Ok(request),
            }
        };
        let served = runtime.spawn(async move {
            let (_reporter, health) = tonic_health::server::health_reporter();
            tonic::transport::Server::builder()
                .layer(tonic::service::InterceptorLayer::new(check))
                .add_service(health)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
        });
        TestServer {
            socket,
            seen,
            runtime,
            stop: Some(stop),
            served: Some(served),
        }
    }

    fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// The headers seen since the last call of this, and forgets them.
    fn take_headers(&self) -> Vec<Option<String>> {
        std::mem::take(&mut self.seen.lock().unwrap().headers)
    }

    fn require(&self, token: Option<&str>) {
        self.seen.lock().unwrap().required = token.map(String::from);
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(served) = self.served.take() {
            let _ = self
                .runtime
                .block_on(async { tokio::time::timeout(Duration::from_secs(5), served).await });
        }
    }
}

/// Runs `sbx args…` with a clean environment of the test's own (`env` added), bounded by
/// [`RUN_LIMIT`].
fn sbx(home: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut command = Command::new(SBX);
    command
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("SBX_CONFIG", home.join("config.toml"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().unwrap();
    let deadline = Instant::now() + RUN_LIMIT;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sbx {args:?} did not end within {RUN_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "sbx failed: {:?}\nstdout: {}\nstderr: {}",
        out.status,
        stdout(out),
        stderr(out)
    );
    stdout(out)
}

#[test]
fn the_token_from_flag_env_and_context_reaches_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path();
    let server = TestServer::start(home);
    let endpoint = server.endpoint();
    let wait = ["wait", "--for", "serving", "--timeout", "5"];
    let bearer = |t: &str| vec![Some(format!("Bearer {t}"))];

    // Flag.
    let mut args = vec!["--endpoint", &endpoint, "--token", "tok-flag"];
    args.extend(wait);
    assert_eq!(ok(&sbx(home, &[], &args)), format!("{endpoint}\n"));
    assert_eq!(server.take_headers(), bearer("tok-flag"));

    // Environment, with the short unix:/path form.
    let short = format!("unix:{}", server.socket.display());
    let env = [("SBX_ENDPOINT", short.as_str()), ("SBX_TOKEN", "tok-env")];
    assert_eq!(ok(&sbx(home, &env, &wait)), format!("{endpoint}\n"));
    assert_eq!(server.take_headers(), bearer("tok-env"));

    // The flag wins over the environment.
    let mut args = vec!["--token", "tok-flag"];
    args.extend(wait);
    ok(&sbx(home, &env, &args));
    assert_eq!(server.take_headers(), bearer("tok-flag"));

    // No token: no header at all.
    ok(&sbx(home, &[("SBX_ENDPOINT", &endpoint)], &wait));
    assert_eq!(server.take_headers(), vec![None]);

    // A context, made current, is used when neither flag nor environment says.
    let saved = ok(&sbx(
        home,
        &[],
        &[
            "config",
            "set-context",
            "test",
            "--endpoint",
            &endpoint,
            "--token",
            "tok-ctx",
            "--use",
        ],
    ));
    assert!(saved.contains("context \"test\" created"), "{saved}");
    let config = home.join("config.toml");
    let mode = std::fs::metadata(&config).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(ok(&sbx(home, &[], &wait)), format!("{endpoint}\n"));
    assert_eq!(server.take_headers(), bearer("tok-ctx"));
    // The environment's token wins over the context's.
    ok(&sbx(home, &[("SBX_TOKEN", "tok-env")], &wait));
    assert_eq!(server.take_headers(), bearer("tok-env"));

    // --context picks a context that is not the current one.
    ok(&sbx(
        home,
        &[],
        &[
            "config",
            "set-context",
            "other",
            "--endpoint",
            &endpoint,
            "--token",
            "tok-other",
        ],
    ));
    assert_eq!(
        ok(&sbx(home, &[], &["config", "current-context"])),
        "test\n"
    );
    let mut args = vec!["--context", "other"];
    args.extend(wait);
    ok(&sbx(home, &[], &args));
    assert_eq!(server.take_headers(), bearer("tok-other"));

    // The listing says a token is set, never which.
    let listed = ok(&sbx(home, &[], &["config", "get-contexts"]));
    assert!(!listed.contains("tok-"), "{listed}");
    let rows: Vec<Vec<&str>> = listed
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows[1], ["other", endpoint.as_str(), "set", "-"]);
    assert_eq!(rows[2], ["*", "test", endpoint.as_str(), "set", "-"]);

    // A context that does not exist is named with those that do.
    let mut args = vec!["--context", "nope"];
    args.extend(wait);
    let out = sbx(home, &[], &args);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("no context \"nope\"") && err.contains("other, test"),
        "{err}"
    );
    assert!(server.take_headers().is_empty(), "it dialed anyway");

    ok(&sbx(home, &[], &["config", "use-context", "other"]));
    ok(&sbx(home, &[], &["config", "delete-context", "other"]));
    let out = sbx(home, &[], &["config", "current-context"]);
    assert!(
        !out.status.success(),
        "the deleted current context is still current"
    );
}

#[test]
fn unauthenticated_says_how_to_give_a_credential() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path();
    let server = TestServer::start(home);
    server.require(Some("good-token"));
    let endpoint = server.endpoint();

    // Any call (here one the server does not even implement) is refused first.
    let out = sbx(
        home,
        &[("SBX_TOKEN", "wrong-token-123")],
        &["--endpoint", &endpoint, "workspace", "ls"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.starts_with("error: UNAUTHENTICATED: "), "{err}");
    assert!(err.contains("pass --token or set SBX_TOKEN"), "{err}");
    assert!(err.contains("sbx config set-context NAME"), "{err}");
    assert!(
        !err.contains("wrong-token-123"),
        "the token was printed: {err}"
    );
    assert_eq!(
        server.take_headers(),
        vec![Some("Bearer wrong-token-123".into())]
    );

    // Waiting for the gateway stops at once: asking again would not help.
    let started = Instant::now();
    let out = sbx(
        home,
        &[],
        &[
            "--endpoint",
            &endpoint,
            "wait",
            "--for",
            "serving",
            "--timeout",
            "30",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("pass --token or set SBX_TOKEN"),
        "{}",
        stderr(&out)
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    // With the right token the same call goes through.
    let out = sbx(
        home,
        &[("SBX_TOKEN", "good-token")],
        &["--endpoint", &endpoint, "wait", "--for", "serving"],
    );
    assert_eq!(ok(&out), format!("{endpoint}\n"));
}

#[test]
fn wait_reads_a_unix_address_from_the_addr_file_and_a_missing_socket_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path();
    let server = TestServer::start(home);
    let addr_file = home.join("addr");
    std::fs::write(&addr_file, format!("{}\n", server.endpoint())).unwrap();
    let out = sbx(
        home,
        &[("SBX_TOKEN", "tok-addr")],
        &[
            "wait",
            "--for",
            "serving",
            "--addr-file",
            addr_file.to_str().unwrap(),
        ],
    );
    assert_eq!(ok(&out), format!("{}\n", server.endpoint()));
    assert_eq!(server.take_headers(), vec![Some("Bearer tok-addr".into())]);

    let missing = home.join("none").join("sbxd.sock");
    let out = sbx(
        home,
        &[],
        &[
            "--endpoint",
            &format!("unix://{}", missing.display()),
            "workspace",
            "ls",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains(&format!("no socket at {}", missing.display())),
        "{err}"
    );
    assert!(err.contains("sbxd may not be running there"), "{err}");

    // The default endpoint is sbxd's socket under the state dir (here, a non-root HOME
    // cannot be faked for root, so only the form is checked).
    let out = sbx(
        home,
        &[("XDG_STATE_HOME", "/nonexistent-state")],
        &["workspace", "ls"],
    );
    let err = stderr(&out);
    assert!(err.contains("sbxd.sock"), "{err}");
}
