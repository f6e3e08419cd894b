//! A real PostgreSQL server for tests that need one (std only: processes
//! and files).
//!
//! `MUSTER_TEST_POSTGRES` names a running server (a URL whose user may
//! create databases; `.ci/run` starts one from Debian's package). Without
//! it, [`TestPostgres::get`] starts a private server from the machine's
//! PostgreSQL binaries (`initdb`, `pg_ctl` under `/usr/lib/postgresql`) in
//! a temporary directory, as `postgres` when running as root (PostgreSQL
//! refuses root), and stops it when dropped. Without either, it says so
//! loudly and answers `None`, unless `MUSTER_REQUIRE_TOOLS` is set (as in
//! CI), where that is a failure.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A PostgreSQL server to make test databases on.
pub struct TestPostgres {
    admin: String,
    private: Option<PrivateServer>,
}

struct PrivateServer {
    dir: tempfile::TempDir,
    bin: PathBuf,
    as_postgres: bool,
}

static DATABASES: AtomicU32 = AtomicU32::new(0);

/// The newest PostgreSQL's binaries on this machine.
fn bin_dir() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(|entry| entry.ok().map(|e| e.path().join("bin")))
                .collect()
        })
        .unwrap_or_default();
    candidates.sort();
    candidates
        .into_iter()
        .rev()
        .find(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim() == "0")
        .unwrap_or(false)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("a free port")
}

impl PrivateServer {
    fn command(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            Command::new(path)
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn start() -> Option<(PrivateServer, u16)> {
        let bin = bin_dir()?;
        let dir = tempfile::tempdir().expect("a temporary directory");
        let server = PrivateServer {
            dir,
            bin,
            as_postgres: is_root(),
        };
        let data = server.data();
        std::fs::create_dir(&data).expect("the data directory");
        if server.as_postgres {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(server.dir.path(), std::fs::Permissions::from_mode(0o755))
                .expect("chmod");
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&data)
                .status()
                .expect("chown runs");
            assert!(
                status.success(),
                "cannot give the data directory to postgres"
            );
        }
        let initdb = server
            .command("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .output()
            .expect("initdb runs");
        assert!(
            initdb.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&initdb.stderr)
        );
        let port = free_port();
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1",
            data.display()
        );
        let started = server
            .command("pg_ctl")
            .arg("-D")
            .arg(&data)
            .args(["-w", "-t", "30", "-o", &options, "-l"])
            .arg(data.join("server.log"))
            .arg("start")
            .output()
            .expect("pg_ctl runs");
        assert!(
            started.status.success(),
            "PostgreSQL did not start: {}",
            String::from_utf8_lossy(&started.stderr)
        );
        Some((server, port))
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"])
            .output();
    }
}

impl TestPostgres {
    /// The server named by `MUSTER_TEST_POSTGRES`, else a private one;
    /// `None` (said loudly) when PostgreSQL is not on this machine.
    pub fn get() -> Option<TestPostgres> {
        if let Ok(admin) = std::env::var("MUSTER_TEST_POSTGRES") {
            return Some(TestPostgres {
                admin,
                private: None,
            });
        }
        match PrivateServer::start() {
            Some((server, port)) => Some(TestPostgres {
                admin: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
                private: Some(server),
            }),
            None => {
                assert!(
                    std::env::var_os("MUSTER_REQUIRE_TOOLS").is_none(),
                    "PostgreSQL is needed: set MUSTER_TEST_POSTGRES, or install Debian's \
                     postgresql"
                );
                eprintln!(
                    "\n*** NO POSTGRESQL: tests that need it check SQLite only or nothing \
                     (set MUSTER_TEST_POSTGRES or install Debian's postgresql) ***\n"
                );
                None
            }
        }
    }

    /// The server's URL for its `postgres` database.
    pub fn admin_url(&self) -> &str {
        &self.admin
    }

    /// `psql` on the database at `url`, running the command that follows.
    fn psql(&self, url: &str) -> Command {
        let psql = self
            .private
            .as_ref()
            .map(|server| server.bin.join("psql"))
            .or_else(|| bin_dir().map(|bin| bin.join("psql")))
            .unwrap_or_else(|| PathBuf::from("psql"));
        let mut command = Command::new(psql);
        command.args([
            "-X",
            "-q",
            "-t",
            "-A",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            url,
            "-c",
        ]);
        command
    }

    fn run(&self, sql: &str) {
        let output = self.psql(&self.admin).arg(sql).output().expect("psql runs");
        assert!(
            output.status.success(),
            "{sql}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// A new, empty database (its name starts with `prefix`); its URL and
    /// name.
    pub fn create_database(&self, prefix: &str) -> (String, String) {
        let name = format!(
            "{prefix}_{}_{}",
            std::process::id(),
            DATABASES.fetch_add(1, Ordering::Relaxed)
        );
        self.run(&format!("DROP DATABASE IF EXISTS {name}"));
        self.run(&format!("CREATE DATABASE {name}"));
        let (base, _) = self.admin.rsplit_once('/').expect("a URL with a database");
        (format!("{base}/{name}"), name)
    }

    /// Drops a database made by [`TestPostgres::create_database`], even
    /// with connections still open.
    pub fn drop_database(&self, name: &str) {
        self.run(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
    }

    /// What `sql` answers on the database at `url`, as text (fields
    /// separated by `|`, rows by newlines), or psql's error.
    pub fn query(&self, url: &str, sql: &str) -> Result<String, String> {
        let output = self
            .psql(url)
            .arg(sql)
            .output()
            .map_err(|e| e.to_string())?;
        if !output.status.success() {
            return Err(String::from_utf8_lossy(&output.stderr).into_owned());
        }
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    }
}
