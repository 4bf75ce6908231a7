//! The connection layer under the router: ferrolm's own accept loop over hyper's HTTP/1
//! connections, so that no single client can hold the server's connections, memory or shutdown.
//!
//! - [`accept`]: the accept loop, the cap on open connections (beyond it a connection is answered
//!   503 and closed), back-off on accept errors such as EMFILE, and the drain at shutdown.
//! - `activity`: where each connection stands (awaiting a request head, busy with a request, or
//!   finishing its response), shared by the three pieces below.
//! - `io`: the socket as hyper sees it. It enforces the head and idle timeouts and replaces hyper's
//!   bodiless transport-error responses with OpenAI-shaped ones.
//! - `peer`: with half-close on, whether a client that sent its FIN during its request is still
//!   there to read the answer (else the request is aborted).
//! - `service`: each request on the router, its body under a deadline (408 when it runs out).
//! - `transport`: raw error responses written outside any handler, and what was wrong with a head.
//! - [`fd_limit`]: the process's open-files limit (every connection is a file descriptor).
//!
//! Timeouts, and why they are not hyper's: hyper 1.x's `header_read_timeout` starts whenever hyper
//! begins to read a head, idle keep-alive waits included (`Conn::idle` re-arms it), so one timer
//! would close idle connections after the header timeout. Here a connection's clock depends on its
//! phase: a new connection must deliver a complete head within `header_timeout` of being
//! accepted; a kept-alive one may stay silent for `idle_timeout`, and once the first byte of its
//! next head arrives, the head must be complete within `header_timeout`; a body must be complete
//! within `body_timeout` of its head. A head that times out part-way is answered 408; a silent
//! connection is closed without a response (a pooled client may be about to reuse it).
//!
//! Transport errors: hyper answers a request line or header it cannot parse, a bad
//! `Content-Length` or an oversized head with a bodiless 400/414/431 that it writes itself. While a
//! connection awaits a head (the previous response fully flushed, no request since), nothing else
//! can be written to it, so `io` recognises that response there, swallows it and writes an
//! OpenAI-shaped one with the same status instead, its message diagnosed from the head's first
//! bytes. A malformed head pipelined behind a request whose response is still being flushed keeps
//! hyper's bodiless answer.
//!
//! Invariants: every accepted connection holds one permit of the connection semaphore until its
//! task ends, so the permits in use are the open connections; an error response written outside
//! hyper is followed by a write shutdown and a bounded drain of what the client still sends, so
//! the client reads the response instead of a reset.

pub(crate) mod accept;
mod activity;
pub mod fd_limit;
mod io;
mod peer;
mod service;
mod transport;

use std::time::Duration;

/// Limits on each client connection. `ferrolm serve` fills these from its `--http-*-timeout` and
/// `--max-connections` flags.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// A request head must be complete this long after the connection opens or after the first
    /// byte of a later head arrives; a partial head is then answered 408 and the connection closed.
    pub header_timeout: Duration,
    /// A request body must be complete this long after its head: 408 and the connection closed.
    pub body_timeout: Duration,
    /// A kept-alive connection with no request in progress is closed after this long.
    pub idle_timeout: Duration,
    /// Open connections at most; beyond them a new connection is answered 503 and closed.
    pub max_connections: usize,
    /// Largest request head (request line and headers) in bytes; larger is answered 431.
    pub max_head_bytes: usize,
    /// Most headers in a request; more is answered 431.
    pub max_headers: usize,
}

impl Default for ConnectionLimits {
    fn default() -> ConnectionLimits {
        ConnectionLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            max_connections: 2048,
            max_head_bytes: 64 << 10,
            max_headers: 100,
        }
    }
}

/// Longest accepted timeout: a day is "never" for a request, and deadlines stay far from overflow.
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// A smaller head limit would refuse ordinary clients (browsers send several KiB of cookies).
const MIN_HEAD_BYTES: usize = 8192;

impl ConnectionLimits {
    /// Checks the limits, naming the field that is out of range.
    pub fn validate(&self) -> Result<(), String> {
        for (name, value) in [
            ("header_timeout", self.header_timeout),
            ("body_timeout", self.body_timeout),
            ("idle_timeout", self.idle_timeout),
        ] {
            if value.is_zero() || value > MAX_TIMEOUT {
                let max = MAX_TIMEOUT.as_secs();
                return Err(format!("{name} must be in (0, {max}] s, got {} s", value.as_secs_f64()));
            }
        }
        if self.max_connections == 0 || u32::try_from(self.max_connections).is_err() {
            return Err(format!("max_connections must be in 1..={}, got {}", u32::MAX, self.max_connections));
        }
        if self.max_head_bytes < MIN_HEAD_BYTES {
            return Err(format!("max_head_bytes must be at least {MIN_HEAD_BYTES}, got {}", self.max_head_bytes));
        }
        if self.max_headers == 0 {
            return Err("max_headers must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_out_of_range_name_their_field() {
        assert_eq!(ConnectionLimits::default().validate(), Ok(()));
        let cases = [
            (ConnectionLimits { header_timeout: Duration::ZERO, ..Default::default() }, "header_timeout"),
            (ConnectionLimits { idle_timeout: MAX_TIMEOUT * 2, ..Default::default() }, "idle_timeout"),
            (ConnectionLimits { max_connections: 0, ..Default::default() }, "max_connections"),
            (ConnectionLimits { max_head_bytes: 100, ..Default::default() }, "max_head_bytes"),
            (ConnectionLimits { max_headers: 0, ..Default::default() }, "max_headers"),
        ];
        for (limits, field) in cases {
            let err = limits.validate().expect_err(field);
            assert!(err.starts_with(field), "{err}");
        }
    }
}
