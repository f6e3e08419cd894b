//! End to end: task logs through the real binary, loopback only.
//!
//! - Bytes arrive exactly as the task wrote them (invalid UTF-8, a
//!   multi-byte character across every 64 KiB boundary), whole, through
//!   `muster run`, `muster logs` and `muster logs -f`.
//! - A log past `--max-log-bytes` keeps its head and its tail with a marker,
//!   and the server stores no more than the limit.
//! - A task writing as fast as it can for 60 s next to a canary: the node
//!   stays `ready`, the canary keeps running, and the server sees heartbeats
//!   at most twice the nominal interval apart.
//!
//! Every wait is bounded.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

mod common;

use common::cli::{Daemon, Env};
use common::wait_until;

/// The server's default heartbeat interval (`ServerConfig::new`).
const NOMINAL_HEARTBEAT_MS: u64 = 2_000;

impl Env {
    fn json(&self, args: &[&str]) -> serde_json::Value {
        let output = self.muster(args);
        assert!(
            output.status.success(),
            "muster {args:?} failed: {output:?}"
        );
        serde_json::from_slice(&output.stdout).expect("JSON output")
    }

    /// `muster up` with simulated GPUs and `extra` flags.
    fn up(&self, extra: &[&str]) -> Daemon {
        let listen = self.url.trim_start_matches("http://").to_string();
        let data = self.path("up-data");
        let mut args = vec![
            "up",
            "--listen",
            &listen,
            "--data-dir",
            data.to_str().expect("a UTF-8 path"),
            "--simulate-gpus",
            "2xH100-80GB",
        ];
        args.extend_from_slice(extra);
        self.start("up", &args)
    }

    /// A file every task can read (tasks may run as `nobody`).
    fn readable_file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(self.dir.path(), std::fs::Permissions::from_mode(0o711))
            .expect("chmod");
        let dir = self.path("inputs");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let path = dir.join(name);
        std::fs::write(&path, bytes).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        path
    }

    /// The id of the only job, or of the job named in `ps`.
    fn last_job(&self) -> String {
        let jobs = self.json(&["ps", "--all", "--json"]);
        jobs["jobs"]
            .as_array()
            .and_then(|jobs| jobs.iter().filter_map(|j| j["id"].as_u64()).max())
            .expect("a job")
            .to_string()
    }
}

/// `len` bytes from a fixed xorshift generator (so mostly invalid UTF-8),
/// with a euro sign (3 bytes) across every 64 KiB boundary.
fn awkward_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut bytes: Vec<u8> = (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect();
    let mut boundary = 65_536;
    let mut shift = 1;
    while boundary + 2 < len {
        bytes[boundary - shift..boundary - shift + 3].copy_from_slice("€".as_bytes());
        shift = 3 - shift; // 1, 2, 1, 2: both ways of cutting it
        boundary += 65_536;
    }
    bytes
}

fn assert_same_bytes(what: &str, got: &[u8], expected: &[u8]) {
    if got != expected {
        let first = got
            .iter()
            .zip(expected)
            .position(|(a, b)| a != b)
            .unwrap_or(got.len().min(expected.len()));
        panic!(
            "{what}: {} bytes, expected {}; first difference at byte {first}",
            got.len(),
            expected.len()
        );
    }
}

#[test]
fn logs_arrive_byte_identical_and_whole() {
    let env = Env::new();
    let _up = env.up(&[]);
    // 3 MiB and a bit: many agent chunks, several server pages.
    let expected = awkward_bytes(3 * 1024 * 1024 + 123, 7);
    let file = env.readable_file("awkward.bin", &expected);
    let file = file.to_str().expect("a UTF-8 path");

    let output = env.muster(&["run", "--", "cat", file]);
    assert!(output.status.success(), "{output:?}");
    assert_same_bytes("muster run", &output.stdout, &expected);

    let id = env.last_job();
    let output = env.muster(&["logs", &id]);
    assert!(output.status.success(), "{output:?}");
    assert_same_bytes("muster logs", &output.stdout, &expected);
    let output = env.muster(&["logs", "-f", &id]);
    assert!(output.status.success(), "{output:?}");
    assert_same_bytes("muster logs -f", &output.stdout, &expected);
}

/// Splits `head + "\n[muster: N bytes omitted]\n" + tail`.
fn split_marker(text: &[u8], head: usize) -> (u64, &[u8]) {
    let rest = &text[head..];
    let prefix = b"\n[muster: ";
    assert!(rest.starts_with(prefix), "no marker after the head");
    let close = rest
        .windows(b" bytes omitted]\n".len())
        .position(|w| w == b" bytes omitted]\n")
        .expect("the marker ends");
    let number = std::str::from_utf8(&rest[prefix.len()..close])
        .expect("a number")
        .parse::<u64>()
        .expect("a number");
    (number, &rest[close + b" bytes omitted]\n".len()..])
}

fn stored_bytes(path: &Path) -> u64 {
    std::fs::read_dir(path)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| match entry.metadata() {
                    Ok(meta) if meta.is_dir() => stored_bytes(&entry.path()),
                    Ok(meta) => meta.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn a_log_past_the_limit_keeps_head_and_tail() {
    let env = Env::new();
    let _up = env.up(&["--max-log-bytes", "64KiB"]);
    let expected = awkward_bytes(1024 * 1024, 11);
    let file = env.readable_file("big.bin", &expected);
    let output = env.muster(&["run", "--", "cat", file.to_str().expect("a UTF-8 path")]);
    assert!(output.status.success(), "{output:?}");

    let id = env.last_job();
    let output = env.muster(&["logs", &id]);
    assert!(output.status.success(), "{output:?}");
    let got = output.stdout;
    let head = 32 * 1024;
    assert_same_bytes("the head", &got[..head], &expected[..head]);
    let (omitted, tail) = split_marker(&got, head);
    assert!(
        (8 * 1024..=32 * 1024).contains(&tail.len()),
        "between a quarter and half of the limit is kept at the end, not {}",
        tail.len()
    );
    assert_same_bytes("the tail", tail, &expected[expected.len() - tail.len()..]);
    assert_eq!(
        omitted as usize + head + tail.len(),
        expected.len(),
        "the marker counts what is left out"
    );
    // Following reads the same thing, offsets and all.
    let followed = env.muster(&["logs", "-f", &id]);
    assert_same_bytes("muster logs -f", &followed.stdout, &got);
    // The server stores no more than the limit.
    let stored = stored_bytes(&env.path("up-data").join("logs"));
    assert!(stored <= 64 * 1024 + 64, "{stored} bytes stored");
}

#[test]
fn a_task_writing_at_full_speed_does_not_delay_heartbeats() {
    let mut env = Env::new();
    let listen = env.url.trim_start_matches("http://").to_string();
    let data = env.path("server-data");
    let data_arg = data.to_str().expect("a UTF-8 path").to_string();
    let _server = env.start(
        "server",
        &[
            "server",
            "--listen",
            &listen,
            "--data-dir",
            &data_arg,
            "--max-log-bytes",
            "16MiB",
        ],
    );
    let join = data.join("join.token");
    let join = join.to_str().expect("a UTF-8 path");
    let token = std::fs::read_to_string(data.join("admin.token")).expect("admin token");
    env.flags = vec![
        "--server".into(),
        env.url.clone(),
        "--token".into(),
        token.trim().to_string(),
    ];
    let state = env.path("node-a");
    let _agent = env.start(
        "agent",
        &[
            "agent",
            "--server",
            &env.url,
            "--join-token-file",
            join,
            "--name",
            "node-a",
            "--address",
            "127.0.0.1",
            "--simulate-gpus",
            "2xH100-80GB",
            "--state-dir",
            state.to_str().expect("a UTF-8 path"),
        ],
    );
    wait_until("the node", Duration::from_secs(30), || {
        env.json(&["nodes", "--json"])["nodes"]
            .as_array()
            .is_some_and(|nodes| !nodes.is_empty())
    });

    let canary = env.muster(&["run", "--detach", "--gpus", "1", "--", "sleep", "300"]);
    assert!(canary.status.success(), "{canary:?}");
    let canary = String::from_utf8_lossy(&canary.stdout).trim().to_string();
    // As fast as `yes` goes, in bursts of 16 MB, for 60 s: bounded in time
    // and, on the agent's disk, to a few GB.
    let noisy = env.muster(&[
        "run",
        "--detach",
        "--gpus",
        "1",
        "--",
        "sh",
        "-c",
        "end=$(( $(date +%s) + 60 )); \
         while [ \"$(date +%s)\" -lt \"$end\" ]; do yes 'muster noise' | head -c 16000000; sleep 0.2; done",
    ]);
    assert!(noisy.status.success(), "{noisy:?}");
    let noisy = String::from_utf8_lossy(&noisy.stdout).trim().to_string();
    wait_until("both jobs to run", Duration::from_secs(30), || {
        [&canary, &noisy]
            .iter()
            .all(|id| env.json(&["describe", id, "--json"])["state"] == "running")
    });

    let started = Instant::now();
    let mut most_on_disk = 0;
    let mut widest_gap = 0;
    let mut gaps_seen = 0;
    loop {
        let node = env.json(&["nodes", "node-a", "--json"]);
        assert_eq!(node["state"], "ready", "the node left ready: {node}");
        let gaps: Vec<u64> = node["recent_heartbeat_gaps_ms"]
            .as_array()
            .map(|gaps| gaps.iter().filter_map(|g| g.as_u64()).collect())
            .unwrap_or_default();
        gaps_seen = gaps_seen.max(gaps.len());
        widest_gap = widest_gap.max(gaps.iter().copied().max().unwrap_or(0));
        assert!(
            widest_gap <= 2 * NOMINAL_HEARTBEAT_MS,
            "heartbeats {widest_gap} ms apart (nominal {NOMINAL_HEARTBEAT_MS} ms): {gaps:?}"
        );
        // The agent's disk: what the server has is freed in the task's log
        // file as it goes (the file's length stays, so offsets do).
        if let Some((length, on_disk)) = noisy_log_on_agent(&state, &noisy) {
            most_on_disk = most_on_disk.max(on_disk);
            assert!(
                on_disk <= 256 * 1024 * 1024,
                "{on_disk} bytes of a {length}-byte log on the agent's disk (can this \
                 filesystem punch holes?)"
            );
        }
        let canary_state = env.json(&["describe", &canary, "--json"])["state"].clone();
        assert_eq!(canary_state, "running", "the canary stopped");
        let noisy_state = env.json(&["describe", &noisy, "--json"])["state"].clone();
        if noisy_state != "running" {
            assert_eq!(noisy_state, "succeeded");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "the noisy job outlived its 60 s"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        started.elapsed() >= Duration::from_secs(50),
        "the noisy job ran {:?}, not about 60 s",
        started.elapsed()
    );
    assert!(gaps_seen >= 10, "only {gaps_seen} heartbeat gaps seen");
    eprintln!("widest heartbeat gap over the noisy minute: {widest_gap} ms");

    // Its log: the head, a marker, the latest bytes, whole soon after the
    // end (the shipper skips what the server would drop).
    let ended = Instant::now();
    let output = env.muster(&["logs", "-f", &noisy]);
    assert!(output.status.success(), "{output:?}");
    eprintln!(
        "the noisy log was whole {:?} after the job ended",
        ended.elapsed()
    );
    assert!(ended.elapsed() < Duration::from_secs(30));
    let head = 8 * 1024 * 1024;
    assert!(
        output.stdout[..head]
            .chunks(13)
            .all(|line| line == b"muster noise\n" || b"muster noise\n".starts_with(line)),
        "the head is the task's output"
    );
    let (omitted, tail) = split_marker(&output.stdout, head);
    assert!(omitted > 100_000_000, "only {omitted} bytes omitted");
    assert!(
        tail.len() >= 2 * 1024 * 1024,
        "{} bytes of tail",
        tail.len()
    );
    let stored = stored_bytes(&data.join("logs"));
    assert!(stored <= 16 * 1024 * 1024 + 64, "{stored} bytes stored");

    // Once whole on the server, the log leaves the agent's disk.
    assert!(
        noisy_log_on_agent(&state, &noisy).is_none(),
        "the shipped log is still on the agent"
    );
    eprintln!("the noisy task's log on the agent's disk: at most {most_on_disk} bytes");

    let cancelled = env.muster(&["cancel", &canary]);
    assert!(cancelled.status.success(), "{cancelled:?}");
}

/// A server, and how to start an agent (`node-a`) for it that ships logs
/// at no more than a given rate.
struct SlowShipping {
    _server: Daemon,
    agent_args: Vec<String>,
}

impl SlowShipping {
    /// The agent, as the process `name`.
    fn start_agent(&self, env: &Env, name: &'static str) -> Daemon {
        let args: Vec<&str> = self.agent_args.iter().map(String::as_str).collect();
        env.start(name, &args)
    }
}

/// A server whose agent ships at most `log_rate` per second; `env` speaks
/// to the server.
fn server_and_slow_agent(env: &mut Env, log_rate: &str) -> SlowShipping {
    let listen = env.url.trim_start_matches("http://").to_string();
    let data = env.path("server-data");
    let data_arg = data.to_str().expect("a UTF-8 path").to_string();
    let server = env.start(
        "server",
        &["server", "--listen", &listen, "--data-dir", &data_arg],
    );
    let join = data.join("join.token");
    let token = std::fs::read_to_string(data.join("admin.token")).expect("admin token");
    env.flags = vec![
        "--server".into(),
        env.url.clone(),
        "--token".into(),
        token.trim().to_string(),
    ];
    let state = env.path("node-a");
    let agent_args = [
        "agent",
        "--server",
        &env.url,
        "--join-token-file",
        join.to_str().expect("a UTF-8 path"),
        "--name",
        "node-a",
        "--address",
        "127.0.0.1",
        "--simulate-gpus",
        "1xH100-80GB",
        "--state-dir",
        state.to_str().expect("a UTF-8 path"),
        "--log-rate",
        log_rate,
    ];
    SlowShipping {
        _server: server,
        agent_args: agent_args.map(String::from).to_vec(),
    }
}

/// A job that wrote faster than its node ships ends before its log is at
/// the server; `muster logs` after the end still prints all of it.
#[test]
fn logs_read_after_the_end_are_whole_while_the_node_still_sends_them() {
    let mut env = Env::new();
    let cluster = server_and_slow_agent(&mut env, "64KiB");
    let _agent = cluster.start_agent(&env, "agent");
    // 512 KiB at 64 KiB/s: about 8 s of shipping after a task that ends at
    // once (its end reaches the server with the next heartbeat).
    let expected = awkward_bytes(512 * 1024, 17);
    let file = env.readable_file("late.bin", &expected);
    let output = env.muster(&[
        "run",
        "--detach",
        "--",
        "cat",
        file.to_str().expect("UTF-8"),
    ]);
    assert!(output.status.success(), "{output:?}");
    let id = String::from_utf8_lossy(&output.stdout).trim().to_string();
    wait_until("the job to end", Duration::from_secs(30), || {
        env.json(&["describe", &id, "--json"])["state"] == "succeeded"
    });
    let output = env.muster(&["logs", &id]);
    assert!(output.status.success(), "{output:?}");
    assert_same_bytes("muster logs after the end", &output.stdout, &expected);
}

#[test]
fn a_restarted_agent_resumes_shipping_where_the_server_is() {
    let mut env = Env::new();
    // Slow, so that the agent dies halfway through.
    let cluster = server_and_slow_agent(&mut env, "256KiB");
    let agent = cluster.start_agent(&env, "agent");
    let expected = awkward_bytes(2 * 1024 * 1024, 13);
    let file = env.readable_file("restart.bin", &expected);
    let script = format!("cat {}; sleep 3", file.display());
    let output = env.muster(&["run", "--detach", "--", "sh", "-c", &script]);
    assert!(output.status.success(), "{output:?}");
    let id = String::from_utf8_lossy(&output.stdout).trim().to_string();
    wait_until("part of the log to arrive", Duration::from_secs(30), || {
        let shipped = env.muster(&["logs", &id]).stdout.len();
        shipped > 0 && shipped < expected.len() / 2
    });
    drop(agent);
    let _agent = cluster.start_agent(&env, "agent-again");
    let output = env.muster(&["logs", "-f", &id]);
    assert!(output.status.success(), "{output:?}");
    assert_same_bytes("after the agent restart", &output.stdout, &expected);
    let job = env.json(&["describe", &id, "--json"]);
    assert_eq!(job["state"], "succeeded", "{job}");
}

/// The length and the bytes on disk of a job's task log on the agent.
fn noisy_log_on_agent(state_dir: &Path, job: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let prefix = format!("j{job}-");
    std::fs::read_dir(state_dir.join("logs"))
        .ok()?
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with(&prefix))
        .find_map(|entry| entry.metadata().ok())
        .map(|meta| (meta.len(), meta.blocks() * 512))
}

#[test]
fn a_follower_reads_a_retried_job_from_the_start_of_its_new_task() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let _up = env.up(&[]);
    std::fs::set_permissions(env.dir.path(), std::fs::Permissions::from_mode(0o711))
        .expect("chmod");
    let marks = env.path("marks");
    std::fs::create_dir_all(&marks).expect("mkdir");
    std::fs::set_permissions(&marks, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    // The first attempt writes more than the second, then fails; the
    // second reads from its own start.
    let spec = format!(
        "name: retried\n\
         command: \"if [ -e {marks}/first ]; then echo second attempt; else touch {marks}/first; \
         head -c 5000 /dev/zero | tr '\\\\0' x; echo; sleep 2; exit 1; fi\"\n\
         retry:\n  max_attempts: 2\n  on_exit_failure: true\n",
        marks = marks.display()
    );
    let spec_file = env.path("retried.yaml");
    std::fs::write(&spec_file, spec).expect("the spec");
    let output = env.muster(&["submit", spec_file.to_str().expect("a UTF-8 path")]);
    assert!(output.status.success(), "{output:?}");
    let id = String::from_utf8_lossy(&output.stdout).trim().to_string();
    let mut follower = env
        .command()
        .args(["logs", "-f", &id])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("muster logs -f starts");
    let deadline = Instant::now() + Duration::from_secs(60);
    while follower.try_wait().expect("the follower").is_none() {
        assert!(Instant::now() < deadline, "the follower never ended");
        std::thread::sleep(Duration::from_millis(100));
    }
    let output = follower.wait_with_output().expect("the follower's output");
    assert!(output.status.success(), "{output:?}");
    let mut expected = vec![b'x'; 5000];
    expected.extend_from_slice(b"\nsecond attempt\n");
    assert_same_bytes("followed across attempts", &output.stdout, &expected);
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("runs again"),
        "{output:?}"
    );
    let job = env.json(&["describe", &id, "--json"]);
    assert_eq!(job["state"], "succeeded", "{job}");
    // Every attempt's output is kept: the first one's still reads back.
    let first = env.muster(&["logs", "--attempt", "1", &id]);
    assert!(first.status.success(), "{first:?}");
    let mut expected_first = vec![b'x'; 5000];
    expected_first.push(b'\n');
    assert_same_bytes("attempt 1", &first.stdout, &expected_first);
    let second = env.muster(&["logs", "--attempt", "2", &id]);
    assert_same_bytes("attempt 2", &second.stdout, b"second attempt\n");
    let none = env.muster(&["logs", "--attempt", "3", &id]);
    assert_eq!(none.status.code(), Some(3), "{none:?}");
    assert_eq!(job["attempts"], 2, "{job}");
}
