//! The one error type of the tokenizer layer.
//!
//! Every message is a single line that names the file or the operation that failed, so the
//! server can log it or return it to the client as is.

use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer, encoding, decoding or rendering a
/// chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("model directory {0} does not exist or is not a directory")]
    DirNotFound(PathBuf),

    #[error("{0} not found: a model directory needs a tokenizer.json")]
    TokenizerJsonMissing(PathBuf),

    #[error("failed to read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("failed to parse {path}: {message}")]
    Parse { path: PathBuf, message: String },

    #[error("failed to encode text: {0}")]
    Encode(String),

    #[error("failed to decode token ids: {0}")]
    Decode(String),

    #[error("token id {id} is out of vocabulary: the tokenizer has {vocab_size} tokens")]
    UnknownTokenId { id: u32, vocab_size: usize },

    #[error("chat template syntax error: {0}")]
    ChatTemplateSyntax(String),

    #[error("chat template failed to render: {0}")]
    ChatTemplateRender(String),

    /// The template called `raise_exception(message)`; the message is the template's own.
    #[error("chat template raised an exception: {0}")]
    ChatTemplateRaised(String),

    #[error("not supported: {0}")]
    Unsupported(String),
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
