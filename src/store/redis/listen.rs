//! Waking local waiters when a job changes: one pattern subscription to every job channel,
//! reconnected until the store is dropped.

use std::time::Duration;

use futures_util::StreamExt;
use tracing::debug;

use super::CONNECT_TIMEOUT;
use crate::store::Changes;

/// Subscribes to every job channel and wakes local waiters; reconnects until the store is
/// dropped.
pub(super) async fn listen(urls: Vec<String>, pattern: String, changed: std::sync::Weak<Changes>) {
    let mut next_url = 0;
    loop {
        if changed.upgrade().is_none() {
            return;
        }
        let url = &urls[next_url % urls.len()];
        next_url += 1;
        let subscribed = async {
            let client = redis::Client::open(url.as_str())?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.psubscribe(&pattern).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, subscribed).await {
            Ok(Ok(mut pubsub)) => {
                debug!(%url, "listening for job changes");
                let mut messages = pubsub.on_message();
                while let Some(message) = messages.next().await {
                    let Some(changed) = changed.upgrade() else {
                        return;
                    };
                    let channel = message.get_channel_name();
                    if let Some(id) = channel.rsplit(":chan:").next() {
                        changed.of(id).notify_waiters();
                    }
                }
            }
            Ok(Err(e)) => debug!(%url, error = %e, "cannot subscribe to job changes; waiters poll"),
            Err(_) => debug!(%url, "subscribing to job changes timed out; waiters poll"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
