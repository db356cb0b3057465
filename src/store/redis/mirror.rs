//! Live streams mirrored through Redis (SPEC §5), so a duplicate that lands on another
//! gateway follows the stream: the head, a list of chunks and an end marker, each with a TTL,
//! and a publish on the job's channel at every step.

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
        let (head, chunks, end) = (
            keys.stream("shead", id),
            keys.stream("schunks", id),
            keys.stream("send", id),
        );
        let mut pipe = redis::pipe();
        match update {
            StreamUpdate::Head(h) => {
                // A new attempt's stream replaces an earlier one's whole: its chunks and end
                // go first. A follower that reads in between finds the earlier attempt's head,
                // which it does not follow (`StreamHead::n` is not the attempt streaming).
                pipe.cmd("DEL").arg(&chunks).arg(&end).ignore();
                pipe.cmd("SET")
                    .arg(&head)
                    .arg(encode(&h))
                    .arg("PX")
                    .arg(MIRROR_TTL_MS)
                    .ignore();
            }
            StreamUpdate::Chunks { from, chunks: new } => {
                if new.is_empty() {
                    return Ok(());
                }
                // Only the chunks the list does not hold yet: a batch written again after a
                // lost reply is not appended twice. EVAL, not EVALSHA through a `Script` as
                // the job scripts go: it rides in this pipeline with the expiries and the
                // publish, and a pipeline cannot load a script a server has lost (a restart,
                // another Cluster node).
                let mut push = redis::cmd("EVAL");
                push.arg(super::scripts::PUSH_FROM)
                    .arg(1)
                    .arg(&chunks)
                    .arg(from);
                for chunk in &new {
                    push.arg(chunk.as_ref());
                }
                pipe.add_command(push).ignore();
                pipe.cmd("PEXPIRE").arg(&chunks).arg(MIRROR_TTL_MS).ignore();
                pipe.cmd("PEXPIRE").arg(&head).arg(MIRROR_TTL_MS).ignore();
            }
            StreamUpdate::End(result) => {
                let marker = match result {
                    Ok(()) => "ok".to_owned(),
                    Err(reason) => format!("cut:{reason}"),
                };
                pipe.cmd("SET")
                    .arg(&end)
                    .arg(marker)
                    .arg("PX")
                    .arg(MIRROR_TTL_MS)
                    .ignore();
            }
        }
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
        // The end marker is read first: whatever chunks preceded it are then in the list.
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(keys.stream("send", id));
        pipe.cmd("GET").arg(keys.stream("shead", id));
        pipe.cmd("LRANGE")
            .arg(keys.stream("schunks", id))
            .arg(from)
            .arg(-1);
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let (end, head, chunks): (Option<String>, Option<Vec<u8>>, Vec<Vec<u8>>) = pipe
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
