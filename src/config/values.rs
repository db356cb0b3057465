//! Parsers for single values of the file: durations, `${ENV}`, base URLs, failover
//! conditions, TOML into JSON.

use std::time::Duration;

use http::Uri;

use super::FailoverOn;

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

pub(super) fn parse_base_url(text: &str) -> Result<(Uri, String), String> {
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

pub(super) fn parse_failover_on(items: &[String]) -> Result<FailoverOn, String> {
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
            lower if lower.starts_with("code:") => {
                // The value is matched as written (error codes are case-sensitive).
                let value = item["code:".len()..].trim();
                if value.is_empty() {
                    return Err(format!("{item:?}: a code entry needs a value, matched against the JSON error body's /error/code or /error/type, e.g. \"code:context_length_exceeded\""));
                }
                on.codes.push(value.to_owned());
            }
            code => match code.parse::<u16>() {
                Ok(status) if (400..600).contains(&status) => on.statuses.push(status),
                _ => {
                    return Err(format!(
                        "{item:?} is not one of \"connect\", \"reset\", \"4xx\", \"5xx\", \"code:<value>\" or a status code 400-599"
                    ))
                }
            },
        }
    }
    Ok(on)
}

pub(super) fn toml_to_json(value: toml::Value, key: &str) -> Result<serde_json::Value, String> {
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

/// A credential digest as `[clients]` lists it: 64 hex digits (SHA-256), kept lowercase.
pub(super) fn parse_digest(text: &str) -> Result<String, String> {
    let digest = text.trim().to_ascii_lowercase();
    if digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(digest)
    } else {
        Err(format!(
            "{text:?} is not a SHA-256 hex digest (64 hex digits; `idemgate owner-hash` prints one)"
        ))
    }
}

/// Reads an allow file: one digest a line; blank lines and `#` comments are skipped.
pub fn read_allow_file(
    path: &std::path::Path,
) -> Result<std::collections::HashSet<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .map(|(i, line)| (i, line.trim()))
        .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
        .map(|(i, line)| {
            parse_digest(line).map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))
        })
        .collect()
}
