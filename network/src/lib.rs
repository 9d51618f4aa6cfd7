//! The gateway's sandbox network: one bridge, one nftables table, and per sandbox a network
//! namespace with a veth into the bridge, an address leased by the sandbox's UUID, and its
//! egress policy enforced in the kernel.
//!
//! Shape (see docs/ARCHITECTURE.md, "Sandbox network"):
//! - **Bridge** `<name>0` holds the network's first address (the sandboxes' gateway). Its
//!   ports are isolated from one another (`bridge link … isolated on`).
//! - **A sandbox** gets the namespace `/run/netns/<name>-<uuid>`, made by host root (so the
//!   workload, root only in its own user namespace, holds no capability over it and cannot
//!   change its address, routes or firewall), with `lo`, and `eth0` holding its address as a
//!   /32 and a default route through the bridge's address. Every packet a sandbox sends, to
//!   another sandbox too, is routed by the host and so passes the gateway's table.
//! - **Leases** are files `<state>/leases/<address>` holding the sandbox's UUID, made with
//!   `O_EXCL` (two sandboxes never share an address) and fsynced before the address is used;
//!   a restarted gateway reads them back and re-attaches without touching a running
//!   workload's namespace, veth or rules.
//! - **Policy**: default deny; the sandbox's allowlist entries ([`policy`]) become its chain
//!   in the table ([`nft`]), replaced whole in one transaction on a live update.
//! - **Names**: the gateway's resolver ([`resolver`]) on the bridge's address answers each
//!   sandbox the names its list holds and admits the addresses it answered.
//! - **Denials** are read from the table's `denied` set (per source, destination, protocol
//!   and port, with a packet count), and names refused from the resolver.
//! - **Budgets** on what every sandbox of the host shares: the resolver's (queries in flight
//!   and a second, [`resolver`]) and the host's connection tracking table (a `ct count` per
//!   sandbox, [`nft`]); what they refused each sandbox is [`Network::budget_refusals`].
//! - **One gateway per network name**: the bridge, the table and the namespaces are named
//!   after it, so a second gateway on the same name would take the first's table over (its
//!   sandboxes would lose their resolver). Opening a network takes an exclusive `flock` on
//!   `/run/sbx/network/<name>.lock` (holding the owner's pid) for as long as the [`Network`]
//!   lives; a second open is refused, naming that pid. The kernel lets go of it when the
//!   owner dies, however it dies.

pub mod auto;
/// Test fixtures (feature `fixtures`, which only dev-dependencies turn on: no daemon links
/// them).
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
pub mod flags;
pub mod guest;
pub mod link;
pub mod nft;
pub mod policy;
pub mod resolver;

pub use auto::{AUTO_CANDIDATES, AUTO_FILE, ChoiceLock, auto_cidr, bridge_owner};

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use uuid::Uuid;

/// The port of the gateway's resolver on the bridge's address: the nft rules admit it, the
/// resolver binds it.
pub const RESOLVER_PORT: u16 = 53;

pub use flags::NetworkArgs;
pub use nft::{DEFAULT_CONNTRACK_MAX, Denial};
pub use policy::{AllowEntry, PolicyError, parse_allowlist, parse_entry};

use sbx_driver_api::locked;

/// The default network: a /16 inside 10/8 that few hosts route.
pub const DEFAULT_CIDR: &str = "10.213.0.0/16";
/// The default name: the bridge is `sbx0`, the table `inet sbx`, namespaces `sbx-<uuid>`.
pub const DEFAULT_NAME: &str = "sbx";

/// What a gateway's network is.
#[derive(Debug, Clone)]
pub struct NetworkConfig {
    /// Names the bridge (`<name>0`), the table and the namespaces: at most 8 characters of
    /// `[a-z0-9]`, starting with a letter.
    pub name: String,
    pub network: Ipv4Addr,
    pub prefix: u8,
    /// Where the leases are kept.
    pub state_dir: PathBuf,
    /// Where the gateway's resolver asks the names sandboxes may resolve; `None`: such names
    /// are answered SERVFAIL.
    pub dns_upstream: Option<SocketAddr>,
    /// The connections each sandbox may have in the host's connection tracking table at
    /// once ([`DEFAULT_CONNTRACK_MAX`]; `sbxd serve --network-conntrack-max`).
    pub conntrack_max: u32,
}

/// Where the lock of each network name is ([`Network::open`]).
pub const LOCK_DIR: &str = "/run/sbx/network";

/// How long [`Network::open`] waits for a previous owner of the name (in this process, being
/// dropped) to let go.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// What a sandbox's budgets on the host's shared resources refused it
/// ([`Network::budget_refusals`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BudgetRefusals {
    /// DNS queries to the gateway's resolver refused by a budget: past its queries in flight
    /// or a second at the resolver (since this process began answering the sandbox), and
    /// past [`nft::DNS_RATE`] a second in the kernel (since the sandbox was attached).
    pub dns_queries: u64,
    /// New connections refused because the sandbox had its conntrack budget's worth in the
    /// host's table (since the sandbox was attached).
    pub connections: u64,
}

/// Why the network cannot be set up or a sandbox cannot be attached.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("{0}")]
    Config(String),
    #[error(
        "the sandbox network {network}/{prefix} overlaps the host's {other}; choose another with --network-cidr"
    )]
    Overlap {
        network: Ipv4Addr,
        prefix: u8,
        other: String,
    },
    #[error("the sandbox network {0} has no free address left")]
    Exhausted(String),
    #[error(
        "the sandbox network {name:?} is served by another sbxd ({holder}, holding {lock}): give this one another --network-name (and --network-cidr), or stop that one"
    )]
    InUse {
        name: String,
        /// `pid N`, or what is known of the holder.
        holder: String,
        lock: String,
    },
    #[error(transparent)]
    Ip(#[from] link::IpError),
    #[error(transparent)]
    Nft(#[from] nft::NftError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetworkError {
    let what = what.into();
    move |source| NetworkError::Io { what, source }
}

/// Parses `A.B.C.D/LEN` into a network whose host bits are zero, with room for a gateway and
/// at least one sandbox.
pub fn parse_cidr(text: &str) -> Result<(Ipv4Addr, u8), NetworkError> {
    let bad = |why: &str| NetworkError::Config(format!("network CIDR {text:?}: {why}"));
    let (addr, len) = text
        .split_once('/')
        .ok_or_else(|| bad("expected A.B.C.D/LEN"))?;
    let addr: Ipv4Addr = addr.parse().map_err(|_| bad("not an IPv4 address"))?;
    let len: u8 = len
        .parse()
        .map_err(|_| bad("prefix length is not a number"))?;
    if !(8..=29).contains(&len) {
        return Err(bad("prefix length must be 8 to 29"));
    }
    let mask = u32::MAX << (32 - len);
    if u32::from(addr) & !mask != 0 {
        return Err(bad("host bits are set"));
    }
    if addr.is_loopback() || addr.is_multicast() || addr.is_unspecified() || addr.is_link_local() {
        return Err(bad("not a unicast network"));
    }
    Ok((addr, len))
}

/// A sandbox's place on the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub address: Ipv4Addr,
    pub gateway: Ipv4Addr,
    /// The namespace's path, for the driver that runs the workload in it.
    pub netns_path: PathBuf,
}

/// The gateway's network (one per gateway; drivers share it).
#[derive(Debug)]
pub struct Network {
    config: NetworkConfig,
    table: nft::Table,
    leases: Mutex<HashMap<Uuid, Ipv4Addr>>,
    /// How many classes (each two address sets) each sandbox (by its key) has in the table;
    /// read back at open.
    sets: Mutex<HashMap<String, usize>>,
    names: Arc<resolver::Shared>,
    resolver: Mutex<Option<resolver::Resolver>>,
    /// Denials per source address as of the last look at the `denied` set, and when.
    summaries: Mutex<Summaries>,
    /// The network name's lock, held as long as this lives.
    lock: NameLock,
}

/// How often, at most, [`Network::denial_summary`] reads the `denied` set again.
pub const DENIAL_REFRESH: std::time::Duration = std::time::Duration::from_secs(3);

#[derive(Debug, Default)]
struct Summaries {
    at: Option<std::time::Instant>,
    by_source: HashMap<Ipv4Addr, (u64, Denial)>,
    /// What the kernel's budgets refused per source: DNS queries past the rate, and new
    /// connections past the conntrack budget.
    dns_refused: HashMap<Ipv4Addr, u64>,
    ct_refused: HashMap<Ipv4Addr, u64>,
}

/// The lock file of network `name`.
fn lock_path(name: &str) -> PathBuf {
    Path::new(LOCK_DIR).join(format!("{name}.lock"))
}

/// A network name's lock, held while this lives. Dropped, it removes its file first (while
/// still held, so no one else's lock goes with it) unless `keep`: a network opened stays on
/// the host for the next gateway, and so does its file; one that failed to open, or was
/// removed, leaves nothing.
#[derive(Debug)]
struct NameLock {
    path: PathBuf,
    keep: bool,
    _held: nix::fcntl::Flock<std::fs::File>,
}

impl Drop for NameLock {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Takes the exclusive lock of network `name` (see the module's doc), waiting up to
/// [`LOCK_WAIT`]; writes this process's pid into it. The file is removed only by a holder
/// (once the network is gone), so a lock taken on a file no longer at the path is let go
/// and taken again on the one there.
fn lock_name(name: &str) -> Result<NameLock, NetworkError> {
    use nix::errno::Errno;
    use nix::fcntl::{Flock, FlockArg};
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(LOCK_DIR)
        .map_err(io(format!("creating {LOCK_DIR}")))?;
    let path = lock_path(name);
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io(format!("opening {}", path.display())))
    };
    let mut file = open()?;
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(mut lock) => {
                let still_there = match (lock.metadata(), std::fs::symlink_metadata(&path)) {
                    (Ok(held), Ok(there)) => held.dev() == there.dev() && held.ino() == there.ino(),
                    _ => false,
                };
                if !still_there {
                    if std::time::Instant::now() >= deadline {
                        return Err(NetworkError::Config(format!(
                            "{} was removed and made again for {LOCK_WAIT:?}: something else is at work on network {name:?}",
                            path.display()
                        )));
                    }
                    drop(lock);
                    file = open()?;
                    continue;
                }
                lock.set_len(0)
                    .and_then(|()| lock.rewind())
                    .and_then(|()| writeln!(lock, "{}", std::process::id()))
                    .map_err(io(format!("writing {}", path.display())))?;
                return Ok(NameLock {
                    path,
                    keep: false,
                    _held: lock,
                });
            }
            Err((back, Errno::EWOULDBLOCK)) if std::time::Instant::now() < deadline => {
                file = back;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err((mut back, Errno::EWOULDBLOCK)) => {
                let mut text = String::new();
                let _ = back.read_to_string(&mut text);
                let holder = match text.trim().parse::<u32>() {
                    Ok(pid) => format!("pid {pid}"),
                    Err(_) => "a process that has not yet said its pid".into(),
                };
                return Err(NetworkError::InUse {
                    name: name.into(),
                    holder,
                    lock: path.display().to_string(),
                });
            }
            Err((_, e)) => {
                return Err(io(format!("locking {}", path.display()))(e.into()));
            }
        }
    }
}

impl Network {
    fn bridge(&self) -> &str {
        &self.table.bridge
    }

    fn gateway_addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.config.network) + 1)
    }

    fn netns_name(&self, id: Uuid) -> String {
        format!("{}-{id}", self.config.name)
    }

    fn veth_name(id: Uuid) -> String {
        format!("sbv{}", &id.simple().to_string()[..12])
    }

    fn lease_dir(&self) -> PathBuf {
        self.config.state_dir.join("leases")
    }

    /// Sets the network up, or finds it set up by an earlier gateway: refuses a CIDR that
    /// overlaps a network of the host's; turns on IPv4 forwarding; makes the bridge and the
    /// table (keeping every sandbox's chain); reads the leases back.
    pub fn open(config: NetworkConfig) -> Result<Network, NetworkError> {
        let name_ok = !config.name.is_empty()
            && config.name.len() <= 8
            && config.name.starts_with(|c: char| c.is_ascii_lowercase())
            && config
                .name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        if !name_ok {
            return Err(NetworkError::Config(format!(
                "network name {:?}: 1 to 8 characters of a-z and 0-9, starting with a letter",
                config.name
            )));
        }
        if config.conntrack_max == 0 {
            return Err(NetworkError::Config(
                "a sandbox's conntrack budget of 0 admits no connection, not even its lookups"
                    .into(),
            ));
        }
        // Before anything of the host is touched: another gateway's network is left alone.
        let lock = lock_name(&config.name)?;
        let bridge = format!("{}0", config.name);
        for (net, len, what) in link::host_networks(&bridge)? {
            if policy::overlaps(config.network, config.prefix, net, len) {
                return Err(NetworkError::Overlap {
                    network: config.network,
                    prefix: config.prefix,
                    other: what,
                });
            }
        }
        let table = nft::Table {
            name: config.name.clone(),
            bridge: bridge.clone(),
            network: config.network,
            prefix: config.prefix,
            conntrack_max: config.conntrack_max,
        };
        let names = Arc::new(resolver::Shared::new(table.clone(), config.dns_upstream));
        let mut net = Network {
            config,
            table,
            leases: Mutex::new(HashMap::new()),
            sets: Mutex::new(HashMap::new()),
            names,
            resolver: Mutex::new(None),
            summaries: Mutex::new(Summaries::default()),
            lock,
        };
        std::fs::write("/proc/sys/net/ipv4/ip_forward", b"1")
            .map_err(io("turning on IPv4 forwarding"))?;
        let made_bridge = !link::link_exists(&bridge);
        if made_bridge {
            link::ip(&["link", "add", "name", &bridge, "type", "bridge"])?;
        }
        match net.set_up(&bridge) {
            Ok(()) => {
                net.lock.keep = true;
                Ok(net)
            }
            Err(e) => {
                // Leave the host as it was: a bridge this call made goes again.
                if made_bridge {
                    let _ = link::ip(&["link", "delete", "dev", &bridge]);
                }
                Err(e)
            }
        }
    }

    fn set_up(&self, bridge: &str) -> Result<(), NetworkError> {
        let net = self;
        let gw = format!("{}/{}", net.gateway_addr(), net.config.prefix);
        let addrs = link::ip(&["-4", "-o", "addr", "show", "dev", bridge])?;
        if !addrs.contains(&format!(" {gw} ")) {
            link::ip(&["addr", "add", &gw, "dev", bridge])?;
        }
        link::ip(&["link", "set", "dev", bridge, "up"])?;
        let existing = nft::list(
            "look for the table",
            &["list", "table", "inet", &net.table.name],
        )
        .ok();
        nft::apply("set up the table", net.table.setup(existing.as_ref()))?;
        if let Some(doc) = &existing {
            net.names.restore_admitted(nft::admitted(doc));
        }
        let sets = nft::list(
            "list the table's sets",
            &["-t", "list", "table", "inet", &net.table.name],
        )?;
        *locked(&net.sets) = nft::sandbox_sets(&sets);
        net.load_leases()?;
        let started = resolver::Resolver::start(net.gateway_addr(), Arc::clone(&net.names))
            .map_err(|e| {
                NetworkError::Config(format!(
                    "the sandbox resolver cannot listen on {}:{} (UDP): {e}",
                    net.gateway_addr(),
                    resolver::PORT
                ))
            })?;
        *locked(&net.resolver) = Some(started);
        Ok(())
    }

    fn load_leases(&self) -> Result<(), NetworkError> {
        let dir = self.lease_dir();
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let mut leases = locked(&self.leases);
        for entry in std::fs::read_dir(&dir).map_err(io(format!("reading {}", dir.display())))? {
            let entry = entry.map_err(io("reading a lease"))?;
            let (Some(addr), Ok(text)) = (
                entry
                    .file_name()
                    .to_str()
                    .and_then(|n| n.parse::<Ipv4Addr>().ok()),
                std::fs::read_to_string(entry.path()),
            ) else {
                continue;
            };
            match Uuid::parse_str(text.trim()) {
                Ok(id) => {
                    leases.insert(id, addr);
                }
                // A lease file cut short by a crash before its fsync: nothing used it.
                Err(_) => {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        Ok(())
    }

    /// The address leased to `id`, leasing the lowest free one if it has none.
    fn lease(&self, id: Uuid) -> Result<Ipv4Addr, NetworkError> {
        let mut leases = locked(&self.leases);
        if let Some(a) = leases.get(&id) {
            return Ok(*a);
        }
        let first = u32::from(self.config.network) + 2;
        let last = u32::from(self.config.network) + (1u32 << (32 - self.config.prefix)) - 2;
        let taken: std::collections::HashSet<Ipv4Addr> = leases.values().copied().collect();
        let dir = self.lease_dir();
        for n in first..=last {
            let addr = Ipv4Addr::from(n);
            if taken.contains(&addr) {
                continue;
            }
            let path = dir.join(addr.to_string());
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    use std::io::Write;
                    f.write_all(id.to_string().as_bytes())
                        .map_err(io("writing a lease"))?;
                    f.sync_all().map_err(io("syncing a lease"))?;
                    std::fs::File::open(&dir)
                        .and_then(|d| d.sync_all())
                        .map_err(io("syncing the lease directory"))?;
                    leases.insert(id, addr);
                    return Ok(addr);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io("creating a lease")(e)),
            }
        }
        Err(NetworkError::Exhausted(format!(
            "{}/{}",
            self.config.network, self.config.prefix
        )))
    }

    /// The address leased to `id`, if any.
    pub fn address_of(&self, id: Uuid) -> Option<Ipv4Addr> {
        locked(&self.leases).get(&id).copied()
    }

    /// The name of the host end of `id`'s link (its counters are the sandbox's traffic).
    pub fn host_link(&self, id: Uuid) -> String {
        Self::veth_name(id)
    }

    /// Gives `id` its namespace, veth, address and routes (whatever of them it does not have
    /// yet: a second call changes nothing), and its policy.
    pub fn attach(&self, id: Uuid, allow: &[AllowEntry]) -> Result<Attachment, NetworkError> {
        let address = self.lease(id)?;
        let ns = self.netns_name(id);
        let gateway = self.gateway_addr();
        // The policy first: the sandbox's traffic is denied before it can send any.
        self.set_policy(id, allow)?;
        if !link::netns_exists(&ns) {
            link::ip(&["netns", "add", &ns])?;
        }
        let configured = link::ip_in(&ns, &["-4", "-o", "addr", "show", "dev", "eth0"])
            .map(|out| out.contains(&format!(" {address}/32 ")))
            .unwrap_or(false);
        if !configured {
            self.make_veth(id, &ns)?;
            link::ip_in(
                &ns,
                &["addr", "add", &format!("{address}/32"), "dev", "eth0"],
            )?;
            link::ip_in(&ns, &["link", "set", "dev", "eth0", "up"])?;
            link::ip_in(
                &ns,
                &[
                    "route",
                    "add",
                    &gateway.to_string(),
                    "dev",
                    "eth0",
                    "scope",
                    "link",
                ],
            )?;
            link::ip_in(
                &ns,
                &[
                    "route",
                    "add",
                    "default",
                    "via",
                    &gateway.to_string(),
                    "dev",
                    "eth0",
                ],
            )?;
        }
        Ok(Attachment {
            address,
            gateway,
            netns_path: Path::new("/run/netns").join(ns),
        })
    }

    /// The veth of `id` (made again when one was there): its host end in the bridge,
    /// isolated from the other ports, and up; `eth0` in `ns`; `ns`'s loopback up.
    fn make_veth(&self, id: Uuid, ns: &str) -> Result<(), NetworkError> {
        let host_end = Self::veth_name(id);
        if link::link_exists(&host_end) {
            link::ip(&["link", "delete", "dev", &host_end])?;
        }
        let _ = link::ip_in(ns, &["link", "delete", "dev", "eth0"]);
        link::ip(&[
            "link", "add", "name", &host_end, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ])?;
        link::ip(&["link", "set", "dev", &host_end, "master", self.bridge()])?;
        link::ip(&[
            "link",
            "set",
            "dev",
            &host_end,
            "type",
            "bridge_slave",
            "isolated",
            "on",
        ])?;
        link::ip(&["link", "set", "dev", &host_end, "up"])?;
        link::ip_in(ns, &["link", "set", "dev", "lo", "up"])?;
        Ok(())
    }

    /// Replaces `id`'s allowlist, in one transaction: a connection already admitted keeps
    /// going, the next new one meets the new list.
    pub fn set_policy(&self, id: Uuid, allow: &[AllowEntry]) -> Result<(), NetworkError> {
        let address = self.lease(id)?;
        let key = id.simple().to_string();
        let mut sets = locked(&self.sets);
        let had = sets.get(&key).copied().unwrap_or(0);
        let admitted = self.names.still_admitted(id);
        let (cmds, now) = self
            .table
            .apply_sandbox(&key, address, allow, had, &admitted);
        self.names.with_policy(id, address, allow, || {
            nft::apply("apply a sandbox's policy", cmds)
        })?;
        sets.insert(key, now);
        Ok(())
    }

    /// Tells the resolver `id`'s list again (a restarted gateway, whose table still holds
    /// it), changing nothing in the table; nothing to do for a sandbox with no lease.
    pub fn restore(&self, id: Uuid, allow: &[AllowEntry]) {
        if let Some(address) = self.address_of(id) {
            let _ = self.names.with_policy(id, address, allow, || Ok(()));
        }
    }

    /// The denials recorded for `id` in the last ten minutes, most packets first.
    pub fn denials(&self, id: Uuid) -> Result<Vec<Denial>, NetworkError> {
        let Some(address) = self.address_of(id) else {
            return Ok(Vec::new());
        };
        let doc = nft::list(
            "read the denials",
            &["list", "set", "inet", &self.table.name, "denied"],
        )?;
        let mut mine: Vec<Denial> = nft::parse_denials(&doc)
            .into_iter()
            .filter(|d| d.source == address)
            .collect();
        mine.sort_by(|a, b| {
            b.packets
                .cmp(&a.packets)
                .then(a.destination.cmp(&b.destination))
                .then(a.port.cmp(&b.port))
        });
        Ok(mine)
    }

    /// How many packets and DNS queries `id`'s policy refused in the last ten minutes, and the
    /// most recent refused destination, as of a look at most [`DENIAL_REFRESH`] old (one read
    /// of the `denied` set serves every sandbox: the cost does not grow with their number).
    pub fn denial_summary(&self, id: Uuid) -> (u64, Option<sbx_driver_api::pb::NetworkDenial>) {
        let Some(address) = self.address_of(id) else {
            return (0, None);
        };
        let sums = self.summaries();
        let (mut total, mut last) = match sums.by_source.get(&address) {
            Some((n, d)) => (*n, Some(pb_denial(d))),
            None => (0, None),
        };
        drop(sums);
        let refused = self.names.refused(id);
        total += refused.iter().map(|(_, n)| n).sum::<u64>();
        if last.is_none() {
            last = refused
                .into_iter()
                .next()
                .map(|(name, n)| dns_denial(name, n));
        }
        (total, last)
    }

    /// What `id`'s budgets on the host's shared resources refused it: DNS queries (the
    /// resolver's budgets since this process began answering it, and the kernel's rate since
    /// it was attached) and new connections past its conntrack budget (since it was
    /// attached). The kernel's counts are as of a look at most [`DENIAL_REFRESH`] old, one
    /// for every sandbox (as [`Network::denial_summary`]); a sandbox with no lease has none.
    pub fn budget_refusals(&self, id: Uuid) -> BudgetRefusals {
        let Some(address) = self.address_of(id) else {
            return BudgetRefusals::default();
        };
        let sums = self.summaries();
        let kernel_dns = sums.dns_refused.get(&address).copied().unwrap_or(0);
        let connections = sums.ct_refused.get(&address).copied().unwrap_or(0);
        drop(sums);
        BudgetRefusals {
            dns_queries: kernel_dns + self.names.over_budget(address),
            connections,
        }
    }

    /// The kernel's records of every sandbox (the `denied`, `dns_refused` and `ct_refused`
    /// sets), read again if the last look is [`DENIAL_REFRESH`] old.
    fn summaries(&self) -> std::sync::MutexGuard<'_, Summaries> {
        let mut sums = locked(&self.summaries);
        if sums.at.is_some_and(|at| at.elapsed() < DENIAL_REFRESH) {
            return sums;
        }
        let set = |name: &str| {
            nft::list(
                "read the denials",
                &["list", "set", "inet", &self.table.name, name],
            )
        };
        match set("denied") {
            Ok(doc) => {
                let mut by: HashMap<Ipv4Addr, (u64, Denial)> = HashMap::new();
                for d in nft::parse_denials(&doc) {
                    match by.get_mut(&d.source) {
                        Some((n, last)) => {
                            *n += d.packets;
                            if d.expires > last.expires {
                                *last = d;
                            }
                        }
                        None => {
                            by.insert(d.source, (d.packets, d));
                        }
                    }
                }
                sums.by_source = by;
            }
            Err(e) => tracing::warn!(error = %e, "the network's denials could not be read"),
        }
        let counted = |name: &str| match set(name) {
            Ok(doc) => Some(nft::counted_by_source(&doc)),
            Err(e) => {
                tracing::warn!(error = %e, set = name, "the network's budget refusals could not be read");
                None
            }
        };
        if let Some(by) = counted("dns_refused") {
            sums.dns_refused = by;
        }
        if let Some(by) = counted("ct_refused") {
            sums.ct_refused = by;
        }
        sums.at = Some(std::time::Instant::now());
        sums
    }

    /// Removes everything `id` had: its rules, namespace (with its veth) and lease. Nothing
    /// of it is left on the host; a second call finds nothing to do.
    pub fn detach(&self, id: Uuid) -> Result<(), NetworkError> {
        let ns = self.netns_name(id);
        let address = self.address_of(id);
        let chain = format!("sb_{}", id.simple());
        let has_chain = nft::list(
            "look for a sandbox's chain",
            &["list", "chain", "inet", &self.table.name, &chain],
        )
        .is_ok();
        // The chain and the map entry are made and removed in one transaction each: the one
        // exists exactly when the other does.
        if let (true, Some(addr)) = (has_chain, address) {
            let key = id.simple().to_string();
            let mut sets = locked(&self.sets);
            let n = sets.get(&key).copied().unwrap_or(0);
            nft::apply(
                "remove a sandbox's policy",
                self.table.remove_sandbox(&key, addr, n),
            )?;
            sets.remove(&key);
        }
        let host_end = Self::veth_name(id);
        if link::link_exists(&host_end) {
            link::ip(&["link", "delete", "dev", &host_end])?;
        }
        if link::netns_exists(&ns) {
            link::ip(&["netns", "delete", &ns])?;
        }
        if let Some(addr) = address {
            let path = self.lease_dir().join(addr.to_string());
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("removing a lease")(e)),
            }
            locked(&self.leases).remove(&id);
        }
        self.names.forget(id, address);
        Ok(())
    }

    /// Removes the bridge and the table (for a gateway whose network is no longer wanted, and
    /// for tests). Refused while a sandbox holds a lease.
    pub fn teardown(&self) -> Result<(), NetworkError> {
        let n = locked(&self.leases).len();
        if n > 0 {
            return Err(NetworkError::Config(format!(
                "{n} sandboxes are still attached to the network"
            )));
        }
        locked(&self.resolver).take();
        if nft::list(
            "look for the table",
            &["list", "table", "inet", &self.table.name],
        )
        .is_ok()
        {
            nft::apply(
                "delete the table",
                vec![
                    serde_json::json!({ "delete": { "table": { "family": "inet", "name": self.table.name } } }),
                ],
            )?;
        }
        if link::link_exists(self.bridge()) {
            link::ip(&["link", "delete", "dev", self.bridge()])?;
        }
        // The network is gone: its lock file with it (held, so no one else is at it).
        let _ = std::fs::remove_file(&self.lock.path);
        Ok(())
    }

    pub fn config(&self) -> &NetworkConfig {
        &self.config
    }

    pub fn bridge_name(&self) -> &str {
        self.bridge()
    }

    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway_addr()
    }

    /// The names the resolver refused to `id`, most asked first, with how often.
    pub fn refused_names(&self, id: Uuid) -> Vec<(String, u64)> {
        self.names.refused(id)
    }
}

fn pb_denial(d: &Denial) -> sbx_driver_api::pb::NetworkDenial {
    sbx_driver_api::pb::NetworkDenial {
        destination: d.destination.to_string(),
        protocol: d.protocol.clone(),
        port: u32::from(d.port),
        packets: d.packets,
    }
}

/// A name the resolver refused: protocol "dns", its count as the packets.
fn dns_denial(name: String, count: u64) -> sbx_driver_api::pb::NetworkDenial {
    sbx_driver_api::pb::NetworkDenial {
        destination: name,
        protocol: "dns".into(),
        port: u32::from(resolver::PORT),
        packets: count,
    }
}

/// What a create's `SandboxSpec.network` asks of a host driver with `network` (or without
/// one): `None` for loopback only, else the allowlist as given (checked here too: a driver
/// never trusts that the gateway did).
pub fn requested(
    policy: Option<&sbx_driver_api::pb::NetworkPolicy>,
    network: Option<&std::sync::Arc<Network>>,
) -> Result<Option<Vec<String>>, sbx_driver_api::DriverError> {
    use sbx_driver_api::pb::NetworkMode;
    let Some(policy) = policy else {
        return Ok(None);
    };
    match NetworkMode::try_from(policy.mode) {
        Ok(NetworkMode::Unspecified) | Ok(NetworkMode::None) => {
            if !policy.allow.is_empty() {
                return Err(sbx_driver_api::DriverError::InvalidArgument(
                    "network mode none admits nothing: an allowlist needs mode policy".into(),
                ));
            }
            Ok(None)
        }
        Ok(NetworkMode::Policy) => {
            if network.is_none() {
                return Err(sbx_driver_api::DriverError::FailedPrecondition(
                    "this gateway has no sandbox network (sbxd serve --network-cidr): \
                     only network mode none"
                        .into(),
                ));
            }
            parse_allowlist(&policy.allow)
                .map_err(|e| sbx_driver_api::DriverError::InvalidArgument(e.to_string()))?;
            Ok(Some(policy.allow.clone()))
        }
        Err(_) => Err(sbx_driver_api::DriverError::InvalidArgument(format!(
            "network mode {} is not known",
            policy.mode
        ))),
    }
}

/// The driver contract's view of a sandbox's network.
pub fn status(
    network: Option<&Network>,
    id: Uuid,
    allow: Option<&Vec<String>>,
) -> Result<sbx_driver_api::pb::NetworkStatus, sbx_driver_api::DriverError> {
    use sbx_driver_api::pb;
    let mode = if allow.is_some() {
        pb::NetworkMode::Policy
    } else {
        pb::NetworkMode::None
    };
    let mut out = pb::NetworkStatus {
        policy: Some(pb::NetworkPolicy {
            mode: mode as i32,
            allow: allow.cloned().unwrap_or_default(),
        }),
        ..Default::default()
    };
    if let (Some(net), Some(_)) = (network, allow) {
        if let Some(addr) = net.address_of(id) {
            out.address = addr.to_string();
            out.gateway = net.gateway().to_string();
        }
        let denials = net
            .denials(id)
            .map_err(|e| sbx_driver_api::DriverError::Unavailable(e.to_string()))?;
        out.denials = denials.iter().take(100).map(pb_denial).collect();
        out.denials.extend(
            net.refused_names(id)
                .into_iter()
                .take(100)
                .map(|(name, count)| dns_denial(name, count)),
        );
    }
    Ok(out)
}

/// What [`cleanup`] removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Cleaned {
    pub table: bool,
    pub bridge: bool,
    /// Sandbox namespaces removed (with `force`).
    pub namespaces: Vec<String>,
}

/// The sandbox namespaces of network `name` on the host (`/run/netns/<name>-<uuid>`).
pub fn sandbox_namespaces(name: &str) -> Vec<String> {
    let prefix = format!("{name}-");
    let mut found: Vec<String> = std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix(&prefix)
                .is_some_and(|rest| Uuid::parse_str(rest).is_ok())
        })
        .collect();
    found.sort();
    found
}

/// Removes what network `name` left on the host once no gateway uses it: its nftables table
/// and its bridge. Refused while a gateway holds the name's lock or a resolver answers on the
/// bridge's address (a gateway, or its driver, still serves the network), and while sandbox
/// namespaces of it remain (their
/// workloads outlive sbxd and may still run) unless `force`, which removes those too.
pub fn cleanup(name: &str, force: bool) -> Result<Cleaned, NetworkError> {
    let bridge = format!("{name}0");
    let mut cleaned = Cleaned::default();
    // Held to the end (and its file removed then): no gateway opens the network while it is
    // being removed.
    let _lock = match lock_name(name) {
        Ok(lock) => lock,
        Err(NetworkError::InUse { holder, .. }) => {
            return Err(NetworkError::Config(format!(
                "an sbxd ({holder}) still serves network {name:?}; stop it first"
            )));
        }
        Err(e) => return Err(e),
    };
    if link::link_exists(&bridge) {
        let addrs: serde_json::Value =
            serde_json::from_str(&link::ip(&["-j", "-4", "addr", "show", "dev", &bridge])?)
                .unwrap_or(serde_json::Value::Null);
        let held: Vec<Ipv4Addr> = addrs
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|l| {
                l.get("addr_info")
                    .and_then(serde_json::Value::as_array)
                    .cloned()
                    .unwrap_or_default()
            })
            .filter_map(|a| {
                a.get("local")
                    .and_then(serde_json::Value::as_str)
                    .and_then(|s| s.parse().ok())
            })
            .collect();
        for addr in held {
            if let Err(e) = std::net::UdpSocket::bind((addr, RESOLVER_PORT))
                && e.kind() == std::io::ErrorKind::AddrInUse
            {
                return Err(NetworkError::Config(format!(
                    "a resolver answers on {addr}:{RESOLVER_PORT}: an sbxd (or its driver) still serves network {name:?}; stop it first"
                )));
            }
        }
    }
    let namespaces = sandbox_namespaces(name);
    if !namespaces.is_empty() && !force {
        return Err(NetworkError::Config(format!(
            "{} sandbox namespace(s) of network {name:?} remain ({}…): their workloads may still run; delete those sandboxes first (start sbxd, `sbx sandbox delete`), or --force to cut them off",
            namespaces.len(),
            namespaces[0]
        )));
    }
    for ns in namespaces {
        link::ip(&["netns", "delete", &ns])?;
        cleaned.namespaces.push(ns);
    }
    if nft::list("look for the table", &["list", "table", "inet", name]).is_ok() {
        nft::apply(
            "delete the table",
            vec![serde_json::json!({ "delete": { "table": { "family": "inet", "name": name } } })],
        )?;
        cleaned.table = true;
    }
    if link::link_exists(&bridge) {
        link::ip(&["link", "delete", "dev", &bridge])?;
        cleaned.bridge = true;
    }
    Ok(cleaned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_network_name_has_one_owner_at_a_time_named_by_its_pid() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: {LOCK_DIR} is root's");
            return;
        }
        let name = format!("lk{:05x}", std::process::id() & 0xfffff);
        let first = lock_name(&name).unwrap();
        let began = std::time::Instant::now();
        let err = lock_name(&name).unwrap_err();
        assert!(
            began.elapsed() >= LOCK_WAIT,
            "waited for the owner to let go"
        );
        let text = err.to_string();
        assert!(
            text.contains(&format!("pid {}", std::process::id())) && text.contains(&name),
            "{text}"
        );
        drop(first);
        // Free once the owner lets go; and a holder may remove the file (the network gone):
        // the next owner takes the one made again, not the removed one.
        let mut second = lock_name(&name).unwrap();
        second.keep = true;
        std::fs::remove_file(lock_path(&name)).unwrap();
        drop(second);
        let mut third = lock_name(&name).unwrap();
        third.keep = true;
        assert!(lock_path(&name).exists());
        drop(third);
        assert!(lock_path(&name).exists(), "kept");
        // Not kept: the file goes with the lock.
        drop(lock_name(&name).unwrap());
        assert!(!lock_path(&name).exists());
    }
}
