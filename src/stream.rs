//! Live streams (SPEC §5): the recording of a streamed answer while it is relayed, which the
//! client that runs the job reads as it grows and which duplicates join from its start.
//!
//! The recording is kept whole up to `max_stored_response_bytes`, because it is what gets
//! stored and replayed; memory per stream is bounded by that limit. Past it the recording
//! *overflows*: bytes are released as soon as the client running the job has read them,
//! the upstream read waits whenever that client is more than [`WINDOW`] chunks behind (so a
//! slow client slows the provider instead of growing memory), duplicates can no longer
//! join, and the job settles with its body omitted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tokio::sync::Notify;

use crate::body::{Body, BoxError};
use crate::job::{JobId, StoredResponse};
use crate::store::{JobStore, MirroredStream};

/// How many unread chunks an overflowed recording holds before the upstream read waits.
pub const WINDOW: usize = 64;

/// Bytes held by every recording of this process, for the `stream_buffered_bytes` gauge.
static BUFFERED: AtomicUsize = AtomicUsize::new(0);

/// Bytes of live streams held in memory right now.
pub fn buffered_bytes() -> usize {
    BUFFERED.load(Ordering::Relaxed)
}

/// A streamed answer being relayed: its head, and its recording.
#[derive(Clone, Debug)]
pub struct LiveStream {
    pub status: u16,
    /// The provider's headers, hop-by-hop and `Content-Length` removed.
    pub headers: crate::job::Headers,
    pub n: u32,
    pub provider: String,
    pub recording: Arc<Recording>,
}

impl LiveStream {
    /// What is stored when the stream ended cleanly.
    pub fn stored(&self) -> StoredResponse {
        let (body, body_omitted) = self.recording.recorded();
        StoredResponse {
            status: self.status,
            headers: self.headers.clone(),
            body,
            body_omitted,
        }
    }
}

#[derive(Debug)]
pub struct Recording {
    state: Mutex<State>,
    changed: Notify,
    limit: usize,
}

#[derive(Debug, Default)]
struct State {
    chunks: Vec<Bytes>,
    bytes: usize,
    /// `Some` once the stream ended: cleanly, or cut with a reason.
    end: Option<Result<(), String>>,
    overflowed: bool,
    /// Chunks the client running the job has read.
    primary_read: usize,
    /// That client hung up: nobody to wait for any more.
    primary_gone: bool,
    /// Bytes of `chunks` still held (released chunks are empty).
    held: usize,
}

impl State {
    fn hold(&mut self, chunk: Bytes) {
        self.held += chunk.len();
        BUFFERED.fetch_add(chunk.len(), Ordering::Relaxed);
        self.chunks.push(chunk);
    }

    fn release(&mut self, index: usize) {
        let released = std::mem::take(&mut self.chunks[index]);
        self.held -= released.len();
        BUFFERED.fetch_sub(released.len(), Ordering::Relaxed);
    }

    /// Releases every chunk the primary client has read, or all of them once it is gone:
    /// an overflowed recording keeps only what someone still has to read.
    fn release_read(&mut self) {
        let upto = if self.primary_gone {
            self.chunks.len()
        } else {
            self.primary_read
        };
        for index in 0..upto {
            self.release(index);
        }
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        let held = self.lock().held;
        BUFFERED.fetch_sub(held, Ordering::Relaxed);
    }
}

impl Recording {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            limit,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn push(&self, chunk: Bytes) {
        let mut state = self.lock();
        state.bytes += chunk.len();
        if state.overflowed && state.primary_gone {
            // Nobody will read it and it will not be stored: count it, keep nothing.
            state.chunks.push(Bytes::new());
        } else {
            state.hold(chunk);
        }
        if state.bytes > self.limit && !state.overflowed {
            state.overflowed = true;
            state.release_read();
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// Waits while an overflowed recording holds more than [`WINDOW`] chunks its client
    /// has not read: backpressure toward the provider.
    pub async fn wait_for_room(&self) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let state = self.lock();
                if !state.overflowed
                    || state.primary_gone
                    || state.chunks.len() - state.primary_read <= WINDOW
                {
                    return;
                }
            }
            notified.await;
        }
    }

    /// Ends the recording, once: a later end changes nothing.
    pub fn finish(&self, end: Result<(), String>) {
        self.lock().end.get_or_insert(end);
        self.changed.notify_waiters();
    }

    /// A guard that cuts the recording if it is dropped before the stream ended: when the
    /// relay stops half way (its task aborted, a panic), its readers see an aborted body
    /// instead of waiting for chunks that will never come.
    pub fn cut_unless_finished(self: &Arc<Self>) -> impl Drop + Send + 'static {
        struct Cut(Arc<Recording>);
        impl Drop for Cut {
            fn drop(&mut self) {
                self.0
                    .finish(Err("the relay of this stream stopped".into()));
            }
        }
        Cut(self.clone())
    }

    /// Waits until there are chunks after `from` or the stream ended; returns those chunks
    /// and the end, if any. `Err` once the recording overflowed: it can no longer be
    /// mirrored from its start.
    pub async fn chunks_from(
        &self,
        from: usize,
    ) -> Result<(Vec<Bytes>, Option<Result<(), String>>), ()> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let state = self.lock();
                if state.overflowed {
                    return Err(());
                }
                if state.chunks.len() > from || state.end.is_some() {
                    return Ok((
                        state.chunks[from.min(state.chunks.len())..].to_vec(),
                        state.end.clone(),
                    ));
                }
            }
            notified.await;
        }
    }

    /// Whether a duplicate can still join from the first byte: not once it overflowed, and
    /// not once it was cut (its job is about to fail; the duplicate waits for that and
    /// re-opens it instead of relaying a broken answer).
    pub fn joinable(&self) -> bool {
        let state = self.lock();
        !state.overflowed && !matches!(state.end, Some(Err(_)))
    }

    /// The whole recording, or an empty body flagged omitted when it overflowed.
    fn recorded(&self) -> (Bytes, bool) {
        let state = self.lock();
        if state.overflowed {
            return (Bytes::new(), true);
        }
        let mut body = BytesMut::with_capacity(state.bytes);
        for chunk in &state.chunks {
            body.extend_from_slice(chunk);
        }
        (body.freeze(), false)
    }

    /// The next chunk after `index`, waiting for it; `None` at a clean end, an error at a cut
    /// (so the client's response ends abnormally, never as a complete-looking answer).
    async fn next(&self, index: usize, primary: bool) -> Option<Result<Bytes, BoxError>> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut state = self.lock();
                if !primary && state.overflowed {
                    return Some(Err("the stream outgrew max_stored_response_bytes".into()));
                }
                if index < state.chunks.len() {
                    let chunk = state.chunks[index].clone();
                    if primary {
                        state.primary_read = index + 1;
                        if state.overflowed {
                            state.release(index);
                        }
                        drop(state);
                        self.changed.notify_waiters();
                    }
                    return Some(Ok(chunk));
                }
                match &state.end {
                    Some(Ok(())) => return None,
                    Some(Err(reason)) => return Some(Err(reason.clone().into())),
                    None => {}
                }
            }
            notified.await;
        }
    }

    /// A response body that relays the recording from its start. `primary` is the client
    /// running the job, whose pace the upstream read follows once the recording overflows.
    pub fn body(self: &Arc<Self>, primary: bool) -> Body {
        let guard = primary.then(|| PrimaryGuard(self.clone()));
        let chunks = futures_util::stream::unfold(
            (self.clone(), 0usize, guard, false),
            |(recording, index, guard, ended)| async move {
                if ended {
                    return None;
                }
                match recording.next(index, guard.is_some()).await {
                    None => None,
                    Some(Ok(chunk)) => {
                        Some((Ok(Frame::data(chunk)), (recording, index + 1, guard, false)))
                    }
                    Some(Err(e)) => Some((Err(e), (recording, index, guard, true))),
                }
            },
        );
        StreamBody::new(chunks).boxed_unsync()
    }
}

/// Marks the primary client gone when its body is dropped, so an overflowed stream stops
/// waiting for it and drains to its end.
struct PrimaryGuard(Arc<Recording>);

impl Drop for PrimaryGuard {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.primary_gone = true;
        if state.overflowed {
            state.release_read();
        }
        drop(state);
        self.0.changed.notify_waiters();
    }
}

/// The streams this process is relaying, by job id, for duplicates to join.
#[derive(Debug, Default)]
pub struct LiveStreams(Mutex<HashMap<JobId, LiveStream>>);

impl LiveStreams {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, LiveStream>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn insert(&self, id: &str, stream: LiveStream) {
        self.lock().insert(id.to_owned(), stream);
    }

    /// Forgets attempt `n`'s stream of a job; a later attempt's, which replaced it, stays.
    pub fn remove(&self, id: &str, n: u32) {
        let mut streams = self.lock();
        if streams.get(id).is_some_and(|s| s.n == n) {
            streams.remove(id);
        }
    }

    /// The live stream of a job, if it is here and can still be joined from its start.
    pub fn joinable(&self, id: &str) -> Option<LiveStream> {
        self.lock()
            .get(id)
            .filter(|s| s.recording.joinable())
            .cloned()
    }
}

/// A duplicate following a stream that another gateway relays, through the store's mirror:
/// what was mirrored so far, then the rest, polled with a bounded lag ([`FOLLOW_LAG`]).
pub fn follow(store: Arc<dyn JobStore>, id: JobId, first: MirroredStream) -> Body {
    const PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);
    let state = Follower {
        store,
        id,
        attempt: first.head.n,
        cursor: first.chunks.len(),
        pending: std::collections::VecDeque::from(first.chunks),
        end: first.end,
        progress: tokio::time::Instant::now(),
    };
    let chunks = futures_util::stream::unfold(Some(state), |state| async move {
        let mut f = state?;
        loop {
            if let Some(chunk) = f.pending.pop_front() {
                return Some((Ok(Frame::data(chunk)), Some(f)));
            }
            match f.end {
                Some(Ok(())) => return None,
                Some(Err(reason)) => return Some((Err(reason.into()), None)),
                None => {}
            }
            if f.progress.elapsed() > PATIENCE {
                return Some((Err("the mirrored stream stopped progressing".into()), None));
            }
            tokio::time::sleep(FOLLOW_LAG).await;
            match f.store.read_stream(&f.id, f.cursor).await {
                // A retry's stream replaced the one followed: that one was cut.
                Ok(Some(next)) if next.head.n != f.attempt => {
                    return Some((Err("the mirrored stream was cut".into()), None));
                }
                Ok(Some(next)) => {
                    if !next.chunks.is_empty() || next.end.is_some() {
                        f.progress = tokio::time::Instant::now();
                    }
                    f.cursor += next.chunks.len();
                    f.pending.extend(next.chunks);
                    f.end = next.end;
                }
                Ok(None) => return Some((Err("the mirrored stream is gone".into()), None)),
                Err(e) => return Some((Err(e.to_string().into()), None)),
            }
        }
    });
    StreamBody::new(chunks).boxed_unsync()
}

/// How often a follower polls the store's mirror of a stream relayed elsewhere.
pub const FOLLOW_LAG: std::time::Duration = std::time::Duration::from_millis(25);

struct Follower {
    store: Arc<dyn JobStore>,
    /// The attempt whose stream is followed.
    attempt: u32,
    id: JobId,
    cursor: usize,
    pending: std::collections::VecDeque<Bytes>,
    end: Option<Result<(), String>>,
    progress: tokio::time::Instant,
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn collect(body: Body) -> Result<Vec<Bytes>, BoxError> {
        let mut body = body;
        let mut chunks = Vec::new();
        while let Some(frame) = body.frame().await {
            chunks.push(frame?.into_data().unwrap());
        }
        Ok(chunks)
    }

    #[tokio::test]
    async fn readers_get_every_chunk_in_order_and_a_clean_end() {
        let rec = Recording::new(1024);
        rec.push(Bytes::from_static(b"a"));
        let early = tokio::spawn(collect(rec.body(true)));
        rec.push(Bytes::from_static(b"b"));
        let late = tokio::spawn(collect(rec.body(false)));
        rec.push(Bytes::from_static(b"c"));
        rec.finish(Ok(()));
        assert_eq!(early.await.unwrap().unwrap(), vec!["a", "b", "c"]);
        assert_eq!(late.await.unwrap().unwrap(), vec!["a", "b", "c"]);
        assert_eq!(rec.recorded(), (Bytes::from_static(b"abc"), false));
    }

    #[test]
    fn an_attempt_that_ends_leaves_a_later_attempts_stream_joinable() {
        let live = |n| LiveStream {
            status: 200,
            headers: Default::default(),
            n,
            provider: "p".into(),
            recording: Recording::new(1024),
        };
        let streams = LiveStreams::default();
        streams.insert("job_1", live(1));
        // The retry's stream replaces the cut one's before the cut attempt's relay is done.
        streams.insert("job_1", live(2));
        streams.remove("job_1", 1);
        assert_eq!(streams.joinable("job_1").map(|s| s.n), Some(2));
        streams.remove("job_1", 2);
        assert!(streams.joinable("job_1").is_none());
    }

    #[tokio::test]
    async fn a_cut_ends_every_reader_with_an_error() {
        let rec = Recording::new(1024);
        rec.push(Bytes::from_static(b"a"));
        let reader = tokio::spawn(collect(rec.body(false)));
        rec.finish(Err("reset".into()));
        assert!(reader.await.unwrap().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn an_overflowed_recording_waits_for_its_client_and_releases_what_it_read() {
        let rec = Recording::new(4);
        for _ in 0..WINDOW + 2 {
            rec.push(Bytes::from_static(b"xx"));
        }
        assert!(!rec.joinable());
        // The client has read nothing: the upstream read must wait.
        let wait =
            tokio::time::timeout(std::time::Duration::from_secs(1), rec.wait_for_room()).await;
        assert!(wait.is_err(), "no room until the client reads");
        let mut body = rec.body(true);
        for _ in 0..3 {
            body.frame().await.unwrap().unwrap();
        }
        tokio::time::timeout(std::time::Duration::from_secs(1), rec.wait_for_room())
            .await
            .expect("room once the client caught up");
        assert!(
            rec.lock().chunks[..3].iter().all(Bytes::is_empty),
            "read chunks are released"
        );
        assert_eq!(rec.recorded(), (Bytes::new(), true));
        // A client that hangs up releases the upstream read.
        drop(body);
        for _ in 0..WINDOW * 2 {
            rec.push(Bytes::from_static(b"xx"));
        }
        tokio::time::timeout(std::time::Duration::from_secs(1), rec.wait_for_room())
            .await
            .expect("nobody to wait for");
    }
}
