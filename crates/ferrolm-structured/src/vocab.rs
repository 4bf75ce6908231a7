//! The model's vocabulary as llguidance sees it: each token's bytes in a token trie, special
//! tokens marked (so that no grammar text can produce them), and the model's EOS ids.

use std::sync::Arc;

use ferrolm_tokenizer::Tokenizer;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::error::StructuredError;

/// The token environment grammars are compiled against. `eos_token_ids`: every id that ends a
/// sequence (the model's list, not only the tokenizer's one).
pub(crate) fn token_env(tokenizer: &Tokenizer, eos_token_ids: &[u32]) -> Result<TokEnv, StructuredError> {
    let mut words = tokenizer.token_bytes().map_err(|e| StructuredError::Vocabulary(e.to_string()))?;
    let special: Vec<u32> = (0..words.len() as u32).filter(|&id| tokenizer.is_special(id)).collect();
    for &id in &special {
        // A special token matches only a grammar that names it, never text.
        words[id as usize].insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
    }
    words_env(words, eos_token_ids)
}

/// The token environment of a vocabulary given as each token's bytes (special tokens already
/// marked with `TokTrie::SPECIAL_TOKEN_MARKER`).
pub(crate) fn words_env(words: Vec<Vec<u8>>, eos_token_ids: &[u32]) -> Result<TokEnv, StructuredError> {
    let vocab_err = |e: &dyn std::fmt::Display| StructuredError::Vocabulary(e.to_string());
    let vocab_size = u32::try_from(words.len()).map_err(|e| vocab_err(&e))?;
    let eos: Vec<u32> = eos_token_ids.iter().copied().filter(|&t| t < vocab_size).collect();
    let Some(&first_eos) = eos.first() else {
        return Err(StructuredError::Vocabulary("the model has no EOS token id in the tokenizer's vocabulary".into()));
    };
    let trie = TokTrie::from(&TokRxInfo::new(vocab_size, first_eos), &words).with_eos_tokens(&eos);
    Ok(Arc::new(ApproximateTokEnv::new(trie)))
}
