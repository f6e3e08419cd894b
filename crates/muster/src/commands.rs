//! The user commands: `run`, `submit`, `ps`, `describe`, `logs`, `cancel`,
//! `nodes`, `cordon`, `uncordon`, `drain`, `queues`, `queue set`. They talk
//! to the server through `muster_api::client`.

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use muster_api::client::{Client, ClientError, JobFilter};
use muster_api::protocol::{
    ErrorCode, JobView, NodeView, QueueUpdate, StartEstimate, StartEstimateKind,
};
use std::io::Write;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

/// Writes to standard output; a closed pipe (`muster ps | head`) ends the
/// program quietly instead of panicking.
pub(crate) fn write_out(args: std::fmt::Arguments<'_>) {
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = stdout.write_fmt(args).and_then(|()| stdout.flush())
        && error.kind() == std::io::ErrorKind::BrokenPipe
    {
        std::process::exit(0);
    }
}

/// Writes a task's output exactly as it is (bytes, not text).
pub(crate) fn write_bytes(bytes: &[u8]) {
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = stdout.write_all(bytes).and_then(|()| stdout.flush())
        && error.kind() == std::io::ErrorKind::BrokenPipe
    {
        std::process::exit(0);
    }
}

macro_rules! outln {
    () => { write_out(format_args!("\n")) };
    ($($arg:tt)*) => { write_out(format_args!("{}\n", format_args!($($arg)*))) };
}

mod cost;
mod dev;
mod history;
mod services;
mod tenants;
mod top;
pub use cost::{CostArgs, PricesArgs, cost, prices};
pub use dev::{DevArgs, dev};
pub use history::{HistoryArgs, history};
pub use services::{ServicesArgs, services};
pub use tenants::{AuditArgs, LoginArgs, SecretsArgs, UsersArgs, audit, login, secrets, users};
pub use top::{TopArgs, top};

/// Where the server is and how to authenticate.
#[derive(Debug, Clone, Args)]
pub struct Connection {
    /// Server URL (default: $MUSTER_SERVER, the config file, or
    /// https://127.0.0.1:7070); several separated by commas for servers
    /// sharing a PostgreSQL store (the next is tried when one is gone).
    #[arg(long, global = true, value_name = "URL")]
    pub server: Option<String>,
    /// A file holding the API token (default: $MUSTER_TOKEN_FILE,
    /// $MUSTER_TOKEN, the config file, or the token `muster up` wrote in
    /// its data directory). Prefer it to --token, whose value every process
    /// on the machine can read in /proc/PID/cmdline.
    #[arg(long, global = true, value_name = "PATH", conflicts_with = "token")]
    pub token_file: Option<PathBuf>,
    /// The API token itself (visible to every process on the machine while
    /// the command runs: use --token-file or $MUSTER_TOKEN instead).
    #[arg(long, global = true, value_name = "TOKEN")]
    pub token: Option<String>,
    /// The cluster CA's fingerprint (sha256:..., printed by `muster server`)
    /// to trust the server's certificate by (default: $MUSTER_CA_SHA256,
    /// the config file's, or $MUSTER_CA_FILE / the config's `ca_file` /
    /// the local server's CA).
    #[arg(long, global = true, value_name = "FINGERPRINT")]
    pub ca_sha256: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

/// The token a command was given, first found of: `--token`,
/// `--token-file`, `$MUSTER_TOKEN_FILE`, `$MUSTER_TOKEN` (what the user
/// wrote on the command line wins over the environment).
pub fn given_token(token: Option<&str>, file: Option<&std::path::Path>) -> Result<Option<String>> {
    if let Some(token) = token {
        return Ok(Some(token.to_string()));
    }
    let file = file
        .map(std::path::Path::to_path_buf)
        .or_else(|| std::env::var_os("MUSTER_TOKEN_FILE").map(PathBuf::from));
    match file {
        Some(file) => read_token_file(&file).map(Some),
        None => Ok(std::env::var("MUSTER_TOKEN").ok()),
    }
}

/// The token in `file` (surrounding white space taken off): an error that
/// names the file when it cannot be read or holds nothing.
pub fn read_token_file(file: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read the API token from {}", file.display()))?;
    let token = text.trim();
    if token.is_empty() {
        anyhow::bail!(
            "{} is empty; it should hold an API token (as `muster users add` printed it)",
            file.display()
        );
    }
    Ok(token.to_string())
}

#[cfg(test)]
mod token_file_tests {
    #[test]
    fn a_token_file_is_read_trimmed_and_an_empty_or_missing_one_is_named() {
        let dir = tempfile::tempdir().expect("a directory");
        let file = dir.path().join("admin.token");
        std::fs::write(&file, "  abc123\n").expect("written");
        assert_eq!(super::read_token_file(&file).expect("read"), "abc123");
        std::fs::write(&file, "\n").expect("written");
        let error = super::read_token_file(&file).unwrap_err().to_string();
        assert!(
            error.contains("is empty") && error.contains("admin.token"),
            "{error}"
        );
        let error = super::read_token_file(&dir.path().join("nope"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("cannot read the API token from"), "{error}");
    }
}

/// Exit codes, so scripts can tell failures apart.
pub mod exit {
    pub const FAILURE: u8 = 1;
    pub const NOT_FOUND: u8 = 3;
    pub const AUTH: u8 = 4;
    pub const UNAVAILABLE: u8 = 5;
    pub const INVALID: u8 = 6;
    /// `muster run`: the job reached its time limit (as `timeout(1)`).
    pub const TIMED_OUT: u8 = 124;
}

/// An error with the exit code it maps to.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub error: anyhow::Error,
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Self {
        let code = error
            .downcast_ref::<ClientError>()
            .map_or(exit::FAILURE, |e| match e {
                ClientError::Transport { .. } => exit::UNAVAILABLE,
                ClientError::Api { body, .. } => match body.code {
                    ErrorCode::NotFound => exit::NOT_FOUND,
                    ErrorCode::Unauthenticated | ErrorCode::PermissionDenied => exit::AUTH,
                    ErrorCode::InvalidArgument => exit::INVALID,
                    ErrorCode::Unavailable => exit::UNAVAILABLE,
                    _ => exit::FAILURE,
                },
                ClientError::Decode { .. } => exit::FAILURE,
            });
        Failure { code, error }
    }
}

/// The per-user data directory (`$MUSTER_DATA_DIR`, else
/// `$XDG_DATA_HOME/muster`, else `~/.local/share/muster`).
pub fn default_data_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MUSTER_DATA_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_DATA_HOME") {
        return PathBuf::from(dir).join("muster");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".local/share/muster")
}

/// The client config file (`$XDG_CONFIG_HOME/muster/config.json`, else
/// `~/.config/muster/config.json`): `{"server": URL, "token_file": PATH}`
/// or `{"server": URL, "token": TOKEN}`.
pub fn config_path() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_CONFIG_HOME") {
        return PathBuf::from(dir).join("muster/config.json");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".config/muster/config.json")
}

pub const DEFAULT_SERVER: &str = "https://127.0.0.1:7070";

/// What to trust the server's certificate by: a CA fingerprint, a CA file,
/// both, or neither (the system's roots).
pub fn trust_of(
    fingerprint: Option<&str>,
    ca_file: Option<&std::path::Path>,
) -> Result<muster_api::tls::Trust> {
    let ca_sha256 = fingerprint
        .map(|text| muster_api::tls::Fingerprint::parse(text).map_err(|e| anyhow!(e)))
        .transpose()?;
    let ca_pem = ca_file
        .map(|path| {
            std::fs::read(path)
                .with_context(|| format!("cannot read the CA file {}", path.display()))
        })
        .transpose()?;
    Ok(muster_api::tls::Trust { ca_pem, ca_sha256 })
}

impl Connection {
    pub fn client(&self) -> Result<Client> {
        let config: serde_json::Value = std::fs::read_to_string(config_path())
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok())
            .unwrap_or_default();
        let server = self
            .server
            .clone()
            .or_else(|| std::env::var("MUSTER_SERVER").ok())
            .or_else(|| config["server"].as_str().map(str::to_string))
            .unwrap_or_else(|| DEFAULT_SERVER.to_string());
        let given = match given_token(self.token.as_deref(), self.token_file.as_deref())? {
            Some(token) => Some(token),
            None => config["token"].as_str().map(str::to_string),
        };
        // The admin token from a file (`muster up`'s) submits as the login
        // user; a user's own token is its user's, and says nothing more.
        let from_admin_file = given.is_none();
        let token = match given {
            Some(token) => token,
            None => {
                let file = config["token_file"]
                    .as_str()
                    .map_or_else(|| default_data_dir().join("admin.token"), PathBuf::from);
                std::fs::read_to_string(&file)
                    .with_context(|| {
                        format!(
                            "no API token: pass --token-file, set MUSTER_TOKEN_FILE or \
                             MUSTER_TOKEN, or start `muster up` (which writes {})",
                            file.display()
                        )
                    })?
                    .trim()
                    .to_string()
            }
        };
        // The config's CA is for the config's server.
        let same_server = config["server"].as_str() == Some(server.as_str());
        let fingerprint = self
            .ca_sha256
            .clone()
            .or_else(|| std::env::var("MUSTER_CA_SHA256").ok())
            .or_else(|| {
                same_server
                    .then(|| config["ca_sha256"].as_str().map(str::to_string))
                    .flatten()
            });
        let ca_file = std::env::var_os("MUSTER_CA_FILE")
            .map(PathBuf::from)
            .or_else(|| {
                if fingerprint.is_some() {
                    return None;
                }
                same_server
                    .then(|| config["ca_file"].as_str().map(PathBuf::from))
                    .flatten()
                    .or_else(|| {
                        // The local server's CA (`muster up`, `muster server`).
                        let local = default_data_dir().join("tls/ca.pem");
                        (server.starts_with("https://") && local.exists()).then_some(local)
                    })
            });
        let trust = trust_of(fingerprint.as_deref(), ca_file.as_deref())?;
        let client = Client::with_trust(&server, &token, &trust).map_err(|e| anyhow!(e))?;
        Ok(
            match std::env::var("USER")
                .ok()
                .filter(|u| !u.is_empty() && from_admin_file)
            {
                Some(user) => client.with_user(&user),
                None => client,
            },
        )
    }
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub(crate) fn ago(ms: u64) -> String {
    ago_text(now_ms().saturating_sub(ms))
}

/// A span as `ps` shows ages: `45s`, `12m`, `3h`, `2d`.
fn ago_text(span_ms: u64) -> String {
    let seconds = span_ms / 1000;
    match seconds {
        0..=59 => format!("{seconds}s"),
        60..=3599 => format!("{}m", seconds / 60),
        3600..=86_399 => format!("{}h", seconds / 3600),
        _ => format!("{}d", seconds / 86_400),
    }
}

/// A span in its two largest units: `45s`, `12m 30s`, `3h 5m`, `2d 4h`.
fn span_text(span_ms: u64) -> String {
    let seconds = span_ms / 1000;
    match seconds {
        0..=59 => format!("{seconds}s"),
        60..=3599 => format!("{}m {}s", seconds / 60, seconds % 60),
        3600..=86_399 => format!("{}h {}m", seconds / 3600, seconds % 3600 / 60),
        _ => format!("{}d {}h", seconds / 86_400, seconds % 86_400 / 3600),
    }
}

/// A moment as `16:30 UTC` (today) or `2026-12-06 16:30 UTC`.
fn clock_text(at_ms: u64, now_ms: u64) -> String {
    let at = |ms: u64| time::OffsetDateTime::from_unix_timestamp((ms / 1000) as i64).ok();
    match (at(at_ms), at(now_ms)) {
        (Some(at), Some(now)) if at.date() == now.date() => {
            format!("{:02}:{:02} UTC", at.hour(), at.minute())
        }
        (Some(at), _) => format!("{} {:02}:{:02} UTC", at.date(), at.hour(), at.minute()),
        (None, _) => format!("{at_ms} ms after the epoch"),
    }
}

/// A pending job's forecast start, in words: `in about 2h 10m (16:30
/// UTC)`, `not before 3d 4h from now`, `unknown (...)`.
fn start_words(estimate: &StartEstimate, now_ms: u64) -> String {
    match (estimate.kind, estimate.at_ms) {
        (StartEstimateKind::At, Some(at)) if at <= now_ms + 1000 => {
            "at the next scheduling cycle".to_string()
        }
        (StartEstimateKind::At, Some(at)) => format!(
            "in about {} ({})",
            span_text(at - now_ms),
            clock_text(at, now_ms)
        ),
        (StartEstimateKind::NotBefore, Some(at)) => format!(
            "not before {} from now ({}; the plan looks no further)",
            span_text(at.saturating_sub(now_ms)),
            clock_text(at, now_ms)
        ),
        _ => "unknown: it waits on running jobs with no runtime estimate (give jobs \
              `estimated_runtime` or `max_runtime`; estimates are also learned from each \
              queue's finished jobs)"
            .to_string(),
    }
}

/// A pending job's forecast start for a table cell: `~2h`, `>3d`, `?`.
fn start_cell(estimate: Option<&StartEstimate>, now_ms: u64) -> String {
    match estimate.map(|e| (e.kind, e.at_ms)) {
        Some((StartEstimateKind::At, Some(at))) => {
            format!("~{}", ago_text(at.saturating_sub(now_ms)))
        }
        Some((StartEstimateKind::NotBefore, Some(at))) => {
            format!(">{}", ago_text(at.saturating_sub(now_ms)))
        }
        Some(_) => "?".to_string(),
        None => String::new(),
    }
}

pub(crate) fn print_json(value: &impl serde::Serialize) -> Result<()> {
    outln!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints rows as aligned columns.
pub(crate) fn table(header: &[&str], rows: Vec<Vec<String>>) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let text: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = widths[i]))
            .collect();
        outln!("{}", text.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        line(row);
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// GPUs per node: a whole number, or a share of one GPU such as 0.25.
    #[arg(long, default_value = "0")]
    pub gpus: String,
    /// Number of nodes (tasks); a job on several nodes is a gang.
    #[arg(long, default_value_t = 1)]
    pub nodes: u32,
    #[arg(long)]
    pub queue: Option<String>,
    #[arg(long)]
    pub name: Option<String>,
    /// CPUs per node.
    #[arg(long)]
    pub cpus: Option<String>,
    /// Memory per node, e.g. 16GiB.
    #[arg(long)]
    pub memory: Option<String>,
    #[arg(long)]
    pub priority_class: Option<String>,
    /// Allowed GPU models, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub gpu_models: Vec<String>,
    /// Environment variables for the job (NAME=VALUE), repeatable.
    #[arg(long = "env", short = 'e', value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Which of this shell's environment variables the job gets, as
    /// `srun --export`: ALL (the default), NONE, or a list like
    /// PATH,VIRTUAL_ENV. muster's own (MUSTER_*, PET_*), the GPU variables
    /// and per-login ones (HOME, USER, SHELL, PWD, ...) never go; `-e`
    /// wins over them.
    #[arg(long, value_name = "ALL|NONE|VARS", default_value = "ALL")]
    pub export: String,
    /// Submit and return the job id without waiting.
    #[arg(long, short = 'd')]
    pub detach: bool,
    /// A time limit (e.g. 30m, 2h, 90s): at it the job gets its stop
    /// signal, its grace period, then is killed, and ends `timed_out`
    /// (`muster run` then exits 124).
    #[arg(long, value_name = "DURATION")]
    pub time: Option<String>,
    /// Stop the job once all its GPUs have stayed below 5% utilisation this
    /// long (e.g. 30m for a notebook); it ends `idle_stopped` (`muster run`
    /// then exits 124).
    #[arg(long, value_name = "DURATION")]
    pub idle_timeout: Option<String>,
    /// VAR=SECRET: the task's VAR holds the secret's value (`muster secrets
    /// set SECRET`); repeat for several.
    #[arg(long = "secret", value_name = "VAR=SECRET")]
    pub secrets: Vec<String>,
    #[command(flatten)]
    pub waiting: WaitingArgs,
    /// The command and its arguments (after `--` when an argument of it
    /// starts with `-` before the command's name).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
    #[command(flatten)]
    pub connection: Connection,
}

fn run_spec(args: &RunArgs) -> Result<serde_json::Value> {
    let program = args
        .command
        .first()
        .map(|c| {
            std::path::Path::new(c)
                .file_name()
                .map_or("job".to_string(), |f| f.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "job".to_string());
    let name: String = args.name.clone().unwrap_or_else(|| {
        let cleaned: String = program
            .to_ascii_lowercase()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let trimmed = cleaned.trim_matches('-');
        if trimmed.is_empty() {
            "job".to_string()
        } else {
            trimmed.chars().take(63).collect()
        }
    });
    let gpus: serde_json::Value = match args.gpus.parse::<u64>() {
        Ok(whole) => whole.into(),
        Err(_) => args
            .gpus
            .parse::<f64>()
            .map(serde_json::Value::from)
            .map_err(|_| {
                anyhow!(
                    "--gpus: expected a whole number or a share like 0.25, got {:?}",
                    args.gpus
                )
            })?,
    };
    let mut spec = serde_json::json!({
        "name": name,
        "nodes": args.nodes,
        "gpus": gpus,
        "command": args.command,
    });
    if let Some(queue) = &args.queue {
        spec["queue"] = queue.clone().into();
    }
    if let Some(cpus) = &args.cpus {
        spec["cpus"] = cpus
            .parse::<f64>()
            .map(serde_json::Value::from)
            .unwrap_or_else(|_| cpus.clone().into());
    }
    if let Some(memory) = &args.memory {
        spec["memory"] = memory.clone().into();
    }
    if let Some(class) = &args.priority_class {
        spec["priority_class"] = class.clone().into();
    }
    if let Some(time) = &args.time {
        spec["max_runtime"] = time.clone().into();
    }
    if let Some(timeout) = &args.idle_timeout {
        spec["idle_timeout"] = timeout.clone().into();
    }
    if !args.secrets.is_empty() {
        let mut secrets = serde_json::Map::new();
        for pair in &args.secrets {
            let Some((variable, name)) = pair.split_once('=') else {
                anyhow::bail!("--secret takes VAR=SECRET, like HF_TOKEN=hf; got {pair:?}");
            };
            secrets.insert(variable.to_string(), name.into());
        }
        spec["secrets"] = secrets.into();
    }
    if !args.waiting.after.is_empty() {
        spec["after"] = args.waiting.after.clone().into();
    }
    if !args.gpu_models.is_empty() {
        spec["gpu_models"] = args.gpu_models.clone().into();
    }
    if let Some(dir) = std::env::current_dir()
        .ok()
        .and_then(|d| d.to_str().map(str::to_string))
    {
        spec["working_dir"] = dir.into();
    }
    let mut env = serde_json::Map::new();
    for (key, value) in exported(&args.export, std::env::vars_os())? {
        env.insert(key, value.into());
    }
    for pair in &args.env {
        let (key, value) = match pair.split_once('=') {
            Some((key, value)) => (key.to_string(), value.to_string()),
            // `-e NAME`: the value this shell has.
            None => (
                pair.clone(),
                std::env::var(pair)
                    .map_err(|_| anyhow!("--env {pair}: not set in this shell; pass NAME=VALUE"))?,
            ),
        };
        env.insert(key, value.into());
    }
    if !env.is_empty() {
        spec["env"] = env.into();
    }
    // Validate here too, so that the user sees every problem before a round
    // trip (the server validates again).
    muster_api::parse_job_spec_value(&spec).map_err(|errors| anyhow!("{errors}"))?;
    Ok(spec)
}

/// GPUs as people write them: `8`, `0.25`.
fn gpus_text(gpus: f64) -> String {
    let text = format!("{gpus:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// How much of a failed rank's output `describe` reads (its last lines).
const TAIL_BYTES: u64 = 4096;

/// Variables of the submitter's shell that mean nothing on another machine
/// or as another user; never exported.
const NOT_EXPORTED: [&str; 14] = [
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "PWD",
    "OLDPWD",
    "SHLVL",
    "_",
    "MAIL",
    "TERM",
    "DISPLAY",
    "HOSTNAME",
    "XAUTHORITY",
    "TMUX",
];

/// What `--export` sends from `vars` (the shell's environment): every
/// variable with a valid, unreserved name (ALL), none (NONE), or the ones
/// listed (each must be set).
fn exported(
    export: &str,
    vars: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<Vec<(String, String)>> {
    let vars: std::collections::BTreeMap<String, String> = vars
        .filter_map(|(key, value)| Some((key.into_string().ok()?, value.into_string().ok()?)))
        .collect();
    // The spec's own rules for names and reserved variables.
    let sendable = |name: &str| {
        muster_api::is_env_name(name)
            && !muster_api::is_reserved_env_name(name)
            && !NOT_EXPORTED.contains(&name)
            && !name.starts_with("SSH_")
            // A shell inside a Slurm allocation has its job's: they would
            // mislead the task (libraries read them); `muster sbatch` sets
            // the job's own.
            && !name.starts_with("SLURM_")
            && !name.starts_with("XDG_")
            && !name.starts_with("DBUS_")
    };
    match export.trim() {
        text if text.eq_ignore_ascii_case("ALL") => Ok(vars
            .into_iter()
            .filter(|(name, value)| sendable(name) && !value.contains('\0'))
            .collect()),
        text if text.eq_ignore_ascii_case("NONE") => Ok(Vec::new()),
        list => list
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(|name| {
                if !sendable(name) {
                    bail!(
                        "--export {name}: muster sets it itself, or it is a per-login variable \
                         or not a variable name"
                    );
                }
                let value = vars
                    .get(name)
                    .ok_or_else(|| anyhow!("--export {name}: not set in this shell"))?;
                Ok((name.to_string(), value.clone()))
            })
            .collect(),
    }
}

/// The exit status `muster run` returns for a finished job.
fn job_exit_status(job: &JobView) -> u8 {
    match job.state.as_str() {
        "succeeded" => 0,
        "cancelled" => 130,
        "timed_out" | "idle_stopped" => exit::TIMED_OUT,
        _ => job.exit_code.map_or(exit::FAILURE, |code| {
            u8::try_from(code).unwrap_or(exit::FAILURE).max(1)
        }),
    }
}

/// Prints a task's output from `offset`, page by page, until the job has
/// ended and every byte was printed (`follow`), or until the end of what
/// the server has now; returns the offset reached.
async fn print_logs(
    client: &Client,
    id: u64,
    rank: u32,
    offset: u64,
    follow: bool,
    format: LogFormat,
) -> Result<u64> {
    print_rank_logs(client, id, rank, offset, follow, format).await
}

/// How task output is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogFormat {
    /// The task's bytes, unchanged.
    Raw,
    /// Each line with `[rank N] ` before it (as `srun -l`).
    Prefixed,
    /// One JSON object per line: `{"event": "output", "job", "rank",
    /// "line"}` (`--json`; invalid UTF-8 replaced).
    Json,
}

impl LogFormat {
    fn of(json: bool, ranks: u32) -> LogFormat {
        if json {
            LogFormat::Json
        } else if ranks > 1 {
            LogFormat::Prefixed
        } else {
            LogFormat::Raw
        }
    }
}

/// Writes `data` as `format` says, whole lines at a time; a line not yet
/// ended waits in `partial` for the rest of it.
fn write_lines(job: u64, rank: u32, format: LogFormat, partial: &mut Vec<u8>, data: &[u8]) {
    if format == LogFormat::Raw {
        write_bytes(data);
        return;
    }
    partial.extend_from_slice(data);
    let Some(last) = partial.iter().rposition(|&b| b == b'\n') else {
        return;
    };
    let mut out = Vec::with_capacity(partial.len() + 16);
    for line in partial[..=last].split_inclusive(|&b| b == b'\n') {
        match format {
            LogFormat::Json => {
                let text = String::from_utf8_lossy(line.strip_suffix(b"\n").unwrap_or(line));
                let event = serde_json::json!({
                    "event": "output",
                    "job": job,
                    "rank": rank,
                    "line": text,
                });
                out.extend_from_slice(event.to_string().as_bytes());
                out.push(b'\n');
            }
            _ => {
                out.extend_from_slice(format!("[rank {rank}] ").as_bytes());
                out.extend_from_slice(line);
            }
        }
    }
    partial.drain(..=last);
    write_bytes(&out);
}

/// Ends what `write_lines` left waiting: a last line without its newline.
fn flush_lines(job: u64, rank: u32, format: LogFormat, partial: &mut Vec<u8>) {
    if format != LogFormat::Raw && !partial.is_empty() {
        partial.push(b'\n');
        write_lines(job, rank, format, partial, &[]);
    }
}

/// Prints one JSON object on a line of its own (`--json` event streams).
fn print_json_line(value: &serde_json::Value) {
    let mut line = value.to_string().into_bytes();
    line.push(b'\n');
    write_bytes(&line);
}

/// Every rank's output at once, each line marked with its rank.
async fn print_all_ranks(
    client: &Client,
    id: u64,
    ranks: u32,
    follow: bool,
    format: LogFormat,
) -> Result<()> {
    let mut followers = tokio::task::JoinSet::new();
    for rank in 0..ranks {
        let client = client.clone();
        followers.spawn(async move { print_rank_logs(&client, id, rank, 0, follow, format).await });
    }
    while let Some(done) = followers.join_next().await {
        done.context("a log follower failed")??;
    }
    Ok(())
}

async fn print_rank_logs(
    client: &Client,
    id: u64,
    rank: u32,
    mut offset: u64,
    follow: bool,
    format: LogFormat,
) -> Result<u64> {
    let mut task = None;
    let mut partial = Vec::new();
    loop {
        let page = client
            .task_logs(id, rank, task, offset, None, follow)
            .await?;
        if task.is_some() && page.allocation.is_some() && page.allocation != task {
            // The job runs again (a retry, or its node was lost): its new
            // task's output from the start, the note on stderr only.
            eprintln!("muster: job {id} runs again; its output from the start follows");
        }
        task = page.allocation.or(task);
        if !page.data.is_empty() {
            write_lines(id, rank, format, &mut partial, &page.data);
        }
        offset = page.next_offset;
        if page.complete || (!follow && !page.more) {
            flush_lines(id, rank, format, &mut partial);
            return Ok(offset);
        }
    }
}

async fn follow_logs(
    client: &Client,
    id: u64,
    rank: u32,
    offset: u64,
    format: LogFormat,
) -> Result<u64> {
    print_logs(client, id, rank, offset, true, format).await
}

/// The reason the API gives a pending job no cycle has looked at yet.
const NO_CYCLE_YET: &str = "waiting for the next scheduling cycle";

/// While job `id` is pending, prints why (on stderr, or as a `pending`
/// event with `--json`) at once and again whenever the reason changes;
/// once the job has left pending it says nothing more. Runs until dropped.
async fn report_pending(client: &Client, id: u64, json: bool) {
    /// How often the job is read while it waits.
    const EVERY: std::time::Duration = std::time::Duration::from_secs(2);
    // A job that starts at once says nothing.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let mut said: Option<String> = None;
    let mut said_start: Option<StartEstimate> = None;
    loop {
        if let Ok(job) = client.job(id).await {
            if job.state != "pending" {
                std::future::pending::<()>().await;
            }
            if let Some(estimate) = job.estimated_start
                && start_changed(said_start.as_ref(), &estimate, now_ms())
            {
                if json {
                    print_json_line(&serde_json::json!({
                        "event": "estimated_start",
                        "job": id,
                        "estimated_start": estimate,
                    }));
                } else if estimate.kind == StartEstimateKind::Unknown {
                    eprintln!("job {id} start time {}", start_words(&estimate, now_ms()));
                } else {
                    eprintln!(
                        "job {id} expected to start {}",
                        start_words(&estimate, now_ms())
                    );
                }
                said_start = Some(estimate);
            }
            if let Some(reason) = job.pending_reason
                && said.as_ref() != Some(&reason)
                && reason != NO_CYCLE_YET
            {
                if json {
                    print_json_line(&serde_json::json!({
                        "event": "pending",
                        "job": id,
                        "reason": reason,
                    }));
                } else {
                    eprintln!("job {id} pending: {reason}");
                }
                said = Some(reason);
            }
        }
        tokio::time::sleep(EVERY).await;
    }
}

/// Whether a new forecast is worth saying: the first, another kind, or a
/// start moved by over a quarter of the wait (at least a minute).
fn start_changed(said: Option<&StartEstimate>, new: &StartEstimate, now_ms: u64) -> bool {
    let Some(said) = said else {
        return true;
    };
    if said.kind != new.kind {
        return true;
    }
    match (said.at_ms, new.at_ms) {
        (Some(old), Some(at)) => {
            let wait = at.saturating_sub(now_ms);
            old.abs_diff(at) > (wait / 4).max(60_000)
        }
        _ => false,
    }
}

fn ask_to_cancel(id: u64) -> bool {
    eprint!("\ncancel job {id}? [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer).is_ok()
        && matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes")
}

pub fn run(args: RunArgs) -> std::result::Result<u8, Failure> {
    // A spec this side can tell is wrong: invalid input, exit code 6.
    let spec = run_spec(&args).map_err(|error| Failure {
        code: exit::INVALID,
        error,
    })?;
    let client = args.connection.client()?;
    let rt = runtime()?;
    rt.block_on(async {
        // Ctrl-C is caught from before the job exists, so one pressed as it
        // starts asks too instead of leaving it running unasked.
        let mut interrupt = (!args.detach)
            .then(|| tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()))
            .transpose()
            .context("cannot catch Ctrl-C")?;
        let response = client
            .submit_request(spec, args.waiting.allow_pending)
            .await
            .map_err(anyhow::Error::from)?;
        let id = response.id;
        for warning in &response.warnings {
            eprintln!("warning: {warning}");
        }
        if args.detach {
            if args.connection.json {
                print_json(&serde_json::json!({ "id": id }))?;
            } else {
                outln!("{id}");
            }
            return Ok::<u8, anyhow::Error>(0);
        }
        let json = args.connection.json;
        if json {
            print_json_line(&serde_json::json!({ "event": "submitted", "job": id }));
        } else {
            eprintln!("job {id} submitted; following its output (Ctrl-C to detach or cancel)");
        }
        let ranks = args.nodes;
        let format = LogFormat::of(json, ranks);
        let followed = async {
            if ranks > 1 {
                print_all_ranks(&client, id, ranks, true, format).await
            } else {
                follow_logs(&client, id, 0, 0, format).await.map(|_| ())
            }
        };
        tokio::select! {
            result = followed => {
                result?;
            }
            // Never ends: says why the job waits while it is pending.
            () = report_pending(&client, id, json) => {}
            Some(()) = async {
                match interrupt.as_mut() {
                    Some(interrupt) => interrupt.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                if ask_to_cancel(id) {
                    client.cancel(id).await.map_err(anyhow::Error::from)?;
                    eprintln!("job {id} cancelled");
                    return Ok(130);
                }
                eprintln!("job {id} keeps running; `muster logs -f {id}` follows it again");
                return Ok(0);
            }
        }
        // The log is complete once the job is final.
        let job = client.job(id).await.map_err(anyhow::Error::from)?;
        if json {
            print_json_line(&serde_json::json!({
                "event": "ended",
                "job": id,
                "state": job.state,
                "exit_code": job.exit_code,
                "failed_rank": job.failed_rank,
                "exit_status": job_exit_status(&job),
            }));
        } else if job.state != "succeeded" {
            let mut detail = Vec::new();
            if let Some(code) = job.exit_code {
                detail.push(format!("exit code {code}"));
            }
            if let Some(rank) = job.failed_rank {
                detail.push(format!("rank {rank}; `muster logs --rank {rank} {id}`"));
            }
            let detail = if detail.is_empty() {
                String::new()
            } else {
                format!(" ({})", detail.join(", "))
            };
            eprintln!("job {id} {}{detail}", job.state);
        }
        Ok(job_exit_status(&job))
    })
    .map_err(Failure::from)
}

/// What a submitted job may wait for: `run` and `submit` take them alike.
#[derive(Debug, Args, Default)]
pub struct WaitingArgs {
    /// Start only after these jobs end: `12` (after it succeeds), `any:12`
    /// (after it ends, however), `notok:12` (after it fails); a comma list
    /// or the flag again. If one cannot be met (e.g. job 12 fails), this job
    /// is cancelled with that reason. Slurm's `afterok:12` works too.
    #[arg(long, value_name = "ID,...", value_delimiter = ',')]
    pub after: Vec<String>,
    /// Queue the job even if no registered node could ever hold it (for
    /// nodes still to come); without it such a job is refused at once.
    #[arg(long)]
    pub allow_pending: bool,
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// The job spec (YAML; see docs/job-spec.md), `-` for standard input.
    pub file: PathBuf,
    /// A time limit (e.g. 30m, 2h), replacing the spec's `max_runtime`.
    #[arg(long, value_name = "DURATION")]
    pub time: Option<String>,
    /// Submit a job array, one job per index, replacing the spec's `array`:
    /// `0-99`, `1,3,5-7`, `0-15:4`; `%8` at the end runs at most 8 at once.
    /// Each element sees MUSTER_ARRAY_INDEX and MUSTER_ARRAY_JOB_ID.
    #[arg(long, value_name = "INDICES[%N]")]
    pub array: Option<String>,
    #[command(flatten)]
    pub waiting: WaitingArgs,
    #[command(flatten)]
    pub connection: Connection,
}

/// Prints what a submission answered: the id (for scripts), and for an
/// array how many elements it has.
fn print_submitted(response: &muster_api::protocol::SubmitResponse, json: bool) -> Result<()> {
    if json {
        return print_json(response);
    }
    outln!("{}", response.id);
    for warning in &response.warnings {
        eprintln!("warning: {warning}");
    }
    if let Some(elements) = response.elements {
        eprintln!(
            "array job {} submitted: {elements} element(s), jobs {} to {}; `muster ps` groups \
             them, `muster cancel {}` cancels them all",
            response.id,
            response.id,
            response.id + u64::from(elements) - 1,
            response.id
        );
    }
    Ok(())
}

pub fn submit(args: SubmitArgs) -> Result<u8, Failure> {
    let text = if args.file.as_os_str() == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
            .context("cannot read the job spec from standard input")?;
        text
    } else {
        std::fs::read_to_string(&args.file)
            .with_context(|| format!("cannot read {}", args.file.display()))?
    };
    let spec = muster_api::parse_job_spec_yaml(&text).map_err(|errors| Failure {
        code: exit::INVALID,
        error: anyhow!("{}: invalid job spec:\n{errors}", args.file.display()),
    })?;
    let wire = muster_api::JobSpec::from(&spec);
    let mut value = serde_json::to_value(&wire).context("cannot encode the job spec")?;
    if let Some(time) = &args.time {
        value["max_runtime"] = time.clone().into();
    }
    if !args.waiting.after.is_empty() {
        value["after"] = args.waiting.after.clone().into();
    }
    if let Some(array) = &args.array {
        value["array"] = array.clone().into();
    }
    if args.time.is_some() || !args.waiting.after.is_empty() || args.array.is_some() {
        muster_api::parse_job_spec_value(&value).map_err(|errors| Failure {
            code: exit::INVALID,
            error: anyhow!("invalid option:\n{errors}"),
        })?;
    }
    let client = args.connection.client()?;
    let response = runtime()?
        .block_on(client.submit_request(value, args.waiting.allow_pending))
        .map_err(anyhow::Error::from)?;
    print_submitted(&response, args.connection.json)?;
    Ok(0)
}

#[derive(Debug, Args)]
pub struct SbatchArgs {
    /// Submit even when the script has options muster does not know (they
    /// are listed, and left out).
    #[arg(long)]
    pub ignore_unknown: bool,
    /// Queue the job even if no registered node could ever hold it.
    #[arg(long)]
    pub allow_pending: bool,
    /// sbatch options (they win over the script's #SBATCH lines), the
    /// script, then the script's arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "[OPTIONS] SCRIPT [ARGS]"
    )]
    pub args: Vec<String>,
    #[command(flatten)]
    pub connection: Connection,
}

/// `muster sbatch`: a Slurm batch script, run on every node of the job with
/// the `SLURM_*` variables it reads.
pub fn sbatch(args: SbatchArgs) -> Result<u8, Failure> {
    let invalid = |error: anyhow::Error| Failure {
        code: exit::INVALID,
        error,
    };
    // muster's own flags may come among the sbatch options too.
    let mut ignore_unknown = args.ignore_unknown;
    let mut allow_pending = args.allow_pending;
    let words: Vec<String> = args
        .args
        .iter()
        .filter(|word| match word.as_str() {
            "--ignore-unknown" => {
                ignore_unknown = true;
                false
            }
            "--allow-pending" => {
                allow_pending = true;
                false
            }
            _ => true,
        })
        .cloned()
        .collect();
    let (options, script, script_args) = muster_api::sbatch::split_command_line(&words);
    let script = script.ok_or_else(|| invalid(anyhow!("name the batch script to submit")))?;
    let text = if script == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
            .context("cannot read the script from standard input")?;
        text
    } else {
        std::fs::read_to_string(&script).with_context(|| format!("cannot read {script}"))?
    };
    let submit_dir = std::env::current_dir()
        .context("cannot tell the current directory")?
        .to_str()
        .ok_or_else(|| anyhow!("the current directory is not UTF-8"))?
        .to_string();
    let file_name = std::path::Path::new(&script)
        .file_name()
        .map_or("script".to_string(), |f| f.to_string_lossy().into_owned());
    let batch = muster_api::sbatch::read_batch_script(&text, &file_name, &submit_dir, &options)
        .map_err(|errors| invalid(anyhow!("{script}:\n  {}", errors.join("\n  "))))?;
    if !batch.unknown.is_empty() {
        let list = batch.unknown.join("\n  ");
        if !ignore_unknown {
            return Err(invalid(anyhow!(
                "{script}: options muster does not know:\n  {list}\nRemove them, or pass \
                 --ignore-unknown to submit without them"
            )));
        }
        eprintln!("note: left out (--ignore-unknown):\n  {list}");
    }
    for note in &batch.notes {
        eprintln!("note: {note}");
    }
    let mut spec = batch.spec;
    // The submitter's environment (sbatch's --export, ALL by default), under
    // the script's own variables.
    let mut env = serde_json::Map::new();
    for (key, value) in exported(&batch.export, std::env::vars_os()).map_err(invalid)? {
        env.insert(key, value.into());
    }
    if let Some(own) = spec["env"].as_object() {
        for (key, value) in own {
            env.insert(key.clone(), value.clone());
        }
    }
    spec["env"] = env.into();
    if let Some(command) = spec["command"].as_array_mut() {
        command.extend(script_args.into_iter().map(serde_json::Value::from));
    }
    muster_api::parse_job_spec_value(&spec).map_err(|errors| {
        invalid(anyhow!(
            "{script}: the job it makes is not valid:\n{errors}"
        ))
    })?;
    let client = args.connection.client()?;
    let response = runtime()?
        .block_on(client.submit_request(spec, allow_pending))
        .map_err(anyhow::Error::from)?;
    print_submitted(&response, args.connection.json)?;
    Ok(0)
}

/// How many rows of `ps` `jobs` make: an array's pending elements share one.
fn rows_of(jobs: &[JobView]) -> usize {
    let mut arrays = std::collections::BTreeSet::new();
    jobs.iter()
        .filter(|job| match job.array.filter(|_| job.state == "pending") {
            Some(array) => arrays.insert(array.job),
            None => true,
        })
        .count()
}

/// Jobs of `filter`, newest first, page by page until they make `most` rows
/// of `ps` (every one: `None`); and whether more were left.
async fn jobs_for_rows(
    client: &Client,
    filter: &JobFilter,
    most: Option<usize>,
) -> Result<(Vec<JobView>, bool), ClientError> {
    let mut filter = filter.clone();
    let mut jobs = Vec::new();
    loop {
        let rows = rows_of(&jobs);
        // Rows still wanted; none: only jobs that add no row (the
        // elements of the array the last page ended in) are read on.
        let left = most.map_or(1000, |most| most.saturating_sub(rows));
        filter.limit = Some(if left == 0 { 1000 } else { left.min(1000) } as u32);
        let page = client.jobs(&filter).await?;
        jobs.extend(page.jobs);
        let rows = rows_of(&jobs);
        let full = most.is_some_and(|most| rows >= most);
        // An array's elements have consecutive ids, so after a job that is
        // not one, every later job makes a row of its own.
        let in_array = jobs.last().is_some_and(|job| job.array.is_some());
        match page.next_cursor {
            Some(_) if most.is_some_and(|most| rows > most) => return Ok((jobs, true)),
            Some(_) if full && !in_array => return Ok((jobs, true)),
            Some(cursor) => filter.cursor = Some(cursor),
            None => return Ok((jobs, most.is_some_and(|most| rows > most))),
        }
    }
}

/// A job as the commands name it: `12`, or an array's elements by index,
/// `12_3` or `12_[1-3,7]` (Slurm's notation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobRef {
    Job(u64),
    Elements {
        array: u64,
        indices: muster_model::ArraySpec,
    },
}

impl std::str::FromStr for JobRef {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<JobRef, String> {
        let text = text.trim();
        let id = |part: &str| {
            part.parse::<u64>().map_err(|_| {
                format!(
                    "{text:?} is not a job: expected an id like 12, or an array element like \
                     12_3 or 12_[1-5]"
                )
            })
        };
        match text.split_once('_') {
            None => Ok(JobRef::Job(id(text)?)),
            Some((array, indices)) => {
                let array = id(array)?;
                let indices = indices
                    .strip_prefix('[')
                    .and_then(|inner| inner.strip_suffix(']'))
                    .unwrap_or(indices);
                let indices = muster_model::ArraySpec::parse(indices)
                    .map_err(|error| format!("{text:?}: {error}"))?;
                if indices.limit.is_some() {
                    return Err(format!("{text:?}: a %limit does not name elements"));
                }
                Ok(JobRef::Elements { array, indices })
            }
        }
    }
}

/// The elements of array job `array` (every page).
async fn array_jobs(client: &Client, array: u64) -> Result<Vec<JobView>, ClientError> {
    let filter = JobFilter {
        array: Some(array),
        ..JobFilter::default()
    };
    Ok(client.all_jobs(&filter, None).await?.0)
}

/// The ids `reference` names; an index the array lacks is an error.
async fn resolve(client: &Client, reference: &JobRef) -> Result<Vec<u64>> {
    match reference {
        JobRef::Job(id) => Ok(vec![*id]),
        JobRef::Elements { array, indices } => {
            let elements = array_jobs(client, *array).await?;
            let mut ids = Vec::new();
            for index in &indices.indices {
                let found = elements
                    .iter()
                    .find(|job| job.array.is_some_and(|a| a.index == *index))
                    .ok_or_else(|| {
                        anyhow!(
                            "array job {array} has no element {index}; `muster ps` lists its \
                             elements"
                        )
                    })?;
                ids.push(found.id);
            }
            Ok(ids)
        }
    }
}

/// The one job `reference` names (for `describe` and `logs`).
async fn resolve_one(client: &Client, reference: &JobRef) -> Result<u64> {
    let ids = resolve(client, reference).await?;
    match ids.as_slice() {
        [id] => Ok(*id),
        _ => bail!("name one job here, not {}", ids.len()),
    }
}

/// How `ps` names a job: its id, or an element as `ARRAY_INDEX`.
fn job_label(job: &JobView) -> String {
    match job.array {
        Some(array) => format!("{}_{}", array.job, array.index),
        None => job.id.to_string(),
    }
}

#[derive(Debug, Args)]
pub struct PsArgs {
    #[arg(long)]
    pub queue: Option<String>,
    /// pending, running, stopping, succeeded, failed or cancelled.
    #[arg(long)]
    pub state: Option<String>,
    #[arg(long)]
    pub user: Option<String>,
    /// Include finished jobs.
    #[arg(long, short = 'a')]
    pub all: bool,
    /// Only the elements of this array job (finished ones too).
    #[arg(long, value_name = "ID")]
    pub array: Option<u64>,
    /// Show at most this many jobs, newest first (0: every one; the list
    /// is read from the server a page at a time).
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// More columns: priority class, place in line, and when a pending job
    /// is expected to start (`~2h`; `>3d`: not within the scheduler's plan;
    /// `?`: unknown; `muster describe` says more).
    #[arg(long, short = 'w')]
    pub wide: bool,
    #[command(flatten)]
    pub connection: Connection,
}

pub fn ps(args: PsArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let filter = JobFilter {
        queue: args.queue.clone(),
        state: args.state.clone(),
        user: args.user.clone(),
        // Finished jobs only with --all or when their state is asked for
        // (or an array's elements are).
        active: !args.all && args.state.is_none() && args.array.is_none(),
        array: args.array,
        ..JobFilter::default()
    };
    let most = (args.limit > 0).then_some(args.limit);
    let (jobs, more) = if args.connection.json {
        runtime()?
            .block_on(client.all_jobs(&filter, most))
            .map_err(anyhow::Error::from)?
    } else {
        // The limit counts rows: an array's pending elements are one.
        runtime()?
            .block_on(jobs_for_rows(&client, &filter, most))
            .map_err(anyhow::Error::from)?
    };
    let jobs: Vec<&JobView> = jobs.iter().collect();
    if args.connection.json {
        // The API's shape: `{"jobs": [...]}`.
        print_json(&serde_json::json!({ "jobs": jobs }))?;
        return Ok(0);
    }
    if more {
        eprintln!(
            "the {} most recent rows; --limit N shows more, --limit 0 all of them",
            most.unwrap_or(0)
        );
    }
    // Pending elements of one array share a row (`12_[5-99%8]`), where
    // the newest of them would be; running and ended ones have their own.
    let mut pending_of: std::collections::BTreeMap<u64, Vec<u32>> =
        std::collections::BTreeMap::new();
    for job in &jobs {
        if let Some(array) = job.array.filter(|_| job.state == "pending") {
            pending_of.entry(array.job).or_default().push(array.index);
        }
    }
    if more {
        // The page may hold only some of an array's pending elements: its
        // row names them all.
        for (&array, indices) in &mut pending_of {
            let filter = JobFilter {
                array: Some(array),
                state: Some("pending".to_string()),
                ..JobFilter::default()
            };
            let (all, _) = runtime()?
                .block_on(client.all_jobs(&filter, None))
                .map_err(anyhow::Error::from)?;
            *indices = all
                .iter()
                .filter_map(|j| j.array.map(|a| a.index))
                .collect();
        }
    }
    let mut rows = Vec::new();
    let now = now_ms();
    for job in &jobs {
        let grouped = job
            .array
            .filter(|_| job.state == "pending")
            .and_then(|array| pending_of.remove(&array.job).map(|group| (array, group)));
        let label = match grouped {
            Some((array, mut indices)) if indices.len() > 1 => {
                indices.sort_unstable();
                let indices = muster_model::ArraySpec {
                    indices,
                    limit: array.limit,
                };
                format!("{}_[{indices}]", array.job)
            }
            Some(_) => job_label(job),
            // A pending element already shown in its array's row.
            None if job.state == "pending" && job.array.is_some() => continue,
            None => job_label(job),
        };
        if most.is_some_and(|most| rows.len() >= most) {
            break;
        }
        // Running: its nodes. Pending: why, as a short code (`muster
        // describe` has the sentence).
        let place = if job.tasks.is_empty() {
            job.pending_code
                .clone()
                .or_else(|| {
                    job.pending_reason
                        .as_ref()
                        .map(|r| r.chars().take(60).collect())
                })
                .unwrap_or_default()
        } else {
            let nodes = job
                .tasks
                .iter()
                .map(|t| t.node.clone())
                .collect::<Vec<_>>()
                .join(",");
            match job.idle_for_s {
                Some(idle) => format!("{nodes} (idle {})", ago_text(idle * 1000)),
                None => nodes,
            }
        };
        let mut row = vec![
            label,
            job.name.clone(),
            job.user.clone(),
            job.queue.clone(),
            job.state.clone(),
            job.nodes.to_string(),
            gpus_text(job.gpus_per_node),
            ago(job.submitted_ms),
        ];
        if args.wide {
            row.push(job.priority_class.clone());
            row.push(job.queue_position.map_or(String::new(), |p| p.to_string()));
            row.push(start_cell(job.estimated_start.as_ref(), now));
        }
        row.push(place);
        rows.push(row);
    }
    let mut header = vec![
        "ID", "NAME", "USER", "QUEUE", "STATE", "NODES", "GPUS", "AGE",
    ];
    if args.wide {
        header.extend(["PRIORITY", "IN LINE", "STARTS"]);
    }
    header.push("WHERE / WHY");
    table(&header, rows);
    Ok(0)
}

#[derive(Debug, Args)]
pub struct JobArgs {
    /// The job id (an array element as 12_3).
    pub job: JobRef,
    #[command(flatten)]
    pub connection: Connection,
}

pub fn describe(args: JobArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let (job, usage) = runtime()?.block_on(async {
        let id = resolve_one(&client, &args.job).await?;
        let job = client.job(id).await.map_err(anyhow::Error::from)?;
        // Usage is extra: a server without it still describes the job.
        let usage = client.job_usage(id).await.ok();
        Ok::<_, anyhow::Error>((job, usage))
    })?;
    if args.connection.json {
        print_json(&job)?;
        return Ok(0);
    }

    outln!("job {}: {}", job.id, job.name);
    outln!("  state:     {}", job.state);
    for warning in &job.warnings {
        outln!("  warning:   {warning}");
    }
    if let Some(code) = job.exit_code {
        outln!("  exit code: {code}");
    }
    if let Some(rank) = job.failed_rank {
        outln!(
            "  failed:    rank {rank} first (the others were stopped because of it); \
             `muster logs --rank {rank} {}`",
            job.id
        );
        // The end of that rank's output: why it failed, usually.
        let tail = runtime()?.block_on(async {
            let probe = client
                .task_logs(job.id, rank, None, 0, Some(1), false)
                .await?;
            let from = probe.end.saturating_sub(TAIL_BYTES);
            client
                .task_logs(job.id, rank, None, from, Some(TAIL_BYTES), false)
                .await
        });
        if let Ok(page) = tail {
            let text = String::from_utf8_lossy(&page.data);
            let lines: Vec<&str> = text.lines().collect();
            outln!("  its last output:");
            for line in &lines[lines.len().saturating_sub(10)..] {
                outln!("    {line}");
            }
        }
    }
    outln!("  user:      {}", job.user);
    outln!(
        "  queue:     {} (priority class {})",
        job.queue,
        job.priority_class
    );
    outln!(
        "  asks:      {} node(s) x {} GPU(s)",
        job.nodes,
        gpus_text(job.gpus_per_node)
    );
    outln!("  command:   {}", job.command.join(" "));
    if !job.after.is_empty() {
        outln!("  after:     {}", job.after.join(", "));
    }
    if let Some(array) = job.array {
        outln!(
            "  array:     element {} of array job {} ({} elements{}); shown as {}",
            array.index,
            array.job,
            array.count,
            array
                .limit
                .map_or(String::new(), |limit| format!(", at most {limit} at once")),
            job_label(&job)
        );
    }
    outln!("  attempts:  {}", job.attempts);
    if let Some(idle) = job.idle_for_s {
        outln!(
            "  idle:      every GPU of it below 5% utilisation for {}; cancel it if it is \
             done (`muster cancel {}`)",
            ago_text(idle * 1000),
            job.id
        );
    }
    if let Some(reason) = &job.pending_reason {
        outln!("  pending:   {reason}");
    }
    if let Some(position) = job.queue_position {
        outln!("  in line:   {position} (1 = next)");
    }
    if let Some(estimate) = &job.estimated_start {
        outln!(
            "  starts:    {}; the scheduler's plan as running jobs end, not counting jobs \
             submitted later",
            start_words(estimate, now_ms())
        );
    }
    if !job.tasks.is_empty() {
        outln!("  placement:");
        for task in &job.tasks {
            let gpus: Vec<String> = task
                .gpus
                .iter()
                .map(|(i, m)| {
                    if *m == 1000 {
                        i.to_string()
                    } else {
                        format!("{i}({:.3})", f64::from(*m) / 1000.0)
                    }
                })
                .collect();
            outln!(
                "    rank {} on {} GPUs [{}] ({}{})",
                task.rank,
                task.node,
                gpus.join(","),
                task.state,
                task.exit_code
                    .map_or(String::new(), |c| format!(", exit code {c}"))
            );
            if let Some(pulling) = &task.pulling {
                outln!("      {pulling}");
            }
            if let Some(usage) = &task.usage {
                outln!(
                    "      GPU utilisation mean {:.0}%, peak {}%; memory peak {} MiB ({} samples)",
                    usage.mean_utilization_pct,
                    usage.peak_utilization_pct,
                    usage.peak_memory_mib,
                    usage.samples
                );
            }
        }
    }
    if let Some(usage) = usage.filter(|usage| !usage.ranks.is_empty()) {
        outln!("  GPU use (every attempt, one-minute accounting):");
        for rank in &usage.ranks {
            outln!(
                "    rank {}: utilisation mean {}, peak {}%; memory peak {} MiB; {:.3} GPU-h \
                 held, {:.3} used, {:.3} idle",
                rank.rank,
                rank.mean_utilization_pct
                    .map_or("-".to_string(), |mean| format!("{mean:.0}%")),
                rank.peak_utilization_pct,
                rank.peak_memory_mib,
                rank.allocated_gpu_hours,
                rank.used_gpu_hours,
                rank.idle_gpu_hours
            );
        }
    }
    outln!("  history:");
    for event in &job.history {
        outln!("    {:>6} ago  {}", ago(event.at_ms), event.what);
    }
    Ok(0)
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    /// The job id (an array element as 12_3).
    pub job: JobRef,
    /// Keep printing new output until the job ends.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// Which task (node rank) to show (default: every rank of a multi-node
    /// job, each line prefixed `[rank N]`).
    #[arg(long)]
    pub rank: Option<u32>,
    /// An earlier attempt's output (1 for the first; default: the latest).
    #[arg(long, value_name = "K")]
    pub attempt: Option<u32>,
    #[command(flatten)]
    pub connection: Connection,
}

pub fn logs(args: LogsArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    runtime()?
        .block_on(async {
            let json = args.connection.json;
            let job_id = resolve_one(&client, &args.job).await?;
            if let Some(attempt) = args.attempt {
                // One attempt's output, whole, of one rank (0 by default).
                let rank = args.rank.unwrap_or(0);
                let format = LogFormat::of(json, 1);
                let mut partial = Vec::new();
                let mut offset = 0;
                loop {
                    let page = client
                        .task_logs_of_attempt(
                            job_id,
                            rank,
                            Some(attempt),
                            None,
                            offset,
                            None,
                            false,
                        )
                        .await?;
                    write_lines(job_id, rank, format, &mut partial, &page.data);
                    offset = page.next_offset;
                    if !page.more {
                        flush_lines(job_id, rank, format, &mut partial);
                        return Ok(());
                    }
                }
            }
            let job = client.job(job_id).await?;
            // A job that has ended is read to the end of its log: its nodes
            // send their output apart from its exit, and may still be
            // sending the last of it (the server says when it has it all,
            // or within seconds when a node is gone).
            let follow = args.follow
                || muster_control::JobState::parse(&job.state)
                    .is_some_and(muster_control::JobState::is_final);
            match args.rank {
                Some(rank) => {
                    let format = LogFormat::of(json, 1);
                    print_logs(&client, job_id, rank, 0, follow, format).await?;
                }
                None => {
                    let format = LogFormat::of(json, job.nodes);
                    if job.nodes > 1 {
                        print_all_ranks(&client, job_id, job.nodes, follow, format).await?;
                    } else {
                        print_logs(&client, job_id, 0, 0, follow, format).await?;
                    }
                }
            }
            Ok::<(), anyhow::Error>(())
        })
        .map_err(Failure::from)?;
    Ok(0)
}

#[derive(Debug, Args)]
pub struct CancelArgs {
    /// The jobs: ids, array elements (12_3, 12_[1-5]); an array's id
    /// (12) cancels every element of it, as Slurm's scancel does.
    #[arg(required_unless_present_any = ["name", "mine"])]
    pub jobs: Vec<JobRef>,
    /// Every unfinished job of this name (with --mine: of yours only).
    #[arg(long)]
    pub name: Option<String>,
    /// Every unfinished job of yours ($USER) (with --name: of that name).
    #[arg(long)]
    pub mine: bool,
    #[command(flatten)]
    pub connection: Connection,
}

/// Cancels every job named; the exit status is the first failure's (the
/// others are still cancelled).
pub fn cancel(args: CancelArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let rt = runtime()?;
    let mut views = Vec::new();
    let mut status = 0;
    let mut fail = |what: String, error: anyhow::Error| {
        let failure = Failure::from(error);
        eprintln!("error: {what}: {:#}", failure.error);
        if status == 0 {
            status = failure.code;
        }
    };
    let mut ids = Vec::new();
    for reference in &args.jobs {
        let resolved = rt.block_on(async {
            if let JobRef::Job(id) = reference {
                // An array's id names the whole array.
                let job = client.job(*id).await?;
                if job.array.is_some_and(|array| array.job == *id) {
                    let list = client.cancel_array(*id).await?;
                    return Ok::<_, anyhow::Error>((Vec::new(), list.jobs));
                }
            }
            Ok((resolve(&client, reference).await?, Vec::new()))
        });
        match resolved {
            Ok((found, cancelled)) => {
                ids.extend(found);
                for job in cancelled {
                    if !args.connection.json {
                        outln!("job {} {}", job_label(&job), job.state);
                    }
                    views.push(job);
                }
            }
            Err(error) => fail(format!("job {}", reference_text(reference)), error),
        }
    }
    if args.name.is_some() || args.mine {
        let user = if args.mine {
            Some(
                std::env::var("USER")
                    .ok()
                    .filter(|u| !u.is_empty())
                    .ok_or_else(|| anyhow!("--mine: $USER is not set"))?,
            )
        } else {
            None
        };
        let filter = JobFilter {
            user,
            active: true,
            ..JobFilter::default()
        };
        let (jobs, _) = rt
            .block_on(client.all_jobs(&filter, None))
            .map_err(anyhow::Error::from)?;
        let before = ids.len();
        ids.extend(
            jobs.iter()
                .filter(|job| args.name.as_ref().is_none_or(|name| &job.name == name))
                .map(|job| job.id),
        );
        if ids.len() == before {
            eprintln!("no unfinished job matches");
        }
    }
    for &id in &ids {
        match rt.block_on(client.cancel(id)) {
            Ok(job) => {
                if !args.connection.json {
                    outln!("job {} {}", job_label(&job), job.state);
                }
                views.push(job);
            }
            Err(error) => fail(format!("job {id}"), error.into()),
        }
    }
    if args.connection.json {
        print_json(&serde_json::json!({ "jobs": views }))?;
    }
    Ok(status)
}

fn reference_text(reference: &JobRef) -> String {
    match reference {
        JobRef::Job(id) => id.to_string(),
        JobRef::Elements { array, indices } => format!("{array}_[{indices}]"),
    }
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct NodesArgs {
    #[command(subcommand)]
    pub action: Option<NodesAction>,
    /// Show this node in detail (GPUs, free capacity, allocations).
    pub node: Option<String>,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Debug, clap::Subcommand)]
pub enum NodesAction {
    /// Remove a node (admin). Refused while it holds running work unless
    /// --force, which re-queues that work. Its credential goes with it: an
    /// agent still running there joins again as a new node only with the
    /// join token.
    Remove {
        /// The node's name.
        node: String,
        /// Remove it even while it holds work (re-queued).
        #[arg(long)]
        force: bool,
    },
    /// Revoke a node's credential (admin): its agent is refused, and the
    /// join token may register the name again (a reinstalled machine, a
    /// lost state directory, a leaked credential).
    ResetIdentity {
        /// The node's name.
        node: String,
    },
    /// Approve a node that joined under the server's --approve-nodes
    /// (operator): it waits in `pending-approval`, given no work and no
    /// secret, until approved.
    Approve {
        /// The node's name.
        node: String,
    },
    /// Join tokens (admin): what new nodes register with. Each expires,
    /// runs out after its uses, or is revoked; the token is shown once.
    Token {
        #[command(subcommand)]
        action: TokenAction,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum TokenAction {
    /// Make a join token and print it (this once).
    Create {
        /// How long it admits new nodes, e.g. 1h or 7d (default: until
        /// revoked).
        #[arg(long, value_name = "DURATION", value_parser = crate::cli::parse_duration_s)]
        ttl: Option<u64>,
        /// How many nodes may join with it (default: any number).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
        uses: Option<u64>,
        /// The pool the nodes it admits join.
        #[arg(long, value_name = "POOL")]
        pool: Option<String>,
    },
    /// List join tokens with their state (never the tokens).
    List,
    /// Revoke a join token: no new node joins with it.
    Revoke {
        /// Its id (`jt-...`, from `muster nodes token list`).
        id: String,
    },
}

#[derive(Debug, Args)]
pub struct PoolsArgs {
    #[command(subcommand)]
    pub command: Option<PoolCommand>,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Debug, clap::Subcommand)]
pub enum PoolCommand {
    /// Set a pool's own stack policy (admin): `report`, `majority` (a node
    /// that differs from the pool's most common stack takes no new work)
    /// or `required` (a node without the --require'd versions takes none).
    Set {
        pool: String,
        #[arg(long, value_name = "POLICY", default_value = "report", value_parser = ["report", "majority", "required"])]
        stack_policy: String,
        /// COMPONENT=VERSION a node must report (driver, cuda, vbios,
        /// kernel, nccl, container_runtime); repeat for several.
        #[arg(long, value_name = "COMPONENT=VERSION")]
        require: Vec<String>,
        /// A host path container jobs in the pool may mount (with
        /// everything under it); repeat for several.
        #[arg(long, value_name = "PATH")]
        allow_mount: Vec<String>,
        /// An inference pool: its nodes run services' replicas first; other
        /// work runs there only if preemptible, and any replica preempts it
        /// (with its grace period).
        #[arg(long)]
        inference: bool,
    },
    /// Remove a pool's own policy: the server's --stack-policy applies.
    Reset { pool: String },
}

#[derive(Debug, Args)]
pub struct FleetArgs {
    #[command(flatten)]
    pub connection: Connection,
}

fn gpu_summary(node: &NodeView) -> String {
    let total = node.gpus.len();
    let free: f64 = node.gpu_free.iter().map(|&m| f64::from(m) / 1000.0).sum();
    // A node may hold several models: each once, in index order.
    let mut models: Vec<&str> = Vec::new();
    for gpu in &node.gpus {
        if !models.contains(&gpu.model.as_str()) {
            models.push(&gpu.model);
        }
    }
    if total == 0 {
        "-".to_string()
    } else {
        format!("{free:.2}/{total} free {}", models.join("+"))
    }
}

fn describe_node(node: &NodeView) {
    outln!("node {}", node.name);
    outln!(
        "  state:     {}{}",
        node.state,
        if node.draining {
            ", draining"
        } else if node.cordoned {
            ", cordoned"
        } else {
            ""
        }
    );
    outln!("  pool:      {}   rack: {}", node.pool, node.rack);
    outln!("  address:   {}", node.address);
    outln!(
        "  CPUs:      {}   memory: {} GiB",
        node.cpu_milli / 1000,
        node.memory_mib / 1024
    );
    outln!(
        "  software:  {} (driver {}, CUDA {})",
        node.backend,
        node.driver_version.as_deref().unwrap_or("-"),
        node.cuda_version.as_deref().unwrap_or("-")
    );
    outln!("  GPUs:");
    for (gpu, free) in node.gpus.iter().zip(&node.gpu_free) {
        outln!(
            "    {} {} {} GiB, NVLink domain {}, {:.3} free  {}{}",
            gpu.index,
            gpu.model,
            gpu.memory_mib / 1024,
            gpu.nvlink_domain,
            f64::from(*free) / 1000.0,
            gpu.uuid,
            if node.unhealthy_gpus.contains(&gpu.index) {
                "  OUT OF SERVICE"
            } else {
                ""
            }
        );
    }
    for event in &node.gpu_events {
        outln!("  event:     {event}");
    }
    let allocations: Vec<String> = node.allocations.iter().map(u64::to_string).collect();
    outln!(
        "  allocations: {}",
        if allocations.is_empty() {
            "-".to_string()
        } else {
            allocations.join(", ")
        }
    );
}

fn join_token_row(token: &muster_api::protocol::JoinTokenView, now: u64) -> Vec<String> {
    vec![
        token.id.clone(),
        token.state.clone(),
        token
            .expires_ms
            .map_or_else(|| "never".to_string(), |at| clock_text(at, now)),
        match token.max_uses {
            Some(max) => format!("{}/{max}", token.uses),
            None => token.uses.to_string(),
        },
        token.pool.clone().unwrap_or_else(|| "-".to_string()),
        if token.initial {
            "join.token".to_string()
        } else {
            String::new()
        },
    ]
}

const JOIN_TOKEN_HEADER: [&str; 6] = ["ID", "STATE", "EXPIRES", "USES", "POOL", "NOTE"];

fn join_tokens(
    client: &muster_api::client::Client,
    action: &TokenAction,
    json: bool,
) -> Result<u8, Failure> {
    let now = now_ms();
    match action {
        TokenAction::Create { ttl, uses, pool } => {
            let request = muster_api::protocol::JoinTokenCreate {
                ttl_ms: ttl.map(|seconds| seconds.saturating_mul(1000)),
                uses: *uses,
                pool: pool.clone(),
            };
            let made = runtime()?
                .block_on(client.create_join_token(&request))
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&made)?;
            } else {
                outln!("{}", made.token);
                eprintln!(
                    "join token {} ({}); give it to agents with --join-token-file; it is not \
                     shown again",
                    made.join_token.id,
                    match (made.join_token.expires_ms, made.join_token.max_uses) {
                        (Some(at), Some(n)) => format!("expires {}, {n} uses", clock_text(at, now)),
                        (Some(at), None) => format!("expires {}", clock_text(at, now)),
                        (None, Some(n)) => format!("{n} uses, never expires"),
                        (None, None) => "until revoked".to_string(),
                    }
                );
            }
        }
        TokenAction::List => {
            let list = runtime()?
                .block_on(client.join_tokens())
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&list)?;
            } else {
                table(
                    &JOIN_TOKEN_HEADER,
                    list.join_tokens
                        .iter()
                        .map(|token| join_token_row(token, now))
                        .collect(),
                );
            }
        }
        TokenAction::Revoke { id } => {
            let token = runtime()?
                .block_on(client.revoke_join_token(id))
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&token)?;
            } else {
                outln!(
                    "join token {} revoked; nodes that joined with it keep their credentials",
                    token.id
                );
            }
        }
    }
    Ok(0)
}

pub fn nodes(args: NodesArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    match &args.action {
        Some(NodesAction::Remove { node, force }) => {
            let removed = runtime()?
                .block_on(client.remove_node(node, *force))
                .map_err(anyhow::Error::from)?;
            if args.connection.json {
                print_json(&removed)?;
            } else if removed.requeued_jobs.is_empty() {
                outln!("node {} removed", removed.name);
            } else {
                let jobs: Vec<String> = removed.requeued_jobs.iter().map(u64::to_string).collect();
                outln!(
                    "node {} removed; re-queued job(s) {}",
                    removed.name,
                    jobs.join(", ")
                );
            }
            return Ok(0);
        }
        Some(NodesAction::Token { action }) => {
            return join_tokens(&client, action, args.connection.json);
        }
        Some(NodesAction::Approve { node }) => {
            let view = runtime()?
                .block_on(client.node_action(node, "approve"))
                .map_err(anyhow::Error::from)?;
            if args.connection.json {
                print_json(&view)?;
            } else {
                outln!("node {} approved: it takes work now", view.name);
            }
            return Ok(0);
        }
        Some(NodesAction::ResetIdentity { node }) => {
            let view = runtime()?
                .block_on(client.node_action(node, "reset-identity"))
                .map_err(anyhow::Error::from)?;
            if args.connection.json {
                print_json(&view)?;
            } else {
                outln!(
                    "node {}: credential revoked; its agent joins again with the join token",
                    view.name
                );
            }
            return Ok(0);
        }
        None => {}
    }
    if let Some(name) = &args.node {
        let node = runtime()?
            .block_on(client.node(name))
            .map_err(anyhow::Error::from)?;
        if args.connection.json {
            print_json(&node)?;
        } else {
            describe_node(&node);
        }
        return Ok(0);
    }
    let list = runtime()?
        .block_on(client.nodes())
        .map_err(anyhow::Error::from)?;
    if args.connection.json {
        print_json(&list)?;
        return Ok(0);
    }
    table(
        &[
            "NAME", "STATE", "POOL", "RACK", "GPUS", "CPUS", "MEMORY", "BACKEND", "DRIVER", "SEEN",
            "NOTE",
        ],
        list.nodes
            .iter()
            .map(|n| {
                let mut state = n.state.clone();
                if n.draining {
                    state.push_str(",draining");
                } else if n.cordoned {
                    state.push_str(",cordoned");
                }
                vec![
                    n.name.clone(),
                    state,
                    n.pool.clone(),
                    n.rack.clone(),
                    gpu_summary(n),
                    format!("{}", n.cpu_milli / 1000),
                    format!("{}GiB", n.memory_mib / 1024),
                    n.backend.clone(),
                    n.driver_version.clone().unwrap_or_else(|| "-".into()),
                    format!("{} ago", ago(n.last_heartbeat_ms)),
                    n.excluded
                        .as_deref()
                        .map(|why| format!("not scheduled: {why}"))
                        .or_else(|| {
                            n.drift
                                .as_deref()
                                .map(|why| format!("takes no new work: {why}"))
                        })
                        .unwrap_or_default(),
                ]
            })
            .collect(),
    );
    Ok(0)
}

#[derive(Debug, Args)]
pub struct NodeActionArgs {
    /// The node's name.
    pub node: String,
    #[command(flatten)]
    pub connection: Connection,
}

pub fn node_action(args: NodeActionArgs, action: &str) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let node = runtime()?
        .block_on(client.node_action(&args.node, action))
        .map_err(anyhow::Error::from)?;
    if args.connection.json {
        print_json(&node)?;
    } else {
        outln!("node {}: {action} done", node.name);
    }
    Ok(0)
}

pub fn pools(args: PoolsArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let list = match &args.command {
        None => runtime()?.block_on(client.pools()),
        Some(PoolCommand::Set {
            pool,
            stack_policy,
            require,
            allow_mount,
            inference,
        }) => {
            let mut required = std::collections::BTreeMap::new();
            for pair in require {
                let (component, version) = pair.split_once('=').ok_or_else(|| {
                    anyhow::anyhow!(
                        "--require takes COMPONENT=VERSION, like driver=550.90; got {pair:?}"
                    )
                })?;
                required.insert(component.trim().to_string(), version.trim().to_string());
            }
            let update = muster_api::protocol::PoolPolicyUpdate {
                stack_policy: stack_policy.clone(),
                required,
                allowed_mounts: allow_mount.clone(),
                inference: *inference,
            };
            runtime()?.block_on(client.set_pool_policy(pool, &update))
        }
        Some(PoolCommand::Reset { pool }) => runtime()?.block_on(client.remove_pool_policy(pool)),
    }
    .map_err(anyhow::Error::from)?;
    if args.connection.json {
        print_json(&list)?;
        return Ok(0);
    }
    table(
        &[
            "POOL",
            "NODES",
            "SCHEDULABLE",
            "GPUS",
            "FREE GPUS",
            "MODELS",
            "STACK POLICY",
            "SERVICES / BORROWED GPUS",
        ],
        list.pools
            .iter()
            .map(|p| {
                let use_of = if p.inference {
                    format!(
                        "inference: {:.2} / {:.2}",
                        p.service_gpu_milli as f64 / 1000.0,
                        p.borrowed_gpu_milli as f64 / 1000.0
                    )
                } else if p.service_gpu_milli > 0 {
                    format!("{:.2} / -", p.service_gpu_milli as f64 / 1000.0)
                } else {
                    String::new()
                };
                vec![
                    p.name.clone(),
                    p.nodes.to_string(),
                    p.schedulable_nodes.to_string(),
                    p.gpus.to_string(),
                    format!("{:.2}", p.gpu_free_milli as f64 / 1000.0),
                    p.models.join(","),
                    if p.required.is_empty() {
                        p.stack_policy.clone()
                    } else {
                        format!(
                            "{}: {}",
                            p.stack_policy,
                            p.required
                                .iter()
                                .map(|(c, v)| format!("{c}={v}"))
                                .collect::<Vec<_>>()
                                .join(",")
                        )
                    },
                    use_of,
                ]
            })
            .collect(),
    );
    Ok(0)
}

/// `muster fleet`: each pool's software stack and the nodes that differ.
pub fn fleet(args: FleetArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let fleet = runtime()?
        .block_on(client.fleet())
        .map_err(anyhow::Error::from)?;
    if args.connection.json {
        print_json(&fleet)?;
        return Ok(0);
    }
    for pool in &fleet.pools {
        outln!("pool {} ({} nodes)", pool.pool, pool.nodes);
        for (component, version) in &pool.majority {
            let others: Vec<String> = pool
                .versions
                .get(component)
                .into_iter()
                .flatten()
                .filter(|(other, _)| *other != version)
                .map(|(other, count)| format!("{other} on {count}"))
                .collect();
            let count = pool
                .versions
                .get(component)
                .and_then(|counts| counts.get(version))
                .copied()
                .unwrap_or(0);
            outln!(
                "  {component:<18} {version} on {count}{}",
                if others.is_empty() {
                    String::new()
                } else {
                    format!("; also {}", others.join(", "))
                }
            );
        }
        if pool.drift.is_empty() {
            outln!("  every node has the pool's stack");
        } else {
            outln!("  differing:");
            for drift in &pool.drift {
                outln!(
                    "    {:<20} {} {} (the pool's: {})",
                    drift.node,
                    drift.component,
                    drift.version,
                    drift.expected
                );
            }
        }
    }
    Ok(0)
}

#[derive(Debug, Args)]
pub struct QueuesArgs {
    #[command(subcommand)]
    pub command: Option<QueueCommand>,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Debug, clap::Subcommand)]
pub enum QueueCommand {
    /// Create or change a queue (admin). Only what is given changes; a new
    /// queue starts with no guarantee, unlimited borrowing and weight 1.
    Set {
        name: String,
        /// GPUs the queue may always use.
        #[arg(long)]
        guaranteed: Option<f64>,
        /// GPUs it may borrow above its guarantee, or `unlimited`.
        #[arg(long, value_name = "GPUS", value_parser = parse_limit)]
        borrow_limit: Option<Limit>,
        /// Fair-share weight.
        #[arg(long)]
        weight: Option<u32>,
        /// Stop the queue's jobs once their GPUs have stayed below 5% this
        /// long (e.g. 30m, for notebook queues; 0 never); they end
        /// `idle_stopped`.
        #[arg(long, value_name = "DURATION")]
        idle_timeout: Option<String>,
        /// Its jobs count as idle once their GPUs stay below --idle-below
        /// this long (default: the server's --idle-after).
        #[arg(long, value_name = "DURATION")]
        idle_after: Option<String>,
        /// Below this utilisation (percent) its jobs' GPUs count as idle
        /// (default 5).
        #[arg(long, value_name = "PERCENT")]
        idle_below: Option<u32>,
        /// Monthly GPU budget in the price list's currency (`muster
        /// prices`); past it `describe`, `submit` and metrics warn.
        #[arg(long, value_name = "AMOUNT")]
        budget: Option<f64>,
        /// Past the budget the queue's new jobs wait (`budget exhausted`)
        /// instead of only a warning (`--budget-hard false` warns only).
        #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
        budget_hard: Option<bool>,
        /// Its members may read (not cancel) each other's jobs.
        #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
        members_see_jobs: Option<bool>,
        /// The most jobs (array elements one each) the queue may have
        /// pending, or `unlimited`; past it a submission is refused.
        #[arg(long, value_name = "N", value_parser = parse_count_limit)]
        max_pending: Option<CountLimit>,
        /// The highest priority class its users may submit (operators and
        /// admins are not limited; default normal).
        #[arg(long, value_name = "CLASS", value_parser = ["low", "normal", "high", "critical"])]
        max_priority_class: Option<String>,
        /// Its users may submit non-preemptible jobs.
        #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
        allow_non_preemptible: Option<bool>,
    },
}

/// A limit of GPUs, or none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    Gpus(f64),
    Unlimited,
}

fn parse_limit(text: &str) -> Result<Limit, String> {
    match text.trim() {
        "unlimited" | "none" => Ok(Limit::Unlimited),
        number => number
            .parse::<f64>()
            .map(Limit::Gpus)
            .map_err(|_| format!("{text:?} is neither a number of GPUs nor `unlimited`")),
    }
}

/// A count, or no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountLimit {
    At(u64),
    Unlimited,
}

fn parse_count_limit(text: &str) -> Result<CountLimit, String> {
    match text.trim() {
        "unlimited" | "none" => Ok(CountLimit::Unlimited),
        number => number
            .parse::<u64>()
            .map(CountLimit::At)
            .map_err(|_| format!("{text:?} is neither a whole number nor `unlimited`")),
    }
}

/// The queue as `current` has it, with what `set` gives changed (a new
/// queue from the defaults).
fn queue_update(
    current: Option<&muster_api::protocol::QueueView>,
    set: &QueueCommand,
) -> QueueUpdate {
    let QueueCommand::Set {
        guaranteed,
        borrow_limit,
        weight,
        idle_timeout,
        idle_after,
        idle_below,
        budget,
        budget_hard,
        members_see_jobs,
        max_pending,
        max_priority_class,
        allow_non_preemptible,
        ..
    } = set;
    let seconds = |s: Option<u64>| s.map(|s| format!("{s}s"));
    QueueUpdate {
        guaranteed_gpus: guaranteed.unwrap_or(current.map_or(0.0, |q| q.guaranteed_gpus)),
        borrow_limit_gpus: match borrow_limit {
            Some(Limit::Gpus(gpus)) => Some(*gpus),
            Some(Limit::Unlimited) => None,
            None => current.and_then(|q| q.borrow_limit_gpus),
        },
        weight: weight.unwrap_or(current.map_or(1, |q| q.weight)),
        idle_timeout: idle_timeout
            .clone()
            .or_else(|| seconds(current.and_then(|q| q.idle_timeout_s))),
        idle_after: idle_after
            .clone()
            .or_else(|| seconds(current.and_then(|q| q.idle_after_s))),
        idle_below_pct: idle_below.or(current.and_then(|q| q.idle_below_pct)),
        budget: budget.or(current.and_then(|q| q.budget)),
        budget_hard: budget_hard.unwrap_or(current.is_some_and(|q| q.budget_hard)),
        members_see_jobs: members_see_jobs.unwrap_or(current.is_some_and(|q| q.members_see_jobs)),
        max_pending: match max_pending {
            Some(CountLimit::At(n)) => Some(*n),
            Some(CountLimit::Unlimited) => None,
            None => current.and_then(|q| q.max_pending),
        },
        max_priority_class: max_priority_class
            .clone()
            .or_else(|| current.map(|q| q.max_priority_class.clone()))
            .filter(|class| !class.is_empty()),
        allow_non_preemptible: allow_non_preemptible
            .unwrap_or(current.is_some_and(|q| q.allow_non_preemptible)),
    }
}

pub fn queues(args: QueuesArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let rt = runtime()?;
    if let Some(set @ QueueCommand::Set { name, .. }) = &args.command {
        let queues = rt.block_on(client.queues()).map_err(anyhow::Error::from)?;
        let current = queues.queues.iter().find(|queue| &queue.name == name);
        let update = queue_update(current, set);
        let queue = rt
            .block_on(client.set_queue(name, &update))
            .map_err(anyhow::Error::from)?;
        if args.connection.json {
            print_json(&queue)?;
        } else {
            outln!("queue {} set", queue.name);
        }
        return Ok(0);
    }
    let list = rt.block_on(client.queues()).map_err(anyhow::Error::from)?;
    if args.connection.json {
        print_json(&list)?;
        return Ok(0);
    }
    table(
        &[
            "QUEUE",
            "GUARANTEED",
            "BORROW LIMIT",
            "WEIGHT",
            "IN USE",
            "RUNNING",
            "PENDING",
            "IDLE WHEN",
            "IDLE TIMEOUT",
            "SPENT / BUDGET (MONTH)",
        ],
        list.queues
            .iter()
            .map(|q| {
                vec![
                    q.name.clone(),
                    format!("{}", q.guaranteed_gpus),
                    q.borrow_limit_gpus
                        .map_or("unlimited".to_string(), |b| b.to_string()),
                    q.weight.to_string(),
                    if q.borrowed_gpus > 0.0 {
                        format!("{} ({} borrowed)", q.in_use_gpus, q.borrowed_gpus)
                    } else {
                        format!("{}", q.in_use_gpus)
                    },
                    q.running_jobs.to_string(),
                    q.pending_jobs.to_string(),
                    match (q.idle_below_pct, q.idle_after_s) {
                        (None, None) => "default".to_string(),
                        (below, after) => format!(
                            "<{}% for {}",
                            below.unwrap_or(5),
                            after.map_or("default".to_string(), |s| ago_text(s * 1000))
                        ),
                    },
                    q.idle_timeout_s
                        .map_or("-".to_string(), |s| ago_text(s * 1000)),
                    match q.budget {
                        Some(budget) => format!(
                            "{:.2} / {budget:.2}{}",
                            q.spent_this_month,
                            if q.budget_hard { " (hard)" } else { "" }
                        ),
                        None => format!("{:.2}", q.spent_this_month),
                    },
                ]
            })
            .collect(),
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(gpus: &str, command: &[&str]) -> RunArgs {
        RunArgs {
            gpus: gpus.to_string(),
            nodes: 1,
            queue: None,
            name: None,
            cpus: None,
            memory: None,
            priority_class: None,
            gpu_models: Vec::new(),
            env: vec!["A=1".into()],
            detach: false,
            time: None,
            idle_timeout: None,
            secrets: Vec::new(),
            waiting: WaitingArgs::default(),
            export: "NONE".into(),
            command: command.iter().map(|s| s.to_string()).collect(),
            connection: Connection {
                server: None,
                token: None,
                token_file: None,
                ca_sha256: None,
                json: false,
            },
        }
    }

    #[test]
    fn run_builds_a_valid_spec_named_after_the_program() {
        let spec = run_spec(&run_args("0.25", &["/usr/bin/Python3", "x.py"])).unwrap();
        assert_eq!(spec["name"], "python3");
        assert_eq!(spec["gpus"], 0.25);
        assert_eq!(spec["env"]["A"], "1");
    }

    #[test]
    fn run_rejects_bad_gpus_with_a_clear_message() {
        let error = run_spec(&run_args("lots", &["true"]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("--gpus"), "{error}");
    }
}

#[cfg(test)]
mod export_tests {
    use super::exported;
    use std::ffi::OsString;

    fn shell() -> impl Iterator<Item = (OsString, OsString)> {
        [
            ("PATH", "/venv/bin:/usr/bin"),
            ("VIRTUAL_ENV", "/venv"),
            ("HOME", "/home/alice"),
            ("MUSTER_TOKEN", "secret"),
            ("CUDA_VISIBLE_DEVICES", "3"),
            ("SSH_AUTH_SOCK", "/tmp/x"),
            ("BASH_FUNC_f%%", "() { :; }"),
            ("MYVAR", "hello"),
        ]
        .into_iter()
        .map(|(k, v)| (OsString::from(k), OsString::from(v)))
    }

    #[test]
    fn gpu_counts_read_as_written() {
        assert_eq!(super::gpus_text(8.0), "8");
        assert_eq!(super::gpus_text(0.25), "0.25");
        assert_eq!(super::gpus_text(0.005), "0.005");
        assert_eq!(super::gpus_text(0.0), "0");
    }

    #[test]
    fn all_sends_the_shell_but_never_muster_s_own_or_per_login_variables() {
        let sent = exported("ALL", shell()).expect("exported");
        let names: Vec<&str> = sent.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["MYVAR", "PATH", "VIRTUAL_ENV"]);
    }

    #[test]
    fn none_and_lists_limit_it_and_a_missing_name_is_an_error() {
        assert!(exported("none", shell()).expect("none").is_empty());
        let sent = exported("PATH, MYVAR", shell()).expect("a list");
        assert_eq!(
            sent,
            [
                ("PATH".to_string(), "/venv/bin:/usr/bin".to_string()),
                ("MYVAR".to_string(), "hello".to_string())
            ]
        );
        let error = exported("NOPE", shell()).expect_err("unset");
        assert!(error.to_string().contains("not set"), "{error}");
        let error = exported("MUSTER_TOKEN", shell()).expect_err("reserved");
        assert!(error.to_string().contains("muster sets it"), "{error}");
    }
}
