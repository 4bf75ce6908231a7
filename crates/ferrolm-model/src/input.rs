//! The flattened batch the model runs each step, and the paged KV cache it reads and writes.
//!
//! Names follow vLLM: requests sit back to back in `token_ids`; request `r` owns rows
//! `query_start_loc[r]..query_start_loc[r + 1]`; `slot_mapping[g][t] = block_id * block_size +
//! offset` says where token `t`'s K and V go in KV cache group `g`'s cache. Every group has its
//! own block tables ([`crate::kv_groups`]), which cover the same positions: a sliding group's
//! hold its null block where the window has passed, so that an entry's index is its position's
//! block in every group.

use ferrolm_backend::cpu::CpuKvLayer;

use crate::decoder::StepRows;
use crate::ModelError;

/// One step's batch.
#[derive(Clone, Debug, Default)]
pub struct ModelInput {
    /// `[T]`
    pub token_ids: Vec<u32>,
    /// `[T]`
    pub positions: Vec<u32>,
    /// `[num_reqs + 1]`
    pub query_start_loc: Vec<u32>,
    /// `[num_reqs]`: context length after this step.
    pub seq_lens: Vec<u32>,
    /// `[num_groups][num_reqs * max_blocks_per_seq]`: each KV cache group's block tables, padded
    /// with 0. A batch with one group's serves every group of the model.
    pub block_tables: Vec<Vec<u32>>,
    /// Width of every group's block tables.
    pub max_blocks_per_seq: usize,
    /// `[num_groups][T]`: where each token's K and V go in each group's cache; negative =
    /// padding, not written.
    pub slot_mapping: Vec<Vec<i64>>,
    /// Rows whose logits are wanted, in output order.
    pub logits_indices: Vec<u32>,
    /// Tokens not known when the step was built (a step scheduled ahead of the one before it):
    /// `(t, row)` makes `token_ids[t]` the token the step launched just before samples from its
    /// logits row `row` (0 where that row picked none). The runner fills them in.
    pub previous_tokens: Vec<(u32, u32)>,
}

impl ModelInput {
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    pub fn num_reqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// KV cache groups the batch has tables for.
    pub fn num_groups(&self) -> usize {
        self.block_tables.len()
    }

    /// The step's token and logits rows, as the decoder takes them.
    pub fn step_rows(&self) -> StepRows {
        let identity = self.logits_indices.len() == self.num_tokens()
            && self.logits_indices.iter().enumerate().all(|(i, &r)| r as usize == i);
        StepRows { tokens: self.num_tokens(), logits: self.logits_indices.len(), identity }
    }

    /// Fills in [`Self::previous_tokens`] from `sampled`, the tokens the step before sampled per
    /// logits row (`None`: none picked, token 0). An error names a pair outside the step or
    /// outside `sampled`.
    pub fn fill_previous_tokens(&mut self, sampled: &[Option<u32>]) -> Result<(), ModelError> {
        for &(t, row) in &self.previous_tokens {
            let token = sampled.get(row as usize).ok_or(ModelError::PreviousToken {
                what: "row (of the step before's rows)",
                index: row,
                len: sampled.len(),
            })?;
            let len = self.token_ids.len();
            let slot = self.token_ids.get_mut(t as usize).ok_or(ModelError::PreviousToken {
                what: "index (of the step's tokens)",
                index: t,
                len,
            })?;
            *slot = token.unwrap_or(0);
        }
        self.previous_tokens.clear();
        Ok(())
    }

    /// Appends one request's scheduled tokens with one block table, which serves every KV cache
    /// group (a model of one group, or a batch that does not page the groups apart). See
    /// [`Self::push_request_tables`].
    pub fn push_request(
        &mut self,
        tokens: &[u32],
        start: usize,
        block_table: &[u32],
        block_size: usize,
        want_logits: bool,
        all_logits: bool,
    ) {
        self.push_request_tables(tokens, start, &[block_table], block_size, want_logits, all_logits);
    }

    /// Appends one request's scheduled tokens. `block_tables` holds its table in each KV cache
    /// group (block ids, or anything that converts to them), as many as the requests before it
    /// had, each covering `start + tokens.len()` positions; the last row's logits are requested
    /// when `want_logits` (all rows when `all_logits`).
    ///
    /// # Panics
    /// When `block_tables` holds another number of groups than the requests before it.
    pub fn push_request_tables<T: AsRef<[B]>, B: Copy + Into<u32>>(
        &mut self,
        tokens: &[u32],
        start: usize,
        block_tables: &[T],
        block_size: usize,
        want_logits: bool,
        all_logits: bool,
    ) {
        if self.query_start_loc.is_empty() {
            self.query_start_loc.push(0);
            self.block_tables = vec![Vec::new(); block_tables.len()];
            self.slot_mapping = vec![Vec::new(); block_tables.len()];
        }
        assert_eq!(
            block_tables.len(),
            self.block_tables.len(),
            "push_request: block tables of {} groups after requests of {}",
            block_tables.len(),
            self.block_tables.len()
        );
        let first_row = self.token_ids.len() as u32;
        for (i, &tok) in tokens.iter().enumerate() {
            let pos = start + i;
            self.token_ids.push(tok);
            self.positions.push(pos as u32);
        }
        for (table, slots) in block_tables.iter().zip(&mut self.slot_mapping) {
            let table = table.as_ref();
            slots.extend(
                (start..start + tokens.len()).map(|pos| {
                    i64::from(table[pos / block_size].into()) * block_size as i64 + (pos % block_size) as i64
                }),
            );
        }
        let end_row = self.token_ids.len() as u32;
        self.query_start_loc.push(end_row);
        self.seq_lens.push((start + tokens.len()) as u32);
        if all_logits {
            self.logits_indices.extend(first_row..end_row);
        } else if want_logits && end_row > first_row {
            self.logits_indices.push(end_row - 1);
        }
        // Re-pad the block tables to the widest request.
        let num_reqs = self.seq_lens.len();
        let old_width = self.max_blocks_per_seq;
        let width = block_tables.iter().map(|t| t.as_ref().len()).fold(old_width, usize::max);
        for (table, tables) in block_tables.iter().zip(&mut self.block_tables) {
            if width != old_width {
                let old = std::mem::take(tables);
                for r in 0..num_reqs - 1 {
                    tables.extend_from_slice(&old[r * old_width..(r + 1) * old_width]);
                    tables.resize((r + 1) * width, 0);
                }
            }
            tables.extend(table.as_ref().iter().map(|&b| b.into()));
            tables.resize(num_reqs * width, 0);
        }
        self.max_blocks_per_seq = width;
    }
}

/// The paged K/V cache of every layer on the CPU.
pub struct KvCache {
    /// `[num_kv_cache_groups]`: blocks of each group's layers.
    pub num_blocks: Vec<usize>,
    pub block_size: usize,
    /// `num_kv_heads * head_dim`
    pub kv_width: usize,
    /// Per layer: K and V, each `[num_blocks of its group * block_size, kv_width]`.
    pub layers: Vec<CpuKvLayer>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn previous_tokens_are_filled_from_the_step_before() {
        let mut input = ModelInput::default();
        input.push_request(&[u32::MAX], 5, &[0, 1], 4, true, false);
        input.push_request(&[7], 2, &[2], 4, true, false);
        input.push_request(&[u32::MAX], 9, &[3, 4, 5], 4, true, false);
        input.previous_tokens = vec![(0, 2), (2, 0)];
        let mut bad = input.clone();
        input.fill_previous_tokens(&[Some(11), Some(12), None]).expect("in range");
        assert_eq!(input.token_ids, vec![0, 7, 11]);
        assert!(input.previous_tokens.is_empty());
        assert!(bad.fill_previous_tokens(&[Some(1), Some(2)]).is_err(), "row 2 of 2 rows");
        bad.previous_tokens = vec![(3, 0)];
        assert!(bad.fill_previous_tokens(&[Some(1)]).is_err(), "token 3 of 3 tokens");
    }

    #[test]
    fn push_requests_builds_flattened_batch() {
        let mut input = ModelInput::default();
        // A decode at position 17 with blocks [3, 5], then a 3-token prefill in block [7].
        input.push_request(&[42], 17, &[3, 5], 16, true, false);
        input.push_request(&[1, 2, 3], 0, &[7], 16, true, true);
        assert_eq!(input.token_ids, vec![42, 1, 2, 3]);
        assert_eq!(input.positions, vec![17, 0, 1, 2]);
        assert_eq!(input.query_start_loc, vec![0, 1, 4]);
        assert_eq!(input.seq_lens, vec![18, 3]);
        assert_eq!(input.slot_mapping, vec![vec![5 * 16 + 1, 7 * 16, 7 * 16 + 1, 7 * 16 + 2]]);
        assert_eq!(input.max_blocks_per_seq, 2);
        assert_eq!(input.block_tables, vec![vec![3, 5, 7, 0]]);
        assert_eq!(input.logits_indices, vec![0, 1, 2, 3]);
    }

    #[test]
    fn wider_later_request_repads_earlier_rows() {
        let mut input = ModelInput::default();
        input.push_request(&[1], 0, &[9], 4, true, false);
        input.push_request(&[2], 8, &[1, 2, 3], 4, false, false);
        assert_eq!(input.block_tables, vec![vec![9, 0, 0, 1, 2, 3]]);
        assert_eq!(input.logits_indices, vec![0]);
    }

    #[test]
    fn each_group_gets_its_tables_and_slots() {
        let mut input = ModelInput::default();
        // Two groups; the second is a sliding group whose window passed the first block (null 0).
        input.push_request_tables(&[1, 2], 5, &[[4u32, 6], [0, 3]], 4, true, false);
        input.push_request_tables(&[3], 0, &[[8u32], [1]], 4, true, false);
        input.push_request_tables(&[4], 9, &[vec![2u32, 5, 7], vec![0, 0, 9]], 4, true, false);
        assert_eq!(input.num_groups(), 2);
        assert_eq!(input.max_blocks_per_seq, 3);
        assert_eq!(input.block_tables, vec![vec![4, 6, 0, 8, 0, 0, 2, 5, 7], vec![0, 3, 0, 1, 0, 0, 0, 0, 9]]);
        assert_eq!(input.slot_mapping, vec![vec![6 * 4 + 1, 6 * 4 + 2, 8 * 4, 7 * 4 + 1], vec![13, 14, 4, 37]]);
        assert_eq!(input.positions, vec![5, 6, 0, 9]);
    }
}
