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
//! is admitted only if it is **public** ([`admissible`]) — outside every block of IANA's
//! special-purpose registry that is not globally reachable (private, shared, loopback,
//! link-local, documentation, benchmarking, multicast, reserved: [`is_public`]) and outside
//! every network the host is attached to (the networks of its interfaces' addresses, and
//! every on-link route of its namespace in any table: another bridge, a container, libvirt
//! or pod network, the LAN — public addresses too) — or if the sandbox's own policy names a
//! network holding it (a CIDR entry: the operator said the sandbox may go there). The
//! sandbox network (the bridge and every neighbour), the host's own addresses, loopback,
//! link-local, "this network", multicast and the reserved range are never admitted, whatever
//! the policy says ([`never`]). Such records are taken out of the reply, and an answer left
//! with none is REFUSED and recorded.
//!
//! Only the question goes upstream — a fresh query of the resolver's own, never the
//! sandbox's additional or authority records (a payload smuggled out inside a query for an
//! allowed name stays here) — and only the question and its answer records come back: the
//! reply is a new message with the upstream's response code, the truncation bit, the
//! question and the answer records of the question's name and of the names its CNAME records
//! lead to. No authority record (a negative answer's SOA included: a stub resolver does not
//! cache), no additional record and no EDNS option reach the sandbox (nothing else of a
//! hostile zone's reply is a channel in).
//!
//! Messages are read and written with `hickory-proto` (the DNS wire format, well kept, no
//! resolver of its own pulled in); each query is answered by a thread of its own (an
//! upstream that does not answer holds one for 2 × 1.5 s), within **budgets** per sandbox,
//! answered fairly ([`Budgets`]): at most [`MAX_IN_FLIGHT_PER_SANDBOX`] of its queries at
//! once, of which [`RESERVED_PER_SANDBOX`] (a lookup's A and AAAA) it always gets whatever
//! the others do — only the queries past those draw on [`SHARED_IN_FLIGHT`], the bound of
//! all sandboxes together — and at most [`QUERIES_PER_SECOND`] a second (a token bucket of
//! [`QUERY_BURST`]). A query over a budget is dropped at once (the sandbox's stub resolver
//! asks again) and counted for its sandbox; so a sandbox that floods waits for its own
//! answers, never another for theirs (20 sandboxes flooding a name whose upstream never
//! answers left another 2 of 20 lookups in 60 s before the reserved share, 20 of 20 in
//! under a second after: `gateway/tests/network_e2e.rs`). UDP only: an answer too large for
//! a datagram comes back truncated, as the upstream sent it.

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{RData, Record, RecordType};
use uuid::Uuid;

use super::link;
use super::nft;
use super::policy::{self, AllowEntry};
use sbx_driver_api::locked;

/// The resolver's port on the bridge's address ([`crate::RESOLVER_PORT`]).
pub const PORT: u16 = crate::RESOLVER_PORT;
/// Queries of one sandbox being answered at once; one more of it is dropped.
pub const MAX_IN_FLIGHT_PER_SANDBOX: usize = 4;
/// Of a sandbox's queries in flight, how many it always gets, whatever every other sandbox
/// does: a lookup is two queries at once (A and AAAA).
pub const RESERVED_PER_SANDBOX: usize = 2;
/// Queries past their sandbox's reserved ones being answered at once, of all sandboxes
/// together; one more past it is dropped. (So at most 2 × sandboxes + 64 threads wait on
/// the upstream at once.)
pub const SHARED_IN_FLIGHT: usize = 64;
/// Queries a second one sandbox is answered, sustained (a token bucket; the kernel drops
/// past [`nft::DNS_RATE`] before they reach the resolver): 125 lookups a second (each an A
/// and an AAAA query) is past what an ordinary program keeps up, and an upstream is asked no
/// faster on any one sandbox's behalf.
pub const QUERIES_PER_SECOND: f64 = 250.0;
/// The bucket's depth (the kernel's burst): a program starting up, or a test looking a name
/// up a few hundred times in a row, is answered every time.
pub const QUERY_BURST: f64 = 500.0;
/// The stack of a thread answering one query (it parses and writes small messages and runs
/// `nft`): threads waiting on an upstream cost no more than this of address space each.
const ANSWER_STACK: usize = 512 * 1024;
/// The resolver's socket's receive buffer (`SO_RCVBUFFORCE`): what the kernel lets through
/// of every sandbox ([`nft::DNS_RATE`] each) waits here for the one thread that reads it, and
/// a full buffer would drop any sandbox's query.
const RECEIVE_BUFFER: usize = 4 << 20;
/// How long the host's on-link routes are read for (a process each time); the networks of
/// its interfaces' addresses are read afresh for every answer.
const ROUTES_REFRESH: Duration = Duration::from_secs(1);
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
    /// Every network its list names (of every class): an answer into one of them is
    /// admitted even if it is not public.
    networks: Vec<(Ipv4Addr, u8)>,
}

/// The host's on-link routes as read at an instant.
type Routes = (Instant, Vec<(Ipv4Addr, u8)>);

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
    budgets: Budgets,
    /// The host's on-link routes, and when they were read.
    routes: Mutex<Option<Routes>>,
}

impl Shared {
    pub fn new(table: nft::Table, upstream: Option<SocketAddr>) -> Shared {
        Shared {
            table,
            upstream,
            clients: Mutex::new(HashMap::new()),
            admitted: Mutex::new(HashMap::new()),
            refused: Mutex::new(HashMap::new()),
            budgets: Budgets::new(Limits::default()),
            routes: Mutex::new(None),
        }
    }

    /// How many queries from `address` its budgets refused (in flight, per second) since
    /// this process began answering it, or since the sandbox that held it before was
    /// forgotten.
    pub fn over_budget(&self, address: Ipv4Addr) -> u64 {
        self.budgets.refused(address)
    }

    /// The host's own addresses and the networks it is attached to, as of now (the routes as
    /// of at most [`ROUTES_REFRESH`] ago).
    fn host_view(&self) -> Result<HostView, link::IpError> {
        let mut routes = locked(&self.routes);
        let stale = routes
            .as_ref()
            .is_none_or(|(at, _)| at.elapsed() >= ROUTES_REFRESH);
        if stale {
            *routes = Some((Instant::now(), link::on_link_routes()?));
        }
        let mut view = HostView::default();
        if let Some((_, r)) = routes.as_ref() {
            view.attached.extend(r.iter().copied());
        }
        drop(routes);
        if let Ok(all) = nix::ifaddrs::getifaddrs() {
            for i in all {
                let Some(addr) = i
                    .address
                    .as_ref()
                    .and_then(|a| a.as_sockaddr_in())
                    .map(|a| a.ip())
                else {
                    continue;
                };
                view.addrs.push(addr);
                let len = i
                    .netmask
                    .as_ref()
                    .and_then(|m| m.as_sockaddr_in())
                    .map(|m| u32::from(m.ip()).count_ones() as u8)
                    .unwrap_or(32);
                if (link::ATTACHED_MIN_PREFIX..32).contains(&len) {
                    let net = Ipv4Addr::from(u32::from(addr) & (u32::MAX << (32 - len)));
                    view.attached.push((net, len));
                }
            }
        }
        Ok(view)
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
        let classes = policy::classes(entries);
        clients.insert(
            address,
            Client {
                id,
                key: id.simple().to_string(),
                networks: classes
                    .iter()
                    .flat_map(|c| c.networks.iter().copied())
                    .collect(),
                classes: classes.into_iter().map(|c| c.names).collect(),
            },
        );
        Ok(out)
    }

    /// Forgets `id` (detached).
    pub fn forget(&self, id: Uuid, address: Option<Ipv4Addr>) {
        if let Some(a) = address {
            locked(&self.clients).remove(&a);
            self.budgets.forget(a);
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
        // Root may set it past rmem_max; otherwise what the host allows.
        use nix::sys::socket::{setsockopt, sockopt};
        if setsockopt(&socket, sockopt::RcvBufForce, &RECEIVE_BUFFER).is_err() {
            let _ = setsockopt(&socket, sockopt::RcvBuf, &RECEIVE_BUFFER);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("sbx-resolver".into())
                .spawn(move || serve(socket, shared, stop))?
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

/// The bounds of [`Budgets`] (the module's constants, smaller in tests).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub per_sandbox: usize,
    pub reserved: usize,
    pub shared: usize,
    pub per_second: f64,
    pub burst: f64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            per_sandbox: MAX_IN_FLIGHT_PER_SANDBOX,
            reserved: RESERVED_PER_SANDBOX,
            shared: SHARED_IN_FLIGHT,
            per_second: QUERIES_PER_SECOND,
            burst: QUERY_BURST,
        }
    }
}

/// Why a query was not let in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverBudget {
    /// Its sandbox has as many queries being answered as it may (or every shared slot is
    /// taken and its reserved ones too).
    InFlight,
    /// Its sandbox asked faster than it may.
    Rate,
}

/// One source's share: its queries being answered, and its token bucket (tokens as of `at`).
#[derive(Debug)]
struct Share {
    in_flight: usize,
    tokens: f64,
    at: Instant,
}

#[derive(Debug, Default)]
struct Shares {
    by_source: HashMap<Ipv4Addr, Share>,
    /// Queries refused per source (kept until its sandbox is forgotten: at most one entry
    /// per address of the network).
    refused: HashMap<Ipv4Addr, u64>,
    /// Queries in flight past their source's reserved ones, of every source.
    shared: usize,
    pruned: Option<Instant>,
}

/// The resolver's budgets per source address, answered fairly: a source's first
/// `reserved` queries in flight are its own whatever the others do; the ones past those (to
/// `per_sandbox`) draw on `shared`, which all sources share; and a token bucket bounds its
/// queries a second.
#[derive(Debug)]
pub struct Budgets {
    limits: Limits,
    shares: Mutex<Shares>,
}

impl Budgets {
    pub fn new(limits: Limits) -> Budgets {
        Budgets {
            limits,
            shares: Mutex::new(Shares::default()),
        }
    }

    /// Counts a query of `source` in at `now`, unless a budget refuses it (counted, for
    /// [`Budgets::refused`]).
    pub fn enter(&self, source: Ipv4Addr, now: Instant) -> Result<(), OverBudget> {
        let mut shares = locked(&self.shares);
        let entered = self.admit(&mut shares, source, now);
        if entered.is_err() {
            *shares.refused.entry(source).or_insert(0) += 1;
        }
        entered
    }

    /// How many queries of `source` were refused.
    pub fn refused(&self, source: Ipv4Addr) -> u64 {
        locked(&self.shares)
            .refused
            .get(&source)
            .copied()
            .unwrap_or(0)
    }

    /// Forgets `source`'s refusals (its sandbox is gone; the address may go to another).
    pub fn forget(&self, source: Ipv4Addr) {
        locked(&self.shares).refused.remove(&source);
    }

    fn admit(&self, shares: &mut Shares, source: Ipv4Addr, now: Instant) -> Result<(), OverBudget> {
        let l = self.limits;
        // Sources whose bucket is full again and that have nothing in flight are forgotten
        // (a new one starts full): the map holds the sources of the last seconds only.
        if shares
            .pruned
            .is_none_or(|at| now.saturating_duration_since(at) >= Duration::from_secs(10))
        {
            let refill = Duration::from_secs_f64(l.burst / l.per_second);
            shares
                .by_source
                .retain(|_, s| s.in_flight > 0 || now.saturating_duration_since(s.at) < refill);
            shares.pruned = Some(now);
        }
        let shared_full = shares.shared >= l.shared;
        let mine = shares.by_source.entry(source).or_insert(Share {
            in_flight: 0,
            tokens: l.burst,
            at: now,
        });
        let past_reserved = mine.in_flight >= l.reserved;
        if mine.in_flight >= l.per_sandbox || (past_reserved && shared_full) {
            return Err(OverBudget::InFlight);
        }
        let elapsed = now.saturating_duration_since(mine.at).as_secs_f64();
        mine.tokens = (mine.tokens + elapsed * l.per_second).min(l.burst);
        mine.at = now;
        if mine.tokens < 1.0 {
            return Err(OverBudget::Rate);
        }
        mine.tokens -= 1.0;
        mine.in_flight += 1;
        if past_reserved {
            shares.shared += 1;
        }
        Ok(())
    }

    /// Counts a query of `source` out.
    pub fn leave(&self, source: Ipv4Addr) {
        let reserved = self.limits.reserved;
        let mut shares = locked(&self.shares);
        let Some(mine) = shares.by_source.get_mut(&source) else {
            return;
        };
        let was_past_reserved = mine.in_flight > reserved;
        mine.in_flight = mine.in_flight.saturating_sub(1);
        if was_past_reserved {
            shares.shared = shares.shared.saturating_sub(1);
        }
    }
}

fn serve(socket: UdpSocket, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
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
        if shared.budgets.enter(source, Instant::now()).is_err() {
            continue;
        }
        let (Ok(reply_socket), query) = (socket.try_clone(), buf[..n].to_vec()) else {
            shared.budgets.leave(source);
            continue;
        };
        let worker = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("sbx-resolve".into())
            .stack_size(ANSWER_STACK)
            .spawn(move || {
                if let Some(reply) = answer(&worker, source, &query) {
                    let _ = reply_socket.send_to(&reply, from);
                }
                worker.budgets.leave(source);
            });
        if spawned.is_err() {
            shared.budgets.leave(source);
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
    let Some(reply) = ask_upstream(upstream, &q) else {
        return bare(&q, ResponseCode::ServFail);
    };
    // The question's own records only; none of them may name an address the sandbox may
    // not be steered to (the host read only for an answer that has addresses).
    let answered = in_chain(question.name(), reply.answers());
    let had_a = answered.iter().any(|r| matches!(r.data(), RData::A(_)));
    let host = if had_a {
        match shared.host_view() {
            Ok(view) => view,
            Err(e) => {
                tracing::warn!(error = %e, "the host's routes could not be read: an answer with addresses is SERVFAIL until they can");
                return bare(&q, ResponseCode::ServFail);
            }
        }
    } else {
        HostView::default()
    };
    let (network, prefix) = (shared.table.network, shared.table.prefix);
    let (kept, refused): (Vec<_>, Vec<_>) = answered.into_iter().partition(|r| match r.data() {
        RData::A(a) => admissible(a.0, network, prefix, &host, &client.networks),
        _ => true,
    });
    if !refused.is_empty() {
        tracing::info!(sandbox_id = %client.id, name = %name, refused = refused.len(), "an answer named addresses a sandbox may not be steered to; taken out");
    }
    if had_a && !kept.iter().any(|r| matches!(r.data(), RData::A(_))) {
        shared.refuse(client.id, &name);
        return bare(&q, ResponseCode::Refused);
    }
    if question.query_type() == RecordType::A || question.query_type() == RecordType::ANY {
        let mut addrs = Vec::new();
        let mut ttl = MAX_TTL;
        for rec in &kept {
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
    // A new message: the question, its answers, the upstream's code and truncation bit.
    let mut out = Message::new();
    out.set_id(q.id())
        .set_message_type(MessageType::Response)
        .set_op_code(q.op_code())
        .set_recursion_desired(q.recursion_desired())
        .set_recursion_available(true)
        .set_truncated(reply.truncated())
        .set_response_code(reply.response_code())
        .add_queries(q.queries().to_vec())
        .insert_answers(kept);
    out.to_vec().ok()
}

/// The records of `answers` that answer `name`: those of `name` itself and of every name a
/// CNAME record among them leads to from it, in their order (anything else an upstream put
/// in the section is not the question's answer).
fn in_chain(name: &hickory_proto::rr::Name, answers: &[Record]) -> Vec<Record> {
    let lower = |n: &hickory_proto::rr::Name| n.to_ascii().to_ascii_lowercase();
    let mut names = vec![lower(name)];
    let mut taken = vec![false; answers.len()];
    // Each pass takes at least one record or ends: at most as many passes as records.
    loop {
        let mut grew = false;
        for (i, r) in answers.iter().enumerate() {
            if taken[i] || !names.contains(&lower(r.name())) {
                continue;
            }
            taken[i] = true;
            grew = true;
            if let RData::CNAME(target) = r.data() {
                names.push(lower(&target.0));
            }
        }
        if !grew {
            break;
        }
    }
    answers
        .iter()
        .zip(taken)
        .filter(|(_, t)| *t)
        .map(|(r, _)| r.clone())
        .collect()
}

/// The host as an answer may not steer a sandbox into it: its own addresses, and the
/// networks it is attached to (its interfaces' address networks and its on-link routes).
#[derive(Debug, Clone, Default)]
pub struct HostView {
    pub addrs: Vec<Ipv4Addr>,
    pub attached: Vec<(Ipv4Addr, u8)>,
}

/// Blocks of IANA's IPv4 Special-Purpose Address Registry that are not globally reachable,
/// and multicast (224/4, its own registry): private (10/8, 172.16/12, 192.168/16), shared
/// (100.64/10), "this network" (0/8), loopback (127/8), link-local (169.254/16), IETF
/// protocol assignments (192.0.0/24, but for the two in [`GLOBAL_IN_SPECIAL`]),
/// documentation (192.0.2/24, 198.51.100/24, 203.0.113/24), benchmarking (198.18/15) and
/// reserved (240/4, with the limited broadcast address).
pub const NOT_GLOBAL: [(Ipv4Addr, u8); 14] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(10, 0, 0, 0), 8),
    (Ipv4Addr::new(100, 64, 0, 0), 10),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(172, 16, 0, 0), 12),
    (Ipv4Addr::new(192, 0, 0, 0), 24),
    (Ipv4Addr::new(192, 0, 2, 0), 24),
    (Ipv4Addr::new(192, 168, 0, 0), 16),
    (Ipv4Addr::new(198, 18, 0, 0), 15),
    (Ipv4Addr::new(198, 51, 100, 0), 24),
    (Ipv4Addr::new(203, 0, 113, 0), 24),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// The registry's globally reachable addresses inside 192.0.0.0/24 (PCP and TURN anycast).
pub const GLOBAL_IN_SPECIAL: [Ipv4Addr; 2] =
    [Ipv4Addr::new(192, 0, 0, 9), Ipv4Addr::new(192, 0, 0, 10)];

/// Whether `addr` is a public address: in no block of [`NOT_GLOBAL`] (but for
/// [`GLOBAL_IN_SPECIAL`]).
pub fn is_public(addr: Ipv4Addr) -> bool {
    GLOBAL_IN_SPECIAL.contains(&addr)
        || !NOT_GLOBAL
            .iter()
            .any(|(net, len)| policy::contains(*net, *len, addr))
}

/// Whether `addr` is one no answer may admit, whatever the sandbox's policy: in the sandbox
/// network `network/prefix` (the bridge, the neighbours), one of the host's own (`host`), or
/// "this network" 0/8, loopback 127/8, link-local 169.254/16, multicast 224/4, reserved
/// 240/4 (with the broadcast address).
pub fn never(addr: Ipv4Addr, network: Ipv4Addr, prefix: u8, host: &[Ipv4Addr]) -> bool {
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

/// Whether an answer may admit `addr` for a sandbox on `network/prefix` whose policy names
/// the networks `named`, on a host as `host` shows it: never ([`never`]); a public address
/// ([`is_public`]) on no network the host is attached to, yes; any other only if a network
/// of `named` holds it.
pub fn admissible(
    addr: Ipv4Addr,
    network: Ipv4Addr,
    prefix: u8,
    host: &HostView,
    named: &[(Ipv4Addr, u8)],
) -> bool {
    if never(addr, network, prefix, &host.addrs) {
        return false;
    }
    let local = !is_public(addr)
        || host
            .attached
            .iter()
            .any(|(net, len)| policy::contains(*net, *len, addr));
    !local
        || named
            .iter()
            .any(|(net, len)| policy::contains(*net, *len, addr))
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
            conntrack_max: nft::DEFAULT_CONNTRACK_MAX,
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
    fn answers_that_would_steer_a_sandbox_to_the_host_or_a_neighbour_are_never_admitted() {
        let net = Ipv4Addr::new(10, 9, 0, 0);
        let host = HostView {
            addrs: vec![Ipv4Addr::new(198, 51, 100, 7)],
            attached: Vec::new(),
        };
        // Not even for a policy that names every address.
        let everything = [(Ipv4Addr::UNSPECIFIED, 0)];
        for bad in [
            Ipv4Addr::new(10, 9, 0, 1),
            Ipv4Addr::new(10, 9, 3, 4),
            Ipv4Addr::new(198, 51, 100, 7),
            Ipv4Addr::new(127, 0, 0, 1),
            Ipv4Addr::new(127, 8, 9, 1),
            Ipv4Addr::new(169, 254, 169, 254),
            Ipv4Addr::new(224, 0, 0, 251),
            Ipv4Addr::new(255, 255, 255, 255),
            Ipv4Addr::new(0, 0, 0, 0),
        ] {
            assert!(never(bad, net, 16, &host.addrs), "{bad} admitted");
            assert!(!admissible(bad, net, 16, &host, &everything), "{bad}");
        }
        assert!(!never(Ipv4Addr::new(10, 10, 0, 1), net, 16, &host.addrs));
    }

    #[test]
    fn only_public_addresses_off_the_hosts_networks_are_admitted_unless_the_policy_names_them() {
        let net = Ipv4Addr::new(10, 9, 0, 0);
        let host = HostView {
            addrs: vec![Ipv4Addr::new(192, 52, 193, 201)],
            // A LAN with public addresses, and a container's /32 route.
            attached: vec![
                (Ipv4Addr::new(192, 52, 193, 200), 30),
                (Ipv4Addr::new(93, 184, 216, 99), 32),
            ],
        };
        let admitted = |a: [u8; 4], named: &[(Ipv4Addr, u8)]| {
            admissible(Ipv4Addr::from(a), net, 16, &host, named)
        };
        for public in [
            [93, 184, 216, 34],
            [1, 1, 1, 1],
            [100, 63, 255, 255],
            [100, 128, 0, 1],
            [172, 32, 0, 1],
            [192, 0, 0, 9],
            [192, 0, 0, 10],
            [192, 0, 3, 1],
            [192, 52, 193, 1],
            [198, 20, 0, 1],
            [223, 255, 255, 254],
        ] {
            assert!(admitted(public, &[]), "{public:?} refused");
        }
        for local in [
            [10, 1, 2, 3],
            [100, 64, 0, 1],
            [100, 127, 255, 254],
            [172, 16, 0, 1],
            [172, 31, 255, 254],
            [192, 0, 0, 8],
            [192, 0, 0, 170],
            [192, 0, 2, 1],
            [192, 168, 1, 1],
            [198, 18, 0, 1],
            [198, 19, 255, 254],
            [198, 51, 100, 1],
            [203, 0, 113, 9],
            [192, 52, 193, 202],
            [93, 184, 216, 99],
        ] {
            assert!(!admitted(local, &[]), "{local:?} admitted");
        }
        // Named by the policy: the network, or the address itself.
        assert!(admitted([10, 1, 2, 3], &[(Ipv4Addr::new(10, 0, 0, 0), 8)]));
        assert!(admitted(
            [192, 52, 193, 202],
            &[(Ipv4Addr::new(192, 52, 193, 200), 30)]
        ));
        assert!(admitted(
            [93, 184, 216, 99],
            &[(Ipv4Addr::new(93, 184, 216, 99), 32)]
        ));
        assert!(!admitted(
            [10, 1, 2, 3],
            &[(Ipv4Addr::new(10, 2, 0, 0), 16)]
        ));
    }

    #[test]
    fn a_sandbox_always_gets_its_reserved_queries_and_the_rest_are_shared_and_rate_bound() {
        let b = Budgets::new(Limits {
            per_sandbox: 4,
            reserved: 2,
            shared: 3,
            per_second: 10.0,
            burst: 20.0,
        });
        let now = Instant::now();
        let src = |n: u8| Ipv4Addr::new(10, 9, 0, n);
        // Two flooders take every shared slot: the first 4 (2 reserved, 2 shared), the
        // second 3 (the last shared slot; its fourth is refused).
        for _ in 0..4 {
            assert!(b.enter(src(2), now).is_ok());
        }
        assert_eq!(
            b.enter(src(2), now),
            Err(OverBudget::InFlight),
            "its own bound"
        );
        for _ in 0..3 {
            assert!(b.enter(src(3), now).is_ok());
        }
        assert_eq!(
            b.enter(src(3), now),
            Err(OverBudget::InFlight),
            "the shared slots are all taken"
        );
        // Whatever they do, another sandbox gets its reserved two at once…
        assert!(b.enter(src(4), now).is_ok());
        assert!(b.enter(src(4), now).is_ok());
        // …and no more while the shared slots are taken.
        assert_eq!(b.enter(src(4), now), Err(OverBudget::InFlight));
        // A shared slot let go is taken again.
        b.leave(src(2));
        assert!(b.enter(src(4), now).is_ok());
        for _ in 0..3 {
            b.leave(src(4));
        }
        // The rate: a burst of 20, then 10 a second.
        let c = src(5);
        let mut admitted = 0;
        for _ in 0..30 {
            if b.enter(c, now).is_ok() {
                admitted += 1;
                b.leave(c);
            }
        }
        assert_eq!(admitted, 20, "the burst");
        assert_eq!(b.enter(c, now), Err(OverBudget::Rate));
        let later = now + Duration::from_millis(500);
        let mut again = 0;
        for _ in 0..30 {
            if b.enter(c, later).is_ok() {
                again += 1;
                b.leave(c);
            }
        }
        assert_eq!(again, 5, "half a second at 10 a second");
        // Every refusal above is counted for its source, until it is forgotten.
        assert_eq!(
            (b.refused(src(2)), b.refused(src(3)), b.refused(src(4))),
            (1, 1, 1)
        );
        assert_eq!(b.refused(c), 10 + 1 + 25);
        b.forget(c);
        assert_eq!(b.refused(c), 0);
    }

    #[test]
    fn only_the_questions_own_records_are_its_answer() {
        use hickory_proto::rr::rdata::{A, CNAME};
        let name = |n: &str| Name::from_str(n).unwrap();
        let rec = |owner: &str, data: RData| Record::from_rdata(name(owner), 30, data);
        let answers = vec![
            rec(
                "api.example.test.",
                RData::CNAME(CNAME(name("edge.cdn.test."))),
            ),
            rec("other.test.", RData::A(A::new(10, 0, 0, 1))),
            rec("Edge.CDN.test.", RData::A(A::new(93, 184, 216, 34))),
        ];
        let kept = in_chain(&name("API.example.test."), &answers);
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert!(kept.iter().all(|r| r.name().to_ascii() != "other.test."));
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
