//! The streaming detokenizer against whole-sequence decoding: the deltas must add up to
//! exactly what `decode` gives for all ids, and never split a character.

use std::path::Path;
use std::sync::Arc;

use ferrolm_tokenizer::{IncrementalDetokenizer, Tokenizer};
use proptest::prelude::*;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures");

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn llama_tokenizer() -> Result<Arc<Tokenizer>, ferrolm_tokenizer::TokenizerError> {
    Tokenizer::from_dir(&Path::new(FIXTURES).join("llama")).map(Arc::new)
}

/// Streams `generated` after `prompt`; returns every delta, the `finish` output last.
fn stream(
    tokenizer: &Arc<Tokenizer>,
    prompt: &[u32],
    generated: &[u32],
    skip_special_tokens: bool,
) -> Result<Vec<String>, ferrolm_tokenizer::TokenizerError> {
    let mut detok = IncrementalDetokenizer::new(Arc::clone(tokenizer), prompt, skip_special_tokens)?;
    let mut deltas = Vec::with_capacity(generated.len() + 1);
    for &id in generated {
        deltas.push(detok.push(id)?);
    }
    deltas.push(detok.finish()?);
    Ok(deltas)
}

/// Checks the streaming invariants for `generated` after an empty prompt.
fn check_stream(tokenizer: &Arc<Tokenizer>, generated: &[u32], skip: bool) -> Result<(), String> {
    let deltas = stream(tokenizer, &[], generated, skip).map_err(|e| e.to_string())?;
    let full = tokenizer.decode(generated, skip).map_err(|e| e.to_string())?;
    let joined: String = deltas.concat();
    if joined != full {
        return Err(format!("deltas {deltas:?} join to {joined:?}, decode gives {full:?}"));
    }
    // Deltas before finish never end inside a character; a U+FFFD they hold is one the
    // full decode has at the same place (implied by the concatenation being equal).
    let (_, before_finish) = deltas.split_last().ok_or("no deltas")?;
    if let Some(bad) = before_finish.iter().find(|d| d.ends_with(char::REPLACEMENT_CHARACTER)) {
        return Err(format!("delta {bad:?} ends in U+FFFD"));
    }
    Ok(())
}

#[test]
fn multibyte_characters_are_never_split() -> TestResult {
    let tokenizer = llama_tokenizer()?;
    let text = "héllo wörld ✓ 🙂";
    let ids = tokenizer.encode(text, false)?;
    // The fixture's byte-level BPE spreads each of ✓ and 🙂 over several tokens.
    assert!(ids.len() > text.chars().count());
    let deltas = stream(&tokenizer, &[], &ids, true)?;
    assert_eq!(deltas.concat(), text);
    for delta in &deltas {
        assert!(!delta.contains(char::REPLACEMENT_CHARACTER), "{deltas:?}");
    }
    // The emoji arrives whole, in the delta of the token carrying its last byte.
    assert!(deltas.iter().any(|d| d.ends_with('🙂')), "{deltas:?}");
    assert_eq!(deltas.last().map(String::as_str), Some(""));
    Ok(())
}

#[test]
fn reference_texts_stream_exactly() -> TestResult {
    let tokenizer = llama_tokenizer()?;
    for text in ["fn main() { println!(\"hi\"); }", "  return x * torch.rsqrt(variance + eps)\n", "a ✓✓ b 🙂🙂!"]
    {
        let ids = tokenizer.encode(text, false)?;
        check_stream(&tokenizer, &ids, false)?;
        assert_eq!(stream(&tokenizer, &[], &ids, false)?.concat(), text);
    }
    Ok(())
}

#[test]
fn stream_after_a_prompt_continues_its_text() -> TestResult {
    let tokenizer = llama_tokenizer()?;
    let prompt = tokenizer.encode("<s>user\nSay héllo wörld ✓ please</s>\n", false)?;
    let generated = tokenizer.encode("héllo wörld ✓ 🙂</s>", false)?;
    let deltas = stream(&tokenizer, &prompt, &generated, true)?;
    assert_eq!(deltas.concat(), "héllo wörld ✓ 🙂");
    let deltas = stream(&tokenizer, &prompt, &generated, false)?;
    assert_eq!(deltas.concat(), "héllo wörld ✓ 🙂</s>");
    Ok(())
}

#[test]
fn window_stays_small_on_clean_text() -> TestResult {
    let tokenizer = llama_tokenizer()?;
    let text = "The quick brown fox jumps over the lazy dog. ✓ 🙂 ".repeat(20);
    let ids = tokenizer.encode(&text, false)?;
    let mut detok = IncrementalDetokenizer::new(Arc::clone(&tokenizer), &[], false)?;
    let mut max_window = 0;
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&detok.push(id)?);
        max_window = max_window.max(detok.window_len());
    }
    out.push_str(&detok.finish()?);
    assert_eq!(out, text);
    // At most the previous delta's tokens plus the 4 bytes of one character.
    assert!(max_window <= 8, "window grew to {max_window} over {} tokens", ids.len());
    Ok(())
}

#[test]
fn unknown_id_is_an_error_not_a_panic() -> TestResult {
    let tokenizer = llama_tokenizer()?;
    assert!(IncrementalDetokenizer::new(Arc::clone(&tokenizer), &[1, 99_999], true).is_err());
    let mut detok = IncrementalDetokenizer::new(Arc::clone(&tokenizer), &[], true)?;
    assert!(detok.push(320).is_err());
    assert_eq!(detok.push(72)?, tokenizer.decode(&[72], true)?);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_ids_stream_to_their_decode(ids in prop::collection::vec(0u32..320, 0..48), skip in any::<bool>()) {
        let tokenizer = llama_tokenizer().map_err(|e| TestCaseError::fail(e.to_string()))?;
        check_stream(&tokenizer, &ids, skip).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn random_ids_after_a_prompt_continue_its_text(
        prompt in prop::collection::vec(3u32..97, 0..12),
        ids in prop::collection::vec(0u32..320, 0..32),
    ) {
        // Ids 3..97 are the printable ASCII bytes, so the prompt text ends on a
        // character boundary and the stream must add exactly the rest.
        let tokenizer = llama_tokenizer().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let prompt_text = tokenizer.decode(&prompt, false).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let all: Vec<u32> = prompt.iter().chain(&ids).copied().collect();
        let full = tokenizer.decode(&all, false).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let deltas = stream(&tokenizer, &prompt, &ids, false).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(format!("{prompt_text}{}", deltas.concat()), full);
    }
}
