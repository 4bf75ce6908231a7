//! The socket as hyper sees it: the head and idle timeouts, and OpenAI-shaped answers in place of
//! hyper's bodiless transport errors (the module doc of [`super`] says why these live here).
//!
//! hyper polls its socket for reads whenever it waits for a request head, so a read that finds
//! nothing is where the head deadline is armed and checked. When it passes, a connection with
//! part of a head is answered 408; a silent one reads as closed by the client, which hyper takes
//! as the end of a kept-alive connection.
//!
//! Its flush, which hyper calls on every turn of the connection task, also checks on the client
//! of a request in progress (see `peer`).
//!
//! Invariant: once an `Ending` begins, nothing hyper writes reaches the socket; the ending writes
//! its response, shuts the socket down for writing, drains what the client still sends (bounded
//! in bytes and time, so the response is not lost to a reset), and every read after it is EOF.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use super::activity::Activity;
use super::peer::PeerWatch;
use super::transport::{self, LINGER, LINGER_BYTES};
use crate::error::ApiError;
use crate::ConnectionLimits;

pub(super) struct GuardedIo {
    stream: TcpStream,
    activity: Arc<Activity>,
    limits: Arc<ConnectionLimits>,
    /// The head deadline, allocated on the first read that finds nothing.
    deadline: Option<Pin<Box<Sleep>>>,
    ending: Option<Ending>,
    /// A silent connection timed out: it reads as closed.
    eof: bool,
    peer: PeerWatch,
}

/// The connection ends with a response of ours.
struct Ending {
    response: Vec<u8>,
    written: usize,
    step: EndStep,
    linger: Pin<Box<Sleep>>,
    drained: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EndStep {
    Write,
    Shutdown,
    Drain,
    Done,
}

impl GuardedIo {
    pub fn new(stream: TcpStream, activity: Arc<Activity>, limits: Arc<ConnectionLimits>) -> GuardedIo {
        GuardedIo { stream, activity, limits, deadline: None, ending: None, eof: false, peer: PeerWatch::default() }
    }

    fn begin_ending(&mut self, error: &ApiError) {
        tracing::debug!(status = error.status().as_u16(), %error, "closing a connection with an error response");
        self.ending = Some(Ending {
            response: transport::error_response(error),
            written: 0,
            step: EndStep::Write,
            linger: Box::pin(tokio::time::sleep(LINGER)),
            drained: 0,
        });
    }

    /// Drives the ending to its end; errors only mean the client is gone, which ends it too.
    fn poll_ending(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(ending) = self.ending.as_mut() else { return Poll::Ready(()) };
        let stream = Pin::new(&mut self.stream);
        ending.poll(stream, cx)
    }

    /// Called when a read found nothing: arms the head deadline, and acts on it once passed.
    fn poll_head_deadline(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let limits = &self.limits;
        let Some(deadline) = self.activity.head_deadline(limits.header_timeout, limits.idle_timeout) else {
            return Poll::Pending;
        };
        let at = tokio::time::Instant::from_std(deadline.at);
        let sleep = match &mut self.deadline {
            Some(sleep) => {
                if sleep.deadline() != at {
                    sleep.as_mut().reset(at);
                }
                sleep
            }
            None => self.deadline.insert(Box::pin(tokio::time::sleep_until(at))),
        };
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        if !deadline.partial {
            tracing::debug!("closing a connection that sent no request in time");
            self.eof = true;
            return Poll::Ready(Ok(()));
        }
        self.begin_ending(&ApiError::HeadTimeout { timeout_s: self.limits.header_timeout.as_secs_f64() });
        ready!(self.poll_ending(cx));
        Poll::Ready(Ok(()))
    }

    /// While the connection awaits a head, what hyper writes is its answer to a head it refused:
    /// begins an ending with ours instead and returns true.
    fn replaces(&mut self, written: &[u8]) -> bool {
        let Some(status) = transport::response_status(written) else { return false };
        let Some(sample) = self.activity.head_sample() else { return false };
        let Some(error) = transport::transport_error(status, &sample, &self.limits) else { return false };
        self.begin_ending(&error);
        true
    }
}

impl Ending {
    fn poll(&mut self, mut stream: Pin<&mut TcpStream>, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            self.step = match self.step {
                EndStep::Write => match ready!(stream.as_mut().poll_write(cx, &self.response[self.written..])) {
                    Ok(n) if n > 0 => {
                        self.written += n;
                        if self.written < self.response.len() {
                            continue;
                        }
                        EndStep::Shutdown
                    }
                    Ok(_) | Err(_) => EndStep::Done,
                },
                EndStep::Shutdown => match ready!(stream.as_mut().poll_shutdown(cx)) {
                    Ok(()) => EndStep::Drain,
                    Err(_) => EndStep::Done,
                },
                EndStep::Drain => {
                    if self.linger.as_mut().poll(cx).is_ready() {
                        EndStep::Done
                    } else {
                        let mut scratch = [0u8; 4096];
                        let mut buf = ReadBuf::new(&mut scratch);
                        match ready!(stream.as_mut().poll_read(cx, &mut buf)) {
                            Ok(()) if !buf.filled().is_empty() => {
                                self.drained += buf.filled().len();
                                if self.drained < LINGER_BYTES {
                                    continue;
                                }
                                EndStep::Done
                            }
                            Ok(()) | Err(_) => EndStep::Done,
                        }
                    }
                }
                EndStep::Done => return Poll::Ready(()),
            };
        }
    }
}

impl AsyncRead for GuardedIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.ending.is_some() {
            ready!(this.poll_ending(cx));
            return Poll::Ready(Ok(()));
        }
        if this.eof {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                this.activity.bytes_read(&buf.filled()[before..]);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(err)) => Poll::Ready(Err(err)),
            Poll::Pending => this.poll_head_deadline(cx),
        }
    }
}

impl AsyncWrite for GuardedIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.ending.is_some() || this.replaces(buf) {
            return Poll::Ready(Ok(buf.len()));
        }
        ready!(this.peer.poll_probe_written(&mut this.stream, cx))?;
        this.activity.wrote();
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| &b[..]);
        if this.ending.is_some() || this.replaces(first) {
            return Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()));
        }
        ready!(this.peer.poll_probe_written(&mut this.stream, cx))?;
        this.activity.wrote();
        Pin::new(&mut this.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.ending.is_some() {
            ready!(this.poll_ending(cx));
            return Poll::Ready(Ok(()));
        }
        ready!(Pin::new(&mut this.stream).poll_flush(cx))?;
        if this.activity.flushed() {
            // The connection now awaits a head: have hyper read again, so that the read finding
            // nothing arms the idle deadline.
            cx.waker().wake_by_ref();
        }
        match this.activity.may_send_interim() {
            Some(may_probe) => Poll::Ready(this.peer.poll(&mut this.stream, cx, may_probe)),
            None => {
                this.peer.reset();
                Poll::Ready(Ok(()))
            }
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.ending.is_some() {
            ready!(this.poll_ending(cx));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.stream).poll_shutdown(cx)
    }
}
