//! Per-connection timers that hyper's HTTP/1 server does not give: a request head must
//! arrive within `request_header_timeout` of the connection opening (or of its first byte
//! after an idle keep-alive pause), else the client gets 408 `request-timeout` and the
//! connection is closed; a keep-alive connection idle for `idle_timeout` is closed, and so
//! is one whose client reads nothing of its answer that long. That last is nginx's
//! `send_timeout`: the time between two writes that go through. Without it, clients that
//! stop reading would hold every connection slot for good.
//!
//! The connection's IO is wrapped ([`Watched`]) so the timers see bytes arrive, and the
//! service marks when a request head was parsed and when its response body was done
//! ([`Phase`]). When a timer fires, the wrapper writes the canned 408 itself (hyper owns the
//! connection, but the wrapper owns the socket) and fails the read, which ends hyper's
//! connection. An HTTP/2 connection has no request heads in this sense: once one is seen,
//! only the idle timer applies.
//!
//! hyper answers a head it cannot parse (not HTTP, or past `MAX_HEAD_BYTES`) itself, before
//! any service sees a request, with an empty body. The wrapper recognises that answer as it
//! is written and writes a problem+json in its place, so that every error the gateway
//! makes is one a client can read.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Where a connection is in its life, for its timers.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Waiting for (the rest of) a request head since `since`.
    Head { since: Instant },
    /// `n` requests are being handled or answered.
    Busy { n: usize },
    /// Nothing in flight since `since`: a keep-alive pause.
    Idle { since: Instant },
    /// HTTP/2 with `n` streams in flight.
    H2 { n: usize, idle_since: Instant },
}

/// Why a connection is being closed by its timers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kill {
    HeadTimeout,
    Idle,
    /// The client read nothing of its answers for `idle_timeout`.
    Stalled,
}

#[derive(Debug)]
pub(crate) struct ConnState {
    inner: Mutex<Inner>,
    changed: Notify,
    header_timeout: Duration,
    idle_timeout: Duration,
}

#[derive(Debug)]
struct Inner {
    phase: Phase,
    kill: Option<Kill>,
    reader: Option<Waker>,
    /// When the watcher ([`ConnState::expired`]) looks next, `None` before it first did. A
    /// change wakes it only if it brings a deadline before that: on a busy keep-alive
    /// connection every request moves the phase three times, and waking the watcher for
    /// each (a notify, a poll, its timer taken out of the wheel and put back) was 4 % of a
    /// replay's instructions.
    wake_at: Option<Instant>,
    /// Since when a write to the client has waited for room in its socket, the client
    /// reading nothing meanwhile.
    write_stalled_since: Option<Instant>,
}

impl Inner {
    /// Whether a phase with a deadline at `deadline` needs the watcher woken to keep it.
    fn sooner(&self, deadline: Instant) -> bool {
        self.wake_at.is_none_or(|at| deadline < at)
    }
}

impl ConnState {
    pub(crate) fn new(header_timeout: Duration, idle_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner {
                phase: Phase::Head {
                    since: Instant::now(),
                },
                kill: None,
                reader: None,
                wake_at: None,
                write_stalled_since: None,
            }),
            changed: Notify::new(),
            header_timeout,
            idle_timeout,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request head was parsed: its request is in flight. No deadline comes of it, so the
    /// watcher is left to find out when it next looks.
    pub(crate) fn request_started(&self, http2: bool) {
        let mut inner = self.lock();
        inner.phase = match inner.phase {
            Phase::Busy { n } => Phase::Busy { n: n + 1 },
            Phase::H2 { n, idle_since } => Phase::H2 {
                n: n + 1,
                idle_since,
            },
            _ if http2 => Phase::H2 {
                n: 1,
                idle_since: Instant::now(),
            },
            _ => Phase::Busy { n: 1 },
        };
    }

    /// A response body was written whole (or dropped).
    pub(crate) fn request_finished(&self) {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.phase = match inner.phase {
            Phase::Busy { n } if n > 1 => Phase::Busy { n: n - 1 },
            Phase::Busy { .. } => Phase::Idle { since: now },
            Phase::H2 { n, .. } => Phase::H2 {
                n: n.saturating_sub(1),
                idle_since: now,
            },
            other => other,
        };
        if let Some((at, _)) = self.deadline(&inner) {
            self.wake_by(inner, at);
        }
    }

    /// Wakes the watcher, once `inner` is let go, if a deadline at `at` comes before its
    /// next look.
    fn wake_by(&self, inner: std::sync::MutexGuard<'_, Inner>, at: Instant) {
        let wake = inner.sooner(at);
        drop(inner);
        if wake {
            self.changed.notify_one();
        }
    }

    /// Bytes arrived: an idle keep-alive connection starts its next head.
    fn bytes_arrived(&self) {
        let mut inner = self.lock();
        if let Phase::Idle { .. } = inner.phase {
            let since = Instant::now();
            inner.phase = Phase::Head { since };
            self.wake_by(inner, since + self.header_timeout);
        }
    }

    /// Whether the connection waits for a request head, none in flight: the only time
    /// hyper writes an answer of its own.
    fn awaiting_head(&self) -> bool {
        matches!(self.lock().phase, Phase::Head { .. })
    }

    /// A write to the client found its socket full: the client is not reading.
    fn write_stalled(&self) {
        let mut inner = self.lock();
        if inner.write_stalled_since.is_none() {
            let since = Instant::now();
            inner.write_stalled_since = Some(since);
            self.wake_by(inner, since + self.idle_timeout);
        }
    }

    /// A write to the client went through after a stall.
    fn write_moved(&self) {
        self.lock().write_stalled_since = None;
    }

    /// When the connection is closed, and why; `None` while requests are in flight and
    /// their answers are being read.
    fn deadline(&self, inner: &Inner) -> Option<(Instant, Kill)> {
        let phase = match inner.phase {
            Phase::Head { since } => Some((since + self.header_timeout, Kill::HeadTimeout)),
            Phase::Idle { since } => Some((since + self.idle_timeout, Kill::Idle)),
            Phase::H2 { n: 0, idle_since } => Some((idle_since + self.idle_timeout, Kill::Idle)),
            Phase::Busy { .. } | Phase::H2 { .. } => None,
        };
        let stalled = inner
            .write_stalled_since
            .map(|since| (since + self.idle_timeout, Kill::Stalled));
        // The sooner of the two; the phase's on a tie.
        phase.into_iter().chain(stalled).min_by_key(|(at, _)| *at)
    }

    /// Resolves when a timer fires; the connection is then being closed.
    ///
    /// It looks at the connection at its deadline, or, while requests are in flight, after
    /// the shorter of the two timeouts; a deadline that a change brings before then wakes
    /// it early. No deadline can come later than that look and be missed: a request that
    /// finishes after it starts an idle timeout no shorter than the time to the look.
    pub(crate) async fn expired(&self) {
        loop {
            let changed = self.changed.notified();
            let now = Instant::now();
            let (wake_at, kill) = {
                let mut inner = self.lock();
                let (at, kill) = match self.deadline(&inner) {
                    Some((at, kill)) => (at, Some(kill)),
                    None => (now + self.header_timeout.min(self.idle_timeout), None),
                };
                inner.wake_at = Some(at);
                (at, kill)
            };
            match kill {
                Some(kill) if wake_at <= now => {
                    self.kill(kill);
                    return;
                }
                _ => {
                    let _ = tokio::time::timeout_at(wake_at, changed).await;
                }
            }
        }
    }

    fn kill(&self, kill: Kill) {
        let mut inner = self.lock();
        inner.kill = Some(kill);
        if let Some(reader) = inner.reader.take() {
            reader.wake();
        }
    }
}

/// The largest request head a client may send: on HTTP/1.1 the request line and headers
/// (what hyper buffers before the head is complete), on HTTP/2 the header list. hyper's own
/// bound on HTTP/1.1 is about 400 KiB, which `max_connections` clients trickling heads
/// could turn into gigabytes held; Envoy's default is 60 KiB, nginx's 32 KiB.
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;

/// The most header fields hyper parses in a request head (its default, kept): one more is
/// answered as a head too large.
const MAX_HEAD_FIELDS: usize = 100;

/// An answer the connection writes itself, outside any request: a problem+json with a
/// request id of its own (no request has one yet), then the connection closes.
fn canned(cause: crate::error::Cause) -> Bytes {
    let problem = crate::error::Problem::from(cause);
    let mut id = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let id = uuid::Uuid::new_v4().hyphenated().encode_lower(&mut id);
    let body = crate::error::REQUEST_ID.sync_scope(
        http::HeaderValue::from_str(id).expect("a UUID is a header value"),
        || problem.body(),
    );
    let status = problem.status();
    let mut out = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/problem+json\r\nx-should-retry: false\r\nx-request-id: {id}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        status.as_str(),
        status.canonical_reason().unwrap_or_default(),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    Bytes::from(out)
}

/// What a head hyper wrote on its own means, when it is one: hyper answers a request head
/// it cannot parse before any service sees it, with an empty body (a status line,
/// `connection: close`, `content-length: 0`, `date` and nothing else). Every answer that
/// comes through the gateway's services carries `x-request-id`, so none has that shape.
fn hypers_own_answer(written: &[u8]) -> Option<crate::error::Cause> {
    use crate::error::Cause;
    let mut headers = [httparse::EMPTY_HEADER; 4];
    let mut head = httparse::Response::new(&mut headers);
    let Ok(httparse::Status::Complete(len)) = head.parse(written) else {
        return None;
    };
    let own = len == written.len()
        && head.headers.iter().all(|h| {
            h.name.eq_ignore_ascii_case("date")
                || h.name.eq_ignore_ascii_case("connection") && h.value == b"close"
                || h.name.eq_ignore_ascii_case("content-length") && h.value == b"0"
        });
    match head.code? {
        400 if own => Some(Cause::MalformedHead),
        414 if own => Some(Cause::UriTooLong),
        431 if own => Some(Cause::HeadTooLarge {
            limit: MAX_HEAD_BYTES,
            fields: MAX_HEAD_FIELDS,
        }),
        _ => None,
    }
}

/// A client connection whose reads its timers watch, and whose writes carry the gateway's
/// problem+json in place of the empty answers hyper makes to heads it cannot parse.
#[derive(Debug)]
pub(crate) struct Watched {
    stream: TcpStream,
    state: Arc<ConnState>,
    /// The connection answered the client itself (a 408, or in hyper's stead): anything
    /// hyper writes after that is not sent.
    answered: bool,
    /// What is still to be written of the replacement.
    replacement: Bytes,
    /// The last write to the client waited for room in its socket.
    stalled: bool,
}

impl Watched {
    pub(crate) fn new(stream: TcpStream, state: Arc<ConnState>) -> Self {
        Self {
            stream,
            state,
            answered: false,
            replacement: Bytes::new(),
            stalled: false,
        }
    }

    /// Whether `written` is to be replaced, or dropped once the connection answered itself.
    fn replaces(&mut self, written: &[u8]) -> bool {
        if self.answered {
            return true;
        }
        // Cheap tests first: this runs on every write of every answer.
        let candidate = written.len() < 256
            && written.starts_with(b"HTTP/1.")
            && matches!(written.get(9..12), Some(b"400" | b"414" | b"431"));
        if !candidate || !self.state.awaiting_head() {
            return false;
        }
        let Some(cause) = hypers_own_answer(written) else {
            return false;
        };
        self.answered = true;
        self.replacement = canned(cause);
        true
    }

    /// Tells the timers when writes to the client stop and start going through; only the
    /// changes, so a connection whose client reads along takes no lock per write.
    fn note_write<T>(&mut self, polled: &Poll<io::Result<T>>) {
        match polled {
            Poll::Pending if !self.stalled => {
                self.stalled = true;
                self.state.write_stalled();
            }
            Poll::Ready(_) if self.stalled => {
                self.stalled = false;
                self.state.write_moved();
            }
            _ => {}
        }
    }

    /// Writes what is left of the replacement.
    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.replacement.is_empty() {
            let n =
                std::task::ready!(Pin::new(&mut self.stream).poll_write(cx, &self.replacement))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            bytes::Buf::advance(&mut self.replacement, n);
        }
        Poll::Ready(Ok(()))
    }

    /// Reads away what the client sent and no one will read: unread bytes at close make the
    /// kernel reset the connection, and a reset can discard an answer before the client
    /// reads it.
    fn read_away(&mut self, cx: &mut Context<'_>) {
        let mut scratch = [0u8; 4096];
        for _ in 0..16 {
            let mut sink = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.stream).poll_read(cx, &mut sink) {
                Poll::Ready(Ok(())) if !sink.filled().is_empty() => {}
                _ => break,
            }
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let kill = {
            let mut inner = self.state.lock();
            if inner.kill.is_none()
                && !inner
                    .reader
                    .as_ref()
                    .is_some_and(|r| r.will_wake(cx.waker()))
            {
                inner.reader = Some(cx.waker().clone());
            }
            inner.kill
        };
        if let Some(kill) = kill {
            if kill == Kill::HeadTimeout && !self.answered {
                self.answered = true;
                // Best effort: a fresh socket's send buffer takes these few hundred bytes.
                let answer = canned(crate::error::Cause::HeadTimeout);
                let _ = Pin::new(&mut self.stream).poll_write(cx, &answer);
                self.read_away(cx);
            }
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "closed by the connection's timers",
            )));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.state.bytes_arrived();
        }
        polled
    }
}

impl Watched {
    /// Writes with `write`, unless `only` (what is being written, when it is one slice) is
    /// hyper's own answer: the replacement goes out in its place.
    fn poll_write_with(
        &mut self,
        cx: &mut Context<'_>,
        only: Option<&[u8]>,
        write: impl FnOnce(Pin<&mut TcpStream>, &mut Context<'_>) -> Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        if let Some(only) = only {
            if self.replaces(only) {
                std::task::ready!(self.poll_replacement(cx))?;
                return Poll::Ready(Ok(only.len()));
            }
        }
        let polled = write(Pin::new(&mut self.stream), cx);
        self.note_write(&polled);
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_with(cx, Some(buf), |stream, cx| stream.poll_write(cx, buf))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_replacement(cx))?;
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_replacement(cx))?;
        if self.answered {
            self.read_away(cx);
        }
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // hyper's own answer is one head and no body: one slice.
        let mut written = bufs.iter().filter(|b| !b.is_empty());
        let only = match (written.next(), written.next()) {
            (Some(only), None) => Some(&**only),
            _ => None,
        };
        self.poll_write_with(cx, only, |stream, cx| stream.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Marks its request finished when the response body is done with (written or dropped).
#[derive(Debug)]
pub(crate) struct Finished(pub(crate) Arc<ConnState>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Cause;

    fn own(status: &str) -> String {
        format!("HTTP/1.1 {status}\r\nconnection: close\r\ncontent-length: 0\r\ndate: Mon, 07 Dec 2026 04:17:12 GMT\r\n\r\n")
    }

    #[test]
    fn hypers_own_answers_are_told_from_the_gateway_s() {
        let cause = |written: &str| hypers_own_answer(written.as_bytes());
        assert!(matches!(
            cause(&own("400 Bad Request")),
            Some(Cause::MalformedHead)
        ));
        assert!(matches!(
            cause(&own("414 URI Too Long")),
            Some(Cause::UriTooLong)
        ));
        assert!(matches!(
            cause(&own("431 Request Header Fields Too Large")),
            Some(Cause::HeadTooLarge {
                limit: MAX_HEAD_BYTES,
                fields: MAX_HEAD_FIELDS
            })
        ));
        // Any other status, header or body is an answer that came through the services.
        assert!(cause(&own("404 Not Found")).is_none());
        assert!(
            cause("HTTP/1.1 400 Bad Request\r\nx-request-id: a\r\ncontent-length: 0\r\n\r\n")
                .is_none()
        );
        assert!(cause("HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}").is_none());
        assert!(cause("HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n").is_none());
    }

    #[test]
    fn a_canned_answer_is_a_whole_problem_with_its_own_request_id() {
        let answer = canned(Cause::HeadTimeout);
        let text = std::str::from_utf8(&answer).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
            "{head}"
        );
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let problem: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(problem["type"], "urn:idemgate:request-timeout");
        let id = problem["request_id"].as_str().unwrap();
        assert!(head.contains(&format!("x-request-id: {id}\r\n")), "{head}");
        assert_ne!(
            canned(Cause::HeadTimeout),
            answer,
            "each answer has an id of its own"
        );
    }
}
