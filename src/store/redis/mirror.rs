//! Live streams mirrored through Redis (SPEC §5), so a duplicate that lands on another
//! gateway follows the stream: the head, a list of chunks, an end marker and the number of
//! the attempt they are of, each with a TTL, and a publish on the job's channel at every
//! step.

use std::sync::atomic::Ordering;

use super::{unavailable, RedisStore, MIRROR_TTL_MS};
use crate::job::shard_tag;
use crate::store::{decode, encode, MirroredStream, StoreError, StreamUpdate};

impl RedisStore {
    pub(super) async fn mirror(&self, id: &str, update: StreamUpdate) -> Result<(), StoreError> {
        let Some(tag) = shard_tag(id) else {
            return Ok(());
        };
        let keys = self.keys(tag);
        let (head, chunks, end, attempt) = (
            keys.stream("shead", id),
            keys.stream("schunks", id),
            keys.stream("send", id),
            keys.stream("sattempt", id),
        );
        // Each step is one script, atomic against the others: an earlier attempt's late
        // chunks or end, checked against `sattempt`, cannot slip in beside a new head. EVAL,
        // not EVALSHA through a `Script` as the job scripts go: it rides in this pipeline
        // with the publish, and a pipeline cannot load a script a server has lost (a
        // restart, another Cluster node).
        let mut step = redis::cmd("EVAL");
        match update {
            StreamUpdate::Head(h) => {
                let n = h.n;
                step.arg(super::scripts::MIRROR_HEAD)
                    .arg(4)
                    .arg(&head)
                    .arg(&chunks)
                    .arg(&end)
                    .arg(&attempt)
                    .arg(encode(&h))
                    .arg(n)
                    .arg(MIRROR_TTL_MS);
            }
            StreamUpdate::Chunks {
                n,
                from,
                chunks: new,
            } => {
                if new.is_empty() {
                    return Ok(());
                }
                step.arg(super::scripts::PUSH_FROM)
                    .arg(3)
                    .arg(&chunks)
                    .arg(&attempt)
                    .arg(&head)
                    .arg(n)
                    .arg(from)
                    .arg(MIRROR_TTL_MS);
                for chunk in &new {
                    step.arg(chunk.as_ref());
                }
            }
            StreamUpdate::End { n, end: result } => {
                let marker = match result {
                    Ok(()) => "ok".to_owned(),
                    Err(reason) => format!("cut:{reason}"),
                };
                step.arg(super::scripts::MIRROR_END)
                    .arg(2)
                    .arg(&end)
                    .arg(&attempt)
                    .arg(n)
                    .arg(marker)
                    .arg(MIRROR_TTL_MS);
            }
        }
        let mut pipe = redis::pipe();
        pipe.add_command(step).ignore();
        pipe.cmd("PUBLISH").arg(keys.chan(id)).arg(0).ignore();
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        pipe.query_async::<()>(&mut connection)
            .await
            .map_err(unavailable)
    }

    pub(super) async fn read_mirror(
        &self,
        id: &str,
        from: usize,
    ) -> Result<Option<MirroredStream>, StoreError> {
        let Some(tag) = shard_tag(id) else {
            return Ok(None);
        };
        let keys = self.keys(tag);
        let mut read = redis::cmd("EVAL");
        read.arg(super::scripts::MIRROR_READ)
            .arg(3)
            .arg(keys.stream("send", id))
            .arg(keys.stream("shead", id))
            .arg(keys.stream("schunks", id))
            .arg(from);
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let (end, head, chunks): (Option<String>, Option<Vec<u8>>, Vec<Vec<u8>>) = read
            .query_async(&mut connection)
            .await
            .map_err(unavailable)?;
        let Some(head) = head else { return Ok(None) };
        let end = end.map(|marker| match marker.strip_prefix("cut:") {
            Some(reason) => Err(reason.to_owned()),
            None => Ok(()),
        });
        Ok(Some(MirroredStream {
            head: decode(&head)?,
            chunks: chunks.into_iter().map(bytes::Bytes::from).collect(),
            end,
        }))
    }
}
