//! The gateway's resolver: how hostname entries of an egress policy are enforced.
//!
//! A networked sandbox's `/etc/resolv.conf` names the bridge's address; there, on UDP port
//! 53, this resolver answers it — and only it, by its leased source address, which the
//! sandbox cannot change (its namespace belongs to host root). For a name its allowlist holds
//! (exactly, or below a `*.` entry) the query goes to the upstream resolver (`sbxd serve
//! --network-dns`, else the host's first IPv4 nameserver), and before the answer goes back to
//! the sandbox, each IPv4 address in it is admitted, to the ports of the entries that named
//! it, in the sandbox's `h_<id>_<k>` sets — for the answer's TTL, kept between one minute
//! and an hour (a connection already made outlives it: established traffic is not checked
//! again). Every other name is answered REFUSED and recorded as a denial: DNS is no way out
//! of the policy either.
//!
//! An answer steers the sandbox nowhere its list does not name (DNS rebinding): an address
//! is admitted only if it lies outside the sandbox network (the bridge and every neighbour),
//! the host's own addresses, loopback, link-local, multicast, "this network" and the reserved
//! range ([`forbidden`]); such records are taken out of the reply, and an answer left with
//! none is REFUSED and recorded. Only an explicit CIDR entry reaches those addresses. Only the
//! question goes upstream — a fresh query of the resolver's own, never the sandbox's
//! additional or authority records (a payload smuggled out inside a query for an allowed
//! name stays here).
//!
//! Messages are read and written with `hickory-proto` (the DNS wire format, well kept, no
//! resolver of its own pulled in); queries are served by a small pool of threads: at most
//! [`MAX_IN_FLIGHT`] at once, and at most [`MAX_IN_FLIGHT_PER_SANDBOX`] of one sandbox, so a
//! sandbox that floods its resolver waits for its own answers, not the others for theirs (a
//! query over either bound is dropped at once, and the sandbox's resolver asks again). UDP
//! only: an answer too large for a datagram comes back truncated, as the upstream sent it.

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{RData, RecordType};
use uuid::Uuid;

use super::nft;
use super::policy::{self, AllowEntry};
use sbx_driver_api::locked;

/// The resolver's port on the bridge's address ([`crate::RESOLVER_PORT`]).
pub const PORT: u16 = crate::RESOLVER_PORT;
/// Queries being answered at once; one more is dropped.
pub const MAX_IN_FLIGHT: usize = 64;
/// Queries of one sandbox being answered at once; one more of it is dropped.
pub const MAX_IN_FLIGHT_PER_SANDBOX: usize = 4;
/// How long the upstream has to answer (once, then once more).
const UPSTREAM_TIMEOUT: Duration = Duration::from_millis(1500);
/// An admitted address is kept at least this long, whatever the answer's TTL…
pub const MIN_TTL: u64 = 60;
/// …and at most this long.
pub const MAX_TTL: u64 = 3600;
/// Names refused per sandbox that are remembered (with a count each).
const MAX_REFUSED_NAMES: usize = 100;
/// Admitted (address, name) pairs remembered per sandbox.
const MAX_ADMITTED: usize = 4096;

/// A sandbox the resolver answers: its table key and, per class of its allowlist (the
/// `k` of its `h_<key>_<k>` sets), the class's name patterns.
#[derive(Debug, Clone)]
struct Client {
    id: Uuid,
    key: String,
    classes: Vec<Vec<String>>,
}

/// An admitted address, the name it was answered for, and until when.
type Admission = (Ipv4Addr, String, Instant);

/// What the resolver and the network share.
#[derive(Debug)]
pub struct Shared {
    table: nft::Table,
    upstream: Option<SocketAddr>,
    /// By source address. Held across an admission's nft transaction and a policy's, so an
    /// answer never lands in a class of a list that has since been replaced.
    clients: Mutex<HashMap<Ipv4Addr, Client>>,
    admitted: Mutex<HashMap<Uuid, Vec<Admission>>>,
    refused: Mutex<HashMap<Uuid, BTreeMap<String, u64>>>,
}

impl Shared {
    pub fn new(table: nft::Table, upstream: Option<SocketAddr>) -> Shared {
        Shared {
            table,
            upstream,
            clients: Mutex::new(HashMap::new()),
            admitted: Mutex::new(HashMap::new()),
            refused: Mutex::new(HashMap::new()),
        }
    }

    /// Remembers answers found in the table at startup (seconds left each).
    pub fn restore_admitted(&self, found: HashMap<String, Vec<(Ipv4Addr, String, u64)>>) {
        let now = Instant::now();
        let mut admitted = locked(&self.admitted);
        for (key, list) in found {
            let Ok(id) = Uuid::parse_str(&key) else {
                continue;
            };
            admitted.insert(
                id,
                list.into_iter()
                    .map(|(a, n, left)| (a, n, now + Duration::from_secs(left)))
                    .collect(),
            );
        }
    }

    /// The answers still valid for `id`: (address, name, seconds left).
    pub fn still_admitted(&self, id: Uuid) -> Vec<(Ipv4Addr, String, u64)> {
        let now = Instant::now();
        let mut admitted = locked(&self.admitted);
        let Some(list) = admitted.get_mut(&id) else {
            return Vec::new();
        };
        list.retain(|(_, _, until)| *until > now);
        list.iter()
            .map(|(a, n, until)| (*a, n.clone(), until.duration_since(now).as_secs().max(1)))
            .collect()
    }

    /// Runs `apply` (the nft transaction of a new list) with the clients held, then answers
    /// `address` by `entries`' names.
    pub fn with_policy<T>(
        &self,
        id: Uuid,
        address: Ipv4Addr,
        entries: &[AllowEntry],
        apply: impl FnOnce() -> Result<T, nft::NftError>,
    ) -> Result<T, nft::NftError> {
        let mut clients = locked(&self.clients);
        let out = apply()?;
        clients.insert(
            address,
            Client {
                id,
                key: id.simple().to_string(),
                classes: policy::classes(entries)
                    .into_iter()
                    .map(|c| c.names)
                    .collect(),
            },
        );
        Ok(out)
    }

    /// Forgets `id` (detached).
    pub fn forget(&self, id: Uuid, address: Option<Ipv4Addr>) {
        if let Some(a) = address {
            locked(&self.clients).remove(&a);
        }
        locked(&self.admitted).remove(&id);
        locked(&self.refused).remove(&id);
    }

    /// The names refused to `id`, most asked first.
    pub fn refused(&self, id: Uuid) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = locked(&self.refused)
            .get(&id)
            .map(|m| m.iter().map(|(n, c)| (n.clone(), *c)).collect())
            .unwrap_or_default();
        out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        out
    }

    fn refuse(&self, id: Uuid, name: &str) {
        // The name is the sandbox's choice: kept short and printable.
        let name: String = name
            .chars()
            .take(253)
            .map(|c| if c.is_ascii_graphic() { c } else { '?' })
            .collect();
        let name = name.as_str();
        let mut refused = locked(&self.refused);
        let names = refused.entry(id).or_default();
        if let Some(n) = names.get_mut(name) {
            *n += 1;
        } else if names.len() < MAX_REFUSED_NAMES {
            names.insert(name.to_string(), 1);
        }
    }

    /// Admits `addrs` (answered for `name`) to `address`'s classes that name it; false if the
    /// sandbox is gone or nothing of its list names it any more.
    fn admit(
        &self,
        address: Ipv4Addr,
        name: &str,
        addrs: &[Ipv4Addr],
        ttl: u64,
    ) -> Result<bool, nft::NftError> {
        let clients = locked(&self.clients);
        let Some(client) = clients.get(&address) else {
            return Ok(false);
        };
        let classes: Vec<usize> = matching(client, name).collect();
        if classes.is_empty() {
            return Ok(false);
        }
        // Asked again within the first half of an admission's life: it stands, and no nft
        // transaction (a process, milliseconds) is spent on it — a sandbox asking the same
        // name in a loop costs the gateway next to nothing.
        let now = Instant::now();
        let fresh = |a: &Ipv4Addr| {
            locked(&self.admitted).get(&client.id).is_some_and(|list| {
                list.iter().any(|(x, n, until)| {
                    x == a && n == name && *until > now + Duration::from_secs(ttl / 2)
                })
            })
        };
        if addrs.iter().all(fresh) {
            return Ok(true);
        }
        let cmds: Vec<_> = classes
            .into_iter()
            .map(|k| self.table.admit(&client.key, k, name, addrs, ttl))
            .collect();
        nft::apply("admit a resolved address", cmds)?;
        let until = Instant::now() + Duration::from_secs(ttl);
        let mut admitted = locked(&self.admitted);
        let list = admitted.entry(client.id).or_default();
        list.retain(|(a, n, _)| !(n == name && addrs.contains(a)));
        list.extend(addrs.iter().map(|a| (*a, name.to_string(), until)));
        if list.len() > MAX_ADMITTED {
            list.sort_by_key(|(_, _, until)| std::cmp::Reverse(*until));
            list.truncate(MAX_ADMITTED);
        }
        Ok(true)
    }
}

fn matching<'a>(client: &'a Client, name: &'a str) -> impl Iterator<Item = usize> + 'a {
    client
        .classes
        .iter()
        .enumerate()
        .filter(move |(_, names)| names.iter().any(|p| policy::name_matches(p, name)))
        .map(|(k, _)| k)
}

/// The running resolver; dropped, it stops (within a quarter second).
#[derive(Debug)]
pub struct Resolver {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Resolver {
    /// Binds `address`:53 (UDP) and serves it.
    pub fn start(address: Ipv4Addr, shared: Arc<Shared>) -> std::io::Result<Resolver> {
        let socket = UdpSocket::bind((address, PORT))?;
        socket.set_read_timeout(Some(Duration::from_millis(250)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let in_flight = Arc::new(InFlight::default());
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("sbx-resolver".into())
                .spawn(move || serve(socket, shared, stop, in_flight))?
        };
        Ok(Resolver {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Resolver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The queries being answered: in all, and per source address.
#[derive(Debug, Default)]
struct InFlight {
    all: AtomicUsize,
    by_source: Mutex<HashMap<Ipv4Addr, usize>>,
}

impl InFlight {
    /// Counts a query of `source` in, unless either bound is reached.
    fn enter(&self, source: Ipv4Addr) -> bool {
        let mut by_source = locked(&self.by_source);
        let mine = by_source.entry(source).or_insert(0);
        if *mine >= MAX_IN_FLIGHT_PER_SANDBOX {
            return false;
        }
        if self.all.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
            self.all.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        *mine += 1;
        true
    }

    /// Counts a query of `source` out.
    fn leave(&self, source: Ipv4Addr) {
        let mut by_source = locked(&self.by_source);
        if let Some(mine) = by_source.get_mut(&source) {
            *mine = mine.saturating_sub(1);
            if *mine == 0 {
                by_source.remove(&source);
            }
        }
        self.all.fetch_sub(1, Ordering::SeqCst);
    }
}

fn serve(socket: UdpSocket, shared: Arc<Shared>, stop: Arc<AtomicBool>, in_flight: Arc<InFlight>) {
    let mut buf = vec![0u8; 4096];
    while !stop.load(Ordering::SeqCst) {
        let (n, from) = match socket.recv_from(&mut buf) {
            Ok(got) => got,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the sandbox resolver could not read a query");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let SocketAddr::V4(from) = from else { continue };
        let source = *from.ip();
        if !in_flight.enter(source) {
            continue;
        }
        let (Ok(reply_socket), query) = (socket.try_clone(), buf[..n].to_vec()) else {
            in_flight.leave(source);
            continue;
        };
        let (shared, counter) = (Arc::clone(&shared), Arc::clone(&in_flight));
        let spawned = std::thread::Builder::new()
            .name("sbx-resolve".into())
            .spawn(move || {
                if let Some(reply) = answer(&shared, source, &query) {
                    let _ = reply_socket.send_to(&reply, from);
                }
                counter.leave(source);
            });
        if spawned.is_err() {
            in_flight.leave(source);
        }
    }
}

/// A reply to `query` with `code` and no records.
fn bare(query: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut r = Message::new();
    r.set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(query.op_code())
        .set_recursion_desired(query.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(code)
        .add_queries(query.queries().to_vec());
    r.to_vec().ok()
}

/// What this process's resolvers did with the queries they got, since it started: answered
/// (`noerror`, whatever the records), `refused`, `servfail`, `notimp`, or `dropped` (no reply:
/// not a query).
pub fn outcome_counts() -> [(&'static str, u64); 5] {
    let n = |i: usize| OUTCOMES[i].load(std::sync::atomic::Ordering::Relaxed);
    [
        ("noerror", n(0)),
        ("refused", n(1)),
        ("servfail", n(2)),
        ("notimp", n(3)),
        ("dropped", n(4)),
    ]
}

static OUTCOMES: [std::sync::atomic::AtomicU64; 5] = [
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
];

/// The reply to `query` from `source` (see [`answer_query`]), counted by its outcome.
pub fn answer(shared: &Shared, source: Ipv4Addr, query: &[u8]) -> Option<Vec<u8>> {
    let reply = answer_query(shared, source, query);
    // The response code: the low four bits of the header's fourth byte.
    let slot = match reply.as_deref().and_then(|r| r.get(3)).map(|b| b & 0x0f) {
        None => 4,
        Some(0) => 0,
        Some(5) => 1,
        Some(4) => 3,
        Some(_) => 2,
    };
    OUTCOMES[slot].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    reply
}

/// The reply for the sandbox at `source`, or nothing for a datagram that is not a query.
fn answer_query(shared: &Shared, source: Ipv4Addr, query: &[u8]) -> Option<Vec<u8>> {
    let q = Message::from_vec(query).ok()?;
    if q.message_type() != MessageType::Query {
        return None;
    }
    if q.op_code() != OpCode::Query || q.queries().len() != 1 {
        return bare(&q, ResponseCode::NotImp);
    }
    let question = &q.queries()[0];
    let name = question.name().to_ascii().to_ascii_lowercase();
    let name = name.strip_suffix('.').unwrap_or(&name).to_string();
    let client = locked(&shared.clients).get(&source).cloned();
    let Some(client) = client else {
        return bare(&q, ResponseCode::Refused);
    };
    if matching(&client, &name).next().is_none() {
        shared.refuse(client.id, &name);
        tracing::debug!(sandbox_id = %client.id, name = %name, "a name the sandbox's policy does not hold was refused");
        return bare(&q, ResponseCode::Refused);
    }
    let Some(upstream) = shared.upstream else {
        return bare(&q, ResponseCode::ServFail);
    };
    let Some(mut reply) = ask_upstream(upstream, &q) else {
        return bare(&q, ResponseCode::ServFail);
    };
    // No record of the reply may name an address the sandbox may not be steered to (the
    // host's addresses read only for an answer that has addresses).
    let answered = reply.take_answers();
    let had_a = answered.iter().any(|r| matches!(r.data(), RData::A(_)));
    let host = if had_a { host_addresses() } else { Vec::new() };
    let (kept, refused): (Vec<_>, Vec<_>) = answered.into_iter().partition(|r| match r.data() {
        RData::A(a) => !forbidden(a.0, shared.table.network, shared.table.prefix, &host),
        _ => true,
    });
    if !refused.is_empty() {
        tracing::info!(sandbox_id = %client.id, name = %name, refused = refused.len(), "an answer named addresses a sandbox may not be steered to; taken out");
    }
    if had_a && !kept.iter().any(|r| matches!(r.data(), RData::A(_))) {
        shared.refuse(client.id, &name);
        return bare(&q, ResponseCode::Refused);
    }
    reply.insert_answers(kept);
    if question.query_type() == RecordType::A || question.query_type() == RecordType::ANY {
        let mut addrs = Vec::new();
        let mut ttl = MAX_TTL;
        for rec in reply.answers() {
            if let RData::A(a) = rec.data() {
                addrs.push(a.0);
                ttl = ttl.min(u64::from(rec.ttl()));
            }
        }
        if !addrs.is_empty() {
            let ttl = ttl.clamp(MIN_TTL, MAX_TTL);
            match shared.admit(source, &name, &addrs, ttl) {
                Ok(true) => {}
                Ok(false) => return bare(&q, ResponseCode::Refused),
                Err(e) => {
                    tracing::warn!(sandbox_id = %client.id, name = %name, error = %e, "a resolved address could not be admitted");
                    return bare(&q, ResponseCode::ServFail);
                }
            }
        }
    }
    reply.set_id(q.id());
    reply.to_vec().ok()
}

/// Whether `addr` is one no answer may admit: in the sandbox network `network/prefix` (the
/// bridge, the neighbours), one of the host's own (`host`), or in a special range —
/// "this network" 0/8, loopback 127/8, link-local 169.254/16, multicast 224/4, reserved
/// 240/4 (with the broadcast address).
pub fn forbidden(addr: Ipv4Addr, network: Ipv4Addr, prefix: u8, host: &[Ipv4Addr]) -> bool {
    const SPECIAL: [(Ipv4Addr, u8); 5] = [
        (Ipv4Addr::new(0, 0, 0, 0), 8),
        (Ipv4Addr::new(127, 0, 0, 0), 8),
        (Ipv4Addr::new(169, 254, 0, 0), 16),
        (Ipv4Addr::new(224, 0, 0, 0), 4),
        (Ipv4Addr::new(240, 0, 0, 0), 4),
    ];
    policy::contains(network, prefix, addr)
        || host.contains(&addr)
        || SPECIAL
            .iter()
            .any(|(net, len)| policy::contains(*net, *len, addr))
}

/// The host's own IPv4 addresses, every interface's (read afresh for each answer: an address
/// added since is refused too).
fn host_addresses() -> Vec<Ipv4Addr> {
    nix::ifaddrs::getifaddrs()
        .map(|all| {
            all.filter_map(|i| i.address?.as_sockaddr_in().map(|a| a.ip()))
                .collect()
        })
        .unwrap_or_default()
}

/// Sends the question of `q` — and nothing else of it: no additional, authority or answer
/// record, no EDNS option of the sandbox's — under a fresh id to the upstream, and waits for
/// its answer to that question.
fn ask_upstream(upstream: SocketAddr, q: &Message) -> Option<Message> {
    let socket = UdpSocket::bind(match upstream {
        SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        SocketAddr::V6(_) => SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)),
    })
    .ok()?;
    socket.connect(upstream).ok()?;
    socket.set_read_timeout(Some(UPSTREAM_TIMEOUT)).ok()?;
    let random = Uuid::new_v4();
    let id = u16::from_be_bytes([random.as_bytes()[0], random.as_bytes()[1]]);
    let mut out = Message::new();
    out.set_id(id)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(q.recursion_desired())
        .add_queries(q.queries().to_vec());
    let bytes = out.to_vec().ok()?;
    let mut buf = vec![0u8; 65535];
    for _ in 0..2 {
        socket.send(&bytes).ok()?;
        let deadline = Instant::now() + UPSTREAM_TIMEOUT;
        while Instant::now() < deadline {
            let Ok(n) = socket.recv(&mut buf) else {
                break;
            };
            let Ok(r) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            if r.id() == id
                && r.message_type() == MessageType::Response
                && r.queries() == q.queries()
            {
                return Some(r);
            }
        }
    }
    None
}

/// The host's first IPv4 nameserver in `/etc/resolv.conf` outside `network/prefix` (the
/// upstream when `--network-dns` is not given), if it has one.
pub fn host_nameserver(resolv_conf: &str, network: Ipv4Addr, prefix: u8) -> Option<SocketAddr> {
    resolv_conf.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            return None;
        }
        let addr: Ipv4Addr = words.next()?.parse().ok()?;
        (!policy::contains(network, prefix, addr)).then(|| SocketAddr::from((addr, 53)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::Name;
    use std::str::FromStr;

    fn query(name: &str) -> Vec<u8> {
        let mut m = Message::new();
        m.set_id(7)
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Query)
            .set_recursion_desired(true)
            .add_query(Query::query(Name::from_str(name).unwrap(), RecordType::A));
        m.to_vec().unwrap()
    }

    fn shared() -> Shared {
        let table = nft::Table {
            name: "t".into(),
            bridge: "t0".into(),
            network: Ipv4Addr::new(10, 9, 0, 0),
            prefix: 16,
        };
        Shared::new(table, None)
    }

    #[test]
    fn a_stranger_and_a_name_off_the_list_are_refused_and_recorded() {
        let s = shared();
        let me = Ipv4Addr::new(10, 9, 0, 2);
        let id = Uuid::new_v4();
        let entries = policy::parse_allowlist(&["api.example.test:443"]).unwrap();
        s.with_policy(id, me, &entries, || Ok(())).unwrap();
        let code =
            |bytes: Option<Vec<u8>>| Message::from_vec(&bytes.unwrap()).unwrap().response_code();
        assert_eq!(
            code(answer(
                &s,
                Ipv4Addr::new(10, 9, 0, 3),
                &query("api.example.test.")
            )),
            ResponseCode::Refused
        );
        assert_eq!(
            code(answer(&s, me, &query("other.example.test."))),
            ResponseCode::Refused
        );
        assert_eq!(
            code(answer(&s, me, &query("Other.Example.test."))),
            ResponseCode::Refused
        );
        assert_eq!(s.refused(id), vec![("other.example.test".to_string(), 2)]);
        // On the list, with no upstream to ask: SERVFAIL, never an invented answer.
        assert_eq!(
            code(answer(&s, me, &query("api.example.test."))),
            ResponseCode::ServFail
        );
        assert_eq!(
            answer(&s, me, b"\x00\x01garbage"),
            None,
            "not DNS: no reply"
        );
    }

    #[test]
    fn answers_that_would_steer_a_sandbox_to_the_host_or_a_neighbour_are_forbidden() {
        let net = Ipv4Addr::new(10, 9, 0, 0);
        let host = [Ipv4Addr::new(192, 0, 2, 7)];
        for bad in [
            Ipv4Addr::new(10, 9, 0, 1),
            Ipv4Addr::new(10, 9, 3, 4),
            Ipv4Addr::new(192, 0, 2, 7),
            Ipv4Addr::new(127, 0, 0, 1),
            Ipv4Addr::new(127, 8, 9, 1),
            Ipv4Addr::new(169, 254, 169, 254),
            Ipv4Addr::new(224, 0, 0, 251),
            Ipv4Addr::new(255, 255, 255, 255),
            Ipv4Addr::new(0, 0, 0, 0),
        ] {
            assert!(forbidden(bad, net, 16, &host), "{bad} admitted");
        }
        for good in [
            Ipv4Addr::new(10, 10, 0, 1),
            Ipv4Addr::new(192, 0, 2, 8),
            Ipv4Addr::new(93, 184, 216, 34),
        ] {
            assert!(!forbidden(good, net, 16, &host), "{good} refused");
        }
    }

    #[test]
    fn one_source_cannot_take_every_slot() {
        let f = InFlight::default();
        let (a, b) = (Ipv4Addr::new(10, 9, 0, 2), Ipv4Addr::new(10, 9, 0, 3));
        for _ in 0..MAX_IN_FLIGHT_PER_SANDBOX {
            assert!(f.enter(a));
        }
        assert!(!f.enter(a), "one more of the same sandbox");
        assert!(f.enter(b), "another sandbox still gets in");
        f.leave(a);
        assert!(f.enter(a));
    }

    #[test]
    fn the_hosts_nameserver_is_its_first_ipv4_outside_the_network() {
        let conf = "# x\nnameserver fd00::1\nnameserver 10.9.0.1\nnameserver 192.0.2.53\n";
        assert_eq!(
            host_nameserver(conf, Ipv4Addr::new(10, 9, 0, 0), 16),
            Some("192.0.2.53:53".parse().unwrap())
        );
        assert_eq!(host_nameserver("", Ipv4Addr::new(10, 9, 0, 0), 16), None);
    }
}
