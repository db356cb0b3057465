//! Per-connection timers that hyper's HTTP/1 server does not give: a request head must
//! arrive within `request_header_timeout` of the connection opening (or of its first byte
//! after an idle keep-alive pause), else the client gets 408 `request-timeout` and the
//! connection is closed; a keep-alive connection idle for `idle_timeout` is closed.
//!
//! The connection's IO is wrapped ([`Watched`]) so the timers see bytes arrive, and the
//! service marks when a request head was parsed and when its response body was done
//! ([`Phase`]). When a timer fires, the wrapper writes the canned 408 itself (hyper owns the
//! connection, but the wrapper owns the socket) and fails the read, which ends hyper's
//! connection. An HTTP/2 connection has no request heads in this sense: once one is seen,
//! only the idle timer applies.

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
        let wake = self
            .deadline(inner.phase)
            .is_some_and(|(at, _)| inner.sooner(at));
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
            let wake = inner.sooner(since + self.header_timeout);
            drop(inner);
            if wake {
                self.changed.notify_one();
            }
        }
    }

    /// When a connection in `phase` is closed, and why; `None` while requests are in flight.
    fn deadline(&self, phase: Phase) -> Option<(Instant, Kill)> {
        match phase {
            Phase::Head { since } => Some((since + self.header_timeout, Kill::HeadTimeout)),
            Phase::Idle { since } => Some((since + self.idle_timeout, Kill::Idle)),
            Phase::H2 { n: 0, idle_since } => Some((idle_since + self.idle_timeout, Kill::Idle)),
            Phase::Busy { .. } | Phase::H2 { .. } => None,
        }
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
                let (at, kill) = match self.deadline(inner.phase) {
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

/// The canned answer to a client too slow to send its request head.
fn request_timeout() -> Bytes {
    let body = crate::error::Problem::from(crate::error::Cause::HeadTimeout).body();
    let mut out = format!(
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/problem+json\r\nx-should-retry: false\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    Bytes::from(out)
}

/// A client connection whose reads its timers watch.
#[derive(Debug)]
pub(crate) struct Watched {
    stream: TcpStream,
    state: Arc<ConnState>,
    answered: bool,
}

impl Watched {
    pub(crate) fn new(stream: TcpStream, state: Arc<ConnState>) -> Self {
        Self {
            stream,
            state,
            answered: false,
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
                let answer = request_timeout();
                let _ = Pin::new(&mut self.stream).poll_write(cx, &answer);
                // Unread bytes at close would make the kernel reset the connection, and a
                // reset can discard the 408 before the client reads it: read them away.
                let mut scratch = [0u8; 4096];
                for _ in 0..16 {
                    let mut sink = ReadBuf::new(&mut scratch);
                    match Pin::new(&mut self.stream).poll_read(cx, &mut sink) {
                        Poll::Ready(Ok(())) if !sink.filled().is_empty() => {}
                        _ => break,
                    }
                }
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

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
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
