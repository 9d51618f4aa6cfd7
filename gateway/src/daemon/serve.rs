//! `sbxd serve`: start, serve, shut down.
//!
//! Start: open the store and the driver, start the actor tree, bind the listener and serve
//! with health NOT_SERVING while every sandbox re-attaches to its workload (progress logged),
//! then mark health SERVING and write the address file. Shutdown (SIGTERM/SIGINT): health
//! NOT_SERVING, stop accepting, end open streams, let calls in flight finish within the
//! grace period, stop the actors (sandboxes keep running), close the store.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sbx_actors::{Config, DriverSet, Gateway};
use sbx_drivers::ComputeDriver;
use sbx_drivers::image::{IdMap, ImageStore};
use sbx_drivers::remote::{DriverHostArgs, run_driver_host, termination_signal};
use sbx_storage::{ObjectStore, SledStore};
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tracing_subscriber::EnvFilter;

use super::{DaemonError, DriverSpec, LogFormat, ServeArgs, drivers};
use crate::grpc::status::ErrorInfoLayer;
use crate::grpc::{SbxService, set_health};

/// How often startup logs how many sandboxes are still re-attaching.
const ATTACH_PROGRESS_EVERY: Duration = Duration::from_secs(3);

/// Runs sbxd until SIGTERM or SIGINT.
pub async fn serve(mut args: ServeArgs) -> Result<(), DaemonError> {
    init_logging(args.log_format);
    args.make_paths_absolute()?;
    // An address file left by an sbxd that was killed names a gateway that is gone: removed
    // before anything else, so that only this start's address is ever read from it.
    if let Some(path) = &args.addr_file {
        remove_stale_addr_file(path)?;
    }
    let data_dir = drivers::data_dir(args.data_dir.as_deref())?;
    create_dir(&data_dir)?;
    let images = open_images(&data_dir)?;
    images.set_limits(args.images.limits());
    crate::grpc::status::hide_data_dir(&data_dir);
    let store: Arc<dyn ObjectStore> = match args.store.open_shared(args.accept_store_loss).await? {
        Some(shared) => shared,
        None => {
            let store_path = data_dir.join("store");
            create_private_dir(&store_path)?;
            let sled = SledStore::open(&store_path).map_err(|source| DaemonError::Store {
                path: store_path.clone(),
                source,
            })?;
            check_store(&sled, &store_path, args.accept_store_loss)?;
            Arc::new(sled)
        }
    };
    // Signals first, so that a SIGTERM during startup is not lost (nor fatal by default,
    // which would orphan a managed driver process).
    let mut sigterm = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    let shutdown = CancellationToken::new();
    {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let name = tokio::select! {
                _ = sigterm.recv() => "SIGTERM",
                _ = sigint.recv() => "SIGINT",
            };
            tracing::info!(signal = name, "shutting down");
            shutdown.cancel();
        });
    }

    if let Some(warning) = args.call_timeout_warning() {
        tracing::warn!("{warning}");
    }
    let opened = drivers::open_driver(&args, &data_dir, &images).await?;
    tracing::info!(
        data_dir = %data_dir.display(),
        driver = %args.driver,
        name = %opened.name,
        call_timeout = ?args.driver_call_timeout(),
        "starting"
    );
    let result = serve_on(
        args,
        &data_dir,
        store,
        images,
        &opened.name,
        opened.driver,
        shutdown,
    )
    .await;
    if let Some(managed) = opened.managed {
        managed.shutdown().await;
        tracing::info!("driver process stopped; its workloads left running");
    }
    result
}

/// Refuses a store that lost acknowledged commits or whose indexes disagree with its
/// records — unless the operator said to take it as it is (`--accept-store-loss`), which is
/// logged and moves the high-water mark to what the store holds.
fn check_store(store: &SledStore, path: &Path, accept: bool) -> Result<(), DaemonError> {
    let began = Instant::now();
    let report = store
        .check_integrity()
        .map_err(|source| DaemonError::Store {
            path: path.to_path_buf(),
            source,
        })?;
    tracing::info!(
        revision = report.revision,
        high_water = ?report.high_water,
        took = ?began.elapsed(),
        "store checked"
    );
    if report.healthy() {
        return Ok(());
    }
    if !accept {
        return Err(DaemonError::StoreDamaged {
            path: path.to_path_buf(),
            report: report.describe(),
        });
    }
    tracing::error!(
        store = %path.display(),
        report = %report.describe(),
        "serving a damaged store, as --accept-store-loss asks; what it lost is gone"
    );
    store.accept_as_is().map_err(|source| DaemonError::Store {
        path: path.to_path_buf(),
        source,
    })
}

/// How long startup waits for an operator's remote driver before re-attaching anyway (the
/// actors retry, and the reconciler recovers sandboxes once it answers).
const REMOTE_DRIVER_READY: Duration = Duration::from_secs(10);

/// Where sbxd listens: TCP with `--listen`, and the Unix socket unless `--no-socket` (at
/// least one of them).
struct Listeners {
    tcp: Option<TcpListener>,
    socket: Option<tokio::net::UnixListener>,
}

/// The Unix socket's connections, read through [`super::h2_authority`] (stock clients that
/// send the socket's path as the authority are served too) and bounded.
fn unix_incoming(
    listener: tokio::net::UnixListener,
    limits: super::connections::Limits,
) -> impl futures::Stream<
    Item = std::io::Result<
        super::connections::Guarded<super::h2_authority::AuthorityFix<tokio::net::UnixStream>>,
    >,
> + Send
+ 'static {
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::UnixListenerStream::new(listener),
        |accepted| accepted.map(super::h2_authority::AuthorityFix::new),
    );
    super::connections::bounded(incoming, limits)
}

/// `--max-connections`, `--max-connections-per-peer`, `--handshake-timeout` and
/// `--proof-timeout`, for the listener `name` (counted in `metrics`).
fn connection_limits(
    args: &ServeArgs,
    name: &'static str,
    metrics: &Arc<sbx_actors::metrics::Metrics>,
) -> super::connections::Limits {
    super::connections::Limits {
        max_connections: args
            .max_connections
            .map(|n| n as usize)
            .unwrap_or_else(super::connections::default_max_connections),
        per_peer: args.max_connections_per_peer as usize,
        handshake_timeout: Duration::from_secs(args.handshake_timeout),
        proof_timeout: Duration::from_secs(args.proof_timeout),
        metrics: Some(Arc::clone(metrics)),
        listener: name,
    }
}

/// Checks what `--listen`, `--auth` and the TLS flags ask for together, binds, and says
/// where clients dial (host:port, or unix://PATH without --listen).
async fn bind(args: &ServeArgs, data_dir: &Path) -> Result<(Listeners, String), DaemonError> {
    let refuse = |why: String| Err(DaemonError::Security(why));
    let socket_path = args
        .socket
        .clone()
        .unwrap_or_else(|| data_dir.join(super::SOCKET_NAME));
    let socket = || bind_socket(&socket_path, args.socket_group.as_deref());
    let Some(addr) = &args.listen else {
        if args.tls_cert.is_some() {
            return refuse(
                "--tls-cert needs --listen: the Unix socket is local, its callers are known by \
                 their uid"
                    .to_string(),
            );
        }
        let listeners = Listeners {
            tcp: None,
            socket: Some(socket()?),
        };
        return Ok((listeners, format!("unix://{}", socket_path.display())));
    };
    if args.no_socket && (args.socket.is_some() || args.socket_group.is_some()) {
        return refuse(
            "--socket and --socket-group set up the socket that --no-socket leaves out".to_string(),
        );
    }
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| DaemonError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| DaemonError::Bind {
        addr: addr.clone(),
        source,
    })?;
    if !bound.ip().is_loopback() {
        if args.tls_cert.is_none() {
            return refuse(format!(
                "--listen {addr} is not a loopback address, so it needs TLS: --tls-cert and \
                 --tls-key (`sbxd certs init` makes them)"
            ));
        }
        if args.auth == super::AuthMode::None {
            return refuse(format!(
                "--auth none is accepted on the Unix socket or a loopback address only, not on \
                 {addr}"
            ));
        }
    }
    let socket = if args.no_socket {
        None
    } else {
        tracing::info!(
            socket = %socket_path.display(),
            "serving on the Unix socket too (its owner is an admin there; --no-socket leaves it out)"
        );
        Some(socket()?)
    };
    let listeners = Listeners {
        tcp: Some(listener),
        socket,
    };
    Ok((listeners, bound.to_string()))
}

/// Binds the Unix socket at `path`, mode 0600 (0660 for `group`), made under a temporary
/// name in a private directory and renamed into place, so that it is never connectable
/// with wider permissions. A socket left by an sbxd that died is replaced (this sbxd holds
/// the store's lock: no other serves this data dir).
fn bind_socket(path: &Path, group: Option<&str>) -> Result<tokio::net::UnixListener, DaemonError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let io = |what: &'static str, at: &Path| {
        let at = at.to_path_buf();
        move |source| DaemonError::Io {
            what,
            path: at,
            source,
        }
    };
    let len = path.as_os_str().len();
    if len > 107 {
        return Err(DaemonError::SocketPathTooLong {
            path: path.to_path_buf(),
            len,
        });
    }
    let parent = path.parent().unwrap_or(Path::new("/"));
    let private = parent.join(".sbxd-socket");
    std::fs::create_dir_all(&private).map_err(io("cannot create", &private))?;
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700))
        .map_err(io("cannot set the mode of", &private))?;
    let fresh = private.join("sbxd.sock");
    let _ = std::fs::remove_file(&fresh);
    let listener = tokio::net::UnixListener::bind(&fresh).map_err(|source| DaemonError::Bind {
        addr: fresh.display().to_string(),
        source,
    })?;
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(mode))
        .map_err(io("cannot set the mode of", &fresh))?;
    if let Some(group) = group {
        let gid = nix::unistd::Group::from_name(group)
            .ok()
            .flatten()
            .ok_or_else(|| DaemonError::Security(format!("--socket-group {group}: no such group")))?
            .gid;
        nix::unistd::chown(&fresh, None, Some(gid)).map_err(|e| DaemonError::Io {
            what: "cannot give the socket to its group:",
            path: fresh.clone(),
            source: e.into(),
        })?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            std::fs::remove_file(path).map_err(io("cannot remove the old socket", path))?
        }
        Ok(_) => {
            return Err(DaemonError::Security(format!(
                "{} exists and is not a socket; not replacing it",
                path.display()
            )));
        }
        Err(_) => {}
    }
    std::fs::rename(&fresh, path).map_err(io("cannot put the socket at", path))?;
    Ok(listener)
}

/// The task serving the gRPC API on every listener.
type ApiServer = tokio::task::JoinHandle<Result<(), tonic::transport::Error>>;

/// Serves the gateway over `driver` until a signal: the listeners bound, the actor tree
/// started, every door opened over one front door, then served until shutdown.
#[allow(clippy::too_many_arguments)]
async fn serve_on(
    args: ServeArgs,
    data_dir: &Path,
    store: Arc<dyn ObjectStore>,
    images: ImageStore,
    driver_name: &str,
    driver: Arc<dyn ComputeDriver>,
    shutdown: CancellationToken,
) -> Result<(), DaemonError> {
    // Bound before the actors start, so that a taken port fails fast; connections wait in the
    // backlog until the server runs, a moment later.
    let (listeners, bound) = bind(&args, data_dir).await?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(
            crate::tls::server_config(cert, key, args.tls_client_ca.as_deref())
                .map_err(|e| DaemonError::Security(e.to_string()))?,
        ),
        _ => None,
    };
    let auth = authenticator(&args, data_dir, &bound)?;
    wait_for_driver(&args, driver.as_ref(), &shutdown).await;
    let image_mirror = super::images::image_mirror(&args.images, &images);
    let config = gateway_config(&args, data_dir, &bound, images)?;
    let ownership = config.ownership.clone();
    let gateway = start_gateway(
        &args,
        config,
        store,
        driver_name,
        driver,
        &image_mirror,
        &auth,
    )
    .await?;
    let metrics_bound = serve_metrics(&args, &gateway, &shutdown).await?;
    let peers = peers_of(&args, ownership.as_ref(), &auth)?;
    // Every door's calls go through one front door: access, audit, the mirror, forwarding.
    let front = crate::frontdoor::FrontDoor::new(Arc::clone(&gateway))
        .with_mirror(image_mirror)
        .with_peers(peers.clone())
        .with_identities(data_dir);
    let service_bound = serve_service_endpoints(&args, &gateway, &front, &shutdown).await?;
    let e2b_bound = serve_e2b(&args, data_dir, &gateway, &auth, &front, &shutdown).await?;
    let service = SbxService::new(front, shutdown.clone());
    let (mut server, health) = serve_api(
        &args, tls, &gateway, &auth, peers, service, listeners, &shutdown,
    )
    .await?;
    tracing::info!(%bound, "listening; re-attaching sandboxes");
    let attached = tokio::select! {
        attached = wait_attached(&gateway) => attached,
        _ = shutdown.cancelled() => false,
    };
    if attached {
        set_health(&health, ServingStatus::Serving).await;
        let files = [
            (&args.service_addr_file, &service_bound),
            (&args.metrics_addr_file, &metrics_bound),
            (&args.e2b_addr_file, &e2b_bound),
        ];
        announce(&args, &files, &bound)?;
        tracing::info!(%bound, driver = driver_name, "serving");
        tokio::spawn(report_disk_full(
            Arc::clone(&gateway),
            health.clone(),
            shutdown.clone(),
        ));
    }
    let result = serve_until_stopped(&args, &mut server, &health, &shutdown).await;
    if let Some(path) = &args.addr_file
        && attached
    {
        let _ = std::fs::remove_file(path);
    }
    match Arc::try_unwrap(gateway) {
        // Whether every actor let go in time is logged by the actor layer itself.
        Ok(gateway) => {
            let _ = gateway.shutdown().await;
        }
        Err(_) => tracing::warn!("the actor tree is still referenced; it stops with the process"),
    }
    result
}

/// The authenticator of the API's callers (the identities of `data_dir`).
fn authenticator(
    args: &ServeArgs,
    data_dir: &Path,
    bound: &str,
) -> Result<Arc<crate::auth::Authenticator>, DaemonError> {
    let identities = crate::auth::Identities::open(data_dir)
        .map_err(|e| DaemonError::Security(format!("the identities: {e}")))?;
    if args.auth == super::AuthMode::None {
        tracing::warn!(
            listen = %bound,
            "--auth none: every caller is a gateway-wide admin (for scripts and tests on this \
             machine only)"
        );
    }
    Ok(Arc::new(crate::auth::Authenticator {
        identities,
        none: args.auth == super::AuthMode::None,
        owner_uid: nix::unistd::geteuid().as_raw(),
        workspaces: std::sync::OnceLock::new(),
    }))
}

/// Waits (bounded) until a driver in another process answers; starts anyway when it does not.
async fn wait_for_driver(
    args: &ServeArgs,
    driver: &dyn ComputeDriver,
    shutdown: &CancellationToken,
) {
    let ready_limit = match &args.driver {
        DriverSpec::InProcess(_) => None,
        DriverSpec::Managed(kind) => Some(kind.factory().host_ready_within),
        DriverSpec::Remote(_) => Some(REMOTE_DRIVER_READY),
    };
    if let Some(limit) = ready_limit {
        let ready = tokio::select! {
            ready = drivers::wait_driver_ready(driver, limit) => ready,
            _ = shutdown.cancelled() => false,
        };
        if ready {
            tracing::info!(driver = %args.driver, "the driver answers");
        } else {
            tracing::warn!(
                driver = %args.driver,
                waited = ?limit,
                "the driver does not answer yet; starting anyway (its sandboxes recover once it does)"
            );
        }
    }
}

/// The actor tree's configuration from the flags.
fn gateway_config(
    args: &ServeArgs,
    data_dir: &Path,
    bound: &str,
    images: ImageStore,
) -> Result<Config, DaemonError> {
    Ok(Config {
        reconcile_interval: args.reconcile_interval(),
        driver_call_timeout: args.driver_call_timeout(),
        image_store: Some(images),
        default_image: args.images.default_image.clone(),
        max_image_import_bytes: args.images.max_import_mib << 20,
        pull_timeout: args.images.pull_timeout,
        event_history: args.watch_history_events as usize,
        event_history_bytes: (args.watch_history_mib as usize) << 20,
        // Providers' credentials are sealed under DATA/secrets.key (made 0600 on first use).
        secrets: Arc::new(
            sbx_actors::Sealer::open_or_create(&data_dir.join("secrets.key"))
                .map_err(|e| DaemonError::Setup(e.to_string()))?,
        ),
        service_domain: validate_service_domain(&args.service_domain)?,
        default_resources: default_resources(args)?,
        stats: stats_settings(args)?,
        events_per_sandbox: args.events_per_sandbox as usize,
        events_max: args.events_max as usize,
        lifetimes: sbx_actors::LifetimeSettings {
            max_ttl: args.max_ttl,
            idle_cpu_cores: args.idle_cpu,
            ..Default::default()
        },
        // Gateways sharing a store take turns at each workspace, under leases.
        ownership: match &args.store.store {
            Some(_) => Some(sbx_actors::OwnershipSettings {
                gateway: super::store::gateway_id(data_dir)?,
                address: args.store.advertised(bound)?,
                period: Duration::from_secs(args.store.lease_seconds),
            }),
            None => None,
        },
        ..Config::default()
    })
}

/// The actor tree started over `driver` and the nodes, its default image made and mirrored,
/// and grants written by name bound to their workspaces.
async fn start_gateway(
    args: &ServeArgs,
    config: Config,
    store: Arc<dyn ObjectStore>,
    driver_name: &str,
    driver: Arc<dyn ComputeDriver>,
    image_mirror: &Option<Arc<crate::grpc::ImageMirror>>,
    auth: &crate::auth::Authenticator,
) -> Result<Arc<Gateway>, DaemonError> {
    let nodes = sbx_actors::nodes::Nodes::new(
        Some(Arc::new(
            args.nodes
                .dialer(
                    args.driver_call_timeout(),
                    config.ownership.as_ref().map(|o| o.gateway),
                )?
                .with_image_source(image_mirror.as_ref().map(|m| m.source())),
        )),
        args.nodes.timing(),
    );
    let drivers = DriverSet::single(driver_name, driver).with_nodes(nodes);
    let gateway = Arc::new(Gateway::start(store, drivers, config).await?);
    super::images::ensure_default_image(&gateway, &args.images).await?;
    super::images::mirror_default_image(&gateway, image_mirror.as_ref());
    // Grants written by name (an identities file from before ids, or `sbxd token create`) are
    // bound to the workspaces of those names now, before anything is served, and by the auth
    // layer whenever the file holds new ones.
    let lookup_gateway = gateway.clone();
    let lookup: crate::auth::WorkspaceLookup = Arc::new(move |name: String| {
        let gateway = lookup_gateway.clone();
        Box::pin(async move { gateway.workspace_id(&name).await.map_err(|e| e.to_string()) })
    });
    let _ = auth.workspaces.set(lookup);
    auth.bind_unbound().await;

    Ok(gateway)
}

/// `--metrics-listen`: the metrics listener, and the address it bound.
async fn serve_metrics(
    args: &ServeArgs,
    gateway: &Arc<Gateway>,
    shutdown: &CancellationToken,
) -> Result<Option<String>, DaemonError> {
    Ok(match &args.metrics_listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
                DaemonError::Setup(format!("cannot listen for metrics on {addr}: {e}"))
            })?;
            let local = listener
                .local_addr()
                .map_err(|e| DaemonError::Setup(format!("the metrics listener: {e}")))?;
            super::metrics::check_listen(&local).map_err(DaemonError::Setup)?;
            gateway.metrics().enable();
            tracing::info!(bound = %local, "serving metrics at /metrics");
            tokio::spawn(super::metrics::serve(
                listener,
                connection_limits(args, "metrics", &gateway.metrics()),
                super::metrics::of_gateway(Arc::clone(gateway)),
                shutdown.clone(),
            ));
            Some(local.to_string())
        }
        None => None,
    })
}

/// `--service-listen`: the routed service endpoints, and the address they bound.
async fn serve_service_endpoints(
    args: &ServeArgs,
    gateway: &Arc<Gateway>,
    front: &crate::frontdoor::FrontDoor,
    shutdown: &CancellationToken,
) -> Result<Option<String>, DaemonError> {
    Ok(match &args.service_listen {
        Some(addr) => {
            let (listener, bound) = bind_plain(addr, "service endpoints").await?;
            if !listener.local_addr().is_ok_and(|a| a.ip().is_loopback()) {
                tracing::warn!(%bound, "service endpoints are served off loopback, without authentication: whoever reaches this address reaches every exposed port");
            }
            tracing::info!(%bound, domain = %args.service_domain, "serving service endpoints");
            tokio::spawn(crate::routes::serve(
                listener,
                connection_limits(args, "service", &gateway.metrics()),
                front.clone(),
                shutdown.clone(),
            ));
            Some(bound)
        }
        None => None,
    })
}

/// Gateways sharing a store: the others, as requests for a workspace another one serves go on
/// to it.
fn peers_of(
    args: &ServeArgs,
    ownership: Option<&sbx_actors::OwnershipSettings>,
    auth: &crate::auth::Authenticator,
) -> Result<Option<Arc<super::forward::Peers>>, DaemonError> {
    Ok(match ownership {
        // Gateways that require client certificates would refuse a forward (this gateway
        // presents none): requests for another's workspace are answered naming the holder.
        Some(_) if args.tls_client_ca.is_some() => {
            tracing::warn!(
                "--tls-client-ca: requests for workspaces another gateway serves are not \
                 forwarded (the gateways would have to present client certificates to each \
                 other); they are answered UNAVAILABLE naming the holder"
            );
            None
        }
        Some(ownership) => {
            let tls = match &args.tls_cert {
                Some(_) => Some(
                    crate::tls::client_config(args.store.peer_tls_ca.as_deref(), None, None)
                        .map_err(|e| DaemonError::Security(format!("--peer-tls-ca: {e}")))?,
                ),
                None => None,
            };
            Some(Arc::new(super::forward::Peers::new(
                ownership.gateway,
                tls,
                auth.none,
            )))
        }
        None => None,
    })
}

/// `--e2b-listen`: the E2B API over the front door, and the address it bound.
async fn serve_e2b(
    args: &ServeArgs,
    data_dir: &Path,
    gateway: &Arc<Gateway>,
    auth: &Arc<crate::auth::Authenticator>,
    front: &crate::frontdoor::FrontDoor,
    shutdown: &CancellationToken,
) -> Result<Option<String>, DaemonError> {
    Ok(match &args.e2b_listen {
        Some(addr) => {
            let (listener, bound) = bind_plain(addr, "the E2B API").await?;
            let tls = match (&args.e2b_tls_cert, &args.e2b_tls_key) {
                (Some(cert), Some(key)) => Some(tokio_rustls::TlsAcceptor::from(Arc::new(
                    sbx_tls::rustls_server_config(cert, key)
                        .map_err(|e| DaemonError::Security(format!("--e2b-tls-cert: {e}")))?,
                ))),
                _ => None,
            };
            if !listener.local_addr().is_ok_and(|a| a.ip().is_loopback()) {
                if tls.is_none() {
                    return Err(DaemonError::Security(format!(
                        "--e2b-listen {addr} is not a loopback address, so it needs TLS: \
                         --e2b-tls-cert and --e2b-tls-key (its API keys would travel in the clear)"
                    )));
                }
                if auth.none {
                    return Err(DaemonError::Security(format!(
                        "--auth none is accepted on a loopback address only, not on \
                         --e2b-listen {addr}"
                    )));
                }
            }
            tracing::info!(%bound, tls = tls.is_some(), domain = ?args.e2b_domain, "serving the E2B API");
            tokio::spawn(crate::e2b::serve(
                listener,
                tls,
                connection_limits(args, "e2b", &gateway.metrics()),
                crate::e2b::E2b {
                    front: front.clone(),
                    auth: Arc::clone(auth),
                    templates: Arc::new(args.e2b_templates.iter().cloned().collect()),
                    // The same key file the gateway's config opened: the same key.
                    secrets: Arc::new(
                        sbx_actors::Sealer::open_or_create(&data_dir.join("secrets.key"))
                            .map_err(|e| DaemonError::Setup(e.to_string()))?,
                    ),
                    transfers: Default::default(),
                    processes: Default::default(),
                    watchers: Default::default(),
                    domain: args.e2b_domain.clone(),
                    keys: Default::default(),
                    default_users: Default::default(),
                    caller: None,
                    bearer: None,
                },
                shutdown.clone(),
            ));
            Some(bound)
        }
        None => None,
    })
}

/// The gRPC API on every listener: its layers (metrics, ErrorInfo, authentication,
/// forwarding) and every service, health (not serving yet) and reflection included; a task
/// that ends when every listener has, and the health reporter.
#[allow(clippy::too_many_arguments)]
async fn serve_api(
    args: &ServeArgs,
    tls: Option<tonic::transport::ServerTlsConfig>,
    gateway: &Arc<Gateway>,
    auth: &Arc<crate::auth::Authenticator>,
    peers: Option<Arc<super::forward::Peers>>,
    service: SbxService,
    listeners: Listeners,
    shutdown: &CancellationToken,
) -> Result<(ApiServer, tonic_health::server::HealthReporter), DaemonError> {
    let (health, health_server) = tonic_health::server::health_reporter();
    set_health(&health, ServingStatus::NotServing).await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(sbx_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| DaemonError::Reflection(e.to_string()))?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(sbx_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| DaemonError::Reflection(e.to_string()))?;
    // Every error answered carries an ErrorInfo and stays bounded, tonic's own included.
    let keepalive = Duration::from_secs(args.keepalive);
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(keepalive))
        .http2_keepalive_timeout(Some(keepalive))
        .tcp_keepalive(Some(keepalive));
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .map_err(|e| DaemonError::Security(format!("the TLS configuration: {e}")))?;
    }
    let router = builder
        .layer(super::metrics::ApiMetricsLayer(gateway.metrics()))
        .layer(ErrorInfoLayer)
        .layer(crate::auth::AuthLayer(Arc::clone(auth)))
        .layer(super::forward::ForwardLayer(peers))
        .add_service(health_server)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service.gateway_server())
        .add_service(service.workspace_server())
        .add_service(service.sandbox_server())
        .add_service(service.image_server())
        .add_service(service.node_server())
        .add_service(service.identity_server())
        .add_service(service.provider_server())
        .add_service(service.setting_server())
        .add_service(service.service_endpoint_server());
    drop(service);
    let stop_accepting = shutdown.clone();
    // TCP_NODELAY on every accepted connection: without it a small HTTP/2 frame written while
    // an earlier one is unacknowledged waits for the client's delayed ACK (40 ms on Linux), a
    // floor under every answer (docs/BENCHMARKS.md, oci create→Ready).
    let stopped = async move { stop_accepting.cancelled().await };
    let limits = connection_limits(args, "api", &gateway.metrics());
    tracing::info!(
        max_connections = limits.max_connections,
        per_peer = limits.per_peer,
        proof_timeout = ?limits.proof_timeout,
        handshake_timeout = ?limits.handshake_timeout,
        keepalive = ?keepalive,
        "connection limits"
    );
    // One router on each listener; the server task ends when both have.
    let tcp = listeners.tcp.map(|listener| {
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let incoming = super::connections::bounded(incoming, limits.clone());
        router
            .clone()
            .serve_with_incoming_shutdown(incoming, stopped)
    });
    let local = listeners.socket.map(|socket| {
        let stop = shutdown.clone();
        router.serve_with_incoming_shutdown(unix_incoming(socket, limits), async move {
            stop.cancelled().await
        })
    });
    let server = tokio::spawn(async move {
        let tcp = async move {
            match tcp {
                Some(served) => served.await,
                None => Ok(()),
            }
        };
        let local = async move {
            match local {
                Some(served) => served.await,
                None => Ok(()),
            }
        };
        tokio::try_join!(tcp, local).map(|_| ())
    });
    Ok((server, health))
}

/// Writes the listeners' address files: the others first, then the main one (which says
/// sbxd serves, so whoever waits for it then finds the others there).
fn announce(
    args: &ServeArgs,
    files: &[(&Option<PathBuf>, &Option<String>)],
    bound: &str,
) -> Result<(), DaemonError> {
    for (path, addr) in files {
        if let (Some(path), Some(addr)) = (path, addr) {
            write_addr_file(path, addr)?;
        }
    }
    if let Some(path) = &args.addr_file {
        write_addr_file(path, bound)?;
    }
    Ok(())
}

/// Serves until a signal (or until the server fails by itself), then lets calls in flight
/// end within the grace period.
async fn serve_until_stopped(
    args: &ServeArgs,
    server: &mut ApiServer,
    health: &tonic_health::server::HealthReporter,
    shutdown: &CancellationToken,
) -> Result<(), DaemonError> {
    // Serve until a signal (or until the server fails by itself).
    let served = tokio::select! {
        _ = shutdown.cancelled() => None,
        result = &mut *server => Some(result),
    };
    let began = Instant::now();
    shutdown.cancel();
    set_health(health, ServingStatus::NotServing).await;
    let result = match served {
        Some(result) => flatten(result),
        None => match tokio::time::timeout(args.shutdown_grace(), &mut *server).await {
            Ok(result) => flatten(result),
            Err(_) => {
                tracing::warn!(
                    grace = ?args.shutdown_grace(),
                    "calls still in flight after the grace period; dropping their connections"
                );
                server.abort();
                // Wait for the abort to drop the server (and its hold on the actor tree).
                let _ = (&mut *server).await;
                Ok(())
            }
        },
    };
    tracing::info!(took = ?began.elapsed(), "stopped; sandboxes left running");
    result
}

/// `sbxd driver`: serves one driver on a Unix socket until SIGTERM or SIGINT.
pub async fn run_driver(args: DriverHostArgs) -> Result<(), DaemonError> {
    init_logging(LogFormat::Pretty);
    let shutdown = termination_signal().map_err(DaemonError::DriverHost)?;
    let backend = args.backend.name;
    tracing::info!(%backend, socket = %args.socket.display(), "driver host starting");
    run_driver_host(args, shutdown)
        .await
        .map_err(DaemonError::DriverHost)?;
    tracing::info!("driver host stopped; workloads left running");
    Ok(())
}

/// Waits until every sandbox loaded at startup has re-attached, logging progress.
async fn wait_attached(gateway: &Gateway) -> bool {
    let began = Instant::now();
    loop {
        if gateway.wait_attached(ATTACH_PROGRESS_EVERY).await {
            tracing::info!(took = ?began.elapsed(), "every sandbox re-attached");
            return true;
        }
        tracing::info!(
            pending = gateway.pending_attach(),
            waited = ?began.elapsed(),
            "sandboxes still re-attaching"
        );
    }
}

fn flatten(
    joined: Result<Result<(), tonic::transport::Error>, tokio::task::JoinError>,
) -> Result<(), DaemonError> {
    match joined {
        Ok(result) => result.map_err(DaemonError::from),
        Err(e) => {
            tracing::error!(error = %e, "the server task ended abnormally");
            Ok(())
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = std::env::var("SBX_LOG")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("RUST_LOG").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "info".to_string());
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("warning: bad log filter {filter:?} ({e}); using \"info\"");
        EnvFilter::new("info")
    });
    // Colour only for a person at a terminal: a log file, journald or a pipe would keep the
    // escape sequences as noise around every level and field name.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        // A log line that cannot be written (a full disk under a log file) is lost, and only
        // it: reporting the failure on that same stderr would panic the task that logged.
        .log_internal_errors(false);
    // A second initialisation (only possible in tests) keeps the first subscriber.
    let _ = match format {
        LogFormat::Pretty => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Makes the data directory, mode 0711: the oci driver's sandboxes (an unprivileged host uid)
/// walk through it to their root filesystems; nobody but its owner can list it, and what it
/// holds is private on its own (the store 0700, the image store 0700).
fn create_dir(dir: &Path) -> Result<(), DaemonError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)))
        .map_err(|source| DaemonError::Io {
            what: "cannot create the data directory",
            path: dir.to_path_buf(),
            source,
        })
}

/// Makes `dir` readable by its owner only.
fn create_private_dir(dir: &Path) -> Result<(), DaemonError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|source| DaemonError::Io {
            what: "cannot create the directory",
            path: dir.to_path_buf(),
            source,
        })
}

/// The image store, DATA/images: the content of every image the gateway has.
fn open_images(data_dir: &Path) -> Result<ImageStore, DaemonError> {
    let path = data_dir.join("images");
    ImageStore::open(path.clone(), IdMap::default())
        .map_err(|source| DaemonError::Images { path, source })
}

/// Writes `addr` and a newline to `path` so that no reader ever sees a partial line: the text
/// goes to a temporary file beside it, which is then renamed over `path`.
/// A service domain: DNS labels joined by dots (a Host ends in it).
/// `--default-cpu`, `--default-memory` and `--default-disk` as the gateway's default limits.
fn default_resources(args: &ServeArgs) -> Result<sbx_proto::v1::Resources, DaemonError> {
    sbx_actors::validate::memory_limit("--default-memory", args.default_memory, "no limit")
        .map_err(|e| DaemonError::Setup(e.to_string()))?;
    sbx_actors::validate::disk_limit("--default-disk", args.default_disk, "no limit")
        .map_err(|e| DaemonError::Setup(e.to_string()))?;
    Ok(sbx_proto::v1::Resources {
        cpu_millis: args.default_cpu,
        memory_bytes: args.default_memory,
        disk_bytes: args.default_disk,
    })
}

/// `--stats-interval` and `--stats-history`, at most `MAX_STATS_SAMPLES` samples apart.
fn stats_settings(args: &ServeArgs) -> Result<sbx_actors::stats::StatsSettings, DaemonError> {
    let settings = sbx_actors::stats::StatsSettings {
        interval: args.stats_interval,
        history: args.stats_history,
    };
    if settings.capacity() as u64 > super::MAX_STATS_SAMPLES {
        return Err(DaemonError::Setup(format!(
            "--stats-history {:?} at --stats-interval {:?} keeps {} samples per sandbox; at most \
             {} (a longer interval, or a shorter history)",
            settings.history,
            settings.interval,
            settings.capacity(),
            super::MAX_STATS_SAMPLES
        )));
    }
    Ok(settings)
}

fn validate_service_domain(domain: &str) -> Result<String, DaemonError> {
    let ok = !domain.is_empty()
        && domain.len() <= 253
        && domain
            .split('.')
            .all(|label| sbx_proto::names::validate_name(label).is_ok());
    if !ok {
        return Err(DaemonError::Setup(format!(
            "--service-domain {domain:?} is not a domain name (DNS labels joined by dots)"
        )));
    }
    Ok(domain.to_ascii_lowercase())
}

pub fn write_addr_file(path: &Path, addr: &str) -> Result<(), DaemonError> {
    let tmp = temp_path(path);
    std::fs::write(&tmp, format!("{addr}\n")).map_err(|source| DaemonError::Io {
        what: "cannot write the address file",
        path: tmp.clone(),
        source,
    })?;
    std::fs::rename(&tmp, path).map_err(|source| DaemonError::Io {
        what: "cannot rename the address file into place at",
        path: path.to_path_buf(),
        source,
    })
}

/// Removes `path` if it exists (a missing file is fine).
fn remove_stale_addr_file(path: &Path) -> Result<(), DaemonError> {
    match std::fs::remove_file(path) {
        Ok(()) => {
            tracing::info!(path = %path.display(), "removed a stale address file");
            Ok(())
        }
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DaemonError::Io {
            what: "cannot remove the stale address file",
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// The health service name that is NOT_SERVING while the store refuses writes for lack of
/// space (as is the server's overall status, service ""); `sbx.v1.WorkspaceService` and
/// `sbx.v1.SandboxService` stay SERVING meanwhile, because their reads (get, list, watch) do.
pub const WRITES_HEALTH_SERVICE: &str = "sbx.v1.Writes";

/// How often the health service looks at the store's disk (one `statvfs` each time).
const DISK_CHECK_INTERVAL: Duration = Duration::from_millis(500);

/// Keeps health in step with the store's disk until shutdown: "" and
/// [`WRITES_HEALTH_SERVICE`] NOT_SERVING while the store is full, SERVING again once it takes
/// writes (within [`DISK_CHECK_INTERVAL`]).
async fn report_disk_full(
    gateway: Arc<Gateway>,
    health: tonic_health::server::HealthReporter,
    shutdown: CancellationToken,
) {
    health
        .set_service_status(WRITES_HEALTH_SERVICE, ServingStatus::Serving)
        .await;
    let mut full = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(DISK_CHECK_INTERVAL) => {}
        }
        let now = gateway.store().disk_full();
        if now.is_some() == full || shutdown.is_cancelled() {
            continue;
        }
        full = now.is_some();
        let status = match &now {
            Some(e) => {
                tracing::error!(error = %e, "health NOT_SERVING: the store's disk is full; reads are served, writes refused");
                ServingStatus::NotServing
            }
            None => {
                tracing::warn!("health SERVING: the store's disk has space again");
                ServingStatus::Serving
            }
        };
        health.set_service_status("", status).await;
        health
            .set_service_status(WRITES_HEALTH_SERVICE, status)
            .await;
    }
    health
        .set_service_status(WRITES_HEALTH_SERVICE, ServingStatus::NotServing)
        .await;
}

/// Binds a plain HTTP listener of sbxd's (`what` names it in the error), and its bound
/// address as text.
async fn bind_plain(
    addr: &str,
    what: &str,
) -> Result<(tokio::net::TcpListener, String), DaemonError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| DaemonError::Setup(format!("cannot listen for {what} on {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| addr.to_string());
    Ok((listener, bound))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addr_file_is_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("addr");
        write_addr_file(&path, "127.0.0.1:1").unwrap();
        write_addr_file(&path, "127.0.0.1:65535").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "127.0.0.1:65535\n");
        // Nothing is left beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1);
    }
}
