//! Fingerprint throughput on a 1 MiB chat body: the exact canonical form against the
//! former approach (parse into `serde_json::Value`, whose numbers are 64-bit floats and
//! whose objects keep the last duplicate, then write it sorted), in one run; then reading
//! the body's `model` for a route that matches by model, against parsing it into a `Value`.
//!
//! `cargo bench --bench fingerprint`

// A bench times real work on the real clock: paused time has no place here.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// A chat request of about 1 MiB: many messages of prose, numbers and escapes.
fn chat_body() -> Vec<u8> {
    let mut messages = Vec::new();
    let mut size = 0;
    let mut i = 0u64;
    while size < 1024 * 1024 {
        let content = format!(
            "Message {i}: the quick brown fox \\u00e9 jumps over {} lazy dogs; \\\"quoted\\\" text, tab\\t and more words to make it realistic.",
            i * 7919
        );
        let message = format!(
            r#"{{"role":"{}","content":"{content}","weight":{}.{},"id":{i}}}"#,
            if i % 2 == 0 { "user" } else { "assistant" },
            i % 97,
            i % 13
        );
        size += message.len() + 1;
        messages.push(message);
        i += 1;
    }
    format!(
        r#"{{"model":"gpt-4o-mini","temperature":0.7,"max_tokens":1024,"messages":[{}]}}"#,
        messages.join(",")
    )
    .into_bytes()
}

fn former(body: &[u8]) -> String {
    fn write(value: &serde_json::Value, out: &mut Vec<u8>) {
        use std::io::Write;
        match value {
            serde_json::Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                out.push(b'{');
                for (i, (k, v)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    serde_json::to_writer(&mut *out, k).unwrap();
                    out.push(b':');
                    write(v, out);
                }
                out.push(b'}');
            }
            serde_json::Value::Array(items) => {
                out.push(b'[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write(v, out);
                }
                out.push(b']');
            }
            scalar => {
                let _ = write!(out, "{scalar}");
            }
        }
    }
    let value: serde_json::Value = serde_json::from_slice(body).unwrap();
    let mut canonical = Vec::with_capacity(body.len());
    write(&value, &mut canonical);
    hex::encode(Sha256::digest(&canonical))
}

fn measure(name: &str, body: &[u8], f: impl Fn(&[u8]) -> String) -> f64 {
    // Warm up, then as many rounds as fit in two seconds.
    black_box(f(body));
    let started = Instant::now();
    let mut rounds = 0u32;
    while started.elapsed() < Duration::from_secs(2) {
        black_box(f(black_box(body)));
        rounds += 1;
    }
    let per_round = started.elapsed() / rounds;
    let mb_s = body.len() as f64 / per_round.as_secs_f64() / 1e6;
    println!(
        "{name:<40} {:>8.2} ms per body  {mb_s:>8.1} MB/s",
        per_round.as_secs_f64() * 1e3
    );
    mb_s
}

fn main() {
    let body = chat_body();
    println!("fingerprint of a {} byte chat body", body.len());
    let before = measure("former (serde_json Value, sorted)", &body, former);
    let exact = measure("exact canonical form (idemgate)", &body, |b| {
        idemgate::intent::fingerprint("POST", "/v1/chat/completions", b, &[])
    });
    let raw = measure("raw SHA-256 of the bytes (floor)", &body, |b| {
        hex::encode(Sha256::digest(b))
    });
    println!(
        "exact / former = {:.2}x; exact / raw SHA-256 = {:.2}x",
        exact / before,
        exact / raw
    );
    // What a route that matches by model reads of every request it could take.
    let parsed = measure("model, parsed into a Value", &body, |b| {
        let value: serde_json::Value = serde_json::from_slice(b).unwrap();
        value["model"].as_str().unwrap().to_owned()
    });
    let skipped = measure("model, the rest skipped (idemgate)", &body, |b| {
        idemgate::gateway::model::model_of(b).unwrap().into_owned()
    });
    println!("model skipped / parsed = {:.2}x", skipped / parsed);
}
