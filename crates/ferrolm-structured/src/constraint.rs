//! `Grammar` (a compiled constraint, not started) and `Constraint` (one sequence's place in it).

use llguidance::{Matcher, TokenParser};

use crate::error::StructuredError;

/// A compiled constraint ready to start: each sequence of a request starts its own
/// [`Constraint`] from it.
pub struct Grammar {
    /// Boxed: a parser is large, and grammars travel in requests and commands.
    parser: Box<TokenParser>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

impl Clone for Grammar {
    fn clone(&self) -> Self {
        Grammar { parser: Box::new(self.parser.deep_clone()) }
    }
}

impl Grammar {
    pub(crate) fn new(parser: TokenParser) -> Grammar {
        Grammar { parser: Box::new(parser) }
    }

    /// Refuses a grammar no output of this vocabulary can start: its first mask fails (a lexer
    /// limit) or allows nothing, which would otherwise show only once a sequence runs.
    pub(crate) fn check_start(&self) -> Result<(), StructuredError> {
        let mut matcher = Matcher::new(Ok(self.parser.deep_clone()));
        let first = matcher.compute_mask().map_err(|e| StructuredError::Invalid(e.to_string()))?;
        if first.is_zero() {
            return Err(StructuredError::Invalid(
                "no output of this model's vocabulary satisfies the constraint".into(),
            ));
        }
        Ok(())
    }

    /// A sequence's constraint at the start of its output.
    pub fn start(&self) -> Constraint {
        Constraint { matcher: Matcher::new(Ok(self.parser.deep_clone())) }
    }
}

/// One sequence's state in its grammar: which tokens may come next, and the tokens taken.
///
/// Invariant: every sampled token is [`Constraint::advance`]d before the next
/// [`Constraint::fill_mask`], so the mask is always that of the sequence's next token.
pub struct Constraint {
    matcher: Matcher,
}

impl Constraint {
    /// Writes the tokens that may come next as packed bits (`[words]`, bit `t % 32` of word
    /// `t / 32`): what keeps the output a prefix of a valid one, and the EOS ids once it is
    /// complete (only them once nothing can follow). Words past the vocabulary are cleared.
    pub fn fill_mask(&mut self, mask: &mut [u32]) -> Result<(), StructuredError> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(|e| StructuredError::Matcher(e.to_string()))?;
        let words = allowed.as_slice();
        let n = words.len().min(mask.len());
        mask[..n].copy_from_slice(&words[..n]);
        mask[n..].fill(0);
        Ok(())
    }

    /// Takes the token sampled under the last mask.
    pub fn advance(&mut self, token: u32) -> Result<(), StructuredError> {
        self.matcher.consume_token(token).map_err(|e| StructuredError::Matcher(e.to_string()))
    }

    /// Whether the output is complete and nothing more can follow.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}
