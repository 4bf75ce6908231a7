//! Each request of a connection on the router.
//!
//! The request body runs under a deadline of `body_timeout` from its head: when the body is still
//! incomplete then, the handler reading it gets an error, and whatever it answers is replaced by a
//! 408 that closes the connection (a `Content-Length` larger than what is sent ends here). The
//! response body reports its end to the connection's [`Activity`].

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Request, Response, Version};
use axum::response::IntoResponse;
use axum::Router;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::activity::Activity;
use crate::error::ApiError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The router as one connection's hyper service.
pub(super) struct RequestService {
    pub router: Router,
    pub activity: Arc<Activity>,
    pub body_timeout: Duration,
}

impl hyper::service::Service<Request<Incoming>> for RequestService {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<TrackedBody>, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        self.activity.request_started(request.version() == Version::HTTP_10);
        let expired = Arc::new(AtomicBool::new(false));
        let deadline = Instant::now() + self.body_timeout;
        let request = request
            .map(|inner| Body::new(DeadlineBody { inner, deadline, sleep: None, expired: Arc::clone(&expired) }));
        let mut router = self.router.clone();
        let activity = Arc::clone(&self.activity);
        let body_timeout = self.body_timeout;
        Box::pin(async move {
            let Ok(()) = std::future::poll_fn(|cx| Service::<Request<Body>>::poll_ready(&mut router, cx)).await;
            let Ok(response) = router.call(request).await;
            let response = if expired.load(Ordering::Acquire) {
                tracing::debug!(timeout_s = body_timeout.as_secs_f64(), "request body timed out");
                let mut response = ApiError::BodyTimeout { timeout_s: body_timeout.as_secs_f64() }.into_response();
                response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                response
            } else {
                response
            };
            Ok(response.map(|inner| TrackedBody { inner, activity }))
        })
    }
}

/// A request body that fails once its deadline passes with data still to come.
struct DeadlineBody {
    inner: Incoming,
    deadline: Instant,
    /// Allocated the first time the body waits for data.
    sleep: Option<Pin<Box<Sleep>>>,
    /// Set when the deadline passed: the response becomes a 408.
    expired: Arc<AtomicBool>,
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(BoxError::from)));
        }
        let deadline = self.deadline;
        let sleep = self.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.expired.store(true, Ordering::Release);
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "the request body did not arrive in time");
        Poll::Ready(Some(Err(timed_out.into())))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that tells its connection when hyper is done with it.
pub(super) struct TrackedBody {
    inner: Body,
    activity: Arc<Activity>,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        self.activity.response_ended();
    }
}
