//! The command line: one `Command` per subcommand.

use clap::{Args, Parser, Subcommand};
use muster_sim::NamedPolicy;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "muster",
    version,
    about = "A GPU cluster orchestrator: server, agent, simulator and CLI in one binary"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay traces through the scheduler and compare placement policies.
    Sim(SimArgs),
}

#[derive(Debug, Args)]
pub struct SimArgs {
    #[command(subcommand)]
    pub command: SimCommand,
}

#[derive(Debug, Subcommand)]
pub enum SimCommand {
    /// Allocation under load (traces/README.md, protocol A): tasks arrive
    /// until 130% of the GPU capacity is asked, each placed at once or
    /// dropped; reports the GPU allocation ratio per policy.
    Alloc(AllocArgs),
}

#[derive(Debug, Args)]
pub struct AllocArgs {
    /// Node list (openb format: sn,cpu_milli,memory_mib,gpu,model).
    #[arg(
        long,
        value_name = "FILE",
        default_value = "../shared/traces/openb/openb_node_list_gpu_node.csv"
    )]
    pub nodes: PathBuf,

    /// Pod list (openb format: name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]).
    #[arg(
        long,
        value_name = "FILE",
        default_value = "../shared/traces/openb/openb_pod_list_default.csv"
    )]
    pub tasks: PathBuf,

    /// Placement policies to compare, comma-separated.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "fgd,best-fit,packing,random,default"
    )]
    pub policies: Vec<NamedPolicy>,

    /// Number of seeds (0, 1, ... N-1); results are medians over seeds.
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub seeds: u64,

    /// Simulations run at once (default: the number of cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub jobs: Option<u64>,

    /// Output folder for results.json and alloc.svg (created if missing).
    #[arg(long, value_name = "DIR", default_value = "out/alloc")]
    pub out: PathBuf,
}
