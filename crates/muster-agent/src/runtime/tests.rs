//! Tests with real processes. Each waits by polling with a deadline, never
//! by a fixed sleep; the processes they start are killed when they end.

use super::*;
use std::future::Future;

/// Long enough for a loaded 2-core CI machine; tests finish far sooner.
const DEADLINE: Duration = Duration::from_secs(10);

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
    }
}

fn runtime() -> (tempfile::TempDir, ProcessRuntime) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let runtime = ProcessRuntime::new(dir.path().to_path_buf());
    (dir, runtime)
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

/// Kills a group a failed test may have left behind.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = group::signal_group(self.0, nix::sys::signal::Signal::SIGKILL);
    }
}

async fn pgid_of(runtime: &ProcessRuntime, allocation: &str) -> i32 {
    let recovery = runtime.recover().await.expect("recover");
    recovery
        .tasks
        .iter()
        .find(|task| task.allocation == allocation)
        .map(|task| task.pgid)
        .expect("a pid file for the task")
}

#[tokio::test]
async fn task_sees_its_gpus_and_env_but_not_the_agents() {
    let (_dir, runtime) = runtime();
    let mut task = launch(
        "env-1",
        "echo cuda=[$CUDA_VISIBLE_DEVICES] nvidia=[$NVIDIA_VISIBLE_DEVICES] \
         order=$CUDA_DEVICE_ORDER uuids=$MUSTER_GPU_UUIDS job=$MUSTER_JOB_ID \
         cargo=[$CARGO_PKG_NAME] path=${PATH:+set}",
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
    assert_eq!(
        log_text(&runtime, "env-1").await,
        "cuda=[2,5] nvidia=[2,5] order=PCI_BUS_ID uuids=GPU-a,GPU-b job=42 cargo=[] path=set\n"
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
    assert_eq!(
        exit,
        TaskExit {
            allocation: "exit-3".to_string(),
            exit_code: Some(3),
            signal: None,
        }
    );
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
    let _guard = KillOnDrop(pgid_of(&runtime, "trap-term").await);
    wait_for_log(&runtime, "trap-term", "ready").await;
    let outcome = within(
        "the stop",
        runtime.stop("trap-term", Signal::Term, Duration::from_secs(5)),
    )
    .await
    .expect("stop");
    assert_eq!(outcome, StopOutcome::Exited);
    assert_eq!(next_exit(&runtime).await.exit_code, Some(0));
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
    let pgid = pgid_of(&runtime, "stubborn").await;
    let _guard = KillOnDrop(pgid);
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
    eventually("the group to be gone", async || !group_alive(pgid)).await;
    let again = runtime
        .stop("stubborn", Signal::Term, grace)
        .await
        .expect("stop again");
    assert_eq!(again, StopOutcome::NotRunning);
}

#[tokio::test]
async fn grandchildren_die_with_the_group() {
    let (_dir, runtime) = runtime();
    // The grandchildren ignore TERM (an ignored signal is inherited), and
    // the leader exits on TERM at once: only the final SIGKILL to the group
    // can end them.
    runtime
        .start(launch(
            "family",
            "(trap '' TERM; echo a-ready; exec sleep 1000) & \
             (trap '' TERM; echo b-ready; exec sleep 1000) & wait",
        ))
        .await
        .expect("start");
    let pgid = pgid_of(&runtime, "family").await;
    let _guard = KillOnDrop(pgid);
    // Both grandchildren ignore TERM by now.
    wait_for_log(&runtime, "family", "a-ready").await;
    wait_for_log(&runtime, "family", "b-ready").await;
    assert!(group_alive(pgid));
    let outcome = within(
        "the stop",
        runtime.stop("family", Signal::Term, Duration::from_secs(5)),
    )
    .await
    .expect("stop");
    assert_eq!(outcome, StopOutcome::Exited, "the leader exits on TERM");
    // Only zombies may remain (this host's PID 1 may never reap them), so
    // look past them: killpg(pgid, 0) answers for zombies too.
    eventually("the grandchildren to die", async || !group_alive(pgid)).await;
}

#[tokio::test]
async fn another_runtime_recovers_a_running_task_and_can_kill_it() {
    let (dir, first) = runtime();
    let mut task = launch("survivor", "echo ready; exec sleep 1000");
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
    std::fs::write(dir.path().join("tasks").join("junk.json"), "{").expect("write");

    // As after an agent restart: a new runtime on the same directory.
    let second = ProcessRuntime::new(dir.path().to_path_buf());
    let recovery = second.recover().await.expect("recover");
    assert_eq!(recovery.unreadable.len(), 1, "{recovery:?}");
    let [finished, survivor] = recovery.tasks.as_slice() else {
        panic!("two tasks expected: {recovery:?}");
    };
    let _guard = KillOnDrop(survivor.pgid);
    assert_eq!(survivor.allocation, "survivor");
    assert_eq!(survivor.status, RecoveredStatus::Running);
    assert_eq!(survivor.pid, survivor.pgid);
    assert_eq!(survivor.started_at, Time(1_700_000_000_000));
    assert_eq!(survivor.gpu_indices, [1]);
    assert_eq!(survivor.gpu_uuids, ["GPU-x"]);
    assert_eq!(survivor.stop_signal, Signal::Usr1);
    assert_eq!(survivor.grace_period, Duration::from_secs(1));
    assert_eq!(
        finished.status,
        RecoveredStatus::Exited(TaskExit {
            allocation: "finished".to_string(),
            exit_code: Some(7),
            signal: None,
        })
    );

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

    within("the kill", second.kill_orphan(survivor.pgid))
        .await
        .expect("kill");
    assert!(!group_alive(survivor.pgid));
    // The first runtime, the process's parent, sees it die.
    assert_eq!(next_exit(&first).await.signal, Some(9));
    second.forget("finished").await.expect("forget");
    second.forget("survivor").await.expect("forget");
    let recovery = second.recover().await.expect("recover");
    assert!(recovery.tasks.is_empty(), "{recovery:?}");
}

#[tokio::test]
async fn stop_works_on_a_recovered_task() {
    let (dir, first) = runtime();
    first
        .start(launch(
            "adopted",
            "trap 'exit 0' TERM; echo ready; while :; do sleep 0.05; done",
        ))
        .await
        .expect("start");
    let _guard = KillOnDrop(pgid_of(&first, "adopted").await);
    wait_for_log(&first, "adopted", "ready").await;
    let second = ProcessRuntime::new(dir.path().to_path_buf());
    let outcome = within(
        "the stop",
        second.stop("adopted", Signal::Term, Duration::from_secs(5)),
    )
    .await
    .expect("stop");
    assert_eq!(outcome, StopOutcome::Exited);
    assert_eq!(next_exit(&first).await.exit_code, Some(0));
}

#[tokio::test]
async fn a_missing_command_is_a_clear_error() {
    let (dir, runtime) = runtime();
    let mut task = launch("missing", "");
    task.command = vec!["/nonexistent/muster-test-program".to_string()];
    let error = runtime.start(task).await.expect_err("no such program");
    let message = error.to_string();
    assert!(
        message.starts_with(
            "cannot start `/nonexistent/muster-test-program` for allocation missing: \
             No such file or directory"
        ),
        "{message}"
    );
    assert!(!dir.path().join("tasks").join("missing.json").exists());
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

#[test]
fn environment_keeps_only_the_allowlist_and_gpu_variables_win() {
    let mut task = launch("x", "true");
    task.gpu_indices = vec![0];
    task.env.insert("HOME".to_string(), "/job".to_string());
    task.env
        .insert("NVIDIA_VISIBLE_DEVICES".to_string(), "all".to_string());
    let agent = |name: &str| match name {
        "HOME" => Some("/root".to_string()),
        "LANG" => Some("C.UTF-8".to_string()),
        "MUSTER_JOIN_TOKEN" => Some("secret".to_string()),
        _ => None,
    };
    let env = task_environment(&task, agent);
    assert_eq!(env["HOME"], "/job", "the launch overrides the agent");
    assert_eq!(env["LANG"], "C.UTF-8");
    assert_eq!(env["PATH"], DEFAULT_PATH);
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "0");
    assert!(!env.contains_key("MUSTER_JOIN_TOKEN"));
}
