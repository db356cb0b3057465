//! `multipart/form-data` bodies (RFC 7578) as the sequence of their parts: name, filename,
//! content type and bytes. The boundary — which SDKs pick at random for every request, so a
//! retry of one upload never repeats it — is not part of the intent.

/// One part of a form.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Part<'a> {
    pub(super) name: String,
    pub(super) filename: Option<String>,
    pub(super) content_type: Option<String>,
    pub(super) body: &'a [u8],
}

/// The boundary of a `multipart/form-data` content type, if it is one.
pub(super) fn boundary(content_type: &str) -> Option<String> {
    let mut params = content_type.split(';');
    let kind = params.next()?.trim();
    if !kind.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.find_map(|param| {
        let (name, value) = param.split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| unquote(value.trim()))
            .filter(|b| !b.is_empty() && b.len() <= 200)
    })
}

/// The parts of `body`; `None` when it is not a well-formed form with this boundary.
pub(super) fn parts<'a>(body: &'a [u8], boundary: &str) -> Option<Vec<Part<'a>>> {
    let dash = format!("--{boundary}");
    let delimiter = format!("\r\n--{boundary}");
    // The first delimiter may follow a preamble.
    let mut pos = if body.starts_with(dash.as_bytes()) {
        dash.len()
    } else {
        find(body, delimiter.as_bytes(), 0)? + delimiter.len()
    };
    let mut parts = Vec::new();
    loop {
        let rest = &body[pos..];
        if rest.starts_with(b"--") {
            return Some(parts);
        }
        // Transport padding after a delimiter is allowed before its line break.
        let line_end = find(body, b"\r\n", pos)?;
        if body[pos..line_end]
            .iter()
            .any(|b| !matches!(b, b' ' | b'\t'))
        {
            return None;
        }
        let start = line_end + 2;
        let end = find(body, delimiter.as_bytes(), start)?;
        parts.push(part(&body[start..end])?);
        pos = end + delimiter.len();
    }
}

fn part(raw: &[u8]) -> Option<Part<'_>> {
    let (head, body) = match find(raw, b"\r\n\r\n", 0) {
        Some(at) => (&raw[..at], &raw[at + 4..]),
        // A part with no headers at all starts with its blank line.
        None if raw.starts_with(b"\r\n") => (&raw[..0], &raw[2..]),
        None => return None,
    };
    let head = std::str::from_utf8(head).ok()?;
    let mut name = None;
    let mut filename = None;
    let mut content_type = None;
    for line in head.split("\r\n").filter(|l| !l.is_empty()) {
        let (field, value) = line.split_once(':')?;
        let field = field.trim();
        if field.eq_ignore_ascii_case("content-disposition") {
            for param in split_params(value).into_iter().skip(1) {
                let Some((key, value)) = param.split_once('=') else {
                    continue;
                };
                match key.trim().to_ascii_lowercase().as_str() {
                    "name" => name = Some(unquote(value.trim())),
                    "filename" => filename = Some(unquote(value.trim())),
                    _ => {}
                }
            }
        } else if field.eq_ignore_ascii_case("content-type") {
            content_type = Some(value.trim().to_owned());
        }
    }
    Some(Part {
        name: name?,
        filename,
        content_type,
        body,
    })
}

/// Splits header parameters at `;` outside quoted strings.
fn split_params(value: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in value.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            ';' if !quoted => {
                out.push(&value[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&value[start..]);
    out
}

fn unquote(value: &str) -> String {
    match value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
        Some(inner) => {
            let mut out = String::with_capacity(inner.len());
            let mut chars = inner.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => out.extend(chars.next()),
                    c => out.push(c),
                }
            }
            out
        }
        None => value.to_owned(),
    }
}

fn find(haystack: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    haystack
        .get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|at| at + from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(boundary: &str, file: &[u8]) -> Vec<u8> {
        let mut body = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a;b.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
        )
        .into_bytes();
        body.extend_from_slice(file);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        body
    }

    #[test]
    fn a_form_is_its_parts_whatever_its_boundary() {
        let a = form("abc123", b"RIFF\r\n--not-a-boundary\x00\x01");
        let parts = parts(&a, "abc123").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "model");
        assert_eq!(parts[0].body, b"whisper-1");
        assert_eq!(parts[1].filename.as_deref(), Some("a;b.wav"));
        assert_eq!(parts[1].content_type.as_deref(), Some("audio/wav"));
        assert_eq!(parts[1].body, b"RIFF\r\n--not-a-boundary\x00\x01");
        let b = form("zzz", b"RIFF\r\n--not-a-boundary\x00\x01");
        assert_eq!(super::parts(&b, "zzz").unwrap(), parts);
    }

    #[test]
    fn boundaries_come_from_the_content_type() {
        assert_eq!(
            boundary("multipart/form-data; boundary=abc").as_deref(),
            Some("abc")
        );
        assert_eq!(
            boundary("Multipart/Form-Data; charset=utf-8; boundary=\"a b\"").as_deref(),
            Some("a b")
        );
        assert_eq!(boundary("application/json"), None);
        assert_eq!(boundary("multipart/form-data"), None);
    }

    #[test]
    fn broken_forms_are_not_forms() {
        assert!(parts(b"--abc\r\nno blank line", "abc").is_none());
        assert!(parts(
            b"--abc\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\nnever closed",
            "abc"
        )
        .is_none());
        assert!(parts(b"nothing here", "abc").is_none());
    }
}
