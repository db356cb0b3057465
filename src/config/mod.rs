//! Configuration (SPEC §9): TOML parsed into raw serde structs that refuse unknown keys, then
//! validated into typed values. Every problem names the file, the key and what is wrong, and
//! all of them are reported at once so one edit fixes the file.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method, Uri};

use crate::intent::{IgnoredPointer, OwnerMode};

mod raw;
mod validate;
mod values;

use self::raw::RawConfig;
use self::validate::Validator;
pub use self::values::{expand_env, parse_duration, read_allow_file};

/// The validated configuration of one gateway.
#[derive(Clone, Debug)]
pub struct Config {
    pub log: LogConfig,
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub idempotency: IdempotencyConfig,
    pub providers: Vec<Arc<Provider>>,
    pub routes: Vec<Arc<Route>>,
    /// `[clients]`: who may use the gateway at all (SPEC §11); `None` when not configured.
    pub clients: Option<ClientsConfig>,
}

/// `[clients]`: the SHA-256 digests of the credentials allowed to use the gateway.
#[derive(Clone, Debug)]
pub struct ClientsConfig {
    pub allow: std::collections::HashSet<String>,
    /// One digest a line, re-read on SIGHUP.
    pub allow_file: Option<PathBuf>,
}

/// `[log]`: how the gateway writes its logs (to stderr).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A `tracing` filter: `info`, `warn`, `idemgate=debug,info`, …; `IDEMGATE_LOG` overrides it.
    pub level: String,
    /// A busy worker thread keeps the lines after its first and writes them in one call when
    /// it runs out of work; `false`: one write each, before the answer it describes
    /// (`logsink`).
    pub buffered: bool,
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
    pub request_header_timeout: Duration,
    pub request_body_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub max_in_flight: usize,
    pub max_buffered_body_bytes: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    Embedded,
    Memory,
    Redis,
    Postgres,
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
    /// A store operation slower than this counts as the store failing.
    pub op_timeout: Duration,
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
    /// At most this many timed-out calls are kept waiting for a late answer at once.
    pub late_result_max: usize,
    /// The client headers that carry credentials, the owner header among them: never sent
    /// to a provider unless it forwards client credentials (SPEC §11). Worked out once
    /// here, shared by every request.
    pub credential_headers: Arc<[HeaderName]>,
}

impl IdempotencyConfig {
    /// The credential headers for an owner mode.
    pub(crate) fn credential_headers_for(owner: &OwnerMode) -> Arc<[HeaderName]> {
        let mut names = vec![
            http::header::AUTHORIZATION,
            http::header::PROXY_AUTHORIZATION,
            HeaderName::from_static("x-api-key"),
            HeaderName::from_static("api-key"),
        ];
        if let OwnerMode::Header(name) = owner {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        names.into()
    }
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
    /// Bring-your-own-key: the client's credentials go to this provider (SPEC §11).
    pub forward_client_credentials: bool,
}

/// `breaker = { failures, cool_down, max_cool_down }` (SPEC §4).
#[derive(Clone, Copy, Debug)]
pub struct Breaker {
    /// Definite failures in a row that open the breaker.
    pub failures: u32,
    /// The first cool-down; it doubles each time the breaker re-opens without a success.
    pub cool_down: Duration,
    pub max_cool_down: Duration,
}

impl Default for Breaker {
    fn default() -> Self {
        Self {
            failures: 5,
            cool_down: Duration::from_secs(2),
            max_cool_down: Duration::from_secs(60),
        }
    }
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
    /// `code:<value>`: an error answer whose JSON body has this value at `/error/code` or
    /// `/error/type` (the provider refused the request, so nothing ran).
    pub codes: Vec<String>,
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

    /// The `code:` entry an error answer's body matches, if any.
    pub fn covered_code(&self, status: u16, body: &[u8]) -> Option<&str> {
        if self.codes.is_empty() || !(400..600).contains(&status) || status == 504 {
            return None;
        }
        let json: serde_json::Value = serde_json::from_slice(body).ok()?;
        let error = json.get("error")?;
        let found: Vec<&str> = ["code", "type"]
            .iter()
            .filter_map(|field| error.get(*field).and_then(|v| v.as_str()))
            .collect();
        self.codes
            .iter()
            .find(|code| found.contains(&code.as_str()))
            .map(String::as_str)
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

#[cfg(test)]
mod tests {
    use super::values::parse_failover_on;
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
        assert_eq!(c.log.format, LogFormat::Text);
        assert_eq!(c.log.level, "info");
        assert!(c.log.buffered);
    }

    #[test]
    fn the_log_can_write_each_line_before_its_answer() {
        let c = Config::parse(
            &format!("{MINIMAL}\n[log]\nbuffered = false\n"),
            "test.toml",
        )
        .unwrap();
        assert!(!c.log.buffered);
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
