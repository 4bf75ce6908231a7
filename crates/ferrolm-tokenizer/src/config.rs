//! Parsing of `tokenizer_config.json`, the HF file that names the special tokens, says whether
//! a BOS token is prepended, and may carry the chat template.
//!
//! Only the fields ferrolm uses are read; every other key is ignored. Each field accepts the
//! shapes HF writes: a special token is a string or an `{"content": ..}` object, the chat
//! template is a string or a list of `{name, template}` of which "default" is used.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Result, TokenizerError};

/// HF writes `int(1e30)` as `model_max_length` when the model sets no limit.
const NO_LENGTH_LIMIT: f64 = 1e30;

/// The special token strings of `tokenizer_config.json`; a chat template sees them as
/// `bos_token`, `eos_token`, ...
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub unk_token: Option<String>,
}

/// The fields of `tokenizer_config.json` that ferrolm uses, normalised.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerConfig {
    pub special_tokens: SpecialTokens,
    /// `None` leaves BOS handling to tokenizer.json's post-processor.
    pub add_bos_token: Option<bool>,
    pub chat_template: Option<String>,
    /// `None` when absent or set to HF's "no limit" sentinel.
    pub model_max_length: Option<usize>,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "a token string or an object with a \"content\" string")]
enum SpecialTokenField {
    Content(String),
    Object { content: String },
}

impl SpecialTokenField {
    fn into_content(self) -> String {
        match self {
            SpecialTokenField::Content(s) | SpecialTokenField::Object { content: s } => s,
        }
    }
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "a template string or a list of {\"name\", \"template\"} objects")]
enum ChatTemplateField {
    Single(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct RawTokenizerConfig {
    #[serde(default)]
    bos_token: Option<SpecialTokenField>,
    #[serde(default)]
    eos_token: Option<SpecialTokenField>,
    #[serde(default)]
    pad_token: Option<SpecialTokenField>,
    #[serde(default)]
    unk_token: Option<SpecialTokenField>,
    #[serde(default)]
    add_bos_token: Option<bool>,
    #[serde(default)]
    chat_template: Option<ChatTemplateField>,
    #[serde(default)]
    model_max_length: Option<f64>,
}

impl TokenizerConfig {
    /// Parses the text of a `tokenizer_config.json`; `path` only names the file in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let raw: RawTokenizerConfig = serde_json::from_str(text)
            .map_err(|e| TokenizerError::Parse { path: path.to_path_buf(), message: e.to_string() })?;
        let chat_template = match raw.chat_template {
            Some(ChatTemplateField::Single(t)) => Some(t),
            // NOTE: HF refuses to pick among named templates when none is called "default";
            // the model then has no chat template unless chat_template.jinja provides one.
            Some(ChatTemplateField::Named(list)) => list.into_iter().find(|t| t.name == "default").map(|t| t.template),
            None => None,
        };
        // The range leaves out NaN, infinities and the sentinel; values past usize::MAX are
        // rejected rather than saturated by `as`.
        let model_max_length = raw
            .model_max_length
            .filter(|n| (0.0..NO_LENGTH_LIMIT).contains(n) && *n <= usize::MAX as f64)
            .map(|n| n as usize);
        Ok(TokenizerConfig {
            special_tokens: SpecialTokens {
                bos_token: raw.bos_token.map(SpecialTokenField::into_content),
                eos_token: raw.eos_token.map(SpecialTokenField::into_content),
                pad_token: raw.pad_token.map(SpecialTokenField::into_content),
                unk_token: raw.unk_token.map(SpecialTokenField::into_content),
            },
            add_bos_token: raw.add_bos_token,
            chat_template,
            model_max_length,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<TokenizerConfig> {
        TokenizerConfig::from_json(text, Path::new("tokenizer_config.json"))
    }

    #[test]
    fn special_tokens_as_strings_or_objects() -> Result<()> {
        let cfg = parse(
            r#"{"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>",
                "lstrip": false}, "pad_token": null, "add_bos_token": true}"#,
        )?;
        assert_eq!(cfg.special_tokens.bos_token.as_deref(), Some("<s>"));
        assert_eq!(cfg.special_tokens.eos_token.as_deref(), Some("</s>"));
        assert_eq!(cfg.special_tokens.pad_token, None);
        assert_eq!(cfg.add_bos_token, Some(true));
        Ok(())
    }

    #[test]
    fn named_chat_templates_pick_default() -> Result<()> {
        let cfg = parse(
            r#"{"chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]}"#,
        )?;
        assert_eq!(cfg.chat_template.as_deref(), Some("D"));
        let cfg = parse(r#"{"chat_template": [{"name": "tool_use", "template": "T"}]}"#)?;
        assert_eq!(cfg.chat_template, None);
        Ok(())
    }

    #[test]
    fn model_max_length_sentinel_means_no_limit() -> Result<()> {
        let cfg = parse(r#"{"model_max_length": 1000000000000000019884624838656}"#)?;
        assert_eq!(cfg.model_max_length, None);
        let cfg = parse(r#"{"model_max_length": 4096}"#)?;
        assert_eq!(cfg.model_max_length, Some(4096));
        Ok(())
    }

    #[test]
    fn wrong_field_type_names_the_file() {
        let err = parse(r#"{"add_bos_token": "yes"}"#).err().map(|e| e.to_string());
        let msg = err.unwrap_or_default();
        assert!(msg.contains("tokenizer_config.json"), "{msg}");
    }
}
