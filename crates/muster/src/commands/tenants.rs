//! `muster users`, `muster login` and `muster audit`.

use super::{Connection, Failure, ago, config_path, print_json, runtime, table, write_out};
use anyhow::Context;
use clap::Args;
use muster_api::protocol::UserCreate;
use std::io::Read;

#[derive(Debug, Args)]
pub struct UsersArgs {
    #[command(subcommand)]
    pub command: Option<UserCommand>,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Debug, clap::Subcommand)]
pub enum UserCommand {
    /// Make a user (admin) and print its token, this once.
    Add {
        name: String,
        /// `user` (its own jobs, in its queues), `operator` (also nodes,
        /// pools, every job) or `admin` (everything).
        #[arg(long, default_value = "user", value_parser = ["user", "operator", "admin"])]
        role: String,
        /// The queues a user may submit to, comma-separated (default:
        /// `default`).
        #[arg(long, value_delimiter = ',')]
        queues: Vec<String>,
    },
    /// List users (never their tokens).
    List,
    /// Remove a user: its token stops working at once.
    Remove { name: String },
    /// A new token for a user (printed once); the old one stops working.
    RotateToken { name: String },
    /// Set a user's own limits (admin); only what is given changes.
    Set {
        name: String,
        /// The most jobs (array elements one each) it may have pending, or
        /// `default` (the server's --max-pending-per-user for a user, none
        /// for operators and admins).
        #[arg(long, value_name = "N")]
        max_pending: Option<String>,
    },
}

pub fn users(args: UsersArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let rt = runtime()?;
    let json = args.connection.json;
    match args.command.unwrap_or(UserCommand::List) {
        UserCommand::Add { name, role, queues } => {
            let made = rt
                .block_on(client.add_user(&UserCreate { name, role, queues }))
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&made)?;
            } else {
                outln!("{}", made.token);
                eprintln!(
                    "user {} ({}) made; its token is above, shown this once: give it to the \
                     user, who runs `muster login --server URL` and pastes it",
                    made.user.name, made.user.role
                );
            }
        }
        UserCommand::Set { name, max_pending } => {
            let list = rt.block_on(client.users()).map_err(anyhow::Error::from)?;
            let current = list.users.iter().find(|user| user.name == name);
            let max_pending = match max_pending.as_deref() {
                None => current.and_then(|user| user.max_pending),
                Some("default") => None,
                Some(text) => Some(text.trim().parse::<u64>().map_err(|_| {
                    anyhow::anyhow!("--max-pending {text:?}: a whole number, or `default`")
                })?),
            };
            let user = rt
                .block_on(
                    client
                        .set_user_limits(&name, &muster_api::protocol::UserLimits { max_pending }),
                )
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&user)?;
            } else {
                outln!(
                    "user {}: at most {} pending",
                    user.name,
                    user.max_pending.map_or_else(
                        || "the server's default for its role".to_string(),
                        |max| format!("{max} jobs")
                    )
                );
            }
        }
        UserCommand::RotateToken { name } => {
            let made = rt
                .block_on(client.rotate_token(&name))
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&made)?;
            } else {
                outln!("{}", made.token);
                eprintln!(
                    "user {}: new token above (the old one no longer works)",
                    name
                );
            }
        }
        UserCommand::Remove { name } => {
            let gone = rt
                .block_on(client.remove_user(&name))
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&gone)?;
            } else {
                outln!("user {} removed", gone.name);
            }
        }
        UserCommand::List => {
            let list = rt.block_on(client.users()).map_err(anyhow::Error::from)?;
            if json {
                print_json(&list)?;
            } else {
                table(
                    &["USER", "ROLE", "QUEUES", "GROUP", "MADE"],
                    list.users
                        .iter()
                        .map(|user| {
                            vec![
                                user.name.clone(),
                                user.role.clone(),
                                if user.queues.is_empty() {
                                    "(all)".to_string()
                                } else {
                                    user.queues.join(",")
                                },
                                user.task_group
                                    .map_or_else(|| "-".to_string(), |n| n.to_string()),
                                format!("{} ago", ago(user.created_ms)),
                            ]
                        })
                        .collect(),
                );
            }
        }
    }
    Ok(0)
}

#[derive(Debug, Args)]
pub struct LoginArgs {
    /// The token from `--token-file FILE` (or `--token`); else standard
    /// input.
    #[command(flatten)]
    pub connection: Connection,
}

/// Checks a token against the server and keeps it (and the server) in the
/// client config, readable by its owner only.
pub fn login(args: LoginArgs) -> Result<u8, Failure> {
    let token = match (&args.connection.token, &args.connection.token_file) {
        (Some(token), _) => token.clone(),
        (None, Some(file)) => crate::commands::read_token_file(file)?,
        (None, None) => {
            eprintln!("paste the token and press Enter (or end with Ctrl-D):");
            let mut text = String::new();
            std::io::stdin()
                .lock()
                .take(4096)
                .read_to_string(&mut text)
                .context("cannot read the token from standard input")?;
            text.lines().next().unwrap_or_default().to_string()
        }
    };
    let token = token.trim().to_string();
    if token.is_empty() {
        return Err(anyhow::anyhow!("no token given").into());
    }
    let connection = Connection {
        token: Some(token.clone()),
        ..args.connection.clone()
    };
    let client = connection.client()?;
    let me = runtime()?
        .block_on(client.whoami())
        .map_err(anyhow::Error::from)?;
    let path = config_path();
    let mut config: serde_json::Value = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_else(|| serde_json::json!({}));
    let same_server = config["server"].as_str() == Some(client.base());
    config["server"] = client.base().into();
    config["token"] = token.into();
    // How the server is trusted from now on: the fingerprint or CA file
    // this login used.
    let fingerprint = args
        .connection
        .ca_sha256
        .clone()
        .or_else(|| std::env::var("MUSTER_CA_SHA256").ok());
    let ca_file = std::env::var_os("MUSTER_CA_FILE").map(std::path::PathBuf::from);
    if let Some(object) = config.as_object_mut() {
        object.remove("token_file");
        if fingerprint.is_some() || ca_file.is_some() || !same_server {
            object.remove("ca_sha256");
            object.remove("ca_file");
        }
    }
    if let Some(fingerprint) = fingerprint {
        config["ca_sha256"] = muster_api::tls::Fingerprint::parse(&fingerprint)
            .map_err(|e| anyhow::anyhow!(e))?
            .to_string()
            .into();
    } else if let Some(file) = ca_file {
        config["ca_file"] = std::path::absolute(&file)
            .unwrap_or(file)
            .display()
            .to_string()
            .into();
    } else if !same_server && client.base().starts_with("https://") {
        let local = super::default_data_dir().join("tls/ca.pem");
        if local.exists() {
            config["ca_file"] = local.display().to_string().into();
        }
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    write_private(
        &path,
        &serde_json::to_string_pretty(&config).unwrap_or_default(),
    )
    .with_context(|| format!("cannot write {}", path.display()))?;
    outln!(
        "logged in to {} as {} ({}); the token is kept in {}",
        client.base(),
        me.name,
        me.role,
        path.display()
    );
    Ok(0)
}

/// Writes `text` to `path`, readable and writable by its owner only.
fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    file.write_all(text.as_bytes())
}

#[derive(Debug, Args)]
pub struct AuditArgs {
    /// How far back (24h, 30d).
    #[arg(long, default_value = "24h")]
    pub since: String,
    /// Only this user's requests (`admin`, a user, `node:NAME`).
    #[arg(long)]
    pub user: Option<String>,
    /// At most this many entries.
    #[arg(long, default_value_t = 1000)]
    pub limit: u32,
    #[command(flatten)]
    pub connection: Connection,
}

/// The audit log (admin): who changed what, from where, allowed or not.
pub fn audit(args: AuditArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let list = runtime()?
        .block_on(client.audit(&args.since, args.user.as_deref(), args.limit))
        .map_err(anyhow::Error::from)?;
    if args.connection.json {
        print_json(&list)?;
        return Ok(0);
    }
    table(
        &[
            "WHEN", "WHO", "ACTION", "OBJECT", "FROM", "STATUS", "ALLOWED",
        ],
        list.entries
            .iter()
            .map(|entry| {
                vec![
                    format!("{} ago", ago(entry.at_ms)),
                    entry.who.clone(),
                    entry.action.clone(),
                    entry.object.clone(),
                    entry.origin.clone(),
                    entry.status.to_string(),
                    if entry.allowed { "yes" } else { "REFUSED" }.to_string(),
                ]
            })
            .collect(),
    );
    Ok(0)
}

#[derive(Debug, Args)]
pub struct SecretsArgs {
    #[command(subcommand)]
    pub command: Option<SecretCommand>,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Debug, clap::Subcommand)]
pub enum SecretCommand {
    /// Set a secret (admin); its value is read from standard input (one
    /// trailing newline dropped), never from the command line.
    Set {
        name: String,
        /// Only this queue's jobs may use it (default: every queue's).
        #[arg(long)]
        queue: Option<String>,
    },
    /// List secrets (names and queues; never values).
    List,
    /// Remove a secret.
    Remove {
        name: String,
        #[arg(long)]
        queue: Option<String>,
    },
}

pub fn secrets(args: SecretsArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let rt = runtime()?;
    let json = args.connection.json;
    match args.command.unwrap_or(SecretCommand::List) {
        SecretCommand::Set { name, queue } => {
            let mut value = String::new();
            std::io::stdin()
                .lock()
                .take(64 * 1024 + 2)
                .read_to_string(&mut value)
                .context("cannot read the secret from standard input")?;
            let value = value
                .strip_suffix('\n')
                .map(|v| v.strip_suffix('\r').unwrap_or(v))
                .unwrap_or(&value)
                .to_string();
            if value.is_empty() {
                return Err(anyhow::anyhow!(
                    "no value on standard input (e.g. `muster secrets set hf < token.txt`)"
                )
                .into());
            }
            let set = rt
                .block_on(client.set_secret(&name, &value, queue.as_deref()))
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&set)?;
            } else {
                outln!(
                    "secret {} set{}",
                    set.name,
                    set.queue
                        .map_or(" for every queue".to_string(), |q| format!(
                            " for queue {q}"
                        ))
                );
            }
        }
        SecretCommand::Remove { name, queue } => {
            let gone = rt
                .block_on(client.remove_secret(&name, queue.as_deref()))
                .map_err(anyhow::Error::from)?;
            if json {
                print_json(&gone)?;
            } else {
                outln!("secret {} removed", gone.name);
            }
        }
        SecretCommand::List => {
            let list = rt.block_on(client.secrets()).map_err(anyhow::Error::from)?;
            if json {
                print_json(&list)?;
            } else {
                table(
                    &["SECRET", "QUEUE", "SET"],
                    list.secrets
                        .iter()
                        .map(|secret| {
                            vec![
                                secret.name.clone(),
                                secret
                                    .queue
                                    .clone()
                                    .unwrap_or_else(|| "(every queue)".into()),
                                format!("{} ago", ago(secret.updated_ms)),
                            ]
                        })
                        .collect(),
                );
            }
        }
    }
    Ok(0)
}
