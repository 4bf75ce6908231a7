//! ferrolm's text layer: the model's tokenizer, its chat template and the streaming
//! detokenizer that turns generated ids into text deltas.
//!
//! - [`Tokenizer`] loads a HF model directory (`tokenizer.json`, `tokenizer_config.json`,
//!   `chat_template.jinja`) and encodes and decodes exactly as HF's tokenizers do.
//! - [`ChatTemplate`] renders a conversation into a prompt as HF's `apply_chat_template`.
//! - [`Tokenizer::token_bytes`] gives the text bytes of every token, for grammars.
//! - [`IncrementalDetokenizer`] streams text per generated id without splitting characters.

mod chat_template;
mod config;
mod detokenizer;
mod error;
mod pyfmt;
mod strftime;
mod token_bytes;
mod tokenizer;

pub use chat_template::{ChatMessage, ChatTemplate, RenderOptions};
pub use config::{SpecialTokens, TokenizerConfig};
pub use detokenizer::IncrementalDetokenizer;
pub use error::{Result, TokenizerError};
pub use tokenizer::Tokenizer;
