//! Services end to end: a real server, three agents, replicas of a small
//! Python HTTP server, checks run by their agents, replicas replaced, a
//! rolling update, a rollout stopped by a failing readiness check, a
//! rollback and a delete. Loopback only; every wait is bounded.

use std::time::{Duration, Instant};

mod common;

use common::cluster::{Cluster, runtime, wait_for_nodes};
use common::wait_until;
use muster_api::client::Client;
use muster_api::protocol::ServiceView;

/// Serves `VERSION` on every path, on `$PORT`; `/healthz` answers 500 when
/// `FAIL=1`.
const SERVER: &str = r#"
import http.server, os, socketserver
version = os.environ.get("VERSION", "1")
fail = os.environ.get("FAIL") == "1"
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        code = 500 if fail and self.path == "/healthz" else 200
        body = (version + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
Server(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
"#;

pub fn spec(version: &str, fail: bool) -> serde_json::Value {
    serde_json::json!({
        "kind": "service",
        "name": "web",
        "replicas": 3,
        "gpus": 0,
        "cpus": 0.5,
        "memory": "256MiB",
        "command": ["python3", "-c", SERVER],
        "env": {"VERSION": version, "FAIL": if fail { "1" } else { "0" }},
        "readiness": {"http": "/healthz", "period": 1, "timeout": 1, "failure_threshold": 1},
        "liveness": {"tcp": true, "period": 1, "failure_threshold": 2, "initial_delay": 3},
        "update": {"max_surge": 1, "max_unavailable": 0, "progress_deadline": 6},
        "restart": {"initial": 1, "max": 4},
        "drain": 1,
    })
}

fn service(rt: &tokio::runtime::Runtime, client: &Client) -> ServiceView {
    rt.block_on(client.service("web")).expect("the service")
}

/// The pids of the processes whose environment names job `job`.
/// The replica processes of job `job` of this cluster: its job id and this
/// cluster's master port for it in the environment (tests of one binary
/// run at once, each cluster numbering its jobs from 1, so the id alone
/// could name another test's replica).
fn pids_of_job(cluster: &Cluster, job: u64) -> Vec<i32> {
    let marker = format!("MUSTER_JOB_ID={job}\0");
    let port = format!("MUSTER_MASTER_PORT={}\0", cluster.master_port(job));
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let environ = std::fs::read(entry.path().join("environ")).ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let environ = String::from_utf8_lossy(&environ);
            (environ.contains(&marker)
                && environ.contains(&port)
                && String::from_utf8_lossy(&cmdline).starts_with("python3"))
            .then_some(pid)
        })
        .collect()
}

fn get(address: &str) -> Option<String> {
    let url = format!("http://{address}/");
    std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode().strip())",
            &url,
        ])
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_string())
}

#[test]
fn a_service_keeps_its_replicas_ready_rolls_out_and_rolls_back() {
    let cluster = Cluster::start("3s");
    let _agents: Vec<_> = (1..=3)
        .map(|i| cluster.agent_with(&format!("node-{i}"), &cluster.url(), "1xH100-80GB", &[]))
        .collect();
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 3);

    // Created: three replicas, one a node, all ready.
    let created = rt
        .block_on(client.create_service(spec("1", false)))
        .expect("created");
    assert_eq!(created.revision, 1);
    wait_until("three ready replicas", Duration::from_secs(30), || {
        service(&rt, &client).ready == 3
    });
    let view = service(&rt, &client);
    let mut nodes: Vec<String> = view
        .replica_list
        .iter()
        .filter_map(|replica| replica.node.clone())
        .collect();
    nodes.sort();
    nodes.dedup();
    assert_eq!(nodes.len(), 3, "one replica a node: {view:#?}");
    let endpoints = rt
        .block_on(client.service_endpoints("web"))
        .expect("endpoints");
    assert_eq!(endpoints.endpoints.len(), 3);
    for endpoint in &endpoints.endpoints {
        assert_eq!(get(&endpoint.address).as_deref(), Some("1"), "{endpoint:?}");
    }

    // A replica's process killed: a new replica runs within 5 s.
    let victim = view.replica_list[0].job;
    let pids = pids_of_job(&cluster, victim);
    assert!(!pids.is_empty(), "the replica's process of job {victim}");
    let killed = Instant::now();
    for pid in pids {
        std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("kill");
    }
    wait_until(
        "a replacement replica running",
        Duration::from_secs(5),
        || {
            service(&rt, &client).replica_list.iter().any(|replica| {
                replica.job != victim
                    && !view.replica_list.iter().any(|old| old.job == replica.job)
                    && (replica.state == "starting" || replica.state == "ready")
            })
        },
    );
    let replaced_in = killed.elapsed();
    wait_until(
        "three ready replicas again",
        Duration::from_secs(20),
        || {
            let now = service(&rt, &client);
            now.ready == 3 && !now.replica_list.iter().any(|replica| replica.job == victim)
        },
    );
    eprintln!(
        "replacement running {:.2}s after the kill, ready {:.2}s after",
        replaced_in.as_secs_f64(),
        killed.elapsed().as_secs_f64()
    );
    assert!(
        service(&rt, &client)
            .last_failure
            .unwrap_or_default()
            .contains(&format!("replica job {victim}")),
        "the failure is told"
    );

    // A rolling update: never fewer than three ready, all on revision 2 at
    // the end, serving the new version.
    let updated = rt
        .block_on(client.update_service("web", spec("2", false)))
        .expect("updated");
    assert_eq!(updated.revision, 2);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = service(&rt, &client);
        assert!(
            now.ready >= 3,
            "fewer than 3 ready during the rollout: {now:#?}"
        );
        if now.rollout.is_none()
            && now.replica_list.len() == 3
            && now.replica_list.iter().all(|replica| replica.revision == 2)
            && now.ready == 3
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the rollout did not finish: {now:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for endpoint in rt
        .block_on(client.service_endpoints("web"))
        .expect("endpoints")
        .endpoints
    {
        assert_eq!(get(&endpoint.address).as_deref(), Some("2"));
    }

    // A revision whose readiness check fails: the rollout stops, says why,
    // and the old replicas keep serving.
    let broken = rt
        .block_on(client.update_service("web", spec("3", true)))
        .expect("updated");
    assert_eq!(broken.revision, 3);
    wait_until("the rollout to stop", Duration::from_secs(30), || {
        service(&rt, &client)
            .rollout
            .is_some_and(|rollout| rollout.contains("stopped"))
    });
    let stopped = service(&rt, &client);
    let why = stopped.rollout.clone().unwrap_or_default();
    assert!(why.contains("rollout to revision 3 stopped"), "{why}");
    assert!(why.contains("GET /healthz answered 500"), "{why}");
    assert_eq!(stopped.ready, 3, "{stopped:#?}");
    assert_eq!(
        stopped
            .replica_list
            .iter()
            .filter(|replica| replica.revision == 2)
            .count(),
        3
    );
    let text = common::success(&common::muster(
        cluster.dir.path(),
        &[
            "services",
            "describe",
            "web",
            "--server",
            &cluster.url(),
            "--token",
            &cluster.token("admin.token"),
            "--ca-sha256",
            &cluster.ca_sha256(),
        ],
    ));
    assert!(text.contains("rollout to revision 3 stopped"), "{text}");

    // Rolled back: revision 2's template again, as revision 4.
    let back = rt
        .block_on(client.rollback_service("web", None))
        .expect("rolled back");
    assert_eq!(back.revision, 4);
    wait_until("the rollback to finish", Duration::from_secs(60), || {
        let now = service(&rt, &client);
        now.rollout.is_none()
            && now.ready == 3
            && now.replica_list.len() == 3
            && now.replica_list.iter().all(|replica| replica.revision == 4)
    });
    for endpoint in rt
        .block_on(client.service_endpoints("web"))
        .expect("endpoints")
        .endpoints
    {
        assert_eq!(get(&endpoint.address).as_deref(), Some("2"));
    }

    // Scaled down to one, then deleted: its replicas stop, it is gone.
    rt.block_on(client.scale_service("web", 1)).expect("scaled");
    wait_until("one replica", Duration::from_secs(20), || {
        let now = service(&rt, &client);
        now.replica_list.len() == 1 && now.ready == 1
    });
    rt.block_on(client.delete_service("web")).expect("deleted");
    wait_until("the service gone", Duration::from_secs(20), || {
        rt.block_on(client.service("web")).is_err()
    });
    wait_until("no replica process", Duration::from_secs(20), || {
        common::processes_with("os.environ.get(\"VERSION\"") == 0
    });
}

/// Sends GETs through the gateway from `clients` tasks until `stop`;
/// answers (version served) and failures (what went wrong) are counted.
struct Load {
    answers: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>,
    failures: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// `clients` clients sending `limit` requests in all, each as fast as
    /// it is answered, or one every `pace` at most.
    fn start(
        rt: &tokio::runtime::Runtime,
        url: String,
        clients: usize,
        limit: u64,
        pace: Option<Duration>,
    ) -> Load {
        let answers = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::<
            String,
            u64,
        >::new()));
        let failures = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let tasks = (0..clients)
            .map(|_| {
                let (answers, failures, stop, sent, url) = (
                    answers.clone(),
                    failures.clone(),
                    stop.clone(),
                    sent.clone(),
                    url.clone(),
                );
                rt.spawn(async move {
                    let http = reqwest::Client::builder()
                        .timeout(Duration::from_secs(10))
                        .build()
                        .expect("client");
                    let mut ticks = pace.map(|pace| {
                        let mut ticks = tokio::time::interval(pace);
                        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                        ticks
                    });
                    while !stop.load(std::sync::atomic::Ordering::Relaxed)
                        && sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < limit
                    {
                        if let Some(ticks) = ticks.as_mut() {
                            ticks.tick().await;
                        }
                        match http.get(&url).send().await {
                            Ok(response) if response.status().is_success() => {
                                let body = response.text().await.unwrap_or_default();
                                *answers
                                    .lock()
                                    .expect("answers")
                                    .entry(body.trim().to_string())
                                    .or_default() += 1;
                            }
                            Ok(response) => {
                                let status = response.status();
                                let body = response.text().await.unwrap_or_default();
                                failures
                                    .lock()
                                    .expect("failures")
                                    .push(format!("{status}: {body}"));
                            }
                            Err(error) => {
                                failures.lock().expect("failures").push(error.to_string())
                            }
                        }
                    }
                })
            })
            .collect();
        Load {
            answers,
            failures,
            stop,
            tasks,
        }
    }

    fn answered(&self) -> u64 {
        self.answers.lock().expect("answers").values().sum()
    }

    fn finish(
        self,
        rt: &tokio::runtime::Runtime,
    ) -> (std::collections::BTreeMap<String, u64>, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for task in self.tasks {
            rt.block_on(task).expect("load task");
        }
        let answers = self.answers.lock().expect("answers").clone();
        let failures = self.failures.lock().expect("failures").clone();
        (answers, failures)
    }
}

/// `muster gateway` on a free loopback port for `cluster` (the admin's
/// token file, the cluster's CA), with `extra` arguments; and its address.
fn spawn_gateway(cluster: &Cluster, extra: &[&str]) -> (common::cluster::Daemon, String) {
    let address = format!("127.0.0.1:{}", common::free_port());
    // The token from its file, never on the command line (every task on
    // the machine could read it in /proc).
    let (url, token_file, ca) = (
        cluster.url(),
        cluster.path("server").join("admin.token"),
        cluster.ca_sha256(),
    );
    let token_file = token_file.to_str().expect("utf-8 path");
    let mut args = vec!["gateway", "--listen", &address];
    args.extend_from_slice(extra);
    args.extend([
        "--server",
        &url,
        "--token-file",
        token_file,
        "--ca-sha256",
        &ca,
    ]);
    let daemon = common::cluster::spawn(cluster.dir.path(), "gateway.log", &args);
    (daemon, address)
}

#[test]
fn the_gateway_serves_through_a_rolling_update_and_a_replica_s_death_without_failing() {
    let cluster = Cluster::start("3s");
    let _agents: Vec<_> = (1..=2)
        .map(|i| cluster.agent_with(&format!("node-{i}"), &cluster.url(), "1xH100-80GB", &[]))
        .collect();
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 2);
    let (_gateway, gateway_address) = spawn_gateway(&cluster, &["--domain", "muster.internal"]);
    rt.block_on(client.create_service(spec("1", false)))
        .expect("created");
    wait_until("three ready replicas", Duration::from_secs(30), || {
        service(&rt, &client).ready == 3
    });
    let url = format!("http://{gateway_address}/web/");
    wait_until("the gateway to route", Duration::from_secs(10), || {
        get(&format!("{gateway_address}/web")).as_deref() == Some("1")
    });
    // By host too, under the gateway's --domain.
    let by_host = rt
        .block_on(
            reqwest::Client::new()
                .get(format!("http://{gateway_address}/any/path"))
                .header("host", "web.muster.internal")
                .send(),
        )
        .expect("answer");
    assert!(by_host.status().is_success());
    let unknown = rt
        .block_on(reqwest::get(format!("http://{gateway_address}/nothing/")))
        .expect("answer");
    assert_eq!(unknown.status().as_u16(), 404);

    // A rolling update under load.
    let load = Load::start(&rt, url.clone(), 8, 20_000, None);
    wait_until("requests flowing", Duration::from_secs(10), || {
        load.answered() > 200
    });
    rt.block_on(client.update_service("web", spec("2", false)))
        .expect("updated");
    wait_until("the rollout to finish", Duration::from_secs(60), || {
        let now = service(&rt, &client);
        now.rollout.is_none()
            && now.replica_list.len() == 3
            && now.replica_list.iter().all(|replica| replica.revision == 2)
            && now.ready == 3
    });
    let before = load.answered();
    wait_until("a few thousand requests", Duration::from_secs(30), || {
        load.answered() > (before + 200).max(3_000)
    });
    let (answers, failures) = load.finish(&rt);
    let total: u64 = answers.values().sum();
    eprintln!(
        "rolling update: {total} requests answered {answers:?}, {} failed",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(total >= 3_000, "a bounded load of a few thousand: {total}");
    assert!(answers.get("1").is_some_and(|n| *n > 0) && answers.get("2").is_some_and(|n| *n > 0));

    // A replica's process killed under load: no request fails (the gateway
    // sends a GET that finds it dead to another), and traffic is on the
    // others once it leaves the endpoints.
    let load = Load::start(&rt, url, 4, 20_000, None);
    wait_until("requests flowing", Duration::from_secs(10), || {
        load.answered() > 200
    });
    let victim = service(&rt, &client).replica_list[0].job;
    let killed = Instant::now();
    for pid in pids_of_job(&cluster, victim) {
        std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("kill");
    }
    wait_until(
        "the dead replica out of the endpoints",
        Duration::from_secs(10),
        || {
            !rt.block_on(client.service_endpoints("web"))
                .expect("endpoints")
                .endpoints
                .iter()
                .any(|endpoint| endpoint.job == victim)
        },
    );
    let out = killed.elapsed();
    wait_until(
        "three ready replicas again",
        Duration::from_secs(20),
        || service(&rt, &client).ready == 3,
    );
    let replaced = killed.elapsed();
    let (answers, failures) = load.finish(&rt);
    eprintln!(
        "replica death: out of the endpoints after {:.2}s, a replacement ready after {:.2}s; \
         {} requests answered, {} failed",
        out.as_secs_f64(),
        replaced.as_secs_f64(),
        answers.values().sum::<u64>(),
        failures.len()
    );
    assert!(failures.is_empty(), "{failures:?}");

    // Per-service metrics at the gateway.
    let metrics = rt
        .block_on(async {
            reqwest::get(format!("http://{gateway_address}/_muster/metrics"))
                .await?
                .text()
                .await
        })
        .expect("metrics");
    assert!(
        metrics.contains("muster_gateway_requests_total{service=\"web\",code=\"2xx\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("muster_gateway_request_seconds_bucket{"),
        "{metrics}"
    );
}

#[test]
fn load_through_the_gateway_scales_a_service_from_zero_to_its_maximum_and_back() {
    let cluster = Cluster::start("3s");
    let _agents: Vec<_> = (1..=2)
        .map(|i| cluster.agent_with(&format!("node-{i}"), &cluster.url(), "1xH100-80GB", &[]))
        .collect();
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 2);
    let (_gateway, gateway_address) = spawn_gateway(&cluster, &["--hold", "30s"]);
    let mut autoscaled = spec("1", false);
    autoscaled["replicas"] = 0.into();
    autoscaled["autoscale"] = serde_json::json!({
        "min_replicas": 0, "max_replicas": 3, "requests_per_second": 20, "window": 5,
    });
    rt.block_on(client.create_service(autoscaled))
        .expect("created");
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        service(&rt, &client).replica_list.len(),
        0,
        "no traffic, no replica"
    );

    // The first request is held until a replica is ready.
    let url = format!("http://{gateway_address}/web/");
    wait_until(
        "the gateway to know the service",
        Duration::from_secs(10),
        || {
            rt.block_on(reqwest::get(format!(
                "http://{gateway_address}/_muster/healthz"
            )))
            .is_ok()
        },
    );
    let first = Instant::now();
    let answer = rt
        .block_on(async {
            reqwest::Client::builder()
                .timeout(Duration::from_secs(40))
                .build()?
                .get(&url)
                .send()
                .await?
                .text()
                .await
        })
        .expect("the first request is answered");
    assert_eq!(answer.trim(), "1");
    eprintln!(
        "scale from zero: the first request answered after {:.2}s",
        first.elapsed().as_secs_f64()
    );

    // Load raises the replicas to the maximum: 80 requests/s (8 clients,
    // each at most 10 a second), four replicas' worth at 20 each. Paced, as
    // real traffic is: unpaced, the clients saturate the replicas (half a
    // CPU each) on a busy machine, their readiness checks time out, and
    // the ready count flaps below three.
    let load = Load::start(&rt, url, 8, 1_000_000, Some(Duration::from_millis(100)));
    let view = common::wait_for_state(
        "three ready replicas",
        Duration::from_secs(30),
        || service(&rt, &client),
        |now| now.replicas == 3 && now.ready == 3,
    );
    assert!(
        view.autoscaling
            .as_deref()
            .unwrap_or_default()
            .contains("requests/s"),
        "{view:#?}"
    );
    let (answers, failures) = load.finish(&rt);
    assert!(failures.is_empty(), "{failures:?}");
    eprintln!(
        "autoscaled to 3 under {} requests",
        answers.values().sum::<u64>()
    );

    // Without load they stay for the window, then go (to zero).
    let quiet = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(service(&rt, &client).replicas, 3, "not before the window");
    wait_until("the replicas to go", Duration::from_secs(30), || {
        let now = service(&rt, &client);
        now.replicas == 0 && now.replica_list.is_empty()
    });
    eprintln!(
        "scaled back to zero {:.1}s after the load stopped",
        quiet.elapsed().as_secs_f64()
    );
    assert!(
        service(&rt, &client)
            .events
            .iter()
            .any(|event| event.message.contains("autoscaled from 3 to")),
        "the autoscaler's steps are events"
    );
}

#[test]
fn training_that_borrows_an_inference_pool_yields_to_a_service_scaling_up() {
    let cluster = Cluster::start("3s");
    let _agent = cluster.agent_with(
        "serve-1",
        &cluster.url(),
        "1xH100-80GB",
        &["--pool", "inference"],
    );
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    rt.block_on(client.set_pool_policy(
        "inference",
        &muster_api::protocol::PoolPolicyUpdate {
            stack_policy: "report".into(),
            required: Default::default(),
            allowed_mounts: Vec::new(),
            inference: true,
        },
    ))
    .expect("an inference pool");

    // Training that may not be preempted is kept off the pool.
    let refused = rt.block_on(client.submit(serde_json::json!({
        "name": "steady", "gpus": 1, "preemptible": false, "command": ["sleep", "600"],
    })));
    let why = refused.expect_err("no node could hold it").to_string();
    assert!(why.contains("inference pool"), "{why}");

    // Preemptible training borrows the idle GPU; a 3 s grace period.
    let training = rt
        .block_on(client.submit(serde_json::json!({
            "name": "borrower", "gpus": 1, "preemptible": true,
            "checkpoint": {"signal": "TERM", "grace_period": "3s"},
            "command": ["sh", "-c", "trap 'sleep 2; exit 0' TERM; sleep 600 & wait"],
        })))
        .expect("submitted");
    wait_until("the borrower running", Duration::from_secs(20), || {
        common::cluster::state(&rt, &client, training) == "running"
    });
    let pools = rt.block_on(client.pools()).expect("pools");
    let pool = pools
        .pools
        .iter()
        .find(|pool| pool.name == "inference")
        .expect("the pool");
    assert!(pool.inference);
    assert_eq!(pool.borrowed_gpu_milli, 1_000, "{pool:?}");
    let queues = rt.block_on(client.queues()).expect("queues");
    let queue = queues
        .queues
        .iter()
        .find(|queue| queue.name == "default")
        .expect("the training's queue");
    assert_eq!(queue.borrowed_gpus, 1.0, "{queue:?}");

    // A service in the pool scales up: the borrower is stopped (with its
    // grace) and the replica starts within the grace period plus 5 s.
    let mut serving = spec("1", false);
    serving["replicas"] = 0.into();
    serving["gpus"] = 1.into();
    serving["pool"] = "inference".into();
    rt.block_on(client.create_service(serving))
        .expect("created");
    let scaled = Instant::now();
    rt.block_on(client.scale_service("web", 1)).expect("scaled");
    wait_until("the replica running", Duration::from_secs(8), || {
        service(&rt, &client)
            .replica_list
            .iter()
            .any(|replica| replica.state == "starting" || replica.state == "ready")
    });
    eprintln!(
        "replica running {:.2}s after the scale-up (grace 3 s)",
        scaled.elapsed().as_secs_f64()
    );
    let borrower = rt.block_on(client.job(training)).expect("the borrower");
    assert_eq!(borrower.state, "pending", "preempted and queued again");
    let pools = rt.block_on(client.pools()).expect("pools");
    let pool = pools
        .pools
        .iter()
        .find(|pool| pool.name == "inference")
        .expect("the pool");
    assert_eq!(
        (pool.service_gpu_milli, pool.borrowed_gpu_milli),
        (1_000, 0),
        "{pool:?}"
    );
}

/// The uid and cgroup of process `pid`.
fn uid_and_cgroup(pid: i32) -> (String, String) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let uid = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_default()
        .to_string();
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    (uid, cgroup.trim().to_string())
}

#[test]
fn command_checks_run_beside_the_replica_as_its_user_and_gate_its_traffic() {
    let cluster = Cluster::start("3s");
    let _agent = cluster.agent_with("node-1", &cluster.url(), "1xH100-80GB", &[]);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let out = common::task_writable(cluster.dir.path(), "checks");
    let with_checks = |version: &str, fail: bool| {
        let mut spec = spec(version, fail);
        spec["replicas"] = 2.into();
        spec["env"]["CHECK_OUT"] = out.to_str().expect("utf-8").into();
        spec["readiness"] = serde_json::json!({
            "command": [
                "python3", "-c",
                "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['PORT'], timeout=1)",
            ],
            "period": 1, "timeout": 2, "failure_threshold": 1,
        });
        spec["liveness"] = serde_json::json!({
            "command": ["sh", "-c", "id -u > \"$CHECK_OUT/uid.$PORT\"; cat /proc/self/cgroup > \"$CHECK_OUT/cgroup.$PORT\""],
            "period": 1,
        });
        spec
    };
    rt.block_on(client.create_service(with_checks("1", false)))
        .expect("created");
    wait_until(
        "two replicas ready by their command checks",
        Duration::from_secs(40),
        || {
            let now = service(&rt, &client);
            now.ready == 2
        },
    );
    // The checks ran as the replica's user, in its cgroup.
    let view = service(&rt, &client);
    for replica in &view.replica_list {
        let port = replica
            .endpoint
            .as_deref()
            .and_then(|endpoint| endpoint.rsplit(':').next())
            .expect("an endpoint")
            .to_string();
        let pid = *pids_of_job(&cluster, replica.job)
            .first()
            .expect("the replica's process");
        let (uid, cgroup) = uid_and_cgroup(pid);
        wait_until(
            "the liveness check's record",
            Duration::from_secs(10),
            || out.join(format!("cgroup.{port}")).exists(),
        );
        let check_uid = std::fs::read_to_string(out.join(format!("uid.{port}")))
            .expect("the check wrote its uid");
        let check_cgroup = std::fs::read_to_string(out.join(format!("cgroup.{port}")))
            .expect("the check wrote its cgroup");
        assert_eq!(
            check_uid.trim(),
            uid,
            "the check runs as the replica's user"
        );
        assert_eq!(
            check_cgroup.trim(),
            cgroup,
            "the check runs in the replica's cgroup"
        );
    }
    // A revision whose check fails stops its rollout, saying why.
    rt.block_on(client.update_service("web", with_checks("2", true)))
        .expect("updated");
    wait_until("the rollout to stop", Duration::from_secs(40), || {
        service(&rt, &client)
            .rollout
            .is_some_and(|rollout| rollout.contains("stopped"))
    });
    let why = service(&rt, &client).rollout.unwrap_or_default();
    assert!(why.contains("exited 1"), "{why}");
    assert!(why.contains("500"), "{why}");
    assert_eq!(service(&rt, &client).ready, 2);
}

#[test]
fn a_network_check_reaches_only_its_replica_s_own_listener() {
    let cluster = Cluster::start("3s");
    let _agent = cluster.agent_with("node-1", &cluster.url(), "1xH100-80GB", &[]);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    // A fixed port the replica never listens on; once it runs, something
    // else (here this test, standing for the server's API or another
    // tenant's service) listens there.
    // The last port of this cluster's own range (its jobs, numbered from
    // 1, take the first ones; other tests' clusters have other ranges), not
    // an ephemeral one another test could be given meanwhile.
    let port = cluster.master_port_base() + 99;
    let mut spec = spec("1", false);
    spec["name"] = "scanner".into();
    spec["replicas"] = 1.into();
    spec["port"] = port.into();
    spec["command"] = serde_json::json!(["sleep", "600"]);
    spec["readiness"] = serde_json::json!({"http": "/v1/secrets", "period": 1, "timeout": 1, "failure_threshold": 1});
    spec.as_object_mut().expect("a mapping").remove("liveness");
    rt.block_on(client.create_service(spec)).expect("created");
    let replica = || {
        rt.block_on(client.service("scanner"))
            .expect("the service")
            .replica_list
            .first()
            .cloned()
    };
    // Its task runs once its checks do (a replica whose job is `starting`
    // may not have been started by its agent yet, and an agent refuses to
    // start a task whose port is taken): until the port is taken, they
    // find nothing there.
    wait_until("the replica's task runs", Duration::from_secs(30), || {
        replica().is_some_and(|replica| {
            replica.state == "starting"
                && replica
                    .not_ready
                    .is_some_and(|said| said.contains("nothing listens there"))
        })
    });
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).expect("the port");
    listener.set_nonblocking(true).expect("non-blocking");
    let mut arrived = 0;
    let mut why = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut quiet_since = None;
    while Instant::now() < deadline {
        if listener.accept().is_ok() {
            arrived += 1;
        }
        let said = replica().and_then(|replica| replica.not_ready);
        if said
            .as_deref()
            .is_some_and(|said| said.contains("not held by this replica's task"))
        {
            why = said;
            // Several periods of checks, each refused before it is sent.
            let since = *quiet_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(4) {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let why = why.unwrap_or_else(|| {
        panic!(
            "the replica's check never said why it was not sent; last: {:?}",
            replica()
        )
    });
    assert!(why.contains(&format!("port {port}")), "{why}");
    assert_eq!(arrived, 0, "a check reached a listener not its replica's");
    let scanner = rt.block_on(client.service("scanner")).expect("the service");
    assert_eq!(scanner.ready, 0);
}
