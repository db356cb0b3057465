//! The one spelling of a request's method and path that routing, fingerprinting and
//! forwarding all use (SPEC §3 step 1), so no other spelling of a protected path can slip
//! past its route: dot segments removed (RFC 3986 §5.2.4), repeated `/` collapsed,
//! percent-encoded unreserved characters decoded.

use http::Method;

/// Why a path is refused rather than normalised.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Refused;

/// The method in its standard spelling: `post` is `POST`. Methods are case-sensitive on the
/// wire, but a lower-case `post` must not become a method no route names and pass through
/// unprotected.
pub(super) fn method(method: &Method) -> Method {
    const STANDARD: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::CONNECT,
        Method::OPTIONS,
        Method::TRACE,
        Method::PATCH,
    ];
    STANDARD
        .into_iter()
        .find(|m| m.as_str().eq_ignore_ascii_case(method.as_str()))
        .unwrap_or_else(|| method.clone())
}

/// The normalised path. An encoded `/` or `\` is refused: a provider may decode it into a
/// path separator that the gateway never saw.
pub(super) fn normalise(path: &str) -> Result<String, Refused> {
    // Nearly every request names its path in the one spelling already: checked in one pass
    // and copied, instead of decoded, split and joined again.
    if is_normal(path) {
        return Ok(path.to_owned());
    }
    normalise_in_full(path)
}

fn normalise_in_full(path: &str) -> Result<String, Refused> {
    let decoded = decode_unreserved(path)?;
    let mut kept: Vec<&str> = Vec::new();
    // A path that ends in `/`, `/.` or `/..` names a directory: it keeps its trailing slash.
    let mut trailing = false;
    for segment in decoded.split('/') {
        trailing = matches!(segment, "" | "." | "..");
        match segment {
            // Empty segments are repeated slashes.
            "" | "." => {}
            ".." => {
                kept.pop();
            }
            s => kept.push(s),
        }
    }
    let mut normal = String::with_capacity(decoded.len() + 1);
    for segment in &kept {
        normal.push('/');
        normal.push_str(segment);
    }
    if trailing || normal.is_empty() {
        normal.push('/');
    }
    Ok(normal)
}

/// Whether `path` is its own normal form: ASCII, rooted, nothing percent-encoded, and no
/// empty, `.` or `..` segment but a last empty one (a trailing slash).
fn is_normal(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    if !path.is_ascii() || path.contains('%') {
        return false;
    }
    let mut segments = rest.split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        if matches!(segment, "." | "..") || (segment.is_empty() && !last) {
            return false;
        }
    }
    true
}

fn decode_unreserved(path: &str) -> Result<String, Refused> {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = &path[i + 1..i + 3];
            if let Ok(byte) = u8::from_str_radix(hex, 16) {
                if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
                    out.push(char::from(byte));
                } else if matches!(byte, b'/' | b'\\') {
                    return Err(Refused);
                } else {
                    out.push('%');
                    out.push_str(&hex.to_ascii_uppercase());
                }
                i += 3;
                continue;
            }
        }
        out.push(char::from(bytes[i]));
        i += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_of_a_path_is_one_path() {
        for spelling in [
            "/v1/chat/completions",
            "/v1//chat/completions",
            "//v1/chat/completions",
            "/v1/./chat/completions",
            "/v1/x/../chat/completions",
            "/v1/%63hat/completions",
            "/v1/chat/%2E/completions",
            "/v1/chat/completions/.",
        ] {
            let normal = normalise(spelling).unwrap();
            assert!(
                normal == "/v1/chat/completions" || normal == "/v1/chat/completions/",
                "{spelling} -> {normal}"
            );
        }
        assert_eq!(normalise("/").unwrap(), "/");
        assert_eq!(normalise("/../..").unwrap(), "/");
        assert_eq!(normalise("/a/b/").unwrap(), "/a/b/");
        assert_eq!(normalise("/a%20b").unwrap(), "/a%20b");
        assert_eq!(normalise("/a%2fb"), Err(Refused));
        assert_eq!(normalise("/a%5Cb"), Err(Refused));
        assert_eq!(normalise("/a%2"), Ok("/a%2".into()));
    }

    #[test]
    fn a_path_taken_as_normal_is_what_normalising_it_gives() {
        use proptest::prelude::*;
        let spelling = proptest::collection::vec(
            prop_oneof![
                Just("/"),
                Just("."),
                Just(".."),
                Just("a"),
                Just("v1"),
                Just("%2E"),
                Just("%61"),
                Just("%2F"),
                Just("é"),
                Just("\\"),
            ],
            0..8,
        )
        .prop_map(|parts| parts.concat());
        proptest!(ProptestConfig::with_cases(2048), |(path in spelling)| {
            if is_normal(&path) {
                prop_assert_eq!(normalise_in_full(&path), Ok(path.clone()));
            }
            prop_assert_eq!(normalise(&path), normalise_in_full(&path));
        });
        for normal in ["/", "/v1/chat/completions", "/a/b/", "/a\\b"] {
            assert!(is_normal(normal), "{normal}");
        }
        for not_normal in ["", "a", "//a", "/a//b", "/a/./b", "/a/..", "/a%20b", "/é"] {
            assert!(!is_normal(not_normal), "{not_normal}");
        }
    }

    #[test]
    fn lower_case_methods_are_the_standard_ones() {
        assert_eq!(method(&Method::from_bytes(b"post").unwrap()), Method::POST);
        assert_eq!(method(&Method::GET), Method::GET);
        let custom = Method::from_bytes(b"PURGE").unwrap();
        assert_eq!(method(&custom), custom);
    }
}
