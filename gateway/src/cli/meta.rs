//! `sbx version` and `sbx completion`: what the CLI says about itself.
//!
//! The sbx.v1 API has no call that reports the gateway's version or its default driver, so
//! `sbx version` says what it can learn, whether the gateway answers its health service
//! (within about 2 s), and says in so many words that the rest is not reported, rather than
//! guessing.

use std::io::Write;

use clap::CommandFactory;
use serde::Serialize;

use super::output::render_structured;
use super::{Cli, CliError, CompletionArgs, OutputFormat, VersionArgs};

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
    /// The gateway's version; `None`: the API does not report it.
    pub version: Option<String>,
    /// The gateway's default driver; `None`: the API does not report it.
    pub default_driver: Option<String>,
}

/// The client's version, the version of this crate (the workspace version).
pub const CLIENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// What the gateway at `endpoint` told us: `health` is the outcome of one health check.
pub fn version_view(endpoint: &str, health: Result<(), String>) -> VersionView {
    let (reachable, error) = match health {
        Ok(()) => (true, String::new()),
        Err(cause) => (false, cause),
    };
    VersionView {
        client: ClientVersion {
            version: CLIENT_VERSION.to_string(),
        },
        server: ServerVersion {
            endpoint: endpoint.to_string(),
            reachable,
            error,
            version: None,
            default_driver: None,
        },
    }
}

/// Text for humans, one `Key: value` line each.
pub fn render_version(format: OutputFormat, view: &VersionView) -> Result<String, CliError> {
    if !matches!(format, OutputFormat::Json | OutputFormat::Yaml) {
        let server = &view.server;
        let not_reported = "not reported by the gateway (the sbx.v1 API has no version call)";
        let mut out = format!("Client Version: {}\n", view.client.version);
        if server.reachable {
            out.push_str(&format!("Server: {} (serving)\n", server.endpoint));
            out.push_str(&format!(
                "Server Version: {}\n",
                server.version.as_deref().unwrap_or(not_reported)
            ));
            out.push_str(&format!(
                "Default Driver: {}\n",
                server.default_driver.as_deref().unwrap_or(not_reported)
            ));
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

/// `sbx version`: always exits 0 with the client's version, also when no gateway answers.
pub async fn run_version(endpoint: &str, args: &VersionArgs) -> Result<u8, CliError> {
    let normalized = super::run::normalize_endpoint(endpoint);
    let health = super::wait::health(&normalized).await;
    super::run::print(&render_version(
        args.output.format,
        &version_view(&normalized, health),
    )?)?;
    Ok(0)
}

/// `sbx completion SHELL`: the shell's completion script on stdout.
pub fn run_completion(args: &CompletionArgs) -> Result<u8, CliError> {
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut Cli::command(), "sbx", &mut script);
    let mut out = std::io::stdout().lock();
    out.write_all(&script)?;
    out.flush()?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_says_what_the_gateway_does_not_report() {
        let text = render_version(
            OutputFormat::Table,
            &version_view("http://127.0.0.1:1", Ok(())),
        )
        .unwrap();
        assert_eq!(
            text,
            format!(
                "Client Version: {CLIENT_VERSION}\nServer: http://127.0.0.1:1 (serving)\n\
                 Server Version: not reported by the gateway (the sbx.v1 API has no version \
                 call)\nDefault Driver: not reported by the gateway (the sbx.v1 API has no \
                 version call)\n"
            )
        );
        let down = version_view("http://127.0.0.1:1", Err("connection refused".into()));
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
