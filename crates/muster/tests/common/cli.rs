//! The `muster` CLI and daemons in a temporary home, for the end-to-end
//! tests that drive the binary as a user would. Every wait is bounded.

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

pub const BIN: &str = env!("CARGO_BIN_EXE_muster");

/// A child process, killed when dropped.
pub struct Daemon {
    pub child: Child,
    pub name: &'static str,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A temporary home (config, data) and the address its server listens on.
pub struct Env {
    pub dir: tempfile::TempDir,
    pub url: String,
    /// Connection flags for the CLI, put before any `--` (empty with
    /// `muster up`, which writes the client config).
    pub flags: Vec<String>,
    /// Whether `up` and `server` serve HTTPS (their default); most tests
    /// here speak plain HTTP to them (`--insecure-http`), the TLS tests
    /// set this.
    pub tls: bool,
}

impl Env {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("http://127.0.0.1:{}", free_port());
        Env {
            dir,
            url,
            flags: Vec::new(),
            tls: false,
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `muster` with this home and none of the caller's connection settings.
    pub fn command(&self) -> Command {
        let mut command = Command::new(BIN);
        command
            .env("HOME", self.path("home"))
            .env("XDG_CONFIG_HOME", self.path("config"))
            .env("XDG_DATA_HOME", self.path("data"))
            .env_remove("MUSTER_SERVER")
            .env_remove("MUSTER_TOKEN")
            .env_remove("MUSTER_DATA_DIR")
            .stdin(Stdio::null());
        command
    }

    /// `muster ARGS` in the background, its output in `NAME.log`.
    pub fn spawn(&self, name: &'static str, args: &[&str]) -> Daemon {
        let log = std::fs::File::create(self.path(&format!("{name}.log"))).expect("log file");
        let mut args: Vec<&str> = args.to_vec();
        if !self.tls && matches!(args.first(), Some(&"up") | Some(&"server")) {
            args.insert(1, "--insecure-http");
        }
        let child = self
            .command()
            .args(&args)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("muster starts");
        Daemon { child, name }
    }

    /// [`spawn`](Self::spawn), then wait until the API answers.
    pub fn start(&self, name: &'static str, args: &[&str]) -> Daemon {
        let mut daemon = self.spawn(name, args);
        self.wait_for_api(&mut daemon);
        daemon
    }

    pub fn wait_for_api(&self, daemon: &mut Daemon) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let address = self.url.trim_start_matches("http://").to_string();
        while Instant::now() < deadline {
            if let Ok(Some(status)) = daemon.child.try_wait() {
                panic!(
                    "{} exited early ({status}): {}",
                    daemon.name,
                    std::fs::read_to_string(self.path(&format!("{}.log", daemon.name)))
                        .unwrap_or_default()
                );
            }
            if std::net::TcpStream::connect(&address).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the API at {} never came up", self.url);
    }

    /// The CLI, with the connection flags before any `--`.
    pub fn muster(&self, args: &[&str]) -> Output {
        let mut all: Vec<&str> = args.to_vec();
        let at = all.iter().position(|a| *a == "--").unwrap_or(all.len());
        all.splice(at..at, self.flags.iter().map(String::as_str));
        self.command().args(&all).output().expect("muster runs")
    }
}
