//! `muster`: the one binary of the muster GPU cluster orchestrator.
//!
//! Each subcommand lives in its own module and is dispatched from
//! [`cli::Command`]; today `muster sim alloc` (Protocol A of
//! `traces/README.md`). Errors are reported as `error: ...` on stderr with a
//! non-zero exit status.

mod cli;
mod sim;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let result = match cli.command {
        cli::Command::Sim(args) => sim::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
