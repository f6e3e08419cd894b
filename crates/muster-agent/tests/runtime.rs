//! The process runtime with real supervisors and real processes, under each
//! kind of task isolation this host offers: no cgroups (process groups and a
//! subreaper), cgroup v1, and cgroup v2 (the hybrid `unified` hierarchy where
//! that is all there is). Each test waits by polling with a deadline, never
//! by a fixed sleep; what they start is killed when they end.
//!
//! The tests run as root (as CI does), so each task runs as a uid of its
//! own from the default task uid range, and, as the agent's default
//! (`--task-namespaces auto`) does where the host allows it, in a PID and
//! mount namespace of its own; the escape test runs without namespaces
//! too.

use muster_agent::runtime::cgroup::{self, CgroupChoice, CgroupPlan};
use muster_agent::{
    EndReason, ProcessRuntime, RecoveredStatus, RuntimeConfig, RuntimeError, StopOutcome, TaskExit,
    TaskLaunch,
};
use muster_model::{Signal, Time};
use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Long enough for a loaded 2-core CI machine; tests finish far sooner.
const DEADLINE: Duration = Duration::from_secs(20);

const SUPERVISOR: &str = env!("CARGO_BIN_EXE_muster-supervise");

fn launch(allocation: &str, script: &str) -> TaskLaunch {
    TaskLaunch {
        allocation: allocation.to_string(),
        command: vec!["sh".to_string(), "-c".to_string(), script.to_string()],
        env: BTreeMap::new(),
        working_dir: None,
        gpu_indices: Vec::new(),
        gpu_uuids: Vec::new(),
        stop_signal: Signal::Term,
        grace_period: Duration::from_secs(1),
        user: None,
        user_group: None,
        memory_limit_mib: None,
        image: None,
        cpu_milli: None,
        registry_auth: None,
        mounts: Vec::new(),
    }
}

fn far_future() -> u64 {
    now_ms() + 3_600_000
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A runtime in a fresh directory, with no cgroups and a fence deadline an
/// hour away.
fn runtime() -> (tempfile::TempDir, ProcessRuntime) {
    runtime_with(CgroupPlan::None)
}

fn runtime_with(cgroups: CgroupPlan) -> (tempfile::TempDir, ProcessRuntime) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let runtime = again(dir.path(), cgroups);
    runtime
        .set_fence_deadline(far_future())
        .expect("the fence deadline");
    (dir, runtime)
}

/// Another runtime on the same directory (as after an agent restart).
fn again(dir: &Path, cgroups: CgroupPlan) -> ProcessRuntime {
    again_with(dir, cgroups, namespaces())
}

fn again_with(dir: &Path, cgroups: CgroupPlan, namespaces: bool) -> ProcessRuntime {
    ProcessRuntime::new(RuntimeConfig {
        cgroups,
        namespaces,
        ..RuntimeConfig::new(dir.to_path_buf(), PathBuf::from(SUPERVISOR))
    })
}

/// Whether tasks get namespaces, as the agent decides by default: where
/// it is root and the host allows them (as root, they must be allowed here:
/// CI runs as root).
fn namespaces() -> bool {
    if !nix::unistd::Uid::effective().is_root() {
        return false;
    }
    muster_agent::taskinit::namespaces_available(Path::new(SUPERVISOR))
        .map_err(|why| format!("tests run as root must be able to make namespaces: {why}"))
        .expect("namespaces");
    true
}

/// The default task uid range.
fn task_uids() -> std::ops::RangeInclusive<u32> {
    let range = muster_agent::runtime::uids::UidRange::parse(
        muster_agent::runtime::uids::DEFAULT_TASK_UID_RANGE,
    )
    .expect("the default range");
    range.first()..=range.last()
}

/// The cgroup plans this host offers, named; none is always there. v1 and
/// v2 must be usable where the host mounts them (CI runs as root).
fn plans(node: &str) -> Vec<(&'static str, CgroupPlan)> {
    let mut plans = vec![("none", CgroupPlan::None)];
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mounts = cgroup::parse_mountinfo(&mountinfo);
    if mounts
        .iter()
        .any(|m| !m.version2 && m.controllers.iter().any(|c| c == "freezer"))
    {
        let (plan, _) = cgroup::detect(CgroupChoice::V1, node, None)
            .expect("the host mounts cgroup v1: the tests (run as root) must be able to use it");
        plans.push(("v1", plan));
    }
    if mounts.iter().any(|m| m.version2) {
        let (plan, _) = cgroup::detect(CgroupChoice::V2, node, None)
            .expect("the host mounts cgroup v2: the tests (run as root) must be able to use it");
        plans.push(("v2", plan));
    }
    plans
}

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, future)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

async fn next_exit(runtime: &ProcessRuntime) -> TaskExit {
    within("a task to exit", runtime.next_exit()).await
}

/// Polls `condition` every 10 ms until it holds.
async fn eventually(what: &str, mut condition: impl AsyncFnMut() -> bool) {
    within(what, async {
        while !condition().await {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

async fn log_text(runtime: &ProcessRuntime, allocation: &str) -> String {
    let (bytes, _) = runtime
        .read_log(allocation, 0, 1 << 20)
        .await
        .expect("the log exists");
    String::from_utf8_lossy(&bytes).into_owned()
}

async fn wait_for_log(runtime: &ProcessRuntime, allocation: &str, text: &str) {
    eventually(&format!("`{text}` in the log"), async || {
        log_text(runtime, allocation).await.contains(text)
    })
    .await;
}

/// Processes whose command line holds `marker` (and that are not zombies).
fn processes_with(marker: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        if !zombie && String::from_utf8_lossy(&cmdline).contains(marker) {
            found.push(pid);
        }
    }
    found
}

/// A shell command that sleeps forever, ignoring TERM, named `name` (its
/// `$0`, so it shows on its command line).
fn sleeper(name: &str) -> String {
    format!("sh -c 'trap \"\" TERM; while :; do sleep 1; done' {name}")
}

/// The sleepers ([`sleeper`]) whose name starts with `marker`.
fn sleepers(marker: &str) -> usize {
    processes_with(marker)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                let arguments: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
                arguments.len() >= 4
                    && arguments[0] == b"sh"
                    && arguments[3].starts_with(marker.as_bytes())
            })
        })
        .count()
}

/// Kills processes a failed test may have left behind.
struct KillOnDrop(&'static str);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in processes_with(self.0) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// A script that leaves two processes that escape its process group: one
/// through `setsid`, one through a double fork into a new session; each
/// sleeps with `marker` on its command line and ignores TERM.
fn escaping(marker: &str) -> String {
    format!(
        "trap '' TERM; \
         setsid sh -c 'while :; do sleep 1; done' {marker}-a </dev/null >/dev/null 2>&1 & \
         (setsid sh -c 'sh -c \"while :; do sleep 1; done\" {marker}-b & exit 0' & ) ; \
         echo ready"
    )
}

async fn wait_for_processes(marker: &str, count: usize) {
    eventually(
        &format!("{count} sleeping processes of {marker}"),
        async || sleepers(marker) >= count,
    )
    .await;
}

async fn wait_for_no_process(marker: &str) {
    eventually(&format!("no process of {marker} left"), async || {
        processes_with(marker).is_empty()
    })
    .await;
}

#[tokio::test]
async fn task_sees_its_gpus_and_env_but_not_the_agents() {
    let (_dir, runtime) = runtime();
    let mut task = launch(
        "env-1",
        "echo cuda=[$CUDA_VISIBLE_DEVICES] nvidia=[$NVIDIA_VISIBLE_DEVICES] \
         order=$CUDA_DEVICE_ORDER uuids=$MUSTER_GPU_UUIDS job=$MUSTER_JOB_ID \
         cargo=[$CARGO_PKG_NAME] path=${PATH:+set} user=$USER home=$HOME uid=$(id -u)",
    );
    task.gpu_indices = vec![2, 5];
    task.gpu_uuids = vec!["GPU-a".to_string(), "GPU-b".to_string()];
    task.env
        .insert("MUSTER_JOB_ID".to_string(), "42".to_string());
    task.env
        .insert("CUDA_VISIBLE_DEVICES".to_string(), "0,1,2,3".to_string());
    runtime.start(task).await.expect("start");
    let exit = next_exit(&runtime).await;
    assert_eq!(exit.exit_code, Some(0));
    // A uid of its own, named after it; its home is its (private) /tmp.
    let log = log_text(&runtime, "env-1").await;
    let uid = log
        .trim()
        .rsplit_once("uid=")
        .and_then(|(_, uid)| uid.parse::<u32>().ok())
        .unwrap_or_else(|| panic!("no uid: {log}"));
    assert!(task_uids().contains(&uid), "{log}");
    assert_eq!(
        log,
        format!(
            "cuda=[2,5] nvidia=[2,5] order=PCI_BUS_ID uuids=GPU-a,GPU-b job=42 cargo=[] \
             path=set user=muster-task-{uid} home=/tmp uid={uid}\n"
        )
    );
}

#[tokio::test]
async fn no_gpus_means_an_empty_cuda_visible_devices() {
    let (_dir, runtime) = runtime();
    runtime
        .start(launch(
            "nogpu",
            "test \"${CUDA_VISIBLE_DEVICES-unset}\" = '' && echo empty",
        ))
        .await
        .expect("start");
    assert_eq!(next_exit(&runtime).await.exit_code, Some(0));
    assert_eq!(log_text(&runtime, "nogpu").await, "empty\n");
}

#[tokio::test]
async fn exit_code_and_both_streams_are_captured() {
    let (dir, runtime) = runtime();
    let workdir = dir.path().join("work");
    std::fs::create_dir(&workdir).expect("mkdir");
    let mut task = launch("exit-3", "pwd; echo out; echo err >&2; exit 3");
    task.working_dir = Some(workdir.clone());
    runtime.start(task).await.expect("start");
    let exit = next_exit(&runtime).await;
    assert_eq!(exit.allocation, "exit-3");
    assert_eq!((exit.exit_code, exit.signal), (Some(3), None));
    assert_eq!(exit.reason, EndReason::Exited);
    let log = log_text(&runtime, "exit-3").await;
    assert_eq!(log, format!("{}\nout\nerr\n", workdir.display()));
    assert_eq!(
        runtime.log_path("exit-3"),
        dir.path().join("logs").join("exit-3.log")
    );
}

#[tokio::test]
async fn logs_are_read_in_pieces_from_an_offset() {
    let (_dir, runtime) = runtime();
    runtime
        .start(launch("pieces", "printf 'hello world'"))
        .await
        .expect("start");
    next_exit(&runtime).await;
    let (first, offset) = runtime.read_log("pieces", 0, 5).await.expect("log");
    assert_eq!((first.as_slice(), offset), (b"hello".as_slice(), 5));
    let (rest, offset) = runtime.read_log("pieces", offset, 100).await.expect("log");
    assert_eq!((rest.as_slice(), offset), (b" world".as_slice(), 11));
    let (nothing, offset) = runtime.read_log("pieces", 50, 100).await.expect("log");
    assert_eq!((nothing.len(), offset), (0, 50));
    let error = runtime.read_log("other", 0, 10).await.expect_err("no log");
    assert!(matches!(error, RuntimeError::NoLog { .. }), "{error}");
}

#[tokio::test]
async fn stop_with_term_lets_a_trap_exit_cleanly() {
    let (_dir, runtime) = runtime();
    runtime
        .start(launch(
            "trap-term",
            "trap 'echo saving; exit 0' TERM; echo ready; while :; do sleep 0.05; done",
        ))
        .await
        .expect("start");
    wait_for_log(&runtime, "trap-term", "ready").await;
    let outcome = within(
        "the stop",
        runtime.stop("trap-term", Signal::Term, Duration::from_secs(5)),
    )
    .await
    .expect("stop");
    assert_eq!(outcome, StopOutcome::Exited);
    let exit = next_exit(&runtime).await;
    assert_eq!(exit.exit_code, Some(0));
    assert_eq!(exit.reason, EndReason::Stopped);
    assert!(log_text(&runtime, "trap-term").await.contains("saving"));
}

#[tokio::test]
async fn a_task_ignoring_term_is_killed_after_the_grace_period() {
    let (_dir, runtime) = runtime();
    runtime
        .start(launch(
            "stubborn",
            "trap '' TERM; echo ready; while :; do sleep 0.05; done",
        ))
        .await
        .expect("start");
    wait_for_log(&runtime, "stubborn", "ready").await;
    let started = std::time::Instant::now();
    let grace = Duration::from_millis(300);
    let outcome = within("the stop", runtime.stop("stubborn", Signal::Term, grace))
        .await
        .expect("stop");
    assert_eq!(outcome, StopOutcome::Killed);
    assert!(started.elapsed() >= grace, "waited the grace period");
    let exit = next_exit(&runtime).await;
    assert_eq!((exit.exit_code, exit.signal), (None, Some(9)));
    let again = runtime
        .stop("stubborn", Signal::Term, grace)
        .await
        .expect("stop again");
    assert_eq!(again, StopOutcome::NotRunning);
}

/// `setsid` and double-forked children die with a stop, under each kind of
/// isolation, and nothing is left of a task that ended by itself either.
#[tokio::test]
async fn escaped_children_die_with_a_stop_and_with_the_task_under_every_isolation() {
    let variants = plans("escape-test")
        .into_iter()
        .flat_map(|(kind, plan)| [true, false].map(|namespaces| (kind, plan.clone(), namespaces)));
    for (kind, plan, namespaces) in variants {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let runtime = again_with(dir.path(), plan.clone(), namespaces && self::namespaces());
        runtime.set_fence_deadline(far_future()).expect("deadline");
        let kind: &'static str =
            Box::leak(format!("{kind}{}", if namespaces { "-ns" } else { "" }).into_boxed_str());
        let marker: &'static str = Box::leak(format!("muster-escape-{kind}").into_boxed_str());
        let _guard = KillOnDrop(marker);
        // Stopped while its escaped children run.
        let script = format!("{}; while :; do sleep 0.05; done", escaping(marker));
        runtime
            .start(launch("escape-stop", &script))
            .await
            .expect("start");
        wait_for_processes(marker, 2).await;
        let outcome = within(
            "the stop",
            runtime.stop("escape-stop", Signal::Term, Duration::from_millis(200)),
        )
        .await
        .expect("stop");
        assert_eq!(
            outcome,
            StopOutcome::Killed,
            "{kind}: the leader ignores TERM"
        );
        assert_eq!(next_exit(&runtime).await.reason, EndReason::Stopped);
        assert!(
            processes_with(marker).is_empty(),
            "{kind}: escaped processes survived the stop: {:?}",
            processes_with(marker)
        );

        // Ended by itself, leaving daemons behind: they go with it.
        runtime
            .start(launch(
                "escape-exit",
                &format!("{}; sleep 0.5", escaping(marker)),
            ))
            .await
            .expect("start");
        let exit = next_exit(&runtime).await;
        assert_eq!(exit.exit_code, Some(0), "{kind}");
        assert!(
            processes_with(marker).is_empty(),
            "{kind}: processes outlived their task: {:?}",
            processes_with(marker)
        );
        // The task's cgroup is gone with it.
        if let CgroupPlan::V1 { freezer, .. } = &plan {
            assert!(!freezer.join("escape-exit").exists(), "{kind}");
        }
        if let CgroupPlan::V2 { parent, .. } = &plan {
            assert!(!parent.join("escape-exit").exists(), "{kind}");
        }
    }
}

/// The fence deadline passes while the agent is gone: the supervisor kills
/// the task, its escaped children, whatever the task did to its `PATH`, its
/// signals or its files, and says it was fenced.
#[tokio::test]
async fn a_task_is_fenced_at_the_deadline_with_no_agent_whatever_it_does() {
    for (kind, plan) in plans("fence-test") {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let marker: &'static str = Box::leak(format!("muster-fence-{kind}").into_boxed_str());
        let _guard = KillOnDrop(marker);
        let first = again(dir.path(), plan.clone());
        first.set_fence_deadline(far_future()).expect("deadline");
        let fence = dir.path().join("fence_at");
        let script = format!(
            "{escape}; export PATH=/nonexistent; \
             echo 99999999999999 > {fence} 2>/dev/null && echo wrote-fence; \
             kill -USR1 $PPID 2>/dev/null && echo signalled-supervisor; \
             cat {fence} >/dev/null 2>&1 && echo read-fence; \
             while :; do /bin/sleep 0.05; done",
            escape = escaping(marker),
            fence = fence.display()
        );
        first.start(launch("fenced", &script)).await.expect("start");
        wait_for_processes(marker, 2).await;
        wait_for_log(&first, "fenced", "ready").await;
        // The agent dies (its runtime is dropped), having renewed the lease
        // last with a deadline 300 ms from now.
        first.set_fence_deadline(now_ms() + 300).expect("deadline");
        drop(first);
        let second = again(dir.path(), plan.clone());
        let exit = within("the fence", async {
            loop {
                let recovery = second.recover().await.expect("recover");
                let task = recovery
                    .tasks
                    .iter()
                    .find(|t| t.allocation == "fenced")
                    .expect("the task's record");
                if let RecoveredStatus::Exited(exit) = &task.status {
                    break exit.clone();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert_eq!(exit.reason, EndReason::Fenced, "{kind}");
        assert!(processes_with(marker).is_empty(), "{kind}");
        let log = log_text(&second, "fenced").await;
        assert!(
            !log.contains("wrote-fence") && !log.contains("read-fence"),
            "{kind}: the task reached the fence file: {log}"
        );
    }
}

#[tokio::test]
async fn a_task_runs_unprivileged_and_cannot_read_the_agent_state() {
    let (dir, runtime) = runtime();
    let state = dir.path().display().to_string();
    runtime
        .start(launch(
            "nosy",
            &format!(
                "id -u; cat {state}/fence_at && echo read-state; ls {state}/logs && echo listed"
            ),
        ))
        .await
        .expect("start");
    let exit = next_exit(&runtime).await;
    assert_ne!(exit.exit_code, Some(0));
    let log = log_text(&runtime, "nosy").await;
    let uid: u32 = log
        .lines()
        .next()
        .and_then(|line| line.parse().ok())
        .unwrap_or_else(|| panic!("no uid first: {log}"));
    assert!(
        task_uids().contains(&uid),
        "{uid} is not of the task range: {log}"
    );
    assert!(
        !log.contains("read-state") && !log.contains("listed"),
        "{log}"
    );
    use std::os::unix::fs::PermissionsExt;
    for path in [
        dir.path().to_path_buf(),
        dir.path().join("logs"),
        dir.path().join("tasks"),
    ] {
        let mode = std::fs::metadata(&path)
            .expect("metadata")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700, "{}", path.display());
    }
    let mode = std::fs::metadata(runtime.log_path("nosy"))
        .expect("metadata")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[tokio::test]
async fn a_task_over_its_memory_limit_is_killed_and_says_so() {
    for (kind, plan) in plans("memory-test") {
        let limited = match &plan {
            CgroupPlan::V1 { memory, .. } => memory.is_some(),
            CgroupPlan::V2 { memory, .. } => *memory,
            CgroupPlan::None => false,
        };
        if !limited {
            continue;
        }
        let (_dir, runtime) = runtime_with(plan);
        let mut task = launch("hungry", "");
        task.command = ["dd", "if=/dev/zero", "of=/dev/null", "bs=256M", "count=1"]
            .map(String::from)
            .to_vec();
        task.memory_limit_mib = Some(32);
        runtime.start(task).await.expect("start");
        let exit = next_exit(&runtime).await;
        assert_eq!(exit.reason, EndReason::MemoryLimit, "{kind}: {exit:?}");
        assert!(exit.usage.oom_killed, "{kind}");
    }
}

/// A fork bomb stops at the task's pids limit, where the node has a pids
/// controller, and what it forked goes with it.
#[tokio::test]
async fn a_fork_bomb_stops_at_the_task_s_pids_limit() {
    for (kind, plan) in plans("pids-test") {
        let limited = match &plan {
            CgroupPlan::V1 { pids, .. } => pids.is_some(),
            CgroupPlan::V2 { parent, .. } => {
                parent.join("pids.max").exists()
                    || std::fs::read_to_string(parent.join("cgroup.subtree_control"))
                        .is_ok_and(|c| c.contains("pids"))
            }
            CgroupPlan::None => false,
        };
        if !limited {
            continue;
        }
        let dir = tempfile::tempdir().expect("a temporary directory");
        let runtime = ProcessRuntime::new(RuntimeConfig {
            cgroups: plan,
            task_pids_max: Some(20),
            ..RuntimeConfig::new(dir.path().to_path_buf(), PathBuf::from(SUPERVISOR))
        });
        runtime.set_fence_deadline(far_future()).expect("deadline");
        let marker: &'static str = Box::leak(format!("muster-bomb-{kind}").into_boxed_str());
        let _guard = KillOnDrop(marker);
        // Without a limit all 60 start and the shell says so; at the limit
        // the shell cannot fork and gives up.
        let script = format!(
            "for i in $(seq 60); do {} & done; echo forked-all; wait",
            sleeper(marker)
        );
        runtime.start(launch("bomb", &script)).await.expect("start");
        let exit = next_exit(&runtime).await;
        let log = log_text(&runtime, "bomb").await;
        assert!(!log.contains("forked-all"), "{kind}: {log}");
        assert!(log.contains("fork"), "{kind}: {log}");
        assert_ne!(exit.exit_code, Some(0), "{kind}");
        assert!(processes_with(marker).is_empty(), "{kind}");
    }
}

#[tokio::test]
async fn another_runtime_recovers_a_running_task_and_can_stop_it() {
    let (dir, first) = runtime();
    let _guard = KillOnDrop("muster-survivor");
    let mut task = launch(
        "survivor",
        &format!(
            "trap 'exit 0' USR1; echo ready; {} & wait",
            sleeper("muster-survivor")
        ),
    );
    task.gpu_indices = vec![1];
    task.gpu_uuids = vec!["GPU-x".to_string()];
    task.stop_signal = Signal::Usr1;
    first
        .start_at(task, Time(1_700_000_000_000))
        .await
        .expect("start");
    first
        .start(launch("finished", "exit 7"))
        .await
        .expect("start");
    assert_eq!(next_exit(&first).await.exit_code, Some(7));
    wait_for_log(&first, "survivor", "ready").await;
    std::fs::write(dir.path().join("tasks").join("junk.json"), "{").expect("write");

    // As after an agent restart: a new runtime on the same directory.
    let second = again(dir.path(), CgroupPlan::None);
    let recovery = second.recover().await.expect("recover");
    assert_eq!(recovery.unreadable.len(), 1, "{recovery:?}");
    let [finished, survivor] = recovery.tasks.as_slice() else {
        panic!("two tasks expected: {recovery:?}");
    };
    assert_eq!(survivor.allocation, "survivor");
    assert_eq!(survivor.status, RecoveredStatus::Running);
    assert!(survivor.pid > 1);
    assert_eq!(survivor.started_at, Time(1_700_000_000_000));
    assert_eq!(survivor.gpu_indices, [1]);
    assert_eq!(survivor.gpu_uuids, ["GPU-x"]);
    assert_eq!(survivor.stop_signal, Signal::Usr1);
    assert_eq!(survivor.grace_period, Duration::from_secs(1));
    let RecoveredStatus::Exited(exit) = &finished.status else {
        panic!("finished: {finished:?}");
    };
    assert_eq!(exit.exit_code, Some(7));

    // The new runtime cannot start it twice, nor forget it while it runs.
    let error = second
        .start(launch("survivor", "true"))
        .await
        .expect_err("already running");
    assert!(
        matches!(error, RuntimeError::AlreadyRunning { .. }),
        "{error}"
    );
    let error = second.forget("survivor").await.expect_err("still running");
    assert!(
        matches!(error, RuntimeError::StillRunning { .. }),
        "{error}"
    );
    let outcome = within(
        "the stop",
        second.stop("survivor", Signal::Usr1, Duration::from_secs(5)),
    )
    .await
    .expect("stop");
    assert_eq!(outcome, StopOutcome::Exited);
    // Both runtimes learn of the exit: the second through its watch of the
    // recovered task, the first as the supervisor's parent.
    let exit = next_exit(&second).await;
    assert_eq!(
        (exit.exit_code, &exit.reason),
        (Some(0), &EndReason::Stopped)
    );
    assert_eq!(next_exit(&first).await.exit_code, Some(0));
    assert!(processes_with("muster-survivor").is_empty());
    second.forget("finished").await.expect("forget");
    second.forget("survivor").await.expect("forget");
    let recovery = second.recover().await.expect("recover");
    assert!(recovery.tasks.is_empty(), "{recovery:?}");
}

#[tokio::test]
async fn a_task_whose_supervisor_is_killed_is_killed_too() {
    let (dir, runtime) = runtime();
    let _guard = KillOnDrop("muster-orphan");
    runtime
        .start(launch(
            "orphan",
            &format!("echo ready; exec {}", sleeper("muster-orphan")),
        ))
        .await
        .expect("start");
    wait_for_processes("muster-orphan", 1).await;
    let pids: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("tasks/orphan.pid")).expect("the pid record"),
    )
    .expect("json");
    let supervisor = pids["supervisor"].as_i64().expect("a pid") as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(supervisor),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the supervisor");
    let exit = next_exit(&runtime).await;
    assert_eq!(exit.reason, EndReason::Lost);
    wait_for_no_process("muster-orphan").await;
}

#[tokio::test]
async fn a_missing_command_is_a_clear_error() {
    let (_dir, runtime) = runtime();
    let mut task = launch("missing", "");
    task.command = vec!["/nonexistent/muster-test-program".to_string()];
    let error = runtime.start(task).await.expect_err("no such program");
    let message = error.to_string();
    assert!(
        message.starts_with(
            "cannot start allocation missing: cannot start `/nonexistent/muster-test-program`: \
             No such file or directory"
        ),
        "{message}"
    );
    assert!(
        log_text(&runtime, "missing")
            .await
            .starts_with("muster: cannot start `/nonexistent/muster-test-program`")
    );
}

#[tokio::test]
async fn bad_launches_are_refused_before_anything_runs() {
    let (dir, runtime) = runtime();
    for allocation in ["", "../escape", ".hidden", "a/b", "a b", &"x".repeat(129)] {
        let error = runtime
            .start(launch(allocation, "true"))
            .await
            .expect_err(allocation);
        assert!(
            matches!(error, RuntimeError::InvalidAllocation { .. }),
            "{allocation}: {error}"
        );
    }
    let mut empty = launch("empty", "");
    empty.command.clear();
    let error = runtime.start(empty).await.expect_err("empty command");
    assert!(
        matches!(error, RuntimeError::EmptyCommand { .. }),
        "{error}"
    );

    let mut nowhere = launch("nowhere", "true");
    nowhere.working_dir = Some(dir.path().join("does-not-exist"));
    let error = runtime.start(nowhere).await.expect_err("no working dir");
    assert!(
        error
            .to_string()
            .contains("does not exist or is not a directory"),
        "{error}"
    );
    let error = runtime
        .stop("unknown", Signal::Term, Duration::ZERO)
        .await
        .expect_err("unknown");
    assert!(matches!(error, RuntimeError::NotFound { .. }), "{error}");
}

#[tokio::test]
async fn an_exited_allocation_can_be_started_again() {
    let (_dir, runtime) = runtime();
    runtime
        .start(launch("again", "echo one"))
        .await
        .expect("start");
    next_exit(&runtime).await;
    runtime
        .start(launch("again", "echo two"))
        .await
        .expect("restart");
    next_exit(&runtime).await;
    assert_eq!(log_text(&runtime, "again").await, "one\ntwo\n", "appended");
    assert_eq!(runtime.try_next_exit(), None);
}

#[tokio::test]
async fn the_supervisors_error_log_stays_bounded() {
    let (dir, runtime) = runtime();
    let log = dir.path().join("supervisor.log");
    std::fs::write(&log, vec![b'x'; 2 << 20]).expect("write");
    runtime
        .start(launch("bounded", "true"))
        .await
        .expect("start");
    next_exit(&runtime).await;
    let size = std::fs::metadata(&log).expect("the log").len();
    assert!(size < 1 << 20, "supervisor.log kept growing: {size} bytes");
}

/// Two tasks of users with no account here, as two hostile tenants: each
/// runs as a uid of its own; from inside the second, the first's secret in
/// its environment and its `/tmp`, a `kill -9`, a `ptrace` attach and its
/// memory are all out of reach, and the first runs on. With namespaces the
/// second does not even see the first's processes, its `/tmp` starts empty
/// and is gone with it; without, the uids alone keep them apart.
#[tokio::test]
async fn two_tenants_tasks_get_uids_of_their_own_and_cannot_reach_each_other() {
    for namespaces in [namespaces(), false] {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let runtime = again_with(dir.path(), CgroupPlan::None, namespaces);
        runtime.set_fence_deadline(far_future()).expect("deadline");
        let tag = format!("{}-{namespaces}", std::process::id());
        let marker: &'static str = Box::leak(format!("muster-alice-{tag}").into_boxed_str());
        let _guard = KillOnDrop(marker);
        let secret = format!("alice-secret-{tag}");
        let mut alice = launch(
            "alice",
            &format!(
                "echo {secret} > /tmp/{marker}; echo {secret} > /tmp/{marker}-shared; \
                 chmod 644 /tmp/{marker}-shared; id -u; \
                 exec sh -c 'while :; do sleep 0.1; done' {marker}"
            ),
        );
        alice.user = Some("alice-has-no-account-here".to_string());
        alice.env.insert("HF_TOKEN".to_string(), secret.clone());
        runtime.start(alice).await.expect("start alice");
        wait_for_processes(marker, 1).await;
        // Her command itself (under namespaces, her init's command line
        // names it too).
        let alice_pid = sleeping(marker);
        // Every way in that a shared uid gave.
        let script = format!(
            "id -u; \
             cat /proc/{alice_pid}/environ && echo read-environ; \
             cat /tmp/{marker} && echo read-tmp; \
             cat /tmp/{marker}-shared >/dev/null && echo read-shared-tmp; \
             dd if=/proc/{alice_pid}/mem bs=1 count=1 skip=4194304 2>/dev/null && echo read-mem; \
             kill -9 {alice_pid} && echo killed; \
             python3 -c 'import ctypes, sys; \
               libc = ctypes.CDLL(None); \
               sys.exit(0 if libc.ptrace(16, {alice_pid}, 0, 0) == 0 else 1)' && echo attached; \
             echo processes $(ls /proc | grep -c '^[0-9]'); \
             echo tmp-files $(find /tmp -mindepth 1 -maxdepth 1 ! -uid 0 | wc -l); \
             echo done"
        );
        let mut bob = launch("bob", &script);
        bob.user = Some("bob-has-no-account-here".to_string());
        runtime.start(bob).await.expect("start bob");
        let exit = next_exit(&runtime).await;
        assert_eq!(exit.allocation, "bob", "alice ended first: {exit:?}");
        let log = log_text(&runtime, "bob").await;
        assert!(log.contains("done"), "{log}");
        for harm in ["read-environ", "read-tmp", "read-mem", "killed", "attached"] {
            assert!(
                !log.contains(harm),
                "namespaces {namespaces}: bob reached alice ({harm}): {log}"
            );
        }
        let alice_log = log_text(&runtime, "alice").await;
        let uid_of = |log: &str| -> u32 {
            log.lines()
                .next()
                .and_then(|line| line.trim().parse().ok())
                .unwrap_or_else(|| panic!("no uid first: {log}"))
        };
        let (alice_uid, bob_uid) = (uid_of(&alice_log), uid_of(&log));
        assert_ne!(alice_uid, bob_uid, "two tasks shared a uid");
        assert!(task_uids().contains(&alice_uid) && task_uids().contains(&bob_uid));
        assert_eq!(runtime.task_uid("alice"), Some(alice_uid));
        assert_eq!(
            runtime.task_uid("bob"),
            None,
            "an ended task's uid is given back"
        );
        assert_eq!(sleeping(marker), alice_pid, "alice runs on");
        let count = |word: &str| -> usize {
            log.lines()
                .find_map(|line| line.strip_prefix(word))
                .and_then(|rest| rest.trim().parse().ok())
                .unwrap_or_else(|| panic!("no `{word}` line: {log}"))
        };
        // A file she made readable to all in a /tmp shared with him is his
        // to read: only a /tmp of her own keeps it.
        assert_eq!(
            log.contains("read-shared-tmp"),
            !namespaces,
            "namespaces {namespaces}: {log}"
        );
        assert!(!log.contains(&secret), "{log}");
        if namespaces {
            // Its shell, the subshells of its command substitutions: a
            // handful, never the host's.
            assert!(
                count("processes ") <= 6,
                "bob sees others' processes: {log}"
            );
            // The operator's (root's) entries of the host's /tmp are kept;
            // no tenant's.
            assert_eq!(count("tmp-files "), 0, "bob's /tmp is not his own: {log}");
            assert!(
                !Path::new(&format!("/tmp/{marker}")).exists(),
                "alice's private /tmp leaked to the host's"
            );
        }
        runtime
            .stop("alice", Signal::Term, Duration::from_millis(100))
            .await
            .expect("stop alice");
        let _ = next_exit(&runtime).await;
        for file in [format!("/tmp/{marker}"), format!("/tmp/{marker}-shared")] {
            let _ = std::fs::remove_file(file);
        }
    }
}

/// Runs of one user's job (another attempt, as another uid) read and write
/// what the earlier ones left, through the user's group; another user's
/// task does not.
#[tokio::test]
async fn runs_of_one_user_share_their_files_and_another_user_s_task_does_not() {
    if !nix::unistd::Uid::effective().is_root() {
        return; // tasks then run as the agent's own user
    }
    let (dir, runtime) = runtime();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("mkdir");
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let run = |name: &str, user: &str, group: u32, script: &str| {
        let mut task = launch(name, script);
        task.user = Some(user.to_string());
        task.user_group = Some(group);
        task.working_dir = Some(work.clone());
        task
    };
    let first = run(
        "first",
        "alice-has-no-account-here",
        5,
        "id -u; id -g; mkdir ckpts; echo step-1 > ckpts/state; echo begun > log",
    );
    runtime.start(first).await.expect("start");
    assert_eq!(next_exit(&runtime).await.exit_code, Some(0));
    let second = run(
        "second",
        "alice-has-no-account-here",
        5,
        "id -u; cat ckpts/state && echo step-2 >> ckpts/state && echo resumed; \
         echo again >> log; mv ckpts/state ckpts/state.old && echo renamed",
    );
    runtime.start(second).await.expect("start");
    assert_eq!(next_exit(&runtime).await.exit_code, Some(0));
    let other = run(
        "other",
        "bob-has-no-account-here",
        6,
        "id -g; cat ckpts/state.old && echo read; echo x >> log && echo wrote; \
         touch ckpts/mine && echo entered; echo done",
    );
    runtime.start(other).await.expect("start");
    let _ = next_exit(&runtime).await;
    let first = log_text(&runtime, "first").await;
    let second = log_text(&runtime, "second").await;
    let other = log_text(&runtime, "other").await;
    let line = |log: &str, n: usize| -> u32 {
        log.lines()
            .nth(n)
            .and_then(|line| line.trim().parse().ok())
            .unwrap_or_else(|| panic!("no id on line {n}: {log}"))
    };
    let range = muster_agent::runtime::uids::UidRange::parse(
        muster_agent::runtime::uids::DEFAULT_TASK_UID_RANGE,
    )
    .expect("range");
    assert_ne!(line(&first, 0), line(&second, 0), "two runs, two uids");
    assert_eq!(Some(line(&first, 1)), range.group(5), "{first}");
    assert!(
        second.contains("step-1") && second.contains("resumed") && second.contains("renamed"),
        "the second run could not take up the first's files: {second}"
    );
    assert_eq!(
        std::fs::read_to_string(work.join("ckpts/state.old")).expect("state"),
        "step-1\nstep-2\n"
    );
    assert_eq!(Some(line(&other, 0)), range.group(6), "{other}");
    assert!(other.contains("done"), "{other}");
    for harm in ["step-", "read", "wrote", "entered"] {
        assert!(
            !other.lines().any(|l| l.starts_with(harm)),
            "another user's task reached alice's files ({harm}): {other}"
        );
    }
    let mode = std::fs::metadata(work.join("log"))
        .expect("log")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o660, "umask 007: the group's, no one else's");
}

/// Under an init, a task's exit code, the signal that ended it and a start
/// that failed are what they would be without one.
#[tokio::test]
async fn a_namespaced_task_ends_as_its_command_did() {
    if !namespaces() {
        return;
    }
    let (_dir, runtime) = runtime();
    runtime
        .start(launch("code", "echo out; exit 7"))
        .await
        .expect("start");
    let exit = next_exit(&runtime).await;
    assert_eq!((exit.exit_code, exit.signal), (Some(7), None));
    assert_eq!(log_text(&runtime, "code").await, "out\n");
    runtime
        .start(launch("signalled", "kill -TERM $$"))
        .await
        .expect("start");
    let exit = next_exit(&runtime).await;
    assert_eq!((exit.exit_code, exit.signal), (None, Some(15)), "{exit:?}");
    let mut missing = launch("missing", "");
    missing.command = vec!["/nonexistent/program".to_string()];
    let error = runtime.start(missing).await.expect_err("no such program");
    assert!(
        error.to_string().contains("/nonexistent/program"),
        "{error}"
    );
    // The working directory is kept when it lies under /tmp.
    let work = tempfile::tempdir_in("/tmp").expect("a directory in /tmp");
    std::fs::write(work.path().join("input"), "kept\n").expect("write");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(work.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut task = launch("in-tmp", "cat input; pwd");
    task.working_dir = Some(work.path().to_path_buf());
    runtime.start(task).await.expect("start");
    let exit = next_exit(&runtime).await;
    assert_eq!(exit.exit_code, Some(0));
    assert_eq!(
        log_text(&runtime, "in-tmp").await,
        format!("kept\n{}\n", work.path().display())
    );
}

/// The one sleeper ([`sleeper`]-like: `sh -c ... NAME`) named `marker`.
fn sleeping(marker: &str) -> i32 {
    let found: Vec<i32> = processes_with(marker)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                let arguments: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
                arguments.first() == Some(&b"sh".as_slice())
            })
        })
        .collect();
    assert_eq!(found.len(), 1, "one sleeper named {marker}: {found:?}");
    found[0]
}

/// Starts of different tasks run side by side (the agent's loop does not
/// wait for one to begin the next); a second start of a task whose first is
/// under way is refused; a stop that comes while a task is being started
/// stops it once it runs.
#[tokio::test]
async fn starts_run_side_by_side_and_a_stop_waits_for_its_start() {
    let (_dir, runtime) = runtime();
    let (a, b, again) = tokio::join!(
        runtime.start(launch("side-a", "sleep 30")),
        runtime.start(launch("side-b", "sleep 30")),
        runtime.start(launch("side-a", "sleep 30")),
    );
    a.expect("start a");
    b.expect("start b");
    let error = again.expect_err("a second start of side-a while its first is under way");
    assert!(error.to_string().contains("side-a"), "{error}");
    let stop = async {
        // After the start below has begun.
        tokio::task::yield_now().await;
        runtime
            .stop("side-c", Signal::Term, Duration::from_millis(200))
            .await
    };
    let (started, stopped) = tokio::join!(runtime.start(launch("side-c", "sleep 30")), stop);
    started.expect("start c");
    let stopped = stopped.expect("the stop found the task once it ran");
    assert_ne!(stopped, StopOutcome::NotRunning);
    let exit = next_exit(&runtime).await;
    assert_eq!(exit.allocation, "side-c");
    assert_eq!(exit.signal, Some(15), "{exit:?}");
    for name in ["side-a", "side-b"] {
        runtime
            .stop(name, Signal::Term, Duration::from_millis(200))
            .await
            .expect("stop");
        assert_eq!(next_exit(&runtime).await.allocation, name);
    }
}
