//! Configuration (SPEC §9): TOML parsed into raw serde structs that refuse unknown keys, then
//! validated into typed values. Every problem names the file, the key and what is wrong, and
//! all of them are reported at once so one edit fixes the file.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method, Uri};
use serde::Deserialize;

use crate::intent::{IgnoredPointer, OwnerMode};

/// The validated configuration of one gateway.
#[derive(Clone, Debug)]
pub struct Config {
    pub log: LogConfig,
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub idempotency: IdempotencyConfig,
    pub providers: Vec<Arc<Provider>>,
    pub routes: Vec<Arc<Route>>,
}

/// `[log]`: how the gateway writes its logs (to stderr).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A `tracing` filter: `info`, `warn`, `idemgate=debug,info`, …; `IDEMGATE_LOG` overrides it.
    pub level: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin_listen: Option<SocketAddr>,
    /// Name of the environment variable holding the admin bearer token.
    pub admin_token_env: String,
    pub max_body_bytes: usize,
    pub max_stored_response_bytes: usize,
    pub shutdown_grace: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    Embedded,
    Memory,
    Redis,
}

#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub kind: StoreKind,
    pub path: PathBuf,
    pub urls: Vec<String>,
    pub cluster: bool,
    pub key_prefix: String,
    pub pool_size: Option<u32>,
    pub wait_replicas: u32,
}

#[derive(Clone, Debug)]
pub struct IdempotencyConfig {
    pub header: HeaderName,
    pub owner: OwnerMode,
    pub max_key_length: usize,
    pub retention: Duration,
    pub wait_for_in_flight: Duration,
    pub lease: Duration,
    pub late_result_window: Duration,
    pub fingerprint_ignore: Vec<IgnoredPointer>,
}

#[derive(Clone, Debug)]
pub struct Provider {
    pub name: String,
    /// Scheme and authority the upstream requests go to.
    pub base_url: Uri,
    /// Path prefix of `base_url` without a trailing slash (`""` for none).
    pub base_path: String,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub stream_idle_timeout: Duration,
    /// Set on every upstream request, replacing the client's header of the same name.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Top-level JSON body fields overridden for this provider (e.g. its own `model` name).
    pub body_set: serde_json::Map<String, serde_json::Value>,
    pub breaker: Breaker,
}

#[derive(Clone, Copy, Debug)]
pub struct Breaker {
    pub failures: u32,
    pub cool_down: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdempotencyMode {
    Required,
    Optional,
    Off,
}

#[derive(Clone, Debug)]
pub struct Route {
    pub name: String,
    /// `None` matches every method.
    pub methods: Option<Vec<Method>>,
    pub path_prefix: String,
    pub models: Vec<glob::Pattern>,
    /// Indexes into [`Config::providers`]; a repeated index is a retry.
    pub providers: Vec<usize>,
    pub idempotency: IdempotencyMode,
    pub failover_on: FailoverOn,
    pub max_retry_after: Duration,
    pub hedge_after: Option<Duration>,
    pub contract: Option<Contract>,
    pub probe: Option<Probe>,
    pub failover_requires_probe: bool,
    pub probe_interval: Duration,
}

/// Which upstream outcomes are definite failures that move a round to its next provider.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FailoverOn {
    pub connect: bool,
    pub reset: bool,
    pub any_5xx: bool,
    pub any_4xx: bool,
    pub statuses: Vec<u16>,
}

impl FailoverOn {
    /// A 504 is never a definite failure: the provider's own timeout says nothing about
    /// whether the work ran.
    pub fn covers_status(&self, status: u16) -> bool {
        status != 504
            && (self.statuses.contains(&status)
                || (self.any_5xx && (500..600).contains(&status))
                || (self.any_4xx && (400..500).contains(&status)))
    }
}

#[derive(Clone, Debug)]
pub struct Contract {
    pub json_pointers: Vec<String>,
    pub schema: Option<Schema>,
}

/// A compiled JSON Schema a 2xx body must satisfy.
#[derive(Clone)]
pub struct Schema {
    pub path: PathBuf,
    pub validator: Arc<jsonschema::Validator>,
}

impl fmt::Debug for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Schema")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

#[derive(Clone, Debug)]
pub struct Probe {
    pub method: Method,
    pub path: Option<String>,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: serde_json::Value,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read the config file: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Syntax { path: String, message: String },
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Invalid>),
}

/// One invalid key.
#[derive(Debug)]
pub struct Invalid {
    pub path: String,
    pub key: String,
    pub reason: String,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: `{}`: {}", self.path, self.key, self.reason)
    }
}

impl Config {
    /// Reads, parses and validates a config file. Relative paths in it (a contract's
    /// schema) are taken from the file's directory.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse_in(&text, &shown, path.parent())
    }

    /// Parses and validates config text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        Self::parse_in(text, origin, None)
    }

    fn parse_in(text: &str, origin: &str, base: Option<&Path>) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            path: origin.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        let mut v = Validator {
            path: origin,
            base,
            problems: Vec::new(),
        };
        let config = v.config(raw);
        if v.problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid(v.problems))
        }
    }

    pub fn provider(&self, index: usize) -> &Arc<Provider> {
        &self.providers[index]
    }
}

// ---- raw TOML shapes -------------------------------------------------------------------

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    log: RawLog,
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    store: RawStore,
    #[serde(default)]
    idempotency: RawIdempotency,
    #[serde(default)]
    providers: Vec<RawProvider>,
    #[serde(default)]
    routes: Vec<RawRoute>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLog {
    format: Option<String>,
    level: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    admin_listen: Option<String>,
    admin_token_env: Option<String>,
    max_body_bytes: Option<u64>,
    max_stored_response_bytes: Option<u64>,
    shutdown_grace: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawStore {
    kind: Option<String>,
    path: Option<String>,
    url: Option<String>,
    cluster: Option<bool>,
    key_prefix: Option<String>,
    pool_size: Option<u32>,
    wait_replicas: Option<u32>,
    on_error: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawIdempotency {
    header: Option<String>,
    owner: Option<String>,
    max_key_length: Option<u64>,
    retention: Option<String>,
    wait_for_in_flight: Option<String>,
    lease: Option<String>,
    late_result_window: Option<String>,
    fingerprint_ignore: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProvider {
    name: String,
    base_url: String,
    timeout: Option<String>,
    connect_timeout: Option<String>,
    stream_idle_timeout: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    body_set: BTreeMap<String, toml::Value>,
    breaker: Option<RawBreaker>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBreaker {
    failures: Option<u32>,
    cool_down: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    name: String,
    methods: Option<Vec<String>>,
    path_prefix: Option<String>,
    models: Option<Vec<String>>,
    providers: Vec<String>,
    idempotency: Option<String>,
    failover_on: Option<Vec<String>>,
    max_retry_after: Option<String>,
    hedge_after: Option<String>,
    contract: Option<RawContract>,
    probe: Option<RawProbe>,
    failover_requires_probe: Option<bool>,
    probe_interval: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawContract {
    #[serde(default)]
    json_pointers: Vec<String>,
    schema: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProbe {
    method: Option<String>,
    path: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    body: Option<toml::Value>,
}

// ---- validation ------------------------------------------------------------------------

struct Validator<'a> {
    path: &'a str,
    /// Where relative paths in the file are resolved from.
    base: Option<&'a Path>,
    problems: Vec<Invalid>,
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

    fn config(&mut self, raw: RawConfig) -> Config {
        let log = self.log(raw.log);
        let server = self.server(raw.server);
        let store = self.store(raw.store);
        let idempotency = self.idempotency(raw.idempotency);
        let providers = self.providers(raw.providers);
        let routes = self.routes(raw.routes, &providers);
        Config {
            log,
            server,
            store,
            idempotency,
            providers,
            routes,
        }
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
        LogConfig { format, level }
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
            other => {
                self.bad(
                    "store.kind",
                    format!("{other:?} is not one of \"embedded\", \"memory\", \"redis\""),
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
        StoreConfig {
            kind,
            path,
            cluster: raw.cluster.unwrap_or(false) || urls.len() > 1,
            urls,
            key_prefix: raw.key_prefix.unwrap_or_else(|| "idemgate".into()),
            pool_size: raw.pool_size,
            wait_replicas: raw.wait_replicas.unwrap_or(0),
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
            "anonymous" => OwnerMode::Anonymous,
            other => {
                match other.strip_prefix("header:").map(str::trim) {
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
                        format!("{other:?} is not one of \"bearer\", \"anonymous\", \"header:<Name>\""),
                    );
                        OwnerMode::Anonymous
                    }
                }
            }
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
        let breaker = p.breaker.map_or(
            Breaker {
                failures: 5,
                cool_down: Duration::from_secs(30),
            },
            |b| Breaker {
                failures: b.failures.unwrap_or(5).max(1),
                cool_down: self.duration(
                    &format!("{at}.breaker.cool_down"),
                    b.cool_down,
                    Duration::from_secs(30),
                ),
            },
        );
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

/// Humane durations: `"250ms"`, `"10s"`, `"1m 30s"`, `"24h"`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("{text:?} is not a duration like \"250ms\", \"10s\" or \"24h\" ({e})"))
}

/// Expands `${NAME}` from the environment; an unset variable is an error, never "".
pub fn expand_env(text: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("unterminated \"${{\" in {text:?}"))?;
        let name = &after[..end];
        if name.is_empty() {
            return Err("empty variable name in \"${}\"".into());
        }
        let value =
            std::env::var(name).map_err(|_| format!("environment variable {name} is not set"))?;
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn parse_base_url(text: &str) -> Result<(Uri, String), String> {
    let uri: Uri = text
        .parse()
        .map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(format!("{text:?} must start with http:// or https://")),
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("{text:?} has no host"))?
        .clone();
    if uri.query().is_some() {
        return Err(format!("{text:?} must not carry a query"));
    }
    let base_path = uri.path().trim_end_matches('/').to_owned();
    let root = Uri::builder()
        .scheme(uri.scheme().cloned().expect("checked above"))
        .authority(authority)
        .path_and_query("/")
        .build()
        .map_err(|e| e.to_string())?;
    Ok((root, base_path))
}

fn parse_failover_on(items: &[String]) -> Result<FailoverOn, String> {
    let mut on = FailoverOn::default();
    for item in items {
        match item.to_ascii_lowercase().as_str() {
            "connect" => on.connect = true,
            "reset" => on.reset = true,
            "5xx" => on.any_5xx = true,
            "4xx" => on.any_4xx = true,
            "504" => {
                return Err("504 cannot be a definite failure: the provider timed out and the work may have run (it is treated as a timeout)".into())
            }
            code => match code.parse::<u16>() {
                Ok(status) if (400..600).contains(&status) => on.statuses.push(status),
                _ => {
                    return Err(format!(
                        "{item:?} is not one of \"connect\", \"reset\", \"4xx\", \"5xx\" or a status code 400-599"
                    ))
                }
            },
        }
    }
    Ok(on)
}

fn toml_to_json(value: toml::Value, key: &str) -> Result<serde_json::Value, String> {
    use serde_json::Value as J;
    Ok(match value {
        toml::Value::String(s) => J::String(expand_env(&s)?),
        toml::Value::Integer(i) => J::from(i),
        toml::Value::Float(f) => J::from(
            serde_json::Number::from_f64(f)
                .ok_or_else(|| format!("{key}: {f} is not a JSON number"))?,
        ),
        toml::Value::Boolean(b) => J::Bool(b),
        toml::Value::Datetime(d) => J::String(d.to_string()),
        toml::Value::Array(items) => J::Array(
            items
                .into_iter()
                .map(|v| toml_to_json(v, key))
                .collect::<Result<_, _>>()?,
        ),
        toml::Value::Table(table) => J::Object(
            table
                .into_iter()
                .map(|(k, v)| Ok((k, toml_to_json(v, key)?)))
                .collect::<Result<_, String>>()?,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        [[providers]]
        name = "p"
        base_url = "http://127.0.0.1:9/api/"
        [[routes]]
        name = "chat"
        path_prefix = "/v1"
        providers = ["p"]
    "#;

    fn errors(text: &str) -> String {
        Config::parse(text, "test.toml").unwrap_err().to_string()
    }

    #[test]
    fn defaults_follow_the_spec() {
        let c = Config::parse(MINIMAL, "test.toml").unwrap();
        assert_eq!(c.store.kind, StoreKind::Embedded);
        assert_eq!(c.store.path, PathBuf::from("data/idemgate.db"));
        assert_eq!(c.server.max_body_bytes, 10 * 1024 * 1024);
        assert_eq!(c.idempotency.header, "idempotency-key");
        assert_eq!(c.idempotency.owner, OwnerMode::Bearer);
        assert_eq!(c.idempotency.max_key_length, 255);
        assert_eq!(c.idempotency.retention, Duration::from_secs(86400));
        assert_eq!(c.idempotency.late_result_window, Duration::from_secs(600));
        let p = &c.providers[0];
        assert_eq!(p.base_url, "http://127.0.0.1:9/");
        assert_eq!(p.base_path, "/api");
        assert_eq!(p.timeout, Duration::from_secs(60));
        let r = &c.routes[0];
        assert_eq!(r.idempotency, IdempotencyMode::Required);
        assert!(r.methods.is_none());
        assert!(r.failover_on.connect && !r.failover_on.reset);
        assert!(r.failover_on.covers_status(429));
        assert!(r.failover_on.covers_status(503));
        assert!(!r.failover_on.covers_status(504));
        assert!(!r.failover_on.covers_status(400));
    }

    #[test]
    fn unknown_keys_are_refused_with_their_name() {
        let e = errors(&format!("{MINIMAL}\n[server]\nlisten_on = \"x\"\n"));
        assert!(e.starts_with("test.toml: "), "{e}");
        assert!(e.contains("listen_on"), "{e}");
    }

    #[test]
    fn every_invalid_key_is_named_with_its_reason() {
        let e = errors(
            r#"
            [idempotency]
            retention = "forever"
            owner = "cookie"
            [[providers]]
            name = "p"
            base_url = "ftp://x"
            [[routes]]
            name = "r"
            providers = ["p", "q"]
            failover_on = ["504"]
            "#,
        );
        assert!(
            e.contains("test.toml: `idempotency.retention`: \"forever\" is not a duration"),
            "{e}"
        );
        assert!(e.contains("`idempotency.owner`"), "{e}");
        assert!(e.contains("`providers[0].base_url`"), "{e}");
        assert!(
            e.contains("`routes[0].providers`: \"q\" is not a [[providers]] name"),
            "{e}"
        );
        assert!(e.contains("`routes[0].failover_on`: 504"), "{e}");
    }

    #[test]
    fn env_vars_expand_and_missing_ones_are_errors() {
        std::env::set_var("IDEMGATE_TEST_KEY", "sk-test");
        let c = Config::parse(
            &MINIMAL.replace(
                "base_url = \"http://127.0.0.1:9/api/\"",
                "base_url = \"http://127.0.0.1:9\"\nheaders = { Authorization = \"Bearer ${IDEMGATE_TEST_KEY}\" }",
            ),
            "t",
        )
        .unwrap();
        assert_eq!(c.providers[0].headers[0].1, "Bearer sk-test");
        let e = errors(&MINIMAL.replace("/api/", "/${IDEMGATE_TEST_UNSET_VAR}/"));
        assert!(
            e.contains(
                "`providers[0].base_url`: environment variable IDEMGATE_TEST_UNSET_VAR is not set"
            ),
            "{e}"
        );
    }

    #[test]
    fn failover_on_parses_classes_and_codes() {
        let on = parse_failover_on(&["connect".into(), "reset".into(), "408".into()]).unwrap();
        assert!(on.connect && on.reset);
        assert!(on.covers_status(408));
        assert!(!on.covers_status(500));
        assert!(parse_failover_on(&["teapot".into()]).is_err());
    }

    #[test]
    fn durations_are_humane() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86400)));
        assert!(parse_duration("10").is_err());
    }

    #[test]
    fn shipped_examples_are_valid() {
        std::env::set_var("OPENAI_API_KEY", "sk-example");
        std::env::set_var("OPENROUTER_API_KEY", "sk-or-example");
        std::env::set_var("ANTHROPIC_API_KEY", "sk-ant-example");
        std::env::set_var("ANTHROPIC_FALLBACK_KEY", "sk-ant-fallback");
        for file in [
            "config/openai.toml",
            "config/local.toml",
            "config/anthropic.toml",
        ] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
            Config::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}
