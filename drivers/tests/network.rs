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

use sbx_drivers::network::fixtures::{Held, SERVER, Upstream, connect_from, runnable};
use sbx_drivers::network::{Network, NetworkConfig, parse_allowlist};
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

    // A new gateway instance over the same state: same addresses, nothing re-made, the held
    // connection still up, the policy still enforced.
    let reopened = Network::open(config(&name, 7, dir.path())).expect("reopen");
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
