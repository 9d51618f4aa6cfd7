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

/// A namespace with servers, made by the test: `addr` on a veth to the host, `second` another
/// address of it the host routes there too. TCP servers on `ports` of every address answer
/// each connection with "hello <port>\n" and then echo what they read; with names, a DNS
/// answerer on UDP port 53 answers A queries for them (TTL 30 s), NXDOMAIN for others; given
/// the name `@log` (its "address" a file path), it appends one line per query it receives:
/// `LENGTH NSCOUNT ARCOUNT`.
pub struct Upstream {
    pub ns: String,
    pub host_veth: String,
    pub addr: Ipv4Addr,
    pub second: Ipv4Addr,
    servers: Option<Child>,
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
            ans = b""
            if addr and qtype == b"\x00\x01":
                ans = b"\xc0\x0c\x00\x01\x00\x01" + (30).to_bytes(4, "big") + b"\x00\x04" + socket.inet_aton(addr)
            flags = bytes([0x81, 0x80 | (0 if addr else 3)])
            counts = b"\x00\x01" + (b"\x00\x01" if ans else b"\x00\x00") + b"\x00\x00\x00\x00"
            u.sendto(q[:2] + flags + counts + q[12:end] + ans, peer)
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
    /// Made at 10.251.`third`.2 (the host's end .1), the second address 10.252.`third`.1;
    /// `tag` (at most 6 characters) names the namespace and veth.
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
        let ns = format!("sbxt-up-{tag}");
        let host_veth = format!("sbxtu{tag}");
        let addr = Ipv4Addr::new(10, 251, third, 2);
        let second = Ipv4Addr::new(10, 252, third, 1);
        let mut up = Upstream {
            ns: ns.clone(),
            host_veth: host_veth.clone(),
            addr,
            second,
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
        ip(&[
            "route",
            "add",
            &format!("{second}/32"),
            "via",
            &addr.to_string(),
            "dev",
            &host_veth,
        ]);
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
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{second}/32"),
            "dev",
            "lo",
        ]);
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
        args.extend(names.iter().map(|(n, a)| format!("{n}={a}")));
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
