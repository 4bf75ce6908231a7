//! Whether the client of a request in progress is still there.
//!
//! With HTTP/1 half-close on, hyper stops reading while a request is in progress, and a client
//! that shut down only its write side (and waits for the answer) sends the same FIN as one that
//! went away. Only a write tells them apart: to a closed socket, the client's kernel answers
//! with a reset. So when the FIN arrives before anything was written for the request, an interim
//! `HTTP/1.1 100 Continue` is written (HTTP/1.1 clients must accept unexpected 1xx responses;
//! HTTP/1.0 ones get none) and the socket's pending error is checked for the reset at growing
//! intervals (10 ms, doubling up to 1 s) until the response begins. A reset
//! fails the connection, which drops the request's handler and so aborts its engine request,
//! as a write error during a streamed response does.
//!
//! `PeerWatch` is driven from the socket wrapper's flush, which hyper calls on every turn of its
//! connection task. Invariant: a probe is written only while hyper's write buffer is empty (hyper
//! flushes the socket only then), and every write of hyper waits for a started probe to finish,
//! so the probe never splits a response.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

const PROBE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";
const FIRST_CHECK: Duration = Duration::from_millis(10);
const MAX_CHECK: Duration = Duration::from_secs(1);

#[derive(Default)]
pub(super) enum PeerWatch {
    /// No FIN seen for the request in progress (or none in progress), or its response has begun.
    #[default]
    Open,
    /// FIN seen; the probe is being written.
    Probing { written: usize },
    /// The probe is out: the socket is checked for a reset.
    Probed { check: Pin<Box<Sleep>>, interval: Duration },
}

impl PeerWatch {
    /// No request in progress any more.
    pub fn reset(&mut self) {
        *self = PeerWatch::Open;
    }

    /// Checks on the client while a request is in progress; `Err` means it is gone.
    /// `may_probe`: nothing has been written for the request yet and it is HTTP/1.1.
    pub fn poll(&mut self, stream: &mut TcpStream, cx: &mut Context<'_>, may_probe: bool) -> io::Result<()> {
        loop {
            match self {
                // Once the response has begun, its own writes meet a reset: nothing to watch.
                PeerWatch::Open if !may_probe => return Ok(()),
                PeerWatch::Open => {
                    let mut byte = [0u8; 1];
                    match stream.poll_peek(cx, &mut ReadBuf::new(&mut byte)) {
                        // Nothing to read (the waker is registered), or data hyper will read.
                        Poll::Pending | Poll::Ready(Ok(1..)) => return Ok(()),
                        Poll::Ready(Ok(_)) => *self = PeerWatch::Probing { written: 0 },
                        Poll::Ready(Err(err)) => return Err(err),
                    }
                }
                PeerWatch::Probing { .. } => {
                    if self.poll_probe_written(stream, cx)?.is_pending() {
                        return Ok(());
                    }
                }
                PeerWatch::Probed { check, interval } => {
                    if check.as_mut().poll(cx).is_pending() {
                        return Ok(());
                    }
                    // NOTE: reads after a FIN report end of file even once a reset has come;
                    // the reset shows only as the socket's pending error (SO_ERROR).
                    if let Some(err) = stream.take_error().unwrap_or_else(Some) {
                        tracing::debug!(error = %err, "the client went away during its request");
                        return Err(err);
                    }
                    *interval = (*interval * 2).min(MAX_CHECK);
                    let next = tokio::time::Instant::now() + *interval;
                    check.as_mut().reset(next);
                }
            }
        }
    }

    /// Finishes a probe in progress; hyper's writes wait for this.
    pub fn poll_probe_written(&mut self, stream: &mut TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let PeerWatch::Probing { written } = self else { return Poll::Ready(Ok(())) };
        while *written < PROBE.len() {
            match ready!(Pin::new(&mut *stream).poll_write(cx, &PROBE[*written..])) {
                Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(n) => *written += n,
                Err(err) => return Poll::Ready(Err(err)),
            }
        }
        tracing::debug!("the client half-closed its connection during its request; probing it");
        *self = PeerWatch::Probed { check: Box::pin(tokio::time::sleep(FIRST_CHECK)), interval: FIRST_CHECK };
        Poll::Ready(Ok(()))
    }
}
