//! `muster dev`: interactive environments (start, list, shell, forward,
//! stop). An environment is a job running muster's session helper in the
//! user's working directory; shells and forwarded ports reach it through
//! the server and the node's agent (docs/services.md).

use super::{Connection, Failure, ago, exit, print_json, runtime, table, write_out};
use anyhow::{Context, anyhow};
use clap::Args;
use muster_api::client::Client;
use muster_api::protocol::DevView;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Args)]
pub struct DevArgs {
    #[command(subcommand)]
    pub command: Option<DevCommand>,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Debug, clap::Subcommand)]
pub enum DevCommand {
    /// Start an environment in this directory (it must be on the nodes
    /// too, e.g. a shared file system) and wait until it runs.
    Start {
        name: String,
        /// GPUs: a whole number, or a share of one such as 0.5.
        #[arg(long, default_value = "0")]
        gpus: String,
        #[arg(long)]
        cpus: Option<String>,
        /// Memory, e.g. 16GiB.
        #[arg(long)]
        memory: Option<String>,
        #[arg(long)]
        queue: Option<String>,
        #[arg(long)]
        pool: Option<String>,
        /// Run it in a container of this image (it needs a `sh`); with
        /// --pool, this directory is mounted at the same path (the pool's
        /// operator allows it with `muster pools set POOL --allow-mount
        /// DIR`).
        #[arg(long)]
        image: Option<String>,
        /// Stop it once its GPUs have been idle (below 5%) this long; a
        /// warning shows in `muster dev list` and in its shells first.
        #[arg(long, value_name = "DURATION", default_value = "2h")]
        idle: String,
        /// Stop it at the latest this long after it starts.
        #[arg(long, value_name = "DURATION", default_value = "24h")]
        max_lifetime: String,
        /// Environment variables (NAME=VALUE), repeatable.
        #[arg(long = "env", short = 'e', value_name = "NAME=VALUE")]
        env: Vec<String>,
        /// Return once submitted, without waiting for it to run.
        #[arg(long)]
        no_wait: bool,
    },
    /// List environments: state, node, idle time, warnings.
    List,
    /// Open a shell in an environment.
    Shell { name: String },
    /// Forward a local port to a port in an environment (Jupyter, a web
    /// UI): connections to --local reach `PORT` inside it.
    Forward {
        name: String,
        port: u16,
        /// Where to listen here (default: 127.0.0.1 and the same port).
        #[arg(long, value_name = "ADDRESS:PORT")]
        local: Option<std::net::SocketAddr>,
    },
    /// Stop an environment.
    Stop { name: String },
}

fn find(rt: &tokio::runtime::Runtime, client: &Client, name: &str) -> Result<DevView, Failure> {
    let list = rt
        .block_on(client.dev_environments())
        .map_err(anyhow::Error::from)?;
    list.environments
        .into_iter()
        .find(|env| env.name == name && !is_final(&env.state))
        .ok_or_else(|| Failure {
            code: exit::NOT_FOUND,
            error: anyhow!("no dev environment {name}; `muster dev list` lists them"),
        })
}

fn is_final(state: &str) -> bool {
    !matches!(state, "pending" | "running" | "stopping")
}

pub fn dev(args: DevArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let rt = runtime()?;
    let json = args.connection.json;
    match args.command.unwrap_or(DevCommand::List) {
        DevCommand::Start {
            name,
            gpus,
            cpus,
            memory,
            queue,
            pool,
            image,
            idle,
            max_lifetime,
            env,
            no_wait,
        } => {
            if find(&rt, &client, &name).is_ok() {
                return Err(Failure {
                    code: exit::INVALID,
                    error: anyhow!(
                        "dev environment {name} exists; `muster dev shell {name}`, or `muster dev \
                         stop {name}` first"
                    ),
                });
            }
            let dir = std::env::current_dir().context("cannot read the current directory")?;
            let dir = dir
                .to_str()
                .ok_or_else(|| anyhow!("the current directory is not UTF-8: {}", dir.display()))?;
            let mut spec = serde_json::json!({
                "name": name,
                "gpus": gpus,
                "command": [muster_model::DEV_SESSION_COMMAND],
                "working_dir": dir,
                "idle_timeout": idle,
                "max_runtime": max_lifetime,
                // An environment is someone's work in progress.
                "preemptible": false,
            });
            let mut variables = serde_json::Map::new();
            for pair in &env {
                let (key, value) = pair.split_once('=').ok_or_else(|| Failure {
                    code: exit::INVALID,
                    error: anyhow!("-e takes NAME=VALUE, got {pair:?}"),
                })?;
                variables.insert(key.to_string(), value.into());
            }
            if !variables.is_empty() {
                spec["env"] = serde_json::Value::Object(variables);
            }
            if let Some(image) = &image {
                spec["image"] = image.clone().into();
                if pool.is_some() {
                    spec["mounts"] = serde_json::json!([{"source": dir, "target": dir}]);
                } else {
                    if let Some(spec) = spec.as_object_mut() {
                        spec.remove("working_dir");
                    }
                    eprintln!(
                        "note: {dir} is not mounted in the container; name the pool (--pool \
                         POOL) whose operator allows it (`muster pools set POOL --allow-mount \
                         {dir}`) to have it there"
                    );
                }
            }
            for (key, value) in [
                ("cpus", cpus),
                ("memory", memory),
                ("queue", queue),
                ("pool", pool),
            ] {
                if let Some(value) = value {
                    spec[key] = value.into();
                }
            }
            muster_api::parse_job_spec_value(&spec).map_err(|errors| Failure {
                code: exit::INVALID,
                error: anyhow!("invalid option:\n{errors}"),
            })?;
            let job = rt
                .block_on(client.submit(spec))
                .map_err(anyhow::Error::from)?;
            if json && no_wait {
                print_json(&serde_json::json!({"name": name, "job": job}))?;
                return Ok(0);
            }
            if !json {
                eprintln!("dev environment {name}: job {job}, in {dir}");
            }
            if no_wait {
                return Ok(0);
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(600);
            let mut told = String::new();
            loop {
                let view = rt.block_on(client.job(job)).map_err(anyhow::Error::from)?;
                let task_runs = view.tasks.iter().any(|task| task.state == "running");
                match view.state.as_str() {
                    "running" if !task_runs => {}
                    "running" => {
                        let node = view
                            .tasks
                            .first()
                            .map(|task| task.node.clone())
                            .unwrap_or_default();
                        if json {
                            print_json(
                                &serde_json::json!({"name": name, "job": job, "node": node}),
                            )?;
                        } else {
                            outln!(
                                "dev environment {name} runs on {node}: `muster dev shell {name}`, \
                                 `muster dev forward {name} PORT`"
                            );
                        }
                        return Ok(0);
                    }
                    "pending" => {
                        let why = view.pending_reason.unwrap_or_default();
                        if !why.is_empty() && why != told && !json {
                            eprintln!("waiting: {why}");
                            told = why;
                        }
                    }
                    other => {
                        return Err(Failure {
                            code: exit::FAILURE,
                            error: anyhow!(
                                "dev environment {name} (job {job}) is {other}; `muster logs {job}`"
                            ),
                        });
                    }
                }
                if std::time::Instant::now() > deadline {
                    return Err(anyhow!(
                        "dev environment {name} (job {job}) is still pending after 10 minutes; \
                         it stays queued (`muster dev list`)"
                    )
                    .into());
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        }
        DevCommand::List => {
            let list = rt
                .block_on(client.dev_environments())
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&list)?;
                return Ok(0);
            }
            table(
                &[
                    "NAME", "JOB", "STATE", "NODE", "GPUS", "AGE", "IDLE", "WARNING",
                ],
                list.environments
                    .iter()
                    .filter(|env| !is_final(&env.state))
                    .map(|env| {
                        vec![
                            env.name.clone(),
                            env.job.to_string(),
                            env.state.clone(),
                            env.node.clone().unwrap_or_default(),
                            format!("{}", env.gpus),
                            env.started_ms.map(ago).unwrap_or_default(),
                            match (env.idle_for_s, env.idle_limit_s) {
                                (Some(idle), Some(limit)) => format!("{idle}s of {limit}s"),
                                (Some(idle), None) => format!("{idle}s"),
                                _ => String::new(),
                            },
                            env.warning.clone().unwrap_or_default(),
                        ]
                    })
                    .collect(),
            );
            Ok(0)
        }
        DevCommand::Stop { name } => {
            let env = find(&rt, &client, &name)?;
            rt.block_on(client.cancel(env.job))
                .map_err(anyhow::Error::from)?;
            outln!("dev environment {name} (job {}) stops", env.job);
            Ok(0)
        }
        DevCommand::Shell { name } => {
            let env = find(&rt, &client, &name)?;
            let code = rt.block_on(shell(&client, &name, env.job));
            // A read of standard input may still wait in the runtime's
            // blocking pool: do not wait for it.
            rt.shutdown_background();
            code
        }
        DevCommand::Forward { name, port, local } => {
            find(&rt, &client, &name)?;
            let local = local.unwrap_or_else(|| std::net::SocketAddr::from(([127, 0, 0, 1], port)));
            rt.block_on(forward(client, name, port, local))
        }
    }
}

/// Reads the session's first line (`ok`, or `refused: why`).
async fn answer(stream: &mut reqwest::Upgraded) -> Result<(), Failure> {
    let mut line = Vec::new();
    loop {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut byte))
            .await
            .map_err(|_| anyhow!("the environment did not answer within 30 s"))?
            .context("the connection to the environment broke")?;
        if read == 0 {
            return Err(anyhow!("the environment closed the connection").into());
        }
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
        if line.len() > 4096 {
            return Err(anyhow!("the environment's answer is too long").into());
        }
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    if line == "ok" {
        return Ok(());
    }
    Err(Failure {
        code: exit::FAILURE,
        error: anyhow!("{}", line.strip_prefix("refused: ").unwrap_or(&line)),
    })
}

/// Restores the terminal when dropped.
struct RawMode(bool);

impl Drop for RawMode {
    fn drop(&mut self) {
        if self.0 {
            let _ = ratatui::crossterm::terminal::disable_raw_mode();
        }
    }
}

async fn shell(client: &Client, name: &str, job: u64) -> Result<u8, Failure> {
    let (cols, rows) = ratatui::crossterm::terminal::size().unwrap_or((80, 24));
    let term = std::env::var("TERM").unwrap_or_else(|_| "xterm-256color".to_string());
    let term: String = term
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(63)
        .collect();
    let query = format!("kind=shell&rows={rows}&cols={cols}&term={term}");
    let mut stream = client
        .connect_dev(name, &query)
        .await
        .map_err(anyhow::Error::from)?;
    answer(&mut stream).await?;
    let interactive = std::io::IsTerminal::is_terminal(&std::io::stdin());
    let _raw = RawMode(interactive && ratatui::crossterm::terminal::enable_raw_mode().is_ok());
    let (mut from, mut to) = tokio::io::split(stream);
    let output = async {
        let mut stdout = tokio::io::stdout();
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => {
                    if stdout.write_all(&buffer[..read]).await.is_err() {
                        return;
                    }
                    let _ = stdout.flush().await;
                }
            }
        }
    };
    let input = async {
        let mut stdin = tokio::io::stdin();
        let mut buffer = vec![0u8; 4096];
        loop {
            match stdin.read(&mut buffer).await {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    // The shell may still be writing: wait for the output.
                    std::future::pending::<()>().await;
                }
                Ok(read) => {
                    if to.write_all(&buffer[..read]).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    // Idle reclaim and lifetime warnings, in the shell.
    let warnings = async {
        let mut told: Option<String> = None;
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let Ok(list) = client.dev_environments().await else {
                continue;
            };
            let warning = list
                .environments
                .into_iter()
                .find(|env| env.job == job)
                .and_then(|env| env.warning);
            if let Some(warning) = &warning
                && told.as_ref() != Some(warning)
            {
                eprint!("\r\n[muster] dev environment {name}: {warning}\r\n");
            }
            told = warning;
        }
    };
    tokio::select! {
        _ = output => {}
        _ = input => {}
        _ = warnings => {}
    }
    Ok(0)
}

async fn forward(
    client: Client,
    name: String,
    port: u16,
    local: std::net::SocketAddr,
) -> Result<u8, Failure> {
    let listener = tokio::net::TcpListener::bind(local)
        .await
        .with_context(|| format!("cannot listen on {local}"))?;
    eprintln!(
        "forwarding {} to port {port} of dev environment {name} (Ctrl-C stops)",
        listener.local_addr().map_or(local, |addr| addr)
    );
    loop {
        let (mut connection, _) = tokio::select! {
            accepted = listener.accept() => accepted.context("accept failed")?,
            _ = tokio::signal::ctrl_c() => return Ok(0),
        };
        let client = client.clone();
        let name = name.clone();
        tokio::spawn(async move {
            let query = format!("kind=forward&port={port}");
            let mut stream = match client.connect_dev(&name, &query).await {
                Ok(stream) => stream,
                Err(error) => {
                    eprintln!("a connection could not be forwarded: {error}");
                    return;
                }
            };
            if let Err(failure) = answer(&mut stream).await {
                eprintln!("a connection could not be forwarded: {:#}", failure.error);
                return;
            }
            let _ = tokio::io::copy_bidirectional(&mut connection, &mut stream).await;
        });
    }
}
