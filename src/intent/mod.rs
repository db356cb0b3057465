//! Identity and intent: who owns a key (the owner), which intent it names (the key) and what
//! the intent is (the fingerprint), SPEC §3 steps 2–5.

mod canonical;
mod multipart;

use http::HeaderMap;
use sha2::{Digest, Sha256};

/// How the owner of a request is determined (`idempotency.owner`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnerMode {
    /// SHA-256 of the `Authorization` header value.
    Bearer,
    /// SHA-256 of the client's API key, from `Authorization: Bearer …`, `X-Api-Key` or
    /// `api-key`: what the OpenAI, Anthropic and Azure SDKs send.
    ApiKey,
    /// SHA-256 of a header set by an auth layer in front of the gateway.
    Header(http::HeaderName),
    /// One shared owner.
    Anonymous,
}

/// The owner recorded for every request in `anonymous` mode.
pub const ANONYMOUS_OWNER: &str = "anonymous";

/// A key that was present but malformed (SPEC §3 step 3).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the idempotency key is empty")]
    Empty,
    #[error("the idempotency key is longer than {max} characters")]
    TooLong { max: usize },
    #[error("the idempotency key must be visible ASCII (no spaces or control characters)")]
    NotVisibleAscii,
    #[error("the idempotency key header appears more than once")]
    Repeated,
    #[error("the quoted idempotency key is not a valid structured-field string")]
    BadQuoting,
}

/// Why a request has no usable owner.
#[derive(Debug, PartialEq, Eq)]
pub enum OwnerError {
    /// No credential (or owner header) at all.
    Missing,
    /// An owner header sent twice, or two credentials that differ: never "first one wins".
    Ambiguous(&'static str),
}

/// The owner's identity as stored: a hex SHA-256 of the credential as its mode reads it
/// (never the raw credential), or [`ANONYMOUS_OWNER`].
pub fn owner(mode: &OwnerMode, headers: &HeaderMap) -> Result<String, OwnerError> {
    let credential = match mode {
        OwnerMode::Anonymous => return Ok(ANONYMOUS_OWNER.to_owned()),
        OwnerMode::Bearer => single(headers, &http::header::AUTHORIZATION)?,
        OwnerMode::Header(name) => single(headers, name)?,
        OwnerMode::ApiKey => api_key(headers)?,
    };
    let credential = credential.ok_or(OwnerError::Missing)?;
    Ok(digest(credential))
}

/// The hex SHA-256 of a credential: the owner, and what `[clients]` lists.
pub fn digest(credential: &[u8]) -> String {
    crate::job::hex_of(&Sha256::digest(credential).into())
}

/// The one value of `name`, `None` when absent or blank.
fn single<'h>(
    headers: &'h HeaderMap,
    name: &http::HeaderName,
) -> Result<Option<&'h [u8]>, OwnerError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(OwnerError::Ambiguous(
            "the owner's header appears more than once",
        ));
    }
    let value = value.as_bytes();
    Ok((!value.iter().all(u8::is_ascii_whitespace)).then_some(value))
}

/// The API key in whichever of its headers the SDK used; the same key in two of them is one
/// credential, two different keys are refused.
fn api_key(headers: &HeaderMap) -> Result<Option<&[u8]>, OwnerError> {
    let bearer = single(headers, &http::header::AUTHORIZATION)?.map(|value| {
        let text = value.trim_ascii();
        match text.get(..7) {
            Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => text[7..].trim_ascii(),
            _ => text,
        }
    });
    let mut found: Option<&[u8]> = None;
    for candidate in [
        bearer,
        single(headers, &http::HeaderName::from_static("x-api-key"))?.map(<[u8]>::trim_ascii),
        single(headers, &http::HeaderName::from_static("api-key"))?.map(<[u8]>::trim_ascii),
    ]
    .into_iter()
    .flatten()
    .filter(|c| !c.is_empty())
    {
        match found {
            Some(seen) if seen != candidate => {
                return Err(OwnerError::Ambiguous(
                    "the request carries two different credentials",
                ))
            }
            _ => found = Some(candidate),
        }
    }
    Ok(found)
}

/// Reads the idempotency key: `Ok(None)` when absent, the key text when valid. The bare form
/// and the Structured-Fields string form (`"..."`) name the same key.
pub fn key(
    headers: &HeaderMap,
    name: &http::HeaderName,
    max_len: usize,
) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(raw) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    let raw = raw.as_bytes();
    let text = match raw {
        [b'"', inner @ .., b'"'] => unquote(inner)?,
        [b'"', ..] => return Err(KeyError::BadQuoting),
        _ => raw.to_vec(),
    };
    if text.is_empty() {
        return Err(KeyError::Empty);
    }
    if !text.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::NotVisibleAscii);
    }
    if text.len() > max_len {
        return Err(KeyError::TooLong { max: max_len });
    }
    Ok(Some(
        String::from_utf8(text).expect("visible ASCII is UTF-8"),
    ))
}

/// RFC 8941 sf-string: `\"` and `\\` are the only escapes; a bare `"` ends the string.
fn unquote(inner: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::BadQuoting),
            },
            b'"' => return Err(KeyError::BadQuoting),
            _ => out.push(b),
        }
    }
    Ok(out)
}

/// A JSON Pointer (RFC 6901) to drop from the body before fingerprinting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IgnoredPointer(Vec<String>);

impl IgnoredPointer {
    pub fn parse(pointer: &str) -> Result<Self, String> {
        let rest = pointer
            .strip_prefix('/')
            .ok_or_else(|| format!("JSON pointer {pointer:?} must start with '/'"))?;
        Ok(Self(
            rest.split('/')
                .map(|t| t.replace("~1", "/").replace("~0", "~"))
                .collect(),
        ))
    }
}

/// SHA-256 (hex) of the intent: method, path and query, and the body — its canonical JSON
/// form when it is one JSON value (with `ignore` pointers removed), its parts when it is a
/// `multipart/form-data` form, its raw bytes otherwise (SPEC §3 step 5).
pub fn fingerprint(
    method: &str,
    path_and_query: &str,
    body: &[u8],
    ignore: &[IgnoredPointer],
) -> String {
    fingerprint_of(method, path_and_query, None, body, ignore)
}

/// [`fingerprint`] for a body of this `Content-Type`.
pub fn fingerprint_of(
    method: &str,
    path_and_query: &str,
    content_type: Option<&str>,
    body: &[u8],
    ignore: &[IgnoredPointer],
) -> String {
    let mut hasher = Sha256::new();
    // Length-prefixed fields, so no two different intents hash the same bytes.
    let field = |hasher: &mut Sha256, bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    field(&mut hasher, method.as_bytes());
    field(&mut hasher, path_and_query.as_bytes());
    if let Some(mut json) = canonical::Document::parse(body) {
        for pointer in ignore {
            json.remove(&pointer.0);
        }
        hasher.update(b"json");
        let mut out = Hashing {
            pending: Vec::with_capacity(HASH_CHUNK.min(body.len())),
            hasher: &mut hasher,
        };
        json.write(&mut out);
        out.flush();
    } else if let Some(parts) = content_type
        .and_then(multipart::boundary)
        .and_then(|boundary| multipart::parts(body, &boundary))
    {
        hasher.update(b"form");
        for part in parts {
            field(&mut hasher, part.name.as_bytes());
            match &part.filename {
                Some(name) => field(&mut hasher, format!("f{name}").as_bytes()),
                None => field(&mut hasher, b"-"),
            }
            match &part.content_type {
                Some(kind) => field(&mut hasher, format!("t{kind}").as_bytes()),
                None => field(&mut hasher, b"-"),
            }
            field(&mut hasher, part.body);
        }
    } else {
        hasher.update(b"raw ");
        hasher.update(body);
    }
    crate::job::hex_of(&hasher.finalize().into())
}

/// SHA-256 of a request exactly as it came: method, path and query, `Content-Type` and the
/// raw body, each length-prefixed. Everything [`fingerprint_of`] reads is in it, so two
/// requests of one digest have one fingerprint: a repeat of a request already replayed is
/// recognised by it without its body being parsed again (`JobStore::peek_repeat`). Hashing
/// the bytes costs a fraction of parsing them into their canonical form.
pub fn request_digest(
    method: &str,
    path_and_query: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for field in [
        method.as_bytes(),
        path_and_query.as_bytes(),
        content_type.unwrap_or_default().as_bytes(),
    ] {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field);
    }
    // No `Content-Type` and an empty one are not the same request.
    hasher.update([u8::from(content_type.is_some())]);
    hasher.update(body);
    hasher.finalize().into()
}

/// How much of a canonical form is gathered before it is hashed: the form comes in pieces
/// of a few bytes, each too small to hand the hasher on its own, and a copy of the whole
/// form would be as large as the body.
const HASH_CHUNK: usize = 8 * 1024;

/// Hashes a canonical form as it is written, [`HASH_CHUNK`] bytes at a time.
struct Hashing<'h> {
    pending: Vec<u8>,
    hasher: &'h mut Sha256,
}

impl Hashing<'_> {
    fn flush(&mut self) {
        self.hasher.update(&self.pending);
        self.pending.clear();
    }
}

impl canonical::Output for Hashing<'_> {
    fn put(&mut self, bytes: &[u8]) {
        if self.pending.len() + bytes.len() > HASH_CHUNK {
            self.flush();
            if bytes.len() > HASH_CHUNK {
                self.hasher.update(bytes);
                return;
            }
        }
        self.pending.extend_from_slice(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderName, HeaderValue};

    fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_bytes(v).unwrap(),
            );
        }
        map
    }

    fn key_of(value: &[u8]) -> Result<Option<String>, KeyError> {
        let name = HeaderName::from_static("idempotency-key");
        key(&headers(&[("idempotency-key", value)]), &name, 16)
    }

    #[test]
    fn bare_and_quoted_keys_name_the_same_key() {
        assert_eq!(key_of(b"abc-123"), Ok(Some("abc-123".into())));
        assert_eq!(key_of(b"\"abc-123\""), Ok(Some("abc-123".into())));
        assert_eq!(key_of(b"\"a\\\"b\""), Ok(Some("a\"b".into())));
    }

    #[test]
    fn bad_keys_are_refused() {
        assert_eq!(key_of(b""), Err(KeyError::Empty));
        assert_eq!(key_of(b"\"\""), Err(KeyError::Empty));
        assert_eq!(key_of(b"\"a b\""), Err(KeyError::NotVisibleAscii));
        assert_eq!(key_of(b"a b"), Err(KeyError::NotVisibleAscii));
        assert_eq!(
            key_of("caf\u{e9}".as_bytes()),
            Err(KeyError::NotVisibleAscii)
        );
        assert_eq!(key_of(b"\"abc"), Err(KeyError::BadQuoting));
        assert_eq!(key_of(b"\"a\\nb\""), Err(KeyError::BadQuoting));
        assert_eq!(key_of(&[b'k'; 17]), Err(KeyError::TooLong { max: 16 }));
        assert_eq!(key_of(&[b'k'; 16]), Ok(Some("k".repeat(16))));
        let name = HeaderName::from_static("idempotency-key");
        let twice = headers(&[("idempotency-key", b"a"), ("idempotency-key", b"b")]);
        assert_eq!(key(&twice, &name, 16), Err(KeyError::Repeated));
        assert_eq!(key(&HeaderMap::new(), &name, 16), Ok(None));
    }

    /// A fingerprint is stored with its job and compared with those of later requests, maybe
    /// made by a later version: its bytes must never change. This one was worked out apart
    /// from this code: SHA-256 of the length-prefixed method and path, `json`, and the
    /// canonical form written here by hand.
    #[test]
    fn a_fingerprint_is_the_same_from_one_version_to_the_next() {
        let body = br#" {"z": {}, "b": [true, null, []], "a": "\u00e9\n\"q\""} "#;
        let mut form = Vec::new();
        canonical::Document::parse(body).unwrap().write(&mut form);
        assert_eq!(
            String::from_utf8(form).unwrap(),
            "{\"a\":\"\u{e9}\\u000a\\\"q\\\"\",\"b\":[true,null,[]],\"z\":{}}"
        );
        assert_eq!(
            fingerprint_of("POST", "/v1/chat/completions", None, body, &[]),
            "2e61797f1654a62a7ca521b297eb489bfef48f89ab86198fadb2528c7e0ef207"
        );
    }

    /// The canonical form is hashed in chunks as it is written: pieces smaller than a chunk,
    /// a string larger than one, and many across chunk boundaries hash as the whole form does.
    #[test]
    fn a_form_hashed_in_chunks_hashes_as_the_whole_form() {
        let long = "x".repeat(3 * HASH_CHUNK + 5);
        let items: Vec<String> = (0..2000)
            .map(|i| format!(r#"{{"n":{i},"s":"v{i}"}}"#))
            .collect();
        let body = format!(
            r#"{{"long":"{long}","items":[{}],"tail":"{long}"}}"#,
            items.join(",")
        );
        let mut form = Vec::new();
        canonical::Document::parse(body.as_bytes())
            .unwrap()
            .write(&mut form);
        let mut hasher = Sha256::new();
        for field in [&b"POST"[..], b"/v1/x"] {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field);
        }
        hasher.update(b"json");
        hasher.update(&form);
        assert_eq!(
            fingerprint_of("POST", "/v1/x", None, body.as_bytes(), &[]),
            crate::job::hex_of(&hasher.finalize().into())
        );
    }

    #[test]
    fn owners_are_hashed() {
        let h = headers(&[
            ("authorization", b"Bearer sk-secret"),
            ("x-owner-id", b"team-a"),
        ]);
        let bearer = owner(&OwnerMode::Bearer, &h).unwrap();
        assert_eq!(bearer, hex::encode(Sha256::digest(b"Bearer sk-secret")));
        assert!(!bearer.contains("sk-secret"));
        let by_header = owner(
            &OwnerMode::Header(HeaderName::from_static("x-owner-id")),
            &h,
        );
        assert_eq!(by_header, Ok(hex::encode(Sha256::digest(b"team-a"))));
        assert_eq!(
            owner(&OwnerMode::Bearer, &HeaderMap::new()),
            Err(OwnerError::Missing)
        );
        assert_eq!(
            owner(&OwnerMode::Bearer, &headers(&[("authorization", b" ")])),
            Err(OwnerError::Missing)
        );
        assert_eq!(
            owner(&OwnerMode::Anonymous, &HeaderMap::new()).unwrap(),
            ANONYMOUS_OWNER
        );
    }

    #[test]
    fn a_repeated_owner_header_is_ambiguous_never_first_wins() {
        let twice = headers(&[("x-owner-id", b"victim"), ("x-owner-id", b"attacker")]);
        let mode = OwnerMode::Header(HeaderName::from_static("x-owner-id"));
        assert!(matches!(
            owner(&mode, &twice),
            Err(OwnerError::Ambiguous(_))
        ));
        let twice = headers(&[
            ("authorization", b"Bearer a"),
            ("authorization", b"Bearer b"),
        ]);
        assert!(matches!(
            owner(&OwnerMode::Bearer, &twice),
            Err(OwnerError::Ambiguous(_))
        ));
    }

    #[test]
    fn api_key_owners_read_every_sdk_header_as_one_credential() {
        let expected = Ok(digest(b"sk-1"));
        for h in [
            headers(&[("authorization", b"Bearer sk-1")]),
            headers(&[("authorization", b"bearer  sk-1 ")]),
            headers(&[("x-api-key", b"sk-1")]),
            headers(&[("api-key", b"sk-1")]),
            headers(&[("authorization", b"Bearer sk-1"), ("x-api-key", b"sk-1")]),
        ] {
            assert_eq!(owner(&OwnerMode::ApiKey, &h), expected, "{h:?}");
        }
        let two = headers(&[("authorization", b"Bearer sk-1"), ("x-api-key", b"sk-2")]);
        assert!(matches!(
            owner(&OwnerMode::ApiKey, &two),
            Err(OwnerError::Ambiguous(_))
        ));
        assert_eq!(
            owner(&OwnerMode::ApiKey, &HeaderMap::new()),
            Err(OwnerError::Missing)
        );
    }

    #[test]
    fn canonical_json_ignores_order_and_whitespace() {
        let a = fingerprint("POST", "/v1/x", br#"{"b":1,"a":{"d":[1,2],"c":"x"}}"#, &[]);
        let b = fingerprint(
            "POST",
            "/v1/x",
            b"{ \"a\" : {\"c\":\"x\", \"d\":[1, 2]},\n \"b\": 1 }",
            &[],
        );
        assert_eq!(a, b);
        assert_ne!(
            a,
            fingerprint("POST", "/v1/y", br#"{"b":1,"a":{"d":[1,2],"c":"x"}}"#, &[])
        );
        assert_ne!(
            a,
            fingerprint("PUT", "/v1/x", br#"{"b":1,"a":{"d":[1,2],"c":"x"}}"#, &[])
        );
        assert_ne!(
            a,
            fingerprint(
                "POST",
                "/v1/x?q=1",
                br#"{"b":1,"a":{"d":[1,2],"c":"x"}}"#,
                &[]
            )
        );
        assert_ne!(
            a,
            fingerprint("POST", "/v1/x", br#"{"b":1,"a":{"d":[2,1],"c":"x"}}"#, &[])
        );
    }

    #[test]
    fn non_json_bodies_hash_raw() {
        let a = fingerprint("POST", "/u", b"a=1&b=2", &[]);
        assert_ne!(a, fingerprint("POST", "/u", b"b=2&a=1", &[]));
        assert_eq!(a, fingerprint("POST", "/u", b"a=1&b=2", &[]));
    }

    #[test]
    fn ignored_pointers_are_removed_first() {
        let ignore = [
            IgnoredPointer::parse("/metadata/trace_id").unwrap(),
            IgnoredPointer::parse("/tags/0").unwrap(),
        ];
        let a = fingerprint(
            "POST",
            "/x",
            br#"{"m":1,"metadata":{"trace_id":"a","u":1},"tags":["t1","k"]}"#,
            &ignore,
        );
        let b = fingerprint(
            "POST",
            "/x",
            br#"{"m":1,"metadata":{"trace_id":"b","u":1},"tags":["t2","k"]}"#,
            &ignore,
        );
        let c = fingerprint(
            "POST",
            "/x",
            br#"{"m":1,"metadata":{"trace_id":"b","u":2},"tags":["t2","k"]}"#,
            &ignore,
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(IgnoredPointer::parse("metadata").is_err());
        assert_eq!(
            IgnoredPointer::parse("/a~1b/c~0d").unwrap().0,
            vec!["a/b", "c~d"]
        );
    }

    #[test]
    fn the_payloads_that_once_shared_a_fingerprint_no_longer_do() {
        let fp = |body: &str| fingerprint("POST", "/v1/chat/completions", body.as_bytes(), &[]);
        assert_ne!(
            fp(r#"{"seed":18446744073709551616}"#),
            fp(r#"{"seed":18446744073709551617}"#)
        );
        assert_ne!(
            fp(r#"{"max_tokens":1,"max_tokens":5}"#),
            fp(r#"{"max_tokens":999999,"max_tokens":5}"#)
        );
        assert_eq!(fp(r#"{"t":1.0}"#), fp(r#"{"t":1.00}"#));
        assert_eq!(fp(r#"{"t":100.0}"#), fp(r#"{"t":1e2}"#));
        assert_ne!(fp(r#"{"t":1}"#), fp(r#"{"t":"1"}"#));
    }

    #[test]
    fn a_form_is_fingerprinted_by_its_parts_not_its_boundary() {
        let form = |boundary: &str, file: &str| {
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n{file}\r\n--{boundary}--\r\n"
            )
        };
        let fp = |boundary: &str, file: &str| {
            fingerprint_of(
                "POST",
                "/v1/audio/transcriptions",
                Some(&format!("multipart/form-data; boundary={boundary}")),
                form(boundary, file).as_bytes(),
                &[],
            )
        };
        assert_eq!(fp("aaa", "RIFF1"), fp("bbbbbb", "RIFF1"));
        assert_ne!(fp("aaa", "RIFF1"), fp("aaa", "RIFF2"));
        // Not a form by its content type: its bytes, boundary and all.
        assert_ne!(
            fingerprint("POST", "/x", form("aaa", "RIFF1").as_bytes(), &[]),
            fingerprint("POST", "/x", form("bbb", "RIFF1").as_bytes(), &[])
        );
    }
}
