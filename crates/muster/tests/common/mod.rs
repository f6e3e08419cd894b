//! Helpers shared by the end-to-end tests (real processes, loopback only).

#![allow(dead_code)] // each test file uses its own subset

pub mod cli;
pub mod cluster;

use std::net::TcpListener;
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Polls `done` every 50 ms until it holds, for at most `limit`.
pub fn wait_until(what: &str, limit: Duration, done: impl FnMut() -> bool) {
    wait_for_state(what, limit, done, |&done| done);
}

/// Polls `state` every 50 ms until `done` holds for it, for at most
/// `limit`, and returns it; on a time-out says what it was last.
pub fn wait_for_state<T: std::fmt::Debug>(
    what: &str,
    limit: Duration,
    mut state: impl FnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        let now = state();
        if done(&now) {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; last: {now:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How many live (not zombie) processes have `marker` in their command line.
pub fn processes_with(marker: &str) -> usize {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .flatten()
        .filter(|entry| {
            let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
            let zombie = status
                .lines()
                .any(|l| l.starts_with("State:") && l.contains('Z'));
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            !zombie && String::from_utf8_lossy(&cmdline).contains(marker)
        })
        .count()
}

/// Runs the built `muster` binary in `dir` and waits for it.
pub fn muster(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_muster"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("the muster binary runs")
}

/// The stdout of a run that must have succeeded.
pub fn success(output: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The stderr of a run that must have failed cleanly (no panic).
pub fn failure(output: &std::process::Output) -> String {
    assert!(!output.status.success(), "expected a failure");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// A directory that tasks can write into. When the tests run as root (as CI
/// does), tasks run as uids of their own, and a temporary directory is
/// private: this
/// opens `root` for traversal only (0711) and creates `root/name` writable
/// by everyone (0777).
pub fn task_writable(root: &std::path::Path, name: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    dir
}
