//! A sandbox whose workload has a kernel of its own (a `vm` guest): it holds the address
//! itself, so its namespace carries frames, not an address.
//!
//! The namespace (`<name>-<uuid>`, host root's, as for any sandbox) has the veth into the
//! bridge (`eth0`, no address) and a tap device (`tap0`) that the guest's QEMU opens; tc joins
//! the two (every frame that comes in on one leaves on the other: `mirred` redirects, as Kata
//! Containers' "tcfilter" mode does). The guest sets its leased address and routes itself.
//!
//! **Anti-spoofing.** The guest is root in its own kernel and can put any source address or
//! MAC on what it sends. What comes in on `tap0` is passed on only when it is IPv4 from the
//! guest's MAC ([`guest_mac`], given to its NIC) and its leased address, or ARP from that MAC
//! that says that address (tc `u32` matches: this host's kernel has no `flower`); everything
//! else (another address, another MAC, IPv6, other protocols) is not passed on: it ends in
//! the namespace's own stack, which has no address, does not forward and has IPv6 off — in
//! the namespace the guest cannot reach. Past the veth, its
//! packets meet the gateway's table like any sandbox's, by their (now true) source address.

use std::net::Ipv4Addr;

use uuid::Uuid;

use crate::link::{self, IpError, tc_in};
use crate::{AllowEntry, Attachment, Network, NetworkError};

/// The tap device a guest's QEMU opens, inside the sandbox's namespace.
pub const TAP: &str = "tap0";

/// The MAC a guest's NIC gets: locally administered, unicast, from the sandbox's id.
pub fn guest_mac(id: Uuid) -> String {
    let b = id.as_bytes();
    format!(
        "02:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        b[0], b[1], b[2], b[3], b[4]
    )
}

/// The guest's MAC as the ARP header holds it: its first four bytes and its last two, in hex.
fn mac_words(id: Uuid) -> (String, String) {
    let b = id.as_bytes();
    (
        format!("0x02{:02x}{:02x}{:02x}", b[0], b[1], b[2]),
        format!("0x{:02x}{:02x}", b[3], b[4]),
    )
}

/// In the namespace: no forwarding, no IPv6 (`ip netns exec` runs sysctl there).
fn sysctls(netns: &str) -> Result<(), IpError> {
    for setting in [
        "net.ipv4.conf.all.forwarding=0",
        "net.ipv6.conf.all.disable_ipv6=1",
        "net.ipv6.conf.default.disable_ipv6=1",
    ] {
        link::ip(&["netns", "exec", netns, "sysctl", "-q", "-w", setting])?;
    }
    Ok(())
}

impl Network {
    /// [`Network::attach`] for a guest that holds its address itself: the namespace, the veth
    /// without an address, the tap and the filters between them (see the module docs), the
    /// lease and the policy. What is already there and whole is kept (a restarted gateway
    /// re-attaches without touching a running guest's link); anything half made is made
    /// again.
    pub fn attach_guest(&self, id: Uuid, allow: &[AllowEntry]) -> Result<Attachment, NetworkError> {
        let address = self.lease(id)?;
        let ns = self.netns_name(id);
        let gateway = self.gateway_addr();
        let mac = guest_mac(id);
        self.set_policy(id, allow)?;
        if !link::netns_exists(&ns) {
            link::ip(&["netns", "add", &ns])?;
        }
        if !self.guest_link_whole(&ns, address, id) {
            let _ = link::ip_in(&ns, &["link", "delete", "dev", TAP]);
            self.make_veth(id, &ns)?;
            link::ip_in(&ns, &["tuntap", "add", "dev", TAP, "mode", "tap"])?;
            link::ip_in(&ns, &["link", "set", "dev", "eth0", "up"])?;
            link::ip_in(&ns, &["link", "set", "dev", TAP, "up"])?;
            // The namespace itself neither forwards nor speaks IPv6: a frame no filter below
            // passes on ends in its stack, which has no address and no route.
            sysctls(&ns)?;
            for dev in ["eth0", TAP] {
                tc_in(&ns, &["qdisc", "add", "dev", dev, "ingress"])?;
            }
            let (mac_hi, mac_lo) = mac_words(id);
            let ip = u32::from(address);
            let (ip_hi, ip_lo) = (
                format!("{:#06x}", ip >> 16),
                format!("{:#06x}", ip & 0xffff),
            );
            let addr = format!("{address}/32");
            // From the guest: its IPv4 from its MAC and address, its ARP from that MAC saying
            // that address (sender MAC at 8, sender address at 14 of the ARP header; u32
            // matches are aligned, so in halves). To the guest: everything the bridge sends.
            tc_in(
                &ns,
                &[
                    "filter", "add", "dev", TAP, "ingress", "pref", "10", "protocol", "ip", "u32",
                    "match", "ip", "src", &addr, "match", "ether", "src", &mac, "action", "mirred",
                    "egress", "redirect", "dev", "eth0",
                ],
            )?;
            tc_in(
                &ns,
                &[
                    "filter",
                    "add",
                    "dev",
                    TAP,
                    "ingress",
                    "pref",
                    "20",
                    "protocol",
                    "arp",
                    "u32",
                    "match",
                    "ether",
                    "src",
                    &mac,
                    "match",
                    "u32",
                    &mac_hi,
                    "0xffffffff",
                    "at",
                    "8",
                    "match",
                    "u16",
                    &mac_lo,
                    "0xffff",
                    "at",
                    "12",
                    "match",
                    "u16",
                    &ip_hi,
                    "0xffff",
                    "at",
                    "14",
                    "match",
                    "u16",
                    &ip_lo,
                    "0xffff",
                    "at",
                    "16",
                    "action",
                    "mirred",
                    "egress",
                    "redirect",
                    "dev",
                    "eth0",
                ],
            )?;
            tc_in(
                &ns,
                &[
                    "filter", "add", "dev", "eth0", "ingress", "pref", "10", "protocol", "all",
                    "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect",
                    "dev", TAP,
                ],
            )?;
        }
        Ok(Attachment {
            address,
            gateway,
            netns_path: std::path::Path::new("/run/netns").join(ns),
        })
    }

    /// Whether the guest's link in `ns` is whole: the tap, and its filters naming this MAC
    /// and address, and the veth's redirect to it.
    fn guest_link_whole(&self, ns: &str, address: Ipv4Addr, id: Uuid) -> bool {
        let tap_up = link::ip_in(ns, &["-o", "link", "show", "dev", TAP]).is_ok();
        let from_guest = tc_in(ns, &["filter", "show", "dev", TAP, "ingress"]).unwrap_or_default();
        let to_guest = tc_in(ns, &["filter", "show", "dev", "eth0", "ingress"]).unwrap_or_default();
        let ip = format!("{:08x}/ffffffff", u32::from(address));
        let (mac_hi, _) = mac_words(id);
        tap_up
            && from_guest.contains(&ip)
            && from_guest.contains(&format!("{}/ffffffff at 8", &mac_hi[2..]))
            && to_guest.contains(&format!("device {TAP}"))
    }
}
