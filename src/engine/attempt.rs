//! One attempt: the upstream call, what its answer means, and its own settlement in the
//! store, reported to its round afterwards.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::Engine;
use crate::body::Body;
use crate::config::Route;
use crate::job::{Effect, Failure, JobId, StoredResponse, Transition};
use crate::store::{Applied, StoreError};
use crate::stream::LiveStream;
use crate::upstream::{kept_headers, next_data, read_body, CallError, ClientRequest, Read};

/// What an attempt concluded.
#[derive(Debug)]
pub(super) enum Outcome {
    Final(StoredResponse),
    Definite {
        kind: Failure,
        upstream_status: Option<u16>,
        /// The answer to pass to the client if every provider fails; `None` for answers
        /// that must never reach it (a broken contract).
        response: Option<StoredResponse>,
        error: Option<String>,
        failover: bool,
        /// Whether it says the provider is unwell (for its breaker): a refused connection
        /// does, an over-long prompt refused by its `code:` does not.
        unhealthy: bool,
    },
    Unknown(String),
}

#[derive(Debug)]
pub(super) enum Event {
    FirstByte(u32),
    /// The attempt holds the result slot and is relaying a stream.
    Streaming(LiveStream),
    Done(u32, Done),
}

/// An answer as read from the provider.
pub(super) enum Answer {
    Whole(http::response::Parts, Bytes),
    /// A stream, or a body too large to store: the chunks read so far and the rest.
    Stream(http::response::Parts, Vec<Bytes>, Body),
}

pub(super) fn is_event_stream(head: &http::response::Parts) -> bool {
    head.status.is_success()
        && head
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.trim_start()
                    .to_ascii_lowercase()
                    .starts_with("text/event-stream")
            })
}

/// An attempt's report to its round, after it settled itself in the store.
#[derive(Debug)]
pub(super) enum Done {
    Won(StoredResponse),
    Lost,
    /// The attempt had been cancelled: its answer was dropped.
    Discarded,
    Failed {
        response: Option<StoredResponse>,
        failover: bool,
    },
    Unknown,
    Store(StoreError),
}

/// One attempt: the upstream call, its classification, and its own settlement.
pub(super) struct AttemptTask {
    pub(super) engine: Arc<Engine>,
    pub(super) route: Arc<Route>,
    pub(super) job_id: Option<JobId>,
    /// The job version the round read (0 for keyless rounds).
    pub(super) version: u64,
    pub(super) n: u32,
    pub(super) provider_index: usize,
    pub(super) request: Arc<ClientRequest>,
    pub(super) events: mpsc::UnboundedSender<Event>,
}

impl AttemptTask {
    pub(super) async fn run(self) {
        let provider = self.engine.config().provider(self.provider_index).clone();
        let request = self.request.for_provider(&provider, self.job_id.as_deref());
        let events = self.events.clone();
        let n = self.n;
        let limit = self.engine.config().server.max_stored_response_bytes;
        let upstream = self.engine.upstream().clone();
        let index = self.provider_index;
        let exchange = async move {
            let response = upstream.send(index, request).await?;
            let (head, mut body) = response.into_parts();
            let first_byte = move || {
                let _ = events.send(Event::FirstByte(n));
            };
            if is_event_stream(&head) {
                // Relayed as it arrives; its first byte is where it claims the result slot.
                return Ok(match next_data(&mut body).await? {
                    Some(first) => {
                        first_byte();
                        Answer::Stream(head, vec![first], body)
                    }
                    None => Answer::Whole(head, Bytes::new()),
                });
            }
            Ok(match read_body(&mut body, limit, first_byte).await? {
                Read::Whole(bytes) => Answer::Whole(head, bytes),
                // Too large to store: relayed like a stream, and kept without its body.
                Read::Over(prefix) => Answer::Stream(head, prefix, body),
            })
        };
        // A job's call is kept alive for its late answer; a keyless call has nobody to
        // settle for once its round gave up.
        let patience = if self.job_id.is_some() {
            self.engine
                .config
                .idempotency
                .late_result_window
                .max(provider.timeout)
        } else {
            provider.timeout
        };
        let sent = tokio::time::Instant::now();
        let outcome = match tokio::time::timeout(patience, exchange).await {
            Err(_) => Outcome::Unknown("no answer within late_result_window".into()),
            Ok(Ok(Answer::Whole(head, body))) => self.classify_answer(StoredResponse {
                status: head.status.as_u16(),
                headers: kept_headers(&head.headers, &[]),
                body,
                body_omitted: false,
            }),
            Ok(Ok(Answer::Stream(head, prefix, body))) => {
                self.engine.metrics.upstream(&provider.name, sent.elapsed());
                return self.relay(&provider, head, prefix, body).await;
            }
            Ok(Err(error)) => self.classify_error(error),
        };
        self.engine.metrics.upstream(&provider.name, sent.elapsed());
        let result = match &outcome {
            Outcome::Final(_) => {
                self.engine.breakers.record_success(index);
                "succeeded"
            }
            Outcome::Definite {
                kind, unhealthy, ..
            } => {
                if *unhealthy {
                    self.engine.breakers.record_failure(index);
                }
                match kind {
                    Failure::Failed => "failed",
                    Failure::ContractRejected => "contract_rejected",
                }
            }
            Outcome::Unknown(_) => "unknown",
        };
        let done = self.settle(outcome).await;
        match &done {
            Done::Lost => {
                self.engine.metrics.race_lost(&provider.name);
                self.engine.metrics.attempt(&provider.name, "lost_race");
            }
            Done::Discarded | Done::Store(_) => {}
            _ => self.engine.metrics.attempt(&provider.name, result),
        }
        // The round may have ended already (after a timeout): then nobody listens.
        let _ = self.events.send(Event::Done(self.n, done));
    }

    fn classify_answer(&self, response: StoredResponse) -> Outcome {
        let status = response.status;
        if status == 504 {
            return Outcome::Unknown("the provider answered 504".into());
        }
        if self.route.failover_on.covers_status(status) {
            return Outcome::Definite {
                kind: Failure::Failed,
                upstream_status: Some(status),
                error: Some(format!("the provider answered {status}")),
                response: Some(response),
                failover: true,
                unhealthy: true,
            };
        }
        if let Some(code) = self.route.failover_on.covered_code(status, &response.body) {
            // The provider refused the request (e.g. an over-long prompt): nothing ran, so
            // another provider may take it; it says nothing about the provider's health.
            return Outcome::Definite {
                kind: Failure::Failed,
                upstream_status: Some(status),
                error: Some(format!("the provider answered {status} {code}")),
                response: Some(response),
                failover: true,
                unhealthy: false,
            };
        }
        if (200..300).contains(&status) {
            if let Some(missing) =
                crate::contract::violation(self.route.contract.as_ref(), &response.body)
            {
                return Outcome::Definite {
                    kind: Failure::ContractRejected,
                    upstream_status: Some(status),
                    error: Some(missing),
                    response: None,
                    failover: true,
                    unhealthy: true,
                };
            }
        }
        Outcome::Final(response)
    }

    fn classify_error(&self, error: CallError) -> Outcome {
        let text = error.to_string();
        match error {
            CallError::Connect(_) | CallError::NotSent(_) => Outcome::Definite {
                kind: Failure::Failed,
                upstream_status: None,
                response: None,
                error: Some(text),
                failover: self.route.failover_on.connect,
                unhealthy: true,
            },
            CallError::Reset(_) if self.route.failover_on.reset => Outcome::Definite {
                kind: Failure::Failed,
                upstream_status: None,
                response: None,
                error: Some(text),
                failover: true,
                unhealthy: true,
            },
            CallError::Reset(_) | CallError::Broken(_) => Outcome::Unknown(text),
        }
    }

    async fn settle(&self, outcome: Outcome) -> Done {
        let Some(job_id) = &self.job_id else {
            return match outcome {
                Outcome::Final(response) => Done::Won(response),
                Outcome::Definite {
                    response, failover, ..
                } => Done::Failed { response, failover },
                Outcome::Unknown(_) => Done::Unknown,
            };
        };
        let n = self.n;
        match outcome {
            Outcome::Final(response) => {
                let complete = Transition::Complete {
                    n,
                    response: response.clone(),
                };
                match self.engine.apply(job_id, complete).await {
                    Ok(Applied {
                        outcome: Ok(Effect::Won),
                        record,
                    }) => Done::Won(match record.job.response {
                        // The answer as stored, which is this one: what the client gets
                        // first is then what every replay gives, whatever took the slot.
                        Some(stored) if !stored.body_omitted => stored,
                        _ => response,
                    }),
                    Ok(Applied {
                        outcome: Ok(Effect::LostRace { completed_by }),
                        ..
                    }) => {
                        warn!(job_id = %job_id, attempt = n, winner = ?completed_by,
                            "attempt lost the race; its answer is dropped");
                        Done::Lost
                    }
                    Ok(_) => {
                        info!(job_id = %job_id, attempt = n, "late answer discarded: the attempt was cancelled");
                        Done::Discarded
                    }
                    Err(e) => Done::Store(e),
                }
            }
            Outcome::Definite {
                kind,
                upstream_status,
                response,
                error,
                failover,
                ..
            } => {
                let fail = Transition::FailAttempt {
                    n,
                    kind,
                    upstream_status,
                    error,
                };
                match self.engine.apply(job_id, fail).await {
                    Ok(_) => Done::Failed { response, failover },
                    Err(e) => Done::Store(e),
                }
            }
            Outcome::Unknown(error) => {
                match self
                    .engine
                    .apply(job_id, Transition::AttemptUnknown { n, error })
                    .await
                {
                    Ok(_) => Done::Unknown,
                    Err(e) => Done::Store(e),
                }
            }
        }
    }
}
