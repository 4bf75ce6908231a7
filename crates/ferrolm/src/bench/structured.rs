//! `--structured-output`: every benchmark request generates under a grammar, to measure what
//! constrained decoding costs against the same run without it.
//!
//! The grammar is a JSON schema of the shape agents ask for (an array of records with numbers,
//! bounded strings, enums, nested arrays) whose `minItems` keeps it open for any output length,
//! so each request still produces exactly its output length and every one of its steps computes
//! a real mask. A model directory's tokenizer gives the vocabulary; a `--model-config` model
//! has none, so its vocabulary is made of the text's own substrings (every byte, then distinct
//! pieces of English and Rust prose up to the model's vocabulary size), which gives the grammar
//! engine a token trie of a real vocabulary's depth and fan-out.

use anyhow::{Context, Result};
use clap::ValueEnum;
use ferrolm_structured::{Grammar, GrammarCompiler, StructuredOutput};
use serde::Serialize;
use serde_json::json;

use super::setup::BenchModel;

/// What `--structured-output` constrains each request to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StructuredBench {
    /// An open JSON array of records under a JSON schema.
    JsonSchema,
}

/// Text the synthetic vocabulary is cut from.
const CORPUS: [&str; 3] =
    [include_str!("../../../../README.md"), include_str!("../../../../docs/ARCHITECTURE.md"), include_str!("mod.rs")];

/// Longest synthetic token, in bytes.
const MAX_PIECE: usize = 12;

impl StructuredBench {
    /// The grammar every request follows, compiled for `model`'s vocabulary.
    pub fn grammar(self, model: &BenchModel) -> Result<Grammar> {
        let eos = &model.config.eos_token_ids;
        let compiler = match &model.tokenizer {
            Some(tokenizer) => GrammarCompiler::new(tokenizer, eos),
            None => {
                let words = synthetic_vocabulary(model.config.output_vocab_size, eos);
                GrammarCompiler::from_token_bytes(words, eos, eos)
            }
        }
        .context("no grammar for this vocabulary")?;
        let StructuredBench::JsonSchema = self;
        compiler.compile(&StructuredOutput::JsonSchema(records_schema())).context("the benchmark's schema")
    }
}

fn records_schema() -> serde_json::Value {
    let record = json!({
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 32},
            "kind": {"enum": ["user", "assistant", "tool", "system"]},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
            "active": {"type": "boolean"}
        },
        "required": ["id", "name", "kind", "score", "tags", "active"],
        "additionalProperties": false
    });
    // NOTE: open for any output length: no record is under one token.
    json!({"type": "array", "items": record, "minItems": 100_000})
}

/// `size` tokens: the 256 bytes, then distinct substrings of [`CORPUS`] (each also with a leading
/// space), the ids in `eos` left empty for the special tokens they are.
fn synthetic_vocabulary(size: usize, eos: &[u32]) -> Vec<Vec<u8>> {
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).take(size).collect();
    let mut seen: std::collections::HashSet<Vec<u8>> = words.iter().cloned().collect();
    'fill: for len in 2..=MAX_PIECE {
        for text in CORPUS {
            for window in text.as_bytes().windows(len) {
                for piece in [window.to_vec(), [b" ", window].concat()] {
                    if words.len() >= size {
                        break 'fill;
                    }
                    if std::str::from_utf8(&piece).is_ok() && seen.insert(piece.clone()) {
                        words.push(piece);
                    }
                }
            }
        }
    }
    // Past what the text gives: numbered pieces, so that every id has bytes.
    while words.len() < size {
        words.push(format!("<{}>", words.len()).into_bytes());
    }
    for &id in eos {
        if let Some(word) = words.get_mut(id as usize) {
            *word = format!("<eos{id}>").into_bytes();
        }
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_vocabulary_is_distinct_and_sized() {
        let words = synthetic_vocabulary(128_256, &[128_001, 128_009]);
        assert_eq!(words.len(), 128_256);
        let distinct: std::collections::HashSet<&Vec<u8>> = words.iter().collect();
        assert_eq!(distinct.len(), words.len());
        assert!(words.iter().all(|w| !w.is_empty()));
    }

    /// The schema stays open: a long walk of tokens it allows never closes the array, and every
    /// mask allows some token but never EOS.
    #[test]
    fn the_records_schema_stays_open_on_a_synthetic_vocabulary() {
        let eos = [4095];
        let words = synthetic_vocabulary(4096, &eos);
        let compiler = GrammarCompiler::from_token_bytes(words, &eos, &eos).expect("compiler");
        let grammar = compiler.compile(&StructuredOutput::JsonSchema(records_schema())).expect("schema");
        let mut constraint = grammar.start();
        let mut mask = vec![0u32; 4096 / 32];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for step in 0..400 {
            constraint.fill_mask(&mut mask).expect("mask");
            let allowed: Vec<u32> = (0..4096u32).filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1).collect();
            assert!(!allowed.is_empty() && !allowed.contains(&eos[0]), "step {step}");
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            constraint.advance(allowed[state as usize % allowed.len()]).expect("advance");
        }
    }
}
