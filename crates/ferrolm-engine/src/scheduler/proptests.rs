//! Property tests: random arrivals, prompts with shared prefixes, aborts and tiny block pools,
//! driven by a fake model whose next token depends on the whole context, over three layouts of
//! KV cache groups: one of full attention, one sliding window (every layer slides), and both
//! (hybrid models). After every `schedule()` and every `update_from_output()` the block
//! accounting is checked in full, in every group; a fake KV cache per group checks that every
//! position a request attends to (in a sliding group, its window) holds that request's token,
//! which catches a wrong prefix hit, slot mapping or block table, and a block released while a
//! step still reads it. Every request must finish with exactly the outputs it would produce
//! alone.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::tests::{reference_outputs, sample};
use super::*;
use crate::kv::{hash_block_tokens, KvCacheGroupConfig};

/// Small, so that stop tokens are sampled now and then.
const VOCAB: u32 = 16;
const STOP: u32 = 0;

#[derive(Clone, Debug)]
struct Arrival {
    /// Which of three base sequences the prompt starts with, and how much of it.
    base: u32,
    shared: usize,
    tail_len: usize,
    tail_seed: u32,
    max_tokens: usize,
    stop: bool,
    prompt_logprobs: bool,
    /// The client request it belongs to, which admission takes turns by.
    group: u64,
}

#[derive(Clone, Debug)]
enum Event {
    Arrive(Arrival),
    /// Aborts the n-th live request (modulo their number).
    Abort(usize),
    /// The engine finishes the n-th live request on a stop string.
    FinishStop(usize),
}

#[derive(Clone, Debug)]
struct Scenario {
    config: SchedulerConfig,
    /// Schedule each step ahead of the one in flight where `schedule_ahead` allows, as the
    /// engine does when it overlaps steps.
    ahead: bool,
    /// Events before each step; once they run out, steps continue until all requests finish.
    steps: Vec<Vec<Event>>,
}

fn arrival() -> impl Strategy<Value = Arrival> {
    (0..3u32, 0..24usize, 0..16usize, any::<u32>(), 1..16usize, any::<bool>(), prop::bool::weighted(0.1), 0..3u64)
        .prop_map(|(base, shared, tail_len, tail_seed, max_tokens, stop, prompt_logprobs, group)| Arrival {
            base,
            shared,
            tail_len,
            tail_seed,
            max_tokens,
            stop,
            prompt_logprobs,
            group,
        })
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        8 => arrival().prop_map(Event::Arrive),
        1 => any::<usize>().prop_map(Event::Abort),
        1 => any::<usize>().prop_map(Event::FinishStop),
    ]
}

/// The KV cache groups of a model: one of full attention, one sliding window, or both (the
/// sliding group's pool sized apart, small ones included, so that either group may run short).
fn kv_cache_groups() -> impl Strategy<Value = Vec<KvCacheGroupConfig>> {
    (1..=24usize, 0..3u8, 1..=24usize, 1..=24usize).prop_map(
        |(num_blocks, layout, window, sliding_blocks)| match layout {
            0 => vec![KvCacheGroupConfig::full(num_blocks)],
            1 => vec![KvCacheGroupConfig::sliding(window, num_blocks)],
            _ => vec![KvCacheGroupConfig::full(num_blocks), KvCacheGroupConfig::sliding(window, sliding_blocks)],
        },
    )
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        kv_cache_groups(),
        prop::sample::select(vec![1usize, 2, 4, 8]),
        1..=6usize,
        1..=40usize,
        prop::option::of(1..=16usize),
        8..=96usize,
        1..=12usize,
        any::<bool>(),
    )
        .prop_map(
            |(kv_cache_groups, block_size, max_num_seqs, budget, threshold, max_model_len, logprob_rows, caching)| {
                SchedulerConfig {
                    max_num_seqs,
                    max_num_batched_tokens: budget,
                    block_size,
                    kv_cache_groups,
                    max_model_len,
                    long_prefill_token_threshold: threshold,
                    max_prompt_logprob_rows: logprob_rows,
                    enable_prefix_caching: caching,
                }
            },
        )
}

fn scenario(num_steps: usize, events_per_step: usize) -> impl Strategy<Value = Scenario> {
    let steps = prop::collection::vec(prop::collection::vec(event(), 0..=events_per_step), 0..=num_steps);
    (config(), steps).prop_map(|(config, steps)| Scenario { config, ahead: false, steps })
}

fn prompt(a: &Arrival) -> Vec<u32> {
    let base = (0..a.shared as u32).map(|i| 100 * (a.base + 1) + i);
    let tail = (0..a.tail_len as u32).map(|i| 1000 + a.tail_seed.wrapping_mul(31).wrapping_add(i) % 97);
    base.chain(tail).collect()
}

/// What `add_request` must answer for a request of this shape.
fn expected_admission(
    cfg: &SchedulerConfig,
    id: RequestId,
    prompt_len: usize,
    max_tokens: usize,
) -> Result<(), SchedulerError> {
    if prompt_len == 0 {
        return Err(SchedulerError::EmptyPrompt(id));
    }
    if prompt_len + max_tokens > cfg.max_model_len {
        return Err(SchedulerError::TooLong {
            request_id: id,
            num_prompt_tokens: prompt_len,
            max_tokens,
            max_model_len: cfg.max_model_len,
        });
    }
    // At its longest, all but its last token hold K and V; in a sliding group, at most those of
    // the window before a step's chunk and the chunk: the blocks touching `w + chunk - 1`
    // positions.
    let bs = cfg.block_size;
    let whole = (prompt_len + max_tokens - 1).div_ceil(bs);
    let chunk = cfg.long_prefill_token_threshold.unwrap_or(usize::MAX).min(cfg.max_num_batched_tokens);
    for group in &cfg.kv_cache_groups {
        let needed = group.sliding_window.map_or(whole, |w| whole.min((w + chunk - 2).div_ceil(bs) + 1));
        if needed > group.num_blocks {
            return Err(SchedulerError::ExceedsKvCache {
                request_id: id,
                num_blocks_needed: needed,
                num_blocks: group.num_blocks,
            });
        }
    }
    Ok(())
}

fn fail(msg: String) -> Result<(), TestCaseError> {
    Err(TestCaseError::fail(msg))
}

/// The first table entry a request that has computed `c` tokens still reads in a group of
/// `window` (`None`: full attention): the blocks before it hold only keys below `c - w + 1`.
fn first_read_block(window: Option<usize>, c: usize, block_size: usize) -> usize {
    window.map_or(0, |w| (c + 1).saturating_sub(w) / block_size)
}

/// Block accounting and request state, checked after every `schedule()` (with the steps in
/// flight: one, or two when one was scheduled ahead) and every `update_from_output()`, in every
/// KV cache group.
fn check_invariants(
    s: &Scheduler,
    in_flight: &[&SchedulerOutput],
    live: &HashSet<RequestId>,
) -> Result<(), TestCaseError> {
    let kv = s.kv_cache_manager();
    let bs = kv.block_size();

    let running: HashSet<RequestId> = s.running().iter().copied().collect();
    let waiting: Vec<RequestId> = s.waiting().collect();
    let holders: HashSet<RequestId> = kv.request_ids().collect();
    prop_assert_eq!(&holders, &running, "exactly the running requests hold blocks");
    prop_assert_eq!(running.len(), s.running().len(), "a request runs twice");
    // With a step scheduled ahead, requests ending with the step in flight still hold seats.
    if in_flight.len() < 2 {
        prop_assert!(running.len() <= s.config().max_num_seqs);
    }
    let mut queued: HashSet<RequestId> = waiting.iter().copied().collect();
    prop_assert_eq!(queued.len(), waiting.len(), "a request is queued twice");
    prop_assert!(queued.is_disjoint(&running));
    queued.extend(running.iter().copied());
    prop_assert_eq!(&queued, live, "live requests are exactly the running and waiting ones");
    for &id in &waiting {
        let req = s.request(id).ok_or_else(|| TestCaseError::fail(format!("{id} unknown")))?;
        prop_assert!(matches!(req.status(), RequestStatus::Waiting | RequestStatus::Preempted));
        prop_assert_eq!(req.num_computed_tokens(), 0);
    }

    for g in 0..kv.num_groups() {
        let pool = kv.block_pool(g);
        let window = kv.sliding_window(g);
        let null = pool.null_block();
        prop_assert_eq!(null.is_some(), window.is_some(), "group {}: a null block iff it slides", g);
        pool.check_invariants().map_err(TestCaseError::fail)?;
        let mut refs = vec![0u32; pool.num_ids()];
        // Entries of real blocks and tokens in flight, over the running requests.
        let (mut num_real, mut num_in_flight) = (0, 0);
        for &id in s.running() {
            let req = s.request(id).ok_or_else(|| TestCaseError::fail(format!("{id} unknown")))?;
            prop_assert_eq!(req.status(), RequestStatus::Running);
            let table = kv.block_table(id, g);
            let real: Vec<BlockId> = table.iter().copied().filter(|&b| Some(b) != null).collect();
            let distinct: HashSet<BlockId> = real.iter().copied().collect();
            prop_assert_eq!(distinct.len(), real.len(), "{} holds a block twice in group {}: {:?}", id, g, table);
            for b in &real {
                refs[b.index()] += 1;
            }
            let scheduled: usize = in_flight.iter().filter_map(|o| o.get(id)).map(|r| r.num_scheduled_tokens).sum();
            num_real += real.len();
            num_in_flight += scheduled;
            let covered = req.num_computed_tokens() + scheduled;
            // A step scheduled ahead runs the token the step before it samples.
            prop_assert!(covered <= req.num_tokens() + in_flight.len().saturating_sub(1));
            prop_assert_eq!(table.len(), covered.div_ceil(bs), "{} table {:?} vs {} tokens", id, table, covered);
            // A sliding group holds the null block exactly where no query to come reads: its
            // real blocks cover the window of the next query and everything after.
            let first_read = first_read_block(window, req.num_computed_tokens(), bs);
            for (i, &b) in table.iter().enumerate() {
                prop_assert_eq!(Some(b) == null, i < first_read, "{} group {} entry {}: {:?}", id, g, i, table);
            }
            // A cached block's hash must be the chained hash of this request's tokens.
            let mut parent = None;
            for (i, chunk) in req.all_token_ids().chunks_exact(bs).take(req.num_computed_tokens() / bs).enumerate() {
                let h = hash_block_tokens(parent, chunk);
                if let Some(cached) = pool.block_hash(table[i]).filter(|_| Some(table[i]) != null) {
                    prop_assert_eq!(cached, h, "{} block {} of group {} holds another prefix", id, i, g);
                }
                parent = Some(h);
            }
        }
        if let Some(w) = window {
            // What sizes a sliding group (`scheduler/config.rs`): `R` requests with `M` tokens in
            // flight hold at most `(R (w + 2 bs - 3) + M) / bs` blocks.
            let bound = (s.running().len() * (w + 2 * bs - 3) + num_in_flight) / bs;
            prop_assert!(num_real <= bound, "group {}: {} blocks held, bound {}", g, num_real, bound);
        }
        let mut referenced = 0;
        for (i, &r) in refs.iter().enumerate() {
            let b = BlockId(i as u32);
            prop_assert_eq!(pool.ref_count(b), r, "ref count of {:?} in group {}", b, g);
            referenced += usize::from(r > 0);
        }
        prop_assert_eq!(pool.num_free_blocks() + referenced, pool.num_blocks(), "group {}", g);
        prop_assert_eq!(pool.num_ids(), pool.num_blocks() + usize::from(null.is_some()));
    }
    Ok(())
}

/// Checks the shape of one step's output against the state before it.
fn check_output(s: &Scheduler, out: &SchedulerOutput, running_before: &[RequestId]) -> Result<(), TestCaseError> {
    let cfg = s.config();
    let total: usize = out.scheduled.iter().map(|r| r.num_scheduled_tokens).sum();
    prop_assert_eq!(total, out.total_num_scheduled_tokens);
    prop_assert!(total <= cfg.max_num_batched_tokens);
    if s.has_unfinished_requests() {
        prop_assert!(!out.is_empty(), "nothing scheduled with requests pending: deadlock");
    }
    let mut seen_new = false;
    for r in &out.scheduled {
        prop_assert!(r.num_scheduled_tokens >= 1);
        if let Some(t) = cfg.long_prefill_token_threshold {
            prop_assert!(r.num_scheduled_tokens <= t);
        }
        prop_assert_eq!(r.is_new, !running_before.contains(&r.request_id));
        prop_assert!(!seen_new || r.is_new, "running requests come before new ones");
        seen_new |= r.is_new;
        let req = s.request(r.request_id).ok_or_else(|| TestCaseError::fail("unknown request"))?;
        prop_assert_eq!(&r.token_ids[..], &req.all_token_ids()[r.num_computed_tokens..r.seq_len()]);
        prop_assert_eq!(r.samples_next_token, r.seq_len() == req.num_tokens());
    }
    // Logits rows: one per request that samples, every scheduled row of a prompt-logprob chunk.
    let (mut rows, mut prompt_rows) = (0, 0);
    for r in &out.scheduled {
        let req = s.request(r.request_id).ok_or_else(|| TestCaseError::fail("unknown request"))?;
        if req.needs_prompt_logprobs() && r.num_computed_tokens < req.num_prompt_tokens() {
            prompt_rows += r.num_scheduled_tokens;
            rows += r.num_scheduled_tokens;
        } else {
            rows += usize::from(r.samples_next_token);
        }
    }
    prop_assert!(prompt_rows <= cfg.prompt_logprob_rows(), "{} prompt-logprob rows", prompt_rows);
    prop_assert!(rows <= cfg.max_logits_rows(), "{} logits rows", rows);
    for id in &out.preempted {
        prop_assert!(running_before.contains(id));
        prop_assert!(out.get(*id).is_none());
        prop_assert!(!out.scheduled.iter().any(|r| r.is_new), "admission in a preempting step");
    }
    Ok(())
}

/// What `schedule_ahead` gave (`next`) against the step in flight (`out`), before its update:
/// running requests first, each going on from after its tokens in flight (a decode of the unknown
/// token where `out` catches it up, else its next known tokens), those that surely end with the
/// token in flight left out, the others all there unless the budget ran out; then admissions in
/// waiting order.
fn check_ahead(
    s: &Scheduler,
    out: &SchedulerOutput,
    next: &SchedulerOutput,
    running_before: &[RequestId],
) -> Result<(), TestCaseError> {
    let cfg = s.config();
    let total: usize = next.scheduled.iter().map(|r| r.num_scheduled_tokens).sum();
    prop_assert_eq!(total, next.total_num_scheduled_tokens);
    prop_assert!(total <= cfg.max_num_batched_tokens);
    prop_assert!(next.preempted.is_empty());
    let in_flight = |id| out.get(id).filter(|_| s.request(id).is_some()).map_or(0, |r| r.num_scheduled_tokens);
    let ends =
        |req: &Request| req.num_output_tokens() + 1 >= req.max_tokens() || req.num_tokens() + 1 >= cfg.max_model_len;
    let mut seen_new = false;
    for r in &next.scheduled {
        let req = s.request(r.request_id).ok_or_else(|| TestCaseError::fail("unknown request"))?;
        prop_assert_eq!(r.is_new, !running_before.contains(&r.request_id));
        prop_assert!(!seen_new || r.is_new, "running requests come before new ones");
        seen_new |= r.is_new;
        prop_assert!(r.num_scheduled_tokens >= 1);
        prop_assert_eq!(&r.block_tables[..], s.kv_cache_manager().block_tables(r.request_id));
        if r.is_new {
            prop_assert_eq!(&r.token_ids[..], &req.all_token_ids()[r.num_computed_tokens..r.seq_len()]);
            prop_assert_eq!(r.samples_next_token, r.seq_len() == req.num_tokens());
            continue;
        }
        let start = req.num_computed_tokens() + in_flight(r.request_id);
        prop_assert_eq!(r.num_computed_tokens, start, "{} goes on from after its tokens in flight", r.request_id);
        if start == req.num_tokens() {
            prop_assert!(!ends(req), "{} surely ends, yet is scheduled ahead", r.request_id);
            prop_assert_eq!(&r.token_ids[..], &[UNKNOWN_TOKEN][..]);
            prop_assert!(r.samples_next_token);
        } else {
            prop_assert_eq!(&r.token_ids[..], &req.all_token_ids()[start..r.seq_len()]);
            prop_assert_eq!(r.samples_next_token, r.seq_len() == req.num_tokens());
        }
    }
    if total < cfg.max_num_batched_tokens {
        for &id in running_before {
            let req = s.request(id).ok_or_else(|| TestCaseError::fail("unknown request"))?;
            let caught_up = req.num_computed_tokens() + in_flight(id) == req.num_tokens();
            if !(caught_up && ends(req)) {
                prop_assert!(next.get(id).is_some(), "{} goes on, yet is not scheduled ahead", id);
            }
        }
    }
    Ok(())
}

/// Writes `(token, position)` where the model would write K and V in each KV cache group, after
/// checking that every earlier position the request attends to there (in a sliding group, the
/// step's first query's window) holds its own token. The step writes no null block. Requests that
/// ended since the step was scheduled (ahead) are skipped.
fn fake_forward(
    s: &Scheduler,
    out: &SchedulerOutput,
    kv: &mut [Vec<Option<(u32, usize)>>],
) -> Result<(), TestCaseError> {
    let bs = s.config().block_size;
    for r in &out.scheduled {
        let Some(req) = s.request(r.request_id) else { continue };
        let tokens = req.all_token_ids();
        for (g, (table, cache)) in r.block_tables.iter().zip(kv.iter_mut()).enumerate() {
            let window = s.kv_cache_manager().sliding_window(g);
            let null = s.kv_cache_manager().block_pool(g).null_block();
            let first_key = window.map_or(0, |w| (r.num_computed_tokens + 1).saturating_sub(w));
            for (pos, &token) in tokens.iter().enumerate().take(r.num_computed_tokens).skip(first_key) {
                let slot = table[pos / bs].index() * bs + pos % bs;
                prop_assert_eq!(
                    cache[slot],
                    Some((token, pos)),
                    "{} reads a wrong KV at {} in group {}",
                    r.request_id,
                    pos,
                    g
                );
            }
            for (pos, slot) in (r.num_computed_tokens..r.seq_len()).zip(r.slot_mapping(g, bs)) {
                prop_assert!(
                    Some(table[pos / bs]) != null,
                    "{} writes position {} to the null block",
                    r.request_id,
                    pos
                );
                cache[slot] = Some((tokens[pos], pos));
            }
        }
    }
    Ok(())
}

fn run(scenario: &Scenario) -> Result<(), TestCaseError> {
    let cfg = &scenario.config;
    let mut s = Scheduler::new(cfg.clone()).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut kv: Vec<Vec<_>> =
        cfg.kv_cache_groups.iter().map(|g| vec![None; g.num_cache_blocks() * cfg.block_size]).collect();
    let mut live: HashSet<RequestId> = HashSet::new();
    let mut live_order: Vec<RequestId> = Vec::new();
    let mut expected: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut next_id = 0u64;
    let total_work: usize = 1000;
    let mut step = 0usize;
    // A step scheduled ahead, to run once the step in flight is updated.
    let mut ahead: Option<SchedulerOutput> = None;
    loop {
        if step >= scenario.steps.len() && !s.has_unfinished_requests() && ahead.is_none() {
            break;
        }
        if step > scenario.steps.len() + total_work * 20 {
            return fail(format!("requests still pending after {step} steps"));
        }
        for ev in scenario.steps.get(step).into_iter().flatten() {
            match ev {
                Event::Arrive(a) => {
                    let id = RequestId(next_id);
                    next_id += 1;
                    let p = prompt(a);
                    let stop = if a.stop { vec![STOP] } else { vec![] };
                    let want = expected_admission(cfg, id, p.len(), a.max_tokens);
                    let request = Request::new(id, p.clone(), a.max_tokens)
                        .with_stop_token_ids(stop.clone())
                        .with_prompt_logprobs(a.prompt_logprobs)
                        .with_group(a.group);
                    prop_assert_eq!(s.add_request(request), want.clone());
                    if want.is_ok() {
                        expected.insert(id, reference_outputs(&p, a.max_tokens, &stop, VOCAB));
                        live.insert(id);
                        live_order.push(id);
                    }
                }
                Event::Abort(k) | Event::FinishStop(k) => {
                    if live_order.is_empty() {
                        continue;
                    }
                    let id = live_order.remove(k % live_order.len());
                    live.remove(&id);
                    let reason = if matches!(ev, Event::Abort(_)) { FinishReason::Abort } else { FinishReason::Stop };
                    let req =
                        s.finish_request(id, reason).ok_or_else(|| TestCaseError::fail(format!("{id} unknown")))?;
                    prop_assert_eq!(req.status(), RequestStatus::Finished(reason));
                    prop_assert!(s.kv_cache_manager().block_tables(id).is_empty());
                }
            }
        }
        check_invariants(&s, ahead.as_slice().iter().collect::<Vec<_>>().as_slice(), &live)?;

        let out = match ahead.take() {
            Some(out) => out,
            None => {
                let running_before = s.running().to_vec();
                let out = s.schedule();
                check_output(&s, &out, &running_before)?;
                out
            }
        };
        check_invariants(&s, &[&out], &live)?;
        fake_forward(&s, &out, &mut kv)?;
        if scenario.ahead {
            let running_before = s.running().to_vec();
            ahead = s.schedule_ahead();
            if let Some(next) = &ahead {
                check_ahead(&s, &out, next, &running_before)?;
                check_invariants(&s, &[&out, next], &live)?;
            }
        }

        let sampled = sample(&s, &out, VOCAB);
        let finished = s.update_from_output(&sampled).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for req in finished {
            let id = req.request_id();
            prop_assert!(matches!(req.status(), RequestStatus::Finished(FinishReason::Stop | FinishReason::Length)));
            prop_assert_eq!(Some(req.output_token_ids()), expected.get(&id).map(|v| &v[..]), "outputs of {}", id);
            prop_assert!(live.remove(&id));
            live_order.retain(|&r| r != id);
        }
        check_invariants(&s, ahead.as_slice().iter().collect::<Vec<_>>().as_slice(), &live)?;
        step += 1;
    }
    for g in 0..s.kv_cache_manager().num_groups() {
        let pool = s.kv_cache_manager().block_pool(g);
        prop_assert_eq!(pool.num_free_blocks(), pool.num_blocks(), "blocks leaked in group {}", g);
    }
    prop_assert_eq!(s.kv_cache_usage(), 0.0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// Arrivals, aborts and engine-side finishes spread over time.
    #[test]
    fn block_accounting_holds_after_every_step(scenario in scenario(40, 3)) {
        run(&scenario)?;
    }

    /// Everything arrives at once in a tiny pool: heavy preemption, yet every request that
    /// fits the pool on its own finishes, with the outputs it would produce alone.
    #[test]
    fn a_burst_of_requests_all_finish(config in config(), arrivals in prop::collection::vec(arrival(), 1..24)) {
        let steps = vec![arrivals.into_iter().map(Event::Arrive).collect()];
        run(&Scenario { config, ahead: false, steps })?;
    }

    /// The same with every step that can be scheduled ahead of the one in flight scheduled so:
    /// the outputs are those of each request alone, and no block leaks.
    #[test]
    fn steps_scheduled_ahead_keep_the_accounting_and_the_outputs(
        scenario in scenario(40, 3),
        arrivals in prop::collection::vec(arrival(), 0..12),
    ) {
        let mut scenario = Scenario { ahead: true, ..scenario };
        scenario.steps.push(arrivals.into_iter().map(Event::Arrive).collect());
        run(&scenario)?;
    }
}
