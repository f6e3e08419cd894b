//! Tunnels into dev environments (`muster dev shell`/`forward`): the agent
//! connects out to the server for each one and joins it to the
//! environment's session helper on the node, or to a shell in its
//! container. Nodes need no inbound port.

use crate::agent::task_key;
use muster_api::client::Client;
use muster_api::protocol::TunnelOpen;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// A session into a dev environment that runs in a container: the agent
/// reads its first line (the server wrote it) and opens a shell in the
/// container, or connects to the port (the container shares the node's
/// network).
async fn container_session<S>(
    state_dir: &std::path::Path,
    key: &str,
    upstream: &mut S,
) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut line = Vec::new();
    loop {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), upstream.read(&mut byte))
            .await
            .map_err(|_| "no session header".to_string())?
            .map_err(|error| error.to_string())?;
        if read == 0 {
            return Err("the connection closed".to_string());
        }
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
        if line.len() > 4096 {
            return Err("the session header is too long".to_string());
        }
    }
    let header: crate::devsession::Header =
        serde_json::from_slice(&line).map_err(|error| format!("a bad session header: {error}"))?;
    match header.kind.as_str() {
        "shell" => {
            let term = header
                .term
                .filter(|term| term.len() < 64 && term.bytes().all(|b| b.is_ascii_graphic()))
                .unwrap_or_else(|| "xterm-256color".to_string());
            crate::container::exec_shell(
                state_dir,
                key,
                header.rows.unwrap_or(24),
                header.cols.unwrap_or(80),
                &term,
                upstream,
            )
            .await
        }
        "forward" => {
            let port = header.port.ok_or("forward: no port")?;
            let mut target = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .map_err(|error| {
                    format!("nothing answers on port {port} in the environment ({error})")
                })?;
            upstream
                .write_all(b"ok\n")
                .await
                .map_err(|error| error.to_string())?;
            let _ = tokio::io::copy_bidirectional(upstream, &mut target).await;
            Ok(())
        }
        other => Err(format!("unknown kind {other:?}")),
    }
}

/// The most tunnels an agent joins at once (more wait).
const MAX_TUNNELS: usize = 64;

/// How long a tunnel waits for one of [`MAX_TUNNELS`] (less than the
/// server's 15 s wait for the agent to connect it).
const TUNNEL_SLOT_WAIT: Duration = Duration::from_secs(10);

fn tunnel_slots() -> &'static Arc<tokio::sync::Semaphore> {
    static SLOTS: std::sync::OnceLock<Arc<tokio::sync::Semaphore>> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| Arc::new(tokio::sync::Semaphore::new(MAX_TUNNELS)))
}

/// Opens each tunnel a user asked for (`muster dev shell`/`forward`):
/// a connection to the server, upgraded, joined to `127.0.0.1:port`
/// (the dev environment's session helper). Nodes need no inbound port.
pub(crate) fn open(client: &Client, node: &str, state_dir: &Path, tunnels: &[TunnelOpen]) {
    for tunnel in tunnels {
        let client = client.clone();
        let node = node.to_string();
        let state_dir = state_dir.to_path_buf();
        let tunnel = *tunnel;
        tokio::spawn(async move {
            // The server stops waiting for the agent after 15 s: a
            // tunnel that finds no free slot by then is given up, not
            // left waiting.
            let slot = tunnel_slots().clone().acquire_owned();
            let Ok(Ok(_slot)) = tokio::time::timeout(TUNNEL_SLOT_WAIT, slot).await else {
                tracing::warn!(tunnel = tunnel.id, "no free tunnel slot: not opened");
                return;
            };
            let mut upstream = match client.open_tunnel(&node, tunnel.id).await {
                Ok(upstream) => upstream,
                Err(error) => {
                    tracing::warn!(tunnel = tunnel.id, %error, "cannot open a tunnel");
                    return;
                }
            };
            if let Some(task) = tunnel.container {
                let key = task_key(task.job, task.allocation, task.generation);
                if let Err(error) = container_session(&state_dir, &key, &mut upstream).await {
                    let _ = tokio::io::AsyncWriteExt::write_all(
                        &mut upstream,
                        format!("refused: {error}\n").as_bytes(),
                    )
                    .await;
                }
                return;
            }
            // The helper may be starting still: a few seconds to listen.
            let mut local = tokio::net::TcpStream::connect(("127.0.0.1", tunnel.port)).await;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while local.is_err() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                local = tokio::net::TcpStream::connect(("127.0.0.1", tunnel.port)).await;
            }
            match local {
                Ok(mut local) => {
                    let _ = tokio::io::copy_bidirectional(&mut upstream, &mut local).await;
                }
                Err(error) => {
                    // The user reads this as the session's answer.
                    let _ = tokio::io::AsyncWriteExt::write_all(
                        &mut upstream,
                        format!(
                            "refused: the environment's session helper does not answer on \
                             port {} of its node ({error}); `muster logs` shows its output\n",
                            tunnel.port
                        )
                        .as_bytes(),
                    )
                    .await;
                }
            }
        });
    }
}
