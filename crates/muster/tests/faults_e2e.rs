//! Faults injected into real processes on loopback: the server killed with
//! SIGKILL during a burst of submissions, an agent killed while it runs a
//! job, and an agent cut off from the server by a TCP proxy that stops
//! forwarding (a partition of its traffic). Every wait is bounded.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;

use common::cluster::{Cluster, runtime, state, wait_for_nodes};
use common::{processes_with, wait_until};

#[test]
fn a_server_killed_during_a_burst_loses_no_acknowledged_job() {
    let mut cluster = Cluster::start("10s");
    let rt = runtime();
    let client = cluster.client();
    let acknowledged: Arc<Mutex<Vec<u64>>> = Arc::default();
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let client = client.clone();
            let acknowledged = Arc::clone(&acknowledged);
            rt.spawn(async move {
                for _ in 0..40 {
                    let spec = serde_json::json!({"name": "burst", "command": ["true"], "gpus": 8});
                    match client.submit(spec).await {
                        Ok(id) => acknowledged.lock().unwrap().push(id),
                        Err(_) => break,
                    }
                }
            })
        })
        .collect();
    wait_until("some acknowledgements", Duration::from_secs(30), || {
        acknowledged.lock().unwrap().len() >= 100
    });
    // SIGKILL in the middle of the burst.
    drop(cluster.server.take());
    for task in tasks {
        let _ = rt.block_on(task);
    }
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert!(acknowledged.len() >= 100);
    cluster.start_server();
    // Every job, page by page.
    let (jobs, _) = rt
        .block_on(cluster.client().all_jobs(&Default::default(), None))
        .expect("jobs listed");
    let mut ids: Vec<u64> = jobs.iter().map(|j| j.id).collect();
    ids.sort_unstable();
    let before = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), before, "no job appears twice");
    for id in &acknowledged {
        assert!(ids.binary_search(id).is_ok(), "acknowledged job {id} lost");
    }
}

#[test]
fn a_killed_agent_s_job_is_requeued_and_completes_elsewhere() {
    let cluster = Cluster::start("3s");
    let url = cluster.url();
    let mut a = Some(cluster.agent("node-a", &url));
    let _b = cluster.agent("node-b", &url);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 2);
    // Keep node-b out at first, so the job lands on node-a.
    rt.block_on(client.node_action("node-b", "cordon"))
        .expect("cordon");
    let spec = serde_json::json!({"name": "victim", "gpus": 1, "command": ["sleep", "3"]});
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the job to run", Duration::from_secs(30), || {
        state(&rt, &client, id) == "running"
    });
    rt.block_on(client.node_action("node-b", "uncordon"))
        .expect("uncordon");
    let killed = Instant::now();
    drop(a.take()); // SIGKILL
    wait_until("node-a to be lost", Duration::from_secs(30), || {
        rt.block_on(client.node("node-a"))
            .is_ok_and(|node| node.state == "lost")
    });
    let detected = killed.elapsed();
    wait_until("the job to run again", Duration::from_secs(30), || {
        rt.block_on(client.job(id))
            .is_ok_and(|j| j.attempts >= 2 && j.state != "pending")
    });
    let requeued = killed.elapsed();
    wait_until("the job to succeed", Duration::from_secs(30), || {
        state(&rt, &client, id) == "succeeded"
    });
    let job = rt.block_on(client.job(id)).expect("job");
    assert_eq!(job.tasks[0].node, "node-b");
    eprintln!(
        "lease 3s: node loss detected after {:.1}s, job running again after {:.1}s",
        detected.as_secs_f64(),
        requeued.as_secs_f64()
    );
    assert!(
        requeued < Duration::from_secs(3 + 5),
        "re-queued within lease + 5 s"
    );
}

/// Forwards TCP connections to `target` until cut; then drops every
/// connection and refuses new ones until healed.
struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
}

impl Proxy {
    fn start(target: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listens");
        let port = listener.local_addr().expect("address").port();
        let cut = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&cut);
        std::thread::spawn(move || {
            for inbound in listener.incoming().flatten() {
                if flag.load(Ordering::SeqCst) {
                    let _ = inbound.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(outbound) = TcpStream::connect(&target) else {
                    continue;
                };
                for (mut from, mut to) in [
                    (inbound.try_clone(), outbound.try_clone()),
                    (outbound.try_clone(), inbound.try_clone()),
                ]
                .into_iter()
                .filter_map(|(a, b)| Some((a.ok()?, b.ok()?)))
                {
                    let flag = Arc::clone(&flag);
                    std::thread::spawn(move || {
                        let _ = from.set_read_timeout(Some(Duration::from_millis(100)));
                        let mut buffer = [0u8; 16 * 1024];
                        loop {
                            if flag.load(Ordering::SeqCst) {
                                break;
                            }
                            match from.read(&mut buffer) {
                                Ok(0) => break,
                                Ok(n) => {
                                    if to.write_all(&buffer[..n]).is_err() {
                                        break;
                                    }
                                }
                                Err(e)
                                    if e.kind() == std::io::ErrorKind::WouldBlock
                                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                                Err(_) => break,
                            }
                        }
                        let _ = from.shutdown(Shutdown::Both);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Proxy { port, cut }
    }
}

#[test]
fn a_partitioned_agent_fences_its_task_before_the_job_runs_elsewhere() {
    let cluster = Cluster::start("4s");
    let proxy = Proxy::start(cluster.address.clone());
    let _a = cluster.agent("node-a", &format!("https://127.0.0.1:{}", proxy.port));
    let _b = cluster.agent("node-b", &cluster.url());
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 2);
    rt.block_on(client.node_action("node-b", "cordon"))
        .expect("cordon");
    // One file for every run: the runs have different task uids, and each
    // appends to what the earlier one left through the user's group.
    let log = common::task_writable(cluster.dir.path(), "out").join("runs.log");
    let script = format!(
        "echo start $(date +%s%N) >> {log}; \
         trap 'echo stop $(date +%s%N) >> {log}; exit 143' TERM; \
         sleep 6 & wait $!; echo stop $(date +%s%N) >> {log}",
        log = log.display()
    );
    let spec = serde_json::json!({
        "name": "fenced", "gpus": 1, "command": ["bash", "-c", script],
        "checkpoint": {"grace_period": "2s"}
    });
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the job to run on node-a", Duration::from_secs(30), || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("start"))
    });
    rt.block_on(client.node_action("node-b", "uncordon"))
        .expect("uncordon");
    proxy.cut.store(true, Ordering::SeqCst);
    wait_until("the job to run again", Duration::from_secs(40), || {
        rt.block_on(client.job(id)).is_ok_and(|j| j.attempts >= 2)
    });
    proxy.cut.store(false, Ordering::SeqCst);
    wait_until("the job to succeed", Duration::from_secs(40), || {
        state(&rt, &client, id) == "succeeded"
    });
    // The workload's own log: runs never overlapped.
    let text = std::fs::read_to_string(&log).expect("runs log");
    let mut events: Vec<(&str, u128)> = text
        .lines()
        .filter_map(|line| {
            let (what, at) = line.split_once(' ')?;
            Some((what, at.trim().parse().ok()?))
        })
        .collect();
    // The fenced run may get its stop signal twice (the agent's fencing and
    // its supervisor's deadline, milliseconds apart), and its trap then
    // writes "stop" twice: one run still, the first stop counts.
    events.dedup_by(|later, earlier| later.0 == "stop" && earlier.0 == "stop");
    assert_eq!(
        events.iter().map(|e| e.0).collect::<Vec<_>>(),
        vec!["start", "stop", "start", "stop"],
        "{text}"
    );
    assert!(
        events[1].1 <= events[2].1,
        "the fenced run stopped before the new one started: {text}"
    );
    eprintln!(
        "partition: first run stopped {:.1}s before the second started",
        (events[2].1 - events[1].1) as f64 / 1e9
    );
}

#[test]
fn running_jobs_keep_running_across_a_server_restart() {
    let mut cluster = Cluster::start("10s");
    let url = cluster.url();
    let _a = cluster.agent("node-a", &url);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let marker = common::task_writable(cluster.dir.path(), "out").join("done");
    let script = format!("sleep 3; touch {}", marker.display());
    let spec = serde_json::json!({"name": "survivor", "gpus": 1, "command": ["sh", "-c", script]});
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the job to run", Duration::from_secs(30), || {
        state(&rt, &client, id) == "running"
    });
    // SIGKILL the server while the job runs; the agent keeps its task.
    drop(cluster.server.take());
    std::thread::sleep(Duration::from_millis(500));
    cluster.start_server();
    let client = cluster.client();
    wait_until("the job to succeed", Duration::from_secs(30), || {
        state(&rt, &client, id) == "succeeded"
    });
    let job = rt.block_on(client.job(id)).expect("job");
    assert_eq!(job.attempts, 1, "it ran once, through the restart");
    assert!(marker.exists());
}

#[test]
fn a_restarted_agent_re_attaches_to_its_running_task() {
    let cluster = Cluster::start("10s");
    let url = cluster.url();
    let mut agent = Some(cluster.agent("node-a", &url));
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let spec = serde_json::json!({"name": "adopted", "gpus": 1, "command": ["sh", "-c", "sleep 3; exit 7"]});
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the job to run", Duration::from_secs(30), || {
        state(&rt, &client, id) == "running"
    });
    drop(agent.take()); // SIGKILL the agent; its task runs on
    agent = Some(cluster.agent("node-a", &url));
    wait_until("the job to end", Duration::from_secs(30), || {
        state(&rt, &client, id) == "failed"
    });
    let job = rt.block_on(client.job(id)).expect("job");
    assert_eq!(job.attempts, 1, "re-attached, not run again");
    assert_eq!(
        job.exit_code,
        Some(7),
        "the exit code survives the agent restart"
    );
    drop(agent);
}

#[test]
fn a_dead_agent_s_task_fences_itself_before_the_job_runs_elsewhere() {
    let cluster = Cluster::start("4s");
    let url = cluster.url();
    let mut a = Some(cluster.agent("node-a", &url));
    let _b = cluster.agent("node-b", &url);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 2);
    rt.block_on(client.node_action("node-b", "cordon"))
        .expect("cordon");
    // One file for every run: the runs have different task uids, and each
    // appends to what the earlier one left through the user's group.
    let log = common::task_writable(cluster.dir.path(), "out").join("runs.log");
    let marker = format!("muster-orphan-{}", std::process::id());
    let script = format!(
        "echo start $(date +%s%N) >> {log}; exec -a {marker} sleep 8",
        log = log.display()
    );
    let spec = serde_json::json!({"name": "orphan", "gpus": 1, "command": ["bash", "-c", script]});
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the task on node-a", Duration::from_secs(30), || {
        processes_with(&marker) > 0
    });
    rt.block_on(client.node_action("node-b", "uncordon"))
        .expect("uncordon");
    drop(a.take()); // SIGKILL: nobody is left to stop the task but itself
    wait_until(
        "the orphaned task to fence itself",
        Duration::from_secs(30),
        || processes_with(&marker) == 0,
    );
    let gone = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    wait_until(
        "the job to succeed elsewhere",
        Duration::from_secs(40),
        || state(&rt, &client, id) == "succeeded",
    );
    let text = std::fs::read_to_string(&log).expect("runs log");
    let starts: Vec<u128> = text
        .lines()
        .filter_map(|l| l.strip_prefix("start ")?.trim().parse().ok())
        .collect();
    assert_eq!(starts.len(), 2, "{text}");
    assert!(
        gone <= starts[1],
        "the orphan was gone before the second run started"
    );
    let job = rt.block_on(client.job(id)).expect("job");
    assert_eq!(job.tasks[0].node, "node-b");
}
