//! The text log line: `<time> <LEVEL> <spans:> <target>: <message> name=value …`, the shape
//! of `tracing-subscriber`'s default, written straight into the line buffer. The default
//! formatter writes every string field through `Debug`, escaping it a character at a time;
//! with one access line per request (SPEC §11) that was the largest cost of the line.
//! Strings that need no quoting (no space, quote, `=`, backslash or control character) are
//! written as they are, the rest quoted and escaped as before, so a line still splits
//! unambiguously into fields.

use std::cell::Cell;
use std::fmt::{self, Write as _};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The text format's [`FormatEvent`].
#[derive(Debug, Default, Clone, Copy)]
pub struct TextLine;

impl<S, N> FormatEvent<S, N> for TextLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        write_time(&mut writer, crate::clock::now())?;
        writer.write_str(match *meta.level() {
            tracing::Level::ERROR => "ERROR ",
            tracing::Level::WARN => " WARN ",
            tracing::Level::INFO => " INFO ",
            tracing::Level::DEBUG => "DEBUG ",
            tracing::Level::TRACE => "TRACE ",
        })?;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                writer.write_str(span.name())?;
                let extensions = span.extensions();
                if let Some(fields) = extensions.get::<FormattedFields<N>>() {
                    if !fields.is_empty() {
                        write!(writer, "{{{fields}}}")?;
                    }
                }
                writer.write_char(':')?;
            }
            writer.write_char(' ')?;
        }
        writer.write_str(meta.target())?;
        writer.write_str(": ")?;
        let mut fields = Fields {
            writer: &mut writer,
            first: true,
            result: Ok(()),
        };
        event.record(&mut fields);
        fields.result?;
        writeln!(writer)
    }
}

fn write_time(writer: &mut Writer<'_>, now: SystemTime) -> fmt::Result {
    let text = time_text(now);
    writer.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?)
}

/// `now` as RFC 3339 with microseconds and a space, as `humantime::format_rfc3339_micros`
/// writes it (and `tracing-subscriber`'s JSON `timestamp`, without the space). The date and
/// time of day change once a second, so each thread keeps the second it last formatted and
/// writes only the microseconds anew: the access line is written once per request, and
/// working out the date went through `fmt` for every one.
pub(crate) fn time_text(now: SystemTime) -> [u8; 28] {
    thread_local! {
        static SECOND: Cell<Option<(u64, [u8; 19])>> = const { Cell::new(None) };
    }
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let date = SECOND.with(|second| match second.get() {
        Some((cached, date)) if cached == secs => date,
        _ => {
            let mut date = [0u8; 19];
            let full = humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(secs))
                .to_string();
            date.copy_from_slice(&full.as_bytes()[..19]);
            second.set(Some((secs, date)));
            date
        }
    });
    let mut text = *b"YYYY-MM-DDTHH:MM:SS.000000Z ";
    text[..19].copy_from_slice(&date);
    let mut micros = since.subsec_micros();
    for digit in text[20..26].iter_mut().rev() {
        *digit = b'0' + (micros % 10) as u8;
        micros /= 10;
    }
    text
}

struct Fields<'a, 'w> {
    writer: &'a mut Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl Fields<'_, '_> {
    fn name(&mut self, field: &Field) -> fmt::Result {
        if !std::mem::take(&mut self.first) {
            self.writer.write_char(' ')?;
        }
        if field.name() == "message" {
            return Ok(());
        }
        self.writer.write_str(field.name())?;
        self.writer.write_char('=')
    }

    fn write(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if self.result.is_ok() {
            self.result = self.name(field).and_then(|()| value(self.writer));
        }
    }
}

/// Whether `value` can stand unquoted in a `name=value` list.
pub(crate) fn plain(value: &str) -> bool {
    // Every byte looked at, without branches, so that the loop is vectorised: nearly every
    // value is plain, and the access line's are ids of 36 to 45 bytes.
    !value.is_empty()
        && value.bytes().fold(true, |plain, b| {
            plain & (b > b' ') & (b < 0x7f) & (b != b'"') & (b != b'\\') & (b != b'=')
        })
}

impl Visit for Fields<'_, '_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" || plain(value) {
            self.write(field, |w| w.write_str(value));
        } else {
            self.write(field, |w| write!(w, "{value:?}"));
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.write(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.write(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.write(field, |w| write!(w, "{value}"));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.write(field, |w| write!(w, "{value}"));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.record_debug(field, &format_args!("{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.write(field, |w| write!(w, "{value:?}"));
            return;
        }
        // `%value` fields arrive here too: written once into a scratch string, then as a
        // plain or a quoted string by the same rule.
        let mut text = String::new();
        if write!(text, "{value:?}").is_err() {
            self.result = Err(fmt::Error);
            return;
        }
        let quoted = text.len() >= 2
            && text.starts_with('"')
            && text.ends_with('"')
            && !text.bytes().any(|b| b.is_ascii_control());
        if plain(&text) || quoted {
            self.write(field, |w| w.write_str(&text));
        } else {
            self.write(field, |w| write!(w, "{text:?}"));
        }
    }
}

/// A log writer that keeps what it is given, for tests of what is written.
#[cfg(test)]
#[derive(Clone, Default)]
pub(crate) struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

#[cfg(test)]
impl Captured {
    pub(crate) fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

#[cfg(test)]
impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logged(f: impl FnOnce()) -> String {
        let out = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .event_format(TextLine)
            .with_writer(out.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        out.text()
    }

    #[test]
    fn a_line_reads_as_the_default_format_did() {
        let text = logged(|| {
            tracing::info!(
                target: "idemgate::access",
                method = %"POST",
                path = %"/v1/chat/completions",
                status = 200u16,
                duration_ms = 2.5,
                outcome = "new",
                replayed = false,
                "request"
            );
        });
        let line = text.trim_end();
        let (time, rest) = line.split_once(' ').unwrap();
        assert!(humantime::parse_rfc3339(time).is_ok(), "{time}");
        assert_eq!(
            rest,
            " INFO idemgate::access: request method=POST path=/v1/chat/completions \
             status=200 duration_ms=2.5 outcome=new replayed=false"
        );
    }

    #[test]
    fn the_time_is_written_as_humantime_writes_it() {
        // Repeated and neighbouring seconds, so the cached second is both hit and replaced.
        let seconds = [1_700_000_000, 1_700_000_000, 1_700_000_001, 0, 951_782_400];
        for secs in seconds {
            for nanos in [0, 999, 1_000, 123_456_789, 999_999_999] {
                let t = UNIX_EPOCH + Duration::new(secs, nanos);
                let mut text = String::new();
                write_time(&mut Writer::new(&mut text), t).unwrap();
                assert_eq!(text, format!("{} ", humantime::format_rfc3339_micros(t)));
            }
        }
    }

    #[test]
    fn values_that_could_be_misread_are_quoted_and_escaped() {
        let text = logged(|| {
            tracing::warn!(
                error = %"connect: refused \"x\"\nnext",
                empty = "",
                eq = "a=b",
                "a warning"
            );
        });
        assert!(
            text.contains(r#"WARN idemgate::logline::tests: a warning error="connect: refused \"x\"\nnext" empty="" eq="a=b""#),
            "{text}"
        );
        assert_eq!(
            text.lines().count(),
            1,
            "a newline in a value never splits the line"
        );
    }

    #[test]
    fn plain_values_are_visible_ascii_without_quote_backslash_or_equals() {
        let chars = (0u8..=0x7f)
            .map(char::from)
            .chain(['\u{80}', '\u{e9}', '\u{2028}']);
        for c in chars {
            let expected = c.is_ascii_graphic() && !matches!(c, '"' | '\\' | '=');
            for value in [
                c.to_string(),
                format!("job_{c}0193a4c2-7b1e-7cc0-9f5e-3f1e2d3c"),
            ] {
                assert_eq!(plain(&value), expected, "{value:?}");
            }
        }
        assert!(!plain(""));
    }

    #[test]
    fn spans_prefix_the_line_with_their_fields() {
        let text = logged(|| {
            let span = tracing::debug_span!("request", route = "chat");
            let _in = span.enter();
            tracing::info!("inside");
        });
        assert!(
            text.contains("INFO request{route=\"chat\"}: idemgate::logline::tests: inside"),
            "{text}"
        );
    }
}
