//! The text of a request's outputs (as vLLM v1's `OutputProcessor`): turns the token ids the
//! engine thread sends for a request's sequences into text, detokenized incrementally and cut
//! at stop strings. It runs on the output stage's thread (`output_stage.rs`), off the engine
//! thread and the callers', one processor per request; its stop strings are compiled once and
//! shared by the request's sequences.
//!
//! Invariants:
//! - The text of a sequence's outputs, concatenated, is its detokenized output cut before the
//!   first stop string (a stop string ends it with `FinishReason::Stop`).
//! - Once a sequence has finished here, later outputs of it are dropped: the tokens the engine
//!   sampled before it heard of a stop string are never shown nor counted.
//! - The request is finished here once each of its sequences is.

use std::sync::Arc;

use ferrolm_sampling::{SamplingParams, StopChecker, StopStrings};
use ferrolm_tokenizer::{IncrementalDetokenizer, Tokenizer};

use super::handle::EngineError;
use super::state::RequestOutput;
use crate::request::FinishReason;

/// The text state of every sequence of one request.
pub(crate) struct OutputProcessor {
    /// By sequence index.
    sequences: Vec<SequenceText>,
    /// Sequences not finished here yet.
    num_unfinished: usize,
}

struct SequenceText {
    /// `None` when the engine runs without a tokenizer: no text, and stop strings never match.
    detokenizer: Option<IncrementalDetokenizer>,
    stop: StopChecker,
    finished: bool,
}

/// One output ready for the caller.
#[derive(Debug)]
pub(crate) struct Processed {
    pub(crate) output: RequestOutput,
    /// A stop string ended the sequence here while the engine still runs it: the engine must be
    /// told to finish it.
    pub(crate) stopped_here: bool,
}

/// A request's stop strings as one automaton; without a tokenizer there is no text to match, so
/// no automaton either.
pub(crate) fn stop_strings(
    tokenizer: Option<&Arc<Tokenizer>>,
    params: &SamplingParams,
) -> Result<StopStrings, EngineError> {
    Ok(if tokenizer.is_some() { StopStrings::new(&params.stop)? } else { StopStrings::default() })
}

impl OutputProcessor {
    /// `stops`: the request's stop strings, compiled by [`stop_strings`] (once for all the
    /// prompts of a client request that share them).
    pub(crate) fn new(
        tokenizer: Option<&Arc<Tokenizer>>,
        prompt_token_ids: &[u32],
        params: &SamplingParams,
        stops: StopStrings,
    ) -> Result<OutputProcessor, EngineError> {
        let sequences: Vec<SequenceText> = (0..params.n)
            .map(|_| {
                let detokenizer = tokenizer
                    .map(|t| IncrementalDetokenizer::new(Arc::clone(t), prompt_token_ids, params.skip_special_tokens))
                    .transpose()?;
                Ok(SequenceText { detokenizer, stop: StopChecker::new(stops.clone()), finished: false })
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(OutputProcessor { num_unfinished: sequences.len(), sequences })
    }

    /// Every sequence has finished here: nothing more will be let through.
    pub(crate) fn is_finished(&self) -> bool {
        self.num_unfinished == 0
    }

    /// Fills in the text of an output from the engine thread; `None` when the output's
    /// sequence has already finished here.
    pub(crate) fn process(&mut self, mut output: RequestOutput) -> Option<Processed> {
        let seq = self.sequences.get_mut(output.index as usize)?;
        if seq.finished {
            return None;
        }
        let engine_finished = output.finish_reason.is_some();
        if engine_finished {
            seq.finished = true;
            self.num_unfinished -= 1;
        }
        // An end without a token (an abort, a failed step) carries no text.
        if output.token_ids.is_empty() {
            return Some(Processed { output, stopped_here: false });
        }
        let mut delta = String::new();
        if let Some(detokenizer) = seq.detokenizer.as_mut() {
            for &token in &output.token_ids {
                delta.push_str(&detokenizer.push(token).unwrap_or_default());
            }
            if engine_finished {
                delta.push_str(&detokenizer.finish().unwrap_or_default());
            }
        }
        let result = seq.stop.push(&delta);
        output.text = result.emit;
        if result.stopped {
            output.finish_reason = Some(FinishReason::Stop);
            if !engine_finished {
                seq.finished = true;
                self.num_unfinished -= 1;
            }
        } else if engine_finished {
            output.text.push_str(&seq.stop.flush());
        }
        Some(Processed { output, stopped_here: result.stopped && !engine_finished })
    }
}

#[cfg(test)]
mod tests {
    use ferrolm_tokenizer::TokenizerError;

    use super::*;

    fn tokenizer() -> Result<Arc<Tokenizer>, TokenizerError> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/llama");
        Ok(Arc::new(Tokenizer::from_dir(&dir)?))
    }

    fn token(index: u32, token: u32, finish_reason: Option<FinishReason>) -> RequestOutput {
        RequestOutput { index, token_ids: vec![token], finish_reason, ..RequestOutput::default() }
    }

    /// Runs `ids` through one sequence and returns what the caller sees of each output.
    fn texts(
        processor: &mut OutputProcessor,
        ids: &[u32],
        last: Option<FinishReason>,
    ) -> Vec<Option<(String, Option<FinishReason>, bool)>> {
        ids.iter()
            .enumerate()
            .map(|(i, &id)| {
                let finish = if i + 1 == ids.len() { last } else { None };
                processor.process(token(0, id, finish)).map(|p| (p.output.text, p.output.finish_reason, p.stopped_here))
            })
            .collect()
    }

    #[test]
    fn text_is_cut_at_a_stop_string_and_later_tokens_are_dropped() -> Result<(), EngineError> {
        let tok = tokenizer()?;
        let ids = tok.encode("hello world, hello moon", false)?;
        let full = tok.decode(&ids, true)?;
        let params = SamplingParams { stop: vec![", hello".into()], ..SamplingParams::default() };
        let mut processor = OutputProcessor::new(Some(&tok), &[ids[0]], &params, stop_strings(Some(&tok), &params)?)?;
        let seen = texts(&mut processor, &ids, Some(FinishReason::Length));
        let text: String = seen.iter().flatten().map(|(t, _, _)| t.as_str()).collect();
        assert_eq!(full, "hello world, hello moon");
        assert_eq!(text, "hello world", "the text stops before the stop string");
        let last = seen.iter().rposition(Option::is_some).unwrap_or(0);
        assert_eq!(seen[last].as_ref().map(|(_, f, here)| (*f, *here)), Some((Some(FinishReason::Stop), true)));
        assert!(seen[last + 1..].iter().all(Option::is_none), "tokens after the stop are dropped: {seen:?}");
        assert!(seen[..last].iter().flatten().all(|(_, f, _)| f.is_none()));
        Ok(())
    }

    #[test]
    fn without_a_stop_the_whole_text_comes_through() -> Result<(), EngineError> {
        let tok = tokenizer()?;
        let ids = tok.encode("hello world", false)?;
        let params = SamplingParams { stop: vec!["world!".into()], ..SamplingParams::default() };
        let mut processor = OutputProcessor::new(Some(&tok), &[ids[0]], &params, stop_strings(Some(&tok), &params)?)?;
        let seen = texts(&mut processor, &ids, Some(FinishReason::Length));
        let text: String = seen.iter().flatten().map(|(t, _, _)| t.as_str()).collect();
        assert_eq!(text, "hello world", "text held back for a possible stop string is flushed at the end");
        assert_eq!(
            seen.last().and_then(|s| s.as_ref().map(|(_, f, here)| (*f, *here))),
            Some((Some(FinishReason::Length), false))
        );
        Ok(())
    }

    #[test]
    fn sequences_are_apart_and_ends_without_tokens_pass_through() -> Result<(), EngineError> {
        let tok = tokenizer()?;
        let ids = tok.encode("a b", false)?;
        let params = SamplingParams { n: 2, stop: vec![" b".into()], ..SamplingParams::default() };
        let mut processor = OutputProcessor::new(Some(&tok), &[ids[0]], &params, stop_strings(Some(&tok), &params)?)?;
        let abort = RequestOutput { index: 1, finish_reason: Some(FinishReason::Abort), ..RequestOutput::default() };
        let out = processor.process(abort).map(|p| (p.output.text, p.output.finish_reason, p.stopped_here));
        assert_eq!(out, Some((String::new(), Some(FinishReason::Abort), false)));
        assert!(processor.process(token(1, ids[0], None)).is_none(), "sequence 1 has ended");
        let out = processor.process(token(0, ids[0], None)).map(|p| p.output.finish_reason);
        assert_eq!(out, Some(None), "sequence 0 runs on");
        assert!(processor.process(token(7, ids[0], None)).is_none(), "no such sequence");
        assert!(!processor.is_finished());
        let stopped = ids
            .iter()
            .filter_map(|&id| processor.process(token(0, id, None)))
            .any(|p| p.output.finish_reason == Some(FinishReason::Stop) && p.stopped_here);
        assert!(stopped, "sequence 0 stops at \" b\"");
        assert!(processor.is_finished(), "both sequences have ended");
        Ok(())
    }

    #[test]
    fn without_a_tokenizer_outputs_carry_ids_only() {
        let params = SamplingParams { stop: vec!["x".into()], ..SamplingParams::default() };
        let Ok(mut processor) = OutputProcessor::new(None, &[1, 2], &params, StopStrings::default()) else {
            panic!("no tokenizer to fail")
        };
        let out =
            processor.process(token(0, 5, Some(FinishReason::Length))).map(|p| (p.output.token_ids, p.output.text));
        assert_eq!(out, Some((vec![5], String::new())));
    }
}
