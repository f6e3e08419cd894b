//! `muster services`: create, update, scale, roll back, delete, list and
//! describe services (docs/services.md).

use super::{Connection, Failure, ago, exit, print_json, runtime, table, write_out};
use anyhow::{Context, anyhow};
use clap::Args;
use muster_api::protocol::ServiceView;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct ServicesArgs {
    #[command(subcommand)]
    pub command: Option<ServiceCommand>,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Debug, clap::Subcommand)]
pub enum ServiceCommand {
    /// Create a service from a spec (`kind: service`; `-` reads standard
    /// input).
    Create {
        #[arg(short = 'f', long = "file", value_name = "FILE")]
        file: PathBuf,
    },
    /// Change a service: a new command, image, environment or resources
    /// roll out one replica at a time (a new one ready before an old one
    /// stops); the count, checks and strategy apply at once.
    Update {
        #[arg(short = 'f', long = "file", value_name = "FILE")]
        file: PathBuf,
        /// Replicas above the count while updating (overrides the spec's).
        #[arg(long, value_name = "N")]
        max_surge: Option<u32>,
        /// Ready replicas below the count while updating (overrides the spec's).
        #[arg(long, value_name = "N")]
        max_unavailable: Option<u32>,
    },
    /// Set the number of replicas.
    Scale { name: String, replicas: u32 },
    /// Run an earlier revision again (default: the one before the current).
    Rollback {
        name: String,
        #[arg(long, value_name = "N")]
        revision: Option<u32>,
    },
    /// Delete a service: its replicas drain and stop.
    Delete { name: String },
    /// List services.
    List,
    /// Show a service: replicas, rollout, revisions, recent events.
    Describe { name: String },
    /// The ready replicas' addresses (`ADDRESS:PORT`, one a line).
    Endpoints { name: String },
}

fn read_spec(file: &Path) -> Result<muster_model::ServiceSpec, Failure> {
    let text = if file.as_os_str() == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
            .context("cannot read the service spec from standard input")?;
        text
    } else {
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?
    };
    muster_api::service::parse_service_spec_yaml(&text).map_err(|errors| Failure {
        code: exit::INVALID,
        error: anyhow!("{}: invalid service spec:\n{errors}", file.display()),
    })
}

pub fn services(args: ServicesArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let rt = runtime()?;
    let json = args.connection.json;
    let shown = match args.command.unwrap_or(ServiceCommand::List) {
        ServiceCommand::Create { file } => {
            let spec = read_spec(&file)?;
            let value = muster_api::service::service_spec_value(&spec);
            rt.block_on(client.create_service(value))
        }
        ServiceCommand::Update {
            file,
            max_surge,
            max_unavailable,
        } => {
            let mut spec = read_spec(&file)?;
            if let Some(surge) = max_surge {
                spec.update.max_surge = surge;
            }
            if let Some(unavailable) = max_unavailable {
                spec.update.max_unavailable = unavailable;
            }
            let value = muster_api::service::service_spec_value(&spec);
            // Checked again with the overrides.
            muster_api::service::parse_service_spec_value(&value).map_err(|errors| Failure {
                code: exit::INVALID,
                error: anyhow!("invalid option:\n{errors}"),
            })?;
            rt.block_on(client.update_service(&spec.name, value))
        }
        ServiceCommand::Scale { name, replicas } => {
            rt.block_on(client.scale_service(&name, replicas))
        }
        ServiceCommand::Rollback { name, revision } => {
            rt.block_on(client.rollback_service(&name, revision))
        }
        ServiceCommand::Delete { name } => rt.block_on(client.delete_service(&name)),
        ServiceCommand::Describe { name } => rt.block_on(client.service(&name)),
        ServiceCommand::Endpoints { name } => {
            let list = rt
                .block_on(client.service_endpoints(&name))
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&list)?;
            } else {
                for endpoint in &list.endpoints {
                    outln!("{}", endpoint.address);
                }
            }
            return Ok(0);
        }
        ServiceCommand::List => {
            let list = rt
                .block_on(client.services())
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&list)?;
            } else {
                table(
                    &[
                        "SERVICE",
                        "USER",
                        "QUEUE",
                        "READY",
                        "UP-TO-DATE",
                        "REVISION",
                        "STATUS",
                    ],
                    list.services
                        .iter()
                        .map(|service| {
                            vec![
                                service.name.clone(),
                                service.user.clone(),
                                service.queue.clone(),
                                format!("{}/{}", service.ready, service.replicas),
                                service.updated.to_string(),
                                service.revision.to_string(),
                                status_word(service),
                            ]
                        })
                        .collect(),
                );
            }
            return Ok(0);
        }
    }
    .map_err(anyhow::Error::from)?;
    if json {
        print_json(&shown)?;
    } else {
        describe(&shown);
    }
    Ok(0)
}

fn status_word(service: &ServiceView) -> String {
    if service.deleting {
        return "deleting".to_string();
    }
    match &service.rollout {
        Some(rollout) if rollout.contains("stopped") => "rollout stopped".to_string(),
        Some(_) => "rolling out".to_string(),
        None if service.backoff_until_ms.is_some() => "backing off".to_string(),
        None if service.ready < service.replicas => "starting".to_string(),
        None => "ready".to_string(),
    }
}

fn describe(service: &ServiceView) {
    outln!("service:   {}", service.name);
    outln!("user:      {} (queue {})", service.user, service.queue);
    outln!(
        "replicas:  {} asked, {} up, {} ready, {} of revision {}",
        service.replicas,
        service.current,
        service.ready,
        service.updated,
        service.revision
    );
    outln!("status:    {}", status_word(service));
    if let Some(autoscaling) = &service.autoscaling {
        outln!("autoscale: {autoscaling}");
    }
    if let Some(rollout) = &service.rollout {
        outln!("rollout:   {rollout}");
    }
    if let Some(until) = service.backoff_until_ms {
        let wait = until.saturating_sub(super::now_ms());
        outln!(
            "backoff:   replicas start again in {:.1}s",
            wait as f64 / 1000.0
        );
    }
    if let Some(failure) = &service.last_failure {
        outln!("last failure: {failure}");
    }
    outln!();
    table(
        &[
            "JOB",
            "REVISION",
            "STATE",
            "NODE",
            "ENDPOINT",
            "STARTED",
            "NOT READY BECAUSE",
        ],
        service
            .replica_list
            .iter()
            .map(|replica| {
                vec![
                    replica.job.to_string(),
                    replica.revision.to_string(),
                    replica.state.clone(),
                    replica.node.clone().unwrap_or_default(),
                    replica.endpoint.clone().unwrap_or_default(),
                    replica.started_ms.map(ago).unwrap_or_default(),
                    replica.not_ready.clone().unwrap_or_default(),
                ]
            })
            .collect(),
    );
    outln!();
    outln!("revisions:");
    for revision in &service.revisions {
        let mark = if revision.revision == service.revision {
            "*"
        } else {
            " "
        };
        outln!(
            " {mark} {:>3}  {:>6} ago  {}",
            revision.revision,
            ago(revision.created_ms),
            revision.runs
        );
    }
    if !service.events.is_empty() {
        outln!();
        outln!("events:");
        for event in &service.events {
            outln!("  {:>6} ago  {}", ago(event.at_ms), event.message);
        }
    }
}
