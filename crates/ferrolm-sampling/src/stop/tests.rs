use proptest::prelude::*;

use super::*;

fn stops(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// A checker over `stop_list`, compiled as a request's would be.
fn checker(stop_list: &[String]) -> StopChecker {
    StopChecker::new(StopStrings::new(stop_list).expect("stop strings compile"))
}

/// Feeds `deltas` and returns (every emit, stopped at the end, flushed text).
fn run(stop_list: &[String], deltas: &[&str]) -> (Vec<String>, bool, String) {
    let mut checker = checker(stop_list);
    let mut emits = Vec::new();
    let mut stopped = false;
    for d in deltas {
        let r = checker.push(d);
        assert!(!stopped || (r.stopped && r.emit.is_empty()), "emitted after stop");
        stopped = r.stopped;
        emits.push(r.emit);
    }
    (emits, stopped, checker.flush())
}

/// The text cut at the first stop string to complete (earliest end, then longest).
fn reference(text: &str, stop_list: &[String]) -> (String, bool) {
    let first = stop_list
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()).map(|at| (at + s.len(), at)))
        .min();
    match first {
        Some((_, at)) => (text[..at].to_string(), true),
        None => (text.to_string(), false),
    }
}

#[test]
fn finish_reason_strings_are_openai_ones() -> Result<(), serde_json::Error> {
    assert_eq!(FinishReason::Stop.as_str(), "stop");
    assert_eq!(FinishReason::Length.as_str(), "length");
    assert_eq!(FinishReason::Abort.as_str(), "abort");
    assert_eq!(FinishReason::Length.to_string(), "length");
    assert_eq!(serde_json::to_string(&FinishReason::Stop)?, "\"stop\"");
    Ok(())
}

#[test]
fn stop_string_split_across_deltas_is_held_then_dropped() {
    let (emits, stopped, rest) = run(&stops(&["###"]), &["Hello #", "#", "# world"]);
    assert_eq!(emits, vec!["Hello ", "", ""]);
    assert!(stopped);
    assert_eq!(rest, "");
}

#[test]
fn false_start_is_released_once_it_cannot_match() {
    let mut c = checker(&stops(&["###"]));
    let r = c.push("a ##");
    assert_eq!(r, StopResult { emit: "a ".into(), stopped: false });
    let r = c.push("b");
    assert_eq!(r, StopResult { emit: "##b".into(), stopped: false });
    assert_eq!(c.flush(), "");
    assert_eq!(c.matched(), None);
}

#[test]
fn held_text_comes_out_on_flush_when_the_sequence_ends_otherwise() {
    let mut c = checker(&stops(&["</answer>"]));
    assert_eq!(c.push("42 </ans").emit, "42 ");
    assert_eq!(c.flush(), "</ans");
}

#[test]
fn first_completed_stop_wins_and_is_reported() {
    // "c" completes before "abcd" could, so the text is cut before "c".
    let (emits, stopped, _) = run(&stops(&["abcd", "c"]), &["a", "b", "c", "d"]);
    assert_eq!(emits.concat(), "ab");
    assert!(stopped);
    // Same result when everything arrives at once.
    let mut c = checker(&stops(&["abcd", "c"]));
    assert_eq!(c.push("xabcd").emit, "xab");
    assert_eq!(c.matched(), Some("c"));
    // Ending at the same byte, the longer (earlier-starting) one wins.
    let mut c = checker(&stops(&["bc", "abc"]));
    assert_eq!(c.push("zab").emit, "z");
    let r = c.push("c!");
    assert_eq!(r, StopResult { emit: String::new(), stopped: true });
    assert_eq!(c.matched(), Some("abc"));
}

#[test]
fn stop_at_the_very_start_emits_nothing() {
    let (emits, stopped, rest) = run(&stops(&["\n"]), &["\nfoo"]);
    assert_eq!(emits, vec![""]);
    assert!(stopped);
    assert_eq!(rest, "");
}

#[test]
fn multibyte_text_is_never_split_inside_a_char() {
    // The stop shares its first byte (0xE2) with "€" but not the char.
    let mut c = checker(&stops(&["→end"]));
    assert_eq!(c.push("price: 5€").emit, "price: 5€");
    assert_eq!(c.push(" →").emit, " ");
    assert_eq!(c.push("en").emit, "");
    let r = c.push("d😀");
    assert_eq!(r, StopResult { emit: String::new(), stopped: true });

    let mut c = checker(&stops(&["😀😀"]));
    assert_eq!(c.push("é😀").emit, "é");
    assert_eq!(c.push("é").emit, "😀é");
}

#[test]
fn without_stop_strings_everything_streams_through() {
    let (emits, stopped, rest) = run(&[], &["a", "", "bc"]);
    assert_eq!(emits, vec!["a", "", "bc"]);
    assert!(!stopped);
    assert_eq!(rest, "");
    // empty stop strings are ignored rather than stopping at once
    let (emits, stopped, _) = run(&stops(&[""]), &["a"]);
    assert_eq!((emits.concat(), stopped), ("a".to_string(), false));
}

/// Texts over a small alphabet, with multi-byte chars, so stop strings occur and overlap.
fn text_strategy(max_len: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(vec!['a', 'b', ' ', 'é', '€', '😀']), 0..max_len)
        .prop_map(|cs| cs.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn streamed_output_is_the_text_cut_at_the_first_stop(
        text in text_strategy(40),
        stop_list in prop::collection::vec(text_strategy(5), 0..4),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let deltas = split(&text, &cuts);

        let (expected, expect_stop) = reference(&text, &stop_list);
        let longest = stop_list.iter().map(String::len).max().unwrap_or(0);

        let mut checker = checker(&stop_list);
        let mut streamed = String::new();
        let mut stopped = false;
        for d in &deltas {
            let r = checker.push(d);
            prop_assert!(!stopped || r.emit.is_empty());
            stopped |= r.stopped;
            streamed.push_str(&r.emit);
            // Nothing streamed is ever taken back, and no stop string is ever streamed.
            prop_assert!(expected.starts_with(&streamed), "{streamed:?} leaks past {expected:?}");
            for s in stop_list.iter().filter(|s| !s.is_empty()) {
                prop_assert!(!streamed.contains(s.as_str()));
            }
            prop_assert!(checker.held.len() < longest.max(1));
        }
        streamed.push_str(&checker.flush());
        prop_assert_eq!(&streamed, &expected);
        prop_assert_eq!(stopped, expect_stop);
        prop_assert_eq!(checker.is_stopped(), expect_stop);
    }
}

/// The matcher before the automaton, kept as the reference: every stop string searched in the
/// held text on every delta, and every one tested against each suffix that may be held.
struct NaiveChecker {
    stops: Vec<String>,
    held: String,
    matched: Option<usize>,
}

impl NaiveChecker {
    fn new(stops: &[String]) -> Self {
        Self { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), held: String::new(), matched: None }
    }

    fn push(&mut self, delta: &str) -> StopResult {
        if self.matched.is_some() {
            return StopResult { emit: String::new(), stopped: true };
        }
        self.held.push_str(delta);
        // Earliest end, then earliest start (the longest string), then list order.
        let first_completed = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at + s.len(), at, i)))
            .min();
        if let Some((_, at, i)) = first_completed {
            self.held.truncate(at);
            self.matched = Some(i);
            return StopResult { emit: std::mem::take(&mut self.held), stopped: true };
        }
        let keep_from = (0..self.held.len())
            .filter(|&i| self.held.is_char_boundary(i))
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let rest = self.held.split_off(keep_from);
        StopResult { emit: std::mem::replace(&mut self.held, rest), stopped: false }
    }
}

/// Splits `text` at the char boundaries `cuts` pick.
fn split<'t>(text: &'t str, cuts: &[prop::sample::Index]) -> Vec<&'t str> {
    let boundaries: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    let mut at: Vec<usize> =
        cuts.iter().filter(|_| !boundaries.is_empty()).map(|ix| boundaries[ix.index(boundaries.len())]).collect();
    at.push(0);
    at.push(text.len());
    at.sort_unstable();
    at.windows(2).map(|w| &text[w[0]..w[1]]).collect()
}

#[test]
fn duplicates_and_prefixes_of_each_other_report_the_first_longest() {
    let mut c = checker(&stops(&["b", "ab", "ab", "xab"]));
    assert_eq!(c.push("zzab").emit, "zz");
    assert_eq!(c.matched(), Some("ab"));
    let list = stops(&["ab", "b"]);
    let mut c = checker(&list);
    assert_eq!(c.push("a").emit, "");
    assert!(c.push("b").stopped);
    assert_eq!(c.matched(), Some("ab"));
}

#[test]
fn a_long_run_that_keeps_almost_matching_holds_only_what_may_still_match() {
    // Every suffix of a's is a prefix of the stop string: the held text grows up to one byte
    // short of it, then slides.
    let stop = format!("{}b", "a".repeat(255));
    let mut c = checker(&[stop]);
    let mut emitted = String::new();
    for _ in 0..1000 {
        emitted.push_str(&c.push("a").emit);
        assert!(c.held.len() <= 255);
    }
    assert_eq!(emitted.len(), 1000 - 255);
    assert_eq!(c.flush().len(), 255);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// Delta by delta, the automaton lets through what the naive matcher does, stops at the same
    /// delta, reports the same stop string and holds the same text.
    #[test]
    fn the_automaton_matches_the_naive_checker_delta_by_delta(
        text in text_strategy(60),
        stop_list in prop::collection::vec(text_strategy(6), 0..6),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..16),
    ) {
        let mut fast = checker(&stop_list);
        let mut naive = NaiveChecker::new(&stop_list);
        for d in split(&text, &cuts) {
            prop_assert_eq!(fast.push(d), naive.push(d), "delta {:?} of {:?}", d, text);
            prop_assert_eq!(&fast.held, &naive.held);
            prop_assert_eq!(fast.matched(), naive.matched.map(|i| naive.stops[i].as_str()));
        }
        prop_assert_eq!(fast.flush(), std::mem::take(&mut naive.held));
    }
}
