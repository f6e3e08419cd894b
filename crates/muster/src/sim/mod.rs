//! `muster sim`: trace replays and fault injection over the pure simulator
//! (`muster-sim`). This shell reads the files, runs seeds on threads, prints
//! and writes results.

mod alloc;
mod faults;
mod plot;
mod replay;

use crate::cli::{SimArgs, SimCommand};

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    match args.command {
        SimCommand::Alloc(args) => alloc::run(&args),
        SimCommand::Replay(args) => replay::run(&args),
        SimCommand::Faults(args) => faults::run(&args),
    }
}
