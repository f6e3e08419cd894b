//! `muster dev-session`: a dev environment's task (`muster dev start`).
//!
//! The supervisor runs this program (its own binary, by absolute path) in
//! place of the job's command [`muster_model::DEV_SESSION_COMMAND`], so it
//! is the task's process: in the task's cgroup, as the task's user, with
//! its environment and working directory. It listens on
//! `127.0.0.1:$MUSTER_MASTER_PORT` for the connections the agent joins to
//! the server's tunnels; each starts with one JSON line naming the
//! environment's token (`MUSTER_DEV_TOKEN`, which the server derives and
//! puts only in the task's environment) and what is wanted:
//!
//! - `{"kind": "shell", "rows": R, "cols": C, "term": T}`: a login shell on
//!   a pseudo-terminal (the user's `$SHELL`, else bash, else sh), its bytes
//!   both ways until it exits;
//! - `{"kind": "forward", "port": P}`: a connection to `127.0.0.1:P`, the
//!   bytes both ways.
//!
//! It answers `ok` (or `refused: why`) and a newline first. A connection
//! with a wrong token gets nothing else; the token never reaches the shells.

use serde::Deserialize;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// The variable holding the environment's token.
pub const TOKEN_VARIABLE: &str = muster_model::DEV_TOKEN_VARIABLE;
/// The longest first line.
const MAX_HEADER: u64 = 4096;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    pub token: String,
    pub kind: String,
    #[serde(default)]
    pub rows: Option<u16>,
    #[serde(default)]
    pub cols: Option<u16>,
    #[serde(default)]
    pub term: Option<String>,
    #[serde(default)]
    pub port: Option<u16>,
}

/// `muster dev-session`: serves until killed. Returns the exit code.
pub fn main(_args: &[String]) -> i32 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("muster dev-session: cannot start: {error}");
            return 1;
        }
    };
    match runtime.block_on(serve()) {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("muster dev-session: {error}");
            1
        }
    }
}

async fn serve() -> Result<(), String> {
    let port: u16 = std::env::var("MUSTER_MASTER_PORT")
        .ok()
        .and_then(|port| port.parse().ok())
        .ok_or("MUSTER_MASTER_PORT is not set: run by `muster dev start`, not by hand")?;
    let token = std::env::var(TOKEN_VARIABLE)
        .ok()
        .filter(|token| token.len() >= 32)
        .ok_or("MUSTER_DEV_TOKEN is not set: run by `muster dev start`, not by hand")?;
    let listener = TcpListener::bind(("127.0.0.1", port))
        .await
        .map_err(|error| format!("cannot listen on 127.0.0.1:{port}: {error}"))?;
    println!(
        "dev environment ready in {}: `muster dev shell` opens a shell, `muster dev forward` a \
         port",
        std::env::current_dir()
            .map(|dir| dir.display().to_string())
            .unwrap_or_default()
    );
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                eprintln!("accept failed: {error}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let token = token.clone();
        tokio::spawn(async move {
            if let Err(error) = session(stream, &token).await {
                eprintln!("a session ended: {error}");
            }
        });
    }
}

/// Compares without stopping at the first difference.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

async fn session(stream: TcpStream, token: &str) -> Result<(), String> {
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    let read = tokio::time::timeout(
        Duration::from_secs(10),
        (&mut reader).take(MAX_HEADER).read_until(b'\n', &mut line),
    )
    .await
    .map_err(|_| "no header within 10 s".to_string())?
    .map_err(|error| error.to_string())?;
    if read == 0 || !line.ends_with(b"\n") {
        return Err("no header line".to_string());
    }
    let header: Header =
        serde_json::from_slice(&line).map_err(|error| format!("a bad header: {error}"))?;
    let mut stream = reader.into_inner();
    if !same(header.token.as_bytes(), token.as_bytes()) {
        let _ = stream.write_all(b"refused: wrong token\n").await;
        return Err("a connection with a wrong token".to_string());
    }
    match header.kind.as_str() {
        "shell" => shell(stream, &header).await,
        "forward" => {
            let port = header.port.ok_or("forward: no port")?;
            match TcpStream::connect(("127.0.0.1", port)).await {
                Ok(mut target) => {
                    stream
                        .write_all(b"ok\n")
                        .await
                        .map_err(|error| error.to_string())?;
                    let _ = tokio::io::copy_bidirectional(&mut stream, &mut target).await;
                    Ok(())
                }
                Err(error) => {
                    let _ = stream
                        .write_all(
                            format!(
                                "refused: nothing answers on port {port} in the environment \
                                 ({error})\n"
                            )
                            .as_bytes(),
                        )
                        .await;
                    Ok(())
                }
            }
        }
        other => {
            let _ = stream
                .write_all(format!("refused: unknown kind {other:?}\n").as_bytes())
                .await;
            Err(format!("unknown kind {other:?}"))
        }
    }
}

/// The shell to start: the user's `$SHELL`, else bash, else sh.
fn shell_program() -> String {
    std::env::var("SHELL")
        .ok()
        .filter(|shell| std::path::Path::new(shell).is_file())
        .or_else(|| {
            ["/bin/bash", "/usr/bin/bash"]
                .iter()
                .find(|shell| std::path::Path::new(shell).is_file())
                .map(|shell| shell.to_string())
        })
        .unwrap_or_else(|| "/bin/sh".to_string())
}

async fn shell(mut stream: TcpStream, header: &Header) -> Result<(), String> {
    let (mut pty, pts) = pty_process::open().map_err(|error| error.to_string())?;
    let size = pty_process::Size::new(
        header.rows.unwrap_or(24).max(1),
        header.cols.unwrap_or(80).max(1),
    );
    pty.resize(size).map_err(|error| error.to_string())?;
    let program = shell_program();
    let term = header
        .term
        .clone()
        .filter(|term| {
            !term.is_empty() && term.len() < 64 && term.bytes().all(|b| b.is_ascii_graphic())
        })
        .unwrap_or_else(|| "xterm-256color".to_string());
    let mut child = pty_process::Command::new(&program)
        .env_remove(TOKEN_VARIABLE)
        .env("TERM", term)
        .kill_on_drop(true)
        .spawn(pts)
        .map_err(|error| format!("cannot start {program}: {error}"))?;
    stream
        .write_all(b"ok\n")
        .await
        .map_err(|error| error.to_string())?;
    tokio::select! {
        // The pty reads an error once the shell and its children are gone.
        _ = tokio::io::copy_bidirectional(&mut stream, &mut pty) => {}
        _ = child.wait() => {
            // Whatever the shell wrote last.
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(
                Duration::from_millis(200),
                pty.read_to_end(&mut rest),
            )
            .await;
            let _ = stream.write_all(&rest).await;
        }
    }
    let _ = child.start_kill();
    let _ = stream.shutdown().await;
    Ok(())
}
