//! A task in a container, through the node's Docker Engine API (bollard;
//! never the `docker` program).
//!
//! The supervisor runs a container task like any other (its cgroup, its
//! process group, its log, its stop signal, its fence), except that the
//! process it starts is this helper, `PROGRAM container-task run STATE_DIR
//! KEY UID:GID`, by the absolute path of the running binary. The helper
//! creates the container `muster-HASH-KEY` (see [`container_name`]) from the task's record (the image,
//! the command, the task's environment, its working directory inside the
//! image, its user, its memory and process limits, `/dev/shm`, the network,
//! and its GPUs through the NVIDIA runtime's device request on real nodes),
//! starts it, copies its output into the task's log, passes on every signal
//! the supervisor sends (the job's stop signal), and exits with the
//! container's exit code once it has ended and been removed.
//!
//! When the supervisor kills the task (the grace period is over, or the
//! node's lease ran out) it kills the helper with everything else in the
//! task's cgroup, then runs `PROGRAM container-task kill STATE_DIR KEY`,
//! which removes the container by force: a container never outlives its
//! task's supervisor's decision, whether or not the agent is alive.
//!
//! An image that is not on the node is pulled (progress lines in the task's
//! log); one that cannot be pulled ends the task with exit code 125 and the
//! engine's reason in the log, which `muster logs` shows.

use crate::runtime::record::{self, TaskRecord};
use bollard::Docker;
use bollard::auth::DockerCredentials;
use bollard::models::{ContainerCreateBody, DeviceRequest, HostConfig, Mount, MountType};
use bollard::query_parameters::{
    CreateContainerOptions, CreateImageOptions, KillContainerOptions, LogsOptions,
    RemoveContainerOptions,
};
use futures_util::StreamExt;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

/// Exit code of a task whose container could not be made or started (as
/// `docker run` uses).
pub const CANNOT_RUN: i32 = 125;

/// Runs a command check in the container of task `key`: a Docker `exec`
/// without a terminal, as the container's user, in its directory, within
/// `timeout`. Ok on exit 0, else why (its exit status and the end of its
/// output). (The engine cannot stop an `exec` that outlives its timeout: it
/// ends with the container.)
pub async fn exec_check(
    state_dir: &Path,
    key: &str,
    command: &[String],
    timeout: Duration,
) -> Result<(), (Option<i64>, String)> {
    let shown = command.join(" ");
    let failed = |message: String| (None, message);
    let docker = Docker::connect_with_local_defaults()
        .map_err(|error| failed(format!("no Docker engine: {error}")))?;
    let name = container_name(state_dir, key);
    let exec = docker
        .create_exec(
            &name,
            bollard::exec::CreateExecOptions {
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                cmd: Some(command.to_vec()),
                ..Default::default()
            },
        )
        .await
        .map_err(|error| failed(format!("`{shown}` could not start in {name}: {error}")))?;
    let run = async {
        let mut said = Vec::new();
        if let bollard::exec::StartExecResults::Attached { mut output, .. } = docker
            .start_exec(&exec.id, None)
            .await
            .map_err(|error| failed(format!("`{shown}` could not start: {error}")))?
        {
            while let Some(Ok(chunk)) = output.next().await {
                said.extend_from_slice(&chunk.into_bytes());
                if said.len() > 64 * 1024 {
                    said.drain(..said.len() - 64 * 1024);
                }
            }
        }
        let inspected = docker
            .inspect_exec(&exec.id)
            .await
            .map_err(|error| failed(format!("`{shown}`: {error}")))?;
        Ok::<_, (Option<i64>, String)>((inspected.exit_code, said))
    };
    match tokio::time::timeout(timeout, run).await {
        Err(_) => Err(failed(format!(
            "`{shown}` did not finish within {}s",
            timeout.as_secs_f64()
        ))),
        Ok(Err(error)) => Err(error),
        Ok(Ok((Some(0), _))) => Ok(()),
        Ok(Ok((code, said))) => Err((
            code.or(Some(-1)),
            String::from_utf8_lossy(&said).trim().to_string(),
        )),
    }
}

/// What a dev environment's container runs: nothing but staying up until
/// it is stopped (its image needs a `sh`).
const DEV_KEEP_ALIVE: &str = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done";

/// A shell in the container of dev environment task `key` (an `exec` with
/// a terminal of `rows` x `cols`, the container's user and directory):
/// writes `ok` and a newline to `stream`, then its bytes both ways until
/// the shell ends.
pub async fn exec_shell<S>(
    state_dir: &Path,
    key: &str,
    rows: u16,
    cols: u16,
    term: &str,
    stream: &mut S,
) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let docker = Docker::connect_with_local_defaults()
        .map_err(|error| format!("no Docker engine: {error}"))?;
    let name = container_name(state_dir, key);
    let exec = docker
        .create_exec(
            &name,
            bollard::exec::CreateExecOptions {
                attach_stdin: Some(true),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                tty: Some(true),
                env: Some(vec![format!("TERM={term}")]),
                cmd: Some(vec![
                    "sh".to_string(),
                    "-c".to_string(),
                    "if command -v bash >/dev/null 2>&1; then exec bash -l; fi; exec sh -l"
                        .to_string(),
                ]),
                ..Default::default()
            },
        )
        .await
        .map_err(|error| format!("cannot start a shell in {name}: {error}"))?;
    let started = docker
        .start_exec(
            &exec.id,
            Some(bollard::exec::StartExecOptions {
                detach: false,
                tty: true,
                output_capacity: None,
            }),
        )
        .await
        .map_err(|error| format!("cannot start a shell in {name}: {error}"))?;
    let bollard::exec::StartExecResults::Attached {
        mut output,
        mut input,
    } = started
    else {
        return Err("the shell started detached".to_string());
    };
    let _ = docker
        .resize_exec(
            &exec.id,
            bollard::exec::ResizeExecOptions {
                height: rows.max(1),
                width: cols.max(1),
            },
        )
        .await;
    stream
        .write_all(b"ok\n")
        .await
        .map_err(|error| error.to_string())?;
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            next = output.next() => match next {
                Some(Ok(chunk)) => {
                    if stream.write_all(&chunk.into_bytes()).await.is_err() {
                        break;
                    }
                }
                _ => break,
            },
            read = stream.read(&mut buffer) => match read {
                Ok(0) | Err(_) => break,
                Ok(count) => {
                    if input.write_all(&buffer[..count]).await.is_err() {
                        break;
                    }
                }
            },
        }
    }
    let _ = stream.shutdown().await;
    Ok(())
}

/// The container of the task `key` of the agent whose state is in
/// `state_dir`: `muster-HASH-KEY`, HASH naming the agent (agents on one
/// machine share its engine, and their keys may be alike), the same for
/// every build (FNV-1a of the directory's path).
pub fn container_name(state_dir: &Path, key: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in state_dir.as_os_str().as_encoded_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("muster-{:08x}-{key}", hash as u32)
}

/// `container-task run STATE_DIR KEY UID:GID` or `container-task kill
/// STATE_DIR KEY`; returns the process's exit code.
pub fn main(args: &[String]) -> i32 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("muster: cannot start the container helper: {error}");
            return CANNOT_RUN;
        }
    };
    match args {
        [verb, state_dir, key, user] if verb == "run" => {
            runtime.block_on(run(Path::new(state_dir), key, user))
        }
        [verb, state_dir, key] if verb == "kill" => {
            runtime.block_on(kill(Path::new(state_dir), key))
        }
        _ => {
            eprintln!(
                "usage: muster container-task run STATE_DIR KEY UID:GID | kill STATE_DIR KEY \
                 (started by a task's supervisor, not by hand)"
            );
            2
        }
    }
}

/// The node's Docker engine, at `DOCKER_HOST` or its default socket, at an
/// API version both sides speak.
pub async fn connect() -> Result<Docker, String> {
    let docker = Docker::connect_with_local_defaults()
        .map_err(|error| format!("cannot reach the Docker engine: {error}"))?;
    docker.negotiate_version().await.map_err(|error| {
        format!(
            "cannot reach the Docker engine ({error}); is dockerd running, and may the agent's \
             user use its socket?"
        )
    })
}

/// The Docker engine's version, if one answers here (within 5 s).
pub async fn engine_version() -> Option<String> {
    let check = async {
        let docker = connect().await.ok()?;
        docker.version().await.ok()?.version
    };
    tokio::time::timeout(Duration::from_secs(5), check)
        .await
        .ok()
        .flatten()
}

/// Says why in the task's log (the helper's stdout and stderr are the
/// log), and gives the exit code.
fn cannot_run(message: String) -> i32 {
    let mut stderr = std::io::stderr();
    let _ = writeln!(stderr, "muster: {message}");
    let _ = stderr.flush();
    CANNOT_RUN
}

async fn remove(docker: &Docker, name: &str) {
    let _ = docker
        .remove_container(
            name,
            Some(RemoveContainerOptions {
                force: true,
                ..Default::default()
            }),
        )
        .await;
}

async fn run(state_dir: &Path, key: &str, user: &str) -> i32 {
    let record_path = record::path(&state_dir.join("tasks"), key, "json");
    let task: TaskRecord = match record::read_task(&record_path) {
        Ok(task) => task,
        Err(why) => return cannot_run(format!("cannot read {}: {why}", record_path.display())),
    };
    let Some(plan) = task.container.clone() else {
        return cannot_run(format!("{key} is not a container task"));
    };
    let docker = match connect().await {
        Ok(docker) => docker,
        Err(message) => return cannot_run(message),
    };
    let name = container_name(state_dir, key);
    // Keys carry the attempt's generation, so none should be there; one
    // left by a crash of an earlier helper is not this task's to keep.
    remove(&docker, &name).await;
    if docker.inspect_image(&plan.image).await.is_err() {
        let progress = record::path(&state_dir.join("tasks"), key, "pull");
        let pulled = pull(
            &docker,
            &plan.image,
            plan.registry_auth.as_deref(),
            &progress,
        )
        .await;
        let _ = std::fs::remove_file(&progress);
        if let Err(message) = pulled {
            return cannot_run(message);
        }
    }
    let mut env = task.env.clone();
    if !plan.gpu_devices.is_empty() {
        // The NVIDIA runtime shows the container only its GPUs, numbered
        // from 0.
        let visible = (0..plan.gpu_devices.len())
            .map(|index| index.to_string())
            .collect::<Vec<_>>()
            .join(",");
        env.insert("CUDA_VISIBLE_DEVICES".into(), visible);
        env.insert("NVIDIA_VISIBLE_DEVICES".into(), plan.gpu_devices.join(","));
    }
    // A dev environment's container only stays up: its shells are the
    // agent's `exec`s into it (see `exec_shell`).
    let command = if muster_model::is_dev_session_command(&task.command) {
        vec![
            "sh".to_string(),
            "-c".to_string(),
            DEV_KEEP_ALIVE.to_string(),
        ]
    } else {
        task.command.clone()
    };
    let body = ContainerCreateBody {
        image: Some(plan.image.clone()),
        cmd: Some(command),
        env: Some(env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
        working_dir: task
            .working_dir
            .as_ref()
            .map(|dir| dir.display().to_string()),
        user: Some(user.to_string()),
        labels: Some(HashMap::from([(
            "muster.task".to_string(),
            key.to_string(),
        )])),
        stop_signal: Some(format!("SIG{}", task.stop_signal)),
        host_config: Some(HostConfig {
            network_mode: Some(plan.network.clone()),
            shm_size: i64::try_from(plan.shm_size_bytes).ok(),
            memory: task
                .memory_limit_bytes
                .and_then(|bytes| i64::try_from(bytes).ok()),
            // No swap beyond the limit: the limit is the limit.
            memory_swap: task
                .memory_limit_bytes
                .and_then(|bytes| i64::try_from(bytes).ok()),
            pids_limit: task.pids_max.and_then(|pids| i64::try_from(pids).ok()),
            // The job's CPUs (in billionths, as the engine counts them).
            nano_cpus: plan
                .cpu_milli
                .filter(|&milli| milli > 0)
                .and_then(|milli| i64::try_from(milli.saturating_mul(1_000_000)).ok()),
            // PID 1 that reaps and passes signals on (docker-init).
            init: Some(true),
            // Bind mounts (not `Binds`): a source that is not on the node
            // is an error, never an empty directory made for it.
            mounts: (!plan.mounts.is_empty()).then(|| {
                plan.mounts
                    .iter()
                    .map(|mount| Mount {
                        source: Some(mount.source.clone()),
                        target: Some(mount.target.clone()),
                        typ: Some(MountType::BIND),
                        read_only: Some(mount.read_only),
                        ..Default::default()
                    })
                    .collect()
            }),
            auto_remove: Some(false),
            device_requests: (!plan.gpu_devices.is_empty()).then(|| {
                vec![DeviceRequest {
                    driver: Some("nvidia".into()),
                    device_ids: Some(plan.gpu_devices.clone()),
                    capabilities: Some(vec![vec!["gpu".into()]]),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let created = docker
        .create_container(
            Some(CreateContainerOptions {
                name: Some(name.clone()),
                ..Default::default()
            }),
            body,
        )
        .await;
    if let Err(error) = created {
        return cannot_run(format!(
            "cannot create the container from {}: {error}",
            plan.image
        ));
    }
    if let Err(error) = docker.start_container(&name, None).await {
        remove(&docker, &name).await;
        return cannot_run(format!(
            "cannot start the container from {}: {error}",
            plan.image
        ));
    }
    // Its output into the task's log, as it comes.
    let logs = {
        let docker = docker.clone();
        let name = name.clone();
        tokio::spawn(async move {
            let mut output = docker.logs(
                &name,
                Some(LogsOptions {
                    follow: true,
                    stdout: true,
                    stderr: true,
                    ..Default::default()
                }),
            );
            let mut stdout = std::io::stdout();
            while let Some(Ok(chunk)) = output.next().await {
                let _ = stdout.write_all(&chunk.into_bytes());
                let _ = stdout.flush();
            }
        })
    };
    let code = tokio::select! {
        code = wait(&docker, &name) => code,
        () = forward_signals(&docker, &name) => CANNOT_RUN,
    };
    // The rest of its output, then the container goes.
    let _ = tokio::time::timeout(Duration::from_secs(5), logs).await;
    let out_of_memory = docker
        .inspect_container(&name, None)
        .await
        .ok()
        .and_then(|inspected| inspected.state)
        .and_then(|state| state.oom_killed)
        .unwrap_or(false);
    if out_of_memory {
        // For the supervisor, which sees the helper's cgroup, not the
        // container's: the task ended at its memory limit.
        let _ = std::fs::write(record::path(&state_dir.join("tasks"), key, "oom"), b"");
        let limit = task
            .memory_limit_bytes
            .map_or("its".to_string(), |bytes| format!("{} MiB", bytes >> 20));
        let _ = writeln!(
            std::io::stderr(),
            "muster: the container was killed for going over its memory limit ({limit})"
        );
    }
    remove(&docker, &name).await;
    code
}

/// The registry an image reference names (`docker.io` when it names
/// none: its first part has no `.` or `:` and is not `localhost`).
pub fn registry_of(image: &str) -> &str {
    match image.split_once('/') {
        Some((first, _)) if first.contains(['.', ':']) || first == "localhost" => first,
        _ => "docker.io",
    }
}

/// Credentials from an image pull secret: `USER:PASSWORD`, or a JSON
/// object with `username` and `password` (and optionally
/// `serveraddress`).
pub fn credentials(secret: &str, image: &str) -> Result<DockerCredentials, String> {
    let secret = secret.trim();
    let (username, password, server) = if secret.starts_with('{') {
        let value: serde_json::Value = serde_json::from_str(secret)
            .map_err(|error| format!("the image pull secret is not valid JSON: {error}"))?;
        let field = |name: &str| value.get(name).and_then(|v| v.as_str()).map(str::to_string);
        (field("username"), field("password"), field("serveraddress"))
    } else {
        match secret.split_once(':') {
            Some((user, password)) => (Some(user.to_string()), Some(password.to_string()), None),
            None => (None, None, None),
        }
    };
    let (Some(username), Some(password)) = (username, password) else {
        return Err(
            "the image pull secret holds no credentials: set it to USER:PASSWORD, or to \
             {\"username\": ..., \"password\": ...}"
                .to_string(),
        );
    };
    Ok(DockerCredentials {
        username: Some(username),
        password: Some(password),
        serveraddress: Some(server.unwrap_or_else(|| registry_of(image).to_string())),
        ..Default::default()
    })
}

/// Pulls `image` (with the pull secret's credentials, if any), its
/// progress in the task's log and, for the agent to report, in
/// `progress_file` (rewritten whole as it changes).
async fn pull(
    docker: &Docker,
    image: &str,
    secret: Option<&str>,
    progress_file: &Path,
) -> Result<(), String> {
    let credentials = secret
        .map(|secret| credentials(secret, image))
        .transpose()?;
    println!("muster: pulling {image}");
    let note = |status: &str| {
        let temporary = progress_file.with_extension("pull.tmp");
        if std::fs::write(&temporary, format!("pulling {image}: {status}")).is_ok() {
            let _ = std::fs::rename(&temporary, progress_file);
        }
    };
    note("starting");
    let mut layers: std::collections::BTreeMap<String, bool> = Default::default();
    let mut progress = docker.create_image(
        Some(CreateImageOptions {
            from_image: Some(image.to_string()),
            ..Default::default()
        }),
        None,
        credentials,
    );
    let mut last = String::new();
    while let Some(step) = progress.next().await {
        match step {
            Ok(info) => {
                let status = info.status.unwrap_or_default();
                if let Some(layer) = info.id.filter(|id| id.len() == 12) {
                    let done =
                        status.starts_with("Pull complete") || status.starts_with("Already exists");
                    layers.insert(layer, done);
                }
                let done = layers.values().filter(|&&done| done).count();
                let line = if layers.is_empty() {
                    status.clone()
                } else {
                    format!("{status} ({done} of {} layers done)", layers.len())
                };
                if line != last {
                    println!("muster: {image}: {line}");
                    note(&line);
                    last = line;
                }
            }
            Err(error) => {
                return Err(format!(
                    "cannot pull the image {image}: {error} (is the name right, and may this \
                     node reach its registry?)"
                ));
            }
        }
    }
    Ok(())
}

/// The container's exit code once it has ended (128 + N for a signal, as
/// Docker reports it).
async fn wait(docker: &Docker, name: &str) -> i32 {
    let mut waits = docker.wait_container(name, None);
    loop {
        match waits.next().await {
            Some(Ok(answer)) => return i32::try_from(answer.status_code).unwrap_or(CANNOT_RUN),
            // bollard answers a non-zero exit as this error.
            Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => {
                return i32::try_from(code).unwrap_or(CANNOT_RUN);
            }
            Some(Err(error)) => {
                let _ = writeln!(std::io::stderr(), "muster: lost the container: {error}");
                // Ask again: a dropped connection is not the container's end.
                tokio::time::sleep(Duration::from_millis(500)).await;
                waits = docker.wait_container(name, None);
            }
            None => return CANNOT_RUN,
        }
    }
}

/// Passes the signals the supervisor sends (the job's stop signal) on to
/// the container; never returns unless signals cannot be watched.
async fn forward_signals(docker: &Docker, name: &str) {
    use tokio::signal::unix::{SignalKind, signal};
    let kinds = [
        (SignalKind::terminate(), "SIGTERM"),
        (SignalKind::interrupt(), "SIGINT"),
        (SignalKind::hangup(), "SIGHUP"),
        (SignalKind::quit(), "SIGQUIT"),
        (SignalKind::user_defined1(), "SIGUSR1"),
        (SignalKind::user_defined2(), "SIGUSR2"),
    ];
    let mut streams = Vec::new();
    for (kind, signal_name) in kinds {
        match signal(kind) {
            Ok(stream) => streams.push((stream, signal_name)),
            Err(_) => return,
        }
    }
    let (sender, mut received) = tokio::sync::mpsc::unbounded_channel();
    for (mut stream, signal_name) in streams {
        let sender = sender.clone();
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                if sender.send(signal_name).is_err() {
                    return;
                }
            }
        });
    }
    while let Some(signal_name) = received.recv().await {
        let _ = docker
            .kill_container(
                name,
                Some(KillContainerOptions {
                    signal: signal_name.to_string(),
                }),
            )
            .await;
    }
}

/// Removes the container of the task `key` of the agent whose state is in
/// `state_dir`, if the engine answers within 20 s (the agent's own clean-up
/// when a task's supervisor is gone).
pub async fn remove_task_container(state_dir: &Path, key: &str) {
    let removed = async {
        if let Ok(docker) = connect().await {
            remove(&docker, &container_name(state_dir, key)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(20), removed).await;
}

/// Removes the task's container by force (the supervisor's kill).
async fn kill(state_dir: &Path, key: &str) -> i32 {
    match connect().await {
        Ok(docker) => {
            remove(&docker, &container_name(state_dir, key)).await;
            0
        }
        Err(message) => cannot_run(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pull_secret_gives_credentials_for_the_images_registry() {
        let plain = credentials("alice:pa:ss", "registry.internal:5000/team/trainer:1")
            .expect("credentials");
        assert_eq!(plain.username.as_deref(), Some("alice"));
        assert_eq!(plain.password.as_deref(), Some("pa:ss"));
        assert_eq!(
            plain.serveraddress.as_deref(),
            Some("registry.internal:5000")
        );
        let json = credentials(
            r#"{"username": "$oauthtoken", "password": "nvapi-x"}"#,
            "nvcr.io/nvidia/pytorch:24.05-py3",
        )
        .expect("credentials");
        assert_eq!(json.username.as_deref(), Some("$oauthtoken"));
        assert_eq!(json.serveraddress.as_deref(), Some("nvcr.io"));
        assert_eq!(
            credentials("bob:x", "team/trainer:1")
                .expect("credentials")
                .serveraddress
                .as_deref(),
            Some("docker.io")
        );
        let error = credentials("no-colon", "a/b").unwrap_err();
        assert!(error.contains("USER:PASSWORD"), "{error}");
        assert!(credentials("{not json", "a/b").is_err());
        assert_eq!(registry_of("localhost/x:1"), "localhost");
        assert_eq!(registry_of("ubuntu:22.04"), "docker.io");
    }
}
