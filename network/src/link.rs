//! Links, addresses, routes and network namespaces, through iproute2's `ip` (argv, never a
//! shell), and the host's routes read back with `ip -j`.

use std::net::Ipv4Addr;
use std::process::Command;

use serde_json::Value;

/// Why an `ip` command failed: the command and what it said.
#[derive(Debug, thiserror::Error)]
#[error("ip {args}: {detail}")]
pub struct IpError {
    pub args: String,
    pub detail: String,
}

/// `ip ARGS…`; its stdout.
pub fn ip(args: &[&str]) -> Result<String, IpError> {
    iproute2("ip", args)
}

/// `tc -n NETNS ARGS…`: traffic control inside a named network namespace.
pub fn tc_in(netns: &str, args: &[&str]) -> Result<String, IpError> {
    let mut all = vec!["-n", netns];
    all.extend_from_slice(args);
    iproute2("tc", &all)
}

/// One of iproute2's programs with these arguments; its stdout.
fn iproute2(program: &str, args: &[&str]) -> Result<String, IpError> {
    let err = |detail: String| IpError {
        args: match program {
            "ip" => args.join(" "),
            _ => format!("({program}) {}", args.join(" ")),
        },
        detail,
    };
    let out = Command::new(program).args(args).output().map_err(|e| {
        err(format!(
            "cannot run {program} (install Debian's iproute2): {e}"
        ))
    })?;
    if !out.status.success() {
        let text = String::from_utf8_lossy(&out.stderr);
        return Err(err(format!(
            "{} ({})",
            text.trim().chars().take(300).collect::<String>(),
            out.status
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip -n NETNS ARGS…`: the same inside a named network namespace.
pub fn ip_in(netns: &str, args: &[&str]) -> Result<String, IpError> {
    let mut all = vec!["-n", netns];
    all.extend_from_slice(args);
    ip(&all)
}

/// Whether the link exists (in the host's namespace).
pub fn link_exists(name: &str) -> bool {
    ip(&["link", "show", "dev", name]).is_ok()
}

/// Whether the named network namespace exists.
pub fn netns_exists(name: &str) -> bool {
    std::path::Path::new("/run/netns").join(name).exists()
}

/// Every IPv4 network the host routes or holds an address in (an address's own route, in
/// table `local`, stays while its link is down), except those on `except` (the gateway's
/// own bridge), as (network, prefix, where). Where a link is the bridge of another sbx
/// network, `where` says so, and which sbxd serves it ([`crate::bridge_owner`]).
pub fn host_networks(except: &str) -> Result<Vec<(Ipv4Addr, u8, String)>, IpError> {
    let mut found = Vec::new();
    let mut routes_on: Vec<(Ipv4Addr, u8, String)> = Vec::new();
    let routes: Value = serde_json::from_str(&ip(&["-j", "-4", "route", "show", "table", "all"])?)
        .map_err(|e| IpError {
            args: "-j route".into(),
            detail: e.to_string(),
        })?;
    for r in routes.as_array().cloned().unwrap_or_default() {
        let dev = r
            .get("dev")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let dst = r.get("dst").and_then(Value::as_str).unwrap_or_default();
        let kind = r.get("type").and_then(Value::as_str).unwrap_or("unicast");
        if dev == except || dst == "default" || dst.is_empty() || kind == "broadcast" {
            continue;
        }
        let (addr, len) = match dst.split_once('/') {
            Some((a, l)) => (a, l.parse().unwrap_or(32)),
            None => (dst, 32),
        };
        if let Ok(a) = addr.parse::<Ipv4Addr>() {
            if a.is_loopback() {
                continue;
            }
            found.push((
                a,
                len,
                format!("route {dst} dev {dev}{}", crate::bridge_owner(&dev)),
            ));
            routes_on.push((a, len, dev));
        }
    }
    // A host route (an address's own, in table local) inside a network route of its own link
    // says nothing that route does not.
    let covered = |i: usize| {
        let (a, len, dev) = &routes_on[i];
        *len == 32
            && routes_on.iter().any(|(net, l, on)| {
                on == dev && *l < 32 && crate::policy::overlaps(*a, 32, *net, *l)
            })
    };
    let keep: Vec<bool> = (0..found.len()).map(|i| !covered(i)).collect();
    let mut kept = keep.iter();
    found.retain(|_| *kept.next().unwrap_or(&true));
    Ok(found)
}

/// A route or an interface's network shorter than this is no network the host is attached to
/// but a catch-all (a VPN's `0.0.0.0/1 dev tun0`, a default route on a point-to-point link):
/// left out (here and by the resolver, [`crate::resolver`]), or every public address would be
/// "local".
pub const ATTACHED_MIN_PREFIX: u8 = 8;

/// The networks of the host's on-link routes (no gateway: a network it is attached to, such
/// as another bridge, a container's or pod's veth, the LAN) in every routing table, from
/// `ip -j -4 route show table all`: unicast routes only (not local, broadcast, blackhole or
/// unreachable ones), none shorter than [`ATTACHED_MIN_PREFIX`] (a catch-all
/// such as a VPN's `0.0.0.0/1 dev tun0` is no attached network) and no default route.
pub fn on_link_routes() -> Result<Vec<(Ipv4Addr, u8)>, IpError> {
    let text = ip(&["-j", "-4", "route", "show", "table", "all"])?;
    let routes: Value = serde_json::from_str(&text).map_err(|e| IpError {
        args: "-j -4 route show table all".into(),
        detail: e.to_string(),
    })?;
    Ok(routes
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            let kind = r.get("type").and_then(Value::as_str).unwrap_or("unicast");
            if kind != "unicast" || r.get("gateway").is_some() || r.get("nexthops").is_some() {
                return None;
            }
            let dst = r.get("dst").and_then(Value::as_str)?;
            let (addr, len) = match dst.split_once('/') {
                Some((a, l)) => (a, l.parse::<u8>().ok()?),
                None => (dst, 32),
            };
            let addr: Ipv4Addr = addr.parse().ok()?;
            (ATTACHED_MIN_PREFIX..=32)
                .contains(&len)
                .then_some((addr, len))
        })
        .collect())
}
