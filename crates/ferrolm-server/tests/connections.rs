//! Connections as a hostile or careless client holds them, over real sockets: the head, body and
//! idle timeouts, the connection cap, half-closed clients, transport errors with OpenAI-shaped
//! bodies, and shutdown with idle connections open.

mod common;

use std::time::{Duration, Instant};

use common::{error_of, start, Options, TestServer};
use ferrolm_server::ConnectionLimits;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Long enough that a clock not under test never fires during a test.
const NEVER: Duration = Duration::from_secs(60);

fn limits() -> ConnectionLimits {
    ConnectionLimits { header_timeout: NEVER, body_timeout: NEVER, idle_timeout: NEVER, ..ConnectionLimits::default() }
}

async fn server_with(connections: ConnectionLimits) -> TestServer {
    start(Options { connections, ..Options::default() }).await
}

/// One HTTP response as read off a socket.
struct Raw {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// `bytes` without the interim (1xx) responses in front, and how many bytes those took.
fn skip_interim(bytes: &[u8]) -> (&[u8], usize) {
    let mut skipped = 0;
    while bytes[skipped..].starts_with(b"HTTP/1.1 1") {
        match bytes[skipped..].windows(4).position(|w| w == b"\r\n\r\n") {
            Some(end) => skipped += end + 4,
            None => break,
        }
    }
    (&bytes[skipped..], skipped)
}

/// Parses a response from `bytes` (after any interim 1xx responses); `None` until its head and its
/// `Content-Length` body (or, without one, everything after the head) are there.
fn parse(bytes: &[u8], complete: bool) -> Option<(Raw, usize)> {
    let (bytes, skipped) = skip_interim(bytes);
    let (raw, end) = parse_final(bytes, complete)?;
    Some((raw, skipped + end))
}

fn parse_final(bytes: &[u8], complete: bool) -> Option<(Raw, usize)> {
    let end = bytes.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&bytes[..end]).expect("an ASCII head");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("a status line");
    let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status code");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let length = headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse::<usize>().ok());
    let body_end = match length {
        Some(length) => end + length,
        None if complete => bytes.len(),
        None => return None,
    };
    let body = bytes.get(end..body_end)?.to_vec();
    Some((Raw { status, headers, body }, body_end))
}

/// Reads until the server closes the connection; panics past `within`. Returns what was read and
/// how long it took.
async fn read_until_closed(socket: &mut TcpStream, within: Duration) -> (Vec<u8>, Duration) {
    let began = Instant::now();
    let mut bytes = Vec::new();
    let read = tokio::time::timeout(within, async {
        let mut chunk = [0u8; 8192];
        loop {
            match socket.read(&mut chunk).await {
                Ok(0) => return Ok(()),
                Ok(n) => bytes.extend_from_slice(&chunk[..n]),
                Err(err) => return Err(err),
            }
        }
    })
    .await;
    match read {
        Ok(Ok(())) => (bytes, began.elapsed()),
        Ok(Err(err)) => {
            panic!("the connection was reset instead of closed ({err}) after {:?}", String::from_utf8_lossy(&bytes))
        }
        Err(_) => {
            panic!("the server kept the connection open for {within:?}; read {:?}", String::from_utf8_lossy(&bytes))
        }
    }
}

/// The one response the server sends before closing the connection.
async fn last_response(socket: &mut TcpStream, within: Duration) -> (Raw, Duration) {
    let (bytes, took) = read_until_closed(socket, within).await;
    let (raw, end) =
        parse(&bytes, true).unwrap_or_else(|| panic!("no response in {:?}", String::from_utf8_lossy(&bytes)));
    assert_eq!(end, bytes.len(), "bytes after the response: {:?}", String::from_utf8_lossy(&bytes));
    (raw, took)
}

/// Reads one response on a connection that stays open.
async fn next_response(socket: &mut TcpStream) -> Raw {
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some((raw, end)) = parse(&bytes, false) {
            assert_eq!(end, bytes.len(), "unexpected bytes after the response");
            return raw;
        }
        let n = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut chunk))
            .await
            .expect("a response within 10 s")
            .expect("read");
        assert!(n > 0, "closed before a full response: {:?}", String::from_utf8_lossy(&bytes));
        bytes.extend_from_slice(&chunk[..n]);
    }
}

fn get_health(server: &TestServer) -> String {
    format!("GET /health HTTP/1.1\r\nhost: {}\r\n\r\n", server.addr)
}

fn post(server: &TestServer, path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        server.addr,
        body.len()
    )
}

async fn connect(server: &TestServer) -> TcpStream {
    TcpStream::connect(server.addr).await.expect("connect")
}

/// Asserts an OpenAI-shaped error body with `code`, closing the connection; returns its message.
fn assert_error(raw: &Raw, status: u16, code: &str) -> String {
    assert_eq!(raw.status, status, "{}", raw.text());
    assert_eq!(raw.header("content-type"), Some("application/json"));
    assert_eq!(raw.header("connection"), Some("close"));
    let body = raw.json();
    let error = error_of(&body);
    assert_eq!(error["code"], code, "{body}");
    error["message"].as_str().expect("a message").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_head_gets_408_after_the_header_timeout() {
    let timeout = Duration::from_millis(300);
    let server = server_with(ConnectionLimits { header_timeout: timeout, ..limits() }).await;

    let mut partial = connect(&server).await;
    partial.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-").await.expect("write");
    let (raw, took) = last_response(&mut partial, Duration::from_secs(10)).await;
    let message = assert_error(&raw, 408, "request_timeout");
    assert!(message.contains("head"), "{message}");
    assert!(took >= timeout - Duration::from_millis(50), "closed after {took:?}, before the timeout");

    // A connection that sends nothing is closed too, without a response.
    let mut silent = connect(&server).await;
    let (bytes, took) = read_until_closed(&mut silent, Duration::from_secs(10)).await;
    assert!(bytes.is_empty(), "{:?}", String::from_utf8_lossy(&bytes));
    assert!(took >= timeout - Duration::from_millis(50), "closed after {took:?}");

    // A head that trickles in slower than the timeout allows is cut off too.
    let mut trickle = connect(&server).await;
    let began = Instant::now();
    for byte in b"GET /health HTTP/1.1\r\nhost: a\r\n" {
        if trickle.write_all(&[*byte]).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (raw, _) = last_response(&mut trickle, Duration::from_secs(10)).await;
    assert_error(&raw, 408, "request_timeout");
    assert!(began.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_shorter_than_its_content_length_gets_408() {
    let timeout = Duration::from_millis(300);
    let server = server_with(ConnectionLimits { body_timeout: timeout, ..limits() }).await;
    let mut socket = connect(&server).await;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n",
        server.addr
    );
    socket.write_all(head.as_bytes()).await.expect("write");
    socket.write_all(b"{\"prompt\": \"fn\"").await.expect("write");
    let (raw, took) = last_response(&mut socket, Duration::from_secs(10)).await;
    let message = assert_error(&raw, 408, "request_timeout");
    assert!(message.contains("body"), "{message}");
    assert!(took >= timeout - Duration::from_millis(50), "answered after {took:?}, before the timeout");

    // A body that arrives in time is served as usual.
    let (status, body) = server.post("/v1/completions", &serde_json::json!({"prompt": "fn", "max_tokens": 2})).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_after_the_idle_timeout_not_the_header_timeout() {
    let header = Duration::from_millis(300);
    let idle = Duration::from_millis(1200);
    let server = server_with(ConnectionLimits { header_timeout: header, idle_timeout: idle, ..limits() }).await;
    let mut socket = connect(&server).await;
    socket.write_all(get_health(&server).as_bytes()).await.expect("write");
    assert_eq!(next_response(&mut socket).await.status, 200);

    // Silent for longer than the header timeout, shorter than the idle one: still served.
    tokio::time::sleep(header * 2).await;
    socket.write_all(get_health(&server).as_bytes()).await.expect("write");
    assert_eq!(next_response(&mut socket).await.status, 200);

    let (bytes, took) = read_until_closed(&mut socket, Duration::from_secs(10)).await;
    assert!(bytes.is_empty(), "an idle connection is closed without a response: {:?}", String::from_utf8_lossy(&bytes));
    assert!(took >= idle - Duration::from_millis(100), "closed after {took:?}, before the idle timeout");
    assert!(took < idle + Duration::from_secs(3), "closed after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_get_503_until_some_close() {
    let cap = 3;
    let server = server_with(ConnectionLimits { max_connections: cap, ..limits() }).await;
    let mut held = Vec::new();
    for _ in 0..cap {
        let mut socket = connect(&server).await;
        socket.write_all(get_health(&server).as_bytes()).await.expect("write");
        assert_eq!(next_response(&mut socket).await.status, 200);
        held.push(socket);
    }

    let mut extra = connect(&server).await;
    extra.write_all(get_health(&server).as_bytes()).await.expect("write");
    let (raw, _) = last_response(&mut extra, Duration::from_secs(10)).await;
    let message = assert_error(&raw, 503, "too_many_connections");
    assert!(message.contains(&cap.to_string()), "{message}");
    assert_eq!(raw.header("retry-after"), Some("1"));
    assert_eq!(raw.json()["error"]["type"], "server_error");

    // Those held still work.
    held[0].write_all(get_health(&server).as_bytes()).await.expect("write");
    assert_eq!(next_response(&mut held[0]).await.status, 200);

    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut socket = connect(&server).await;
        socket.write_all(get_health(&server).as_bytes()).await.expect("write");
        let mut bytes = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), socket.read_to_end(&mut bytes)).await;
        let status = parse(&bytes, true).map(|(raw, _)| raw.status);
        if status == Some(200) {
            break;
        }
        assert_eq!(status, Some(503), "{:?}", String::from_utf8_lossy(&bytes));
        assert!(Instant::now() < deadline, "a closed connection never freed its place");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_closed_client_gets_its_full_response() {
    let server = server_with(limits()).await;
    // Long enough that the FIN arrives while the request runs: the server cannot tell a client
    // that half-closed from one that left until it writes, so it sends an interim 100 first.
    let request = post(&server, "/v1/completions", r#"{"prompt": "fn", "max_tokens": 300, "ignore_eos": true}"#);
    let mut socket = connect(&server).await;
    socket.write_all(request.as_bytes()).await.expect("write");
    socket.shutdown().await.expect("half-close");
    let (bytes, _) = read_until_closed(&mut socket, Duration::from_secs(60)).await;
    assert!(bytes.starts_with(b"HTTP/1.1 100 Continue\r\n\r\n"), "{:?}", String::from_utf8_lossy(&bytes));
    let (raw, end) = parse(&bytes, true).expect("a response");
    assert_eq!(end, bytes.len());
    assert_eq!(raw.status, 200, "{}", raw.text());
    let body = raw.json();
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 300, "{body}");

    let request = post(&server, "/v1/completions", r#"{"prompt": "fn", "max_tokens": 4, "stream": true}"#);
    let mut socket = connect(&server).await;
    socket.write_all(request.as_bytes()).await.expect("write");
    socket.shutdown().await.expect("half-close");
    let (bytes, _) = read_until_closed(&mut socket, Duration::from_secs(30)).await;
    let text = String::from_utf8_lossy(skip_interim(&bytes).0);
    assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
    assert!(text.contains("data: [DONE]"), "the stream was cut short: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_errors_get_openai_shaped_bodies() {
    let server = server_with(ConnectionLimits { max_head_bytes: 16 << 10, max_headers: 50, ..limits() }).await;
    let big_header = format!("GET /health HTTP/1.1\r\nhost: a\r\nx-big: {}\r\n\r\n", "a".repeat(100_000));
    let many_headers = format!(
        "GET /health HTTP/1.1\r\nhost: a\r\n{}\r\n",
        (0..80).map(|i| format!("x-h{i}: 1\r\n")).collect::<String>()
    );
    let cases: Vec<(&str, String, u16, &str, &str)> = vec![
        ("garbage request line", "THIS IS NOT HTTP\r\n\r\n".into(), 400, "malformed_request", "malformed HTTP request"),
        (
            "negative Content-Length",
            "POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-length: -5\r\n\r\n".into(),
            400,
            "malformed_request",
            "invalid Content-Length header `-5`",
        ),
        ("huge header", big_header, 431, "request_header_fields_too_large", "16384 bytes"),
        ("too many headers", many_headers, 431, "request_header_fields_too_large", "50 headers"),
    ];
    for (what, request, status, code, says) in cases {
        let socket = connect(&server).await;
        let (mut reader, mut writer) = socket.into_split();
        // The server answers before reading all of a huge head: write on the side.
        let write = tokio::spawn(async move {
            let _ = writer.write_all(request.as_bytes()).await;
            writer
        });
        let mut bytes = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), reader.read_to_end(&mut bytes)).await;
        assert!(matches!(read, Ok(Ok(_))), "{what}: not closed cleanly: {read:?}");
        let (raw, _) = parse(&bytes, true).unwrap_or_else(|| panic!("{what}: no response: {bytes:?}"));
        let message = assert_error(&raw, status, code);
        assert!(message.contains(says), "{what}: {message}");
        assert_eq!(raw.json()["error"]["type"], "invalid_request_error", "{what}");
        drop(write.await.expect("writer"));
    }

    // A well-formed request on a new connection is still served.
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_idle_connections_returns_promptly() {
    let mut server = server_with(limits()).await;
    let mut sockets = Vec::new();
    for i in 0..20 {
        let mut socket = connect(&server).await;
        match i % 3 {
            // Kept alive after a request.
            0 => {
                socket.write_all(get_health(&server).as_bytes()).await.expect("write");
                assert_eq!(next_response(&mut socket).await.status, 200);
            }
            // Part of a head.
            1 => socket.write_all(b"GET /health HTTP/1.1\r\nho").await.expect("write"),
            // Nothing at all.
            _ => {}
        }
        sockets.push(socket);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let join = server.join.take().expect("a running server");
    let began = Instant::now();
    server.trigger_shutdown();
    let result = tokio::time::timeout(Duration::from_secs(5), join).await.expect("shutdown waited on idle connections");
    result.expect("server task").expect("server result");
    assert!(began.elapsed() < Duration::from_secs(2), "shutdown took {:?}", began.elapsed());
    for mut socket in sockets {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(2), socket.read_to_end(&mut rest)).await;
        assert!(read.is_ok(), "a connection stayed open after shutdown");
    }
}
