//! The store conformance suite, run against every store: memory, embedded, Redis standalone
//! a 3-master Redis Cluster (real `redis-server` processes the harness starts itself) and
//! PostgreSQL (a real server from `initdb`, a fresh database per case).

mod common;
mod conformance;
mod faults;

use std::sync::Arc;

use common::redis_server::{RedisCluster, RedisServer};
use idemgate::config::{StoreConfig, StoreKind};
use idemgate::store::embedded::EmbeddedStore;
use idemgate::store::memory::MemoryStore;
use idemgate::store::postgres::PostgresStore;
use idemgate::store::redis::RedisStore;
use idemgate::store::JobStore;

fn redis_config(urls: Vec<String>, cluster: bool) -> StoreConfig {
    StoreConfig {
        kind: StoreKind::Redis,
        path: Default::default(),
        urls,
        cluster,
        key_prefix: "idemgate-test".into(),
        pool_size: None,
        wait_replicas: 0,
        op_timeout: std::time::Duration::from_secs(2),
    }
}

conformance_suite!(memory, || async {
    let store = Arc::new(MemoryStore::new(conformance::POLICY)) as Arc<dyn JobStore>;
    (store, ())
});

conformance_suite!(embedded, || async {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(&dir.path().join("jobs.db"), conformance::POLICY).unwrap();
    (Arc::new(store) as Arc<dyn JobStore>, dir)
});

conformance_suite!(redis_standalone, || async {
    let server = RedisServer::start().await;
    let store = RedisStore::open(
        &redis_config(vec![server.url()], false),
        conformance::POLICY,
    )
    .await
    .unwrap();
    (Arc::new(store) as Arc<dyn JobStore>, server)
});

conformance_suite!(redis_cluster, || async {
    let cluster = RedisCluster::start().await;
    let store = RedisStore::open(&redis_config(cluster.urls(), true), conformance::POLICY)
        .await
        .unwrap();
    (Arc::new(store) as Arc<dyn JobStore>, cluster)
});

conformance_suite!(postgres, || async {
    let url = common::pg_server::shared().database().await;
    let store = PostgresStore::open(
        &common::pg_server::store_config(&url, 8),
        conformance::POLICY,
    )
    .await
    .unwrap();
    (Arc::new(store) as Arc<dyn JobStore>, ())
});
