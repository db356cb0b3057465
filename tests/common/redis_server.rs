//! Real `redis-server` processes for tests: a standalone server, or a 3-master Cluster,
//! each on free ports, in a temporary directory, killed when dropped.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{closed_port, PATIENCE};

/// The store settings of a gateway on the standalone server at `url`.
pub fn store_config(url: String) -> idemgate::config::StoreConfig {
    idemgate::config::StoreConfig {
        kind: idemgate::config::StoreKind::Redis,
        path: Default::default(),
        urls: vec![url],
        cluster: false,
        key_prefix: "idemgate".into(),
        pool_size: None,
        wait_replicas: 0,
        op_timeout: Duration::from_secs(2),
    }
}

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    extra: Vec<&'static str>,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn spawn(port: u16, dir: &std::path::Path, extra: &[&str]) -> Child {
    Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server is installed (.ci/run installs it)")
}

/// Waits (bounded) until the server at `port` answers `PING`; `false` when it exited
/// instead, as it does when a port it was given is no longer free.
async fn wait_ready(child: &mut Child, port: u16) -> bool {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    loop {
        if let Ok(mut c) = client.get_multiplexed_async_connection().await {
            if redis::cmd("PING")
                .query_async::<String>(&mut c)
                .await
                .is_ok()
            {
                return true;
            }
        }
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "redis-server on {port} never answered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts a server on a port the kernel just handed out, and a Cluster node's bus on
/// another (`cluster-port`: by default the bus is the port + 10 000, which nothing
/// reserved, and which does not exist above 55 535). Between a port's choice and the
/// server's bind, another test's socket may take it, and the server exits: then new ports
/// are tried, a bounded number of times.
async fn start_on_free_ports(dir: &std::path::Path, extra: &[&str], cluster: bool) -> (Child, u16) {
    for _ in 0..5 {
        let port = closed_port().await.port();
        let mut args = extra.to_vec();
        let bus;
        if cluster {
            bus = closed_port().await.port().to_string();
            args.extend(["--cluster-port", bus.as_str()]);
        }
        let mut child = spawn(port, dir, &args);
        if wait_ready(&mut child, port).await {
            return (child, port);
        }
    }
    panic!("redis-server exited on start five times: its ports were taken each time");
}

impl RedisServer {
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A server that writes every change to its append-only file before answering: a
    /// `kill -9` loses nothing it acknowledged.
    pub async fn start_durable() -> Self {
        Self::start_with(&["--appendonly", "yes", "--appendfsync", "always"]).await
    }

    async fn start_with(extra: &[&'static str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (child, port) = start_on_free_ports(dir.path(), extra, false).await;
        Self {
            child: Some(child),
            port,
            dir,
            extra: extra.to_vec(),
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Sends `signal` (e.g. `STOP`, `CONT`) to the server process.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("the server is running").id();
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// Stops the server (SIGKILL): the store must notice.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port.
    pub async fn restart(&mut self) {
        self.stop();
        let mut child = spawn(self.port, self.dir.path(), &self.extra);
        assert!(
            wait_ready(&mut child, self.port).await,
            "redis-server did not start again on {}",
            self.port
        );
        self.child = Some(child);
    }

    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}

/// A 3-master Redis Cluster, no replicas.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub async fn start() -> Self {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            let dir = tempfile::tempdir().unwrap();
            let conf = dir.path().join("nodes.conf");
            let (child, port) = start_on_free_ports(
                dir.path(),
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    conf.to_str().unwrap(),
                    "--cluster-node-timeout",
                    "2000",
                ],
                true,
            )
            .await;
            nodes.push(RedisServer {
                child: Some(child),
                port,
                dir,
                // Cluster nodes are never restarted by the tests.
                extra: Vec::new(),
            });
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli is installed (.ci/run installs it)");
        assert!(status.success(), "redis-cli --cluster create failed");
        let deadline = tokio::time::Instant::now() + PATIENCE;
        for node in &nodes {
            loop {
                let mut c = node.connection().await;
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query_async(&mut c)
                    .await
                    .unwrap();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the cluster never became ready: {info}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Self { nodes }
    }

    /// The `store.url` value: every node, comma-separated.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}
