//! `muster`: the one binary of the muster GPU cluster orchestrator.
//!
//! Each subcommand lives in its own module and is dispatched from
//! [`cli::Command`]; today `muster sim alloc` (Protocol A of
//! `traces/README.md`) and `muster sim replay` (Protocols B and C). Errors
//! are reported as `error: ...` on stderr with a non-zero exit status.

mod bench;
mod cli;
mod cluster;
mod commands;
mod sim;

use clap::Parser;
use std::process::ExitCode;

/// mimalloc instead of the system allocator: the server's scheduling cycle
/// and state changes allocate many small objects, where glibc's malloc spent
/// a third of the time (docs/benchmarks.md, "One scheduling cycle").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option (`mi_option_purge_delay` in its
/// `mimalloc.h`, 15th of `mi_option_e`, counted from 0); not among the
/// crate's named constants.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// mimalloc's own default for it, in ms: what the option reads unless
/// `MIMALLOC_PURGE_DELAY` set it (or the option moved in another version).
const MI_DEFAULT_PURGE_DELAY_MS: std::ffi::c_long = 10;

/// Freed memory is given back to the system after a second rather than
/// 10 ms: a scheduling cycle over a million pending jobs frees and takes
/// back some hundred MiB each time, and each page taken back from the
/// system is faulted in and zeroed again (a third of the first cycle at
/// 32,768 nodes, docs/benchmarks.md). Left alone when the option does not
/// read mimalloc's default (set by `MIMALLOC_PURGE_DELAY`, or another
/// option in another mimalloc).
#[allow(unsafe_code)]
fn keep_freed_memory_a_while() {
    // SAFETY: mimalloc's option calls take and return plain integers; they
    // run here before any thread of ours is started.
    unsafe {
        if libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) == MI_DEFAULT_PURGE_DELAY_MS {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 1_000);
        }
    }
}

fn main() -> ExitCode {
    // `muster supervise STATE_DIR KEY`: a task's supervisor, started by the
    // agent by absolute path for each task. Dispatched before the CLI is
    // built: it is started once per task and must be small and quick.
    let mut args = std::env::args();
    match args.nth(1).as_deref() {
        Some("supervise") => {
            let rest: Vec<String> = args.collect();
            let code = muster_agent::supervise::main(&rest);
            return ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
        // `muster task-init --probe`: whether tasks can have namespaces of
        // their own here, asked by the agent at start (see
        // muster_agent::taskinit).
        Some("task-init") => {
            let rest: Vec<String> = args.collect();
            let code = muster_agent::taskinit::entry(&rest);
            return ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
        // `muster check-exec ...`: a service's command check, started by
        // the agent (see muster_agent::checks).
        Some("check-exec") => {
            let rest: Vec<String> = args.collect();
            let code = muster_agent::checks::exec_main(&rest);
            return ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
        // `muster dev-session`: a dev environment's task (see
        // muster_agent::devsession), started by its supervisor.
        Some("dev-session") => {
            let rest: Vec<String> = args.collect();
            let code = muster_agent::devsession::main(&rest);
            return ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
        // `muster container-task ...`: a container task's helper, started
        // by its supervisor (see muster_agent::container).
        Some("container-task") => {
            let rest: Vec<String> = args.collect();
            let code = muster_agent::container::main(&rest);
            return ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
        _ => {}
    }
    keep_freed_memory_a_while();
    let cli = cli::Cli::parse();
    let status: Result<u8, commands::Failure> = match cli.command {
        cli::Command::Sim(args) => sim::run(args).map(|()| 0).map_err(Into::into),
        cli::Command::Bench(args) => bench::run(args).map(|()| 0).map_err(Into::into),
        cli::Command::Up(args) => cluster::up(args).map(|()| 0).map_err(Into::into),
        cli::Command::Server(args) => cluster::server(args).map(|()| 0).map_err(Into::into),
        cli::Command::Agent(args) => cluster::agent(args).map(|()| 0).map_err(Into::into),
        cli::Command::Gateway(args) => cluster::gateway(args).map(|()| 0).map_err(Into::into),
        cli::Command::Run(args) => commands::run(args),
        cli::Command::Submit(args) => commands::submit(args),
        cli::Command::Sbatch(args) => commands::sbatch(args),
        cli::Command::Fleet(args) => commands::fleet(args),
        cli::Command::Ps(args) => commands::ps(args),
        cli::Command::Describe(args) => commands::describe(args),
        cli::Command::Logs(args) => commands::logs(args),
        cli::Command::Cancel(args) => commands::cancel(args),
        cli::Command::Nodes(args) => commands::nodes(args),
        cli::Command::Cordon(args) => commands::node_action(args, "cordon"),
        cli::Command::Uncordon(args) => commands::node_action(args, "uncordon"),
        cli::Command::Drain(args) => commands::node_action(args, "drain"),
        cli::Command::Queues(args) => commands::queues(args),
        cli::Command::Cost(args) => commands::cost(args),
        cli::Command::History(args) => commands::history(args),
        cli::Command::Top(args) => commands::top(args),
        cli::Command::Users(args) => commands::users(args),
        cli::Command::Login(args) => commands::login(args),
        cli::Command::Audit(args) => commands::audit(args),
        cli::Command::Secrets(args) => commands::secrets(args),
        cli::Command::Services(args) => commands::services(args),
        cli::Command::Dev(args) => commands::dev(args),
        cli::Command::Prices(args) => commands::prices(args),
        cli::Command::Pools(args) => commands::pools(args),
        cli::Command::Completions { shell } => {
            let mut command = <cli::Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut command, "muster", &mut std::io::stdout());
            Ok(0)
        }
    };
    match status {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            eprintln!("error: {:#}", failure.error);
            ExitCode::from(failure.code)
        }
    }
}
