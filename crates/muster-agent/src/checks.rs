//! Command checks of services' replicas (`readiness: {command: [...]}`):
//! the server names them in each task's desired entry; the agent runs each
//! every period, beside the task: in the task's cgroup (its limits apply,
//! and its clean-up kills what a check leaves), as the task's user, with
//! its environment and working directory, through its own binary's
//! `muster check-exec` (which joins the cgroup and drops privileges before
//! it executes the command, by absolute path of this program); a container
//! task's checks run inside its container (a Docker `exec`). Results are
//! reported to the server (`POST /v1/agents/{node}/checks`), which applies
//! the thresholds.
//!
//! TCP and HTTP checks run here too, never from the server: the agent
//! connects only to the replica's own port, and only after it has found a
//! process of the task holding the listening socket there
//! ([`crate::runtime::ports::task_listener`]); a check aimed at any other
//! listener is not sent. An HTTP check reads the status line and nothing
//! more: its result is pass or fail with the status code, never a body.

use muster_api::client::Client;
use muster_api::protocol::{CheckReport, CheckResult, CheckSpec, DesiredAllocation, NetworkCheck};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The most output of a failed check kept for its message.
const MESSAGE_BYTES: usize = 400;

/// How a task's checks run.
#[derive(Debug, Clone)]
pub struct TaskContext {
    /// The task's job (a network check's listener must be its task's).
    pub job: u64,
    pub env: BTreeMap<String, String>,
    pub working_dir: Option<String>,
    /// (uid, gid) to run as; `None`: as the agent, which only a
    /// non-root agent may (see `needs_user`).
    pub user: Option<(u32, u32)>,
    /// The agent is root: a check without a user is not run (its task has
    /// no uid yet) rather than run as root.
    pub needs_user: bool,
    /// The task's `cgroup.procs` files.
    pub procs: Vec<PathBuf>,
    /// The task's cgroup (whose members a network check's listener must be
    /// among).
    pub cgroup: crate::runtime::cgroup::TaskCgroup,
    /// A container task: the agent's state directory and the task's key
    /// (its checks run inside the container, see
    /// [`crate::container::exec_check`]).
    pub container: Option<(PathBuf, String)>,
}

struct Entry {
    spec: CheckSpec,
    context: TaskContext,
    known: Instant,
    last: Option<Instant>,
    running: bool,
    runs: u64,
}

/// Every command check of this node's tasks, and results not yet sent.
#[derive(Default)]
pub struct Checks {
    entries: Mutex<BTreeMap<(u64, bool), Entry>>,
    results: Mutex<Vec<CheckResult>>,
}

impl Checks {
    /// The checks the server's latest answer names: new ones start their
    /// initial delay now, known ones keep their timing and context (an
    /// allocation's task does not change: its user is looked up once),
    /// others go.
    pub fn update(
        &self,
        desired: &[DesiredAllocation],
        context: impl Fn(&DesiredAllocation) -> TaskContext,
    ) {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let mut next = BTreeMap::new();
        for task in desired.iter().filter(|task| !task.stop) {
            for spec in &task.checks {
                let key = (task.allocation, spec.liveness);
                let entry = match entries.remove(&key) {
                    Some(mut entry) if entry.spec == *spec => {
                        // A task's uid is known once it has started.
                        if entry.context.needs_user && entry.context.user.is_none() {
                            entry.context = context(task);
                        }
                        entry
                    }
                    _ => Entry {
                        spec: spec.clone(),
                        context: context(task),
                        known: Instant::now(),
                        last: None,
                        running: false,
                        runs: 0,
                    },
                };
                next.insert(key, entry);
            }
        }
        *entries = next;
    }

    /// Runs what is due, and sends results, until `stop`.
    pub async fn run(
        self: Arc<Self>,
        client: Arc<Mutex<Option<Client>>>,
        node: String,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let helper = match std::env::current_exe() {
            Ok(path) => path,
            Err(error) => {
                tracing::warn!(%error, "command checks cannot run: this program's path is unknown");
                return;
            }
        };
        let mut last_send = Instant::now();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                _ = stop.changed() => return,
            }
            self.start_due(&helper);
            let pending = !self
                .results
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty();
            if pending && last_send.elapsed() >= Duration::from_millis(200) {
                last_send = Instant::now();
                let results = std::mem::take(
                    &mut *self.results.lock().unwrap_or_else(PoisonError::into_inner),
                );
                let client = client
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                if let Some(client) = client
                    && let Err(error) = client.report_checks(&node, &CheckReport { results }).await
                {
                    tracing::debug!(%error, "check results not taken");
                }
            }
        }
    }

    fn start_due(self: &Arc<Self>, helper: &std::path::Path) {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        for (&(allocation, liveness), entry) in entries.iter_mut() {
            if entry.running
                || entry.known.elapsed() < Duration::from_millis(entry.spec.initial_delay_ms)
                || entry.last.is_some_and(|last| {
                    last.elapsed() < Duration::from_millis(entry.spec.period_ms)
                })
            {
                continue;
            }
            entry.running = true;
            entry.last = Some(Instant::now());
            entry.runs += 1;
            let run = entry.runs;
            let spec = entry.spec.clone();
            let context = entry.context.clone();
            let checks = self.clone();
            let helper = helper.to_path_buf();
            tokio::spawn(async move {
                let outcome = run_one(&helper, &spec, &context).await;
                if let Some(entry) = checks
                    .entries
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_mut(&(allocation, liveness))
                {
                    entry.running = false;
                }
                let (ok, message) = match outcome {
                    Ok(()) => (true, String::new()),
                    Err(message) => (false, message),
                };
                checks
                    .results
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(CheckResult {
                        allocation,
                        liveness,
                        run,
                        ok,
                        message,
                    });
            });
        }
    }
}

/// Why a check failed, in words: the command, its exit status and the end
/// of what it printed.
fn failure(shown: &str, code: Option<i64>, said: &str) -> String {
    let mut said = said.trim().to_string();
    if said.len() > MESSAGE_BYTES {
        let mut start = said.len() - MESSAGE_BYTES;
        while !said.is_char_boundary(start) {
            start += 1;
        }
        said = format!("...{}", &said[start..]);
    }
    let status = match code {
        Some(code) => format!("exited {code}"),
        None => "was killed".to_string(),
    };
    if said.is_empty() {
        format!("`{shown}` {status}")
    } else {
        format!("`{shown}` {status}: {said}")
    }
}

async fn run_one(
    helper: &std::path::Path,
    spec: &CheckSpec,
    context: &TaskContext,
) -> Result<(), String> {
    let timeout = Duration::from_millis(spec.timeout_ms.max(1));
    if let Some(network) = &spec.network {
        return network_check(network, context, timeout).await;
    }
    if let Some((state_dir, key)) = &context.container {
        let shown = spec.command.join(" ");
        return crate::container::exec_check(state_dir, key, &spec.command, timeout)
            .await
            .map_err(|(code, said)| match code {
                Some(code) => failure(&shown, Some(code), &said),
                None => said,
            });
    }
    if context.needs_user && context.user.is_none() {
        return Err(format!(
            "`{}` was not run: its task has no user on this node yet",
            spec.command.join(" ")
        ));
    }
    let mut command = tokio::process::Command::new(helper);
    command.arg("check-exec");
    match context.user {
        Some((uid, gid)) => command.args([uid.to_string(), gid.to_string()]),
        None => command.args(["-", "-"]),
    };
    for procs in &context.procs {
        command.arg(procs);
    }
    command
        .arg("--")
        .args(&spec.command)
        .env_clear()
        .envs(&context.env)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    if let Some(dir) = &context.working_dir {
        command.current_dir(dir);
    }
    let shown = spec.command.join(" ");
    let mut child = command
        .spawn()
        .map_err(|error| format!("`{shown}` could not start: {error}"))?;
    // Only the end of what it prints is kept (a check may print without end).
    let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
    let run = async {
        let (status, stdout, stderr) = tokio::join!(child.wait(), tail(stdout), tail(stderr));
        status.map(|status| (status, stdout, stderr))
    };
    match tokio::time::timeout(timeout, run).await {
        Err(_) => Err(format!(
            "`{shown}` did not finish within {}s",
            timeout.as_secs_f64()
        )),
        Ok(Err(error)) => Err(format!("`{shown}` failed: {error}")),
        Ok(Ok((status, _, _))) if status.success() => Ok(()),
        Ok(Ok((status, stdout, stderr))) => {
            let mut said = String::from_utf8_lossy(&stderr).trim().to_string();
            if said.is_empty() {
                said = String::from_utf8_lossy(&stdout).trim().to_string();
            }
            Err(failure(&shown, status.code().map(i64::from), &said))
        }
    }
}

/// A TCP or HTTP check against the replica's own listener.
async fn network_check(
    check: &NetworkCheck,
    context: &TaskContext,
    timeout: Duration,
) -> Result<(), String> {
    let shown = match &check.http_path {
        Some(path) => format!("GET {path}"),
        None => "TCP".to_string(),
    };
    let (port, job, cgroup) = (check.port, context.job, context.cgroup.clone());
    let found = tokio::task::spawn_blocking(move || {
        crate::runtime::ports::task_listener(port, cgroup.members().as_deref(), job)
    })
    .await
    .map_err(|error| format!("{shown}: {error}"))?;
    let address = found.map_err(|why| format!("{shown}: {why}"))?;
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(address)
            .await
            .map_err(|error| format!("{shown}: {error} at {address}"))?;
        let Some(path) = &check.http_path else {
            return Ok(());
        };
        let status = http_status(&mut stream, address, path)
            .await
            .map_err(|error| format!("{shown}: {error}"))?;
        if (200..400).contains(&status) {
            Ok(())
        } else {
            Err(format!("{shown} answered {status}"))
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(format!(
            "{shown}: no answer within {}s",
            timeout.as_secs_f64()
        )),
    }
}

/// Sends `GET path` and reads the answer's status code (its status line,
/// nothing after it).
async fn http_status(
    stream: &mut tokio::net::TcpStream,
    address: std::net::SocketAddr,
    path: &str,
) -> Result<u16, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if !path.starts_with('/') || path.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{path:?} is not a path"));
    }
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nUser-Agent: muster-agent\r\n\
         Accept: */*\r\nConnection: close\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|error| error.to_string())?;
    // "HTTP/1.1 200 OK\r\n": the first line, at most a few hundred bytes.
    let mut line = Vec::with_capacity(64);
    let mut chunk = [0u8; 256];
    while !line.contains(&b'\n') && line.len() < 512 {
        let read = stream
            .read(&mut chunk)
            .await
            .map_err(|error| error.to_string())?;
        if read == 0 {
            break;
        }
        line.extend_from_slice(&chunk[..read]);
    }
    let text = String::from_utf8_lossy(&line);
    let status = text
        .lines()
        .next()
        .filter(|first| first.starts_with("HTTP/"))
        .and_then(|first| first.split_whitespace().nth(1))
        .and_then(|code| code.parse::<u16>().ok());
    status.ok_or_else(|| "the answer is not HTTP".to_string())
}

/// The last bytes `reader` gives until it ends (at most a few times what a
/// message shows), however much it gives.
async fn tail(reader: Option<impl tokio::io::AsyncRead + Unpin>) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    const KEEP: usize = 4 * MESSAGE_BYTES;
    let Some(mut reader) = reader else {
        return Vec::new();
    };
    let mut kept = Vec::with_capacity(2 * KEEP);
    let mut chunk = [0u8; 4096];
    while let Ok(read) = reader.read(&mut chunk).await {
        if read == 0 {
            break;
        }
        kept.extend_from_slice(&chunk[..read]);
        if kept.len() > 2 * KEEP {
            kept.drain(..kept.len() - KEEP);
        }
    }
    if kept.len() > KEEP {
        kept.drain(..kept.len() - KEEP);
    }
    kept
}

/// `muster check-exec UID GID [PROCS_FILE...] -- COMMAND...`: joins the
/// task's cgroup (writes its own pid into each `cgroup.procs`), takes the
/// task's user (`-` `-`: stays as it is), and executes the command with
/// the environment and directory it was given. Returns only on failure.
pub fn exec_main(args: &[String]) -> i32 {
    match exec(args) {
        Ok(never) => match never {},
        Err(error) => {
            eprintln!("muster check-exec: {error}");
            127
        }
    }
}

fn exec(args: &[String]) -> Result<std::convert::Infallible, String> {
    let split = args
        .iter()
        .position(|arg| arg == "--")
        .ok_or("usage: muster check-exec UID GID [PROCS...] -- COMMAND...")?;
    let (head, command) = (&args[..split], &args[split + 1..]);
    if head.len() < 2 || command.is_empty() {
        return Err("usage: muster check-exec UID GID [PROCS...] -- COMMAND...".into());
    }
    let me = std::process::id().to_string();
    for procs in &head[2..] {
        std::fs::write(procs, &me).map_err(|error| format!("cannot join {procs}: {error}"))?;
    }
    if head[0] != "-" {
        let uid: u32 = head[0].parse().map_err(|_| "a bad uid")?;
        let gid: u32 = head[1].parse().map_err(|_| "a bad gid")?;
        let gid = nix::unistd::Gid::from_raw(gid);
        nix::unistd::setgroups(&[gid]).map_err(|error| format!("setgroups: {error}"))?;
        nix::unistd::setgid(gid).map_err(|error| format!("setgid: {error}"))?;
        nix::unistd::setuid(nix::unistd::Uid::from_raw(uid))
            .map_err(|error| format!("setuid: {error}"))?;
    }
    let argv: Vec<std::ffi::CString> = command
        .iter()
        .map(|arg| std::ffi::CString::new(arg.as_bytes()).map_err(|_| "a NUL in the command"))
        .collect::<Result<_, _>>()?;
    let error = nix::unistd::execvp(&argv[0], &argv).err();
    Err(format!(
        "cannot run {}: {}",
        command[0],
        error.map_or_else(|| "unknown".to_string(), |error| error.to_string())
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_http_check_reads_the_status_line_only_from_the_task_s_own_listener() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("a port");
            let port = listener.local_addr().expect("an address").port();
            let served = tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut answered = 0;
                for status in ["200 OK", "503 Service Unavailable"] {
                    let (mut stream, _) = listener.accept().await.expect("a connection");
                    let mut request = vec![0u8; 1024];
                    let read = stream.read(&mut request).await.expect("a request");
                    assert!(request[..read].starts_with(b"GET /healthz HTTP/1.1\r\n"));
                    let answer = format!("HTTP/1.1 {status}\r\nContent-Length: 6\r\n\r\nsecret");
                    stream.write_all(answer.as_bytes()).await.expect("sent");
                    answered += 1;
                }
                answered
            });
            let mut context = TaskContext {
                job: 1,
                env: BTreeMap::new(),
                working_dir: None,
                user: None,
                needs_user: true,
                procs: Vec::new(),
                cgroup: crate::runtime::cgroup::TaskCgroup::None,
                container: None,
            };
            // No cgroup, and this process names no job: not sent.
            let check = NetworkCheck {
                port,
                http_path: Some("/healthz".into()),
            };
            let error = network_check(&check, &context, Duration::from_secs(5))
                .await
                .unwrap_err();
            assert!(error.contains("not sent"), "{error}");
            // This process as the task (its "cgroup" lists its pid).
            let dir = tempfile::tempdir().expect("a directory");
            std::fs::write(
                dir.path().join("cgroup.procs"),
                format!("{}\n", std::process::id()),
            )
            .expect("written");
            context.cgroup = crate::runtime::cgroup::TaskCgroup::V2 {
                dir: dir.path().to_path_buf(),
                memory: false,
            };
            assert_eq!(
                network_check(&check, &context, Duration::from_secs(5)).await,
                Ok(())
            );
            let error = network_check(&check, &context, Duration::from_secs(5))
                .await
                .unwrap_err();
            // The code, never the body.
            assert_eq!(error, "GET /healthz answered 503");
            assert_eq!(served.await.expect("served"), 2);
        });
    }

    #[test]
    fn only_the_end_of_a_long_output_is_kept() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        // A megabyte, ending in a line that says what went wrong.
        let mut output = vec![b'x'; 1 << 20];
        output.extend_from_slice(b"\nthe end");
        let kept = runtime.block_on(tail(Some(&output[..])));
        assert!(kept.len() <= 4 * MESSAGE_BYTES, "{} bytes kept", kept.len());
        assert!(kept.ends_with(b"\nthe end"));
        assert_eq!(runtime.block_on(tail(Some(&b"short"[..]))), b"short");
        assert!(runtime.block_on(tail(None::<&[u8]>)).is_empty());
    }
}
