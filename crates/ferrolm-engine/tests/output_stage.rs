//! The output stage on its own thread: stop strings end sequences whether or not their streams
//! are read, and no request's output state outlives the request.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrolm_engine::{EngineConfig, EngineHandle, FinishReason, GenerateRequest, RequestOutput, RequestStream};
use ferrolm_engine::{Load, SchedulerConfig};
use ferrolm_model::Model;
use ferrolm_sampling::SamplingParams;
use ferrolm_tokenizer::Tokenizer;
use serde_json::Value;

const MAX_MODEL_LEN: usize = 512;

fn fixture() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures/llama"))
}

fn start() -> (EngineHandle, Arc<Tokenizer>) {
    let model = Model::from_dir(&fixture()).expect("model");
    let tokenizer = Arc::new(Tokenizer::from_dir(&fixture()).expect("tokenizer"));
    let scheduler = SchedulerConfig { max_num_seqs: 64, ..SchedulerConfig::new(256, MAX_MODEL_LEN) };
    let config = EngineConfig {
        scheduler,
        max_pending: Load { sequences: 64, prompt_tokens: 1 << 20 },
        eos_token_ids: vec![1],
        overlap_steps: true,
    };
    (EngineHandle::start(model, Arc::clone(&tokenizer), config).expect("engine"), tokenizer)
}

/// The prompt of the fixture's first reference case.
fn prompt() -> Vec<u32> {
    let text = std::fs::read_to_string(fixture().join("reference.json")).expect("read");
    let reference: Value = serde_json::from_str(&text).expect("json");
    let ids = reference["cases"][0]["prompt_ids"].as_array().expect("prompt ids");
    ids.iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens: Some(max_tokens), ignore_eos: true, ..SamplingParams::default() }
}

/// Every output of a stream, in order.
fn read_all(mut stream: RequestStream) -> Vec<RequestOutput> {
    std::iter::from_fn(|| stream.blocking_recv()).collect()
}

/// Waits until `done` holds, failing after 10 s with what `state` says.
fn wait_for(what: &str, engine: &EngineHandle, done: impl Fn(&EngineHandle) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done(engine) {
        let s = engine.stats();
        assert!(
            Instant::now() < deadline,
            "{what}: not reached; {s:?}, pending {:?}, output requests {}",
            engine.pending(),
            engine.num_output_requests()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// No request left anywhere: not in the engine, not in the KV cache, not in the output stage.
fn is_idle(engine: &EngineHandle) -> bool {
    let s = engine.stats();
    s.num_running == 0
        && s.num_waiting == 0
        && s.kv_usage == 0.0
        && engine.pending() == Load::default()
        && engine.num_output_requests() == 0
}

/// A stop string in the middle of the greedy text of 12 tokens, and the text before it.
fn stop_in_greedy_text(engine: &EngineHandle) -> (String, String) {
    let outputs = read_all(
        engine.submit(GenerateRequest { prompt_token_ids: prompt(), params: greedy(12), grammar: None }).expect("s"),
    );
    let text: String = outputs.iter().map(|o| o.text.as_str()).collect();
    let chars: Vec<char> = text.chars().collect();
    let start = chars.len() / 2;
    let stop: String = chars[start..start + 2].iter().collect();
    let before = text[..text.find(&stop).expect("stop occurs")].to_string();
    (stop, before)
}

#[test]
fn a_stop_string_ends_its_sequences_while_nobody_reads_the_stream() {
    let (engine, _) = start();
    let (stop, before) = stop_in_greedy_text(&engine);
    wait_for("idle after the first request", &engine, is_idle);
    let generated_before = engine.stats().generation_tokens;

    // Room for hundreds of tokens; the stop string comes within the first 12.
    let max_tokens = 300;
    assert!(prompt().len() + max_tokens < MAX_MODEL_LEN);
    let params = SamplingParams { n: 2, stop: vec![stop.clone()], ..greedy(max_tokens as u32) };
    let stream = engine.submit(GenerateRequest { prompt_token_ids: prompt(), params, grammar: None }).expect("submit");
    // Not a single read: the sequences still end at the stop string and free their blocks, and
    // the output stage lets go of the request (its outputs wait in the stream).
    wait_for("the unread request to end", &engine, is_idle);
    let generated = engine.stats().generation_tokens - generated_before;
    // 12 tokens each at most to the stop, and those sampled before the engine heard of it: far
    // fewer than the 600 the two sequences would run to.
    assert!(generated < 2 * 100, "{generated} tokens generated for 2 sequences stopped within 12");

    let outputs = read_all(stream);
    for index in 0..2 {
        let of_seq: Vec<&RequestOutput> = outputs.iter().filter(|o| o.index == index).collect();
        let text: String = of_seq.iter().map(|o| o.text.as_str()).collect();
        assert_eq!(text, before, "sequence {index}");
        assert_eq!(of_seq.last().and_then(|o| o.finish_reason), Some(FinishReason::Stop), "sequence {index}");
        assert_eq!(of_seq.iter().filter(|o| o.finish_reason.is_some()).count(), 1, "one end for sequence {index}");
    }
    assert!(engine.shutdown(Duration::from_secs(10)), "both threads end once the last handle is gone");
}

#[test]
fn the_output_stage_keeps_nothing_of_finished_aborted_or_dropped_requests() {
    let (engine, _) = start();
    let submit = |params: SamplingParams| {
        engine.submit(GenerateRequest { prompt_token_ids: prompt(), params, grammar: None }).expect("submit")
    };

    // Read to the end.
    let outputs = read_all(submit(greedy(4)));
    assert_eq!(outputs.iter().map(|o| o.token_ids.len()).sum::<usize>(), 4);
    wait_for("a finished request to be forgotten", &engine, is_idle);

    // Finished, its stream alive but never read.
    let unread = submit(SamplingParams { n: 3, ..greedy(3) });
    wait_for("an unread finished request to be forgotten", &engine, is_idle);
    assert_eq!(read_all(unread).iter().filter(|o| o.finish_reason == Some(FinishReason::Length)).count(), 3);

    // Dropped mid-way, after one output.
    let mut dropped = submit(greedy(400));
    assert!(dropped.blocking_recv().is_some());
    assert_eq!(engine.num_output_requests(), 1, "the running request is held");
    drop(dropped);
    wait_for("a dropped request to be forgotten", &engine, is_idle);

    // Dropped before any output, with stop strings and several sequences.
    let params = SamplingParams { n: 4, stop: vec!["never in this text \u{1F600}".into()], ..greedy(400) };
    drop(submit(params));
    wait_for("a request dropped at once to be forgotten", &engine, is_idle);

    // Aborted while its stream lives on: it ends at once.
    let mut aborted = submit(greedy(400));
    assert!(aborted.blocking_recv().is_some());
    aborted.abort();
    assert!(aborted.blocking_recv().is_none(), "an aborted stream ends");
    wait_for("an aborted request to be forgotten", &engine, is_idle);
    drop(aborted);

    // Many at once, some read, some dropped.
    let streams: Vec<RequestStream> = (0..8).map(|i| submit(greedy(8 + i))).collect();
    for (i, stream) in streams.into_iter().enumerate() {
        if i % 2 == 0 {
            assert_eq!(read_all(stream).iter().map(|o| o.token_ids.len()).sum::<usize>(), 8 + i);
        }
    }
    wait_for("a mixed batch to be forgotten", &engine, is_idle);
    assert!(engine.shutdown(Duration::from_secs(10)));
}
