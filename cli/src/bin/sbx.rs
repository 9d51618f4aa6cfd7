//! `sbx`: the command-line client of the sbx gateway.

fn main() -> std::process::ExitCode {
    sbx_cli::main()
}
