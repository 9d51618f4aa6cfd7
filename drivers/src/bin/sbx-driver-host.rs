//! `sbx-driver-host`: serves one in-tree compute driver over `sbx.driver.v1` on a Unix socket,
//! so that the gateway can run it out of process (and a chaos test can kill it).

use std::process::ExitCode;

use clap::Parser;
use sbx_drivers::remote::{DriverHostArgs, run_driver_host, termination_signal};

/// Serve a compute driver (process, vm or sim) over gRPC on a Unix socket until SIGTERM/SIGINT.
///
/// Workloads of the process and vm drivers outlive the host: kill it (even with SIGKILL) and
/// start a new one on the same --state-dir, and it finds every sandbox again. The sim backend keeps
/// everything in memory: a killed sim host loses all its sandboxes.
///
/// Logs go to stderr; RUST_LOG sets their filter (default: info).
#[derive(Debug, Parser)]
#[command(name = "sbx-driver-host", version)]
struct Cli {
    #[command(flatten)]
    host: DriverHostArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // As sbxd serve's: a failed log write loses that line, never the call that logged.
        .log_internal_errors(false)
        .init();
    let cli = Cli::parse();
    let outcome = match termination_signal() {
        Ok(signal) => run_driver_host(cli.host, signal).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sbx-driver-host: {e}");
            ExitCode::FAILURE
        }
    }
}
