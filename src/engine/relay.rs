//! An attempt whose answer is a stream: the result slot claimed at the first byte, the
//! chunks relayed live and recorded, the recording mirrored for other gateways, the job
//! settled when the stream ends.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tracing::{debug, warn};

use super::Engine;
use crate::body::Body;
use crate::config::Provider;
use crate::job::{Effect, JobId, Transition};
use crate::store::{Applied, JobStore, StoreError, StreamHead, StreamUpdate};
use crate::stream::{LiveStream, Recording};
use crate::upstream::{kept_headers, next_data};

use super::attempt::{AttemptTask, Done, Event};

impl AttemptTask {
    /// Relays a streamed answer: claims the result slot by compare-and-swap before the
    /// first byte leaves, records every chunk for duplicates and for the store, and settles
    /// the job when the stream ends — `succeeded` with the recording, or `failed` at a cut.
    pub(super) async fn relay(
        &self,
        provider: &Provider,
        head: http::response::Parts,
        prefix: Vec<Bytes>,
        mut body: Body,
    ) {
        let n = self.n;
        if let Some(id) = &self.job_id {
            let done = match self.engine.apply(id, Transition::BeginStream { n }).await {
                Ok(Applied {
                    outcome: Ok(Effect::Won),
                    ..
                }) => None,
                Ok(Applied {
                    outcome: Ok(Effect::LostRace { completed_by }),
                    ..
                }) => {
                    warn!(job_id = %id, attempt = n, winner = ?completed_by,
                        "streaming attempt lost the race; not a byte of it is relayed");
                    self.engine.metrics.race_lost(&provider.name);
                    self.engine.metrics.attempt(&provider.name, "lost_race");
                    Some(Done::Lost)
                }
                Ok(_) => Some(Done::Lost),
                Err(e) => Some(Done::Store(e)),
            };
            if let Some(done) = done {
                let _ = self.events.send(Event::Done(n, done));
                return;
            }
        }
        self.engine.breakers.record_success(self.provider_index);
        let live = LiveStream {
            status: head.status.as_u16(),
            // A relayed stream's length is the relay's to set.
            headers: kept_headers(&head.headers, &[http::header::CONTENT_LENGTH]),
            n,
            provider: provider.name.clone(),
            recording: Recording::new(self.engine.config().server.max_stored_response_bytes),
        };
        let _cut_if_dropped = live.recording.cut_unless_finished();
        for chunk in prefix {
            live.recording.push(chunk);
        }
        if let Some(id) = &self.job_id {
            self.engine.streams.insert(id, live.clone());
        }
        let _ = self.events.send(Event::Streaming(live.clone()));
        // Duplicates on other gateways follow the stream through the store.
        let mirror = self.job_id.clone().map(|id| {
            self.engine
                .spawn(mirror(self.engine.clone(), id, live.clone()))
        });
        // The job stays in progress while it streams: keep its lease alive.
        let renew = self.job_id.clone().map(|id| {
            let engine = self.engine.clone();
            self.engine.spawn(keep_leased(engine, id, self.version))
        });
        let end = loop {
            match tokio::time::timeout(provider.stream_idle_timeout, next_data(&mut body)).await {
                Err(_) => {
                    break Err(format!(
                        "the stream was silent for longer than {:?}",
                        provider.stream_idle_timeout
                    ))
                }
                Ok(Err(e)) => break Err(e.to_string()),
                Ok(Ok(None)) => break Ok(()),
                Ok(Ok(Some(chunk))) => {
                    live.recording.push(chunk);
                    live.recording.wait_for_room().await;
                }
            }
        };
        if let Some(renew) = renew {
            renew.abort();
        }
        // The job is settled before the client's body ends: a client that read a complete
        // answer finds it stored on its retry, even if this process dies right after. If the
        // settle cannot be written, the body ends abnormally instead — its job will turn
        // unknown, and the client must not take the answer for a settled one.
        let recorded = match &self.job_id {
            None => true,
            Some(id) => self.settle_stream(id, n, provider, &live, &end).await,
        };
        live.recording.finish(match (&end, recorded) {
            (Ok(()), false) => Err("the answer could not be recorded".into()),
            _ => end,
        });
        if let Some(mirror) = mirror {
            let _ = mirror.await;
        }
        if let Some(id) = &self.job_id {
            self.engine.streams.remove(id, n);
        }
    }

    /// Settles the job with the stream's end; whether that was written.
    async fn settle_stream(
        &self,
        id: &str,
        n: u32,
        provider: &Provider,
        live: &LiveStream,
        end: &Result<(), String>,
    ) -> bool {
        let transition = match end {
            Ok(()) => Transition::EndStream {
                n,
                response: live.stored(),
            },
            Err(reason) => {
                warn!(job_id = %id, attempt = n, reason = %reason, "stream cut; its attempt failed and the client sees an aborted body");
                Transition::CutStream {
                    n,
                    error: reason.clone(),
                }
            }
        };
        match self.engine.apply(id, transition).await {
            Ok(Applied {
                outcome: Ok(Effect::Won),
                ..
            }) => {
                self.engine.metrics.attempt(&provider.name, "succeeded");
                true
            }
            Ok(Applied {
                outcome: Ok(Effect::AttemptFailed { .. }),
                ..
            }) => {
                self.engine.metrics.attempt(&provider.name, "failed");
                true
            }
            // Cancelled while it streamed: the recording is dropped.
            Ok(_) => false,
            Err(e) => {
                warn!(job_id = %id, attempt = n, error = %e, "could not settle the stream; its lease will lapse");
                false
            }
        }
    }
}

/// Mirrors a live stream to the store chunk batch by chunk batch, then its end.
async fn mirror(engine: Arc<Engine>, id: JobId, live: LiveStream) {
    let n = live.n;
    let head = StreamHead {
        status: live.status,
        headers: live.headers.clone(),
        n: live.n,
        provider: live.provider.clone(),
    };
    let store = engine.store();
    if let Err(e) = mirror_step(store, &id, StreamUpdate::Head(head)).await {
        warn!(job_id = %id, error = %e, "cannot mirror the stream; duplicates elsewhere will wait for it to settle");
        return;
    }
    let mut sent = 0;
    loop {
        let Ok((chunks, end)) = live.recording.chunks_from(sent).await else {
            let outgrew = Err("the stream outgrew max_stored_response_bytes".into());
            let _ = mirror_step(store, &id, StreamUpdate::End { n, end: outgrew }).await;
            return;
        };
        let from = sent;
        sent += chunks.len();
        let update = StreamUpdate::Chunks { n, from, chunks };
        if let Err(e) = mirror_step(store, &id, update).await {
            warn!(job_id = %id, error = %e, "mirroring the stream failed");
            return;
        }
        if let Some(end) = end {
            let _ = mirror_step(store, &id, StreamUpdate::End { n, end }).await;
            return;
        }
    }
}

/// Writes one step of a mirror, again after a failure: every step can be written twice
/// (see [`StreamUpdate`]), so a store that fails once, or whose reply is lost, does not
/// leave the duplicates on other gateways waiting for the job to settle.
async fn mirror_step(
    store: &Arc<dyn JobStore>,
    id: &str,
    update: StreamUpdate,
) -> Result<(), StoreError> {
    const TRIES: u32 = 3;
    let mut pause = Duration::from_millis(50);
    let mut tried = 1;
    loop {
        match store.mirror_stream(id, update.clone()).await {
            Ok(()) => return Ok(()),
            Err(e) if tried >= TRIES => return Err(e),
            Err(e) => {
                debug!(job_id = %id, error = %e, "mirroring the stream failed; writing it again");
                tokio::time::sleep(pause).await;
                pause *= 4;
                tried += 1;
            }
        }
    }
}

/// Renews a streaming job's lease until aborted.
async fn keep_leased(engine: Arc<Engine>, id: JobId, version: u64) {
    let lease = engine.config.idempotency.lease;
    let mut tick = tokio::time::interval_at(Instant::now() + lease / 3, lease / 3);
    loop {
        tick.tick().await;
        let until = crate::clock::now() + lease;
        if let Err(e) = engine
            .apply(&id, Transition::RenewLease { version, until })
            .await
        {
            warn!(job_id = %id, error = %e, "could not renew a streaming job's lease");
        }
    }
}
