//! Container tasks through the machine's real Docker engine, with real
//! supervisors: the task's environment, exit code and output, its stop
//! signal, its memory limit, its fence, and an image that does not exist.
//! There is no registry to pull from here, so the tests import their image
//! (`muster-test-busybox:1`) from a root file system holding Debian's
//! statically linked busybox (`busybox-static`).
//!
//! Without a Docker engine (or busybox) these tests say so loudly and pass,
//! unless `MUSTER_REQUIRE_DOCKER` is set (as `.ci/run` does once it has an
//! engine running), where that is a failure (`muster_testkit::docker`).

use muster_agent::{EndReason, ProcessRuntime, RuntimeConfig, TaskExit, TaskLaunch};
use muster_model::Signal;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const SUPERVISOR: &str = env!("CARGO_BIN_EXE_muster-supervise");
const DEADLINE: Duration = Duration::from_secs(60);

fn runtime() -> (tempfile::TempDir, ProcessRuntime) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let runtime = ProcessRuntime::new(RuntimeConfig::new(
        dir.path().to_path_buf(),
        PathBuf::from(SUPERVISOR),
    ));
    runtime
        .set_fence_deadline(now_ms() + 3_600_000)
        .expect("the fence deadline");
    (dir, runtime)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn launch(allocation: &str, image: &str, script: &str) -> TaskLaunch {
    TaskLaunch {
        allocation: allocation.to_string(),
        command: vec!["sh".to_string(), "-c".to_string(), script.to_string()],
        env: BTreeMap::from([
            ("MUSTER_JOB_ID".to_string(), "7".to_string()),
            ("MUSTER_RANK".to_string(), "0".to_string()),
        ]),
        working_dir: Some(PathBuf::from("/tmp")),
        gpu_indices: vec![2, 3],
        gpu_uuids: vec!["GPU-a".to_string(), "GPU-b".to_string()],
        stop_signal: Signal::Term,
        grace_period: Duration::from_secs(2),
        user: None,
        user_group: None,
        memory_limit_mib: None,
        image: Some(image.to_string()),
        cpu_milli: Some(500),
        registry_auth: None,
        mounts: Vec::new(),
    }
}

/// A unique key per test process (containers are named after keys).
fn key(name: &str) -> String {
    format!("{name}-{}", std::process::id())
}

async fn next_exit(runtime: &ProcessRuntime) -> TaskExit {
    tokio::time::timeout(DEADLINE, runtime.next_exit())
        .await
        .expect("the task ends in time")
}

async fn log_text(runtime: &ProcessRuntime, allocation: &str) -> String {
    let (bytes, _) = runtime
        .read_log(allocation, 0, 1 << 20)
        .await
        .expect("the log exists");
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Waits until the task's log holds `text` (the container started).
async fn wait_for_log(runtime: &ProcessRuntime, allocation: &str, text: &str) {
    tokio::time::timeout(DEADLINE, async {
        while !log_text(runtime, allocation).await.contains(text) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("`{text}` in {allocation}'s log in time"));
}

/// Containers of this task still on the engine, running or not.
fn containers_of(key: &str) -> String {
    let output = Command::new("docker")
        .args(["ps", "-a", "--format", "{{.Names}}", "--filter"])
        .arg(format!("name=^muster-[0-9a-f]{{8}}-{key}$"))
        .output()
        .expect("docker ps runs");
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

#[tokio::test]
async fn a_container_task_gets_the_task_contract_and_its_exit_code() {
    let Some(image) = muster_testkit::docker::test_image() else {
        return;
    };
    let (_dir, runtime) = runtime();
    let key = key("contract");
    runtime
        .start(launch(
            &key,
            image,
            "echo hello from $(pwd); env | sort; id -u; \
             echo quota $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu.max 2>/dev/null); \
             exit 3",
        ))
        .await
        .expect("started");
    let exit = next_exit(&runtime).await;
    assert_eq!(exit.exit_code, Some(3), "{exit:?}");
    let log = log_text(&runtime, &key).await;
    assert!(
        log.contains("hello from /tmp"),
        "the working directory: {log}"
    );
    assert!(log.contains("MUSTER_JOB_ID=7"), "{log}");
    assert!(log.contains("MUSTER_RANK=0"), "{log}");
    // Simulated GPUs (no devices): the same variables as a process gets.
    assert!(log.contains("CUDA_VISIBLE_DEVICES=2,3"), "{log}");
    assert!(log.contains("MUSTER_GPU_UUIDS=GPU-a,GPU-b"), "{log}");
    // Half a CPU: 50 ms of every 100 ms (cgroup v1 or v2).
    assert!(log.contains("quota 50000"), "the CPU limit: {log}");
    // Run as root, the agent gives a task whose user has no account here
    // a uid of its own from its range (never root, never a shared
    // `nobody`): so does the container.
    if nix::unistd::Uid::effective().is_root() {
        let range = muster_agent::runtime::uids::UidRange::parse(
            muster_agent::runtime::uids::DEFAULT_TASK_UID_RANGE,
        )
        .expect("the default range");
        let uid = log
            .lines()
            .find_map(|line| line.trim().parse::<u32>().ok())
            .unwrap_or_else(|| panic!("no uid in the log: {log}"));
        assert!(
            range.contains(uid),
            "uid {uid}, not one of the task range: {log}"
        );
    }
    assert_eq!(containers_of(&key), "", "the container is removed");
}

#[tokio::test]
async fn a_stopped_container_gets_the_signal_then_is_removed() {
    let Some(image) = muster_testkit::docker::test_image() else {
        return;
    };
    let (_dir, runtime) = runtime();
    let key = key("stopped");
    runtime
        .start(launch(
            &key,
            image,
            "trap 'echo got TERM; exit 0' TERM; echo ready; while true; do sleep 1; done",
        ))
        .await
        .expect("started");
    wait_for_log(&runtime, &key, "ready").await;
    runtime
        .stop(&key, Signal::Term, Duration::from_secs(10))
        .await
        .expect("stopped");
    let exit = next_exit(&runtime).await;
    let log = log_text(&runtime, &key).await;
    assert!(
        log.contains("got TERM"),
        "the job's signal reached it: {log}"
    );
    assert!(matches!(exit.reason, EndReason::Stopped), "{exit:?}");
    assert_eq!(containers_of(&key), "");

    // One that ignores the signal is killed after the grace period.
    let stubborn = format!("{key}-stubborn");
    runtime
        .start(launch(
            &stubborn,
            image,
            "trap '' TERM; echo ready; while true; do sleep 1; done",
        ))
        .await
        .expect("started");
    wait_for_log(&runtime, &stubborn, "ready").await;
    runtime
        .stop(&stubborn, Signal::Term, Duration::from_millis(500))
        .await
        .expect("stopped");
    let exit = next_exit(&runtime).await;
    assert!(matches!(exit.reason, EndReason::Stopped), "{exit:?}");
    assert_eq!(containers_of(&stubborn), "", "killed and removed");
}

#[tokio::test]
async fn a_container_over_its_memory_limit_is_killed() {
    let Some(image) = muster_testkit::docker::test_image() else {
        return;
    };
    let (_dir, runtime) = runtime();
    let key = key("memory");
    let mut task = launch(
        &key,
        image,
        "x=$(head -c 300000000 /dev/zero | tr '\\0' a); echo survived",
    );
    task.memory_limit_mib = Some(64);
    runtime.start(task).await.expect("started");
    let exit = next_exit(&runtime).await;
    let log = log_text(&runtime, &key).await;
    assert!(!log.contains("survived"), "{log}");
    // The kernel's OOM killer ended it: SIGKILL, reported as 128 + 9, and
    // the log and the task's end say why.
    assert_eq!(exit.exit_code, Some(137), "{exit:?} {log}");
    assert!(matches!(exit.reason, EndReason::MemoryLimit), "{exit:?}");
    assert!(
        log.contains("killed for going over its memory limit (64 MiB)"),
        "{log}"
    );
    assert_eq!(containers_of(&key), "");
}

#[tokio::test]
async fn a_fenced_container_stops_at_the_deadline() {
    let Some(image) = muster_testkit::docker::test_image() else {
        return;
    };
    let (_dir, runtime) = runtime();
    let key = key("fenced");
    runtime
        .start(launch(
            &key,
            image,
            "echo ready; while true; do sleep 1; done",
        ))
        .await
        .expect("started");
    wait_for_log(&runtime, &key, "ready").await;
    assert!(containers_of(&key).ends_with(&format!("-{key}")));
    // The lease runs out (no agent renews it): the supervisor alone stops
    // the container.
    runtime
        .set_fence_deadline(now_ms())
        .expect("the fence deadline");
    let exit = next_exit(&runtime).await;
    assert!(matches!(exit.reason, EndReason::Fenced), "{exit:?}");
    assert_eq!(containers_of(&key), "", "no container outlives its fence");
}

#[tokio::test]
async fn an_image_that_does_not_exist_fails_the_task_with_the_reason() {
    if muster_testkit::docker::test_image().is_none() {
        return;
    }
    let (_dir, runtime) = runtime();
    let key = key("missing");
    runtime
        .start(launch(&key, "muster-test-no-such-image:1", "true"))
        .await
        .expect("started");
    let exit = next_exit(&runtime).await;
    assert_eq!(exit.exit_code, Some(125), "{exit:?}");
    let log = log_text(&runtime, &key).await;
    assert!(
        log.contains("cannot pull the image muster-test-no-such-image:1"),
        "{log}"
    );
}

/// A registry on loopback that asks for Basic credentials and keeps the
/// `Authorization` headers it is sent (it has no images: every pull
/// fails). The engine speaks plain HTTP to a loopback registry after its
/// TLS attempt fails; anything that is not an HTTP request is dropped.
fn fake_registry() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = listener.local_addr().expect("address").port();
    let seen: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let kept = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let mut reader = BufReader::new(&stream);
            let mut first = String::new();
            if reader.read_line(&mut first).is_err()
                || !(first.starts_with("GET ") || first.starts_with("HEAD "))
            {
                continue;
            }
            let mut authorization = None;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                    break;
                }
                if let Some((name, value)) = line.split_once(':')
                    && name.eq_ignore_ascii_case("authorization")
                {
                    authorization = Some(value.trim().to_string());
                }
            }
            let answer = match authorization {
                None => "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"muster-test\"\r\nDocker-Distribution-API-Version: registry/2.0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string(),
                Some(value) => {
                    kept.lock().expect("lock").push(value);
                    "HTTP/1.1 404 Not Found\r\nDocker-Distribution-API-Version: registry/2.0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string()
                }
            };
            let mut stream = &stream;
            let _ = stream.write_all(answer.as_bytes());
        }
    });
    (port, seen)
}

/// A private image's pull carries the job's image pull secret to the
/// registry, and nothing of it reaches the task's log.
#[tokio::test]
async fn a_pull_carries_the_image_pull_secret_to_the_registry() {
    use base64::Engine;
    if muster_testkit::docker::test_image().is_none() {
        return;
    }
    let (port, seen) = fake_registry();
    let (_dir, runtime) = runtime();
    let key = key("private");
    let image = format!("127.0.0.1:{port}/team/trainer:1");
    let mut task = launch(&key, &image, "true");
    task.registry_auth = Some("alice:s3cret-token".to_string());
    runtime.start(task).await.expect("started");
    let exit = next_exit(&runtime).await;
    assert_eq!(exit.exit_code, Some(125), "{exit:?}");
    let expected = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("alice:s3cret-token")
    );
    let seen = seen.lock().expect("lock").clone();
    let log = log_text(&runtime, &key).await;
    assert!(seen.contains(&expected), "{seen:?}\n{log}");
    assert!(
        log.contains(&format!("cannot pull the image {image}")),
        "{log}"
    );
    assert!(
        !log.contains("s3cret"),
        "the secret stays out of the log: {log}"
    );
}

/// A container task whose supervisor is killed (SIGKILL) is lost, and its
/// container goes with it: the agent removes it, so nothing runs
/// unsupervised and the job's next attempt cannot run beside it.
#[tokio::test]
async fn a_container_whose_supervisor_is_killed_is_removed() {
    let Some(image) = muster_testkit::docker::test_image() else {
        return;
    };
    let (dir, runtime) = runtime();
    let key = key("orphaned");
    runtime
        .start(launch(
            &key,
            image,
            "echo ready; while true; do sleep 1; done",
        ))
        .await
        .expect("started");
    wait_for_log(&runtime, &key, "ready").await;
    let pids: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join(format!("tasks/{key}.pid"))).expect("the pid record"),
    )
    .expect("json");
    let supervisor = pids["supervisor"].as_i64().expect("a pid") as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(supervisor),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the supervisor");
    let exit = next_exit(&runtime).await;
    assert_eq!(exit.reason, EndReason::Lost, "{exit:?}");
    tokio::time::timeout(DEADLINE, async {
        while !containers_of(&key).is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the container is removed");
}

/// Host paths bound into the container: one read-only (reads work, writes
/// are refused), one read-write (a file written there is on the node).
#[tokio::test]
async fn host_paths_are_mounted_read_only_or_read_write() {
    use std::os::unix::fs::PermissionsExt;
    let Some(image) = muster_testkit::docker::test_image() else {
        return;
    };
    let host = tempfile::tempdir().expect("a directory");
    let data = host.path().join("data");
    let out = host.path().join("out");
    for dir in [&data, &out] {
        std::fs::create_dir(dir).expect("mkdir");
    }
    std::fs::write(data.join("hello.txt"), "hello from the node\n").expect("write");
    // Tasks run as nobody: the node's paths must let them in.
    std::fs::set_permissions(host.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(
        data.join("hello.txt"),
        std::fs::Permissions::from_mode(0o644),
    )
    .expect("chmod");
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let (_dir, runtime) = runtime();
    let key = key("mounted");
    let mut task = launch(
        &key,
        image,
        "cat /data/hello.txt; echo x > /data/new.txt || echo read-only refused; \
         echo written > /out/result.txt",
    );
    task.mounts = vec![
        (data.display().to_string(), "/data".to_string(), true),
        (out.display().to_string(), "/out".to_string(), false),
    ];
    runtime.start(task).await.expect("started");
    let exit = next_exit(&runtime).await;
    let log = log_text(&runtime, &key).await;
    assert_eq!(exit.exit_code, Some(0), "{exit:?} {log}");
    assert!(log.contains("hello from the node"), "{log}");
    assert!(log.contains("read-only refused"), "{log}");
    assert!(!data.join("new.txt").exists());
    assert_eq!(
        std::fs::read_to_string(out.join("result.txt")).expect("written on the node"),
        "written\n"
    );
}

/// A task stopped while its image is pulled (a registry that never
/// answers) stops pulling at once, says so to nobody afterwards, and once
/// forgotten leaves no file of its own behind.
#[tokio::test]
async fn a_task_stopped_during_its_pull_leaves_nothing_behind() {
    if muster_testkit::docker::test_image().is_none() {
        return;
    }
    // Connections wait in the backlog, never answered.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = silent.local_addr().expect("address").port();
    let (dir, runtime) = runtime();
    let key = key("stuck-pull");
    let image = format!("127.0.0.1:{port}/team/trainer:1");
    runtime
        .start(launch(&key, &image, "true"))
        .await
        .expect("started");
    tokio::time::timeout(DEADLINE, async {
        while runtime.pulling().is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the pull is reported");
    assert!(
        runtime.pulling()[0]
            .1
            .starts_with(&format!("pulling {image}"))
    );
    runtime
        .stop(&key, Signal::Term, Duration::from_millis(500))
        .await
        .expect("stopped");
    let exit = next_exit(&runtime).await;
    assert!(matches!(exit.reason, EndReason::Stopped), "{exit:?}");
    assert!(runtime.pulling().is_empty(), "{:?}", runtime.pulling());
    runtime.forget(&key).await.expect("forgotten");
    let left: Vec<String> = std::fs::read_dir(dir.path().join("tasks"))
        .expect("the tasks directory")
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(&key))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    drop(silent);
}
