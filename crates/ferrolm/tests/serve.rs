//! `ferrolm serve` as an operator runs it: it prints its address, answers HTTP, logs each
//! request, and exits 0 on SIGTERM; bad flags fail with one error line.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures")).join(name)
}

fn ferrolm() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrolm"));
    cmd.env_remove("FERROLM_MODEL").env_remove("FERROLM_API_KEY").env_remove("RUST_LOG");
    cmd
}

/// Kills the server if a test fails before it exits by itself.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 exchange over a fresh connection: (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read");
    let status = resp.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("status line");
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        assert!(Instant::now() < deadline, "the server did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn serves_then_exits_cleanly_on_sigterm() {
    let dir = fixture("llama");
    let child = ferrolm()
        .args(["serve", "--model", dir.to_str().expect("utf-8 path"), "--port", "0", "--max-model-len", "128"])
        .args(["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ferrolm serve");
    let mut server = Running(child);
    let stdout = server.0.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(60)).expect("the address line");
    let addr = line.rsplit("http://").next().expect("an address").trim().to_string();
    assert!(line.contains("http://127.0.0.1:"), "{line}");

    let (status, body) = http(&addr, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{body}");
    let models: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(models["data"][0]["id"], "llama", "the served name defaults to the directory's");
    assert_eq!(models["data"][0]["max_model_len"], 128);
    let (status, body) =
        http(&addr, "POST", "/v1/completions", r#"{"model": "llama", "prompt": "fn", "max_tokens": 4}"#);
    assert_eq!(status, 200, "{body}");
    let (status, _) = http(&addr, "GET", "/health", "");
    assert_eq!(status, 200);
    let chat = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "tools": [{"type": "function", "function": {"name": "f"}}]}"#;
    let (status, body) = http(&addr, "POST", "/v1/chat/completions", chat);
    assert_eq!(status, 200, "{body}");

    let pid = server.0.id().to_string();
    let killed = Command::new("sh").args(["-c", &format!("kill -TERM {pid}")]).status().expect("run kill");
    assert!(killed.success());
    let status = wait_exit(&mut server.0, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    let mut stderr = String::new();
    server.0.stderr.take().expect("stderr").read_to_string(&mut stderr).expect("read stderr");
    assert!(stderr.contains("request finished"), "one log line per request: {stderr}");
    assert!(stderr.contains("completion_tokens=4"), "{stderr}");
    let parser_line = stderr.lines().find(|l| l.contains("tool calls parsed with the configured format"));
    assert!(parser_line.is_some_and(|l| l.contains("hermes")), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_flags_fail_with_one_line() {
    let dir = fixture("llama");
    let dir = dir.to_str().expect("utf-8 path");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("address").port().to_string();
    for (args, needle) in [
        (vec!["serve", "--model", dir, "--device", "cuda"], "no CUDA backend"),
        (vec!["serve", "--model", dir, "--kv-cache-fraction", "1.5"], "--kv-cache-fraction"),
        (vec!["serve", "--model", dir, "--shutdown-timeout=-1"], "--shutdown-timeout"),
        (vec!["serve", "--model", dir, "--port", &port], "cannot listen on"),
        (vec!["serve", "--model", dir, "--tool-call-parser", "pythonic"], "unknown tool call parser \"pythonic\""),
        (vec!["serve", "--model", dir, "--reasoning-parser", "r1"], "unknown reasoning parser \"r1\""),
    ] {
        let out = ferrolm().args(&args).output().expect("run");
        assert!(!out.status.success(), "{args:?} should fail");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: ")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: {stderr}");
        assert!(errors[0].contains(needle), "{args:?}: `{needle}` missing from {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn help_lists_the_parser_flags() {
    let out = ferrolm().args(["serve", "--help"]).output().expect("run");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--tool-call-parser <NAME>", "--reasoning-parser <NAME>", "--enable-auto-tool-choice"] {
        assert!(help.contains(flag), "{flag} missing from {help}");
    }
    for name in ["llama3_json", "hermes", "mistral", "deepseek_r1", "qwen3"] {
        assert!(help.contains(name), "{name} missing from {help}");
    }
}
