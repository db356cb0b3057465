//! The file's shapes as serde reads them: every key optional here, unknown keys refused.
//! What a missing key means is decided in `validate`, where the defaults live.

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) log: RawLog,
    #[serde(default)]
    pub(super) server: RawServer,
    #[serde(default)]
    pub(super) store: RawStore,
    #[serde(default)]
    pub(super) idempotency: RawIdempotency,
    #[serde(default)]
    pub(super) providers: Vec<RawProvider>,
    #[serde(default)]
    pub(super) routes: Vec<RawRoute>,
    pub(super) clients: Option<RawClients>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClients {
    pub(super) allow: Option<Vec<String>>,
    pub(super) allow_file: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    pub(super) format: Option<String>,
    pub(super) level: Option<String>,
    pub(super) buffered: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: Option<String>,
    pub(super) admin_listen: Option<String>,
    pub(super) admin_token_env: Option<String>,
    pub(super) max_body_bytes: Option<u64>,
    pub(super) max_stored_response_bytes: Option<u64>,
    pub(super) shutdown_grace: Option<String>,
    pub(super) request_header_timeout: Option<String>,
    pub(super) request_body_timeout: Option<String>,
    pub(super) idle_timeout: Option<String>,
    pub(super) max_connections: Option<u64>,
    pub(super) max_in_flight: Option<u64>,
    pub(super) max_buffered_body_bytes: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub(super) kind: Option<String>,
    pub(super) path: Option<String>,
    pub(super) url: Option<String>,
    pub(super) cluster: Option<bool>,
    pub(super) key_prefix: Option<String>,
    pub(super) pool_size: Option<u32>,
    pub(super) wait_replicas: Option<u32>,
    pub(super) on_error: Option<String>,
    pub(super) op_timeout: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawIdempotency {
    pub(super) header: Option<String>,
    pub(super) owner: Option<String>,
    pub(super) max_key_length: Option<u64>,
    pub(super) retention: Option<String>,
    pub(super) wait_for_in_flight: Option<String>,
    pub(super) lease: Option<String>,
    pub(super) late_result_window: Option<String>,
    pub(super) fingerprint_ignore: Option<Vec<String>>,
    pub(super) late_result_max: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProvider {
    pub(super) name: String,
    pub(super) base_url: String,
    pub(super) timeout: Option<String>,
    pub(super) connect_timeout: Option<String>,
    pub(super) stream_idle_timeout: Option<String>,
    #[serde(default)]
    pub(super) headers: BTreeMap<String, String>,
    #[serde(default)]
    pub(super) body_set: BTreeMap<String, toml::Value>,
    pub(super) breaker: Option<RawBreaker>,
    pub(super) forward_client_credentials: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBreaker {
    pub(super) failures: Option<u32>,
    pub(super) cool_down: Option<String>,
    pub(super) max_cool_down: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) name: String,
    pub(super) methods: Option<Vec<String>>,
    pub(super) path_prefix: Option<String>,
    pub(super) models: Option<Vec<String>>,
    pub(super) providers: Vec<String>,
    pub(super) idempotency: Option<String>,
    pub(super) failover_on: Option<Vec<String>>,
    pub(super) max_retry_after: Option<String>,
    pub(super) hedge_after: Option<String>,
    pub(super) contract: Option<RawContract>,
    pub(super) probe: Option<RawProbe>,
    pub(super) failover_requires_probe: Option<bool>,
    pub(super) probe_interval: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawContract {
    #[serde(default)]
    pub(super) json_pointers: Vec<String>,
    pub(super) schema: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProbe {
    pub(super) method: Option<String>,
    pub(super) path: Option<String>,
    #[serde(default)]
    pub(super) headers: BTreeMap<String, String>,
    pub(super) body: Option<toml::Value>,
}
