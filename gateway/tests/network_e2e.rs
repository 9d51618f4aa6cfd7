//! Sandbox networking end to end through the real sbxd (oci driver, `--network-cidr`) and the
//! real `sbx` CLI, tried from inside the sandboxes: what a policy admits is reached, the rest
//! is refused at once and recorded; a live update takes effect without restarting the
//! workload; a SIGKILL of sbxd keeps every address, open connection and rule; deletes leave
//! nothing on the host. Needs root, runc, busybox-static, ip, nft and python3.
//!
//! Every packet goes to namespaces this test makes: the "upstream" (its own addresses in
//! 10.251/16 and 10.252/16, and public ones in 192.52.193/24 the host routes to it while the
//! test runs, its own servers) and the sandboxes. Everything made — sandboxes,
//! namespaces, veths, the bridge, the nftables table — is removed at the end, also when the
//! test fails (drop guards), and the test checks that nothing is left.

mod common;

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{CliRun, DataDir, Sbxd, assert_oci_left_nothing, sbx, unique};
use sbx_drivers::network::fixtures::{Answer, Upstream, public_addr, runnable};

/// One test's gateway with its own network name, CIDR and cgroup parent; on drop its
/// sandboxes are deleted (while sbxd runs), then sbxd, the table and the bridge go.
struct World {
    data: DataDir,
    cgroup_parent: String,
    name: String,
    cidr: String,
    sbxd: Option<Sbxd>,
    sandboxes: Vec<&'static str>,
    /// `--network-dns`: the upstream's DNS answerer.
    dns: Option<String>,
    /// `--driver`: empty for sbxd's default (oci).
    driver: &'static str,
    /// More flags for sbxd (the vm driver's asset cache and boot timeout).
    extra: Vec<String>,
    /// More environment for sbxd.
    env: Vec<(&'static str, String)>,
}

impl World {
    fn new(tag: &str, third: u8) -> World {
        World {
            data: DataDir::new(),
            cgroup_parent: format!("sbx-gateway-tests-net-{}", unique()),
            name: format!("n{tag}"),
            cidr: format!("10.253.{third}.0/24"),
            sbxd: None,
            sandboxes: Vec::new(),
            dns: None,
            driver: "",
            extra: Vec::new(),
            env: Vec::new(),
        }
    }

    fn start(&mut self) -> String {
        // The process driver's cgroup parent is the tests' own (common::Sbxd gives it).
        let mut flags = vec![
            "--oci-cgroup-parent",
            &self.cgroup_parent,
            "--network-cidr",
            &self.cidr,
            "--network-name",
            &self.name,
        ];
        if let Some(dns) = &self.dns {
            flags.extend(["--network-dns", dns]);
        }
        flags.extend(self.extra.iter().map(String::as_str));
        let metrics_file = self.metrics_file();
        let metrics_file = metrics_file.to_str().unwrap();
        flags.extend([
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-addr-file",
            metrics_file,
        ]);
        let env: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let d = Sbxd::start_with_env(self.data.path(), self.driver, &flags, &env);
        let ep = d.endpoint();
        self.sbxd = Some(d);
        ep
    }

    fn metrics_file(&self) -> std::path::PathBuf {
        self.data.path().join("metrics-addr")
    }

    /// sbxd's metrics, scraped now and parsed.
    fn metrics(&self) -> common::metrics::Samples {
        let addr = std::fs::read_to_string(self.metrics_file()).unwrap();
        tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(common::metrics::scrape(addr.trim()))
    }

    fn sigkill(&mut self) {
        if let Some(d) = self.sbxd.as_mut() {
            d.sigkill();
        }
        self.sbxd = None;
    }

    /// What of the sandboxes' networks is on the host: veths into the bridge, namespaces
    /// named after the network, chains and map entries in the table.
    fn left_on_host(&self) -> Vec<String> {
        let mut left = Vec::new();
        let out =
            |cmd: &mut Command| String::from_utf8_lossy(&cmd.output().unwrap().stdout).into_owned();
        let bridge = format!("{}0", self.name);
        let ports = out(Command::new("ip").args(["-o", "link", "show", "master", &bridge]));
        if !ports.trim().is_empty() {
            left.push(format!("veths on {bridge}: {ports}"));
        }
        for ns in std::fs::read_dir("/run/netns")
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = ns.file_name().to_string_lossy().into_owned();
            if n.starts_with(&format!("{}-", self.name)) {
                left.push(format!("netns {n}"));
            }
        }
        let table = out(Command::new("nft").args(["list", "table", "inet", &self.name]));
        if table.contains("chain sb_") {
            left.push("a sandbox chain in the table".into());
        }
        if table.contains("jump sb_") {
            left.push("a sandbox entry in the table's map".into());
        }
        let driver = if self.driver.is_empty() {
            "oci"
        } else {
            self.driver
        };
        let leases = self
            .data
            .path()
            .join(format!("drivers/{driver}/network/leases"));
        if std::fs::read_dir(&leases).map(|d| d.count()).unwrap_or(0) > 0 {
            left.push("an address lease".into());
        }
        left
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(d) = &self.sbxd {
            let ep = d.endpoint();
            for name in &self.sandboxes {
                let _ = sbx(&ep, &["sandbox", "delete", name]);
            }
        }
        self.sbxd = None;
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.name])
            .output();
        let _ = Command::new("ip")
            .args(["link", "delete", "dev", &format!("{}0", self.name)])
            .output();
        let _ = std::fs::remove_file(
            std::path::Path::new(sbx_drivers::network::LOCK_DIR)
                .join(format!("{}.lock", self.name)),
        );
        for ns in std::fs::read_dir("/run/netns")
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = ns.file_name().to_string_lossy().into_owned();
            if n.starts_with(&format!("{}-", self.name)) {
                let _ = Command::new("ip").args(["netns", "delete", &n]).output();
            }
        }
        for hierarchy in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::remove_dir(hierarchy.path().join(&self.cgroup_parent));
        }
    }
}

fn exec(ep: &str, name: &str, script: &str) -> CliRun {
    sbx(ep, &["sandbox", "exec", name, "--", "sh", "-c", script])
}

/// What `nc` from inside sandbox `name` got from `addr:port` within 2 s: the first line the
/// server sent, or "refused: …".
fn connect(ep: &str, name: &str, addr: &str, port: u16) -> String {
    // busybox nc keeps a connection open after its stdin ends: `timeout` ends it.
    let run = exec(
        ep,
        name,
        &format!("timeout 2 nc {addr} {port} </dev/null 2>&1 | head -1"),
    );
    let text = run.stdout.trim().to_string();
    if text.starts_with("hello") || text.starts_with("peer") || text.starts_with("host") {
        text
    } else {
        format!("refused: {text} {}", run.stderr.trim())
    }
}

/// The bytes sandbox `name` received and sent, as `sbx sandbox stats` reads them.
fn traffic(ep: &str, name: &str) -> (u64, u64) {
    let all = sbx(ep, &["sandbox", "stats", name, "-o", "json"]).json();
    let now = &all[0]["current"];
    match (
        now["network_rx_bytes"].as_u64(),
        now["network_tx_bytes"].as_u64(),
    ) {
        (Some(rx), Some(tx)) => (rx, tx),
        _ => panic!("no network figures for a networked sandbox: {all}"),
    }
}

fn network(ep: &str, name: &str) -> serde_json::Value {
    sbx(ep, &["sandbox", "network", "get", name, "-o", "json"]).json()
}

#[test]
fn an_egress_policy_admits_what_it_lists_changes_live_and_survives_a_sigkill() {
    if !runnable() {
        return;
    }
    let tag = format!("a{:04x}", std::process::id() & 0xffff);
    let up = Upstream::with_names(
        &tag,
        20,
        &[80, 81, 8080],
        &[
            ("up.sbx.test", public_addr(20)),
            ("second.sbx.test", std::net::Ipv4Addr::new(10, 252, 20, 1)),
        ],
    );
    let upa = up.addr.to_string();
    // What up.sbx.test answers: an address the resolver calls public.
    let public = up.public.to_string();
    let mut w = World::new(&tag, 20);
    w.dns = Some(upa.clone());
    let ep = w.start();
    w.sandboxes = vec!["web", "peer", "iso", "named", "bn", "bi"];

    // web: allowed upstream:80 and :8080, and its main process holds a connection to :8080
    // open, fed from a FIFO in its volume, writing what comes back to /sandbox/held.
    let hold = format!(
        "rm -f /sandbox/f; mkfifo /sandbox/f; exec 3<>/sandbox/f; exec nc {upa} 8080 <&3 >/sandbox/held"
    );
    let t = Instant::now();
    let created = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "web",
            "--allow",
            &format!("{upa}:80"),
            "--allow",
            &format!("{upa}:8080/tcp"),
            "--",
            "sh",
            "-c",
            &hold,
        ],
    );
    assert_eq!(created.code, 0, "{created:?}");
    let networked = t.elapsed();
    let peer = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "peer",
            "--network",
            "policy",
            "--",
            "sh",
            "-c",
            "while true; do echo peer | nc -l -p 9000; done",
        ],
    );
    assert_eq!(peer.code, 0, "{peer:?}");
    let t = Instant::now();
    let iso = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "iso",
            "--network",
            "none",
            "--",
            "sleep",
            "3600",
        ],
    );
    assert_eq!(iso.code, 0, "{iso:?}");
    let unnetworked = t.elapsed();
    let named = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "named",
            "--allow",
            "up.sbx.test:80",
            "--",
            "sleep",
            "3600",
        ],
    );
    assert_eq!(named.code, 0, "{named:?}");
    eprintln!(
        "create -> Ready (sbx sandbox create, waits for Ready): with a network {networked:?}, \
         --network none {unnetworked:?} (ratio {:.2})",
        networked.as_secs_f64() / unnetworked.as_secs_f64()
    );

    let net = network(&ep, "web");
    assert_eq!(net["mode"], "policy", "{net}");
    let addr = net["address"].as_str().unwrap().to_string();
    let gateway = net["gateway"].as_str().unwrap().to_string();
    let peer_addr = network(&ep, "peer")["address"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        addr.starts_with("10.253.20.") && peer_addr.starts_with("10.253.20.") && addr != peer_addr
    );

    // A sandbox on the network sees the host's /sys, bound read-only: it can write nothing
    // there (the kernel refuses it a sysfs of its own network namespace).
    let sys = sbx(
        &ep,
        &[
            "sandbox",
            "exec",
            "named",
            "--",
            "sh",
            "-c",
            "grep ' /sys ' /proc/mounts; echo x > /sys/class/net/lo/mtu && echo WROTE; \
             mkdir /sys/sbx-probe && echo MADE; true",
        ],
    );
    assert_eq!(sys.code, 0, "{sys:?}");
    let mount = sys
        .stdout
        .lines()
        .find(|l| l.contains(" /sys "))
        .unwrap_or("");
    let options: Vec<&str> = mount.split(' ').nth(3).unwrap_or("").split(',').collect();
    assert!(options.contains(&"ro"), "/sys is not read-only: {sys:?}");
    assert!(
        !sys.stdout.contains("WROTE") && !sys.stdout.contains("MADE"),
        "{sys:?}"
    );

    // What the policy admits, and what it does not.
    assert_eq!(connect(&ep, "web", &upa, 80), "hello 80");
    let t = Instant::now();
    let refused = connect(&ep, "web", &upa, 81);
    assert!(
        refused.starts_with("refused"),
        "upstream:81 is not allowed: {refused}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "refused at once, not timed out"
    );
    let second = connect(&ep, "web", &up.second.to_string(), 80);
    assert!(
        second.starts_with("refused"),
        "a second upstream address: {second}"
    );
    // Another sandbox, the gateway's gRPC port, and the host's services on either address.
    let to_peer = connect(&ep, "web", &peer_addr, 9000);
    assert!(to_peer.starts_with("refused"), "another sandbox: {to_peer}");
    let grpc_port: u16 = ep
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let to_grpc = connect(&ep, "web", &gateway, grpc_port);
    assert!(
        to_grpc.starts_with("refused"),
        "the gateway's gRPC port: {to_grpc}"
    );
    let host_any = TcpListener::bind("0.0.0.0:0").unwrap();
    let host_lo = TcpListener::bind("127.0.0.1:0").unwrap();
    let (any_port, lo_port) = (
        host_any.local_addr().unwrap().port(),
        host_lo.local_addr().unwrap().port(),
    );
    for l in [host_any, host_lo] {
        std::thread::spawn(move || {
            use std::io::Write;
            for mut c in l.incoming().take(8).flatten() {
                let _ = c.write_all(b"host\n");
            }
        });
    }
    let to_host = connect(&ep, "web", &gateway, any_port);
    assert!(
        to_host.starts_with("refused"),
        "a host service on the bridge's address: {to_host}"
    );
    let to_lo = connect(&ep, "web", "127.0.0.1", lo_port);
    assert!(to_lo.starts_with("refused"), "the host's loopback: {to_lo}");
    // Mode none: loopback only.
    let iso_links = exec(&ep, "iso", "ip -o link | cut -d: -f2 | tr -d ' \\n'");
    assert_eq!(iso_links.stdout.trim(), "lo", "{iso_links:?}");
    assert!(connect(&ep, "iso", &upa, 80).starts_with("refused"));
    // The workload cannot change its own network.
    let spoof = exec(&ep, "web", &format!("ip addr add {peer_addr}/32 dev eth0"));
    assert_ne!(spoof.code, 0, "the workload changed its address: {spoof:?}");

    // The denials, on the sandbox.
    let denials = network(&ep, "web")["denials"].clone();
    let has = |dest: &str, port: u64| {
        denials.as_array().unwrap().iter().any(|d| {
            d["destination"] == dest && d["port"] == port && d["packets"].as_u64().unwrap() >= 1
        })
    };
    assert!(
        has(&upa, 81)
            && has(&up.second.to_string(), 80)
            && has(&peer_addr, 9000)
            && has(&gateway, u64::from(grpc_port)),
        "{denials}"
    );

    // The denials reach the sandbox's record (one MODIFIED event per change; the driver
    // looks every few seconds): `sbx sandbox get` and the watch stream carry them.
    let began = Instant::now();
    let seen = loop {
        let v = sbx(&ep, &["sandbox", "get", "web", "-o", "json"]).json();
        if v["network_denied"].as_u64().unwrap_or(0) > 0 {
            break v;
        }
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "no denial reached the sandbox: {v}"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    eprintln!(
        "a denial reached the sandbox's record in {:?}",
        began.elapsed()
    );
    assert!(seen["network_last_denial"].as_str().is_some(), "{seen}");
    let rv = seen["resource_version"].as_u64().unwrap();
    let watched = common::run_bounded(
        Command::new("timeout")
            .args(["3", common::SBX, "sandbox", "watch", "-o", "json"])
            .args(["--resource-version", &(rv - 1).to_string()])
            .env("SBX_ENDPOINT", &ep),
        "sbx sandbox watch",
    );
    let carried = watched.stdout.lines().any(|line| {
        serde_json::from_str::<serde_json::Value>(line).is_ok_and(|e| {
            e["type"] == "Modified"
                && e["sandbox"]["name"] == "web"
                && e["sandbox"]["network_denied"].as_u64().unwrap_or(0) > 0
        })
    });
    assert!(carried, "the watch stream carries the denial: {watched:?}");

    // A hostname entry: the sandbox resolves through the gateway's resolver, which answers
    // the name on its list (and admits that answer) and refuses the rest.
    let resolv = exec(&ep, "named", "cat /etc/resolv.conf").ok().to_string();
    assert_eq!(resolv.trim(), format!("nameserver {gateway}"));
    assert!(
        connect(&ep, "named", &public, 80).starts_with("refused"),
        "nothing admitted before the name is resolved"
    );
    let looked_up = exec(&ep, "named", "nslookup up.sbx.test");
    assert!(looked_up.stdout.contains(&public), "{looked_up:?}");
    assert_eq!(
        connect(&ep, "named", &public, 80),
        "hello 80",
        "the name's answer, admitted"
    );
    assert!(
        connect(&ep, "named", &public, 81).starts_with("refused"),
        "its port only"
    );
    let off_list = exec(&ep, "named", "nslookup second.sbx.test");
    assert!(
        !off_list.stdout.contains(&up.second.to_string()),
        "a name off the list is not answered: {off_list:?}"
    );
    assert!(connect(&ep, "named", &up.second.to_string(), 80).starts_with("refused"));
    let named_denials = network(&ep, "named")["denials"].clone();
    assert!(
        named_denials
            .as_array()
            .unwrap()
            .iter()
            .any(|d| { d["destination"] == "second.sbx.test" && d["protocol"] == "dns" }),
        "{named_denials}"
    );
    let web_lookup = exec(&ep, "web", "nslookup up.sbx.test");
    assert!(
        !web_lookup.stdout.contains(&format!("Address: {public}")),
        "web's list holds no names: {web_lookup:?}"
    );

    let table = sbx(&ep, &["sandbox", "network", "get", "web"])
        .ok()
        .to_string();
    assert!(
        table.contains("DESTINATION") && table.contains(&upa),
        "{table}"
    );
    let get = sbx(&ep, &["sandbox", "get", "web"]).ok().to_string();
    assert!(
        get.contains(&format!("address {addr}")) && get.contains(&format!("{upa}:81/tcp")),
        "{get}"
    );

    // The held connection works; a live update admits :81 without restarting the workload.
    let held = |ep: &str, line: &str| {
        exec(
            ep,
            "web",
            &format!("echo {line} > /sandbox/f; sleep 0.3; cat /sandbox/held"),
        )
        .ok()
        .to_string()
    };
    assert_eq!(held(&ep, "one"), "hello 8080\none\n");
    let pid_before = exec(&ep, "web", "cat /proc/1/stat | cut -d' ' -f22")
        .ok()
        .trim()
        .to_string();
    let t = Instant::now();
    let allowed = sbx(
        &ep,
        &[
            "sandbox",
            "network",
            "allow",
            "web",
            &format!("{upa}:81"),
            "-o",
            "json",
        ],
    )
    .json();
    let update = t.elapsed();
    assert!(
        allowed["allow"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == &format!("{upa}:81")),
        "{allowed}"
    );
    assert_eq!(
        connect(&ep, "web", &upa, 81),
        "hello 81",
        "after the live update"
    );
    eprintln!("sbx sandbox network allow (round trip, applied): {update:?}");
    assert_eq!(
        held(&ep, "two"),
        "hello 8080\none\ntwo\n",
        "the open connection survived the update"
    );
    let pid_after = exec(&ep, "web", "cat /proc/1/stat | cut -d' ' -f22")
        .ok()
        .trim()
        .to_string();
    assert_eq!(pid_before, pid_after, "the workload was not restarted");

    // SIGKILL of sbxd, and a new one over the same data: same address, the connection held,
    // the policy enforced.
    w.sigkill();
    let ep = w.start();
    let after = network(&ep, "web");
    assert_eq!(after["address"], addr.as_str(), "{after}");
    assert_eq!(
        held(&ep, "three"),
        "hello 8080\none\ntwo\nthree\n",
        "the connection survived the SIGKILL"
    );
    assert_eq!(connect(&ep, "web", &upa, 81), "hello 81");
    assert!(
        connect(&ep, "web", &up.second.to_string(), 80).starts_with("refused"),
        "still enforced"
    );
    assert_eq!(
        connect(&ep, "named", &public, 80),
        "hello 80",
        "the admission survived"
    );
    let again = exec(&ep, "named", "nslookup up.sbx.test");
    assert!(
        again.stdout.contains(&public),
        "the resolver answers after the restart: {again:?}"
    );
    let off_again = exec(&ep, "named", "nslookup second.sbx.test");
    assert!(
        !off_again.stdout.contains(&up.second.to_string()),
        "{off_again:?}"
    );
    // Deny takes :81 away again.
    sbx(
        &ep,
        &["sandbox", "network", "deny", "web", &format!("{upa}:81")],
    )
    .ok();
    assert!(connect(&ep, "web", &upa, 81).starts_with("refused"));

    // create → Ready, networked vs --network none: alternated, each sandbox deleted before
    // the next round (SBX_BENCH_ROUNDS, default 3).
    let rounds: usize = std::env::var("SBX_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .clamp(1, 50);
    let (mut with_net, mut without) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        for (name, flags, into) in [
            (
                "bn",
                vec!["--allow".to_string(), format!("{upa}:80")],
                &mut with_net,
            ),
            (
                "bi",
                vec!["--network".to_string(), "none".to_string()],
                &mut without,
            ),
        ] {
            let mut args = vec!["sandbox", "create", "-n", name];
            args.extend(flags.iter().map(String::as_str));
            args.extend(["--", "sleep", "3600"]);
            let t = Instant::now();
            sbx(&ep, &args).ok();
            into.push(t.elapsed().as_secs_f64() * 1000.0);
            sbx(&ep, &["sandbox", "delete", name]).ok();
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (n, i) = (median(&mut with_net), median(&mut without));
    eprintln!(
        "create -> Ready, median of {rounds} alternated: networked {n:.0} ms, --network none \
         {i:.0} ms (ratio {:.2})",
        n / i
    );

    // Deletes leave nothing on the host.
    for name in ["web", "peer", "iso", "named"] {
        sbx(&ep, &["sandbox", "delete", name]).ok();
    }
    assert_eq!(w.left_on_host(), Vec::<String>::new());
    assert_oci_left_nothing(w.data.path(), &w.cgroup_parent);
    drop(up);
}

#[test]
fn a_process_sandbox_gets_the_same_network_policy_and_resolver() {
    if !runnable() {
        return;
    }
    let tag = format!("p{:04x}", std::process::id() & 0xffff);
    let up = Upstream::with_names(&tag, 22, &[80, 81], &[("up.sbx.test", public_addr(22))]);
    let upa = up.addr.to_string();
    // What up.sbx.test answers: an address the resolver calls public.
    let public = up.public.to_string();
    let mut w = World::new(&tag, 22);
    w.driver = "process";
    w.dns = Some(upa.clone());
    let ep = w.start();
    w.sandboxes = vec!["pweb"];
    let created = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "pweb",
            "--allow",
            &format!("{upa}:80"),
            "--allow",
            "up.sbx.test:81",
            "--",
            "sleep",
            "3600",
        ],
    );
    assert_eq!(created.code, 0, "{created:?}");
    let net = network(&ep, "pweb");
    let (addr, gateway) = (
        net["address"].as_str().unwrap().to_string(),
        net["gateway"].as_str().unwrap().to_string(),
    );
    assert!(addr.starts_with("10.253.22."), "{net}");
    // The host's programs (the process driver has no image): busybox for nc and nslookup.
    let connect = |ep: &str, addr: &str, port: u16| {
        let run = exec(
            ep,
            "pweb",
            &format!("timeout 2 busybox nc {addr} {port} </dev/null 2>&1 | head -1"),
        );
        run.stdout.trim().to_string()
    };
    let links = exec(&ep, "pweb", "ip -o -4 addr show dev eth0");
    assert!(links.stdout.contains(&format!("{addr}/32")), "{links:?}");
    assert_eq!(connect(&ep, &upa, 80), "hello 80");
    // `sbx sandbox stats` counts what crosses the sandbox's link: 256 KiB sent to the
    // upstream, which echoes them back.
    let (rx0, tx0) = traffic(&ep, "pweb");
    let echoed = exec(
        &ep,
        "pweb",
        &format!("head -c 262144 /dev/zero | timeout 3 busybox nc {upa} 80 | wc -c"),
    );
    let echoed: u64 = echoed.stdout.trim().parse().unwrap_or(0);
    assert!(echoed >= 262_144, "the upstream echoed {echoed} bytes");
    let (rx1, tx1) = traffic(&ep, "pweb");
    assert!(
        tx1 >= tx0 + 262_144 && rx1 >= rx0 + 262_144,
        "256 KiB each way: rx {rx0} → {rx1}, tx {tx0} → {tx1}"
    );
    assert!(
        !connect(&ep, &public, 81).starts_with("hello"),
        "nothing admitted for the name before it is resolved"
    );
    let resolv = exec(&ep, "pweb", "cat /etc/resolv.conf").ok().to_string();
    assert_eq!(
        resolv.trim(),
        format!("nameserver {gateway}"),
        "the sandbox's own resolv.conf, not the host's"
    );
    let looked_up = exec(&ep, "pweb", "busybox nslookup up.sbx.test");
    assert!(looked_up.stdout.contains(&public), "{looked_up:?}");
    assert_eq!(connect(&ep, &public, 81), "hello 81");
    assert!(!connect(&ep, &up.second.to_string(), 80).starts_with("hello"));
    // What the policy refused is an event of the sandbox (at most one a minute).
    let began = Instant::now();
    let denied = loop {
        let events = sbx(&ep, &["sandbox", "events", "pweb", "-o", "json"]).json();
        let denied = events
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["reason"] == "NetworkDenied")
            .cloned();
        if let Some(denied) = denied {
            break denied;
        }
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "no NetworkDenied event: {events}"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert_eq!(denied["type"], "Warning", "{denied}");
    assert!(
        denied["message"].as_str().unwrap().contains("refused"),
        "{denied}"
    );
    // And in sbxd's metrics: the refusals, and the resolver's answers by outcome (the lookup
    // of up.sbx.test answered, names outside the policy refused).
    let outside = exec(&ep, "pweb", "busybox nslookup elsewhere.sbx.test");
    assert!(!outside.stdout.contains("Address: 10."), "{outside:?}");
    let m = w.metrics();
    let answers = |outcome: &str| {
        common::metrics::value(&m, "sbx_resolver_answers_total", &[("outcome", outcome)])
    };
    assert!(
        answers("noerror") >= 1.0 && answers("refused") >= 1.0,
        "{m:?}"
    );
    assert!(
        common::metrics::value(&m, "sbx_network_denials", &[]) >= 1.0,
        "{m:?}"
    );
    let grpc_port = ep
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .to_string();
    assert!(
        !connect(&ep, &gateway, grpc_port.parse().unwrap()).starts_with("hello"),
        "the gateway's port"
    );
    let spoof = exec(&ep, "pweb", "ip addr add 10.253.22.250/32 dev eth0");
    assert_ne!(spoof.code, 0, "the workload changed its address: {spoof:?}");
    let host_resolv = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    assert!(
        !host_resolv.contains(&format!("nameserver {gateway}")),
        "the host's /etc/resolv.conf is untouched"
    );

    // SIGKILL of sbxd: the address, the rules and the resolver come back.
    w.sigkill();
    let ep = w.start();
    assert_eq!(network(&ep, "pweb")["address"], addr.as_str());
    assert_eq!(connect(&ep, &upa, 80), "hello 80");
    assert_eq!(
        connect(&ep, &public, 81),
        "hello 81",
        "the admission survived"
    );
    let again = exec(&ep, "pweb", "busybox nslookup up.sbx.test");
    assert!(again.stdout.contains(&public), "{again:?}");

    sbx(&ep, &["sandbox", "delete", "pweb"]).ok();
    assert_eq!(w.left_on_host(), Vec::<String>::new());
    drop(up);
}

/// The vm driver on the same network: the guest holds its leased address itself (on a NIC
/// whose tap is in the sandbox's namespace), and reaches what its policy admits, by address
/// and by a name through the gateway's resolver, and nothing else (a second address, the
/// gateway's port, the host, another sandbox); a live allow; the guest,
/// root in its own kernel, changes its address or its MAC and then reaches nothing; a SIGKILL
/// of sbxd keeps its address and rules; delete leaves nothing. In the `vm` test group.
#[test]
fn vm_sandbox_gets_the_network_policy_and_resolver_and_cannot_spoof() {
    if !runnable() {
        return;
    }
    let tag = format!("v{:04x}", std::process::id() & 0xffff);
    let up = Upstream::with_names(
        &tag,
        23,
        &[80, 81, 82, 83],
        &[("up.sbx.test", public_addr(23))],
    );
    let upa = up.addr.to_string();
    // What up.sbx.test answers: an address the resolver calls public.
    let public = up.public.to_string();
    let mut w = World::new(&tag, 23);
    w.driver = "vm";
    w.dns = Some(upa.clone());
    let cache = std::env::temp_dir().join("sbx-vm-test-assets");
    w.extra = vec![
        "--vm-asset-cache".into(),
        cache.display().to_string(),
        "--vm-boot-timeout".into(),
        "120".into(),
    ];
    let ep = w.start();
    w.sandboxes = vec!["vweb"];
    let created = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "vweb",
            "--allow",
            &format!("{upa}:80"),
            "--allow",
            "up.sbx.test:81",
            "--",
            "sleep",
            "3600",
        ],
    );
    assert_eq!(created.code, 0, "{created:?}");
    let net = network(&ep, "vweb");
    let (addr, gateway) = (
        net["address"].as_str().unwrap().to_string(),
        net["gateway"].as_str().unwrap().to_string(),
    );
    assert!(addr.starts_with("10.253.23."), "{net}");
    let links = exec(&ep, "vweb", "ip -o -4 addr show dev eth0");
    assert!(links.stdout.contains(&format!("{addr}/32")), "{links:?}");
    assert_eq!(connect(&ep, "vweb", &upa, 80), "hello 80");
    let (rx0, tx0) = traffic(&ep, "vweb");
    let echoed = exec(
        &ep,
        "vweb",
        &format!("head -c 262144 /dev/zero | timeout 5 nc {upa} 80 | wc -c"),
    );
    let echoed: u64 = echoed.stdout.trim().parse().unwrap_or(0);
    assert!(echoed >= 262_144, "the upstream echoed {echoed} bytes");
    let (rx1, tx1) = traffic(&ep, "vweb");
    assert!(
        tx1 >= tx0 + 262_144 && rx1 >= rx0 + 262_144,
        "256 KiB each way: rx {rx0} → {rx1}, tx {tx0} → {tx1}"
    );
    assert!(connect(&ep, "vweb", &public, 81).starts_with("refused"));
    let resolv = exec(&ep, "vweb", "cat /etc/resolv.conf").ok().to_string();
    assert_eq!(resolv.trim(), format!("nameserver {gateway}"));
    let looked_up = exec(&ep, "vweb", "nslookup up.sbx.test");
    assert!(looked_up.stdout.contains(&public), "{looked_up:?}");
    assert_eq!(
        connect(&ep, "vweb", &public, 81),
        "hello 81",
        "admitted by name"
    );
    let second = connect(&ep, "vweb", &up.second.to_string(), 80);
    assert!(second.starts_with("refused"), "{second}");
    let denials = network(&ep, "vweb");
    assert!(
        denials.to_string().contains(&up.second.to_string()),
        "the second address is recorded: {denials}"
    );
    // The gateway's own port, and another sandbox (a namespace on the same bridge, made by
    // the test with the kit), are refused.
    let grpc_port: u16 = ep
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .parse()
        .unwrap();
    assert!(connect(&ep, "vweb", &gateway, grpc_port).starts_with("refused"));
    let host = TcpListener::bind((gateway.parse::<std::net::Ipv4Addr>().unwrap(), 0)).unwrap();
    let host_port = host.local_addr().unwrap().port();
    assert!(connect(&ep, "vweb", &gateway, host_port).starts_with("refused"));
    // A live allow: port 82 admitted without a restart.
    let updated = sbx(
        &ep,
        &["sandbox", "network", "allow", "vweb", &format!("{upa}:82")],
    );
    assert_eq!(updated.code, 0, "{updated:?}");
    assert_eq!(connect(&ep, "vweb", &upa, 82), "hello 82", "the live allow");

    // Root in its own kernel, the guest takes another sandbox's address (one that may reach
    // port 83, which it may not: the table alone would pass that), then another MAC with its
    // own address (which the table alone would pass too): the host passes on neither; with
    // its own back, it reaches the upstream again.
    w.sandboxes.push("vother");
    let created = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "vother",
            "--allow",
            &format!("{upa}:83"),
            "--",
            "sleep",
            "3600",
        ],
    );
    assert_eq!(created.code, 0, "{created:?}");
    assert_eq!(connect(&ep, "vother", &upa, 83), "hello 83");
    // Another sandbox is not reachable: a server in vother (busybox nc, one connection),
    // refused from vweb, then reached from vother itself (so it was listening).
    let other_net = network(&ep, "vother");
    let listener = std::thread::spawn({
        let ep = ep.clone();
        move || exec(&ep, "vother", "echo peer | timeout 30 nc -l -p 9000")
    });
    std::thread::sleep(Duration::from_secs(2));
    let other_addr = other_net["address"].as_str().unwrap().to_string();
    let to_peer = connect(&ep, "vweb", &other_addr, 9000);
    assert!(to_peer.starts_with("refused"), "another sandbox: {to_peer}");
    assert_eq!(
        connect(&ep, "vother", "127.0.0.1", 9000),
        "peer",
        "it listened"
    );
    let _ = listener.join();
    let other = other_net["address"].as_str().unwrap().to_string();
    let other = other.as_str();
    let readdress = |from: &str, to: &str| {
        format!(
            "ip addr del {from}/32 dev eth0; ip addr add {to}/32 dev eth0; \
             ip route add {gateway} dev eth0 scope link; ip route add default via {gateway}"
        )
    };
    let spoofed = exec(
        &ep,
        "vweb",
        &format!(
            "{}; ip -o -4 addr show dev eth0; timeout 3 nc {upa} 83 </dev/null 2>&1 | head -1; \
             echo spoofed-done; {}",
            readdress(&addr, other),
            readdress(other, &addr)
        ),
    );
    assert!(spoofed.stdout.contains("spoofed-done"), "{spoofed:?}");
    assert!(
        spoofed.stdout.contains(&format!("{other}/32")),
        "the guest took the address: {spoofed:?}"
    );
    assert!(
        !spoofed.stdout.contains("hello"),
        "another sandbox's address reached the upstream: {spoofed:?}"
    );
    assert_eq!(
        connect(&ep, "vweb", &upa, 80),
        "hello 80",
        "its own address again"
    );
    let mac = exec(&ep, "vweb", "cat /sys/class/net/eth0/address")
        .ok()
        .trim()
        .to_string();
    let remac = |to: &str| {
        format!(
            "ip link set eth0 down; ip link set eth0 address {to}; ip link set eth0 up; \
             ip route add {gateway} dev eth0 scope link; ip route add default via {gateway}; \
             ip neigh flush dev eth0"
        )
    };
    let spoofed = exec(
        &ep,
        "vweb",
        &format!(
            "{}; cat /sys/class/net/eth0/address; timeout 3 nc {upa} 80 </dev/null 2>&1 | \
             head -1; echo spoofed-done; {}",
            remac("02:00:00:00:00:99"),
            remac(&mac)
        ),
    );
    assert!(spoofed.stdout.contains("spoofed-done"), "{spoofed:?}");
    assert!(
        spoofed.stdout.contains("02:00:00:00:00:99"),
        "the guest took the MAC: {spoofed:?}"
    );
    assert!(
        !spoofed.stdout.contains("hello"),
        "another MAC reached the upstream: {spoofed:?}"
    );
    assert_eq!(
        connect(&ep, "vweb", &upa, 80),
        "hello 80",
        "its own MAC again"
    );

    // SIGKILL of sbxd: the address and the rules hold.
    w.sigkill();
    let ep = w.start();
    assert_eq!(network(&ep, "vweb")["address"], addr.as_str());
    assert_eq!(connect(&ep, "vweb", &upa, 80), "hello 80");
    assert_eq!(connect(&ep, "vweb", &upa, 82), "hello 82");
    assert!(connect(&ep, "vweb", &up.second.to_string(), 80).starts_with("refused"));

    sbx(&ep, &["sandbox", "delete", "vweb"]).ok();
    sbx(&ep, &["sandbox", "delete", "vother"]).ok();
    assert_eq!(w.left_on_host(), Vec::<String>::new());
    drop(host);
    drop(up);
}

#[test]
fn bad_network_input_is_refused_with_its_reason_and_an_overlapping_cidr_at_startup() {
    if !runnable() {
        return;
    }
    let tag = format!("b{:04x}", std::process::id() & 0xffff);
    let up = Upstream::new(&tag, 21, &[80]);
    // A network overlapping the upstream's route: sbxd refuses to start, saying why.
    let data = DataDir::new();
    let out = Command::new(common::SBXD)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data.path())
        .args([
            "--network-cidr",
            "10.251.0.0/16",
            "--network-name",
            &format!("o{tag}"),
        ])
        .env("SBX_AUTH", "none")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "sbxd started on an overlapping network: {text}"
    );
    assert!(
        text.contains("overlaps") && text.contains("10.251."),
        "{text}"
    );

    let mut w = World::new(&tag, 21);
    let ep = w.start();
    w.sandboxes = vec!["b", "plain", "inherit", "own"];
    for (entry, why) in [
        ("10.0.0.0/33", "prefix length"),
        ("10.0.0.1:70000", "out of range"),
        ("10.0.0.1:0", "out of range"),
        (":80", "no address"),
        ("a..example.test:443", "not a hostname label"),
        ("*:443", "wildcard"),
        ("api.example.test/24:443", "no prefix length"),
        ("10.0.0.1/8", "host bits"),
        ("", "empty"),
    ] {
        let run = sbx(
            &ep,
            &[
                "sandbox", "create", "-n", "b", "--allow", entry, "--", "sleep", "60",
            ],
        );
        assert_ne!(run.code, 0, "{entry:?} was accepted: {run:?}");
        assert!(
            run.stderr.contains("INVALID_ARGUMENT") && run.stderr.contains(why),
            "{entry:?}: {run:?}"
        );
    }
    let none_allow = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "b",
            "--network",
            "none",
            "--allow",
            "10.0.0.1",
            "--",
            "sleep",
            "60",
        ],
    );
    assert_ne!(none_allow.code, 0, "{none_allow:?}");

    // A sandbox made with mode none has no network to change.
    sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "plain",
            "--network",
            "none",
            "--",
            "sleep",
            "3600",
        ],
    )
    .ok();
    let change = sbx(
        &ep,
        &["sandbox", "network", "allow", "plain", "10.0.0.1:80"],
    );
    assert!(
        change.code != 0
            && change.stderr.contains("FAILED_PRECONDITION")
            && change.stderr.contains("fixed at create"),
        "{change:?}"
    );

    // 10,000 entries work (and are enforced); 10,001 are refused.
    let upa = up.addr.to_string();
    sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "b",
            "--allow",
            &format!("{upa}:80"),
            "--",
            "sleep",
            "3600",
        ],
    )
    .ok();
    let mut entries: Vec<String> = (0..9_999)
        .map(|i| format!("10.{}.{}.{}:443", 100 + i / 65536, (i / 256) % 256, i % 256))
        .collect();
    entries.push(format!("{upa}:80"));
    let mut args: Vec<&str> = vec!["sandbox", "network", "set", "b", "-o", "json"];
    args.extend(entries.iter().map(String::as_str));
    let t = Instant::now();
    let set = sbx(&ep, &args).json();
    eprintln!("a 10,000-entry allowlist applied in {:?}", t.elapsed());
    assert_eq!(set["allow"].as_array().unwrap().len(), 10_000);
    assert_eq!(connect(&ep, "b", &upa, 80), "hello 80");
    entries.push("10.99.0.1:1".into());
    let mut args: Vec<&str> = vec!["sandbox", "network", "set", "b"];
    args.extend(entries.iter().map(String::as_str));
    let over = sbx(&ep, &args);
    assert!(
        over.code != 0 && over.stderr.contains("INVALID_ARGUMENT") && over.stderr.contains("10000"),
        "{}",
        over.stderr
    );
    assert_eq!(
        connect(&ep, "b", &upa, 80),
        "hello 80",
        "a refused update changed nothing"
    );

    // A workspace default: new sandboxes asking for nothing get it, copied in; existing ones
    // and those asking for none keep theirs.
    let set = sbx(
        &ep,
        &[
            "workspace",
            "network",
            "set",
            "default",
            "--allow",
            &format!("{upa}:80"),
            "-o",
            "json",
        ],
    )
    .json();
    assert_eq!(set["mode"], "policy", "{set}");
    sbx(
        &ep,
        &["sandbox", "create", "-n", "inherit", "--", "sleep", "3600"],
    )
    .ok();
    sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "own",
            "--network",
            "none",
            "--",
            "sleep",
            "3600",
        ],
    )
    .ok();
    let inherited = network(&ep, "inherit");
    assert_eq!(inherited["mode"], "policy", "{inherited}");
    assert_eq!(
        inherited["allow"][0],
        format!("{upa}:80").as_str(),
        "{inherited}"
    );
    assert_eq!(connect(&ep, "inherit", &upa, 80), "hello 80");
    assert_eq!(network(&ep, "plain")["mode"], "none");
    assert_eq!(network(&ep, "own")["mode"], "none");
    let shown = sbx(
        &ep,
        &["workspace", "network", "get", "default", "-o", "json"],
    )
    .json();
    assert_eq!(shown["mode"], "policy", "{shown}");
    let bad = sbx(
        &ep,
        &[
            "workspace",
            "network",
            "set",
            "default",
            "--allow",
            "10.0.0.1:99999",
        ],
    );
    assert!(
        bad.code != 0 && bad.stderr.contains("INVALID_ARGUMENT"),
        "{bad:?}"
    );
    let cleared = sbx(
        &ep,
        &[
            "workspace",
            "network",
            "set",
            "default",
            "--clear",
            "-o",
            "json",
        ],
    )
    .json();
    assert_eq!(cleared["mode"], "none", "{cleared}");

    // An sbxd without the network does not run a networked sandbox on loopback instead: its
    // restart is refused, saying why; with the network back, it runs as before.
    w.sigkill();
    let bare = Sbxd::start(
        w.data.path(),
        "",
        &["--oci-cgroup-parent", &w.cgroup_parent],
    );
    let restart = sbx(&bare.endpoint(), &["sandbox", "restart", "b"]);
    assert!(
        restart.code != 0 && restart.stderr.contains("has no network"),
        "{restart:?}"
    );
    drop(bare);
    let ep = w.start();
    let again = sbx(&ep, &["sandbox", "restart", "b"]);
    assert_eq!(again.code, 0, "{again:?}");
    assert_eq!(connect(&ep, "b", &upa, 80), "hello 80");

    for name in ["b", "plain", "inherit", "own"] {
        sbx(&ep, &["sandbox", "delete", name]).ok();
    }
    assert_eq!(w.left_on_host(), Vec::<String>::new());
    drop(up);
}

/// `sbxd network cleanup --network-name NAME`, as an operator runs it.
fn network_cleanup(name: &str) -> CliRun {
    common::run_bounded(
        Command::new(common::SBXD).args(["network", "cleanup", "--network-name", name]),
        "sbxd network cleanup",
    )
}

#[test]
fn the_network_is_on_by_default_a_refused_lookup_is_explained_and_cleanup_removes_it() {
    if !runnable() {
        return;
    }
    let mut w = World::new("auto", 0);
    // What sbxd does with no --network-cidr (tests run with SBX_NETWORK_CIDR=off: one
    // network per host, and they run at once), under a name of this test's own.
    w.cidr = "auto".into();
    let ep = w.start();
    let log = w.sbxd.as_ref().unwrap().log_text();
    let chosen = sbx_drivers::network::AUTO_CANDIDATES
        .iter()
        .find(|c| log.contains(&format!("cidr={c}")))
        .unwrap_or_else(|| panic!("the log says which network auto chose: {log}"));
    let kept = std::fs::read_to_string(
        w.data
            .path()
            .join("drivers/oci/network")
            .join(sbx_drivers::network::AUTO_FILE),
    )
    .unwrap();
    assert_eq!(&kept, chosen, "the choice is kept for later starts");

    // A sandbox that asks for nothing: an address on it, no egress.
    w.sandboxes.push("plain");
    sbx(
        &ep,
        &["sandbox", "create", "-n", "plain", "--", "sleep", "3600"],
    )
    .ok();
    let net = network(&ep, "plain");
    assert_eq!(net["mode"], "policy", "{net}");
    assert_eq!(net["allow"], serde_json::json!([]), "{net}");
    let (base, len) = sbx_drivers::network::parse_cidr(chosen).unwrap();
    let address: std::net::Ipv4Addr = net["address"].as_str().unwrap().parse().unwrap();
    assert!(
        sbx_drivers::network::policy::overlaps(address, 32, base, len),
        "{address} is on {chosen}"
    );

    // A name lookup fails inside, and `sbx sandbox get` says why and what would admit it.
    let lookup = exec(&ep, "plain", "nslookup deb.debian.org 2>&1");
    assert!(
        !lookup.stdout.contains("Address: 1"),
        "nothing resolves: {lookup:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let shown = loop {
        let got = sbx(&ep, &["sandbox", "get", "plain"]);
        if got.stdout.contains("DENIED:") || Instant::now() > deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    assert!(
        shown.stdout.contains("NETWORK: an address, no egress"),
        "{shown:?}"
    );
    assert!(
        shown.stdout.contains("deb.debian.org")
            && shown
                .stdout
                .contains("not in its allowlist (admit it: sbx sandbox network allow plain deb.debian.org:PORT)"),
        "{shown:?}"
    );

    // Cleanup is refused while sbxd serves the network, and then removes it.
    let busy = network_cleanup(&w.name);
    assert_eq!(busy.code, 2, "{busy:?}");
    assert!(busy.stderr.contains("still serves network"), "{busy:?}");
    sbx(&ep, &["sandbox", "delete", "plain"]).ok();
    w.sandboxes.clear();
    w.sbxd.as_mut().unwrap().sigterm(Duration::from_secs(30));
    w.sbxd = None;
    let bridge = format!("{}0", w.name);
    assert!(
        sbx_drivers::network::link::link_exists(&bridge),
        "sbxd leaves its bridge"
    );
    let cleaned = network_cleanup(&w.name);
    assert_eq!(cleaned.code, 0, "{cleaned:?}");
    assert!(
        cleaned.stdout.contains(&format!(
            "removed nftables table inet {}, bridge {bridge}",
            w.name
        )),
        "{cleaned:?}"
    );
    assert!(!sbx_drivers::network::link::link_exists(&bridge));
    let again = network_cleanup(&w.name);
    assert!(
        again.stdout.contains("nothing of it is on this host"),
        "{again:?}"
    );
}

/// The flooding sandboxes of [`a_flood_of_lookups_from_twenty_sandboxes_leaves_another_its_answers`].
const FLOODERS: [&str; 20] = [
    "f0", "f1", "f2", "f3", "f4", "f5", "f6", "f7", "f8", "f9", "f10", "f11", "f12", "f13", "f14",
    "f15", "f16", "f17", "f18", "f19",
];

/// Twenty lookups of `name` one after another inside sandbox `name`, bounded by 60 s: how
/// many were answered with `addr`, and how long they took.
fn lookups(ep: &str, sandbox: &str, name: &str, addr: &str) -> (usize, Duration) {
    let t = Instant::now();
    let run = exec(
        ep,
        sandbox,
        &format!("timeout 60 sh -c 'for i in $(seq 20); do nslookup {name} 2>&1; done'"),
    );
    let took = t.elapsed();
    let answered = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("Address") && l.trim_end().ends_with(addr))
        .count();
    (answered, took)
}

#[test]
fn a_flood_of_lookups_from_twenty_sandboxes_leaves_another_its_answers() {
    if !runnable() {
        return;
    }
    let tag = format!("d{:04x}", std::process::id() & 0xffff);
    let third = 25;
    let public = public_addr(third);
    let up = Upstream::with_answers(
        &tag,
        third,
        &[80],
        &[
            ("fast.sbx.test", Answer::A(public)),
            ("slow.sbx.test", Answer::Silent),
        ],
        None,
    );
    let mut w = World::new(&tag, third);
    w.dns = Some(up.addr.to_string());
    let ep = w.start();
    w.sandboxes = vec!["victim"];
    w.sandboxes.extend(FLOODERS);
    sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "victim",
            "--allow",
            "fast.sbx.test:80",
            "--",
            "sleep",
            "3600",
        ],
    )
    .ok();
    let public = public.to_string();
    let (quiet, quiet_took) = lookups(&ep, "victim", "fast.sbx.test", &public);
    assert_eq!(quiet, 20, "without a flood");
    // Each flooder: 64 loops of lookups of a name whose upstream never answers, each loop
    // starting at its own moment (busybox's nslookup gives up after 5 s), so that the
    // resolver always has as many of its queries as it takes.
    let flood = "for i in $(seq 64); do (usleep $((RANDOM * 150)); while true; do \
                 nslookup slow.sbx.test >/dev/null 2>&1; done) & done; wait";
    for f in FLOODERS {
        sbx(
            &ep,
            &[
                "sandbox",
                "create",
                "-n",
                f,
                "--allow",
                "slow.sbx.test:80",
                "--",
                "sh",
                "-c",
                flood,
            ],
        )
        .ok();
    }
    std::thread::sleep(Duration::from_secs(5));
    // The flood is on: sbxd's resolver has threads waiting on the upstream for (at least two
    // queries of) every flooder.
    let pid = w.sbxd.as_ref().unwrap().pid();
    let waiting = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim_end() == "sbx-resolve")
        })
        .count();
    assert!(
        waiting >= 2 * FLOODERS.len(),
        "{waiting} queries of the flooders wait on the upstream"
    );
    let (flooded, flooded_took) = lookups(&ep, "victim", "fast.sbx.test", &public);
    let rate = |n: usize, d: Duration| n as f64 / d.as_secs_f64();
    eprintln!(
        "the victim's lookups (20, one after another, through `sbx sandbox exec`): \
         {quiet}/20 in {quiet_took:.2?} ({:.1}/s) alone; {flooded}/20 in {flooded_took:.2?} \
         ({:.1}/s) while {} sandboxes flood a name whose upstream never answers ({waiting} of \
         their queries waiting on it)",
        rate(quiet, quiet_took),
        rate(flooded, flooded_took),
        FLOODERS.len()
    );
    assert_eq!(flooded, 20, "every lookup answered while the others flood");
    assert!(
        flooded_took < Duration::from_secs(10),
        "answered promptly: {flooded_took:?}"
    );
    assert_eq!(connect(&ep, "victim", &public, 80), "hello 80");

    for name in w.sandboxes.clone() {
        sbx(&ep, &["sandbox", "delete", name]).ok();
    }
    w.sandboxes.clear();
    assert_eq!(w.left_on_host(), Vec::<String>::new());
    assert_oci_left_nothing(w.data.path(), &w.cgroup_parent);
    drop(up);
}

#[test]
fn a_second_sbxd_on_the_same_network_name_is_refused_naming_the_first() {
    if !runnable() {
        return;
    }
    let tag = format!("k{:04x}", std::process::id() & 0xffff);
    let third = 26;
    let public = public_addr(third);
    let up = Upstream::with_names(&tag, third, &[80], &[("fast.sbx.test", public)]);
    let public = public.to_string();
    let mut w = World::new(&tag, third);
    w.dns = Some(up.addr.to_string());
    let ep = w.start();
    let first = w.sbxd.as_ref().unwrap().pid();
    w.sandboxes = vec!["s"];
    sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "s",
            "--allow",
            "fast.sbx.test:80",
            "--",
            "sleep",
            "3600",
        ],
    )
    .ok();
    let looked_up = exec(&ep, "s", "nslookup fast.sbx.test");
    assert!(looked_up.stdout.contains(&public), "{looked_up:?}");

    // Another sbxd, its own data and network, the same --network-name.
    let data = DataDir::new();
    let addr_file = data.path().join("addr");
    let mut second = Command::new(common::SBXD)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data.path())
        .arg("--addr-file")
        .arg(&addr_file)
        .args([
            "--oci-cgroup-parent",
            &w.cgroup_parent,
            "--network-cidr",
            &format!("10.253.{}.0/24", third + 1),
            "--network-name",
            &w.name,
        ])
        .env("SBX_AUTH", "none")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let began = Instant::now();
    let status = loop {
        if let Some(status) = second.try_wait().unwrap() {
            break status;
        }
        if addr_file.exists() || began.elapsed() > Duration::from_secs(60) {
            let _ = second.kill();
            let _ = second.wait();
            panic!(
                "a second sbxd serves network {:?} (the first is pid {first}): {:?}",
                w.name,
                std::io::read_to_string(second.stderr.take().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let said = std::io::read_to_string(second.stderr.take().unwrap()).unwrap();
    eprintln!("the second sbxd: {status}; it said: {}", said.trim());
    assert!(!status.success(), "{status}: {said}");
    assert!(
        said.contains(&format!("pid {first}")) && said.contains(&w.name),
        "the refusal names the network and the sbxd that serves it: {said}"
    );
    // The first one's sandbox still resolves its names and reaches what they answer.
    let again = exec(&ep, "s", "nslookup fast.sbx.test");
    assert!(again.stdout.contains(&public), "{again:?}");
    assert_eq!(connect(&ep, "s", &public, 80), "hello 80");

    sbx(&ep, &["sandbox", "delete", "s"]).ok();
    w.sandboxes.clear();
    assert_eq!(w.left_on_host(), Vec::<String>::new());
    drop(up);
}

/// The ranges the gateways of [`gateways_on_auto_take_free_ranges_and_one_with_none_free_refuses`]
/// choose from (its own, so it takes none of the host's defaults).
const AUTO_TEST_RANGES: &str = "10.254.28.0/24,10.254.29.0/24";

#[test]
fn gateways_on_auto_take_free_ranges_and_one_with_none_free_refuses() {
    if !runnable() {
        return;
    }
    let tag = format!("r{:04x}", std::process::id() & 0xffff);
    let third = 28;
    let public = public_addr(third);
    let up = Upstream::with_names(&tag, third, &[80], &[("auto.sbx.test", public)]);
    let public = public.to_string();
    let auto_world = |suffix: &str| {
        let mut w = World::new(&format!("{tag}{suffix}"), third);
        w.cidr = "auto".into();
        w.dns = Some(up.addr.to_string());
        w.env = vec![("SBX_NETWORK_AUTO_RANGES", AUTO_TEST_RANGES.to_string())];
        w
    };
    let kept = |w: &World| {
        std::fs::read_to_string(
            w.data
                .path()
                .join("drivers/oci/network")
                .join(sbx_drivers::network::AUTO_FILE),
        )
        .unwrap_or_default()
        .trim()
        .to_string()
    };

    // Two gateways, each its own --network-name, both on auto: each gets a range of its own,
    // and a sandbox on each resolves a name its list allows through its gateway's resolver.
    let mut worlds = vec![auto_world("a"), auto_world("b")];
    let mut chosen = Vec::new();
    for w in worlds.iter_mut() {
        let ep = w.start();
        w.sandboxes = vec!["s"];
        sbx(
            &ep,
            &[
                "sandbox",
                "create",
                "-n",
                "s",
                "--allow",
                "auto.sbx.test:80",
                "--",
                "sleep",
                "3600",
            ],
        )
        .ok();
        let looked_up = exec(&ep, "s", "nslookup auto.sbx.test");
        assert!(
            looked_up.stdout.contains(&public),
            "gateway {}: the resolver answers an allowed name: {looked_up:?}",
            w.name
        );
        assert_eq!(connect(&ep, "s", &public, 80), "hello 80");
        chosen.push(kept(w));
    }
    eprintln!("the two gateways took {chosen:?}");
    assert_ne!(chosen[0], chosen[1], "different ranges");

    // A third, whose kept choice is the first's range and whose other range the second
    // holds: it does not start, and says what is in the way and how to run without.
    let c = auto_world("c");
    let net_dir = c.data.path().join("drivers/oci/network");
    std::fs::create_dir_all(&net_dir).unwrap();
    std::fs::write(net_dir.join(sbx_drivers::network::AUTO_FILE), &chosen[0]).unwrap();
    let addr_file = c.data.path().join("addr");
    let mut third_sbxd = common::sbxd_command()
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(c.data.path())
        .arg("--addr-file")
        .arg(&addr_file)
        .args([
            "--oci-cgroup-parent",
            &c.cgroup_parent,
            "--network-cidr",
            "auto",
            "--network-name",
            &c.name,
            "--network-dns",
            &up.addr.to_string(),
        ])
        .env("SBX_NETWORK_AUTO_RANGES", AUTO_TEST_RANGES)
        .env("SBX_AUTH", "none")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let began = Instant::now();
    let status = loop {
        if let Some(status) = third_sbxd.try_wait().unwrap() {
            break status;
        }
        if addr_file.exists() || began.elapsed() > Duration::from_secs(60) {
            let _ = third_sbxd.kill();
            let _ = third_sbxd.wait();
            panic!(
                "a third sbxd serves with no free range (its kept choice {}, the first's): {}",
                chosen[0],
                std::io::read_to_string(third_sbxd.stderr.take().unwrap()).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let said = std::io::read_to_string(third_sbxd.stderr.take().unwrap()).unwrap();
    eprintln!("the third sbxd: {status}; it said: {}", said.trim());
    assert!(!status.success(), "{status}: {said}");
    for (w, range) in worlds.iter().zip(&chosen) {
        assert!(
            said.contains(range.as_str()) && said.contains(&format!("{}0", w.name)),
            "the refusal names {range} and the bridge that holds it: {said}"
        );
    }
    assert!(said.contains("--network-cidr off"), "{said}");
    assert!(
        !sbx_drivers::network::link::link_exists(&format!("{}0", c.name)),
        "the refused gateway made no bridge"
    );

    for w in worlds.iter_mut() {
        let ep = w.sbxd.as_ref().unwrap().endpoint();
        sbx(&ep, &["sandbox", "delete", "s"]).ok();
        w.sandboxes.clear();
        assert_eq!(w.left_on_host(), Vec::<String>::new());
    }
    for c in &chosen {
        assert!(
            AUTO_TEST_RANGES.split(',').any(|r| r == c),
            "{c} is one of {AUTO_TEST_RANGES}"
        );
    }
    drop(c);
    drop(worlds);
    drop(up);
}
