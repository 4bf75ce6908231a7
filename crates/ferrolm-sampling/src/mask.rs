//! `TokenMasks`: the tokens each constrained row of a step may sample, as packed bits.
//!
//! A grammar (structured output, tool calls) decides per step which tokens keep the output
//! valid. The engine computes one mask per constrained row while the device runs the step's
//! forward pass, and hands the step's masks to the runner, which applies each before anything
//! else touches the row (see [`SamplePlan::apply_masked`](crate::SamplePlan::apply_masked)):
//! a token whose bit is clear scores `-inf`.
//!
//! Layout: `[rows, words]` u32 words, rows in the order of the step's masked rows (the `Sample`
//! rows whose plan has `masked` set), bit `t % 32` of word `t / 32` set when token `t` is
//! allowed. Tokens past `32 * words` are never allowed.

/// The masks of one step's masked rows: `[rows, words]` packed bits.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenMasks {
    /// u32 words per row: `vocab.div_ceil(32)` for the vocabulary the masks cover.
    pub words: usize,
    // [rows, words]
    pub data: Vec<u32>,
}

impl TokenMasks {
    /// Room for `rows` masks of `words` words each, every token disallowed.
    pub fn new(rows: usize, words: usize) -> TokenMasks {
        TokenMasks { words, data: vec![0; rows * words] }
    }

    /// Makes room for `rows` masks of `words` words each, keeping the allocation; the rows'
    /// contents are left for the caller to write in full.
    pub fn reshape(&mut self, rows: usize, words: usize) {
        self.words = words;
        self.data.resize(rows * words, 0);
    }

    /// Words per row for a vocabulary of `vocab` tokens.
    pub fn words_for(vocab: usize) -> usize {
        vocab.div_ceil(32)
    }

    pub fn num_rows(&self) -> usize {
        self.data.len().checked_div(self.words).unwrap_or(0)
    }

    // [words]
    pub fn row(&self, i: usize) -> &[u32] {
        &self.data[i * self.words..][..self.words]
    }

    // [words]
    pub fn row_mut(&mut self, i: usize) -> &mut [u32] {
        &mut self.data[i * self.words..][..self.words]
    }
}

/// Whether `mask` (one row of packed bits) allows `token`.
pub fn allows(mask: &[u32], token: u32) -> bool {
    mask.get(token as usize / 32).is_some_and(|w| w >> (token % 32) & 1 == 1)
}

/// Sets `token`'s bit in `mask` (ids past the mask are ignored).
pub fn allow(mask: &mut [u32], token: u32) {
    if let Some(w) = mask.get_mut(token as usize / 32) {
        *w |= 1 << (token % 32);
    }
}
