//! The gateway's nftables table, driven through `nft`'s JSON interface: every change is one
//! JSON document given to `nft -j -f -`, which the kernel applies as one transaction (all of
//! it or none). Nothing here builds rule text; nothing touches a table but the gateway's own.
//!
//! The table (`inet <name>`):
//! - `forward` and `input` (filter hooks, priority -10): a packet from the bridge of a
//!   connection already admitted passes; a new one jumps, through the verdict map
//!   `sandboxes` (source address → `jump sb_<id>`), to its sandbox's chain; whatever that
//!   chain does not accept, and whatever comes from an address no sandbox holds, goes to
//!   `deny`. New connections from elsewhere *into* the bridge are dropped (a sandbox is
//!   reached through the gateway's port-forward, not the network).
//! - `sb_<id>`: per class of entries (same protocols and ports) an `accept` rule over the
//!   class's networks (`s_<id>_<k>`) and one over the addresses the gateway's resolver
//!   answered for its names (`h_<id>_<k>`, each element kept for its answer's TTL), replaced
//!   whole on a policy update. Sandboxes reach the resolver (the bridge's address, UDP 53)
//!   whatever their list says, at most [`DNS_RATE`] queries a second each (the dynamic set
//!   `dns_rate`, one token bucket per source address; more are dropped, and counted per
//!   source in `dns_refused`).
//! - `admit`: every new connection a sandbox is let make — to the resolver, or one its chain
//!   accepts — goes through here, which holds each sandbox to its **conntrack budget**
//!   (`NetworkConfig::conntrack_max`): the dynamic set `ct_budget` keeps, per source
//!   address, a `ct count` of the connections it has in the host's connection tracking table;
//!   one more than the budget is rejected (`admin-prohibited`) and counted in `ct_refused`
//!   (per source, a packet counter each). The host's table (`nf_conntrack_max`, 262,144 on a
//!   small host) is shared by every connection of the host: without a budget one sandbox
//!   sending datagrams from new ports fills it (500 a second to the resolver alone are
//!   ~15,000 entries, each kept 30 s), and then every new connection of the host fails. The
//!   set's comment records the budget, so a gateway started with another one makes it anew.
//!   (The kernel counts a TCP connection in TIME_WAIT or CLOSE no more: those leave the
//!   count, not the host's table, for their 2 minutes.)
//! - `deny`: records the attempt in the dynamic set `denied` (source . destination .
//!   protocol . port, with a packet counter, kept 10 minutes, at most 65,535 entries: the
//!   record is rate-limited by construction) and rejects it (`admin-prohibited`, so the
//!   workload's connect fails at once instead of timing out).
//! - `postrouting` (nat): traffic from the sandboxes' network leaving by another interface
//!   is masqueraded to the host's address.

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use serde_json::{Value, json};

use super::policy::{AllowEntry, Protocol};

/// Why an nft command failed: what it was for and what nft said.
#[derive(Debug, thiserror::Error)]
#[error("nftables ({what}): {detail}")]
pub struct NftError {
    pub what: String,
    pub detail: String,
}

const PRIORITY: i32 = -10;

/// Queries a second (and their burst) one sandbox may send the gateway's resolver; more are
/// dropped in the kernel.
pub const DNS_RATE: u32 = 500;

/// The connections one sandbox may have in the host's connection tracking table at once, by
/// default (`sbxd serve --network-conntrack-max`). No ordinary program comes near it: a
/// browser keeps a few hundred connections, a package manager tens, a crawler with 1,000 at
/// once still fits, and a DNS lookup from a new port is one entry for 30 s (a program looking
/// up 50 names a second holds 1,500). Sixty-four sandboxes at their budget fill a table of
/// 262,144; a host running more raises `nf_conntrack_max` or lowers this.
pub const DEFAULT_CONNTRACK_MAX: u32 = 4096;

/// Runs one JSON document through `nft -j -f -` (one kernel transaction).
pub fn apply(what: &str, commands: Vec<Value>) -> Result<(), NftError> {
    let doc = json!({ "nftables": commands });
    if std::env::var_os("SBX_NFT_DUMP").is_some() {
        eprintln!("nft {what}: {doc}");
    }
    run(what, &["-j", "-f", "-"], Some(doc.to_string().as_bytes()))?;
    Ok(())
}

/// `nft -j ARGS…` and its parsed output.
pub fn list(what: &str, args: &[&str]) -> Result<Value, NftError> {
    let mut all = vec!["-j"];
    all.extend_from_slice(args);
    let out = run(what, &all, None)?;
    serde_json::from_slice(&out).map_err(|e| NftError {
        what: what.into(),
        detail: format!("unreadable JSON from nft: {e}"),
    })
}

fn run(what: &str, args: &[&str], input: Option<&[u8]>) -> Result<Vec<u8>, NftError> {
    let err = |detail: String| NftError {
        what: what.into(),
        detail,
    };
    let mut child = Command::new("nft")
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| err(format!("cannot run nft (install Debian's nftables): {e}")))?;
    if let Some(bytes) = input {
        let mut stdin = child.stdin.take().expect("piped stdin");
        stdin
            .write_all(bytes)
            .map_err(|e| err(format!("writing to nft: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| err(format!("waiting for nft: {e}")))?;
    if !out.status.success() {
        let text = String::from_utf8_lossy(&out.stderr);
        let first: String = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .take(3)
            .collect::<Vec<_>>()
            .join("; ");
        return Err(err(format!(
            "{} ({})",
            first.chars().take(400).collect::<String>(),
            out.status
        )));
    }
    Ok(out.stdout)
}

/// The item of `kind` named `name` in `existing` (a table as `nft -j list table` shows it).
fn existing_item<'a>(existing: Option<&'a Value>, kind: &str, name: &str) -> Option<&'a Value> {
    existing
        .and_then(|doc| doc.get("nftables"))
        .and_then(Value::as_array)
        .and_then(|items| {
            items
                .iter()
                .find(|i| i.pointer(&format!("/{kind}/name")).and_then(Value::as_str) == Some(name))
        })
}

fn ifname(name: &str) -> Value {
    Value::String(name.into())
}

fn m(left: Value, right: Value) -> Value {
    json!({ "match": { "op": "==", "left": left, "right": right } })
}

fn iif(name: &str) -> Value {
    m(json!({ "meta": { "key": "iifname" } }), ifname(name))
}

fn oif(name: &str) -> Value {
    m(json!({ "meta": { "key": "oifname" } }), ifname(name))
}

fn established() -> Value {
    m(
        json!({ "ct": { "key": "state" } }),
        json!({ "set": ["established", "related"] }),
    )
}

fn prefix(addr: Ipv4Addr, len: u8) -> Value {
    if len == 32 {
        json!(addr.to_string())
    } else {
        json!({ "prefix": { "addr": addr.to_string(), "len": len } })
    }
}

/// The table's name and the objects every change refers to.
#[derive(Debug, Clone)]
pub struct Table {
    pub name: String,
    pub bridge: String,
    pub network: Ipv4Addr,
    pub prefix: u8,
    /// Each sandbox's conntrack budget (see the module's `admit`).
    pub conntrack_max: u32,
}

/// The chain every admitted new connection goes through (the conntrack budget).
const ADMIT: &str = "admit";

fn goto_admit() -> Value {
    json!({ "goto": { "target": ADMIT } })
}

impl Table {
    fn obj(&self, kind: &str, extra: Value) -> Value {
        let mut o = json!({ "family": "inet", "table": self.name });
        if let (Some(o), Some(extra)) = (o.as_object_mut(), extra.as_object()) {
            o.extend(extra.clone());
        }
        json!({ kind: o })
    }

    fn rule(&self, chain: &str, expr: Vec<Value>) -> Value {
        json!({ "add": self.obj("rule", json!({ "chain": chain, "expr": expr })) })
    }

    /// The commands that make the table and its fixed chains, or bring an existing one back to
    /// them — leaving every sandbox's chain and map entry as they are (a restarted gateway
    /// re-attaches without touching a running workload's network).
    ///
    /// `existing` is the table as `nft -j list table` shows it, if it exists: its sets are
    /// kept as they are (the kernel marks `denied` as updated from the packet path, and an
    /// `add` of it without that mark is refused).
    pub fn setup(&self, existing: Option<&Value>) -> Vec<Value> {
        let mut cmds = self.fixed_chains();
        cmds.extend(self.sets(existing));
        cmds.extend(self.forward_rules());
        cmds.extend(self.input_rules());
        cmds.extend(self.postrouting_rules());
        cmds.extend(self.deny_rules());
        cmds.extend(self.admit_rules());
        cmds
    }

    /// [`Self::setup`]'s first step: the table, and its fixed chains made (or kept) and
    /// emptied.
    fn fixed_chains(&self) -> Vec<Value> {
        let t = json!({ "table": { "family": "inet", "name": self.name } });
        let mut cmds = vec![json!({ "add": t })];
        for (name, hook, kind, prio) in [
            ("forward", "forward", "filter", PRIORITY),
            ("input", "input", "filter", PRIORITY),
            ("postrouting", "postrouting", "nat", 100),
        ] {
            cmds.push(json!({ "add": self.obj("chain", json!({ "name": name, "type": kind, "hook": hook, "prio": prio, "policy": "accept" })) }));
            cmds.push(json!({ "flush": self.obj("chain", json!({ "name": name })) }));
        }
        for chain in ["deny", ADMIT] {
            cmds.push(json!({ "add": self.obj("chain", json!({ "name": chain })) }));
            cmds.push(json!({ "flush": self.obj("chain", json!({ "name": chain })) }));
        }
        cmds
    }

    /// [`Self::setup`]'s sets and map: made when missing, kept as they are otherwise (but
    /// `ct_budget`, made anew when the budget changed).
    fn sets(&self, existing: Option<&Value>) -> Vec<Value> {
        let has = |kind: &str, name: &str| existing_item(existing, kind, name).is_some();
        let comment = |kind: &str, name: &str| {
            existing_item(existing, kind, name)
                .and_then(|i| i.pointer(&format!("/{kind}/comment")))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let mut cmds = Vec::new();
        // Per source: its conntrack count (an element per sandbox with connections, gone when
        // it has none), and what the budgets refused it; room for every address of the
        // network (an update of a full set fails, and with it the rule: the refusal would not
        // happen). `ct_budget` is made anew (the counts start again) when the budget changed:
        // an element keeps the budget it was made with.
        let sandboxes = 1u64 << (32 - u32::from(self.prefix.clamp(8, 32)));
        let budget = format!("budget {}", self.conntrack_max);
        match comment("set", "ct_budget") {
            Some(c) if c == budget => {}
            _ => {
                if has("set", "ct_budget") {
                    cmds.push(json!({ "delete": self.obj("set", json!({ "name": "ct_budget" })) }));
                }
                cmds.push(json!({ "add": self.obj("set", json!({
                    "name": "ct_budget",
                    "type": "ipv4_addr",
                    "size": sandboxes,
                    "comment": budget,
                })) }));
            }
        }
        for counted in ["ct_refused", "dns_refused"] {
            if !has("set", counted) {
                cmds.push(json!({ "add": self.obj("set", json!({
                    "name": counted,
                    "type": "ipv4_addr",
                    "size": sandboxes,
                    "stmt": [{ "counter": null }],
                })) }));
            }
        }
        if !has("set", "denied") {
            cmds.push(json!({ "add": self.obj("set", json!({
            "name": "denied",
            "type": ["ipv4_addr", "ipv4_addr", "inet_proto", "inet_service"],
            "flags": ["timeout"],
            "timeout": 600,
            "size": 65535,
            "stmt": [{ "counter": null }],
            })) }));
        }
        if !has("set", "dns_rate") {
            cmds.push(json!({ "add": self.obj("set", json!({
            "name": "dns_rate",
            "type": "ipv4_addr",
            "flags": ["timeout"],
            "timeout": 60,
            "size": 65535,
            })) }));
        }
        if !has("map", "sandboxes") {
            cmds.push(json!({ "add": self.obj("map", json!({ "name": "sandboxes", "type": "ipv4_addr", "map": "verdict" })) }));
        }
        cmds
    }

    /// [`Self::setup`]'s `forward` rules: replies through, a sandbox's packets to its own
    /// chain (the `sandboxes` map) or else to `deny`, nothing else onto the bridge.
    fn forward_rules(&self) -> Vec<Value> {
        let saddr = json!({ "payload": { "protocol": "ip", "field": "saddr" } });
        let vmap = json!({ "vmap": { "key": saddr, "data": "@sandboxes" } });
        let br = &self.bridge;
        let mut cmds = Vec::new();
        cmds.push(self.rule(
            "forward",
            vec![iif(br), established(), json!({ "accept": null })],
        ));
        cmds.push(self.rule(
            "forward",
            vec![oif(br), established(), json!({ "accept": null })],
        ));
        cmds.push(self.rule("forward", vec![iif(br), vmap.clone()]));
        cmds.push(self.rule(
            "forward",
            vec![iif(br), json!({ "goto": { "target": "deny" } })],
        ));
        cmds.push(self.rule("forward", vec![oif(br), json!({ "drop": null })]));
        cmds
    }

    /// [`Self::setup`]'s `input` rules: the gateway's resolver (within its rate), replies,
    /// then a sandbox's own chain or `deny`.
    fn input_rules(&self) -> Vec<Value> {
        let saddr = json!({ "payload": { "protocol": "ip", "field": "saddr" } });
        let vmap = json!({ "vmap": { "key": saddr, "data": "@sandboxes" } });
        let br = &self.bridge;
        let mut cmds = Vec::new();
        // The gateway's resolver, whatever a sandbox's list says (it answers only the names
        // the list holds) — past [`DNS_RATE`] queries a second from one sandbox, dropped here,
        // in the kernel: a flood never reaches the resolver's socket, whose queue the other
        // sandboxes' queries share.
        let resolver = Ipv4Addr::from(u32::from(self.network) + 1);
        let to_resolver = vec![
            iif(br),
            m(
                json!({ "payload": { "protocol": "ip", "field": "daddr" } }),
                json!(resolver.to_string()),
            ),
            m(json!({ "meta": { "key": "l4proto" } }), json!("udp")),
            m(
                json!({ "payload": { "protocol": "udp", "field": "dport" } }),
                json!(crate::RESOLVER_PORT),
            ),
        ];
        let mut flood = to_resolver.clone();
        flood.push(json!({ "set": {
            "op": "update",
            "elem": saddr.clone(),
            "set": "@dns_rate",
            "stmt": [{ "limit": { "rate": DNS_RATE, "burst": DNS_RATE, "per": "second", "inv": true } }],
        } }));
        flood.push(
            json!({ "set": { "op": "update", "elem": saddr.clone(), "set": "@dns_refused" } }),
        );
        flood.push(json!({ "drop": null }));
        // First in the chain: a flood's datagrams belong to an established flow once the
        // first is answered, and the rule after this accepts those.
        cmds.push(self.rule("input", flood));
        cmds.push(self.rule(
            "input",
            vec![iif(br), established(), json!({ "accept": null })],
        ));
        let mut accept = to_resolver;
        accept.push(goto_admit());
        cmds.push(self.rule("input", accept));
        cmds.push(self.rule("input", vec![iif(br), vmap]));
        cmds.push(self.rule(
            "input",
            vec![iif(br), json!({ "goto": { "target": "deny" } })],
        ));
        cmds
    }

    /// [`Self::setup`]'s `postrouting` rule: the network's packets leaving by another
    /// interface than the bridge are masqueraded.
    fn postrouting_rules(&self) -> Vec<Value> {
        let saddr = json!({ "payload": { "protocol": "ip", "field": "saddr" } });
        let br = &self.bridge;
        let mut cmds = Vec::new();
        cmds.push(self.rule(
            "postrouting",
            vec![
                m(saddr.clone(), prefix(self.network, self.prefix)),
                json!({ "match": { "op": "!=", "left": { "meta": { "key": "oifname" } }, "right": br } }),
                json!({ "masquerade": null }),
            ],
        ));
        cmds
    }

    /// [`Self::setup`]'s `deny` chain: every denied packet recorded in `denied` (by source,
    /// destination, protocol and port; port 0 without one), then rejected.
    fn deny_rules(&self) -> Vec<Value> {
        let mut cmds = Vec::new();
        let key = json!({ "concat": [
            { "payload": { "protocol": "ip", "field": "saddr" } },
            { "payload": { "protocol": "ip", "field": "daddr" } },
            { "meta": { "key": "l4proto" } },
            { "payload": { "protocol": "th", "field": "dport" } },
        ] });
        let l4 = json!({ "meta": { "key": "l4proto" } });
        cmds.push(self.rule(
            "deny",
            vec![
                m(l4.clone(), json!({ "set": ["tcp", "udp"] })),
                json!({ "set": { "op": "update", "elem": key, "set": "@denied" } }),
            ],
        ));
        // Other protocols (ICMP) have no port: recorded with port 0.
        let icmp_key = json!({ "concat": [
            { "payload": { "protocol": "ip", "field": "saddr" } },
            { "payload": { "protocol": "ip", "field": "daddr" } },
            { "meta": { "key": "l4proto" } },
            0,
        ] });
        cmds.push(self.rule(
            "deny",
            vec![
                json!({ "match": { "op": "!=", "left": l4, "right": { "set": ["tcp", "udp"] } } }),
                json!({ "set": { "op": "update", "elem": icmp_key, "set": "@denied" } }),
            ],
        ));
        cmds.push(self.rule(
            "deny",
            vec![json!({ "reject": { "type": "icmpx", "expr": "admin-prohibited" } })],
        ));
        cmds
    }

    /// [`Self::setup`]'s admit chain: a new connection past the sandbox's conntrack budget
    /// is counted and rejected, any other accepted.
    fn admit_rules(&self) -> Vec<Value> {
        let saddr = json!({ "payload": { "protocol": "ip", "field": "saddr" } });
        let mut cmds = Vec::new();
        cmds.push(self.rule(
            ADMIT,
            vec![
                json!({ "set": {
                    "op": "add",
                    "elem": saddr.clone(),
                    "set": "@ct_budget",
                    "stmt": [{ "ct count": { "val": self.conntrack_max, "inv": true } }],
                } }),
                json!({ "set": { "op": "update", "elem": saddr, "set": "@ct_refused" } }),
                json!({ "reject": { "type": "icmpx", "expr": "admin-prohibited" } }),
            ],
        ));
        cmds.push(self.rule(ADMIT, vec![json!({ "accept": null })]));
        cmds
    }

    /// The commands that give the sandbox at `addr` (chain `sb_<key>`) exactly `entries`,
    /// in one transaction: its chain emptied and refilled with, per class of entries (same
    /// protocols and ports), one rule over an address set `s_<key>_<k>` (interval; networks
    /// inside another of the class left out by `classes`) and one over `h_<key>_<k>` (the
    /// addresses the resolver answered for the class's names, each for its TTL); the sets of
    /// an earlier, longer list (`had` of each) deleted; its map entry added (again).
    /// `admitted` (address, name, seconds left) are the resolver's earlier answers: those the
    /// new list still admits go back into their new class's set. Returns the commands and the
    /// number of classes.
    pub fn apply_sandbox(
        &self,
        key: &str,
        addr: Ipv4Addr,
        entries: &[AllowEntry],
        had: usize,
        admitted: &[(Ipv4Addr, String, u64)],
    ) -> (Vec<Value>, usize) {
        let chain = format!("sb_{key}");
        let classes = super::policy::classes(entries);
        let mut cmds = vec![
            json!({ "add": self.obj("chain", json!({ "name": chain })) }),
            json!({ "flush": self.obj("chain", json!({ "name": chain })) }),
        ];
        let daddr = json!({ "payload": { "protocol": "ip", "field": "daddr" } });
        let l4 = json!({ "meta": { "key": "l4proto" } });
        let dport = json!({ "payload": { "protocol": "th", "field": "dport" } });
        for k in classes.len()..had {
            cmds.extend(self.delete_class_sets(key, k));
        }
        for (k, class) in classes.iter().enumerate() {
            let set = format!("s_{key}_{k}");
            let names = format!("h_{key}_{k}");
            cmds.push(json!({ "add": self.obj("set", json!({ "name": set, "type": "ipv4_addr", "flags": ["interval"] })) }));
            cmds.push(json!({ "flush": self.obj("set", json!({ "name": set })) }));
            cmds.push(json!({ "add": self.obj("set", json!({ "name": names, "type": "ipv4_addr", "flags": ["timeout"] })) }));
            cmds.push(json!({ "flush": self.obj("set", json!({ "name": names })) }));
            let elems: Vec<Value> = class
                .networks
                .iter()
                .map(|(a, len)| prefix(*a, *len))
                .collect();
            if !elems.is_empty() {
                cmds.push(
                    json!({ "add": self.obj("element", json!({ "name": set, "elem": elems })) }),
                );
            }
            let again: Vec<Value> = admitted
                .iter()
                .filter(|(_, name, _)| {
                    class
                        .names
                        .iter()
                        .any(|p| super::policy::name_matches(p, name))
                })
                .map(|(a, name, left)| admitted_elem(*a, name, *left))
                .collect();
            if !again.is_empty() {
                cmds.push(
                    json!({ "add": self.obj("element", json!({ "name": names, "elem": again })) }),
                );
            }
            let mut tail = Vec::new();
            if let Some((lo, hi)) = class.ports {
                let protos: Vec<&str> = match class.protocol {
                    Some(p) => vec![p.name()],
                    None => vec![Protocol::Tcp.name(), Protocol::Udp.name()],
                };
                tail.push(m(l4.clone(), json!({ "set": protos })));
                let port = if lo == hi {
                    json!(lo)
                } else {
                    json!({ "range": [lo, hi] })
                };
                tail.push(m(dport.clone(), port));
            }
            tail.push(goto_admit());
            for (has, over) in [
                (!class.networks.is_empty(), &set),
                (!class.names.is_empty(), &names),
            ] {
                if has {
                    let mut expr = vec![m(daddr.clone(), json!(format!("@{over}")))];
                    expr.extend(tail.iter().cloned());
                    cmds.push(self.rule(&chain, expr));
                }
            }
        }
        cmds.push(json!({ "add": self.obj("element", json!({
            "name": "sandboxes",
            "elem": [[addr.to_string(), { "jump": { "target": chain } }]],
        })) }));
        (cmds, classes.len())
    }

    /// Deletes class `k`'s two sets; each is added first, so a set a gateway before this one
    /// never made (or a half-applied list) is no reason for the transaction to fail.
    fn delete_class_sets(&self, key: &str, k: usize) -> Vec<Value> {
        let mut cmds = Vec::new();
        for (set, flags) in [
            (format!("s_{key}_{k}"), "interval"),
            (format!("h_{key}_{k}"), "timeout"),
        ] {
            cmds.push(json!({ "add": self.obj("set", json!({ "name": set, "type": "ipv4_addr", "flags": [flags] })) }));
            cmds.push(json!({ "delete": self.obj("set", json!({ "name": set })) }));
        }
        cmds
    }

    /// The command that admits `addrs`, answered for `name`, in `h_<key>_<k>` for `ttl`
    /// seconds (an address already there gets the new timeout).
    pub fn admit(&self, key: &str, k: usize, name: &str, addrs: &[Ipv4Addr], ttl: u64) -> Value {
        let elems: Vec<Value> = addrs.iter().map(|a| admitted_elem(*a, name, ttl)).collect();
        json!({ "add": self.obj("element", json!({ "name": format!("h_{key}_{k}"), "elem": elems })) })
    }

    /// The commands that remove the sandbox's map entry, chain, its `sets` classes' sets and
    /// what the budgets refused it (added first: there may be nothing to delete).
    pub fn remove_sandbox(&self, key: &str, addr: Ipv4Addr, sets: usize) -> Vec<Value> {
        let chain = format!("sb_{key}");
        let mut cmds = vec![
            json!({ "delete": self.obj("element", json!({ "name": "sandboxes", "elem": [addr.to_string()] })) }),
        ];
        for counted in ["ct_refused", "dns_refused"] {
            for op in ["add", "delete"] {
                cmds.push(json!({ op: self.obj("element", json!({ "name": counted, "elem": [addr.to_string()] })) }));
            }
        }
        cmds.push(json!({ "flush": self.obj("chain", json!({ "name": chain })) }));
        cmds.push(json!({ "delete": self.obj("chain", json!({ "name": chain })) }));
        for k in 0..sets {
            cmds.extend(self.delete_class_sets(key, k));
        }
        cmds
    }
}

fn admitted_elem(addr: Ipv4Addr, name: &str, ttl: u64) -> Value {
    json!({ "elem": { "val": addr.to_string(), "timeout": ttl.max(1), "comment": name } })
}

/// The resolver's answers still in the table, from `nft -j list table` output: per sandbox
/// key, (address, name, seconds left).
pub fn admitted(doc: &Value) -> std::collections::HashMap<String, Vec<(Ipv4Addr, String, u64)>> {
    let mut out: std::collections::HashMap<String, Vec<_>> = Default::default();
    for item in doc
        .get("nftables")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(set) = item.get("set") else { continue };
        let Some(key) = set
            .get("name")
            .and_then(Value::as_str)
            .and_then(|n| n.strip_prefix("h_"))
            .and_then(|rest| rest.rsplit_once('_'))
            .map(|(key, _)| key.to_string())
        else {
            continue;
        };
        for elem in set
            .get("elem")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let e = elem.get("elem").unwrap_or(elem);
            let (Some(addr), Some(name)) = (
                e.get("val")
                    .and_then(Value::as_str)
                    .and_then(|v| v.parse().ok()),
                e.get("comment").and_then(Value::as_str),
            ) else {
                continue;
            };
            let left = e.get("expires").and_then(Value::as_u64).unwrap_or(0);
            if left > 0 {
                out.entry(key.clone())
                    .or_default()
                    .push((addr, name.to_string(), left));
            }
        }
    }
    out
}

/// How many address sets each sandbox (by its key) has in the table, from `nft -j -t list
/// sets` output.
pub fn sandbox_sets(doc: &Value) -> std::collections::HashMap<String, usize> {
    let mut out = std::collections::HashMap::new();
    for item in doc
        .get("nftables")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(name) = item.pointer("/set/name").and_then(Value::as_str) else {
            continue;
        };
        let Some(rest) = name.strip_prefix("s_") else {
            continue;
        };
        let Some((key, k)) = rest.rsplit_once('_') else {
            continue;
        };
        if let Ok(k) = k.parse::<usize>() {
            let n = out.entry(key.to_string()).or_insert(0);
            *n = (*n).max(k + 1);
        }
    }
    out
}

/// The packet count of each element of a set of source addresses with a counter each (what
/// `nft -j list set` shows of `ct_refused` and `dns_refused`).
pub fn counted_by_source(doc: &Value) -> std::collections::HashMap<Ipv4Addr, u64> {
    let mut out = std::collections::HashMap::new();
    for item in doc
        .get("nftables")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        for elem in item
            .pointer("/set/elem")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let e = elem.get("elem").unwrap_or(elem);
            let addr = e
                .get("val")
                .unwrap_or(e)
                .as_str()
                .and_then(|v| v.parse::<Ipv4Addr>().ok());
            let packets = e
                .pointer("/counter/packets")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            if let Some(addr) = addr {
                *out.entry(addr).or_insert(0) += packets;
            }
        }
    }
    out
}

/// One recorded denial: source, destination, protocol, port (0 for ICMP) and packets seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    pub source: Ipv4Addr,
    pub destination: Ipv4Addr,
    pub protocol: String,
    pub port: u16,
    pub packets: u64,
    /// Seconds until the record expires: every new attempt sets it back to ten minutes, so
    /// the highest is the most recent.
    pub expires: u64,
}

/// Reads the `denied` set's elements out of `nft -j list set` output.
pub fn parse_denials(doc: &Value) -> Vec<Denial> {
    let mut out = Vec::new();
    let items = doc
        .get("nftables")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for item in items {
        let Some(elems) = item.pointer("/set/elem").and_then(Value::as_array) else {
            continue;
        };
        for elem in elems {
            // An element with a counter is {"elem": {"val": {"concat": […]}, "counter": {…}}}.
            let (val, packets, expires) = match elem.get("elem") {
                Some(e) => (
                    e.get("val").cloned().unwrap_or(Value::Null),
                    e.pointer("/counter/packets")
                        .and_then(Value::as_u64)
                        .unwrap_or(0),
                    e.get("expires").and_then(Value::as_u64).unwrap_or(0),
                ),
                None => (elem.clone(), 0, 0),
            };
            let Some(parts) = val.get("concat").and_then(Value::as_array) else {
                continue;
            };
            let text = |i: usize| {
                parts
                    .get(i)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string()
            };
            let (Ok(source), Ok(destination)) = (text(0).parse(), text(1).parse()) else {
                continue;
            };
            let protocol = match parts.get(2) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Number(n)) => n.to_string(),
                _ => String::new(),
            };
            let port = parts.get(3).and_then(Value::as_u64).unwrap_or(0) as u16;
            out.push(Denial {
                source,
                destination,
                protocol,
                port,
                packets,
                expires,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(conntrack_max: u32) -> Table {
        Table {
            name: "t".into(),
            bridge: "t0".into(),
            network: Ipv4Addr::new(10, 9, 0, 0),
            prefix: 16,
            conntrack_max,
        }
    }

    /// The `delete` and `add` commands of `cmds` that name set `name`.
    fn set_ops(cmds: &[Value], name: &str) -> Vec<String> {
        cmds.iter()
            .filter_map(|c| {
                let (op, body) = c.as_object()?.iter().next()?;
                (body.pointer("/set/name")?.as_str()? == name).then(|| op.clone())
            })
            .collect()
    }

    #[test]
    fn the_conntrack_budget_is_kept_across_a_restart_and_made_anew_when_it_changes() {
        let fresh = table(4096).setup(None);
        assert_eq!(set_ops(&fresh, "ct_budget"), ["add"]);
        assert_eq!(set_ops(&fresh, "ct_refused"), ["add"]);
        let made = fresh
            .iter()
            .find_map(|c| c.pointer("/add/set").filter(|s| s["name"] == "ct_budget"))
            .unwrap();
        assert_eq!(made["comment"], "budget 4096");
        assert_eq!(made["size"], 65536, "room for every address of a /16");
        let rule = fresh
            .iter()
            .find(|c| c.pointer("/add/rule/chain") == Some(&json!("admit")))
            .unwrap();
        assert!(
            rule.to_string()
                .contains(r#"{"ct count":{"inv":true,"val":4096}}"#),
            "{rule}"
        );
        let existing = json!({ "nftables": [
            { "set": { "family": "inet", "table": "t", "name": "ct_budget", "comment": "budget 4096" } },
            { "set": { "family": "inet", "table": "t", "name": "ct_refused" } },
            { "set": { "family": "inet", "table": "t", "name": "dns_refused" } },
        ] });
        let again = table(4096).setup(Some(&existing));
        assert!(
            set_ops(&again, "ct_budget").is_empty(),
            "kept: its counts go on"
        );
        assert!(set_ops(&again, "ct_refused").is_empty());
        let changed = table(100).setup(Some(&existing));
        assert_eq!(set_ops(&changed, "ct_budget"), ["delete", "add"]);
        assert!(
            set_ops(&changed, "ct_refused").is_empty(),
            "the refusals stay"
        );
    }

    #[test]
    fn counts_by_source_are_read_back() {
        let doc = json!({ "nftables": [
            { "metainfo": {} },
            { "set": { "name": "ct_refused", "elem": [
                { "elem": { "val": "10.9.0.2", "counter": { "packets": 15904, "bytes": 1 } } },
                { "elem": { "val": "10.9.0.3", "counter": { "packets": 0, "bytes": 0 } } },
            ] } },
        ] });
        let by = counted_by_source(&doc);
        assert_eq!(by.get(&Ipv4Addr::new(10, 9, 0, 2)), Some(&15904));
        assert_eq!(by.get(&Ipv4Addr::new(10, 9, 0, 3)), Some(&0));
        assert_eq!(by.len(), 2);
    }
}
