//! The sandbox network's flags (`--network-*`), shared by the drivers whose sandboxes get a
//! network (oci, process and vm): `sbxd serve` and a driver host (`sbxd driver`, `sbxd node`)
//! take them through the driver registry, and a managed driver host is passed them again
//! ([`NetworkArgs::to_flags`]). [`NetworkArgs::open`] sets the network up, or finds it again,
//! for the driver that opens with them.

use std::ffi::OsString;
use std::sync::Arc;

use sbx_driver_api::DriverError;

use crate::{Network, NetworkConfig, NetworkError};

/// The sandbox network's settings. No help heading of their own: the registry places them
/// (under the oci driver's, where they have always been listed).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct NetworkArgs {
    /// The sandbox network (oci and process drivers): a bridge (<--network-name>0) holding
    /// this IPv4 network's first address, an address per sandbox leased by its UUID, and
    /// their egress policies enforced by one nftables table (`inet <--network-name>`). A
    /// sandbox on it reaches nothing but what its allowlist admits (none by default).
    /// `auto` (the default): the first of --network-auto-ranges that overlaps nothing the
    /// host routes or holds an address in (another gateway's bridge included), kept for
    /// later starts (the log says which). `off`: no network, every sandbox has loopback
    /// only. A CIDR: that one, refused at startup if it overlaps a network the host routes.
    /// When the network cannot be set up as asked (every range taken, no nft, no ip), sbxd
    /// does not start, and says what is in the way. Turns on IPv4 forwarding.
    #[arg(
        id = "network_cidr",
        long = "network-cidr",
        env = "SBX_NETWORK_CIDR",
        value_name = "CIDR|auto|off",
        default_value = "auto"
    )]
    pub cidr: Option<String>,

    /// The networks `--network-cidr auto` tries, in order, comma-separated.
    #[arg(
        id = "network_auto_ranges",
        long = "network-auto-ranges",
        env = "SBX_NETWORK_AUTO_RANGES",
        value_name = "CIDR,…",
        default_value = "10.213.0.0/16,10.214.0.0/16,10.215.0.0/16,172.29.0.0/16,172.30.0.0/16,192.168.213.0/24",
        value_delimiter = ','
    )]
    pub auto_ranges: Vec<String>,

    /// Names the sandbox network's bridge (<NAME>0), nftables table and namespaces
    /// (<NAME>-<uuid>): 1 to 8 characters of a-z and 0-9. One per gateway on a host.
    #[arg(
        id = "network_name",
        long = "network-name",
        env = "SBX_NETWORK_NAME",
        default_value = "sbx",
        value_name = "NAME"
    )]
    pub name: String,

    /// The resolver the gateway's sandbox resolver asks for the names a sandbox's policy
    /// allows (`ADDR` or `ADDR:PORT`, IPv4). Default: the host's first IPv4 nameserver in
    /// /etc/resolv.conf. Sandboxes never reach it themselves: they ask the bridge's address,
    /// and names off their list are refused there.
    #[arg(
        id = "network_dns",
        long = "network-dns",
        env = "SBX_NETWORK_DNS",
        value_name = "ADDR[:PORT]",
        value_parser = parse_dns_upstream
    )]
    pub dns: Option<std::net::SocketAddr>,

    /// The connections each sandbox on the network may have in the host's connection
    /// tracking table at once (the table, `nf_conntrack_max`, is shared by every connection
    /// of the host: without a bound one sandbox fills it). One more is refused and counted.
    /// No ordinary program comes near the default; 64 sandboxes at it fill a table of
    /// 262,144.
    #[arg(
        id = "network_conntrack_max",
        long = "network-conntrack-max",
        env = "SBX_NETWORK_CONNTRACK_MAX",
        default_value_t = crate::DEFAULT_CONNTRACK_MAX,
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub conntrack_max: u32,
}

/// `A.B.C.D` or `A.B.C.D:PORT`.
pub fn parse_dns_upstream(text: &str) -> Result<std::net::SocketAddr, String> {
    if let Ok(addr) = text.parse::<std::net::Ipv4Addr>() {
        return Ok(std::net::SocketAddr::from((addr, 53)));
    }
    match text.parse::<std::net::SocketAddr>() {
        Ok(a @ std::net::SocketAddr::V4(_)) if a.port() != 0 => Ok(a),
        _ => Err(format!(
            "{text:?} is not an IPv4 address, optionally with a port (10.0.0.53 or 10.0.0.53:5353)"
        )),
    }
}

impl Default for NetworkArgs {
    /// No network (`None`: what a driver opened without flags gets), named [`DEFAULT_NAME`].
    ///
    /// [`DEFAULT_NAME`]: crate::DEFAULT_NAME
    fn default() -> Self {
        NetworkArgs {
            cidr: None,
            auto_ranges: crate::AUTO_CANDIDATES
                .iter()
                .map(|c| c.to_string())
                .collect(),
            name: crate::DEFAULT_NAME.to_string(),
            dns: None,
            conntrack_max: crate::DEFAULT_CONNTRACK_MAX,
        }
    }
}

impl NetworkArgs {
    /// These settings as the `--network-*` flags of a driver host sbxd starts (the oci,
    /// process and vm drivers' hosts get them); only `--network-cidr off` when the network is
    /// off.
    pub fn to_flags(&self) -> Vec<OsString> {
        // Always said: a host's own default (auto) must not stand in for `off`.
        let cidr = self.cidr.as_deref().unwrap_or("off");
        let mut flags: Vec<OsString> = vec!["--network-cidr".into(), cidr.into()];
        if cidr == "off" {
            return flags;
        }
        flags.push("--network-name".into());
        flags.push(self.name.clone().into());
        if cidr == "auto" && self.auto_ranges != NetworkArgs::default().auto_ranges {
            flags.push("--network-auto-ranges".into());
            flags.push(self.auto_ranges.join(",").into());
        }
        if let Some(dns) = &self.dns {
            flags.push("--network-dns".into());
            flags.push(dns.to_string().into());
        }
        if self.conntrack_max != crate::DEFAULT_CONNTRACK_MAX {
            flags.push("--network-conntrack-max".into());
            flags.push(self.conntrack_max.to_string().into());
        }
        flags
    }

    /// The sandbox network these flags ask for (its leases under `state_dir/network`), set
    /// up or found again; `None` without `--network-cidr` or with `off`. A network that
    /// cannot be made as asked — `auto` included: every range taken, no nft, no ip — is an
    /// error naming what is in the way and `--network-cidr off`, so sbxd does not start
    /// rather than serve sandboxes with loopback only.
    pub async fn open(
        &self,
        state_dir: &std::path::Path,
    ) -> Result<Option<Arc<Network>>, DriverError> {
        let asked = match self.cidr.as_deref() {
            None | Some("off") => return Ok(None),
            Some(cidr) => cidr.to_string(),
        };
        let auto = asked == "auto";
        if auto {
            if self.auto_ranges.is_empty() {
                return Err(DriverError::InvalidArgument(
                    "--network-auto-ranges is empty: name at least one network".into(),
                ));
            }
            for range in &self.auto_ranges {
                crate::parse_cidr(range).map_err(|e| {
                    DriverError::InvalidArgument(format!("--network-auto-ranges: {e}"))
                })?;
            }
        } else {
            crate::parse_cidr(&asked).map_err(|e| DriverError::InvalidArgument(e.to_string()))?;
        }
        let args = self.clone();
        let state_dir = state_dir.to_path_buf();
        let opened = tokio::task::spawn_blocking(move || args.open_blocking(&state_dir))
            .await
            .map_err(|e| DriverError::Internal(format!("opening the sandbox network: {e}")))?;
        let (net, cidr, dns_upstream) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                return Err(DriverError::Unavailable(format!(
                    "no sandbox network as --network-cidr {asked} asks: {e}; or start sbxd with --network-cidr off (every sandbox then has loopback only)"
                )));
            }
        };
        tracing::info!(cidr = %cidr, chosen = if auto { "auto" } else { "--network-cidr" }, bridge = %net.bridge_name(), resolver = ?dns_upstream, "the sandbox network is up");
        Ok(Some(Arc::new(net)))
    }

    /// [`NetworkArgs::open`]'s work, blocking, under the host's [`crate::ChoiceLock`]: the
    /// range (auto's choice, or the one given), the upstream resolver, the network.
    fn open_blocking(
        &self,
        state_dir: &std::path::Path,
    ) -> Result<(Network, String, Option<std::net::SocketAddr>), NetworkError> {
        let _choosing = crate::ChoiceLock::take()?;
        let net_dir = state_dir.join("network");
        let cidr = match self.cidr.as_deref() {
            Some("auto") => crate::auto_cidr(&net_dir, &self.name, &self.auto_ranges)?,
            other => other.unwrap_or_default().to_string(),
        };
        let (network, prefix) = crate::parse_cidr(&cidr)?;
        let dns_upstream = self.dns.or_else(|| {
            let conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
            crate::resolver::host_nameserver(&conf, network, prefix)
        });
        if dns_upstream.is_none() {
            tracing::warn!(
                "no upstream resolver (no --network-dns, no IPv4 nameserver in /etc/resolv.conf): hostname entries of sandbox policies resolve to nothing"
            );
        }
        let config = NetworkConfig {
            name: self.name.clone(),
            network,
            prefix,
            state_dir: net_dir,
            dns_upstream,
            conntrack_max: self.conntrack_max,
        };
        let net = Network::open(config)?;
        Ok((net, cidr, dns_upstream))
    }
}
