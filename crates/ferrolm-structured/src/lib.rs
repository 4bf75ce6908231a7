//! Structured output for ferrolm: what a request asks its output to match, compiled once into a
//! grammar, and per sequence the tokens each step may sample.
//!
//! - [`StructuredOutput`]: the request's constraint (a JSON schema, any JSON object, a regex, a
//!   choice of strings, a Lark grammar), as the API edge parses it.
//! - [`GrammarCompiler`]: built once per model from its tokenizer; compiles a constraint into a
//!   [`Grammar`] with llguidance, refusing what llguidance cannot handle with a message that names
//!   it, and keeps the compiled grammars of recent distinct constraints.
//! - [`Constraint`]: one sequence's state in its grammar: [`Constraint::fill_mask`] writes the
//!   allowed tokens as packed bits (ferrolm-sampling's `TokenMasks` layout) and
//!   [`Constraint::advance`] takes the sampled token.
//!
//! The end of the output: once the grammar is complete the mask allows the model's EOS ids (all
//! of them, not only the one the grammar engine knows), and nothing else once no further text
//! can follow.

mod compiler;
mod constraint;
mod error;
mod spec;
mod vocab;

pub use compiler::GrammarCompiler;
pub use constraint::{Constraint, Grammar};
pub use error::StructuredError;
pub use spec::StructuredOutput;
