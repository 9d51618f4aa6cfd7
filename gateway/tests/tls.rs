//! TLS end to end: certificates from `sbxd certs init` (`daemon::certs::init`), a tonic server
//! (the health service) on 127.0.0.1:0 with `tls::server_config`, clients with
//! `tls::client_config`; and the errors of both for bad files.
//!
//! Every client call is bounded (5 s connect and request timeouts, 10 s overall) and every
//! server is stopped (graceful shutdown, 5 s, then aborted) at the end of its test.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sbx_gateway::daemon::certs::{self, CertsError, CertsInitArgs};
use sbx_gateway::tls::{self, TlsError};
use tonic::codegen::http;
use tonic::transport::{ClientTlsConfig, Endpoint, Server, ServerTlsConfig};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const CALL_TIMEOUT: Duration = Duration::from_secs(5);

fn args(names: &[&str], clients: &[&str]) -> CertsInitArgs {
    CertsInitArgs {
        dir: None,
        names: names.iter().map(|s| (*s).to_owned()).collect(),
        clients: clients.iter().map(|s| (*s).to_owned()).collect(),
        days: 365,
        force: false,
        data_dir: None,
    }
}

/// `init` with the default server names and the given clients, into a fresh temp dir.
fn make_pki(clients: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    certs::init(&args(&[], clients), dir.path()).unwrap();
    dir
}

/// The identities each request was seen with: by an interceptor (`peer_identity`) and by a
/// tower layer (`peer_identity_http`).
type Seen = Arc<Mutex<Vec<(&'static str, Option<String>)>>>;

struct TestServer {
    addr: SocketAddr,
    seen: Seen,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl TestServer {
    async fn start(tls: ServerTlsConfig) -> TestServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_reporter, health) = tonic_health::server::health_reporter();
        let seen: Seen = Arc::default();
        let (by_layer, by_interceptor) = (seen.clone(), seen.clone());
        let layer = tower::ServiceBuilder::new()
            .map_request(move |req: http::Request<tonic::body::Body>| {
                let who = tls::peer_identity_http(&req);
                by_layer.lock().unwrap().push(("layer", who));
                req
            })
            .layer(tonic::service::InterceptorLayer::new(
                move |req: tonic::Request<()>| {
                    let who = tls::peer_identity(&req);
                    by_interceptor.lock().unwrap().push(("interceptor", who));
                    Ok(req)
                },
            ));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let router = Server::builder()
            .tls_config(tls)
            .unwrap()
            .layer(layer)
            .add_service(health);
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let task = tokio::spawn(router.serve_with_incoming_shutdown(incoming, async move {
            let _ = stopped.await;
        }));
        TestServer {
            addr,
            seen,
            stop: Some(stop),
            task,
        }
    }

    fn seen(&self) -> Vec<(&'static str, Option<String>)> {
        self.seen.lock().unwrap().clone()
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if tokio::time::timeout(Duration::from_secs(5), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

/// An error with all its sources, so a test can look for the cause.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    for _ in 0..16 {
        let Some(s) = source else { break };
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Connects to `addr` over TLS as `host` (the URI's host) and asks the health service.
async fn check(addr: SocketAddr, config: ClientTlsConfig) -> Result<ServingStatus, String> {
    let call = async {
        let endpoint = Endpoint::from_shared(format!("https://{addr}"))
            .map_err(|e| chain(&e))?
            .tls_config(config)
            .map_err(|e| chain(&e))?
            .connect_timeout(CALL_TIMEOUT)
            .timeout(CALL_TIMEOUT);
        let channel = endpoint.connect().await.map_err(|e| chain(&e))?;
        let response = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map_err(|e| format!("{}: {}", e.message(), chain(&e)))?;
        Ok(response.into_inner().status())
    };
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .unwrap_or_else(|_| Err("timed out after 10 s".into()))
}

fn p(dir: &tempfile::TempDir, file: &str) -> PathBuf {
    dir.path().join(file)
}

fn mtls_server_config(pki: &tempfile::TempDir) -> ServerTlsConfig {
    tls::server_config(
        &p(pki, "server.pem"),
        &p(pki, "server-key.pem"),
        Some(&p(pki, "ca.pem")),
    )
    .unwrap()
}

fn client(pki: &tempfile::TempDir, name: Option<&str>, domain: Option<&str>) -> ClientTlsConfig {
    let cert = name.map(|n| {
        (
            p(pki, &format!("client-{n}.pem")),
            p(pki, &format!("client-{n}-key.pem")),
        )
    });
    tls::client_config(
        Some(&p(pki, "ca.pem")),
        cert.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
        domain,
    )
    .unwrap()
}

#[tokio::test]
async fn tls_mutual_client_is_served_and_seen_by_its_name() {
    let pki = make_pki(&["alice"]);
    let server = TestServer::start(mtls_server_config(&pki)).await;
    let status = check(server.addr, client(&pki, Some("alice"), None)).await;
    let seen = server.seen();
    server.stop().await;
    assert_eq!(status, Ok(ServingStatus::Serving));
    assert_eq!(
        seen,
        vec![
            ("layer", Some("alice".to_owned())),
            ("interceptor", Some("alice".to_owned()))
        ]
    );
}

#[tokio::test]
async fn tls_client_of_another_ca_is_refused() {
    let pki = make_pki(&["alice"]);
    let other = make_pki(&["mallory"]);
    let server = TestServer::start(mtls_server_config(&pki)).await;
    // mallory trusts the right CA but her certificate is from another one.
    let config = tls::client_config(
        Some(&p(&pki, "ca.pem")),
        Some((
            &p(&other, "client-mallory.pem"),
            &p(&other, "client-mallory-key.pem"),
        )),
        None,
    )
    .unwrap();
    let status = check(server.addr, config).await;
    let seen = server.seen();
    server.stop().await;
    let err = status.expect_err("a client certificate of another CA was accepted");
    assert!(err.contains("UnknownCA"), "unexpected error: {err}");
    assert!(seen.is_empty(), "a request got through: {seen:?}");
}

#[tokio::test]
async fn tls_client_without_certificate_is_refused_when_the_ca_is_required() {
    let pki = make_pki(&["alice"]);
    let server = TestServer::start(mtls_server_config(&pki)).await;
    let status = check(server.addr, client(&pki, None, None)).await;
    let seen = server.seen();
    server.stop().await;
    let err = status.expect_err("a client without a certificate was accepted");
    assert!(
        err.contains("CertificateRequired"),
        "unexpected error: {err}"
    );
    assert!(seen.is_empty(), "a request got through: {seen:?}");
}

#[tokio::test]
async fn tls_client_without_certificate_is_served_without_client_ca() {
    let pki = make_pki(&["alice"]);
    let config =
        tls::server_config(&p(&pki, "server.pem"), &p(&pki, "server-key.pem"), None).unwrap();
    let server = TestServer::start(config).await;
    let anonymous = check(server.addr, client(&pki, None, None)).await;
    let seen = server.seen();
    server.stop().await;
    assert_eq!(anonymous, Ok(ServingStatus::Serving));
    assert_eq!(seen, vec![("layer", None), ("interceptor", None)]);
}

#[tokio::test]
async fn tls_server_name_not_in_the_certificate_is_refused() {
    let pki = make_pki(&[]);
    let server = TestServer::start(
        tls::server_config(&p(&pki, "server.pem"), &p(&pki, "server-key.pem"), None).unwrap(),
    )
    .await;
    let wrong = check(server.addr, client(&pki, None, Some("sbx.example.org"))).await;
    // The same server, dialed as a name it has: served (the failure above is the name's).
    let right = check(server.addr, client(&pki, None, Some("localhost"))).await;
    server.stop().await;
    let err = wrong.expect_err("a server name not in the certificate was accepted");
    assert!(
        err.contains("not valid for name") && err.contains("sbx.example.org"),
        "unexpected error: {err}"
    );
    assert_eq!(right, Ok(ServingStatus::Serving));
}

#[test]
fn tls_bad_files_are_named() {
    let pki = make_pki(&["alice"]);
    let other = make_pki(&[]);
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let missing = dir.path().join("missing.pem");
    let (cert, key, ca) = (
        p(&pki, "server.pem"),
        p(&pki, "server-key.pem"),
        p(&pki, "ca.pem"),
    );

    let err = tls::server_config(&missing, &key, None).unwrap_err();
    assert!(
        matches!(&err, TlsError::Read { path, .. } if *path == missing),
        "{err:?}"
    );
    assert!(err.to_string().contains("missing.pem"), "{err}");

    let err = tls::server_config(&garbage, &key, None).unwrap_err();
    assert!(
        matches!(&err, TlsError::NotPem { path, .. } if *path == garbage),
        "{err:?}"
    );
    assert!(err.to_string().contains("garbage.pem is not PEM"), "{err}");

    // A key file where the certificate should be.
    let err = tls::server_config(&key, &key, None).unwrap_err();
    assert!(
        matches!(&err, TlsError::NoCertificate { path, .. } if *path == key),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("server-key.pem holds no certificate"),
        "{err}"
    );

    // A certificate where the key should be.
    let err = tls::server_config(&cert, &cert, None).unwrap_err();
    assert!(
        matches!(&err, TlsError::NoKey { path, .. } if *path == cert),
        "{err:?}"
    );

    // The key of another server's certificate.
    let other_key = p(&other, "server-key.pem");
    let err = tls::server_config(&cert, &other_key, None).unwrap_err();
    assert!(
        matches!(&err, TlsError::KeyMismatch { cert: c, key: k } if *c == cert && *k == other_key),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("does not belong to the certificate"),
        "{err}"
    );

    let err = tls::server_config(&cert, &key, Some(&garbage)).unwrap_err();
    assert!(
        matches!(
            &err,
            TlsError::NotPem {
                what: "client CA",
                ..
            }
        ),
        "{err:?}"
    );

    let err = tls::client_config(Some(&missing), None, None).unwrap_err();
    assert!(
        matches!(
            &err,
            TlsError::Read {
                what: "CA certificate",
                ..
            }
        ),
        "{err:?}"
    );

    let client_cert = p(&pki, "client-alice.pem");
    let err = tls::client_config(Some(&ca), Some((&client_cert, &other_key)), None).unwrap_err();
    assert!(matches!(&err, TlsError::KeyMismatch { .. }), "{err:?}");

    let err = tls::client_config(Some(&ca), None, Some("not a name")).unwrap_err();
    assert!(matches!(&err, TlsError::BadServerName { .. }), "{err:?}");

    // And the good ones are accepted.
    tls::server_config(&cert, &key, Some(&ca)).unwrap();
    tls::client_config(
        Some(&ca),
        Some((&client_cert, &p(&pki, "client-alice-key.pem"))),
        Some("localhost"),
    )
    .unwrap();
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn certs_init_writes_the_files_with_their_modes() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("tls");
    let written = certs::init(&args(&[], &["alice", "bob"]), &target).unwrap();
    let names: Vec<String> = written
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "ca.pem",
            "ca-key.pem",
            "server.pem",
            "server-key.pem",
            "client-alice.pem",
            "client-alice-key.pem",
            "client-bob.pem",
            "client-bob-key.pem"
        ]
    );
    for path in &written {
        let want = if path.to_string_lossy().ends_with("-key.pem") {
            0o600
        } else {
            0o644
        };
        assert_eq!(mode(path), want, "{}", path.display());
        assert!(path.starts_with(&target));
    }
    assert_eq!(mode(&target), 0o700);
    // Nothing else in the directory (no temporary file left behind).
    assert_eq!(std::fs::read_dir(&target).unwrap().count(), written.len());

    let described = certs::describe(&written, &[]);
    for want in [
        format!(
            "--tls-cert {} --tls-key {} --tls-client-ca {}",
            target.join("server.pem").display(),
            target.join("server-key.pem").display(),
            target.join("ca.pem").display()
        ),
        format!(
            "--tls-ca {} --tls-cert {} --tls-key {}",
            target.join("ca.pem").display(),
            target.join("client-bob.pem").display(),
            target.join("client-bob-key.pem").display()
        ),
    ] {
        assert!(described.contains(&want), "{want:?} not in:\n{described}");
    }
}

#[test]
fn certs_init_refuses_to_overwrite_without_force() {
    let dir = tempfile::tempdir().unwrap();
    certs::init(&args(&[], &[]), dir.path()).unwrap();
    let before = std::fs::read(dir.path().join("ca.pem")).unwrap();
    let err = certs::init(&args(&["localhost"], &[]), dir.path()).unwrap_err();
    let CertsError::Exists { paths } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(paths.len(), 4, "{paths:?}");
    assert!(
        err.to_string()
            .contains(&dir.path().join("ca.pem").display().to_string()),
        "{err}"
    );
    assert_eq!(std::fs::read(dir.path().join("ca.pem")).unwrap(), before);

    let mut forced = args(&["localhost"], &[]);
    forced.force = true;
    certs::init(&forced, dir.path()).unwrap();
    assert_ne!(std::fs::read(dir.path().join("ca.pem")).unwrap(), before);
}

#[tokio::test]
async fn certs_init_adds_clients_to_an_existing_ca() {
    let pki = make_pki(&["alice"]);
    let ca_before = std::fs::read(p(&pki, "ca.pem")).unwrap();
    let server_before = std::fs::read(p(&pki, "server.pem")).unwrap();
    let written = certs::init(&args(&[], &["carol"]), pki.path()).unwrap();
    assert_eq!(
        written,
        [p(&pki, "client-carol.pem"), p(&pki, "client-carol-key.pem")]
    );
    assert_eq!(std::fs::read(p(&pki, "ca.pem")).unwrap(), ca_before);
    assert_eq!(std::fs::read(p(&pki, "server.pem")).unwrap(), server_before);
    let described = certs::describe(&written, &[]);
    assert!(
        described.contains(&format!(
            "sbx --tls-ca {} --tls-cert {} --tls-key {}",
            p(&pki, "ca.pem").display(),
            written[0].display(),
            written[1].display()
        )),
        "{described}"
    );
    assert!(!described.contains("sbxd serve"), "{described}");
    // Longer than the CA (3650 days from its making): refused, nothing written.
    let mut long = args(&[], &["erin"]);
    long.days = 4000;
    let err = certs::init(&long, pki.path()).unwrap_err();
    assert!(matches!(err, CertsError::CaExpires { .. }), "{err:?}");
    assert!(!p(&pki, "client-erin.pem").exists());
    // Again: carol's files exist now.
    let err = certs::init(&args(&[], &["carol"]), pki.path()).unwrap_err();
    assert!(matches!(err, CertsError::Exists { .. }), "{err:?}");

    // carol's certificate, made later by the same CA, gets through.
    let server = TestServer::start(mtls_server_config(&pki)).await;
    let status = check(server.addr, client(&pki, Some("carol"), None)).await;
    let seen = server.seen();
    server.stop().await;
    assert_eq!(status, Ok(ServingStatus::Serving));
    assert_eq!(seen.first(), Some(&("layer", Some("carol".to_owned()))));
}

#[test]
fn certs_init_checks_names_and_the_ca() {
    let dir = tempfile::tempdir().unwrap();
    for bad in ["-x", "a b", "", "x/y", "..", "x-key", &"n".repeat(65)] {
        let err = certs::init(&args(&[], &[bad]), dir.path()).unwrap_err();
        assert!(
            matches!(err, CertsError::BadClientName { .. }),
            "{bad:?}: {err:?}"
        );
    }
    for bad in ["a b", "-x.example", "x..y", "under_score!"] {
        let err = certs::init(&args(&[bad], &[]), dir.path()).unwrap_err();
        assert!(
            matches!(err, CertsError::BadServerName { .. }),
            "{bad:?}: {err:?}"
        );
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "files made for bad names"
    );

    // A CA certificate without its key: no client certificate can be signed.
    let pki = make_pki(&[]);
    std::fs::remove_file(p(&pki, "ca-key.pem")).unwrap();
    let err = certs::init(&args(&[], &["dave"]), pki.path()).unwrap_err();
    assert!(matches!(err, CertsError::IncompleteCa { .. }), "{err:?}");
    assert!(err.to_string().contains("ca-key.pem"), "{err}");

    // The key of another CA next to ca.pem.
    let other = make_pki(&[]);
    std::fs::copy(p(&other, "ca-key.pem"), p(&pki, "ca-key.pem")).unwrap();
    let err = certs::init(&args(&[], &["dave"]), pki.path()).unwrap_err();
    assert!(
        matches!(&err, CertsError::BadCa { path, .. } if *path == p(&pki, "ca-key.pem")),
        "{err:?}"
    );

    let args = CertsInitArgs {
        data_dir: Some(PathBuf::from("/data")),
        ..args(&[], &[])
    };
    assert_eq!(args.target_dir().unwrap(), PathBuf::from("/data/tls"));
}
