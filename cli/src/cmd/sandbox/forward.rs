//! `sbx sandbox port-forward`: local TCP listeners whose connections each become a byte
//! stream over gRPC (`PortForward`) to `127.0.0.1:REMOTE_PORT` inside the sandbox, as
//! `kubectl port-forward` does. Each direction half-closes on its own; a remote port nobody
//! listens on is reported on the connection that tried it (closed at once), and the
//! listener stays up. Runs until interrupted.

use std::net::SocketAddr;

use clap::Args;
use futures::StreamExt;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    PortForwardInput, PortForwardStart, SandboxRef, port_forward_input, port_forward_output,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::CliError;
use crate::args::parse_name;
use crate::connect::{Channel, Target, connect};

#[derive(Debug, Clone, Args)]
pub struct SandboxPortForwardArgs {
    /// The workspace of the sandbox (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// The sandbox's name.
    #[arg(value_parser = parse_name)]
    pub name: String,
    /// [LOCAL_ADDR:]LOCAL_PORT:REMOTE_PORT, repeatable. LOCAL_ADDR defaults to 127.0.0.1
    /// (loopback only); LOCAL_PORT 0 picks a free port (printed); a lone PORT is both.
    #[arg(required = true, value_name = "PORTS", value_parser = parse_port_spec)]
    pub ports: Vec<PortSpec>,
}

/// `sbx sandbox port-forward`.
pub async fn run_port_forward(
    target: &Target,
    args: SandboxPortForwardArgs,
) -> Result<u8, CliError> {
    let client = SandboxServiceClient::new(connect(target).await?);
    let sandbox = SandboxRef {
        id: String::new(),
        workspace: args.workspace.unwrap_or_default(),
        name: args.name,
    };
    run(client, sandbox, args.ports).await
}

/// One `[LOCAL_ADDR:]LOCAL_PORT:REMOTE_PORT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortSpec {
    pub local: SocketAddr,
    pub remote: u16,
}

/// Parses `[LOCAL_ADDR:]LOCAL_PORT:REMOTE_PORT` (or a lone `PORT`, the same on both sides);
/// the local address defaults to 127.0.0.1, and local port 0 picks a free one.
pub fn parse_port_spec(arg: &str) -> Result<PortSpec, String> {
    let bad = |why: &str| format!("{arg:?}: {why} (expected [LOCAL_ADDR:]LOCAL_PORT:REMOTE_PORT)");
    let port = |s: &str, zero_ok: bool| -> Result<u16, String> {
        match s.parse::<u16>() {
            Ok(0) if !zero_ok => Err(bad("port 0 is not a remote port")),
            Ok(p) => Ok(p),
            Err(_) => Err(bad(&format!("{s:?} is not a port"))),
        }
    };
    let (addr, local, remote) = match arg.rsplit_once(':') {
        None => {
            let p = port(arg, false)?;
            ("127.0.0.1".to_string(), p, p)
        }
        Some((rest, remote)) => {
            let remote = port(remote, false)?;
            match rest.rsplit_once(':') {
                None => ("127.0.0.1".to_string(), port(rest, true)?, remote),
                Some((addr, local)) => {
                    let addr = addr.trim_start_matches('[').trim_end_matches(']');
                    (addr.to_string(), port(local, true)?, remote)
                }
            }
        }
    };
    let ip: std::net::IpAddr = match addr.as_str() {
        "localhost" => std::net::Ipv4Addr::LOCALHOST.into(),
        other => other
            .parse()
            .map_err(|_| bad(&format!("{other:?} is not an IP address")))?,
    };
    Ok(PortSpec {
        local: SocketAddr::new(ip, local),
        remote,
    })
}

/// Binds every listener, says where each forwards from, and serves until interrupted.
pub async fn run(
    client: SandboxServiceClient<Channel>,
    sandbox: SandboxRef,
    specs: Vec<PortSpec>,
) -> Result<u8, CliError> {
    let mut tasks = Vec::new();
    for spec in specs {
        let listener = TcpListener::bind(spec.local)
            .await
            .map_err(|e| CliError::Usage(format!("cannot listen on {}: {e}", spec.local)))?;
        let bound = listener.local_addr()?;
        println!("Forwarding from {bound} -> {}", spec.remote);
        let client = client.clone();
        let sandbox = sandbox.clone();
        tasks.push(tokio::spawn(serve(listener, client, sandbox, spec.remote)));
    }
    tokio::signal::ctrl_c().await?;
    for task in tasks {
        task.abort();
    }
    Ok(0)
}

async fn serve(
    listener: TcpListener,
    client: SandboxServiceClient<Channel>,
    sandbox: SandboxRef,
    remote: u16,
) {
    loop {
        let (conn, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                eprintln!("error: accepting a connection: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = conn.set_nodelay(true);
        let client = client.clone();
        let sandbox = sandbox.clone();
        tokio::spawn(async move {
            if let Err(e) = carry(conn, client, sandbox, remote).await {
                eprintln!("error: the connection from {peer} to port {remote}: {e}");
            }
        });
    }
}

/// Carries one local connection to the sandbox's port and back.
async fn carry(
    conn: TcpStream,
    mut client: SandboxServiceClient<Channel>,
    sandbox: SandboxRef,
    remote: u16,
) -> Result<(), CliError> {
    use port_forward_input::Input;
    let (mut local_rd, mut local_wr) = conn.into_split();
    let (tx, rx) = tokio::sync::mpsc::channel::<PortForwardInput>(8);
    let start = PortForwardInput {
        input: Some(Input::Start(PortForwardStart {
            sandbox: Some(sandbox),
            port: u32::from(remote),
        })),
    };
    tx.send(start)
        .await
        .map_err(|_| CliError::Internal("the forward's channel closed".into()))?;
    let upstream = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match local_rd.read(&mut buf).await {
                Ok(0) | Err(_) => {
                    let close = PortForwardInput {
                        input: Some(Input::CloseWrite(true)),
                    };
                    let _ = tx.send(close).await;
                    // Keep the request stream open (dropping `tx` ends it): the gateway's
                    // answer still flows until the sandbox's side closes.
                    tx.closed().await;
                    return;
                }
                Ok(n) => {
                    let data = PortForwardInput {
                        input: Some(Input::Data(buf[..n].to_vec())),
                    };
                    if tx.send(data).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    let messages = tokio_stream::wrappers::ReceiverStream::new(rx);
    let result = async {
        let mut output = client.port_forward(messages).await?.into_inner();
        while let Some(message) = output.next().await {
            match message?.output {
                Some(port_forward_output::Output::Data(bytes)) => {
                    local_wr.write_all(&bytes).await?
                }
                Some(port_forward_output::Output::Closed(_)) => {
                    local_wr.shutdown().await?;
                    break;
                }
                None => {}
            }
        }
        Ok::<(), CliError>(())
    }
    .await;
    upstream.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_specs_parse_as_kubectl_reads_them() {
        let spec = |s: &str| parse_port_spec(s).unwrap();
        assert_eq!(spec("8080:80").local, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(spec("8080:80").remote, 80);
        assert_eq!(spec("80").local.port(), 80);
        assert_eq!(spec("0:80").local.port(), 0);
        assert_eq!(
            spec("0.0.0.0:9000:80").local,
            "0.0.0.0:9000".parse().unwrap()
        );
        assert_eq!(spec("[::1]:9000:80").local, "[::1]:9000".parse().unwrap());
        assert_eq!(
            spec("localhost:9000:80").local,
            "127.0.0.1:9000".parse().unwrap()
        );
        for bad in ["", "x", "80:0", "70000:80", "1.2.3:80:80", "80:http"] {
            assert!(parse_port_spec(bad).is_err(), "{bad}");
        }
    }
}
