//! Nodes at the boundary, end to end with the real binary: odd node specs
//! never stop a healthy node's jobs, the join token cannot take a known
//! node's name, a node's own credential carries it across agent
//! restarts, and under `--approve-nodes` a new node gets no work (and no
//! secret) until an operator approves it.

mod common;

use common::cluster::{Cluster, runtime, spawn, state, wait_for_nodes};
use common::wait_until;
use muster_api::client::ClientError;
use muster_api::protocol::{ErrorCode, GpuView, RegisterRequest};
use std::time::Duration;

fn register_request(name: &str, models: &[&str]) -> RegisterRequest {
    RegisterRequest {
        name: name.to_string(),
        address: "127.0.0.1".to_string(),
        gpus: models
            .iter()
            .enumerate()
            .map(|(index, model)| GpuView {
                index: index as u32,
                uuid: format!("GPU-{name}-{index}"),
                model: model.to_string(),
                memory_mib: 16_384,
                nvlink_domain: 0,
            })
            .collect(),
        cpu_milli: 8_000,
        memory_mib: 64 * 1024,
        pool: None,
        rack: None,
        backend: "simulated".to_string(),
        driver_version: None,
        cuda_version: None,
        stack: Default::default(),
    }
}

#[test]
fn odd_nodes_do_not_stop_a_healthy_nodes_jobs() {
    let cluster = Cluster::start("10s");
    let url = cluster.url();
    let _healthy = cluster.agent("healthy", &url);
    // The mixed GPUs `muster agent --help` suggests.
    let _mixed = cluster.agent_with("mixed", &url, "2xA100-40GB,4xL4", &[]);
    let rt = runtime();
    let client = cluster.client();
    let joiner = cluster.client_with(&url, &cluster.token("join.token"));
    wait_for_nodes(&rt, &client, 2);

    // A 65-GPU agent is refused with the reason, and says so as it exits.
    let mut big = cluster.agent_with("big", &url, "65xH100-80GB", &[]);
    let status = (0..600)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            big.0.try_wait().expect("wait")
        })
        .expect("the 65-GPU agent stops");
    assert!(!status.success());
    let log = std::fs::read_to_string(cluster.path("big.log")).unwrap();
    assert!(
        log.contains("65 GPUs") && log.contains("at most 64"),
        "{log}"
    );
    // 70 nodes of 70 distinct GPU models (registered by hand; they never
    // heartbeat, so they are lost after the lease).
    for i in 0..70 {
        let model = format!("MODEL-{i}");
        rt.block_on(joiner.register(&register_request(&format!("odd-{i}"), &[&model])))
            .expect("a node of a new model joins");
    }
    wait_for_nodes(&rt, &client, 72);

    // Jobs still run: on the healthy node, on each model of the mixed
    // one, and on one of the 70 models while its node is up.
    let submit = |models: &[&str]| {
        let spec = serde_json::json!({
            "name": "probe", "gpus": 1, "gpu_models": models, "command": ["true"],
            // A node mixing models offers each model a share of its CPUs
            // and memory in proportion to its GPUs (this machine may have
            // two cores).
            "cpus": 0.1, "memory": "64MiB",
        });
        rt.block_on(client.submit(spec)).expect("submitted")
    };
    let on_healthy = submit(&["H100-80GB"]);
    let on_l4 = submit(&["L4"]);
    let on_a100 = submit(&["A100-40GB"]);
    for id in [on_healthy, on_l4, on_a100] {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while state(&rt, &client, id) != "succeeded" {
            if std::time::Instant::now() > deadline {
                let job = rt.block_on(client.job(id));
                let server_log = std::fs::read_to_string(cluster.path("server.log"));
                panic!("job {id} did not succeed: {job:?}\n{server_log:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let job = rt.block_on(client.job(on_l4)).unwrap();
    assert_eq!(job.tasks[0].node, "mixed");
    let index = job.tasks[0].gpus[0].0;
    assert!((2..6).contains(&index), "an L4 (indices 2 to 5): {index}");
    let job = rt.block_on(client.job(on_a100)).unwrap();
    assert_eq!(job.tasks[0].node, "mixed");
    assert!(job.tasks[0].gpus[0].0 < 2);
    let job = rt.block_on(client.job(on_healthy)).unwrap();
    assert_eq!(job.tasks[0].node, "healthy");
    // The server's log has no failed cycle.
    let server_log = std::fs::read_to_string(cluster.path("server.log")).unwrap();
    assert!(
        !server_log.contains("scheduling cycle failed"),
        "{server_log}"
    );
}

#[test]
fn the_join_token_cannot_take_a_known_node_and_its_credential_survives_restarts() {
    let cluster = Cluster::start("10s");
    let url = cluster.url();
    let mut agent = Some(cluster.agent("node-a", &url));
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let credential_now = || {
        std::fs::read_to_string(cluster.path("node-a").join("node.credential")).unwrap_or_default()
    };
    wait_until("the credential file", Duration::from_secs(10), || {
        cluster.path("node-a").join("node.credential").exists()
    });
    let credential = credential_now();
    let mode = std::fs::metadata(cluster.path("node-a").join("node.credential"))
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
        .unwrap();
    assert_eq!(mode, 0o600, "owner-only");
    let spec = serde_json::json!({
        "name": "long", "gpus": 1, "env": {"HF_TOKEN": "secret-of-alice"},
        "command": ["sleep", "6"],
    });
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    // Running as the agent reported it (its supervisor is up), not only
    // placed.
    wait_until("the task to run", Duration::from_secs(30), || {
        rt.block_on(client.job(id))
            .is_ok_and(|job| job.tasks.first().is_some_and(|t| t.state == "running"))
    });

    // An impostor with the join token is refused, and learns nothing.
    let joiner = cluster.client_with(&url, &cluster.token("join.token"));
    let refused = rt
        .block_on(joiner.register(&register_request("node-a", &["H100-80GB"])))
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::Conflict), "{refused}");
    assert!(!refused.to_string().contains("secret-of-alice"));

    // The agent restarts without the join token: its credential registers
    // it again, it adopts its task, and the job runs to success once.
    drop(agent.take());
    let fingerprint = cluster.ca_sha256();
    agent = Some(spawn(
        cluster.dir.path(),
        "node-a.log",
        &[
            "agent",
            "--ca-sha256",
            &fingerprint,
            "--server",
            &url,
            "--name",
            "node-a",
            "--address",
            "127.0.0.1",
            "--simulate-gpus",
            "1xH100-80GB",
            "--state-dir",
            cluster.path("node-a").to_str().unwrap(),
        ],
    ));
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    while state(&rt, &client, id) != "succeeded" {
        if std::time::Instant::now() > deadline {
            let job = rt.block_on(client.job(id));
            let log = std::fs::read_to_string(cluster.path("node-a.log"));
            panic!("job {id} did not succeed: {job:?}\n{log:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let job = rt.block_on(client.job(id)).unwrap();
    assert_eq!(job.attempts, 1, "never re-run: {:?}", job.history);
    assert_eq!(credential_now(), credential, "the same credential");
    let log = std::fs::read_to_string(cluster.path("node-a.log")).unwrap();
    assert!(log.matches("registered").count() >= 2, "{log}");

    // An admin resets the identity: the agent is refused, and without the
    // join token it stops with a clear error.
    let reset = rt.block_on(client.node_action("node-a", "reset-identity"));
    assert!(reset.is_ok(), "{reset:?}");
    let mut running = agent.take().unwrap();
    let status = (0..600)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            running.0.try_wait().expect("wait")
        })
        .expect("the agent stops once its credential is revoked");
    assert!(!status.success());
    let log = std::fs::read_to_string(cluster.path("node-a.log")).unwrap();
    assert!(log.contains("join token"), "{log}");
    // With the join token it joins again as a new identity.
    let _again = cluster.agent("node-a", &url);
    wait_until("node-a to be ready again", Duration::from_secs(30), || {
        rt.block_on(client.node("node-a"))
            .is_ok_and(|node| node.state == "ready")
            && !credential_now().is_empty()
            && credential_now() != credential
    });
    let error: Result<_, ClientError> = rt.block_on(client.remove_node("node-a", false));
    assert!(error.is_ok(), "an idle node is removed: {error:?}");
}

/// `muster nodes token create --uses 1 --pool train` makes a token that
/// admits one agent, into pool train; a second agent with it is refused
/// and says why; list shows it used up; revoke ends it. Nothing prints a
/// token but its creation.
#[test]
fn a_join_token_admits_its_uses_into_its_pool_and_no_more() {
    let cluster = Cluster::start("10s");
    let rt = runtime();
    let client = cluster.client();
    let connection = [
        "--server".to_string(),
        cluster.url(),
        "--token".to_string(),
        cluster.token("admin.token"),
        "--ca-sha256".to_string(),
        cluster.ca_sha256(),
    ];
    let cli = |args: &[&str]| {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(connection.iter().map(String::as_str));
        common::muster(cluster.dir.path(), &all)
    };
    let made = cli(&[
        "nodes", "token", "create", "--uses", "1", "--pool", "train", "--ttl", "1h",
    ]);
    let token = common::success(&made).trim().to_string();
    assert_eq!(token.len(), 64, "{token}");
    let said = String::from_utf8_lossy(&made.stderr).into_owned();
    assert!(
        said.contains("1 uses") && said.contains("not shown again"),
        "{said}"
    );
    let file = cluster.path("train.token");
    std::fs::write(&file, &token).expect("write the token");
    let fingerprint = cluster.ca_sha256();
    let agent = |name: &str| {
        let state = cluster.path(name);
        spawn(
            cluster.dir.path(),
            &format!("{name}.log"),
            &[
                "agent",
                "--ca-sha256",
                &fingerprint,
                "--server",
                &cluster.url(),
                "--join-token-file",
                file.to_str().expect("utf-8 path"),
                "--name",
                name,
                "--address",
                "127.0.0.1",
                "--simulate-gpus",
                "1xH100-80GB",
                "--state-dir",
                state.to_str().expect("utf-8 path"),
            ],
        )
    };
    let _first = agent("first");
    wait_for_nodes(&rt, &client, 1);
    let node = rt.block_on(client.node("first")).expect("the node");
    assert_eq!(node.pool, "train");
    let mut second = agent("second");
    let status = (0..600)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            second.0.try_wait().expect("wait")
        })
        .expect("the second agent stops");
    assert!(!status.success());
    let log = std::fs::read_to_string(cluster.path("second.log")).unwrap();
    assert!(log.contains("used up"), "{log}");
    let listed = common::success(&cli(&["nodes", "token", "list"]));
    assert!(
        listed.contains("used up") && listed.contains("1/1"),
        "{listed}"
    );
    assert!(
        listed.contains("join.token"),
        "the first start's token: {listed}"
    );
    assert!(!listed.contains(&token), "{listed}");
    let id = listed
        .lines()
        .find(|line| line.contains("train"))
        .and_then(|line| line.split_whitespace().next())
        .expect("the token's row")
        .to_string();
    let revoked = common::success(&cli(&["nodes", "token", "revoke", &id]));
    assert!(revoked.contains("revoked"), "{revoked}");
    let listed = common::success(&cli(&["nodes", "token", "list", "--json"]));
    let listed: serde_json::Value = serde_json::from_str(&listed).expect("json");
    let row = listed["join_tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .find(|row| row["id"] == id.as_str())
        .cloned()
        .expect("the row");
    assert_eq!(row["state"], "revoked");
    // The node that joined keeps its own credential.
    assert_eq!(
        rt.block_on(client.node("first")).expect("the node").state,
        "ready"
    );
}

#[test]
fn a_node_waiting_for_approval_gets_no_job_and_no_secret_until_approved() {
    let cluster = Cluster::start_with("10s", &["--approve-nodes"]);
    let admin_file = cluster.path("server").join("admin.token");
    let rt = runtime();
    let client = cluster.client();
    let secret = format!("approval-secret-{}", std::process::id());
    rt.block_on(client.set_secret("hf", &secret, None))
        .expect("the secret is set");
    let _agent = cluster.agent("newcomer", &cluster.url());
    wait_for_nodes(&rt, &client, 1);
    let node = rt.block_on(client.node("newcomer")).expect("the node");
    assert_eq!(node.state, "pending-approval");
    // A job that would fit at once: it waits, and nothing of it (its
    // secret above all) reaches the node.
    let job = rt
        .block_on(client.submit(serde_json::json!({
            "name": "needs-a-node",
            "gpus": 1,
            "command": ["sh", "-c", "test \"$HF_TOKEN\" = \"$EXPECTED\""],
            "env": {"HF_TOKEN": {"secret": "hf"}, "EXPECTED": secret},
        })))
        .expect("submitted");
    // Neither the job nor its secret is anywhere in the agent's state.
    let agent_state = cluster.path("newcomer");
    for _ in 0..30 {
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(state(&rt, &client, job), "pending");
    }
    let mut found = Vec::new();
    for entry in walk(&agent_state) {
        if std::fs::read(&entry)
            .is_ok_and(|bytes| bytes.windows(secret.len()).any(|w| w == secret.as_bytes()))
        {
            found.push(entry);
        }
    }
    assert!(
        found.is_empty(),
        "the pending node holds the secret: {found:?}"
    );
    // The operator's CLI, its token from the file.
    let (url, fingerprint) = (cluster.url(), cluster.ca_sha256());
    let admin_file = admin_file.to_str().expect("utf-8 path");
    let cli = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend([
            "--server",
            &url,
            "--token-file",
            admin_file,
            "--ca-sha256",
            &fingerprint,
        ]);
        common::success(&common::muster(cluster.dir.path(), &all))
    };
    let listed = cli(&["nodes"]);
    assert!(listed.contains("pending-approval"), "{listed}");
    // An operator approves it.
    assert!(cli(&["nodes", "approve", "newcomer"]).contains("approved"));
    assert_eq!(
        rt.block_on(client.node("newcomer"))
            .expect("the node")
            .state,
        "ready"
    );
    wait_until(
        "the job runs on the approved node",
        Duration::from_secs(30),
        || state(&rt, &client, job) == "succeeded",
    );
}

/// Every file under `dir`.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                todo.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files
}
