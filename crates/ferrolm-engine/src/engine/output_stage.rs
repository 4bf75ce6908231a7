//! The output stage's thread, `ferrolm-output`: between the engine thread and the callers, off
//! both. Every output the engine thread sends comes here; the request's [`OutputProcessor`]
//! fills in its text (detokenized, cut at stop strings) and it goes on to the request's stream.
//! When a stop string matches, the engine is told at once ([`Command::StopSequence`]), so the
//! sequence ends and frees its KV blocks whether or not the client reads its stream.
//!
//! Protocol (one channel of [`OutputEvent`]s, in the order they were sent):
//! - The handle sends `Register` before it sends `Command::Add` to the engine, so a request's
//!   outputs, sent by the engine after it took the `Add`, always find their entry.
//! - An entry goes when every sequence of its request has finished here, when its stream is
//!   dropped (`Forget`, sent with the engine's `Abort`), or when the engine thread is gone
//!   (`EngineStopped`: every stream then ends). Client ids are never reused, so outputs of a
//!   request without an entry are late ones of a finished or dropped request: they are dropped.
//! - The thread ends once every sender is gone: the engine thread's and every handle's and
//!   stream's. It holds no sender of the engine's command channel, so it never keeps the engine
//!   alive (stops go on a channel of their own).
//!
//! [`Command::StopSequence`]: super::handle::Command::StopSequence

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use tokio::sync::mpsc as tokio_mpsc;

use super::handle::Command;
use super::output::{OutputProcessor, Processed};
use super::state::RequestOutput;

pub(crate) enum OutputEvent {
    /// A request about to be sent to the engine: its text state and its stream's sender.
    Register { client_id: u64, processor: OutputProcessor, tx: tokio_mpsc::UnboundedSender<RequestOutput> },
    /// What the engine thread produced for one sequence of a request.
    Output { client_id: u64, output: RequestOutput },
    /// The request's stream was dropped; the engine was told to abort it.
    Forget { client_id: u64 },
    /// The engine thread ended (or failed): no output will come any more.
    EngineStopped,
}

/// The engine thread's sender of one request's outputs.
#[derive(Clone)]
pub(crate) struct OutputSender {
    client_id: u64,
    tx: mpsc::Sender<OutputEvent>,
}

impl OutputSender {
    pub(crate) fn new(client_id: u64, tx: mpsc::Sender<OutputEvent>) -> Self {
        Self { client_id, tx }
    }

    /// Fails only when the output stage is gone.
    pub(crate) fn send(&self, output: RequestOutput) -> Result<(), OutputStageGone> {
        self.tx.send(OutputEvent::Output { client_id: self.client_id, output }).map_err(|_| OutputStageGone)
    }
}

#[derive(Debug)]
pub(crate) struct OutputStageGone;

/// Tells the output stage that the engine thread ended, however it ended (a panic included):
/// held by the engine thread, sent when dropped.
pub(crate) struct EngineStoppedGuard(pub(crate) mpsc::Sender<OutputEvent>);

impl Drop for EngineStoppedGuard {
    fn drop(&mut self) {
        let _ = self.0.send(OutputEvent::EngineStopped);
    }
}

/// One registered request.
struct Entry {
    processor: OutputProcessor,
    tx: tokio_mpsc::UnboundedSender<RequestOutput>,
}

pub(crate) struct OutputStage {
    rx: mpsc::Receiver<OutputEvent>,
    /// To the engine thread: `Command::StopSequence` only.
    stops: mpsc::Sender<Command>,
    requests: HashMap<u64, Entry>,
    /// `requests.len()`, for whoever watches (tests, that nothing is left behind).
    num_requests: Arc<AtomicUsize>,
    engine_stopped: bool,
}

impl OutputStage {
    pub(crate) fn new(
        rx: mpsc::Receiver<OutputEvent>,
        stops: mpsc::Sender<Command>,
        num_requests: Arc<AtomicUsize>,
    ) -> Self {
        Self { rx, stops, requests: HashMap::new(), num_requests, engine_stopped: false }
    }

    pub(crate) fn run(mut self) {
        while let Ok(event) = self.rx.recv() {
            self.handle(event);
            self.num_requests.store(self.requests.len(), Ordering::Relaxed);
        }
    }

    fn handle(&mut self, event: OutputEvent) {
        match event {
            // After the engine stopped, dropping the sender ends the stream at once.
            OutputEvent::Register { .. } if self.engine_stopped => {}
            OutputEvent::Register { client_id, processor, tx } => {
                self.requests.insert(client_id, Entry { processor, tx });
            }
            OutputEvent::Output { client_id, output } => self.output(client_id, output),
            OutputEvent::Forget { client_id } => {
                self.requests.remove(&client_id);
            }
            OutputEvent::EngineStopped => {
                self.engine_stopped = true;
                self.requests.clear();
            }
        }
    }

    fn output(&mut self, client_id: u64, output: RequestOutput) {
        let Some(entry) = self.requests.get_mut(&client_id) else { return };
        let Some(Processed { output, stopped_here }) = entry.processor.process(output) else { return };
        if stopped_here {
            // Before the output goes on: the engine hears of the stop as early as it can.
            let _ = self.stops.send(Command::StopSequence { client_id, index: output.index });
        }
        // A stream that is gone has sent `Forget` too; forgetting it now changes nothing.
        if entry.tx.send(output).is_err() || entry.processor.is_finished() {
            self.requests.remove(&client_id);
        }
    }
}
