//! Exact step-by-step expectations for the scheduler, driven by a fake model on the CPU.

use super::*;
use crate::kv::{hash_block_tokens, KvCacheGroupConfig};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const VOCAB: u32 = 1000;

/// The fake model: the next token is a function of the whole context, so a request that is
/// preempted and recomputed must still produce the very same outputs.
pub(crate) fn fake_next_token(tokens: &[u32], vocab: u32) -> u32 {
    (hash_block_tokens(None, tokens).0 % u64::from(vocab)) as u32
}

/// What a request generates when run alone, token by token.
pub(crate) fn reference_outputs(prompt: &[u32], max_tokens: usize, stop: &[u32], vocab: u32) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_tokens {
        let t = fake_next_token(&tokens, vocab);
        tokens.push(t);
        out.push(t);
        if stop.contains(&t) {
            break;
        }
    }
    out
}

/// Tokens sampled by the fake model for every request of `out` that samples.
pub(crate) fn sample(s: &Scheduler, out: &SchedulerOutput, vocab: u32) -> Vec<(RequestId, Vec<u32>)> {
    out.scheduled
        .iter()
        .filter(|r| r.samples_next_token)
        .filter_map(|r| {
            let req = s.request(r.request_id)?;
            Some((r.request_id, vec![fake_next_token(req.all_token_ids(), vocab)]))
        })
        .collect()
}

/// One engine step: schedule, run, sample, update.
fn step(s: &mut Scheduler) -> Result<(SchedulerOutput, Vec<Request>), SchedulerError> {
    let out = s.schedule();
    let sampled = sample(s, &out, VOCAB);
    let finished = s.update_from_output(&sampled)?;
    Ok((out, finished))
}

/// `(request id, start position, tokens)` per scheduled request.
fn summary(out: &SchedulerOutput) -> Vec<(u64, usize, usize)> {
    out.scheduled.iter().map(|r| (r.request_id.0, r.num_computed_tokens, r.num_scheduled_tokens)).collect()
}

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().map(|&i| BlockId(i)).collect()
}

fn seq(start: u32, len: usize) -> Vec<u32> {
    (start..start + len as u32).collect()
}

fn config(num_blocks: usize, block_size: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig { max_num_batched_tokens: budget, block_size, ..SchedulerConfig::new(num_blocks, 1024) }
}

fn req(id: u64, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request::new(RequestId(id), prompt, max_tokens)
}

/// Prompts that need prompt logprobs share `max_prompt_logprob_rows` rows a step; a plain
/// prompt behind them takes the rest of the token budget, and a step's logits rows stay within
/// `max_logits_rows`.
#[test]
fn prompt_logprob_chunks_share_a_budget_of_rows() -> TestResult {
    let cfg = SchedulerConfig { max_prompt_logprob_rows: 8, ..config(100, 16, 64) };
    assert_eq!((cfg.prompt_logprob_rows(), cfg.max_logits_rows()), (8, 64));
    let mut s = Scheduler::new(cfg)?;
    s.add_request(req(1, seq(0, 13), 2).with_prompt_logprobs(true))?;
    s.add_request(req(2, seq(100, 5), 2).with_prompt_logprobs(true))?;
    s.add_request(req(3, seq(200, 30), 2))?;
    let expected = [
        // Request 1 takes the 8 rows; request 2 waits for rows, and request 3 behind it too.
        vec![(1, 0, 8)],
        // Request 1's last 5 rows, then 3 of request 2's; request 3 takes what is left.
        vec![(1, 8, 5), (2, 0, 3), (3, 0, 30)],
        // Request 1 decodes (one row), request 2's last 2 prompt rows, request 3 decodes.
        vec![(1, 13, 1), (2, 3, 2), (3, 30, 1)],
    ];
    for (i, want) in expected.iter().enumerate() {
        let (out, _) = step(&mut s)?;
        assert_eq!(&summary(&out), want, "step {}", i + 1);
    }
    Ok(())
}

#[test]
fn chunked_prefill_runs_beside_decodes() -> TestResult {
    let mut s = Scheduler::new(config(100, 16, 64))?;
    s.add_request(req(1, seq(0, 10), 50))?;
    s.add_request(req(2, seq(100, 10), 50))?;
    let (out, _) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(1, 0, 10), (2, 0, 10)]);
    assert!(out.scheduled.iter().all(|r| r.is_new && r.samples_next_token));
    assert_eq!(out.total_num_scheduled_tokens, 20);

    s.add_request(req(3, seq(200, 150), 5))?;
    let expected = [
        vec![(1, 10, 1), (2, 10, 1), (3, 0, 62)],
        vec![(1, 11, 1), (2, 11, 1), (3, 62, 62)],
        vec![(1, 12, 1), (2, 12, 1), (3, 124, 26)],
        vec![(1, 13, 1), (2, 13, 1), (3, 150, 1)],
    ];
    for (i, want) in expected.iter().enumerate() {
        let out = s.schedule();
        assert_eq!(&summary(&out), want, "step {}", i + 2);
        let long = out.get(RequestId(3)).ok_or("request 3 not scheduled")?;
        assert_eq!(long.is_new, i == 0);
        assert_eq!(long.samples_next_token, i >= 2);
        assert_eq!(long.block_tables[0].len(), long.seq_len().div_ceil(16));
        assert_eq!(
            long.token_ids,
            s.request(RequestId(3)).ok_or("gone")?.all_token_ids()[long.num_computed_tokens..long.seq_len()]
        );
        // The engine may sample every row; a partial chunk's token must be dropped.
        let sampled: Vec<_> = out.scheduled.iter().map(|r| (r.request_id, vec![7])).collect();
        s.update_from_output(&sampled)?;
        let outputs = s.request(RequestId(3)).ok_or("gone")?.num_output_tokens();
        assert_eq!(outputs, i.saturating_sub(1), "step {}", i + 2);
    }
    assert_eq!(s.request(RequestId(1)).ok_or("gone")?.num_output_tokens(), 5);
    Ok(())
}

#[test]
fn long_prefill_threshold_caps_each_chunk() -> TestResult {
    let mut cfg = config(100, 16, 64);
    cfg.long_prefill_token_threshold = Some(20);
    let mut s = Scheduler::new(cfg)?;
    s.add_request(req(1, seq(0, 50), 2))?;
    s.add_request(req(2, seq(100, 30), 2))?;
    let mut chunks = Vec::new();
    while s.has_unfinished_requests() {
        chunks.push(summary(&step(&mut s)?.0));
    }
    assert_eq!(
        chunks,
        vec![
            vec![(1, 0, 20), (2, 0, 20)],
            vec![(1, 20, 20), (2, 20, 10)],
            vec![(1, 40, 10), (2, 30, 1)],
            vec![(1, 50, 1)],
        ]
    );
    Ok(())
}

#[test]
fn max_num_seqs_bounds_the_running_set() -> TestResult {
    let mut cfg = config(100, 16, 64);
    cfg.max_num_seqs = 2;
    let mut s = Scheduler::new(cfg)?;
    s.add_request(req(1, seq(0, 4), 1))?;
    s.add_request(req(2, seq(10, 4), 3))?;
    s.add_request(req(3, seq(20, 4), 1))?;
    let (out, finished) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(1, 0, 4), (2, 0, 4)]);
    assert_eq!(s.waiting().collect::<Vec<_>>(), vec![RequestId(3)]);
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].request_id(), RequestId(1));
    assert_eq!(finished[0].status(), RequestStatus::Finished(FinishReason::Length));
    let (out, _) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(2, 4, 1), (3, 0, 4)]);
    Ok(())
}

#[test]
fn preempts_the_newest_request_which_resumes_and_finishes() -> TestResult {
    // 4 blocks of 4 tokens; two requests of 7 prompt tokens each fill the pool.
    let mut s = Scheduler::new(config(4, 4, 64))?;
    let (pa, pb) = (seq(0, 7), seq(100, 7));
    s.add_request(req(1, pa.clone(), 8))?;
    s.add_request(req(2, pb.clone(), 8))?;
    let tables = |s: &Scheduler, id| s.kv_cache_manager().block_table(RequestId(id), 0).to_vec();

    let (out, _) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(1, 0, 7), (2, 0, 7)]);
    assert_eq!((tables(&s, 1), tables(&s, 2)), (ids(&[0, 1]), ids(&[2, 3])));
    let (out, _) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(1, 7, 1), (2, 7, 1)]);

    // Request 1 needs a third block for position 8: request 2, the newest, gives up its
    // blocks, tail first, and request 1 takes the tail (block 3).
    let (out, _) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(1, 8, 1)]);
    assert_eq!(out.preempted, vec![RequestId(2)]);
    assert_eq!(out.scheduled[0].block_tables, [ids(&[0, 1, 3])]);
    let b = s.request(RequestId(2)).ok_or("gone")?;
    assert_eq!((b.status(), b.num_computed_tokens()), (RequestStatus::Preempted, 0));
    assert_eq!(b.num_output_tokens(), 2, "outputs survive preemption");
    assert_eq!(s.waiting().collect::<Vec<_>>(), vec![RequestId(2)]);
    assert!(s.kv_cache_manager().block_tables(RequestId(2)).is_empty());

    // Request 2 hits its own cached first block but cannot get the two it lacks until
    // request 1 finishes (after taking block 2 for position 12).
    let mut finished_at = Vec::new();
    for step_no in 4..=14 {
        let (out, finished) = step(&mut s)?;
        let want = match step_no {
            4..=8 => vec![(1, step_no + 5, 1)],
            9 => vec![(2, 0, 9)],
            _ => vec![(2, step_no - 1, 1)],
        };
        assert_eq!(summary(&out), want, "step {step_no}");
        if step_no == 7 {
            assert_eq!(out.scheduled[0].block_tables, [ids(&[0, 1, 3, 2])]);
        }
        if step_no == 9 {
            assert!(out.scheduled[0].is_new);
            assert_eq!(out.scheduled[0].block_tables, [ids(&[2, 3, 1])]);
        }
        for r in finished {
            finished_at.push((step_no, r.request_id().0, r.output_token_ids().to_vec()));
        }
    }
    assert_eq!(
        finished_at,
        vec![(8, 1, reference_outputs(&pa, 8, &[], VOCAB)), (14, 2, reference_outputs(&pb, 8, &[], VOCAB)),]
    );
    assert_eq!(s.num_preemptions(), 1);
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.kv_cache_usage(), 0.0);
    Ok(())
}

#[test]
fn the_newest_request_preempts_itself_and_resumes_from_its_cached_blocks() -> TestResult {
    let mut s = Scheduler::new(config(4, 4, 64))?;
    s.add_request(req(1, seq(0, 5), 3))?;
    s.add_request(req(2, seq(100, 8), 2))?;
    let (out, _) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(1, 0, 5), (2, 0, 8)]);

    // Request 1 still fits its two blocks; request 2 needs a third and is the newest.
    let (out, _) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(1, 5, 1)]);
    assert_eq!(out.preempted, vec![RequestId(2)]);
    let free: Vec<BlockId> = s.kv_cache_manager().block_pool(0).free_blocks().collect();
    assert_eq!(free, ids(&[3, 2]));

    // Its two full blocks are still cached but it needs a third, and only two are free.
    let (out, finished) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(1, 6, 1)]);
    assert_eq!(finished.len(), 1);

    let (out, finished) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(2, 8, 1)]);
    assert_eq!(out.scheduled[0].block_tables, [ids(&[2, 3, 1])]);
    assert!(out.scheduled[0].is_new);
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].num_preemptions(), 1);
    assert_eq!(finished[0].num_cached_tokens(), Some(0), "cached tokens count at first admission");
    assert_eq!(finished[0].output_token_ids(), reference_outputs(&seq(100, 8), 2, &[], VOCAB));
    Ok(())
}

#[test]
fn a_waiting_request_that_does_not_fit_holds_the_queue() -> TestResult {
    let mut s = Scheduler::new(config(4, 4, 64))?;
    s.add_request(req(1, seq(0, 8), 2))?;
    s.add_request(req(2, seq(100, 9), 2))?;
    s.add_request(req(3, seq(200, 2), 2))?;
    let (out, _) = step(&mut s)?;
    // Request 2 needs 3 blocks, 2 are left: request 3 would fit but must not overtake it.
    assert_eq!(summary(&out), vec![(1, 0, 8)]);
    assert_eq!(s.waiting().collect::<Vec<_>>(), vec![RequestId(2), RequestId(3)]);
    let (out, finished) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(1, 8, 1)]);
    assert_eq!(finished.len(), 1);
    // Once request 1 is gone, both fit, in queue order.
    let (out, _) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(2, 0, 9), (3, 0, 2)]);
    Ok(())
}

#[test]
fn prefix_hit_starts_a_request_past_the_shared_blocks() -> TestResult {
    let mut s = Scheduler::new(config(10, 16, 64))?;
    s.add_request(req(1, seq(0, 40), 4))?;
    step(&mut s)?;
    let mut prompt = seq(0, 32);
    prompt.extend(seq(500, 8));
    s.add_request(req(2, prompt, 4))?;
    let (out, _) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(1, 40, 1), (2, 32, 8)]);
    let new = &out.scheduled[1];
    assert_eq!(new.block_tables, [ids(&[0, 1, 3])]);
    assert_eq!(out.scheduled[0].block_tables, [ids(&[0, 1, 2])]);
    let pool = s.kv_cache_manager().block_pool(0);
    assert_eq!((pool.ref_count(BlockId(0)), pool.ref_count(BlockId(1))), (2, 2));
    assert_eq!(s.request(RequestId(2)).ok_or("gone")?.num_cached_tokens(), Some(32));
    assert_eq!(s.prefix_cache_hit_rate(), 0.4);
    Ok(())
}

#[test]
fn abort_frees_blocks_at_once() -> TestResult {
    let mut cfg = config(8, 4, 64);
    cfg.max_num_seqs = 1;
    let mut s = Scheduler::new(cfg)?;
    s.add_request(req(1, seq(0, 10), 5))?;
    s.add_request(req(2, seq(100, 10), 5))?;
    step(&mut s)?;
    assert_eq!(s.kv_cache_usage(), 3.0 / 8.0);

    // Aborted between schedule() and update_from_output(): the step skips it.
    let out = s.schedule();
    assert_eq!(summary(&out), vec![(1, 10, 1)]);
    let aborted = s.abort(RequestId(1)).ok_or("request 1 unknown")?;
    assert_eq!(aborted.status(), RequestStatus::Finished(FinishReason::Abort));
    assert_eq!(s.kv_cache_usage(), 0.0);
    assert!(s.kv_cache_manager().block_tables(RequestId(1)).is_empty());
    assert!(s.update_from_output(&[])?.is_empty());

    let waiting = s.abort(RequestId(2)).ok_or("request 2 unknown")?;
    assert_eq!(waiting.status(), RequestStatus::Finished(FinishReason::Abort));
    assert!(s.abort(RequestId(2)).is_none());
    assert_eq!((s.num_running(), s.num_waiting()), (0, 0));
    assert_eq!(s.kv_cache_manager().block_pool(0).num_free_blocks(), 8);
    assert!(s.schedule().is_empty());
    Ok(())
}

#[test]
fn admission_counts_the_blocks_of_all_but_the_last_token() -> TestResult {
    let cfg = config(4, 4, 64);
    // 10 + 7 tokens, the last never run: 16 tokens fill the 4 blocks of 4 exactly.
    assert_eq!(cfg.max_blocks_of(&cfg.kv_cache_groups[0], 10, 7), 4);
    cfg.check_fits_kv_cache(RequestId(1), 10, 7)?;
    assert_eq!(
        cfg.check_fits_kv_cache(RequestId(2), 10, 8),
        Err(SchedulerError::ExceedsKvCache { request_id: RequestId(2), num_blocks_needed: 5, num_blocks: 4 })
    );
    Ok(())
}

#[test]
fn rejects_requests_that_can_never_run() -> TestResult {
    let mut cfg = config(4, 4, 64);
    cfg.max_model_len = 32;
    let mut s = Scheduler::new(cfg)?;
    assert_eq!(
        s.add_request(req(1, seq(0, 30), 3)),
        Err(SchedulerError::TooLong {
            request_id: RequestId(1),
            num_prompt_tokens: 30,
            max_tokens: 3,
            max_model_len: 32
        })
    );
    // 10 + 10 tokens, the last never run: 19 tokens need 5 blocks of 4.
    let err = s.add_request(req(2, seq(0, 10), 10)).err().ok_or("accepted")?;
    assert_eq!(err, SchedulerError::ExceedsKvCache { request_id: RequestId(2), num_blocks_needed: 5, num_blocks: 4 });
    assert_eq!(
        err.to_string(),
        "request 2 may need 5 KV cache blocks but the pool has only 4; lower max_tokens or the \
         prompt length"
    );
    s.add_request(req(3, seq(0, 10), 7))?;
    assert_eq!(s.add_request(req(3, seq(0, 1), 1)), Err(SchedulerError::DuplicateRequest(RequestId(3))));
    assert_eq!(s.add_request(req(4, vec![], 1)), Err(SchedulerError::EmptyPrompt(RequestId(4))));
    assert_eq!(s.add_request(req(5, seq(0, 1), 0)), Err(SchedulerError::ZeroMaxTokens(RequestId(5))));
    assert_eq!(s.num_waiting(), 1);
    // The largest accepted request runs to the end in a full pool.
    while s.has_unfinished_requests() {
        step(&mut s)?;
    }
    Ok(())
}

#[test]
fn stop_tokens_and_finish_request() -> TestResult {
    let mut s = Scheduler::new(config(16, 4, 64))?;
    let prompt = seq(0, 6);
    let first = fake_next_token(&prompt, VOCAB);
    s.add_request(req(1, prompt.clone(), 10).with_stop_token_ids(vec![first]))?;
    s.add_request(req(2, prompt.clone(), 10))?;
    s.add_request(req(3, prompt, 10).with_stop_token_ids(vec![first]).with_min_tokens(2))?;
    let (_, finished) = step(&mut s)?;
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].request_id(), RequestId(1));
    assert_eq!(finished[0].status(), RequestStatus::Finished(FinishReason::Stop));
    assert_eq!(finished[0].output_token_ids(), &[first]);
    assert_eq!(s.num_running(), 2);

    // The engine matched a stop string in request 2's text.
    let done = s.finish_request(RequestId(2), FinishReason::Stop).ok_or("unknown")?;
    assert_eq!(done.status(), RequestStatus::Finished(FinishReason::Stop));
    assert_eq!(s.running(), &[RequestId(3)]);
    assert!(s.kv_cache_manager().block_tables(RequestId(2)).is_empty());
    Ok(())
}

#[test]
fn a_missing_sample_is_an_error_and_changes_nothing() -> TestResult {
    let mut s = Scheduler::new(config(16, 4, 64))?;
    s.add_request(req(1, seq(0, 6), 4))?;
    s.add_request(req(2, seq(10, 6), 4))?;
    let out = s.schedule();
    let only_first = vec![(RequestId(1), vec![5])];
    assert_eq!(s.update_from_output(&only_first), Err(SchedulerError::MissingSampledTokens(RequestId(2))));
    let empty = vec![(RequestId(1), vec![5]), (RequestId(2), vec![])];
    assert_eq!(s.update_from_output(&empty), Err(SchedulerError::MissingSampledTokens(RequestId(2))));
    assert_eq!(s.request(RequestId(1)).ok_or("gone")?.num_computed_tokens(), 0);
    s.update_from_output(&sample(&s, &out, VOCAB))?;
    assert_eq!(s.request(RequestId(1)).ok_or("gone")?.num_computed_tokens(), 6);
    assert_eq!(s.request(RequestId(2)).ok_or("gone")?.num_output_tokens(), 1);
    Ok(())
}

#[test]
fn scheduling_again_without_update_repeats_the_step() -> TestResult {
    let mut s = Scheduler::new(config(16, 4, 64))?;
    s.add_request(req(1, seq(0, 6), 4))?;
    let first = s.schedule();
    let again = s.schedule();
    assert_eq!(summary(&first), summary(&again));
    assert_eq!(first.scheduled[0].block_tables, again.scheduled[0].block_tables);
    assert_eq!(s.kv_cache_manager().block_pool(0).num_free_blocks(), 14);
    s.update_from_output(&sample(&s, &again, VOCAB))?;
    assert_eq!(s.request(RequestId(1)).ok_or("gone")?.num_computed_tokens(), 6);
    Ok(())
}

#[test]
fn slot_mapping_follows_the_block_table() {
    let r = ScheduledRequest {
        request_id: RequestId(1),
        num_computed_tokens: 14,
        num_scheduled_tokens: 4,
        token_ids: vec![1, 2, 3, 4],
        block_tables: vec![ids(&[7, 3])],
        is_new: false,
        samples_next_token: true,
    };
    assert_eq!(r.seq_len(), 18);
    assert_eq!(r.slot_mapping(0, 16), vec![7 * 16 + 14, 7 * 16 + 15, 3 * 16, 3 * 16 + 1]);
}

#[test]
fn config_validation() {
    assert!(Scheduler::new(SchedulerConfig::new(10, 100)).is_ok());
    let bad = [
        SchedulerConfig { max_num_seqs: 0, ..SchedulerConfig::new(10, 100) },
        SchedulerConfig { block_size: 0, ..SchedulerConfig::new(10, 100) },
        SchedulerConfig::new(0, 100),
        SchedulerConfig { long_prefill_token_threshold: Some(0), ..SchedulerConfig::new(10, 100) },
        SchedulerConfig::new(u32::MAX as usize, 100),
    ];
    for cfg in bad {
        assert!(matches!(Scheduler::new(cfg), Err(SchedulerError::InvalidConfig(_))));
    }
}

#[test]
fn stats_snapshot() -> TestResult {
    let mut cfg = config(8, 4, 64);
    cfg.max_num_seqs = 1;
    let mut s = Scheduler::new(cfg)?;
    s.add_request(req(1, seq(0, 7), 3))?;
    s.add_request(req(2, seq(0, 7), 3))?;
    step(&mut s)?;
    let stats = s.stats();
    assert_eq!((stats.num_running, stats.num_waiting, stats.num_preemptions), (1, 1, 0));
    assert_eq!(stats.kv_cache_usage, 0.25);
    assert_eq!(stats.prefix_cache, PrefixCacheStats { queries: 7, hits: 0 });
    Ok(())
}

/// Steps scheduled ahead of the one in flight: one more decode for each request that goes on,
/// its next slot allocated (a new block at a boundary), the request that reaches `max_tokens`
/// left out; a waiting request or a partial prefill stops it.
#[test]
fn a_step_scheduled_ahead_decodes_one_more_token_per_request() -> TestResult {
    let mut s = Scheduler::new(config(100, 4, 64))?;
    s.add_request(req(1, seq(0, 6), 10))?;
    s.add_request(req(2, seq(100, 3), 2))?;
    s.add_request(req(3, seq(200, 40), 10))?;
    // Nothing is in flight yet, so nothing can go ahead.
    assert_eq!(s.schedule_ahead(), None);
    let first = s.schedule();
    assert_eq!(summary(&first), vec![(1, 0, 6), (2, 0, 3), (3, 0, 40)]);
    let ahead = s.schedule_ahead().ok_or("all three catch up: the next step goes ahead")?;
    assert_eq!(summary(&ahead), vec![(1, 6, 1), (2, 3, 1), (3, 40, 1)]);
    assert!(ahead.scheduled.iter().all(|r| r.token_ids == [UNKNOWN_TOKEN] && r.samples_next_token && !r.is_new));
    // Position 40 is the first of request 3's eleventh block; position 6 and 3 lie in blocks held.
    assert_eq!(ahead.get(RequestId(3)).ok_or("3")?.block_tables[0].len(), 11);
    assert_eq!(ahead.get(RequestId(1)).ok_or("1")?.block_tables[0].len(), 2);
    assert_eq!(s.schedule_ahead(), None, "one step ahead at most");

    let sampled = sample(&s, &first, VOCAB);
    assert!(s.update_from_output(&sampled)?.is_empty());
    assert_eq!(s.request(RequestId(1)).ok_or("1")?.num_computed_tokens(), 6);
    // Request 2 reaches max_tokens with the token of the step now in flight: it is left out.
    let next = s.schedule_ahead().ok_or("the step after goes ahead")?;
    assert_eq!(summary(&next), vec![(1, 7, 1), (3, 41, 1)]);
    let sampled = sample(&s, &ahead, VOCAB);
    let finished = s.update_from_output(&sampled)?;
    assert_eq!(finished.iter().map(|r| r.request_id().0).collect::<Vec<_>>(), vec![2]);
    assert!(s.kv_cache_manager().block_tables(RequestId(2)).is_empty());

    // A waiting request is admitted ahead too, behind the decodes.
    s.add_request(req(4, seq(300, 5), 10))?;
    let admitting = s.schedule_ahead().ok_or("decodes and an admission go ahead")?;
    assert_eq!(summary(&admitting), vec![(1, 8, 1), (3, 42, 1), (4, 0, 5)]);
    let new = admitting.get(RequestId(4)).ok_or("4")?;
    assert!(new.is_new && new.samples_next_token && new.token_ids == seq(300, 5));
    let sampled = sample(&s, &next, VOCAB);
    s.update_from_output(&sampled)?;
    let sampled = sample(&s, &admitting, VOCAB);
    s.update_from_output(&sampled)?;
    assert_eq!(s.request(RequestId(4)).ok_or("4")?.num_computed_tokens(), 5);
    Ok(())
}

#[test]
fn prompt_chunks_go_ahead_but_nothing_past_the_pool() -> TestResult {
    let mut s = Scheduler::new(config(100, 4, 8))?;
    s.add_request(req(1, seq(0, 12), 10))?;
    let out = s.schedule();
    assert_eq!(summary(&out), vec![(1, 0, 8)]);
    let ahead = s.schedule_ahead().ok_or("the prompt's last chunk goes ahead")?;
    assert_eq!(summary(&ahead), vec![(1, 8, 4)]);
    assert_eq!(ahead.scheduled[0].token_ids, seq(8, 4));
    assert!(ahead.scheduled[0].samples_next_token);

    let mut s = Scheduler::new(config(4, 4, 16))?;
    s.add_request(req(1, seq(0, 7), 1))?;
    s.add_request(req(2, seq(100, 7), 1))?;
    s.schedule();
    assert_eq!(s.schedule_ahead(), None, "max_tokens 1: both end with the token in flight");
    // A request ending with the step in flight leaves its seat to a waiting one ahead (its blocks
    // are freed only by the update).
    let mut s = Scheduler::new(SchedulerConfig { max_num_seqs: 1, ..config(4, 4, 16) })?;
    s.add_request(req(1, seq(0, 7), 1))?;
    s.add_request(req(2, seq(100, 3), 2))?;
    assert_eq!(summary(&s.schedule()), vec![(1, 0, 7)]);
    let ahead = s.schedule_ahead().ok_or("request 2 takes request 1's seat")?;
    assert_eq!(summary(&ahead), vec![(2, 0, 3)]);
    assert_eq!(s.num_running(), 2, "request 1 leaves with its update");

    // Four blocks, two 8-token prompts in two each: their next decodes need a block each.
    let mut s = Scheduler::new(config(4, 4, 16))?;
    s.add_request(req(1, seq(0, 8), 2))?;
    s.add_request(req(2, seq(100, 8), 2))?;
    assert_eq!(summary(&s.schedule()), vec![(1, 0, 8), (2, 0, 8)]);
    assert_eq!(s.schedule_ahead(), None, "no free block: the next schedule() preempts");
    assert_eq!(s.kv_cache_manager().block_pool(0).num_free_blocks(), 0);
    Ok(())
}

/// One client request of many sequences holds every seat; a later client request's one
/// sequence is admitted with the next seats that free, ahead of the big request's others.
#[test]
fn a_small_client_request_is_not_starved_behind_a_big_one() -> TestResult {
    let cfg = SchedulerConfig { max_num_seqs: 2, ..config(100, 16, 64) };
    let mut s = Scheduler::new(cfg)?;
    for id in 0..6 {
        s.add_request(req(id, seq(100 * id as u32, 4), 1).with_group(1000))?;
    }
    let (out, finished) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(0, 0, 4), (1, 0, 4)]);
    assert_eq!(finished.len(), 2);
    s.add_request(req(50, seq(5000, 4), 3).with_group(2000))?;
    assert_eq!(s.waiting().map(|r| r.0).collect::<Vec<_>>(), vec![2, 50, 3, 4, 5], "groups take turns");
    let (out, _) = step(&mut s)?;
    assert_eq!(summary(&out), vec![(2, 0, 4), (50, 0, 4)], "the other group's turn comes next");
    Ok(())
}

/// Every layer slides (window 8, blocks of 4, chunks of 8): a request holds at most the blocks
/// of its window and its chunk, `ceil((8 + 8 - 2) / 4) + 1 = 5`, whatever its length. So one of
/// 30 + 10 tokens (10 blocks whole) is admitted to a pool of 5 and runs to its end there; a
/// pool of 4 refuses it.
#[test]
fn a_sliding_window_bounds_the_blocks_a_request_holds() -> TestResult {
    let cfg = SchedulerConfig { kv_cache_groups: vec![KvCacheGroupConfig::sliding(8, 5)], ..config(5, 4, 8) };
    assert_eq!(cfg.max_blocks_of(&cfg.kv_cache_groups[0], 30, 10), 5);
    assert_eq!(cfg.max_blocks_of(&cfg.kv_cache_groups[0], 10, 3), 3, "a short request needs its length");
    let small = SchedulerConfig { kv_cache_groups: vec![KvCacheGroupConfig::sliding(8, 4)], ..cfg.clone() };
    assert_eq!(
        Scheduler::new(small)?.add_request(req(1, seq(0, 30), 10)),
        Err(SchedulerError::ExceedsKvCache { request_id: RequestId(1), num_blocks_needed: 5, num_blocks: 4 })
    );
    let mut s = Scheduler::new(cfg)?;
    s.add_request(req(1, seq(0, 30), 10))?;
    let mut most = 0;
    let mut finished = Vec::new();
    while s.has_unfinished_requests() {
        let (out, done) = step(&mut s)?;
        assert!(out.preempted.is_empty());
        let held = s.kv_cache_manager().block_table(RequestId(1), 0).iter().filter(|b| b.0 != 0).count();
        most = most.max(held);
        finished.extend(done);
    }
    assert_eq!(most, 3, "after each step: the window of the next query");
    assert_eq!(finished[0].output_token_ids(), reference_outputs(&seq(0, 30), 10, &[], VOCAB));
    assert_eq!(s.kv_cache_manager().block_pool(0).num_free_blocks(), 5);
    Ok(())
}

/// With a step scheduled ahead, a sliding group releases a block only once the update moves the
/// computed tokens past it: the step then in flight starts there, so it reads none of them.
#[test]
fn a_step_in_flight_keeps_the_blocks_of_its_window() -> TestResult {
    // Window 4, blocks of 2: a query at `p` reads `p - 3..=p`.
    let cfg = SchedulerConfig { kv_cache_groups: vec![KvCacheGroupConfig::sliding(4, 10)], ..config(10, 2, 64) };
    let mut s = Scheduler::new(cfg)?;
    s.add_request(req(1, seq(0, 6), 10))?;
    let table = |s: &Scheduler| s.kv_cache_manager().block_table(RequestId(1), 0).to_vec();
    let first = s.schedule();
    assert_eq!(summary(&first), vec![(1, 0, 6)]);
    assert_eq!(table(&s), ids(&[1, 2, 3]));
    let ahead = s.schedule_ahead().ok_or("the decode goes ahead")?;
    assert_eq!((summary(&ahead), table(&s)), (vec![(1, 6, 1)], ids(&[1, 2, 3, 4])));
    // The prompt applied: the step ahead (query 6) reads 3..=6, so block 1 (positions 0-1) goes.
    s.update_from_output(&sample(&s, &first, VOCAB))?;
    assert_eq!(table(&s), ids(&[0, 2, 3, 4]));
    let next = s.schedule_ahead().ok_or("the next decode goes ahead")?;
    assert_eq!(summary(&next), vec![(1, 7, 1)]);
    assert_eq!(next.scheduled[0].block_tables, [ids(&[0, 2, 3, 4])]);
    // Token 6 applied: the step in flight (query 7) reads 4..=7: block 2 goes.
    s.update_from_output(&sample(&s, &ahead, VOCAB))?;
    assert_eq!(table(&s), ids(&[0, 0, 3, 4]));
    let free: Vec<BlockId> = s.kv_cache_manager().block_pool(0).free_blocks().collect();
    assert_eq!(free, ids(&[5, 6, 7, 8, 9, 10, 1, 2]));
    Ok(())
}

/// How the groups' pools are sized: a sliding group beside a full one gets what `max_num_seqs`
/// requests with two steps in flight can hold, at most the first group's blocks; within a byte
/// budget, the first group gets what the others leave.
#[test]
fn kv_cache_groups_are_sized_from_a_block_count_or_a_byte_budget() {
    let cfg = SchedulerConfig { max_num_seqs: 4, ..config(1, 4, 16) };
    // (4 * (8 + 2 * 4 - 3) + 2 * 16) / 4
    assert_eq!(cfg.sliding_group_blocks(8), 21);
    let hybrid = [None, Some(8)];
    assert_eq!(
        cfg.kv_cache_groups_for(&hybrid, 100),
        [KvCacheGroupConfig::full(100), KvCacheGroupConfig::sliding(8, 21)]
    );
    assert_eq!(
        cfg.kv_cache_groups_for(&hybrid, 10),
        [KvCacheGroupConfig::full(10), KvCacheGroupConfig::sliding(8, 10)]
    );
    assert_eq!(cfg.kv_cache_groups_for(&[Some(8)], 100), [KvCacheGroupConfig::sliding(8, 100)]);
    assert_eq!(cfg.kv_cache_groups_for(&[None], 7), [KvCacheGroupConfig::full(7)]);
    // Blocks of 100 and 300 bytes. 34 full blocks and 21 + 1 (null) sliding ones take 10,000.
    assert_eq!(cfg.num_blocks_within(&hybrid, &[100, 300], 10_000), 34);
    // Below 21, the groups grow together: 6 of each (and the null block) take 2,700 of 3,000.
    assert_eq!(cfg.num_blocks_within(&hybrid, &[100, 300], 3_000), 6);
    assert_eq!(cfg.num_blocks_within(&[Some(8)], &[300], 3_000), 9);
    assert_eq!(cfg.num_blocks_within(&[None], &[300], 3_000), 10);
    assert_eq!(cfg.num_blocks_within(&hybrid, &[100, 300], 200), 0);
}
