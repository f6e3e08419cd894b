//! `muster sim`: trace replays and fault injection over the pure simulator
//! (`muster-sim`). This shell reads the files, runs seeds on threads, prints
//! and writes results.

mod alloc;
mod faults;
mod mix;
mod plot;
mod replay;
mod services;

use crate::cli::{SimArgs, SimCommand};
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A progress bar on stderr, hidden when stderr is not a terminal.
fn progress_bar(len: usize, template: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    let style =
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.enable_steady_tick(std::time::Duration::from_millis(500));
    bar
}

/// Runs `run` on every item on `threads` threads, each taking the next item
/// when it is free; results come back in `items` order. `progress` advances
/// once per item.
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    progress: &ProgressBar,
    run: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let mut slots: Vec<Option<R>> = (0..items.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(index) else {
                            break;
                        };
                        done.push((index, run(item)));
                        progress.inc(1);
                    }
                    done
                })
            })
            .collect();
        for worker in workers {
            match worker.join() {
                Ok(done) => {
                    for (index, result) in done {
                        slots[index] = Some(result);
                    }
                }
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    progress.finish_and_clear();
    slots.into_iter().flatten().collect()
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    match args.command {
        SimCommand::Alloc(args) => alloc::run(&args),
        SimCommand::Replay(args) => replay::run(&args),
        SimCommand::Faults(args) => faults::run(&args),
        SimCommand::Mix(args) => mix::run(&args),
        SimCommand::Services(args) => services::run(&args),
    }
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// Reads and parses an openb node list.
fn read_openb_nodes(path: &Path) -> anyhow::Result<Vec<muster_sched::NodeInput>> {
    Ok(muster_sim::parse_openb_nodes(
        &read(path)?,
        &path.display().to_string(),
    )?)
}

/// Reads and parses an openb pod list.
fn read_openb_tasks(path: &Path) -> anyhow::Result<Vec<muster_sim::TraceTask>> {
    Ok(muster_sim::parse_openb_tasks(
        &read(path)?,
        &path.display().to_string(),
    )?)
}

/// The last component of `path`, for reports.
fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |name| name.to_string_lossy().into_owned(),
    )
}
