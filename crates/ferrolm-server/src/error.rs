//! The one place where errors become HTTP responses.
//!
//! Every failure a handler can meet is an [`ApiError`]; [`ApiError::status`] picks the HTTP status
//! and the response body is always OpenAI's shape:
//! `{"error": {"message": "...", "type": "...", "param": ..., "code": ...}}`.
//! 4xx are the client's fault (bad JSON, bad values, unknown model or route, a full queue);
//! 5xx only for faults inside the server.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use ferrolm_engine::EngineError;
use ferrolm_sampling::SamplingError;
use ferrolm_tokenizer::TokenizerError;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A request the server understood but cannot serve as asked.
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String> },
    /// A body that is not JSON, or JSON of the wrong shape.
    #[error("{message}")]
    InvalidJson { message: String, param: Option<String> },
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("no route for {method} {path}")]
    RouteNotFound { method: String, path: String },
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("the request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("Incorrect or missing API key: pass it as `Authorization: Bearer <key>`.")]
    Unauthorized,
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("the server is shutting down")]
    ShuttingDown,
    /// Transport level: a request line or header hyper could not parse, or a bad `Content-Length`.
    #[error("{0}")]
    MalformedRequest(String),
    #[error("the request head is too large: at most {max_bytes} bytes and {max_headers} headers are accepted")]
    HeadTooLarge { max_bytes: usize, max_headers: usize },
    #[error("the request URI is too long")]
    UriTooLong,
    #[error("the request head did not arrive within {timeout_s} s")]
    HeadTimeout { timeout_s: f64 },
    #[error("the request body did not arrive within {timeout_s} s")]
    BodyTimeout { timeout_s: f64 },
    #[error("the server has {limit} connections open, its limit: retry later")]
    TooManyConnections { limit: usize },
    #[error("internal server error: {0}")]
    Internal(String),
}

/// The `error` object of an OpenAI error body; also sent as a `data:` event when a stream fails
/// after its first chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

#[derive(Serialize)]
struct ErrorEnvelope {
    error: ErrorBody,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError::InvalidRequest { message: message.into(), param: param.map(str::to_string) }
    }

    pub fn status(&self) -> StatusCode {
        use ApiError as E;
        match self {
            E::InvalidRequest { .. } | E::InvalidJson { .. } => StatusCode::BAD_REQUEST,
            E::ModelNotFound(_) | E::RouteNotFound { .. } => StatusCode::NOT_FOUND,
            E::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            E::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            E::Unauthorized => StatusCode::UNAUTHORIZED,
            E::Engine(err) => match err {
                EngineError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
                EngineError::Stopped | EngineError::Device(_) => StatusCode::INTERNAL_SERVER_ERROR,
                EngineError::EmptyPrompt
                | EngineError::TokenOutOfVocab { .. }
                | EngineError::UnknownToken { .. }
                | EngineError::TooLong { .. }
                | EngineError::PromptTooLong { .. }
                | EngineError::InvalidParams(_)
                | EngineError::Scheduler(_)
                | EngineError::Tokenizer(_) => StatusCode::BAD_REQUEST,
            },
            E::Tokenizer(err) => match err {
                // What a client sends can make these fail: its text, its ids, its messages.
                TokenizerError::Encode(_)
                | TokenizerError::Decode(_)
                | TokenizerError::UnknownTokenId { .. }
                | TokenizerError::ChatTemplateRender(_)
                | TokenizerError::ChatTemplateRaised(_) => StatusCode::BAD_REQUEST,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            E::ShuttingDown | E::TooManyConnections { .. } => StatusCode::SERVICE_UNAVAILABLE,
            E::MalformedRequest(_) => StatusCode::BAD_REQUEST,
            E::HeadTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            E::UriTooLong => StatusCode::URI_TOO_LONG,
            E::HeadTimeout { .. } | E::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            E::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn param(&self) -> Option<String> {
        match self {
            ApiError::InvalidRequest { param, .. } | ApiError::InvalidJson { param, .. } => param.clone(),
            ApiError::ModelNotFound(_) => Some("model".into()),
            ApiError::Engine(EngineError::InvalidParams(SamplingError::InvalidParam { param, .. })) => {
                Some((*param).to_string())
            }
            ApiError::Engine(EngineError::TooLong { .. }) => Some("max_tokens".into()),
            ApiError::Engine(
                EngineError::PromptTooLong { .. }
                | EngineError::TokenOutOfVocab { .. }
                | EngineError::UnknownToken { .. }
                | EngineError::Tokenizer(_),
            ) => Some("prompt".into()),
            // Ids a client sent (a prompt of ids echoed back; /detokenize names its own field).
            ApiError::Tokenizer(TokenizerError::UnknownTokenId { .. }) => Some("prompt".into()),
            _ => None,
        }
    }

    fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::ModelNotFound(_) => Some("model_not_found"),
            ApiError::RouteNotFound { .. } => Some("unknown_url"),
            ApiError::MethodNotAllowed { .. } => Some("method_not_allowed"),
            ApiError::PayloadTooLarge { .. } => Some("request_too_large"),
            ApiError::Unauthorized => Some("invalid_api_key"),
            ApiError::MalformedRequest(_) => Some("malformed_request"),
            ApiError::HeadTooLarge { .. } => Some("request_header_fields_too_large"),
            ApiError::UriTooLong => Some("uri_too_long"),
            ApiError::HeadTimeout { .. } | ApiError::BodyTimeout { .. } => Some("request_timeout"),
            ApiError::TooManyConnections { .. } => Some("too_many_connections"),
            ApiError::Engine(EngineError::Overloaded { .. }) => Some("overloaded"),
            ApiError::Engine(EngineError::TooLong { .. } | EngineError::PromptTooLong { .. }) => {
                Some("context_length_exceeded")
            }
            _ => None,
        }
    }

    pub fn body(&self) -> ErrorBody {
        let status = self.status();
        let kind = if status.is_server_error() {
            "server_error"
        } else if status == StatusCode::UNAUTHORIZED {
            "authentication_error"
        } else {
            "invalid_request_error"
        };
        ErrorBody { message: self.to_string(), kind, param: self.param(), code: self.code() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(status = status.as_u16(), error = %self, "request failed");
        } else {
            tracing::debug!(status = status.as_u16(), error = %self, "request refused");
        }
        let mut response = (status, axum::Json(ErrorEnvelope { error: self.body() })).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_whose_fault_it_is() {
        let cases: Vec<(ApiError, u16)> = vec![
            (ApiError::invalid("x", None), 400),
            (ApiError::ModelNotFound("m".into()), 404),
            (ApiError::PayloadTooLarge { limit: 1 }, 413),
            (ApiError::Unauthorized, 401),
            (
                ApiError::Engine(EngineError::Overloaded {
                    pending: ferrolm_engine::Load { sequences: 3, prompt_tokens: 9 },
                }),
                503,
            ),
            (ApiError::Engine(EngineError::Stopped), 500),
            (ApiError::Engine(EngineError::EmptyPrompt), 400),
            (ApiError::Engine(EngineError::UnknownToken { token_id: 330, num_tokens: 320 }), 400),
            (ApiError::Tokenizer(TokenizerError::UnknownTokenId { id: 330, vocab_size: 320 }), 400),
            (ApiError::Tokenizer(TokenizerError::ChatTemplateRaised("no system role".into())), 400),
            (ApiError::Internal("boom".into()), 500),
            (ApiError::MalformedRequest("bad".into()), 400),
            (ApiError::HeadTooLarge { max_bytes: 1, max_headers: 1 }, 431),
            (ApiError::UriTooLong, 414),
            (ApiError::HeadTimeout { timeout_s: 1.0 }, 408),
            (ApiError::BodyTimeout { timeout_s: 1.0 }, 408),
            (ApiError::TooManyConnections { limit: 1 }, 503),
        ];
        for (err, status) in cases {
            assert_eq!(err.status().as_u16(), status, "{err}");
        }
    }

    #[test]
    fn sampling_errors_name_their_param() {
        let err = ApiError::Engine(EngineError::InvalidParams(SamplingError::InvalidParam {
            param: "top_p",
            reason: "must be in (0, 1], got 2".into(),
        }));
        let body = err.body();
        assert_eq!(body.param.as_deref(), Some("top_p"));
        assert_eq!(body.kind, "invalid_request_error");
        assert_eq!(body.message, "top_p must be in (0, 1], got 2");
    }
}
