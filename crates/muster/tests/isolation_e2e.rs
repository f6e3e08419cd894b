//! The task runtime as a hostile tenant meets it, with the real binary on
//! loopback: hundreds of short jobs leave no process behind, a job that
//! writes into everything it is given and signals everything it can harms
//! no neighbour, escaped children die with a cancel and with fencing, a
//! frozen agent's tasks are fenced whatever their `PATH`, and a task cannot
//! read the agent's tokens or another job's log; two tenants' tasks on one
//! node cannot reach each other. The tests run as root (as CI does), with
//! the agent's default isolation: each task of a user without an account
//! here runs as a uid of its own, in PID and mount namespaces of its own.
//! Every wait is bounded.

use std::time::{Duration, Instant};

mod common;

use common::cluster::{Cluster, runtime, state, wait_for_nodes, whole_log};
use common::{processes_with, task_writable, wait_until};

/// A shell that sleeps forever, ignoring TERM, with `name` as its `$0` (so
/// it can be found by its command line).
fn sleeper(name: &str) -> String {
    format!("sh -c 'trap \"\" TERM; while :; do sleep 1; done' {name}")
}

/// Shell lines that leave two processes outside the task's process group:
/// one through `setsid`, one through a double fork into a new session.
fn escapes(marker: &str) -> String {
    format!(
        "setsid {a} </dev/null >/dev/null 2>&1 & \
         (setsid sh -c \"{b} & exit 0\" </dev/null >/dev/null 2>&1 &) ;",
        a = sleeper(&format!("{marker}-a")),
        b = sleeper(&format!("{marker}-b")).replace('"', "\\\""),
    )
}

/// A job's (rank 0's) log as text, as far as the server has it.
fn read_log(rt: &tokio::runtime::Runtime, client: &muster_api::client::Client, id: u64) -> String {
    let mut bytes = Vec::new();
    let mut offset = 0;
    while let Ok(page) = rt.block_on(client.logs(id, 0, offset, None, false)) {
        bytes.extend_from_slice(&page.data);
        if page.data.is_empty() || !page.more {
            break;
        }
        offset = page.next_offset;
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// This agent's cgroup directories that exist, in every hierarchy.
fn cgroup_parents(agent_state: &std::path::Path, node: &str) -> Vec<std::path::PathBuf> {
    let name = muster_agent::runtime::cgroup::agent_dir_name(node, agent_state);
    ["freezer", "memory", "cpuacct", "pids", "unified"]
        .iter()
        .map(|hierarchy| {
            std::path::Path::new("/sys/fs/cgroup")
                .join(hierarchy)
                .join("muster")
                .join(&name)
        })
        .filter(|dir| dir.exists())
        .collect()
}

/// Task cgroups left under this agent's directories, in every hierarchy.
fn task_cgroups_left(agent_state: &std::path::Path, node: &str) -> Vec<String> {
    let mut left = Vec::new();
    for dir in cgroup_parents(agent_state, node) {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    left.push(entry.path().display().to_string());
                }
            }
        }
    }
    left
}

#[test]
fn five_hundred_short_jobs_leave_no_process_behind() {
    let cluster = Cluster::start("10s");
    let mut agent = cluster.agent_with("soak", &cluster.url(), "8xH100-80GB", &[]);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let marker = format!("muster-soak-{}", std::process::id());
    // Every tenth job leaves daemons behind it.
    let daemon_job = format!("{} true", escapes(&marker));
    let started = Instant::now();
    let ids: Vec<u64> = rt.block_on(async {
        let mut handles = Vec::new();
        for worker in 0..10u64 {
            let client = client.clone();
            let daemon_job = daemon_job.clone();
            handles.push(tokio::spawn(async move {
                let mut ids = Vec::new();
                for n in 0..50u64 {
                    let command = if (worker * 50 + n) % 10 == 0 {
                        serde_json::json!(["sh", "-c", daemon_job])
                    } else {
                        serde_json::json!(["true"])
                    };
                    let spec = serde_json::json!({"name": "short", "gpus": 1, "command": command});
                    ids.push(client.submit(spec).await.expect("submitted"));
                }
                ids
            }));
        }
        let mut ids = Vec::new();
        for handle in handles {
            ids.extend(handle.await.expect("submitter"));
        }
        ids
    });
    assert_eq!(ids.len(), 500);
    wait_until("500 jobs to succeed", Duration::from_secs(600), || {
        let succeeded = muster_api::client::JobFilter {
            state: Some("succeeded".to_string()),
            ..Default::default()
        };
        rt.block_on(client.all_jobs(&succeeded, None))
            .is_ok_and(|(jobs, _)| jobs.len() == 500)
    });
    eprintln!(
        "500 short jobs through one agent in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let state_dir = cluster.path("soak");
    // A supervisor's command line: muster supervise STATE_DIR KEY.
    let supervisors = format!("supervise\0{}", state_dir.display());
    wait_until(
        "the last supervisors to exit",
        Duration::from_secs(30),
        || processes_with(&supervisors) == 0,
    );
    assert_eq!(processes_with(&marker), 0, "daemons outlived their jobs");
    assert_eq!(
        task_cgroups_left(&state_dir, "soak"),
        Vec::<String>::new(),
        "task cgroups left behind"
    );
    // An agent that stops removes its own cgroup directories too.
    let parents = cgroup_parents(&state_dir, "soak");
    assert!(!parents.is_empty(), "the agent used cgroups");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM the agent");
    wait_until("the agent to stop", Duration::from_secs(30), || {
        agent.0.try_wait().is_ok_and(|status| status.is_some())
    });
    let left: Vec<_> = parents.iter().filter(|dir| dir.exists()).collect();
    assert!(left.is_empty(), "cgroup directories left behind: {left:?}");
}

#[test]
fn a_hostile_job_harms_no_neighbour_and_its_escaped_children_die_with_cancel() {
    hostile_job("auto");
}

/// The same without cgroups: process groups and the supervisor as
/// subreaper must hold as well.
#[test]
fn without_cgroups_a_hostile_job_harms_no_neighbour_and_dies_whole() {
    hostile_job("none");
}

fn hostile_job(cgroups: &str) {
    let cluster = Cluster::start("10s");
    let agent = cluster.agent_with(
        "node",
        &cluster.url(),
        "2xH100-80GB",
        &["--cgroups", cgroups],
    );
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let tag = std::process::id();
    let canary_name = format!("muster-canary-{tag}");
    let canary = serde_json::json!({
        "name": "canary", "gpus": 1,
        "command": ["sh", "-c", "while :; do sleep 0.2; done", canary_name],
    });
    let canary = rt.block_on(client.submit(canary)).expect("submitted");
    wait_until("the canary to run", Duration::from_secs(30), || {
        processes_with(&canary_name) > 0
    });
    let state_dir = cluster.path("node");
    let server_dir = cluster.path("server");
    let marker = format!("muster-hostile-{tag}");
    // Writes into every path its environment names, every file it can find
    // of the agent's and the server's, signals its supervisor, the agent and
    // every process it may, and leaves escaped children.
    let script = format!(
        "for value in $(env | cut -d= -f2-); do \
           case \"$value\" in /*) echo garbage > \"$value\"; chmod 000 \"$value\";; esac; \
         done 2>/dev/null; \
         for file in {state}/fence_at {state}/lease.json {state}/tasks/* {state}/logs/* \
                     {server}/*.token {server}/logs/*; do \
           echo 0 > \"$file\" && echo wrote $file; rm -f \"$file\" && echo removed $file; \
         done 2>/dev/null; \
         kill -STOP $PPID {agent} 2>/dev/null && echo stopped-someone; \
         kill -KILL $PPID {agent} 2>/dev/null && echo killed-someone; \
         {escapes} echo hostile-ready; while :; do sleep 0.2; done",
        state = state_dir.display(),
        server = server_dir.display(),
        agent = agent.pid(),
        escapes = escapes(&marker),
    );
    let hostile =
        serde_json::json!({"name": "hostile", "gpus": 1, "command": ["sh", "-c", script]});
    let hostile = rt.block_on(client.submit(hostile)).expect("submitted");
    wait_until(
        "the hostile job's children",
        Duration::from_secs(30),
        || processes_with(&format!("{marker}-a")) > 0 && processes_with(&format!("{marker}-b")) > 0,
    );
    // Some time to do harm.
    std::thread::sleep(Duration::from_secs(2));
    let node = rt.block_on(client.node("node")).expect("node");
    assert_eq!(node.state, "ready");
    assert_eq!(state(&rt, &client, canary), "running");
    assert!(processes_with(&canary_name) > 0, "the canary runs on");
    let mut log = String::new();
    wait_until("the hostile job's log", Duration::from_secs(30), || {
        log = read_log(&rt, &client, hostile);
        log.contains("hostile-ready")
    });
    for harm in ["wrote", "removed", "stopped-someone", "killed-someone"] {
        assert!(
            !log.contains(harm),
            "the hostile job did harm ({harm}): {log}"
        );
    }

    rt.block_on(client.cancel(hostile)).expect("cancel");
    wait_until(
        "the hostile job to be cancelled",
        Duration::from_secs(30),
        || state(&rt, &client, hostile) == "cancelled",
    );
    assert_eq!(
        processes_with(&marker),
        0,
        "escaped children outlived the cancel"
    );
    assert_eq!(state(&rt, &client, canary), "running");
    rt.block_on(client.cancel(canary)).expect("cancel");
    wait_until(
        "the canary to be cancelled",
        Duration::from_secs(30),
        || state(&rt, &client, canary) == "cancelled",
    );
    assert_eq!(processes_with(&canary_name), 0);
}

#[test]
fn a_frozen_agent_s_task_is_fenced_in_time_whatever_its_path() {
    let cluster = Cluster::start("4s");
    let agent = cluster.agent("node-a", &cluster.url());
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let marker = format!("muster-frozen-{}", std::process::id());
    let script = format!(
        "/usr/bin/setsid /bin/sh -c 'while :; do /bin/sleep 1; done' {marker}-child \
         </dev/null >/dev/null 2>&1 & \
         while :; do /bin/sleep 1; done"
    );
    let spec = serde_json::json!({
        "name": "no-path", "gpus": 1,
        "command": ["/bin/sh", "-c", script, format!("{marker}-leader")],
        "env": {"PATH": "/nonexistent"},
    });
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the task and its child", Duration::from_secs(30), || {
        processes_with(&format!("{marker}-child")) > 0
            && processes_with(&format!("{marker}-leader")) > 0
    });
    assert_eq!(state(&rt, &client, id), "running");
    // The agent hangs: nothing of it runs, it renews nothing.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.pid()),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .expect("SIGSTOP the agent");
    let frozen = Instant::now();
    let mut gone = None;
    let mut lost = None;
    while (gone.is_none() || lost.is_none()) && frozen.elapsed() < Duration::from_secs(30) {
        if gone.is_none() && processes_with(&marker) == 0 {
            gone = Some(frozen.elapsed());
        }
        if lost.is_none()
            && rt
                .block_on(client.node("node-a"))
                .is_ok_and(|node| node.state == "lost")
        {
            lost = Some(frozen.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.pid()),
        nix::sys::signal::Signal::SIGCONT,
    )
    .expect("SIGCONT the agent");
    let gone = gone.expect("the frozen agent's task was never fenced");
    let lost = lost.expect("the server never declared the node lost");
    eprintln!(
        "frozen agent: task and child gone after {:.2} s, node lost after {:.2} s",
        gone.as_secs_f64(),
        lost.as_secs_f64()
    );
    assert!(
        gone <= lost,
        "the task outlived its node's lease: gone after {gone:?}, node lost after {lost:?}"
    );
}

#[test]
fn a_task_cannot_read_the_tokens_or_another_job_s_log() {
    let cluster = Cluster::start("10s");
    // As a real host's /var/lib: traversable, with muster's own modes
    // protecting what is inside.
    let _ = task_writable(cluster.dir.path(), "shared");
    let _agent = cluster.agent_with("node", &cluster.url(), "2xH100-80GB", &[]);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let secret = format!("secret-{}", std::process::id());
    let first = serde_json::json!({"name": "first", "gpus": 1, "command": ["echo", secret]});
    let first = rt.block_on(client.submit(first)).expect("submitted");
    wait_until("the first job to succeed", Duration::from_secs(30), || {
        state(&rt, &client, first) == "succeeded"
    });
    let state_dir = cluster.path("node");
    let server_dir = cluster.path("server");
    let script = format!(
        "id -u; cat {server}/admin.token {server}/join.token {state}/logs/* {server}/logs/* \
         {state}/tasks/* {state}/lease.json; ls {state} {server}; exit 0",
        state = state_dir.display(),
        server = server_dir.display(),
    );
    let nosy = serde_json::json!({"name": "nosy", "gpus": 1, "command": ["sh", "-c", script]});
    let nosy = rt.block_on(client.submit(nosy)).expect("submitted");
    wait_until("the nosy job to end", Duration::from_secs(30), || {
        state(&rt, &client, nosy) == "succeeded"
    });
    // All of it: a leak in the last line counts.
    let log = whole_log(&rt, &client, nosy, 0);
    let uid: u32 = log
        .lines()
        .next()
        .and_then(|line| line.parse().ok())
        .unwrap_or_else(|| panic!("no uid first: {log}"));
    assert!((200_000..=299_999).contains(&uid), "not a task uid: {log}");
    assert!(log.contains("Permission denied"), "{log}");
    for token in [
        cluster.token("admin.token"),
        cluster.token("join.token"),
        secret,
    ] {
        assert!(!log.contains(&token), "the task read {token}: {log}");
    }
}

#[test]
fn a_job_over_its_memory_says_it_was_killed_by_the_memory_limit() {
    let cluster = Cluster::start("10s");
    let _agent = cluster.agent_with("node", &cluster.url(), "1xH100-80GB", &[]);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let spec = serde_json::json!({
        "name": "hungry", "gpus": 1, "memory": "32MiB",
        "command": ["dd", "if=/dev/zero", "of=/dev/null", "bs=256M", "count=1"],
    });
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the job to fail", Duration::from_secs(30), || {
        state(&rt, &client, id) == "failed"
    });
    let job = rt.block_on(client.job(id)).expect("job");
    let notes: Vec<&str> = job.history.iter().map(|e| e.what.as_str()).collect();
    assert_eq!(
        notes.last(),
        Some(&"failed: killed by the memory limit"),
        "{notes:?}"
    );
}

/// The pid of the shell named `marker` (`sh -c ... MARKER`), as the host
/// sees it: the task's command, not its init (whose command line names it
/// too).
fn shell_named(marker: &str) -> Option<i32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<i32>().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let arguments: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            (arguments.first() == Some(&b"sh".as_slice()) && arguments.contains(&marker.as_bytes()))
                .then_some(pid)
        })
}

/// Alice and Bob, users with no account on the node, share it; from inside
/// Bob's task every way into Alice's that a shared uid gave is refused:
/// her task's environment (her secret), its memory, `ptrace`, `kill -9`,
/// her files in `/tmp`, and the agent's files. Her job runs on, her secret
/// is nowhere in his output, and his task sees none of her processes.
/// Two ordinary users, Alice and Bob, with no account on the node: their
/// clients.
fn alice_and_bob(
    cluster: &Cluster,
    rt: &tokio::runtime::Runtime,
    admin: &muster_api::client::Client,
) -> (muster_api::client::Client, muster_api::client::Client) {
    let client_of = |name: &str| {
        let token = rt
            .block_on(admin.add_user(&muster_api::protocol::UserCreate {
                name: name.to_string(),
                role: "user".to_string(),
                queues: Vec::new(),
            }))
            .expect("a user")
            .token;
        cluster.client_with(&cluster.url(), &token)
    };
    (client_of("alice"), client_of("bob"))
}

#[test]
fn two_tenants_on_one_node_cannot_reach_each_other() {
    let cluster = Cluster::start("10s");
    let _agent = cluster.agent_with("node", &cluster.url(), "2xH100-80GB", &[]);
    let rt = runtime();
    let admin = cluster.client();
    wait_for_nodes(&rt, &admin, 1);
    let (alice, bob) = alice_and_bob(&cluster, &rt, &admin);
    let tag = std::process::id();
    let marker = format!("muster-alice-{tag}");
    let secret = format!("hf_alice_{tag}");
    let script = format!(
        "echo {secret} > /tmp/{marker}; chmod 644 /tmp/{marker}; \
         exec sh -c 'while :; do sleep 0.2; done' {marker}"
    );
    let hers = serde_json::json!({
        "name": "hers", "gpus": 1,
        "command": ["sh", "-c", script],
        "env": {"HF_TOKEN": secret},
    });
    let hers = rt.block_on(alice.submit(hers)).expect("alice submits");
    let mut her_pid = None;
    wait_until("alice's task", Duration::from_secs(30), || {
        her_pid = shell_named(&marker);
        her_pid.is_some()
    });
    let her_pid = her_pid.expect("alice's pid");
    let state_dir = cluster.path("node");
    let script = format!(
        "echo uid $(id -u); \
         cat /proc/{her_pid}/environ && echo read-environ; \
         tr '\\0' '\\n' < /proc/{her_pid}/environ | grep HF_TOKEN && echo read-environ; \
         cat /tmp/{marker} && echo read-tmp; \
         dd if=/proc/{her_pid}/mem bs=1 count=1 skip=4194304 2>/dev/null && echo read-mem; \
         kill -9 {her_pid} && echo killed-her; \
         python3 -c 'import ctypes, sys; \
           sys.exit(0 if ctypes.CDLL(None).ptrace(16, {her_pid}, 0, 0) == 0 else 1)' \
           && echo attached; \
         cat {state}/tasks/* {state}/node.credential && echo read-agent; \
         ls /proc/{her_pid} >/dev/null 2>&1 && echo sees-her; \
         echo processes $(ls /proc | grep -c '^[0-9]'); \
         echo bob-done",
        state = state_dir.display(),
    );
    let his = serde_json::json!({"name": "his", "gpus": 1, "command": ["sh", "-c", script]});
    let his = rt.block_on(bob.submit(his)).expect("bob submits");
    wait_until("bob's job to end", Duration::from_secs(60), || {
        state(&rt, &bob, his) == "succeeded"
    });
    let log = whole_log(&rt, &bob, his, 0);
    assert!(log.contains("bob-done"), "{log}");
    for harm in [
        "read-environ",
        "read-tmp",
        "read-mem",
        "killed-her",
        "attached",
        "read-agent",
        "sees-her",
        secret.as_str(),
    ] {
        assert!(!log.contains(harm), "bob reached alice ({harm}): {log}");
    }
    let processes: usize = log
        .lines()
        .find_map(|line| line.strip_prefix("processes "))
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or_else(|| panic!("no process count: {log}"));
    assert!(processes <= 6, "bob sees the node's processes: {log}");
    assert_eq!(state(&rt, &alice, hers), "running", "alice's job runs on");
    assert_eq!(shell_named(&marker), Some(her_pid));
    // Bob cannot even name her job.
    assert!(rt.block_on(bob.job(hers)).is_err());
    rt.block_on(alice.cancel(hers)).expect("alice cancels");
    wait_until("alice's job to end", Duration::from_secs(30), || {
        state(&rt, &alice, hers) == "cancelled"
    });
    assert_eq!(processes_with(&marker), 0);
}

/// The limits through the CLI: `muster queues set` changes only the flags
/// given (a `--budget` once reset the guarantee and borrow limit), and so
/// does `muster users set`; a user's submission past the queue's priority
/// class or its own cap is refused with the reason, and nothing is
/// submitted.
#[test]
fn limits_are_set_field_by_field_and_refuse_what_passes_them() {
    let cluster = Cluster::start("10s");
    let rt = runtime();
    let admin = cluster.client();
    let connection = |token: &str| {
        vec![
            "--server".to_string(),
            cluster.url(),
            "--token".to_string(),
            token.to_string(),
            "--ca-sha256".to_string(),
            cluster.ca_sha256(),
        ]
    };
    let admin_token = cluster.token("admin.token");
    let cli = |token: &str, args: &[&str]| {
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.extend(connection(token));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        common::muster(cluster.dir.path(), &all)
    };
    common::success(&cli(
        &admin_token,
        &[
            "queues",
            "set",
            "team-a",
            "--guaranteed",
            "8",
            "--borrow-limit",
            "4",
            "--weight",
            "3",
        ],
    ));
    common::success(&cli(
        &admin_token,
        &["queues", "set", "team-a", "--budget", "5000"],
    ));
    common::success(&cli(
        &admin_token,
        &[
            "queues",
            "set",
            "team-a",
            "--max-priority-class",
            "high",
            "--max-pending",
            "40",
        ],
    ));
    let queue = || {
        rt.block_on(admin.queues())
            .expect("queues")
            .queues
            .into_iter()
            .find(|queue| queue.name == "team-a")
            .expect("team-a")
    };
    let team = queue();
    assert_eq!(team.guaranteed_gpus, 8.0, "{team:?}");
    assert_eq!(team.borrow_limit_gpus, Some(4.0), "{team:?}");
    assert_eq!(team.weight, 3);
    assert_eq!(team.budget, Some(5000.0));
    assert_eq!(team.max_priority_class, "high");
    assert_eq!(team.max_pending, Some(40));
    // `unlimited` clears a limit; nothing else moves.
    common::success(&cli(
        &admin_token,
        &["queues", "set", "team-a", "--borrow-limit", "unlimited"],
    ));
    let team = queue();
    assert_eq!((team.borrow_limit_gpus, team.guaranteed_gpus), (None, 8.0));
    assert_eq!(team.max_pending, Some(40));

    let made = common::success(&cli(
        &admin_token,
        &["users", "add", "bob", "--queues", "team-a"],
    ));
    let bob = made.trim().to_string();
    common::success(&cli(
        &admin_token,
        &["users", "set", "bob", "--max-pending", "3"],
    ));
    let spec = cluster.path("array.yaml");
    std::fs::write(
        &spec,
        "name: sweep\nqueue: team-a\ngpus: 1\ncommand: [sleep, '60']\narray: 0-3\n",
    )
    .expect("a spec");
    let spec = spec.to_str().expect("utf-8").to_string();
    let refused = common::failure(&cli(&bob, &["submit", "--allow-pending", &spec]));
    assert!(
        refused.contains("at most 3") && refused.contains("this submission of 4"),
        "{refused}"
    );
    let urgent = cluster.path("urgent.yaml");
    std::fs::write(
        &urgent,
        "name: urgent\nqueue: team-a\ngpus: 1\npriority_class: critical\ncommand: [true]\n",
    )
    .expect("a spec");
    let refused = common::failure(&cli(
        &bob,
        &["submit", "--allow-pending", urgent.to_str().expect("utf-8")],
    ));
    assert!(refused.contains("priority_class critical"), "{refused}");
    assert!(
        rt.block_on(admin.jobs(&Default::default()))
            .expect("jobs")
            .jobs
            .is_empty(),
        "nothing was submitted"
    );
    // `users set` without a flag keeps the limit.
    common::success(&cli(&admin_token, &["users", "set", "bob"]));
    let users = rt.block_on(admin.users()).expect("users");
    let bob_view = users.users.iter().find(|u| u.name == "bob").expect("bob");
    assert_eq!(bob_view.max_pending, Some(3));
}

/// Bob's task takes the port Alice's next job will be given (ports are
/// predictable on the host network): her job's start fails at once, saying
/// which port and that Bob's job holds it, instead of her task dying later
/// with `Address already in use`.
#[test]
fn a_port_taken_by_a_neighbour_fails_the_start_naming_its_job() {
    let cluster = Cluster::start("10s");
    let _agent = cluster.agent_with("node", &cluster.url(), "2xH100-80GB", &[]);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    // Bob's job is 1; Alice's will be 2.
    let port = cluster.master_port(2);
    let squat = format!(
        "import socket, time\n\
         s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(1)\n\
         print('squatting', flush=True)\n\
         time.sleep(120)\n"
    );
    let squatter = serde_json::json!({
        "name": "squatter", "gpus": 1, "command": ["python3", "-c", squat],
    });
    let squatter = rt.block_on(client.submit(squatter)).expect("submitted");
    assert_eq!(squatter, 1);
    let mut log = String::new();
    wait_until("the squatter to listen", Duration::from_secs(30), || {
        log = read_log(&rt, &client, squatter);
        log.contains("squatting")
    });
    let hers = serde_json::json!({"name": "hers", "gpus": 1, "command": ["sleep", "60"]});
    let hers = rt.block_on(client.submit(hers)).expect("submitted");
    assert_eq!(hers, 2);
    wait_until("her job to fail", Duration::from_secs(30), || {
        state(&rt, &client, hers) == "failed"
    });
    // A start that failed is exit code 127, its reason in the task's log.
    let job = rt.block_on(client.job(hers)).expect("job");
    assert_eq!(job.exit_code, Some(127), "{job:?}");
    let said = whole_log(&rt, &client, hers, 0);
    assert!(
        said.contains(&format!("port {port}")) && said.contains("job 1's task"),
        "{said}"
    );
    assert_eq!(state(&rt, &client, squatter), "running");
    rt.block_on(client.cancel(squatter)).expect("cancel");
}

#[test]
fn the_dashboard_keeps_a_session_id_in_a_secure_cookie_never_the_token() {
    let cluster = Cluster::start("10s");
    let admin = cluster.token("admin.token");
    let rt = runtime();
    muster_api::tls::provider();
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        // The cluster's own CA: this test reads headers, not names.
        .tls_danger_accept_invalid_certs(true)
        .build()
        .expect("a client");
    let url = cluster.url();
    let signed_in = rt
        .block_on(http.get(format!("{url}/ui/jobs?token={admin}")).send())
        .expect("an answer");
    assert_eq!(signed_in.status(), 303);
    let headers = signed_in.headers();
    let cookie = headers["set-cookie"].to_str().expect("text").to_string();
    assert!(cookie.starts_with("muster_session="), "{cookie}");
    assert!(
        !cookie.contains(&admin),
        "the token in the cookie: {cookie}"
    );
    for attribute in ["HttpOnly", "SameSite=Strict", "Secure"] {
        assert!(cookie.contains(attribute), "{attribute}: {cookie}");
    }
    assert_eq!(headers["cache-control"], "no-store");
    assert!(
        headers["strict-transport-security"]
            .to_str()
            .expect("text")
            .contains("max-age="),
    );
    let session = cookie.split(';').next().expect("a pair").to_string();
    let page = rt
        .block_on(
            http.get(format!("{url}/ui/nodes"))
                .header("cookie", &session)
                .send(),
        )
        .expect("an answer");
    assert_eq!(page.status(), 200);
    assert!(page.headers().contains_key("strict-transport-security"));
    // The token where the session id belongs opens nothing.
    let page = rt
        .block_on(
            http.get(format!("{url}/ui/nodes"))
                .header("cookie", format!("muster_session={admin}"))
                .send(),
        )
        .expect("an answer");
    assert_eq!(page.status(), 401);
}

/// Bob's task against Alice's dev environment on the same node: her
/// session helper's token is nowhere he can read, and a connection to its
/// port without it gets no shell. Alice's environment runs on; as an
/// ordinary user she could start it at all (non-preemptible, as `muster dev
/// start` makes it, in a queue that takes no other non-preemptible work).
#[test]
fn a_neighbour_cannot_take_a_shell_in_another_user_s_dev_environment() {
    let cluster = Cluster::start("10s");
    let _agent = cluster.agent_with("node", &cluster.url(), "2xH100-80GB", &[]);
    let rt = runtime();
    let admin = cluster.client();
    wait_for_nodes(&rt, &admin, 1);
    let (alice, bob) = alice_and_bob(&cluster, &rt, &admin);
    let dev = serde_json::json!({
        "name": "her-box", "gpus": 1,
        "command": [muster_model::DEV_SESSION_COMMAND],
        "preemptible": false,
    });
    let hers = rt
        .block_on(alice.submit(dev))
        .expect("alice starts her environment");
    let port = cluster.master_port(hers);
    wait_until("alice's session helper", Duration::from_secs(30), || {
        state(&rt, &alice, hers) == "running"
            && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    // Everything Bob can try from inside his task: find the token in any
    // environment he can read, then ask her helper for a shell with a
    // guess and with no token at all.
    let attack = format!(
        "import glob, json, socket\n\
         found = 0\n\
         for path in glob.glob('/proc/*/environ'):\n\
         \x20   try:\n\
         \x20       if b'MUSTER_DEV_TOKEN=' in open(path, 'rb').read(): found += 1\n\
         \x20   except OSError: pass\n\
         print('tokens-found', found)\n\
         for token in ['0' * 64, '']:\n\
         \x20   try:\n\
         \x20       s = socket.create_connection(('127.0.0.1', {port}), timeout=5)\n\
         \x20       s.sendall((json.dumps({{'token': token, 'kind': 'shell'}}) + '\\n').encode())\n\
         \x20       s.sendall(b'echo got-a-shell; id\\n')\n\
         \x20       answer = s.recv(4096)\n\
         \x20       print('answer', answer)\n\
         \x20       if answer.startswith(b'ok'): print('shell-opened')\n\
         \x20   except OSError as error: print('connect', error)\n\
         print('bob-done')\n"
    );
    let his = serde_json::json!({"name": "his", "gpus": 1, "command": ["python3", "-c", attack]});
    let his = rt.block_on(bob.submit(his)).expect("bob submits");
    wait_until("bob's job to end", Duration::from_secs(60), || {
        matches!(state(&rt, &bob, his).as_str(), "succeeded" | "failed")
    });
    let log = whole_log(&rt, &bob, his, 0);
    assert!(log.contains("bob-done"), "{log}");
    assert!(
        log.contains("tokens-found 0"),
        "bob read a dev token: {log}"
    );
    assert!(!log.contains("shell-opened"), "bob got her shell: {log}");
    assert!(!log.contains("got-a-shell\n"), "{log}");
    assert!(log.contains("refused: wrong token"), "{log}");
    assert_eq!(
        state(&rt, &alice, hers),
        "running",
        "her environment runs on"
    );
    rt.block_on(alice.cancel(hers)).expect("alice stops it");
}
