//! The JSON body extractor of every route: a body that is too large, not JSON, not UTF-8, or
//! JSON of the wrong shape becomes an OpenAI-shaped 413 or 400 (axum's own `Json` answers 415
//! and 422 in plain text), naming the offending field where serde knows it. Large bodies are
//! parsed on the tokenizer threads.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::error::Category;

use crate::error::ApiError;
use crate::state::SharedState;

/// Bodies larger than this are parsed on the tokenizer threads, off the async ones: a body of
/// megabytes (millions of prompts) takes a large part of a second to parse.
const PARSE_INLINE_BYTES: usize = 256 << 10;

/// A request body parsed as `T`. The content type is not checked: clients that forget
/// `application/json` are still understood.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned + Send + 'static> FromRequest<SharedState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &SharedState) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge { limit: state.config.max_body_bytes }
            } else {
                ApiError::InvalidJson { message: format!("cannot read the request body: {rejection}"), param: None }
            }
        })?;
        if bytes.len() <= PARSE_INLINE_BYTES {
            return parse(&bytes).map(ApiJson);
        }
        state.work.run(move || parse(&bytes)).await.map(ApiJson)
    }
}

pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        // serde's message for a field the request type does not have (`deny_unknown_fields`):
        // "unknown field `name`, expected one of ...".
        if let Some(name) = inner.to_string().strip_prefix("unknown field `").and_then(|rest| rest.split('`').next()) {
            // The path names a nested field in full (`stream_options.bogus`).
            let param = if path.ends_with(name) { path } else { name.to_string() };
            return ApiError::InvalidJson {
                message: format!("unrecognized request argument `{param}`: this route takes no such parameter"),
                param: Some(param),
            };
        }
        match inner.classify() {
            Category::Data if path != "." => {
                ApiError::InvalidJson { message: format!("invalid value for `{path}`: {inner}"), param: Some(path) }
            }
            Category::Data => ApiError::InvalidJson { message: format!("invalid request body: {inner}"), param: None },
            Category::Io | Category::Syntax | Category::Eof => {
                ApiError::InvalidJson { message: format!("the request body is not valid JSON: {inner}"), param: None }
            }
        }
    })?;
    de.end().map_err(|inner| ApiError::InvalidJson {
        message: format!("the request body is not valid JSON: {inner}"),
        param: None,
    })?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Req {
        #[allow(dead_code)]
        max_tokens: Option<u32>,
        #[allow(dead_code)]
        options: Option<Options>,
        #[allow(dead_code)]
        prompt: String,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Options {
        #[allow(dead_code)]
        include_usage: Option<bool>,
    }

    fn message(bytes: &[u8]) -> (String, Option<String>) {
        match parse::<Req>(bytes) {
            Err(ApiError::InvalidJson { message, param }) => (message, param),
            other => (format!("unexpected: {other:?}"), None),
        }
    }

    #[test]
    fn wrong_types_name_the_field() {
        let (msg, param) = message(br#"{"prompt": "a", "max_tokens": "x"}"#);
        assert_eq!(param.as_deref(), Some("max_tokens"));
        assert!(msg.contains("invalid type: string"), "{msg}");
    }

    #[test]
    fn unknown_fields_are_named() {
        let (msg, param) = message(br#"{"prompt": "a", "max_token": 3}"#);
        assert_eq!(param.as_deref(), Some("max_token"));
        assert_eq!(msg, "unrecognized request argument `max_token`: this route takes no such parameter");
        let (msg, param) = message(br#"{"prompt": "a", "options": {"include_usage": true, "bogus": 1}}"#);
        assert_eq!(param.as_deref(), Some("options.bogus"), "{msg}");
    }

    #[test]
    fn malformed_bodies_are_refused() {
        for body in [&b"{"[..], b"", b"{\"prompt\": \"a\"} trailing", b"{\"prompt\": \"\xff\"}", b"[1]"] {
            assert!(matches!(parse::<Req>(body), Err(ApiError::InvalidJson { .. })), "{body:?}");
        }
        let (msg, _) = message(br#"{"max_tokens": 3}"#);
        assert!(msg.contains("missing field `prompt`"), "{msg}");
    }
}
