//! `muster history export`: the cluster's finished jobs as a job list that
//! `muster sim replay --format muster` replays (what-if on one's own
//! history).

use super::cost::csv_field;
use super::{Connection, Failure, runtime};
use anyhow::Context;
use clap::{Args, Subcommand};
use muster_api::client::JobFilter;
use std::io::Write;

#[derive(Debug, Args)]
pub struct HistoryArgs {
    #[command(subcommand)]
    pub command: HistoryCommand,
}

#[derive(Debug, Subcommand)]
pub enum HistoryCommand {
    /// Jobs that ran and ended in the window, one CSV row each (submitted,
    /// started and finished times in ms, nodes, GPUs per node, queue, user,
    /// state), oldest first: `muster history export --since 30d > jobs.csv`,
    /// then `muster sim replay --trace jobs.csv --format muster`.
    Export {
        /// How far back a job may have ended (30d, 12h).
        #[arg(long, default_value = "30d", value_parser = crate::cli::parse_duration_s)]
        since: u64,
        #[command(flatten)]
        connection: Connection,
    },
}

pub fn history(args: HistoryArgs) -> Result<u8, Failure> {
    match args.command {
        HistoryCommand::Export { since, connection } => {
            let client = connection.client()?;
            let filter = JobFilter {
                state: Some("succeeded,failed,cancelled,timed_out,idle_stopped".to_string()),
                ..JobFilter::default()
            };
            let (jobs, _) = runtime()?
                .block_on(client.all_jobs(&filter, None))
                .map_err(anyhow::Error::from)?;
            let from = super::now_ms().saturating_sub(since.saturating_mul(1000));
            let mut rows: Vec<_> = jobs
                .iter()
                .filter_map(|job| {
                    let started = job.started_ms?;
                    let finished = job.finished_ms?;
                    (finished >= from && started >= job.submitted_ms && finished >= started)
                        .then_some((job, started, finished))
                })
                .collect();
            rows.sort_by_key(|(job, _, _)| (job.submitted_ms, job.id));
            let mut text = format!("{}\n", muster_sim::MUSTER_HISTORY_HEADER);
            for (job, started, finished) in &rows {
                text.push_str(&format!(
                    "{},{},{},{},{},{},{},{},{}\n",
                    job.id,
                    job.submitted_ms,
                    started,
                    finished,
                    job.nodes.max(1),
                    job.gpus_per_node,
                    csv_field(&job.queue),
                    csv_field(&job.user),
                    job.state
                ));
            }
            // Not `write_bytes`: an export cut short (a full disk) must fail.
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes())
                .and_then(|()| out.flush())
                .context("cannot write the job list")?;
            eprintln!("{} jobs", rows.len());
            Ok(0)
        }
    }
}
