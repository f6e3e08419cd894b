//! A client for the `/v1` API (feature `client`), used by the CLI and the
//! agents. Every call sends the bearer token; an API error comes back as
//! [`ClientError::Api`] with the server's code and message.

mod failover;

use crate::protocol::*;
use failover::{
    ELECTION_WAIT, FIRST_RETRY_WAIT, READ_DEADLINE, REQUEST_DEADLINE, SUBMIT_RETRY_FOR, Servers,
    next_wait, no_longer_leads, rebase,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::time::Duration;

/// The `Upgrade` protocol of dev environments' tunnels.
pub const TUNNEL_PROTOCOL: &str = "muster-tunnel";

/// The message a follower answers with (503) while no server leads or the
/// leader does not answer: a submission waits and tries again.
pub const FOLLOWER_UNAVAILABLE: &str = "this server is a follower";

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error.
    #[error("{}", .body.message)]
    Api { status: u16, body: ErrorBody },
    /// The server could not be reached or the connection failed.
    #[error("cannot reach the muster server at {url}: {reason}")]
    Transport {
        url: String,
        reason: String,
        /// The request may have reached the server (it was sent and got no
        /// whole answer): what it asked may or may not have been done.
        sent: bool,
    },
    /// The answer was not what the API promises.
    #[error("unexpected answer from {url}: {reason}")]
    Decode { url: String, reason: String },
}

impl ClientError {
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api { body, .. } => Some(body.code),
            _ => None,
        }
    }
}

/// Filters for `GET /v1/jobs`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JobFilter {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Only jobs not finished.
    pub active: bool,
    /// The most jobs in one page (the server's default: 100).
    pub limit: Option<u32>,
    /// Where the previous page ended (its `next_cursor`).
    pub cursor: Option<String>,
    /// Only the elements of this array job.
    pub array: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct Client {
    servers: Arc<Servers>,
    token: String,
    user: Option<String>,
    http: reqwest::Client,
}

/// A key no other submission has: 128 bits from the process's random hash
/// seeds, the time and a counter.
fn idempotency_key() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut parts = [0u64; 2];
    for part in &mut parts {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u128(nanos);
        hasher.write_u64(count);
        hasher.write_u32(std::process::id());
        *part = hasher.finish();
    }
    format!("muster-{:016x}{:016x}", parts[0], parts[1])
}

/// An error with its causes, which say what went wrong (reqwest's own
/// message is only "error sending request").
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

fn transport_reason(error: &reqwest::Error) -> String {
    let text = chain(error);
    if text.contains("certificate") || text.contains("certificate authority") {
        format!(
            "{text} (the server's TLS certificate is not trusted: pass --ca-sha256 with the \
             fingerprint `muster server` printed, or set MUSTER_CA_SHA256 or MUSTER_CA_FILE)"
        )
    } else if text.contains("InvalidContentType") || text.contains("corrupt message") {
        format!("{text} (is the server speaking plain HTTP? then use an http:// URL)")
    } else if text.contains("invalid HTTP version")
        && error.url().is_some_and(|url| url.scheme() == "http")
    {
        format!(
            "{text} (the server answered in TLS: muster serves HTTPS by default, so use an \
             https:// URL)"
        )
    } else if error.is_timeout() {
        format!(
            "{text} (no answer in time: a request that changes something may or may not have \
             been carried out; look before doing it again)"
        )
    } else {
        text
    }
}

/// The header that names the user a submission is for.
pub const USER_HEADER: &str = "x-muster-user";

impl Client {
    /// `base` like `https://127.0.0.1:7070`; an `https` server must have a
    /// certificate the system trusts (see [`Client::with_trust`]).
    pub fn new(base: &str, token: &str) -> Self {
        // reqwest builds its TLS configuration even for http://: the
        // process's provider first, or it panics.
        let _ = crate::tls::provider();
        Client {
            servers: Servers::parse(base),
            token: token.to_string(),
            user: None,
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_default(),
        }
    }

    /// A client that trusts the server's certificate as `trust` says (the
    /// cluster CA's file or fingerprint; the system's roots when empty).
    pub fn with_trust(base: &str, token: &str, trust: &crate::tls::Trust) -> Result<Self, String> {
        let mut builder = reqwest::Client::builder().connect_timeout(Duration::from_secs(5));
        builder = match crate::tls::client_config(trust)? {
            Some(config) => builder.tls_backend_preconfigured(config),
            None => {
                crate::tls::provider();
                builder
            }
        };
        let http = builder
            .build()
            .map_err(|error| format!("cannot set up the HTTP client: {}", chain(&error)))?;
        Ok(Client {
            servers: Servers::parse(base),
            token: token.to_string(),
            user: None,
            http,
        })
    }

    /// The same server and trust with another token (sharing connections).
    pub fn with_token(&self, token: &str) -> Client {
        Client {
            servers: self.servers.clone(),
            token: token.to_string(),
            user: None,
            http: self.http.clone(),
        }
    }

    /// Submissions are recorded as this user's.
    pub fn with_user(mut self, user: &str) -> Self {
        self.user = Some(user.to_string());
        self
    }

    /// The servers as given (several separated by commas).
    pub fn base(&self) -> &str {
        &self.servers.given
    }

    /// The server requests go to now.
    pub fn current(&self) -> &str {
        self.servers.current().1
    }

    /// The current server did not answer in time: the next one given is
    /// used from now on (no change with one server).
    pub fn skip_server(&self) {
        let (index, _) = self.servers.current();
        self.servers.failed(index);
    }

    async fn send<T: DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<T, ClientError> {
        let request = match &self.user {
            Some(user) => request.header(USER_HEADER, user),
            None => request,
        };
        let transport = |error: reqwest::Error| ClientError::Transport {
            url: url.to_string(),
            reason: transport_reason(&error),
            sent: !error.is_connect() && !error.is_builder(),
        };
        let mut request = request
            .bearer_auth(&self.token)
            .build()
            .map_err(transport)?;
        // Every request has a deadline: a server stopped (SIGSTOP) or cut
        // off mid-answer is left for the next, never waited on for ever.
        request.timeout_mut().get_or_insert(REQUEST_DEADLINE);
        let count = self.servers.urls.len();
        let mut tried = 0;
        let response = loop {
            // One server: nowhere else to send it (no copy needed).
            if count == 1 {
                break self.http.execute(request).await;
            }
            let (index, server) = self.servers.current();
            let Some(mut attempt) = request.try_clone() else {
                break self.http.execute(request).await;
            };
            rebase(attempt.url_mut(), server);
            match self.http.execute(attempt).await {
                // A deposed leader refused it (the store took nothing of
                // it): the next server leads or forwards to the one that
                // does. Sent again there at once, to every server at most.
                Ok(response)
                    if response.status().as_u16() == 503
                        && tried + 1 < count
                        && no_longer_leads(&response) =>
                {
                    self.servers.failed(index);
                    tried += 1;
                }
                // Never sent: the next server may take it now.
                Err(error) if error.is_connect() => {
                    self.servers.failed(index);
                    tried += 1;
                    if tried >= count {
                        break Err(error);
                    }
                }
                // Perhaps taken, perhaps not: the caller decides whether
                // to send it again; later requests go to the next server.
                Err(error) if error.is_timeout() => {
                    self.servers.failed(index);
                    break Err(error);
                }
                other => break other,
            }
        }
        .map_err(transport)?;
        let status = response.status().as_u16();
        let bytes = response
            .bytes()
            .await
            .map_err(|error| ClientError::Transport {
                url: url.to_string(),
                reason: error.to_string(),
                sent: true,
            })?;
        if status >= 400 {
            let body = serde_json::from_slice::<ErrorBody>(&bytes).unwrap_or_else(|_| ErrorBody {
                code: ErrorCode::Internal,
                message: format!(
                    "the server answered {status}: {}",
                    String::from_utf8_lossy(&bytes)
                ),
            });
            return Err(ClientError::Api { status, body });
        }
        serde_json::from_slice(&bytes).map_err(|error| ClientError::Decode {
            url: url.to_string(),
            reason: error.to_string(),
        })
    }

    /// A read, given up after [`READ_DEADLINE`]. One that a follower
    /// answers with no leader to forward to (an election under way), or,
    /// with several servers, one not answered (the next server is asked),
    /// is asked again, backing off, for up to [`ELECTION_WAIT`].
    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        let deadline = std::time::Instant::now() + ELECTION_WAIT;
        let mut wait = FIRST_RETRY_WAIT;
        let several = self.servers.urls.len() > 1;
        loop {
            let url = format!("{}{path}", self.current());
            let request = self.http.get(&url).timeout(READ_DEADLINE);
            match self.send(request, &url).await {
                Err(ClientError::Api { status: 503, body })
                    if body.message.starts_with(FOLLOWER_UNAVAILABLE)
                        && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(wait).await;
                    wait = next_wait(wait);
                }
                Err(ClientError::Transport { .. })
                    if several && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(wait).await;
                    wait = next_wait(wait);
                }
                other => return other,
            }
        }
    }

    async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
        timeout: Option<Duration>,
    ) -> Result<T, ClientError> {
        let url = format!("{}{path}", self.current());
        let mut request = self.http.post(&url).json(body);
        if let Some(timeout) = timeout {
            request = request.timeout(timeout);
        }
        self.send(request, &url).await
    }

    pub async fn submit(&self, spec: serde_json::Value) -> Result<u64, ClientError> {
        self.submit_with(spec, false).await
    }

    /// [`Client::submit`]; `allow_pending` queues a job no registered node
    /// could ever hold instead of having it refused.
    pub async fn submit_with(
        &self,
        spec: serde_json::Value,
        allow_pending: bool,
    ) -> Result<u64, ClientError> {
        Ok(self.submit_request(spec, allow_pending).await?.id)
    }

    /// [`Client::submit_with`], answering the whole response (an array's
    /// element count too). The submission carries a fresh `Idempotency-Key`
    /// and is retried with it while the server cannot be reached (up to a
    /// minute, backing off): a server that crashed after saving the job
    /// answers the same job when it is back, never a second one.
    pub async fn submit_request(
        &self,
        spec: serde_json::Value,
        allow_pending: bool,
    ) -> Result<SubmitResponse, ClientError> {
        let request = SubmitRequest {
            spec,
            allow_pending,
        };
        let key = idempotency_key();
        let deadline = std::time::Instant::now() + SUBMIT_RETRY_FOR;
        let mut wait = FIRST_RETRY_WAIT;
        // Whether some attempt may have reached a server: then a failure
        // in the end does not mean the job was not accepted.
        let mut unknown = false;
        loop {
            let answer = self.submit_attempt(&request, &key, None).await;
            // Sent with no whole answer, or refused by a leader whose commit
            // failed (which may have landed): either may have taken the job.
            match &answer {
                Err(ClientError::Transport { sent: true, .. }) => unknown = true,
                Err(ClientError::Api { status: 503, body })
                    if body.message.starts_with(NO_LONGER_LEADS)
                        && body.message.contains(STORE_COMMIT_FAILED) =>
                {
                    unknown = true;
                }
                _ => {}
            }
            match answer {
                Err(ClientError::Transport { .. }) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(wait).await;
                    wait = next_wait(wait);
                }
                // A follower with no leader to forward to (an election
                // under way), or a leader stepping down (its store took
                // nothing, or took the job with this key): ask again.
                Err(ClientError::Api { status: 503, body })
                    if (body.message.starts_with(FOLLOWER_UNAVAILABLE)
                        || body.message.starts_with(NO_LONGER_LEADS))
                        && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(wait).await;
                    wait = next_wait(wait);
                }
                // A retry that arrived while the first was still being
                // saved: ask again.
                Err(ClientError::Api { status: 409, body })
                    if body.message.contains("Idempotency-Key")
                        && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(wait).await;
                }
                Err(error) => return Err(failover::given_up(error, unknown, &key)),
                other => return other,
            }
        }
    }

    /// One submission attempt, not retried (for measuring; users want
    /// [`Client::submit`]).
    pub async fn submit_once(&self, spec: serde_json::Value) -> Result<u64, ClientError> {
        let request = SubmitRequest {
            spec,
            allow_pending: false,
        };
        let answer = self
            .submit_attempt(&request, &idempotency_key(), Some(Duration::from_secs(5)))
            .await?;
        Ok(answer.id)
    }

    /// One `POST /v1/jobs` with idempotency key `key`.
    async fn submit_attempt(
        &self,
        request: &SubmitRequest,
        key: &str,
        timeout: Option<Duration>,
    ) -> Result<SubmitResponse, ClientError> {
        let url = format!("{}/v1/jobs", self.current());
        let mut post = self
            .http
            .post(&url)
            .header("idempotency-key", key)
            .json(request);
        if let Some(timeout) = timeout {
            post = post.timeout(timeout);
        }
        self.send(post, &url).await
    }

    pub async fn jobs(&self, filter: &JobFilter) -> Result<JobList, ClientError> {
        let mut query = Vec::new();
        let limit = filter.limit.map(|limit| limit.to_string());
        let active = filter.active.then(|| "true".to_string());
        let array = filter.array.map(|array| array.to_string());
        for (key, value) in [
            ("array", &array),
            ("queue", &filter.queue),
            ("state", &filter.state),
            ("user", &filter.user),
            ("active", &active),
            ("limit", &limit),
            ("cursor", &filter.cursor),
        ] {
            if let Some(value) = value {
                query.push(format!("{key}={}", encode(value)));
            }
        }
        let suffix = if query.is_empty() {
            String::new()
        } else {
            format!("?{}", query.join("&"))
        };
        self.get(&format!("/v1/jobs{suffix}")).await
    }

    /// Up to `most` jobs of `filter` (every one: `None`), newest first,
    /// page by page.
    pub async fn all_jobs(
        &self,
        filter: &JobFilter,
        most: Option<usize>,
    ) -> Result<(Vec<JobView>, bool), ClientError> {
        let mut filter = filter.clone();
        let mut jobs = Vec::new();
        loop {
            if let Some(most) = most {
                let left = most.saturating_sub(jobs.len());
                filter.limit = Some(left.clamp(1, 1000) as u32);
            } else {
                filter.limit = Some(1000);
            }
            let page = self.jobs(&filter).await?;
            jobs.extend(page.jobs);
            let full = most.is_some_and(|most| jobs.len() >= most);
            match page.next_cursor {
                Some(cursor) if !full => filter.cursor = Some(cursor),
                // Whether more jobs were left out.
                Some(_) => return Ok((jobs, true)),
                None => return Ok((jobs, false)),
            }
        }
    }

    pub async fn remove_node(&self, name: &str, force: bool) -> Result<NodeRemoved, ClientError> {
        let url = format!("{}/v1/nodes/{}?force={force}", self.current(), encode(name));
        self.send(self.http.delete(&url), &url).await
    }

    pub async fn job(&self, id: u64) -> Result<JobView, ClientError> {
        self.get(&format!("/v1/jobs/{id}")).await
    }

    /// Cancels every unfinished element of array job `array`; answers the
    /// elements the server still holds in memory, as they are now.
    pub async fn cancel_array(&self, array: u64) -> Result<JobList, ClientError> {
        self.post(
            &format!("/v1/arrays/{array}/cancel"),
            &serde_json::json!({}),
            None,
        )
        .await
    }

    pub async fn cancel(&self, id: u64) -> Result<JobView, ClientError> {
        self.post(
            &format!("/v1/jobs/{id}/cancel"),
            &serde_json::json!({}),
            None,
        )
        .await
    }

    /// Up to `limit` bytes (the server's cap when `None`) of a task's output
    /// from byte `offset`; with `follow`, the server waits a while for new
    /// output when there is none yet.
    pub async fn logs(
        &self,
        id: u64,
        rank: u32,
        offset: u64,
        limit: Option<u64>,
        follow: bool,
    ) -> Result<LogsResponse, ClientError> {
        self.task_logs(id, rank, None, offset, limit, follow).await
    }

    /// As [`Client::logs`], for the offset of one task (`allocation`, from
    /// an earlier answer): when the rank has a newer task, the answer is
    /// empty and names it, with `next_offset` 0.
    pub async fn task_logs(
        &self,
        id: u64,
        rank: u32,
        allocation: Option<u64>,
        offset: u64,
        limit: Option<u64>,
        follow: bool,
    ) -> Result<LogsResponse, ClientError> {
        self.task_logs_of_attempt(id, rank, None, allocation, offset, limit, follow)
            .await
    }

    /// As [`Client::task_logs`], of one attempt (1 for the first; `None`:
    /// the latest).
    #[allow(clippy::too_many_arguments)]
    pub async fn task_logs_of_attempt(
        &self,
        id: u64,
        rank: u32,
        attempt: Option<u32>,
        allocation: Option<u64>,
        offset: u64,
        limit: Option<u64>,
        follow: bool,
    ) -> Result<LogsResponse, ClientError> {
        let attempt = attempt.map_or(String::new(), |attempt| format!("&attempt={attempt}"));
        let limit = limit.map_or(String::new(), |limit| format!("&limit={limit}"));
        let allocation = allocation.map_or(String::new(), |allocation| {
            format!("&allocation={allocation}")
        });
        let url = format!(
            "{}/v1/jobs/{id}/logs?rank={rank}&offset={offset}{limit}{allocation}{attempt}&follow={follow}",
            self.current()
        );
        self.send(self.http.get(&url).timeout(Duration::from_secs(60)), &url)
            .await
    }

    pub async fn nodes(&self) -> Result<NodeList, ClientError> {
        self.get("/v1/nodes").await
    }

    pub async fn node(&self, name: &str) -> Result<NodeView, ClientError> {
        self.get(&format!("/v1/nodes/{}", encode(name))).await
    }

    /// `action`: `cordon`, `uncordon`, `drain`, `approve` or
    /// `reset-identity`.
    pub async fn node_action(&self, name: &str, action: &str) -> Result<NodeView, ClientError> {
        self.post(
            &format!("/v1/nodes/{}/{action}", encode(name)),
            &serde_json::json!({}),
            None,
        )
        .await
    }

    pub async fn fleet(&self) -> Result<FleetView, ClientError> {
        self.get("/v1/fleet").await
    }

    /// A job's GPU use, per rank and minute.
    pub async fn job_usage(&self, id: u64) -> Result<JobUsage, ClientError> {
        self.get(&format!("/v1/jobs/{id}/usage")).await
    }

    /// Cost since `since` (`30d`, `month`), grouped `by` queue, user, job or
    /// pool.
    pub async fn cost(&self, since: &str, by: &str) -> Result<CostReport, ClientError> {
        self.get(&format!(
            "/v1/cost?since={}&by={}",
            encode(since),
            encode(by)
        ))
        .await
    }

    pub async fn prices(&self) -> Result<PriceList, ClientError> {
        self.get("/v1/prices").await
    }

    pub async fn set_price(
        &self,
        model: &str,
        per_gpu_hour: f64,
    ) -> Result<PriceList, ClientError> {
        let url = format!("{}/v1/prices/{}", self.current(), encode(model));
        self.send(
            self.http.put(&url).json(&PriceUpdate { per_gpu_hour }),
            &url,
        )
        .await
    }

    pub async fn remove_price(&self, model: &str) -> Result<PriceList, ClientError> {
        let url = format!("{}/v1/prices/{}", self.current(), encode(model));
        self.send(self.http.delete(&url), &url).await
    }

    /// Sets a pool's own stack policy.
    pub async fn set_pool_policy(
        &self,
        pool: &str,
        update: &PoolPolicyUpdate,
    ) -> Result<PoolList, ClientError> {
        let url = format!("{}/v1/pools/{}/policy", self.current(), encode(pool));
        self.send(self.http.put(&url).json(update), &url).await
    }

    /// Removes a pool's own stack policy.
    pub async fn remove_pool_policy(&self, pool: &str) -> Result<PoolList, ClientError> {
        let url = format!("{}/v1/pools/{}/policy", self.current(), encode(pool));
        self.send(self.http.delete(&url), &url).await
    }

    /// Sets a secret's value (for `queue`'s jobs, or every queue's).
    pub async fn set_secret(
        &self,
        name: &str,
        value: &str,
        queue: Option<&str>,
    ) -> Result<SecretView, ClientError> {
        let url = format!("{}/v1/secrets/{}", self.current(), encode(name));
        let body = SecretSet {
            value: value.to_string(),
            queue: queue.map(str::to_string),
        };
        self.send(self.http.put(&url).json(&body), &url).await
    }

    pub async fn secrets(&self) -> Result<SecretList, ClientError> {
        self.get("/v1/secrets").await
    }

    pub async fn remove_secret(
        &self,
        name: &str,
        queue: Option<&str>,
    ) -> Result<SecretView, ClientError> {
        let mut url = format!("{}/v1/secrets/{}", self.current(), encode(name));
        if let Some(queue) = queue {
            url.push_str(&format!("?queue={}", encode(queue)));
        }
        self.send(self.http.delete(&url), &url).await
    }

    /// Creates a service from its spec (`kind: service`).
    pub async fn create_service(
        &self,
        spec: serde_json::Value,
    ) -> Result<ServiceView, ClientError> {
        self.post("/v1/services", &ServiceRequest { spec }, None)
            .await
    }

    /// Changes a service (a new template rolls out as a new revision).
    pub async fn update_service(
        &self,
        name: &str,
        spec: serde_json::Value,
    ) -> Result<ServiceView, ClientError> {
        let url = format!("{}/v1/services/{}", self.current(), encode(name));
        self.send(self.http.put(&url).json(&ServiceRequest { spec }), &url)
            .await
    }

    pub async fn scale_service(
        &self,
        name: &str,
        replicas: u32,
    ) -> Result<ServiceView, ClientError> {
        self.post(
            &format!("/v1/services/{}/scale", encode(name)),
            &ScaleRequest { replicas },
            None,
        )
        .await
    }

    pub async fn rollback_service(
        &self,
        name: &str,
        revision: Option<u32>,
    ) -> Result<ServiceView, ClientError> {
        self.post(
            &format!("/v1/services/{}/rollback", encode(name)),
            &RollbackRequest { revision },
            None,
        )
        .await
    }

    pub async fn delete_service(&self, name: &str) -> Result<ServiceView, ClientError> {
        let url = format!("{}/v1/services/{}", self.current(), encode(name));
        self.send(self.http.delete(&url), &url).await
    }

    pub async fn services(&self) -> Result<ServiceList, ClientError> {
        self.get("/v1/services").await
    }

    pub async fn service(&self, name: &str) -> Result<ServiceView, ClientError> {
        self.get(&format!("/v1/services/{}", encode(name))).await
    }

    pub async fn service_endpoints(&self, name: &str) -> Result<EndpointList, ClientError> {
        self.get(&format!("/v1/services/{}/endpoints", encode(name)))
            .await
    }

    /// This node's command-check results (an agent's token).
    pub async fn report_checks(
        &self,
        node: &str,
        report: &CheckReport,
    ) -> Result<serde_json::Value, ClientError> {
        self.post(
            &format!("/v1/agents/{}/checks", encode(node)),
            report,
            Some(Duration::from_secs(5)),
        )
        .await
    }

    /// Opens tunnel `id` of this node (an agent's token): an upgraded
    /// connection to the server, its bytes a user's `muster dev` session.
    pub async fn open_tunnel(&self, node: &str, id: u64) -> Result<reqwest::Upgraded, ClientError> {
        let url = format!("{}/v1/agents/{}/tunnels/{id}", self.current(), encode(node));
        self.upgrade(self.http.post(&url), &url).await
    }

    /// Connects to dev environment `name`: `query` says what for
    /// (`kind=shell&rows=24&cols=80&term=xterm` or `kind=forward&port=8888`).
    pub async fn connect_dev(
        &self,
        name: &str,
        query: &str,
    ) -> Result<reqwest::Upgraded, ClientError> {
        let url = format!("{}/v1/dev/{}/connect?{query}", self.current(), encode(name));
        self.upgrade(self.http.get(&url), &url).await
    }

    async fn upgrade(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<reqwest::Upgraded, ClientError> {
        let transport = |error: reqwest::Error| ClientError::Transport {
            url: url.to_string(),
            reason: transport_reason(&error),
            sent: !error.is_connect() && !error.is_builder(),
        };
        let response = request
            .bearer_auth(&self.token)
            .header(reqwest::header::CONNECTION, "upgrade")
            .header(reqwest::header::UPGRADE, TUNNEL_PROTOCOL)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .map_err(transport)?;
        let status = response.status().as_u16();
        if status != 101 {
            let bytes = response.bytes().await.unwrap_or_default();
            let body = serde_json::from_slice::<ErrorBody>(&bytes).unwrap_or_else(|_| ErrorBody {
                code: ErrorCode::Internal,
                message: format!(
                    "the server answered {status}: {}",
                    String::from_utf8_lossy(&bytes)
                ),
            });
            return Err(ClientError::Api { status, body });
        }
        response.upgrade().await.map_err(transport)
    }

    /// The caller's dev environments.
    pub async fn dev_environments(&self) -> Result<DevList, ClientError> {
        self.get("/v1/dev").await
    }

    /// A gateway's traffic per service, for the autoscaler.
    pub async fn report_traffic(&self, report: &TrafficReport) -> Result<TrafficAck, ClientError> {
        self.post("/v1/traffic", report, Some(Duration::from_secs(5)))
            .await
    }

    /// Every service's ready replicas; with `after` (an instance and a
    /// version of an earlier answer), waits (up to 10 s) for a version past
    /// it.
    pub async fn endpoint_table(
        &self,
        after: Option<(u64, u64)>,
    ) -> Result<EndpointTable, ClientError> {
        let url = match after {
            Some((instance, version)) => format!(
                "{}/v1/endpoints?instance={instance}&after={version}",
                self.current()
            ),
            None => format!("{}/v1/endpoints", self.current()),
        };
        self.send(self.http.get(&url).timeout(Duration::from_secs(45)), &url)
            .await
    }

    pub async fn whoami(&self) -> Result<WhoAmI, ClientError> {
        self.get("/v1/whoami").await
    }

    pub async fn add_user(&self, user: &UserCreate) -> Result<UserToken, ClientError> {
        self.post("/v1/users", user, None).await
    }

    pub async fn users(&self) -> Result<UserList, ClientError> {
        self.get("/v1/users").await
    }

    pub async fn set_user_limits(
        &self,
        name: &str,
        limits: &UserLimits,
    ) -> Result<UserView, ClientError> {
        self.post(&format!("/v1/users/{}/limits", encode(name)), limits, None)
            .await
    }

    pub async fn create_join_token(
        &self,
        request: &JoinTokenCreate,
    ) -> Result<JoinTokenCreated, ClientError> {
        self.post("/v1/join-tokens", request, None).await
    }

    pub async fn join_tokens(&self) -> Result<JoinTokenList, ClientError> {
        self.get("/v1/join-tokens").await
    }

    pub async fn revoke_join_token(&self, id: &str) -> Result<JoinTokenView, ClientError> {
        self.post(
            &format!("/v1/join-tokens/{}/revoke", encode(id)),
            &serde_json::json!({}),
            None,
        )
        .await
    }

    pub async fn remove_user(&self, name: &str) -> Result<UserView, ClientError> {
        let url = format!("{}/v1/users/{}", self.current(), encode(name));
        self.send(self.http.delete(&url), &url).await
    }

    pub async fn rotate_token(&self, name: &str) -> Result<UserToken, ClientError> {
        self.post(
            &format!("/v1/users/{}/rotate-token", encode(name)),
            &serde_json::json!({}),
            None,
        )
        .await
    }

    /// The audit log since `since` (`24h`, `30d`), of `user` if given.
    pub async fn audit(
        &self,
        since: &str,
        user: Option<&str>,
        limit: u32,
    ) -> Result<AuditList, ClientError> {
        let mut path = format!("/v1/audit?since={}&limit={limit}", encode(since));
        if let Some(user) = user {
            path.push_str(&format!("&user={}", encode(user)));
        }
        self.get(&path).await
    }

    pub async fn pools(&self) -> Result<PoolList, ClientError> {
        self.get("/v1/pools").await
    }

    pub async fn queues(&self) -> Result<QueueList, ClientError> {
        self.get("/v1/queues").await
    }

    pub async fn set_queue(
        &self,
        name: &str,
        update: &QueueUpdate,
    ) -> Result<QueueView, ClientError> {
        let url = format!("{}/v1/queues/{}", self.current(), encode(name));
        self.send(self.http.put(&url).json(update), &url).await
    }

    pub async fn register(
        &self,
        request: &RegisterRequest,
    ) -> Result<RegisterResponse, ClientError> {
        self.post("/v1/agents/register", request, None).await
    }

    pub async fn heartbeat(
        &self,
        node: &str,
        request: &HeartbeatRequest,
    ) -> Result<HeartbeatResponse, ClientError> {
        let timeout = Duration::from_millis(request.wait_ms) + Duration::from_secs(10);
        self.post(
            &format!("/v1/agents/{}/heartbeat", encode(node)),
            request,
            Some(timeout),
        )
        .await
    }

    /// Sends a node's telemetry (its credential's client).
    pub async fn push_telemetry(
        &self,
        node: &str,
        report: &TelemetryReport,
    ) -> Result<serde_json::Value, ClientError> {
        self.post(
            &format!("/v1/agents/{}/telemetry", encode(node)),
            report,
            Some(Duration::from_secs(10)),
        )
        .await
    }

    pub async fn push_logs(&self, node: &str, chunk: &LogChunk) -> Result<LogAck, ClientError> {
        self.post(
            &format!("/v1/agents/{}/logs", encode(node)),
            chunk,
            Some(Duration::from_secs(30)),
        )
        .await
    }
}

/// Percent-encodes a path segment or query value.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(byte as char)
            }
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A loopback listener that answers each request with `answer` (status
    /// line, headers, body) and counts them.
    async fn answering(
        answer: &'static str,
    ) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = hits.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                // The request whole (headers, then Content-Length bytes).
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                while let Ok(read) = stream.read(&mut buffer).await {
                    if read == 0 {
                        break;
                    }
                    request.extend_from_slice(&buffer[..read]);
                    let text = String::from_utf8_lossy(&request).to_string();
                    if let Some((head, body)) = text.split_once("\r\n\r\n") {
                        let length = head
                            .lines()
                            .find_map(|line| {
                                let (name, value) = line.split_once(':')?;
                                name.eq_ignore_ascii_case("content-length")
                                    .then(|| value.trim().parse::<usize>().ok())?
                            })
                            .unwrap_or(0);
                        if body.len() >= length {
                            break;
                        }
                    }
                }
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.shutdown().await;
            }
        });
        (url, hits)
    }

    /// A deposed leader's refusal (the store took nothing) sends the
    /// request on to the next server at once, and later requests go there.
    #[tokio::test]
    async fn a_refusal_from_a_deposed_leader_moves_on_to_the_next_server() {
        let body = r#"{"code":"unavailable","message":"this server no longer leads (it wrote in term 2)"}"#;
        let refused: &'static str = Box::leak(
            format!(
                "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
                 muster-no-longer-leads: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .into_boxed_str(),
        );
        let ok = r#"{"id":7}"#;
        let accepted: &'static str = Box::leak(
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                 connection: close\r\n\r\n{ok}",
                ok.len()
            )
            .into_boxed_str(),
        );
        let (deposed, deposed_hits) = answering(refused).await;
        let (leader, leader_hits) = answering(accepted).await;
        let client = super::Client::new(&format!("{deposed},{leader}"), "token");
        let id = client
            .submit_once(serde_json::json!({"command": ["true"]}))
            .await
            .expect("the next server took it");
        assert_eq!(id, 7);
        assert_eq!(client.current(), leader, "later requests go to the leader");
        let hits = |h: &std::sync::atomic::AtomicUsize| h.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!((hits(&deposed_hits), hits(&leader_hits)), (1, 1));
        // With one server, nowhere to go: the refusal is the answer.
        let alone = super::Client::new(&deposed, "token");
        let error = alone
            .submit_once(serde_json::json!({"command": ["true"]}))
            .await
            .expect_err("refused");
        assert!(error.to_string().contains("no longer leads"), "{error}");
    }

    #[test]
    fn encodes_unsafe_characters() {
        assert_eq!(super::encode("a b/c"), "a%20b%2Fc");
        assert_eq!(super::encode("gpu-01.rack_2"), "gpu-01.rack_2");
    }
}
