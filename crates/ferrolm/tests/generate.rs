//! `ferrolm generate` as a user runs it: reference tokens, several prompts in one batch, and a
//! one-line error with a non-zero exit for every bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures")).join(name)
}

fn ferrolm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrolm")).args(args).env_remove("FERROLM_MODEL").output().expect("run ferrolm")
}

fn reference(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).expect("read")).expect("json")
}

fn join_ids(v: &Value) -> String {
    v.as_array().expect("ids").iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

/// Runs and expects failure with a single-line message containing every `needle`.
fn expect_error(args: &[&str], needles: &[&str]) {
    let out = ferrolm(args);
    assert!(!out.status.success(), "{args:?} should fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one error line expected, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    for n in needles {
        assert!(lines[0].contains(n), "`{n}` missing from: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn json_output_matches_reference_greedy_ids() {
    for name in ["llama", "gemma_geglu"] {
        let reference = reference(name);
        let case = &reference["cases"][2];
        let dir = fixture(name);
        let out = ferrolm(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            &join_ids(&case["prompt_ids"]),
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(v["token_ids"], case["greedy_ids"], "{name}");
        assert!(v["text"].is_string());
        assert_eq!(v["finish_reason"], "length");
    }
}

#[test]
fn several_prompts_run_as_one_batch() {
    let reference = reference("qwen2_tied");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("prompts.jsonl");
    let lines: Vec<String> = reference["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| serde_json::json!({"prompt_ids": c["prompt_ids"]}).to_string())
        .collect();
    std::fs::write(&file, lines.join("\n")).expect("write");
    let model = fixture("qwen2_tied");
    let out = ferrolm(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompts-file",
        file.to_str().unwrap(),
        "--prompt",
        "def f(x):",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let objs: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
    assert_eq!(objs.len(), 5);
    // --prompt comes first, then the file's prompts in order.
    for (i, case) in reference["cases"].as_array().expect("cases").iter().enumerate() {
        assert_eq!(objs[i + 1]["token_ids"], case["greedy_ids"], "case {i}");
    }
}

#[test]
fn text_prompt_streams_text() {
    let model = fixture("llama");
    let out = ferrolm(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "fn main() {",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!out.stdout.is_empty());
}

#[test]
fn missing_model_directory() {
    expect_error(&["generate", "--model", "/nonexistent/dir", "--prompt", "hi"], &["/nonexistent/dir"]);
}

#[test]
fn unknown_architecture_is_named() {
    let dir = copy_fixture("llama");
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path).expect("read").replace("LlamaForCausalLM", "BloomForCausalLM");
    std::fs::write(&path, text).expect("write");
    expect_error(
        &["generate", "--model", dir.path().to_str().unwrap(), "--prompt", "hi"],
        &["BloomForCausalLM", "Qwen2ForCausalLM"],
    );
}

#[test]
fn corrupt_weights_are_reported() {
    let dir = copy_fixture("qwen2_tied");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 100]).expect("write");
    expect_error(&["generate", "--model", dir.path().to_str().unwrap(), "--prompt", "hi"], &["model.safetensors"]);
}

#[test]
fn prompt_longer_than_the_context() {
    let ids = vec!["5"; 600].join(",");
    let model = fixture("llama");
    expect_error(&["generate", "--model", model.to_str().unwrap(), "--prompt-ids", &ids], &["600", "512"]);
}

#[test]
fn token_ids_outside_the_vocabulary() {
    let model = fixture("llama");
    expect_error(&["generate", "--model", model.to_str().unwrap(), "--prompt-ids", "1,2,99999"], &["99999", "320"]);
    expect_error(&["generate", "--model", model.to_str().unwrap(), "--prompt-ids", "1,x"], &["`x`"]);
}

#[test]
fn no_prompt_and_bad_sampling_values() {
    let model = fixture("llama");
    expect_error(&["generate", "--model", model.to_str().unwrap()], &["no prompt"]);
    expect_error(
        &["generate", "--model", model.to_str().unwrap(), "--prompt", "a", "--temperature=-1"],
        &["temperature"],
    );
}

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_dir(&fixture(name), dir.path());
    dir
}

fn copy_dir(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).expect("read dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

#[test]
fn without_model_uses_the_bundled_demo_model() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/ferrolm-demo-py/reference.json"))
            .expect("read"),
    )
    .expect("json");
    let case = &reference["cases"][0];
    let n = case["greedy_ids"].as_array().expect("ids").len().to_string();
    // Run from elsewhere: the binary finds the model in the tree it was built from.
    let cwd = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .current_dir(cwd.path())
        .env_remove("FERROLM_MODEL")
        .args(["generate", "--prompt-ids", &join_ids(&case["prompt_ids"]), "--max-tokens", &n])
        .args(["--temperature", "0", "--ignore-eos", "--json"])
        .output()
        .expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["token_ids"], case["greedy_ids"]);
}
