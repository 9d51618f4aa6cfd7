//! The sandbox network kit against the real kernel: a bridge, sandboxes' namespaces, and an
//! "upstream" namespace this test makes itself (its own addresses, its own servers). No packet
//! goes to any address outside the namespaces the test creates. Everything the test makes —
//! namespaces, veths, addresses, the nftables table — is removed at the end, also when it
//! fails (a drop guard), and the test checks that nothing is left.
//!
//! Needs root, `ip` (iproute2), `nft` (nftables) and python3; skipped with a message without
//! them.

use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sbx_network::fixtures::{
    self, Answer, Attached, Held, SERVER, Upstream, connect_from, conntrack_entries_from,
    query_timing, reply_sections_from, resolve_from, runnable,
};
use sbx_network::{Network, NetworkConfig, parse_allowlist};
use uuid::Uuid;

/// The gateway's network for one test, detached and torn down on drop.
struct Net {
    net: Option<Network>,
    ids: Vec<Uuid>,
    name: String,
}

impl Drop for Net {
    fn drop(&mut self) {
        if let Some(n) = self.net.take() {
            for id in &self.ids {
                let _ = n.detach(*id);
            }
            let _ = n.teardown();
        }
        // Whatever a failed test left: the table, the bridge, namespaces named after it.
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.name])
            .output();
        let _ = Command::new("ip")
            .args(["link", "delete", "dev", &format!("{}0", self.name)])
            .output();
        let _ = std::fs::remove_file(
            std::path::Path::new(sbx_network::LOCK_DIR).join(format!("{}.lock", self.name)),
        );
        for id in &self.ids {
            let _ = Command::new("ip")
                .args(["netns", "delete", &format!("{}-{id}", self.name)])
                .output();
        }
    }
}

fn config(name: &str, third: u8, dir: &std::path::Path) -> NetworkConfig {
    NetworkConfig {
        name: name.into(),
        network: Ipv4Addr::new(10, 253, third, 0),
        prefix: 24,
        state_dir: dir.into(),
        dns_upstream: None,
        conntrack_max: sbx_network::DEFAULT_CONNTRACK_MAX,
    }
}

fn left_on_host(name: &str, ids: &[Uuid]) -> Vec<String> {
    let mut left = Vec::new();
    let links = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["-o", "link"])
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    for id in ids {
        let veth = format!("sbv{}", &id.simple().to_string()[..12]);
        if links.contains(&veth) {
            left.push(format!("veth {veth}"));
        }
        if std::path::Path::new(&format!("/run/netns/{name}-{id}")).exists() {
            left.push(format!("netns {name}-{id}"));
        }
    }
    if links.contains(&format!(" {name}0:")) {
        left.push(format!("bridge {name}0"));
    }
    if Command::new("nft")
        .args(["list", "table", "inet", name])
        .output()
        .unwrap()
        .status
        .success()
    {
        left.push(format!("table inet {name}"));
    }
    let lock = std::path::Path::new(sbx_network::LOCK_DIR).join(format!("{name}.lock"));
    if lock.exists() {
        left.push(format!("lock file {}", lock.display()));
    }
    left
}

#[test]
fn egress_is_default_deny_with_a_live_allowlist_and_nothing_is_left_behind() {
    if !runnable() {
        return;
    }
    let tag = format!("e{:04x}", std::process::id() & 0xffff);
    let name = format!("t{tag}");
    let up = Upstream::new(&tag, 7, &[80, 81, 8080]);
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let mut guard = Net {
        net: None,
        ids: vec![a, b],
        name: name.clone(),
    };
    guard.net = Some(Network::open(config(&name, 7, dir.path())).expect("network"));
    let net = guard.net.as_ref().unwrap();
    let allow80 = parse_allowlist(&[format!("{}:80", up.addr)]).unwrap();
    let at_a = net.attach(a, &allow80).expect("attach a");
    let at_b = net.attach(b, &[]).expect("attach b");
    assert_ne!(at_a.address, at_b.address);
    let ns_a = format!("{name}-{a}");
    let ns_b = format!("{name}-{b}");

    assert_eq!(
        connect_from(&ns_a, up.addr, 80),
        "hello 80",
        "the allowed port"
    );
    let started = Instant::now();
    let refused = connect_from(&ns_a, up.addr, 81);
    assert!(
        refused.starts_with("error"),
        "port 81 is not allowed: {refused}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refused at once, not timed out: {:?}",
        started.elapsed()
    );
    let second = connect_from(&ns_a, up.second, 80);
    assert!(
        second.starts_with("error"),
        "a second upstream address is not allowed: {second}"
    );
    let none = connect_from(&ns_b, up.addr, 80);
    assert!(
        none.starts_with("error"),
        "an empty allowlist reaches nothing: {none}"
    );

    // The denials, per destination and port, for the sandbox that tried.
    let denials = net.denials(a).unwrap();
    assert!(
        denials.iter().any(|d| d.destination == up.addr
            && d.port == 81
            && d.protocol == "tcp"
            && d.packets >= 1),
        "{denials:?}"
    );
    assert!(
        denials
            .iter()
            .any(|d| d.destination == up.second && d.port == 80),
        "{denials:?}"
    );
    assert!(denials.iter().all(|d| d.source == at_a.address));

    // Sandbox to sandbox, and sandbox to the host (the bridge's address): denied unless allowed.
    let host = std::net::TcpListener::bind((at_a.gateway, 0)).unwrap();
    let host_port = host.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in host.incoming().take(4).flatten() {
            let mut c = c;
            let _ = c.write_all(b"hello host\n");
        }
    });
    let to_host = connect_from(&ns_a, at_a.gateway, host_port);
    assert!(
        to_host.starts_with("error"),
        "the host's services are not reachable: {to_host}"
    );
    let peer_server = Command::new("ip")
        .args(["netns", "exec", &ns_b, "python3", "-c", SERVER, "9000"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut peer_server = scopeguard(peer_server);
    let mut ready = [0u8; 6];
    peer_server
        .0
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut ready)
        .unwrap();
    let to_peer = connect_from(&ns_a, at_b.address, 9000);
    assert!(
        to_peer.starts_with("error"),
        "another sandbox is not reachable: {to_peer}"
    );

    // A connection held open across a live update; the update admits :81 and the peer.
    let (mut held, greeting) = Held::open(&ns_a, up.addr, 80);
    assert_eq!(greeting, "hello 80");
    let wider = parse_allowlist(&[
        format!("{}:80", up.addr),
        // Overlapping networks in one class: merged in its address set.
        "10.251.0.0/16:80".to_string(),
        format!("{}:81/tcp", up.addr),
        format!("{}:9000", at_b.address),
        format!("{}:{host_port}", at_a.gateway),
    ])
    .unwrap();
    let t = Instant::now();
    net.set_policy(a, &wider).unwrap();
    let update = t.elapsed();
    assert_eq!(
        connect_from(&ns_a, up.addr, 81),
        "hello 81",
        "after the live update"
    );
    assert_eq!(connect_from(&ns_a, at_b.address, 9000), "hello 9000");
    assert_eq!(connect_from(&ns_a, at_a.gateway, host_port), "hello host");
    assert_eq!(
        held.echo("still here"),
        "still here",
        "the open connection survived the update"
    );
    eprintln!("live policy update applied in {update:?}");

    // A new gateway instance over the same state (the old one gone, its resolver with it):
    // same addresses, nothing re-made, the held connection still up, the policy still
    // enforced.
    // While one holds the network, a second cannot take its name: refused, naming the
    // process that holds it.
    let second = Network::open(config(&name, 7, dir.path())).expect_err("the name is taken");
    assert!(
        second.to_string().contains(&format!(
            "served by another sbxd (pid {}",
            std::process::id()
        )),
        "{second}"
    );
    drop(guard.net.take());
    guard.net = Some(Network::open(config(&name, 7, dir.path())).expect("reopen"));
    let reopened = guard.net.as_ref().unwrap();
    assert_eq!(reopened.address_of(a), Some(at_a.address));
    assert_eq!(reopened.attach(a, &wider).unwrap(), at_a);
    assert_eq!(held.echo("after reopen"), "after reopen");
    assert!(
        connect_from(&ns_a, up.addr, 8080).starts_with("error"),
        "still enforced after the reopen"
    );
    drop(held);
    drop(peer_server);

    // Detach removes the sandbox's namespace, veth, rules and lease; teardown the rest.
    reopened.detach(a).unwrap();
    reopened.detach(a).unwrap();
    reopened.detach(b).unwrap();
    assert_eq!(reopened.address_of(a), None);
    assert!(
        std::fs::read_dir(dir.path().join("leases"))
            .unwrap()
            .next()
            .is_none(),
        "no lease left"
    );
    reopened.teardown().unwrap();
    guard.net = None;
    assert_eq!(left_on_host(&name, &[a, b]), Vec::<String>::new());
}

struct KillOnDrop(Child);
fn scopeguard(c: Child) -> KillOnDrop {
    KillOnDrop(c)
}
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn hostname_entries_admit_what_the_gateways_resolver_answered_and_nothing_else() {
    if !runnable() {
        return;
    }
    let tag = format!("h{:04x}", std::process::id() & 0xffff);
    let name = format!("t{tag}");
    let third = 13;
    // The names answer the upstream's public addresses (an answer into a network the host
    // is attached to, or a private one, is refused: see
    // an_answer_into_a_network_the_host_is_attached_to_is_refused_unless_the_policy_names_it).
    let (public, public2) = (fixtures::public_addr(third), fixtures::public2_addr(third));
    let up = Upstream::with_names(
        &tag,
        third,
        &[80, 81, 8080],
        &[
            ("up.sbx.test", public),
            ("second.sbx.test", public2),
            ("c.wild.sbx.test", public2),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let mut guard = Net {
        net: None,
        ids: vec![a, b],
        name: name.clone(),
    };
    let mut cfg = config(&name, third, dir.path());
    cfg.dns_upstream = Some((up.addr, 53).into());
    guard.net = Some(Network::open(cfg.clone()).expect("network"));
    let net = guard.net.as_ref().unwrap();
    let list = parse_allowlist(&["up.sbx.test:80", "*.wild.sbx.test:8080/tcp"]).unwrap();
    let at = net.attach(a, &list).unwrap();
    net.attach(b, &[]).unwrap();
    let (ns_a, ns_b) = (format!("{name}-{a}"), format!("{name}-{b}"));
    let gw = at.gateway;

    let before = connect_from(&ns_a, public, 80);
    assert!(
        before.starts_with("error"),
        "nothing admitted before the name is resolved: {before}"
    );
    assert_eq!(
        resolve_from(&ns_a, gw, "up.sbx.test"),
        format!("rcode 0 {}", public)
    );
    assert_eq!(
        connect_from(&ns_a, public, 80),
        "hello 80",
        "the resolved address, the entry's port"
    );
    assert!(
        connect_from(&ns_a, public, 81).starts_with("error"),
        "only the entry's port"
    );
    assert_eq!(
        resolve_from(&ns_a, gw, "second.sbx.test"),
        "rcode 5",
        "a name off the list: REFUSED by the gateway (the upstream would answer it)"
    );
    assert!(connect_from(&ns_a, public2, 80).starts_with("error"));
    assert_eq!(
        resolve_from(&ns_a, gw, "c.wild.sbx.test"),
        format!("rcode 0 {}", public2),
        "below a wildcard"
    );
    assert_eq!(connect_from(&ns_a, public2, 8080), "hello 8080");
    assert!(
        connect_from(&ns_a, public2, 80).starts_with("error"),
        "the wildcard's port only"
    );
    assert_eq!(resolve_from(&ns_a, gw, "nowhere.sbx.test"), "rcode 5");
    assert_eq!(
        resolve_from(&ns_b, gw, "up.sbx.test"),
        "rcode 5",
        "another sandbox's list is not this one's"
    );
    assert!(
        connect_from(&ns_b, public, 80).starts_with("error"),
        "nor are its admissions"
    );
    let refused = net.refused_names(a);
    assert!(
        refused.contains(&("second.sbx.test".to_string(), 1))
            && refused.contains(&("nowhere.sbx.test".to_string(), 1)),
        "refused names are recorded: {refused:?}"
    );

    // A live update: up.sbx.test's admission moves to its new port without a new query; the
    // wildcard is gone, and with it what it admitted.
    let (mut held, greeting) = Held::open(&ns_a, public2, 8080);
    assert_eq!(greeting, "hello 8080");
    net.set_policy(a, &parse_allowlist(&["up.sbx.test:81"]).unwrap())
        .unwrap();
    assert_eq!(
        connect_from(&ns_a, public, 81),
        "hello 81",
        "admitted again under the new list"
    );
    assert!(connect_from(&ns_a, public, 80).starts_with("error"));
    assert!(
        connect_from(&ns_a, public2, 8080).starts_with("error"),
        "the wildcard's admission went with it"
    );
    assert_eq!(
        held.echo("still"),
        "still",
        "an open connection outlives the update"
    );
    assert_eq!(resolve_from(&ns_a, gw, "c.wild.sbx.test"), "rcode 5");

    // The gateway stops (its resolver with it) and a new one opens the same network: the
    // admissions are read back from the table, the resolver answers again.
    drop(guard.net.take());
    assert!(
        resolve_from(&ns_a, gw, "up.sbx.test").starts_with("error"),
        "no resolver while no gateway runs"
    );
    guard.net = Some(Network::open(cfg).expect("reopen"));
    let net = guard.net.as_ref().unwrap();
    let list = parse_allowlist(&["up.sbx.test:81"]).unwrap();
    net.restore(a, &list);
    net.attach(a, &list).unwrap();
    assert_eq!(
        connect_from(&ns_a, public, 81),
        "hello 81",
        "the admission survived the restart"
    );
    assert_eq!(
        resolve_from(&ns_a, gw, "up.sbx.test"),
        format!("rcode 0 {}", public)
    );
    assert_eq!(held.echo("after"), "after");
    drop(held);

    for id in [a, b] {
        net.detach(id).unwrap();
    }
    net.teardown().unwrap();
    guard.net = None;
    assert_eq!(left_on_host(&name, &[a, b]), Vec::<String>::new());
    drop(up);
}

#[test]
fn a_network_overlapping_the_hosts_is_refused_at_open() {
    if !runnable() {
        return;
    }
    let tag = format!("o{:04x}", std::process::id() & 0xffff);
    let up = Upstream::new(&tag, 9, &[]);
    let dir = tempfile::tempdir().unwrap();
    // 10.251.9.0/30 is routed to the upstream's veth; a /16 around it overlaps.
    let cfg = NetworkConfig {
        name: format!("o{tag}"),
        network: Ipv4Addr::new(10, 251, 0, 0),
        prefix: 16,
        state_dir: dir.path().into(),
        dns_upstream: None,
        conntrack_max: sbx_network::DEFAULT_CONNTRACK_MAX,
    };
    let err = Network::open(cfg).expect_err("overlap").to_string();
    assert!(
        err.contains("overlaps") && err.contains("route 10.251."),
        "{err}"
    );
    assert!(
        left_on_host(&format!("o{tag}"), &[]).is_empty(),
        "nothing made before the refusal"
    );
    drop(up);
}

/// A link of the test's own, and the lock file it made for it, removed on drop.
struct OtherBridge {
    link: String,
    lock: std::path::PathBuf,
}

impl Drop for OtherBridge {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "delete", "dev", &self.link])
            .output();
        let _ = std::fs::remove_file(&self.lock);
    }
}

#[test]
fn auto_skips_a_range_another_gateways_bridge_holds_naming_whose_it_is() {
    if !runnable() {
        return;
    }
    // Another gateway's bridge (network "d<tag>", its lock naming this process as its sbxd),
    // holding the first address of 10.254.30.0/24, where that gateway's resolver listens.
    let name = format!("d{:04x}", std::process::id() & 0xffff);
    let other = OtherBridge {
        link: format!("{name}0"),
        lock: std::path::Path::new(sbx_network::LOCK_DIR).join(format!("{name}.lock")),
    };
    std::fs::create_dir_all(sbx_network::LOCK_DIR).unwrap();
    std::fs::write(&other.lock, format!("{}\n", std::process::id())).unwrap();
    for args in [
        vec!["link", "add", &other.link, "type", "bridge"],
        vec!["addr", "add", "10.254.30.1/24", "dev", &other.link],
    ] {
        let out = Command::new("ip").args(&args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}: {out:?}");
    }
    let held = sbx_network::link::host_networks("none").unwrap();
    let whose = format!(
        "dev {}: the bridge of sbx network {name:?}, served by pid {}",
        other.link,
        std::process::id()
    );
    let said = held
        .iter()
        .find(|(a, len, _)| {
            sbx_network::policy::overlaps(Ipv4Addr::new(10, 254, 30, 1), 32, *a, *len)
        })
        .map(|(_, _, what)| what.clone())
        .unwrap_or_else(|| panic!("the bridge's address is the host's: {held:?}"));
    assert!(said.ends_with(&whose), "it says whose: {said:?}");

    // auto passes over it to the next range, and keeps that choice.
    let dir = tempfile::tempdir().unwrap();
    let ranges = ["10.254.30.0/24".to_string(), "10.254.31.0/24".to_string()];
    let chosen = sbx_network::auto_cidr(dir.path(), &format!("e{name}"), &ranges).unwrap();
    assert_eq!(chosen, "10.254.31.0/24");
    let kept = std::fs::read_to_string(dir.path().join(sbx_network::AUTO_FILE)).unwrap();
    assert_eq!(kept, chosen);
    // With only that range to try: refused, naming it and what holds it.
    let dir = tempfile::tempdir().unwrap();
    let err = sbx_network::auto_cidr(dir.path(), &format!("e{name}"), &ranges[..1])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("10.254.30.0/24 (in the way of {said})")),
        "{err}"
    );
    assert!(
        !dir.path().join(sbx_network::AUTO_FILE).exists(),
        "nothing kept"
    );
    drop(other);
}

/// Connect latency (median of N connects, each a new connection that reads the greeting) and
/// throughput (MiB/s of one connection writing to a sink) from inside namespace `ns` (or
/// the host's, with `None`) to `addr`.
fn measure(ns: Option<&str>, addr: Ipv4Addr, connects: usize, mib: usize) -> (f64, f64) {
    let script = format!(
        "import socket,time,statistics\n\
         lat=[]\n\
         for _ in range({connects}):\n    t=time.perf_counter(); s=socket.create_connection(('{addr}',80),timeout=5); s.recv(100); lat.append(time.perf_counter()-t); s.close()\n\
         s=socket.create_connection(('{addr}',9100),timeout=5); buf=b'x'*65536; t=time.perf_counter()\n\
         for _ in range({mib}*16): s.sendall(buf)\n\
         s.shutdown(socket.SHUT_WR); s.recv(10); el=time.perf_counter()-t\n\
         print(statistics.median(lat)*1000, {mib}/el)"
    );
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "python3", "-c", &script]);
            c
        }
        None => {
            let mut c = Command::new("python3");
            c.args(["-c", &script]);
            c
        }
    };
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<f64> = text
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    assert_eq!(
        v.len(),
        2,
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (v[0], v[1])
}

/// A sink on port 9100 in the upstream: reads to EOF, answers "ok".
const SINK: &str = "import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0',9100)); s.listen(8)\nprint('ready', flush=True)\nwhile True:\n    c,_=s.accept()\n    while c.recv(1<<20): pass\n    c.sendall(b'ok'); c.close()\n";

#[test]
fn the_network_costs_measured_side_by_side() {
    if !runnable() {
        return;
    }
    let rounds: usize = std::env::var("SBX_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let mib: usize = std::env::var("SBX_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let tag = format!("m{:04x}", std::process::id() & 0xffff);
    let name = format!("t{tag}");
    let up = Upstream::with_names(
        &tag,
        11,
        &[80],
        &[("up.sbx.test", fixtures::public_addr(11))],
    );
    let sink = Command::new("ip")
        .args(["netns", "exec", &up.ns, "python3", "-c", SINK])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut sink = scopeguard(sink);
    let mut ready = [0u8; 6];
    sink.0
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut ready)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = Uuid::new_v4();
    let mut guard = Net {
        net: None,
        ids: vec![a],
        name: name.clone(),
    };
    let net_config = NetworkConfig {
        name: name.clone(),
        network: Ipv4Addr::new(10, 253, 11, 0),
        prefix: 24,
        state_dir: dir.path().into(),
        dns_upstream: Some((up.addr, 53).into()),
        conntrack_max: sbx_network::DEFAULT_CONNTRACK_MAX,
    };
    guard.net = Some(Network::open(net_config).expect("network"));
    let net = guard.net.as_ref().unwrap();
    let small = parse_allowlist(&[format!("{}:80", up.addr), format!("{}:9100", up.addr)]).unwrap();
    net.attach(a, &small).unwrap();
    let ns = format!("{name}-{a}");
    // Side by side, interleaved: host, sandbox, host, sandbox.
    let (h1, s1) = (
        measure(None, up.addr, rounds, mib),
        measure(Some(&ns), up.addr, rounds, mib),
    );
    let (h2, s2) = (
        measure(None, up.addr, rounds, mib),
        measure(Some(&ns), up.addr, rounds, mib),
    );
    let host = ((h1.0 + h2.0) / 2.0, (h1.1 + h2.1) / 2.0);
    let sandbox = ((s1.0 + s2.0) / 2.0, (s1.1 + s2.1) / 2.0);
    // 1,000 entries over 200 port classes (the real ones among them): 200 rules, 1,000 set
    // elements.
    let mut big: Vec<String> = (0..998)
        .map(|i| {
            format!(
                "10.{}.{}.{}:{}",
                120 + i / 65536,
                (i / 256) % 256,
                i % 256,
                1000 + i % 200
            )
        })
        .collect();
    big.push(format!("{}:80", up.addr));
    big.push(format!("{}:9100", up.addr));
    let big = parse_allowlist(&big).unwrap();
    let t = Instant::now();
    net.set_policy(a, &big).unwrap();
    let update = t.elapsed();
    let b1 = measure(Some(&ns), up.addr, rounds, mib);
    net.set_policy(a, &small).unwrap();
    let s3 = measure(Some(&ns), up.addr, rounds, mib);
    net.set_policy(a, &big).unwrap();
    let b2 = measure(Some(&ns), up.addr, rounds, mib);
    let big_lat = (b1.0 + b2.0) / 2.0;
    let small_lat = (s3.0 + sandbox.0 * 2.0) / 3.0;
    // A name on the list: the sandbox asks the gateway's resolver (which asks the upstream's
    // answerer and admits the answer in one nft transaction before replying) vs the host
    // asking the same answerer directly. Interleaved, twice each.
    net.set_policy(a, &parse_allowlist(&["up.sbx.test:80"]).unwrap())
        .unwrap();
    let queries = rounds.clamp(10, 200);
    let gw = net.gateway();
    let (d1, g1) = (
        query_timing(None, up.addr, "up.sbx.test", queries),
        query_timing(Some(&ns), gw, "up.sbx.test", queries),
    );
    let (d2, g2) = (
        query_timing(None, up.addr, "up.sbx.test", queries),
        query_timing(Some(&ns), gw, "up.sbx.test", queries),
    );
    let (direct, via_gateway) = ((d1 + d2) / 2.0, (g1 + g2) / 2.0);
    eprintln!(
        "network costs ({rounds} connects, {mib} MiB per run; two runs each, interleaved):\n  \
         connect latency: host→upstream {:.3} ms, sandbox→upstream {:.3} ms (ratio {:.2})\n  \
         throughput: host→upstream {:.0} MiB/s, sandbox→upstream {:.0} MiB/s (ratio {:.2})\n  \
         1,000-entry allowlist (200 rules): connect {:.3} ms vs {:.3} ms with 2 entries (ratio {:.2}); applied in {:?}\n  \
         a name on the list ({queries} queries, median): through the gateway's resolver {:.3} ms, host→upstream answerer directly {:.3} ms (ratio {:.2})",
        host.0,
        sandbox.0,
        sandbox.0 / host.0,
        host.1,
        sandbox.1,
        sandbox.1 / host.1,
        big_lat,
        small_lat,
        big_lat / small_lat,
        update,
        via_gateway,
        direct,
        via_gateway / direct
    );
    // What is measured is real traffic: every connect got its greeting, every MiB reached
    // the sink (measure asserts both); the numbers are positive.
    assert!(host.0 > 0.0 && sandbox.0 > 0.0 && host.1 > 0.0 && sandbox.1 > 0.0);
    drop(sink);
    net.detach(a).unwrap();
    net.teardown().unwrap();
    guard.net = None;
    assert_eq!(left_on_host(&name, &[a]), Vec::<String>::new());
    drop(up);
}

/// A query for `name` (type A) with one additional record of its own: a TXT record of
/// `payload` bytes (what a workload would smuggle out inside a query for an allowed name).
/// What the answer's rcode was, or `error …`.
fn resolve_with_payload(ns: &str, server: Ipv4Addr, name: &str, payload: usize) -> String {
    let script = format!(
        r#"import socket, struct
qn = b"".join(bytes([len(l)]) + l.encode() for l in "{name}".split(".")) + b"\0"
txt = b"".join(bytes([len(c)]) + c for c in [b"x" * 200] * ({payload} // 200))
ar = b"\xc0\x0c" + struct.pack(">HHIH", 16, 1, 0, len(txt)) + txt
q = struct.pack(">HHHHHH", 4661, 256, 1, 0, 0, 1) + qn + b"\0\1\0\1" + ar
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
try:
    s.sendto(q, ("{server}", 53)); r, _ = s.recvfrom(4096); print("rcode", r[3] & 15)
except Exception as e:
    print("error", type(e).__name__, e)"#
    );
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "python3", "-c", &script])
        .output()
        .expect("python3");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn answers_cannot_rebind_a_sandbox_queries_carry_only_their_question_and_a_flood_delays_only_its_sender()
 {
    if !runnable() {
        return;
    }
    let tag = format!("r{:04x}", std::process::id() & 0xffff);
    let name = format!("t{tag}");
    let third = 14;
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let gw = Ipv4Addr::new(10, 253, third, 1);
    // The sandboxes' addresses are leased in order: a .2, b .3, c .4.
    let neighbour = Ipv4Addr::new(10, 253, third, 3);
    let host_side = Ipv4Addr::new(10, 251, third, 1);
    let log = dir.path().join("queries.log");
    let up = Upstream::with_names_logged(
        &tag,
        third,
        &[80],
        &[
            ("up.sbx.test", fixtures::public_addr(third)),
            ("bridge.sbx.test", gw),
            ("neighbour.sbx.test", neighbour),
            ("host.sbx.test", host_side),
            ("loop.sbx.test", Ipv4Addr::new(127, 0, 0, 1)),
            ("meta.sbx.test", Ipv4Addr::new(169, 254, 169, 254)),
        ],
        Some(&log),
    );
    let mut guard = Net {
        net: None,
        ids: vec![a, b, c],
        name: name.clone(),
    };
    let mut cfg = config(&name, third, dir.path());
    cfg.dns_upstream = Some((up.addr, 53).into());
    guard.net = Some(Network::open(cfg).expect("network"));
    let net = guard.net.as_ref().unwrap();
    let list = parse_allowlist(&[
        "up.sbx.test:80",
        "bridge.sbx.test:80",
        "neighbour.sbx.test:80",
        "host.sbx.test:80",
        "loop.sbx.test:80",
        "meta.sbx.test:80",
    ])
    .unwrap();
    let at = net.attach(a, &list).unwrap();
    assert_eq!(at.gateway, gw);
    net.attach(b, &list).unwrap();
    net.attach(c, &list).unwrap();
    let (ns_a, ns_b) = (format!("{name}-{a}"), format!("{name}-{b}"));

    // Rebinding: an allowed name answered with the bridge's, a neighbour's, the host's, a
    // loopback or a link-local address admits nothing and is refused.
    for (bad, addr) in [
        ("bridge.sbx.test", gw),
        ("neighbour.sbx.test", neighbour),
        ("host.sbx.test", host_side),
        ("loop.sbx.test", Ipv4Addr::new(127, 0, 0, 1)),
        ("meta.sbx.test", Ipv4Addr::new(169, 254, 169, 254)),
    ] {
        assert_eq!(resolve_from(&ns_a, gw, bad), "rcode 5", "{bad}");
        let reached = connect_from(&ns_a, addr, 80);
        assert!(reached.starts_with("error"), "{bad} -> {addr}: {reached}");
    }
    assert!(
        net.refused_names(a)
            .iter()
            .any(|(n, _)| n == "neighbour.sbx.test"),
        "a refused answer is recorded"
    );
    assert_eq!(
        resolve_from(&ns_a, gw, "up.sbx.test"),
        format!("rcode 0 {}", up.public),
        "an ordinary answer still admits"
    );

    // Only the question goes upstream: a query for an allowed name carrying a 1 KB TXT
    // record of the sandbox's reaches the upstream with no additional record, and short.
    let _ = std::fs::remove_file(&log);
    assert_eq!(
        resolve_with_payload(&ns_a, gw, "up.sbx.test", 1000),
        "rcode 0"
    );
    let seen = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = seen.lines().collect();
    assert!(!lines.is_empty(), "the upstream got the query");
    for line in &lines {
        let f: Vec<usize> = line.split(' ').map(|n| n.parse().unwrap()).collect();
        assert!(
            f[0] < 100 && f[1] == 0 && f[2] == 0,
            "the upstream got {line}"
        );
    }

    // A flood: b sends queries for an allowed name as fast as it can for 4 s, while a asks
    // 200 times, one after another; a's answers stay quick.
    let flood = format!(
        r#"import socket, struct, time
q = struct.pack(">HHHHHH", 1, 256, 1, 0, 0, 0) + b"\2up\3sbx\4test\0\0\1\0\1"
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setblocking(False)
end = time.time() + 4; n = 0
while time.time() < end:
    try: s.sendto(q, ("{gw}", 53)); n += 1
    except BlockingIOError: pass
    try: s.recv(4096)
    except BlockingIOError: pass
print(n)"#
    );
    let probe_script = format!(
        r#"import socket, struct, time
q = struct.pack(">HHHHHH", 4660, 256, 1, 0, 0, 0) + b"\2up\3sbx\4test\0\0\1\0\1"
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1)
lat = []
for _ in range(200):
    t = time.perf_counter()
    try:
        s.sendto(q, ("{gw}", 53)); s.recvfrom(4096); lat.append(time.perf_counter() - t)
    except socket.timeout:
        lat.append(1.0)
lat.sort(); print(lat[len(lat) * 99 // 100] * 1000, lat[len(lat) // 2] * 1000)"#
    );
    // (p99, p50) in ms of 200 queries of a, one after another.
    let probe = || {
        let out = Command::new("ip")
            .args(["netns", "exec", &ns_a, "python3", "-c", &probe_script])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut f = text.split_whitespace().map(|v| v.parse::<f64>().unwrap());
        (f.next().unwrap(), f.next().unwrap())
    };
    let (quiet_p99, quiet_p50) = probe();
    let flooder = Command::new("ip")
        .args(["netns", "exec", &ns_b, "python3", "-c", &flood])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let (p99, p50) = probe();
    let flooded = flooder.wait_with_output().unwrap();
    let sent: u64 = String::from_utf8_lossy(&flooded.stdout)
        .trim()
        .parse()
        .unwrap();
    println!(
        "flood: {sent} queries from b in 4 s; a's answers p50 {p50:.2} ms, p99 {p99:.2} ms \
         (without the flood: p50 {quiet_p50:.2} ms, p99 {quiet_p99:.2} ms)"
    );
    assert!(sent > 10_000, "the flood sent only {sent} queries");
    assert!(p99 < 50.0, "a's p99 was {p99:.1} ms while b flooded");

    for id in [a, b, c] {
        net.detach(id).unwrap();
    }
    net.teardown().unwrap();
    guard.net = None;
    assert_eq!(left_on_host(&name, &[a, b, c]), Vec::<String>::new());
    drop(up);
}

#[test]
fn an_answer_into_a_network_the_host_is_attached_to_is_refused_unless_the_policy_names_it() {
    if !runnable() {
        return;
    }
    let tag = format!("l{:04x}", std::process::id() & 0xffff);
    let name = format!("t{tag}");
    let third = 15;
    // Two networks the host is attached to, as a LAN or a container bridge is: the
    // upstream's own veth (10.251.15.0/30, private) and one whose addresses are public by
    // IANA's registry (192.52.193.200/30) — only the host's on-link route says it is local.
    let lan = Attached::new(&tag, Ipv4Addr::new(192, 52, 193, 200), &[80]);
    let public = fixtures::public_addr(third);
    let up = Upstream::with_names(
        &tag,
        third,
        &[80],
        &[
            ("public.sbx.test", public),
            ("lan.sbx.test", lan.peer),
            ("bridge.sbx.test", Ipv4Addr::new(10, 251, third, 2)),
            ("private.sbx.test", Ipv4Addr::new(10, 252, third, 1)),
            ("doc.sbx.test", Ipv4Addr::new(203, 0, 113, 9)),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let mut guard = Net {
        net: None,
        ids: vec![a, b],
        name: name.clone(),
    };
    let mut cfg = config(&name, third, dir.path());
    cfg.dns_upstream = Some((up.addr, 53).into());
    guard.net = Some(Network::open(cfg).expect("network"));
    let net = guard.net.as_ref().unwrap();
    let names = [
        "public.sbx.test:80",
        "lan.sbx.test:80",
        "bridge.sbx.test:80",
        "private.sbx.test:80",
        "doc.sbx.test:80",
    ];
    let at = net.attach(a, &parse_allowlist(&names).unwrap()).unwrap();
    let gw = at.gateway;
    let (ns_a, ns_b) = (format!("{name}-{a}"), format!("{name}-{b}"));

    // A public address, reached through a route: admitted, reached.
    assert_eq!(
        resolve_from(&ns_a, gw, "public.sbx.test"),
        format!("rcode 0 {public}")
    );
    assert_eq!(connect_from(&ns_a, public, 80), "hello 80");
    // Into a network the host is attached to, public or private, or into a private or
    // documentation range: refused, recorded, nothing admitted.
    for (bad, addr) in [
        ("lan.sbx.test", lan.peer),
        ("bridge.sbx.test", up.addr),
        ("private.sbx.test", up.second),
    ] {
        assert_eq!(resolve_from(&ns_a, gw, bad), "rcode 5", "{bad} -> {addr}");
        let reached = connect_from(&ns_a, addr, 80);
        assert!(reached.starts_with("error"), "{bad} -> {addr}: {reached}");
    }
    // (No connect to it: the host has no route of the test's for it.)
    assert_eq!(resolve_from(&ns_a, gw, "doc.sbx.test"), "rcode 5");
    let refused = net.refused_names(a);
    for bad in [
        "lan.sbx.test",
        "bridge.sbx.test",
        "private.sbx.test",
        "doc.sbx.test",
    ] {
        assert!(
            refused.iter().any(|(n, c)| n == bad && *c >= 1),
            "{bad} is recorded as a denial: {refused:?}"
        );
    }
    let (denied, _) = net.denial_summary(a);
    assert!(denied >= 4, "the sandbox's denials count them: {denied}");

    // A policy that names the network (on another port) admits the name's answers into it,
    // to the name's port.
    let named = parse_allowlist(&[
        "lan.sbx.test:80",
        "192.52.193.200/30:81",
        "bridge.sbx.test:80",
        &format!("10.251.{third}.0/30:81"),
    ])
    .unwrap();
    net.attach(b, &named).unwrap();
    assert!(
        connect_from(&ns_b, lan.peer, 80).starts_with("error"),
        "nothing admitted to :80 before the name is resolved"
    );
    assert_eq!(
        resolve_from(&ns_b, gw, "lan.sbx.test"),
        format!("rcode 0 {}", lan.peer)
    );
    assert_eq!(connect_from(&ns_b, lan.peer, 80), "hello 80");
    assert_eq!(
        resolve_from(&ns_b, gw, "bridge.sbx.test"),
        format!("rcode 0 {}", up.addr)
    );
    assert_eq!(connect_from(&ns_b, up.addr, 80), "hello 80");

    for id in [a, b] {
        net.detach(id).unwrap();
    }
    net.teardown().unwrap();
    guard.net = None;
    assert_eq!(left_on_host(&name, &[a, b]), Vec::<String>::new());
    drop(up);
    drop(lan);
}

#[test]
fn a_sandbox_gets_only_the_question_and_its_answer_records() {
    if !runnable() {
        return;
    }
    let tag = format!("x{:04x}", std::process::id() & 0xffff);
    let name = format!("t{tag}");
    let third = 16;
    let public = fixtures::public_addr(third);
    let up = Upstream::with_answers(
        &tag,
        third,
        &[],
        &[("extra.sbx.test", Answer::WithExtra(public))],
        None,
    );
    let dir = tempfile::tempdir().unwrap();
    let a = Uuid::new_v4();
    let mut guard = Net {
        net: None,
        ids: vec![a],
        name: name.clone(),
    };
    let mut cfg = config(&name, third, dir.path());
    cfg.dns_upstream = Some((up.addr, 53).into());
    guard.net = Some(Network::open(cfg).expect("network"));
    let net = guard.net.as_ref().unwrap();
    let at = net
        .attach(a, &parse_allowlist(&["extra.sbx.test:80"]).unwrap())
        .unwrap();
    let ns_a = format!("{name}-{a}");
    // The upstream's own reply carries an NS record and a TXT record besides the answer.
    assert_eq!(
        reply_sections_from(&up.ns, up.addr, "extra.sbx.test"),
        "rcode 0 an 1 ns 1 ar 1 smuggled"
    );
    // The sandbox gets the answer and nothing else.
    assert_eq!(
        reply_sections_from(&ns_a, at.gateway, "extra.sbx.test"),
        "rcode 0 an 1 ns 0 ar 0"
    );
    assert_eq!(
        resolve_from(&ns_a, at.gateway, "extra.sbx.test"),
        format!("rcode 0 {public}")
    );
    net.detach(a).unwrap();
    net.teardown().unwrap();
    guard.net = None;
    assert_eq!(left_on_host(&name, &[a]), Vec::<String>::new());
    drop(up);
}

#[test]
fn one_sandbox_adds_at_most_its_budget_of_conntrack_entries() {
    if !runnable() {
        return;
    }
    let tag = format!("c{:04x}", std::process::id() & 0xffff);
    let name = format!("t{tag}");
    let third = 17;
    let public = fixtures::public_addr(third);
    let up = Upstream::with_names(&tag, third, &[], &[("up.sbx.test", public)]);
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let mut guard = Net {
        net: None,
        ids: vec![a, b],
        name: name.clone(),
    };
    let mut cfg = config(&name, third, dir.path());
    cfg.dns_upstream = Some((up.addr, 53).into());
    guard.net = Some(Network::open(cfg).expect("network"));
    let net = guard.net.as_ref().unwrap();
    let list =
        parse_allowlist(&[format!("{public}:1024-65535/udp"), "up.sbx.test:80".into()]).unwrap();
    let at = net.attach(a, &list).unwrap();
    net.attach(b, &list).unwrap();
    let (ns_a, ns_b) = (format!("{name}-{a}"), format!("{name}-{b}"));
    let budget = 4096;

    // 20,000 new UDP flows, each a datagram to another port of an address the policy admits.
    let flows = format!(
        r#"import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sent = 0
for port in range(2000, 22000):
    try:
        s.sendto(b"x", ("{public}", port)); sent += 1
    except OSError:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
print(sent)"#
    );
    let out = Command::new("ip")
        .args(["netns", "exec", &ns_a, "python3", "-c", &flows])
        .output()
        .unwrap();
    let tried: usize = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{out:?}"));
    let entries = conntrack_entries_from(at.address);
    println!("20,000 new flows tried ({tried} sent): {entries} conntrack entries from the sandbox");
    assert!(
        entries <= budget + 64,
        "one sandbox added {entries} conntrack entries (budget {budget})"
    );
    assert!(entries >= budget / 2, "the flows were made: {entries}");
    // The resolver is behind the same budget (a query from a new port is a new flow): a
    // sandbox at its budget gets no answer, another sandbox still does.
    assert!(
        resolve_from(&ns_a, at.gateway, "up.sbx.test").starts_with("error"),
        "a sandbox at its budget opens no new flow to the resolver either"
    );
    assert_eq!(
        resolve_from(&ns_b, at.gateway, "up.sbx.test"),
        format!("rcode 0 {public}")
    );
    // Each refusal is counted, for its sandbox only (read from the table: at most
    // DENIAL_REFRESH old, so after it).
    std::thread::sleep(sbx_network::DENIAL_REFRESH);
    let refused = net.budget_refusals(a);
    assert!(
        refused.connections as usize >= tried.saturating_sub(budget + 64),
        "{refused:?} of {tried} flows"
    );
    assert_eq!(net.budget_refusals(b).connections, 0);

    for id in [a, b] {
        net.detach(id).unwrap();
    }
    net.teardown().unwrap();
    guard.net = None;
    assert_eq!(left_on_host(&name, &[a, b]), Vec::<String>::new());
    drop(up);
}

#[test]
fn a_sandbox_past_its_dns_budget_is_counted_and_another_is_still_answered() {
    if !runnable() {
        return;
    }
    let tag = format!("q{:04x}", std::process::id() & 0xffff);
    let name = format!("t{tag}");
    let third = 18;
    let public = fixtures::public_addr(third);
    let up = Upstream::with_answers(
        &tag,
        third,
        &[],
        &[
            ("fast.sbx.test", Answer::A(public)),
            ("slow.sbx.test", Answer::Silent),
        ],
        None,
    );
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let mut guard = Net {
        net: None,
        ids: vec![a, b],
        name: name.clone(),
    };
    let mut cfg = config(&name, third, dir.path());
    cfg.dns_upstream = Some((up.addr, 53).into());
    guard.net = Some(Network::open(cfg).expect("network"));
    let net = guard.net.as_ref().unwrap();
    let list = parse_allowlist(&["fast.sbx.test:80", "slow.sbx.test:80"]).unwrap();
    let at = net.attach(a, &list).unwrap();
    net.attach(b, &list).unwrap();
    let (ns_a, ns_b) = (format!("{name}-{a}"), format!("{name}-{b}"));
    // a: 300 queries at once (one socket, one flow) for the name whose upstream never
    // answers: its budget lets 4 wait on the upstream, the rest are dropped and counted.
    let gw = at.gateway;
    let flood = format!(
        r#"import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(300):
    s.sendto(struct.pack(">HHHHHH", i, 256, 1, 0, 0, 0) + b"\4slow\3sbx\4test\0\0\1\0\1", ("{gw}", 53))
print("sent")"#
    );
    let out = Command::new("ip")
        .args(["netns", "exec", &ns_a, "python3", "-c", &flood])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "sent",
        "{out:?}"
    );
    // b is answered at once meanwhile, every time.
    let t = Instant::now();
    for _ in 0..20 {
        assert_eq!(
            resolve_from(&ns_b, gw, "fast.sbx.test"),
            format!("rcode 0 {public}")
        );
    }
    let took = t.elapsed();
    let refused = net.budget_refusals(a);
    println!(
        "a's budgets refused {refused:?}; b answered 20 of 20 meanwhile ({took:?}, each a python3 started in its namespace)"
    );
    assert!(
        refused.dns_queries >= 250,
        "the dropped queries are counted: {refused:?}"
    );
    assert_eq!(net.budget_refusals(b).dns_queries, 0);

    for id in [a, b] {
        net.detach(id).unwrap();
    }
    net.teardown().unwrap();
    guard.net = None;
    assert_eq!(left_on_host(&name, &[a, b]), Vec::<String>::new());
    drop(up);
}
