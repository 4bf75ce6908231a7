//! A runner that answers with a script: each sequence's n-th sampled token is the script's n-th
//! token (the model runs underneath, its own choices overridden), so that a test decides what a
//! model "writes" (a tool call, a thinking block) and checks the server end to end.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ferrolm_model::{CpuRunner, ModelConfig, ModelError, ModelInput, ModelRunner};
use ferrolm_sampling::{RowRequest, TokenLogprobs, TokenMasks};

/// What the scripted model writes: set before each request.
#[derive(Debug, Default)]
pub struct Script {
    pub tokens: Mutex<Vec<u32>>,
    /// The prompt's length in tokens: a sequence's output index is its length past it.
    pub prompt_len: AtomicUsize,
}

impl Script {
    pub fn set(&self, prompt_len: usize, tokens: Vec<u32>) {
        self.prompt_len.store(prompt_len, Ordering::SeqCst);
        *self.tokens.lock().expect("script lock") = tokens;
    }
}

pub struct ScriptedRunner {
    pub inner: CpuRunner,
    pub script: Arc<Script>,
    /// Per launched step not yet collected: each logits row's output index, for sampled rows.
    pending: VecDeque<Vec<Option<usize>>>,
}

impl ScriptedRunner {
    pub fn new(inner: CpuRunner, script: Arc<Script>) -> ScriptedRunner {
        ScriptedRunner { inner, script, pending: VecDeque::new() }
    }
}

impl ModelRunner for ScriptedRunner {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn device(&self) -> String {
        "a scripted runner".into()
    }

    fn allocate_kv_cache(&mut self, num_blocks: &[usize], block_size: usize) -> Result<(), ModelError> {
        self.inner.allocate_kv_cache(num_blocks, block_size)
    }

    fn limit_output_vocab(&mut self, num_ids: usize) {
        self.inner.limit_output_vocab(num_ids);
    }

    fn launch(&mut self, input: &ModelInput, rows: &[RowRequest<'_>]) -> Result<(), ModelError> {
        let prompt_len = self.script.prompt_len.load(Ordering::SeqCst);
        let outputs = input
            .logits_indices
            .iter()
            .zip(rows)
            .map(|(&t, row)| {
                let RowRequest::Sample(_) = row else { return None };
                let r = input.query_start_loc.windows(2).position(|w| w[0] <= t && t < w[1])?;
                (input.seq_lens[r] as usize).checked_sub(prompt_len)
            })
            .collect();
        self.pending.push_back(outputs);
        self.inner.launch(input, rows)
    }

    fn set_token_masks(&mut self, masks: &TokenMasks) -> Result<(), ModelError> {
        self.inner.set_token_masks(masks)
    }

    fn collect(&mut self) -> Result<Vec<Option<TokenLogprobs>>, ModelError> {
        let mut answers = self.inner.collect()?;
        let outputs = self.pending.pop_front().unwrap_or_default();
        let tokens = self.script.tokens.lock().expect("script lock");
        for (answer, output) in answers.iter_mut().zip(outputs) {
            if let (Some(answer), Some(n)) = (answer.as_mut(), output) {
                if let Some(&token) = tokens.get(n).or(tokens.last()) {
                    answer.token = token;
                }
            }
        }
        Ok(answers)
    }
}
