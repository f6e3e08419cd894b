//! The `/v1` HTTP API: routes, authentication, handlers and the OpenAPI
//! document. Handlers translate between the wire and the control plane;
//! they decide nothing themselves.

use crate::auth::{bearer, new_token, same_token};
use crate::core::{Core, Shared, now};
use crate::error::{ApiError, Body, MAX_BODY_BYTES, Params, PathParams};
use crate::records::QueueRecord;
use crate::store::Batch;
use crate::views::{desired_view, empty_queue_view, job_view, node_view, queue_views};
use axum::Json;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use muster_api::protocol::*;
use muster_control::{Allocation, AllocationId, Input, Job, JobState, Observed, Software};
use muster_model::{
    CpuMilli, GpuMilli, GpuModel, GpuSpec, JobId, MemoryMib, NodeName, NodeSpec, PoolName,
    QueueName, QueueSpec, RackName,
};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use utoipa::OpenApi;

mod agents;

type Shared_ = State<Arc<Shared>>;

/// The longest a heartbeat is held (long poll).
const MAX_HEARTBEAT_WAIT: Duration = Duration::from_secs(30);
/// The longest a log read is held when following.
const LOG_FOLLOW_WAIT: Duration = Duration::from_secs(10);
/// The most log bytes returned at once.
const MAX_LOG_READ: usize = 1024 * 1024;
/// The built-in admin's name (the admin token's user).
pub(crate) const DEFAULT_USER: &str = "admin";
/// The header naming the user a job is submitted for.
pub const USER_HEADER: &str = "x-muster-user";

pub fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/jobs", post(submit_job).get(list_jobs))
        .route("/v1/jobs/{id}", get(get_job))
        .route("/v1/jobs/{id}/cancel", post(cancel_job))
        .route("/v1/jobs/{id}/logs", get(job_logs))
        .route("/v1/jobs/{id}/usage", get(crate::accounting::job_usage))
        .route("/v1/cost", get(crate::accounting::cost_endpoint))
        .route(
            "/v1/users",
            post(crate::users::create_user).get(crate::users::list_users),
        )
        .route("/v1/users/{name}", delete(crate::users::remove_user))
        .route("/v1/users/{name}/limits", post(crate::users::set_limits))
        .route(
            "/v1/join-tokens",
            post(crate::jointokens::create_join_token).get(crate::jointokens::list_join_tokens),
        )
        .route(
            "/v1/join-tokens/{id}/revoke",
            post(crate::jointokens::revoke_join_token),
        )
        .route(
            "/v1/users/{name}/rotate-token",
            post(crate::users::rotate_token),
        )
        .route("/v1/whoami", get(crate::users::whoami))
        .route("/v1/secrets", get(crate::secrets::list_secrets))
        .route(
            "/v1/secrets/{name}",
            put(crate::secrets::set_secret).delete(crate::secrets::remove_secret),
        )
        .route("/v1/audit", get(crate::users::audit))
        .route("/v1/prices", get(crate::accounting::list_prices))
        .route(
            "/v1/prices/{model}",
            put(crate::accounting::set_price).delete(crate::accounting::remove_price),
        )
        .route("/v1/arrays/{id}/cancel", post(cancel_array))
        .route(
            "/v1/services",
            post(crate::services::create_service).get(crate::services::list_services),
        )
        .route(
            "/v1/services/{name}",
            get(crate::services::get_service)
                .put(crate::services::update_service)
                .delete(crate::services::delete_service),
        )
        .route(
            "/v1/services/{name}/scale",
            post(crate::services::scale_service),
        )
        .route(
            "/v1/services/{name}/rollback",
            post(crate::services::rollback_service),
        )
        .route(
            "/v1/services/{name}/endpoints",
            get(crate::services::service_endpoints),
        )
        .route("/v1/endpoints", get(crate::services::endpoint_table))
        .route("/v1/traffic", post(crate::services::report_traffic))
        .route("/v1/dev", get(crate::dev::list))
        .route("/v1/dev/{name}/connect", get(crate::dev::connect))
        .route(
            "/v1/agents/{node}/tunnels/{id}",
            post(crate::dev::open_tunnel),
        )
        .route(
            "/v1/agents/{node}/checks",
            post(crate::services::agent_checks),
        )
        .route("/v1/nodes", get(list_nodes))
        .route("/v1/nodes/{name}", get(get_node).delete(remove_node))
        .route("/v1/nodes/{name}/telemetry", get(node_history))
        .route("/v1/nodes/{name}/reset-identity", post(reset_identity))
        .route("/v1/nodes/{name}/cordon", post(cordon_node))
        .route("/v1/nodes/{name}/uncordon", post(uncordon_node))
        .route("/v1/nodes/{name}/approve", post(approve_node))
        .route("/v1/nodes/{name}/drain", post(drain_node))
        .route("/v1/pools", get(list_pools))
        .route(
            "/v1/pools/{name}/policy",
            put(set_pool_policy).delete(remove_pool_policy),
        )
        .route("/v1/fleet", get(fleet))
        .route("/v1/queues", get(list_queues))
        .route("/v1/queues/{name}", put(set_queue))
        .route("/v1/agents/register", post(agents::register_agent))
        .route("/v1/agents/{node}/heartbeat", post(agents::heartbeat))
        .route("/v1/agents/{node}/logs", post(agents::push_logs))
        .route("/v1/agents/{node}/telemetry", post(agents::push_telemetry))
        .merge(crate::dashboard::routes(shared.clone()))
        .route_layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            time_request,
        ))
        .fallback(no_such_endpoint)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            authenticate,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

/// Times each request of a known route, for `muster_api_request_seconds`.
async fn time_request(State(shared): Shared_, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(String::new, |path| path.as_str().to_string());
    let method = request.method().as_str().to_string();
    let started = std::time::Instant::now();
    let response = next.run(request).await;
    shared
        .instruments
        .request_seconds
        .get_or_create(&vec![("route", route), ("method", method)])
        .observe(started.elapsed().as_secs_f64());
    response
}

/// Prometheus metrics (OpenMetrics text): the GPUs under DCGM's names, with
/// the job, queue and user holding each, and muster's own series. The
/// metrics token or the admin token.
async fn metrics(State(shared): Shared_) -> Response {
    let telemetry = match shared.telemetry.lock() {
        Ok(telemetry) => telemetry.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    };
    // Tens of milliseconds at thousands of GPUs: off the async threads.
    let usage = match shared.usage.lock() {
        Ok(usage) => usage.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    };
    let spent = shared.accounting.spent_by_queue();
    let rendering = Arc::clone(&shared);
    let rendered = tokio::task::spawn_blocking(move || {
        let core = rendering.read();
        crate::metrics::render(
            core.control(),
            &telemetry,
            &usage,
            rendering.settings.idle_after_ms,
            &rendering.instruments,
            &spent,
            now().0,
        )
    })
    .await;
    match rendered {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                crate::metrics::CONTENT_TYPE,
            )],
            text,
        )
            .into_response(),
        Err(error) => ApiError::new(
            ErrorCode::Internal,
            format!("the metrics could not be rendered: {error}"),
        )
        .into_response(),
    }
}

/// Liveness, and whether the server takes changes: 503 with the reason
/// once a commit to its store failed (it is read-only until restarted).
async fn healthz(State(shared): Shared_) -> Response {
    match shared.read_only_reason() {
        None => "ok".into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("read-only: a commit to the store failed: {reason}"),
        )
            .into_response(),
    }
}

async fn no_such_endpoint(request: Request) -> ApiError {
    ApiError::not_found(format!(
        "no endpoint {} {}; GET /v1/openapi.json lists them",
        request.method(),
        request.uri().path()
    ))
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::invalid(format!(
        "{} is not accepted on {}; GET /v1/openapi.json lists the methods",
        request.method(),
        request.uri().path()
    ))
    .with_status(StatusCode::METHOD_NOT_ALLOWED)
}

// ---------------------------------------------------------------- auth

/// Who a request comes from, by its token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The admin token in the data directory (the built-in `admin`).
    Admin,
    /// A join token (its id), valid or not: registration says why not.
    Join(String),
    Node(String),
    /// The metrics token: `/metrics` (and the dashboard, read-only) only.
    Metrics,
    /// A user made with `muster users add`.
    User(crate::users::Principal),
}

impl Identity {
    /// The principal of a user or the admin (`None`: agents, metrics).
    pub fn principal(&self) -> Option<crate::users::Principal> {
        match self {
            Identity::Admin => Some(crate::users::Principal::admin()),
            Identity::User(principal) => Some(principal.clone()),
            Identity::Join(_) | Identity::Node(_) | Identity::Metrics => None,
        }
    }

    /// How the audit log names it.
    pub fn audit_name(&self) -> String {
        match self {
            Identity::Admin => DEFAULT_USER.to_string(),
            Identity::Join(id) => format!("join:{id}"),
            Identity::Node(node) => format!("node:{node}"),
            Identity::Metrics => "metrics".to_string(),
            Identity::User(principal) => principal.name.clone(),
        }
    }
}

/// What an endpoint needs.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Need {
    Nothing,
    /// A user of at least this role (the admin token is an admin).
    Role(crate::users::Role),
    /// The join token (a new node) or a node's own credential.
    Register,
    Node(String),
    /// The admin or the metrics token.
    Metrics,
}

/// What `method` on `path` needs. Routes not named here need an admin, so
/// a new route is closed until it is given its place.
fn need_of(method: &axum::http::Method, path: &str) -> Need {
    use crate::users::Role;
    use axum::http::Method;
    if path == "/metrics" {
        return Need::Metrics;
    }
    if path == "/healthz" || path == "/v1/openapi.json" || !path.starts_with("/v1/") {
        return Need::Nothing;
    }
    if path == "/v1/agents/register" {
        return Need::Register;
    }
    if let Some(rest) = path.strip_prefix("/v1/agents/") {
        let node = rest.split('/').next().unwrap_or_default();
        return Need::Node(node.to_string());
    }
    let parts: Vec<&str> = path.trim_end_matches('/').split('/').skip(2).collect();
    let read = method == Method::GET;
    let role = match (parts.as_slice(), read) {
        // Jobs: anyone with a user token; who may see or touch which job
        // is checked by the handler (its own, its queue's, or any for
        // operators and admins).
        (["jobs"], _) | (["jobs", _], true) | (["jobs", _, "logs" | "usage"], true) => Role::User,
        (["jobs", _, "cancel"] | ["arrays", _, "cancel"], false) => Role::User,
        (["whoami"], true) => Role::User,
        // Services: any user; the handlers show a user only their own and
        // let only the owner or staff change one.
        (["services"] | ["services", _] | ["services", _, "endpoints"], true) => Role::User,
        // Every service's endpoints: the gateway's (an operator's token).
        (["endpoints"], true) => Role::Operator,
        (["services"] | ["services", _] | ["services", _, "scale" | "rollback"], false) => {
            Role::User
        }
        (["nodes"] | ["nodes", _] | ["nodes", _, "telemetry"], true) => Role::User,
        (["pools"] | ["fleet"] | ["queues"] | ["prices"], true) => Role::User,
        // Nodes and pools are the operators'.
        (["nodes", _], false) | (["nodes", _, _], false) => Role::Operator,
        (["pools", _, "policy"], false) => Role::Operator,
        (["cost"], true) => Role::Operator,
        // Dev environments: a user's own (the handlers check).
        (["dev"] | ["dev", _, "connect"], true) => Role::User,
        // Gateways' traffic moves autoscaled services: not for any user.
        (["traffic"], false) => Role::Operator,
        _ => Role::Admin,
    };
    Need::Role(role)
}

pub(crate) fn identify(shared: &Shared, token: &str) -> Option<Identity> {
    if same_token(token, &shared.admin_token) {
        return Some(Identity::Admin);
    }
    if let Some(record) = shared
        .join_tokens
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .of_token(token)
    {
        return Some(Identity::Join(record.id.clone()));
    }
    if same_token(token, &shared.metrics_token) {
        return Some(Identity::Metrics);
    }
    // Nodes first: their heartbeats are most of the requests.
    if let Some(name) = shared.read().node_of_token(token) {
        return Some(Identity::Node(name.0.clone()));
    }
    shared
        .users()
        .of_token(token)
        .map(|user| Identity::User(crate::users::Principal::of(user)))
}

// Answers name files by their name in the server's data directory, never
// by their path on the server.
async fn authenticate(State(shared): Shared_, request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let origin = request
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map_or_else(|| "-".to_string(), |info| info.0.ip().to_string());
    let impersonated = request
        .headers()
        .get(USER_HEADER)
        .and_then(|value| value.to_str().ok())
        .map(str::to_string);
    let (who, response) = authorize(&shared, request, next).await;
    // Refusals of requests without a known token are logged at most 5 a
    // second (bursts of 100): anyone can send them, and each would be a
    // row kept for the audit retention.
    let anonymous = who.starts_with('(');
    let logged = audited(&method, &path)
        && (!anonymous || {
            let limit = crate::ratelimit::RateLimit {
                per_second: 5.0,
                burst: 100.0,
            };
            let taken = match shared.limiter.lock() {
                Ok(mut limiter) => {
                    limiter.take(limit, "(anonymous audit)", std::time::Instant::now())
                }
                Err(poisoned) => poisoned.into_inner().take(
                    limit,
                    "(anonymous audit)",
                    std::time::Instant::now(),
                ),
            };
            if taken.is_err() {
                shared.instruments.audit_dropped.inc();
            }
            taken.is_ok()
        });
    if logged {
        let status = response.status().as_u16();
        let who = match impersonated {
            Some(user) if who == DEFAULT_USER && user != DEFAULT_USER => {
                format!("{who} (as {user})")
            }
            _ => who,
        };
        shared.audit(crate::store::AuditEntry {
            at_ms: now().0,
            who,
            action: format!("{method} {}", route_template(&path)),
            object: path.chars().take(512).collect(),
            origin,
            status,
            allowed: status != 401 && status != 403,
        });
    }
    response
}

/// Whether a request goes into the audit log: every change, but an agent's
/// heartbeats, logs and telemetry (hundreds a second, and not a person's
/// doing; registrations are logged).
fn audited(method: &axum::http::Method, path: &str) -> bool {
    use axum::http::Method;
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return false;
    }
    !(path.starts_with("/v1/agents/") && path != "/v1/agents/register")
}

/// A path with its ids and names as placeholders (`/v1/jobs/{id}/cancel`).
fn route_template(path: &str) -> String {
    let mut parts: Vec<String> = path.split('/').map(str::to_string).collect();
    if parts.len() > 3 && parts[1] == "v1" {
        let placeholder = match parts[2].as_str() {
            "jobs" | "arrays" | "join-tokens" => "{id}",
            "nodes" | "queues" | "pools" | "users" | "agents" | "secrets" => "{name}",
            "prices" => "{model}",
            _ => "",
        };
        if !placeholder.is_empty() && parts[3] != "register" {
            parts[3] = placeholder.to_string();
        }
    }
    parts.join("/").chars().take(256).collect()
}

/// Checks the token against what the route needs; runs the request if it
/// may. Answers who it was (for the audit log) and the response.
async fn authorize(shared: &Shared, mut request: Request, next: Next) -> (String, Response) {
    use crate::users::Role;
    let need = need_of(request.method(), request.uri().path());
    if need == Need::Nothing {
        return ("-".to_string(), next.run(request).await);
    }
    let Some(token) = bearer(request.headers()) else {
        return (
            "(no token)".to_string(),
            refused(
                request,
                ApiError::new(
                    ErrorCode::Unauthenticated,
                    "missing bearer token: pass --token, set MUSTER_TOKEN or `muster login` (the \
                 admin token is the file admin.token in the server's data directory; `muster` \
                 also reads ~/.local/share/muster/admin.token)",
                ),
            )
            .await,
        );
    };
    let Some(identity) = identify(shared, token) else {
        return (
            "(unknown token)".to_string(),
            refused(
                request,
                ApiError::new(
                    ErrorCode::Unauthenticated,
                    "invalid token: pass --token or set MUSTER_TOKEN to your user's token (`muster \
                 users add` prints it once; an admin may rotate it) or the admin token \
                 (admin.token in the server's data directory); agents join with the join token \
                 (join.token there) and then use their own node credential",
                ),
            )
            .await,
        );
    };
    let who = identity.audit_name();
    // Users' (and scrapers') requests are limited per token; agents pace
    // their own.
    if let (Some(limit), false) = (
        shared.settings.rate_limit,
        matches!(need, Need::Register | Need::Node(_)),
    ) {
        let key = crate::users::token_hash(token);
        let taken = match shared.limiter.lock() {
            Ok(mut limiter) => limiter.take(limit, &key, std::time::Instant::now()),
            Err(poisoned) => poisoned
                .into_inner()
                .take(limit, &key, std::time::Instant::now()),
        };
        if let Err(wait) = taken {
            let seconds = wait.as_secs_f64().ceil().max(1.0) as u64;
            let mut response = ApiError::new(
                ErrorCode::ResourceExhausted,
                format!(
                    "too many requests with this token ({} a second, bursts of {}); retry in \
                     {seconds} s",
                    limit.per_second, limit.burst
                ),
            )
            .into_response();
            if let Ok(value) = axum::http::HeaderValue::from_str(&seconds.to_string()) {
                response
                    .headers_mut()
                    .insert(axum::http::header::RETRY_AFTER, value);
            }
            return (who, refused(request, response).await);
        }
    }
    let denied = match (&need, &identity) {
        (Need::Register, Identity::Join(_) | Identity::Node(_))
        | (Need::Metrics, Identity::Admin | Identity::Metrics) => None,
        (Need::Metrics, Identity::User(principal)) if principal.role >= Role::Operator => None,
        (Need::Role(_), Identity::Admin) => None,
        (Need::Role(needed), Identity::User(principal)) => (principal.role < *needed).then(|| {
            let with_article = |role: Role| match role {
                Role::User => "a user",
                Role::Operator => "an operator",
                Role::Admin => "an admin",
            };
            format!(
                "{} is {}; this needs {} (an admin makes users of each role: `muster users add \
                 NAME --role ROLE`)",
                principal.name,
                with_article(principal.role),
                with_article(*needed)
            )
        }),
        (Need::Metrics, _) => Some(
            "/metrics takes the metrics token (metrics.token in the server's data directory) \
             or the admin token"
                .to_string(),
        ),
        (_, Identity::Metrics) => Some(
            "the metrics token only reads /metrics and the dashboard; use a user's token for \
             this"
                .to_string(),
        ),
        (Need::Node(wanted), Identity::Node(node)) if wanted == node => None,
        (Need::Node(wanted), Identity::Node(node)) => Some(format!(
            "this token belongs to node {node}, not to node {wanted}"
        )),
        (Need::Node(_), _) => Some(
            "agent endpoints need the node credential that registration returned; register \
             first"
                .to_string(),
        ),
        (Need::Register, _) => Some(
            "agents register with the join token (a new node) or their node credential".to_string(),
        ),
        (Need::Role(_), Identity::Join(_)) => Some(
            "the join token only registers agents; use a user's token or the admin token \
             (admin.token in the server's data directory) for this"
                .to_string(),
        ),
        (Need::Role(_), Identity::Node(_)) => Some(
            "a node credential is only for that node's registration, heartbeats and logs; use \
             a user's token or the admin token (admin.token in the server's data directory)"
                .to_string(),
        ),
        (Need::Nothing, _) => None,
    };
    match denied {
        Some(message) => (
            who,
            refused(request, ApiError::new(ErrorCode::PermissionDenied, message)).await,
        ),
        None => {
            request.extensions_mut().insert(identity);
            (who, next.run(request).await)
        }
    }
}

/// A refusal of a request whose body was not read: the body is read (up
/// to the 1 MiB limit, for at most 5 s) and dropped first, so the
/// connection closes cleanly; closing on unread bytes makes the kernel
/// reset it, and the client never sees the answer (over TLS, an "EOF in
/// violation of protocol").
async fn refused(request: Request, refusal: impl IntoResponse) -> Response {
    let body = request.into_body();
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        axum::body::to_bytes(body, MAX_BODY_BYTES),
    )
    .await;
    refusal.into_response()
}

// ---------------------------------------------------------------- helpers

fn parse_job_id(text: &str) -> Result<JobId, ApiError> {
    text.parse::<u64>()
        .ok()
        .filter(|id| i64::try_from(*id).is_ok())
        .ok_or(())
        .map(JobId)
        .map_err(|_| ApiError::invalid(format!("a job id is a number, got {text:?}")))
}

fn job_not_found(id: JobId) -> ApiError {
    ApiError::not_found(format!("no job {id}; `muster ps` lists jobs"))
}

fn node_not_found(name: &str) -> ApiError {
    ApiError::not_found(format!("no node {name}; `muster nodes` lists nodes"))
}

/// Letters, digits, '-', '_' and '.', starting with a letter or digit, as
/// the job spec's names.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= muster_api::MAX_NAME_LENGTH
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn check_name(what: &str, name: &str) -> Result<(), ApiError> {
    if is_plain_name(name) {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "{what} must be 1 to {} letters, digits, '-', '_' or '.', starting with a letter or \
             digit, got {name:?}",
            muster_api::MAX_NAME_LENGTH
        )))
    }
}

// ---------------------------------------------------------------- jobs

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct JobQuery {
    /// Only jobs not finished (pending, running, stopping).
    pub(crate) active: Option<bool>,
    /// Only jobs of this queue.
    pub(crate) queue: Option<String>,
    /// Only jobs in this state (pending, running, stopping, succeeded,
    /// failed, cancelled, timed_out, idle_stopped), or a comma list.
    #[param(
        pattern = "^$|^(pending|running|stopping|succeeded|failed|cancelled|timed_out|idle_stopped)(,(pending|running|stopping|succeeded|failed|cancelled|timed_out|idle_stopped))*$"
    )]
    pub(crate) state: Option<String>,
    /// Only jobs of this user.
    pub(crate) user: Option<String>,
    /// The most jobs to return: 1 to 1000, 100 by default.
    #[param(minimum = 1, maximum = 1000)]
    pub(crate) limit: Option<u32>,
    /// Where the previous page ended (its `next_cursor`).
    #[param(pattern = "^$|^[0-9]{1,18}$")]
    pub(crate) cursor: Option<String>,
    /// Only the elements of this array job.
    pub(crate) array: Option<u64>,
}

/// The default page of `GET /v1/jobs`.
const DEFAULT_PAGE: u32 = 100;
/// The largest page of `GET /v1/jobs`.
const MAX_PAGE: u32 = 1000;

/// Adds what telemetry says of jobs the server holds in memory: each
/// task's GPU usage, and how long a running job has been idle.
fn with_usage(shared: &Shared, views: &mut [JobView]) {
    let core = shared.read();
    let usage = match shared.usage.lock() {
        Ok(usage) => usage,
        Err(poisoned) => poisoned.into_inner(),
    };
    let pulling = match shared.pulling.lock() {
        Ok(pulling) => pulling,
        Err(poisoned) => poisoned.into_inner(),
    };
    let now_ms = now().0;
    for view in views {
        for task in &mut view.tasks {
            task.pulling = pulling
                .get(&task.node)
                .and_then(|tasks| tasks.get(&task.allocation))
                .filter(|_| task.state == "running" || task.state == "assigned")
                .cloned();
            if task.pulling.is_some() {
                task.state = "pulling".to_string();
            }
            task.usage = usage
                .get(&task.node)
                .and_then(|node| node.get(&task.allocation))
                .map(|found| muster_api::protocol::TaskUsage {
                    samples: found.samples,
                    mean_utilization_pct: found.utilization_sum as f64
                        / found.samples.max(1) as f64,
                    peak_utilization_pct: found.peak_utilization,
                    peak_memory_mib: found.peak_memory_mib,
                    idle_since_ms: found.idle_since_ms,
                });
        }
        view.idle_for_s = muster_control::usage::idle_for(
            view.state == "running",
            view.tasks
                .iter()
                .map(|task| task.usage.as_ref().and_then(|u| u.idle_since_ms)),
            now_ms,
            core.control()
                .queues()
                .find(|queue| queue.name.0 == view.queue)
                .and_then(|queue| queue.idle_after)
                .map_or(shared.settings.idle_after_ms, |after| {
                    u64::try_from(after.as_millis()).unwrap_or(u64::MAX)
                }),
        )
        .map(|ms| ms / 1000);
        view.warnings.clear();
        let finished = JobState::parse(&view.state).is_some_and(JobState::is_final);
        if !finished
            && let Some(queue) = core
                .control()
                .queues()
                .find(|queue| queue.name.0 == view.queue)
            && let Some(warning) = crate::accounting::budget_warning(shared, queue)
        {
            view.warnings.push(warning);
        }
    }
}

/// A job and every attempt's allocations, from memory or, once retired,
/// from the store.
pub(crate) struct FoundJob {
    job: Job,
    allocations: BTreeMap<AllocationId, Allocation>,
    /// Why it waits, as a code (pending jobs of the hot state only).
    pending_code: Option<&'static str>,
    /// Its start forecast (pending jobs of the hot state only).
    forecast: Option<muster_sched::StartForecast>,
}

impl FoundJob {
    fn view(&self) -> JobView {
        job_view(
            &self.job,
            &|id| self.allocations.get(&id),
            self.pending_code,
            self.forecast,
        )
    }

    fn from_store((record, allocations): crate::store::StoredJob) -> Result<FoundJob, ApiError> {
        let internal = |error: crate::records::RecordError| {
            ApiError::new(ErrorCode::Internal, error.to_string())
        };
        let job = record.into_job().map_err(internal)?;
        let allocations = allocations
            .into_iter()
            .map(|record| record.into_allocation().map(|a| (a.id, a)))
            .collect::<Result<_, _>>()
            .map_err(internal)?;
        Ok(FoundJob {
            job,
            allocations,
            pending_code: None,
            forecast: None,
        })
    }
}

async fn find_job(shared: &Shared, id: JobId) -> Result<FoundJob, ApiError> {
    {
        let core = shared.read();
        if let Some(job) = core.control().job(id) {
            return Ok(FoundJob {
                job: job.clone(),
                allocations: core
                    .control()
                    .job_allocations(id)
                    .map(|a| (a.id, a.clone()))
                    .collect(),
                pending_code: core.control().pending_code(id),
                forecast: core.control().start_forecast(id),
            });
        }
    }
    match shared.store.retired_job(id.0).await? {
        Some(stored) => FoundJob::from_store(stored),
        None => Err(job_not_found(id)),
    }
}

/// The principal of a request's identity (the authentication layer lets
/// only users and the admin reach the job routes).
pub(crate) fn principal_of(identity: &Identity) -> Result<crate::users::Principal, ApiError> {
    identity.principal().ok_or_else(|| {
        ApiError::new(
            ErrorCode::PermissionDenied,
            "this needs a user's token or the admin token",
        )
    })
}

/// Whether `queue` lets its members see each other's jobs.
fn members_see_jobs(shared: &Shared, queue: &str) -> bool {
    shared
        .read()
        .control()
        .queues()
        .any(|spec| spec.name.0 == queue && spec.members_see_jobs)
}

/// Job `id` as `identity` may see it: a job it may not read is answered
/// as one that does not exist (its existence is not told).
pub(crate) async fn visible_job(
    shared: &Shared,
    identity: &Identity,
    id: JobId,
) -> Result<FoundJob, ApiError> {
    let principal = principal_of(identity)?;
    let found = find_job(shared, id).await?;
    let queue = found.job.spec.queue.0.as_str();
    if principal.may_read(&found.job.user, queue, members_see_jobs(shared, queue)) {
        Ok(found)
    } else {
        Err(job_not_found(id))
    }
}

/// Whether `identity` may cancel job `id`: its own, or any for an admin
/// (one it may not even read is not found).
async fn may_cancel(shared: &Shared, identity: &Identity, id: JobId) -> Result<(), ApiError> {
    let found = visible_job(shared, identity, id).await?;
    let principal = principal_of(identity)?;
    if principal.may_cancel(&found.job.user) {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorCode::PermissionDenied,
            format!(
                "job {id} is {}'s: only its user or an admin may cancel it",
                found.job.user
            ),
        ))
    }
}

/// Dependencies on jobs that left the hot state (ended longer ago than the
/// retention) are settled here from the store: met ones are dropped, one
/// that can no longer be met or names no job is refused, so the control
/// plane only ever waits for jobs it holds.
async fn resolve_retired_dependencies(
    shared: &Shared,
    spec: &mut muster_model::JobSpec,
) -> Result<(), ApiError> {
    let retired: Vec<muster_model::Dependency> = {
        let core = shared.read();
        spec.after
            .iter()
            .filter(|dependency| core.control().dependency_targets(dependency.job).is_empty())
            .copied()
            .collect()
    };
    for dependency in retired {
        let job = match shared.store.retired_job(dependency.job.0).await? {
            Some(stored) => FoundJob::from_store(stored)?.job,
            None => {
                return Err(ApiError::invalid(format!(
                    "after: there is no job {}; name a job that exists (muster ps --all)",
                    dependency.job
                )));
            }
        };
        // An array job's dependency is on every element: read them all
        // (their ids are the array's range).
        let ended: Vec<Job> = match job.array.filter(|a| a.array == dependency.job) {
            Some(array) if array.count > 1 => {
                let filter = crate::store::JobFilter::default();
                let mut elements = Vec::new();
                for stored in shared
                    .store
                    .retired_jobs(
                        &filter,
                        Some(dependency.job.0 + u64::from(array.count)),
                        Some(dependency.job.0 - 1),
                        array.count,
                    )
                    .await?
                {
                    elements.push(FoundJob::from_store(stored)?.job);
                }
                elements
            }
            _ => vec![job],
        };
        let ended: Vec<&Job> = ended.iter().collect();
        if let Some(why) = muster_control::never_met_by(&dependency, &ended) {
            return Err(ApiError::invalid(why));
        }
        spec.after.retain(|d| d.job != dependency.job);
    }
    Ok(())
}

/// Submit a job. Answers once the job is durable.
#[utoipa::path(
    post, path = "/v1/jobs", tag = "jobs",
    request_body = SubmitRequest,
    params(("x-muster-user" = Option<String>, Header, description = "the user the job runs for (an admin's only; default: the token's user)", pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses(
        (status = 201, description = "accepted and saved", body = SubmitResponse),
        (status = 400, description = "the body is not a submission (not JSON, unknown or mistyped fields outside the spec)", body = ErrorBody),
        (status = 413, description = "body over 1 MiB", body = ErrorBody),
        (status = 422, description = "the spec is refused: every problem, one per line (values this document cannot state, such as a GPU share with several nodes, an estimate over max_runtime, an array's indices, a secret or job that does not exist); or no registered node could ever hold the job (unless `allow_pending`)", body = ErrorBody),
        (status = 503, description = "not saved: the store failed (the server is read-only)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
async fn submit_job(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    headers: axum::http::HeaderMap,
    Body(request): Body<SubmitRequest>,
) -> Result<(StatusCode, Json<SubmitResponse>), ApiError> {
    let principal = principal_of(&identity)?;
    // The job is the token's user's; only an admin may submit for another
    // (and the audit log says so).
    let user = match headers.get(USER_HEADER) {
        None => principal.name.clone(),
        Some(value) => {
            let user = value
                .to_str()
                .map_err(|_| ApiError::invalid(format!("the {USER_HEADER} header is not text")))?;
            check_name("the user", user)?;
            if user != principal.name && principal.role != crate::users::Role::Admin {
                return Err(ApiError::new(
                    ErrorCode::PermissionDenied,
                    format!(
                        "{} may submit only as itself; only an admin may submit for {user}",
                        principal.name
                    ),
                ));
            }
            user.to_string()
        }
    };
    let spec = muster_api::parse_job_spec_value(&request.spec)
        .map_err(|errors| unprocessable(errors.to_string()))?;
    if spec.service.is_some() {
        return Err(unprocessable(
            "service: set by muster on a service's replicas, not by a submission; create a \
             service with `muster services create -f SPEC` (docs/services.md)",
        ));
    }
    crate::secrets::check_spec(&shared, &spec).map_err(as_unprocessable)?;
    check_mounts(&shared, &spec)?;
    if !principal.member_of(&spec.queue.0) {
        return Err(ApiError::new(
            ErrorCode::PermissionDenied,
            format!(
                "{} may submit to queue(s) {}, not {}; an admin adds queues with `muster users \
                 add {} --queues ...`",
                principal.name,
                principal.queues.clone().unwrap_or_default().join(", "),
                spec.queue,
                principal.name
            ),
        ));
    }
    // A retry with the same key answers the job the first request made.
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(value) => {
            let key = value.to_str().unwrap_or_default().to_string();
            crate::idempotency::check_key(&key).map_err(ApiError::invalid)?;
            Some(key)
        }
    };
    if let Some(key) = &key {
        let claim = match shared.idempotency.lock() {
            Ok(mut keys) => keys.claim(&user, key, now().0),
            Err(poisoned) => poisoned.into_inner().claim(&user, key, now().0),
        };
        match claim {
            crate::idempotency::Claim::Go => {}
            crate::idempotency::Claim::Made(job) => {
                let elements = find_job(&shared, JobId(job))
                    .await
                    .ok()
                    .and_then(|found| found.job.array.map(|a| a.count));
                return Ok((
                    StatusCode::OK,
                    Json(SubmitResponse {
                        id: job,
                        elements,
                        warnings: vec![format!(
                            "the Idempotency-Key was used within 24 hours: this is job {job}, \
                             made by the first request"
                        )],
                    }),
                ));
            }
            crate::idempotency::Claim::Busy => {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    "a request with this Idempotency-Key is being submitted; retry in a moment",
                ));
            }
        }
    }
    let limits = SubmitLimits {
        max_pending: shared
            .users()
            .get(&principal.name)
            .and_then(|record| record.max_pending)
            .or(match principal.role {
                crate::users::Role::User => shared.settings.max_pending_per_user,
                _ => None,
            }),
        ordinary: principal.role == crate::users::Role::User,
        max_dev: match principal.role {
            crate::users::Role::User => shared.settings.max_dev_per_user,
            _ => None,
        },
    };
    let result = submit_spec(
        &shared,
        spec,
        user.clone(),
        request.allow_pending,
        key.as_deref(),
        Some(limits),
    )
    .await;
    if let Some(key) = &key {
        let mut keys = match shared.idempotency.lock() {
            Ok(keys) => keys,
            Err(poisoned) => poisoned.into_inner(),
        };
        match &result {
            Ok((_, response)) => keys.made(&user, key, response.id, now().0),
            Err(_) => keys.release(&user, key),
        }
    }
    result
}

/// A job spec the document's grammar lets through but a rule it states in
/// words refuses (a value out of range for another field, an array's
/// indices, a secret or job that does not exist, a job no node could ever
/// hold): 422, with the code `invalid_argument` and every problem.
/// A job's host mounts must be allowed by the pool it names (its
/// operator's `--allow-mount`); a job with mounts names its pool.
pub(crate) fn check_mounts(shared: &Shared, spec: &muster_model::JobSpec) -> Result<(), ApiError> {
    if spec.mounts.is_empty() {
        return Ok(());
    }
    let Some(pool) = &spec.pool else {
        return Err(unprocessable(
            "mounts: a job with mounts names its pool (`pool: NAME`): each pool's operator \
             decides which host paths containers on its nodes may mount",
        ));
    };
    let policy = shared.read().control().stack_policy_of(pool);
    let refused: Vec<&str> = spec
        .mounts
        .iter()
        .filter(|mount| !policy.allows_mount(&mount.source))
        .map(|mount| mount.source.as_str())
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    Err(unprocessable(format!(
        "mounts: pool {pool} does not allow mounting {} (it allows {}); an admin allows a path \
         with `muster pools set {pool} --stack-policy {} --allow-mount PATH`",
        refused.join(", "),
        if policy.mounts.is_empty() {
            "none".to_string()
        } else {
            policy.mounts.join(", ")
        },
        policy.stack.name()
    )))
}

pub(crate) fn unprocessable(message: impl Into<String>) -> ApiError {
    ApiError::invalid(message).with_status(StatusCode::UNPROCESSABLE_ENTITY)
}

fn as_unprocessable(error: ApiError) -> ApiError {
    if error.body.code == ErrorCode::InvalidArgument {
        error.with_status(StatusCode::UNPROCESSABLE_ENTITY)
    } else {
        error
    }
}

/// Submits a parsed spec for `user`; with an idempotency key, the key is
/// written in the same commit as the job.
/// What limits a submission: its user's pending jobs, and whether the
/// queue's rules for ordinary users apply (see
/// `ControlPlane::admission`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SubmitLimits {
    pub max_pending: Option<u64>,
    pub ordinary: bool,
    pub max_dev: Option<u64>,
}

/// Submits `spec` as `user`; `limits` are checked in the submission's own
/// commit (`None`: the server's own submissions, a service's replicas).
pub(crate) async fn submit_spec(
    shared: &Arc<Shared>,
    mut spec: muster_model::JobSpec,
    user: String,
    allow_pending: bool,
    key: Option<&str>,
    limits: Option<SubmitLimits>,
) -> Result<(StatusCode, Json<SubmitResponse>), ApiError> {
    resolve_retired_dependencies(shared, &mut spec)
        .await
        .map_err(as_unprocessable)?;
    if !allow_pending && let Some(why) = shared.read().control().never_fits(&spec) {
        return Err(unprocessable(why));
    }
    // An array's elements take consecutive ids, reserved here at once.
    let elements = spec.array.as_ref().map(|array| array.len() as u32);
    let count = u64::from(elements.unwrap_or(1));
    let submitter = user.clone();
    let (_, durable, id) = shared
        .apply_with_batch(
            |core: &mut Core| {
                if let Some(limits) = limits {
                    let submitter = muster_control::Submitter {
                        user: &user,
                        max_pending: limits.max_pending,
                        ordinary: limits.ordinary,
                        max_dev: limits.max_dev,
                    };
                    core.control()
                        .admission(&spec, &submitter)
                        .map_err(|why| ApiError::new(ErrorCode::PermissionDenied, why))?;
                }
                let id = JobId(core.next_job);
                core.next_job += count;
                Ok((Input::Submit { id, spec, user }, id))
            },
            |_, id| id,
            |id| {
                let mut batch = Batch::default();
                if let Some(key) = key {
                    batch
                        .idempotency
                        .insert((submitter.clone(), key.to_string()), (id.0, now().0));
                }
                batch
            },
        )
        .map_err(as_unprocessable)?;
    if let Err(error) = durable.wait().await {
        // Not durable, so not accepted: the control plane forgets it.
        for element in 0..count {
            shared.withdraw(JobId(id.0 + element));
        }
        return Err(match shared.read_only_reason() {
            Some(reason) => shared.refused(&reason),
            None => error.into(),
        });
    }
    tracing::info!(job = id.0, elements = count, "job submitted");
    let warnings = {
        let core = shared.read();
        core.control()
            .job(id)
            .and_then(|job| {
                let queue = core
                    .control()
                    .queues()
                    .find(|queue| queue.name == job.spec.queue)?;
                crate::accounting::budget_warning(shared, queue)
            })
            .into_iter()
            .collect()
    };
    Ok((
        StatusCode::CREATED,
        Json(SubmitResponse {
            id: id.0,
            elements,
            warnings,
        }),
    ))
}

/// List jobs, newest first, a page at a time (100 by default; pass
/// `next_cursor` back as `cursor` for the next page). Running and recent
/// jobs come from memory, older finished ones from the store.
#[utoipa::path(
    get, path = "/v1/jobs", tag = "jobs", params(JobQuery),
    responses(
        (status = 200, body = JobList),
        (status = 400, body = ErrorBody),
        (status = 404, description = "`array` names no array job", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn list_jobs(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    Params(mut query): Params<JobQuery>,
) -> Result<Json<JobList>, ApiError> {
    // A user lists its own jobs, or a queue's whose members see each
    // other's (and it belongs to); operators and admins anything.
    let principal = principal_of(&identity)?;
    if principal.role == crate::users::Role::User {
        let shared_queue = query
            .queue
            .as_deref()
            .is_some_and(|queue| principal.member_of(queue) && members_see_jobs(&shared, queue));
        match query.user.as_deref() {
            Some(user) if user != principal.name && !shared_queue => {
                return Err(ApiError::new(
                    ErrorCode::PermissionDenied,
                    format!(
                        "{} sees its own jobs (and those of a queue that lets its members see \
                         each other's); not {user}'s",
                        principal.name
                    ),
                ));
            }
            None if !shared_queue => query.user = Some(principal.name.clone()),
            _ => {}
        }
    }
    // One state or a comma list, in any case.
    let states: Option<Vec<JobState>> = match query.state.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(text) => Some(
            text.split(',')
                .map(str::trim)
                .filter(|name| !name.is_empty())
                .map(|name| {
                    JobState::parse(&name.to_ascii_lowercase()).ok_or_else(|| {
                        ApiError::invalid(format!(
                            "unknown job state {name:?}; accepted: pending, running, stopping, \
                             succeeded, failed, cancelled, timed_out, idle_stopped (one, or a comma list)"
                        ))
                    })
                })
                .collect::<Result<_, _>>()?,
        ),
    };
    let wanted = |state: JobState| states.as_ref().is_none_or(|list| list.contains(&state));
    let limit = query.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::invalid(format!(
            "limit must be from 1 to {MAX_PAGE}, got {limit}"
        )));
    }
    let mut before = match query.cursor.as_deref().filter(|c| !c.is_empty()) {
        None => None,
        Some(text) => Some(text.parse::<u64>().map_err(|_| {
            ApiError::invalid(format!(
                "cursor {text:?} is not one this server gave; pass the next_cursor of the \
                 previous page"
            ))
        })?),
    };
    // An array's elements are the jobs from its id on, as many as it has:
    // the range bounds the reads.
    let array = match query.array {
        None => None,
        Some(array) => {
            let head = find_job(&shared, JobId(array)).await?.job;
            let Some(element) = head.array.filter(|a| a.array == JobId(array)) else {
                // No array by that id: as for an unknown job.
                return Err(ApiError::not_found(format!(
                    "job {array} is not an array job"
                )));
            };
            let end = array + u64::from(element.count);
            before = Some(before.map_or(end, |before| before.min(end)));
            Some(JobId(array))
        }
    };
    let of_array =
        |job: &Job| array.is_none_or(|array| job.array.is_some_and(|a| a.array == array));
    let queue = query.queue.filter(|q| !q.is_empty());
    let user = query.user.filter(|u| !u.is_empty());
    let active = query.active.unwrap_or(false);
    let mut jobs: Vec<JobView> = {
        let core = shared.read();
        let control = core.control();
        control
            .jobs_newest_first(before.map(JobId))
            .filter(|job| wanted(job.state))
            .filter(|job| !active || !job.state.is_final())
            .filter(|job| queue.as_deref().is_none_or(|q| job.spec.queue.0 == q))
            .filter(|job| user.as_deref().is_none_or(|u| job.user == u))
            .filter(|job| of_array(job))
            .take(limit as usize)
            .map(|job| {
                job_view(
                    job,
                    &|id| control.allocation(id),
                    control.pending_code(job.id),
                    control.start_forecast(job.id),
                )
            })
            .collect()
    };
    // Retired jobs are finished ones: the store is asked only when they
    // can match.
    let finished_wanted: Option<Vec<String>> = states.as_ref().map(|list| {
        list.iter()
            .filter(|state| state.is_final())
            .map(|state| state.name().to_string())
            .collect()
    });
    if !active && finished_wanted.as_ref().is_none_or(|list| !list.is_empty()) {
        let filter = crate::store::JobFilter {
            states: finished_wanted,
            user: user.clone(),
            queue: queue.clone(),
        };
        // A full page from memory leaves room only for retired jobs newer
        // than its oldest (usually none: the newest page reads nothing
        // from the store).
        let after = (jobs.len() == limit as usize)
            .then(|| jobs.last().map(|job| job.id))
            .flatten();
        let after = match array {
            Some(array) => Some(after.map_or(array.0 - 1, |after| after.max(array.0 - 1))),
            None => after,
        };
        for stored in shared
            .store
            .retired_jobs(&filter, before, after, limit)
            .await?
        {
            let found = FoundJob::from_store(stored)?;
            if of_array(&found.job) {
                jobs.push(found.view());
            }
        }
        jobs.sort_by_key(|job| std::cmp::Reverse(job.id));
        jobs.dedup_by_key(|job| job.id);
        jobs.truncate(limit as usize);
    }
    let next_cursor = (jobs.len() == limit as usize)
        .then(|| jobs.last().map(|job| job.id.to_string()))
        .flatten();
    with_usage(&shared, &mut jobs);
    Ok(Json(JobList { jobs, next_cursor }))
}

/// One job: state, tasks with nodes and GPUs, why it is pending, history.
#[utoipa::path(
    get, path = "/v1/jobs/{id}", tag = "jobs",
    params(("id" = u64, Path, description = "the job's id", maximum = 9_223_372_036_854_775_807_u64)),
    responses((status = 200, body = JobView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
pub(crate) async fn get_job(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(id): PathParams<String>,
) -> Result<Json<JobView>, ApiError> {
    let id = parse_job_id(&id)?;
    let mut view = visible_job(&shared, &identity, id).await?.view();
    with_usage(&shared, std::slice::from_mut(&mut view));
    Ok(Json(view))
}

/// Cancel every unfinished element of an array job; answers the elements
/// the server holds in memory (retired ones had ended), as they are now.
#[utoipa::path(
    post, path = "/v1/arrays/{id}/cancel", tag = "jobs",
    params(("id" = u64, Path, description = "the array's id (its first element's)", maximum = 9_223_372_036_854_775_807_u64)),
    responses(
        (status = 200, body = JobList),
        (status = 409, description = "the job is not an array job", body = ErrorBody),
        (status = 404, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
async fn cancel_array(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(id): PathParams<String>,
) -> Result<Json<JobList>, ApiError> {
    let id = parse_job_id(&id)?;
    may_cancel(&shared, &identity, id).await?;
    let (_, durable) = shared.apply(Input::CancelArray { array: id }, Batch::default())?;
    durable.wait().await?;
    let core = shared.read();
    let control = core.control();
    let jobs = control
        .array_elements(id)
        .into_iter()
        .filter_map(|element| control.job(element))
        .map(|job| {
            job_view(
                job,
                &|a| control.allocation(a),
                control.pending_code(job.id),
                control.start_forecast(job.id),
            )
        })
        .collect();
    Ok(Json(JobList {
        jobs,
        next_cursor: None,
    }))
}

/// Cancel a job: a pending one at once, a running one once its tasks stop.
#[utoipa::path(
    post, path = "/v1/jobs/{id}/cancel", tag = "jobs",
    params(("id" = u64, Path, description = "the job's id", maximum = 9_223_372_036_854_775_807_u64)),
    responses((status = 200, body = JobView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn cancel_job(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(id): PathParams<String>,
) -> Result<Json<JobView>, ApiError> {
    let id = parse_job_id(&id)?;
    may_cancel(&shared, &identity, id).await?;
    match shared.apply(Input::Cancel { job: id }, Batch::default()) {
        Ok((_, durable)) => durable.wait().await?,
        // A retired job has finished: nothing to cancel.
        Err(error) if error.body.code == ErrorCode::NotFound => {}
        Err(error) => return Err(error),
    }
    Ok(Json(find_job(&shared, id).await?.view()))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LogsQuery {
    /// The task (node rank); 0 by default.
    rank: Option<u32>,
    /// The byte offset of the task's output to read from; 0 by default.
    offset: Option<u64>,
    /// The most bytes to return (1 MiB at most, and by default).
    #[param(minimum = 1, maximum = 1_048_576)]
    limit: Option<u64>,
    /// The task (allocation) `offset` belongs to, from an earlier answer:
    /// when the rank has a newer one, the answer is empty, names it, and
    /// has `next_offset` 0.
    allocation: Option<u64>,
    /// Wait up to 10 s for new output before answering.
    follow: Option<bool>,
    /// Which attempt's output (1 for the first; default: the latest).
    #[param(minimum = 1)]
    attempt: Option<u32>,
}

/// How long after its job ended, and after the last byte arrived, a task's
/// log counts as whole without the agent saying so (an agent that died, or
/// a task that never started).
const LOG_SETTLE: Duration = Duration::from_secs(5);

/// A task's output, from a byte offset: the exact bytes it wrote (base64 on
/// the wire), the offset to read next, and whether that is all.
#[utoipa::path(
    get, path = "/v1/jobs/{id}/logs", tag = "jobs",
    params(("id" = u64, Path, description = "the job's id", maximum = 9_223_372_036_854_775_807_u64), LogsQuery),
    responses((status = 200, body = LogsResponse), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn job_logs(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(id): PathParams<String>,
    Params(query): Params<LogsQuery>,
) -> Result<Json<LogsResponse>, ApiError> {
    let id = parse_job_id(&id)?;
    visible_job(&shared, &identity, id).await?;
    let rank = query.rank.unwrap_or(0);
    let offset = query.offset.unwrap_or(0);
    // The document says int64, as most clients' integers are.
    if offset > i64::MAX as u64 || query.allocation.is_some_and(|a| a > i64::MAX as u64) {
        return Err(ApiError::invalid(
            "offset and allocation are at most 9223372036854775807",
        ));
    }
    let limit = match query.limit {
        None => MAX_LOG_READ,
        Some(limit) => usize::try_from(limit)
            .ok()
            .filter(|limit| (1..=MAX_LOG_READ).contains(limit))
            .ok_or_else(|| {
                ApiError::invalid(format!(
                    "limit is from 1 to {MAX_LOG_READ} bytes, got {limit}"
                ))
            })?,
    };
    let deadline = tokio::time::Instant::now() + LOG_FOLLOW_WAIT;
    let mut changes = shared.changes.subscribe();
    let mut shutdown = shared.shutdown.clone();
    loop {
        changes.borrow_and_update();
        let (allocation, finished) = {
            let found = find_job(&shared, id).await?;
            let job = &found.job;
            if rank >= job.spec.nodes {
                return Err(ApiError::not_found(format!(
                    "job {id} has ranks 0 to {}, not {rank}",
                    job.spec.nodes.saturating_sub(1)
                )));
            }
            // Each attempt gave every rank one allocation, in id order.
            let mut of_rank = found.allocations.values().filter(|a| a.rank == rank);
            let allocation = match query.attempt {
                None => of_rank.map(|a| a.id).next_back(),
                Some(0) => {
                    return Err(ApiError::invalid(
                        "attempt counts from 1 (the first attempt)",
                    ));
                }
                Some(attempt) => Some(of_rank.nth(attempt as usize - 1).map(|a| a.id).ok_or_else(
                    || {
                        ApiError::not_found(format!(
                            "job {id} has no attempt {attempt} (it made {})",
                            job.attempts
                        ))
                    },
                )?),
            };
            let finished = job
                .state
                .is_final()
                .then(|| job.finished.map_or(0, |at| at.0));
            (allocation, finished)
        };
        if let (Some(asked), Some(latest)) = (query.allocation, allocation)
            && asked != latest.0
        {
            return Ok(Json(LogsResponse {
                data: Vec::new(),
                next_offset: 0,
                more: true,
                complete: false,
                allocation: Some(latest.0),
                end: 0,
            }));
        }
        let read = match allocation {
            Some(allocation) => {
                let logs = Arc::clone(&shared.logs);
                tokio::task::spawn_blocking(move || logs.read(allocation.0, offset, limit))
                    .await
                    .map_err(|error| {
                        ApiError::new(ErrorCode::Internal, format!("the log read failed: {error}"))
                    })?
                    .map_err(|error| ApiError::new(ErrorCode::Internal, error.to_string()))?
            }
            None => crate::logstore::LogRead {
                data: Vec::new(),
                next_offset: offset,
                end: 0,
                eof: true,
                modified: None,
            },
        };
        // Whole once the job ended and the agent sent the last byte, or
        // when nothing arrived for a while after the end (an agent that
        // died cannot send it).
        let settled =
            |since_ms: u64| now().0.saturating_sub(since_ms) >= LOG_SETTLE.as_millis() as u64;
        let last_write_ms = read.modified.map_or(0, |at| {
            at.duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64)
        });
        let whole =
            finished.is_some_and(|ended| read.eof || (settled(ended) && settled(last_write_ms)));
        let more = read.next_offset < read.end;
        let complete = whole && !more;
        let follow = query.follow.unwrap_or(false);
        let empty = read.data.is_empty();
        let response = LogsResponse {
            data: read.data,
            next_offset: read.next_offset,
            more,
            complete,
            allocation: allocation.map(|a| a.0),
            end: read.end,
        };
        if !follow || !empty || complete || tokio::time::Instant::now() >= deadline {
            return Ok(Json(response));
        }
        // Wake on a change, or in time to notice that the log settled.
        let recheck = tokio::time::Instant::now() + Duration::from_secs(1);
        tokio::select! {
            _ = tokio::time::sleep_until(deadline.min(recheck)) => {}
            _ = changes.changed() => {}
            _ = shutdown.wait_for(|stop| *stop) => return Ok(Json(response)),
        }
    }
}

// ---------------------------------------------------------------- nodes

/// Every node.
#[utoipa::path(
    get, path = "/v1/nodes", tag = "nodes",
    responses((status = 200, body = NodeList)),
    security(("bearer" = []))
)]
pub(crate) async fn list_nodes(State(shared): Shared_) -> Json<NodeList> {
    let core = shared.read();
    let mut nodes: Vec<NodeView> = core
        .control()
        .nodes()
        .map(|node| node_view(&core, node))
        .collect();
    drop(core);
    for node in &mut nodes {
        with_gpu_events(&shared, node);
    }
    Json(NodeList { nodes })
}

/// A node's telemetry over the last hour: a point at most every 30 seconds
/// (memory only; empty after a restart or without telemetry).
#[utoipa::path(
    get, path = "/v1/nodes/{name}/telemetry", tag = "nodes",
    params(("name" = String, Path, description = "the node's name")),
    responses((status = 200, body = NodeHistory), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn node_history(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
) -> Result<Json<NodeHistory>, ApiError> {
    if shared
        .read()
        .control()
        .node(&NodeName(name.clone()))
        .is_none()
    {
        return Err(node_not_found(&name));
    }
    let points = match shared.history.lock() {
        Ok(history) => history.of(&name, now().0),
        Err(poisoned) => poisoned.into_inner().of(&name, now().0),
    };
    Ok(Json(NodeHistory { node: name, points }))
}

/// Adds what the node's latest telemetry says: each GPU's utilisation (if
/// fresh), and GPUs with an XID or uncorrected ECC errors.
fn with_gpu_events(shared: &Shared, view: &mut NodeView) {
    let telemetry = match shared.telemetry.lock() {
        Ok(telemetry) => telemetry,
        Err(poisoned) => poisoned.into_inner(),
    };
    let Some(latest) = telemetry.get(&view.name) else {
        return;
    };
    if now().0.saturating_sub(latest.received_ms) <= crate::metrics::STALE_MS {
        view.gpu_utilization_pct = view
            .gpus
            .iter()
            .map(|gpu| {
                latest
                    .report
                    .gpus
                    .iter()
                    .find(|sample| sample.index == gpu.index)
                    .map_or(0, |sample| sample.utilization_pct)
            })
            .collect();
    }
    view.gpu_events = latest
        .report
        .gpus
        .iter()
        .flat_map(|gpu| {
            let xid = gpu.xid.map(|xid| match muster_model::fatal_xid(xid) {
                Some(what) => format!("GPU {}: XID {xid}, {what}", gpu.index),
                None => format!("GPU {}: XID {xid} (an application error)", gpu.index),
            });
            let ecc = gpu
                .ecc_uncorrected
                .filter(|errors| *errors > 0)
                .map(|errors| format!("GPU {}: {errors} uncorrected ECC error(s)", gpu.index));
            xid.into_iter().chain(ecc)
        })
        .collect();
}

/// One node.
#[utoipa::path(
    get, path = "/v1/nodes/{name}", tag = "nodes",
    params(("name" = String, Path, description = "the node's name")),
    responses((status = 200, body = NodeView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
pub(crate) async fn get_node(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
) -> Result<Json<NodeView>, ApiError> {
    let mut view = {
        let core = shared.read();
        let node = core
            .control()
            .node(&NodeName(name.clone()))
            .ok_or_else(|| node_not_found(&name))?;
        node_view(&core, node)
    };
    with_gpu_events(&shared, &mut view);
    Ok(Json(view))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RemoveQuery {
    /// Remove it even while it holds work, which is re-queued.
    force: Option<bool>,
}

/// Remove a node: refused while it holds running work unless `force`
/// (which re-queues that work). Its credential goes with it: an agent
/// still running there is refused, and joins again as a new node if it
/// has the join token.
#[utoipa::path(
    delete, path = "/v1/nodes/{name}", tag = "nodes",
    params(("name" = String, Path, description = "the node's name"), RemoveQuery),
    responses(
        (status = 200, description = "removed", body = NodeRemoved),
        (status = 404, body = ErrorBody),
        (status = 409, description = "it holds work; drain it or pass force", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
async fn remove_node(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
    Params(query): Params<RemoveQuery>,
) -> Result<Json<NodeRemoved>, ApiError> {
    let input = Input::RemoveNode {
        node: NodeName(name.clone()),
        force: query.force.unwrap_or(false),
    };
    let (outputs, durable) = shared.apply(input, Batch::default())?;
    durable.wait().await?;
    let requeued_jobs: Vec<u64> = outputs
        .iter()
        .filter_map(|output| match output {
            muster_control::Output::JobChanged(id) => Some(id.0),
            _ => None,
        })
        .collect();
    // What its heartbeats said of image pulls goes with it.
    match shared.pulling.lock() {
        Ok(mut pulling) => pulling.remove(&name),
        Err(poisoned) => poisoned.into_inner().remove(&name),
    };
    tracing::info!(node = %name, ?requeued_jobs, "node removed by an admin");
    Ok(Json(NodeRemoved {
        name,
        requeued_jobs,
    }))
}

/// Reset a node's identity: its credential is revoked, so its agent (or
/// whoever holds the credential) is refused, and the join token may
/// register the name again (a reinstalled machine, a leaked credential).
#[utoipa::path(
    post, path = "/v1/nodes/{name}/reset-identity", tag = "nodes",
    params(("name" = String, Path, description = "the node's name")),
    responses((status = 200, body = NodeView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn reset_identity(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
) -> Result<Json<NodeView>, ApiError> {
    let node = NodeName(name.clone());
    shared.reset_identity(&node)?.wait().await?;
    tracing::info!(node = %name, "node identity reset by an admin");
    let core = shared.read();
    let found = core
        .control()
        .node(&node)
        .ok_or_else(|| node_not_found(&name))?;
    Ok(Json(node_view(&core, found)))
}

async fn node_input(
    shared: Arc<Shared>,
    name: String,
    input: Input,
) -> Result<Json<NodeView>, ApiError> {
    let (_, durable) = shared.apply(input, Batch::default())?;
    durable.wait().await?;
    let core = shared.read();
    let node = core
        .control()
        .node(&NodeName(name.clone()))
        .ok_or_else(|| node_not_found(&name))?;
    tracing::info!(node = %name, cordoned = node.cordoned, draining = node.draining, "node changed by an admin");
    Ok(Json(node_view(&core, node)))
}

/// Cordon a node: nothing new is placed on it.
#[utoipa::path(
    post, path = "/v1/nodes/{name}/cordon", tag = "nodes",
    params(("name" = String, Path, description = "the node's name")),
    responses((status = 200, body = NodeView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn cordon_node(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
) -> Result<Json<NodeView>, ApiError> {
    let node = NodeName(name.clone());
    node_input(
        shared,
        name,
        Input::Cordon {
            node,
            cordoned: true,
        },
    )
    .await
}

/// Uncordon a node (ends a drain too).
#[utoipa::path(
    post, path = "/v1/nodes/{name}/uncordon", tag = "nodes",
    params(("name" = String, Path, description = "the node's name")),
    responses((status = 200, body = NodeView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn uncordon_node(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
) -> Result<Json<NodeView>, ApiError> {
    let node = NodeName(name.clone());
    node_input(
        shared,
        name,
        Input::Cordon {
            node,
            cordoned: false,
        },
    )
    .await
}

/// Approve a node that joined under `--approve-nodes`: it takes work from
/// now on.
#[utoipa::path(
    post, path = "/v1/nodes/{name}/approve", tag = "nodes",
    params(("name" = String, Path, description = "the node's name")),
    responses((status = 200, body = NodeView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn approve_node(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
) -> Result<Json<NodeView>, ApiError> {
    let node = NodeName(name.clone());
    node_input(shared, name, Input::Approve { node }).await
}

/// Drain a node: cordon it and stop (re-queue) its jobs.
#[utoipa::path(
    post, path = "/v1/nodes/{name}/drain", tag = "nodes",
    params(("name" = String, Path, description = "the node's name")),
    responses((status = 200, body = NodeView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn drain_node(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
) -> Result<Json<NodeView>, ApiError> {
    let node = NodeName(name.clone());
    node_input(shared, name, Input::Drain { node }).await
}

// ---------------------------------------------------------------- pools

/// Each pool's software stack (driver, CUDA, VBIOS, kernel, NCCL, container
/// runtime) as its nodes report it, and the nodes that differ from the
/// pool's most common version of a component.
#[utoipa::path(
    get, path = "/v1/fleet", tag = "nodes",
    responses((status = 200, body = FleetView)),
    security(("bearer" = []))
)]
async fn fleet(State(shared): Shared_) -> Json<FleetView> {
    let pools = shared
        .read()
        .control()
        .pool_stacks()
        .into_iter()
        .map(|pool| PoolStackView {
            pool: pool.pool,
            nodes: pool.nodes as u64,
            majority: pool.majority,
            versions: pool
                .versions
                .into_iter()
                .map(|(component, counts)| {
                    (
                        component,
                        counts.into_iter().map(|(v, n)| (v, n as u64)).collect(),
                    )
                })
                .collect(),
            drift: pool
                .drift
                .into_iter()
                .map(|drift| DriftView {
                    node: drift.node,
                    component: drift.component,
                    version: drift.version,
                    expected: drift.expected,
                })
                .collect(),
        })
        .collect();
    Json(FleetView { pools })
}

/// Every pool, with its nodes, GPUs and free capacity.
#[utoipa::path(
    get, path = "/v1/pools", tag = "nodes",
    responses((status = 200, body = PoolList)),
    security(("bearer" = []))
)]
async fn list_pools(State(shared): Shared_) -> Json<PoolList> {
    let core = shared.read();
    let mut pools: std::collections::BTreeMap<String, PoolView> = Default::default();
    for node in core.control().nodes() {
        let view = node_view(&core, node);
        let pool = pools.entry(view.pool.clone()).or_insert_with(|| PoolView {
            name: view.pool.clone(),
            nodes: 0,
            schedulable_nodes: 0,
            gpus: 0,
            gpu_free_milli: 0,
            models: Vec::new(),
            stack_policy: String::new(),
            required: BTreeMap::new(),
            allowed_mounts: Vec::new(),
            inference: false,
            service_gpu_milli: 0,
            borrowed_gpu_milli: 0,
        });
        pool.nodes += 1;
        pool.gpus += view.gpus.len() as u32;
        if view.state == "ready" && !view.cordoned {
            pool.schedulable_nodes += 1;
            pool.gpu_free_milli += view.gpu_free.iter().map(|&m| u64::from(m)).sum::<u64>();
        }
        for gpu in &view.gpus {
            if !pool.models.contains(&gpu.model) {
                pool.models.push(gpu.model.clone());
            }
        }
    }
    // Pools with a policy and no node yet are listed too.
    for name in core.control().pool_policies().keys() {
        pools.entry(name.0.clone()).or_insert_with(|| PoolView {
            name: name.0.clone(),
            nodes: 0,
            schedulable_nodes: 0,
            gpus: 0,
            gpu_free_milli: 0,
            models: Vec::new(),
            stack_policy: String::new(),
            required: BTreeMap::new(),
            allowed_mounts: Vec::new(),
            inference: false,
            service_gpu_milli: 0,
            borrowed_gpu_milli: 0,
        });
    }
    for pool in pools.values_mut() {
        let policy = core.control().stack_policy_of(&PoolName(pool.name.clone()));
        pool.stack_policy = policy.stack.name().to_string();
        pool.required = policy.required;
        pool.allowed_mounts = policy.mounts;
        pool.inference = policy.inference;
    }
    // GPU capacity held by services and by work borrowing inference pools.
    for node in core.control().nodes() {
        let Some(pool) = pools.get_mut(&node.spec.pool.0) else {
            continue;
        };
        for allocation in core.control().live_allocations(&node.spec.name) {
            let Some(job) = core.control().job(allocation.job) else {
                continue;
            };
            let milli: u64 = allocation.gpus.iter().map(|&(_, m)| u64::from(m)).sum();
            if job.spec.service.is_some() {
                pool.service_gpu_milli += milli;
            } else if core.control().borrows(job, allocation) {
                pool.borrowed_gpu_milli += milli;
            }
        }
    }
    Json(PoolList {
        pools: pools.into_values().collect(),
    })
}

/// The most components a pool may require versions of.
const MAX_REQUIRED_COMPONENTS: usize = 16;

/// Set a pool's own stack policy: `report`, `majority` (a node that
/// differs from the pool's most common stack takes no new work) or
/// `required` (a node that does not report the given versions takes none).
#[utoipa::path(
    put, path = "/v1/pools/{name}/policy", tag = "nodes",
    params(("name" = String, Path, description = "the pool's name", pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    request_body = PoolPolicyUpdate,
    responses((status = 200, body = PoolList), (status = 400, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn set_pool_policy(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
    Body(update): Body<PoolPolicyUpdate>,
) -> Result<Json<PoolList>, ApiError> {
    check_name("a pool name", &name)?;
    let stack =
        muster_control::StackPolicy::parse(update.stack_policy.trim()).ok_or_else(|| {
            ApiError::invalid(format!(
                "stack_policy: expected report, majority or required, got {:?}",
                update.stack_policy
            ))
        })?;
    let mut problems = Vec::new();
    if update.required.len() > MAX_REQUIRED_COMPONENTS {
        problems.push(format!(
            "at most {MAX_REQUIRED_COMPONENTS} components may be required"
        ));
    }
    for (component, version) in &update.required {
        let plain = |text: &str| {
            !text.is_empty()
                && text.len() <= 128
                && !text.chars().any(|c| c.is_control() || c == ',')
        };
        if !plain(component) || !plain(version) {
            problems.push(format!(
                "required: {component:?}={version:?}: a component and a version are 1 to 128 \
                 printable characters without commas"
            ));
        }
    }
    match (stack, update.required.is_empty()) {
        (muster_control::StackPolicy::Required, true) => problems.push(
            "the required policy needs versions to require, like {\"driver\": \"550.90\"}"
                .to_string(),
        ),
        (muster_control::StackPolicy::Required, false) | (_, true) => {}
        (_, false) => problems.push(format!(
            "required versions go with the required policy, not {}",
            stack.name()
        )),
    }
    if update.allowed_mounts.len() > 64 {
        problems.push("at most 64 allowed mounts a pool".to_string());
    }
    for path in &update.allowed_mounts {
        if !path.starts_with('/')
            || path.len() > 4096
            || path.contains([':', ',', '\0'])
            || path.split('/').any(|part| part == "..")
        {
            problems.push(format!(
                "allowed_mounts: {path:?} is not an absolute path without `..`, `:` or `,`"
            ));
        }
    }
    if !problems.is_empty() {
        return Err(ApiError::invalid(problems.join("; ")));
    }
    let policy = muster_control::PoolPolicy {
        stack,
        required: update.required,
        mounts: update.allowed_mounts,
        inference: update.inference,
    };
    let pool = PoolName(name.clone());
    let mut batch = Batch::default();
    if let Ok(text) = serde_json::to_string(&crate::records::PoolRecord::of(&pool, &policy)) {
        batch.pools.insert(name.clone(), Some(text));
    }
    let (_, durable) = shared.apply(
        Input::SetPoolPolicy {
            pool,
            policy: Some(policy),
        },
        batch,
    )?;
    durable.wait().await?;
    shared.wake_scheduler.notify_one();
    tracing::info!(pool = %name, "pool policy set");
    Ok(list_pools(State(shared)).await)
}

/// Remove a pool's own stack policy: the server's `--stack-policy` applies.
#[utoipa::path(
    delete, path = "/v1/pools/{name}/policy", tag = "nodes",
    params(("name" = String, Path, description = "the pool's name", pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 200, body = PoolList), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn remove_pool_policy(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
) -> Result<Json<PoolList>, ApiError> {
    let pool = PoolName(name.clone());
    if !shared.read().control().pool_policies().contains_key(&pool) {
        return Err(ApiError::not_found(format!(
            "pool {name} has no policy of its own; `muster pools` lists them"
        )));
    }
    let mut batch = Batch::default();
    batch.pools.insert(name.clone(), None);
    let (_, durable) = shared.apply(Input::SetPoolPolicy { pool, policy: None }, batch)?;
    durable.wait().await?;
    shared.wake_scheduler.notify_one();
    Ok(list_pools(State(shared)).await)
}

// ---------------------------------------------------------------- queues

/// Every queue: configured ones and those jobs name.
#[utoipa::path(
    get, path = "/v1/queues", tag = "queues",
    responses((status = 200, body = QueueList)),
    security(("bearer" = []))
)]
pub(crate) async fn list_queues(State(shared): Shared_) -> Json<QueueList> {
    let core = shared.read();
    let mut queues = queue_views(&core);
    for queue in &mut queues {
        queue.spent_this_month = shared.accounting.spent(&queue.name);
    }
    Json(QueueList { queues })
}

/// The most GPUs a quota may name.
const MAX_QUOTA_GPUS: f64 = 1_000_000.0;

fn quota_milli(what: &str, gpus: f64) -> Result<GpuMilli, ApiError> {
    if !gpus.is_finite() || !(0.0..=MAX_QUOTA_GPUS).contains(&gpus) {
        return Err(ApiError::invalid(format!(
            "{what} must be a number of GPUs from 0 to {MAX_QUOTA_GPUS}, got {gpus}"
        )));
    }
    Ok(GpuMilli((gpus * 1000.0).round() as u32))
}

/// Create or change a queue's quota.
#[utoipa::path(
    put, path = "/v1/queues/{name}", tag = "queues",
    params(("name" = String, Path, description = "the queue's name", pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    request_body = QueueUpdate,
    responses((status = 200, body = QueueView), (status = 400, body = ErrorBody)),
    security(("bearer" = []))
)]
async fn set_queue(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
    Body(update): Body<QueueUpdate>,
) -> Result<Json<QueueView>, ApiError> {
    check_name("a queue name", &name)?;
    let guaranteed = quota_milli("guaranteed_gpus", update.guaranteed_gpus)?;
    let borrow_limit = update
        .borrow_limit_gpus
        .map(|gpus| quota_milli("borrow_limit_gpus", gpus))
        .transpose()?;
    if !(1..=10_000).contains(&update.weight) {
        return Err(ApiError::invalid(format!(
            "weight must be from 1 to 10000, got {}",
            update.weight
        )));
    }
    // Zero stops nothing: no idle timeout, as when absent.
    let idle_timeout = match update
        .idle_timeout
        .as_deref()
        .map(muster_api::parse_api_duration)
    {
        None => None,
        Some(Ok(duration)) => duration.filter(|d| !d.is_zero()),
        Some(Err(why)) => {
            return Err(ApiError::invalid(format!(
                "idle_timeout: {why}, got {:?}",
                update.idle_timeout.as_deref().unwrap_or_default()
            )));
        }
    };
    let idle_after = match update
        .idle_after
        .as_deref()
        .map(muster_api::parse_api_duration)
    {
        None => None,
        Some(Ok(duration)) => duration,
        Some(Err(why)) => {
            return Err(ApiError::invalid(format!(
                "idle_after: {why}, got {:?}",
                update.idle_after.as_deref().unwrap_or_default()
            )));
        }
    };
    if let Some(pct) = update.idle_below_pct
        && !(1..=100).contains(&pct)
    {
        return Err(ApiError::invalid(format!(
            "idle_below_pct: expected a utilisation from 1 to 100 (percent), got {pct}"
        )));
    }
    let budget = match update.budget {
        None => None,
        Some(amount) if amount.is_finite() && (0.0..=1e12).contains(&amount) => {
            Some(muster_model::Budget {
                monthly_cents: (amount * 100.0).round() as u64,
                hard: update.budget_hard,
            })
        }
        Some(amount) => {
            return Err(ApiError::invalid(format!(
                "budget: expected an amount per month from 0 to 1e12 in the price list's \
                 currency, got {amount}"
            )));
        }
    };
    if update.max_pending.is_some_and(|max| max > 100_000_000) {
        return Err(ApiError::invalid(
            "max_pending: at most 100000000 (leave it out for no limit of the queue's)",
        ));
    }
    let max_priority_class = match update.max_priority_class.as_deref() {
        None => None,
        Some(name) => Some(muster_model::PriorityClass::by_name(name).ok_or_else(|| {
            ApiError::invalid(format!(
                "max_priority_class: {name:?} is not a priority class; use low, normal, high or \
                 critical"
            ))
        })?),
    };
    // `budget_hard` without a budget holds nothing: there is no limit to
    // be past (the CLI asks for --budget with --budget-hard).
    let spec = QueueSpec {
        name: QueueName(name.clone()),
        guaranteed,
        borrow_limit,
        weight: update.weight,
        idle_timeout,
        idle_after,
        idle_below_pct: update.idle_below_pct,
        budget,
        members_see_jobs: update.members_see_jobs,
        max_pending: update.max_pending,
        max_priority_class,
        allow_non_preemptible: update.allow_non_preemptible,
    };
    let mut batch = Batch::default();
    if let Ok(text) = serde_json::to_string(&QueueRecord::from(&spec)) {
        batch.queues.insert(name.clone(), text);
    }
    let (_, durable) = shared.apply(Input::SetQueue(spec.clone()), batch)?;
    durable.wait().await?;
    crate::accounting::refresh_budgets(&shared).await?;
    shared.wake_scheduler.notify_one();
    tracing::info!(queue = %name, "queue set");
    let core = shared.read();
    let mut view = queue_views(&core)
        .into_iter()
        .find(|view| view.name == name)
        .unwrap_or_else(|| empty_queue_view(&spec));
    view.spent_this_month = shared.accounting.spent(&name);
    Ok(Json(view))
}

// ---------------------------------------------------------------- openapi

#[derive(OpenApi)]
#[openapi(
    info(title = "muster", description = "muster's /v1 API: jobs, nodes, queues, agents."),
    paths(
        submit_job, list_jobs, get_job, cancel_job, cancel_array, job_logs, agents::push_telemetry, fleet,
        list_nodes, get_node, node_history, remove_node, reset_identity, cordon_node, uncordon_node, approve_node, drain_node,
        list_pools, set_pool_policy, remove_pool_policy, list_queues, set_queue,
        agents::register_agent, agents::heartbeat, agents::push_logs,
        crate::accounting::job_usage, crate::accounting::cost_endpoint,
        crate::accounting::list_prices, crate::accounting::set_price,
        crate::accounting::remove_price,
        crate::users::create_user, crate::users::list_users, crate::users::remove_user,
        crate::users::set_limits,
        crate::jointokens::create_join_token, crate::jointokens::list_join_tokens,
        crate::jointokens::revoke_join_token,
        crate::users::rotate_token, crate::users::whoami, crate::users::audit,
        crate::secrets::set_secret, crate::secrets::list_secrets, crate::secrets::remove_secret,
        crate::services::create_service, crate::services::list_services,
        crate::services::get_service, crate::services::update_service,
        crate::services::delete_service, crate::services::scale_service,
        crate::services::rollback_service, crate::services::service_endpoints,
        crate::services::endpoint_table, crate::services::report_traffic,
        crate::dev::list, crate::dev::connect, crate::dev::open_tunnel,
        crate::services::agent_checks,
    ),
    components(schemas(ErrorBody, ErrorCode)),
    modifiers(&BearerAuth, &ErrorAnswers),
)]
struct ApiDoc;

/// Every authenticated operation may answer 401 (no or an unknown
/// token), 403 (a token that may not), 429 (past its rate; agents' own
/// routes aside) and 400 (a body or query that cannot be read); say so in
/// each, with the error body.
struct ErrorAnswers;

impl utoipa::Modify for ErrorAnswers {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{RefOr, ResponseBuilder, content::ContentBuilder};
        let answer = |description: &str| {
            RefOr::T(
                ResponseBuilder::new()
                    .description(description)
                    .content(
                        "application/json",
                        ContentBuilder::new()
                            .schema(Some(utoipa::openapi::Ref::from_schema_name("ErrorBody")))
                            .build(),
                    )
                    .build(),
            )
        };
        for (path, item) in openapi.paths.paths.iter_mut() {
            let agent = path.starts_with("/v1/agents/");
            for operation in [
                item.get.as_mut(),
                item.put.as_mut(),
                item.post.as_mut(),
                item.delete.as_mut(),
            ]
            .into_iter()
            .flatten()
            {
                let responses = &mut operation.responses.responses;
                for (code, description) in [
                    ("400", "the request cannot be read (body, path or query)"),
                    ("401", "no token, or one this server does not know"),
                    ("403", "the token may not do this"),
                ] {
                    responses
                        .entry(code.to_string())
                        .or_insert_with(|| answer(description));
                }
                if !agent {
                    responses.entry("429".to_string()).or_insert_with(|| {
                        answer("too many requests with this token; see Retry-After")
                    });
                }
            }
        }
    }
}

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The OpenAPI 3 document of this API.
pub fn openapi_document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(openapi_document())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_openapi_document_describes_every_endpoint_and_its_types() {
        let document = serde_json::to_value(openapi_document()).unwrap();
        let paths = document["paths"].as_object().unwrap();
        assert_eq!(paths.len(), 47, "{:?}", paths.keys().collect::<Vec<_>>());
        let schemas = document["components"]["schemas"].as_object().unwrap();
        for name in [
            "SubmitRequest",
            "SubmitResponse",
            "JobView",
            "ArrayView",
            "JobList",
            "TelemetryReport",
            "GpuSample",
            "HeartbeatResponse",
            "ErrorBody",
            "LogChunk",
            "CostReport",
            "JobUsage",
            "PriceList",
            "ServiceRequest",
            "ServiceView",
            "EndpointTable",
            "TrafficReport",
            "DevList",
        ] {
            assert!(schemas.contains_key(name), "{name} is described");
        }
        assert_eq!(
            document["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        // The job spec is typed, and every operation says how it fails.
        assert_eq!(
            schemas["SubmitRequest"]["properties"]["spec"]["$ref"], "#/components/schemas/JobSpec",
            "{}",
            schemas["SubmitRequest"]
        );
        let spec = &schemas["JobSpec"]["properties"];
        for field in [
            "name", "command", "gpus", "env", "secrets", "array", "after",
        ] {
            assert!(spec.get(field).is_some(), "JobSpec.{field}");
        }
        assert_eq!(schemas["QueueUpdate"]["properties"]["weight"]["minimum"], 1);
        // Durations: the document states the grammar the server reads.
        let duration = format!(
            "^{}$",
            muster_api::DURATION_PATTERN.trim_matches(['^', '$'])
        );
        assert_eq!(
            schemas["QueueUpdate"]["properties"]["idle_timeout"]["pattern"],
            duration
        );
        assert_eq!(
            schemas["QueueUpdate"]["properties"]["idle_after"]["pattern"],
            duration
        );
        let audit = &paths["/v1/audit"]["get"]["parameters"];
        assert_eq!(audit[0]["name"], "since");
        assert_eq!(audit[0]["schema"]["pattern"], duration);
        // The spec's fields take every shape the reader takes.
        assert!(
            spec["gpu_models"]["anyOf"].is_array(),
            "{}",
            spec["gpu_models"]
        );
        assert!(spec["after"]["anyOf"].is_array(), "{}", spec["after"]);
        assert!(spec["command"]["anyOf"].is_array(), "{}", spec["command"]);
        assert!(
            spec["env"]["additionalProperties"]["anyOf"].is_array(),
            "{}",
            spec["env"]
        );
        assert_eq!(spec["array"]["type"][1], "integer", "{}", spec["array"]);
        let submit = &paths["/v1/jobs"]["post"]["responses"];
        assert!(submit.get("422").is_some(), "{submit}");
        // Unknown fields are refused, and the document says so.
        for name in [
            "SubmitRequest",
            "JobSpec",
            "RetrySpec",
            "CheckpointSpec",
            "TopologySpec",
        ] {
            assert_eq!(schemas[name]["additionalProperties"], false, "{name}");
        }
        for (path, item) in paths {
            for (method, operation) in item.as_object().unwrap() {
                // A parameter said to be in the path is one of the path's
                // (utoipa's IntoParams puts them there unless told Query).
                for parameter in operation["parameters"].as_array().into_iter().flatten() {
                    let name = parameter["name"].as_str().unwrap();
                    if parameter["in"] == "path" {
                        assert!(
                            path.contains(&format!("{{{name}}}")),
                            "{method} {path}: {name} is a query parameter, not the path's"
                        );
                    }
                }
                let responses = operation["responses"].as_object().unwrap();
                for code in ["400", "401", "403"] {
                    assert!(responses.contains_key(code), "{method} {path} lacks {code}");
                }
                if !path.starts_with("/v1/agents/") {
                    assert!(responses.contains_key("429"), "{method} {path} lacks 429");
                }
            }
        }
        // Log bytes are base64 strings (OpenAPI's `byte` format), both ways.
        for name in ["LogChunk", "LogsResponse"] {
            let data = &schemas[name]["properties"]["data_base64"];
            assert_eq!(data["type"], "string", "{name}: {data}");
            assert_eq!(data["format"], "byte", "{name}: {data}");
        }
    }

    #[test]
    fn endpoints_need_the_right_token() {
        use crate::users::Role;
        use axum::http::Method;
        let get = |path: &str| need_of(&Method::GET, path);
        let post = |path: &str| need_of(&Method::POST, path);
        assert_eq!(get("/healthz"), Need::Nothing);
        assert_eq!(get("/v1/openapi.json"), Need::Nothing);
        assert_eq!(get("/v1/jobs/3"), Need::Role(Role::User));
        assert_eq!(post("/v1/arrays/3/cancel"), Need::Role(Role::User));
        assert_eq!(post("/v1/nodes/a/drain"), Need::Role(Role::Operator));
        assert_eq!(
            need_of(&Method::PUT, "/v1/queues/a"),
            Need::Role(Role::Admin)
        );
        assert_eq!(post("/v1/users"), Need::Role(Role::Admin));
        assert_eq!(get("/v1/something-new"), Need::Role(Role::Admin));
        assert_eq!(get("/metrics"), Need::Metrics);
        assert_eq!(
            post("/v1/agents/gpu-1/telemetry"),
            Need::Node("gpu-1".into())
        );
        assert_eq!(post("/v1/agents/register"), Need::Register);
        assert_eq!(
            post("/v1/agents/gpu-1/heartbeat"),
            Need::Node("gpu-1".into())
        );
        assert_eq!(post("/v1/agents/"), Need::Node(String::new()));
        assert_eq!(route_template("/v1/jobs/12/cancel"), "/v1/jobs/{id}/cancel");
        assert_eq!(route_template("/v1/agents/register"), "/v1/agents/register");
        assert_eq!(route_template("/v1/prices/H100"), "/v1/prices/{model}");
    }
}
