//! The model's tokenizer: loading a HF model directory, text to ids and ids to text.
//!
//! `tokenizer.json` is authoritative for splitting text and for the special tokens it marks;
//! `tokenizer_config.json` names BOS/EOS, may force a leading BOS and may carry the chat
//! template; `chat_template.jinja`, when present, replaces the latter (as in HF).
//! Every id handed to `decode` must be in the vocabulary: an unknown id is an error, never
//! silently dropped.

use std::collections::HashSet;
use std::fs;
use std::io::ErrorKind as IoErrorKind;
use std::path::Path;

use crate::chat_template::ChatTemplate;
use crate::config::TokenizerConfig;
use crate::error::{Result, TokenizerError};

const TOKENIZER_JSON: &str = "tokenizer.json";
const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";
const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";

/// [`Tokenizer::surely_past`] tokenizes a long text in pieces of about this many bytes.
const PIECE_BYTES: usize = 64 << 10;
/// Tokens that one cut between pieces may add against tokenizing the whole: cuts fall before a
/// whitespace byte, where pre-tokenizers split anyway, but merges across a run of whitespace
/// may still differ by a few.
const CUT_SLACK: usize = 8;

/// A loaded tokenizer with its special tokens and chat template. `Send + Sync`: share one
/// behind an `Arc` across requests.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    config: TokenizerConfig,
    chat_template: Option<ChatTemplate>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    /// Ids of the added tokens tokenizer.json marks special: the ones
    /// `decode(.., skip_special_tokens = true)` drops.
    special_ids: HashSet<u32>,
    /// One past the highest id, added tokens included.
    vocab_size: usize,
    /// Bytes of the longest token string, added tokens included: no token stands for more bytes
    /// of text (byte-level token strings spell each byte as one char, SentencePiece ones spell a
    /// space as the 3-byte `▁` and a fallback byte as `<0xAB>`, so neither is shorter in UTF-8
    /// than the text it stands for).
    max_token_bytes: usize,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` (required), `dir/tokenizer_config.json` and
    /// `dir/chat_template.jinja` (both optional).
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        if !dir.is_dir() {
            return Err(TokenizerError::DirNotFound(dir.to_path_buf()));
        }
        let tokenizer_path = dir.join(TOKENIZER_JSON);
        let tokenizer_bytes = match fs::read(&tokenizer_path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == IoErrorKind::NotFound => {
                return Err(TokenizerError::TokenizerJsonMissing(tokenizer_path))
            }
            Err(source) => return Err(TokenizerError::Io { path: tokenizer_path, source }),
        };
        let inner = tokenizers::Tokenizer::from_bytes(&tokenizer_bytes)
            .map_err(|e| TokenizerError::Parse { path: tokenizer_path.clone(), message: one_line(&e.to_string()) })?;

        let config_path = dir.join(TOKENIZER_CONFIG_JSON);
        let config = match read_optional(&config_path)? {
            Some(text) => TokenizerConfig::from_json(&text, &config_path)?,
            None => TokenizerConfig::default(),
        };
        // NOTE: as in HF, chat_template.jinja wins over a template inside the config.
        let template_path = dir.join(CHAT_TEMPLATE_JINJA);
        let template = match read_optional(&template_path)? {
            Some(source) => Some((source, template_path)),
            None => config.chat_template.clone().map(|source| (source, config_path)),
        };
        let template = template.as_ref().map(|(source, path)| (source.as_str(), path.as_path()));
        Self::build(inner, config, template)
    }

    /// `template` is the chat template's source and the file it came from.
    fn build(
        inner: tokenizers::Tokenizer,
        config: TokenizerConfig,
        template: Option<(&str, &Path)>,
    ) -> Result<Tokenizer> {
        let chat_template = match template {
            Some((source, path)) => {
                Some(ChatTemplate::new(source, config.special_tokens.clone()).map_err(|e| match e {
                    TokenizerError::ChatTemplateSyntax(msg) => {
                        TokenizerError::ChatTemplateSyntax(format!("{}: {msg}", path.display()))
                    }
                    other => other,
                })?)
            }
            None => None,
        };
        let bos_token_id = config.special_tokens.bos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let eos_token_id = config.special_tokens.eos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let special_ids =
            inner.get_added_tokens_decoder().into_iter().filter(|(_, token)| token.special).map(|(id, _)| id).collect();
        // NOTE: one past the highest id, not the number of tokens: ids may skip some numbers, and
        // an added token may reuse a base token's id.
        let vocab = inner.get_vocab(true);
        let vocab_size = vocab.values().max().map_or(0, |&id| id as usize + 1);
        let max_token_bytes = vocab.keys().map(String::len).max().unwrap_or(1).max(1);
        Ok(Tokenizer {
            inner,
            config,
            chat_template,
            bos_token_id,
            eos_token_id,
            special_ids,
            vocab_size,
            max_token_bytes,
        })
    }

    /// Text to ids. With `add_special_tokens`, tokenizer.json's post-processor adds what it
    /// defines (BOS, EOS), and a BOS is prepended when tokenizer_config.json sets
    /// `add_bos_token: true` and the post-processor did not add it.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode(one_line(&e.to_string())))?;
        let mut ids = encoding.get_ids().to_vec();
        if add_special_tokens && self.config.add_bos_token == Some(true) {
            if let Some(bos) = self.bos_token_id {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    /// Ids to text; invalid UTF-8 from byte-level tokens becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.decode_unchecked(ids, skip_special_tokens)
    }

    /// `decode` for ids already known to be in the vocabulary.
    pub(crate) fn decode_unchecked(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| TokenizerError::Decode(one_line(&e.to_string())))
    }

    pub(crate) fn check_id(&self, id: u32) -> Result<()> {
        match self.inner.id_to_token(id) {
            Some(_) => Ok(()),
            None => Err(TokenizerError::UnknownTokenId { id, vocab_size: self.vocab_size }),
        }
    }

    /// A lower bound on the tokens `encode` gives for `text_bytes` bytes of text, without
    /// tokenizing: no token covers more than the longest token string's bytes. It holds for
    /// normalizers that do not delete or compose text (those of byte-level BPE and SentencePiece
    /// models); special tokens `encode` adds only raise the count.
    pub fn min_tokens_for(&self, text_bytes: usize) -> usize {
        text_bytes.div_ceil(self.max_token_bytes)
    }

    /// Whether `text` surely encodes to more than `limit` tokens (no special tokens added),
    /// answering a lower bound on its tokens if so. A long text is tokenized in pieces, and the
    /// count stops as soon as it is surely past `limit`, so the work is bounded by `limit`
    /// tokens, not by the text. A text of one piece is not counted (`None`): tokenizing it whole
    /// costs as little.
    pub fn surely_past(&self, text: &str, limit: usize) -> Result<Option<usize>> {
        if text.len() <= PIECE_BYTES {
            return Ok(None);
        }
        let (mut count, mut cuts, mut rest) = (0usize, 0usize, text);
        while !rest.is_empty() {
            let (piece, tail) = rest.split_at(piece_end(rest, PIECE_BYTES));
            let encoding =
                self.inner.encode(piece, false).map_err(|e| TokenizerError::Encode(one_line(&e.to_string())))?;
            count += encoding.len();
            rest = tail;
            cuts += usize::from(!rest.is_empty());
            let at_least = count.saturating_sub(cuts * CUT_SLACK);
            if at_least > limit {
                return Ok(Some(at_least));
            }
        }
        Ok(None)
    }

    /// One past the highest id the tokenizer knows, added tokens included: every id it can
    /// decode is below it. A model's embedding may have more rows (padding), which no text
    /// encodes to and which must never be sampled.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Id of tokenizer_config.json's `bos_token`.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Id of tokenizer_config.json's `eos_token`. Models may stop on more ids than this
    /// (generation_config.json's `eos_token_id` list); that list is read with the model.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// Whether `id` is an added token marked special, i.e. one that
    /// `decode(.., skip_special_tokens = true)` leaves out.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The HF tokenizer itself, for this crate's other views of the vocabulary.
    pub(crate) fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The normalised tokenizer_config.json (special token strings, `model_max_length`).
    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }
}

/// Reads a file that may be absent; any other failure is an error naming the file.
fn read_optional(path: &Path) -> Result<Option<String>> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == IoErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io { path: path.to_path_buf(), source }),
    }
}

/// Error messages stay on one line so they read well in logs and HTTP bodies.
/// Where the piece of `text` that starts it ends: before the first ASCII whitespace at or after
/// `target` bytes (within 4 KiB), else at the first char boundary from `target`; all of a short
/// text.
fn piece_end(text: &str, target: usize) -> usize {
    if text.len() <= target {
        return text.len();
    }
    let window = &text.as_bytes()[target..text.len().min(target + 4096)];
    match window.iter().position(u8::is_ascii_whitespace) {
        Some(at) => target + at,
        None => (target..text.len()).find(|&i| text.is_char_boundary(i)).unwrap_or(text.len()),
    }
}

fn one_line(message: &str) -> String {
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine shares one tokenizer across request tasks.
    #[test]
    fn tokenizer_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
    }

    #[test]
    fn messages_stay_on_one_line() {
        assert_eq!(one_line("expected value\n  at line 1"), "expected value at line 1");
    }
}
