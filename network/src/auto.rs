//! The choice `--network-cidr auto` makes: the first of its ranges that overlaps nothing the
//! host routes or holds an address in (another gateway's bridge and resolver included),
//! kept for later starts, made under a host-wide lock so that two gateways starting at once
//! choose in turn; and whose bridge is in the way when none is free.

use std::net::Ipv4Addr;
use std::path::Path;

use crate::{LOCK_DIR, NetworkError, io, link, lock_path, parse_cidr, policy};

/// The networks `--network-cidr auto` tries, in this order: the first that overlaps nothing
/// the host routes or holds an address in is taken (`--network-auto-ranges` gives others).
pub const AUTO_CANDIDATES: &[&str] = &[
    "10.213.0.0/16",
    "10.214.0.0/16",
    "10.215.0.0/16",
    "172.29.0.0/16",
    "172.30.0.0/16",
    "192.168.213.0/24",
];

/// The file under a network's state directory that keeps what `auto` chose, so that a
/// restarted gateway (and its sandboxes' leases) keep the same network.
pub const AUTO_FILE: &str = "auto-cidr";

/// What of the host's is in `net/len`'s way, among `host` ([`link::host_networks`]).
fn in_the_way(net: Ipv4Addr, len: u8, host: &[(Ipv4Addr, u8, String)]) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    for (other, other_len, what) in host {
        if policy::overlaps(net, len, *other, *other_len) && !found.contains(what) {
            found.push(what.clone());
        }
    }
    found
}

/// What `--network-cidr auto` means on this host for the network named `name` whose state
/// is `state_dir`, trying `candidates` in order: the choice made before (kept in
/// [`AUTO_FILE`]) while nothing else on the host holds an address in it, else the first
/// candidate nothing on the host routes or holds an address in (another gateway's bridge
/// and resolver address included), recorded (fsynced) first. A kept choice that is now in
/// another's way is chosen again only when no sandbox holds an address on it (a lease);
/// with leases, and when every candidate is taken, the error names what holds each range.
/// Two gateways choosing at once are kept apart by [`ChoiceLock`].
pub fn auto_cidr(
    state_dir: &Path,
    name: &str,
    candidates: &[String],
) -> Result<String, NetworkError> {
    let file = state_dir.join(AUTO_FILE);
    let bridge = format!("{name}0");
    let host = link::host_networks(&bridge)?;
    if let Ok(kept) = std::fs::read_to_string(&file) {
        let kept = kept.trim().to_string();
        let (net, len) = parse_cidr(&kept)?;
        let blocking = in_the_way(net, len, &host);
        if blocking.is_empty() {
            return Ok(kept);
        }
        let leases = std::fs::read_dir(state_dir.join("leases"))
            .map(|d| d.count())
            .unwrap_or(0);
        if leases > 0 {
            return Err(NetworkError::Config(format!(
                "the network --network-cidr auto chose before, {kept} (kept in {}, where {leases} sandbox address(es) are leased), is now in the way of {}: stop what holds it, or give --network-cidr CIDR (the sandboxes move to it when restarted)",
                file.display(),
                blocking.join(", ")
            )));
        }
        tracing::info!(kept = %kept, held_by = %blocking.join(", "), "the network auto chose before is now another's and no sandbox is on it: choosing again");
    }
    let mut taken = Vec::new();
    let mut free = None;
    for c in candidates {
        let (net, len) = parse_cidr(c)?;
        let blocking = in_the_way(net, len, &host);
        if blocking.is_empty() {
            free = Some(c.clone());
            break;
        }
        taken.push(format!("{c} (in the way of {})", blocking.join(", ")));
    }
    let Some(free) = free else {
        return Err(NetworkError::Config(format!(
            "every network --network-cidr auto tries is taken on this host: {}; give a free one with --network-cidr CIDR (or the ones to try with --network-auto-ranges)",
            taken.join("; ")
        )));
    };
    std::fs::create_dir_all(state_dir)
        .and_then(|()| {
            use std::io::Write;
            let tmp = state_dir.join(format!("{AUTO_FILE}.tmp"));
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(free.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &file)
        })
        .map_err(|e| {
            NetworkError::Config(format!(
                "recording the chosen network in {}: {e}",
                file.display()
            ))
        })?;
    Ok(free)
}

/// What `dev` is, when it is the bridge of an sbx network (`<name>0` with a lock file
/// under [`LOCK_DIR`]): `: the bridge of sbx network "NAME", served by pid N`, or that no
/// running sbxd serves it (and how to remove it); else nothing.
pub fn bridge_owner(dev: &str) -> String {
    let Some(name) = dev.strip_suffix('0') else {
        return String::new();
    };
    let Ok(text) = std::fs::read_to_string(lock_path(name)) else {
        return String::new();
    };
    match text.trim().parse::<u32>() {
        Ok(pid) if Path::new(&format!("/proc/{pid}")).exists() => {
            format!(": the bridge of sbx network {name:?}, served by pid {pid}")
        }
        _ => format!(
            ": the bridge of sbx network {name:?}, which no running sbxd serves (`sbxd network cleanup --network-name {name}` removes it)"
        ),
    }
}

/// Where [`ChoiceLock`] is: in [`LOCK_DIR`], under a name no network can have.
const CHOICE_LOCK: &str = ".choice.lock";

/// How long a gateway waits for another that is choosing and setting up its network.
const CHOICE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The host-wide lock held while a gateway chooses its network's range and sets it up
/// ([`NetworkArgs::open`]): two gateways starting at once would otherwise both see a range
/// free and both put its first address on their bridges (the second's resolver then cannot
/// listen there).
#[derive(Debug)]
pub struct ChoiceLock {
    _held: nix::fcntl::Flock<std::fs::File>,
}

impl ChoiceLock {
    /// Takes it, waiting up to [`CHOICE_WAIT`] for the gateway that holds it.
    pub fn take() -> Result<ChoiceLock, NetworkError> {
        use nix::errno::Errno;
        use nix::fcntl::{Flock, FlockArg};
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(LOCK_DIR)
            .map_err(io(format!("creating {LOCK_DIR}")))?;
        let path = Path::new(LOCK_DIR).join(CHOICE_LOCK);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io(format!("opening {}", path.display())))?;
        let deadline = std::time::Instant::now() + CHOICE_WAIT;
        loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(held) => return Ok(ChoiceLock { _held: held }),
                Err((back, Errno::EWOULDBLOCK)) if std::time::Instant::now() < deadline => {
                    file = back;
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err((_, e)) => {
                    return Err(NetworkError::Config(format!(
                        "another gateway held {} for {CHOICE_WAIT:?} while setting up its network ({e})",
                        path.display()
                    )));
                }
            }
        }
    }
}
