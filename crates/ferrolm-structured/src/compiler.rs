//! `GrammarCompiler`: constraints compiled into grammars once per distinct constraint.
//!
//! Compiling a JSON schema or a Lark grammar costs milliseconds to seconds; agents send the same
//! schema with every request. The compiler keeps the compiled grammars of the last
//! [`CACHE_CAPACITY`] distinct constraints (least recently used out first) and hands out deep
//! copies, which share the compiled grammar and start fresh (each copy grows its own lexer
//! state cache as its sequence runs). A compile also computes the first mask, so a constraint
//! no output can start is refused here rather than once a sequence runs.

use std::collections::HashMap;
use std::sync::Mutex;

use ferrolm_tokenizer::Tokenizer;
use llguidance::{ParserFactory, TokenParser};

use crate::constraint::Grammar;
use crate::error::StructuredError;
use crate::spec::StructuredOutput;
use crate::vocab::{token_env, words_env};

/// Distinct constraints whose compiled grammars are kept.
pub const CACHE_CAPACITY: usize = 256;
/// Longest constraint (a schema's JSON text, a regex, a grammar, the choices), in bytes: what the
/// cache holds stays bounded, and so does the work of compiling one.
pub const MAX_CONSTRAINT_BYTES: usize = 128 << 10;

/// Compiles constraints against one model's vocabulary. `Send + Sync`: share one per model.
pub struct GrammarCompiler {
    factory: ParserFactory,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    entries: HashMap<String, Entry>,
    clock: u64,
}

struct Entry {
    parser: TokenParser,
    last_used: u64,
}

impl GrammarCompiler {
    /// The compiler for `tokenizer`'s vocabulary; `eos_token_ids` are every id that ends a
    /// sequence, which a complete output may sample.
    pub fn new(tokenizer: &Tokenizer, eos_token_ids: &[u32]) -> Result<GrammarCompiler, StructuredError> {
        Self::with_env(token_env(tokenizer, eos_token_ids)?)
    }

    /// The compiler for a vocabulary given as each token's bytes, the ids in `special` being
    /// special tokens (which no text produces): for models without a tokenizer, as benchmarks
    /// of random-weight models run.
    pub fn from_token_bytes(
        mut words: Vec<Vec<u8>>,
        special: &[u32],
        eos_token_ids: &[u32],
    ) -> Result<GrammarCompiler, StructuredError> {
        for &id in special {
            if let Some(word) = words.get_mut(id as usize) {
                word.insert(0, toktrie::TokTrie::SPECIAL_TOKEN_MARKER);
            }
        }
        Self::with_env(words_env(words, eos_token_ids)?)
    }

    fn with_env(env: toktrie::TokEnv) -> Result<GrammarCompiler, StructuredError> {
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| StructuredError::Vocabulary(e.to_string()))?;
        // Warnings and errors come back as values; nothing goes to stderr.
        factory.quiet();
        Ok(GrammarCompiler { factory, cache: Mutex::new(Cache::default()) })
    }

    /// `output` compiled, or the reason it cannot be (a schema feature, regex or grammar
    /// llguidance does not support), as a one-line message for the client.
    pub fn compile(&self, output: &StructuredOutput) -> Result<Grammar, StructuredError> {
        let key = output.key();
        if key.len() > MAX_CONSTRAINT_BYTES {
            return Err(StructuredError::Invalid(format!(
                "the constraint is {} bytes, more than the {MAX_CONSTRAINT_BYTES} allowed",
                key.len()
            )));
        }
        if let Some(parser) = self.cache.lock().expect("grammar cache").get(&key) {
            return Ok(Grammar::new(parser));
        }
        // NOTE: compiled outside the lock: a slow schema must not hold up other requests.
        let parser = self
            .factory
            .create_parser(output.grammar())
            .map_err(|e| StructuredError::Invalid(one_line(&e.to_string())))?;
        let grammar = Grammar::new(parser.deep_clone());
        grammar.check_start()?;
        self.cache.lock().expect("grammar cache").insert(key, parser);
        Ok(grammar)
    }

    /// Compiled grammars kept.
    pub fn cached(&self) -> usize {
        self.cache.lock().expect("grammar cache").entries.len()
    }
}

impl Cache {
    fn get(&mut self, key: &str) -> Option<TokenParser> {
        self.clock += 1;
        let entry = self.entries.get_mut(key)?;
        entry.last_used = self.clock;
        Some(entry.parser.deep_clone())
    }

    fn insert(&mut self, key: String, parser: TokenParser) {
        self.clock += 1;
        if self.entries.len() >= CACHE_CAPACITY && !self.entries.contains_key(&key) {
            let oldest = self.entries.iter().min_by_key(|(_, e)| e.last_used).map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                self.entries.remove(&oldest);
            }
        }
        self.entries.insert(key, Entry { parser, last_used: self.clock });
    }
}

fn one_line(message: &str) -> String {
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}
