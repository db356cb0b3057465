//! Raw shapes into typed config: every default, every check, every problem named with its
//! key, all reported at once.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method};

use super::raw::*;
use super::values::*;
use super::*;
use crate::intent::{IgnoredPointer, OwnerMode};

pub(super) struct Validator<'a> {
    pub(super) path: &'a str,
    /// Where relative paths in the file are resolved from.
    pub(super) base: Option<&'a Path>,
    pub(super) problems: Vec<Invalid>,
}

const MIB: u64 = 1024 * 1024;

impl Validator<'_> {
    fn bad(&mut self, key: impl Into<String>, reason: impl Into<String>) {
        self.problems.push(Invalid {
            path: self.path.to_owned(),
            key: key.into(),
            reason: reason.into(),
        });
    }

    /// Records the error and returns the fallback, so validation goes on and reports all.
    fn check<T>(&mut self, key: &str, result: Result<T, String>, fallback: T) -> T {
        result.unwrap_or_else(|reason| {
            self.bad(key, reason);
            fallback
        })
    }

    fn duration(&mut self, key: &str, value: Option<String>, default: Duration) -> Duration {
        match value {
            None => default,
            Some(text) => self.check(key, parse_duration(&text), default),
        }
    }

    fn expand(&mut self, key: &str, value: &str) -> String {
        self.check(key, expand_env(value), String::new())
    }

    fn addr(&mut self, key: &str, value: &str) -> SocketAddr {
        let parsed = value
            .parse()
            .map_err(|_| format!("{value:?} is not an address like \"127.0.0.1:8080\""));
        self.check(key, parsed, SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    pub(super) fn config(&mut self, raw: RawConfig) -> Config {
        let log = self.log(raw.log);
        let server = self.server(raw.server);
        let store = self.store(raw.store);
        let idempotency = self.idempotency(raw.idempotency);
        let providers = self.providers(raw.providers);
        let routes = self.routes(raw.routes, &providers);
        let clients = raw.clients.map(|c| self.clients(c, &idempotency.owner));
        Config {
            log,
            server,
            store,
            idempotency,
            providers,
            routes,
            clients,
        }
    }

    fn clients(&mut self, raw: RawClients, owner: &OwnerMode) -> ClientsConfig {
        if *owner == OwnerMode::Anonymous {
            self.bad(
                "clients",
                "needs an owner mode that reads a credential (\"bearer\", \"api-key\" or \"header:<Name>\"), not \"anonymous\"",
            );
        }
        let mut allow = std::collections::HashSet::new();
        for (i, digest) in raw.allow.unwrap_or_default().into_iter().enumerate() {
            match parse_digest(&digest) {
                Ok(d) => {
                    allow.insert(d);
                }
                Err(e) => self.bad(format!("clients.allow[{i}]"), e),
            }
        }
        let allow_file = raw.allow_file.map(|f| {
            let path = PathBuf::from(self.expand("clients.allow_file", &f));
            let path = match self.base {
                Some(base) if path.is_relative() => base.join(path),
                _ => path,
            };
            if let Err(e) = read_allow_file(&path) {
                self.bad("clients.allow_file", e);
            }
            path
        });
        ClientsConfig { allow, allow_file }
    }

    fn log(&mut self, raw: RawLog) -> LogConfig {
        let format = match raw.format.as_deref().unwrap_or("text") {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                self.bad(
                    "log.format",
                    format!("{other:?} is not one of \"text\", \"json\""),
                );
                LogFormat::Text
            }
        };
        let level = raw.level.unwrap_or_else(|| "info".into());
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&level) {
            self.bad(
                "log.level",
                format!(
                    "{level:?} is not a log filter like \"info\" or \"idemgate=debug,warn\": {e}"
                ),
            );
        }
        LogConfig {
            format,
            level,
            buffered: raw.buffered.unwrap_or(true),
        }
    }

    fn server(&mut self, raw: RawServer) -> ServerConfig {
        let listen = raw.listen.as_deref().unwrap_or("127.0.0.1:8080");
        let listen = self.addr("server.listen", listen);
        let admin_listen = raw
            .admin_listen
            .map(|a| self.addr("server.admin_listen", &a));
        let max_body_bytes = self.size("server.max_body_bytes", raw.max_body_bytes);
        let max_stored = self.size(
            "server.max_stored_response_bytes",
            raw.max_stored_response_bytes,
        );
        ServerConfig {
            listen,
            admin_listen,
            admin_token_env: raw
                .admin_token_env
                .unwrap_or_else(|| "IDEMGATE_ADMIN_TOKEN".into()),
            max_body_bytes,
            max_stored_response_bytes: max_stored,
            shutdown_grace: self.duration(
                "server.shutdown_grace",
                raw.shutdown_grace,
                Duration::from_secs(30),
            ),
            request_header_timeout: self.positive(
                "server.request_header_timeout",
                raw.request_header_timeout,
                Duration::from_secs(10),
            ),
            request_body_timeout: self.positive(
                "server.request_body_timeout",
                raw.request_body_timeout,
                Duration::from_secs(60),
            ),
            idle_timeout: self.positive(
                "server.idle_timeout",
                raw.idle_timeout,
                Duration::from_secs(60),
            ),
            max_connections: self.count("server.max_connections", raw.max_connections, 10_000),
            max_in_flight: self.count("server.max_in_flight", raw.max_in_flight, 4096),
            max_buffered_body_bytes: self.count(
                "server.max_buffered_body_bytes",
                raw.max_buffered_body_bytes,
                1024 * MIB,
            ),
        }
    }

    fn positive(&mut self, key: &str, value: Option<String>, default: Duration) -> Duration {
        let d = self.duration(key, value, default);
        if d.is_zero() {
            self.bad(key, "must be greater than 0");
            return default;
        }
        d
    }

    fn count(&mut self, key: &str, value: Option<u64>, default: u64) -> usize {
        match value {
            Some(0) => {
                self.bad(key, "must be greater than 0");
                1
            }
            v => usize::try_from(v.unwrap_or(default)).unwrap_or(usize::MAX),
        }
    }

    fn size(&mut self, key: &str, value: Option<u64>) -> usize {
        match value {
            None => (10 * MIB) as usize,
            Some(0) => {
                self.bad(key, "must be greater than 0");
                1
            }
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        }
    }

    fn store(&mut self, raw: RawStore) -> StoreConfig {
        let kind = match raw.kind.as_deref().unwrap_or("embedded") {
            "embedded" => StoreKind::Embedded,
            "memory" => StoreKind::Memory,
            "redis" => StoreKind::Redis,
            "postgres" => StoreKind::Postgres,
            other => {
                self.bad(
                    "store.kind",
                    format!(
                        "{other:?} is not one of \"embedded\", \"memory\", \"redis\", \"postgres\""
                    ),
                );
                StoreKind::Memory
            }
        };
        if let Some(on_error) = raw.on_error.as_deref() {
            if on_error != "fail_closed" {
                self.bad(
                    "store.on_error",
                    format!("{on_error:?} is not supported: only \"fail_closed\" (a store failure never lets a request reach a provider unclaimed)"),
                );
            }
        }
        let path = raw.path.as_deref().unwrap_or("data/idemgate.db");
        let path = PathBuf::from(self.expand("store.path", path));
        let urls: Vec<String> = match raw.url.as_deref() {
            None => Vec::new(),
            Some(url) => self
                .expand("store.url", url)
                .split(',')
                .map(|u| u.trim().to_owned())
                .filter(|u| !u.is_empty())
                .collect(),
        };
        if kind == StoreKind::Redis && urls.is_empty() {
            self.bad("store.url", "required when store.kind = \"redis\"");
        }
        if kind == StoreKind::Postgres {
            match urls.as_slice() {
                [] => self.bad("store.url", "required when store.kind = \"postgres\""),
                [url] if url.starts_with("postgres://") || url.starts_with("postgresql://") => {}
                [_] => self.bad(
                    "store.url",
                    "must be a postgres:// or postgresql:// URL when store.kind = \"postgres\"",
                ),
                _ => self.bad(
                    "store.url",
                    "one database only when store.kind = \"postgres\"",
                ),
            }
            if raw.pool_size == Some(0) {
                self.bad("store.pool_size", "must be greater than 0");
            }
        }
        StoreConfig {
            kind,
            path,
            cluster: raw.cluster.unwrap_or(false) || urls.len() > 1,
            urls,
            key_prefix: raw.key_prefix.unwrap_or_else(|| "idemgate".into()),
            pool_size: raw.pool_size,
            wait_replicas: raw.wait_replicas.unwrap_or(0),
            op_timeout: self.positive("store.op_timeout", raw.op_timeout, Duration::from_secs(2)),
        }
    }

    fn idempotency(&mut self, raw: RawIdempotency) -> IdempotencyConfig {
        let header = raw.header.as_deref().unwrap_or("Idempotency-Key");
        let header = self.check(
            "idempotency.header",
            HeaderName::from_bytes(header.as_bytes())
                .map_err(|_| format!("{header:?} is not a valid header name")),
            HeaderName::from_static("idempotency-key"),
        );
        let owner = match raw.owner.as_deref().unwrap_or("bearer") {
            "bearer" => OwnerMode::Bearer,
            "api-key" => OwnerMode::ApiKey,
            "anonymous" => OwnerMode::Anonymous,
            other => match other.strip_prefix("header:").map(str::trim) {
                Some(name) => match HeaderName::from_bytes(name.as_bytes()) {
                    Ok(name) => OwnerMode::Header(name),
                    Err(_) => {
                        self.bad(
                            "idempotency.owner",
                            format!("{name:?} is not a valid header name"),
                        );
                        OwnerMode::Anonymous
                    }
                },
                None => {
                    self.bad(
                        "idempotency.owner",
                        format!("{other:?} is not one of \"bearer\", \"api-key\", \"anonymous\", \"header:<Name>\""),
                    );
                    OwnerMode::Anonymous
                }
            },
        };
        let max_key_length = match raw.max_key_length {
            Some(0) => {
                self.bad("idempotency.max_key_length", "must be greater than 0");
                255
            }
            Some(n) => n as usize,
            None => 255,
        };
        let fingerprint_ignore = raw
            .fingerprint_ignore
            .unwrap_or_default()
            .iter()
            .filter_map(|p| {
                IgnoredPointer::parse(p)
                    .map_err(|e| self.bad("idempotency.fingerprint_ignore", e))
                    .ok()
            })
            .collect();
        let lease = self.duration("idempotency.lease", raw.lease, Duration::from_secs(30));
        if lease < Duration::from_millis(100) {
            self.bad("idempotency.lease", "must be at least 100ms");
        }
        let credential_headers = IdempotencyConfig::credential_headers_for(&owner);
        IdempotencyConfig {
            header,
            owner,
            max_key_length,
            retention: self.duration(
                "idempotency.retention",
                raw.retention,
                Duration::from_secs(24 * 3600),
            ),
            wait_for_in_flight: self.duration(
                "idempotency.wait_for_in_flight",
                raw.wait_for_in_flight,
                Duration::from_secs(30),
            ),
            lease,
            late_result_window: self.duration(
                "idempotency.late_result_window",
                raw.late_result_window,
                Duration::from_secs(600),
            ),
            fingerprint_ignore,
            late_result_max: self.count("idempotency.late_result_max", raw.late_result_max, 1024),
            credential_headers,
        }
    }

    fn providers(&mut self, raw: Vec<RawProvider>) -> Vec<Arc<Provider>> {
        if raw.is_empty() {
            self.bad("providers", "at least one [[providers]] entry is required");
        }
        let mut seen = HashSet::new();
        raw.into_iter()
            .enumerate()
            .map(|(i, p)| {
                let at = format!("providers[{i}]");
                if !seen.insert(p.name.clone()) {
                    self.bad(
                        format!("{at}.name"),
                        format!("{:?} is defined twice", p.name),
                    );
                }
                Arc::new(self.provider(&at, p))
            })
            .collect()
    }

    fn provider(&mut self, at: &str, p: RawProvider) -> Provider {
        let base = self.expand(&format!("{at}.base_url"), &p.base_url);
        let (base_url, base_path) = self.check(
            &format!("{at}.base_url"),
            parse_base_url(&base),
            (Uri::from_static("http://invalid"), String::new()),
        );
        let headers = p
            .headers
            .iter()
            .filter_map(|(name, value)| {
                let key = format!("{at}.headers.{name}");
                let value = self.expand(&key, value);
                let parsed = HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| format!("{name:?} is not a valid header name"))
                    .and_then(|n| {
                        HeaderValue::from_str(&value)
                            .map(|v| (n, v))
                            .map_err(|_| "the value is not a valid header value".to_owned())
                    });
                parsed.map_err(|reason| self.bad(key, reason)).ok()
            })
            .collect();
        let body_set = p
            .body_set
            .into_iter()
            .map(|(k, v)| {
                let key = format!("{at}.body_set.{k}");
                let json = self.check(&key, toml_to_json(v, &key), serde_json::Value::Null);
                (k, json)
            })
            .collect();
        let breaker = match p.breaker {
            None => Breaker::default(),
            Some(b) => {
                let defaults = Breaker::default();
                let cool_down = self.positive(
                    &format!("{at}.breaker.cool_down"),
                    b.cool_down,
                    defaults.cool_down,
                );
                let max_cool_down = self.positive(
                    &format!("{at}.breaker.max_cool_down"),
                    b.max_cool_down,
                    defaults.max_cool_down.max(cool_down),
                );
                if max_cool_down < cool_down {
                    self.bad(
                        format!("{at}.breaker.max_cool_down"),
                        "must be at least cool_down: the cool-down doubles from cool_down up to it",
                    );
                }
                Breaker {
                    failures: b.failures.unwrap_or(defaults.failures).max(1),
                    cool_down,
                    max_cool_down: max_cool_down.max(cool_down),
                }
            }
        };
        Provider {
            timeout: self.duration(&format!("{at}.timeout"), p.timeout, Duration::from_secs(60)),
            connect_timeout: self.duration(
                &format!("{at}.connect_timeout"),
                p.connect_timeout,
                Duration::from_secs(5),
            ),
            stream_idle_timeout: self.duration(
                &format!("{at}.stream_idle_timeout"),
                p.stream_idle_timeout,
                Duration::from_secs(30),
            ),
            name: p.name,
            base_url,
            base_path,
            headers,
            body_set,
            breaker,
            forward_client_credentials: p.forward_client_credentials.unwrap_or(false),
        }
    }

    fn routes(&mut self, raw: Vec<RawRoute>, providers: &[Arc<Provider>]) -> Vec<Arc<Route>> {
        if raw.is_empty() {
            self.bad("routes", "at least one [[routes]] entry is required");
        }
        let mut seen = HashSet::new();
        raw.into_iter()
            .enumerate()
            .map(|(i, r)| {
                let at = format!("routes[{i}]");
                if !seen.insert(r.name.clone()) {
                    self.bad(
                        format!("{at}.name"),
                        format!("{:?} is defined twice", r.name),
                    );
                }
                Arc::new(self.route(&at, r, providers))
            })
            .collect()
    }

    fn route(&mut self, at: &str, r: RawRoute, providers: &[Arc<Provider>]) -> Route {
        let methods = r.methods.map(|methods| {
            methods
                .iter()
                .filter_map(|m| {
                    Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                        .map_err(|_| {
                            self.bad(
                                format!("{at}.methods"),
                                format!("{m:?} is not an HTTP method"),
                            )
                        })
                        .ok()
                })
                .collect()
        });
        let path_prefix = r.path_prefix.unwrap_or_else(|| "/".into());
        if !path_prefix.starts_with('/') {
            self.bad(format!("{at}.path_prefix"), "must start with '/'");
        }
        let models = r
            .models
            .unwrap_or_default()
            .iter()
            .filter_map(|m| {
                glob::Pattern::new(m)
                    .map_err(|e| self.bad(format!("{at}.models"), format!("{m:?}: {e}")))
                    .ok()
            })
            .collect();
        if r.providers.is_empty() {
            self.bad(format!("{at}.providers"), "must name at least one provider");
        }
        let route_providers = r
            .providers
            .iter()
            .filter_map(|name| {
                let found = providers.iter().position(|p| &p.name == name);
                if found.is_none() {
                    self.bad(
                        format!("{at}.providers"),
                        format!("{name:?} is not a [[providers]] name"),
                    );
                }
                found
            })
            .collect();
        let idempotency = match r.idempotency.as_deref().unwrap_or("required") {
            "required" => IdempotencyMode::Required,
            "optional" => IdempotencyMode::Optional,
            "off" => IdempotencyMode::Off,
            other => {
                self.bad(
                    format!("{at}.idempotency"),
                    format!("{other:?} is not one of \"required\", \"optional\", \"off\""),
                );
                IdempotencyMode::Required
            }
        };
        let failover_on = match r.failover_on {
            None => FailoverOn {
                connect: true,
                any_5xx: true,
                statuses: vec![429],
                ..FailoverOn::default()
            },
            Some(items) => {
                let key = format!("{at}.failover_on");
                let parsed = parse_failover_on(&items);
                self.check(&key, parsed, FailoverOn::default())
            }
        };
        let hedge_after = r.hedge_after.map(|h| {
            self.duration(
                &format!("{at}.hedge_after"),
                Some(h),
                Duration::from_secs(10),
            )
        });
        let contract = r.contract.map(|c| {
            for p in &c.json_pointers {
                if !p.is_empty() && !p.starts_with('/') {
                    self.bad(
                        format!("{at}.contract.json_pointers"),
                        format!("{p:?} is not a JSON pointer (it must start with '/')"),
                    );
                }
            }
            let schema = c.schema.and_then(|file| {
                let key = format!("{at}.contract.schema");
                let loaded = self.schema(&file);
                loaded.map_err(|reason| self.bad(key, reason)).ok()
            });
            Contract {
                json_pointers: c.json_pointers,
                schema,
            }
        });
        let probe = r.probe.map(|p| self.probe(at, p));
        let failover_requires_probe = r.failover_requires_probe.unwrap_or(false);
        if failover_requires_probe && probe.is_none() {
            self.bad(
                format!("{at}.failover_requires_probe"),
                "needs a [routes.probe] request to prove the fallbacks with",
            );
        }
        Route {
            max_retry_after: self.duration(
                &format!("{at}.max_retry_after"),
                r.max_retry_after,
                Duration::from_secs(5),
            ),
            probe_interval: self.duration(
                &format!("{at}.probe_interval"),
                r.probe_interval,
                Duration::from_secs(300),
            ),
            name: r.name,
            methods,
            path_prefix,
            models,
            providers: route_providers,
            idempotency,
            failover_on,
            hedge_after,
            contract,
            probe,
            failover_requires_probe,
        }
    }

    fn schema(&self, file: &str) -> Result<Schema, String> {
        let path = match self.base {
            Some(base) if Path::new(file).is_relative() => base.join(file),
            _ => PathBuf::from(file),
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
        let validator = jsonschema::validator_for(&json)
            .map_err(|e| format!("{} is not a valid JSON Schema: {e}", path.display()))?;
        Ok(Schema {
            path,
            validator: Arc::new(validator),
        })
    }

    fn probe(&mut self, at: &str, p: RawProbe) -> Probe {
        let method = p.method.as_deref().unwrap_or("POST");
        let method = self.check(
            &format!("{at}.probe.method"),
            Method::from_bytes(method.as_bytes())
                .map_err(|_| format!("{method:?} is not an HTTP method")),
            Method::POST,
        );
        let headers = p
            .headers
            .iter()
            .filter_map(|(n, v)| {
                let key = format!("{at}.probe.headers.{n}");
                let v = self.expand(&key, v);
                match (
                    HeaderName::from_bytes(n.as_bytes()),
                    HeaderValue::from_str(&v),
                ) {
                    (Ok(n), Ok(v)) => Some((n, v)),
                    _ => {
                        self.bad(key, "not a valid header");
                        None
                    }
                }
            })
            .collect();
        let body = match p.body {
            None => serde_json::Value::Null,
            Some(toml::Value::String(s)) => {
                let key = format!("{at}.probe.body");
                let parsed = serde_json::from_str(&s).map_err(|e| format!("not JSON: {e}"));
                self.check(&key, parsed, serde_json::Value::Null)
            }
            Some(v) => {
                let key = format!("{at}.probe.body");
                self.check(&key.clone(), toml_to_json(v, &key), serde_json::Value::Null)
            }
        };
        Probe {
            method,
            path: p.path,
            headers,
            body,
        }
    }
}
