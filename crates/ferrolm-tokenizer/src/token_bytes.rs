//! The bytes of text each token id stands for, as a grammar engine needs them to tell which
//! tokens can continue a structured output.
//!
//! A token's string in `tokenizer.json` is not its text: byte-level BPE vocabularies (GPT-2,
//! Llama 3, Qwen) spell each byte as one char of a fixed 256-char alphabet, and SentencePiece
//! vocabularies (Llama 2, Mistral, Gemma) spell a space as `▁` and a byte-fallback token as
//! `<0xAB>`. Added tokens are their content, verbatim. The scheme is read from the tokenizer's
//! decoder; a vocabulary of another kind (WordPiece) is refused.

use std::collections::HashMap;

use tokenizers::DecoderWrapper;

use crate::error::{Result, TokenizerError};
use crate::tokenizer::Tokenizer;

/// How a vocabulary spells bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spelling {
    /// GPT-2's byte-to-char table: every byte one char.
    ByteLevel,
    /// `▁` for a space, `<0xAB>` for a byte-fallback token, other chars as UTF-8.
    SentencePiece,
}

impl Tokenizer {
    /// For each id below [`Tokenizer::vocab_size`], the bytes of text it decodes to (empty for
    /// an id the vocabulary skips). Special tokens are their content; [`Tokenizer::is_special`]
    /// tells them apart.
    pub fn token_bytes(&self) -> Result<Vec<Vec<u8>>> {
        let spelling = spelling(self.inner().get_decoder())?;
        let byte_of_char: HashMap<char, u8> = gpt2_chars().into_iter().map(|(b, c)| (c, b)).collect();
        let added: HashMap<u32, String> =
            self.inner().get_added_tokens_decoder().into_iter().map(|(id, t)| (id, t.content)).collect();
        let mut bytes = vec![Vec::new(); self.vocab_size()];
        for (token, id) in self.inner().get_vocab(false) {
            if let Some(slot) = bytes.get_mut(id as usize) {
                *slot = match spelling {
                    Spelling::ByteLevel => byte_level(&token, &byte_of_char),
                    Spelling::SentencePiece => sentence_piece(&token),
                };
            }
        }
        // NOTE: added tokens win over a base token of the same id, as in decoding.
        for (id, content) in added {
            if let Some(slot) = bytes.get_mut(id as usize) {
                *slot = content.into_bytes();
            }
        }
        Ok(bytes)
    }
}

fn spelling(decoder: Option<&DecoderWrapper>) -> Result<Spelling> {
    let unsupported = |what: &str| TokenizerError::Unsupported(format!("token bytes of a vocabulary with {what}"));
    let decoders: Vec<&DecoderWrapper> = match decoder {
        Some(DecoderWrapper::Sequence(seq)) => seq.get_decoders().iter().collect(),
        Some(d) => vec![d],
        None => return Err(unsupported("no decoder")),
    };
    if decoders.iter().any(|d| matches!(d, DecoderWrapper::ByteLevel(_))) {
        return Ok(Spelling::ByteLevel);
    }
    let sentence_piece =
        |d: &&DecoderWrapper| matches!(d, DecoderWrapper::Metaspace(_) | DecoderWrapper::ByteFallback(_));
    if decoders.iter().any(sentence_piece) {
        return Ok(Spelling::SentencePiece);
    }
    Err(unsupported("a decoder other than byte-level or SentencePiece"))
}

/// GPT-2's table: printable bytes map to themselves, the rest to chars from U+0100 on.
fn gpt2_chars() -> Vec<(u8, char)> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b, char::from(b))
            } else {
                next += 1;
                (b, char::from_u32(next - 1).expect("U+0100..U+0143 are chars"))
            }
        })
        .collect()
}

fn byte_level(token: &str, byte_of_char: &HashMap<char, u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(token.len());
    for c in token.chars() {
        match byte_of_char.get(&c) {
            Some(&b) => out.push(b),
            // A char outside the table (a hand-added token string): its own UTF-8.
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

fn sentence_piece(token: &str) -> Vec<u8> {
    let fallback = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>')).filter(|h| h.len() == 2);
    if let Some(byte) = fallback.and_then(|h| u8::from_str_radix(h, 16).ok()) {
        return vec![byte];
    }
    token.replace('\u{2581}', " ").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_table_is_a_bijection_of_bytes() {
        let table = gpt2_chars();
        let chars: std::collections::HashSet<char> = table.iter().map(|&(_, c)| c).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(table[b' ' as usize].1, '\u{120}', "a space is Ġ");
        assert_eq!(table[b'\n' as usize].1, '\u{10a}', "a newline is Ċ");
        assert_eq!(table[b'a' as usize].1, 'a');
    }

    #[test]
    fn sentence_piece_spells_spaces_and_fallback_bytes() {
        assert_eq!(sentence_piece("\u{2581}the"), b" the");
        assert_eq!(sentence_piece("<0x0A>"), b"\n");
        assert_eq!(sentence_piece("<0xZZ>"), b"<0xZZ>");
    }
}
