//! `sbx completion SHELL`: the shell's completion script, made by clap from the whole command
//! line ([`crate::Cli`]).

use std::io::Write;

use clap::{Args, CommandFactory};

use crate::{Cli, CliError};

/// `sbx completion`.
#[derive(Debug, Clone, Args)]
pub struct CompletionArgs {
    /// The shell to write the script for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
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
