//! The errors of structured output; each message is one line that can go to a client as is.

#[derive(Debug, thiserror::Error)]
pub enum StructuredError {
    /// The request's constraint cannot be compiled (a schema feature llguidance does not
    /// support, a malformed regex or grammar): the client's error.
    #[error("{0}")]
    Invalid(String),
    /// The model's vocabulary cannot be used for grammars.
    #[error("structured output is not available for this model: {0}")]
    Vocabulary(String),
    /// The grammar engine failed while the sequence ran.
    #[error("grammar: {0}")]
    Matcher(String),
}
