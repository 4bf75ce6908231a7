//! Streamed responses (`stream: true`): server-sent events, one JSON chunk per `data:` line,
//! `data: [DONE]` last.
//!
//! A task drives the [`Generation`] and sends events into a channel that the response body
//! reads. When the client goes away the body is dropped, the channel closes, the task returns and
//! drops the generation, which aborts the engine requests. A failure after the first byte cannot
//! change the status any more: it is sent as `data: {"error": {...}}`, then `[DONE]`.

use std::convert::Infallible;

use axum::http::header;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use ferrolm_engine::{FinishReason, RequestOutput};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::ApiError;
use crate::generation::Generation;
use crate::protocol::Usage;

/// How one route turns outputs into chunks.
pub trait ChunkFormat: Send + 'static {
    /// Whether a choice's chunks need its prompt's logprobs (an echo with logprobs): its outputs
    /// wait until they arrive with the first output of the prompt's sequence 0.
    fn needs_prompt_logprobs(&self) -> bool;

    /// The chunks for one output of `choice`; `first` on the choice's first output.
    fn chunks(
        &mut self,
        generation: &Generation,
        choice: usize,
        out: &RequestOutput,
        first: bool,
    ) -> Result<Vec<String>, ApiError>;

    /// The last chunk when the client asked for usage (`stream_options.include_usage`).
    fn usage_chunk(&self, usage: Usage) -> Option<Result<String, ApiError>>;
}

pub fn to_json(value: &impl Serialize) -> Result<String, ApiError> {
    serde_json::to_string(value).map_err(|e| ApiError::Internal(format!("cannot serialize a response: {e}")))
}

/// A 200 with a JSON body already serialized.
pub fn json_response(body: String) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

pub fn respond(generation: Generation, format: impl ChunkFormat) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(drive(generation, format, tx));
    // Comment lines keep idle connections (a long prefill) from looking dead to proxies.
    Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response()
}

/// Client gone.
struct Closed;

async fn send(tx: &mpsc::Sender<Result<Event, Infallible>>, data: String) -> Result<(), Closed> {
    tx.send(Ok(Event::default().data(data))).await.map_err(|_| Closed)
}

async fn drive(mut generation: Generation, mut format: impl ChunkFormat, tx: mpsc::Sender<Result<Event, Infallible>>) {
    let result = stream_chunks(&mut generation, &mut format, &tx).await;
    let ending = match result {
        Ok(()) => Ok(()),
        Err(StreamEnd::Closed) => return,
        Err(StreamEnd::Failed(err)) => {
            tracing::warn!(request_id = %generation.request_id, error = %err, "stream failed");
            let body = serde_json::json!({ "error": err.body() });
            send(&tx, body.to_string()).await
        }
    };
    if ending.is_ok() {
        let _ = send(&tx, "[DONE]".to_string()).await;
    }
    // NOTE: the request's metrics and log line are recorded when the generation drops; do that
    // before `tx` drops and ends the body, so that a client who read `[DONE]` sees them.
    drop(generation);
    drop(tx);
}

enum StreamEnd {
    Closed,
    Failed(ApiError),
}

impl From<Closed> for StreamEnd {
    fn from(_: Closed) -> Self {
        StreamEnd::Closed
    }
}

impl From<ApiError> for StreamEnd {
    fn from(err: ApiError) -> Self {
        StreamEnd::Failed(err)
    }
}

async fn stream_chunks(
    generation: &mut Generation,
    format: &mut impl ChunkFormat,
    tx: &mpsc::Sender<Result<Event, Infallible>>,
) -> Result<(), StreamEnd> {
    let mut started = vec![false; generation.choices.len()];
    // Outputs held back until their prompt's logprobs arrive.
    let mut deferred: Vec<(usize, RequestOutput)> = Vec::new();
    loop {
        let item = tokio::select! {
            biased;
            _ = tx.closed() => return Err(StreamEnd::Closed),
            item = generation.next() => item,
        };
        let Some(item) = item else { break };
        let (choice, out) = match item {
            Ok(item) => item,
            Err(ApiError::ShuttingDown) => {
                return end_aborted(generation, format, tx, Pending { started: &mut started, deferred }).await
            }
            Err(err) => return Err(err.into()),
        };
        deferred.push((choice, out));
        let mut i = 0;
        while i < deferred.len() {
            let choice = deferred[i].0;
            let ready =
                !format.needs_prompt_logprobs() || generation.prompt_logprobs[generation.prompt_of(choice)].is_some();
            if !ready {
                i += 1;
                continue;
            }
            let (choice, out) = deferred.remove(i);
            let first = !std::mem::replace(&mut started[choice], true);
            // A choice's first chunk of an echo with logprobs decodes every prompt row's top
            // tokens: thousands of rows, built while this worker's other tasks move elsewhere.
            let heavy = first && format.needs_prompt_logprobs();
            let chunks = if heavy {
                off_the_async_worker(|| format.chunks(generation, choice, &out, first))?
            } else {
                format.chunks(generation, choice, &out, first)?
            };
            for chunk in chunks {
                send(tx, chunk).await?;
            }
        }
    }
    generation.check_finished()?;
    if let Some(chunk) = format.usage_chunk(generation.usage()) {
        send(tx, chunk?).await?;
    }
    Ok(())
}

/// The server aborted the request (its shutdown grace period is over): every choice still going
/// ends with `finish_reason: "abort"`, then comes the usage chunk if one was asked for, so that
/// the client learns how its stream ended and what it was billed.
/// Runs CPU-heavy work in a stream's task after handing the worker's other tasks to other
/// threads (on the multi-threaded runtime the server uses; inline elsewhere).
fn off_the_async_worker<T>(work: impl FnOnce() -> T) -> T {
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi_thread {
        tokio::task::block_in_place(work)
    } else {
        work()
    }
}

/// Where a stream stands when the server aborts it: which choices have sent a chunk, and the
/// outputs still held back for their prompt's logprobs.
struct Pending<'a> {
    started: &'a mut [bool],
    deferred: Vec<(usize, RequestOutput)>,
}

async fn end_aborted(
    generation: &mut Generation,
    format: &mut impl ChunkFormat,
    tx: &mpsc::Sender<Result<Event, Infallible>>,
    pending: Pending<'_>,
) -> Result<(), StreamEnd> {
    tracing::warn!(request_id = %generation.request_id, "stream aborted at shutdown");
    let Pending { started, deferred } = pending;
    // Held-back outputs go out without the prompt logprobs that never came, so that a choice
    // that had finished still shows how.
    for (choice, out) in deferred {
        let first = !std::mem::replace(&mut started[choice], true);
        for chunk in format.chunks(generation, choice, &out, first)? {
            send(tx, chunk).await?;
        }
    }
    let going: Vec<usize> = (0..generation.choices.len()).filter(|&c| generation.choices[c].finish.is_none()).collect();
    for choice in going {
        let out = RequestOutput {
            index: (choice % generation.n) as u32,
            finish_reason: Some(FinishReason::Abort),
            ..RequestOutput::default()
        };
        let first = !std::mem::replace(&mut started[choice], true);
        for chunk in format.chunks(generation, choice, &out, first)? {
            send(tx, chunk).await?;
        }
    }
    if let Some(chunk) = format.usage_chunk(generation.usage()) {
        send(tx, chunk?).await?;
    }
    Ok(())
}
