//! The accept loop and the set of open connections.
//!
//! Each accepted connection takes a permit of a semaphore of `max_connections` permits and holds
//! it until its task ends; with none left, the connection is answered 503 with `Retry-After` by a
//! small task of its own (at most [`MAX_REFUSING`] at once; beyond them it is closed unanswered).
//! Accept errors that concern one connection are skipped; others (EMFILE, ENFILE, ENOBUFS) are
//! retried after a back-off that doubles up to one second, so the server outlives them.
//!
//! Shutdown goes in stages, told to every connection through one watch channel: `Draining`
//! (connections awaiting a head close at once, busy ones after their response) and `Closing`
//! (every connection still open is dropped). The server waits for the permits to come back.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use super::activity::Activity;
use super::io::GuardedIo;
use super::service::RequestService;
use super::transport::{self, LINGER, LINGER_BYTES};
use crate::error::ApiError;
use crate::ConnectionLimits;

/// Connections beyond the cap being answered 503 at once, at most.
const MAX_REFUSING: usize = 64;
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Serving,
    Draining,
    Closing,
}

/// The server's open connections.
pub(crate) struct Connections {
    shared: Arc<Shared>,
    permits: Arc<Semaphore>,
    refusing: Arc<Semaphore>,
    stage: watch::Sender<Stage>,
    /// The 503 a connection beyond the cap gets.
    refusal: Arc<[u8]>,
    /// Whether the last connection was refused, so the cap is logged once each time it is reached.
    at_cap: AtomicBool,
}

/// What every connection task needs.
struct Shared {
    router: Router,
    limits: Arc<ConnectionLimits>,
    http: http1::Builder,
}

impl Connections {
    /// `limits` must have passed [`ConnectionLimits::validate`].
    pub fn new(router: Router, limits: ConnectionLimits) -> Connections {
        let mut http = http1::Builder::new();
        http.half_close(true)
            .keep_alive(true)
            // The head and idle clocks are `GuardedIo`'s (see the module doc of `conn`).
            .header_read_timeout(None)
            .max_header_size(limits.max_head_bytes)
            .max_headers(limits.max_headers);
        let refusal = transport::error_response(&ApiError::TooManyConnections { limit: limits.max_connections });
        let (stage, _) = watch::channel(Stage::Serving);
        Connections {
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            refusing: Arc::new(Semaphore::new(MAX_REFUSING)),
            stage,
            refusal: refusal.into(),
            at_cap: AtomicBool::new(false),
            shared: Arc::new(Shared { router, limits: Arc::new(limits), http }),
        }
    }

    /// Accepts connections until `stop` resolves, then drops the listener.
    pub async fn accept_until(&self, listener: TcpListener, stop: impl Future<Output = ()>) {
        let mut stop = std::pin::pin!(stop);
        let mut backoff = ACCEPT_BACKOFF_MIN;
        loop {
            let accepted = tokio::select! {
                () = &mut stop => return,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, peer)) => {
                    backoff = ACCEPT_BACKOFF_MIN;
                    self.admit(stream, peer);
                }
                Err(err) if concerns_one_connection(&err) => {}
                Err(err) => {
                    tracing::warn!(error = %err, retry_in_ms = backoff.as_millis() as u64, "cannot accept connections");
                    tokio::select! {
                        () = &mut stop => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                }
            }
        }
    }

    fn admit(&self, stream: TcpStream, peer: SocketAddr) {
        // Streamed tokens are small writes: do not hold them back for an ACK.
        let _ = stream.set_nodelay(true);
        match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(permit) => {
                self.at_cap.store(false, Ordering::Relaxed);
                let stage = self.stage.subscribe();
                tokio::spawn(serve(Arc::clone(&self.shared), stream, peer, stage, permit));
            }
            Err(_) => self.refuse(stream, peer),
        }
    }

    fn refuse(&self, stream: TcpStream, peer: SocketAddr) {
        if !self.at_cap.swap(true, Ordering::Relaxed) {
            let limit = self.shared.limits.max_connections;
            tracing::warn!(limit, "connection limit reached: new connections are answered 503 until some close");
        }
        tracing::debug!(%peer, "refusing a connection beyond the limit");
        let Ok(permit) = Arc::clone(&self.refusing).try_acquire_owned() else { return };
        let refusal = Arc::clone(&self.refusal);
        tokio::spawn(async move {
            let _permit = permit;
            let _ = tokio::time::timeout(LINGER, answer_and_close(stream, &refusal)).await;
        });
    }

    /// Asks every connection to finish: those awaiting a head close at once, busy ones after
    /// their response.
    pub fn drain(&self) {
        self.stage.send_replace(Stage::Draining);
    }

    /// Resolves once every connection has closed.
    pub async fn closed(&self) {
        let all = u32::try_from(self.shared.limits.max_connections).unwrap_or(u32::MAX);
        let _ = self.permits.acquire_many(all).await;
    }

    /// Drops every connection still open.
    pub fn close_all(&self) {
        self.stage.send_replace(Stage::Closing);
    }
}

/// Accept errors after which the listener goes on accepting at once (as hyper's and axum's
/// loops treat them).
fn concerns_one_connection(err: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(err.kind(), K::ConnectionRefused | K::ConnectionAborted | K::ConnectionReset)
}

/// Writes `response`, shuts the socket down for writing and drains what the client sends so
/// that it reads the response rather than a reset.
async fn answer_and_close(mut stream: TcpStream, response: &[u8]) -> std::io::Result<()> {
    stream.write_all(response).await?;
    stream.shutdown().await?;
    let mut scratch = [0u8; 4096];
    let mut drained = 0;
    while drained < LINGER_BYTES {
        match stream.read(&mut scratch).await? {
            0 => break,
            n => drained += n,
        }
    }
    Ok(())
}

/// Resolves once the server's stage satisfies `reached` (or the server is gone).
async fn until(stage: &mut watch::Receiver<Stage>, reached: impl FnMut(&Stage) -> bool) {
    let _ = stage.wait_for(reached).await;
}

/// One connection, from accept to close; `_permit` counts it as open.
async fn serve(
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    mut stage: watch::Receiver<Stage>,
    _permit: OwnedSemaphorePermit,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(GuardedIo::new(stream, Arc::clone(&activity), Arc::clone(&shared.limits)));
    let service = RequestService {
        router: shared.router.clone(),
        activity: Arc::clone(&activity),
        body_timeout: shared.limits.body_timeout,
    };
    let connection = shared.http.serve_connection(io, service);
    let mut connection = std::pin::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = until(&mut stage, |s| *s != Stage::Serving) => {
            if activity.awaiting_head() {
                return;
            }
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                result = connection.as_mut() => result,
                () = until(&mut stage, |s| *s == Stage::Closing) => return,
            }
        }
    };
    if let Err(err) = result {
        tracing::debug!(%peer, error = %err, "connection ended with an error");
    }
}
