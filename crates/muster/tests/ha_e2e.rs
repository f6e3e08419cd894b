//! High availability with real processes, at the flags users run (the
//! default `--lease` and `--leader-lease`): PostgreSQL, two `muster
//! server`s on it and two agents that know both. The leader is killed
//! (SIGKILL) during a burst of submissions: the follower leads within 10 s,
//! every acknowledged job is there exactly once, the running job keeps
//! running and no job runs twice. Then the new leader is paused (SIGSTOP)
//! for 20 s during a burst, and the next one for 60 s: each time the other
//! takes over, no agent fences a task, the long job keeps its first
//! attempt, no finished job starts again, and when the paused one wakes
//! (SIGCONT) its writes are refused under the new term and it steps down to
//! forwarding. Every wait is bounded.

use muster_api::client::Client;
use muster_testkit::postgres::TestPostgres;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;

use common::cluster::{Daemon, runtime, spawn, wait_for_nodes};
use common::{free_port, task_writable, wait_until};

fn url(port: u16) -> String {
    format!("https://127.0.0.1:{port}")
}

/// How many times each job started (a line per start in `starts/ID`).
fn starts(dir: &Path) -> std::collections::BTreeMap<u64, usize> {
    std::fs::read_dir(dir)
        .expect("starts")
        .flatten()
        .filter_map(|entry| {
            let id = entry.file_name().to_str()?.parse().ok()?;
            let text = std::fs::read_to_string(entry.path()).ok()?;
            Some((id, text.lines().count()))
        })
        .collect()
}

/// Starts 8 clients submitting 25 short jobs each (`command`), noting
/// each acknowledged id in `acknowledged`. A client given both servers
/// rides through a failover: the tasks answer the errors they met (a
/// client stops at its first).
fn start_burst(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    command: &serde_json::Value,
    acknowledged: &Arc<Mutex<Vec<u64>>>,
) -> Vec<tokio::task::JoinHandle<Option<String>>> {
    (0..8)
        .map(|_| {
            let client = client.clone();
            let acknowledged = Arc::clone(acknowledged);
            let command = command.clone();
            rt.spawn(async move {
                for _ in 0..25 {
                    let spec = serde_json::json!({"name": "burst", "command": command});
                    match client.submit(spec).await {
                        Ok(id) => acknowledged.lock().expect("lock").push(id),
                        Err(error) => return Some(error.to_string()),
                    }
                }
                None
            })
        })
        .collect()
}

/// Waits for a burst's clients: none met an error.
fn finish_burst(rt: &tokio::runtime::Runtime, burst: Vec<tokio::task::JoinHandle<Option<String>>>) {
    let errors: Vec<String> = burst
        .into_iter()
        .filter_map(|task| rt.block_on(task).expect("burst client"))
        .collect();
    assert!(
        errors.is_empty(),
        "every submission is acknowledged through a failover: {errors:?}"
    );
}

/// How many times the agents logged fencing their tasks.
fn fenced(root: &Path) -> usize {
    ["n1", "n2"]
        .iter()
        .map(|name| {
            std::fs::read_to_string(root.join(format!("{name}.log")))
                .unwrap_or_default()
                .matches("stopping every task (fenced)")
                .count()
        })
        .sum()
}

/// After a leader's pause: no agent fenced since `fenced_before`, the
/// nodes are ready, the long job runs in its first attempt, every
/// acknowledged job succeeded and is listed once, and no job started
/// twice.
fn settled_once(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    started: &Path,
    long: u64,
    acknowledged: &[u64],
    root: &Path,
    fenced_before: usize,
) {
    assert!(
        acknowledged.len() >= 20,
        "{} acknowledged",
        acknowledged.len()
    );
    wait_until("the burst to finish", Duration::from_secs(90), || {
        acknowledged.iter().all(|id| {
            rt.block_on(client.job(*id))
                .is_ok_and(|job| job.state == "succeeded")
        })
    });
    assert_eq!(fenced(root), fenced_before, "no agent fenced its tasks");
    let nodes = rt.block_on(client.nodes()).expect("nodes");
    assert!(
        nodes.nodes.iter().all(|node| node.state == "ready"),
        "{:?}",
        nodes.nodes
    );
    let job = rt.block_on(client.job(long)).expect("long job");
    assert_eq!(
        (job.state.as_str(), job.attempts),
        ("running", 1),
        "{job:?}"
    );
    let (jobs, _) = rt
        .block_on(client.all_jobs(&Default::default(), None))
        .expect("jobs listed");
    let mut ids: Vec<u64> = jobs.iter().map(|job| job.id).collect();
    ids.sort_unstable();
    let listed = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), listed, "no job is listed twice");
    for id in acknowledged {
        assert!(ids.binary_search(id).is_ok(), "acknowledged job {id} lost");
        let job = jobs.iter().find(|job| job.id == *id).expect("listed");
        assert_eq!(job.attempts, 1, "job {id} ran in one attempt: {job:?}");
    }
    let counted = starts(started);
    for id in acknowledged.iter().chain([&long]) {
        assert_eq!(
            counted.get(id),
            Some(&1),
            "job {id} started once: {counted:?}"
        );
    }
    assert!(
        counted.values().all(|&n| n == 1),
        "no job ran twice: {counted:?}"
    );
}

#[test]
fn the_follower_takes_over_from_a_dead_leader_and_a_paused_leader_is_fenced() {
    let Some(postgres) = TestPostgres::get() else {
        return; // said loudly; CI requires PostgreSQL
    };
    let (database, database_name) = postgres.create_database("muster_ha");
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    let (port_a, port_b) = (free_port(), free_port());
    let server = |name: &str, port: u16| -> Daemon {
        let data = root.join(name);
        spawn(
            root,
            &format!("{name}.log"),
            &[
                "server",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
                data.to_str().expect("utf-8"),
                "--store",
                &database,
                "--advertise",
                &url(port),
            ],
        )
    };
    let leader = || -> (String, i64) {
        // Before the first server made its tables, no row.
        let row = postgres
            .query(&database, "SELECT address, term FROM leader WHERE id = 1")
            .unwrap_or_default();
        match row.split_once('|') {
            Some((address, term)) => (address.to_string(), term.parse().unwrap_or(0)),
            None => (String::new(), 0),
        }
    };
    let log =
        |name: &str| std::fs::read_to_string(root.join(format!("{name}.log"))).unwrap_or_default();
    let listening = |port: u16| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();

    // a starts alone and leads; b shares its identity and follows.
    let mut a = Some(server("a", port_a));
    wait_until("a to lead", Duration::from_secs(30), || {
        leader().0 == url(port_a) && listening(port_a)
    });
    muster_server::ha::share_identity(&root.join("a"), &root.join("b")).expect("shared");
    let b = Some(server("b", port_b));
    wait_until("b to follow", Duration::from_secs(30), || {
        listening(port_b) && log("b").contains("following the leader at")
    });
    let fingerprint = std::fs::read_to_string(root.join("a/tls/ca.sha256"))
        .expect("CA fingerprint")
        .trim()
        .to_string();
    let trust = muster_api::tls::Trust {
        ca_pem: None,
        ca_sha256: Some(muster_api::tls::Fingerprint::parse(&fingerprint).expect("fingerprint")),
    };
    let token = std::fs::read_to_string(root.join("a/admin.token"))
        .expect("token")
        .trim()
        .to_string();
    let both = format!("{},{}", url(port_a), url(port_b));
    let client = Client::with_trust(&both, &token, &trust).expect("client");
    let join_token = root.join("a/join.token");
    let agents: Vec<Daemon> = ["n1", "n2"]
        .iter()
        .map(|name| {
            let state = root.join(name);
            spawn(
                root,
                &format!("{name}.log"),
                &[
                    "agent",
                    "--ca-sha256",
                    &fingerprint,
                    "--server",
                    &both,
                    "--join-token-file",
                    join_token.to_str().expect("utf-8"),
                    "--name",
                    name,
                    "--address",
                    "127.0.0.1",
                    "--simulate-gpus",
                    "1xH100-80GB",
                    "--state-dir",
                    state.to_str().expect("utf-8"),
                ],
            )
        })
        .collect();
    let rt = runtime();
    wait_for_nodes(&rt, &client, 2);

    // Each start of a job adds a line to starts/ID.
    let started = task_writable(root, "starts");
    let record = |then: &str| {
        serde_json::json!([
            "sh",
            "-c",
            format!(
                "echo started >> {}/$MUSTER_JOB_ID; {then}",
                started.display()
            )
        ])
    };
    let long = rt
        .block_on(client.submit(serde_json::json!({
            "name": "long", "command": record("sleep 600"), "gpus": 1
        })))
        .expect("long job submitted");
    wait_until("the long job to run", Duration::from_secs(30), || {
        rt.block_on(client.job(long))
            .is_ok_and(|job| job.state == "running")
            && starts(&started).contains_key(&long)
    });

    // A burst of short jobs from 8 clients; the leader dies in the middle.
    let acknowledged: Arc<Mutex<Vec<u64>>> = Arc::default();
    let burst = start_burst(&rt, &client, &record("true"), &acknowledged);
    wait_until("some acknowledgements", Duration::from_secs(60), || {
        acknowledged.lock().expect("lock").len() >= 40
    });
    let (_, first_term) = leader();
    drop(a.take()); // SIGKILL
    let killed = Instant::now();
    // A read during the election waits for it (the follower has no leader
    // to forward to yet) rather than failing.
    let reader = Client::with_trust(&both, &token, &trust).expect("client");
    rt.block_on(reader.queues())
        .expect("a read through the election is answered once b leads");
    wait_until("b to lead", Duration::from_secs(10), || {
        leader().0 == url(port_b)
    });
    let failover = killed.elapsed();
    let (_, second_term) = leader();
    assert!(
        second_term > first_term,
        "a new term: {first_term} then {second_term}"
    );
    eprintln!("failover: b leads {failover:?} after a was killed");
    finish_burst(&rt, burst);
    let acknowledged = acknowledged.lock().expect("lock").clone();
    assert!(
        acknowledged.len() >= 40,
        "{} acknowledged",
        acknowledged.len()
    );

    // Every acknowledged job is there, once.
    let (jobs, _) = rt
        .block_on(client.all_jobs(&Default::default(), None))
        .expect("jobs listed");
    let mut ids: Vec<u64> = jobs.iter().map(|job| job.id).collect();
    ids.sort_unstable();
    let listed = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), listed, "no job is listed twice");
    for id in &acknowledged {
        assert!(ids.binary_search(id).is_ok(), "acknowledged job {id} lost");
    }
    // The running job kept running: the same attempt, never restarted.
    let job = rt.block_on(client.job(long)).expect("long job");
    assert_eq!(
        (job.state.as_str(), job.attempts),
        ("running", 1),
        "{job:?}"
    );
    wait_until("the burst to finish", Duration::from_secs(90), || {
        acknowledged.iter().all(|id| {
            rt.block_on(client.job(*id))
                .is_ok_and(|job| job.state == "succeeded")
        })
    });
    let counted = starts(&started);
    for id in acknowledged.iter().chain([&long]) {
        assert_eq!(
            counted.get(id),
            Some(&1),
            "job {id} started once: {counted:?}"
        );
    }
    assert!(
        counted.values().all(|&n| n == 1),
        "no job ran twice: {counted:?}"
    );

    // a comes back as a follower; then b, leading, is paused for 20 s
    // during a burst.
    a = Some(server("a", port_a));
    wait_until("a to follow", Duration::from_secs(30), || {
        listening(port_a) && log("a").matches("following the leader at").count() >= 1
    });
    // A burst under way, the leader (`pid`) is stopped until the other
    // (`next`, listening on `port`) leads in a later term: what the burst
    // acknowledges, the fence count before, when the pause began and the
    // new term.
    let pause_in_burst = |pid: i32, next: &str, port: u16, term: i64| {
        let fenced_before = fenced(root);
        let pausing: Arc<Mutex<Vec<u64>>> = Arc::default();
        let burst = start_burst(&rt, &client, &record("true"), &pausing);
        wait_until("a burst under way", Duration::from_secs(60), || {
            pausing.lock().expect("lock").len() >= 20
        });
        let pid = nix::unistd::Pid::from_raw(pid);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
        let paused = Instant::now();
        wait_until(&format!("{next} to lead"), Duration::from_secs(15), || {
            leader().0 == url(port)
        });
        let (_, later) = leader();
        assert!(later > term, "a new term: {term} then {later}");
        eprintln!(
            "failover: {next} leads {:?} after a pause",
            paused.elapsed()
        );
        (pausing, burst, fenced_before, paused, later)
    };
    let b_pid = nix::unistd::Pid::from_raw(b.as_ref().expect("b").pid());
    let (pausing, burst, fenced_before, paused, third_term) =
        pause_in_burst(b_pid.as_raw(), "a", port_a, second_term);
    // a serves meanwhile (a client that asks a first: b would not answer).
    let via_a = Client::with_trust(&format!("{},{}", url(port_a), url(port_b)), &token, &trust)
        .expect("client");
    let during = rt
        .block_on(via_a.submit(serde_json::json!({"name": "during", "command": record("true")})))
        .expect("a takes submissions while b is paused");
    // A submission to b alone, sent just before b wakes: b takes it up
    // still believing it leads, and the store refuses its write.
    std::thread::sleep(Duration::from_secs(18).saturating_sub(paused.elapsed()));
    let b_only = Client::with_trust(&url(port_b), &token, &trust).expect("client");
    let late = rt.spawn(async move {
        b_only
            .submit(serde_json::json!({"name": "late", "command": ["true"]}))
            .await
    });
    std::thread::sleep(Duration::from_secs(20).saturating_sub(paused.elapsed()));
    nix::sys::signal::kill(b_pid, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    let late = rt.block_on(late).expect("the late submission");
    eprintln!("the submission b took up as it woke: {late:?}");
    // b wrote as the leader of term 2 (the submission, and its lease
    // ticker marking the nodes lost after 20 s without heartbeats): the
    // store refused it, under the new term, or had ended the session b
    // stopped inside a transaction.
    let refused = "no longer the leader: it wrote in term";
    let ended = "idle-in-transaction timeout";
    assert!(
        late.as_ref()
            .is_err_and(|error| error.to_string().contains(refused))
            || log("b").contains(refused)
            || log("b").contains(ended),
        "a write of b's, refused: {late:?}\n{}",
        log("b")
    );
    // b wakes thinking it leads; what it tries to write is refused under
    // the new term, and it steps down.
    wait_until("b to step down", Duration::from_secs(30), || {
        log("b").contains("no longer the leader")
    });
    wait_until("b to forward", Duration::from_secs(30), || {
        log("b").matches("following the leader at").count() >= 2
    });
    assert_eq!(
        leader(),
        (url(port_a), third_term),
        "a still leads, in its term"
    );
    finish_burst(&rt, burst);
    let late_landed = late.ok();
    let mut ours = pausing.lock().expect("lock").clone();
    ours.push(during);
    // Nothing b did while it believed it led took: the nodes are up, the
    // long job still runs in its first attempt, and b now forwards to a.
    let via_b = Client::with_trust(&url(port_b), &token, &trust).expect("client");
    settled_once(&rt, &via_b, &started, long, &ours, root, fenced_before);
    // A refused submission left nothing (one b forwarded, had it stepped
    // down first, would be a's).
    let (jobs, _) = rt
        .block_on(via_b.all_jobs(&Default::default(), None))
        .expect("jobs listed");
    let late_jobs: Vec<u64> = jobs
        .iter()
        .filter(|job| job.name == "late")
        .map(|job| job.id)
        .collect();
    assert_eq!(late_jobs, late_landed.into_iter().collect::<Vec<_>>());

    // Now a, leading, is paused for 60 s during a burst: b takes over, and
    // the same holds.
    let a_pid = nix::unistd::Pid::from_raw(a.as_ref().expect("a").pid());
    let (pausing, burst, fenced_before, paused, fourth_term) =
        pause_in_burst(a_pid.as_raw(), "b", port_b, third_term);
    finish_burst(&rt, burst);
    std::thread::sleep(Duration::from_secs(60).saturating_sub(paused.elapsed()));
    nix::sys::signal::kill(a_pid, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    wait_until("a to forward", Duration::from_secs(30), || {
        log("a").matches("following the leader at").count() >= 2
    });
    assert_eq!(
        leader(),
        (url(port_b), fourth_term),
        "b still leads, in its term"
    );
    let ours = pausing.lock().expect("lock").clone();
    let via_a = Client::with_trust(&url(port_a), &token, &trust).expect("client");
    settled_once(&rt, &via_a, &started, long, &ours, root, fenced_before);
    drop(agents);
    drop(a);
    drop(b);
    postgres.drop_database(&database_name);
}

/// A `--lease` that a takeover would outlast is refused before anything
/// starts, saying what would do (no database is needed to say so).
#[test]
fn a_node_lease_too_short_for_the_leader_lease_is_refused_saying_what_would_do() {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_muster"))
        .args([
            "server",
            "--data-dir",
            dir.path().to_str().expect("utf-8"),
            "--store",
            "postgres://muster@127.0.0.1:1/muster",
            "--lease",
            "10s",
        ])
        .output()
        .expect("muster server runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("--lease 10000 ms is too short for --leader-lease 4000 ms")
            && stderr.contains("give --lease 17000 ms or more"),
        "{stderr}"
    );
}
