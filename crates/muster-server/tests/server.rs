//! The server over real HTTP on loopback, with a real SQLite store in a
//! temporary directory: authentication, the job API, an agent's flow done
//! by hand, restarts, and group commit under a burst of submissions.

use muster_api::protocol::*;
use muster_server::{Server, ServerConfig, ServerHandle};
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;

/// Every test is bounded by this.
const TEST_LIMIT: Duration = Duration::from_secs(25);

fn test_config(dir: &Path) -> ServerConfig {
    let mut config = ServerConfig::new(dir.to_path_buf());
    config.listen = "127.0.0.1:0".parse().expect("an address");
    config.schedule_interval_ms = 50;
    config
}

async fn start(dir: &Path) -> ServerHandle {
    Server::start(test_config(dir))
        .await
        .expect("server starts")
}

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    fn new(server: &ServerHandle) -> Self {
        Api {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .build()
                .expect("an HTTP client"),
            base: format!("http://{}", server.addr()),
        }
    }

    /// The same server through a client that never reuses a connection: for
    /// a request the server answers before reading it all (and then closes
    /// the connection), so later requests do not land on the closed one.
    fn unpooled(&self) -> Self {
        Api {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .pool_max_idle_per_host(0)
                .build()
                .expect("an HTTP client"),
            base: self.base.clone(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends a request and returns the status and the JSON body.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut request = self.http.request(method, self.url(path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("request sent");
        let status = response.status();
        let text = response.text().await.expect("a body");
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, value)
    }

    async fn get(&self, path: &str, token: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::GET, path, Some(token), None)
            .await
    }

    async fn post(&self, path: &str, token: &str, body: Value) -> (StatusCode, Value) {
        self.call(reqwest::Method::POST, path, Some(token), Some(body))
            .await
    }

    async fn submit(&self, token: &str, spec: Value) -> u64 {
        let (status, body) = self.post("/v1/jobs", token, json!({ "spec": spec })).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        body["id"].as_u64().expect("an id")
    }

    /// Registers node `name` with the join token; it must succeed.
    async fn register(&self, join_token: &str, name: &str) -> RegisterResponse {
        let (status, body) = self
            .post(
                "/v1/agents/register",
                join_token,
                serde_json::to_value(register_request(name)).expect("a request"),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        serde_json::from_value(body).expect("a registration")
    }

    /// Every job of `query` (`state=...&user=...`), page by page of
    /// `page`, newest first.
    async fn all_jobs(&self, token: &str, query: &str, page: u32) -> Vec<JobView> {
        let mut jobs = Vec::new();
        let mut cursor = String::new();
        loop {
            let path = format!("/v1/jobs?limit={page}&cursor={cursor}&{query}");
            let (status, body) = self.get(&path, token).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let list: JobList = serde_json::from_value(body).expect("a job list");
            assert!(
                list.jobs.len() <= page as usize,
                "a page holds at most the limit"
            );
            jobs.extend(list.jobs);
            match list.next_cursor {
                Some(next) => cursor = next,
                None => return jobs,
            }
        }
    }

    async fn job(&self, token: &str, id: u64) -> JobView {
        let (status, body) = self.get(&format!("/v1/jobs/{id}"), token).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        serde_json::from_value(body).expect("a job view")
    }
}

fn error_of(body: &Value) -> ErrorBody {
    serde_json::from_value(body.clone()).unwrap_or_else(|_| panic!("an error body: {body}"))
}

fn spec(name: &str, queue: &str, gpus: u32) -> Value {
    json!({ "name": name, "queue": queue, "gpus": gpus, "command": ["python", "train.py"] })
}

fn register_request(name: &str) -> RegisterRequest {
    RegisterRequest {
        name: name.to_string(),
        address: "127.0.0.1".to_string(),
        gpus: (0..4)
            .map(|index| GpuView {
                index,
                uuid: format!("GPU-{name}-{index}"),
                model: "H100-80GB".to_string(),
                memory_mib: 81_920,
                nvlink_domain: 0,
            })
            .collect(),
        cpu_milli: 64_000,
        memory_mib: 512 * 1024,
        pool: None,
        rack: None,
        backend: "simulated".to_string(),
        driver_version: Some("550.54".to_string()),
        cuda_version: Some("12.4".to_string()),
        stack: [("kernel", "6.1.0-18-amd64"), ("vbios", "96.00.89.00.01")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

async fn bounded<F: std::future::Future<Output = ()>>(test: F) {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .expect("the test finished in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_job_call_needs_the_admin_token() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        assert!(server.first_start);
        let api = Api::new(&server);

        let (status, body) = api.call(reqwest::Method::GET, "/v1/jobs", None, None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        let error = error_of(&body);
        assert_eq!(error.code, ErrorCode::Unauthenticated);
        assert!(error.message.contains("MUSTER_TOKEN"), "{}", error.message);
        assert!(error.message.contains("admin.token"), "{}", error.message);

        let (status, body) = api.get("/v1/jobs", "not-a-token").await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(error_of(&body).code, ErrorCode::Unauthenticated);

        let (status, body) = api
            .post(
                "/v1/jobs",
                server.join_token(),
                json!({ "spec": spec("x", "default", 1) }),
            )
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert_eq!(error_of(&body).code, ErrorCode::PermissionDenied);

        let (status, body) = api
            .post(
                "/v1/agents/register",
                server.admin_token(),
                serde_json::to_value(register_request("a")).unwrap(),
            )
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");

        let (status, _) = api.get("/v1/jobs", server.admin_token()).await;
        assert_eq!(status, StatusCode::OK);

        // Not job APIs: served without a token.
        let (status, body) = api.call(reqwest::Method::GET, "/healthz", None, None).await;
        assert_eq!((status, body), (StatusCode::OK, Value::String("ok".into())));
        let (status, body) = api
            .call(reqwest::Method::GET, "/v1/openapi.json", None, None)
            .await;
        assert_eq!(status, StatusCode::OK);
        assert!(body["openapi"].as_str().unwrap().starts_with("3."));
        for path in [
            "/v1/jobs",
            "/v1/jobs/{id}/logs",
            "/v1/agents/{node}/heartbeat",
        ] {
            assert!(body["paths"].get(path).is_some(), "{path} is documented");
        }

        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            for file in ["admin.token", "join.token"] {
                let mode = std::fs::metadata(dir.path().join(file))
                    .unwrap()
                    .permissions()
                    .mode();
                assert_eq!(mode & 0o777, 0o600, "{file} is for its owner only");
            }
        }
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_submitted_listed_and_cancelled() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let token = server.admin_token().to_string();

        let first = api.submit(&token, spec("first", "team-a", 1)).await;
        let (status, body) = api
            .http
            .post(api.url("/v1/jobs"))
            .bearer_auth(&token)
            .header(muster_server::USER_HEADER, "bob")
            .json(&json!({ "spec": spec("second", "team-b", 2) }))
            .send()
            .await
            .map(|r| (r.status(), r))
            .unwrap();
        assert_eq!(status, StatusCode::CREATED);
        let second = body.json::<SubmitResponse>().await.unwrap().id;
        assert!(second > first);

        // No nodes: both wait, with a reason and a place in line.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let job = api.job(&token, first).await;
        assert_eq!(job.state, "pending");
        assert_eq!(job.name, "first");
        assert_eq!(job.queue, "team-a");
        assert_eq!(job.gpus_per_node, 1.0);
        assert_eq!(job.user, "admin");
        assert!(job.pending_reason.is_some());
        assert!(job.queue_position.is_some(), "{job:?}");
        assert_eq!(job.history[0].what, "submitted");

        let (_, body) = api.get("/v1/jobs", &token).await;
        let list: JobList = serde_json::from_value(body).unwrap();
        let ids: Vec<u64> = list.jobs.iter().map(|j| j.id).collect();
        assert_eq!(ids, [second, first], "newest first");
        let (_, body) = api.get("/v1/jobs?queue=team-b", &token).await;
        let list: JobList = serde_json::from_value(body).unwrap();
        assert_eq!(list.jobs.len(), 1);
        assert_eq!(list.jobs[0].id, second);
        let (_, body) = api.get("/v1/jobs?user=bob&state=pending", &token).await;
        let list: JobList = serde_json::from_value(body).unwrap();
        assert_eq!(list.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [second]);
        let (status, body) = api.get("/v1/jobs?state=sleeping", &token).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(error_of(&body).message.contains("pending"));

        let (status, body) = api
            .post(&format!("/v1/jobs/{first}/cancel"), &token, json!({}))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["state"], "cancelled");
        let (_, body) = api.get("/v1/jobs?state=cancelled", &token).await;
        assert_eq!(body["jobs"].as_array().unwrap().len(), 1);

        let (status, body) = api.get("/v1/jobs/999", &token).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let error = error_of(&body);
        assert_eq!(error.code, ErrorCode::NotFound);
        assert!(error.message.contains("999"), "{}", error.message);
        let (status, _) = api.post("/v1/jobs/999/cancel", &token, json!({})).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, _) = api.get("/v1/jobs/abc", &token).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_every_problem() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let token = server.admin_token().to_string();

        let bad = json!({ "name": "x", "gpu": 8, "nodes": 0, "command": ["a"] });
        let (status, body) = api.post("/v1/jobs", &token, json!({ "spec": bad })).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        let error = error_of(&body);
        assert_eq!(error.code, ErrorCode::InvalidArgument);
        let lines: Vec<&str> = error.message.lines().collect();
        assert_eq!(lines.len(), 2, "{}", error.message);
        assert!(lines[0].starts_with("gpu: unknown field"), "{}", lines[0]);
        assert!(lines[1].starts_with("nodes:"), "{}", lines[1]);

        let huge = "x".repeat(2 * 1024 * 1024);
        let (status, body) = api
            .unpooled()
            .post("/v1/jobs", &token, json!({ "spec": { "name": huge } }))
            .await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        let error = error_of(&body);
        assert_eq!(error.code, ErrorCode::InvalidArgument);
        assert!(error.message.contains("1 MiB"), "{}", error.message);

        let response = api
            .http
            .post(api.url("/v1/jobs"))
            .bearer_auth(&token)
            .body("{not json")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let error: ErrorBody = response.json().await.unwrap();
        assert!(
            error.message.starts_with("invalid json body"),
            "{}",
            error.message
        );

        let (status, body) = api
            .call(
                reqwest::Method::PUT,
                "/v1/queues/team-a",
                Some(&token),
                Some(json!({ "guaranteed_gpus": -1.0, "borrow_limit_gpus": null, "weight": 1 })),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let (status, body) = api
            .call(
                reqwest::Method::PUT,
                "/v1/queues/team-a",
                Some(&token),
                Some(json!({ "guaranteed_gpus": 8.0, "borrow_limit_gpus": 4.0, "weight": 2 })),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["guaranteed_gpus"], 8.0);
        assert!(body["idle_timeout_s"].is_null(), "{body}");
        let (_, body) = api.get("/v1/queues", &token).await;
        assert_eq!(body["queues"][0]["name"], "team-a");
        // A notebook queue stops its jobs once their GPUs sit idle.
        let update = |timeout: &str| {
            json!({ "guaranteed_gpus": 0.0, "borrow_limit_gpus": null, "weight": 1, "idle_timeout": timeout })
        };
        let (status, body) = api
            .call(reqwest::Method::PUT, "/v1/queues/notebooks", Some(&token), Some(update("30m")))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["idle_timeout_s"], 1800, "{body}");
        let (status, body) = api
            .call(reqwest::Method::PUT, "/v1/queues/notebooks", Some(&token), Some(update("soon")))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(error_of(&body).message.contains("idle_timeout"), "{body}");

        let (status, body) = api.get("/v1/nope", &token).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(error_of(&body).code, ErrorCode::NotFound);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_runs_a_job_and_its_logs_come_back() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();

        let registered = api.register(server.join_token(), "gpu-1").await;
        let node_token = registered.node_token.clone();
        assert_eq!(registered.lease_ms, 10_000);

        // The node token is for this node's agent calls only.
        let (status, _) = api.get("/v1/jobs", &node_token).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        let beat = |known_version: u64, wait_ms: u64, observed: Vec<ObservedAllocation>| {
            serde_json::to_value(HeartbeatRequest {
                pulling: Vec::new(),
                epoch: registered.epoch,
                observed,
                wait_ms,
                known_version,
                unhealthy_gpus: Vec::new(),
                sequence: 0,
            })
            .unwrap()
        };
        let (status, _) = api
            .post(
                "/v1/agents/gpu-2/heartbeat",
                &node_token,
                beat(0, 0, vec![]),
            )
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN);

        let (status, body) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &node_token,
                beat(0, 0, vec![]),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let first: HeartbeatResponse = serde_json::from_value(body).unwrap();
        assert!(first.desired.is_empty());

        // A long poll at the current version waits for the job to be placed.
        let poll = {
            let http = api.http.clone();
            let url = api.url("/v1/agents/gpu-1/heartbeat");
            let token = node_token.clone();
            let body = beat(first.version, 5_000, vec![]);
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let response = http
                    .post(url)
                    .bearer_auth(token)
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                (
                    started.elapsed(),
                    response.json::<HeartbeatResponse>().await.unwrap(),
                )
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let id = api.submit(&admin, spec("train", "default", 2)).await;
        let (waited, placed) = poll.await.unwrap();
        assert!(
            waited < Duration::from_secs(4),
            "woken by the placement, not the timeout"
        );
        assert_ne!(placed.version, first.version);
        assert_eq!(placed.desired.len(), 1);
        let task = &placed.desired[0];
        assert_eq!(task.job, id);
        assert_eq!(task.gpus.len(), 2);
        assert_eq!(task.command, ["python", "train.py"]);
        assert_eq!(task.env["MUSTER_JOB_ID"], id.to_string());
        assert!(!task.stop);

        let running = ObservedAllocation {
            allocation: task.allocation,
            generation: task.generation,
            exited: None,
            fenced: false,
            memory_limit: false,
        };
        let (status, _) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &node_token,
                beat(placed.version, 0, vec![running.clone()]),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        let job = api.job(&admin, id).await;
        assert_eq!(job.state, "running");
        assert_eq!(job.tasks.len(), 1);
        assert_eq!(job.tasks[0].node, "gpu-1");
        assert_eq!(job.tasks[0].gpus.len(), 2);
        assert_eq!(job.tasks[0].state, "running");

        // Logs: exact bytes (here not UTF-8) appended at offsets; a retried
        // chunk is not written twice, an overlapping one only in part.
        let chunk_of = |offset: u64, data: &[u8], eof: bool| {
            serde_json::to_value(LogChunk {
                allocation: task.allocation,
                offset,
                data: data.to_vec(),
                omit_gap: false,
                eof,
            })
            .unwrap()
        };
        let chunk = |offset: u64, data: &[u8]| chunk_of(offset, data, false);
        for (offset, data) in [
            (0, &b"he\xffo\n"[..]),
            (0, b"he\xffo\n"),
            (3, b"o\nw\xe2\x82"),
            (8, b"\xacld\n"),
        ] {
            let (status, body) = api
                .post("/v1/agents/gpu-1/logs", &node_token, chunk(offset, data))
                .await;
            assert_eq!(status, StatusCode::OK, "{body}");
        }
        let (status, body) = api
            .post("/v1/agents/gpu-1/logs", &node_token, chunk(100, b"gap"))
            .await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| m.contains("send from byte 12")),
            "the refusal says where to resume: {body}"
        );
        let (_, body) = api
            .get(&format!("/v1/jobs/{id}/logs?rank=0&offset=0"), &admin)
            .await;
        let logs: LogsResponse = serde_json::from_value(body).unwrap();
        assert_eq!(logs.data, b"he\xffo\nw\xe2\x82\xacld\n");
        assert!(!logs.complete, "the job still runs");
        assert!(!logs.more);
        // Paging: a limit cuts anywhere, even inside a character.
        let (_, body) = api
            .get(&format!("/v1/jobs/{id}/logs?offset=5&limit=2"), &admin)
            .await;
        let page: LogsResponse = serde_json::from_value(body).unwrap();
        assert_eq!(
            (&page.data[..], page.next_offset, page.more),
            (&b"w\xe2"[..], 7, true)
        );

        // A follower waits for the next output.
        let follow = {
            let http = api.http.clone();
            let url = api.url(&format!(
                "/v1/jobs/{id}/logs?offset={}&follow=true",
                logs.next_offset
            ));
            let token = admin.clone();
            tokio::spawn(async move {
                let response = http.get(url).bearer_auth(token).send().await.unwrap();
                response.json::<LogsResponse>().await.unwrap()
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (status, _) = api
            .post(
                "/v1/agents/gpu-1/logs",
                &node_token,
                chunk_of(12, b"done\n", true),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        let followed = follow.await.unwrap();
        assert_eq!(followed.data, b"done\n");

        let exited = ObservedAllocation {
            exited: Some(Some(0)),
            ..running
        };
        let (status, body) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &node_token,
                beat(placed.version, 0, vec![exited]),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        let after: HeartbeatResponse = serde_json::from_value(body).unwrap();
        assert!(after.desired.is_empty());
        let job = api.job(&admin, id).await;
        assert_eq!(job.state, "succeeded");
        assert_eq!(job.exit_code, Some(0));

        let (_, body) = api
            .get(&format!("/v1/jobs/{id}/logs?offset=0&follow=true"), &admin)
            .await;
        let logs: LogsResponse = serde_json::from_value(body).unwrap();
        assert_eq!(logs.data, b"he\xffo\nw\xe2\x82\xacld\ndone\n");
        assert!(logs.complete);

        let (_, body) = api.get("/v1/nodes/gpu-1", &admin).await;
        let node: NodeView = serde_json::from_value(body).unwrap();
        assert_eq!(node.state, "ready");
        assert_eq!(node.gpu_free, [1000; 4]);
        let (status, body) = api.post("/v1/nodes/gpu-1/cordon", &admin, json!({})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["cordoned"], true);
        let (status, _) = api.post("/v1/nodes/nope/drain", &admin, json!({})).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        server.shutdown().await;
    })
    .await;
}

fn heartbeat_body(
    epoch: u64,
    observed: Vec<ObservedAllocation>,
    known_version: u64,
    wait_ms: u64,
) -> Value {
    serde_json::to_value(HeartbeatRequest {
        pulling: Vec::new(),
        epoch,
        observed,
        wait_ms,
        known_version,
        unhealthy_gpus: Vec::new(),
        sequence: 0,
    })
    .expect("a heartbeat")
}

fn all_running(desired: &[DesiredAllocation]) -> Vec<ObservedAllocation> {
    desired
        .iter()
        .map(|task| ObservedAllocation {
            allocation: task.allocation,
            generation: task.generation,
            exited: None,
            fenced: false,
            memory_limit: false,
        })
        .collect()
}

/// Heartbeats (reporting `observed`) until the node has `count` desired
/// allocations.
async fn wait_for_desired(
    api: &Api,
    token: &str,
    epoch: u64,
    observed: &[ObservedAllocation],
    count: usize,
) -> HeartbeatResponse {
    let mut version = 0;
    loop {
        let (status, body) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                token,
                heartbeat_body(epoch, observed.to_vec(), version, 2_000),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let response: HeartbeatResponse = serde_json::from_value(body).expect("a heartbeat");
        if response.desired.len() == count {
            return response;
        }
        version = response.version;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_gpus_under_dcgm_names_with_the_job_holding_them() {
    bounded(async {
        use muster_api::protocol::{GpuSample, InterfaceSample, NodeSample, TelemetryReport};
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        // Idle as soon as every GPU of a job reads below 5%.
        config.idle_after_ms = 0;
        let server = Server::start(config).await.unwrap();
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let metrics_token = server.metrics_token().to_string();
        let registered = api.register(server.join_token(), "gpu-1").await;
        let (token, epoch) = (registered.node_token.clone(), registered.epoch);
        let id = api.submit(&admin, spec("train", "team-a", 2)).await;
        let placed = wait_for_desired(&api, &token, epoch, &[], 1).await;
        let held = placed.desired[0].gpus.clone();
        assert_eq!(held.len(), 2);
        let (status, _) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &token,
                heartbeat_body(epoch, all_running(&placed.desired), placed.version, 0),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        let (busy, idle) = (held[0], held[1]);
        let report = TelemetryReport {
            epoch,
            sampled_ms: 1,
            gpus: (0..4)
                .map(|index| GpuSample {
                    index,
                    utilization_pct: if index == busy {
                        90
                    } else if index == idle {
                        2
                    } else {
                        0
                    },
                    memory_used_mib: 1_000,
                    memory_total_mib: 81_920,
                    power_watts: Some(350.5),
                    temperature_c: Some(61),
                    sm_clock_mhz: Some(1_980),
                    ecc_uncorrected: Some(0),
                    xid: None,
                    pcie_tx_bytes: None,
                    pcie_rx_bytes: None,
                    healthy: true,
                })
                .collect(),
            node: NodeSample {
                cpu_busy_pct: Some(12.5),
                memory_used_mib: Some(1_024),
                memory_total_mib: Some(4_096),
                network: vec![InterfaceSample {
                    interface: "eth0".to_string(),
                    receive_bytes: 1_000,
                    transmit_bytes: 2_000,
                }],
            },
        };
        let path = "/v1/agents/gpu-1/telemetry";
        let body = serde_json::to_value(&report).unwrap();
        let (status, answer) = api.post(path, &token, body.clone()).await;
        assert_eq!(status, StatusCode::OK, "{answer}");
        // Another registration's report, another node's token, too many GPUs.
        let mut stale = body.clone();
        stale["epoch"] = json!(epoch + 7);
        assert_eq!(api.post(path, &token, stale).await.0, StatusCode::CONFLICT);
        assert_eq!(
            api.post(path, &admin, body.clone()).await.0,
            StatusCode::FORBIDDEN
        );
        let mut huge = body.clone();
        huge["gpus"] = json!(vec![body["gpus"][0].clone(); 65]);
        assert_eq!(
            api.post(path, &token, huge).await.0,
            StatusCode::BAD_REQUEST
        );
        // Readings no device gives are refused, not shown in every scrape.
        for (field, value) in [
            ("utilization_pct", json!(250)),
            ("power_watts", json!(-5.0)),
            ("memory_used_mib", json!(90_000)),
        ] {
            let mut odd = body.clone();
            odd["gpus"][0][field] = value;
            assert_eq!(
                api.post(path, &token, odd).await.0,
                StatusCode::BAD_REQUEST,
                "{field}"
            );
        }

        let (status, text) = api.get("/metrics", &metrics_token).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let text = text.as_str().expect("text").to_string();
        let gpu = |index: u32| {
            format!(
                "gpu=\"{index}\",UUID=\"GPU-gpu-1-{index}\",device=\"nvidia{index}\",\
                 modelName=\"H100-80GB\",Hostname=\"gpu-1\""
            )
        };
        let free = (0..4).find(|i| !held.contains(i)).expect("a free GPU");
        for line in [
            format!(
                "DCGM_FI_DEV_GPU_UTIL{{{},job_id=\"{id}\",queue=\"team-a\",user=\"admin\"}} 90.0",
                gpu(busy)
            ),
            format!("DCGM_FI_DEV_GPU_UTIL{{{}}} 0.0", gpu(free)),
            format!(
                "DCGM_FI_DEV_FB_FREE{{{},job_id=\"{id}\",queue=\"team-a\",user=\"admin\"}} 80920.0",
                gpu(busy)
            ),
            format!("DCGM_FI_DEV_POWER_USAGE{{{}}} 350.5", gpu(free)),
            format!("DCGM_FI_DEV_GPU_TEMP{{{}}} 61.0", gpu(free)),
            format!("DCGM_FI_DEV_SM_CLOCK{{{}}} 1980.0", gpu(free)),
            "muster_gpus{pool=\"default\",modelName=\"H100-80GB\",state=\"allocated\"} 2.0"
                .to_string(),
            "muster_gpus{pool=\"default\",modelName=\"H100-80GB\",state=\"free\"} 2.0".to_string(),
            "muster_gpus_idle{pool=\"default\",modelName=\"H100-80GB\"} 1.0".to_string(),
            // Both free GPUs sit beside the job: a 4-GPU job could not start.
            "muster_pool_fragmentation{pool=\"default\"} 1.0".to_string(),
            "muster_jobs{state=\"running\",queue=\"team-a\"} 1.0".to_string(),
            "muster_nodes{state=\"ready\"} 1.0".to_string(),
            "muster_node_cpu_busy_percent{Hostname=\"gpu-1\"} 12.5".to_string(),
            "muster_node_network_receive_bytes_total{Hostname=\"gpu-1\",interface=\"eth0\"} 1000"
                .to_string(),
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\nnot in:\n{text}");
        }
        assert!(text.contains("# TYPE DCGM_FI_DEV_GPU_UTIL gauge"), "{text}");
        // The server's own work: the start, its wait, commits, requests.
        for prefix in [
            "muster_placements_total 1",
            "muster_queue_wait_seconds_count 1",
            "muster_scheduling_cycle_seconds_count ",
            "muster_store_commit_seconds_count ",
            "muster_api_request_seconds_count{route=\"/v1/jobs\",method=\"POST\"} 1",
            "muster_api_request_seconds_count{route=\"/v1/agents/{node}/telemetry\",method=\"POST\"} ",
        ] {
            assert!(text.lines().any(|l| l.starts_with(prefix)), "{prefix}\nnot in:\n{text}");
        }
        // The job's usage so far: one sample, its two GPUs' mean.
        let usage = api.job(&admin, id).await.tasks[0]
            .usage
            .clone()
            .expect("usage");
        assert_eq!(usage.samples, 1);
        assert_eq!(usage.peak_utilization_pct, 46);
        assert_eq!(usage.peak_memory_mib, 2_000);
        assert_eq!(usage.idle_since_ms, None);
        // Then both its GPUs fall idle: the job reads idle, in the API and
        // in /metrics.
        let mut quiet = report.clone();
        for gpu in &mut quiet.gpus {
            gpu.utilization_pct = 1;
        }
        let (status, _) = api
            .post(path, &token, serde_json::to_value(&quiet).unwrap())
            .await;
        assert_eq!(status, StatusCode::OK);
        let job = api.job(&admin, id).await;
        let usage = job.tasks[0].usage.clone().expect("usage");
        assert_eq!(usage.samples, 2);
        assert_eq!(usage.mean_utilization_pct, 23.5);
        assert_eq!(usage.peak_utilization_pct, 46);
        assert!(usage.idle_since_ms.is_some());
        assert!(job.idle_for_s.is_some(), "{job:?}");
        let (_, text) = api.get("/metrics", &metrics_token).await;
        let text = text.as_str().expect("text").to_string();
        assert!(
            text.lines().any(|l| l.starts_with(&format!(
                "muster_job_idle_seconds{{job_id=\"{id}\",queue=\"team-a\",user=\"admin\"}} "
            ))),
            "{text}"
        );
        // Pending jobs by queue and reason.
        let mut big = spec("big", "team-b", 4);
        big["gpu_models"] = json!(["B200"]);
        let (status, _) = api
            .post(
                "/v1/jobs",
                &admin,
                json!({ "spec": big, "allow_pending": true }),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED);
        let mut found = false;
        for _ in 0..100 {
            let (_, text) = api.get("/metrics", &metrics_token).await;
            if text.as_str().is_some_and(|t| {
                t.lines()
                    .any(|l| l == "muster_jobs_pending{queue=\"team-b\",reason=\"never-fits\"} 1.0")
            }) {
                found = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(found, "pending by reason");
        // Who may read them: the metrics or admin token, nobody else; the
        // metrics token reads nothing else.
        assert_eq!(api.get("/metrics", &admin).await.0, StatusCode::OK);
        assert_eq!(
            api.get("/metrics", server.join_token()).await.0,
            StatusCode::FORBIDDEN
        );
        assert_eq!(api.get("/metrics", &token).await.0, StatusCode::FORBIDDEN);
        let (status, _) = api.call(reqwest::Method::GET, "/metrics", None, None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(
            api.get("/v1/jobs", &metrics_token).await.0,
            StatusCode::FORBIDDEN
        );
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_names_the_node_whose_stack_differs_from_its_pool() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        config.stack_policy = muster_control::StackPolicy::Majority;
        let server = Server::start(config).await.unwrap();
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        for name in ["gpu-1", "gpu-2", "gpu-3"] {
            let mut request = register_request(name);
            if name == "gpu-3" {
                request.driver_version = Some("550.90".to_string());
                request.stack.remove("vbios");
            }
            let (status, body) = api
                .post(
                    "/v1/agents/register",
                    server.join_token(),
                    serde_json::to_value(&request).unwrap(),
                )
                .await;
            assert_eq!(status, StatusCode::OK, "{body}");
        }
        let (status, body) = api.get("/v1/fleet", &admin).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let fleet: FleetView = serde_json::from_value(body).unwrap();
        assert_eq!(fleet.pools.len(), 1);
        let pool = &fleet.pools[0];
        assert_eq!(pool.nodes, 3);
        assert_eq!(pool.majority["driver"], "550.54");
        assert_eq!(pool.majority["kernel"], "6.1.0-18-amd64");
        assert_eq!(pool.versions["driver"]["550.90"], 1);
        let drift: Vec<(&str, &str, &str, &str)> = pool
            .drift
            .iter()
            .map(|d| {
                (
                    d.node.as_str(),
                    d.component.as_str(),
                    d.version.as_str(),
                    d.expected.as_str(),
                )
            })
            .collect();
        assert_eq!(
            drift,
            vec![
                ("gpu-3", "driver", "550.90", "550.54"),
                ("gpu-3", "vbios", "(none)", "96.00.89.00.01"),
            ]
        );
        // Under the majority policy the drifting node takes no new work,
        // and says why.
        let (_, body) = api.get("/v1/nodes/gpu-3", &admin).await;
        assert_eq!(
            body["drift"], "stack drift: driver 550.90 vs 550.54, vbios (none) vs 96.00.89.00.01",
            "{body}"
        );
        let (_, body) = api.get("/v1/nodes/gpu-1", &admin).await;
        assert!(body["drift"].is_null(), "{body}");
        // The stack is kept across a restart, and shown per node.
        server.shutdown().await;
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let (_, body) = api.get("/v1/nodes/gpu-1", &admin).await;
        assert_eq!(body["stack"]["kernel"], "6.1.0-18-amd64", "{body}");
        let (_, text) = api.get("/metrics", &admin).await;
        let text = text.as_str().expect("text").to_string();
        assert!(
            text.lines().any(|l| l
                == "muster_node_stack_drift{Hostname=\"gpu-3\",pool=\"default\",\
                    component=\"driver\",version=\"550.90\",expected=\"550.54\"} 1.0"),
            "{text}"
        );
        // A hostile stack is refused whole.
        let mut request = register_request("gpu-9");
        request.stack = (0..17)
            .map(|i| (format!("c{i}"), "1".to_string()))
            .collect();
        request
            .stack
            .insert("Bad Name".to_string(), "x".repeat(200));
        let (status, body) = api
            .post(
                "/v1/agents/register",
                server.join_token(),
                serde_json::to_value(&request).unwrap(),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let message = error_of(&body).message;
        assert!(message.contains("at most 16"), "{message}");
        assert!(message.contains("\"Bad Name\""), "{message}");
        // The pool requires driver 550.54: gpu-3 (550.90) takes no new
        // work, saying why; the policy survives a restart; removed, the
        // server's default (report) applies again.
        let put = |body: Value| {
            api.call(
                reqwest::Method::PUT,
                "/v1/pools/default/policy",
                Some(&admin),
                Some(body),
            )
        };
        let (status, body) = put(json!({ "stack_policy": "required" })).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(error_of(&body).message.contains("needs versions"), "{body}");
        let (status, body) = put(json!({ "stack_policy": "sometimes" })).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let (status, body) = put(json!({
            "stack_policy": "required", "required": { "driver": "550.54" }
        }))
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["pools"][0]["stack_policy"], "required", "{body}");
        assert_eq!(body["pools"][0]["required"]["driver"], "550.54", "{body}");
        let (_, body) = api.get("/v1/nodes/gpu-3", &admin).await;
        assert_eq!(
            body["drift"], "stack drift: driver 550.90 vs required 550.54",
            "{body}"
        );
        server.shutdown().await;
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let (_, body) = api.get("/v1/nodes/gpu-3", &admin).await;
        assert_eq!(
            body["drift"], "stack drift: driver 550.90 vs required 550.54",
            "{body}"
        );
        let (status, body) = api
            .call(
                reqwest::Method::DELETE,
                "/v1/pools/default/policy",
                Some(&admin),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["pools"][0]["stack_policy"], "report", "{body}");
        let (_, body) = api.get("/v1/nodes/gpu-3", &admin).await;
        assert!(body["drift"].is_null(), "{body}");
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_jobs_tokens_nodes_and_allocations() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let join = server.join_token().to_string();
        let registered = api.register(&join, "gpu-1").await;
        let node_token = registered.node_token.clone();
        let epoch = registered.epoch;
        let mut ids = Vec::new();
        for name in ["a", "b", "c"] {
            ids.push(api.submit(&admin, spec(name, "default", 1)).await);
        }
        let mut never_fits = spec("never-fits", "default", 1);
        never_fits["gpu_models"] = json!(["A100-40GB"]);
        // Refused unless asked to wait for nodes still to come.
        let (status, body) = api
            .post("/v1/jobs", &admin, json!({ "spec": never_fits.clone() }))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| m.contains("no registered node can ever hold this job")),
            "{body}"
        );
        let (status, body) = api
            .post(
                "/v1/jobs",
                &admin,
                json!({ "spec": never_fits, "allow_pending": true }),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        let pending = body["id"].as_u64().expect("an id");
        ids.push(pending);
        let placed = wait_for_desired(&api, &node_token, epoch, &[], 3).await;
        let (status, _) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &node_token,
                heartbeat_body(epoch, all_running(&placed.desired), placed.version, 0),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        server.shutdown().await;

        let server = start(dir.path()).await;
        assert!(!server.first_start);
        assert_eq!(server.admin_token(), admin);
        assert_eq!(server.join_token(), join);
        let api = Api::new(&server);
        let (_, body) = api.get("/v1/jobs", &admin).await;
        let list: JobList = serde_json::from_value(body).unwrap();
        let mut found: Vec<u64> = list.jobs.iter().map(|j| j.id).collect();
        found.sort_unstable();
        assert_eq!(found, ids, "every job, exactly once");
        let states: Vec<&str> = list.jobs.iter().map(|j| j.state.as_str()).collect();
        assert_eq!(states, ["pending", "running", "running", "running"]);

        // The agent goes on with its token and epoch; its allocations are
        // the same ones, and its lease was renewed by the restart.
        let (status, body) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &node_token,
                heartbeat_body(epoch, all_running(&placed.desired), placed.version, 0),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let after: HeartbeatResponse = serde_json::from_value(body).unwrap();
        assert_eq!(after.desired, placed.desired);
        assert_ne!(after.version, placed.version, "versions do not repeat");

        let next = api.submit(&admin, spec("d", "default", 1)).await;
        assert!(next > pending, "job ids are not reused");
        let placed_again =
            wait_for_desired(&api, &node_token, epoch, &all_running(&placed.desired), 4).await;
        let newest = placed_again
            .desired
            .iter()
            .find(|task| task.job == next)
            .expect("the new job is placed on the free GPU");
        let oldest = placed.desired.iter().map(|task| task.generation).max();
        assert!(
            Some(newest.generation) > oldest,
            "generations are not reused"
        );
        assert!(
            placed
                .desired
                .iter()
                .all(|task| task.allocation < newest.allocation)
        );
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_submissions_is_all_durable() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..200 {
            let http = api.http.clone();
            let url = api.url("/v1/jobs");
            let token = admin.clone();
            tasks.spawn(async move {
                let response = http
                    .post(url)
                    .bearer_auth(token)
                    .json(&json!({ "spec": spec(&format!("job-{i}"), "default", 1) }))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), StatusCode::CREATED);
                response.json::<SubmitResponse>().await.unwrap().id
            });
        }
        let mut acknowledged = Vec::new();
        while let Some(id) = tasks.join_next().await {
            acknowledged.push(id.unwrap());
        }
        acknowledged.sort_unstable();
        acknowledged.dedup();
        assert_eq!(acknowledged.len(), 200);
        server.shutdown().await;

        let server = start(dir.path()).await;
        let api = Api::new(&server);
        // The default page is 100.
        let (_, body) = api.get("/v1/jobs", &admin).await;
        let list: JobList = serde_json::from_value(body).unwrap();
        assert_eq!(list.jobs.len(), 100);
        assert!(list.next_cursor.is_some());
        let mut found: Vec<u64> = api
            .all_jobs(&admin, "", 64)
            .await
            .iter()
            .map(|j| j.id)
            .collect();
        found.sort_unstable();
        assert_eq!(found, acknowledged);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_gpu_reported_in_a_heartbeat_is_taken_out_of_service() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let registered = api.register(server.join_token(), "gpu-1").await;
        let token = registered.node_token.clone();
        // GPU 0 is out of service from the start.
        let beat = |version: u64| {
            serde_json::to_value(HeartbeatRequest {
                pulling: Vec::new(),
                epoch: registered.epoch,
                observed: Vec::new(),
                wait_ms: 2_000,
                known_version: version,
                unhealthy_gpus: vec![0],
                sequence: 0,
            })
            .unwrap()
        };
        let (status, body) = api
            .post("/v1/agents/gpu-1/heartbeat", &token, beat(0))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let (_, node) = api.get("/v1/nodes/gpu-1", &admin).await;
        assert_eq!(node["unhealthy_gpus"], json!([0]));
        // Four GPUs asked on a node with three healthy ones: never fits.
        let big = api.submit(&admin, spec("big", "default", 4)).await;
        let small = api.submit(&admin, spec("small", "default", 3)).await;
        let mut version = 0;
        let placed = loop {
            let (status, body) = api
                .post("/v1/agents/gpu-1/heartbeat", &token, beat(version))
                .await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let response: HeartbeatResponse = serde_json::from_value(body).unwrap();
            if !response.desired.is_empty() {
                break response.desired;
            }
            version = response.version;
        };
        assert_eq!(placed.len(), 1);
        assert_eq!(placed[0].job, small);
        assert!(!placed[0].gpus.contains(&0), "GPU 0 is out of service");
        let job = api.job(&admin, big).await;
        assert_eq!(job.state, "pending");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_server_on_the_same_data_directory_is_refused() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let first = start(dir.path()).await;
        let mut config = ServerConfig::new(dir.path().to_path_buf());
        config.listen = "127.0.0.1:0".parse().unwrap();
        let error = match Server::start(config).await {
            Ok(_) => panic!("a second server started on the same data directory"),
            Err(error) => error.to_string(),
        };
        assert!(error.contains("another muster server is using"), "{error}");
        first.shutdown().await;
        // Once the first is gone, the directory is free again.
        let again = start(dir.path()).await;
        again.shutdown().await;
    })
    .await;
}

/// A library caller's master port base whose ports do not all exist is
/// refused at start, as the command line refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_port_base_past_the_ports_there_are_is_refused() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        config.master_port_base = 60_000;
        let error = match Server::start(config).await {
            Ok(_) => panic!("a server started with ports past 65535"),
            Err(error) => error.to_string(),
        };
        assert!(
            error.contains("60000") && error.contains("--master-port-base"),
            "{error}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_jobs_leave_memory_and_stay_listed_and_readable_from_the_store() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        // Retired at the first lease tick (every second) after they end.
        config.retention_ms = 0;
        let server = Server::start(config).await.unwrap();
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let mut ids = Vec::new();
        for i in 0..30 {
            let mut job = spec(&format!("j{i}"), if i % 2 == 0 { "even" } else { "odd" }, 1);
            // Never placed: no node has this model.
            job["gpu_models"] = json!(["A100-40GB"]);
            ids.push(api.submit(&admin, job).await);
        }
        for &id in &ids[..20] {
            let (status, body) = api
                .post(&format!("/v1/jobs/{id}/cancel"), &admin, json!({}))
                .await;
            assert_eq!(status, StatusCode::OK, "{body}");
        }
        // After a tick the 20 cancelled ones are retired; wait for it.
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        let all = api.all_jobs(&admin, "", 7).await;
        let listed: Vec<u64> = all.iter().map(|j| j.id).collect();
        let mut newest_first = ids.clone();
        newest_first.reverse();
        assert_eq!(
            listed, newest_first,
            "every job once, newest first, across pages"
        );
        let cancelled = api.all_jobs(&admin, "state=cancelled", 6).await;
        assert_eq!(cancelled.len(), 20);
        assert!(cancelled.iter().all(|j| j.state == "cancelled"));
        let odd_cancelled = api.all_jobs(&admin, "state=cancelled&queue=odd", 100).await;
        assert_eq!(odd_cancelled.len(), 10);
        let pending = api.all_jobs(&admin, "state=pending", 100).await;
        assert_eq!(pending.len(), 10);
        let active = api.all_jobs(&admin, "active=true", 4).await;
        assert_eq!(active.len(), 10);
        // States in any case, and lists of them.
        let both = api.all_jobs(&admin, "state=Cancelled,PENDING", 8).await;
        assert_eq!(both.len(), 30);
        let (status, body) = api.get("/v1/jobs?state=pending,nope", &admin).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(error_of(&body).message.contains("\"nope\""), "{body}");
        // A retired job reads back whole, and cancelling it again is
        // harmless.
        let first = api.job(&admin, ids[0]).await;
        assert_eq!(first.state, "cancelled");
        assert!(first.history.iter().any(|e| e.what == "cancelled"));
        let (status, body) = api
            .post(&format!("/v1/jobs/{}/cancel", ids[0]), &admin, json!({}))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let (status, _) = api.get("/v1/jobs?limit=0", &admin).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let (status, _) = api.get("/v1/jobs?cursor=abc", &admin).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        server.shutdown().await;

        // A restart loads only what is not retired, and lists the same.
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let again: Vec<u64> = api
            .all_jobs(&admin, "", 100)
            .await
            .iter()
            .map(|j| j.id)
            .collect();
        assert_eq!(again, newest_first);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrays_are_listed_cancelled_and_kept_across_retirement_and_restarts() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        // Retired at the first lease tick (every second) after they end.
        config.retention_ms = 0;
        let server = Server::start(config.clone()).await.unwrap();
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let first = api.submit(&admin, spec("before", "default", 1)).await;
        let mut array = spec("shard", "default", 1);
        array["array"] = json!("0-9%3");
        let (status, body) = api.post("/v1/jobs", &admin, json!({ "spec": array })).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert_eq!(body["elements"], 10, "{body}");
        let head = body["id"].as_u64().expect("an id");
        assert_eq!(head, first + 1);
        // The array's ids are reserved: the next job comes after them.
        let after = api.submit(&admin, spec("after", "default", 1)).await;
        assert_eq!(after, head + 10);
        let elements = api.all_jobs(&admin, &format!("array={head}"), 4).await;
        let indices: Vec<u32> = elements
            .iter()
            .map(|job| job.array.expect("an element").index)
            .collect();
        assert_eq!(indices, (0..10).rev().collect::<Vec<u32>>());
        assert!(elements.iter().all(|job| {
            job.array
                .is_some_and(|a| a.job == head && a.count == 10 && a.limit == Some(3))
        }));
        // One element cancelled, then retired: still listed with its array.
        let (status, _) = api
            .post(&format!("/v1/jobs/{}/cancel", head + 5), &admin, json!({}))
            .await;
        assert_eq!(status, StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        let elements = api.all_jobs(&admin, &format!("array={head}"), 100).await;
        assert_eq!(elements.len(), 10);
        let retired = api.job(&admin, head + 5).await;
        assert_eq!(retired.state, "cancelled");
        assert_eq!(retired.array.map(|a| a.index), Some(5));
        // The whole array, in one call; a job that is not an array is not.
        let (status, body) = api
            .post(&format!("/v1/arrays/{head}/cancel"), &admin, json!({}))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let list: JobList = serde_json::from_value(body).unwrap();
        assert_eq!(list.jobs.len(), 9);
        assert!(list.jobs.iter().all(|job| job.state == "cancelled"));
        let (status, body) = api
            .post(&format!("/v1/arrays/{first}/cancel"), &admin, json!({}))
            .await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        let (status, _) = api.post("/v1/arrays/999/cancel", &admin, json!({})).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, body) = api.get(&format!("/v1/jobs?array={first}"), &admin).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
        assert_eq!(api.job(&admin, first).await.state, "pending");
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        server.shutdown().await;

        // After a restart, with every element retired to the store.
        let server = Server::start(config).await.unwrap();
        let api = Api::new(&server);
        let elements = api.all_jobs(&admin, &format!("array={head}"), 3).await;
        assert_eq!(elements.len(), 10);
        assert!(elements.iter().all(|job| job.state == "cancelled"));
        let next = api.submit(&admin, spec("later", "default", 1)).await;
        assert_eq!(next, after + 1, "no id is given twice");
        // Waiting for a retired array is waiting for every element, read
        // from the store: they were cancelled, so it can never succeed.
        let mut post = spec("post", "default", 1);
        post["after"] = json!([head]);
        let (status, body) = api.post("/v1/jobs", &admin, json!({ "spec": post })).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(
            error_of(&body)
                .message
                .contains(&format!("of array job {head} cancelled")),
            "{body}"
        );
        let mut post = spec("post", "default", 1);
        post["after"] = json!([format!("notok:{head}")]);
        let (status, body) = api.post("/v1/jobs", &admin, json!({ "spec": post })).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_join_token_admits_only_new_names_and_a_node_keeps_its_credential() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let join = server.join_token().to_string();
        let first = api.register(&join, "gpu-1").await;
        let job = api.submit(&admin, spec("a", "default", 1)).await;
        let placed = wait_for_desired(&api, &first.node_token, first.epoch, &[], 1).await;
        let (status, _) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &first.node_token,
                heartbeat_body(first.epoch, all_running(&placed.desired), 0, 0),
            )
            .await;
        assert_eq!(status, StatusCode::OK);

        // An impostor with the join token cannot take the name.
        let (status, body) = api
            .post(
                "/v1/agents/register",
                &join,
                serde_json::to_value(register_request("gpu-1")).unwrap(),
            )
            .await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert!(
            error_of(&body).message.contains("node.credential"),
            "{body}"
        );
        // Nor with another node's credential.
        let other = api.register(&join, "gpu-2").await;
        let (status, _) = api
            .post(
                "/v1/agents/register",
                &other.node_token,
                serde_json::to_value(register_request("gpu-1")).unwrap(),
            )
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        // The real node's job runs on.
        assert_eq!(api.job(&admin, job).await.state, "running");

        // The real agent restarts: its credential registers it again, with
        // the same credential and a newer epoch; the old epoch is refused.
        let (status, body) = api
            .post(
                "/v1/agents/register",
                &first.node_token,
                serde_json::to_value(register_request("gpu-1")).unwrap(),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let again: RegisterResponse = serde_json::from_value(body).unwrap();
        assert_eq!(again.node_token, first.node_token);
        assert!(again.epoch > other.epoch && other.epoch > first.epoch);
        let (status, body) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &first.node_token,
                heartbeat_body(first.epoch, all_running(&placed.desired), 0, 0),
            )
            .await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        let (status, body) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &first.node_token,
                heartbeat_body(again.epoch, all_running(&placed.desired), 0, 0),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(api.job(&admin, job).await.state, "running");

        // A node spec the cluster cannot take is refused with the reason.
        let mut big = register_request("big");
        big.gpus = (0..65)
            .map(|index| GpuView {
                index,
                uuid: format!("GPU-big-{index}"),
                model: "H100-80GB".to_string(),
                memory_mib: 81_920,
                nvlink_domain: 0,
            })
            .collect();
        let (status, body) = api
            .post(
                "/v1/agents/register",
                &join,
                serde_json::to_value(big).unwrap(),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(error_of(&body).message.contains("65 GPUs"), "{body}");

        // An admin resets the identity: the credential stops working and
        // the join token may claim the name again.
        let (status, body) = api
            .post("/v1/nodes/gpu-1/reset-identity", &admin, json!({}))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let (status, body) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &first.node_token,
                heartbeat_body(again.epoch, Vec::new(), 0, 0),
            )
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        assert!(
            !body.to_string().contains(&dir.path().display().to_string()),
            "no server path: {body}"
        );
        let renewed = api.register(&join, "gpu-1").await;
        assert_ne!(renewed.node_token, first.node_token);
        server.shutdown().await;

        // Credentials survive a restart; the revoked one stays revoked.
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let (status, _) = api
            .post(
                "/v1/agents/register",
                &renewed.node_token,
                serde_json::to_value(register_request("gpu-1")).unwrap(),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        let (status, _) = api
            .post(
                "/v1/agents/register",
                &first.node_token,
                serde_json::to_value(register_request("gpu-1")).unwrap(),
            )
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_holding_work_is_removed_only_with_force() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let node = api.register(server.join_token(), "gpu-1").await;
        let job = api.submit(&admin, spec("a", "default", 1)).await;
        wait_for_desired(&api, &node.node_token, node.epoch, &[], 1).await;
        let (status, body) = api
            .call(
                reqwest::Method::DELETE,
                "/v1/nodes/gpu-1",
                Some(&admin),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert!(error_of(&body).message.contains("--force"), "{body}");
        let (status, body) = api
            .call(
                reqwest::Method::DELETE,
                "/v1/nodes/gpu-1?force=true",
                Some(&admin),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["requeued_jobs"], json!([job]));
        let (status, _) = api.get("/v1/nodes/gpu-1", &admin).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let view = api.job(&admin, job).await;
        assert_eq!(view.state, "pending", "re-queued: {:?}", view.history);
        // Its credential went with it.
        let (status, _) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &node.node_token,
                heartbeat_body(node.epoch, Vec::new(), 0, 0),
            )
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        server.shutdown().await;
        // And it stays removed after a restart.
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let (status, _) = api.get("/v1/nodes/gpu-1", &admin).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_makes_the_server_read_only_and_nothing_unsaved_is_acknowledged() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        // A store that may not grow past 1 MiB: it fills up.
        config.store_max_mib = Some(1);
        let server = Server::start(config).await.unwrap();
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let node = api.register(server.join_token(), "gpu-1").await;
        let mut acknowledged = Vec::new();
        let mut refusal = None;
        let padding = "x".repeat(16 * 1024);
        for i in 0..400 {
            let mut job = spec(&format!("j{i}"), "default", 1);
            job["gpu_models"] = json!(["A100-40GB"]);
            job["env"] = json!({ "PADDING": padding });
            // Kept pending (no node takes A100s) so the state only grows.
            let (status, body) = api
                .post(
                    "/v1/jobs",
                    &admin,
                    json!({ "spec": job, "allow_pending": true }),
                )
                .await;
            if status == StatusCode::CREATED {
                acknowledged.push(body["id"].as_u64().unwrap());
            } else {
                refusal = Some((status, body));
                break;
            }
        }
        let (status, body) = refusal.expect("the store fills up");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        // Whether that commit took is not known: the answer says so.
        assert!(
            error_of(&body)
                .message
                .contains("may or may not have been saved"),
            "{body}"
        );
        assert!(!acknowledged.is_empty());
        // Read-only from now on: writes answer 503 with the reason,
        // heartbeats too (no answer may carry unsaved state), and /healthz
        // says so.
        let (status, body) = api
            .post(
                "/v1/jobs",
                &admin,
                json!({ "spec": spec("late", "default", 1) }),
            )
            .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(error_of(&body).message.contains("read-only"), "{body}");
        let (status, _) = api
            .post(
                "/v1/agents/gpu-1/heartbeat",
                &node.node_token,
                heartbeat_body(node.epoch, Vec::new(), 0, 0),
            )
            .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        let (status, body) = api.call(reqwest::Method::GET, "/healthz", None, None).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.to_string().contains("read-only"), "{body}");
        server.shutdown().await;

        // Restarted with room: exactly the acknowledged jobs are there.
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let mut found: Vec<u64> = api
            .all_jobs(&admin, "", 1000)
            .await
            .iter()
            .map(|j| j.id)
            .collect();
        found.sort_unstable();
        assert_eq!(found, acknowledged);
        let (status, _) = api.call(reqwest::Method::GET, "/healthz", None, None).await;
        assert_eq!(status, StatusCode::OK);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_breaks_an_invariant_is_refused_with_the_reason() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let id = api.submit(&admin, spec("a", "default", 1)).await;
        server.shutdown().await;
        // Damage the store: the pending job now claims to run on an
        // allocation that does not exist.
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_with(
                sqlx::sqlite::SqliteConnectOptions::new().filename(dir.path().join("muster.db")),
            )
            .await
            .unwrap();
        let record: String = sqlx::query_scalar("SELECT record FROM jobs WHERE id = ?1")
            .bind(id as i64)
            .fetch_one(&pool)
            .await
            .unwrap();
        let mut record: Value = serde_json::from_str(&record).unwrap();
        record["state"] = json!("running");
        record["allocations"] = json!([999]);
        sqlx::query("UPDATE jobs SET record = ?1 WHERE id = ?2")
            .bind(record.to_string())
            .bind(id as i64)
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
        let error = Server::start(test_config(dir.path()))
            .await
            .expect_err("an inconsistent store is refused");
        let text = format!("{error:#}");
        assert!(text.contains("inconsistent"), "{text}");
        assert!(text.contains("missing allocation 999"), "{text}");
    })
    .await;
}

fn telemetry_of(epoch: u64, utilization: impl Fn(u32) -> u32) -> Value {
    use muster_api::protocol::{GpuSample, NodeSample, TelemetryReport};
    serde_json::to_value(TelemetryReport {
        epoch,
        sampled_ms: 1,
        gpus: (0..4)
            .map(|index| GpuSample {
                index,
                utilization_pct: utilization(index),
                memory_used_mib: 1_000,
                memory_total_mib: 81_920,
                power_watts: None,
                temperature_c: None,
                sm_clock_mhz: None,
                ecc_uncorrected: None,
                xid: None,
                pcie_tx_bytes: None,
                pcie_rx_bytes: None,
                healthy: true,
            })
            .collect(),
        node: NodeSample::default(),
    })
    .expect("a report")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_time_is_accounted_priced_and_a_hard_budget_holds_its_queue() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        // Prices are kept under the model's name as agents give it.
        let (status, body) = api
            .call(
                reqwest::Method::PUT,
                "/v1/prices/h100-80gb",
                Some(&admin),
                Some(json!({ "per_gpu_hour": 2.5 })),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["prices"]["H100-80GB"], 2.5);
        let (status, _) = api
            .call(
                reqwest::Method::PUT,
                "/v1/prices/H100",
                Some(&admin),
                Some(json!({ "per_gpu_hour": -1.0 })),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);

        let registered = api.register(server.join_token(), "gpu-1").await;
        let (token, epoch) = (registered.node_token.clone(), registered.epoch);
        let id = api.submit(&admin, spec("train", "team-a", 2)).await;
        let placed = wait_for_desired(&api, &token, epoch, &[], 1).await;
        let held = placed.desired[0].gpus.clone();
        let running = all_running(&placed.desired);
        let beat =
            |observed: Vec<ObservedAllocation>| heartbeat_body(epoch, observed, placed.version, 0);
        let (status, _) = api
            .post("/v1/agents/gpu-1/heartbeat", &token, beat(running.clone()))
            .await;
        assert_eq!(status, StatusCode::OK);
        let busy = |index: u32| {
            if held.contains(&index) { 80 } else { 0 }
        };
        let path = "/v1/agents/gpu-1/telemetry";
        assert_eq!(
            api.post(path, &token, telemetry_of(epoch, busy)).await.0,
            StatusCode::OK
        );
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        assert_eq!(
            api.post(path, &token, telemetry_of(epoch, busy)).await.0,
            StatusCode::OK
        );
        // While it runs, its open minute already counts.
        let (_, live) = api.get(&format!("/v1/jobs/{id}/usage"), &admin).await;
        let live: JobUsage = serde_json::from_value(live).expect("usage");
        assert_eq!(live.ranks.len(), 1);
        assert!(live.ranks[0].allocated_gpu_hours > 0.0, "{live:?}");
        let mut exited = running.clone();
        exited[0].exited = Some(Some(0));
        let (status, _) = api
            .post("/v1/agents/gpu-1/heartbeat", &token, beat(exited))
            .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(api.job(&admin, id).await.state, "succeeded");

        // The job's minutes, written once it ended.
        let mut usage: Option<JobUsage> = None;
        for _ in 0..100 {
            let (status, body) = api.get(&format!("/v1/jobs/{id}/usage"), &admin).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let found: JobUsage = serde_json::from_value(body).expect("usage");
            if found.ranks.first().is_some_and(|r| r.samples == 2) && usage.as_ref() == Some(&found)
            {
                break;
            }
            usage = Some(found);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let usage = usage.expect("usage");
        let rank = &usage.ranks[0];
        assert_eq!(rank.samples, 2);
        assert_eq!(rank.mean_utilization_pct, Some(80.0));
        assert_eq!(
            (rank.peak_utilization_pct, rank.peak_memory_mib),
            (80, 2_000)
        );
        // Two GPUs for about 2.5 s, used at 80% while telemetry covered them.
        let held_hours = rank.allocated_gpu_hours;
        assert!(
            held_hours > 2.0 * 2.0 / 3600.0 && held_hours < 2.0 * 10.0 / 3600.0,
            "{rank:?}"
        );
        assert!(rank.used_gpu_hours > 0.0 && rank.used_gpu_hours <= 0.8 * held_hours + 1e-12);
        assert_eq!(rank.idle_gpu_hours, 0.0);
        assert!(!usage.minutes.is_empty());
        let (_, missing) = api.get("/v1/jobs/x/usage", &admin).await;
        assert!(error_of(&missing).message.contains("job id"), "{missing}");

        // The cost: the GPU-hours at 2.50, by queue and by job.
        let (status, body) = api.get("/v1/cost?since=1h&by=queue", &admin).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let report: CostReport = serde_json::from_value(body).expect("a report");
        assert_eq!(report.lines.len(), 1);
        let line = &report.lines[0];
        assert_eq!(line.key, "team-a");
        assert!(
            (line.allocated_gpu_hours - held_hours).abs() < 1e-12,
            "{line:?}"
        );
        assert!((line.cost - held_hours * 2.5).abs() < 1e-9, "{line:?}");
        assert!(report.unpriced_models.is_empty());
        let (_, body) = api.get("/v1/cost?since=month&by=job", &admin).await;
        let by_job: CostReport = serde_json::from_value(body).expect("a report");
        assert_eq!(by_job.lines[0].key, id.to_string());
        let (status, body) = api.get("/v1/cost?by=team", &admin).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(error_of(&body).message.contains("queue, user, job or pool"));

        // A hard budget below what team-a spent: its next job waits, and
        // says why; submitting warns.
        let (status, body) = api
            .call(
                reqwest::Method::PUT,
                "/v1/queues/team-a",
                Some(&admin),
                Some(json!({ "guaranteed_gpus": 0.0, "weight": 1,
                             "budget": 0.0001, "budget_hard": true })),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(
            body["spent_this_month"].as_f64().expect("spent") > 0.0001,
            "{body}"
        );
        let (status, body) = api
            .post(
                "/v1/jobs",
                &admin,
                json!({ "spec": spec("next", "team-a", 1) }),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        let next = body["id"].as_u64().expect("an id");
        assert!(
            body["warnings"][0]
                .as_str()
                .expect("a warning")
                .contains("budget"),
            "{body}"
        );
        // Other queues still run.
        let other = api.submit(&admin, spec("other", "team-b", 1)).await;
        let placed = wait_for_desired(&api, &token, epoch, &[], 1).await;
        assert_eq!(placed.desired[0].job, other);
        let job = api.job(&admin, next).await;
        assert_eq!(job.pending_code.as_deref(), Some("budget"), "{job:?}");
        assert!(
            job.pending_reason
                .expect("a reason")
                .contains("budget exhausted")
        );
        assert!(!job.warnings.is_empty());
        let (_, text) = api.get("/metrics", &admin).await;
        let text = text.as_str().expect("text").to_string();
        for line in [
            "muster_queue_budget{queue=\"team-a\",hard=\"true\"} 0.0",
            "muster_jobs_pending{queue=\"team-a\",reason=\"budget\"} 1.0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\nnot in:\n{text}");
        }
        // Raised, the job starts.
        let (status, _) = api
            .call(
                reqwest::Method::PUT,
                "/v1/queues/team-a",
                Some(&admin),
                Some(json!({ "guaranteed_gpus": 0.0, "weight": 1, "budget": 1000.0 })),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        let placed = wait_for_desired(&api, &token, epoch, &[], 2).await;
        assert!(placed.desired.iter().any(|task| task.job == next));
        server.shutdown().await;

        // A price file at start adds to the stored prices; the accounting
        // survives the restart.
        std::fs::write(dir.path().join("prices.yaml"), "L4: 0.80\n").unwrap();
        let mut config = test_config(dir.path());
        config.prices_file = Some(dir.path().join("prices.yaml"));
        let server = Server::start(config).await.unwrap();
        let api = Api::new(&server);
        let (_, body) = api.get("/v1/prices", &admin).await;
        assert_eq!(body["prices"], json!({ "H100-80GB": 2.5, "L4": 0.8 }));
        let (_, body) = api.get(&format!("/v1/jobs/{id}/usage"), &admin).await;
        let after: JobUsage = serde_json::from_value(body).expect("usage");
        assert_eq!(after.ranks[0].allocated_gpu_hours, held_hours);
        server.shutdown().await;
        std::fs::write(dir.path().join("prices.yaml"), "L4: free\n").unwrap();
        let mut config = test_config(dir.path());
        config.prices_file = Some(dir.path().join("prices.yaml"));
        let error = Server::start(config).await.expect_err("a bad price list");
        assert!(error.to_string().contains("prices.yaml"), "{error}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_needs_a_token_escapes_what_it_shows_and_loads_nothing_else() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let registered = api.register(server.join_token(), "gpu-1").await;
        let mut hostile = spec("hostile", "team-a", 1);
        hostile["command"] = json!(["sh", "-c", "echo '<script>alert(1)</script>'"]);
        let id = api.submit(&admin, hostile).await;
        // A node's telemetry over the last hour.
        let (status, _) = api
            .post(
                "/v1/agents/gpu-1/telemetry",
                &registered.node_token,
                telemetry_of(registered.epoch, |_| 40),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        let (status, body) = api.get("/v1/nodes/gpu-1/telemetry", &admin).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let history: NodeHistory = serde_json::from_value(body).expect("a history");
        assert_eq!(history.points.len(), 1);
        assert_eq!(history.points[0].gpus[0].utilization_pct, 40);
        assert_eq!(
            api.get("/v1/nodes/nope/telemetry", &admin).await.0,
            StatusCode::NOT_FOUND
        );

        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let get = |path: String, cookie: Option<String>| {
            let mut request = client.get(api.url(&path));
            if let Some(cookie) = cookie {
                request = request.header("cookie", cookie);
            }
            request.send()
        };
        // No token, a wrong one, a node's: the sign-in page, 401.
        for (path, cookie) in [
            ("/".to_string(), None),
            ("/ui/jobs?token=wrong".to_string(), None),
            (
                "/ui/jobs".to_string(),
                Some(format!("muster_session={}", registered.node_token)),
            ),
            // The token itself is no session.
            (
                "/ui/jobs".to_string(),
                Some(format!("muster_session={admin}")),
            ),
            (
                "/ui/jobs".to_string(),
                Some(format!("muster_token={admin}")),
            ),
        ] {
            let response = get(path.clone(), cookie).await.unwrap();
            assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{path}");
            assert!(
                response
                    .text()
                    .await
                    .unwrap()
                    .contains("Paste the admin token")
            );
        }
        // A token in the address: kept in an HttpOnly cookie and taken out
        // of the address.
        let response = get(format!("/ui/jobs?state=pending&token={admin}"), None)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SEE_OTHER);
        assert_eq!(response.headers()["location"], "/ui/jobs?state=pending");
        let cookie = response.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(
            cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
            "{cookie}"
        );
        // A random session id, never the token; the redirect that carries
        // it is cached nowhere. (Plain HTTP here: no Secure, no HSTS; the
        // HTTPS test checks those.)
        assert!(!cookie.contains(&admin), "the token in a cookie: {cookie}");
        assert!(cookie.starts_with("muster_session="), "{cookie}");
        assert_eq!(response.headers()["cache-control"], "no-store");
        assert!(!cookie.contains("Secure"), "{cookie}");
        let cookie = cookie.split(';').next().unwrap().to_string();
        for path in [
            "/",
            "/ui/queues",
            "/ui/jobs",
            "/ui/nodes",
            "/ui/nodes/gpu-1",
            "/ui/cost",
        ] {
            let response = get(path.to_string(), Some(cookie.clone())).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            let csp = response.headers()["content-security-policy"]
                .to_str()
                .unwrap();
            assert!(csp.contains("default-src 'none'"), "{csp}");
            let text = response.text().await.unwrap();
            assert!(!text.contains("<script"), "{path}: no script at all");
        }
        let text = get(format!("/ui/jobs/{id}"), Some(cookie.clone()))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            text.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{text}"
        );
        assert!(!text.contains("<script"), "{text}");
        let response = get("/ui/jobs/999".to_string(), Some(cookie.clone()))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        // Signing out ends the session.
        let response = client
            .post(api.url("/ui/logout"))
            .header("cookie", cookie.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SEE_OTHER);
        let response = get("/ui/jobs".to_string(), Some(cookie.clone()))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        // The sign-in form.
        let response = client
            .post(api.url("/ui/login"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={}", server.metrics_token()))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SEE_OTHER);
        let response = client
            .post(api.url("/ui/login"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body("token=nope")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        server.shutdown().await;
    })
    .await;
}

/// Who calls, in the authorization matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    NoToken,
    WrongToken,
    Join,
    Node,
    Metrics,
    /// The owner of the job the routes name (a user of team-a).
    Alice,
    /// Another user of team-a, whose members see each other's jobs.
    Bob,
    /// A user of team-b only.
    Carol,
    Operator,
    Admin,
}

/// (method, route as OpenAPI names it, path, body, status per caller).
type Case = (
    reqwest::Method,
    &'static str,
    String,
    Option<Value>,
    Vec<(Who, u16)>,
);

const EVERYONE: [Who; 10] = [
    Who::NoToken,
    Who::WrongToken,
    Who::Join,
    Who::Node,
    Who::Metrics,
    Who::Alice,
    Who::Bob,
    Who::Carol,
    Who::Operator,
    Who::Admin,
];

/// The statuses of a route for which only `allowed` get past
/// authorization (answering `ok`), the rest 401 (no or a wrong token) or
/// 403.
fn only(allowed: &[Who], ok: u16) -> Vec<(Who, u16)> {
    EVERYONE
        .iter()
        .map(|who| {
            let status = if allowed.contains(who) {
                ok
            } else if matches!(who, Who::NoToken | Who::WrongToken) {
                401
            } else {
                403
            };
            (*who, status)
        })
        .collect()
}

const USERS: [Who; 5] = [Who::Alice, Who::Bob, Who::Carol, Who::Operator, Who::Admin];

/// Alice's job as each caller sees it: its owner, a member of its shared
/// queue and staff read it; carol does not see it at all.
fn job_read(ok: u16) -> Vec<(Who, u16)> {
    let mut statuses = only(&USERS, ok);
    for (who, status) in &mut statuses {
        if *who == Who::Carol {
            *status = 404;
        }
    }
    statuses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_authorization_matrix_holds_for_every_route() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let node = api.register(server.join_token(), "gpu-1").await.node_token;
        let (status, _) = api
            .call(
                reqwest::Method::PUT,
                "/v1/queues/team-a",
                Some(&admin),
                Some(json!({ "guaranteed_gpus": 0.0, "weight": 1, "members_see_jobs": true })),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        let mut tokens = std::collections::BTreeMap::new();
        for (name, role, queues) in [
            ("alice", "user", vec!["team-a"]),
            ("bob", "user", vec!["team-a"]),
            ("carol", "user", vec!["team-b"]),
            ("olga", "operator", vec![]),
            ("root2", "admin", vec![]),
        ] {
            let (status, body) = api
                .post(
                    "/v1/users",
                    &admin,
                    json!({ "name": name, "role": role, "queues": queues }),
                )
                .await;
            assert_eq!(status, StatusCode::CREATED, "{body}");
            tokens.insert(name, body["token"].as_str().expect("a token").to_string());
        }
        let token_of = |who: Who| -> Option<String> {
            Some(match who {
                Who::NoToken => return None,
                Who::WrongToken => "0".repeat(64),
                Who::Join => server.join_token().to_string(),
                Who::Node => node.clone(),
                Who::Metrics => server.metrics_token().to_string(),
                Who::Alice => tokens["alice"].clone(),
                Who::Bob => tokens["bob"].clone(),
                Who::Carol => tokens["carol"].clone(),
                Who::Operator => tokens["olga"].clone(),
                Who::Admin => tokens["root2"].clone(),
            })
        };
        // Alice's job, in team-a.
        let (status, body) = api
            .post(
                "/v1/jobs",
                &tokens["alice"],
                json!({ "spec": spec("mine", "team-a", 1) }),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        let job = body["id"].as_u64().expect("an id");
        let (_, body) = api.get(&format!("/v1/jobs/{job}"), &admin).await;
        assert_eq!(body["user"], "alice", "the job is the token's user's");
        // Alice's service, in team-a: its endpoints are as hidden from
        // carol as the service itself.
        let (status, body) = api
            .post(
                "/v1/services",
                &tokens["alice"],
                json!({ "spec": {
                    "kind": "service", "name": "hers", "queue": "team-a", "replicas": 1,
                    "gpus": 0, "command": ["sleep", "600"],
                } }),
            )
            .await;
        assert!(status.is_success(), "{status}: {body}");

        use reqwest::Method;
        let team_a = json!({ "spec": spec("x", "team-a", 1) });
        let mut submit = only(&USERS, 201);
        for (who, status) in &mut submit {
            if *who == Who::Carol {
                *status = 403;
            }
        }
        let mut cancel = job_read(200);
        for (who, status) in &mut cancel {
            if matches!(who, Who::Bob | Who::Operator) {
                *status = 403;
            }
        }
        let mut array_cancel = cancel.clone();
        for (_, status) in &mut array_cancel {
            if *status == 200 {
                *status = 409;
            }
        }
        let staff = [Who::Operator, Who::Admin];
        // (method, route as OpenAPI names it, path, body, statuses)
        let cases: Vec<Case> = vec![
            (
                Method::GET,
                "/v1/jobs",
                "/v1/jobs".into(),
                None,
                only(&USERS, 200),
            ),
            (
                Method::POST,
                "/v1/jobs",
                "/v1/jobs".into(),
                Some(team_a),
                submit,
            ),
            (
                Method::GET,
                "/v1/jobs/{id}",
                format!("/v1/jobs/{job}"),
                None,
                job_read(200),
            ),
            (
                Method::GET,
                "/v1/jobs/{id}/logs",
                format!("/v1/jobs/{job}/logs"),
                None,
                job_read(200),
            ),
            (
                Method::GET,
                "/v1/jobs/{id}/usage",
                format!("/v1/jobs/{job}/usage"),
                None,
                job_read(200),
            ),
            (
                Method::GET,
                "/v1/nodes",
                "/v1/nodes".into(),
                None,
                only(&USERS, 200),
            ),
            (
                Method::GET,
                "/v1/nodes/{name}",
                "/v1/nodes/gpu-1".into(),
                None,
                only(&USERS, 200),
            ),
            (
                Method::GET,
                "/v1/nodes/{name}/telemetry",
                "/v1/nodes/gpu-1/telemetry".into(),
                None,
                only(&USERS, 200),
            ),
            (
                Method::DELETE,
                "/v1/nodes/{name}",
                "/v1/nodes/nope".into(),
                None,
                only(&staff, 404),
            ),
            (
                Method::POST,
                "/v1/nodes/{name}/cordon",
                "/v1/nodes/nope/cordon".into(),
                None,
                only(&staff, 404),
            ),
            (
                Method::POST,
                "/v1/nodes/{name}/uncordon",
                "/v1/nodes/nope/uncordon".into(),
                None,
                only(&staff, 404),
            ),
            (
                Method::POST,
                "/v1/nodes/{name}/approve",
                "/v1/nodes/nope/approve".into(),
                None,
                only(&staff, 404),
            ),
            (
                Method::POST,
                "/v1/nodes/{name}/drain",
                "/v1/nodes/nope/drain".into(),
                None,
                only(&staff, 404),
            ),
            (
                Method::POST,
                "/v1/nodes/{name}/reset-identity",
                "/v1/nodes/nope/reset-identity".into(),
                None,
                only(&staff, 404),
            ),
            (
                Method::GET,
                "/v1/pools",
                "/v1/pools".into(),
                None,
                only(&USERS, 200),
            ),
            (
                Method::PUT,
                "/v1/pools/{name}/policy",
                "/v1/pools/gpu-a/policy".into(),
                Some(json!({ "stack_policy": "report" })),
                only(&staff, 200),
            ),
            (
                Method::DELETE,
                "/v1/pools/{name}/policy",
                "/v1/pools/nope/policy".into(),
                None,
                only(&staff, 404),
            ),
            (
                Method::GET,
                "/v1/fleet",
                "/v1/fleet".into(),
                None,
                only(&USERS, 200),
            ),
            (
                Method::GET,
                "/v1/queues",
                "/v1/queues".into(),
                None,
                only(&USERS, 200),
            ),
            (
                Method::PUT,
                "/v1/queues/{name}",
                "/v1/queues/team-c".into(),
                Some(json!({ "guaranteed_gpus": 0.0, "weight": 1 })),
                only(&[Who::Admin], 200),
            ),
            (
                Method::GET,
                "/v1/cost",
                "/v1/cost".into(),
                None,
                only(&staff, 200),
            ),
            (
                Method::GET,
                "/v1/prices",
                "/v1/prices".into(),
                None,
                only(&USERS, 200),
            ),
            (
                Method::PUT,
                "/v1/prices/{model}",
                "/v1/prices/L4".into(),
                Some(json!({ "per_gpu_hour": 1.0 })),
                only(&[Who::Admin], 200),
            ),
            (
                Method::DELETE,
                "/v1/prices/{model}",
                "/v1/prices/NOPE".into(),
                None,
                only(&[Who::Admin], 404),
            ),
            (
                Method::GET,
                "/v1/users",
                "/v1/users".into(),
                None,
                only(&[Who::Admin], 200),
            ),
            (
                Method::POST,
                "/v1/users",
                "/v1/users".into(),
                Some(json!({ "name": "dave", "role": "user" })),
                only(&[Who::Admin], 201),
            ),
            (
                Method::DELETE,
                "/v1/users/{name}",
                "/v1/users/nobody".into(),
                None,
                only(&[Who::Admin], 404),
            ),
            (
                Method::POST,
                "/v1/users/{name}/rotate-token",
                "/v1/users/nobody/rotate-token".into(),
                None,
                only(&[Who::Admin], 404),
            ),
            (
                Method::POST,
                "/v1/users/{name}/limits",
                "/v1/users/nobody/limits".into(),
                Some(json!({ "max_pending": 5 })),
                only(&[Who::Admin], 404),
            ),
            // Join tokens: an admin's.
            (
                Method::GET,
                "/v1/join-tokens",
                "/v1/join-tokens".into(),
                None,
                only(&[Who::Admin], 200),
            ),
            (
                Method::POST,
                "/v1/join-tokens",
                "/v1/join-tokens".into(),
                Some(json!({ "uses": 0 })),
                only(&[Who::Admin], 400),
            ),
            (
                Method::POST,
                "/v1/join-tokens/{id}/revoke",
                "/v1/join-tokens/jt-000000000000/revoke".into(),
                Some(json!({})),
                only(&[Who::Admin], 404),
            ),
            (
                Method::GET,
                "/v1/whoami",
                "/v1/whoami".into(),
                None,
                only(&USERS, 200),
            ),
            (
                Method::PUT,
                "/v1/secrets/{name}",
                "/v1/secrets/hf".into(),
                Some(json!({ "value": "x" })),
                only(&[Who::Admin], 200),
            ),
            (
                Method::GET,
                "/v1/secrets",
                "/v1/secrets".into(),
                None,
                only(&[Who::Admin], 200),
            ),
            (
                Method::DELETE,
                "/v1/secrets/{name}",
                "/v1/secrets/nope".into(),
                None,
                only(&[Who::Admin], 404),
            ),
            (
                Method::GET,
                "/v1/audit",
                "/v1/audit".into(),
                None,
                only(&[Who::Admin], 200),
            ),
            (
                Method::POST,
                "/v1/agents/register",
                "/v1/agents/register".into(),
                Some(json!({})),
                only(&[Who::Join, Who::Node], 400),
            ),
            (
                Method::POST,
                "/v1/agents/{node}/heartbeat",
                "/v1/agents/gpu-1/heartbeat".into(),
                Some(json!({})),
                only(&[Who::Node], 400),
            ),
            (
                Method::POST,
                "/v1/agents/{node}/logs",
                "/v1/agents/gpu-1/logs".into(),
                Some(json!({})),
                only(&[Who::Node], 400),
            ),
            (
                Method::POST,
                "/v1/agents/{node}/telemetry",
                "/v1/agents/gpu-1/telemetry".into(),
                Some(json!({})),
                only(&[Who::Node], 400),
            ),
            (
                Method::GET,
                "/metrics",
                "/metrics".into(),
                None,
                only(&[Who::Metrics, Who::Operator, Who::Admin], 200),
            ),
            // Services: any user reads and may try to change one (the
            // handler lets only its owner or staff); a spec that is no
            // service is refused after authorization.
            (
                Method::GET,
                "/v1/services",
                "/v1/services".into(),
                None,
                only(&USERS, 200),
            ),
            (
                Method::POST,
                "/v1/services",
                "/v1/services".into(),
                Some(json!({ "spec": { "kind": "service" } })),
                only(&USERS, 422),
            ),
            (
                Method::GET,
                "/v1/services/{name}",
                "/v1/services/nope".into(),
                None,
                only(&USERS, 404),
            ),
            (
                Method::PUT,
                "/v1/services/{name}",
                "/v1/services/nope".into(),
                Some(json!({ "spec": { "kind": "service" } })),
                only(&USERS, 422),
            ),
            (
                Method::DELETE,
                "/v1/services/{name}",
                "/v1/services/nope".into(),
                None,
                only(&USERS, 404),
            ),
            (
                Method::POST,
                "/v1/services/{name}/scale",
                "/v1/services/nope/scale".into(),
                Some(json!({ "replicas": 1 })),
                only(&USERS, 404),
            ),
            (
                Method::POST,
                "/v1/services/{name}/rollback",
                "/v1/services/nope/rollback".into(),
                Some(json!({})),
                only(&USERS, 404),
            ),
            (
                Method::GET,
                "/v1/services/{name}/endpoints",
                "/v1/services/nope/endpoints".into(),
                None,
                only(&USERS, 404),
            ),
            (
                Method::GET,
                "/v1/services/{name}",
                "/v1/services/hers".into(),
                None,
                job_read(200),
            ),
            (
                Method::GET,
                "/v1/services/{name}/endpoints",
                "/v1/services/hers/endpoints".into(),
                None,
                job_read(200),
            ),
            (
                Method::GET,
                "/v1/endpoints",
                "/v1/endpoints".into(),
                None,
                // Every service's endpoints: the gateway's, not a user's.
                only(&[Who::Operator, Who::Admin], 200),
            ),
            // Traffic moves autoscaled services: gateways run with staff
            // tokens.
            (
                Method::POST,
                "/v1/traffic",
                "/v1/traffic".into(),
                Some(json!({ "gateway": "g", "services": {} })),
                only(&[Who::Operator, Who::Admin], 200),
            ),
            (
                Method::GET,
                "/v1/dev",
                "/v1/dev".into(),
                None,
                only(&USERS, 200),
            ),
            // Not an upgrade: refused (422) after authorization.
            (
                Method::GET,
                "/v1/dev/{name}/connect",
                "/v1/dev/nope/connect?kind=shell".into(),
                None,
                only(&USERS, 422),
            ),
            (
                Method::POST,
                "/v1/agents/{node}/checks",
                "/v1/agents/gpu-1/checks".into(),
                Some(json!({ "results": [] })),
                only(&[Who::Node], 200),
            ),
            (
                Method::POST,
                "/v1/agents/{node}/tunnels/{id}",
                "/v1/agents/gpu-1/tunnels/1".into(),
                None,
                only(&[Who::Node], 404),
            ),
            // Cancels last: they change the job.
            (
                Method::POST,
                "/v1/arrays/{id}/cancel",
                format!("/v1/arrays/{job}/cancel"),
                None,
                array_cancel,
            ),
            (
                Method::POST,
                "/v1/jobs/{id}/cancel",
                format!("/v1/jobs/{job}/cancel"),
                None,
                cancel,
            ),
        ];
        // Every route of the API is in the matrix: a new one fails here
        // until it is given its row.
        let (_, document) = api.get("/v1/openapi.json", &admin).await;
        for (path, item) in document["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("methods").keys() {
                let method =
                    Method::from_bytes(method.to_uppercase().as_bytes()).expect("a method");
                assert!(
                    cases
                        .iter()
                        .any(|(m, route, ..)| *m == method && route == path),
                    "{method} {path} is not in the authorization matrix"
                );
            }
        }
        let mut failures = Vec::new();
        for (method, route, path, body, statuses) in &cases {
            for (who, expected) in statuses {
                let (status, answer) = api
                    .call(
                        method.clone(),
                        path,
                        token_of(*who).as_deref(),
                        body.clone(),
                    )
                    .await;
                if status.as_u16() != *expected {
                    failures.push(format!(
                        "{method} {route} as {who:?}: {status}, expected {expected}: {answer}"
                    ));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        // The public ones.
        for path in ["/healthz", "/v1/openapi.json"] {
            let (status, _) = api.call(Method::GET, path, None, None).await;
            assert_eq!(status, StatusCode::OK, "{path}");
        }
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_are_audited_and_a_retried_submission_makes_one_job() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let (_, body) = api
            .post(
                "/v1/users",
                &admin,
                json!({ "name": "alice", "role": "user" }),
            )
            .await;
        let alice = body["token"].as_str().expect("a token").to_string();
        assert_eq!(body["user"]["queues"], json!(["default"]));
        // Users are numbered for their group on the nodes, from 1 (the
        // built-in admin's is 0).
        assert_eq!(body["user"]["task_group"], 1, "{body}");
        // The token is shown once: the list has no token, the store no copy.
        let (_, list) = api.get("/v1/users", &admin).await;
        assert!(!list.to_string().contains(&alice), "{list}");
        let db = std::fs::read(dir.path().join("muster.db")).unwrap();
        assert!(
            !db.windows(alice.len()).any(|w| w == alice.as_bytes()),
            "the token is not in the store"
        );
        let (_, me) = api.get("/v1/whoami", &alice).await;
        assert_eq!(me["name"], "alice");
        // Submitting with a key: a retry answers the same job.
        let submit = |key: &'static str| {
            let request = api
                .http
                .post(api.url("/v1/jobs"))
                .bearer_auth(&alice)
                .header("idempotency-key", key)
                .json(&json!({ "spec": spec("once", "default", 1) }));
            async move {
                let response = request.send().await.expect("sent");
                let status = response.status();
                let body: Value = response.json().await.expect("JSON");
                (status, body)
            }
        };
        let (status, first) = submit("k-1").await;
        assert_eq!(status, StatusCode::CREATED, "{first}");
        let (status, again) = submit("k-1").await;
        assert_eq!(status, StatusCode::OK, "{again}");
        assert_eq!(again["id"], first["id"]);
        let (status, other) = submit("k-2").await;
        assert_eq!(status, StatusCode::CREATED);
        assert_ne!(other["id"], first["id"]);
        let (status, _) = api
            .call(
                reqwest::Method::POST,
                "/v1/jobs",
                Some(&alice),
                Some(json!({ "spec": spec("x", "team-z", 1) })),
            )
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "not a member of team-z");
        // Impersonation is the admin's only, and audited.
        let response = api
            .http
            .post(api.url("/v1/jobs"))
            .bearer_auth(&alice)
            .header("x-muster-user", "bob")
            .json(&json!({ "spec": spec("x", "default", 1) }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        let response = api
            .http
            .post(api.url("/v1/jobs"))
            .bearer_auth(&admin)
            .header("x-muster-user", "bob")
            .json(&json!({ "spec": spec("for-bob", "default", 1) }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        // A restart keeps the keys and the users, with their numbers.
        server.shutdown().await;
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let (_, list) = api.get("/v1/users", &admin).await;
        assert_eq!(list["users"][0]["name"], "alice", "{list}");
        assert_eq!(list["users"][0]["task_group"], 1, "{list}");
        let (status, after) = {
            let response = api
                .http
                .post(api.url("/v1/jobs"))
                .bearer_auth(&alice)
                .header("idempotency-key", "k-1")
                .json(&json!({ "spec": spec("once", "default", 1) }))
                .send()
                .await
                .unwrap();
            (response.status(), response.json::<Value>().await.unwrap())
        };
        assert_eq!(status, StatusCode::OK, "{after}");
        assert_eq!(after["id"], first["id"]);
        let (_, list) = api.get("/v1/jobs?user=alice", &admin).await;
        let names: Vec<&str> = list["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|job| job["name"].as_str())
            .collect();
        assert_eq!(
            names.iter().filter(|name| **name == "once").count(),
            2,
            "{names:?}"
        );
        // The audit log: who did what, allowed or not; newest first.
        let mut entries = Value::Null;
        for _ in 0..50 {
            let (status, body) = api.get("/v1/audit?since=1h", &admin).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            if body["entries"].as_array().is_some_and(|e| e.len() >= 7) {
                entries = body["entries"].clone();
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let entries = entries.as_array().expect("entries").clone();
        let find = |who: &str, allowed: bool, status: u64| {
            entries.iter().any(|e| {
                e["who"] == who
                    && e["action"] == "POST /v1/jobs"
                    && e["allowed"] == allowed
                    && e["status"] == status
            })
        };
        assert!(find("alice", true, 201), "{entries:#?}");
        assert!(find("alice", false, 403), "{entries:#?}");
        assert!(find("admin (as bob)", true, 201), "{entries:#?}");
        assert!(
            entries
                .iter()
                .any(|e| e["action"] == "POST /v1/users" && e["who"] == "admin"),
            "{entries:#?}"
        );
        assert!(
            entries.iter().all(|e| e["origin"] == "127.0.0.1"),
            "{entries:#?}"
        );
        let (_, mine) = api.get("/v1/audit?user=alice", &admin).await;
        assert!(
            mine["entries"]
                .as_array()
                .unwrap()
                .iter()
                .all(|e| e["who"] == "alice")
        );
        // Users go: the token stops working at once; rotation replaces it.
        let (status, rotated) = api
            .post("/v1/users/alice/rotate-token", &admin, json!({}))
            .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            api.get("/v1/whoami", &alice).await.0,
            StatusCode::UNAUTHORIZED
        );
        let fresh = rotated["token"].as_str().unwrap().to_string();
        assert_eq!(api.get("/v1/whoami", &fresh).await.0, StatusCode::OK);
        let (status, _) = api
            .call(
                reqwest::Method::DELETE,
                "/v1/users/alice",
                Some(&admin),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            api.get("/v1/whoami", &fresh).await.0,
            StatusCode::UNAUTHORIZED
        );
        // Her number is never another's: two users made at once, after
        // her removal, get two new ones.
        let make = |name: &'static str| {
            api.post("/v1/users", &admin, json!({ "name": name, "role": "user" }))
        };
        let ((_, carol), (_, dave)) = tokio::join!(make("carol"), make("dave"));
        let mut numbers = [&carol, &dave].map(|b| b["user"]["task_group"].as_u64());
        numbers.sort_unstable();
        assert_eq!(numbers, [Some(2), Some(3)], "{carol} {dave}");
        // A flood of requests without a token cannot fill the store: their
        // refusals are logged at a bounded rate and the rest counted.
        for _ in 0..300 {
            let (status, _) = api
                .call(reqwest::Method::POST, "/v1/jobs", None, Some(json!({})))
                .await;
            assert_eq!(status, StatusCode::UNAUTHORIZED);
        }
        // Entries ride with the next commit or the flush within a second.
        let mut anonymous = 0;
        for _ in 0..40 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (_, body) = api.get("/v1/audit?limit=10000", &admin).await;
            anonymous = body["entries"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["who"] == "(no token)")
                .count();
            if anonymous >= 100 {
                break;
            }
        }
        assert!((100..250).contains(&anonymous), "{anonymous} logged");
        let (_, text) = api.get("/metrics", &admin).await;
        let dropped: f64 = text
            .as_str()
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("muster_audit_dropped_total "))
            .expect("the counter")
            .parse()
            .unwrap();
        assert!(dropped >= 50.0, "{dropped}");
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_reaches_only_its_task_and_is_never_shown() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let value = "s3cret-VALUE-7f1e2d";
        let (status, body) = api
            .call(
                reqwest::Method::PUT,
                "/v1/secrets/hf",
                Some(&admin),
                Some(json!({ "value": value })),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(!body.to_string().contains(value));
        let (status, _) = api
            .call(
                reqwest::Method::PUT,
                "/v1/secrets/team-only",
                Some(&admin),
                Some(json!({ "value": "other", "queue": "team-a" })),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        // A job may name only secrets of its queue (or every queue's).
        let mut wrong = spec("x", "team-b", 1);
        wrong["env"] = json!({ "T": { "secret": "team-only" } });
        let (status, body) = api.post("/v1/jobs", &admin, json!({ "spec": wrong })).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(
            error_of(&body).message.contains("no secret \"team-only\""),
            "{body}"
        );
        let one = api.register(server.join_token(), "gpu-1").await;
        let two = api.register(server.join_token(), "gpu-2").await;
        let mut job = spec("uses-secret", "default", 4);
        job["env"] = json!({ "HF_TOKEN": { "secret": "hf" }, "PLAIN": "1" });
        let id = api.submit(&admin, job).await;
        // The node that runs it gets the value in the task's environment;
        // the other node gets nothing.
        let mut found = None;
        for _ in 0..100 {
            for (name, node) in [("gpu-1", &one), ("gpu-2", &two)] {
                let (status, body) = api
                    .post(
                        &format!("/v1/agents/{name}/heartbeat"),
                        &node.node_token,
                        heartbeat_body(node.epoch, Vec::new(), 0, 0),
                    )
                    .await;
                assert_eq!(status, StatusCode::OK);
                let response: HeartbeatResponse = serde_json::from_value(body).unwrap();
                if !response.desired.is_empty() {
                    assert!(found.is_none(), "one node runs the task");
                    found = Some(response.desired);
                }
            }
            if found.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let desired = found.expect("the task placed");
        assert_eq!(desired[0].job, id);
        assert_eq!(
            desired[0].env.get("HF_TOKEN").map(String::as_str),
            Some(value)
        );
        assert_eq!(desired[0].env.get("PLAIN").map(String::as_str), Some("1"));
        // Nothing a person or a scraper can read holds it.
        let metrics = server.metrics_token().to_string();
        let mut seen = Vec::new();
        for (path, token) in [
            (format!("/v1/jobs/{id}"), admin.as_str()),
            ("/v1/jobs".to_string(), admin.as_str()),
            ("/v1/secrets".to_string(), admin.as_str()),
            ("/v1/audit".to_string(), admin.as_str()),
            ("/v1/nodes".to_string(), admin.as_str()),
            ("/metrics".to_string(), metrics.as_str()),
            ("/".to_string(), admin.as_str()),
            ("/ui/jobs".to_string(), admin.as_str()),
            (format!("/ui/jobs/{id}"), admin.as_str()),
        ] {
            let (_, body) = api.get(&path, token).await;
            if body.to_string().contains(value) {
                seen.push(path);
            }
        }
        assert!(seen.is_empty(), "the secret is shown by {seen:?}");
        server.shutdown().await;
        // Nor the store (sealed), which keeps it across a restart.
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let path = entry.unwrap().path();
            if path.is_file() {
                let bytes = std::fs::read(&path).unwrap();
                assert!(
                    !bytes.windows(value.len()).any(|w| w == value.as_bytes()),
                    "{} holds the secret",
                    path.display()
                );
            }
        }
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let (_, list) = api.get("/v1/secrets", &admin).await;
        assert_eq!(list["secrets"].as_array().map(Vec::len), Some(2), "{list}");
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_past_its_rate_gets_429_with_retry_after_and_agents_are_not_limited() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        config.rate_limit = Some(muster_server::RateLimit {
            per_second: 1.0,
            burst: 3.0,
        });
        let server = Server::start(config).await.unwrap();
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let registered = api.register(server.join_token(), "gpu-1").await;
        let mut statuses = Vec::new();
        for _ in 0..5 {
            statuses.push(api.get("/v1/nodes", &admin).await.0.as_u16());
        }
        assert_eq!(&statuses[..3], &[200, 200, 200]);
        assert_eq!(statuses[3], 429, "{statuses:?}");
        let response = api
            .http
            .get(api.url("/v1/jobs"))
            .bearer_auth(&admin)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        let retry: u64 = response.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=2).contains(&retry), "{retry}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["code"], "resource_exhausted");
        // Another token has its own bucket; a node's heartbeats are not
        // limited.
        assert_eq!(
            api.get("/metrics", server.metrics_token()).await.0,
            StatusCode::OK
        );
        for _ in 0..6 {
            let (status, _) = api
                .post(
                    "/v1/agents/gpu-1/heartbeat",
                    &registered.node_token,
                    heartbeat_body(registered.epoch, Vec::new(), 0, 0),
                )
                .await;
            assert_eq!(status, StatusCode::OK);
        }
        server.shutdown().await;
    })
    .await;
}

/// A job with an image goes only to a node whose agent reported a Docker
/// engine (the `docker` entry of its software stack), and carries the image
/// to it; with no such node it is refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_with_an_image_goes_to_a_node_that_runs_containers() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let join = server.join_token().to_string();
        let plain = api.register(&join, "plain").await;
        let mut boxed = spec("boxed", "default", 1);
        boxed["image"] = json!("registry.internal/team/trainer:1.2");
        let (status, body) = api
            .post("/v1/jobs", &admin, json!({ "spec": boxed.clone() }))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| m.contains("0 of the 1 registered nodes can run containers")),
            "{body}"
        );
        let mut request = register_request("docker");
        request
            .stack
            .insert("docker".to_string(), "20.10.24".to_string());
        let (status, body) = api
            .post(
                "/v1/agents/register",
                &join,
                serde_json::to_value(request).expect("a request"),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let docker: RegisterResponse = serde_json::from_value(body).expect("registered");
        // A pull secret that does not exist is refused; one that does goes
        // to the node with the task, apart from its environment.
        boxed["image_pull_secret"] = json!("regcred");
        let (status, body) = api
            .post("/v1/jobs", &admin, json!({ "spec": boxed.clone() }))
            .await;
        assert!(status.is_client_error(), "{status} {body}");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| m.contains("regcred")),
            "{body}"
        );
        let (status, body) = api
            .call(
                reqwest::Method::PUT,
                "/v1/secrets/regcred",
                Some(&admin),
                Some(json!({"value": "robot:t0ken"})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let id = api.submit(&admin, boxed).await;
        let placed: HeartbeatResponse = loop {
            let (status, body) = api
                .post(
                    "/v1/agents/docker/heartbeat",
                    &docker.node_token,
                    heartbeat_body(docker.epoch, Vec::new(), 0, 0),
                )
                .await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let answer: HeartbeatResponse = serde_json::from_value(body).expect("an answer");
            if !answer.desired.is_empty() {
                break answer;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(placed.desired[0].job, id);
        assert_eq!(
            placed.desired[0].image.as_deref(),
            Some("registry.internal/team/trainer:1.2")
        );
        assert_eq!(
            placed.desired[0].registry_auth.as_deref(),
            Some("robot:t0ken")
        );
        assert!(
            !placed.desired[0].env.values().any(|v| v.contains("t0ken")),
            "the pull secret is not in the task's environment"
        );
        // Nor in what users see of the job.
        let (_, job) = api.get(&format!("/v1/jobs/{id}"), &admin).await;
        assert!(!job.to_string().contains("t0ken"), "{job}");

        // Host paths: only those the job's pool allows.
        let mut mounted = spec("mounted", "default", 0);
        mounted["image"] = json!("registry.internal/team/trainer:1.2");
        mounted["mounts"] = json!([
            {"source": "/datasets/imagenet", "target": "/data", "read_only": true}
        ]);
        let (status, body) = api
            .post("/v1/jobs", &admin, json!({ "spec": mounted.clone() }))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| m.contains("names its pool")),
            "{body}"
        );
        mounted["pool"] = json!("default");
        let (status, body) = api
            .post("/v1/jobs", &admin, json!({ "spec": mounted.clone() }))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(
            body["message"].as_str().is_some_and(|m| m.contains(
                "pool default does not allow mounting /datasets/imagenet (it allows none)"
            )),
            "{body}"
        );
        let (status, body) = api
            .call(
                reqwest::Method::PUT,
                "/v1/pools/default/policy",
                Some(&admin),
                Some(
                    json!({"stack_policy": "report", "allowed_mounts": ["/datasets", "/scratch"]}),
                ),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.to_string().contains("/scratch"), "{body}");
        // A path beside an allowed one is not under it.
        let mut beside = mounted.clone();
        beside["mounts"] = json!([{"source": "/datasets-private", "target": "/data"}]);
        let (status, body) = api
            .post("/v1/jobs", &admin, json!({ "spec": beside }))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        let mounted_id = api.submit(&admin, mounted).await;
        let carried = loop {
            let (status, body) = api
                .post(
                    "/v1/agents/docker/heartbeat",
                    &docker.node_token,
                    heartbeat_body(docker.epoch, Vec::new(), 0, 0),
                )
                .await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let answer: HeartbeatResponse = serde_json::from_value(body).expect("an answer");
            if let Some(task) = answer.desired.iter().find(|task| task.job == mounted_id) {
                break task.clone();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(carried.mounts.len(), 1);
        assert_eq!(carried.mounts[0].source, "/datasets/imagenet");
        assert_eq!(carried.mounts[0].read_only, Some(true));
        // The plain node gets nothing.
        let (status, body) = api
            .post(
                "/v1/agents/plain/heartbeat",
                &plain.node_token,
                heartbeat_body(plain.epoch, Vec::new(), 0, 0),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(
            body["desired"].as_array().is_some_and(Vec::is_empty),
            "{body}"
        );
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_tokens_expire_run_out_are_revoked_and_nodes_claim_only_what_they_may() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        // The first start's token lasts a millisecond here.
        config.join_token_ttl_ms = Some(1);
        let server = Server::start(config).await.expect("server starts");
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let register = |token: String, request: RegisterRequest| {
            let api = &api;
            async move {
                api.post(
                    "/v1/agents/register",
                    &token,
                    serde_json::to_value(request).expect("a request"),
                )
                .await
            }
        };
        let refused = |(status, body): (StatusCode, Value), code: StatusCode, says: &str| {
            assert_eq!(status, code, "{body}");
            let message = error_of(&body).message;
            assert!(message.contains(says), "{message}");
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        refused(
            register(server.join_token().to_string(), register_request("late")).await,
            StatusCode::FORBIDDEN,
            "expired",
        );
        let create = |body: Value| {
            let (api, admin) = (&api, admin.clone());
            async move {
                let (status, body) = api.post("/v1/join-tokens", &admin, body).await;
                assert_eq!(status, StatusCode::CREATED, "{body}");
                (
                    body["token"].as_str().expect("a token").to_string(),
                    body["join_token"]["id"]
                        .as_str()
                        .expect("an id")
                        .to_string(),
                )
            }
        };
        // Counts past what the schema allows are refused, as it says.
        // A body that is no object (serde would read `[null, null]` as the
        // struct's fields in order) is refused too.
        for bad in [
            json!({ "uses": 1_000_001 }),
            json!({ "ttl_ms": 0 }),
            json!([null, null]),
        ] {
            let (status, body) = api.post("/v1/join-tokens", &admin, bad.clone()).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
        }
        // One use: the second node is refused, and a burst cannot pass it.
        let (once, once_id) = create(json!({ "uses": 1, "ttl_ms": 3_600_000 })).await;
        let (first, second) = tokio::join!(
            register(once.clone(), register_request("n-1")),
            register(once.clone(), register_request("n-2")),
        );
        let statuses = [first.0, second.0];
        assert_eq!(
            statuses.iter().filter(|s| **s == StatusCode::OK).count(),
            1,
            "{first:?} {second:?}"
        );
        let (loser, joined) = if first.0 == StatusCode::OK {
            (second, "n-1")
        } else {
            (first, "n-2")
        };
        refused(loser, StatusCode::FORBIDDEN, "used up (1 of 1");
        // Expired, revoked.
        let (short, _) = create(json!({ "ttl_ms": 1 })).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        refused(
            register(short, register_request("n-3")).await,
            StatusCode::FORBIDDEN,
            "expired",
        );
        let (revoked, revoked_id) = create(json!({})).await;
        let (status, _) = api
            .post(
                &format!("/v1/join-tokens/{revoked_id}/revoke"),
                &admin,
                json!({}),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        refused(
            register(revoked, register_request("n-3")).await,
            StatusCode::FORBIDDEN,
            "revoked",
        );
        // A pool's token puts its nodes there and admits no other pool.
        let (train, _) = create(json!({ "pool": "train" })).await;
        let (status, body) = register(train.clone(), register_request("n-4")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let (_, node) = api.get("/v1/nodes/n-4", &admin).await;
        assert_eq!(node["pool"], "train", "{node}");
        let mut elsewhere = register_request("n-5");
        elsewhere.pool = Some("infer".to_string());
        refused(
            register(train.clone(), elsewhere).await,
            StatusCode::FORBIDDEN,
            "pool train",
        );
        // Claims: another node's GPUs, too many GPUs or too much memory, a
        // link-local address.
        let mut copy = register_request("n-6");
        copy.gpus = register_request(joined).gpus;
        refused(
            register(train.clone(), copy).await,
            StatusCode::CONFLICT,
            &format!("which node {joined} holds"),
        );
        let mut thief = register_request("thief");
        thief.gpus = (0..64)
            .map(|index| GpuView {
                index,
                uuid: format!("GPU-thief-{index}"),
                model: "H100-80GB".to_string(),
                memory_mib: 81_920,
                nvlink_domain: 0,
            })
            .collect();
        thief.memory_mib = 100 << 20;
        thief.address = "169.254.169.254".to_string();
        let (status, body) = register(train.clone(), thief).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let message = error_of(&body).message;
        for says in ["64 GPUs", "--max-node-memory", "link-local"] {
            assert!(message.contains(says), "{says}: {message}");
        }
        let (_, body) = api.get("/v1/nodes/thief", &admin).await;
        assert_eq!(error_of(&body).code, ErrorCode::NotFound);
        // Listed with their states, never a token; kept across a restart.
        let (status, list) = api.get("/v1/join-tokens", &admin).await;
        assert_eq!(status, StatusCode::OK);
        let text = list.to_string();
        assert!(!text.contains(&once) && !text.contains(&train), "{text}");
        let state_of = |list: &Value, id: &str| {
            list["join_tokens"]
                .as_array()
                .expect("tokens")
                .iter()
                .find(|token| token["id"] == id)
                .map(|token| token["state"].as_str().unwrap_or_default().to_string())
        };
        assert_eq!(state_of(&list, &once_id).as_deref(), Some("used up"));
        assert_eq!(state_of(&list, &revoked_id).as_deref(), Some("revoked"));
        // Only an admin makes them.
        let (status, _) = api.post("/v1/join-tokens", &train, json!({})).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        drop(server);
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let (_, list) = api.get("/v1/join-tokens", &admin).await;
        assert_eq!(state_of(&list, &once_id).as_deref(), Some("used up"));
        assert_eq!(state_of(&list, &revoked_id).as_deref(), Some("revoked"));
        let (status, body) = api
            .post(
                "/v1/agents/register",
                &once,
                serde_json::to_value(register_request("n-7")).expect("a request"),
            )
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_arrays_stops_at_the_user_s_cap_exactly_and_queues_keep_their_classes() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let (status, body) = api
            .post(
                "/v1/users",
                &admin,
                json!({ "name": "alice", "role": "user", "queues": ["default", "team-a"] }),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        let alice = body["token"].as_str().expect("a token").to_string();
        let (status, body) = api
            .post(
                "/v1/users/alice/limits",
                &admin,
                json!({ "max_pending": 50 }),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["max_pending"], 50);
        // Twenty arrays of five at once: exactly ten pass (no node: all
        // stay pending).
        let array = |name: &str| {
            json!({ "spec": { "name": name, "gpus": 1, "command": ["true"], "array": "0-4" },
                    "allow_pending": true })
        };
        let submissions = (0..20).map(|i| {
            let (api, alice, spec) = (&api, alice.clone(), array(&format!("burst-{i}")));
            async move { api.post("/v1/jobs", &alice, spec).await }
        });
        let answers = futures_util::future::join_all(submissions).await;
        let accepted = answers
            .iter()
            .filter(|(status, _)| *status == StatusCode::CREATED)
            .count();
        assert_eq!(accepted, 10, "{answers:?}");
        for (status, body) in answers.iter().filter(|(s, _)| *s != StatusCode::CREATED) {
            assert_eq!(*status, StatusCode::FORBIDDEN, "{body}");
            let message = error_of(body).message;
            assert!(
                message.contains("at most 50") && message.contains("--max-pending"),
                "{message}"
            );
        }
        let pending = api.all_jobs(&admin, "state=pending", 100).await;
        assert_eq!(pending.len(), 50);
        // One more job does not fit either; once some are cancelled, it does.
        let one = json!({ "spec": spec("one", "default", 1), "allow_pending": true });
        let (status, _) = api.post("/v1/jobs", &alice, one.clone()).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        let first = pending.last().expect("a job").id;
        let (status, _) = api
            .post(&format!("/v1/jobs/{first}/cancel"), &alice, json!({}))
            .await;
        assert_eq!(status, StatusCode::OK);
        let (status, body) = api.post("/v1/jobs", &alice, one).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");

        // Priority classes and preemptibility, queue by queue: a user's
        // `critical` is refused (not lowered) where the queue allows up to
        // `normal` (the default) or `high`; an admin's is not.
        let critical = |queue: &str| {
            json!({ "spec": { "name": "urgent", "queue": queue, "gpus": 1, "command": ["true"],
                              "priority_class": "critical" }, "allow_pending": true })
        };
        let (status, body) = api
            .call(
                reqwest::Method::PUT,
                "/v1/queues/team-a",
                Some(&admin),
                Some(json!({ "guaranteed_gpus": 0.0, "weight": 1,
                             "max_priority_class": "high", "max_pending": 3 })),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["max_priority_class"], "high");
        let (status, _) = api.post("/v1/users/alice/limits", &admin, json!({})).await;
        assert_eq!(status, StatusCode::OK);
        let (status, body) = api.post("/v1/jobs", &alice, critical("team-a")).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        let message = error_of(&body).message;
        assert!(
            message.contains("priority_class critical") && message.contains("(high)"),
            "{message}"
        );
        let (status, body) = api.post("/v1/jobs", &alice, critical("default")).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert!(error_of(&body).message.contains("(normal)"));
        let (status, body) = api.post("/v1/jobs", &admin, critical("team-a")).await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "an admin is not limited: {body}"
        );
        let steady = json!({ "spec": { "name": "steady", "queue": "team-a", "gpus": 1,
                                       "command": ["true"], "preemptible": false },
                             "allow_pending": true });
        let (status, body) = api.post("/v1/jobs", &alice, steady).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert!(error_of(&body).message.contains("non-preemptible"));
        // The queue's own cap: three pending (the admin's one counts).
        let small = json!({ "spec": { "name": "small", "queue": "team-a", "gpus": 1,
                                      "command": ["true"], "priority_class": "high" },
                            "allow_pending": true });
        for _ in 0..2 {
            let (status, body) = api.post("/v1/jobs", &alice, small.clone()).await;
            assert_eq!(status, StatusCode::CREATED, "{body}");
        }
        let (status, body) = api.post("/v1/jobs", &alice, small).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert!(
            error_of(&body).message.contains("queue team-a has 3"),
            "{body}"
        );
        // Kept across a restart.
        drop(server);
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let (_, queues) = api.get("/v1/queues", &admin).await;
        let team = queues["queues"]
            .as_array()
            .expect("queues")
            .iter()
            .find(|q| q["name"] == "team-a")
            .cloned()
            .expect("team-a");
        assert_eq!(team["max_pending"], 3);
        assert_eq!(team["max_priority_class"], "high");
        let (status, _) = api.post("/v1/jobs", &alice, critical("team-a")).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
    })
    .await;
}

/// A backend that answers every request with its name and the request's
/// head as it arrived (what a replica would see).
async fn echo_backend(name: &'static str) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let address = listener.local_addr().expect("an address");
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buffer = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65_536 {
                    match socket.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buffer[..n]),
                    }
                }
                let body = format!("{name}\n{}", String::from_utf8_lossy(&head));
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(reply.as_bytes()).await;
            });
        }
    });
    address
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_keeps_muster_s_credentials_home_and_routes_hosts_only_under_its_domain() {
    bounded(async {
        let web = echo_backend("web").await;
        let squatter = echo_backend("localhost").await;
        let guarded = echo_backend("guarded").await;
        let key_hash: String = {
            use sha2::Digest;
            sha2::Sha256::digest(b"its-key")
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        };
        let endpoint = |address: std::net::SocketAddr, job: u64| muster_api::protocol::Endpoint {
            job,
            revision: 1,
            address: address.to_string(),
        };
        let table = muster_api::protocol::EndpointTable {
            instance: 0,
            version: 1,
            auth: std::collections::BTreeMap::from([("guarded".to_string(), key_hash)]),
            services: std::collections::BTreeMap::from([
                ("guarded".to_string(), vec![endpoint(guarded, 3)]),
                ("web".to_string(), vec![endpoint(web, 1)]),
                // A tenant's service named like the gateway's host.
                ("localhost".to_string(), vec![endpoint(squatter, 2)]),
            ]),
        };
        let start = |domain: Option<&str>| {
            muster_server::gateway::start(
                muster_server::gateway::GatewayConfig {
                    listen: "127.0.0.1:0".parse().unwrap(),
                    upstream_timeout: Duration::from_secs(10),
                    hold: Duration::ZERO,
                    domain: domain.map(str::to_string),
                },
                muster_server::gateway::Endpoints::Fixed(table.clone()),
            )
        };
        muster_api::tls::provider();
        let http = reqwest::Client::new();
        let token = "ab".repeat(32);
        let gateway = start(None).await.expect("a gateway");
        let seen = http
            .get(format!("http://{}/web/hello", gateway.addr))
            .header("host", format!("localhost:{}", gateway.addr.port()))
            .header(
                "cookie",
                format!("muster_session={token}; muster_token={token}; theme=dark"),
            )
            .header("authorization", format!("Bearer {token}"))
            .send()
            .await
            .expect("an answer")
            .text()
            .await
            .expect("a body")
            .to_lowercase();
        assert!(
            seen.starts_with("web\n"),
            "a path route went elsewhere: {seen}"
        );
        assert!(seen.contains("get /hello"), "{seen}");
        assert!(seen.contains("cookie: theme=dark"), "{seen}");
        assert!(
            !seen.contains(&token),
            "a muster token reached the replica: {seen}"
        );
        assert!(!seen.contains("authorization"), "{seen}");
        // A service's own credentials pass.
        let seen = http
            .get(format!("http://{}/web/", gateway.addr))
            .header("authorization", "Bearer its-own-api-key")
            .send()
            .await
            .expect("an answer")
            .text()
            .await
            .expect("a body");
        assert!(seen.contains("Bearer its-own-api-key"), "{seen}");
        // A service with a bearer secret: checked at the gateway, and the
        // key goes no further.
        let status = http
            .get(format!("http://{}/guarded/", gateway.addr))
            .send()
            .await
            .expect("an answer")
            .status();
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        let seen = http
            .get(format!("http://{}/guarded/", gateway.addr))
            .header("authorization", "Bearer its-key")
            .send()
            .await
            .expect("an answer")
            .text()
            .await
            .expect("a body")
            .to_lowercase();
        assert!(seen.starts_with("guarded\n"), "{seen}");
        assert!(
            !seen.contains("its-key"),
            "the key reached the replica: {seen}"
        );
        gateway.stop().await;
        // Under a domain, hosts route; anything else goes by path.
        let gateway = start(Some("apps.example.test")).await.expect("a gateway");
        let via_host = http
            .get(format!("http://{}/hello", gateway.addr))
            .header("host", "web.apps.example.test")
            .send()
            .await
            .expect("an answer")
            .text()
            .await
            .expect("a body");
        assert!(
            via_host.starts_with("web\n") && via_host.contains("GET /hello"),
            "{via_host}"
        );
        let other_host = http
            .get(format!("http://{}/web/x", gateway.addr))
            .header("host", "localhost.elsewhere.test")
            .send()
            .await
            .expect("an answer")
            .text()
            .await
            .expect("a body");
        assert!(other_host.starts_with("web\n"), "{other_host}");
        gateway.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_s_services_and_dev_environments_are_bounded_and_staff_s_are_not() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        config.max_services_per_user = Some(2);
        config.max_dev_per_user = Some(1);
        let server = Server::start(config).await.expect("server starts");
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let alice = add_user(&api, &admin, "alice").await;
        let service = |name: &str| {
            json!({ "spec": { "kind": "service", "name": name, "replicas": 1, "gpus": 0,
                              "command": ["sleep", "600"] } })
        };
        for name in ["a1", "a2"] {
            let (status, body) = api.post("/v1/services", &alice, service(name)).await;
            assert_eq!(status, StatusCode::CREATED, "{body}");
        }
        let (status, body) = api.post("/v1/services", &alice, service("a3")).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        let message = error_of(&body).message;
        assert!(
            message.contains("alice has 2 service(s)") && message.contains("at most 2"),
            "{message}"
        );
        let (status, body) = api.post("/v1/services", &admin, service("ops")).await;
        assert_eq!(status, StatusCode::CREATED, "an admin is not limited: {body}");
        // Dev environments: one at a time.
        let dev = |name: &str| {
            json!({ "spec": { "name": name, "gpus": 0, "command": [muster_model::DEV_SESSION_COMMAND] },
                    "allow_pending": true })
        };
        let (status, body) = api.post("/v1/jobs", &alice, dev("box-1")).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        let first = body["id"].as_u64().expect("an id");
        let (status, body) = api.post("/v1/jobs", &alice, dev("box-2")).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert!(
            error_of(&body).message.contains("1 dev environment(s)"),
            "{body}"
        );
        let (status, _) = api
            .post(&format!("/v1/jobs/{first}/cancel"), &alice, json!({}))
            .await;
        assert_eq!(status, StatusCode::OK);
        let (status, body) = api.post("/v1/jobs", &alice, dev("box-2")).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_with_a_bearer_secret_is_reached_only_with_its_token() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let service = |secret: &str| {
            json!({ "spec": { "kind": "service", "name": "private", "replicas": 1, "gpus": 0,
                              "command": ["sleep", "600"], "auth": {"bearer_secret": secret} } })
        };
        // A secret that does not exist is refused with the fix.
        let (status, body) = api.post("/v1/services", &admin, service("api-key")).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(
            error_of(&body)
                .message
                .contains("muster secrets set api-key"),
            "{body}"
        );
        let key = "the-service-s-own-key";
        let (status, body) = api
            .call(
                reqwest::Method::PUT,
                "/v1/secrets/api-key",
                Some(&admin),
                Some(json!({ "value": key })),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let (status, body) = api.post("/v1/services", &admin, service("api-key")).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        // The gateway's table carries the key's hash, never the key.
        let hash: String = {
            use sha2::Digest;
            sha2::Sha256::digest(key.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        };
        let mut table = Value::Null;
        for _ in 0..100 {
            table = api.get("/v1/endpoints", &admin).await.1;
            if table["auth"]["private"] == hash.as_str() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(table["auth"]["private"], hash.as_str(), "{table}");
        assert!(!table.to_string().contains(key), "{table}");
        // A gateway that follows the server: no token, a wrong one, a
        // muster token: 401; the key passes (then waits for a replica,
        // which never runs here: no node).
        let follower = muster_api::client::Client::new(&api.base, &admin);
        let gateway = muster_server::gateway::start(
            muster_server::gateway::GatewayConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                upstream_timeout: Duration::from_secs(5),
                hold: Duration::ZERO,
                domain: None,
            },
            muster_server::gateway::Endpoints::Server(follower),
        )
        .await
        .expect("a gateway");
        let http = reqwest::Client::new();
        let url = format!("http://{}/private/", gateway.addr);
        let mut answer = None;
        for _ in 0..100 {
            let response = http.get(&url).send().await.expect("an answer");
            if response.status() != StatusCode::NOT_FOUND {
                answer = Some(response);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let answer = answer.expect("the gateway learns the service");
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(answer.headers()["www-authenticate"], "Bearer");
        for wrong in ["Bearer nope", &format!("Bearer {admin}"), key] {
            let status = http
                .get(&url)
                .header("authorization", wrong)
                .send()
                .await
                .expect("an answer")
                .status();
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{wrong}");
        }
        let status = http
            .get(&url)
            .header("authorization", format!("Bearer {key}"))
            .send()
            .await
            .expect("an answer")
            .status();
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "past the check, no replica yet"
        );
        gateway.stop().await;
        server.shutdown().await;
    })
    .await;
}

/// Adds an ordinary user of queue `default`: its token.
async fn add_user(api: &Api, admin: &str, name: &str) -> String {
    let (status, body) = api
        .post(
            "/v1/users",
            admin,
            json!({ "name": name, "role": "user", "queues": ["default"] }),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    body["token"].as_str().expect("a token").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_defaults_a_user_has_20_services_and_4_dev_environments() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let server = start(dir.path()).await;
        let api = Api::new(&server);
        let admin = server.admin_token().to_string();
        let alice = add_user(&api, &admin, "alice").await;
        // The cap-th is refused, every one before it made.
        let expected = |index: usize, cap: usize| {
            if index < cap {
                StatusCode::CREATED
            } else {
                StatusCode::FORBIDDEN
            }
        };
        for index in 0..=20 {
            let spec = json!({ "spec": { "kind": "service", "name": format!("s{index}"),
                                         "replicas": 0, "gpus": 0, "command": ["true"] } });
            let (status, body) = api.post("/v1/services", &alice, spec).await;
            assert_eq!(status, expected(index, 20), "service {index}: {body}");
        }
        for index in 0..=4 {
            let spec = json!({ "spec": { "name": format!("box-{index}"), "gpus": 0,
                                         "command": [muster_model::DEV_SESSION_COMMAND],
                                         "preemptible": false },
                               "allow_pending": true });
            let (status, body) = api.post("/v1/jobs", &alice, spec).await;
            assert_eq!(
                status,
                expected(index, 4),
                "dev environment {index}: {body}"
            );
        }
        server.shutdown().await;
    })
    .await;
}

/// A leader whose own lease may have lapsed (woken from a pause longer than
/// it) renews no node's lease: its heartbeat answer is a 503 that sends the
/// agent to the next server, until the leader has renewed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_may_have_lapsed_answers_no_heartbeat() {
    bounded(async {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        let lease = Duration::from_secs(2);
        let clock = muster_server::ha::LeaseClock::new(lease, std::time::Instant::now());
        config.leadership = Some(clock.clone());
        let server = Server::start(config).await.expect("server starts");
        let api = Api::new(&server);
        let registered = api.register(server.join_token(), "gpu-1").await;
        let beat = heartbeat_body(registered.epoch, vec![], 0, 0);
        let send = || async {
            api.http
                .post(api.url("/v1/agents/gpu-1/heartbeat"))
                .bearer_auth(&registered.node_token)
                .json(&beat)
                .send()
                .await
                .expect("sent")
        };
        clock.renewed(std::time::Instant::now());
        assert_eq!(send().await.status(), StatusCode::OK, "a current lease");
        // As after a pause: the last renewal is more than a lease ago.
        tokio::time::sleep(lease + Duration::from_millis(500)).await;
        let refused = send().await;
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            refused
                .headers()
                .contains_key(muster_api::protocol::NO_LONGER_LEADS_HEADER)
        );
        let body = refused.text().await.expect("a body");
        assert!(body.contains("no longer leads"), "{body}");
        clock.renewed(std::time::Instant::now());
        assert_eq!(send().await.status(), StatusCode::OK, "renewed again");
        server.shutdown().await;
    })
    .await;
}
