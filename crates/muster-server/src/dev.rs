//! Dev environments (`muster dev`, docs/services.md): jobs whose command is
//! [`muster_model::DEV_SESSION_COMMAND`], listed per user, and the tunnels
//! that carry `muster dev shell` and `muster dev forward` to them through
//! the agents' own connections: the user's request is upgraded and held,
//! the node's next heartbeat answer names the tunnel, its agent opens it
//! (`POST /v1/agents/{node}/tunnels/{id}`, upgraded) and joins it to the
//! environment's session helper, and the server joins the two.

use crate::api::{Identity, principal_of, unprocessable};
use crate::core::{Shared, now};
use crate::error::{ApiError, PathParams};
use axum::Json;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use muster_api::protocol::{DevList, DevView, ErrorBody, ErrorCode, TunnelOpen};
use muster_control::JobState;
use muster_model::JobId;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Shared_ = State<Arc<Shared>>;

/// How long a user's connection waits for the node's agent to open its
/// tunnel.
const OPEN_WAIT: Duration = Duration::from_secs(15);
/// The most tunnels waiting to be opened at once.
const MAX_PENDING: usize = 1_000;

/// Tunnels one user may have waiting for their agents at once, so that no
/// user takes the others' share of [`MAX_PENDING`].
const MAX_PENDING_PER_USER: usize = 32;
/// A warning shows this long before an idle environment is stopped (or a
/// third of its idle limit, if less).
const WARN_BEFORE: Duration = Duration::from_secs(15 * 60);

struct Pending {
    /// Who asked (at most [`MAX_PENDING_PER_USER`] each).
    user: String,
    node: String,
    port: u16,
    container: Option<muster_api::protocol::TunnelTask>,
    asked: Instant,
    /// Sent in a heartbeat answer.
    sent: bool,
    opened: tokio::sync::oneshot::Sender<hyper::upgrade::OnUpgrade>,
}

/// Tunnels asked for and not yet opened by their agent (memory only).
#[derive(Default)]
pub struct Tunnels {
    next: u64,
    pending: BTreeMap<u64, Pending>,
}

impl std::fmt::Debug for Tunnels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tunnels")
            .field("pending", &self.pending.len())
            .finish()
    }
}

fn tunnels(shared: &Shared) -> std::sync::MutexGuard<'_, Tunnels> {
    match shared.tunnels.lock() {
        Ok(tunnels) => tunnels,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// The tunnels node `node` must open, each named once (for its heartbeat
/// answer).
pub fn to_open(shared: &Shared, node: &str) -> Vec<TunnelOpen> {
    let mut tunnels = tunnels(shared);
    tunnels
        .pending
        .retain(|_, pending| pending.asked.elapsed() < OPEN_WAIT && !pending.opened.is_closed());
    tunnels
        .pending
        .iter_mut()
        .filter(|(_, pending)| pending.node == node && !pending.sent)
        .map(|(&id, pending)| {
            pending.sent = true;
            TunnelOpen {
                id,
                port: pending.port,
                container: pending.container,
            }
        })
        .collect()
}

/// The token of dev environment `job` (derived from the server's key; only
/// its task's environment and the server know it).
pub fn token(shared: &Shared, job: JobId) -> String {
    match shared.secrets.lock() {
        Ok(secrets) => secrets.derive("dev-session", job.0),
        Err(poisoned) => poisoned.into_inner().derive("dev-session", job.0),
    }
}

/// A node's agent opens tunnel `id` (its own token): upgraded, and handed
/// to the user's connection that waits for it.
#[utoipa::path(
    post, path = "/v1/agents/{node}/tunnels/{id}", tag = "agents",
    params(
        ("node" = String, Path, description = "the node's name"),
        ("id" = u64, Path, description = "the tunnel, from a heartbeat answer"),
    ),
    responses(
        (status = 101, description = "upgraded: the bytes of a dev session"),
        (status = 404, description = "no such tunnel waits for this node", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn open_tunnel(
    State(shared): Shared_,
    PathParams((node, id)): PathParams<(String, String)>,
    mut request: Request,
) -> Result<Response, ApiError> {
    let id: u64 = id
        .parse()
        .map_err(|_| ApiError::invalid(format!("tunnel {id:?} is not a number")))?;
    let pending = {
        let mut tunnels = tunnels(&shared);
        match tunnels.pending.get(&id) {
            Some(pending) if pending.node == node => tunnels.pending.remove(&id),
            _ => None,
        }
    };
    let Some(pending) = pending else {
        return Err(ApiError::not_found(format!(
            "no tunnel {id} waits for node {node} (it was given up: the user waited {}s)",
            OPEN_WAIT.as_secs()
        )));
    };
    if !upgrading(&request) {
        return Err(ApiError::invalid(format!(
            "a tunnel is an upgrade: send `Connection: upgrade` and `Upgrade: {}`",
            muster_api::client::TUNNEL_PROTOCOL
        )));
    }
    let upgrade = hyper::upgrade::on(&mut request);
    let _ = pending.opened.send(upgrade);
    Ok(switching())
}

fn upgrading(request: &Request) -> bool {
    request
        .headers()
        .get(hyper::header::UPGRADE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.eq_ignore_ascii_case(muster_api::client::TUNNEL_PROTOCOL))
}

fn switching() -> Response {
    (
        StatusCode::SWITCHING_PROTOCOLS,
        [
            (hyper::header::CONNECTION, "upgrade"),
            (hyper::header::UPGRADE, muster_api::client::TUNNEL_PROTOCOL),
        ],
    )
        .into_response()
}

/// The caller's running dev environment `name`.
type Environment = (JobId, String, u16, Option<muster_api::protocol::TunnelTask>);

fn environment(shared: &Shared, identity: &Identity, name: &str) -> Result<Environment, ApiError> {
    let principal = principal_of(identity)?;
    let core = shared.read();
    let control = core.control();
    let job = control
        .jobs()
        .rev()
        .find(|job| {
            job.spec.is_dev_environment()
                && job.spec.name == name
                && job.user == principal.name
                && !job.state.is_final()
        })
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "{} has no dev environment {name}; `muster dev list` lists them, `muster dev \
                 start {name}` starts one",
                principal.name
            ))
        })?;
    let allocation = job
        .allocations
        .first()
        .and_then(|id| control.allocation(*id))
        .filter(|allocation| allocation.state == muster_control::AllocationState::Running)
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "dev environment {name} (job {}) is {}, not running yet; `muster describe \
                     {}` says why",
                    job.id.0,
                    job.state.name(),
                    job.id.0
                ),
            )
        })?;
    let port = control.master_port(job.id);
    let container = job
        .spec
        .image
        .is_some()
        .then_some(muster_api::protocol::TunnelTask {
            job: job.id.0,
            allocation: allocation.id.0,
            generation: allocation.generation,
        });
    Ok((job.id, allocation.node.0.clone(), port, container))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ConnectKind {
    Shell,
    Forward,
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ConnectQuery {
    /// `shell` (a shell on a terminal) or `forward` (to `port`).
    #[param(inline)]
    kind: ConnectKind,
    /// For `forward`: the port in the environment.
    #[param(minimum = 1, maximum = 65535)]
    port: Option<u16>,
    #[param(maximum = 65535)]
    rows: Option<u16>,
    #[param(maximum = 65535)]
    cols: Option<u16>,
    /// The terminal type (`TERM`).
    #[param(max_length = 63)]
    term: Option<String>,
}

/// Connects to the caller's dev environment `name` (an upgrade): a shell,
/// or a forwarded port, through its node's agent.
#[utoipa::path(
    get, path = "/v1/dev/{name}/connect", tag = "dev",
    params(("name" = String, Path, description = "the environment"), ConnectQuery),
    responses(
        (status = 101, description = "upgraded: the session's bytes (its first line `ok` or `refused: why`)"),
        (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 422, description = "not an upgrade (`Connection: upgrade`, `Upgrade: muster-tunnel`), or a forward without a port", body = ErrorBody),
        (status = 503, description = "not running yet, or its agent did not open the tunnel in time", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn connect(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(name): PathParams<String>,
    crate::error::Params(query): crate::error::Params<ConnectQuery>,
    mut request: Request,
) -> Result<Response, ApiError> {
    let header = match query.kind {
        ConnectKind::Shell => serde_json::json!({
            "kind": "shell",
            "rows": query.rows.unwrap_or(24).max(1),
            "cols": query.cols.unwrap_or(80).max(1),
            "term": query.term.clone().unwrap_or_else(|| "xterm-256color".into()),
        }),
        ConnectKind::Forward => serde_json::json!({
            "kind": "forward",
            "port": query.port.filter(|port| *port > 0).ok_or_else(|| {
                unprocessable("forward: say which port of the environment (port=8888)")
            })?,
        }),
    };
    if !upgrading(&request) {
        return Err(unprocessable(format!(
            "a dev connection is an upgrade: send `Connection: upgrade` and `Upgrade: {}` \
             (`muster dev shell` and `muster dev forward` do)",
            muster_api::client::TUNNEL_PROTOCOL
        )));
    }
    let user = principal_of(&identity)?.name;
    // A task just placed is reported running within a heartbeat.
    let started = Instant::now();
    let (job, node, port, container) = loop {
        match environment(&shared, &identity, &name) {
            Err(error)
                if error.body.code == ErrorCode::Unavailable
                    && started.elapsed() < Duration::from_secs(10) =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => break other?,
        }
    };
    let (opened, waiting) = tokio::sync::oneshot::channel();
    {
        let mut tunnels = tunnels(&shared);
        if tunnels.pending.len() >= MAX_PENDING {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                "too many dev connections are being opened; try again in a moment",
            ));
        }
        if tunnels
            .pending
            .values()
            .filter(|pending| pending.user == user)
            .count()
            >= MAX_PENDING_PER_USER
        {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "you have {MAX_PENDING_PER_USER} dev connections being opened; wait for \
                     them to open or fail"
                ),
            ));
        }
        tunnels.next += 1;
        let id = tunnels.next;
        tunnels.pending.insert(
            id,
            Pending {
                user: user.clone(),
                node: node.clone(),
                port,
                container,
                asked: Instant::now(),
                sent: false,
                opened,
            },
        );
    }
    // Wake the node's long poll: its answer names the tunnel.
    shared
        .lock()
        .wake_node(&muster_model::NodeName(node.clone()));
    let agent = match tokio::time::timeout(OPEN_WAIT, waiting).await {
        Ok(Ok(agent)) => agent,
        _ => {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "the agent of node {node} did not open the connection within {}s (is it \
                     connected? `muster nodes {node}`)",
                    OPEN_WAIT.as_secs()
                ),
            ));
        }
    };
    let user = hyper::upgrade::on(&mut request);
    let token = token(&shared, job);
    tokio::spawn(async move {
        let (agent, user) = match tokio::join!(agent, user) {
            (Ok(agent), Ok(user)) => (agent, user),
            _ => return,
        };
        let mut agent = TokioIo::new(agent);
        let mut user = TokioIo::new(user);
        let mut first = header;
        first["token"] = token.into();
        let mut line = first.to_string().into_bytes();
        line.push(b'\n');
        if tokio::io::AsyncWriteExt::write_all(&mut agent, &line)
            .await
            .is_err()
        {
            return;
        }
        let _ = tokio::io::copy_bidirectional(&mut user, &mut agent).await;
    });
    tracing::info!(environment = %name, job = job.0, %node, "dev connection opened");
    Ok(switching())
}

/// The caller's dev environments (an admin's or operator's: everyone's).
#[utoipa::path(
    get, path = "/v1/dev", tag = "dev",
    responses((status = 200, body = DevList)),
    security(("bearer" = []))
)]
pub async fn list(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
) -> Result<Json<DevList>, ApiError> {
    let principal = principal_of(&identity)?;
    let usage = match shared.usage.lock() {
        Ok(usage) => usage.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    };
    let at = now().0;
    let core = shared.read();
    let control = core.control();
    let environments = control
        .jobs()
        .rev()
        .filter(|job| job.spec.is_dev_environment())
        .filter(|job| principal.role != crate::users::Role::User || job.user == principal.name)
        .map(|job| {
            let idle_limit = control.idle_timeout_of(job);
            let idle_for = muster_control::usage::idle_for_ms(control, &usage, job, at, 0)
                .filter(|_| job.state == JobState::Running);
            let lifetime = job.spec.max_runtime;
            let started = job.started.map(|time| time.0);
            let mut warnings = Vec::new();
            if let (Some(limit), Some(idle)) = (idle_limit, idle_for) {
                let limit_ms = limit.as_millis() as u64;
                let warn_ms = (WARN_BEFORE.as_millis() as u64)
                    .min(limit_ms / 3)
                    .max(1_000);
                if idle + warn_ms >= limit_ms {
                    warnings.push(format!(
                        "its GPUs have been idle for {}s: it stops in {}s unless they are used",
                        idle / 1000,
                        limit_ms.saturating_sub(idle) / 1000
                    ));
                }
            }
            if let (Some(lifetime), Some(started)) = (lifetime, started)
                && job.state == JobState::Running
            {
                let end = started + lifetime.as_millis() as u64;
                let left = end.saturating_sub(at);
                let warn_ms = (WARN_BEFORE.as_millis() as u64)
                    .min(lifetime.as_millis() as u64 / 3)
                    .max(1_000);
                if left <= warn_ms {
                    warnings.push(format!(
                        "it reaches its maximum lifetime in {}s",
                        left / 1000
                    ));
                }
            }
            DevView {
                name: job.spec.name.clone(),
                job: job.id.0,
                user: job.user.clone(),
                state: job.state.name().to_string(),
                node: job
                    .allocations
                    .first()
                    .and_then(|id| control.allocation(*id))
                    .map(|allocation| allocation.node.0.clone()),
                gpus: f64::from(job.spec.gpus_per_node.total().0) / 1000.0,
                image: job.spec.image.clone(),
                started_ms: started,
                idle_limit_s: idle_limit.map(|limit| limit.as_secs()),
                idle_for_s: idle_for.map(|idle| idle / 1000),
                max_lifetime_s: lifetime.map(|lifetime| lifetime.as_secs()),
                warning: (!warnings.is_empty()).then(|| warnings.join("; ")),
            }
        })
        .take(1_000)
        .collect();
    Ok(Json(DevList { environments }))
}
