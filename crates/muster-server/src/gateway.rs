//! `muster gateway`: routes HTTP requests for a service to its ready
//! replicas (docs/services.md). It follows the server's endpoint table
//! (`GET /v1/endpoints`, a long poll), so a replica that drains leaves the
//! rotation before it stops. Requests are routed by host (`NAME.DOMAIN`,
//! under `--domain` only) or by path (`/NAME/...`, the prefix taken off),
//! never with muster's own cookie or bearer token, to the replica with the
//! fewest requests in flight; an idempotent request without a body whose
//! replica fails to answer (refused, reset) is sent to another. Per-service request counts,
//! latencies and errors are at `/_muster/metrics` (a service name cannot
//! start with `_`). HTTP/1.1 through hyper on both sides; nothing here
//! parses HTTP by hand.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full, combinators::BoxBody};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use muster_api::client::Client;
use muster_api::protocol::EndpointTable;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

type GatewayBody = BoxBody<Bytes, hyper::Error>;

/// The most connections served at once (more wait to be accepted).
const MAX_CONNECTIONS: usize = 10_000;
/// Attempts for an idempotent request without a body.
const ATTEMPTS: usize = 3;

#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    /// A reply from a replica slower than this is a 504.
    pub upstream_timeout: Duration,
    /// A request for a service with no ready replica (scaled to zero,
    /// starting) waits this long for one before it is answered 503.
    pub hold: Duration,
    /// Requests for host `NAME.DOMAIN` go to service NAME; without a
    /// domain, only the path routes (`/NAME/...`), so no service named
    /// like the gateway's own host name captures other services' traffic.
    pub domain: Option<String>,
}

/// What the gateway has seen of one service, reported to the server for
/// its autoscaler.
#[derive(Debug, Default)]
struct Counts {
    requests: std::sync::atomic::AtomicU64,
    in_flight: std::sync::atomic::AtomicU64,
    waiting: std::sync::atomic::AtomicU64,
}

/// Decrements a count when dropped.
struct Held<'a>(&'a std::sync::atomic::AtomicU64);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One replica in the rotation.
#[derive(Debug)]
struct Backend {
    address: String,
    job: u64,
    in_flight: AtomicUsize,
}

#[derive(Debug, Default)]
struct Pool {
    backends: Vec<Arc<Backend>>,
    next: AtomicUsize,
    /// `auth: {bearer_secret}`: the SHA-256 (hex) of the token a caller
    /// must send (empty: none passes).
    auth: Option<String>,
}

impl Pool {
    /// The replica with the fewest requests in flight, taking turns among
    /// equals; not one of `tried`.
    fn pick(&self, tried: &[u64]) -> Option<Arc<Backend>> {
        let count = self.backends.len();
        if count == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<&Arc<Backend>> = None;
        for offset in 0..count {
            let backend = &self.backends[(start + offset) % count];
            if tried.contains(&backend.job) {
                continue;
            }
            if best.is_none_or(|best| {
                backend.in_flight.load(Ordering::Relaxed) < best.in_flight.load(Ordering::Relaxed)
            }) {
                best = Some(backend);
            }
        }
        best.cloned()
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceLabel {
    service: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    service: String,
    /// `2xx` ... `5xx` as answered to the client.
    code: String,
}

struct Metrics {
    registry: Registry,
    requests: Family<ResultLabels, Counter>,
    seconds: Family<ServiceLabel, Histogram>,
    in_flight: Family<ServiceLabel, Gauge>,
    upstream_errors: Family<ServiceLabel, Counter>,
    retries: Family<ServiceLabel, Counter>,
}

impl Metrics {
    /// Drops a service's series (it is gone from the endpoint table), so
    /// that services created and deleted over time do not pile up here.
    fn forget(&self, service: &str) {
        let label = ServiceLabel {
            service: service.to_string(),
        };
        self.seconds.remove(&label);
        self.in_flight.remove(&label);
        self.upstream_errors.remove(&label);
        self.retries.remove(&label);
        // Codes are counted by hundreds, 1xx to 9xx.
        for hundreds in 1..=9 {
            self.requests.remove(&ResultLabels {
                service: service.to_string(),
                code: format!("{hundreds}xx"),
            });
        }
    }

    fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<ResultLabels, Counter>::default();
        let seconds = Family::<ServiceLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0,
            ])
        });
        let in_flight = Family::<ServiceLabel, Gauge>::default();
        let upstream_errors = Family::<ServiceLabel, Counter>::default();
        let retries = Family::<ServiceLabel, Counter>::default();
        registry.register(
            "muster_gateway_requests",
            "Requests answered, by service and status class",
            requests.clone(),
        );
        registry.register(
            "muster_gateway_request_seconds",
            "Time from a request's arrival to its reply's headers, by service",
            seconds.clone(),
        );
        registry.register(
            "muster_gateway_in_flight",
            "Requests being served, by service",
            in_flight.clone(),
        );
        registry.register(
            "muster_gateway_upstream_errors",
            "Requests a replica could not answer (connection refused or reset, timeout)",
            upstream_errors.clone(),
        );
        registry.register(
            "muster_gateway_retries",
            "Idempotent requests sent again to another replica",
            retries.clone(),
        );
        Metrics {
            registry,
            requests,
            seconds,
            in_flight,
            upstream_errors,
            retries,
        }
    }
}

struct State {
    routes: RwLock<BTreeMap<String, Arc<Pool>>>,
    /// Bumped by every new table (held requests wait on it).
    updated: tokio::sync::watch::Sender<u64>,
    counts: RwLock<BTreeMap<String, Arc<Counts>>>,
    /// Wakes the traffic reporter (a request is held).
    report_now: tokio::sync::Notify,
    http: HttpClient<HttpConnector, GatewayBody>,
    metrics: Metrics,
    config: GatewayConfig,
}

impl State {
    /// Takes a new endpoint table; replicas already known keep their
    /// in-flight counts.
    fn update(&self, table: &EndpointTable) {
        let mut routes = match self.routes.write() {
            Ok(routes) => routes,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut next = BTreeMap::new();
        for (service, endpoints) in &table.services {
            let known = routes.get(service);
            let backends = endpoints
                .iter()
                .map(|endpoint| {
                    known
                        .and_then(|pool| {
                            pool.backends.iter().find(|backend| {
                                backend.job == endpoint.job && backend.address == endpoint.address
                            })
                        })
                        .cloned()
                        .unwrap_or_else(|| {
                            Arc::new(Backend {
                                address: endpoint.address.clone(),
                                job: endpoint.job,
                                in_flight: AtomicUsize::new(0),
                            })
                        })
                })
                .collect();
            next.insert(
                service.clone(),
                Arc::new(Pool {
                    backends,
                    next: AtomicUsize::new(0),
                    auth: table.auth.get(service).cloned(),
                }),
            );
        }
        // Counts and metrics of services that are gone go too.
        for service in routes.keys().filter(|service| !next.contains_key(*service)) {
            self.metrics.forget(service);
        }
        match self.counts.write() {
            Ok(mut counts) => counts.retain(|service, _| next.contains_key(service)),
            Err(poisoned) => poisoned
                .into_inner()
                .retain(|service, _| next.contains_key(service)),
        }
        *routes = next;
        drop(routes);
        self.updated.send_modify(|version| *version += 1);
    }

    fn counts(&self, service: &str) -> Arc<Counts> {
        if let Some(counts) = match self.counts.read() {
            Ok(counts) => counts,
            Err(poisoned) => poisoned.into_inner(),
        }
        .get(service)
        {
            return counts.clone();
        }
        let mut counts = match self.counts.write() {
            Ok(counts) => counts,
            Err(poisoned) => poisoned.into_inner(),
        };
        counts.entry(service.to_string()).or_default().clone()
    }

    /// The traffic seen per service (known services only).
    fn report(&self, gateway: &str) -> muster_api::protocol::TrafficReport {
        let counts = match self.counts.read() {
            Ok(counts) => counts,
            Err(poisoned) => poisoned.into_inner(),
        };
        muster_api::protocol::TrafficReport {
            gateway: gateway.to_string(),
            services: counts
                .iter()
                .map(|(service, counts)| {
                    (
                        service.clone(),
                        muster_api::protocol::ServiceTraffic {
                            requests: counts.requests.load(Ordering::Relaxed),
                            in_flight: counts.in_flight.load(Ordering::Relaxed),
                            waiting: counts.waiting.load(Ordering::Relaxed),
                        },
                    )
                })
                .collect(),
        }
    }

    fn pool(&self, service: &str) -> Option<Arc<Pool>> {
        let routes = match self.routes.read() {
            Ok(routes) => routes,
            Err(poisoned) => poisoned.into_inner(),
        };
        routes.get(service).cloned()
    }

    fn knows(&self, service: &str) -> bool {
        self.pool(service).is_some()
    }
}

/// A running gateway.
pub struct GatewayHandle {
    pub addr: SocketAddr,
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl GatewayHandle {
    /// Stops accepting and following; connections in progress end.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Where a gateway learns the services' ready replicas.
pub enum Endpoints {
    /// A server's endpoint table, followed (what `muster gateway` does).
    Server(Client),
    /// A fixed table (`muster bench gateway`, against a local backend).
    Fixed(EndpointTable),
}

/// Starts a gateway on `config.listen` that routes by `endpoints`. It
/// answers at once; until a server's first table arrives every service is
/// unknown (404).
pub async fn start(config: GatewayConfig, endpoints: Endpoints) -> anyhow::Result<GatewayHandle> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|error| anyhow::anyhow!("cannot listen on {}: {error}", config.listen))?;
    let addr = listener.local_addr()?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    let http = HttpClient::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_timer(TokioTimer::new())
        .build(connector);
    let state = Arc::new(State {
        routes: RwLock::new(BTreeMap::new()),
        updated: tokio::sync::watch::channel(0).0,
        counts: RwLock::new(BTreeMap::new()),
        report_now: tokio::sync::Notify::new(),
        http,
        metrics: Metrics::new(),
        config,
    });
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    match endpoints {
        Endpoints::Server(server) => {
            let name = format!("{}-{:08x}", addr, {
                let mut bytes = [0u8; 4];
                let _ = getrandom::fill(&mut bytes);
                u32::from_le_bytes(bytes)
            });
            tasks.push(tokio::spawn(report(
                state.clone(),
                server.clone(),
                name,
                stopped.clone(),
            )));
            tasks.push(tokio::spawn(follow(state.clone(), server, stopped.clone())))
        }
        Endpoints::Fixed(table) => state.update(&table),
    }
    tasks.push(tokio::spawn(serve(listener, state, stopped)));
    tracing::info!(%addr, "muster gateway listening");
    Ok(GatewayHandle { addr, stop, tasks })
}

async fn follow(
    state: Arc<State>,
    server: Client,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    let mut after: Option<(u64, u64)> = None;
    loop {
        let answer = tokio::select! {
            answer = server.endpoint_table(after) => answer,
            _ = stopped.changed() => return,
        };
        match answer {
            Ok(table) => {
                state.update(&table);
                after = Some((table.instance, table.version));
            }
            Err(error) => {
                tracing::warn!(%error, "cannot read the service endpoints; the last known stay");
                after = None;
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stopped.changed() => return,
                }
            }
        }
    }
}

/// Tells the server what each service's requests are (every second, and at
/// once when a request is held), for its autoscaler.
async fn report(
    state: Arc<State>,
    server: Client,
    name: String,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = state.report_now.notified() => {}
            _ = stopped.changed() => return,
        }
        let report = state.report(&name);
        if report.services.is_empty() {
            continue;
        }
        if let Err(error) = server.report_traffic(&report).await {
            tracing::debug!(%error, "the traffic report was not taken");
        }
    }
}

async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped.changed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(handle(&state, request, peer).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(30))
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            if let Err(error) = connection.await {
                tracing::debug!(%error, "a client connection ended with an error");
            }
            drop(permit);
        });
    }
}

fn text(status: StatusCode, message: String) -> Response<GatewayBody> {
    let mut response = Response::new(
        Full::new(Bytes::from(message + "\n"))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// The service a request is for, and the path to send on: by host when the
/// host is `NAME.DOMAIN` for the configured domain and a known service,
/// else by the path's first part.
fn route(state: &State, request: &Request<Incoming>) -> Option<(String, String)> {
    let path_and_query = request
        .uri()
        .path_and_query()
        .map_or("/", |path| path.as_str());
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|host| host.to_str().ok())
        .or_else(|| request.uri().host())
        .unwrap_or_default();
    if let Some(label) = host_service(host, state.config.domain.as_deref())
        && state.knows(label)
    {
        return Some((label.to_string(), path_and_query.to_string()));
    }
    let rest = path_and_query.strip_prefix('/')?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let service = &rest[..end];
    if service.is_empty() {
        return None;
    }
    let forward = match &rest[end..] {
        "" => "/".to_string(),
        tail if tail.starts_with('?') => format!("/{tail}"),
        tail => tail.to_string(),
    };
    Some((service.to_string(), forward))
}

/// The service a `Host` names under `domain`: `NAME` of `NAME.DOMAIN`
/// (a port and letter case aside); none without a domain.
fn host_service<'a>(host: &'a str, domain: Option<&str>) -> Option<&'a str> {
    let domain = domain?.trim_matches('.');
    let host = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let (label, rest) = host.split_once('.')?;
    (rest.eq_ignore_ascii_case(domain) && !label.is_empty()).then_some(label)
}

/// The names of muster's own cookies (the dashboard's session, and the
/// token cookie older servers set): never sent on to a service.
const MUSTER_COOKIES: &[&str] = &[crate::dashboard::COOKIE, crate::dashboard::OLD_COOKIE];

/// Takes muster's credentials out of a request meant for a service: its
/// cookies, and an `Authorization` that carries a muster token (a bearer
/// of 64 hex digits, the form of every muster token).
fn strip_muster_credentials(headers: &mut hyper::HeaderMap) {
    let cookies: Vec<String> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .map(str::trim)
        .filter(|cookie| !cookie.is_empty())
        .filter(|cookie| {
            let name = cookie
                .split_once('=')
                .map_or(*cookie, |(name, _)| name)
                .trim();
            !MUSTER_COOKIES.contains(&name)
        })
        .map(str::to_string)
        .collect();
    headers.remove(header::COOKIE);
    if !cookies.is_empty()
        && let Ok(value) = header::HeaderValue::from_str(&cookies.join("; "))
    {
        headers.insert(header::COOKIE, value);
    }
    let musters = headers
        .get_all(header::AUTHORIZATION)
        .iter()
        .any(|value| value.to_str().is_ok_and(is_muster_bearer));
    if musters {
        headers.remove(header::AUTHORIZATION);
    }
}

/// Whether `headers` carry `Authorization: Bearer TOKEN` whose SHA-256
/// (hex) is `expected` (compared in time that does not depend on where
/// they differ; an empty `expected` matches nothing).
fn bearer_matches(headers: &hyper::HeaderMap, expected: &str) -> bool {
    let Some(token) = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| {
            let (scheme, token) = value.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
    else {
        return false;
    };
    let got = crate::users::token_hash(token);
    !expected.is_empty()
        && got.len() == expected.len()
        && got
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |differ, (a, b)| differ | (a ^ b))
            == 0
}

/// `Bearer` and 64 hex digits: how muster's tokens travel.
fn is_muster_bearer(value: &str) -> bool {
    let mut words = value.split_whitespace();
    matches!(
        (words.next(), words.next(), words.next()),
        (Some(scheme), Some(token), None)
            if scheme.eq_ignore_ascii_case("bearer")
                && token.len() == 64
                && token.bytes().all(|b| b.is_ascii_hexdigit())
    )
}

/// Headers that concern one connection, not the request.
const HOP_BY_HOP: &[header::HeaderName] = &[
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn has_body(request: &Request<Incoming>) -> bool {
    let length = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|length| length.to_str().ok())
        .and_then(|length| length.parse::<u64>().ok());
    match length {
        Some(length) => length > 0,
        None => request.headers().contains_key(header::TRANSFER_ENCODING),
    }
}

async fn handle(
    state: &State,
    request: Request<Incoming>,
    peer: SocketAddr,
) -> Response<GatewayBody> {
    match request.uri().path() {
        "/_muster/healthz" => return text(StatusCode::OK, "ok".to_string()),
        "/_muster/metrics" => {
            let mut body = String::new();
            if let Err(error) =
                prometheus_client::encoding::text::encode(&mut body, &state.metrics.registry)
            {
                return text(StatusCode::INTERNAL_SERVER_ERROR, error.to_string());
            }
            let mut response = text(StatusCode::OK, body);
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            return response;
        }
        _ => {}
    }
    let started = Instant::now();
    let Some((service, forward)) = route(state, &request) else {
        return text(
            StatusCode::NOT_FOUND,
            "name a service: http://GATEWAY/NAME/... or a host NAME.DOMAIN".to_string(),
        );
    };
    let Some(mut pool) = state.pool(&service) else {
        return text(
            StatusCode::NOT_FOUND,
            format!("no service {service} (`muster services list` lists them)"),
        );
    };
    // Checked before anything counts the request: an unauthenticated
    // caller neither wakes a service scaled to zero nor reaches a replica.
    if let Some(expected) = &pool.auth
        && !bearer_matches(request.headers(), expected)
    {
        let mut response = text(
            StatusCode::UNAUTHORIZED,
            format!("service {service} needs `Authorization: Bearer TOKEN` (its bearer secret)"),
        );
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return response;
    }
    let mut request = request;
    if pool.auth.is_some() {
        // Checked here; the replica never sees the service's key.
        request.headers_mut().remove(header::AUTHORIZATION);
    }
    let counts = state.counts(&service);
    counts.requests.fetch_add(1, Ordering::Relaxed);
    counts.in_flight.fetch_add(1, Ordering::Relaxed);
    let _in_flight = Held(&counts.in_flight);
    let label = ServiceLabel {
        service: service.clone(),
    };
    if pool.backends.is_empty() {
        // Scaled to zero, or starting: the request waits for a replica.
        counts.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Held(&counts.waiting);
        state.report_now.notify_one();
        let mut updated = state.updated.subscribe();
        let deadline = tokio::time::Instant::now() + state.config.hold;
        loop {
            match state.pool(&service) {
                Some(now) if !now.backends.is_empty() => {
                    pool = now;
                    break;
                }
                Some(_) => {}
                None => {
                    return text(StatusCode::NOT_FOUND, format!("service {service} is gone"));
                }
            }
            if tokio::time::timeout_at(deadline, updated.changed())
                .await
                .is_err()
            {
                break;
            }
        }
    }
    let in_flight = state.metrics.in_flight.get_or_create(&label).clone();
    in_flight.inc();
    let response = forward_request(state, &pool, &label, request, &forward, peer).await;
    in_flight.dec();
    state
        .metrics
        .seconds
        .get_or_create(&label)
        .observe(started.elapsed().as_secs_f64());
    state
        .metrics
        .requests
        .get_or_create(&ResultLabels {
            service,
            code: format!("{}xx", response.status().as_u16() / 100),
        })
        .inc();
    response
}

async fn forward_request(
    state: &State,
    pool: &Pool,
    label: &ServiceLabel,
    request: Request<Incoming>,
    forward: &str,
    peer: SocketAddr,
) -> Response<GatewayBody> {
    let idempotent = matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    ) && !has_body(&request);
    let (mut parts, body) = request.into_parts();
    for name in HOP_BY_HOP {
        parts.headers.remove(name);
    }
    strip_muster_credentials(&mut parts.headers);
    if let Some(host) = parts.headers.get(header::HOST).cloned() {
        parts.headers.insert("x-forwarded-host", host);
    }
    let forwarded_for = match parts
        .headers
        .get("x-forwarded-for")
        .and_then(|value| value.to_str().ok())
    {
        Some(earlier) => format!("{earlier}, {}", peer.ip()),
        None => peer.ip().to_string(),
    };
    if let Ok(value) = header::HeaderValue::from_str(&forwarded_for) {
        parts.headers.insert("x-forwarded-for", value);
    }
    let mut body = Some(body);
    let mut tried: Vec<u64> = Vec::new();
    let attempts = if idempotent { ATTEMPTS } else { 1 };
    let mut last_error = String::new();
    for attempt in 0..attempts {
        let Some(backend) = pool.pick(&tried) else {
            break;
        };
        tried.push(backend.job);
        if attempt > 0 {
            state.metrics.retries.get_or_create(label).inc();
        }
        let uri = match format!("http://{}{forward}", backend.address).parse::<hyper::Uri>() {
            Ok(uri) => uri,
            Err(error) => {
                return text(
                    StatusCode::BAD_REQUEST,
                    format!("the request's path cannot be forwarded: {error}"),
                );
            }
        };
        let mut upstream = Request::new(match body.take() {
            Some(incoming) if !idempotent => incoming.boxed(),
            _ => Empty::new().map_err(|never| match never {}).boxed(),
        });
        *upstream.method_mut() = parts.method.clone();
        *upstream.uri_mut() = uri;
        *upstream.headers_mut() = parts.headers.clone();
        if let Ok(host) = header::HeaderValue::from_str(&backend.address) {
            upstream.headers_mut().insert(header::HOST, host);
        }
        backend.in_flight.fetch_add(1, Ordering::Relaxed);
        let guard = InFlight(backend.clone());
        let answer =
            tokio::time::timeout(state.config.upstream_timeout, state.http.request(upstream)).await;
        match answer {
            Ok(Ok(response)) => {
                let (mut parts, incoming) = response.into_parts();
                for name in HOP_BY_HOP {
                    parts.headers.remove(name);
                }
                // The replica counts as busy until its reply is sent.
                let body = Tracked {
                    inner: incoming,
                    _guard: guard,
                };
                return Response::from_parts(parts, body.boxed());
            }
            Ok(Err(error)) => {
                state.metrics.upstream_errors.get_or_create(label).inc();
                last_error = format!(
                    "replica job {} at {}: {error}",
                    backend.job, backend.address
                );
                tracing::debug!(service = %label.service, %last_error, "upstream error");
                // An idempotent request without a body goes to another
                // replica (refused, reset, closed before the reply: a
                // replica that died); others were tried once.
            }
            Err(_) => {
                state.metrics.upstream_errors.get_or_create(label).inc();
                return text(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "replica job {} did not answer within {}s",
                        backend.job,
                        state.config.upstream_timeout.as_secs()
                    ),
                );
            }
        }
    }
    if tried.is_empty() {
        let mut response = text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("service {} has no ready replica", label.service),
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return response;
    }
    text(
        StatusCode::BAD_GATEWAY,
        format!("no replica of {} answered: {last_error}", label.service),
    )
}

/// Counts a request in flight at its replica until dropped.
struct InFlight(Arc<Backend>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A replica's reply body, with its in-flight count held until it ends.
struct Tracked {
    inner: Incoming,
    _guard: InFlight,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposition(metrics: &Metrics) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &metrics.registry).expect("encodes");
        text
    }

    #[test]
    fn a_gone_services_series_are_dropped() {
        let metrics = Metrics::new();
        for service in ["web", "llm"] {
            let label = ServiceLabel {
                service: service.to_string(),
            };
            metrics.seconds.get_or_create(&label).observe(0.1);
            metrics.in_flight.get_or_create(&label).inc();
            metrics.upstream_errors.get_or_create(&label).inc();
            metrics.retries.get_or_create(&label).inc();
            for code in ["2xx", "5xx"] {
                metrics
                    .requests
                    .get_or_create(&ResultLabels {
                        service: service.to_string(),
                        code: code.to_string(),
                    })
                    .inc();
            }
        }
        assert!(exposition(&metrics).contains("service=\"web\""));
        metrics.forget("web");
        let text = exposition(&metrics);
        assert!(!text.contains("service=\"web\""), "{text}");
        assert!(text.contains("service=\"llm\",code=\"5xx\""), "{text}");
    }
}
