//! An egress policy's allowlist: parsed once, at the API boundary and again by the driver
//! that enforces it, into entries the firewall can express.
//!
//! An entry is `CIDR[:PORT[-PORT]][/tcp|/udp]`: an IPv4 address or network (`10.1.2.3`,
//! `10.0.0.0/8`), optionally a port or an inclusive port range, optionally a protocol. With
//! no port the entry admits every protocol to those addresses (ICMP too); with a port and no
//! protocol it admits both TCP and UDP. Or `HOSTNAME[:PORT[-PORT]][/tcp|/udp]`
//! (`api.example.test:443`, `*.example.test`): the gateway's resolver (`resolver`) answers
//! the sandbox's queries for that name (a leading `*.` is any name below it) and admits, to
//! those ports, exactly the addresses it answered, for the answer's TTL. A name the list does
//! not hold is refused by the resolver, so DNS is no way out either.

use std::fmt;
use std::net::Ipv4Addr;

/// At most this many entries in one policy (each becomes one firewall rule, evaluated only
/// for a connection's first packet).
pub const MAX_ALLOW_ENTRIES: usize = 10_000;
/// At most this many bytes in one entry.
pub const MAX_ENTRY_BYTES: usize = 128;
/// At most this many distinct (protocol, port range) combinations in one policy: each is one
/// firewall rule over a set of addresses, so a policy update stays one quick transaction
/// whatever the number of addresses.
pub const MAX_PORT_CLASSES: usize = 256;

/// Entries that admit the same protocols and ports, with their networks: one rule over one
/// address set in the firewall.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Class {
    /// `None`: every protocol and port.
    pub ports: Option<(u16, u16)>,
    /// With `ports`: `None` is TCP and UDP.
    pub protocol: Option<Protocol>,
    pub networks: Vec<(Ipv4Addr, u8)>,
    /// Hostname patterns (lowercase; `*.` leading) whose resolved addresses this class admits.
    pub names: Vec<String>,
}

/// The entries grouped by what they admit, in a stable order; within a class, a network
/// inside another of the class is left out (CIDR networks nest or are disjoint, so what is
/// left has no overlap, as the firewall's interval sets require).
pub fn classes(entries: &[AllowEntry]) -> Vec<Class> {
    type Key = (Option<(u16, u16)>, Option<Protocol>);
    type Dests = (Vec<(Ipv4Addr, u8)>, Vec<String>);
    let mut by: std::collections::BTreeMap<Key, Dests> = Default::default();
    for e in entries {
        let (nets, names) = by.entry((e.ports, e.protocol)).or_default();
        match &e.target {
            Target::Net { addr, prefix } => nets.push((*addr, *prefix)),
            Target::Name(n) => names.push(n.clone()),
        }
    }
    by.into_iter()
        .map(|((ports, protocol), (mut nets, mut names))| {
            names.sort();
            names.dedup();
            nets.sort_by_key(|(a, len)| (*len, *a));
            let mut kept: std::collections::HashSet<(u32, u8)> = Default::default();
            let mut networks = Vec::with_capacity(nets.len());
            for (addr, len) in nets {
                let bits = u32::from(addr);
                let covered = (0..=len).any(|l| {
                    let mask = if l == 0 { 0 } else { u32::MAX << (32 - l) };
                    kept.contains(&(bits & mask, l))
                });
                if !covered {
                    kept.insert((bits, len));
                    networks.push((addr, len));
                }
            }
            Class {
                ports,
                protocol,
                networks,
                names,
            }
        })
        .collect()
}

/// The transport protocol an entry admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

/// What an entry admits traffic to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// A network address (host bits zero) and its prefix length.
    Net { addr: Ipv4Addr, prefix: u8 },
    /// A hostname, lowercase, without a trailing dot; `*.example.test` is every name below
    /// `example.test` (not `example.test` itself).
    Name(String),
}

/// Whether `name` (lowercase, no trailing dot) is what `pattern` admits.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => name
            .strip_suffix(suffix)
            .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        None => pattern == name,
    }
}

/// One parsed allowlist entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllowEntry {
    pub target: Target,
    /// An inclusive port range; `None` admits every port and protocol.
    pub ports: Option<(u16, u16)>,
    /// `None` with `ports` set admits TCP and UDP.
    pub protocol: Option<Protocol>,
}

impl fmt::Display for AllowEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.target {
            Target::Net { addr, prefix: 32 } => write!(f, "{addr}")?,
            Target::Net { addr, prefix } => write!(f, "{addr}/{prefix}")?,
            Target::Name(n) => write!(f, "{n}")?,
        }
        match self.ports {
            Some((lo, hi)) if lo == hi => write!(f, ":{lo}")?,
            Some((lo, hi)) => write!(f, ":{lo}-{hi}")?,
            None => {}
        }
        if let Some(p) = self.protocol {
            write!(f, "/{}", p.name())?;
        }
        Ok(())
    }
}

/// Why an entry or a policy was refused; the message quotes at most a short, escaped prefix
/// of the entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("network allow entry {entry}: {reason}")]
pub struct PolicyError {
    pub entry: String,
    pub reason: String,
}

fn refuse(raw: &str, reason: impl Into<String>) -> PolicyError {
    let mut shown: String = raw
        .chars()
        .take(40)
        .collect::<String>()
        .escape_debug()
        .collect();
    if raw.chars().count() > 40 {
        shown.push('…');
    }
    PolicyError {
        entry: format!("\"{shown}\""),
        reason: reason.into(),
    }
}

fn parse_port(raw: &str, text: &str) -> Result<u16, PolicyError> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) || text.len() > 5 {
        return Err(refuse(
            raw,
            format!("port {text:?} is not a number from 1 to 65535"),
        ));
    }
    match text.parse::<u32>() {
        Ok(p) if (1..=65535).contains(&p) => Ok(p as u16),
        _ => Err(refuse(
            raw,
            format!("port {text} is out of range (1 to 65535)"),
        )),
    }
}

fn looks_like_hostname(host: &str) -> bool {
    host.bytes().any(|b| b.is_ascii_alphabetic() || b == b'*')
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'*')
}

/// Checks a hostname (RFC 1123 labels, optionally `*.` first; the entry's bound keeps it
/// short of DNS's 253 bytes) and gives
/// it lowercase without a trailing dot.
fn parse_hostname(raw: &str, host: &str) -> Result<String, PolicyError> {
    let name = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    let rest = name.strip_prefix("*.").unwrap_or(&name);
    if rest.is_empty() {
        return Err(refuse(
            raw,
            "a wildcard needs a domain below it (*.example.test)",
        ));
    }
    for label in rest.split('.') {
        let ok = (1..=63).contains(&label.len())
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !ok {
            let why = if label.contains('*') {
                "a wildcard is only `*.` at the start".to_string()
            } else {
                format!(
                    "{label:?} is not a hostname label (1 to 63 of a-z, 0-9 and -, not starting \
                     or ending with -)"
                )
            };
            return Err(refuse(raw, why));
        }
    }
    if rest
        .rsplit('.')
        .next()
        .is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(refuse(raw, format!("{host:?} is not an IPv4 address")));
    }
    Ok(name)
}

/// Parses one entry.
pub fn parse_entry(raw: &str) -> Result<AllowEntry, PolicyError> {
    if raw.is_empty() {
        return Err(refuse(
            raw,
            "is empty (expected CIDR[:PORT[-PORT]][/tcp|/udp])",
        ));
    }
    if raw.len() > MAX_ENTRY_BYTES {
        return Err(refuse(
            raw,
            format!("is longer than {MAX_ENTRY_BYTES} bytes"),
        ));
    }
    let (rest, protocol) = if let Some(r) = raw.strip_suffix("/tcp") {
        (r, Some(Protocol::Tcp))
    } else if let Some(r) = raw.strip_suffix("/udp") {
        (r, Some(Protocol::Udp))
    } else {
        (raw, None)
    };
    if rest.contains('[') || rest.matches(':').count() > 1 {
        return Err(refuse(
            raw,
            "IPv6 is not supported: sandboxes have IPv4 addresses only",
        ));
    }
    let (net, ports) = match rest.split_once(':') {
        Some((net, ports)) => {
            let range = match ports.split_once('-') {
                Some((lo, hi)) => (parse_port(raw, lo)?, parse_port(raw, hi)?),
                None => {
                    let p = parse_port(raw, ports)?;
                    (p, p)
                }
            };
            if range.0 > range.1 {
                return Err(refuse(
                    raw,
                    format!("port range {}-{} is reversed", range.0, range.1),
                ));
            }
            (net, Some(range))
        }
        None => (rest, None),
    };
    if protocol.is_some() && ports.is_none() {
        return Err(refuse(raw, "a protocol needs a port (CIDR:PORT/tcp)"));
    }
    let (host, prefix) = match net.split_once('/') {
        Some((host, len)) => {
            let prefix = match len.parse::<u8>() {
                Ok(p) if p <= 32 && !len.is_empty() && len.bytes().all(|b| b.is_ascii_digit()) => p,
                _ => return Err(refuse(raw, format!("prefix length {len:?} is not 0 to 32"))),
            };
            (host, prefix)
        }
        None => (net, 32),
    };
    if host.is_empty() {
        return Err(refuse(raw, "has no address or hostname"));
    }
    let addr: Ipv4Addr = match host.parse() {
        Ok(a) => a,
        Err(_) if looks_like_hostname(host) && !net.contains('/') => {
            return Ok(AllowEntry {
                target: Target::Name(parse_hostname(raw, host)?),
                ports,
                protocol,
            });
        }
        Err(_) if looks_like_hostname(host) => {
            return Err(refuse(raw, "a hostname has no prefix length"));
        }
        Err(_) => return Err(refuse(raw, format!("{host:?} is not an IPv4 address"))),
    };
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    let bits = u32::from(addr);
    if bits & !mask != 0 {
        return Err(refuse(
            raw,
            format!(
                "{addr}/{prefix} has host bits set (the network is {}/{prefix})",
                Ipv4Addr::from(bits & mask)
            ),
        ));
    }
    Ok(AllowEntry {
        target: Target::Net { addr, prefix },
        ports,
        protocol,
    })
}

/// Parses a whole allowlist: every entry, at most [`MAX_ALLOW_ENTRIES`], duplicates removed,
/// in a stable order.
pub fn parse_allowlist<S: AsRef<str>>(entries: &[S]) -> Result<Vec<AllowEntry>, PolicyError> {
    if entries.len() > MAX_ALLOW_ENTRIES {
        return Err(PolicyError {
            entry: format!("list of {}", entries.len()),
            reason: format!("has more than {MAX_ALLOW_ENTRIES} entries"),
        });
    }
    let mut parsed = entries
        .iter()
        .map(|e| parse_entry(e.as_ref()))
        .collect::<Result<Vec<_>, _>>()?;
    parsed.sort();
    parsed.dedup();
    Ok(parsed)
}

/// Whether `addr` lies in `net/prefix`.
pub fn contains(net: Ipv4Addr, prefix: u8, addr: Ipv4Addr) -> bool {
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    u32::from(net) & mask == u32::from(addr) & mask
}

/// Whether two networks share any address.
pub fn overlaps(a: Ipv4Addr, a_len: u8, b: Ipv4Addr, b_len: u8) -> bool {
    let len = a_len.min(b_len);
    contains(a, len, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_to_what_they_say() {
        let e = parse_entry("10.1.2.3:443").unwrap();
        assert_eq!(
            (e.target, e.ports, e.protocol),
            (
                Target::Net {
                    addr: "10.1.2.3".parse().unwrap(),
                    prefix: 32
                },
                Some((443, 443)),
                None
            )
        );
        let e = parse_entry("10.0.0.0/8:80-90/tcp").unwrap();
        assert_eq!((e.ports, e.protocol), (Some((80, 90)), Some(Protocol::Tcp)));
        assert!(matches!(e.target, Target::Net { prefix: 8, .. }));
        let e = parse_entry("API.Example.test.:443/tcp").unwrap();
        assert_eq!(e.target, Target::Name("api.example.test".into()));
        assert_eq!(e.to_string(), "api.example.test:443/tcp");
        assert_eq!(
            parse_entry("*.example.test").unwrap().target,
            Target::Name("*.example.test".into())
        );
        let e = parse_entry("192.168.0.0/16").unwrap();
        assert_eq!((e.ports, e.protocol), (None, None));
        assert_eq!(
            parse_entry("10.0.0.1:53/udp").unwrap().to_string(),
            "10.0.0.1:53/udp"
        );
        assert_eq!(parse_entry("0.0.0.0/0").unwrap().to_string(), "0.0.0.0/0");
    }

    #[test]
    fn malformed_entries_are_refused_with_their_reason() {
        for (bad, why) in [
            ("", "empty"),
            ("10.0.0.0/33", "prefix length"),
            ("10.0.0.1/8", "host bits"),
            ("10.0.0.256", "not an IPv4"),
            ("10.0.0.1:0", "out of range"),
            ("10.0.0.1:65536", "out of range"),
            ("10.0.0.1:", "not a number"),
            ("10.0.0.1:90-80", "reversed"),
            ("10.0.0.1/tcp", "needs a port"),
            (":80", "no address"),
            ("api.example.test/24:443", "no prefix length"),
            ("a..example.test", "not a hostname label"),
            ("-a.example.test", "not a hostname label"),
            ("a*.example.test", "wildcard"),
            ("*", "wildcard"),
            ("*.", "wildcard"),
            ("example.1", "not an IPv4"),
            ("[::1]:80", "IPv6"),
            ("fd00::1", "IPv6"),
            ("10.0.0.1:80/sctp", "not a number"),
        ] {
            let err = parse_entry(bad).expect_err(bad);
            assert!(err.to_string().contains(why), "{bad}: {err}");
        }
        let long = "1".repeat(10_000);
        let err = parse_entry(&long).unwrap_err().to_string();
        assert!(err.len() < 200, "the message quotes a short prefix: {err}");
    }

    #[test]
    fn names_and_wildcards_match_what_they_say() {
        assert!(name_matches("api.example.test", "api.example.test"));
        assert!(!name_matches("api.example.test", "xapi.example.test"));
        assert!(name_matches("*.example.test", "a.example.test"));
        assert!(name_matches("*.example.test", "b.a.example.test"));
        assert!(!name_matches("*.example.test", "example.test"));
        assert!(!name_matches("*.example.test", "aexample.test"));
        let label = format!("{}.test", "a".repeat(64));
        assert!(parse_entry(&label).is_err(), "a label is at most 63 bytes");
    }

    #[test]
    fn a_list_is_bounded_and_deduplicated() {
        let many: Vec<String> = (0..=MAX_ALLOW_ENTRIES)
            .map(|i| format!("10.{}.{}.1:80", i / 256, i % 256))
            .collect();
        assert!(parse_allowlist(&many).is_err());
        let ok = parse_allowlist(&many[..MAX_ALLOW_ENTRIES]).unwrap();
        assert_eq!(ok.len(), MAX_ALLOW_ENTRIES);
        assert_eq!(
            parse_allowlist(&["10.0.0.1:80", "10.0.0.1:80"])
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn overlap_and_containment() {
        let a: Ipv4Addr = "10.88.0.0".parse().unwrap();
        assert!(overlaps(a, 16, "10.88.3.0".parse().unwrap(), 24));
        assert!(overlaps("10.0.0.0".parse().unwrap(), 8, a, 16));
        assert!(!overlaps(a, 16, "10.89.0.0".parse().unwrap(), 16));
        assert!(contains(a, 16, "10.88.255.1".parse().unwrap()));
    }
}
