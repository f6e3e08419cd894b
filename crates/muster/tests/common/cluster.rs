//! A server and agents as real child processes on loopback, for the
//! end-to-end tests. Everything lives in one temporary directory; every
//! process is killed (SIGKILL) when its handle drops.

use muster_api::client::Client;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, wait_until};

pub const BIN: &str = env!("CARGO_BIN_EXE_muster");

/// A child process, killed when dropped.
pub struct Daemon(pub Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Daemon {
    pub fn pid(&self) -> i32 {
        self.0.id() as i32
    }
}

/// Starts `muster ARGS` in `dir`, its output appended to `dir/LOG`.
pub fn spawn(dir: &Path, log: &str, args: &[&str]) -> Daemon {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(log))
        .expect("log file");
    Daemon(
        Command::new(BIN)
            .args(args)
            .env("HOME", dir)
            .env("XDG_CONFIG_HOME", dir.join("config"))
            .env("XDG_DATA_HOME", dir.join("data"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("muster starts"),
    )
}

/// A server (and the agents started from it) in a temporary directory.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub address: String,
    pub server: Option<Daemon>,
    pub lease: &'static str,
    /// More flags for `muster server`.
    pub server_args: Vec<String>,
}

impl Cluster {
    pub fn start(lease: &'static str) -> Self {
        Cluster::start_with(lease, &[])
    }

    /// A cluster whose server has `extra` flags too.
    pub fn start_with(lease: &'static str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let address = format!("127.0.0.1:{}", free_port());
        let mut cluster = Cluster {
            dir,
            address,
            server: None,
            lease,
            server_args: extra.iter().map(|arg| arg.to_string()).collect(),
        };
        cluster.start_server();
        cluster
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The server serves HTTPS with its generated CA (the default).
    pub fn url(&self) -> String {
        format!("https://{}", self.address)
    }

    /// The cluster CA's fingerprint, as `muster server` prints it.
    pub fn ca_sha256(&self) -> String {
        std::fs::read_to_string(self.path("server").join("tls/ca.sha256"))
            .expect("the server wrote its CA's fingerprint")
            .trim()
            .to_string()
    }

    /// A client for `token` that pins the cluster CA.
    pub fn client_with(&self, url: &str, token: &str) -> Client {
        let trust = muster_api::tls::Trust {
            ca_pem: None,
            ca_sha256: Some(
                muster_api::tls::Fingerprint::parse(&self.ca_sha256()).expect("fingerprint"),
            ),
        };
        Client::with_trust(url, token, &trust).expect("client")
    }

    pub fn start_server(&mut self) {
        let data = self.path("server");
        let base = self.master_port_base().to_string();
        let mut args = vec![
            "server",
            "--listen",
            &self.address,
            "--data-dir",
            data.to_str().expect("utf-8 path"),
            "--lease",
            self.lease,
            "--master-port-base",
            &base,
        ];
        args.extend(self.server_args.iter().map(String::as_str));
        self.server = Some(spawn(self.dir.path(), "server.log", &args));
        let address = self.address.clone();
        wait_until("the server", Duration::from_secs(30), || {
            TcpStream::connect(&address).is_ok()
        });
    }

    /// This cluster's range of jobs' `MUSTER_MASTER_PORT`s: one of 220
    /// ranges of 100 ports from 10,000 (below the kernel's ephemeral
    /// ports), picked by the server's port, so that the clusters of tests
    /// running at once do not hand their jobs (job ids start at 1 in each)
    /// the same ports on this one host: gangs, dev environments and service
    /// replicas listen on them.
    pub fn master_port_base(&self) -> u16 {
        let port: u16 = self
            .address
            .rsplit(':')
            .next()
            .and_then(|port| port.parse().ok())
            .expect("the server's address has a port");
        10_000 + (port % 220) * 100
    }

    /// Job `job`'s `MUSTER_MASTER_PORT` in this cluster.
    pub fn master_port(&self, job: u64) -> u16 {
        muster_control::master_port(self.master_port_base(), muster_model::JobId(job))
    }

    pub fn token(&self, name: &str) -> String {
        std::fs::read_to_string(self.path("server").join(name))
            .expect("token file")
            .trim()
            .to_string()
    }

    pub fn client(&self) -> Client {
        self.client_with(&self.url(), &self.token("admin.token"))
    }

    /// An agent with `gpus` (a `--simulate-gpus` spec) and `extra` flags;
    /// its state under `dir/NAME`, its output in `dir/NAME.log`.
    pub fn agent_with(&self, name: &str, server_url: &str, gpus: &str, extra: &[&str]) -> Daemon {
        let state = self.path(name);
        let join_token = self.path("server").join("join.token");
        let fingerprint = self.ca_sha256();
        let mut args = vec![
            "agent",
            "--ca-sha256",
            &fingerprint,
            "--server",
            server_url,
            "--join-token-file",
            join_token.to_str().expect("utf-8 path"),
            "--name",
            name,
            "--address",
            "127.0.0.1",
            "--simulate-gpus",
            gpus,
            "--state-dir",
            state.to_str().expect("utf-8 path"),
        ];
        args.extend_from_slice(extra);
        spawn(self.dir.path(), &format!("{name}.log"), &args)
    }

    pub fn agent(&self, name: &str, server_url: &str) -> Daemon {
        self.agent_with(name, server_url, "1xH100-80GB", &[])
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Waits until `count` nodes have registered.
pub fn wait_for_nodes(rt: &tokio::runtime::Runtime, client: &Client, count: usize) {
    wait_until("the nodes to register", Duration::from_secs(30), || {
        rt.block_on(client.nodes()).map_or(0, |n| n.nodes.len()) == count
    });
}

/// The job's state, or "" when it cannot be read.
pub fn state(rt: &tokio::runtime::Runtime, client: &Client, id: u64) -> String {
    rt.block_on(client.job(id))
        .map(|job| job.state)
        .unwrap_or_default()
}

/// Rank `rank`'s whole log of job `id`, once the job has ended: read,
/// following, until the server says it has every byte (`complete`), since
/// the agent ships a task's output apart from its exit, so a job can end
/// before the last of its output reaches the server.
pub fn whole_log(rt: &tokio::runtime::Runtime, client: &Client, id: u64, rank: u32) -> String {
    let mut bytes = Vec::new();
    let mut offset = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let page = rt
            .block_on(client.logs(id, rank, offset, None, true))
            .expect("the log reads");
        bytes.extend_from_slice(&page.data);
        offset = page.next_offset;
        if page.complete {
            return String::from_utf8_lossy(&bytes).into_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "job {id} rank {rank}'s log was not complete within a minute; so far: {}",
            String::from_utf8_lossy(&bytes)
        );
    }
}
