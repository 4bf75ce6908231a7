//! Helpers the engine's integration tests share.

use ferrolm_engine::{RequestOutput, RequestStream};

/// All outputs of one request, per sequence index, in order.
pub fn collect(mut stream: RequestStream) -> Vec<Vec<RequestOutput>> {
    let mut by_index: Vec<Vec<RequestOutput>> = Vec::new();
    while let Some(out) = stream.blocking_recv() {
        let i = out.index as usize;
        if by_index.len() <= i {
            by_index.resize_with(i + 1, Vec::new);
        }
        by_index[i].push(out);
    }
    by_index
}
