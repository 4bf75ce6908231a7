//! Helpers shared by the golden tests: log-softmax in f64, reference ids from JSON, scrambled
//! block tables and teacher-forced prompt logprobs read in chunks through the paged path.

use ferrolm_model::{KvCache, Model, ModelInput};
use serde_json::Value;

pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits.iter().map(|&x| x as f64 - max - sum.ln()).collect()
}

/// A sequence's KV blocks: deliberately non-contiguous and descending.
pub fn block_table(num_blocks: usize, total_blocks: usize) -> Vec<u32> {
    (0..num_blocks).map(|i| (total_blocks - 1 - 2 * i) as u32).collect()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// Teacher-forced logprobs of the prompt, reading it in chunks of `chunk` tokens.
pub fn prompt_logprobs(
    model: &Model,
    kv: &mut KvCache,
    table: &[u32],
    block_size: usize,
    prompt: &[u32],
    chunk: usize,
) -> Vec<f64> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < prompt.len() {
        let end = (start + chunk).min(prompt.len());
        let mut input = ModelInput::default();
        input.push_request(&prompt[start..end], start, table, block_size, true, true);
        let logits = model.forward(&input, kv);
        let vocab = model.config.vocab_size;
        for (row, pos) in (start..end).enumerate() {
            if pos + 1 < prompt.len() {
                out.push(log_softmax(&logits[row * vocab..(row + 1) * vocab])[prompt[pos + 1] as usize]);
            }
        }
        start = end;
    }
    out
}
