//! `sbx version` prints the client's version, then asks the gateway (health, then
//! `GatewayService.GetGatewayInfo`, within about 2 s each) for its version, its default
//! driver and what each driver can do. A gateway that does not answer is said to be
//! unreachable, with why; the command still exits 0 with the client's version.

use clap::Args;
use serde::Serialize;

use crate::CliError;
use crate::connect::Target;
use crate::output::{OutputArgs, OutputFormat, render_structured};

/// `sbx version`.
#[derive(Debug, Clone, Args)]
pub struct VersionArgs {
    #[command(flatten)]
    pub output: OutputArgs,
}

/// What `sbx version -o json|yaml` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VersionView {
    pub client: ClientVersion,
    pub server: ServerVersion,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClientVersion {
    pub version: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServerVersion {
    pub endpoint: String,
    pub reachable: bool,
    /// Why the gateway is not reachable (empty when it is).
    pub error: String,
    /// The gateway's version; `None`: not known (unreachable, or an older gateway).
    pub version: Option<String>,
    /// The gateway's default driver; `None`: not known.
    pub default_driver: Option<String>,
    /// Every driver of the gateway and what it can do.
    pub drivers: Vec<DriverView>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DriverView {
    pub name: String,
    pub kind: String,
    pub isolation: String,
    /// What exec and its neighbours can do on it: "stdin", "tty", "cp", "cp-when-stopped",
    /// "port-forward", "images", "pause".
    pub features: Vec<String>,
    /// Why its capabilities are unknown, or empty.
    pub error: String,
}

impl DriverView {
    fn from_info(d: sbx_proto::v1::DriverInfo) -> DriverView {
        let features = [
            (d.exec_stdin, "stdin"),
            (d.exec_tty, "tty"),
            (d.copy, "cp"),
            (d.copy_when_stopped, "cp-when-stopped"),
            (d.port_forward, "port-forward"),
            (d.images, "images"),
            (d.pause, "pause"),
        ]
        .iter()
        .filter(|(has, _)| *has)
        .map(|(_, name)| name.to_string())
        .collect();
        DriverView {
            name: d.name,
            kind: d.kind,
            isolation: d.isolation,
            features,
            error: d.error,
        }
    }
}

/// The client's version, the version of this crate (the workspace version).
pub const CLIENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// What the gateway at `endpoint` told us: `health` is the outcome of one health check,
/// `info` its answer to GetGatewayInfo (an error from an older gateway leaves the server's
/// fields unknown, and says so).
pub fn version_view(
    endpoint: &str,
    health: Result<(), String>,
    info: Option<Result<sbx_proto::v1::GatewayInfo, String>>,
) -> VersionView {
    let (reachable, mut error) = match health {
        Ok(()) => (true, String::new()),
        Err(cause) => (false, cause),
    };
    let (version, default_driver, drivers) = match info {
        Some(Ok(info)) => (
            Some(info.version),
            Some(info.default_driver),
            info.drivers
                .into_iter()
                .map(DriverView::from_info)
                .collect(),
        ),
        Some(Err(why)) => {
            error = why;
            (None, None, Vec::new())
        }
        None => (None, None, Vec::new()),
    };
    VersionView {
        client: ClientVersion {
            version: CLIENT_VERSION.to_string(),
        },
        server: ServerVersion {
            endpoint: endpoint.to_string(),
            reachable,
            error,
            version,
            default_driver,
            drivers,
        },
    }
}

/// Text for humans, one `Key: value` line each.
pub fn render_version(format: OutputFormat, view: &VersionView) -> Result<String, CliError> {
    if !matches!(format, OutputFormat::Json | OutputFormat::Yaml) {
        let server = &view.server;
        let unknown = format!("not reported by the gateway ({})", server.error);
        let mut out = format!("Client Version: {}\n", view.client.version);
        if server.reachable {
            out.push_str(&format!("Server: {} (serving)\n", server.endpoint));
            out.push_str(&format!(
                "Server Version: {}\n",
                server.version.as_deref().unwrap_or(&unknown)
            ));
            out.push_str(&format!(
                "Default Driver: {}\n",
                server.default_driver.as_deref().unwrap_or(&unknown)
            ));
            for d in &server.drivers {
                if d.error.is_empty() {
                    out.push_str(&format!(
                        "Driver {}: {} ({}); {}\n",
                        d.name,
                        d.kind,
                        if d.features.is_empty() {
                            "exec only".to_string()
                        } else {
                            format!("exec with {}", d.features.join(", "))
                        },
                        d.isolation
                    ));
                } else {
                    out.push_str(&format!("Driver {}: unknown ({})\n", d.name, d.error));
                }
            }
        } else {
            out.push_str(&format!(
                "Server: not reachable at {}: {}\n",
                server.endpoint, server.error
            ));
        }
        return Ok(out);
    }
    render_structured(format, view)
}

/// `sbx version`: always exits 0 with the client's version, also when no gateway answers
/// (or it refuses the credential: that is said as the server's error).
pub async fn run_version(target: &Target, args: &VersionArgs) -> Result<u8, CliError> {
    let health = crate::wait::health(target).await;
    let info = match health {
        Ok(()) => Some(gateway_info(target).await),
        Err(_) => None,
    };
    let health = health.map_err(|e| e.to_string());
    crate::reply::print(&render_version(
        args.output.format,
        &version_view(&target.endpoint(), health, info),
    )?)?;
    Ok(0)
}

/// GetGatewayInfo, within about 2 s.
pub(crate) async fn gateway_info(target: &Target) -> Result<sbx_proto::v1::GatewayInfo, String> {
    use sbx_proto::v1::gateway_service_client::GatewayServiceClient;
    let call = async {
        let channel = crate::connect::connect(target)
            .await
            .map_err(|e| e.to_string())?;
        GatewayServiceClient::new(channel)
            .get_gateway_info(sbx_proto::v1::GetGatewayInfoRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| match s.code() {
                tonic::Code::Unimplemented => "an older gateway without GetGatewayInfo".into(),
                _ => crate::error::describe_status(&s, Some(target.address.transport())),
            })
    };
    tokio::time::timeout(std::time::Duration::from_secs(2), call)
        .await
        .unwrap_or_else(|_| Err("no answer within 2 s".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_says_what_the_gateway_reports_and_what_it_does_not() {
        let info = sbx_proto::v1::GatewayInfo {
            version: "9.9.9".into(),
            default_driver: "oci".into(),
            drivers: vec![
                sbx_proto::v1::DriverInfo {
                    name: "oci".into(),
                    kind: "oci".into(),
                    isolation: "OCI container".into(),
                    exec_stdin: true,
                    exec_tty: true,
                    copy: true,
                    port_forward: true,
                    images: true,
                    ..Default::default()
                },
                sbx_proto::v1::DriverInfo {
                    name: "slow".into(),
                    error: "no answer within 2 s".into(),
                    ..Default::default()
                },
            ],
        };
        let text = render_version(
            OutputFormat::Table,
            &version_view("http://127.0.0.1:1", Ok(()), Some(Ok(info))),
        )
        .unwrap();
        assert_eq!(
            text,
            format!(
                "Client Version: {CLIENT_VERSION}\nServer: http://127.0.0.1:1 (serving)\n\
                 Server Version: 9.9.9\nDefault Driver: oci\nDriver oci: oci (exec with stdin, \
                 tty, cp, port-forward, images); OCI container\nDriver slow: unknown (no \
                 answer within 2 s)\n"
            )
        );
        let old = version_view(
            "http://127.0.0.1:1",
            Ok(()),
            Some(Err("an older gateway without GetGatewayInfo".into())),
        );
        let text = render_version(OutputFormat::Table, &old).unwrap();
        assert!(
            text.contains("Server Version: not reported by the gateway (an older gateway"),
            "{text}"
        );
        let down = version_view("http://127.0.0.1:1", Err("connection refused".into()), None);
        let text = render_version(OutputFormat::Table, &down).unwrap();
        assert!(
            text.ends_with("Server: not reachable at http://127.0.0.1:1: connection refused\n"),
            "{text}"
        );
        let json: serde_json::Value =
            serde_json::from_str(&render_version(OutputFormat::Json, &down).unwrap()).unwrap();
        assert_eq!(json["client"]["version"], CLIENT_VERSION);
        assert_eq!(json["server"]["reachable"], false);
        assert_eq!(json["server"]["version"], serde_json::Value::Null);
    }
}
