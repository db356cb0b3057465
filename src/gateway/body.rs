//! The client's request body: read at most once, as late as possible, within bounds.

use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http_body_util::BodyExt;

use crate::body::{self, Body};
use crate::edge::budget::Reservation;
use crate::error::Cause;

/// The client's body, unread until something needs it (a model glob, the fingerprint), and
/// the bounds it is read within: `max_body_bytes`, the shared body budget, and the deadline
/// of `request_body_timeout` counted from the request's head.
pub(super) struct PendingBody {
    state: State,
    limit: usize,
    deadline: tokio::time::Instant,
    reservation: Reservation,
}

enum State {
    Unread(Body),
    Read(Bytes),
}

impl PendingBody {
    pub(super) fn new(
        body: Body,
        limit: usize,
        deadline: tokio::time::Instant,
        reservation: Reservation,
    ) -> Self {
        Self {
            state: State::Unread(body),
            limit,
            deadline,
            reservation,
        }
    }

    /// The whole body, at most `limit` bytes; read once, then kept.
    pub(super) async fn read(&mut self, parts: &Parts) -> Result<Bytes, Cause> {
        let body = match std::mem::replace(&mut self.state, State::Read(Bytes::new())) {
            State::Read(bytes) => {
                self.state = State::Read(bytes.clone());
                return Ok(bytes);
            }
            State::Unread(body) => body,
        };
        let limit = self.limit;
        let declared = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let mut body = body;
        if declared.is_some_and(|len| len > limit as u64) {
            drain(body).await;
            return Err(Cause::TooLarge { limit });
        }
        // A declared length is reserved whole, up front: a crowd of large bodies is refused
        // at once instead of after each has filled memory.
        if let Some(len) = declared {
            if !self.reservation.grow_to(len as usize) {
                return Err(Cause::Overloaded);
            }
        }
        let reservation = &mut self.reservation;
        let read = async {
            // A declared length is already reserved: one buffer of that size, not a chain of
            // doublings whose freed predecessors the allocator may keep resident.
            let mut buf = bytes::BytesMut::with_capacity(declared.map_or(0, |len| len as usize));
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|_| Cause::UnreadableBody)?;
                if let Ok(data) = frame.into_data() {
                    if buf.len() + data.len() > limit {
                        return Err(Cause::TooLarge { limit });
                    }
                    if !reservation.grow_to(buf.len() + data.len()) {
                        return Err(Cause::Overloaded);
                    }
                    buf.extend_from_slice(&data);
                }
            }
            Ok(buf.freeze())
        };
        let bytes = match tokio::time::timeout_at(self.deadline, read).await {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(cause @ Cause::TooLarge { .. })) => {
                drain(body).await;
                return Err(cause);
            }
            Ok(Err(cause)) => return Err(cause),
            Err(_) => return Err(Cause::BodyTimeout),
        };
        self.state = State::Read(bytes.clone());
        Ok(bytes)
    }

    /// The body to forward as it is, read or not; an unread one still has to arrive by the
    /// deadline, or it ends with an error (`tripped` says so).
    pub(super) fn into_body(self) -> (Body, std::sync::Arc<std::sync::atomic::AtomicBool>) {
        let tripped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let body = match self.state {
            State::Read(bytes) => body::full(bytes),
            State::Unread(body) => deadline_body(body, self.deadline, tripped.clone()),
        };
        (body, tripped)
    }
}

/// `body`, ending with an error if it has not ended by `deadline`.
fn deadline_body(
    body: Body,
    deadline: tokio::time::Instant,
    tripped: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Body {
    let frames = futures_util::stream::unfold(Some(body), move |body| {
        let tripped = tripped.clone();
        async move {
            let mut body = body?;
            match tokio::time::timeout_at(deadline, body.frame()).await {
                Ok(Some(frame)) => Some((frame, Some(body))),
                Ok(None) => None,
                Err(_) => {
                    tripped.store(true, std::sync::atomic::Ordering::SeqCst);
                    Some((Err("the request body did not arrive in time".into()), None))
                }
            }
        }
    });
    BodyExt::boxed_unsync(http_body_util::StreamBody::new(frames))
}

/// Reads and discards what is left of a refused body, within bounds, so the client gets to
/// read the 413 instead of a connection reset while it is still sending.
async fn drain(mut body: Body) {
    const MAX_DRAIN: usize = 64 * 1024 * 1024;
    let mut drained = 0;
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while let Some(Ok(frame)) = body.frame().await {
            drained += frame.data_ref().map_or(0, Bytes::len);
            if drained > MAX_DRAIN {
                return;
            }
        }
    })
    .await;
}
