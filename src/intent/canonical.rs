//! Canonical JSON for fingerprints (SPEC §3 step 5): two bodies have the same canonical form
//! exactly when they are the same JSON value.
//!
//! - Numbers are compared by exact decimal value at any size or precision: `1`, `1.0`,
//!   `10e-1` and `1e0` are one value, `18446744073709551616` and `18446744073709551617` are
//!   two. A number is written as its significant digits and a base-10 exponent
//!   (`-15e-1`), never expanded, so `1e1000000000` costs what `1` costs.
//! - Strings are compared by code points after unescaping (`"\u00e9"` is `"é"`).
//! - Object members are sorted by name; members with the same name are all kept, in their
//!   order — never collapsed to the last one.
//! - Insignificant whitespace is dropped.
//!
//! The parser is iterative (an explicit stack, no recursion), so a 100 000-deep array costs
//! memory in proportion to its size and cannot overflow the thread's stack. Anything that is
//! not a single valid JSON text (RFC 8259) is not JSON: the caller hashes its raw bytes.

/// A parsed JSON text: nodes in an arena, the root last to be finished.
#[derive(Debug)]
pub(super) struct Document {
    nodes: Vec<Node>,
    /// Every scalar and member name in canonical form, one after another: one allocation
    /// for all of them.
    bytes: Vec<u8>,
    root: usize,
}

/// A run of [`Document::bytes`].
type Span = (usize, usize);

#[derive(Debug)]
enum Node {
    /// A string, number or literal, already in canonical form.
    Scalar(Span),
    Array(Vec<usize>),
    /// Members as canonical (quoted) names and value nodes, in document order.
    Object(Vec<(Span, usize)>),
}

enum Frame {
    Array(usize),
    Object { node: usize, name: Span },
}

impl Document {
    /// Parses `text`; `None` when it is not exactly one JSON value.
    pub(super) fn parse(text: &[u8]) -> Option<Self> {
        // Checked once up front: every string below can then copy bytes as they are.
        std::str::from_utf8(text).ok()?;
        let mut p = Parser {
            text,
            pos: 0,
            out: Vec::with_capacity(text.len()),
        };
        // Room for a usual request's dozen values, so that they are not copied as it grows.
        let mut nodes: Vec<Node> = Vec::with_capacity(16);
        let mut stack: Vec<Frame> = Vec::new();
        p.skip_ws();
        loop {
            // A value starts here.
            let mut done = match p.peek()? {
                b'[' => {
                    p.pos += 1;
                    nodes.push(Node::Array(Vec::new()));
                    let id = nodes.len() - 1;
                    p.skip_ws();
                    if p.peek()? == b']' {
                        p.pos += 1;
                        id
                    } else {
                        stack.push(Frame::Array(id));
                        continue;
                    }
                }
                b'{' => {
                    p.pos += 1;
                    nodes.push(Node::Object(Vec::new()));
                    let id = nodes.len() - 1;
                    p.skip_ws();
                    if p.peek()? == b'}' {
                        p.pos += 1;
                        id
                    } else {
                        let name = p.member_name()?;
                        stack.push(Frame::Object { node: id, name });
                        continue;
                    }
                }
                _ => {
                    nodes.push(Node::Scalar(p.scalar()?));
                    nodes.len() - 1
                }
            };
            // A value ended: attach it, then close every container that ends with it.
            loop {
                p.skip_ws();
                match stack.last_mut() {
                    None => {
                        return (p.pos == text.len()).then_some(Self {
                            nodes,
                            bytes: p.out,
                            root: done,
                        });
                    }
                    Some(Frame::Array(array)) => {
                        let array = *array;
                        if let Node::Array(items) = &mut nodes[array] {
                            items.push(done);
                        }
                        match p.peek()? {
                            b',' => {
                                p.pos += 1;
                                p.skip_ws();
                                break;
                            }
                            b']' => {
                                p.pos += 1;
                                stack.pop();
                                done = array;
                            }
                            _ => return None,
                        }
                    }
                    Some(Frame::Object { node, name }) => {
                        let object = *node;
                        let name = *name;
                        if let Node::Object(members) = &mut nodes[object] {
                            members.push((name, done));
                        }
                        match p.peek()? {
                            b',' => {
                                p.pos += 1;
                                let next = p.member_name()?;
                                if let Some(Frame::Object { name, .. }) = stack.last_mut() {
                                    *name = next;
                                }
                                break;
                            }
                            b'}' => {
                                p.pos += 1;
                                stack.pop();
                                done = object;
                            }
                            _ => return None,
                        }
                    }
                }
            }
        }
    }

    /// Removes what a JSON Pointer names: every member of that name (duplicates included),
    /// or the array element at that index.
    pub(super) fn remove(&mut self, tokens: &[String]) {
        let Some((last, parents)) = tokens.split_last() else {
            return;
        };
        let mut at = vec![self.root];
        for token in parents {
            let name = quoted(token);
            let mut next = Vec::new();
            for id in at {
                match &self.nodes[id] {
                    Node::Object(members) => next.extend(
                        members
                            .iter()
                            .filter(|(n, _)| self.span(*n) == name.as_slice())
                            .map(|(_, child)| *child),
                    ),
                    Node::Array(items) => {
                        if let Some(child) = token.parse::<usize>().ok().and_then(|i| items.get(i))
                        {
                            next.push(*child);
                        }
                    }
                    Node::Scalar(_) => {}
                }
            }
            at = next;
        }
        let name = quoted(last);
        let bytes = &self.bytes;
        for id in at {
            match &mut self.nodes[id] {
                Node::Object(members) => {
                    members.retain(|(n, _)| &bytes[n.0..n.1] != name.as_slice());
                }
                Node::Array(items) => {
                    if let Some(i) = last.parse::<usize>().ok().filter(|&i| i < items.len()) {
                        items.remove(i);
                    }
                }
                Node::Scalar(_) => {}
            }
        }
    }

    fn span(&self, (start, end): Span) -> &[u8] {
        &self.bytes[start..end]
    }

    /// The canonical form, written without recursion, in pieces: nothing is taken back, so
    /// `out` may hash the bytes as they come instead of holding a copy of the whole form.
    pub(super) fn write(mut self, out: &mut impl Output) {
        let bytes = &self.bytes;
        for node in &mut self.nodes {
            if let Node::Object(members) = node {
                // Stable: members of one name keep their document order.
                members.sort_by(|a, b| bytes[a.0 .0..a.0 .1].cmp(&bytes[b.0 .0..b.0 .1]));
            }
        }
        // (node, next child to write)
        let mut stack: Vec<(usize, usize)> = vec![(self.root, 0)];
        while let Some((id, child)) = stack.pop() {
            match &self.nodes[id] {
                Node::Scalar(span) => out.put(self.span(*span)),
                Node::Array(items) => match items.get(child) {
                    Some(&item) => {
                        out.put(if child == 0 { b"[" } else { b"," });
                        stack.push((id, child + 1));
                        stack.push((item, 0));
                    }
                    None => out.put(if child == 0 { b"[]" } else { b"]" }),
                },
                Node::Object(members) => match members.get(child) {
                    Some((name, value)) => {
                        out.put(if child == 0 { b"{" } else { b"," });
                        out.put(self.span(*name));
                        out.put(b":");
                        stack.push((id, child + 1));
                        stack.push((*value, 0));
                    }
                    None => out.put(if child == 0 { b"{}" } else { b"}" }),
                },
            }
        }
    }
}

/// Where [`Document::write`] puts the canonical form, a piece at a time.
pub(super) trait Output {
    fn put(&mut self, bytes: &[u8]);
}

impl Output for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// A pointer token as the canonical form of a member name.
fn quoted(token: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(token.len() + 2);
    out.push(b'"');
    for c in token.chars() {
        push_code_point(&mut out, u32::from(c));
    }
    out.push(b'"');
    out
}

/// Where the run of bytes a JSON string can hold as they are ends: the index of the first
/// quote, backslash or control character, `None` when there is none. Most of a chat body is
/// message text, so this scan is most of the parse; it tests eight bytes at a time with
/// word arithmetic, several times faster than a byte loop, which the compiler cannot
/// vectorise because it stops early.
fn plain_run(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // The high bit of each byte of `w` below `n` (n ≤ 0x80). A borrow only runs upwards from
    // a byte that matches, so the lowest flagged byte is always a true match; higher flags
    // may be false, and are never read.
    let below = |w: u64, n: u64| w.wrapping_sub(ONES * n) & !w & HIGH;
    let mut chunks = bytes.chunks_exact(8);
    let mut at = 0;
    for chunk in &mut chunks {
        let w = u64::from_le_bytes(chunk.try_into().expect("eight bytes"));
        let found = below(w ^ (ONES * u64::from(b'"')), 1)
            | below(w ^ (ONES * u64::from(b'\\')), 1)
            | below(w, 0x20);
        if found != 0 {
            return Some(at + (found.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        .map(|i| at + i)
}

/// One code point of a canonical string: `"`, `\` and control characters escaped, lone
/// surrogates as `\udxxx`, everything else as UTF-8.
fn push_code_point(out: &mut Vec<u8>, c: u32) {
    match c {
        0x22 => out.extend_from_slice(b"\\\""),
        0x5c => out.extend_from_slice(b"\\\\"),
        0..=0x1f | 0xd800..=0xdfff => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            let mut escaped = *b"\\u0000";
            for (at, shift) in [(2, 12), (3, 8), (4, 4), (5, 0)] {
                escaped[at] = HEX[((c >> shift) & 0xf) as usize];
            }
            out.extend_from_slice(&escaped);
        }
        _ => {
            let c = char::from_u32(c).expect("not a surrogate");
            let mut buf = [0u8; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
}

struct Parser<'a> {
    text: &'a [u8],
    pos: usize,
    /// Where scalars and names are written in canonical form.
    out: Vec<u8>,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn member_name(&mut self) -> Option<Span> {
        self.skip_ws();
        if self.peek()? != b'"' {
            return None;
        }
        let name = self.string()?;
        self.skip_ws();
        if self.peek()? != b':' {
            return None;
        }
        self.pos += 1;
        self.skip_ws();
        Some(name)
    }

    fn scalar(&mut self) -> Option<Span> {
        match self.peek()? {
            b'"' => self.string(),
            b'-' | b'0'..=b'9' => {
                let start = self.out.len();
                self.number()?;
                Some((start, self.out.len()))
            }
            _ => {
                for literal in [&b"true"[..], b"false", b"null"] {
                    if self.text[self.pos..].starts_with(literal) {
                        self.pos += literal.len();
                        let start = self.out.len();
                        self.out.extend_from_slice(literal);
                        return Some((start, self.out.len()));
                    }
                }
                None
            }
        }
    }

    /// A string, from its opening quote, in canonical form.
    fn string(&mut self) -> Option<Span> {
        self.pos += 1;
        let start = self.out.len();
        let out = &mut self.out;
        out.push(b'"');
        loop {
            // Plain bytes up to the next quote, escape or control character, in one copy.
            let run = plain_run(&self.text[self.pos..])?;
            out.extend_from_slice(&self.text[self.pos..self.pos + run]);
            self.pos += run;
            match self.text[self.pos] {
                b'"' => {
                    self.pos += 1;
                    out.push(b'"');
                    return Some((start, out.len()));
                }
                b'\\' => {
                    let (c, used) = escape(&self.text[self.pos..])?;
                    self.pos += used;
                    push_code_point(out, c);
                }
                _ => return None,
            }
        }
    }

    /// A number in canonical form, written to `out`: `[-]digits[e[-]exponent]`, with no
    /// leading or trailing zero in the digits; zero (and minus zero) is `0`.
    fn number(&mut self) -> Option<()> {
        let start = self.pos;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let int = self.digits();
        if int.is_empty() || (int.len() > 1 && int[0] == b'0') {
            return None;
        }
        let mut frac: &[u8] = &[];
        if self.peek() == Some(b'.') {
            self.pos += 1;
            frac = self.digits();
            if frac.is_empty() {
                return None;
            }
        }
        let mut exponent = (false, &b""[..]);
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            let sign = match self.peek() {
                Some(b'-') => {
                    self.pos += 1;
                    true
                }
                Some(b'+') => {
                    self.pos += 1;
                    false
                }
                _ => false,
            };
            let digits = self.digits();
            if digits.is_empty() {
                return None;
            }
            exponent = (sign, digits);
        }
        debug_assert!(self.pos > start);
        if frac.is_empty() && exponent.1.is_empty() {
            // The usual `0`, `64` or `-3`: an integer without trailing zeros is its own
            // canonical form (the grammar above refused leading ones).
            if int == b"0" {
                self.out.push(b'0');
                return Some(());
            }
            if int.last() != Some(&b'0') {
                if negative {
                    self.out.push(b'-');
                }
                self.out.extend_from_slice(int);
                return Some(());
            }
        }
        let mut significant: Vec<u8> = int.iter().chain(frac).copied().collect();
        let leading = significant.iter().take_while(|&&d| d == b'0').count();
        significant.drain(..leading);
        if significant.is_empty() {
            self.out.push(b'0');
            return Some(());
        }
        let trailing = significant.iter().rev().take_while(|&&d| d == b'0').count();
        significant.truncate(significant.len() - trailing);
        // value = significant × 10^(exponent − len(frac) + trailing)
        let shift = trailing as i128 - frac.len() as i128;
        let (exp_negative, exp_digits) = add(exponent.0, exponent.1, shift);
        let out = &mut self.out;
        if negative {
            out.push(b'-');
        }
        out.extend_from_slice(&significant);
        if exp_digits != b"0" {
            out.push(b'e');
            if exp_negative {
                out.push(b'-');
            }
            out.extend_from_slice(&exp_digits);
        }
        Some(())
    }

    fn digits(&mut self) -> &'a [u8] {
        let text = self.text;
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        &text[start..self.pos]
    }
}

/// One escape sequence at the start of `text` (its backslash first): the code point it
/// names and the bytes it used. A surrogate pair is one code point; a lone surrogate stays
/// itself.
fn escape(text: &[u8]) -> Option<(u32, usize)> {
    let hex4 = |at: usize| -> Option<u32> {
        text.get(at..at + 4)?.iter().try_fold(0, |value, &digit| {
            Some(value << 4 | char::from(digit).to_digit(16)?)
        })
    };
    Some(match *text.get(1)? {
        b'"' => (0x22, 2),
        b'\\' => (0x5c, 2),
        b'/' => (0x2f, 2),
        b'b' => (0x08, 2),
        b'f' => (0x0c, 2),
        b'n' => (0x0a, 2),
        b'r' => (0x0d, 2),
        b't' => (0x09, 2),
        b'u' => {
            let high = hex4(2)?;
            if (0xd800..0xdc00).contains(&high) && text[6..].starts_with(b"\\u") {
                if let Some(low) = hex4(8).filter(|low| (0xdc00..0xe000).contains(low)) {
                    return Some((0x10000 + ((high - 0xd800) << 10) + (low - 0xdc00), 12));
                }
            }
            (high, 6)
        }
        _ => return None,
    })
}

/// `(negative, digits) + shift` for a decimal integer of any length and a small shift:
/// the sign and digits of the sum, without leading zeros (`0` for zero).
fn add(negative: bool, digits: &[u8], shift: i128) -> (bool, Vec<u8>) {
    let digits = &digits[digits.iter().take_while(|&&d| d == b'0').count()..];
    if digits.len() <= 30 {
        let magnitude: i128 = std::str::from_utf8(digits)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let value = if negative { -magnitude } else { magnitude } + shift;
        return (value < 0, value.unsigned_abs().to_string().into_bytes());
    }
    // Longer than any shift: the sign is the big number's; only its magnitude moves.
    let delta = shift.unsigned_abs();
    let grow = (shift >= 0) != negative;
    let mut out: Vec<u8> = digits.to_vec();
    let mut carry = delta;
    let mut i = out.len();
    while carry > 0 {
        i -= 1;
        let step = (carry % 10) as u8;
        carry /= 10;
        let d = out[i] - b'0';
        if grow {
            let sum = d + step;
            out[i] = b'0' + sum % 10;
            carry += u128::from(sum / 10);
        } else if d >= step {
            out[i] = b'0' + d - step;
        } else {
            out[i] = b'0' + d + 10 - step;
            carry += 1;
        }
        if i == 0 && carry > 0 {
            // Only growth can run past the first digit.
            let mut longer = carry.to_string().into_bytes();
            longer.extend_from_slice(&out);
            out = longer;
            break;
        }
    }
    let zeros = out.iter().take_while(|&&d| d == b'0').count();
    out.drain(..zeros.min(out.len() - 1));
    (negative, out)
}

/// Compares canonical forms by bytes; for tests.
#[cfg(test)]
fn canonical(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    Document::parse(text.as_bytes())?.write(&mut out);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: &str, b: &str) -> bool {
        canonical(a).unwrap() == canonical(b).unwrap()
    }

    /// Every byte value at every position of runs around a word's length, among plain bytes
    /// that sit next to the stops in value (0x20, 0x21, 0x23, 0x5b, 0x5d, 0x7f, 0x80, 0xff):
    /// the word scan finds what a byte loop finds, and a second stop after the first does
    /// not move it.
    #[test]
    fn a_plain_run_ends_at_the_first_quote_backslash_or_control_character() {
        let naive = |bytes: &[u8]| {
            bytes
                .iter()
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        };
        let fillers = [0x20, 0x21, 0x23, 0x5b, 0x5d, 0x7f, 0x80, 0xff, b'a'];
        for len in 0..=19 {
            for filler in fillers {
                let plain = vec![filler; len];
                assert_eq!(plain_run(&plain), None, "{len} bytes of {filler:#x}");
                for at in 0..len {
                    for byte in 0..=255u8 {
                        let mut bytes = plain.clone();
                        bytes[at] = byte;
                        assert_eq!(
                            plain_run(&bytes),
                            naive(&bytes),
                            "{byte:#x} at {at} of {len}"
                        );
                        if at + 1 < len {
                            bytes[at + 1] = 0;
                            assert_eq!(
                                plain_run(&bytes),
                                naive(&bytes),
                                "{byte:#x} at {at}, then a stop"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn numbers_are_their_exact_value() {
        assert!(same("1", "1.0"));
        assert!(same("1", "1e0"));
        assert!(same("1", "10e-1"));
        assert!(same("100.0", "1e2"));
        assert!(same("1.0", "1.00"));
        assert!(same("0", "-0.0e7"));
        assert!(same("123.456", "1.23456E+2"));
        assert!(!same("18446744073709551616", "18446744073709551617"));
        let forty = "1234567890123456789012345678901234567890";
        let forty_one_off = "1234567890123456789012345678901234567891";
        assert!(!same(forty, forty_one_off));
        assert!(same(forty, "1234567890123456789012345678901234567890.000"));
        assert!(!same("1", "-1"));
        assert!(!same("1e1", "1e-1"));
        assert_eq!(canonical("1e1000000000").unwrap(), b"1e1000000000");
        assert_eq!(canonical("-1500").unwrap(), b"-15e2");
        assert_eq!(canonical("0.25").unwrap(), b"25e-2");
        // Exponents beyond any machine integer, moved by the digits they carry.
        let big = format!("1e{}", "9".repeat(40));
        assert!(same(&big, &format!("10e{}8", "9".repeat(39))));
        assert!(!same(&big, &format!("1e{}8", "9".repeat(39))));
        assert!(same(
            &format!("100e-{}", "1".repeat(40)),
            &format!("1e-{}09", "1".repeat(38))
        ));
        for bad in ["01", "1.", ".1", "1e", "+1", "-", "1e+", "0x1", "NaN"] {
            assert!(canonical(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn duplicate_members_are_all_kept_in_order() {
        assert!(!same(
            r#"{"max_tokens":1,"max_tokens":5}"#,
            r#"{"max_tokens":999999,"max_tokens":5}"#
        ));
        assert!(!same(r#"{"a":1,"a":2}"#, r#"{"a":2,"a":1}"#));
        assert!(!same(r#"{"a":1,"a":2}"#, r#"{"a":2}"#));
        assert!(same(r#"{"b":0,"a":1,"a":2}"#, r#"{"a":1,"b":0,"a":2}"#));
    }

    #[test]
    fn strings_are_their_code_points() {
        assert!(same(r#""\u00e9""#, "\"\u{e9}\""));
        assert!(same(r#""\/""#, r#""/""#));
        assert!(same(r#""\ud83d\ude00""#, "\"\u{1f600}\""));
        assert!(!same(r#""\ud83d""#, r#""\ud83d\ude00""#));
        assert!(!same(r#""a""#, r#""A""#));
        assert!(same(r#"{"\u0061":1}"#, r#"{"a":1}"#));
        assert!(
            canonical("\"a\nb\"").is_none(),
            "raw control characters are not JSON"
        );
        assert!(canonical(r#""\x""#).is_none());
    }

    #[test]
    fn whitespace_and_order_do_not_matter() {
        assert!(same(
            r#"{"b":[1, 2],"a":{"y":null,"x":true}}"#,
            " {\"a\" : {\"x\":true,\"y\":null} ,\n\"b\":[1,2]} "
        ));
        assert!(!same("[1,2]", "[2,1]"));
        assert!(same("[]", " [ ] "));
        assert!(same("{}", "{ }"));
        assert!(canonical("[1,]").is_none());
        assert!(canonical("{\"a\":1,}").is_none());
        assert!(canonical("[1] x").is_none());
        assert!(canonical("").is_none());
    }

    #[test]
    fn a_hundred_thousand_deep_array_is_fine() {
        let depth = 100_000;
        let text = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        // Real time: this is about how much work the parser does, not about timers.
        #[allow(clippy::disallowed_methods)]
        let started = std::time::Instant::now();
        let out = canonical(&text).unwrap();
        assert_eq!(out, text.as_bytes());
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        let unbalanced = format!("{}{}", "[".repeat(depth), "]".repeat(depth - 1));
        assert!(canonical(&unbalanced).is_none());
    }

    #[test]
    fn pointers_remove_every_member_they_name() {
        let mut doc = Document::parse(
            br#"{"metadata":{"trace_id":"x","k":1},"metadata":{"trace_id":"y"},"a":[1,2,3]}"#,
        )
        .unwrap();
        doc.remove(&["metadata".into(), "trace_id".into()]);
        doc.remove(&["a".into(), "1".into()]);
        let mut out = Vec::new();
        doc.write(&mut out);
        assert_eq!(out, br#"{"a":[1,3],"metadata":{"k":1},"metadata":{}}"#);
    }

    #[test]
    fn big_integer_addition_carries_and_borrows() {
        let nines = "9".repeat(35);
        assert_eq!(
            add(false, nines.as_bytes(), 1),
            (false, format!("1{}", "0".repeat(35)).into_bytes())
        );
        let one_then_zeros = format!("1{}", "0".repeat(35));
        assert_eq!(
            add(false, one_then_zeros.as_bytes(), -1),
            (false, nines.clone().into_bytes())
        );
        assert_eq!(
            add(true, nines.as_bytes(), 1),
            (true, format!("{}8", "9".repeat(34)).into_bytes())
        );
        assert_eq!(add(false, b"5", -7), (true, b"2".to_vec()));
        assert_eq!(add(false, b"0", 0), (false, b"0".to_vec()));
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// A JSON value as generated: numbers as significant digits and an exponent (any
        /// length), strings as code points, objects with possibly repeated member names.
        #[derive(Clone, Debug)]
        enum J {
            Null,
            Bool(bool),
            Num {
                negative: bool,
                digits: String,
                exp: i64,
            },
            Str(Vec<char>),
            Arr(Vec<J>),
            Obj(Vec<(String, J)>),
        }

        fn value() -> impl Strategy<Value = J> {
            let leaf = prop_oneof![
                Just(J::Null),
                any::<bool>().prop_map(J::Bool),
                (any::<bool>(), "[1-9][0-9]{0,45}", -40i64..40).prop_map(
                    |(negative, digits, exp)| J::Num {
                        negative,
                        digits,
                        exp
                    }
                ),
                prop::collection::vec(any::<char>(), 0..6).prop_map(J::Str),
            ];
            leaf.prop_recursive(4, 40, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..5).prop_map(J::Arr),
                    // Few names, so repeated ones are common.
                    prop::collection::vec(("[ab]{1,2}", inner), 0..6).prop_map(J::Obj),
                ]
            })
        }

        struct Rng(u64);

        impl Rng {
            fn next(&mut self, below: usize) -> usize {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.0 >> 33) as usize) % below.max(1)
            }
        }

        fn ws(rng: &mut Rng, out: &mut String) {
            out.push_str(["", " ", "\n ", "\t"][rng.next(4)]);
        }

        fn string(chars: &[char], rng: Option<&mut Rng>, out: &mut String) {
            let mut rng = rng;
            out.push('"');
            for &c in chars {
                let escape = matches!(c, '"' | '\\')
                    || (c as u32) < 0x20
                    || rng.as_deref_mut().is_some_and(|r| r.next(3) == 0);
                if !escape {
                    out.push(c);
                } else if c == '"' && rng.is_none() {
                    out.push_str("\\\"");
                } else {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04X}"));
                    }
                }
            }
            out.push('"');
        }

        /// `value` spelled plainly (`rng` = None) or as a random re-serialisation of the same
        /// value: members reordered (repeated names keeping their order), numbers spelled
        /// another way, characters escaped, whitespace added.
        fn spell(value: &J, mut rng: Option<&mut Rng>, out: &mut String) {
            match value {
                J::Null => out.push_str("null"),
                J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
                J::Num {
                    negative,
                    digits,
                    exp,
                } => {
                    if *negative {
                        out.push('-');
                    }
                    let Some(rng) = rng else {
                        out.push_str(&format!("{digits}e{exp}"));
                        return;
                    };
                    let zeros = rng.next(3);
                    let mantissa = format!("{digits}{}", "0".repeat(zeros));
                    let point = rng.next(mantissa.len() + 1);
                    let (int, frac) = mantissa.split_at(mantissa.len() - point);
                    out.push_str(if int.is_empty() { "0" } else { int });
                    if !frac.is_empty() {
                        out.push('.');
                        out.push_str(frac);
                    }
                    let e = exp - zeros as i64 + point as i64;
                    match rng.next(3) {
                        0 if e == 0 => {}
                        1 => out.push_str(&format!("E{e:+}")),
                        _ => out.push_str(&format!("e{e}")),
                    }
                }
                J::Str(chars) => string(chars, rng, out),
                J::Arr(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        if let Some(r) = rng.as_deref_mut() {
                            ws(r, out);
                        }
                        spell(item, rng.as_deref_mut(), out);
                    }
                    out.push(']');
                }
                J::Obj(members) => {
                    let mut order: Vec<usize> = (0..members.len()).collect();
                    if let Some(r) = rng.as_deref_mut() {
                        for i in (1..order.len()).rev() {
                            order.swap(i, r.next(i + 1));
                        }
                        // Members of one name keep their relative order: that is the value.
                        let mut by_name: std::collections::HashMap<&str, Vec<usize>> =
                            Default::default();
                        for (i, (name, _)) in members.iter().enumerate() {
                            by_name.entry(name).or_default().push(i);
                        }
                        let mut taken: std::collections::HashMap<&str, usize> = Default::default();
                        for slot in &mut order {
                            let name = members[*slot].0.as_str();
                            let n = taken.entry(name).or_default();
                            *slot = by_name[name][*n];
                            *n += 1;
                        }
                    }
                    out.push('{');
                    for (i, &m) in order.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        let (name, value) = &members[m];
                        let chars: Vec<char> = name.chars().collect();
                        string(&chars, rng.as_deref_mut(), out);
                        out.push(':');
                        if let Some(r) = rng.as_deref_mut() {
                            ws(r, out);
                        }
                        spell(value, rng.as_deref_mut(), out);
                    }
                    out.push('}');
                }
            }
        }

        /// One change of value somewhere in `value`; `false` when there was nothing to change.
        fn mutate(value: &mut J, rng: &mut Rng) -> bool {
            match value {
                J::Null => {
                    *value = J::Bool(false);
                    true
                }
                J::Bool(b) => {
                    *b = !*b;
                    true
                }
                J::Num { digits, .. } => {
                    // One digit of it, never the leading one into a zero.
                    let at = rng.next(digits.len());
                    let old = digits.as_bytes()[at];
                    let mut new = b'0' + rng.next(10) as u8;
                    if new == old || (at == 0 && new == b'0') {
                        new = if old == b'9' { b'1' } else { old + 1 };
                    }
                    let mut bytes = digits.clone().into_bytes();
                    bytes[at] = new;
                    *digits = String::from_utf8(bytes).unwrap();
                    true
                }
                J::Str(chars) => {
                    if chars.is_empty() {
                        chars.push('x');
                    } else {
                        let at = rng.next(chars.len());
                        chars[at] = if chars[at] == 'x' { 'y' } else { 'x' };
                    }
                    true
                }
                J::Arr(items) => {
                    if !items.is_empty() && rng.next(2) == 0 {
                        let at = rng.next(items.len());
                        return mutate(&mut items[at], rng);
                    }
                    items.push(J::Null);
                    true
                }
                J::Obj(members) => match (members.is_empty(), rng.next(3)) {
                    (false, 0) => {
                        let at = rng.next(members.len());
                        mutate(&mut members[at].1, rng)
                    }
                    (false, 1) => {
                        // One more member of a name already there.
                        let at = rng.next(members.len());
                        let copy = members[at].clone();
                        members.push(copy);
                        true
                    }
                    _ => {
                        members.push(("new".into(), J::Null));
                        true
                    }
                },
            }
        }

        fn canonical_of(text: &str) -> Vec<u8> {
            canonical(text).unwrap_or_else(|| panic!("not JSON: {text}"))
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            #[test]
            fn every_spelling_of_a_value_is_one_canonical_form(value in value(), seed in any::<u64>()) {
                let mut plain = String::new();
                spell(&value, None, &mut plain);
                let mut other = String::new();
                spell(&value, Some(&mut Rng(seed)), &mut other);
                prop_assert_eq!(canonical_of(&plain), canonical_of(&other), "{} vs {}", plain, other);
            }

            #[test]
            fn any_change_of_value_changes_the_canonical_form(value in value(), seed in any::<u64>()) {
                let mut changed = value.clone();
                prop_assume!(mutate(&mut changed, &mut Rng(seed)));
                let (mut a, mut b) = (String::new(), String::new());
                spell(&value, None, &mut a);
                spell(&changed, Some(&mut Rng(seed ^ 1)), &mut b);
                prop_assert_ne!(canonical_of(&a), canonical_of(&b), "{} vs {}", a, b);
            }
        }
    }
}
