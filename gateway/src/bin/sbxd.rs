//! `sbxd`: the sbx gateway daemon.

fn main() -> std::process::ExitCode {
    sbx_gateway::daemon::main()
}
