//! The log shipper against a real server in this process: exact bytes,
//! resumption by a new shipper, `eof` and `shipped_all`, the rate cap, the
//! skip past what the server would drop, and an allocation the server does
//! not know. Log files are written by the test (no task runs).

use muster_agent::logship::{LogShipConfig, LogShipper};
use muster_agent::{ProcessRuntime, RuntimeConfig};
use muster_api::client::Client;
use muster_api::protocol::{HeartbeatRequest, RegisterRequest};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Setup {
    _dir: tempfile::TempDir,
    server: muster_server::ServerHandle,
    admin: Client,
    node_token: String,
    runtime: Arc<ProcessRuntime>,
    state_dir: PathBuf,
    url: String,
}

/// A server keeping `max_log_bytes` per task, a node `n1` on it, and one
/// job placed there: its task's name on the node and the job's id.
async fn setup(max_log_bytes: u64) -> (Setup, String, u64) {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = muster_server::Server::start(muster_server::ServerConfig {
        listen: "127.0.0.1:0".parse().expect("an address"),
        max_log_bytes,
        ..muster_server::ServerConfig::new(dir.path().join("server"))
    })
    .await
    .expect("the server starts");
    let url = format!("http://{}", server.addr());
    let admin = Client::new(&url, server.admin_token());
    let registered = Client::new(&url, server.join_token())
        .register(&RegisterRequest {
            name: "n1".into(),
            address: "127.0.0.1".into(),
            gpus: Vec::new(),
            cpu_milli: 4000,
            memory_mib: 4096,
            pool: None,
            rack: None,
            backend: "simulated".into(),
            driver_version: None,
            cuda_version: None,
            stack: Default::default(),
        })
        .await
        .expect("the node registers");
    let id = admin
        .submit(serde_json::json!({"name": "logs", "command": ["true"]}))
        .await
        .expect("the job is accepted");
    let node = Client::new(&url, &registered.node_token);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut sequence = 0;
    let allocation = loop {
        sequence += 1;
        let answer = node
            .heartbeat(
                "n1",
                &HeartbeatRequest {
                    pulling: Vec::new(),
                    epoch: registered.epoch,
                    observed: Vec::new(),
                    wait_ms: 500,
                    known_version: 0,
                    unhealthy_gpus: Vec::new(),
                    sequence,
                },
            )
            .await
            .expect("a heartbeat");
        if let Some(task) = answer.desired.first() {
            break task.allocation;
        }
        assert!(Instant::now() < deadline, "the job was never placed");
    };
    let state_dir = dir.path().join("agent");
    std::fs::create_dir_all(state_dir.join("logs")).expect("mkdir");
    let runtime = Arc::new(ProcessRuntime::new(RuntimeConfig::new(
        state_dir.clone(),
        PathBuf::from("/bin/false"),
    )));
    let key = format!("j{id}-a{allocation}-g1");
    let setup = Setup {
        _dir: dir,
        server,
        admin,
        node_token: registered.node_token,
        runtime,
        state_dir,
        url,
    };
    (setup, key, id)
}

impl Setup {
    fn shipper(&self, rate_bytes_per_s: u64) -> LogShipper {
        let shipper = LogShipper::start(
            muster_api::client::Client::new(&self.url, ""),
            "n1",
            Arc::clone(&self.runtime),
            LogShipConfig {
                rate_bytes_per_s,
                ..LogShipConfig::default()
            },
        );
        shipper.set_token(&self.node_token);
        shipper
    }

    fn append(&self, key: &str, bytes: &[u8]) {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state_dir.join("logs").join(format!("{key}.log")))
            .expect("the log file");
        file.write_all(bytes).expect("written");
    }

    /// Everything the server returns for the job, paging.
    async fn stored(&self, id: u64) -> Vec<u8> {
        let mut out = Vec::new();
        let mut offset = 0;
        loop {
            let page = self
                .admin
                .logs(id, 0, offset, None, false)
                .await
                .expect("the logs");
            out.extend_from_slice(&page.data);
            offset = page.next_offset;
            if !page.more {
                return out;
            }
        }
    }
}

fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(167).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

async fn wait_for(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ships_exact_bytes_resumes_after_a_restart_and_ends_with_eof() {
    let (setup, key, id) = setup(1 << 30).await;
    let first = bytes(700_000, 1);
    setup.append(&key, &first);
    let shipper = setup.shipper(64 << 20);
    shipper.update([(key.as_str(), true)]);
    wait_for("the first part", Duration::from_secs(20), async || {
        setup.stored(id).await == first
    })
    .await;
    assert!(!shipper.shipped_all(&key), "the task still runs");

    // A new shipper (an agent restarted) resumes where the server is.
    drop(shipper);
    let second = bytes(300_000, 2);
    setup.append(&key, &second);
    let shipper = setup.shipper(64 << 20);
    shipper.update([(key.as_str(), false)]);
    wait_for("the whole log", Duration::from_secs(20), async || {
        shipper.shipped_all(&key)
    })
    .await;
    let mut whole = first.clone();
    whole.extend_from_slice(&second);
    assert_eq!(setup.stored(id).await, whole);
    let file = setup.state_dir.join("logs").join(format!("{key}.log"));
    assert!(!file.exists(), "a shipped log leaves the node");
    // Unknown to the shipper: not shipped.
    assert!(!shipper.shipped_all("j1-a999-g1"));
    setup.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_cap_holds() {
    let (setup, key, id) = setup(1 << 30).await;
    let data = bytes(3 << 20, 3);
    setup.append(&key, &data);
    let started = Instant::now();
    let shipper = setup.shipper(1 << 20);
    shipper.update([(key.as_str(), false)]);
    wait_for("the whole log", Duration::from_secs(30), async || {
        shipper.shipped_all(&key)
    })
    .await;
    let took = started.elapsed();
    // 3 MiB at 1 MiB/s, the first 256 KiB chunk free.
    assert!(took >= Duration::from_millis(2_500), "{took:?}");
    assert_eq!(setup.stored(id).await, data);
    setup.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_far_behind_skips_what_the_server_would_drop() {
    let (setup, key, id) = setup(64 * 1024).await;
    let data = bytes(16 << 20, 4);
    setup.append(&key, &data);
    let started = Instant::now();
    // 16 MiB at 512 KiB/s would take 32 s; the server keeps 64 KiB of it.
    let shipper = setup.shipper(512 * 1024);
    shipper.update([(key.as_str(), true)]);
    wait_for("the latest bytes", Duration::from_secs(30), async || {
        setup.stored(id).await.ends_with(&data[data.len() - 1024..])
    })
    .await;
    // While the task runs, the node's disk holds only what may still be
    // needed (where the filesystem can punch holes); the length stays.
    use std::os::unix::fs::MetadataExt;
    let file = setup.state_dir.join("logs").join(format!("{key}.log"));
    let meta = std::fs::metadata(&file).expect("the log file");
    assert_eq!(meta.len(), data.len() as u64, "the length stays");
    assert!(
        meta.blocks() * 512 <= 5 << 20,
        "{} bytes still on disk",
        meta.blocks() * 512
    );
    shipper.update([(key.as_str(), false)]);
    wait_for("the log", Duration::from_secs(30), async || {
        shipper.shipped_all(&key)
    })
    .await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(8), "{took:?}");
    let stored = setup.stored(id).await;
    assert_eq!(&stored[..32 * 1024], &data[..32 * 1024]);
    let text = String::from_utf8_lossy(&stored[32 * 1024..]);
    assert!(text.starts_with("\n[muster: "), "{}", &text[..40]);
    let marker_end = stored[32 * 1024 + 1..]
        .iter()
        .position(|&b| b == b'\n')
        .expect("the marker ends")
        + 32 * 1024
        + 2;
    let tail = &stored[marker_end..];
    assert!(tail.len() >= 16 * 1024, "{} bytes of tail", tail.len());
    assert_eq!(tail, &data[data.len() - tail.len()..]);
    assert!(!file.exists(), "a shipped log leaves the node");
    setup.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocation_the_server_does_not_know_is_given_up() {
    let (setup, _, _) = setup(1 << 30).await;
    let key = "j77-a999-g1";
    setup.append(key, b"lost\n");
    let shipper = setup.shipper(1 << 20);
    shipper.update([(key, false)]);
    wait_for(
        "the shipper to give up",
        Duration::from_secs(20),
        async || shipper.shipped_all(key),
    )
    .await;
    setup.server.shutdown().await;
}
