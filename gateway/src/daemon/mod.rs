//! `sbxd`, the gateway daemon: command line, driver and store setup, serving and shutdown.
//!
//! Layout: this module holds the clap types and the daemon's error; [`drivers`] opens the
//! chosen compute driver ([`driver_spec`] parses `--driver`, [`managed`] runs a driver as a
//! supervised child process); [`serve`] runs the gRPC server over the actor tree until a signal.

pub mod access;
mod backup;
pub mod certs;
pub mod connections;
pub mod driver_spec;
pub mod drivers;
pub mod forward;
pub mod h2_authority;
pub mod images;
pub mod managed;
pub mod metrics;
pub mod node;
pub mod node_link;
pub mod serve;
pub mod store;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use sbx_actors::ActorError;
use sbx_drivers::DriverError;
use sbx_drivers::process::ProcessArgs;
use sbx_drivers::registry::DriverArgs;
use sbx_drivers::registry::DriverFactory;
use sbx_storage::StoreError;

pub use driver_spec::DriverSpec;
pub use serve::serve;

/// The Unix socket sbxd listens on, in its data directory, unless `--socket` says otherwise.
pub const SOCKET_NAME: &str = "sbxd.sock";

/// Parses the arguments, runs the command, and returns the exit code: 0 after a clean
/// shutdown, 1 when sbxd could not start or failed while serving, 2 on a usage error.
pub fn main() -> std::process::ExitCode {
    let cli = match Sbxd::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            return std::process::ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(1));
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let result = match cli.command {
        Command::Serve(args) => runtime.block_on(serve(args)),
        Command::Driver(args) => runtime.block_on(serve::run_driver(args)),
        Command::Node(args) => runtime.block_on(node::run(args)),
        Command::Token(command) => return access::run_token(command),
        Command::Certs(command) => return access::run_certs(command),
        Command::Store(command) => return access::run_store(command),
        Command::Network(NetworkCommand::Cleanup(args)) => return network_cleanup(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "sbxd failed");
            eprintln!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

/// The `sbxd` command line.
#[derive(Debug, Parser)]
#[command(
    name = "sbxd",
    version,
    about = "The sbx sandbox gateway daemon",
    long_about = "The sbx sandbox gateway daemon: serves the sbx.v1 gRPC API (workspaces and \
        sandboxes), gRPC health and reflection, over a supervision tree of actors that keeps \
        an embedded store in step with a compute driver.\n\n\
        Every flag has an SBX_* environment variable; the flag wins over the variable. Logs go \
        to stderr, filtered by SBX_LOG (else RUST_LOG, else \"info\"), e.g. SBX_LOG=sbx_actors=debug."
)]
pub struct Sbxd {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
// Parsed once per process: boxing `serve`'s many flags would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Serve the gateway until SIGTERM or SIGINT. Shutdown stops accepting calls, lets the
    /// calls in flight finish (up to --shutdown-grace), stops the actors and closes the store
    /// — and leaves every sandbox running, to be re-attached by the next start.
    Serve(ServeArgs),
    /// Serve one compute driver (process, sim or vm) over the sbx.driver.v1 gRPC contract on
    /// a Unix socket, until SIGTERM or SIGINT, for an `sbxd serve --driver remote:SOCKET` to
    /// use. `sbxd serve --driver managed:BACKEND` runs this itself. Shutdown leaves every
    /// workload running; a driver started again on the same --state-dir finds them.
    #[command(
        long_about = "Serve one compute driver over the sbx.driver.v1 gRPC contract on a Unix \
            socket (mode 0600), until SIGTERM or SIGINT, for `sbxd serve --driver \
            remote:SOCKET` to use.\n\n\
            Example: sbxd driver --backend process --socket /run/sbx/process.sock \
            --state-dir /var/lib/sbx/drivers/process\n\n\
            Example: sbxd driver --backend vm --vm-accel tcg --socket /run/sbx/vm.sock \
            --state-dir /var/lib/sbx/drivers/vm\n\n\
            Shutdown leaves every workload running (processes live in their own sessions, \
            QEMU runs daemonized); a driver started again on the same --state-dir finds them. \
            Only one process or vm driver may use a state directory at a time. The --vm-* \
            flags (and their SBX_VM_* variables) are those of `sbxd serve`. Logs go to stderr, \
            filtered by SBX_LOG (else RUST_LOG, else \"info\")."
    )]
    Driver(sbx_drivers::remote::DriverHostArgs),
    /// Serve one compute driver to gateways on other machines: the driver contract and the
    /// node service (its id, name, labels, capacity) over TCP with mutual TLS, until SIGTERM
    /// or SIGINT. Shutdown leaves every workload running.
    #[command(long_about = node::ABOUT)]
    Node(node::NodeArgs),
    /// Identities and their bearer tokens: create (prints the token, once), list (no
    /// secrets), revoke (effective at the next call, and open streams end within a second).
    /// Works while sbxd runs on the same data dir: the identities are a file of their own.
    #[command(subcommand)]
    Token(access::TokenCommand),
    /// Certificates for TLS and mutual TLS, for operators without a PKI of their own.
    #[command(subcommand)]
    Certs(access::CertsCommand),
    /// The store: check it against its high-water mark and its indexes, back it up to a file,
    /// restore it from one (while sbxd is not running on it).
    #[command(subcommand)]
    Store(access::StoreCommand),
    /// The sandbox network's leftovers on this host.
    #[command(subcommand)]
    Network(NetworkCommand),
}

/// `sbxd network …`.
#[derive(Debug, Subcommand)]
pub enum NetworkCommand {
    /// Remove the sandbox network's bridge (<NAME>0) and nftables table (`inet <NAME>`) once
    /// no sbxd uses them: refused while a resolver still answers on the bridge (an sbxd or
    /// its driver serves the network), and while sandbox namespaces of it remain (their
    /// workloads outlive sbxd) unless --force.
    Cleanup(NetworkCleanupArgs),
}

#[derive(Debug, Args)]
pub struct NetworkCleanupArgs {
    /// The network's name, as `sbxd serve --network-name` gave it.
    #[arg(
        long,
        env = "SBX_NETWORK_NAME",
        default_value = "sbx",
        value_name = "NAME"
    )]
    pub network_name: String,
    /// Also delete the sandbox namespaces that remain (their sandboxes lose their network).
    #[arg(long)]
    pub force: bool,
}

/// `sbxd network cleanup`: says what it removed (or that nothing was there); exit 2 when
/// refused.
fn network_cleanup(args: &NetworkCleanupArgs) -> std::process::ExitCode {
    use std::process::ExitCode;
    match sbx_drivers::network::cleanup(&args.network_name, args.force) {
        Ok(done) => {
            let mut said = Vec::new();
            if done.table {
                said.push(format!("nftables table inet {}", args.network_name));
            }
            if done.bridge {
                said.push(format!("bridge {}0", args.network_name));
            }
            if !done.namespaces.is_empty() {
                said.push(format!("{} sandbox namespace(s)", done.namespaces.len()));
            }
            if said.is_empty() {
                println!(
                    "network {:?}: nothing of it is on this host",
                    args.network_name
                );
            } else {
                println!(
                    "network {:?}: removed {}",
                    args.network_name,
                    said.join(", ")
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// `--data-dir` of the offline commands (`sbxd store …`, `sbxd token …`).
#[derive(Debug, Args)]
pub struct DataDirArg {
    /// The data directory of the gateway (default as for `sbxd serve`).
    #[arg(long, env = "SBX_DATA_DIR", value_name = "DATA")]
    pub data_dir: Option<PathBuf>,
}

/// The compute driver sandboxes run on: a row of the drivers' registry
/// ([`sbx_drivers::registry::DRIVERS`]), which says what each is and needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverKind(&'static DriverFactory);

impl DriverKind {
    /// The driver registered as `name`, if there is one.
    pub fn named(name: &str) -> Option<DriverKind> {
        sbx_drivers::registry::driver(name).map(DriverKind)
    }

    /// The name the driver is registered under (the `spec.driver` of its sandboxes).
    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// Its row in the registry: how it is opened, and what a driver host of it is given.
    pub fn factory(self) -> &'static DriverFactory {
        self.0
    }
}

/// `--auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AuthMode {
    /// Every call needs a credential.
    Token,
    /// No credential needed (Unix socket or loopback only).
    None,
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Pretty,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Also serve gRPC on TCP at host:port (the Unix socket stays, for the local admin, unless
    /// --no-socket). Port 0 picks a free port (see --addr-file, which then names it). An
    /// address that is not loopback needs TLS (--tls-cert, --tls-key).
    #[arg(long, env = "SBX_LISTEN", value_name = "HOST:PORT")]
    pub listen: Option<String>,

    /// With --listen: serve on TCP only, without the Unix socket.
    #[arg(long, requires = "listen")]
    pub no_socket: bool,

    /// The Unix socket to serve on (mode 0600, or 0660 with --socket-group). Default:
    /// DATA/sbxd.sock. The uid sbxd runs as is a gateway-wide admin there; other callers need
    /// a token.
    #[arg(long, env = "SBX_SOCKET", value_name = "PATH")]
    pub socket: Option<PathBuf>,

    /// Also let this group connect to the Unix socket (mode 0660). Its members still need a
    /// token.
    #[arg(long, env = "SBX_SOCKET_GROUP", value_name = "GROUP")]
    pub socket_group: Option<String>,

    /// Who may call: `token` (the default: a bearer token or a client certificate of an
    /// identity made with `sbxd token create`, or the socket's owner), or `none` (every caller
    /// is a gateway-wide admin; accepted on the Unix socket or a loopback address only, for
    /// scripts and tests, with a warning).
    #[arg(long, env = "SBX_AUTH", value_enum, default_value_t = AuthMode::Token)]
    pub auth: AuthMode,

    /// TLS: the server's certificate chain (PEM), with --tls-key. `sbxd certs init` makes one.
    #[arg(long, env = "SBX_TLS_CERT", value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// TLS: the server certificate's private key (PEM).
    #[arg(long, env = "SBX_TLS_KEY", value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Mutual TLS: require client certificates signed by this CA (PEM); a certificate's
    /// subject common name is the caller's identity (`sbxd token create --cert-only`).
    #[arg(
        long,
        env = "SBX_TLS_CLIENT_CA",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,

    /// Serve a store that lost acknowledged commits or whose indexes disagree (see `sbxd store
    /// check`): what it lost is gone; the loss is logged and the store taken as it is.
    #[arg(long, env = "SBX_ACCEPT_STORE_LOSS")]
    pub accept_store_loss: bool,

    #[command(flatten)]
    pub store: store::StoreArgs,

    #[command(flatten)]
    pub nodes: node_link::NodeClientArgs,

    /// The most connections open at once (TCP or socket); past it new ones are closed at
    /// once. Default: the descriptor limit less 256 kept for the store and the driver
    /// (768 under the usual 1,024), at most 4,096.
    #[arg(long, env = "SBX_MAX_CONNECTIONS", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: Option<u32>,

    /// The most connections one peer (an IPv4 address, an IPv6 /64) holds at once on each
    /// TCP listener (the API, E2B, service routes, metrics); past it its new ones are closed
    /// at once, and logged once a minute per peer.
    #[arg(long, env = "SBX_MAX_CONNECTIONS_PER_PEER", value_name = "N",
          default_value_t = connections::DEFAULT_PER_PEER as u32,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections_per_peer: u32,

    /// Seconds a TCP connection may stay open without carrying an authenticated request (a
    /// call a credential backs; on the E2B API a key or a sandbox's token; on the service
    /// routes a request that reaches an exposed service). Past it the connection is closed,
    /// however busy it keeps itself; clients open another when they have a call to make.
    #[arg(long, env = "SBX_PROOF_TIMEOUT", value_name = "SECS",
          default_value_t = connections::DEFAULT_PROOF_TIMEOUT,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub proof_timeout: u64,

    /// Seconds a new connection has to send the HTTP/2 connection preface before it is
    /// closed.
    #[arg(long, env = "SBX_HANDSHAKE_TIMEOUT", default_value_t = 10, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub handshake_timeout: u64,

    /// Seconds an HTTP/2 connection may be quiet before sbxd pings it; one that does not
    /// answer within as long again is closed.
    #[arg(long, env = "SBX_KEEPALIVE", default_value_t = 30, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub keepalive: u64,

    /// Once serving (every sandbox re-attached, health SERVING), write where to dial — the
    /// bound host:port, or unix://PATH for the socket — and a newline to this file,
    /// atomically (written beside it, then renamed). Removed on a clean shutdown.
    #[arg(long, env = "SBX_ADDR_FILE", value_name = "PATH")]
    pub addr_file: Option<PathBuf>,

    /// Where state lives: the store in DATA/store, images in DATA/images, driver state in
    /// DATA/drivers/NAME. Default: /var/lib/sbx when run as root, else $XDG_STATE_HOME/sbx,
    /// else ~/.local/state/sbx. (The oci driver's sandboxes must be able to walk through
    /// DATA's parents: /root, mode 0700, would not do.)
    #[arg(long, env = "SBX_DATA_DIR", value_name = "DATA")]
    pub data_dir: Option<PathBuf>,

    /// The compute driver sandboxes run on: a driver's name (in this process), `remote:SOCKET`
    /// or `managed:NAME` (see --help).
    #[arg(
        long,
        env = "SBX_DRIVER",
        default_value = "oci",
        value_parser = driver_spec::parse_driver_spec,
        value_name = "NAME|remote:SOCKET|managed:NAME",
        long_help = driver_help()
    )]
    pub driver: DriverSpec,

    /// With `--driver remote:SOCKET` only: the name the remote driver is registered under,
    /// which is the `spec.driver` its sandboxes are stored with. It defaults to "process", so
    /// that sandboxes made under `--driver process` or `managed:process` keep working when
    /// the same process state dir is served remotely, and back. (In-process and managed
    /// drivers are always named after their backend.)
    #[arg(long, env = "SBX_DRIVER_NAME", value_name = "NAME")]
    pub driver_name: Option<String>,

    /// Deadline of every driver call, in seconds: both the actors' deadline and the remote
    /// driver's per-call deadline (sent to the driver as grpc-timeout). Default: 30; for the
    /// vm driver (`vm`, `managed:vm`, or a remote driver named vm) --vm-boot-timeout + 15,
    /// because a create or start returns only once the guest has booted. A value that does
    /// not exceed --vm-boot-timeout makes slow boots fail and retry (sbxd warns at start).
    #[arg(long, env = "SBX_DRIVER_CALL_TIMEOUT", value_name = "SECS")]
    pub driver_call_timeout: Option<u64>,

    /// Log line format (stderr). The filter comes from SBX_LOG, else RUST_LOG, else "info".
    #[arg(long, env = "SBX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Pretty)]
    pub log_format: LogFormat,

    /// Seconds between reconciler sweeps (store against driver); 0 disables the periodic
    /// sweep.
    #[arg(
        long,
        env = "SBX_RECONCILE_INTERVAL",
        default_value_t = 15,
        value_name = "SECS"
    )]
    pub reconcile_interval: u64,

    /// The watch history, in events: what a watch can resume from (an older resource
    /// version is OUT_OF_RANGE: list again), and how far a watch may fall behind before it
    /// ends with UNAVAILABLE "the watch fell behind". The oldest events go first once this or
    /// --watch-history-mib is passed.
    #[arg(long, env = "SBX_WATCH_HISTORY_EVENTS", default_value_t = 10_000, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub watch_history_events: u32,

    /// The watch history, in MiB of events (each counted as its protobuf encoding plus 1 KiB;
    /// one sandbox's spec may be 256 KiB): bounds sbxd's memory for it whatever the specs.
    /// At least 1, so that the largest event fits.
    #[arg(long, env = "SBX_WATCH_HISTORY_MIB", default_value_t = 64, value_name = "MIB",
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub watch_history_mib: u32,

    /// How often sbxd reads the usage of each running sandbox it serves and keeps it (`sbx
    /// sandbox stats --history`): 5s, 1m, … ; 0 keeps none (a stats call still reads the
    /// sandbox's figures now).
    #[arg(long, env = "SBX_STATS_INTERVAL", default_value = "5s", value_name = "DURATION",
          value_parser = parse_stats_interval)]
    pub stats_interval: Duration,

    /// How long each sandbox's usage samples are kept (10m, 1h, 1d). Each sample takes
    /// about 56 bytes: 720 samples (5s over 1h) about 40 KiB per sandbox. At most 17,280
    /// samples (--stats-history / --stats-interval).
    #[arg(long, env = "SBX_STATS_HISTORY", default_value = "1h", value_name = "DURATION",
          value_parser = access::parse_ttl)]
    pub stats_history: Duration,

    /// Events kept per sandbox (`sbx sandbox events`): past it the oldest are dropped; 0
    /// keeps none.
    #[arg(long, env = "SBX_EVENTS_PER_SANDBOX", default_value_t = 100, value_name = "N",
          value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub events_per_sandbox: u32,

    /// Events kept in all, every sandbox's together (`sbx events`): past it the oldest are
    /// dropped, once a minute. Each takes about 300 bytes of the store.
    #[arg(long, env = "SBX_EVENTS_MAX", default_value_t = 100_000, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub events_max: u32,

    /// The longest ttl, idle timeout or delete-after a sandbox (or a workspace's default
    /// lifetime) may ask: 30d, 12h, … A longer one is refused at create, naming the field.
    #[arg(long, env = "SBX_MAX_TTL", default_value = "30d", value_name = "DURATION",
          value_parser = parse_max_ttl)]
    pub max_ttl: Duration,

    /// A Ready sandbox with an idle timeout is busy, not idle, while its workload uses at
    /// least this many cores on average over the idle window (its cgroup's CPU time, or its
    /// VM's): a build or a model call in progress is never stopped as idle.
    #[arg(long, env = "SBX_IDLE_CPU", default_value_t = 0.05, value_name = "CORES",
          value_parser = parse_idle_cpu)]
    pub idle_cpu: f64,

    /// The memory limit of a sandbox that sets none itself and whose workspace has no default
    /// (`sbx workspace limits set`): 512Mi, 1Gi, 2G, … (0: no limit). On drivers that limit
    /// memory (oci, process where the host has the controller, vm: its RAM); shown by `sbx
    /// sandbox get`.
    #[arg(long, env = "SBX_DEFAULT_MEMORY", default_value = "1Gi", value_name = "SIZE",
          value_parser = sbx_proto::quantity::size_arg)]
    pub default_memory: u64,

    /// The cpu limit of a sandbox that sets none itself and whose workspace has no default:
    /// cores (1, 0.5) or millicores (500m); 0: no limit.
    #[arg(long, env = "SBX_DEFAULT_CPU", default_value = "1", value_name = "CPUS",
          value_parser = sbx_proto::quantity::cpu_arg)]
    pub default_cpu: u32,

    /// The disk limit of a sandbox that sets none itself and whose workspace has no default:
    /// its root filesystem's writable layer and /sandbox together (10Gi, 512Mi, …; 0: no
    /// limit). On drivers that limit disk (oci: an ext4 filesystem of that size per sandbox,
    /// sparse, on a loop device); a write past it fails with ENOSPC inside. Fixed at create.
    #[arg(long, env = "SBX_DEFAULT_DISK", default_value = "10Gi", value_name = "SIZE",
          value_parser = sbx_proto::quantity::size_arg)]
    pub default_disk: u64,

    /// Serve the sandboxes' service endpoints (`sbx service expose`) over HTTP on host:port:
    /// a request whose Host is NAME--SANDBOX--WORKSPACE.<--service-domain> goes to that
    /// endpoint's port inside its sandbox. Off unless given. No authentication: whoever
    /// reaches this address reaches every exposed port (keep it on loopback, or behind a proxy
    /// that authenticates). Port 0 picks a free port (see --service-addr-file).
    #[arg(long, env = "SBX_SERVICE_LISTEN", value_name = "HOST:PORT")]
    pub service_listen: Option<String>,

    /// The domain service endpoints' Hosts end in.
    #[arg(
        long,
        env = "SBX_SERVICE_DOMAIN",
        default_value = "localhost",
        value_name = "DOMAIN"
    )]
    pub service_domain: String,

    /// Write the service listener's bound address (host:port) to this file once serving.
    #[arg(long, value_name = "PATH", requires = "service_listen")]
    pub service_addr_file: Option<PathBuf>,

    /// Serve the E2B API on host:port, for the unmodified E2B SDKs (E2B_API_URL and
    /// E2B_SANDBOX_URL=http://HOST:PORT; the API key is an sbx token, scoped as every token):
    /// the control plane (create, get, list, set_timeout, pause, connect, metrics, kill) and
    /// the in-sandbox API (commands, pty, files, a sandbox's ports). Off unless given. Off
    /// loopback it needs --e2b-tls-cert and --e2b-tls-key. Port 0 picks a free port (see
    /// --e2b-addr-file). Held to --max-connections and --handshake-timeout as --listen is.
    #[arg(long, env = "SBX_E2B_LISTEN", value_name = "HOST:PORT")]
    pub e2b_listen: Option<String>,

    /// The E2B listener's certificate (PEM; for the names its clients dial, e.g.
    /// api.DOMAIN and *.DOMAIN with --e2b-domain): it then speaks HTTPS.
    #[arg(long, value_name = "PATH", requires_all = ["e2b_listen", "e2b_tls_key"])]
    pub e2b_tls_cert: Option<PathBuf>,

    /// The private key of --e2b-tls-cert (PEM).
    #[arg(long, value_name = "PATH", requires = "e2b_tls_cert")]
    pub e2b_tls_key: Option<PathBuf>,

    /// Route the E2B listener's requests by Host as E2B's own domain does, for SDKs given
    /// E2B_DOMAIN=DOMAIN instead of the two URLs: api.DOMAIN is the control plane, and
    /// PORT-ID.DOMAIN is port PORT of sandbox ID (49983: the in-sandbox API). The names must
    /// resolve to this listener (a wildcard DNS record) and, with TLS, be in its certificate.
    #[arg(
        long,
        env = "SBX_E2B_DOMAIN",
        value_name = "DOMAIN",
        requires = "e2b_listen"
    )]
    pub e2b_domain: Option<String>,

    /// Write the E2B listener's bound address (host:port) to this file once serving.
    #[arg(long, value_name = "PATH", requires = "e2b_listen")]
    pub e2b_addr_file: Option<PathBuf>,

    /// An E2B template name and the image it stands for, NAME=IMAGE (repeatable): a create
    /// with templateID NAME runs IMAGE. Other template ids are image references; `base` is
    /// the default image.
    #[arg(long = "e2b-template", value_name = "NAME=IMAGE", value_parser = parse_template,
          requires = "e2b_listen")]
    pub e2b_templates: Vec<(String, String)>,

    /// Serve Prometheus metrics (OpenMetrics text) at http://HOST:PORT/metrics: API requests,
    /// driver calls, actor restarts, sandboxes by phase, the watch history (docs/OPERATIONS.md
    /// lists them). Off unless given. Without authentication, so a loopback address only. Port
    /// 0 picks a free port (see --metrics-addr-file).
    #[arg(long, env = "SBX_METRICS_LISTEN", value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,

    /// Write the metrics listener's bound address (host:port) to this file once serving.
    #[arg(long, value_name = "PATH", requires = "metrics_listen")]
    pub metrics_addr_file: Option<PathBuf>,

    /// Seconds that calls in flight may take to finish after SIGTERM/SIGINT before their
    /// connections are dropped. Open watch/logs/exec streams end at once with UNAVAILABLE.
    #[arg(
        long,
        env = "SBX_SHUTDOWN_GRACE",
        default_value_t = 10,
        value_name = "SECS"
    )]
    pub shutdown_grace: u64,

    /// The process driver's settings (`--process-cgroup-parent`).
    #[command(flatten)]
    pub process: ProcessArgs,

    /// sim driver (testing): latency added to every driver call, in milliseconds.
    #[arg(
        long,
        env = "SBX_SIM_LATENCY_MS",
        default_value_t = 0,
        value_name = "MS"
    )]
    pub sim_latency_ms: u64,

    /// sim driver (testing): make every call of these operations fail with UNAVAILABLE
    /// (comma-separated: create, start, stop, delete, get, list, watch, exec, logs,
    /// capabilities).
    #[arg(long, env = "SBX_SIM_FAIL", value_delimiter = ',', value_name = "OP,…")]
    pub sim_fail: Vec<String>,

    /// Every driver's own settings, from the registry (`--driver NAME` and `managed:NAME`,
    /// which passes them on): the vm driver's, the oci driver's, the sandbox network's and the
    /// host drivers' shared ones.
    #[command(flatten)]
    pub drivers: DriverArgs,

    /// The image flags: the default image and how the built-in one is made.
    #[command(flatten)]
    pub images: images::ImageArgs,
}

/// The long help of `--driver`: the three forms, then every driver of the registry.
fn driver_help() -> String {
    format!(
        "The compute driver sandboxes run on: NAME runs it in this process; remote:SOCKET is a \
         driver served by `sbxd driver` on that Unix socket, run by the operator; managed:NAME \
         has sbxd run `sbxd driver --backend NAME` itself as a supervised child process on \
         DATA/drivers/NAME.sock, restarting it when it dies. The drivers (default oci):\n\n{}",
        sbx_drivers::registry::help()
    )
}

/// The vm driver's name: its calls wait for boots (see [`ServeArgs::driver_call_timeout`]).
const VM: &str = "vm";

/// The default driver-call deadline.
/// `--e2b-template NAME=IMAGE`.
fn parse_template(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((name, image)) if !name.trim().is_empty() && !image.trim().is_empty() => {
            Ok((name.trim().to_string(), image.trim().to_string()))
        }
        _ => Err(format!("{text:?} is not NAME=IMAGE")),
    }
}

/// `--max-ttl`: a duration of at most 100 years (a deadline past what a clock says is none).
fn parse_max_ttl(text: &str) -> Result<Duration, String> {
    let ttl = access::parse_ttl(text)?;
    if ttl > Duration::from_secs(100 * 365 * 86_400) {
        return Err(format!("{text:?} is more than 100 years (36500d)"));
    }
    Ok(ttl)
}

/// `--idle-cpu`: cores, from 0.001 to 64.
fn parse_idle_cpu(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(c) if (0.001..=64.0).contains(&c) => Ok(c),
        _ => Err(format!(
            "{text:?} is not a number of cores from 0.001 to 64 (0.05 is 5% of a core)"
        )),
    }
}

/// `--stats-interval`: a duration, or 0 for none.
fn parse_stats_interval(text: &str) -> Result<Duration, String> {
    if text.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    access::parse_ttl(text)
}

/// The most usage samples sbxd keeps per sandbox (`--stats-history` / `--stats-interval`).
pub const MAX_STATS_SAMPLES: u64 = 17_280;

pub const DEFAULT_DRIVER_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// What the vm driver's default deadline adds to its boot timeout: making the disk before
/// the boot, and ending a guest that did not boot in time (QMP quit, then SIGKILL) after it.
pub const VM_CALL_MARGIN: Duration = Duration::from_secs(15);

impl ServeArgs {
    /// Makes every path flag absolute against the current directory, once at start: the data
    /// dir, the address file, the busyboxes, the vm's kernel and modules, an `--oci-runtime`
    /// given as a path (a bare name is looked up in PATH) and a `remote:` socket. A relative
    /// path used to reach runc and the driver hosts as it was, resolved against whatever
    /// directory they ran in; `sbxd serve --data-dir data` then failed to start sandboxes.
    pub fn make_paths_absolute(&mut self) -> Result<(), DaemonError> {
        let mut paths: Vec<&mut PathBuf> = [
            &mut self.data_dir,
            &mut self.addr_file,
            &mut self.socket,
            &mut self.tls_cert,
            &mut self.tls_key,
            &mut self.tls_client_ca,
            &mut self.images.image_busybox,
        ]
        .into_iter()
        .flatten()
        .collect();
        paths.extend(self.drivers.paths_mut());
        if let DriverSpec::Remote(socket) = &mut self.driver {
            paths.push(socket);
        }
        for path in paths {
            if path.is_relative() {
                *path = std::path::absolute(&*path).map_err(|source| DaemonError::Io {
                    what: "cannot make this path absolute:",
                    path: path.clone(),
                    source,
                })?;
            }
        }
        Ok(())
    }

    pub fn reconcile_interval(&self) -> Duration {
        Duration::from_secs(self.reconcile_interval)
    }

    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace)
    }

    /// The flag when given (at least one second: a zero deadline would fail every call);
    /// else [`DEFAULT_DRIVER_CALL_TIMEOUT`], or for the vm driver the longer of that and
    /// its boot timeout plus [`VM_CALL_MARGIN`].
    pub fn driver_call_timeout(&self) -> Duration {
        match self.driver_call_timeout {
            Some(secs) => Duration::from_secs(secs.max(1)),
            None if self.serves_vm() => {
                DEFAULT_DRIVER_CALL_TIMEOUT.max(self.drivers.vm.boot_timeout() + VM_CALL_MARGIN)
            }
            None => DEFAULT_DRIVER_CALL_TIMEOUT,
        }
    }

    /// Whether the driver is the vm driver: `vm`, `managed:vm`, or a remote driver named vm.
    pub fn serves_vm(&self) -> bool {
        match &self.driver {
            DriverSpec::InProcess(kind) | DriverSpec::Managed(kind) => kind.name() == VM,
            DriverSpec::Remote(_) => self.driver_name.as_deref() == Some(VM),
        }
    }

    /// A warning when the driver-call deadline cuts vm boots short (a create or start waits
    /// for the boot, so a deadline within the boot timeout fails slow boots).
    pub fn call_timeout_warning(&self) -> Option<String> {
        let deadline = self.driver_call_timeout();
        (self.serves_vm() && deadline <= self.drivers.vm.boot_timeout()).then(|| {
            format!(
                "--driver-call-timeout {}s does not exceed --vm-boot-timeout {}s: a slow boot \
                 will fail the call and be retried; leave --driver-call-timeout unset for {}s",
                deadline.as_secs(),
                self.drivers.vm.boot_timeout_secs,
                (DEFAULT_DRIVER_CALL_TIMEOUT.max(self.drivers.vm.boot_timeout() + VM_CALL_MARGIN))
                    .as_secs()
            )
        })
    }
}

/// Why sbxd could not start, or stopped with a failure.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// No --data-dir, and neither XDG_STATE_HOME nor HOME is set.
    #[error("no data directory: pass --data-dir (or set SBX_DATA_DIR, XDG_STATE_HOME or HOME)")]
    NoDataDir,
    /// A file or directory sbxd needs could not be made, written or renamed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The store could not be opened (another sbxd holds it, or it is corrupt or newer).
    #[error("cannot open the store in {path}: {source}")]
    Store {
        path: PathBuf,
        #[source]
        source: StoreError,
    },
    /// The image store (DATA/images) could not be opened (unwritable, or made with another
    /// id map).
    #[error("cannot open the image store in {path}: {source}")]
    Images {
        path: PathBuf,
        #[source]
        source: sbx_drivers::image::ImageError,
    },
    /// The compute driver could not be opened on this machine.
    #[error("cannot open the {driver} driver: {source}{hint}")]
    Driver {
        driver: &'static str,
        #[source]
        source: DriverError,
        /// What to try instead, when there is something.
        hint: &'static str,
    },
    /// --driver-name was given without `--driver remote:SOCKET`, or is not a DNS-1123 label.
    #[error("--driver-name {0:?}: {1}")]
    DriverName(String, String),
    /// The `sbxd driver` host failed to open its driver or to serve.
    #[error("the driver host failed: {0}")]
    DriverHost(#[source] DriverError),
    /// The driver's Unix socket path is too long for the kernel (a remote: socket, or a
    /// managed driver's DATA/drivers/X.sock under a deep data dir).
    #[error(
        "the driver socket path {path} is {len} bytes; Unix sockets take at most 107 (108 with \
         the NUL): use a shorter path (for managed drivers, a shorter --data-dir)"
    )]
    SocketPathTooLong { path: PathBuf, len: usize },
    /// A --sim-fail entry names no driver operation.
    #[error("--sim-fail: unknown operation {0:?}; expected one of {1}")]
    UnknownSimOp(String, String),
    /// The built-in default image could not be made (no static busybox).
    #[error(transparent)]
    DefaultImage(#[from] images::BusyboxError),
    /// The actor tree did not start.
    #[error("the actor runtime did not start: {0}")]
    Actors(#[from] ActorError),
    /// The listen address could not be bound (in use, not local, malformed).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// The store lost acknowledged commits or its indexes disagree with its records.
    #[error(
        "the store in {path} is damaged; sbxd does not serve it:\n{report}\n\
         `sbxd store check --data-dir DATA` says the same without starting; restore a \
         backup (`sbxd store restore --force FILE`, which keeps this store aside), put back a \
         copy of DATA/store and DATA/store.high-water taken while sbxd was stopped, or start \
         with --accept-store-loss to serve what is left"
    )]
    StoreDamaged { path: PathBuf, report: String },
    /// A shared store (`--store postgres://…`) could not be opened: unreachable, a wrong
    /// password, a schema this build cannot use.
    #[error("cannot open the store {store}: {source}")]
    SharedStore {
        store: String,
        #[source]
        source: StoreError,
    },
    /// A shared store's records disagree with each other (its integrity check).
    #[error(
        "{store} is damaged; sbxd does not serve it:\n{report}\nrestore the database from a \
         backup, or start with --accept-store-loss to serve it as it is"
    )]
    SharedStoreDamaged { store: String, report: String },
    /// The listener's security: TLS off a loopback address, `--auth none` off loopback, TLS
    /// files that do not load, the identities file unreadable.
    #[error("{0}")]
    Security(String),
    /// A setting sbxd cannot use: the service listener's address or domain, the secrets key
    /// of providers' credentials.
    #[error("{0}")]
    Setup(String),
    /// The reflection service could not be built from the descriptor sets (a build bug).
    #[error("cannot build the reflection service: {0}")]
    Reflection(String),
    /// The gRPC server failed while serving.
    #[error("the gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// The signal handlers could not be installed.
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
}

#[cfg(test)]
mod tests {
    use sbx_drivers::vm::Accel;

    use super::*;

    /// `sbxd serve ARGS…` parsed (the SBX_* variables of the test's environment apply).
    fn serve_args(args: &[&str]) -> Result<ServeArgs, clap::Error> {
        let argv = ["sbxd", "serve"].into_iter().chain(args.iter().copied());
        match Sbxd::try_parse_from(argv)?.command {
            Command::Serve(args) => Ok(args),
            _ => unreachable!("parsed serve"),
        }
    }

    #[test]
    fn driver_call_timeout_defaults_per_driver_and_the_flag_wins() {
        let secs = |args: &[&str]| serve_args(args).unwrap().driver_call_timeout().as_secs();
        assert_eq!(secs(&["--driver", "process"]), 30);
        assert_eq!(secs(&["--driver", "sim"]), 30);
        // The vm driver: the boot timeout (default 45 s) plus the margin, at least 30 s.
        assert_eq!(secs(&["--driver", "vm"]), 60);
        assert_eq!(secs(&["--driver", "managed:vm"]), 60);
        assert_eq!(secs(&["--driver", "vm", "--vm-boot-timeout", "120"]), 135);
        assert_eq!(secs(&["--driver", "vm", "--vm-boot-timeout", "5"]), 30);
        assert_eq!(secs(&["--driver", "remote:/s", "--driver-name", "vm"]), 60);
        assert_eq!(secs(&["--driver", "remote:/s"]), 30);
        assert_eq!(
            secs(&["--driver", "vm", "--driver-call-timeout", "100"]),
            100
        );
        assert_eq!(secs(&["--driver-call-timeout", "0"]), 1);
    }

    #[test]
    fn a_call_timeout_within_the_boot_timeout_is_warned_about() {
        let warning = |args: &[&str]| serve_args(args).unwrap().call_timeout_warning();
        assert_eq!(warning(&["--driver", "vm"]), None);
        assert_eq!(
            warning(&["--driver", "process", "--driver-call-timeout", "5"]),
            None
        );
        let w = warning(&["--driver", "vm", "--driver-call-timeout", "45"]).expect("a warning");
        assert!(w.contains("45s") && w.contains("unset for 60s"), "{w}");
        assert!(
            warning(&[
                "--driver",
                "managed:vm",
                "--vm-boot-timeout",
                "90",
                "--driver-call-timeout",
                "60"
            ])
            .is_some()
        );
    }

    #[test]
    fn every_path_flag_is_made_absolute() {
        let mut args = serve_args(&[
            "--data-dir",
            "data",
            "--addr-file",
            "run/addr",
            "--busybox",
            "bb",
            "--oci-busybox",
            "./obb",
            "--oci-runtime",
            "bin/crun",
            "--vm-kernel",
            "k",
            "--vm-busybox",
            "/abs/vbb",
            "--driver",
            "remote:sock/d.sock",
        ])
        .unwrap();
        args.make_paths_absolute().unwrap();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(args.data_dir, Some(cwd.join("data")));
        assert_eq!(args.addr_file, Some(cwd.join("run/addr")));
        assert_eq!(args.images.image_busybox, Some(cwd.join("bb")));
        assert_eq!(args.drivers.oci.busybox, Some(cwd.join("obb")));
        assert_eq!(args.drivers.oci.runtime, cwd.join("bin/crun"));
        assert_eq!(args.drivers.vm.kernel, Some(cwd.join("k")));
        assert_eq!(args.drivers.vm.busybox, Some(PathBuf::from("/abs/vbb")));
        assert_eq!(args.driver, DriverSpec::Remote(cwd.join("sock/d.sock")));
        // A bare runtime name stays a name, for PATH.
        let mut args = serve_args(&["--data-dir", "/var/lib/x"]).unwrap();
        args.make_paths_absolute().unwrap();
        assert_eq!(args.drivers.oci.runtime, PathBuf::from("runc"));
        assert_eq!(args.data_dir, Some(PathBuf::from("/var/lib/x")));
    }

    #[test]
    fn serve_takes_the_vm_flags() {
        let args = serve_args(&[
            "--driver",
            "vm",
            "--vm-accel",
            "tcg",
            "--vm-memory-mib",
            "384",
            "--vm-disk-mib",
            "32",
            "--vm-boot-timeout",
            "90",
            "--vm-kernel",
            "/boot/k",
            "--vm-busybox",
            "/opt/bb",
        ])
        .unwrap();
        assert_eq!(
            args.driver,
            DriverSpec::InProcess(DriverKind::named("vm").unwrap())
        );
        let opts = args.drivers.vm.driver_options();
        assert_eq!(opts.accel, Accel::Tcg);
        assert_eq!((opts.memory_mib, opts.disk_mib), (384, 32));
        assert_eq!(opts.boot_timeout, Duration::from_secs(90));
        assert_eq!(opts.assets.kernel, Some(PathBuf::from("/boot/k")));
        assert_eq!(opts.assets.busybox, Some(PathBuf::from("/opt/bb")));
        assert_eq!(opts.assets.modules_dir, None);
    }

    #[test]
    fn bad_vm_values_are_usage_errors_naming_the_flag() {
        for (flag, value, mentions) in [
            ("--vm-accel", "xen", "auto, kvm or tcg"),
            ("--vm-memory-mib", "100", "at least 256"),
            ("--vm-memory-mib", "lots", "not a whole number"),
            ("--vm-disk-mib", "8", "at least 16"),
            ("--vm-boot-timeout", "0", "at least 1"),
            ("--vm-boot-timeout", "-5", "not a whole number"),
        ] {
            let err = serve_args(&["--driver", "vm", &format!("{flag}={value}")]).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{flag} {value}: a usage error");
            let text = err.to_string();
            assert!(
                text.contains(flag) && text.contains(mentions),
                "{flag} {value}: {text}"
            );
        }
    }
}
