//! The one error type of `ferrolm-sampling`.
//!
//! `InvalidParam` is the client's fault (the server maps it to a 400 with `param` set);
//! the other variants describe logits that cannot be sampled from, which is the model's
//! or the engine's fault, never a reason to panic.

/// Everything that can go wrong while validating parameters or sampling.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A sampling parameter is out of its allowed range. `reason` names the range and
    /// the value that was given.
    #[error("{param} {reason}")]
    InvalidParam {
        /// The field's name as the API spells it, e.g. `"top_p"`.
        param: &'static str,
        /// What the value must be, and what it was.
        reason: String,
    },
    /// `sample` was called with an empty logits row.
    #[error("cannot sample from an empty logits row")]
    EmptyLogits,
    /// Every logit is `-inf` or NaN once penalties and masks are applied.
    #[error("cannot sample: no token has a finite logit after masking")]
    NoCandidates,
}

impl SamplingError {
    pub(crate) fn invalid(param: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidParam { param, reason: reason.into() }
    }
}
