//! The access line (SPEC §11): one per request, written straight into the log's sink.
//!
//! As a `tracing` event the line went through the dispatcher, the filter, the field visitor
//! and the formatter, about 6 000 instructions a line: an eighth of a replay. The gateway's
//! binary calls [`install`] when it starts logging, and from then on the line is written
//! here, in the very bytes the formatter of the configured format (text or JSON) wrote; the
//! filter still decides whether it is written at all (`IDEMGATE_LOG=warn`,
//! `idemgate::access=off`). Where nothing was installed (the gateway used as a library, a
//! test with a subscriber of its own) the line is an ordinary event, as before.
//!
//! The line is written by the outermost layer of the client stack, outside every span, so a
//! formatter would have prefixed nothing to it.

use std::cell::RefCell;
use std::io::Write as _;
use std::sync::OnceLock;
use std::time::SystemTime;

use tracing_subscriber::fmt::MakeWriter;

use crate::config::LogFormat;
use crate::logsink::Batched;

/// What one access line says.
#[derive(Debug, Clone, Copy)]
pub struct AccessLine<'a> {
    pub method: &'a str,
    /// The normalised path.
    pub path: &'a str,
    pub route: &'a str,
    pub status: u16,
    /// Written as `duration_ms`, milliseconds to the microsecond.
    pub micros: u64,
    pub outcome: &'a str,
    pub job_id: &'a str,
    pub attempt: &'a str,
    pub provider: &'a str,
    pub replayed: &'a str,
    pub request_id: &'a str,
}

static DIRECT: OnceLock<Direct> = OnceLock::new();

/// From now on, access lines are written to `sink` in `format` without going through
/// `tracing`. Only the first call counts: the process has one log.
pub fn install(format: LogFormat, sink: Batched) {
    let _ = DIRECT.set(Direct { format, sink });
}

impl AccessLine<'_> {
    /// Writes the line, if the log's filter lets info lines of `idemgate::access` through.
    pub fn log(&self) {
        if !tracing::enabled!(target: "idemgate::access", tracing::Level::INFO) {
            return;
        }
        match DIRECT.get() {
            Some(direct) => direct.write(self, crate::clock::now()),
            None => self.event(),
        }
    }

    /// The line as a `tracing` event: what [`Direct`] writes without one.
    fn event(&self) {
        tracing::info!(
            target: "idemgate::access",
            method = self.method,
            path = self.path,
            route = self.route,
            status = self.status,
            duration_ms = self.micros as f64 / 1000.0,
            outcome = self.outcome,
            job_id = self.job_id,
            attempt = self.attempt,
            provider = self.provider,
            replayed = self.replayed,
            request_id = self.request_id,
            "request"
        );
    }

    /// The fields after the message, in the event's order.
    fn fields(&self) -> [(&'static str, Value<'_>); 11] {
        use Value::{Millis, Number, Text};
        [
            ("method", Text(self.method)),
            ("path", Text(self.path)),
            ("route", Text(self.route)),
            ("status", Number(self.status)),
            ("duration_ms", Millis(self.micros)),
            ("outcome", Text(self.outcome)),
            ("job_id", Text(self.job_id)),
            ("attempt", Text(self.attempt)),
            ("provider", Text(self.provider)),
            ("replayed", Text(self.replayed)),
            ("request_id", Text(self.request_id)),
        ]
    }
}

#[derive(Clone, Copy)]
enum Value<'a> {
    Text(&'a str),
    Number(u16),
    Millis(u64),
}

#[derive(Debug)]
struct Direct {
    format: LogFormat,
    sink: Batched,
}

impl Direct {
    fn write(&self, line: &AccessLine<'_>, now: SystemTime) {
        thread_local! {
            static BUFFER: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(512));
        }
        let write = |buffer: &mut Vec<u8>| {
            buffer.clear();
            self.render(line, now, buffer);
            let _ = self.sink.make_writer().write_all(buffer);
        };
        let written =
            BUFFER.try_with(|buffer| buffer.try_borrow_mut().map(|mut b| write(&mut b)).is_ok());
        if written != Ok(true) {
            // The thread is ending (or, impossibly, writing a line already): a buffer of
            // its own.
            write(&mut Vec::new());
        }
    }

    fn render(&self, line: &AccessLine<'_>, now: SystemTime, out: &mut Vec<u8>) {
        match self.format {
            LogFormat::Text => text(line, now, out),
            LogFormat::Json => json(line, now, out),
        }
    }
}

/// As [`crate::logline::TextLine`] writes the event.
fn text(line: &AccessLine<'_>, now: SystemTime, out: &mut Vec<u8>) {
    out.extend_from_slice(&crate::logline::time_text(now));
    out.extend_from_slice(b" INFO idemgate::access: request");
    for (name, value) in line.fields() {
        out.push(b' ');
        out.extend_from_slice(name.as_bytes());
        out.push(b'=');
        match value {
            Value::Text(text) if crate::logline::plain(text) => {
                out.extend_from_slice(text.as_bytes());
            }
            Value::Text(text) => {
                let _ = write!(out, "{text:?}");
            }
            Value::Number(n) => out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes()),
            Value::Millis(micros) => millis(micros, false, out),
        }
    }
    out.push(b'\n');
}

/// As `tracing-subscriber`'s JSON format writes the event: `timestamp`, `level`, `fields`
/// (the message first), `target`.
fn json(line: &AccessLine<'_>, now: SystemTime, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"timestamp\":\"");
    out.extend_from_slice(&crate::logline::time_text(now)[..27]);
    out.extend_from_slice(b"\",\"level\":\"INFO\",\"fields\":{\"message\":\"request\"");
    for (name, value) in line.fields() {
        out.extend_from_slice(b",\"");
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\":");
        match value {
            // serde_json's escaping, as the JSON format's.
            Value::Text(text) => {
                let _ = serde_json::to_writer(&mut *out, text);
            }
            Value::Number(n) => out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes()),
            Value::Millis(micros) => millis(micros, true, out),
        }
    }
    out.extend_from_slice(b"},\"target\":\"idemgate::access\"}\n");
}

/// `micros / 1000` as the shortest decimal, the way an `f64` of that value prints: no
/// trailing zeros, and a whole number as `2` (`Display`) or `2.0` (JSON).
fn millis(micros: u64, json: bool, out: &mut Vec<u8>) {
    out.extend_from_slice(itoa::Buffer::new().format(micros / 1000).as_bytes());
    let fraction = micros % 1000;
    if fraction == 0 {
        if json {
            out.extend_from_slice(b".0");
        }
        return;
    }
    let digits = [
        b'0' + (fraction / 100) as u8,
        b'0' + (fraction / 10 % 10) as u8,
        b'0' + (fraction % 10) as u8,
    ];
    let kept = if digits[2] != b'0' {
        3
    } else if digits[1] != b'0' {
        2
    } else {
        1
    };
    out.push(b'.');
    out.extend_from_slice(&digits[..kept]);
}

#[cfg(test)]
mod tests {
    use std::sync::{mpsc, Arc, Mutex};

    use proptest::prelude::*;

    use super::*;
    use crate::logline::Captured;

    /// The line as the event, through the subscriber `main` sets up for `format`.
    fn through_tracing(line: &AccessLine<'_>, format: LogFormat) -> String {
        let out = Captured::default();
        let builder = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(out.clone());
        match format {
            LogFormat::Text => tracing::subscriber::with_default(
                builder.event_format(crate::logline::TextLine).finish(),
                || line.event(),
            ),
            LogFormat::Json => {
                tracing::subscriber::with_default(builder.json().finish(), || line.event())
            }
        }
        out.text()
    }

    fn direct(line: &AccessLine<'_>, format: LogFormat) -> String {
        let mut out = Vec::new();
        Direct {
            format,
            sink: Batched::stderr(),
        }
        .render(line, crate::clock::now(), &mut out);
        String::from_utf8(out).unwrap()
    }

    /// The line after its time, which the two writers read at different moments.
    fn untimed(line: &str, format: LogFormat) -> String {
        match format {
            LogFormat::Text => line[27..].to_owned(),
            LogFormat::Json => {
                let start = "{\"timestamp\":\"".len();
                format!("{}{}", &line[..start], &line[start + 27..])
            }
        }
    }

    fn sample(micros: u64) -> AccessLine<'static> {
        AccessLine {
            method: "POST",
            path: "/v1/chat/completions",
            route: "chat",
            status: 200,
            micros,
            outcome: "replayed",
            job_id: "job_0193a4c2-7b1e-7cc0-9f5e-3f1e2d3c4b5a",
            attempt: "1",
            provider: "openai",
            replayed: "true",
            request_id: "5b1f0a7e-8a43-4a0e-9d44-0c3b6f1e2a9d",
        }
    }

    fn same_bytes(line: &AccessLine<'_>) {
        for format in [LogFormat::Text, LogFormat::Json] {
            let expected = through_tracing(line, format);
            let written = direct(line, format);
            assert_eq!(
                untimed(&written, format),
                untimed(&expected, format),
                "{format:?}"
            );
            assert_eq!(
                written.len(),
                expected.len(),
                "{format:?}: the time's width"
            );
        }
    }

    #[test]
    fn a_line_is_written_as_the_formatter_wrote_the_event() {
        same_bytes(&sample(1_234));
    }

    #[test]
    fn values_that_need_quoting_or_escaping_are_written_as_the_formatter_wrote_them() {
        same_bytes(&AccessLine {
            method: "GET",
            path: "/v1/a path/with \"quotes\"\\and=equals",
            route: "",
            status: 404,
            micros: 0,
            outcome: "not_found",
            job_id: "",
            attempt: "",
            provider: "caf\u{e9}\ttab\u{1}",
            replayed: "",
            request_id: "\u{2028}line",
        });
    }

    #[test]
    fn the_json_line_parses_with_every_field() {
        let line = direct(&sample(17_000), LogFormat::Json);
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["target"], "idemgate::access");
        assert_eq!(value["fields"]["duration_ms"], 17.0);
        assert_eq!(value["fields"]["status"], 200);
        assert!(humantime::parse_rfc3339(value["timestamp"].as_str().unwrap()).is_ok());
    }

    proptest! {
        #[test]
        fn milliseconds_print_as_the_f64_of_them_does(micros in prop_oneof![
            0u64..5_000,
            0u64..1_000_000_000_000,
        ]) {
            let value = micros as f64 / 1000.0;
            for (json, expected) in [
                (false, value.to_string()),
                (true, serde_json::to_string(&value).unwrap()),
            ] {
                let mut out = Vec::new();
                millis(micros, json, &mut out);
                prop_assert_eq!(String::from_utf8(out).unwrap(), expected);
            }
        }
    }

    #[test]
    fn an_installed_writer_sends_each_line_to_its_sink_in_one_write() {
        struct Channel(Mutex<mpsc::Sender<Vec<u8>>>);
        impl crate::logsink::Sink for Channel {
            fn write_lines(&self, lines: &[u8]) {
                let _ = self.0.lock().unwrap().send(lines.to_vec());
            }
        }
        let (tx, rx) = mpsc::channel();
        let direct = Direct {
            format: LogFormat::Text,
            sink: Batched::new(Arc::new(Channel(Mutex::new(tx)))),
        };
        // A thread that never parked in a runtime: nothing is batched.
        std::thread::spawn(move || {
            direct.write(&sample(1_500), crate::clock::now());
            direct.write(&sample(2_000), crate::clock::now());
        })
        .join()
        .unwrap();
        let first = String::from_utf8(rx.try_recv().unwrap()).unwrap();
        let second = String::from_utf8(rx.try_recv().unwrap()).unwrap();
        assert!(first.ends_with("duration_ms=1.5 outcome=replayed job_id=job_0193a4c2-7b1e-7cc0-9f5e-3f1e2d3c4b5a attempt=1 provider=openai replayed=true request_id=5b1f0a7e-8a43-4a0e-9d44-0c3b6f1e2a9d\n"), "{first}");
        assert!(second.contains(" duration_ms=2 "), "{second}");
        assert_eq!(first.lines().count(), 1);
    }
}
