//! The router: every route, the API-key check, the body limit, panic containment, and the
//! OpenAI-shaped 404 and 405 fallbacks.

pub mod chat;
pub mod completions;
pub mod models;
pub mod tokenize;

use std::any::Any;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tower_http::catch_panic::CatchPanicLayer;

use crate::error::ApiError;
use crate::state::SharedState;

pub fn router(state: SharedState) -> Router {
    let protected = Router::new()
        .route("/v1/completions", post(completions::create))
        .route("/v1/chat/completions", post(chat::create))
        .route("/v1/models", get(models::list))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(SharedState::clone(&state), require_api_key));
    let open = Router::new().route("/health", get(models::health)).route("/metrics", get(models::metrics));
    let app = protected
        .merge(open)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes));
    contain_panics(app).with_state(state)
}

/// A handler that panics answers 500; the connection, the server and other requests go on.
fn contain_panics<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    router.layer(CatchPanicLayer::custom(panic_response))
}

async fn require_api_key(State(state): State<SharedState>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        let given = request
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(request).await
}

/// Compares without stopping at the first difference, so timing does not reveal the key.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(request: Request) -> ApiError {
    ApiError::RouteNotFound { method: request.method().to_string(), path: request.uri().path().to_string() }
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::MethodNotAllowed { method: request.method().to_string(), path: request.uri().path().to_string() }
}

fn panic_response(panic: Box<dyn Any + Send + 'static>) -> Response {
    let detail = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("unknown panic");
    ApiError::Internal(format!("a handler panicked: {detail}")).into_response()
}

/// Unix time now, for `created`.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A fresh response id such as `cmpl-3f9c...`.
pub(crate) fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_handler_answers_500_and_the_server_goes_on() -> Result<(), Box<dyn std::error::Error>> {
        async fn boom() -> &'static str {
            panic!("boom")
        }
        let app: Router = contain_panics(Router::new().route("/boom", get(boom)).route("/ok", get(|| async { "ok" })));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::new();
        for _ in 0..2 {
            let resp = client.get(format!("http://{addr}/boom")).send().await?;
            assert_eq!(resp.status().as_u16(), 500);
            let body: serde_json::Value = serde_json::from_str(&resp.text().await?)?;
            assert_eq!(body["error"]["type"], "server_error");
            assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("boom")), "{body}");
        }
        let resp = client.get(format!("http://{addr}/ok")).send().await?;
        assert_eq!(resp.text().await?, "ok");
        Ok(())
    }

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
