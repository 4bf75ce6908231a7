//! Decode steps replayed from CUDA graphs.
//!
//! A step of only decodes (one new token per request) launches the same few hundred kernels every
//! time, each too short to hide its own launch. So the runner captures such a step once per
//! shape and replays it: the shape is the batch padded up to a bucket of [`GRAPH_BATCHES`] and the
//! block tables padded to a power-of-two width. A captured graph reads its step's indices from
//! buffers of its own, which the runner overwrites before each replay, and its activations from
//! the runner's [`crate::Activations`], which must not move while it lives.
//!
//! Padding requests have one token at position 0 with slot -1 (no KV write) and a block table of
//! block 0 in every KV cache group, so they read valid memory and write nothing; their logits
//! rows are ignored.

use std::collections::HashMap;

use ferrolm_backend::cuda::GpuGraph;

use super::step_buffers::StepBuffers;
use crate::input::ModelInput;

/// Batch sizes that get a graph; a decode batch takes the smallest bucket that holds it.
pub(super) const GRAPH_BATCHES: [usize; 28] = [
    1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256, 288, 320, 352, 384, 416, 448,
    480, 512,
];

// A bucket ends at the FP8 GEMV's row limit, so that padding never takes a decode batch across
// it: the GPU quantizes an FP8 product's inputs at the batch sizes where the CPU's reference
// does (`Fp8Inputs::GPU`).
const _: () = assert!(holds(&GRAPH_BATCHES, ferrolm_backend::cuda::GEMV_MAX_M), "GRAPH_BATCHES must hold GEMV_MAX_M");

const fn holds(batches: &[usize], n: usize) -> bool {
    let mut i = 0;
    while i < batches.len() {
        if batches[i] == n {
            return true;
        }
        i += 1;
    }
    false
}

/// The graph batch a decode batch of `n` requests is padded to, if one holds it.
pub(super) fn graph_batch(n: usize) -> Option<usize> {
    GRAPH_BATCHES.iter().copied().find(|&b| b >= n)
}

/// Narrowest block table a graph is captured for, in blocks.
const MIN_TABLE_WIDTH: usize = 8;

/// The shape a graph is captured for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct GraphShape {
    /// Requests (= tokens = logits rows), padding included.
    pub(super) batch: usize,
    /// Blocks per block-table row.
    pub(super) table_width: usize,
}

impl GraphShape {
    /// The shape that serves `input`, when it is a batch of decodes small enough for a graph:
    /// every request schedules one token and samples it.
    pub(super) fn of(input: &ModelInput) -> Option<GraphShape> {
        let n = input.num_reqs();
        // One token per request, each sampled: its logits rows are all rows, in order.
        let all_decodes = n > 0 && input.num_tokens() == n && input.step_rows().identity;
        if !all_decodes {
            return None;
        }
        let batch = graph_batch(n)?;
        let table_width = input.max_blocks_per_seq.max(MIN_TABLE_WIDTH).next_power_of_two();
        Some(GraphShape { batch, table_width })
    }

    /// `input` padded to this shape (see the module docs).
    pub(super) fn pad(&self, input: &ModelInput) -> ModelInput {
        let (n, b, w) = (input.num_reqs(), self.batch, self.table_width);
        let mut token_ids = input.token_ids.clone();
        token_ids.resize(b, 0);
        let mut positions = input.positions.clone();
        positions.resize(b, 0);
        let query_start_loc = (0..=b as u32).collect();
        let mut seq_lens = input.seq_lens.clone();
        seq_lens.resize(b, 1);
        let pad_tables = |tables: &Vec<u32>| {
            let mut padded = vec![0u32; b * w];
            for (r, row) in tables.chunks_exact(input.max_blocks_per_seq.max(1)).take(n).enumerate() {
                padded[r * w..r * w + row.len()].copy_from_slice(row);
            }
            padded
        };
        let block_tables = input.block_tables.iter().map(pad_tables).collect();
        let pad_slots = |slots: &Vec<i64>| {
            let mut padded = slots.clone();
            padded.resize(b, -1);
            padded
        };
        let slot_mapping = input.slot_mapping.iter().map(pad_slots).collect();
        ModelInput {
            token_ids,
            positions,
            query_start_loc,
            seq_lens,
            block_tables,
            max_blocks_per_seq: w,
            slot_mapping,
            logits_indices: (0..b as u32).collect(),
            // The caller writes them into the padded step's first tokens.
            previous_tokens: Vec::new(),
        }
    }
}

/// A captured decode step and the index buffers it reads.
pub(super) struct DecodeGraph {
    pub(super) buffers: StepBuffers,
    pub(super) graph: GpuGraph,
}

/// The runner's graphs, by shape.
pub(super) struct DecodeGraphs {
    pub(super) graphs: HashMap<GraphShape, DecodeGraph>,
    /// Set when a capture failed: from then on every step runs eagerly.
    pub(super) disabled: bool,
}

impl DecodeGraphs {
    /// No graphs yet; `enabled: false` runs every step eagerly.
    pub(super) fn new(enabled: bool) -> DecodeGraphs {
        DecodeGraphs { graphs: HashMap::new(), disabled: !enabled }
    }

    /// Drops every graph (the buffers they use moved).
    pub(super) fn clear(&mut self) {
        self.graphs.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decodes(n: usize, max_blocks: usize) -> ModelInput {
        let mut input = ModelInput::default();
        for r in 0..n {
            let blocks: Vec<u32> = (0..max_blocks as u32).map(|b| (r * max_blocks) as u32 + b).collect();
            // A context of 16 * max_blocks - 3 tokens, its last one new.
            let ctx = 16 * max_blocks - 3;
            input.push_request(&[7], ctx - 1, &blocks, 16, true, false);
        }
        input
    }

    #[test]
    fn decode_batches_take_the_smallest_bucket_and_a_power_of_two_table() {
        assert_eq!(GraphShape::of(&decodes(1, 3)), Some(GraphShape { batch: 1, table_width: 8 }));
        assert_eq!(GraphShape::of(&decodes(3, 9)), Some(GraphShape { batch: 4, table_width: 16 }));
        assert_eq!(GraphShape::of(&decodes(17, 2)), Some(GraphShape { batch: 32, table_width: 8 }));
        assert_eq!(GraphShape::of(&decodes(250, 40)), Some(GraphShape { batch: 256, table_width: 64 }));
        assert_eq!(GraphShape::of(&decodes(257, 2)), Some(GraphShape { batch: 288, table_width: 8 }));
        assert_eq!(GraphShape::of(&decodes(512, 2)), Some(GraphShape { batch: 512, table_width: 8 }));
        assert_eq!(GraphShape::of(&decodes(513, 2)), None);
        assert_eq!(GraphShape::of(&ModelInput::default()), None);
    }

    #[test]
    fn prefill_chunks_and_prompt_logprobs_run_eagerly() {
        let mut chunk = decodes(2, 2);
        chunk.push_request(&[1, 2, 3, 4], 0, &[9], 16, true, false);
        assert_eq!(GraphShape::of(&chunk), None);
        let mut no_sample = ModelInput::default();
        no_sample.push_request(&[1], 2, &[0], 16, false, false);
        assert_eq!(GraphShape::of(&no_sample), None);
    }

    #[test]
    fn padding_keeps_the_real_rows_and_adds_writeless_requests() {
        let input = decodes(3, 2);
        let shape = GraphShape::of(&input).expect("decodes");
        let padded = shape.pad(&input);
        assert_eq!(padded.num_reqs(), 4);
        assert_eq!(padded.num_tokens(), 4);
        assert_eq!(&padded.token_ids[..3], &input.token_ids[..]);
        assert_eq!(&padded.positions[..3], &input.positions[..]);
        assert_eq!(&padded.slot_mapping[0][..3], &input.slot_mapping[0][..]);
        assert_eq!(padded.slot_mapping[0][3], -1);
        assert_eq!(&padded.seq_lens[..3], &input.seq_lens[..]);
        assert_eq!(padded.seq_lens[3], 1);
        assert_eq!(padded.query_start_loc, vec![0, 1, 2, 3, 4]);
        assert_eq!(padded.logits_indices, vec![0, 1, 2, 3]);
        assert_eq!(padded.max_blocks_per_seq, 8);
        let (tables, input_tables) = (&padded.block_tables[0], &input.block_tables[0]);
        for r in 0..3 {
            assert_eq!(&tables[r * 8..r * 8 + 2], &input_tables[r * 2..r * 2 + 2]);
            assert!(tables[r * 8 + 2..(r + 1) * 8].iter().all(|&b| b == 0));
        }
        assert!(tables[24..].iter().all(|&b| b == 0));
    }

    #[test]
    fn every_kv_cache_group_is_padded() {
        let mut input = ModelInput::default();
        // A full group and a sliding one whose window passed the first block (null block 0).
        input.push_request_tables(&[7], 20, &[[3u32, 4], [0, 9]], 16, true, false);
        input.push_request_tables(&[8], 5, &[[5u32], [6]], 16, true, false);
        let shape = GraphShape::of(&input).expect("decodes");
        assert_eq!(shape, GraphShape { batch: 2, table_width: 8 });
        let padded = shape.pad(&input);
        assert_eq!(padded.num_groups(), 2);
        for g in 0..2 {
            assert_eq!(padded.block_tables[g].len(), 2 * 8);
            assert_eq!(&padded.block_tables[g][..2], &input.block_tables[g][..2]);
            assert_eq!(padded.block_tables[g][8], input.block_tables[g][2]);
            assert_eq!(padded.slot_mapping[g], input.slot_mapping[g]);
        }
        assert_eq!(padded.slot_mapping, vec![vec![4 * 16 + 4, 5 * 16 + 5], vec![9 * 16 + 4, 6 * 16 + 5]]);
    }
}
