//! The web dashboard at `/`: read-only pages rendered by the server (maud
//! templates, every value escaped), charts as inline SVG, no JavaScript.
//! The same tokens as the API: the admin token sees everything, the
//! metrics token everything but task output. A browser signs in once (a
//! form, or `?token=` in a link) and gets an HttpOnly, SameSite=Strict
//! cookie (`Secure` under HTTPS, with HSTS) holding a random session id,
//! never the token (see [`crate::sessions`]); the sign-in's redirect is
//! `no-store`, and `/ui/logout` ends the session.
//!
//! Pages: overview (GPUs by pool and model, the last 24 hours), queues,
//! jobs (filterable; a job with per-rank usage charts and its output),
//! nodes (GPUs, telemetry, stack, health; a node with its last hour), cost.

use crate::api::{Identity, JobQuery};
use crate::core::{Shared, now};
use crate::error::{ApiError, Params, PathParams};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use maud::{DOCTYPE, Markup, PreEscaped, html};
use muster_api::protocol::{JobView, NodeView};
use std::collections::BTreeMap;
use std::sync::Arc;

type Shared_ = State<Arc<Shared>>;

/// The session cookie's name.
pub(crate) const COOKIE: &str = "muster_session";

/// The cookie that held the token itself before sessions: still never
/// forwarded by the gateway.
pub(crate) const OLD_COOKIE: &str = "muster_token";

/// The pages, behind [`sign_in`].
pub fn routes(shared: Arc<Shared>) -> axum::Router<Arc<Shared>> {
    axum::Router::new()
        .route("/", get(overview))
        .route("/ui/queues", get(queues))
        .route("/ui/jobs", get(jobs))
        .route("/ui/jobs/{id}", get(job))
        .route("/ui/nodes", get(nodes))
        .route("/ui/nodes/{name}", get(node))
        .route("/ui/cost", get(cost))
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&shared),
            sign_in,
        ))
        .route("/ui/login", post(login))
        .route("/ui/logout", post(logout))
}

/// Who may see the pages: the admin, or the metrics token (no task output).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Viewer {
    Admin,
    ReadOnly,
}

fn viewer_of(shared: &Shared, token: &str) -> Option<Viewer> {
    match crate::api::identify(shared, token)? {
        Identity::Admin => Some(Viewer::Admin),
        // Operators see every job and its output anyway.
        Identity::User(principal) if principal.role >= crate::users::Role::Operator => {
            Some(Viewer::Admin)
        }
        Identity::Metrics => Some(Viewer::ReadOnly),
        // A user sees its own jobs through the CLI and the API; the pages
        // show the whole cluster.
        Identity::User(_) | Identity::Join(_) | Identity::Node(_) => None,
    }
}

fn session_id(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .find_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))
}

/// The token a request's session cookie stands for.
fn session_token(shared: &Shared, headers: &HeaderMap) -> Option<String> {
    let id = session_id(headers)?;
    shared
        .sessions
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .token(id, now().0)
        .map(str::to_string)
}

/// Signs a browser in: a new session for `token`, its cookie on a
/// redirect to `target` that no cache keeps.
fn signed_in(shared: &Shared, token: &str, target: &str) -> Response {
    let opened = shared
        .sessions
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .open(token, now().0);
    let id = match opened {
        Ok(id) => id,
        Err(error) => {
            return error_page(ApiError::new(
                muster_api::protocol::ErrorCode::Internal,
                error.to_string(),
            ));
        }
    };
    let secure = if shared.settings.https {
        "; Secure"
    } else {
        ""
    };
    let cookie = format!(
        "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}{secure}",
        crate::sessions::SESSION_TTL_MS / 1000
    );
    let mut response = Redirect::to(target).into_response();
    if let Ok(cookie) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    harden(response.headers_mut());
    response
}

/// Pages need a token: from the cookie, a bearer header, or `?token=`
/// (kept in the cookie, then taken out of the address by a redirect).
async fn sign_in(State(shared): Shared_, request: Request, next: Next) -> Response {
    let mut response = sign_in_pages(&shared, request, next).await;
    hsts(&shared, response.headers_mut());
    response
}

async fn sign_in_pages(shared: &Arc<Shared>, mut request: Request, next: Next) -> Response {
    let shared = Arc::clone(shared);
    let query_token = request.uri().query().and_then(|query| {
        query
            .split('&')
            .find_map(|pair| pair.strip_prefix("token="))
            .map(str::to_string)
    });
    if let Some(token) = query_token {
        if viewer_of(&shared, &token).is_none() {
            return page_response(
                StatusCode::UNAUTHORIZED,
                login_page(Some("that token is not one this server knows")),
            );
        }
        let rest: Vec<&str> = request
            .uri()
            .query()
            .unwrap_or_default()
            .split('&')
            .filter(|pair| !pair.starts_with("token=") && !pair.is_empty())
            .collect();
        let target = if rest.is_empty() {
            request.uri().path().to_string()
        } else {
            format!("{}?{}", request.uri().path(), rest.join("&"))
        };
        return signed_in(&shared, &token, &target);
    }
    let token = session_token(&shared, request.headers())
        .or_else(|| crate::auth::bearer(request.headers()).map(str::to_string));
    let Some(viewer) = token.and_then(|token| viewer_of(&shared, &token)) else {
        return page_response(StatusCode::UNAUTHORIZED, login_page(None));
    };
    request.extensions_mut().insert(viewer);
    let mut response = next.run(request).await;
    harden(response.headers_mut());
    response
}

#[derive(Debug, serde::Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(State(shared): Shared_, axum::Form(form): axum::Form<LoginForm>) -> Response {
    let token = form.token.trim();
    let mut response = if viewer_of(&shared, token).is_none() {
        page_response(
            StatusCode::UNAUTHORIZED,
            login_page(Some("that token is not one this server knows")),
        )
    } else {
        signed_in(&shared, token, "/")
    };
    hsts(&shared, response.headers_mut());
    response
}

/// Ends the browser's session and clears its cookie.
async fn logout(State(shared): Shared_, headers: HeaderMap) -> Response {
    if let Some(id) = session_id(&headers) {
        shared
            .sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .close(id);
    }
    let mut response = Redirect::to("/").into_response();
    response.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static("muster_session=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"),
    );
    harden(response.headers_mut());
    hsts(&shared, response.headers_mut());
    response
}

/// Under HTTPS, browsers are told to use nothing else for a year.
fn hsts(shared: &Shared, headers: &mut HeaderMap) {
    if shared.settings.https {
        headers.insert(
            header::STRICT_TRANSPORT_SECURITY,
            HeaderValue::from_static("max-age=31536000"),
        );
    }
}

/// No scripts, no framing, nothing loaded from elsewhere, nothing cached.
fn harden(headers: &mut HeaderMap) {
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}

fn page_response(status: StatusCode, markup: Markup) -> Response {
    let mut response = (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        markup.into_string(),
    )
        .into_response();
    harden(response.headers_mut());
    response
}

fn error_page(error: ApiError) -> Response {
    page_response(
        error.status,
        layout("error", html! { p class="error" { (error.body.message) } }),
    )
}

const STYLE: &str = "
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
nav{background:#1d2330;padding:8px 16px}nav a{color:#dfe6f3;margin-right:18px;text-decoration:none}
nav b{color:#fff;margin-right:24px}main{padding:16px 20px;max-width:1200px}
table{border-collapse:collapse;background:#fff;margin:8px 0 16px}
th,td{padding:4px 10px;border-bottom:1px solid #e3e6eb;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.tiles{display:flex;gap:12px;flex-wrap:wrap}.tile{background:#fff;padding:10px 16px;border:1px solid #e3e6eb}
.tile b{display:block;font-size:22px}.error{color:#b3261e}.muted{color:#6b7385}
pre{background:#10141c;color:#d8dee9;padding:10px;overflow:auto;max-height:480px}
svg{background:#fff;border:1px solid #e3e6eb}form.filter{margin:8px 0}
";

fn layout(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { "muster: " (title) }
                link rel="icon" href="data:,";
                style { (PreEscaped(STYLE)) }
            }
            body {
                nav {
                    b { "muster" }
                    a href="/" { "Overview" }
                    a href="/ui/queues" { "Queues" }
                    a href="/ui/jobs" { "Jobs" }
                    a href="/ui/nodes" { "Nodes" }
                    a href="/ui/cost" { "Cost" }
                }
                main { h1 { (title) } (body) }
            }
        }
    }
}

fn login_page(problem: Option<&str>) -> Markup {
    layout(
        "sign in",
        html! {
            @if let Some(problem) = problem { p class="error" { (problem) } }
            p { "Paste the admin token (admin.token in the server's data directory) or the \
                 metrics token (metrics.token, read-only: no task output)." }
            form method="post" action="/ui/login" {
                input type="password" name="token" size="70" autocomplete="off";
                " "
                button type="submit" { "Sign in" }
            }
        },
    )
}

fn page(title: &str, body: Markup) -> Response {
    page_response(StatusCode::OK, layout(title, body))
}

/// A line chart: each series (label, colour, points (x, y)) over
/// `x_range`, y from 0 to `y_max` (at least 1).
/// (label, colour, points).
type Series<'a> = (&'a str, &'a str, Vec<(f64, f64)>);

struct Chart<'a> {
    series: Vec<Series<'a>>,
    x_range: (f64, f64),
    y_max: f64,
    y_unit: &'a str,
    x_labels: (String, String),
}

impl Chart<'_> {
    fn render(&self) -> Markup {
        const W: f64 = 720.0;
        const H: f64 = 180.0;
        const LEFT: f64 = 48.0;
        const BOTTOM: f64 = 22.0;
        let (x0, x1) = self.x_range;
        let span = (x1 - x0).max(1.0);
        let y_max = if self.y_max > 0.0 { self.y_max } else { 1.0 };
        let x = |value: f64| LEFT + (value - x0) / span * (W - LEFT - 8.0);
        let y = |value: f64| 8.0 + (1.0 - (value / y_max).clamp(0.0, 1.0)) * (H - BOTTOM - 8.0);
        html! {
            svg width=(W) height=(H) viewBox={"0 0 " (W) " " (H)} role="img" {
                @for tick in [0.0, y_max / 2.0, y_max] {
                    line x1=(LEFT) x2=(W - 8.0) y1=(y(tick)) y2=(y(tick)) stroke="#e3e6eb" {}
                    text x="4" y=(y(tick) + 4.0) font-size="11" fill="#6b7385" {
                        (format!("{tick:.0}{}", self.y_unit))
                    }
                }
                text x=(LEFT) y=(H - 6.0) font-size="11" fill="#6b7385" { (self.x_labels.0) }
                text x=(W - 60.0) y=(H - 6.0) font-size="11" fill="#6b7385" { (self.x_labels.1) }
                @for (label, colour, points) in &self.series {
                    polyline fill="none" stroke=(colour) stroke-width="1.5"
                        points=(points.iter().map(|(px, py)| format!("{:.1},{:.1}", x(*px), y(*py))).collect::<Vec<_>>().join(" ")) {
                        title { (label) }
                    }
                    // A series of a point or two is shown by its points.
                    @if points.len() <= 3 {
                        @for (px, py) in points {
                            circle cx=(format!("{:.1}", x(*px))) cy=(format!("{:.1}", y(*py))) r="3" fill=(colour) {}
                        }
                    }
                }
            }
            p class="muted" {
                @for (label, colour, _) in &self.series {
                    span style={"color:" (colour)} { "■ " } (label) "   "
                }
            }
        }
    }
}

// ------------------------------------------------------------- overview

#[derive(Debug, Default, Clone, Copy)]
struct GpuCounts {
    total: u32,
    allocated: u32,
    idle: u32,
    free: u32,
    unhealthy: u32,
}

async fn overview(State(shared): Shared_) -> Response {
    let nodes = crate::api::list_nodes(State(Arc::clone(&shared)))
        .await
        .0
        .nodes;
    let latest = latest_utilization(&shared);
    let mut by_pool: BTreeMap<(String, String), GpuCounts> = BTreeMap::new();
    let mut all = GpuCounts::default();
    for node in &nodes {
        for (gpu, free) in node.gpus.iter().zip(&node.gpu_free) {
            let counts = by_pool
                .entry((node.pool.clone(), gpu.model.clone()))
                .or_default();
            for counts in [counts, &mut all] {
                counts.total += 1;
                if node.unhealthy_gpus.contains(&gpu.index) {
                    counts.unhealthy += 1;
                } else if *free < 1000 {
                    counts.allocated += 1;
                    if latest
                        .get(&(node.name.clone(), gpu.index))
                        .is_some_and(|util| *util < muster_control::usage::IDLE_UTILIZATION_PCT)
                    {
                        counts.idle += 1;
                    }
                } else {
                    counts.free += 1;
                }
            }
        }
    }
    let (running, pending) = {
        let core = shared.read();
        let control = core.control();
        (
            control
                .jobs()
                .filter(|j| j.state == muster_control::JobState::Running)
                .count(),
            control
                .jobs()
                .filter(|j| j.state == muster_control::JobState::Pending)
                .count(),
        )
    };
    let now_ms = now().0;
    let since = now_ms.saturating_sub(86_400_000);
    let minutes = match shared.store.cluster_minutes(since).await {
        Ok(minutes) => minutes,
        Err(error) => return error_page(error.into()),
    };
    let minute_ms = muster_control::accounting::MINUTE_MS as f64;
    let chart = Chart {
        series: vec![
            (
                "GPUs allocated",
                "#3b6fd8",
                minutes
                    .iter()
                    .map(|(m, allocated, _)| (*m as f64, *allocated as f64 / minute_ms))
                    .collect(),
            ),
            (
                "GPUs used (utilisation-weighted)",
                "#2e9e5b",
                minutes
                    .iter()
                    .map(|(m, _, used)| (*m as f64, *used as f64 / minute_ms))
                    .collect(),
            ),
        ],
        x_range: (since as f64, now_ms as f64),
        y_max: f64::from(all.total),
        y_unit: "",
        x_labels: ("24 h ago".to_string(), "now".to_string()),
    };
    page(
        "overview",
        html! {
            div class="tiles" {
                div class="tile" { b data-test="gpus-total" { (all.total) } "GPUs" }
                div class="tile" { b data-test="gpus-allocated" { (all.allocated) } "allocated" }
                div class="tile" { b data-test="gpus-idle" { (all.idle) } "allocated, idle (<5%)" }
                div class="tile" { b data-test="gpus-free" { (all.free) } "free" }
                div class="tile" { b data-test="gpus-unhealthy" { (all.unhealthy) } "out of service" }
                div class="tile" { b data-test="jobs-running" { (running) } "jobs running" }
                div class="tile" { b data-test="jobs-pending" { (pending) } "jobs pending" }
                div class="tile" { b data-test="nodes" { (nodes.len()) } "nodes" }
            }
            h2 { "GPUs by pool and model" }
            table {
                tr { th { "pool" } th { "model" } th { "GPUs" } th { "allocated" } th { "idle" } th { "free" } th { "out of service" } th { "" } }
                @for ((pool, model), counts) in &by_pool {
                    tr {
                        td { (pool) } td { (model) }
                        td class="n" { (counts.total) } td class="n" { (counts.allocated) }
                        td class="n" { (counts.idle) } td class="n" { (counts.free) }
                        td class="n" { (counts.unhealthy) }
                        td { (share_bar(&[
                            (counts.allocated - counts.idle, "#3b6fd8"),
                            (counts.idle, "#e0a030"),
                            (counts.free, "#cfd6e2"),
                            (counts.unhealthy, "#b3261e"),
                        ])) }
                    }
                }
            }
            h2 { "The last 24 hours" }
            @if minutes.is_empty() {
                p class="muted" { "No GPU time accounted yet." }
            } @else {
                (chart.render())
            }
        },
    )
}

/// A horizontal bar split in proportion to `parts`.
fn share_bar(parts: &[(u32, &str)]) -> Markup {
    let total: u32 = parts.iter().map(|(n, _)| n).sum();
    let mut left = 0.0;
    let rects: Vec<(f64, f64, &str)> = parts
        .iter()
        .map(|(count, colour)| {
            let width = if total == 0 {
                0.0
            } else {
                200.0 * f64::from(*count) / f64::from(total)
            };
            left += width;
            (left - width, width, *colour)
        })
        .collect();
    html! {
        svg width="200" height="14" {
            @for (x, width, colour) in rects {
                rect x=(x) y="0" width=(width) height="14" fill=(colour) {}
            }
        }
    }
}

/// Each (node, GPU)'s latest utilisation from fresh telemetry.
fn latest_utilization(shared: &Shared) -> BTreeMap<(String, u32), u32> {
    let telemetry = match shared.telemetry.lock() {
        Ok(telemetry) => telemetry,
        Err(poisoned) => poisoned.into_inner(),
    };
    let now_ms = now().0;
    telemetry
        .iter()
        .filter(|(_, t)| now_ms.saturating_sub(t.received_ms) <= crate::metrics::STALE_MS)
        .flat_map(|(node, t)| {
            t.report
                .gpus
                .iter()
                .map(move |gpu| ((node.clone(), gpu.index), gpu.utilization_pct))
        })
        .collect()
}

// --------------------------------------------------------------- queues

async fn queues(State(shared): Shared_) -> Response {
    let queues = crate::api::list_queues(State(Arc::clone(&shared)))
        .await
        .0
        .queues;
    let mut reasons: BTreeMap<(String, &'static str), u32> = BTreeMap::new();
    {
        let core = shared.read();
        for job in core
            .control()
            .jobs()
            .filter(|j| j.state == muster_control::JobState::Pending)
        {
            let code = core.control().pending_code(job.id).unwrap_or("unscheduled");
            *reasons.entry((job.spec.queue.0.clone(), code)).or_default() += 1;
        }
    }
    page(
        "queues",
        html! {
            table {
                tr { th { "queue" } th { "guaranteed" } th { "borrow limit" } th { "weight" }
                     th { "GPUs in use" } th { "running" } th { "pending" } th { "why pending" }
                     th { "spent this month" } th { "budget" } }
                @for queue in &queues {
                    tr data-queue=(queue.name) {
                        td { a href={"/ui/jobs?queue=" (queue.name)} { (queue.name) } }
                        td class="n" { (queue.guaranteed_gpus) }
                        td class="n" { (queue.borrow_limit_gpus.map_or("unlimited".to_string(), |b| b.to_string())) }
                        td class="n" { (queue.weight) }
                        td class="n" data-test="in-use" { (queue.in_use_gpus) }
                        td class="n" data-test="running" { (queue.running_jobs) }
                        td class="n" data-test="pending" { (queue.pending_jobs) }
                        td {
                            @for ((name, code), count) in &reasons {
                                @if name == &queue.name { (code) ": " (count) " " }
                            }
                        }
                        td class="n" { (format!("{:.2}", queue.spent_this_month)) }
                        td { @match queue.budget {
                            Some(budget) => { (format!("{budget:.2}")) @if queue.budget_hard { " (hard)" } }
                            None => { "-" }
                        } }
                    }
                }
            }
        },
    )
}

// ----------------------------------------------------------------- jobs

#[derive(Debug, Default, serde::Deserialize)]
struct JobFilterForm {
    state: Option<String>,
    queue: Option<String>,
    user: Option<String>,
}

async fn jobs(State(shared): Shared_, Params(filter): Params<JobFilterForm>) -> Response {
    let blank = |value: &Option<String>| value.clone().filter(|v| !v.trim().is_empty());
    let query = JobQuery {
        state: blank(&filter.state),
        queue: blank(&filter.queue),
        user: blank(&filter.user),
        limit: Some(200),
        ..JobQuery::default()
    };
    let list = match crate::api::list_jobs(
        State(Arc::clone(&shared)),
        axum::Extension(Identity::Admin),
        Params(query),
    )
    .await
    {
        Ok(list) => list.0,
        Err(error) => return error_page(error),
    };
    page(
        "jobs",
        html! {
            form class="filter" method="get" action="/ui/jobs" {
                "state " input name="state" size="10" value=(filter.state.clone().unwrap_or_default());
                " queue " input name="queue" size="12" value=(filter.queue.clone().unwrap_or_default());
                " user " input name="user" size="12" value=(filter.user.clone().unwrap_or_default());
                " " button type="submit" { "Filter" }
            }
            p class="muted" { "The newest 200." }
            table {
                tr { th { "id" } th { "name" } th { "user" } th { "queue" } th { "state" }
                     th { "nodes × GPUs" } th { "where / why" } }
                @for job in &list.jobs {
                    tr data-job=(job.id) {
                        td { a href={"/ui/jobs/" (job.id)} { (job.id) } }
                        td { (job.name) } td { (job.user) } td { (job.queue) }
                        td data-test="state" { (job.state) @if job.idle_for_s.is_some() { " (idle)" } }
                        td class="n" { (job.nodes) " × " (job.gpus_per_node) }
                        td { (where_or_why(job)) }
                    }
                }
            }
        },
    )
}

fn where_or_why(job: &JobView) -> String {
    if let Some(reason) = &job.pending_reason {
        return reason.clone();
    }
    let nodes: Vec<&str> = job.tasks.iter().map(|t| t.node.as_str()).collect();
    nodes.join(", ")
}

async fn job(
    State(shared): Shared_,
    axum::Extension(viewer): axum::Extension<Viewer>,
    PathParams(id): PathParams<String>,
) -> Response {
    let view = match crate::api::get_job(
        State(Arc::clone(&shared)),
        axum::Extension(Identity::Admin),
        PathParams(id.clone()),
    )
    .await
    {
        Ok(view) => view.0,
        Err(error) => return error_page(error),
    };
    let usage = match crate::accounting::job_usage(
        State(Arc::clone(&shared)),
        axum::Extension(Identity::Admin),
        PathParams(id),
    )
    .await
    {
        Ok(usage) => usage.0,
        Err(error) => return error_page(error),
    };
    let output = if viewer == Viewer::Admin {
        view.tasks.iter().find(|t| t.rank == 0).and_then(|task| {
            let end = shared.logs.read(task.allocation, 0, 0).ok()?.end;
            let read = shared
                .logs
                .read(task.allocation, end.saturating_sub(8_192), 8_192)
                .ok()?;
            Some(String::from_utf8_lossy(&read.data).into_owned())
        })
    } else {
        None
    };
    let colours = [
        "#3b6fd8", "#2e9e5b", "#e0a030", "#b3261e", "#7b4fd0", "#1c9aa6",
    ];
    let first = usage.minutes.first().map_or(0, |p| p.minute_ms) as f64;
    let last = usage.minutes.last().map_or(0, |p| p.minute_ms) as f64;
    let mut per_rank: BTreeMap<u32, Vec<(f64, f64)>> = BTreeMap::new();
    for point in &usage.minutes {
        if let Some(mean) = point.mean_utilization_pct {
            per_rank
                .entry(point.rank)
                .or_default()
                .push((point.minute_ms as f64, mean));
        }
    }
    let labels: Vec<String> = per_rank.keys().map(|rank| format!("rank {rank}")).collect();
    let chart = Chart {
        series: per_rank
            .into_iter()
            .zip(&labels)
            .enumerate()
            .map(|(i, ((_, points), label))| (label.as_str(), colours[i % colours.len()], points))
            .collect(),
        x_range: (first, last.max(first + 60_000.0)),
        y_max: 100.0,
        y_unit: "%",
        x_labels: ("start".to_string(), "latest".to_string()),
    };
    page(
        &format!("job {}: {}", view.id, view.name),
        html! {
            table {
                tr { th { "state" } td data-test="state" { (view.state) } }
                tr { th { "user / queue" } td { (view.user) " / " (view.queue) } }
                tr { th { "asks" } td { (view.nodes) " node(s) × " (view.gpus_per_node) " GPU(s)" } }
                tr { th { "command" } td { code { (view.command.join(" ")) } } }
                @if let Some(reason) = &view.pending_reason { tr { th { "pending" } td { (reason) } } }
                @if let Some(idle) = view.idle_for_s { tr { th { "idle" } td { "every GPU below 5% for " (idle) " s" } } }
                @for warning in &view.warnings { tr { th { "warning" } td class="error" { (warning) } } }
            }
            h2 { "Tasks" }
            table {
                tr { th { "rank" } th { "node" } th { "GPUs" } th { "state" } }
                @for task in &view.tasks {
                    tr { td { (task.rank) } td { a href={"/ui/nodes/" (task.node)} { (task.node) } }
                         td { (task.gpus.iter().map(|(i, _)| i.to_string()).collect::<Vec<_>>().join(",")) }
                         td { (task.state) } }
                }
            }
            h2 { "GPU use" }
            table {
                tr { th { "rank" } th { "mean" } th { "peak" } th { "peak memory" }
                     th { "GPU-h held" } th { "used" } th { "idle" } }
                @for rank in &usage.ranks {
                    tr data-rank=(rank.rank) {
                        td { (rank.rank) }
                        td class="n" data-test="mean" { (rank.mean_utilization_pct.map_or("-".to_string(), |m| format!("{m:.0}%"))) }
                        td class="n" { (rank.peak_utilization_pct) "%" }
                        td class="n" { (rank.peak_memory_mib) " MiB" }
                        td class="n" { (format!("{:.3}", rank.allocated_gpu_hours)) }
                        td class="n" { (format!("{:.3}", rank.used_gpu_hours)) }
                        td class="n" { (format!("{:.3}", rank.idle_gpu_hours)) }
                    }
                }
            }
            @if !usage.minutes.is_empty() { (chart.render()) }
            @match (viewer, output) {
                (Viewer::Admin, Some(text)) => { h2 { "Output (rank 0, the latest 8 KiB)" } pre { (text) } }
                (Viewer::Admin, None) => {}
                (Viewer::ReadOnly, _) => { p class="muted" { "Output needs the admin token." } }
            }
            h2 { "History" }
            table {
                @for event in &view.history { tr { td class="muted" { (clock(event.at_ms)) } td { (event.what) } } }
            }
        },
    )
}

/// `HH:MM:SS` UTC of a time in ms.
fn clock(ms: u64) -> String {
    let seconds = ms / 1000 % 86_400;
    format!(
        "{:02}:{:02}:{:02}",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60
    )
}

// ---------------------------------------------------------------- nodes

async fn nodes(State(shared): Shared_) -> Response {
    let nodes = crate::api::list_nodes(State(Arc::clone(&shared)))
        .await
        .0
        .nodes;
    let latest = latest_utilization(&shared);
    page(
        "nodes",
        html! {
            table {
                tr { th { "node" } th { "state" } th { "pool" } th { "GPUs (utilisation)" }
                     th { "driver / CUDA" } th { "health" } th { "note" } }
                @for node in &nodes {
                    tr data-node=(node.name) {
                        td { a href={"/ui/nodes/" (node.name)} { (node.name) } }
                        td { (node.state) @if node.cordoned { ", cordoned" } }
                        td { (node.pool) }
                        td { (gpu_bars(node, &latest)) }
                        td { (node.driver_version.clone().unwrap_or_default()) " / " (node.cuda_version.clone().unwrap_or_default()) }
                        td data-test="unhealthy" {
                            @if node.unhealthy_gpus.is_empty() { "ok" }
                            @else { span class="error" { (node.unhealthy_gpus.len()) " GPU(s) out of service" } }
                        }
                        td { (node.drift.clone().or(node.excluded.clone()).unwrap_or_default()) }
                    }
                }
            }
        },
    )
}

/// One small bar per GPU, as busy as its latest utilisation.
fn gpu_bars(node: &NodeView, latest: &BTreeMap<(String, u32), u32>) -> Markup {
    html! {
        svg width=(node.gpus.len() * 14 + 2) height="24" {
            @for (i, gpu) in node.gpus.iter().enumerate() {
                @let util = latest.get(&(node.name.clone(), gpu.index)).copied().unwrap_or(0);
                @let colour = if node.unhealthy_gpus.contains(&gpu.index) { "#b3261e" } else { "#3b6fd8" };
                rect x=(i * 14 + 1) y="1" width="12" height="22" fill="#eef1f5" {}
                rect x=(i * 14 + 1) y=(23 - util * 22 / 100) width="12" height=(util * 22 / 100) fill=(colour) {
                    title { "GPU " (gpu.index) ": " (util) "%" }
                }
            }
        }
    }
}

async fn node(State(shared): Shared_, PathParams(name): PathParams<String>) -> Response {
    let view =
        match crate::api::get_node(State(Arc::clone(&shared)), PathParams(name.clone())).await {
            Ok(view) => view.0,
            Err(error) => return error_page(error),
        };
    let points = match shared.history.lock() {
        Ok(history) => history.of(&name, now().0),
        Err(poisoned) => poisoned.into_inner().of(&name, now().0),
    };
    let colours = [
        "#3b6fd8", "#2e9e5b", "#e0a030", "#b3261e", "#7b4fd0", "#1c9aa6", "#8a8f98", "#d05f8a",
    ];
    let labels: Vec<String> = view
        .gpus
        .iter()
        .map(|gpu| format!("GPU {}", gpu.index))
        .collect();
    let now_ms = now().0 as f64;
    let chart = Chart {
        series: view
            .gpus
            .iter()
            .zip(&labels)
            .enumerate()
            .map(|(i, (gpu, label))| {
                (
                    label.as_str(),
                    colours[i % colours.len()],
                    points
                        .iter()
                        .filter_map(|p| {
                            let found = p.gpus.iter().find(|g| g.index == gpu.index)?;
                            Some((p.at_ms as f64, f64::from(found.utilization_pct)))
                        })
                        .collect(),
                )
            })
            .collect(),
        x_range: (now_ms - crate::history::HISTORY_MS as f64, now_ms),
        y_max: 100.0,
        y_unit: "%",
        x_labels: ("1 h ago".to_string(), "now".to_string()),
    };
    page(
        &format!("node {}", view.name),
        html! {
            table {
                tr { th { "state" } td data-test="state" { (view.state) @if view.cordoned { ", cordoned" } @if view.draining { ", draining" } } }
                tr { th { "pool / rack" } td { (view.pool) " / " (view.rack) } }
                tr { th { "address" } td { (view.address) } }
                tr { th { "CPUs / memory" } td { (view.cpu_milli / 1000) " / " (view.memory_mib / 1024) " GiB" } }
                tr { th { "driver / CUDA" } td { (view.driver_version.clone().unwrap_or_default()) " / " (view.cuda_version.clone().unwrap_or_default()) } }
                @for (component, version) in &view.stack { tr { th { (component) } td { (version) } } }
                @if let Some(drift) = &view.drift { tr { th { "drift" } td class="error" { (drift) } } }
                @for event in &view.gpu_events { tr { th { "GPU event" } td class="error" { (event) } } }
            }
            h2 { "GPUs" }
            table {
                tr { th { "index" } th { "model" } th { "memory" } th { "free" } th { "health" } th { "UUID" } }
                @for (gpu, free) in view.gpus.iter().zip(&view.gpu_free) {
                    tr data-gpu=(gpu.index) {
                        td { (gpu.index) } td { (gpu.model) } td class="n" { (gpu.memory_mib / 1024) " GiB" }
                        td class="n" { (format!("{:.3}", f64::from(*free) / 1000.0)) }
                        td data-test="health" { @if view.unhealthy_gpus.contains(&gpu.index) { span class="error" { "out of service" } } @else { "ok" } }
                        td class="muted" { (gpu.uuid) }
                    }
                }
            }
            h2 { "Utilisation, the last hour" }
            @if points.is_empty() { p class="muted" { "No telemetry yet." } } @else { (chart.render()) }
        },
    )
}

// ----------------------------------------------------------------- cost

#[derive(Debug, Default, serde::Deserialize)]
struct CostForm {
    since: Option<String>,
    by: Option<String>,
}

async fn cost(State(shared): Shared_, Params(form): Params<CostForm>) -> Response {
    let since = form.since.clone().unwrap_or_else(|| "30d".to_string());
    let by = form.by.clone().unwrap_or_else(|| "queue".to_string());
    let query = crate::accounting::CostQuery {
        since: Some(since.clone()),
        by: Some(by.clone()),
    };
    let report =
        match crate::accounting::cost_endpoint(State(Arc::clone(&shared)), Params(query)).await {
            Ok(report) => report.0,
            Err(error) => return error_page(error),
        };
    page(
        "cost",
        html! {
            form class="filter" method="get" action="/ui/cost" {
                "since " input name="since" size="8" value=(since);
                " by " select name="by" {
                    @for option in ["queue", "user", "job", "pool"] {
                        option value=(option) selected[option == by] { (option) }
                    }
                }
                " " button type="submit" { "Show" }
            }
            table {
                tr { th { (by) } th { "GPU-h allocated" } th { "GPU-h used" } th { "GPU-h idle" }
                     th { "cost" } th { "waste (idle)" } }
                @for line in &report.lines {
                    tr data-key=(line.key) {
                        td { (line.key) }
                        td class="n" data-test="allocated" { (format!("{:.3}", line.allocated_gpu_hours)) }
                        td class="n" { (format!("{:.3}", line.used_gpu_hours)) }
                        td class="n" { (format!("{:.3}", line.idle_gpu_hours)) }
                        td class="n" data-test="cost" { (format!("{:.2}", line.cost)) }
                        td class="n" { (format!("{:.2}", line.waste)) }
                    }
                }
            }
            @if !report.unpriced_models.is_empty() {
                p class="muted" { "No price for " (report.unpriced_models.join(", ")) ": their hours cost 0 here." }
            }
        },
    )
}
