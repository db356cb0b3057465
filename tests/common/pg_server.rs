//! Real PostgreSQL servers for tests: `initdb` + `pg_ctl` into a temporary directory, on a
//! free port, as an unprivileged user (initdb refuses root). Never a server that happens to
//! run on the machine.
//!
//! [`shared`] is one server per test binary, each test taking a fresh database of its own;
//! a watchdog stops it when the test process exits. [`PgServer::start`] is a server of the
//! test's own, stopped when dropped, for tests that kill and restart it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

pub struct PgServer {
    pub port: u16,
    dir: PathBuf,
    owned: bool,
    /// fsync on (a benchmark's server); tests run without it.
    durable: bool,
}

/// Where Debian keeps the server binaries (not on PATH), else PATH.
fn binary(name: &str) -> PathBuf {
    let mut found: Vec<PathBuf> = glob::glob(&format!("/usr/lib/postgresql/*/bin/{name}"))
        .map(|paths| paths.flatten().collect())
        .unwrap_or_default();
    found.sort();
    found.pop().unwrap_or_else(|| PathBuf::from(name))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.trim_ascii() == b"0")
        .unwrap_or(false)
}

/// A command run as the `postgres` user when the tests run as root.
fn as_server_user(program: &Path) -> Command {
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn run(mut command: Command, what: &str) {
    let output = command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{what}: {e} (.ci/run installs postgresql)"));
    assert!(
        output.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl PgServer {
    /// A server of this test's own, stopped (and its directory removed) when dropped.
    pub fn start() -> Self {
        let server = Self::init(true);
        server.start_process();
        server
    }

    /// Like [`PgServer::start`], with every commit synced to disk as in production.
    pub fn start_durable() -> Self {
        let mut server = Self::init(true);
        server.durable = true;
        server.start_process();
        server
    }

    fn init(owned: bool) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("idemgate-pg-")
            .tempdir()
            .unwrap()
            .keep();
        if is_root() {
            run(
                {
                    let mut c = Command::new("chown");
                    c.arg("-R").arg("postgres").arg(&dir);
                    c
                },
                "chown",
            );
        }
        let mut initdb = as_server_user(&binary("initdb"));
        initdb
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
                "-D",
            ])
            .arg(dir.join("data"));
        run(initdb, "initdb");
        Self {
            port: free_port(),
            dir,
            owned,
            durable: false,
        }
    }

    fn start_process(&self) {
        let mut pg_ctl = as_server_user(&binary("pg_ctl"));
        pg_ctl
            .args(["-w", "-t", "30", "-D"])
            .arg(self.dir.join("data"))
            .arg("-l")
            .arg(self.dir.join("log"))
            .arg("-o")
            .arg(format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync={} -c max_connections=300",
                self.port,
                self.dir.display(),
                if self.durable { "on" } else { "off" }
            ))
            .arg("start");
        run(pg_ctl, "pg_ctl start");
    }

    /// Stops the server at once, as a crash would.
    pub fn kill(&self) {
        let mut pg_ctl = as_server_user(&binary("pg_ctl"));
        pg_ctl
            .args(["-w", "-m", "immediate", "-D"])
            .arg(self.dir.join("data"))
            .arg("stop");
        run(pg_ctl, "pg_ctl stop");
    }

    /// Sends `signal` (`STOP`, `CONT`, …) to the server and every process it forked, so a
    /// `STOP` freezes it whole, open connections included.
    pub fn signal(&self, signal: &str) {
        let pid = std::fs::read_to_string(self.dir.join("data/postmaster.pid"))
            .expect("the server is running")
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned();
        let children = Command::new("pgrep")
            .args(["-P", &pid])
            .output()
            .expect("pgrep is installed");
        let mut pids = vec![pid];
        pids.extend(
            String::from_utf8_lossy(&children.stdout)
                .split_whitespace()
                .map(str::to_owned),
        );
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .args(&pids)
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} {pids:?}");
    }

    /// Starts it again on the same port, with the same data.
    pub fn restart(&self) {
        self.start_process();
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// A fresh, empty database on this server; its URL.
    pub async fn database(&self) -> String {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "t{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let (client, connection) =
            tokio_postgres::connect(&self.url("postgres"), tokio_postgres::NoTls)
                .await
                .expect("the test server answers");
        let driver = tokio::spawn(connection);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        drop(client);
        let _ = driver.await;
        self.url(&name)
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if self.owned {
            let mut pg_ctl = as_server_user(&binary("pg_ctl"));
            pg_ctl
                .args(["-m", "immediate", "-D"])
                .arg(self.dir.join("data"))
                .arg("stop")
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let _ = pg_ctl.status();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The test binary's shared server; a watchdog process stops it once this process is gone.
pub fn shared() -> &'static PgServer {
    static SHARED: OnceLock<PgServer> = OnceLock::new();
    SHARED.get_or_init(|| {
        let server = PgServer::init(false);
        server.start_process();
        let pg_ctl = binary("pg_ctl");
        let stop = if is_root() {
            format!("runuser -u postgres -- {}", pg_ctl.display())
        } else {
            pg_ctl.display().to_string()
        };
        // Polls once a second whether the test process still lives; then stops the server
        // and removes its directory.
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 1; done; \
             {stop} -m immediate -D '{data}' stop >/dev/null 2>&1; rm -rf '{dir}'",
            pid = std::process::id(),
            data = server.dir.join("data").display(),
            dir = server.dir.display(),
        );
        // `setsid -f` forks the watchdog off and returns at once.
        let started = Command::new("setsid")
            .args(["-f", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("the watchdog starts");
        assert!(started.success(), "the watchdog starts");
        server
    })
}

/// The store settings of a gateway on the database at `url`, with `pool_size` connections.
pub fn store_config(url: &str, pool_size: u32) -> idemgate::config::StoreConfig {
    idemgate::config::StoreConfig {
        kind: idemgate::config::StoreKind::Postgres,
        path: Default::default(),
        urls: vec![url.to_owned()],
        cluster: false,
        key_prefix: String::new(),
        pool_size: Some(pool_size),
        wait_replicas: 0,
        op_timeout: std::time::Duration::from_secs(2),
    }
}
