//! Error responses written straight to a socket, outside any handler: a head that timed out, a
//! head hyper could not parse, a connection beyond the cap. Each is a complete HTTP/1.1 response
//! with an OpenAI-shaped JSON body and `connection: close`; the connection ends after it.

use std::time::Duration;

use axum::http::StatusCode;

use crate::error::ApiError;
use crate::ConnectionLimits;

/// After an error response, how long and how much of what the client still sends is drained
/// before the socket is closed (closing with unread data would reset the connection, and the
/// client could lose the response).
pub(super) const LINGER: Duration = Duration::from_secs(1);
pub(super) const LINGER_BYTES: usize = 1 << 20;

/// The bytes of a response carrying `error`, closing the connection.
pub(super) fn error_response(error: &ApiError) -> Vec<u8> {
    let status = error.status();
    let body = serde_json::json!({ "error": error.body() }).to_string();
    let retry_after = if status == StatusCode::SERVICE_UNAVAILABLE { "retry-after: 1\r\n" } else { "" };
    let head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{retry_after}\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len(),
    );
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body.as_bytes());
    bytes
}

/// The status of a response whose first bytes are `written`, if they start one
/// (`HTTP/1.1 400 Bad Request\r\n...`).
pub(super) fn response_status(written: &[u8]) -> Option<u16> {
    let rest = written.strip_prefix(b"HTTP/1.")?;
    let code = rest.get(2..5)?;
    if rest.get(1) != Some(&b' ') || !code.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(code).ok()?.parse().ok()
}

/// What to answer in place of hyper's bodiless `status` to a head starting with `head`; `None`
/// for a status hyper is not known to send for a head it refuses (its own response then stands).
pub(super) fn transport_error(status: u16, head: &[u8], limits: &ConnectionLimits) -> Option<ApiError> {
    match status {
        400 => Some(ApiError::MalformedRequest(diagnose(head))),
        414 => Some(ApiError::UriTooLong),
        431 => Some(ApiError::HeadTooLarge { max_bytes: limits.max_head_bytes, max_headers: limits.max_headers }),
        _ => None,
    }
}

/// Says what is wrong with a head hyper refused with a 400, as far as its first bytes tell.
fn diagnose(head: &[u8]) -> String {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut request = httparse::Request::new(&mut headers);
    if let Err(err) = request.parse(head) {
        return format!("malformed HTTP request: {err} in the request line or headers");
    }
    let lengths = request.headers.iter().filter(|h| h.name.eq_ignore_ascii_case("content-length"));
    let mut first_length: Option<String> = None;
    for header in lengths {
        let value = String::from_utf8_lossy(header.value);
        let value = value.trim();
        if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) || value.parse::<u64>().is_err() {
            let shown: String = value.chars().take(64).collect();
            return format!("malformed HTTP request: invalid Content-Length header `{shown}`");
        }
        match &first_length {
            None => first_length = Some(value.to_string()),
            Some(first) if first != value => {
                return "malformed HTTP request: conflicting Content-Length headers".into();
            }
            Some(_) => {}
        }
    }
    "malformed HTTP request: the request line or a header could not be parsed".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_of(response: &[u8]) -> serde_json::Value {
        let text = String::from_utf8_lossy(response);
        let (_, body) = text.split_once("\r\n\r\n").expect("a head and a body");
        serde_json::from_str(body).expect("a JSON body")
    }

    #[test]
    fn responses_are_complete_and_openai_shaped() {
        let bytes = error_response(&ApiError::TooManyConnections { limit: 4 });
        let text = String::from_utf8_lossy(&bytes).into_owned();
        assert!(text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{text}");
        assert!(text.contains("\r\nretry-after: 1\r\n") && text.contains("\r\nconnection: close\r\n"), "{text}");
        let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
        assert!(head.contains(&format!("content-length: {}", body.len())), "{text}");
        let body = body_of(&bytes);
        assert_eq!(body["error"]["type"], "server_error");
        assert_eq!(body["error"]["code"], "too_many_connections");
        assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains('4')), "{body}");
    }

    #[test]
    fn statuses_are_read_from_a_response_line() {
        assert_eq!(response_status(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), Some(431));
        assert_eq!(response_status(b"HTTP/1.0 400 "), Some(400));
        assert_eq!(response_status(b"0\r\n\r\n"), None);
        assert_eq!(response_status(b"HTTP/1.1 4"), None);
        assert_eq!(response_status(b"HTTP/1.1 4x0 "), None);
    }

    #[test]
    fn a_bad_content_length_is_named() {
        let limits = ConnectionLimits::default();
        let head = b"POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-length: -5\r\n\r\n";
        let err = transport_error(400, head, &limits).expect("a 400");
        assert_eq!(err.status().as_u16(), 400);
        assert!(err.to_string().contains("invalid Content-Length header `-5`"), "{err}");
        let head = b"POST / HTTP/1.1\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n";
        let err = transport_error(400, head, &limits).expect("a 400");
        assert!(err.to_string().contains("conflicting Content-Length"), "{err}");
    }

    #[test]
    fn a_garbage_request_line_is_named() {
        let err = transport_error(400, b"\x16\x03\x01 hello\r\n\r\n", &ConnectionLimits::default()).expect("a 400");
        assert!(err.to_string().starts_with("malformed HTTP request: invalid"), "{err}");
    }

    #[test]
    fn oversized_heads_state_the_limits() {
        let limits = ConnectionLimits::default();
        let err = transport_error(431, b"GET / HTTP/1.1\r\n", &limits).expect("a 431");
        assert_eq!(err.status().as_u16(), 431);
        assert!(err.to_string().contains(&limits.max_head_bytes.to_string()), "{err}");
        assert!(transport_error(500, b"", &limits).is_none());
    }
}
