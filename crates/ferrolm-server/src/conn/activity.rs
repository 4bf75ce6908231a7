//! Where one connection stands, as its socket wrapper, its service and its response bodies see it.
//!
//! ```text
//!  AwaitingHead ──service called──▶ Busy ──response body dropped──▶ Finishing
//!       ▲                                                              │
//!       └──────────────── socket flushed (hyper's write buffer empty) ─┘
//! ```
//! hyper drops a response body only after encoding its last bytes into its write buffer, and
//! flushes the socket only once that buffer is empty, so the flush after the drop marks the
//! response as fully written. A pipelined head may start the next request before that flush;
//! `Finishing` then goes straight to `Busy`.
//!
//! Invariant: in `AwaitingHead`, hyper has nothing of ours left to write, so whatever it writes
//! is its own answer to a head it could not parse. In `Busy`, `responded` turns true with the
//! first byte written for the request (an interim `100 Continue` or the response head).

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How many bytes of a head are kept to say what was wrong with it.
pub(super) const HEAD_SAMPLE_BYTES: usize = 8 << 10;

#[derive(Debug)]
enum Phase {
    AwaitingHead {
        /// When the connection was accepted or its previous response flushed.
        since: Instant,
        /// No request yet on this connection: the head clock runs from `since`.
        fresh: bool,
        /// When the first byte of this head arrived.
        first_byte: Option<Instant>,
        /// The head's first bytes, at most [`HEAD_SAMPLE_BYTES`].
        sample: Vec<u8>,
    },
    Busy {
        /// The request is HTTP/1.0: it may not be sent interim (1xx) responses.
        http10: bool,
        responded: bool,
    },
    Finishing,
}

/// What the socket wrapper must do about a connection awaiting a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HeadDeadline {
    pub at: Instant,
    /// Part of a head has arrived: a timeout is answered 408 (else the connection closes silently).
    pub partial: bool,
}

#[derive(Debug)]
pub(super) struct Activity {
    phase: Mutex<Phase>,
}

impl Activity {
    pub fn new() -> Activity {
        let phase = Phase::AwaitingHead { since: Instant::now(), fresh: true, first_byte: None, sample: Vec::new() };
        Activity { phase: Mutex::new(phase) }
    }

    // NOTE: the lock is held for a few instructions and never across an await; a panic while it
    // is held cannot leave the phase half-written, so a poisoned lock is used as it is.
    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// hyper parsed a head and called the service.
    pub fn request_started(&self, http10: bool) {
        *self.phase() = Phase::Busy { http10, responded: false };
    }

    /// Bytes are being written to the socket.
    pub fn wrote(&self) {
        if let Phase::Busy { responded, .. } = &mut *self.phase() {
            *responded = true;
        }
    }

    /// hyper dropped the response body: its last bytes are in hyper's write buffer.
    pub fn response_ended(&self) {
        let mut phase = self.phase();
        if matches!(*phase, Phase::Busy { .. }) {
            *phase = Phase::Finishing;
        }
    }

    /// While a request is in progress: whether an interim `100 Continue` may still be written
    /// (nothing written for it yet, and not HTTP/1.0). `None` when no request is in progress.
    pub fn may_send_interim(&self) -> Option<bool> {
        match &*self.phase() {
            Phase::Busy { http10, responded } => Some(!http10 && !responded),
            Phase::AwaitingHead { .. } | Phase::Finishing => None,
        }
    }

    /// The socket was flushed. Returns true when that ended a response (the connection now
    /// awaits a head, and its deadline must be armed).
    pub fn flushed(&self) -> bool {
        let mut phase = self.phase();
        if !matches!(*phase, Phase::Finishing) {
            return false;
        }
        *phase = Phase::AwaitingHead { since: Instant::now(), fresh: false, first_byte: None, sample: Vec::new() };
        true
    }

    /// Bytes were read from the socket.
    pub fn bytes_read(&self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if let Phase::AwaitingHead { first_byte, sample, .. } = &mut *self.phase() {
            first_byte.get_or_insert_with(Instant::now);
            let room = HEAD_SAMPLE_BYTES.saturating_sub(sample.len());
            sample.extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
    }

    pub fn awaiting_head(&self) -> bool {
        matches!(*self.phase(), Phase::AwaitingHead { .. })
    }

    /// When the connection must be closed if no head has been parsed by then; `None` unless it
    /// awaits a head.
    pub fn head_deadline(&self, header_timeout: Duration, idle_timeout: Duration) -> Option<HeadDeadline> {
        match &*self.phase() {
            Phase::AwaitingHead { since, fresh: true, first_byte, .. } => {
                Some(HeadDeadline { at: *since + header_timeout, partial: first_byte.is_some() })
            }
            Phase::AwaitingHead { since, fresh: false, first_byte: None, .. } => {
                Some(HeadDeadline { at: *since + idle_timeout, partial: false })
            }
            Phase::AwaitingHead { first_byte: Some(first), .. } => {
                Some(HeadDeadline { at: *first + header_timeout, partial: true })
            }
            Phase::Busy { .. } | Phase::Finishing => None,
        }
    }

    /// The first bytes of the head being read, when the connection awaits one.
    pub fn head_sample(&self) -> Option<Vec<u8>> {
        match &*self.phase() {
            Phase::AwaitingHead { sample, .. } => Some(sample.clone()),
            Phase::Busy { .. } | Phase::Finishing => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD: Duration = Duration::from_secs(10);
    const IDLE: Duration = Duration::from_secs(60);

    #[test]
    fn a_new_connection_runs_the_head_clock_from_its_start() {
        let activity = Activity::new();
        let silent = activity.head_deadline(HEAD, IDLE).expect("awaits a head");
        assert!(!silent.partial);
        activity.bytes_read(b"GET / HT");
        let partial = activity.head_deadline(HEAD, IDLE).expect("awaits a head");
        assert!(partial.partial);
        assert_eq!(partial.at, silent.at, "the first byte does not extend a new connection's deadline");
        assert_eq!(activity.head_sample().as_deref(), Some(&b"GET / HT"[..]));
    }

    #[test]
    fn a_response_is_over_only_once_flushed_after_its_body() {
        let activity = Activity::new();
        activity.request_started(false);
        assert_eq!(activity.may_send_interim(), Some(true));
        assert!(!activity.flushed(), "a flush mid-response ends nothing");
        assert_eq!(activity.head_deadline(HEAD, IDLE), None);
        activity.bytes_read(b"{\"prompt\": 1}");
        activity.wrote();
        assert_eq!(activity.may_send_interim(), Some(false), "the response has begun");
        activity.response_ended();
        assert_eq!(activity.may_send_interim(), None);
        assert!(!activity.awaiting_head());
        assert!(activity.flushed());
        let idle = activity.head_deadline(HEAD, IDLE).expect("awaits a head");
        assert!(!idle.partial);
        assert!(idle.at > Instant::now() + HEAD, "a kept-alive connection gets the idle timeout");
        assert_eq!(activity.head_sample(), Some(Vec::new()), "the body is not part of the next head");
        activity.bytes_read(b"G");
        let partial = activity.head_deadline(HEAD, IDLE).expect("awaits a head");
        assert!(partial.partial && partial.at <= Instant::now() + HEAD);
    }

    #[test]
    fn a_pipelined_request_goes_from_finishing_to_busy() {
        let activity = Activity::new();
        activity.request_started(false);
        activity.response_ended();
        activity.request_started(true);
        assert_eq!(activity.may_send_interim(), Some(false), "never to HTTP/1.0");
        assert!(!activity.flushed());
        assert!(!activity.awaiting_head());
    }

    #[test]
    fn the_head_sample_is_bounded() {
        let activity = Activity::new();
        activity.bytes_read(&vec![b'a'; HEAD_SAMPLE_BYTES + 10]);
        activity.bytes_read(b"more");
        assert_eq!(activity.head_sample().map(|s| s.len()), Some(HEAD_SAMPLE_BYTES));
    }
}
