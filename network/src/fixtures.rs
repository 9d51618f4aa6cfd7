//! Network fixtures for tests (this crate's and the gateway's): an "upstream" namespace the
//! test makes itself, with its own addresses and TCP servers, and connects made from inside a
//! namespace. Nothing here sends a packet anywhere but to namespaces the test created.

use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether this process can make namespaces and tables: root, `ip`, `nft`, python3.
pub fn runnable() -> bool {
    let have = |tool: &str| {
        Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    };
    let ok =
        nix::unistd::Uid::effective().is_root() && have("ip") && have("nft") && have("python3");
    if !ok {
        eprintln!("skipped: needs root, ip, nft and python3");
    }
    ok
}

/// A namespace with servers, made by the test: `addr` on a veth to the host (a network the
/// host is attached to, as a LAN or a container bridge is), `second` another address of it
/// the host routes there too, and `public` and `public2` two more, outside every
/// special-purpose range, the host routes there as well (/32 routes through `addr` the
/// fixture adds before any packet and removes with the veth, also when the test fails): what
/// a sandbox's resolver admits as "remote" servers. TCP servers on `ports` of every address answer each connection with
/// "hello <port>\n" and then echo what they read; with names, a DNS answerer on UDP port 53
/// answers A queries for them as [`Answer`] says (TTL 30 s), NXDOMAIN for others; given the
/// name `@log` (its "address" a file path), it appends one line per query it receives:
/// `LENGTH NSCOUNT ARCOUNT`.
pub struct Upstream {
    pub ns: String,
    pub host_veth: String,
    pub addr: Ipv4Addr,
    pub second: Ipv4Addr,
    pub public: Ipv4Addr,
    pub public2: Ipv4Addr,
    servers: Option<Child>,
}

/// The public address [`Upstream`] made with `third` gets: in 192.52.193.0/24, a block of
/// IANA's special-purpose registry that is globally reachable (AMT relay anycast, RFC 7450),
/// so every rule calls it public, and one a host has no use for — the route the fixture adds
/// for it takes nothing from the host.
pub fn public_addr(third: u8) -> Ipv4Addr {
    Ipv4Addr::new(192, 52, 193, third)
}

/// The second public address of [`Upstream`] made with `third` (below 128).
pub fn public2_addr(third: u8) -> Ipv4Addr {
    Ipv4Addr::new(192, 52, 193, 128 + third)
}

/// How the upstream's DNS answerer answers a name's A query.
#[derive(Debug, Clone, Copy)]
pub enum Answer {
    /// The address, alone in the answer section.
    A(Ipv4Addr),
    /// The address, plus an NS record in the authority section and a TXT record
    /// ("smuggled-…") in the additional section: what a hostile zone would add.
    WithExtra(Ipv4Addr),
    /// Never answered (an upstream that does not answer this name).
    Silent,
}

impl Answer {
    fn arg(&self) -> String {
        match self {
            Answer::A(a) => a.to_string(),
            Answer::WithExtra(a) => format!("{a}+extra"),
            Answer::Silent => "@silent".into(),
        }
    }
}

pub const SERVER: &str = r#"
import socket, sys, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept()
        def talk(c=c):
            c.sendall(b"hello %d\n" % port)
            while True:
                d = c.recv(4096)
                if not d: break
                c.sendall(d)
        threading.Thread(target=talk, daemon=True).start()
def dns(names):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", 53))
    log = names.pop("@log", None)
    while True:
        q, peer = u.recvfrom(4096)
        if log:
            with open(log, "a") as f:
                f.write("%d %d %d\n" % (len(q), int.from_bytes(q[8:10], "big"), int.from_bytes(q[10:12], "big")))
        try:
            i, labels = 12, []
            while q[i]:
                labels.append(q[i + 1:i + 1 + q[i]].decode().lower()); i += 1 + q[i]
            qtype, end = q[i + 1:i + 3], i + 5
            addr = names.get(".".join(labels))
            if addr == "@silent":
                continue
            extra = addr is not None and addr.endswith("+extra")
            if extra:
                addr = addr[:-len("+extra")]
            ans, ns, ar = b"", b"", b""
            if addr and qtype == b"\x00\x01":
                ans = b"\xc0\x0c\x00\x01\x00\x01" + (30).to_bytes(4, "big") + b"\x00\x04" + socket.inet_aton(addr)
            if addr and extra:
                target = b"\x02ns\x08smuggled\x00"
                ns = b"\xc0\x0c\x00\x02\x00\x01" + (30).to_bytes(4, "big") + len(target).to_bytes(2, "big") + target
                txt = b"smuggled-" + b"x" * 100
                ar = b"\xc0\x0c\x00\x10\x00\x01" + (30).to_bytes(4, "big") + (len(txt) + 1).to_bytes(2, "big") + bytes([len(txt)]) + txt
            flags = bytes([0x81, 0x80 | (0 if addr else 3)])
            counts = b"\x00\x01" + (b"\x00\x01" if ans else b"\x00\x00") + (b"\x00\x01" if ns else b"\x00\x00") + (b"\x00\x01" if ar else b"\x00\x00")
            u.sendto(q[:2] + flags + counts + q[12:end] + ans + ns + ar, peer)
        except Exception:
            pass
names = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
if names:
    threading.Thread(target=dns, args=(names,), daemon=True).start()
for p in sys.argv[1:]:
    if "=" not in p:
        threading.Thread(target=serve, args=(int(p),), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"#;

impl Upstream {
    /// Made at 10.251.`third`.2 (the host's end .1), the second address 10.252.`third`.1, the
    /// public ones [`public_addr`]`(third)` and [`public2_addr`]`(third)` (`third` below
    /// 128); `tag` (at most 6 characters) names the namespace and veth.
    pub fn new(tag: &str, third: u8, ports: &[u16]) -> Upstream {
        Upstream::with_names(tag, third, ports, &[])
    }

    /// As [`Upstream::new`], with a DNS answerer for `names` (name → address).
    pub fn with_names(tag: &str, third: u8, ports: &[u16], names: &[(&str, Ipv4Addr)]) -> Upstream {
        Upstream::with_names_logged(tag, third, ports, names, None)
    }

    /// As [`Upstream::with_names`], the DNS answerer appending a line per query it receives
    /// to `log` (see [`SERVER`]).
    pub fn with_names_logged(
        tag: &str,
        third: u8,
        ports: &[u16],
        names: &[(&str, Ipv4Addr)],
        log: Option<&std::path::Path>,
    ) -> Upstream {
        let answers: Vec<(&str, Answer)> = names.iter().map(|(n, a)| (*n, Answer::A(*a))).collect();
        Upstream::with_answers(tag, third, ports, &answers, log)
    }

    /// As [`Upstream::with_names_logged`], each name answered as its [`Answer`] says.
    pub fn with_answers(
        tag: &str,
        third: u8,
        ports: &[u16],
        answers: &[(&str, Answer)],
        log: Option<&std::path::Path>,
    ) -> Upstream {
        let ns = format!("sbxt-up-{tag}");
        let host_veth = format!("sbxtu{tag}");
        let addr = Ipv4Addr::new(10, 251, third, 2);
        let second = Ipv4Addr::new(10, 252, third, 1);
        assert!(
            third < 128,
            "the public addresses are 192.52.193.THIRD and .128+THIRD"
        );
        let public = public_addr(third);
        let public2 = public2_addr(third);
        // Dropped (the namespace, veth and routes removed) if a step below fails.
        let mut up = Upstream {
            ns: ns.clone(),
            host_veth: host_veth.clone(),
            addr,
            second,
            public,
            public2,
            servers: None,
        };
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", "name", &host_veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&[
            "addr",
            "add",
            &format!("10.251.{third}.1/30"),
            "dev",
            &host_veth,
        ]);
        ip(&["link", "set", "dev", &host_veth, "up"]);
        for routed in [second, public, public2] {
            ip(&[
                "route",
                "add",
                &format!("{routed}/32"),
                "via",
                &addr.to_string(),
                "dev",
                &host_veth,
            ]);
        }
        ip(&["-n", &ns, "link", "set", "dev", "lo", "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/30"),
            "dev",
            "eth0",
        ]);
        for local in [second, public, public2] {
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{local}/32"),
                "dev",
                "lo",
            ]);
        }
        ip(&["-n", &ns, "link", "set", "dev", "eth0", "up"]);
        // No route back to the sandboxes' network: their replies come back only because the
        // gateway masquerades what leaves the bridge (a test of that, not an assumption).
        let mut args = vec![
            "netns".to_string(),
            "exec".into(),
            ns.clone(),
            "python3".into(),
            "-c".into(),
            SERVER.into(),
        ];
        args.extend(ports.iter().map(|p| p.to_string()));
        args.extend(answers.iter().map(|(n, a)| format!("{n}={}", a.arg())));
        if let Some(log) = log {
            args.push(format!("@log={}", log.display()));
        }
        let mut child = Command::new("ip")
            .args(&args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("servers");
        let mut ready = [0u8; 6];
        child
            .stdout
            .as_mut()
            .unwrap()
            .read_exact(&mut ready)
            .expect("servers ready");
        up.servers = Some(child);
        up
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(mut c) = self.servers.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // The routes go with the veth; said first so that none outlives the test even if the
        // veth's delete failed.
        for routed in [self.second, self.public, self.public2] {
            let _ = Command::new("ip")
                .args([
                    "route",
                    "delete",
                    &format!("{routed}/32"),
                    "dev",
                    &self.host_veth,
                ])
                .output();
        }
        let _ = Command::new("ip")
            .args(["link", "delete", "dev", &self.host_veth])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.ns])
            .output();
    }
}

/// A network the host is attached to, made by the test: a namespace behind a veth whose host
/// end holds the first address of the /30 `net` (the on-link route a LAN, a container bridge,
/// a libvirt or pod network gives the host) and whose other end, `peer`, the second; TCP
/// servers on `ports` as [`Upstream`]'s. `tag` (at most 6 characters) names the namespace and
/// veth; all of it goes on drop.
pub struct Attached {
    pub ns: String,
    pub host_veth: String,
    pub peer: Ipv4Addr,
    servers: Option<Child>,
}

impl Attached {
    pub fn new(tag: &str, net: Ipv4Addr, ports: &[u16]) -> Attached {
        let ns = format!("sbxt-at-{tag}");
        let host_veth = format!("sbxta{tag}");
        let host_end = Ipv4Addr::from(u32::from(net) + 1);
        let peer = Ipv4Addr::from(u32::from(net) + 2);
        let mut at = Attached {
            ns: ns.clone(),
            host_veth: host_veth.clone(),
            peer,
            servers: None,
        };
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", "name", &host_veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&["addr", "add", &format!("{host_end}/30"), "dev", &host_veth]);
        ip(&["link", "set", "dev", &host_veth, "up"]);
        ip(&["-n", &ns, "link", "set", "dev", "lo", "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{peer}/30"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &ns, "link", "set", "dev", "eth0", "up"]);
        let mut args = vec![
            "netns".to_string(),
            "exec".into(),
            ns.clone(),
            "python3".into(),
            "-c".into(),
            SERVER.into(),
        ];
        args.extend(ports.iter().map(|p| p.to_string()));
        let mut child = Command::new("ip")
            .args(&args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("servers");
        let mut ready = [0u8; 6];
        let started = child.stdout.as_mut().unwrap().read_exact(&mut ready);
        at.servers = Some(child);
        started.expect("servers ready");
        at
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        if let Some(mut c) = self.servers.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip")
            .args(["link", "delete", "dev", &self.host_veth])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.ns])
            .output();
    }
}

/// What a connect from inside namespace `ns` to `addr:port` got: the server's greeting, or
/// the error, within 3 s.
pub fn connect_from(ns: &str, addr: Ipv4Addr, port: u16) -> String {
    let script = format!(
        "import socket\ns=socket.socket(); s.settimeout(3)\ntry:\n    s.connect(('{addr}', {port})); print(s.recv(100).decode().strip())\nexcept Exception as e:\n    print('error', type(e).__name__, e)"
    );
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "python3", "-c", &script])
        .output()
        .expect("python3");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// What a DNS query for `name` (type A), sent from inside namespace `ns` to `server`:53,
/// got: `rcode N` and the addresses answered (`rcode 0 10.0.0.1`), or `error …` within 3 s.
pub fn resolve_from(ns: &str, server: Ipv4Addr, name: &str) -> String {
    let script = format!(
        r#"import socket, struct
q = struct.pack(">HHHHHH", 4660, 256, 1, 0, 0, 0) + b"".join(bytes([len(l)]) + l.encode() for l in "{name}".split(".")) + b"\0\0\1\0\1"
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
try:
    s.sendto(q, ("{server}", 53)); r, _ = s.recvfrom(4096)
    n, i = struct.unpack(">H", r[6:8])[0], len(q)
    out = []
    for _ in range(n):
        if r[i] & 0xc0 == 0xc0: i += 2
        else:
            while r[i]: i += 1 + r[i]
            i += 1
        t, _, _, l = struct.unpack(">HHIH", r[i:i + 10]); i += 10
        if t == 1: out.append(socket.inet_ntoa(r[i:i + l]))
        i += l
    print("rcode", r[3] & 15, *out)
except Exception as e:
    print("error", type(e).__name__, e)"#
    );
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "python3", "-c", &script])
        .output()
        .expect("python3");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// What the reply to a DNS query for `name` (type A), sent from inside namespace `ns` to
/// `server`:53, holds: `rcode R an N ns N ar N`, and ` smuggled` if any of its bytes spell
/// "smuggled" (what [`Answer::WithExtra`] puts in the authority and additional sections), or
/// `error …` within 3 s.
pub fn reply_sections_from(ns: &str, server: Ipv4Addr, name: &str) -> String {
    let script = format!(
        r#"import socket, struct
q = struct.pack(">HHHHHH", 4662, 256, 1, 0, 0, 0) + b"".join(bytes([len(l)]) + l.encode() for l in "{name}".split(".")) + b"\0\0\1\0\1"
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
try:
    s.sendto(q, ("{server}", 53)); r, _ = s.recvfrom(4096)
    an, ns, ar = struct.unpack(">HHH", r[6:12])
    print("rcode", r[3] & 15, "an", an, "ns", ns, "ar", ar, *(["smuggled"] if b"smuggled" in r else []))
except Exception as e:
    print("error", type(e).__name__, e)"#
    );
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "python3", "-c", &script])
        .output()
        .expect("python3");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// How many entries of the host's connection tracking table (`/proc/net/nf_conntrack`, this
/// process's namespace) `source` began: those whose original direction's source it is.
pub fn conntrack_entries_from(source: Ipv4Addr) -> usize {
    let table = std::fs::read_to_string("/proc/net/nf_conntrack").expect("/proc/net/nf_conntrack");
    let first_src = format!("src={source} ");
    table
        .lines()
        .filter(|l| {
            l.split_once("src=")
                .is_some_and(|(_, rest)| format!("src={rest}").starts_with(&first_src))
        })
        .count()
}

/// The median time, in milliseconds, of `n` DNS queries for `name` (type A) sent one after
/// another from inside namespace `ns` (or the host's, with `None`) to `server`:53; panics
/// unless every one was answered NOERROR with an address.
pub fn query_timing(ns: Option<&str>, server: Ipv4Addr, name: &str, n: usize) -> f64 {
    let script = format!(
        r#"import socket, struct, time, statistics
q = struct.pack(">HHHHHH", 4660, 256, 1, 0, 0, 0) + b"".join(bytes([len(l)]) + l.encode() for l in "{name}".split(".")) + b"\0\0\1\0\1"
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
lat = []
for _ in range({n}):
    t = time.perf_counter(); s.sendto(q, ("{server}", 53)); r, _ = s.recvfrom(4096); lat.append(time.perf_counter() - t)
    assert r[3] & 15 == 0 and struct.unpack(">H", r[6:8])[0] >= 1, r
print(statistics.median(lat) * 1000)"#
    );
    let out = match ns {
        Some(ns) => Command::new("ip")
            .args(["netns", "exec", ns, "python3", "-c", &script])
            .output(),
        None => Command::new("python3").args(["-c", &script]).output(),
    }
    .expect("python3");
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim().parse().unwrap_or_else(|_| {
        panic!(
            "query timing from {ns:?}: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A long-lived connection from inside `ns`: a child that connects, prints the greeting, then
/// echoes lines from its stdin over the connection.
pub struct Held {
    child: Child,
}

impl Held {
    pub fn open(ns: &str, addr: Ipv4Addr, port: u16) -> (Held, String) {
        let script = format!(
            "import socket,sys\ns=socket.create_connection(('{addr}', {port}), timeout=5)\nf=s.makefile('rwb')\nprint(f.readline().decode().strip(), flush=True)\nfor line in sys.stdin:\n    f.write(line.encode()); f.flush(); print(f.readline().decode().strip(), flush=True)"
        );
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, "python3", "-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let greeting = read_line(&mut child);
        (Held { child }, greeting)
    }

    pub fn echo(&mut self, text: &str) -> String {
        writeln!(self.child.stdin.as_mut().unwrap(), "{text}").unwrap();
        read_line(&mut self.child)
    }
}

fn read_line(child: &mut Child) -> String {
    let out = child.stdout.as_mut().unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while out.read(&mut b).map(|n| n == 1).unwrap_or(false) && b[0] != b'\n' {
        line.push(b[0]);
        if line.len() > 200 {
            break;
        }
    }
    String::from_utf8_lossy(&line).into_owned()
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
