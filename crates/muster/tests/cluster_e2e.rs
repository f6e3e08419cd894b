//! End to end: the real `muster` binary, real processes, loopback only.
//! `muster up` runs jobs; a server with three agents runs a gang; bad input
//! gets clear errors. Every wait is bounded.

use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

mod common;

use common::cli::{Daemon, Env};
use common::processes_with;

impl Env {
    /// `muster server` on this environment's address, up; and its data
    /// directory.
    fn start_server(&self) -> (Daemon, PathBuf) {
        let listen = self.url.trim_start_matches("http://").to_string();
        let data = self.path("server-data");
        let server = self.start(
            "server",
            &[
                "server",
                "--listen",
                &listen,
                "--data-dir",
                data.to_str().expect("a UTF-8 path"),
            ],
        );
        (server, data)
    }
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn json(output: &Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "muster failed: {}{}",
        stdout(output),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON output")
}

#[test]
fn muster_up_runs_jobs_end_to_end() {
    let env = Env::new();
    let listen = env.url.trim_start_matches("http://").to_string();
    let data = env.path("up-data");
    let mut up = env.spawn(
        "up",
        &[
            "up",
            "--listen",
            &listen,
            "--data-dir",
            data.to_str().unwrap(),
            "--simulate-gpus",
            "2xH100-80GB",
        ],
    );
    env.wait_for_api(&mut up);

    // A job runs, succeeds, and its output comes back; the CLI needs no flags.
    let output = env.muster(&[
        "run",
        "--gpus",
        "1",
        "--",
        "sh",
        "-c",
        "echo hello from rank $MUSTER_NODE_RANK on GPU $CUDA_VISIBLE_DEVICES",
    ]);
    assert!(output.status.success(), "{output:?}");
    assert!(
        stdout(&output).contains("hello from rank 0 on GPU 0"),
        "{output:?}"
    );

    // A failing command is reported failed with its exit code.
    let output = env.muster(&["run", "--", "sh", "-c", "echo failing; exit 3"]);
    assert_eq!(output.status.code(), Some(3), "{output:?}");

    let jobs = json(&env.muster(&["ps", "--all", "--json"]));
    let jobs = jobs["jobs"].as_array().expect("a list");
    assert_eq!(jobs.len(), 2);
    let failed = jobs
        .iter()
        .find(|j| j["state"] == "failed")
        .expect("a failed job");
    assert_eq!(failed["exit_code"], 3);
    let id = failed["id"].as_u64().unwrap().to_string();
    let described = json(&env.muster(&["describe", &id, "--json"]));
    assert_eq!(described["tasks"][0]["exit_code"], 3);
    let text = stdout(&env.muster(&["describe", &id]));
    assert!(text.contains("exit code: 3"), "{text}");
    let logs = stdout(&env.muster(&["logs", &id]));
    assert!(logs.contains("failing"), "{logs}");

    // Cancel stops a running job's whole process group.
    let marker = format!("muster-e2e-{}", std::process::id());
    let script = format!("sleep 1000 & exec -a {marker} sleep 1000");
    let output = env.muster(&["run", "--detach", "--", "bash", "-c", &script]);
    let id = stdout(&output).trim().to_string();
    common::wait_until("the job to run", Duration::from_secs(30), || {
        json(&env.muster(&["describe", &id, "--json"]))["state"] == "running"
            && processes_with(&marker) > 0
    });
    let output = env.muster(&["cancel", &id]);
    assert!(output.status.success(), "{output:?}");
    common::wait_until("the job to be cancelled", Duration::from_secs(30), || {
        json(&env.muster(&["describe", &id, "--json"]))["state"] == "cancelled"
    });
    common::wait_until("its processes to be gone", Duration::from_secs(30), || {
        processes_with(&marker) == 0
    });

    // No `--` needed before a command whose arguments follow it.
    let output = env.muster(&["run", "echo", "no", "dashes", "--needed"]);
    assert!(output.status.success(), "{output:?}");
    assert!(stdout(&output).contains("no dashes --needed"), "{output:?}");

    // The submitter's environment reaches the job (as `srun --export=ALL`):
    // a tool found only through this shell's PATH (a virtualenv, say) runs
    // by its bare name, and an exported variable arrives; `--export NONE`
    // keeps them home.
    let venv = common::task_writable(env.dir.path(), "venv-bin");
    let tool = venv.join("hello-tool");
    std::fs::write(&tool, "#!/bin/sh\necho \"tool says $MYVAR\"\n").unwrap();
    std::fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        venv.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = env
        .command()
        .env("PATH", &path)
        .env("MYVAR", "hello")
        .args(["run", "--", "hello-tool"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert!(stdout(&output).contains("tool says hello"), "{output:?}");
    let output = env
        .command()
        .env("MYVAR", "hello")
        .args([
            "run",
            "--export",
            "NONE",
            "--",
            "sh",
            "-c",
            "echo \"[$MYVAR]\"",
        ])
        .output()
        .unwrap();
    assert!(stdout(&output).contains("[]"), "{output:?}");

    // Cancel by name: every unfinished job of that name.
    for _ in 0..2 {
        let output = env.muster(&["run", "--detach", "--name", "napper", "--", "sleep", "60"]);
        assert!(output.status.success(), "{output:?}");
    }
    let output = env.muster(&["cancel", "--name", "napper", "--json"]);
    assert!(output.status.success(), "{output:?}");
    let cancelled = json(&output);
    assert_eq!(
        cancelled["jobs"].as_array().map(Vec::len),
        Some(2),
        "{cancelled}"
    );

    // --json on run and logs: one JSON object per line, numbers as numbers.
    let output = env.muster(&[
        "run",
        "--json",
        "--",
        "sh",
        "-c",
        "echo one; printf two; exit 4",
    ]);
    assert_eq!(output.status.code(), Some(4), "{output:?}");
    let events: Vec<serde_json::Value> = stdout(&output)
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("each line is JSON"))
        // A slow cycle may give a `pending` event first.
        .filter(|event| event["event"] != "pending")
        .collect();
    assert_eq!(events.len(), 4, "{events:?}");
    assert_eq!(events[0]["event"], "submitted");
    let job = events[0]["job"].as_u64().expect("a job id");
    assert_eq!(
        events[1],
        serde_json::json!({"event": "output", "job": job, "rank": 0, "line": "one"})
    );
    assert_eq!(events[2]["line"], "two", "a last line without its newline");
    assert_eq!(events[3]["event"], "ended");
    assert_eq!(events[3]["state"], "failed");
    assert_eq!(events[3]["exit_code"], 4);
    assert_eq!(events[3]["exit_status"], 4);
    let output = env.muster(&["logs", "--json", &job.to_string()]);
    let lines: Vec<serde_json::Value> = stdout(&output)
        .lines()
        .map(|line| serde_json::from_str(line).expect("each line is JSON"))
        .collect();
    assert_eq!(lines, events[1..3].to_vec());

    // Ctrl-C on `muster run`, answered yes: the job is cancelled, exit 130.
    let mut child = env
        .command()
        .args(["run", "--", "sleep", "60"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("muster run starts");
    common::wait_until("the job to run", Duration::from_secs(30), || {
        let running = json(&env.muster(&["ps", "--state", "running", "--json"]));
        running["jobs"]
            .as_array()
            .is_some_and(|jobs| jobs.iter().any(|j| j["command"][0] == "sleep"))
    });
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .expect("SIGINT sent");
    std::io::Write::write_all(child.stdin.as_mut().expect("stdin"), b"y\n").expect("answered");
    let output = child.wait_with_output().expect("muster run ends");
    assert_eq!(output.status.code(), Some(130), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("cancelled"),
        "{output:?}"
    );

    // Dependencies: B waits for A to succeed, C for A to end however. A
    // fails: B is cancelled saying why, C runs.
    let output = env.muster(&["run", "--detach", "--", "sh", "-c", "sleep 4; exit 3"]);
    let a = stdout(&output).trim().to_string();
    let output = env.muster(&["run", "--detach", "--after", &a, "--", "echo", "b"]);
    assert!(output.status.success(), "{output:?}");
    let b = stdout(&output).trim().to_string();
    let waiting = json(&env.muster(&["describe", &b, "--json"]));
    assert_eq!(waiting["state"], "pending", "{waiting}");
    assert_eq!(waiting["pending_code"], "dependency", "{waiting}");
    let listed = stdout(&env.muster(&["ps", "--state", "pending"]));
    let row = listed
        .lines()
        .find(|line| line.starts_with(&format!("{b} ")))
        .unwrap_or_else(|| panic!("job {b} listed: {listed}"));
    assert!(row.trim_end().ends_with("dependency"), "{listed}");
    assert_eq!(
        waiting["after"],
        serde_json::json!([a.clone()]),
        "{waiting}"
    );
    assert_eq!(
        waiting["pending_reason"],
        format!("waiting for job {a} to succeed (after: {a})"),
        "{waiting}"
    );
    let any = format!("any:{a}");
    let output = env.muster(&["run", "--after", &any, "--", "echo", "ran after any"]);
    assert!(output.status.success(), "{output:?}");
    assert!(stdout(&output).contains("ran after any"), "{output:?}");
    // While it waited, `muster run` said why.
    assert!(
        String::from_utf8_lossy(&output.stderr).contains(&format!(
            "pending: waiting for job {a} to end (after: any:{a})"
        )),
        "{output:?}"
    );
    let cancelled = json(&env.muster(&["describe", &b, "--json"]));
    assert_eq!(cancelled["state"], "cancelled", "{cancelled}");
    let last = &cancelled["history"]
        .as_array()
        .expect("a list")
        .last()
        .expect("an event")["what"];
    assert_eq!(
        last,
        &format!("cancelled: job {a} failed, and this job waited for it to succeed")
    );
    let text = stdout(&env.muster(&["describe", &b]));
    assert!(text.contains(&format!("after:     {a}")), "{text}");
    // One that can never be met, or names no job, is refused at once.
    let output = env.muster(&["run", "--after", &a, "--", "true"]);
    assert_eq!(output.status.code(), Some(6), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains(&format!("job {a} already failed")),
        "{output:?}"
    );
    let spec = env.path("after.yaml");
    std::fs::write(&spec, "name: after-nothing\ncommand: [\"true\"]\n").unwrap();
    let output = env.muster(&["submit", "--after", "999999", spec.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(6), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("there is no job 999999"),
        "{output:?}"
    );

    // A time limit stops the job and `muster run` says so with 124.
    let started = std::time::Instant::now();
    let output = env.muster(&["run", "--time", "2s", "--", "sleep", "60"]);
    assert_eq!(output.status.code(), Some(124), "{output:?}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "stopped at the limit"
    );
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("timed_out"),
        "{output:?}"
    );
    let timed_out = json(&env.muster(&["ps", "--state", "timed_out", "--json"]));
    assert_eq!(
        timed_out["jobs"].as_array().map(Vec::len),
        Some(1),
        "{timed_out}"
    );

    // Unknown job: a clear error and its own exit code.
    let output = env.muster(&["describe", "999999"]);
    assert_eq!(output.status.code(), Some(3), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("999999"));
}

/// An absolute python3 a task (perhaps run as `nobody`) can execute.
fn python() -> Option<String> {
    ["/usr/bin/python3", "/usr/local/bin/python3"]
        .into_iter()
        .find(|path| std::path::Path::new(path).exists())
        .map(str::to_string)
}

/// A stand-in for `torchrun` where torch is not installed: the same launch
/// contract (it reads PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE,
/// PET_MASTER_ADDR, PET_MASTER_PORT and starts its workers with RANK,
/// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
const STAND_IN_TORCHRUN: &str = r#"
import os, subprocess, sys
nnodes = int(os.environ["PET_NNODES"])
node_rank = int(os.environ["PET_NODE_RANK"])
nproc = int(os.environ["PET_NPROC_PER_NODE"])
workers = []
for local in range(nproc):
    env = dict(os.environ)
    env.update(RANK=str(node_rank * nproc + local), LOCAL_RANK=str(local),
               WORLD_SIZE=str(nnodes * nproc), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR=os.environ["PET_MASTER_ADDR"],
               MASTER_PORT=os.environ["PET_MASTER_PORT"])
    workers.append(subprocess.Popen([sys.executable] + sys.argv[1:], env=env))
sys.exit(max(worker.wait() for worker in workers))
"#;

/// Sums RANK + 1 over all ranks: with torch (gloo) where it is installed,
/// else over TCP to MASTER_ADDR:MASTER_PORT, as a rendezvous would.
const DDP_ALL_REDUCE: &str = r#"
import os, socket, time
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
try:
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    total = int(value.item())
except ImportError:
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if rank == 0:
        server = socket.create_server(("", address[1]))
        peers = [server.accept()[0] for _ in range(world - 1)]
        total = 1 + sum(int(peer.recv(64).decode()) for peer in peers)
        for peer in peers:
            peer.sendall(str(total).encode())
    else:
        deadline = time.time() + 60
        while True:
            try:
                peer = socket.create_connection(address, timeout=5)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        peer.sendall(str(rank + 1).encode())
        total = int(peer.recv(64).decode())
print(f"all_reduce rank {rank}/{world}: {total}", flush=True)
"#;

#[test]
fn a_server_with_three_agents_runs_a_gang() {
    let env = Env::new();
    let (_server, data) = env.start_server();
    let join = data.join("join.token");
    let join = join.to_str().expect("a UTF-8 path");
    let token = std::fs::read_to_string(data.join("admin.token")).expect("admin token");
    let mut agents = Vec::new();
    for name in ["node-a", "node-b", "node-c"] {
        let state = env.path(name);
        agents.push(env.spawn(
            match name {
                "node-a" => "agent-a",
                "node-b" => "agent-b",
                _ => "agent-c",
            },
            &[
                "agent",
                "--server",
                &env.url,
                "--join-token-file",
                join,
                "--name",
                name,
                "--address",
                "127.0.0.1",
                "--simulate-gpus",
                "4xH100-80GB",
                "--state-dir",
                state.to_str().unwrap(),
            ],
        ));
    }
    let cli = |args: &[&str]| {
        let mut all = args.to_vec();
        let flags = ["--server", env.url.as_str(), "--token", token.trim()];
        // Connection flags go before `--` (the command of `muster run`).
        let at = all.iter().position(|a| *a == "--").unwrap_or(all.len());
        all.splice(at..at, flags);
        env.muster(&all)
    };
    common::wait_until("three nodes", Duration::from_secs(30), || {
        json(&cli(&["nodes", "--json"]))["nodes"]
            .as_array()
            .map_or(0, Vec::len)
            == 3
    });

    let pools = json(&cli(&["pools", "--json"]));
    assert_eq!(pools["pools"][0]["name"], "default");
    assert_eq!(pools["pools"][0]["gpus"], 12);
    let node = json(&cli(&["nodes", "node-b", "--json"]));
    assert_eq!(node["gpus"].as_array().map(Vec::len), Some(4));

    // A 2-node gang: consistent environments, tasks running at once.
    let out = common::task_writable(env.dir.path(), "gang");
    let script = format!(
        "env | grep -E '^(MUSTER|PET)_' | sort > {dir}/rank-$MUSTER_NODE_RANK.env; \
         date +%s%N > {dir}/start-$MUSTER_NODE_RANK; sleep 1; date +%s%N > {dir}/end-$MUSTER_NODE_RANK",
        dir = out.display()
    );
    let output = cli(&[
        "run", "--nodes", "2", "--gpus", "4", "--", "sh", "-c", &script,
    ]);
    assert!(output.status.success(), "{output:?}");
    let read = |name: &str| std::fs::read_to_string(out.join(name)).unwrap_or_default();
    let rank0 = read("rank-0.env");
    let rank1 = read("rank-1.env");
    for (rank, text) in [(0, &rank0), (1, &rank1)] {
        assert!(text.contains(&format!("MUSTER_NODE_RANK={rank}")), "{text}");
        assert!(text.contains(&format!("PET_NODE_RANK={rank}")), "{text}");
        assert!(text.contains("PET_NNODES=2"), "{text}");
        assert!(text.contains("PET_NPROC_PER_NODE=4"), "{text}");
    }
    let line = |text: &str, key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .unwrap_or_default()
            .to_string()
    };
    for key in [
        "MUSTER_MASTER_ADDR=",
        "MUSTER_MASTER_PORT=",
        "PET_MASTER_ADDR=",
        "PET_MASTER_PORT=",
    ] {
        assert_eq!(line(&rank0, key), line(&rank1, key), "{key}");
        assert!(!line(&rank0, key).is_empty(), "{key} missing");
    }
    let number = |name: &str| read(name).trim().parse::<u128>().unwrap_or(0);
    assert!(
        number("start-0") < number("end-1") && number("start-1") < number("end-0"),
        "the gang's tasks ran at the same time"
    );

    // torchrun from a virtualenv on the submitter's PATH, by its bare name:
    // a 2-node all-reduce over the PET_* variables torchrun reads. Where
    // torch is installed the real torchrun runs a gloo all-reduce; without
    // it a stand-in with the same launch contract does a TCP all-reduce.
    match python() {
        Some(python) => {
            let venv = common::task_writable(env.dir.path(), "venv-bin");
            let torch = std::process::Command::new(&python)
                .args(["-c", "import torch"])
                .output()
                .is_ok_and(|o| o.status.success());
            let torchrun = venv.join("torchrun");
            let launcher = if torch {
                format!("#!/bin/sh\nexec {python} -m torch.distributed.run \"$@\"\n")
            } else {
                format!("#!{python}\n{STAND_IN_TORCHRUN}")
            };
            std::fs::write(&torchrun, launcher).unwrap();
            std::fs::set_permissions(
                &torchrun,
                std::os::unix::fs::PermissionsExt::from_mode(0o755),
            )
            .unwrap();
            let ddp = venv.join("ddp.py");
            std::fs::write(&ddp, DDP_ALL_REDUCE).unwrap();
            let path = format!(
                "{}:{}",
                venv.display(),
                std::env::var("PATH").unwrap_or_default()
            );
            let output = env
                .command()
                .env("PATH", &path)
                .args(["run", "--server", &env.url, "--token", token.trim()])
                .args(["--nodes", "2", "--gpus", "1", "--time", "2m", "--"])
                .args(["torchrun", ddp.to_str().unwrap()])
                .output()
                .unwrap();
            assert!(output.status.success(), "{output:?}");
            let text = stdout(&output);
            for rank in 0..2 {
                assert!(
                    text.contains(&format!("[rank {rank}] all_reduce rank {rank}/2: 3")),
                    "{text}"
                );
            }
        }
        None => eprintln!(
            "note: no python3 here, so the torchrun all-reduce is not run (.ci/run installs \
             python3); the PET_* contract is checked above"
        ),
    }

    // A gang's outcome is the rank that failed on its own: rank 1 exits 3,
    // rank 0 is then stopped by muster (SIGTERM, 143) and does not count.
    let output = cli(&[
        "run",
        "--nodes",
        "2",
        "--gpus",
        "1",
        "--",
        "sh",
        "-c",
        "if [ \"$MUSTER_NODE_RANK\" = 1 ]; then sleep 1; echo 'rank1: CUDA OOM'; exit 3; fi; sleep 60",
    ]);
    assert_eq!(output.status.code(), Some(3), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("rank 1"), "{stderr}");
    // Every rank's output, each line with its rank (as `srun -l`).
    assert!(
        stdout(&output).contains("[rank 1] rank1: CUDA OOM"),
        "{output:?}"
    );
    // `describe` names the rank and shows the end of its output.
    let failed = json(&cli(&["ps", "--state", "failed", "--json"]));
    let failed_id = failed["jobs"][0]["id"]
        .as_u64()
        .expect("the failed gang")
        .to_string();
    assert_eq!(failed["jobs"][0]["failed_rank"], 1, "{failed}");
    let text = stdout(&cli(&["describe", &failed_id]));
    assert!(text.contains("rank 1 first"), "{text}");
    assert!(text.contains("rank1: CUDA OOM"), "{text}");

    // GPU indices never overlap between jobs on a node.
    let mut ids = Vec::new();
    for _ in 0..6 {
        let output = cli(&["run", "--detach", "--gpus", "2", "--", "sleep", "30"]);
        ids.push(stdout(&output).trim().to_string());
    }
    common::wait_until("six jobs running", Duration::from_secs(30), || {
        ids.iter()
            .all(|id| json(&cli(&["describe", id, "--json"]))["state"] == "running")
    });
    let mut seen = std::collections::BTreeSet::new();
    for id in &ids {
        let job = json(&cli(&["describe", id, "--json"]));
        for task in job["tasks"].as_array().unwrap() {
            for gpu in task["gpus"].as_array().unwrap() {
                let key = (task["node"].to_string(), gpu[0].as_u64().unwrap());
                assert!(seen.insert(key.clone()), "GPU {key:?} given twice");
            }
        }
    }

    // A job larger than the cluster is refused at once, naming the largest
    // node; with --allow-pending it is queued and stays pending, saying why.
    let output = cli(&["run", "--nodes", "4", "--gpus", "4", "--", "true"]);
    assert_eq!(output.status.code(), Some(6), "{output:?}");
    let refusal = String::from_utf8_lossy(&output.stderr);
    assert!(
        refusal.contains("no registered node can ever hold this job")
            && refusal.contains("3 of the 3 nodes could hold a task")
            && refusal.contains("--allow-pending"),
        "{refusal}"
    );
    let output = cli(&[
        "run",
        "--detach",
        "--allow-pending",
        "--nodes",
        "4",
        "--gpus",
        "4",
        "--",
        "true",
    ]);
    assert!(output.status.success(), "{output:?}");
    let big = stdout(&output).trim().to_string();
    common::wait_until("a pending reason", Duration::from_secs(30), || {
        json(&cli(&["describe", &big, "--json"]))["pending_reason"].is_string()
    });
    let job = json(&cli(&["describe", &big, "--json"]));
    assert_eq!(job["state"], "pending");
    let reason = job["pending_reason"].as_str().unwrap();
    assert!(
        reason.contains("too wide for the cluster: it needs 4 nodes, and only 3"),
        "{reason}"
    );
    assert_eq!(job["pending_code"], "too-wide");
    // Several jobs in one cancel; an unknown one is named, the others still
    // cancelled, and the exit status says not found.
    let mut args = vec!["cancel"];
    args.extend(ids.iter().map(String::as_str));
    args.push("999999");
    let output = cli(&args);
    assert_eq!(output.status.code(), Some(3), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("job 999999"));
    for id in &ids {
        let state = json(&cli(&["describe", id, "--json"]))["state"].clone();
        assert!(state == "stopping" || state == "cancelled", "{id}: {state}");
    }
    drop(agents);
}

#[test]
fn bad_input_gets_clear_errors() {
    let env = Env::new();
    let (mut server, data) = env.start_server();
    let token = std::fs::read_to_string(data.join("admin.token")).expect("admin token");
    let with = |token: &str, args: &[&str]| {
        let mut all = args.to_vec();
        all.extend_from_slice(&["--server", env.url.as_str(), "--token", token]);
        env.muster(&all)
    };
    // A port range that does not fit in the ports there are.
    let output = env.muster(&["server", "--master-port-base", "50000"]);
    assert!(!output.status.success(), "{output:?}");
    let errors = String::from_utf8_lossy(&output.stderr);
    assert!(
        errors.contains("--master-port-base") && errors.contains("1024..=45535"),
        "{errors}"
    );
    // A bad token is refused with its own exit code.
    let output = with("wrong", &["ps"]);
    assert_eq!(output.status.code(), Some(4), "{output:?}");
    // An invalid spec lists every problem.
    let spec = env.path("bad.yaml");
    std::fs::write(&spec, "name: x\ngpu: 8\nnodes: 0\ncommand: [true]\n").unwrap();
    let output = with(token.trim(), &["submit", spec.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(6), "invalid input: {output:?}");
    let errors = String::from_utf8_lossy(&output.stderr);
    assert!(errors.contains("did you mean \"gpus\""), "{errors}");
    assert!(
        errors.contains("nodes: must be at least 1, got 0"),
        "{errors}"
    );
    // A good one is accepted, and survives the bad requests around it.
    std::fs::write(&spec, "name: ok\ncommand: [true]\n").unwrap();
    let output = with(token.trim(), &["submit", spec.to_str().unwrap()]);
    assert!(output.status.success(), "{output:?}");
    let id = stdout(&output).trim().to_string();
    let output = with(token.trim(), &["describe", "424242"]);
    assert_eq!(output.status.code(), Some(3));
    let output = with(token.trim(), &["run", "--gpus", "lots", "--", "true"]);
    assert_eq!(output.status.code(), Some(6), "invalid input: {output:?}");
    // The other documented exit codes: 2 usage, 5 unreachable, 1 any other
    // failure (here a spec file that is not there).
    let output = with(token.trim(), &["ps", "--no-such-flag"]);
    assert_eq!(output.status.code(), Some(2), "usage: {output:?}");
    let output = env.muster(&["ps", "--server", "http://127.0.0.1:1", "--token", "x"]);
    assert_eq!(output.status.code(), Some(5), "unreachable: {output:?}");
    let missing = env.path("no-such-spec.yaml");
    let output = with(token.trim(), &["submit", missing.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1), "failure: {output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("no-such-spec.yaml"),
        "{output:?}"
    );
    let job = json(&with(token.trim(), &["describe", &id, "--json"]));
    assert_eq!(job["name"], "ok");
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "the server is still up"
    );
}

#[test]
fn arrays_and_batch_scripts_work_as_slurm_users_expect() {
    let env = Env::new();
    let listen = env.url.trim_start_matches("http://").to_string();
    let data = env.path("up-data");
    let mut up = env.spawn(
        "up",
        &[
            "up",
            "--listen",
            &listen,
            "--data-dir",
            data.to_str().unwrap(),
            "--simulate-gpus",
            "2xH100-80GB",
        ],
    );
    env.wait_for_api(&mut up);

    // An array of 6 elements, at most 2 at once (the node has room for 8
    // of them: the limit is what holds them); each knows its index.
    let out = common::task_writable(env.dir.path(), "array-out");
    let spec = env.path("shard.yaml");
    std::fs::write(
        &spec,
        format!(
            "name: shard\ncpus: 0.25\ncommand: \"echo shard $MUSTER_ARRAY_INDEX of $MUSTER_ARRAY_JOB_ID; \
             date +%s%N > {dir}/start-$MUSTER_ARRAY_INDEX; sleep 1; \
             date +%s%N > {dir}/end-$MUSTER_ARRAY_INDEX\"\n",
            dir = out.display()
        ),
    )
    .unwrap();
    let output = env.muster(&["submit", "--array", "0-5%2", spec.to_str().unwrap()]);
    assert!(output.status.success(), "{output:?}");
    let id = stdout(&output).trim().to_string();
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("6 element(s)"),
        "{output:?}"
    );
    // `ps` groups the pending elements in one row, with why they wait.
    common::wait_until("grouped pending elements", Duration::from_secs(30), || {
        let text = stdout(&env.muster(&["ps"]));
        text.contains(&format!("{id}_[")) && text.contains("array-limit")
    });
    let elements = |state: &str| {
        json(&env.muster(&["ps", "--array", &id, "--json"]))["jobs"]
            .as_array()
            .expect("a list")
            .iter()
            .filter(|job| job["state"] == state)
            .count()
    };
    common::wait_until("every element to succeed", Duration::from_secs(60), || {
        elements("succeeded") == 6
    });
    // Never more than 2 ran at once.
    let time = |name: String| {
        std::fs::read_to_string(out.join(name))
            .unwrap_or_default()
            .trim()
            .parse::<u128>()
            .expect("a time")
    };
    let spans: Vec<(u128, u128)> = (0..6)
        .map(|i| (time(format!("start-{i}")), time(format!("end-{i}"))))
        .collect();
    for &(start, _) in &spans {
        let at_once = spans
            .iter()
            .filter(|(s, e)| *s <= start && start <= *e)
            .count();
        assert!(at_once <= 2, "{at_once} elements ran at once: {spans:?}");
    }
    // An element by its index, as Slurm writes it.
    let logs = stdout(&env.muster(&["logs", &format!("{id}_3")]));
    assert!(logs.contains(&format!("shard 3 of {id}")), "{logs}");
    let text = stdout(&env.muster(&["describe", &format!("{id}_3")]));
    assert!(
        text.contains(&format!(
            "element 3 of array job {id} (6 elements, at most 2 at once)"
        )),
        "{text}"
    );

    // Cancelling one element, then the whole array by its id.
    let sleeper = env.path("sleeper.yaml");
    std::fs::write(
        &sleeper,
        "name: sleeper\ncpus: 0.25\ncommand: [sleep, '60']\n",
    )
    .unwrap();
    let output = env.muster(&["submit", "--array", "1-4", sleeper.to_str().unwrap()]);
    assert!(output.status.success(), "{output:?}");
    let second = stdout(&output).trim().to_string();
    let states = || -> Vec<(u64, String)> {
        json(&env.muster(&["ps", "--array", &second, "--json"]))["jobs"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|job| {
                (
                    job["array"]["index"].as_u64().expect("an index"),
                    job["state"].as_str().expect("a state").to_string(),
                )
            })
            .collect()
    };
    common::wait_until("four running", Duration::from_secs(30), || {
        states().iter().filter(|(_, s)| s == "running").count() == 4
    });
    // Jobs waiting for the whole array: to succeed, and to end however.
    let waiter = |kind: &str| {
        let after = format!("{kind}{second}");
        let output = env.muster(&["run", "--detach", "--after", &after, "--", "true"]);
        assert!(output.status.success(), "{output:?}");
        stdout(&output).trim().to_string()
    };
    let all_ok = waiter("");
    let all_end = waiter("any:");
    for waiting in [&all_ok, &all_end] {
        let job = json(&env.muster(&["describe", waiting, "--json"]));
        assert_eq!(job["pending_code"], "dependency", "{job}");
    }
    let output = env.muster(&["cancel", &format!("{second}_2")]);
    assert!(output.status.success(), "{output:?}");
    // One element cancelled: the job waiting for all to succeed never
    // will, and is cancelled saying so.
    common::wait_until(
        "the afterok waiter cancelled",
        Duration::from_secs(30),
        || json(&env.muster(&["describe", &all_ok, "--json"]))["state"] == "cancelled",
    );
    let text = stdout(&env.muster(&["describe", &all_ok]));
    assert!(
        text.contains(&format!("element 2 of array job {second} cancelled")),
        "{text}"
    );
    assert_eq!(
        json(&env.muster(&["describe", &all_end, "--json"]))["state"],
        "pending"
    );
    common::wait_until("element 2 cancelled", Duration::from_secs(30), || {
        states()
            .iter()
            .all(|(index, state)| (*index == 2) == (state == "cancelled"))
    });
    let output = env.muster(&["cancel", &second]);
    assert!(output.status.success(), "{output:?}");
    common::wait_until("the whole array cancelled", Duration::from_secs(30), || {
        states().iter().all(|(_, state)| state == "cancelled")
    });
    common::wait_until(
        "the afterany waiter to run",
        Duration::from_secs(30),
        || json(&env.muster(&["describe", &all_end, "--json"]))["state"] == "succeeded",
    );
    let output = env.muster(&["cancel", &format!("{second}_9")]);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("has no element 9"),
        "{output:?}"
    );

    // A Slurm batch script: #SBATCH options, the script's arguments, the
    // SLURM_* variables; run from the submit directory.
    let submit_dir = common::task_writable(env.dir.path(), "project");
    let script = submit_dir.join("train.sh");
    std::fs::write(
        &script,
        "#!/bin/bash\n\
         #SBATCH --job-name=My_Batch\n\
         #SBATCH --nodes=1 --ntasks-per-node=1\n\
         #SBATCH --gres=gpu:1\n\
         #SBATCH --time=5\n\
         #SBATCH --array=0-1\n\
         #SBATCH --output=slurm-%j.out\n\
         echo \"job=$SLURM_JOB_ID array=$SLURM_ARRAY_JOB_ID task=$SLURM_ARRAY_TASK_ID \
         proc=$SLURM_PROCID nodes=$SLURM_NNODES ntasks=$SLURM_NTASKS gpus=$CUDA_VISIBLE_DEVICES \
         dir=$SLURM_SUBMIT_DIR pwd=$(pwd) arg=$1\"\n",
    )
    .unwrap();
    let output = env
        .command()
        .current_dir(&submit_dir)
        .args(["sbatch", "train.sh", "hello"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--output slurm-%j.out: not applied"),
        "{stderr}"
    );
    let batch: u64 = stdout(&output).trim().parse().expect("a job id");
    let batch_text = batch.to_string();
    common::wait_until("both elements to succeed", Duration::from_secs(60), || {
        json(&env.muster(&["ps", "--array", &batch_text, "--json"]))["jobs"]
            .as_array()
            .is_some_and(|jobs| jobs.iter().filter(|j| j["state"] == "succeeded").count() == 2)
    });
    let logs = stdout(&env.muster(&["logs", &format!("{batch}_1")]));
    let dir = submit_dir.display();
    assert!(
        logs.contains(&format!(
            "job={} array={batch} task=1 proc=0 nodes=1 ntasks=1 gpus=",
            batch + 1
        )) && logs.contains(&format!("dir={dir} pwd={dir} arg=hello")),
        "{logs}"
    );
    let job = json(&env.muster(&["describe", &batch_text, "--json"]));
    assert_eq!(job["name"], "my-batch");
    // Options muster does not know stop the submission, named with their
    // lines, unless --ignore-unknown.
    std::fs::write(
        &script,
        "#!/bin/sh\n#SBATCH --exclusive\n#SBATCH -N 1\necho ok\n",
    )
    .unwrap();
    let sbatch = |extra: &[&str]| {
        env.command()
            .current_dir(&submit_dir)
            .arg("sbatch")
            .args(extra)
            .arg("train.sh")
            .output()
            .unwrap()
    };
    let output = sbatch(&[]);
    assert_eq!(output.status.code(), Some(6), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("--exclusive (line 2)"),
        "{output:?}"
    );
    let output = sbatch(&["--ignore-unknown", "--time", "1:00"]);
    assert!(output.status.success(), "{output:?}");
    let job = json(&env.muster(&["describe", stdout(&output).trim(), "--json"]));
    assert_eq!(job["name"], "train");

    // A shell inside a Slurm allocation does not pass its SLURM_* on to
    // `muster run` jobs (they would mislead libraries that read them).
    let output = env
        .command()
        .env("SLURM_JOB_ID", "999")
        .args(["run", "--", "sh", "-c", "echo \"[$SLURM_JOB_ID]\""])
        .output()
        .unwrap();
    assert!(stdout(&output).contains("[]"), "{output:?}");
}

/// `GET path` with a bearer token over plain HTTP/1.1: the status and body.
fn http_get(url: &str, path: &str, token: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let address = url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address).expect("the server answers");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("a timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {token}\r\n\
         Connection: close\r\n\r\n"
    )
    .expect("request sent");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("an answer");
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_string());
    (status, body)
}

#[test]
fn metrics_show_a_running_jobs_gpu_utilisation_from_the_agent() {
    let env = Env::new();
    let listen = env.url.trim_start_matches("http://").to_string();
    let data = env.path("up-data");
    let mut up = env.spawn(
        "up",
        &[
            "up",
            "--listen",
            &listen,
            "--data-dir",
            data.to_str().unwrap(),
            "--simulate-gpus",
            "2xH100-80GB",
            "--telemetry-interval",
            "1s",
            "--idle-after",
            "2s",
        ],
    );
    env.wait_for_api(&mut up);
    // A task declares how busy its simulated GPU is.
    let output = env.muster(&[
        "run",
        "--detach",
        "--gpus",
        "1",
        "-e",
        "MUSTER_SIM_UTIL=0.9",
        "--",
        "sleep",
        "60",
    ]);
    assert!(output.status.success(), "{output:?}");
    let id = stdout(&output).trim().to_string();
    let token = std::fs::read_to_string(data.join("metrics.token")).expect("a metrics token");
    let wanted = format!("job_id=\"{id}\",queue=\"default\"");
    let mut last = String::new();
    common::wait_until("the job's GPU in /metrics", Duration::from_secs(30), || {
        let (status, body) = http_get(&env.url, "/metrics", token.trim());
        assert_eq!(status, 200, "{body}");
        last = body;
        last.lines().any(|line| {
            line.starts_with("DCGM_FI_DEV_GPU_UTIL{")
                && line.contains(&wanted)
                && line.ends_with(" 90.0")
        })
    });
    // PCIe counters where the device counts them (the simulated one does).
    assert!(
        last.lines()
            .any(|l| l.starts_with("muster_gpu_pcie_transmit_bytes_total{") && l.contains(&wanted)),
        "{last}"
    );
    // The node's own counters come along; the other GPU is free and idle.
    assert!(
        last.lines()
            .any(|l| l.starts_with("muster_node_memory_total_bytes{Hostname=")),
        "{last}"
    );
    assert!(
        last.lines()
            .any(|l| l.starts_with("DCGM_FI_DEV_GPU_UTIL{") && l.ends_with(" 0.0")),
        "{last}"
    );
    // A job that holds its GPU and leaves it idle is flagged once every
    // GPU of it stayed below 5% for the threshold; the busy one is not.
    let output = env.muster(&[
        "run",
        "--detach",
        "--gpus",
        "1",
        "-e",
        "MUSTER_SIM_UTIL=0.01",
        "--",
        "sleep",
        "60",
    ]);
    assert!(output.status.success(), "{output:?}");
    let idle = stdout(&output).trim().to_string();
    common::wait_until("the idle job flagged", Duration::from_secs(30), || {
        json(&env.muster(&["describe", &idle, "--json"]))["idle_for_s"].is_u64()
    });
    let job = json(&env.muster(&["describe", &id, "--json"]));
    assert!(job["idle_for_s"].is_null(), "{job}");
    assert!(
        job["tasks"][0]["usage"]["mean_utilization_pct"]
            .as_f64()
            .is_some_and(|mean| mean > 80.0),
        "{job}"
    );
    let text = stdout(&env.muster(&["ps"]));
    let row = text
        .lines()
        .find(|line| line.starts_with(&format!("{idle} ")))
        .unwrap_or_default();
    assert!(row.contains("(idle "), "{text}");
    let text = stdout(&env.muster(&["describe", &idle]));
    assert!(text.contains("GPU utilisation mean 1%"), "{text}");
    assert!(
        text.contains("idle:      every GPU of it below 5%"),
        "{text}"
    );
    let (_, metrics) = http_get(&env.url, "/metrics", token.trim());
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with(&format!("muster_job_idle_seconds{{job_id=\"{idle}\""))),
        "{metrics}"
    );
    dashboard_in_chromium(&env, &data, &id, &idle);
    // `muster top`, one frame: the node's GPUs, the busy job at 90%.
    let output = env.muster(&["top", "--once", "--size", "140x30"]);
    assert!(output.status.success(), "{output:?}");
    let text = stdout(&output);
    assert!(text.contains("GPUs 2: 2 allocated, 0 free"), "{text}");
    let row = text
        .lines()
        .find(|line| line.starts_with(&format!("{id} ")))
        .unwrap_or_default();
    assert!(row.contains(" 90%"), "{text}");
    let row = text
        .lines()
        .find(|line| line.starts_with(&format!("{idle} ")))
        .unwrap_or_default();
    assert!(row.contains("(idle)"), "{text}");
    prometheus_scrapes(&env, &data.join("metrics.token"), &id, &idle);
    let output = env.muster(&["cancel", &id, &idle]);
    assert!(output.status.success(), "{output:?}");
    // A job with an idle_timeout whose GPU stays idle is stopped: it ends
    // idle_stopped and `muster run` exits 124.
    let output = env.muster(&[
        "run",
        "--gpus",
        "1",
        "--idle-timeout",
        "2s",
        "-e",
        "MUSTER_SIM_UTIL=0",
        "--",
        "sleep",
        "120",
    ]);
    assert_eq!(output.status.code(), Some(124), "{output:?}");
    let stopped = json(&env.muster(&["ps", "--state", "idle_stopped", "--json"]));
    let stopped = &stopped["jobs"][0];
    assert!(
        stopped["history"]
            .as_array()
            .is_some_and(|events| events.iter().any(|e| e["what"]
                .as_str()
                .is_some_and(|w| w.contains("idle (below 5%) for its idle_timeout")))),
        "{stopped}"
    );
    // The node's software stack, as its agent reported it.
    let fleet = json(&env.muster(&["fleet", "--json"]));
    let pool = &fleet["pools"][0];
    assert_eq!(pool["nodes"], 1, "{fleet}");
    assert_eq!(pool["majority"]["driver"], "simulated", "{fleet}");
    assert!(pool["majority"]["kernel"].is_string(), "{fleet}");
    let text = stdout(&env.muster(&["fleet"]));
    assert!(text.contains("every node has the pool's stack"), "{text}");
    // The GPU time of the jobs above is accounted: per rank in describe,
    // per queue in `muster cost`, priced.
    let output = env.muster(&["prices", "set", "H100-80GB", "3"]);
    assert!(output.status.success(), "{output:?}");
    common::wait_until("the cost of the jobs", Duration::from_secs(30), || {
        let report = json(&env.muster(&["cost", "--since", "1h", "--json"]));
        report["lines"][0]["used_gpu_hours"]
            .as_f64()
            .is_some_and(|used| used > 0.0)
    });
    let report = json(&env.muster(&["cost", "--since", "1h", "--json"]));
    let line = &report["lines"][0];
    assert_eq!(line["key"], "default", "{report}");
    let held = line["allocated_gpu_hours"].as_f64().expect("hours");
    assert!(
        (line["cost"].as_f64().expect("cost") - 3.0 * held).abs() < 1e-9,
        "{report}"
    );
    assert!(
        line["idle_gpu_hours"]
            .as_f64()
            .is_some_and(|idle| idle > 0.0),
        "{report}"
    );
    let text = stdout(&env.muster(&["cost", "--by", "job", "--csv"]));
    assert!(text.starts_with("job,allocated_gpu_hours,"), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with(&format!("{id},"))),
        "{text}"
    );
    let text = stdout(&env.muster(&["describe", &id]));
    assert!(text.contains("GPU use (every attempt"), "{text}");
    assert!(text.contains("rank 0: utilisation mean 90%"), "{text}");
    // The driver reports XID 79 (fallen off the bus) on a task's GPU: the
    // GPU is taken out of service and shown with the event.
    let output = env.muster(&[
        "run",
        "--detach",
        "--gpus",
        "1",
        "-e",
        "MUSTER_SIM_XID=79",
        "--",
        "sleep",
        "60",
    ]);
    assert!(output.status.success(), "{output:?}");
    let broken = stdout(&output).trim().to_string();
    let nodes = json(&env.muster(&["nodes", "--json"]));
    let node = nodes["nodes"][0]["name"]
        .as_str()
        .expect("a node")
        .to_string();
    common::wait_until("the GPU out of service", Duration::from_secs(30), || {
        let view = json(&env.muster(&["nodes", &node, "--json"]));
        view["unhealthy_gpus"]
            .as_array()
            .is_some_and(|gpus| !gpus.is_empty())
            && view["gpu_events"].as_array().is_some_and(|events| {
                events.iter().any(|e| {
                    e.as_str()
                        .is_some_and(|e| e.contains("XID 79, the GPU has fallen off the bus"))
                })
            })
    });
    let text = stdout(&env.muster(&["nodes", &node]));
    assert!(text.contains("OUT OF SERVICE"), "{text}");
    let (_, metrics) = http_get(&env.url, "/metrics", token.trim());
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("DCGM_FI_DEV_XID_ERRORS{") && l.ends_with(" 79.0")),
        "{metrics}"
    );
    let output = env.muster(&["cancel", &broken]);
    assert!(output.status.success(), "{output:?}");
}

/// One page in a real headless Chromium (Debian's package): its DOM, with a
/// screenshot written beside the test's other files. No console message
/// may appear (there is no script, so one would be a blocked load, a CSP
/// violation or an error).
fn chromium_page(url: &str, screenshot: &std::path::Path) -> String {
    let output = std::process::Command::new("/usr/bin/chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,1000",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
        ])
        .arg(format!("--screenshot={}", screenshot.display()))
        .arg(url)
        .output()
        .expect("chromium runs");
    assert!(
        output.status.success(),
        "chromium failed on {url}: {output:?}"
    );
    let log = String::from_utf8_lossy(&output.stderr);
    let console: Vec<&str> = log.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(
        console.is_empty(),
        "console messages on {url}: {console:#?}"
    );
    let png = std::fs::read(screenshot).expect("a screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 2_000,
        "{}",
        screenshot.display()
    );
    stdout(&output)
}

/// The number in the element tagged `data-test="NAME"` after `from`.
fn tagged(dom: &str, from: &str, name: &str) -> String {
    let start = dom
        .find(from)
        .unwrap_or_else(|| panic!("{from} not in {dom}"));
    let tag = format!("data-test=\"{name}\">");
    let at = dom[start..]
        .find(&tag)
        .unwrap_or_else(|| panic!("{tag} not after {from}"));
    let rest = &dom[start + at + tag.len()..];
    rest[..rest.find('<').unwrap_or(rest.len())].to_string()
}

/// The dashboard in Chromium shows what the API says: every page renders,
/// with no console message, for the admin token; the metrics token sees
/// no task output; without a token, the sign-in page.
fn dashboard_in_chromium(env: &Env, data: &std::path::Path, busy: &str, idle: &str) {
    if !std::path::Path::new("/usr/bin/chromium").exists() {
        assert!(
            std::env::var_os("MUSTER_REQUIRE_TOOLS").is_none(),
            "/usr/bin/chromium is missing (Debian: apt-get install chromium)"
        );
        eprintln!("note: no /usr/bin/chromium here; the dashboard check is skipped");
        return;
    }
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&shots).expect("a screenshot directory");
    let token = std::fs::read_to_string(data.join("admin.token")).expect("the admin token");
    let page = |path: &str, name: &str| {
        let separator = if path.contains('?') { '&' } else { '?' };
        chromium_page(
            &format!("{}{path}{separator}token={}", env.url, token.trim()),
            &shots.join(format!("{name}.png")),
        )
    };
    let nodes = json(&env.muster(&["nodes", "--json"]));
    let node = &nodes["nodes"][0];
    let name = node["name"].as_str().expect("a node");
    let allocated = node["gpu_free"]
        .as_array()
        .expect("free GPUs")
        .iter()
        .filter(|free| free.as_u64() != Some(1000))
        .count();
    let running = json(&env.muster(&["ps", "--state", "running", "--json"]))["jobs"]
        .as_array()
        .expect("jobs")
        .len();
    let dom = page("/", "overview");
    assert_eq!(
        tagged(&dom, "", "gpus-allocated"),
        allocated.to_string(),
        "{dom}"
    );
    assert_eq!(tagged(&dom, "", "gpus-total"), "2");
    assert_eq!(tagged(&dom, "", "gpus-idle"), "1", "the idle job's GPU");
    assert_eq!(tagged(&dom, "", "jobs-running"), running.to_string());
    let dom = page("/ui/queues", "queues");
    assert_eq!(
        tagged(&dom, "data-queue=\"default\"", "running"),
        running.to_string()
    );
    let dom = page("/ui/jobs?state=running", "jobs");
    assert!(dom.contains(&format!("data-job=\"{busy}\"")), "{dom}");
    assert!(dom.contains(&format!("data-job=\"{idle}\"")), "{dom}");
    let usage: serde_json::Value = serde_json::from_str(
        &http_get(&env.url, &format!("/v1/jobs/{busy}/usage"), token.trim()).1,
    )
    .expect("usage");
    let mean = usage["ranks"][0]["mean_utilization_pct"]
        .as_f64()
        .expect("a mean");
    let dom = page(&format!("/ui/jobs/{busy}"), "job");
    assert_eq!(tagged(&dom, "", "state"), "running");
    assert_eq!(
        tagged(&dom, "data-rank=\"0\"", "mean"),
        format!("{mean:.0}%")
    );
    assert!(dom.contains("Output (rank 0"), "{dom}");
    let dom = page("/ui/nodes", "nodes");
    assert_eq!(
        tagged(&dom, &format!("data-node=\"{name}\""), "unhealthy"),
        "ok"
    );
    let dom = page(&format!("/ui/nodes/{name}"), "node");
    assert!(dom.contains("<polyline"), "the last hour's chart: {dom}");
    assert_eq!(tagged(&dom, "data-gpu=\"0\"", "health"), "ok");
    let before: serde_json::Value =
        serde_json::from_str(&http_get(&env.url, "/v1/cost?since=1h", token.trim()).1)
            .expect("cost");
    let dom = page("/ui/cost?since=1h&by=queue", "cost");
    let after: serde_json::Value =
        serde_json::from_str(&http_get(&env.url, "/v1/cost?since=1h", token.trim()).1)
            .expect("cost");
    let shown: f64 = tagged(&dom, "data-key=\"default\"", "allocated")
        .parse()
        .expect("a number");
    let hours = |report: &serde_json::Value| {
        report["lines"][0]["allocated_gpu_hours"]
            .as_f64()
            .expect("hours")
    };
    assert!(
        shown >= hours(&before) - 0.0005 && shown <= hours(&after) + 0.0005,
        "{shown} between {before} and {after}"
    );
    // The metrics token sees the pages but no task output.
    let metrics_token = std::fs::read_to_string(data.join("metrics.token")).expect("a token");
    let dom = chromium_page(
        &format!("{}/ui/jobs/{busy}?token={}", env.url, metrics_token.trim()),
        &shots.join("job-read-only.png"),
    );
    assert!(dom.contains("Output needs the admin token"), "{dom}");
    // Without a token: the sign-in page.
    let dom = chromium_page(&format!("{}/ui/nodes", env.url), &shots.join("sign-in.png"));
    assert!(dom.contains("Paste the admin token"), "{dom}");
    eprintln!("dashboard screenshots: {}", shots.display());
}

/// A query string's value, percent-encoded.
fn encode_query(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A real Prometheus scraping muster with `scrape` (the `scrape_configs`
/// entry's lines after `job_name`), killed when dropped (a failed wait
/// leaves no process behind). `None` when it is not installed, which
/// `.ci/run` (MUSTER_REQUIRE_TOOLS) does not allow.
struct Prometheus {
    child: std::process::Child,
    listen: String,
}

impl Prometheus {
    fn start(env: &Env, name: &str, scrape: &str) -> Option<Prometheus> {
        let binary = std::path::Path::new("/usr/bin/prometheus");
        if !binary.exists() {
            assert!(
                std::env::var_os("MUSTER_REQUIRE_TOOLS").is_none(),
                "/usr/bin/prometheus is missing (Debian: apt-get install prometheus)"
            );
            eprintln!("note: no /usr/bin/prometheus here; the real-Prometheus check is skipped");
            return None;
        }
        let listen = format!("127.0.0.1:{}", common::free_port());
        let config = env.path(&format!("{name}.yml"));
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - \
                 job_name: muster\n{scrape}"
            ),
        )
        .expect("the config written");
        let log = std::fs::File::create(env.path(&format!("{name}.log"))).expect("a log file");
        let child = std::process::Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                env.path(&format!("{name}-tsdb")).display()
            ))
            .arg(format!("--web.listen-address={listen}"))
            .stdout(log.try_clone().expect("the log again"))
            .stderr(log)
            .spawn()
            .expect("prometheus starts");
        Some(Prometheus { child, listen })
    }

    /// The first value of `promql` now, if Prometheus answers with one.
    fn value(&self, promql: &str) -> Option<f64> {
        std::net::TcpStream::connect(&self.listen).ok()?;
        let path = format!("/api/v1/query?query={}", encode_query(promql));
        let (_, body) = http_get(&format!("http://{}", self.listen), &path, "unused");
        // The body may be chunked: take the JSON object in it.
        let start = body.find('{')?;
        let end = body.rfind('}')? + 1;
        let value: serde_json::Value = serde_json::from_str(&body[start..end]).ok()?;
        value["data"]["result"][0]["value"][1]
            .as_str()?
            .parse()
            .ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The real Prometheus (Debian's package) scrapes the server with the
/// metrics token, and PromQL finds the running job's utilisation, the idle
/// job and the GPUs by state. Without it installed the check is skipped,
/// unless MUSTER_REQUIRE_TOOLS is set (as `.ci/run` does, having installed
/// it).
fn prometheus_scrapes(env: &Env, token_file: &std::path::Path, busy: &str, idle: &str) {
    let Some(prometheus) = Prometheus::start(
        env,
        "prometheus",
        &format!(
            "    authorization:\n      credentials_file: {}\n    static_configs:\n      - \
             targets: [\"{}\"]\n",
            token_file.display(),
            env.url.trim_start_matches("http://")
        ),
    ) else {
        return;
    };
    let busy_query = format!("DCGM_FI_DEV_GPU_UTIL{{job_id=\"{busy}\"}}");
    common::wait_until(
        "Prometheus to scrape muster",
        Duration::from_secs(60),
        || prometheus.value(&busy_query) == Some(90.0),
    );
    let idle_query = format!("muster_job_idle_seconds{{job_id=\"{idle}\"}}");
    common::wait_until(
        "the idle job in Prometheus",
        Duration::from_secs(30),
        || prometheus.value(&idle_query).is_some(),
    );
    assert_eq!(
        prometheus.value("sum(muster_gpus{state=\"allocated\"})"),
        Some(2.0)
    );
    assert_eq!(prometheus.value("up{job=\"muster\"}"), Some(1.0));
}

/// A real Prometheus scrapes an HTTPS server as docs/observability.md says
/// (`scheme: https`, the cluster CA as `tls_config.ca_file`, the metrics
/// token): the scrape is up.
fn prometheus_scrapes_https(env: &Env, address: &str, data: &std::path::Path) {
    let Some(prometheus) = Prometheus::start(
        env,
        "prometheus-tls",
        &format!(
            "    scheme: https\n    tls_config:\n      ca_file: {}\n    authorization:\n      \
             credentials_file: {}\n    static_configs:\n      - targets: [\"{address}\"]\n",
            data.join("tls/ca.pem").display(),
            data.join("metrics.token").display(),
        ),
    ) else {
        return;
    };
    common::wait_until(
        "Prometheus to scrape muster over HTTPS",
        Duration::from_secs(60),
        || prometheus.value("up{job=\"muster\"}") == Some(1.0),
    );
}

/// POST `body` to `path` with a token and an idempotency key; the status
/// and the body.
fn http_post_with_key(url: &str, path: &str, token: &str, key: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let address = url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address).expect("the server answers");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("a timeout");
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {token}\r\n\
         Idempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("request sent");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("an answer");
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_string());
    (status, body)
}

#[test]
fn users_log_in_see_their_own_jobs_and_a_submission_survives_a_server_crash_once() {
    let mut env = Env::new();
    let (server, data) = env.start_server();
    let admin = std::fs::read_to_string(data.join("admin.token")).expect("admin token");
    let admin = admin.trim().to_string();
    env.flags = vec![
        "--server".into(),
        env.url.clone(),
        "--token".into(),
        admin.clone(),
    ];
    let output = env.muster(&[
        "users", "add", "alice", "--role", "user", "--queues", "team-a",
    ]);
    assert!(output.status.success(), "{output:?}");
    let alice = stdout(&output).trim().to_string();
    assert_eq!(alice.len(), 64, "{alice}");
    // Alice logs in from her own config (the token on standard input).
    let alice_config = env.path("alice-config");
    let login = |args: &[&str]| {
        let mut child = env
            .command()
            .env("XDG_CONFIG_HOME", &alice_config)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("muster runs");
        use std::io::Write;
        if let Some(mut input) = child.stdin.take() {
            let _ = writeln!(input, "{alice}");
        }
        child.wait_with_output().expect("muster ends")
    };
    let output = login(&["login", "--server", &env.url]);
    assert!(output.status.success(), "{output:?}");
    assert!(stdout(&output).contains("as alice (user)"), "{output:?}");
    let config = std::fs::read_to_string(alice_config.join("muster/config.json")).expect("config");
    assert!(config.contains(&alice));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(alice_config.join("muster/config.json"))
        .expect("config")
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "the config is its owner's only");
    let as_alice = |args: &[&str]| {
        env.command()
            .env("XDG_CONFIG_HOME", &alice_config)
            .args(args)
            .output()
            .expect("muster runs")
    };
    // The admin's job and alice's.
    let output = env.muster(&["submit", "--allow-pending", "-"]);
    assert!(!output.status.success(), "no file on stdin");
    let spec = env.path("job.yaml");
    std::fs::write(
        &spec,
        "name: theirs\nqueue: team-a\ngpus: 1\ncommand: [sleep, '60']\n",
    )
    .expect("a spec");
    let output = env.muster(&["submit", "--allow-pending", spec.to_str().expect("a path")]);
    assert!(output.status.success(), "{output:?}");
    let theirs = stdout(&output).trim().to_string();
    std::fs::write(
        &spec,
        "name: mine\nqueue: team-a\ngpus: 1\ncommand: [sleep, '60']\n",
    )
    .expect("a spec");
    let output = as_alice(&["submit", "--allow-pending", spec.to_str().expect("a path")]);
    assert!(output.status.success(), "{output:?}");
    let mine = stdout(&output).trim().to_string();
    let listed = json(&as_alice(&["ps", "--json"]));
    let ids: Vec<String> = listed["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|job| job["id"].to_string())
        .collect();
    assert_eq!(ids, vec![mine.clone()], "alice sees only her job");
    let output = as_alice(&["cancel", &theirs]);
    assert_eq!(
        output.status.code(),
        Some(3),
        "not found for her: {output:?}"
    );
    let output = as_alice(&["drain", "x"]);
    assert_eq!(output.status.code(), Some(4), "refused: {output:?}");
    // The audit log has her submission and her refused drain (entries are
    // written with the next commit: wait a moment for them).
    let mut audit = serde_json::Value::Null;
    common::wait_until("the audit entries", Duration::from_secs(10), || {
        audit = json(&env.muster(&["audit", "--json"]));
        let entries = audit["entries"].as_array().cloned().unwrap_or_default();
        entries
            .iter()
            .any(|e| e["who"] == "alice" && e["action"] == "POST /v1/jobs" && e["status"] == 201)
            && entries.iter().any(|e| {
                e["who"] == "alice"
                    && e["action"] == "POST /v1/nodes/{name}/drain"
                    && e["allowed"] == false
                    && e["status"] == 403
            })
    });
    let text = stdout(&env.muster(&["audit", "--user", "alice"]));
    assert!(text.contains("REFUSED"), "{text}");
    // A submission with a key, then the server is killed (SIGKILL) and
    // started again: the retry answers the same job.
    let body = r#"{"spec":{"name":"once","gpus":1,"command":["true"]},"allow_pending":true}"#;
    let (status, first) = http_post_with_key(&env.url, "/v1/jobs", &admin, "crash-key", body);
    assert_eq!(status, 201, "{first}");
    drop(server);
    let server = env.start(
        "server-again",
        &[
            "server",
            "--listen",
            env.url.trim_start_matches("http://"),
            "--data-dir",
            data.to_str().expect("a path"),
        ],
    );
    let (status, again) = http_post_with_key(&env.url, "/v1/jobs", &admin, "crash-key", body);
    assert_eq!(status, 200, "{again}");
    let id =
        |text: &str| serde_json::from_str::<serde_json::Value>(text).expect("JSON")["id"].clone();
    assert_eq!(id(&first), id(&again));
    // The CLI retries a submission while the server is down, with one key:
    // one job when it is back.
    drop(server);
    let mut submit = env
        .command()
        .arg("run")
        .args(&env.flags)
        .args([
            "--detach",
            "--allow-pending",
            "--name",
            "retried",
            "--gpus",
            "1",
            "--",
            "true",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("muster runs");
    std::thread::sleep(Duration::from_millis(1_500));
    let _server = env.start(
        "server-third",
        &[
            "server",
            "--listen",
            env.url.trim_start_matches("http://"),
            "--data-dir",
            data.to_str().expect("a path"),
        ],
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = submit.try_wait().expect("a status") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the retried submission ended"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{:?}", submit.wait_with_output());
    let all = json(&env.muster(&["ps", "--all", "--json"]));
    let named = |name: &str| {
        all["jobs"]
            .as_array()
            .expect("jobs")
            .iter()
            .filter(|job| job["name"] == name)
            .count()
    };
    assert_eq!(named("once"), 1, "{all}");
    assert_eq!(named("retried"), 1, "{all}");
}

#[test]
fn a_task_gets_its_secret_and_nothing_shows_it() {
    let env = Env::new();
    let listen = env.url.trim_start_matches("http://").to_string();
    let data = env.path("up-data");
    let mut up = env.spawn(
        "up",
        &[
            "up",
            "--listen",
            &listen,
            "--data-dir",
            data.to_str().expect("a path"),
            "--simulate-gpus",
            "1xH100-80GB",
        ],
    );
    env.wait_for_api(&mut up);
    let value = "hf_e2e-Secret-91c4";
    let mut child = env
        .command()
        .args(["secrets", "set", "hf"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("muster runs");
    {
        use std::io::Write;
        let mut input = child.stdin.take().expect("stdin");
        writeln!(input, "{value}").expect("written");
    }
    let output = child.wait_with_output().expect("muster ends");
    assert!(output.status.success(), "{output:?}");
    // The task proves it got the value by its hash, without printing it.
    let output = env.muster(&[
        "run",
        "--gpus",
        "1",
        "--secret",
        "HF_TOKEN=hf",
        "--",
        "sh",
        "-c",
        "printf %s \"$HF_TOKEN\" | sha256sum",
    ]);
    assert!(output.status.success(), "{output:?}");
    let expected = {
        let mut hasher = std::process::Command::new("sha256sum")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("sha256sum");
        {
            use std::io::Write;
            hasher
                .stdin
                .take()
                .expect("stdin")
                .write_all(value.as_bytes())
                .expect("written");
        }
        stdout(&hasher.wait_with_output().expect("a hash"))
    };
    assert_eq!(
        stdout(&output).split_whitespace().next(),
        expected.split_whitespace().next(),
        "{output:?}"
    );
    // Not in describe, ps, the secrets list, the server's log or its store.
    for args in [
        &["describe", "1", "--json"][..],
        &["ps", "--all", "--json"],
        &["secrets", "list", "--json"],
    ] {
        let output = env.muster(args);
        assert!(output.status.success(), "{args:?}: {output:?}");
        assert!(
            !stdout(&output).contains(value),
            "{args:?} shows the secret"
        );
    }
    let log = std::fs::read_to_string(env.path("up.log")).expect("the log");
    assert!(!log.contains(value), "the server's log holds the secret");
    let store = std::fs::read(data.join("muster.db")).expect("the store");
    assert!(!store.windows(value.len()).any(|w| w == value.as_bytes()));
    // A secret that does not exist is refused at submission.
    let output = env.muster(&["run", "--gpus", "1", "--secret", "X=nope", "--", "true"]);
    assert_eq!(output.status.code(), Some(6), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("no secret \"nope\""));
}

/// TLS by default: `muster server` makes a cluster CA and serves HTTPS; an
/// agent joins with the CA's fingerprint, the CLI logs in with it and runs
/// a job; a wrong fingerprint, a plain-HTTP client and a name the
/// certificate is not for are refused; a replaced certificate is served
/// without a restart while the agent goes on; `muster up` writes the CA
/// into the client config.
#[test]
fn tls_is_the_default_and_a_pinned_ca_is_what_clients_trust() {
    let mut env = Env::new();
    env.tls = true;
    let (_server, data) = env.start_server();
    let address = env.url.trim_start_matches("http://").to_string();
    let url = format!("https://{address}");
    // The join command is printed once the server listens.
    common::wait_until("the join command", Duration::from_secs(30), || {
        std::fs::read_to_string(env.path("server.log")).is_ok_and(|log| log.contains("--ca-sha256"))
    });
    let log = std::fs::read_to_string(env.path("server.log")).expect("server log");
    let fingerprint = std::fs::read_to_string(data.join("tls/ca.sha256"))
        .expect("the CA's fingerprint")
        .trim()
        .to_string();
    assert!(fingerprint.starts_with("sha256:") && fingerprint.len() == 71);
    assert!(
        log.contains(&format!("--ca-sha256 {fingerprint}")) && log.contains(&url),
        "the join command is printed with the fingerprint: {log}"
    );
    for key in ["tls/ca.key", "tls/server.key"] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(data.join(key))
            .expect(key)
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{key} is its owner's only: {mode:o}");
    }
    let admin = std::fs::read_to_string(data.join("admin.token")).expect("admin token");
    let admin = admin.trim();

    // Plain HTTP gets no answer from an HTTPS server.
    let plain = env.muster(&["ps", "--server", &env.url, "--token", admin]);
    assert_eq!(plain.status.code(), Some(5), "{plain:?}");
    assert!(
        String::from_utf8_lossy(&plain.stderr).contains("use an https:// URL"),
        "{plain:?}"
    );
    // Without a fingerprint (and no local CA to find) the system's roots do
    // not know the cluster CA; with a wrong one, the pin does not match.
    let unknown = env.muster(&["ps", "--server", &url, "--token", admin]);
    assert_eq!(unknown.status.code(), Some(5), "{unknown:?}");
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("--ca-sha256"),
        "the error says what to do: {unknown:?}"
    );
    let wrong = format!("sha256:{}", "00".repeat(32));
    let refused = env.muster(&[
        "ps",
        "--server",
        &url,
        "--token",
        admin,
        "--ca-sha256",
        &wrong,
    ]);
    assert_eq!(refused.status.code(), Some(5), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("not the pinned one"),
        "{refused:?}"
    );

    // An agent joins with the fingerprint.
    let join = data.join("join.token");
    let _agent = env.spawn(
        "agent",
        &[
            "agent",
            "--server",
            &url,
            "--ca-sha256",
            &fingerprint,
            "--join-token-file",
            join.to_str().unwrap(),
            "--name",
            "tls-node",
            "--address",
            "127.0.0.1",
            "--simulate-gpus",
            "1xH100-80GB",
            "--state-dir",
            env.path("agent").to_str().unwrap(),
        ],
    );
    // An admin logs in with the fingerprint: the config keeps it, and
    // the CLI needs no flags after that.
    let login = env
        .command()
        .args(["login", "--server", &url, "--ca-sha256", &fingerprint])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(format!("{admin}\n").as_bytes())?;
            child.wait_with_output()
        })
        .expect("login runs");
    assert!(login.status.success(), "{login:?}");
    let config = std::fs::read_to_string(env.path("config/muster/config.json")).expect("config");
    assert!(config.contains(&fingerprint), "{config}");
    common::wait_until("the node over TLS", Duration::from_secs(30), || {
        json(&env.muster(&["nodes", "--json"]))["nodes"]
            .as_array()
            .is_some_and(|nodes| nodes.iter().any(|n| n["state"] == "ready"))
    });
    prometheus_scrapes_https(&env, &address, &data);
    let run = env.muster(&["run", "--gpus", "1", "--", "echo", "over-tls"]);
    assert!(run.status.success(), "{run:?}");
    assert!(stdout(&run).contains("over-tls"), "{run:?}");
    // The name in the URL must be one the certificate is for.
    let by_name = format!("https://localhost:{}", address.rsplit(':').next().unwrap());
    let named = env.muster(&["ps", "--server", &by_name, "--ca-sha256", &fingerprint]);
    assert!(
        named.status.success(),
        "localhost is in the certificate: {named:?}"
    );

    // The server certificate is replaced on disk by one for 127.0.0.1 only
    // (signed by the same CA): it is served without a restart, the agent
    // goes on, and `localhost` is now refused.
    let ca_key = rcgen::KeyPair::from_pem(
        &std::fs::read_to_string(data.join("tls/ca.key")).expect("CA key"),
    )
    .expect("CA key");
    let issuer = rcgen::Issuer::new(muster_server::tls::ca_params(), &ca_key);
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let leaf = params.signed_by(&key, &issuer).expect("signed");
    let ca_pem = std::fs::read_to_string(data.join("tls/ca.pem")).expect("CA");
    std::fs::write(data.join("tls/new.key"), key.serialize_pem()).unwrap();
    std::fs::write(data.join("tls/new.pem"), format!("{}{ca_pem}", leaf.pem())).unwrap();
    std::fs::rename(data.join("tls/new.key"), data.join("tls/server.key")).unwrap();
    std::fs::rename(data.join("tls/new.pem"), data.join("tls/server.pem")).unwrap();
    common::wait_until("the new certificate", Duration::from_secs(30), || {
        let named = env.muster(&["ps", "--server", &by_name, "--ca-sha256", &fingerprint]);
        !named.status.success()
            && String::from_utf8_lossy(&named.stderr).contains("not valid for name")
    });
    let again = env.muster(&["run", "--gpus", "1", "--", "echo", "after-rotation"]);
    assert!(again.status.success(), "{again:?}");
    assert!(stdout(&again).contains("after-rotation"), "{again:?}");
    let nodes = json(&env.muster(&["nodes", "--json"]));
    assert_eq!(nodes["nodes"][0]["state"], "ready", "{nodes}");
    assert!(
        std::fs::read_to_string(env.path("agent.log"))
            .unwrap_or_default()
            .matches("registered")
            .count()
            == 1,
        "the agent never had to register again"
    );
}

/// `muster up` serves HTTPS too, and the CLI finds its CA through the
/// client config; `--insecure-http` is what plain HTTP takes.
#[test]
fn muster_up_serves_https_and_the_cli_trusts_it_with_no_flags() {
    let mut env = Env::new();
    env.tls = true;
    let listen = env.url.trim_start_matches("http://").to_string();
    let data = env.path("up-data");
    let _up = env.start(
        "up",
        &[
            "up",
            "--listen",
            &listen,
            "--data-dir",
            data.to_str().unwrap(),
            "--simulate-gpus",
            "1xH100-80GB",
        ],
    );
    // The client config, token and CA are all there before the port opens,
    // so a script that waits for the port can use the CLI at once.
    let config = std::fs::read_to_string(env.path("config/muster/config.json"))
        .expect("the client config exists once the port is open");
    assert!(
        config.contains("https://") && config.contains("ca.pem"),
        "{config}"
    );
    assert!(data.join("admin.token").exists() && data.join("tls/ca.pem").exists());
    // A second `muster up` on the same port fails and leaves the running
    // cluster's config as it was.
    let second = env
        .command()
        .args([
            "up",
            "--listen",
            &listen,
            "--data-dir",
            env.path("other-data").to_str().unwrap(),
            "--simulate-gpus",
            "1xH100-80GB",
        ])
        .output()
        .expect("muster runs");
    assert!(
        !second.status.success() && String::from_utf8_lossy(&second.stderr).contains("in use"),
        "{second:?}"
    );
    assert_eq!(
        std::fs::read_to_string(env.path("config/muster/config.json")).expect("config"),
        config,
        "a failed start restores the config it found"
    );
    let run = env.muster(&["run", "--", "echo", "up-over-tls"]);
    assert!(run.status.success(), "{run:?}");
    assert!(stdout(&run).contains("up-over-tls"));
    let plain = env.muster(&["ps", "--server", &env.url]);
    assert!(
        !plain.status.success(),
        "an HTTPS server does not speak HTTP"
    );
}

/// `--tls-cert/--tls-key`: the operator's own certificate (here from a CA
/// the test makes) is served, and clients trust it through the CA's file
/// (`MUSTER_CA_FILE`) or its fingerprint; the server made no CA of its own.
#[test]
fn an_operators_own_certificate_is_served_and_trusted_through_its_ca() {
    let mut env = Env::new();
    env.tls = true;
    let dir = env.path("pki");
    std::fs::create_dir_all(&dir).unwrap();
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let mut ca_params = rcgen::CertificateParams::default();
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "operator CA");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca = ca_params.self_signed(&ca_key).expect("CA");
    let issuer = rcgen::Issuer::new(ca_params, &ca_key);
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let leaf = params.signed_by(&key, &issuer).expect("leaf");
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(
        dir.join("server.pem"),
        format!("{}{}", leaf.pem(), ca.pem()),
    )
    .unwrap();
    std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();

    let address = env.url.trim_start_matches("http://").to_string();
    let data = env.path("server-data");
    let _server = env.start(
        "server",
        &[
            "server",
            "--listen",
            &address,
            "--data-dir",
            data.to_str().unwrap(),
            "--tls-cert",
            dir.join("server.pem").to_str().unwrap(),
            "--tls-key",
            dir.join("server.key").to_str().unwrap(),
        ],
    );
    assert!(!data.join("tls/ca.pem").exists(), "no CA of its own");
    let url = format!("https://{address}");
    let admin = std::fs::read_to_string(data.join("admin.token")).expect("admin token");
    let by_file = env
        .command()
        .env("MUSTER_CA_FILE", dir.join("ca.pem"))
        .args(["queues", "--server", &url, "--token", admin.trim()])
        .output()
        .expect("muster runs");
    assert!(by_file.status.success(), "{by_file:?}");
    let fingerprint = muster_api::tls::fingerprint_of_pem(ca.pem().as_bytes()).unwrap();
    let by_pin = env.muster(&[
        "queues",
        "--server",
        &url,
        "--token",
        admin.trim(),
        "--ca-sha256",
        &fingerprint.to_string(),
    ]);
    assert!(by_pin.status.success(), "{by_pin:?}");
    // Both flags are needed together.
    let half = env.muster(&["server", "--tls-cert", "x.pem"]);
    assert!(!half.status.success());
    assert!(
        String::from_utf8_lossy(&half.stderr).contains("--tls-key"),
        "{half:?}"
    );
}

/// What-if on the cluster's own history: jobs run through a real `muster
/// up`, `muster history export` writes them (oldest first, one row each),
/// and `muster sim replay --format muster` replays them under two policies.
#[test]
fn a_clusters_history_is_exported_and_replayed() {
    let env = Env::new();
    let listen = env.url.trim_start_matches("http://").to_string();
    let data = env.path("up-data");
    let _up = env.start(
        "up",
        &[
            "up",
            "--listen",
            &listen,
            "--data-dir",
            data.to_str().unwrap(),
            "--simulate-gpus",
            "2xH100-80GB",
        ],
    );
    common::wait_until("the client config", Duration::from_secs(30), || {
        env.path("config/muster/config.json").exists()
    });
    for (gpus, seconds) in [("1", "0.3"), ("2", "0.2"), ("0.5", "0.1")] {
        let run = env.muster(&["run", "--gpus", gpus, "--", "sleep", seconds]);
        assert!(run.status.success(), "{run:?}");
    }
    let export = env.muster(&["history", "export", "--since", "1h"]);
    assert!(export.status.success(), "{export:?}");
    let csv = stdout(&export);
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], muster_sim::MUSTER_HISTORY_HEADER);
    assert_eq!(lines.len(), 4, "a row per job that ran: {csv}");
    assert!(
        lines.iter().any(|line| line.contains(",1,0.5,default,")),
        "{csv}"
    );
    std::fs::write(env.path("jobs.csv"), &csv).unwrap();
    let cluster = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/clusters/small.yaml"
    );
    let out = env.path("replay");
    let jobs = env.path("jobs.csv");
    let replay = env.muster(&[
        "sim",
        "replay",
        "--trace",
        jobs.to_str().unwrap(),
        "--format",
        "muster",
        "--cluster",
        cluster,
        "--policies",
        "fifo,default",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(replay.status.success(), "{replay:?}");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(results["format"], "muster");
    assert_eq!(results["jobs"], 3);
    for run in results["results"].as_array().unwrap() {
        assert_eq!(run["completed"], 3, "{run}");
    }
    // With other queues: the guarantee given, and a bad file named.
    std::fs::write(
        env.path("queues.yaml"),
        "default: {guaranteed_gpus: 6, weight: 2}
",
    )
    .unwrap();
    std::fs::write(
        env.path("bad.yaml"),
        "default: {guaranteed: 6}
",
    )
    .unwrap();
    let with = |queues: &str, out: &str| {
        let out = env.path(out);
        let output = env.muster(&[
            "sim",
            "replay",
            "--trace",
            jobs.to_str().unwrap(),
            "--format",
            "muster",
            "--cluster",
            cluster,
            "--policies",
            "default",
            "--queues",
            env.path(queues).to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        (output, out)
    };
    let (output, out) = with("queues.yaml", "replay-queues");
    assert!(output.status.success(), "{output:?}");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(
        results["results"][0]["per_queue"]["default"]["guaranteed_share"], 0.25,
        "6 of small.yaml's 24 GPUs: {}",
        results["results"][0]["per_queue"]
    );
    let (output, _) = with("bad.yaml", "replay-bad");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("default.guaranteed: unknown field") && stderr.contains("bad.yaml"),
        "{stderr}"
    );
    // On the cluster the server has today, and on twice its nodes.
    let out = env.path("replay-here");
    let replay = env.muster(&[
        "sim",
        "replay",
        "--trace",
        jobs.to_str().unwrap(),
        "--format",
        "muster",
        "--cluster-from",
        &env.url,
        "--scale-nodes",
        "2",
        "--policies",
        "default",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(replay.status.success(), "{replay:?}");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(results["cluster"]["nodes"], 2, "{}", results["cluster"]);
    assert_eq!(results["cluster"]["gpus"], 4, "{}", results["cluster"]);
    assert_eq!(results["results"][0]["completed"], 3);
}

/// Issue 14: a pending job says when it should start: the scheduler's plan
/// run ahead (here: the job holding the only GPU says it takes 2 hours), in
/// the API, `describe`, `ps --wide` and `muster run` while it waits.
#[test]
fn a_pending_job_says_when_it_should_start() {
    let env = Env::new();
    let listen = env.url.trim_start_matches("http://").to_string();
    let data = env.path("up-data");
    let _up = env.start(
        "up",
        &[
            "up",
            "--listen",
            &listen,
            "--data-dir",
            data.to_str().unwrap(),
            "--simulate-gpus",
            "1xH100-80GB",
        ],
    );
    let spec = env.path("long.yaml");
    std::fs::write(
        &spec,
        "name: long\ngpus: 1\nestimated_runtime: 2h\ncommand: [sleep, '1000']\n",
    )
    .unwrap();
    let holder = stdout(&env.muster(&["submit", spec.to_str().unwrap()]))
        .trim()
        .to_string();
    let holder_view = || json(&env.muster(&["describe", &holder, "--json"]));
    common::wait_until("the long job to run", Duration::from_secs(30), || {
        holder_view()["state"] == "running"
    });
    let started_ms = holder_view()["started_ms"].as_u64().expect("started");
    let output = env.muster(&["run", "--detach", "--gpus", "1", "--", "true"]);
    let waiting = stdout(&output).trim().to_string();
    let view = || json(&env.muster(&["describe", &waiting, "--json"]));
    common::wait_until("a start forecast", Duration::from_secs(30), || {
        view()["estimated_start"]["kind"] == "at"
    });
    let at = view()["estimated_start"]["at_ms"].as_u64().expect("a time");
    let expected = started_ms + 2 * 3_600_000;
    assert!(
        at.abs_diff(expected) < 60_000,
        "forecast {at}, the long job's estimated end {expected}"
    );
    let text = stdout(&env.muster(&["describe", &waiting]));
    assert!(text.contains("starts:    in about 1h 5"), "{text}");
    let table = stdout(&env.muster(&["ps", "--wide"]));
    assert!(table.contains("STARTS") && table.contains("~1h"), "{table}");
    assert!(!stdout(&env.muster(&["ps"])).contains("STARTS"));
    // `muster run` says it while it waits (first in line once the other
    // waiting job is cancelled).
    assert!(env.muster(&["cancel", &waiting]).status.success());
    let mut run = env.spawn("waiter", &["run", "--gpus", "1", "--", "true"]);
    common::wait_until("run to say when", Duration::from_secs(30), || {
        std::fs::read_to_string(env.path("waiter.log"))
            .unwrap_or_default()
            .contains("expected to start in about 1h 5")
    });
    // Once the long job is cancelled the waiting one runs and `run` ends;
    // a job that is not pending has no forecast.
    assert!(env.muster(&["cancel", &holder]).status.success());
    common::wait_until(
        "run to end",
        Duration::from_secs(30),
        || matches!(run.child.try_wait(), Ok(Some(status)) if status.success()),
    );
    assert!(view().get("estimated_start").is_none(), "{}", view());
}
