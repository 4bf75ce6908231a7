//! The flattened batch the model runs each step, and the paged KV cache it reads and writes.
//!
//! Names follow vLLM: requests sit back to back in `token_ids`; request `r` owns rows
//! `query_start_loc[r]..query_start_loc[r + 1]`; `slot_mapping[t] = block_id * block_size + offset`
//! says where token `t`'s K and V go.

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
    /// `[num_reqs, max_blocks_per_seq]`, padded with 0.
    pub block_tables: Vec<u32>,
    pub max_blocks_per_seq: usize,
    /// `[T]`; negative = padding, not written.
    pub slot_mapping: Vec<i64>,
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

    /// Appends one request's scheduled tokens. `block_table` must cover `start + tokens.len()`
    /// positions; the last row's logits are requested when `want_logits` (all rows when
    /// `all_logits`).
    pub fn push_request(
        &mut self,
        tokens: &[u32],
        start: usize,
        block_table: &[u32],
        block_size: usize,
        want_logits: bool,
        all_logits: bool,
    ) {
        if self.query_start_loc.is_empty() {
            self.query_start_loc.push(0);
        }
        let first_row = self.token_ids.len() as u32;
        for (i, &tok) in tokens.iter().enumerate() {
            let pos = start + i;
            self.token_ids.push(tok);
            self.positions.push(pos as u32);
            let block = block_table[pos / block_size] as i64;
            self.slot_mapping.push(block * block_size as i64 + (pos % block_size) as i64);
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
        let width = self.max_blocks_per_seq.max(block_table.len());
        if width != self.max_blocks_per_seq {
            let old = std::mem::take(&mut self.block_tables);
            let rows = self.seq_lens.len() - 1;
            for r in 0..rows {
                let row = &old[r * self.max_blocks_per_seq..(r + 1) * self.max_blocks_per_seq];
                self.block_tables.extend_from_slice(row);
                self.block_tables.resize((r + 1) * width, 0);
            }
            self.max_blocks_per_seq = width;
        }
        self.block_tables.extend_from_slice(block_table);
        self.block_tables.resize(self.seq_lens.len() * width, 0);
    }
}

/// The paged K/V cache of every layer on the CPU.
pub struct KvCache {
    pub num_blocks: usize,
    pub block_size: usize,
    /// `num_kv_heads * head_dim`
    pub kv_width: usize,
    /// Per layer: K and V, each `[num_blocks * block_size, kv_width]`.
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
        assert_eq!(input.slot_mapping, vec![5 * 16 + 1, 7 * 16, 7 * 16 + 1, 7 * 16 + 2]);
        assert_eq!(input.max_blocks_per_seq, 2);
        assert_eq!(input.block_tables, vec![3, 5, 7, 0]);
        assert_eq!(input.logits_indices, vec![0, 1, 2, 3]);
    }

    #[test]
    fn wider_later_request_repads_earlier_rows() {
        let mut input = ModelInput::default();
        input.push_request(&[1], 0, &[9], 4, true, false);
        input.push_request(&[2], 8, &[1, 2, 3], 4, false, false);
        assert_eq!(input.block_tables, vec![9, 0, 0, 1, 2, 3]);
        assert_eq!(input.logits_indices, vec![0]);
    }
}
