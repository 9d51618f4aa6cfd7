//! `sbxd node`: one compute driver served over TCP, with mutual TLS, for gateways on other
//! machines — the driver host of `sbxd driver` with a network listener instead of a Unix
//! socket, and the node service (`sbx.driver.v1.Node`) beside the driver contract.
//!
//! Start: check what `--listen`, `--auth` and the TLS flags ask for together (before anything
//! is bound or opened), read or make the node id, detect the capacity, load the TLS files,
//! open the driver, bind, serve, and write the address file. Shutdown (SIGTERM/SIGINT): stop
//! accepting, let calls in flight finish for a moment, remove the address file; the workloads
//! keep running, and a node started again on the same state dir finds them (and keeps its id).
//!
//! Security: the node has no authentication but mutual TLS — any client with a certificate
//! signed by `--tls-client-ca` is a gateway and may do anything to any sandbox of the node. So
//! the three TLS flags are required unless `--auth none`, which is refused off loopback.
//!
//! The node id (`STATE_DIR/node-id`): a UUID made at the first start and kept, by which a
//! gateway knows that it reached the same node again. A file that holds no UUID is an error,
//! never replaced: a new id would make the gateways take this machine for another node.

use std::collections::{BTreeMap, HashMap};
use std::io::{IsTerminal, Write as _};
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::ValueEnum;
use sbx_drivers::image::IdMap;
use sbx_drivers::pb;
use sbx_drivers::remote::images::NodeImages;
use sbx_drivers::remote::{
    BackendArgs, NodeIdentity, open_backend_with, serve_node, termination_signal,
};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;
use uuid::Uuid;

use super::DaemonError;

/// The file in the state dir that holds the node id.
pub const NODE_ID_FILE: &str = "node-id";

/// `--max-sandboxes` when not given.
pub const DEFAULT_MAX_SANDBOXES: u32 = 1000;

/// The long help of `sbxd node`.
pub const ABOUT: &str = "Serve one compute driver to gateways on other machines: the driver \
    contract (sbx.driver.v1.Driver) and what this node is (sbx.driver.v1.Node: its id, name, \
    labels, capacity and how many sandboxes it holds) over TCP on --listen, with mutual TLS, \
    until SIGTERM or SIGINT.\n\n\
    Every client with a certificate signed by --tls-client-ca may do anything to every \
    sandbox of the node: that is the node's only authentication. `sbxd certs init --dir X \
    --name NODE_ADDRESS --client gateway` makes a CA, the node's certificate and a client \
    certificate for the gateway.\n\n\
    Example: sbxd node --driver process --state-dir /var/lib/sbx/node --listen 0.0.0.0:7443 \
    --tls-cert X/server.pem --tls-key X/server-key.pem --tls-client-ca X/ca.pem --label \
    zone=a\n\n\
    The node keeps its id in STATE_DIR/node-id (made at the first start): a gateway knows by \
    it that it reached the same node again. An oci node keeps an image store of its own \
    (STATE_DIR/images, or --image-store) and fetches an image a create needs and it lacks, \
    by digest, from the image mirror the gateway names (sbxd serve --image-mirror). \
    Shutdown leaves every workload running; a node started again on the same --state-dir \
    finds them and keeps its id. The driver flags are those of `sbxd driver`. Logs go to \
    stderr, filtered by SBX_LOG (else RUST_LOG, else \"info\").";

/// `--auth` of `sbxd node`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NodeAuth {
    /// Mutual TLS: every client presents a certificate signed by --tls-client-ca.
    Mtls,
    /// No client authentication (a loopback --listen only, for tests).
    None,
}

/// The command line of `sbxd node`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    mut_arg("backend", |a| a.long("driver").alias("backend")),
    // Required for every driver (sim too): a required group, as the driver host's own
    // `required_if_eq` on it rules out `required`.
    group(clap::ArgGroup::new("node_state").args(["state_dir"]).required(true)),
    mut_arg("state_dir", |a| a
        .help("Where the node keeps its id (STATE_DIR/node-id) and its driver its sandboxes \
               (one live node per directory); its file system's size is the default disk \
               capacity")),
    mut_arg("image_store", |a| a
        .help("The node's own image store, which the oci driver runs images from and the \
               node fills from the image mirror a gateway's create names (sbxd serve \
               --image-mirror): written by this node alone, never a gateway's DATA/images \
               [default: STATE_DIR/images]")),
)]
pub struct NodeArgs {
    /// Where to listen: HOST:PORT (port 0 picks a free port; see --addr-file). Off a
    /// loopback address the node needs mutual TLS (--tls-cert, --tls-key, --tls-client-ca).
    #[arg(long, value_name = "HOST:PORT")]
    pub listen: String,

    /// Once serving, write the bound HOST:PORT and a newline to this file, atomically
    /// (written beside it, then renamed). A file left by an earlier run is removed at start,
    /// and this one on a clean shutdown.
    #[arg(long, value_name = "PATH")]
    pub addr_file: Option<PathBuf>,

    /// Serve Prometheus metrics (OpenMetrics text) at http://HOST:PORT/metrics: the calls the
    /// node fenced, calls under one token from two gateways, the sandboxes it holds. Off
    /// unless given; a loopback address only (no authentication). Port 0 picks a free port
    /// (see --metrics-addr-file).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,

    /// Write the metrics listener's bound address (host:port) to this file once serving.
    #[arg(long, value_name = "PATH", requires = "metrics_listen")]
    pub metrics_addr_file: Option<PathBuf>,

    /// Who may call: `mtls` (every client presents a certificate signed by
    /// --tls-client-ca; needs the three --tls-* flags) or `none` (anyone who reaches the
    /// address: accepted on a loopback --listen only, for tests, with a warning; TLS without
    /// client certificates if --tls-cert and --tls-key are given).
    #[arg(long, value_enum, default_value_t = NodeAuth::Mtls)]
    pub auth: NodeAuth,

    /// TLS: the node's certificate chain (PEM), valid for the address gateways dial
    /// (`sbxd certs init --name ADDRESS` makes one: server.pem).
    #[arg(long, value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,

    /// TLS: the private key of --tls-cert (PEM; server-key.pem).
    #[arg(long, value_name = "PEM")]
    pub tls_key: Option<PathBuf>,

    /// Mutual TLS: the CA (PEM) that signed the gateways' client certificates (ca.pem);
    /// a client without such a certificate fails its TLS handshake.
    #[arg(long, value_name = "PEM")]
    pub tls_client_ca: Option<PathBuf>,

    /// The node's name as it reports it to gateways (default: this machine's host name).
    /// Gateways register a node under a name of their own; this one is for people.
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,

    /// A label of the node, KEY=VALUE, for placement (a sandbox's node selector); repeat for
    /// more. Keys: letters, digits, '-', '_', '.', '/'; values: letters, digits, '-', '_',
    /// '.' (as the gateway's labels).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,

    /// The CPU the node offers sandboxes: cores (2, 0.5) or millicores (1500m). Default: the
    /// machine's CPUs.
    #[arg(long, value_name = "CPUS", value_parser = sbx_proto::quantity::cpu_arg)]
    pub capacity_cpu: Option<u32>,

    /// The memory the node offers sandboxes (64Gi, 512Mi, …). Default: the machine's memory
    /// (MemTotal in /proc/meminfo).
    #[arg(long, value_name = "SIZE", value_parser = sbx_proto::quantity::size_arg)]
    pub capacity_memory: Option<u64>,

    /// The disk the node offers sandboxes (500Gi, 2T, …). Default: the size of the file
    /// system that holds --state-dir.
    #[arg(long, value_name = "SIZE", value_parser = sbx_proto::quantity::size_arg)]
    pub capacity_disk: Option<u64>,

    /// The static busybox an oci node makes the built-in default image from at start, as a
    /// gateway does (default: /bin/busybox, else /usr/bin/busybox; env SBX_BUSYBOX): the same
    /// busybox gives the same image digest, so a create of the default image needs no mirror.
    #[arg(
        id = "image_busybox",
        long = "busybox",
        env = "SBX_BUSYBOX",
        value_name = "PATH"
    )]
    pub busybox: Option<PathBuf>,

    /// The most sandboxes the node takes.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_SANDBOXES,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_sandboxes: u32,

    /// The driver and its settings: the flags of `sbxd driver` but --socket (and --backend
    /// spelled --driver). Last, so that the node's own flags come first in --help.
    #[command(flatten)]
    pub driver: BackendArgs,
}

/// Makes the built-in default image in the node's store from its static busybox, as a
/// gateway makes it in its own (deterministic: the same busybox, the same digest). A node
/// without one, or whose store refuses it, says so and serves on: images from a mirror still
/// run.
async fn make_builtin_image(
    store: &sbx_drivers::image::ImageStore,
    busybox: Option<&std::path::Path>,
) {
    let busybox = match sbx_drivers::find_static_busybox(busybox, &sbx_drivers::BUSYBOX_PATHS) {
        Ok(path) => path,
        Err(why) => {
            tracing::warn!(
                image = sbx_actors::DEFAULT_IMAGE,
                "the built-in image is not made here ({why}): its creates need an image mirror; install busybox-static or pass --busybox"
            );
            return;
        }
    };
    let (store, from) = (store.clone(), busybox.clone());
    let made =
        tokio::task::spawn_blocking(move || store.import_busybox(&from, sbx_actors::DEFAULT_IMAGE))
            .await;
    match made {
        Ok(Ok(info)) => {
            tracing::info!(image = sbx_actors::DEFAULT_IMAGE, digest = %info.digest, busybox = %busybox.display(), "built the default image");
        }
        Ok(Err(e)) => {
            tracing::warn!(
                image = sbx_actors::DEFAULT_IMAGE,
                "the built-in image is not made here: {e}"
            );
        }
        Err(e) => tracing::warn!("the built-in image's task: {e}"),
    }
}

/// `--label KEY=VALUE` (clap's value parser), checked by the gateway's own label rules.
pub fn parse_label(text: &str) -> Result<(String, String), String> {
    let Some((key, value)) = text.split_once('=') else {
        return Err("expected KEY=VALUE, e.g. zone=a".to_string());
    };
    let one = BTreeMap::from([(key.to_string(), value.to_string())]);
    sbx_storage::validate_labels(&one).map_err(|e| e.to_string())?;
    Ok((key.to_string(), value.to_string()))
}

/// The labels, each key once.
fn labels(pairs: &[(String, String)]) -> Result<HashMap<String, String>, DaemonError> {
    let mut labels = HashMap::new();
    for (key, value) in pairs {
        if let Some(before) = labels.insert(key.clone(), value.clone()) {
            return Err(DaemonError::Setup(format!(
                "--label {key}: given twice ({key}={before} and {key}={value})"
            )));
        }
    }
    Ok(labels)
}

/// The node's name: `--name`, else the host name. Printable, no blanks, at most 253 bytes.
fn node_name(name: Option<&str>) -> Result<String, DaemonError> {
    let name = match name {
        Some(name) => name.to_string(),
        None => nix::unistd::gethostname()
            .map_err(|e| {
                DaemonError::Setup(format!("cannot read the host name ({e}): pass --name"))
            })?
            .to_string_lossy()
            .into_owned(),
    };
    if name.is_empty() || name.len() > 253 || name.chars().any(|c| c.is_control() || c == ' ') {
        return Err(DaemonError::Setup(format!(
            "--name {name:?}: a node's name is 1 to 253 printable characters without blanks"
        )));
    }
    Ok(name)
}

/// What the security flags come to, checked before anything is bound.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Security {
    /// Plain TCP, no client authentication (`--auth none`, loopback).
    Plain,
    /// TLS; with a client CA, mutual.
    Tls {
        cert: PathBuf,
        key: PathBuf,
        client_ca: Option<PathBuf>,
    },
}

/// Checks `--auth` and the TLS flags against `--listen`, whose resolved addresses are
/// `resolved` (all loopback or not): see the module docs.
fn check_security(args: &NodeArgs, loopback: bool) -> Result<Security, DaemonError> {
    let refuse = |why: String| Err(DaemonError::Security(why));
    let listen = &args.listen;
    let given = |flag: &Option<PathBuf>| flag.clone();
    let (cert, key, ca) = (
        given(&args.tls_cert),
        given(&args.tls_key),
        given(&args.tls_client_ca),
    );
    match args.auth {
        NodeAuth::None => {
            if !loopback {
                return refuse(format!(
                    "--auth none is accepted on a loopback address only (for tests), not on \
                     --listen {listen}: off loopback the node needs mutual TLS (--tls-cert, \
                     --tls-key, --tls-client-ca)"
                ));
            }
            if ca.is_some() {
                return refuse(
                    "--tls-client-ca asks for client certificates and --auth none for none: \
                     drop one of them"
                        .to_string(),
                );
            }
            match (cert, key) {
                (None, None) => Ok(Security::Plain),
                (Some(cert), Some(key)) => Ok(Security::Tls {
                    cert,
                    key,
                    client_ca: None,
                }),
                (Some(_), None) => refuse("--tls-cert needs --tls-key".to_string()),
                (None, Some(_)) => refuse("--tls-key needs --tls-cert".to_string()),
            }
        }
        NodeAuth::Mtls => match (cert, key, ca) {
            (Some(cert), Some(key), Some(ca)) => Ok(Security::Tls {
                cert,
                key,
                client_ca: Some(ca),
            }),
            (cert, key, ca) => {
                let missing: Vec<&str> = [
                    ("--tls-cert", cert.is_none()),
                    ("--tls-key", key.is_none()),
                    ("--tls-client-ca", ca.is_none()),
                ]
                .into_iter()
                .filter_map(|(flag, absent)| absent.then_some(flag))
                .collect();
                let missing = missing.join(", ");
                let instead = if loopback {
                    ", or --auth none (loopback only, for tests)"
                } else {
                    ""
                };
                let off_loopback = if loopback {
                    String::new()
                } else {
                    format!("--listen {listen} is not a loopback address: ")
                };
                refuse(format!(
                    "{off_loopback}the node has no authentication but mutual TLS, so it needs \
                     --tls-cert, --tls-key and --tls-client-ca (missing: {missing}){instead}; \
                     `sbxd certs init --name ADDRESS --client gateway` makes them"
                ))
            }
        },
    }
}

/// Whether every address `listen` resolves to is a loopback address (resolved, not bound).
async fn resolves_to_loopback(listen: &str) -> Result<bool, DaemonError> {
    let bad = |source: std::io::Error| DaemonError::Bind {
        addr: listen.to_string(),
        source,
    };
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(listen)
        .await
        .map_err(bad)?
        .collect();
    if addrs.is_empty() {
        return Err(bad(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "the name resolves to no address",
        )));
    }
    Ok(addrs.iter().all(|a| a.ip().is_loopback()))
}

/// The node id in `state_dir` (made, mode 0600, when there is none). See the module docs.
pub fn node_id(state_dir: &Path) -> Result<Uuid, DaemonError> {
    let path = state_dir.join(NODE_ID_FILE);
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| DaemonError::Io { what, path, source }
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => return parse_node_id(&path, &text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(io("cannot read the node id", &path)(source)),
    }
    std::fs::create_dir_all(state_dir).map_err(io("cannot create the state dir", state_dir))?;
    let id = Uuid::new_v4();
    // Written whole beside it, then linked into place: a crash leaves no partial id, and of
    // two nodes started at once on the same directory the second takes the first one's id.
    let temporary = state_dir.join(format!(".{NODE_ID_FILE}.tmp-{}", Uuid::new_v4().simple()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temporary)
        .and_then(|mut file| {
            file.write_all(format!("{id}\n").as_bytes())?;
            file.sync_all()
        })
        .map_err(io("cannot write the node id to", &temporary));
    let placed = written.and_then(|()| match std::fs::hard_link(&temporary, &path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(source) => Err(io("cannot put the node id at", &path)(source)),
    });
    let _ = std::fs::remove_file(&temporary);
    if !placed? {
        let text = std::fs::read_to_string(&path).map_err(io("cannot read the node id", &path))?;
        return parse_node_id(&path, &text);
    }
    std::fs::File::open(state_dir)
        .and_then(|dir| dir.sync_all())
        .map_err(io("cannot sync the state dir", state_dir))?;
    tracing::info!(node_id = %id, path = %path.display(), "made the node id");
    Ok(id)
}

fn parse_node_id(path: &Path, text: &str) -> Result<Uuid, DaemonError> {
    let trimmed = text.trim_end_matches('\n');
    match Uuid::try_parse(trimmed) {
        Ok(id) if !id.is_nil() && trimmed.len() == 36 => Ok(id),
        _ => Err(DaemonError::Setup(format!(
            "the node id file {} holds {:?}, not a node id (a UUID, \
             xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx in hex digits, on a line): put the node's \
             id back in it (gateways know the node by it), or remove the file to make this a \
             new node",
            path.display(),
            trimmed.chars().take(64).collect::<String>(),
        ))),
    }
}

/// The capacity: the flags where given, else what this machine has.
fn capacity(args: &NodeArgs, state_dir: &Path) -> Result<pb::Capacity, DaemonError> {
    let cpu_millicores = match args.capacity_cpu {
        Some(millis) => u64::from(millis),
        None => std::thread::available_parallelism()
            .map(|n| n.get() as u64 * 1000)
            .map_err(|e| {
                DaemonError::Setup(format!("cannot count the CPUs ({e}): pass --capacity-cpu"))
            })?,
    };
    let memory_bytes = match args.capacity_memory {
        Some(bytes) => bytes,
        None => std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|text| mem_total(&text))
            .ok_or_else(|| {
                DaemonError::Setup(
                    "cannot read MemTotal in /proc/meminfo: pass --capacity-memory".to_string(),
                )
            })?,
    };
    let disk_bytes = match args.capacity_disk {
        Some(bytes) => bytes,
        None => nix::sys::statvfs::statvfs(state_dir)
            .map(|fs| fs.blocks().saturating_mul(fs.fragment_size()))
            .map_err(|e| {
                DaemonError::Setup(format!(
                    "cannot size the file system of {} ({e}): pass --capacity-disk",
                    state_dir.display()
                ))
            })?,
    };
    Ok(pb::Capacity {
        cpu_millicores,
        memory_bytes,
        disk_bytes,
        max_sandboxes: args.max_sandboxes,
    })
}

/// MemTotal of /proc/meminfo's text, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => kib.checked_mul(1024),
        _ => None,
    }
}

/// Removes an address file left by an earlier run (a missing one is fine).
fn remove_stale_addr_file(path: &Path) -> Result<(), DaemonError> {
    match std::fs::remove_file(path) {
        Ok(()) => {
            tracing::info!(path = %path.display(), "removed a stale address file");
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DaemonError::Io {
            what: "cannot remove the stale address file",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Log lines to stderr, filtered by SBX_LOG, else RUST_LOG, else "info".
fn init_logging() {
    let filter = ["SBX_LOG", "RUST_LOG"]
        .into_iter()
        .filter_map(|name| std::env::var(name).ok())
        .find(|s| !s.is_empty())
        .unwrap_or_else(|| "info".to_string());
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("warning: bad log filter {filter:?} ({e}); using \"info\"");
        EnvFilter::new("info")
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        // As sbxd serve's: a failed log write loses that line, never the call that logged.
        .log_internal_errors(false)
        .try_init();
}

/// `sbxd node`: serves the driver and the node service on `--listen` until SIGTERM or SIGINT.
pub async fn run(args: NodeArgs) -> Result<(), DaemonError> {
    init_logging();
    if let Some(path) = &args.addr_file {
        remove_stale_addr_file(path)?;
    }
    // Refused before anything is bound or opened.
    let loopback = resolves_to_loopback(&args.listen).await?;
    let security = check_security(&args, loopback)?;
    let labels = labels(&args.labels)?;
    let name = node_name(args.name.as_deref())?;
    let Some(state_dir) = args.driver.state_dir.clone() else {
        return Err(DaemonError::Setup(
            "sbxd node needs --state-dir".to_string(),
        ));
    };
    let node_id = node_id(&state_dir)?;
    let capacity = capacity(&args, &state_dir)?;
    let tls = match &security {
        Security::Plain => None,
        Security::Tls {
            cert,
            key,
            client_ca,
        } => Some(
            crate::tls::server_config(cert, key, client_ca.as_deref())
                .map_err(|e| DaemonError::Security(e.to_string()))?,
        ),
    };
    if args.auth == NodeAuth::None {
        tracing::warn!(
            listen = %args.listen,
            "--auth none: whoever reaches this address may do anything to every sandbox of \
             this node (for tests on this machine only)"
        );
    }
    // Installed before the driver opens, so that a signal during startup is not lost.
    let shutdown = termination_signal().map_err(DaemonError::DriverHost)?;
    let backend = args.driver.backend;
    tracing::info!(driver = backend.name, %node_id, %name, ?capacity, "node starting");
    let driver_error = |source| DaemonError::Driver {
        driver: backend.name,
        source,
        hint: backend.hint,
    };
    // An oci node's own image store, filled from the image mirror its creates name.
    let images = match backend.needs_images {
        true => {
            let root = args
                .driver
                .image_store
                .clone()
                .unwrap_or_else(|| state_dir.join("images"));
            let images = NodeImages::open(root, IdMap::default()).map_err(driver_error)?;
            tracing::info!(store = %images.store().root().display(), "the node's image store");
            make_builtin_image(images.store(), args.busybox.as_deref()).await;
            Some(Arc::new(images))
        }
        false => None,
    };
    let driver = open_backend_with(&args.driver, images.as_ref().map(|i| i.store().clone()))
        .await
        .map_err(driver_error)?;
    let listener = TcpListener::bind(&args.listen)
        .await
        .map_err(|source| DaemonError::Bind {
            addr: args.listen.clone(),
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| DaemonError::Bind {
        addr: args.listen.clone(),
        source,
    })?;
    if args.auth == NodeAuth::None && !bound.ip().is_loopback() {
        // The name resolved to loopback a moment ago and was bound elsewhere: refuse still.
        return Err(DaemonError::Security(format!(
            "--auth none is accepted on a loopback address only; {} was bound at {bound}",
            args.listen
        )));
    }
    let identity = NodeIdentity {
        node_id: node_id.to_string(),
        name,
        version: env!("CARGO_PKG_VERSION").to_string(),
        drivers: vec![backend.name.to_string()],
        labels,
        capacity,
    };
    let fences =
        sbx_drivers::remote::fence::Fences::open(&state_dir.join("fences")).map_err(|e| {
            DaemonError::Setup(format!("the node's fences in {}: {e}", state_dir.display()))
        })?;
    let metrics_stop = tokio_util::sync::CancellationToken::new();
    let _stop_metrics = metrics_stop.clone().drop_guard();
    if let Some(addr) = &args.metrics_listen {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| DaemonError::Setup(format!("cannot listen for metrics on {addr}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| DaemonError::Setup(format!("the metrics listener: {e}")))?;
        super::metrics::check_listen(&local).map_err(DaemonError::Setup)?;
        let render = node_metrics(Arc::clone(&driver), Arc::clone(&fences));
        tokio::spawn(super::metrics::serve(
            listener,
            super::connections::Limits::default(),
            render,
            metrics_stop.clone(),
        ));
        if let Some(path) = &args.metrics_addr_file {
            super::serve::write_addr_file(path, &local.to_string())?;
        }
        tracing::info!(bound = %local, "serving metrics at /metrics");
    }
    let serving = tokio::spawn(serve_node(
        Arc::clone(&driver),
        identity,
        fences,
        images,
        listener,
        tls,
        shutdown,
    ));
    if let Some(path) = &args.addr_file
        && let Err(e) = super::serve::write_addr_file(path, &bound.to_string())
    {
        serving.abort();
        return Err(e);
    }
    tracing::info!(%bound, %node_id, driver = backend.name, "node serving");
    let served = serving.await;
    if let Some(path) = &args.addr_file {
        let _ = std::fs::remove_file(path);
    }
    drop(driver);
    match served {
        Ok(result) => result.map_err(DaemonError::DriverHost)?,
        Err(e) => {
            return Err(DaemonError::DriverHost(sbx_drivers::DriverError::Internal(
                format!("the node's server task: {e}"),
            )));
        }
    }
    tracing::info!("node stopped; workloads left running");
    Ok(())
}

/// The node's exposition: the calls it fenced and those under one token from two gateways
/// (counters that follow the fences' own counts), the sandboxes its driver holds (read at each
/// scrape), the version.
fn node_metrics(
    driver: Arc<dyn sbx_drivers::ComputeDriver>,
    fences: Arc<sbx_drivers::remote::fence::Fences>,
) -> super::metrics::Render {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;
    let mut registry = Registry::with_prefix("sbx_node");
    let fenced: Counter = Counter::default();
    registry.register(
        "fenced_calls",
        "Driver calls refused because their fencing token was older than the newest seen for \
         their workspace (a former holder's), since the node started",
        fenced.clone(),
    );
    let conflicts: Counter = Counter::default();
    registry.register(
        "token_conflicts",
        "Driver calls admitted under a workspace's token from a gateway other than the first \
         that called under it (never, unless leases failed), since the node started",
        conflicts.clone(),
    );
    let sandboxes: Gauge = Gauge::default();
    registry.register(
        "sandboxes",
        "Sandboxes the node's driver holds (read at each scrape)",
        sandboxes.clone(),
    );
    let build = Family::<Vec<(String, String)>, Gauge>::default();
    build
        .get_or_create(&vec![(
            "version".to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        )])
        .set(1);
    registry.register("build_info", "The sbx version serving (always 1)", build);
    let registry = Arc::new(std::sync::Mutex::new(registry));
    Arc::new(move || {
        let (driver, fences, registry) = (
            Arc::clone(&driver),
            Arc::clone(&fences),
            Arc::clone(&registry),
        );
        let (fenced, conflicts, sandboxes) = (fenced.clone(), conflicts.clone(), sandboxes.clone());
        Box::pin(async move {
            fenced.inc_by(fences.refused().saturating_sub(fenced.get()));
            conflicts.inc_by(fences.conflicts().saturating_sub(conflicts.get()));
            match driver.list().await {
                Ok(list) => {
                    sandboxes.set(list.len() as i64);
                }
                Err(e) => tracing::warn!("metrics: cannot list the driver's sandboxes: {e}"),
            }
            let mut out = String::new();
            let registry = registry.lock().unwrap_or_else(|p| p.into_inner());
            let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
            out
        })
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Node {
        #[command(flatten)]
        node: NodeArgs,
    }

    fn node_args(args: &[&str]) -> Result<NodeArgs, clap::Error> {
        Node::try_parse_from(std::iter::once("node").chain(args.iter().copied())).map(|n| n.node)
    }

    const BASE: [&str; 6] = [
        "--driver",
        "sim",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        "/d",
    ];

    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        BASE.iter().chain(extra).copied().collect()
    }

    #[test]
    fn the_command_line_parses_and_takes_the_driver_flags() {
        use clap::CommandFactory;
        Node::command().debug_assert();
        // The whole of sbxd's command line, `sbxd driver` (which shares the driver's flags)
        // and `sbxd node` included.
        super::super::Sbxd::command().debug_assert();
        let args = node_args(&with(&[
            "--label",
            "zone=a",
            "--label",
            "tier=gold",
            "--capacity-cpu",
            "1500m",
            "--capacity-memory",
            "2Gi",
            "--max-sandboxes",
            "7",
            "--poll-interval-ms",
            "50",
        ]))
        .unwrap();
        assert_eq!(args.driver.backend.name, "sim");
        assert_eq!(args.driver.poll_interval_ms, 50);
        assert_eq!(args.capacity_cpu, Some(1500));
        assert_eq!(args.capacity_memory, Some(2 << 30));
        assert_eq!(args.max_sandboxes, 7);
        assert_eq!(args.auth, NodeAuth::Mtls);
        assert_eq!(labels(&args.labels).unwrap().len(), 2);
        // --backend is the driver host's spelling of --driver.
        let args =
            node_args(&["--backend", "sim", "--listen", "x:1", "--state-dir", "/d"]).unwrap();
        assert_eq!(args.driver.backend.name, "sim");
        // No --socket, and --state-dir and --listen are required, even for sim.
        let err = node_args(&with(&["--socket", "/s"])).unwrap_err();
        assert!(err.to_string().contains("--socket"), "{err}");
        let err = node_args(&["--driver", "sim", "--listen", "127.0.0.1:0"]).unwrap_err();
        assert!(err.to_string().contains("--state-dir"), "{err}");
        let err = node_args(&["--driver", "sim", "--state-dir", "/d"]).unwrap_err();
        assert!(err.to_string().contains("--listen"), "{err}");
        // An oci node needs no --image-store: it keeps its own (STATE_DIR/images).
        let oci = node_args(&["--driver", "oci", "--listen", "x:1", "--state-dir", "/d"]).unwrap();
        assert_eq!(oci.driver.image_store, None);
    }

    #[test]
    fn labels_follow_the_gateways_rules_and_come_once() {
        assert_eq!(
            parse_label("zone=eu-1"),
            Ok(("zone".to_string(), "eu-1".to_string()))
        );
        assert_eq!(parse_label("k="), Ok(("k".to_string(), String::new())));
        for bad in ["zone", "=a", "zo ne=a", "zone=a/b", "zone=a=b"] {
            assert!(parse_label(bad).is_err(), "{bad}");
        }
        let err = node_args(&with(&["--label", "zone"])).unwrap_err();
        assert!(err.to_string().contains("--label"), "{err}");
        let twice = [("a".into(), "1".into()), ("a".into(), "2".into())];
        let err = labels(&twice).unwrap_err().to_string();
        assert!(err.contains("--label a") && err.contains("twice"), "{err}");
    }

    #[test]
    fn security_needs_mutual_tls_unless_none_on_loopback() {
        let check = |extra: &[&str], loopback: bool| {
            check_security(&node_args(&with(extra)).unwrap(), loopback)
        };
        let tls = ["--tls-cert", "c", "--tls-key", "k", "--tls-client-ca", "ca"];
        assert!(matches!(
            check(&tls, false),
            Ok(Security::Tls {
                client_ca: Some(_),
                ..
            })
        ));
        assert_eq!(check(&["--auth", "none"], true).unwrap(), Security::Plain);
        assert!(matches!(
            check(
                &["--auth", "none", "--tls-cert", "c", "--tls-key", "k"],
                true
            ),
            Ok(Security::Tls {
                client_ca: None,
                ..
            })
        ));
        for (extra, loopback, mentions) in [
            (&["--auth", "none"][..], false, "--auth none"),
            (&[][..], false, "--tls-cert, --tls-key, --tls-client-ca"),
            (&[][..], true, "--auth none (loopback only"),
            (&tls[..4], false, "missing: --tls-client-ca"),
            (
                &["--auth", "none", "--tls-client-ca", "ca"][..],
                true,
                "--tls-client-ca",
            ),
            (
                &["--auth", "none", "--tls-cert", "c"][..],
                true,
                "--tls-key",
            ),
        ] {
            let err = check(extra, loopback).unwrap_err().to_string();
            assert!(err.contains(mentions), "{extra:?}: {err}");
        }
        let err = check(&[], false).unwrap_err().to_string();
        assert!(err.contains("not a loopback address"), "{err}");
    }

    #[test]
    fn the_node_id_is_made_once_and_kept() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let id = node_id(&state).unwrap();
        assert_eq!(node_id(&state).unwrap(), id);
        let path = state.join(NODE_ID_FILE);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{id}\n"));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // Nothing is left beside it.
        assert_eq!(std::fs::read_dir(&state).unwrap().count(), 1);
        for bad in [
            String::new(),
            "node-1\n".to_string(),
            format!("{}\n", Uuid::nil()),
            format!("{id}x\n"),
            id.simple().to_string(),
        ] {
            std::fs::write(&path, &bad).unwrap();
            let err = node_id(&state).unwrap_err().to_string();
            assert!(err.contains(&path.display().to_string()), "{bad:?}: {err}");
            assert_eq!(
                std::fs::read_to_string(&path).unwrap(),
                bad,
                "never replaced"
            );
        }
    }

    #[test]
    fn capacity_is_detected_unless_given() {
        let dir = tempfile::tempdir().unwrap();
        let args = node_args(&BASE).unwrap();
        let detected = capacity(&args, dir.path()).unwrap();
        assert!(detected.cpu_millicores >= 1000, "{detected:?}");
        assert!(
            detected.memory_bytes > 0 && detected.disk_bytes > 0,
            "{detected:?}"
        );
        assert_eq!(detected.max_sandboxes, DEFAULT_MAX_SANDBOXES);
        let args = node_args(&with(&[
            "--capacity-cpu",
            "2",
            "--capacity-memory",
            "1Gi",
            "--capacity-disk",
            "10G",
        ]))
        .unwrap();
        let given = capacity(&args, Path::new("/nonexistent")).unwrap();
        assert_eq!(
            (given.cpu_millicores, given.memory_bytes, given.disk_bytes),
            (2000, 1 << 30, 10_000_000_000)
        );
        assert_eq!(
            mem_total("MemFree: 1 kB\nMemTotal:  2048 kB\n"),
            Some(2 << 20)
        );
        assert_eq!(mem_total("MemTotal: lots\n"), None);
    }
}
