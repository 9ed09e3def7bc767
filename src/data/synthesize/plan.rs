//! The decisions of a synthesis, apart from any model or file: which attempts run, what each asks the target next
//! (a user turn, then an answer, for each of its turns), which requests are kept (the turn checks, then the duplicate
//! index in attempt order), and when the run has its conversations. A state machine driven by events
//! ([`Synthesis::launch`], [`Synthesis::generated`]), so the tests drive it without a model.
//!
//! Attempt `i` draws everything from the run's seed and `i` alone (its number of turns, system prompt, topic, and the
//! seed of each generation), and is judged for duplicates against the attempts before it only, in attempt order,
//! whatever order the generations finish in. The conversations kept are the first `count` attempts accepted: the
//! same seed and settings give the same conversations, resumed or not (a rerun skips the attempts its files hold).
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use serde_json::{Value, json};

use super::near_duplicates::{Duplicate, DuplicateIndex};
use super::turn_checks::{Generated, TurnBounds, check_user_turn, first_word};
use crate::model::sampling::splitmix64;

/// What shapes the conversations.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Conversations wanted.
    pub count: u64,
    pub seed: u64,
    /// User turns per conversation, drawn uniformly from this range (inclusive).
    pub turns: (usize, usize),
    /// System prompts a conversation may start with, and the share of conversations that do.
    pub system_prompts: Vec<String>,
    pub system_share: f64,
    /// Topics that steer the first request (through a system prompt the request alone sees).
    pub topics: Vec<String>,
    pub bounds: TurnBounds,
    /// Near duplicates at this Jaccard similarity and above are rejected (above 1: exact duplicates only).
    pub duplicate_threshold: f64,
    /// Attempts at most, the earlier runs' included (default: 4 x count + 1,000).
    pub max_attempts: Option<u64>,
}

impl Settings {
    fn most_attempts(&self) -> u64 {
        self.max_attempts.unwrap_or(4 * self.count + 1000)
    }
}

/// An attempt an earlier run settled, read back from its files.
#[derive(Debug, Clone, PartialEq)]
pub enum Earlier {
    Accepted {
        attempt: u64,
        request: String,
    },
    /// `indexed`: its request passed the duplicate check (it was rejected later, for its answer).
    Rejected {
        attempt: u64,
        request: String,
        indexed: bool,
    },
}

/// What to generate next for an attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Want {
    /// A user turn: the template opened at a user turn after `messages`.
    UserTurn,
    /// The assistant's answer to `messages`.
    Answer,
}

/// A generation asked of the target.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    pub attempt: u64,
    pub want: Want,
    pub messages: Vec<Value>,
    pub seed: u64,
}

/// An attempt settled: a conversation to write, or why none.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Accepted { attempt: u64, line: Value },
    Rejected { attempt: u64, line: Value },
}

/// What the run's attempts came to, by reason (those that count: up to the last one kept).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    /// Attempts settled (accepted or rejected) in this run.
    pub attempts: u64,
    /// Attempts rejected in this run, by reason.
    pub rejected: BTreeMap<&'static str, u64>,
    /// Follow-up turns not kept (the conversation ends before them), by reason.
    pub follow_ups_dropped: BTreeMap<&'static str, u64>,
    /// Answers cut at their token limit (kept).
    pub answers_cut: u64,
}

/// Where an attempt is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stage {
    /// Its user turn `t` is being written.
    Asking(usize),
    /// Its first request waits for the attempts before it to be judged.
    AtGate,
    /// The answer to its user turn `t` is being written.
    Answering(usize),
}

struct Attempt {
    seed: u64,
    turns: usize,
    system: Option<String>,
    topic: Option<String>,
    messages: Vec<Value>,
    request: String,
    stage: Stage,
    answers_cut: usize,
}

/// Attempts running at most per attempt generating (see [`Settings::in_flight`]).
const WAITING_PER_GENERATING: usize = 8;

const DRAW_TURNS: u64 = 1;
const DRAW_SYSTEM: u64 = 2;
const DRAW_SYSTEM_PICK: u64 = 3;
const DRAW_TOPIC: u64 = 4;

/// A uniform draw in [0, 1) from `seed` and a purpose.
fn unit(seed: u64, purpose: u64) -> f64 {
    (splitmix64(seed ^ splitmix64(purpose)) >> 11) as f64 / (1u64 << 53) as f64
}

/// A draw in 0..n from `seed` and a purpose.
fn pick(seed: u64, purpose: u64, n: usize) -> usize {
    ((unit(seed, purpose) * n as f64) as usize).min(n.saturating_sub(1))
}

/// The system prompt that steers a request towards `topic` (with the conversation's own system prompt, if any). The
/// answer does not see it.
pub fn steering_prompt(system: Option<&str>, topic: &str) -> String {
    let steer = format!("The user's next message is a request about {topic}.");
    match system {
        Some(s) => format!("{s}\n\n{steer}"),
        None => format!("You are a helpful assistant. {steer}"),
    }
}

/// See the module documentation.
pub struct Synthesis {
    s: Settings,
    /// Attempts generating at once (those whose first request waits for its judgement do not count: a runaway
    /// request being written holds up the judgement of every later one, and the generator should stay busy meanwhile).
    in_flight: usize,
    /// The generation settings every written line carries (`synthesis.settings`).
    described: Value,
    /// Attempts settled by earlier runs.
    earlier: HashSet<u64>,
    next_attempt: u64,
    live: BTreeMap<u64, Attempt>,
    /// First requests checked, waiting to be judged for duplicates in attempt order (`None`: already rejected).
    gate: BTreeMap<u64, Option<String>>,
    /// Live attempts whose first request waits at the gate.
    waiting: usize,
    next_gate: u64,
    index: DuplicateIndex,
    accepted: BTreeSet<u64>,
    /// The `count`-th smallest of `accepted`, once there are that many.
    cut: Option<u64>,
    first_words: HashMap<u64, String>,
    /// What each attempt settled in this run came to.
    settled: BTreeMap<u64, Record>,
    /// How many of `settled` were rejected.
    rejected_here: usize,
}

/// What one attempt came to.
#[derive(Debug, Clone, Default)]
struct Record {
    rejected: Option<&'static str>,
    follow_ups_dropped: Option<&'static str>,
    answers_cut: usize,
}

impl Synthesis {
    /// A synthesis of `s`, `in_flight` attempts generating at once, each line carrying `described`, continuing what
    /// `earlier` runs settled.
    pub fn new(s: Settings, in_flight: usize, described: Value, earlier: impl IntoIterator<Item = Earlier>) -> Self {
        let mut this = Synthesis {
            index: DuplicateIndex::new(s.duplicate_threshold),
            s,
            in_flight,
            described,
            earlier: HashSet::new(),
            next_attempt: 0,
            live: BTreeMap::new(),
            gate: BTreeMap::new(),
            waiting: 0,
            next_gate: 0,
            accepted: BTreeSet::new(),
            cut: None,
            first_words: HashMap::new(),
            settled: BTreeMap::new(),
            rejected_here: 0,
        };
        for e in earlier {
            match e {
                Earlier::Accepted { attempt, request } => {
                    this.index.insert(attempt, &request);
                    this.first_words.insert(attempt, first_word(&request));
                    this.record_accepted(attempt);
                    this.earlier.insert(attempt);
                }
                Earlier::Rejected { attempt, request, indexed } => {
                    if indexed {
                        this.index.insert(attempt, &request);
                    }
                    this.earlier.insert(attempt);
                }
            }
        }
        this.skip_earlier();
        this
    }

    /// Conversations accepted so far (earlier runs' included).
    pub fn accepted(&self) -> u64 {
        self.accepted.len() as u64
    }

    /// Attempts running now.
    pub fn running(&self) -> usize {
        self.live.len()
    }

    fn enough(&self) -> bool {
        self.accepted() >= self.s.count
    }

    /// The attempt of the `count`-th conversation accepted, once there are that many.
    fn cutoff(&self) -> Option<u64> {
        self.cut
    }

    /// Records `attempt` as accepted, keeping the cutoff (the `count`-th smallest accepted) current in O(log n): it
    /// is called after every event, and walking the set each time made a run of 100,000 quadratic.
    fn record_accepted(&mut self, attempt: u64) {
        self.accepted.insert(attempt);
        let count = self.s.count as usize;
        self.cut = match (self.accepted.len(), self.cut) {
            (n, _) if n < count || count == 0 => None,
            (n, _) if n == count => self.accepted.last().copied(),
            (_, Some(cut)) if attempt < cut => self.accepted.range(..cut).next_back().copied(),
            (_, cut) => cut,
        };
    }

    /// The run has its conversations (no running attempt can change which), or can start no more attempts and none
    /// runs. Attempts still running then are abandoned.
    pub fn finished(&self) -> bool {
        match self.cutoff() {
            Some(cut) => self.live.keys().next().is_none_or(|&first| first > cut),
            None => self.live.is_empty() && self.next_attempt >= self.s.most_attempts(),
        }
    }

    /// The attempts whose conversations the output keeps, in order: the first `count` accepted.
    pub fn kept(&self) -> Vec<u64> {
        self.accepted.iter().take(self.s.count as usize).copied().collect()
    }

    /// The first word of each kept conversation's first request.
    pub fn kept_first_words(&self) -> Vec<&str> {
        self.kept().iter().filter_map(|a| self.first_words.get(a).map(String::as_str)).collect()
    }

    /// What this run's attempts came to, up to the last one kept (attempts settled past it do not count: the files
    /// leave them out, and a later run with a higher count generates them again).
    pub fn tally(&self) -> Tally {
        let last = self.cutoff().unwrap_or(u64::MAX);
        let mut t = Tally::default();
        for r in self.settled.range(..=last).map(|(_, r)| r) {
            t.attempts += 1;
            t.answers_cut += r.answers_cut as u64;
            if let Some(why) = r.rejected {
                *t.rejected.entry(why).or_default() += 1;
            }
            if let Some(why) = r.follow_ups_dropped {
                *t.follow_ups_dropped.entry(why).or_default() += 1;
            }
        }
        t
    }

    /// The attempts the rejected file keeps: those rejected up to the last one kept, earlier runs' included.
    pub fn rejected_kept(&self, earlier_rejected: &[u64]) -> Vec<u64> {
        let last = self.cutoff().unwrap_or(u64::MAX);
        let mut ids: Vec<u64> = (earlier_rejected.iter().copied())
            .chain(self.settled.iter().filter(|(_, r)| r.rejected.is_some()).map(|(a, _)| *a))
            .filter(|&a| a <= last)
            .collect();
        ids.sort_unstable();
        ids
    }

    fn skip_earlier(&mut self) {
        while self.earlier.contains(&self.next_attempt) {
            self.next_attempt += 1;
        }
    }

    /// Starts attempts while fewer than `in_flight` generate (and fewer than [`WAITING_PER_GENERATING`] times that
    /// run, bounding what waits at the gate) and more may be needed: the first generation of each.
    pub fn launch(&mut self) -> Vec<Ask> {
        let mut asks = Vec::new();
        let most = self.in_flight.max(1);
        while self.live.len() - self.waiting < most
            && self.live.len() < WAITING_PER_GENERATING * most
            && !self.enough()
            && self.live.len() < self.worth_running()
            && self.next_attempt < self.s.most_attempts()
        {
            let attempt = self.next_attempt;
            self.next_attempt += 1;
            self.skip_earlier();
            let a = self.begin(attempt);
            asks.push(Ask {
                attempt,
                want: Want::UserTurn,
                messages: self.opening_messages(&a),
                seed: turn_seed(a.seed, 0, 0),
            });
            self.live.insert(attempt, a);
        }
        asks
    }

    /// Attempts worth running at once for the conversations still missing: as many as the share accepted so far
    /// says it takes to fill them, a quarter more, and one. More only cost time (the output keeps the first `count`
    /// accepted, whatever else runs): `--count 12` on a CPU would otherwise generate a whole batch of 256.
    fn worth_running(&self) -> usize {
        let missing = self.s.count.saturating_sub(self.accepted()) as f64;
        // Counted as if one more had been accepted: a first rejection or two do not multiply the attempts by 20.
        let settled = self.settled.len();
        let accepted_share = (settled - self.rejected_here + 1) as f64 / (settled + 1) as f64;
        (missing / accepted_share.max(0.05) * 1.25).ceil() as usize + 1
    }

    fn begin(&self, attempt: u64) -> Attempt {
        let seed = splitmix64(self.s.seed ^ splitmix64(attempt.wrapping_add(0x5EED)));
        let (low, high) = self.s.turns;
        let turns = low + pick(seed, DRAW_TURNS, high.saturating_sub(low) + 1);
        let with_system = !self.s.system_prompts.is_empty() && unit(seed, DRAW_SYSTEM) < self.s.system_share;
        let system = with_system
            .then(|| self.s.system_prompts[pick(seed, DRAW_SYSTEM_PICK, self.s.system_prompts.len())].clone());
        let topic =
            (!self.s.topics.is_empty()).then(|| self.s.topics[pick(seed, DRAW_TOPIC, self.s.topics.len())].clone());
        let messages = system.iter().map(|s| json!({"role": "system", "content": s})).collect();
        Attempt {
            seed,
            turns,
            system,
            topic,
            messages,
            request: String::new(),
            stage: Stage::Asking(0),
            answers_cut: 0,
        }
    }

    /// What the first user turn is written after: the conversation's system prompt, or the one that steers it to its
    /// topic.
    fn opening_messages(&self, a: &Attempt) -> Vec<Value> {
        match &a.topic {
            Some(topic) => vec![json!({"role": "system", "content": steering_prompt(a.system.as_deref(), topic)})],
            None => a.messages.clone(),
        }
    }

    /// Takes what the target wrote for `attempt`'s current generation: the generations to ask next and the attempts
    /// settled. A generation for an attempt not running (abandoned) is ignored.
    pub fn generated(&mut self, attempt: u64, g: Generated) -> (Vec<Ask>, Vec<Outcome>) {
        let (mut asks, mut outcomes) = (Vec::new(), Vec::new());
        let Some(stage) = self.live.get(&attempt).map(|a| a.stage) else {
            return (asks, outcomes);
        };
        match stage {
            Stage::Asking(0) => {
                let request = g.text.trim().to_string();
                match check_user_turn(&g, self.s.bounds) {
                    Ok(()) => {
                        let a = self.live.get_mut(&attempt).expect("live");
                        a.messages.push(json!({"role": "user", "content": request}));
                        a.request = request.clone();
                        a.stage = Stage::AtGate;
                        self.waiting += 1;
                        self.gate.insert(attempt, Some(request));
                    }
                    Err(why) => {
                        outcomes.push(self.reject(attempt, why.reason(), &request, false, None));
                        self.gate.insert(attempt, None);
                    }
                }
                self.judge(&mut asks, &mut outcomes);
            }
            Stage::Asking(turn) => match check_user_turn(&g, self.s.bounds) {
                Ok(()) => {
                    let a = self.live.get_mut(&attempt).expect("live");
                    a.messages.push(json!({"role": "user", "content": g.text.trim()}));
                    a.stage = Stage::Answering(turn);
                    asks.push(Ask {
                        attempt,
                        want: Want::Answer,
                        messages: a.messages.clone(),
                        seed: turn_seed(a.seed, turn, 1),
                    });
                }
                Err(why) => outcomes.push(self.accept(attempt, Some(why.reason()))),
            },
            Stage::AtGate => {}
            Stage::Answering(turn) => {
                if g.text.trim().is_empty() {
                    if turn == 0 {
                        let request = self.live[&attempt].request.clone();
                        outcomes.push(self.reject(attempt, "empty answer", &request, true, None));
                    } else {
                        self.live.get_mut(&attempt).expect("live").messages.pop();
                        outcomes.push(self.accept(attempt, Some("empty answer")));
                    }
                    return (asks, outcomes);
                }
                let a = self.live.get_mut(&attempt).expect("live");
                a.messages.push(json!({"role": "assistant", "content": g.text}));
                if !g.ended {
                    a.answers_cut += 1;
                }
                if turn + 1 < a.turns {
                    a.stage = Stage::Asking(turn + 1);
                    asks.push(Ask {
                        attempt,
                        want: Want::UserTurn,
                        messages: a.messages.clone(),
                        seed: turn_seed(a.seed, turn + 1, 0),
                    });
                } else {
                    outcomes.push(self.accept(attempt, None));
                }
            }
        }
        (asks, outcomes)
    }

    /// Judges the first requests waiting at the gate, in attempt order, as far as no earlier one is missing.
    fn judge(&mut self, asks: &mut Vec<Ask>, outcomes: &mut Vec<Outcome>) {
        loop {
            while self.earlier.contains(&self.next_gate) {
                self.next_gate += 1;
            }
            let Some(verdict) = self.gate.remove(&self.next_gate) else {
                return;
            };
            let attempt = self.next_gate;
            self.next_gate += 1;
            let Some(request) = verdict else {
                continue;
            };
            self.waiting -= 1;
            match self.index.check(attempt, &request) {
                Some(Duplicate::Exact(of)) => {
                    outcomes.push(self.reject(attempt, "exact duplicate", &request, false, Some(of)));
                }
                Some(Duplicate::Near(of, _)) => {
                    outcomes.push(self.reject(attempt, "near duplicate", &request, false, Some(of)));
                }
                None => {
                    self.index.insert(attempt, &request);
                    self.first_words.insert(attempt, first_word(&request));
                    let a = self.live.get_mut(&attempt).expect("an attempt at the gate is live");
                    a.stage = Stage::Answering(0);
                    asks.push(Ask {
                        attempt,
                        want: Want::Answer,
                        messages: a.messages.clone(),
                        seed: turn_seed(a.seed, 0, 1),
                    });
                }
            }
        }
    }

    fn reject(&mut self, attempt: u64, reason: &'static str, request: &str, indexed: bool, of: Option<u64>) -> Outcome {
        let answers_cut = self.live.remove(&attempt).map_or(0, |a| a.answers_cut);
        let record = Record { rejected: Some(reason), follow_ups_dropped: None, answers_cut };
        if self.settled.insert(attempt, record).is_none() {
            self.rejected_here += 1;
        }
        let mut line = json!({"id": attempt, "reason": reason, "request": request, "indexed": indexed});
        if let Some(of) = of {
            line["duplicate_of"] = json!(of);
        }
        Outcome::Rejected { attempt, line }
    }

    fn accept(&mut self, attempt: u64, follow_ups_dropped: Option<&'static str>) -> Outcome {
        let a = self.live.remove(&attempt).expect("live");
        let record = Record { rejected: None, follow_ups_dropped, answers_cut: a.answers_cut };
        self.settled.insert(attempt, record);
        self.record_accepted(attempt);
        let mut synthesis = json!({
            "seed": a.seed,
            "turns": a.messages.iter().filter(|m| m["role"] == "user").count(),
            "answers_cut": a.answers_cut,
            "settings": self.described,
        });
        if let Some(topic) = &a.topic {
            synthesis["topic"] = json!(topic);
        }
        Outcome::Accepted { attempt, line: json!({"id": attempt, "messages": a.messages, "synthesis": synthesis}) }
    }
}

/// The seed of user turn `turn` (`which` 0) or of its answer (1) in a conversation of seed `seed`.
fn turn_seed(seed: u64, turn: usize, which: u64) -> u64 {
    splitmix64(seed.wrapping_add(2 * turn as u64 + which))
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORDS: [&str; 5] = ["bake", "bread", "paint", "a", "fence"];

    /// A stand-in target: requests of three words drawn by the seed (so duplicates are common), some runaways and
    /// some with special tokens; answers echo the request, and some are empty.
    fn target(ask: &Ask) -> Generated {
        let s = ask.seed;
        match ask.want {
            Want::UserTurn => Generated {
                text: (0..3).map(|i| WORDS[(splitmix64(s + i) % 5) as usize]).collect::<Vec<_>>().join(" ") + "?",
                tokens: 6,
                ended: !s.is_multiple_of(11),
                special: s.is_multiple_of(13),
            },
            Want::Answer => {
                let last = ask.messages.last().and_then(|m| m["content"].as_str()).unwrap_or_default();
                let text = if s.is_multiple_of(7) { String::new() } else { format!("About {last}") };
                Generated { text, tokens: 9, ended: !s.is_multiple_of(5), special: false }
            }
        }
    }

    fn settings(count: u64, turns: (usize, usize)) -> Settings {
        Settings {
            count,
            seed: 7,
            turns,
            system_prompts: vec!["Be brief.".into()],
            system_share: 0.5,
            topics: Vec::new(),
            bounds: TurnBounds { min_tokens: 2, max_tokens: 64 },
            duplicate_threshold: 0.8,
            max_attempts: Some(400),
        }
    }

    fn described() -> Value {
        json!({"seed": 7})
    }

    /// Runs `plan` to its end, completing the pending generations in an order drawn from `order` (a generator that
    /// finishes sequences in any order), or stops after `settle` outcomes (a kill). The outcomes, in settling order.
    fn drive(plan: &mut Synthesis, order: u64, settle: Option<usize>) -> Vec<Outcome> {
        let mut pending = plan.launch();
        let mut outcomes = Vec::new();
        let mut step = 0;
        while !plan.finished() {
            assert!(!pending.is_empty(), "nothing pending, not finished: stalled");
            step += 1;
            let ask = pending.swap_remove((splitmix64(order ^ step) % pending.len() as u64) as usize);
            let (asks, settled) = plan.generated(ask.attempt, target(&ask));
            pending.extend(asks);
            pending.extend(plan.launch());
            outcomes.extend(settled);
            if settle.is_some_and(|n| outcomes.len() >= n) {
                break;
            }
        }
        outcomes
    }

    /// The kept conversations' lines, in attempt order, and every rejection by attempt.
    fn result(plan: &Synthesis, outcomes: &[Outcome]) -> (Vec<Value>, BTreeMap<u64, Value>) {
        let mut accepted = BTreeMap::new();
        let mut rejected = BTreeMap::new();
        for o in outcomes {
            match o {
                Outcome::Accepted { attempt, line } => accepted.insert(*attempt, line.clone()),
                Outcome::Rejected { attempt, line } => rejected.insert(*attempt, line.clone()),
            };
        }
        let cut = plan.kept().last().copied().unwrap_or(0);
        rejected.retain(|a, _| *a < cut);
        (plan.kept().iter().map(|a| accepted[a].clone()).collect(), rejected)
    }

    /// A small count starts about the attempts it needs, not a whole batch: 3 conversations with room for 256
    /// generating start 5 at first, and (this fake target rejects two attempts in three) a few times 3 in all.
    #[test]
    fn a_small_count_starts_the_attempts_it_needs_not_a_batch() {
        let mut plan = Synthesis::new(settings(3, (1, 1)), 256, described(), []);
        assert_eq!(plan.launch().len(), 5, "3 missing, a quarter more, one");
        let mut plan = Synthesis::new(settings(3, (1, 1)), 256, described(), []);
        let outcomes = drive(&mut plan, 1, None);
        let rejected = outcomes.iter().filter(|o| matches!(o, Outcome::Rejected { .. })).count();
        assert_eq!(plan.kept().len(), 3);
        assert!(plan.next_attempt <= 20, "{} attempts for 3, {rejected} rejected", plan.next_attempt);
    }

    /// The same conversations and rejections whatever order the generations finish in and however many run at
    /// once: duplicates are judged in attempt order, and the first `count` accepted attempts are kept.
    #[test]
    fn the_outcome_does_not_depend_on_the_order_generations_finish_in() {
        let mut first = None;
        for order in 0..6 {
            let in_flight = [6, 1, 256][order as usize % 3];
            let mut plan = Synthesis::new(settings(30, (1, 3)), in_flight, described(), []);
            let outcomes = drive(&mut plan, order, None);
            let got = result(&plan, &outcomes);
            assert_eq!(got.0.len(), 30);
            assert_eq!(plan.cutoff(), plan.kept().last().copied(), "the cutoff kept as attempts were accepted");
            match &first {
                None => first = Some(got),
                Some(want) => assert_eq!(&got, want, "order {order}"),
            }
        }
        let (kept, rejected) = first.unwrap();
        let reasons: HashSet<&str> = rejected.values().filter_map(|l| l["reason"].as_str()).collect();
        for reason in ["exact duplicate", "runaway request (no end of turn within the length bound)"] {
            assert!(reasons.contains(reason), "{reasons:?}");
        }
        // Requests of one conversation differ from every earlier kept one.
        let requests: Vec<&str> = kept
            .iter()
            .map(|l| l["messages"].as_array().unwrap())
            .map(|m| m.iter().find(|m| m["role"] == "user").unwrap()["content"].as_str().unwrap())
            .collect();
        assert_eq!(requests.iter().collect::<HashSet<_>>().len(), requests.len());
        // Some conversations have several turns, some a system prompt, some an answer cut at its limit.
        assert!(kept.iter().any(|l| l["synthesis"]["turns"].as_u64() > Some(1)));
        assert!(kept.iter().any(|l| l["messages"][0]["role"] == "system"));
        assert!(kept.iter().any(|l| l["synthesis"]["answers_cut"].as_u64() > Some(0)));
        assert!(kept.iter().all(|l| l["synthesis"]["settings"] == json!({"seed": 7})));
    }

    /// A run stopped at any point and continued from what it wrote (its accepted and rejected attempts read back)
    /// ends with the same conversations as a run never stopped, generating no settled attempt again.
    #[test]
    fn a_resumed_run_ends_as_an_uninterrupted_one() {
        let mut whole = Synthesis::new(settings(40, (1, 2)), 6, described(), []);
        let outcomes = drive(&mut whole, 1, None);
        let want = result(&whole, &outcomes);
        for kill_after in (1..60).step_by(3) {
            let mut first = Synthesis::new(settings(40, (1, 2)), 6, described(), []);
            let before = drive(&mut first, 2, Some(kill_after));
            let earlier: Vec<Earlier> =
                before
                    .iter()
                    .map(|o| match o {
                        Outcome::Accepted { attempt, line } => Earlier::Accepted {
                            attempt: *attempt,
                            request: line["messages"].as_array().unwrap().iter().find(|m| m["role"] == "user").unwrap()
                                ["content"]
                                .as_str()
                                .unwrap()
                                .to_string(),
                        },
                        Outcome::Rejected { attempt, line } => Earlier::Rejected {
                            attempt: *attempt,
                            request: line["request"].as_str().unwrap().to_string(),
                            indexed: line["indexed"] == true,
                        },
                    })
                    .collect();
            let settled: HashSet<u64> = before
                .iter()
                .map(|o| match o {
                    Outcome::Accepted { attempt, .. } | Outcome::Rejected { attempt, .. } => *attempt,
                })
                .collect();
            let mut again = Synthesis::new(settings(40, (1, 2)), 6, described(), earlier);
            let after = drive(&mut again, 3, None);
            for o in &after {
                let (Outcome::Accepted { attempt, .. } | Outcome::Rejected { attempt, .. }) = o;
                assert!(!settled.contains(attempt), "attempt {attempt} generated again after the kill");
            }
            let all: Vec<Outcome> = before.into_iter().chain(after).collect();
            assert_eq!(result(&again, &all), want, "killed after {kill_after} outcomes");
        }
    }

    /// A later request that fails its checks ends the conversation before it; an empty first answer rejects the
    /// attempt (its request stays in the duplicate index: `indexed`); the first request is judged against earlier
    /// attempts only, even when a later attempt's finished first.
    #[test]
    fn turns_end_rejections_and_duplicates_in_attempt_order() {
        let mut plan = Synthesis::new(settings(2, (2, 2)), 2, described(), []);
        let asks = plan.launch();
        assert_eq!(asks.iter().map(|a| a.attempt).collect::<Vec<_>>(), [0, 1]);
        let request = |text: &str| Generated { text: text.into(), tokens: 5, ended: true, special: false };
        // Attempt 1 finishes first with the same request as attempt 0 writes afterwards: it waits, then is the
        // duplicate.
        let (more, settled) = plan.generated(1, request("How do I bake bread?"));
        assert!(more.is_empty() && settled.is_empty(), "attempt 1 waits for attempt 0");
        let (more, settled) = plan.generated(0, request("how do I bake bread"));
        assert_eq!(more.len(), 1, "attempt 0's answer");
        assert!(
            matches!(&settled[..], [Outcome::Rejected { attempt: 1, line }] if line["reason"] == "exact duplicate" && line["duplicate_of"] == 0)
        );
        // Attempt 0's answer, then a later request that is a reply: the conversation ends with its first turn.
        let (more, _) = plan.generated(0, request("Knead, rest, bake."));
        assert!(matches!(&more[..], [Ask { want: Want::UserTurn, .. }]));
        let (_, settled) = plan.generated(0, request("Sure! Here is another recipe"));
        let Outcome::Accepted { line, .. } = &settled[0] else { panic!("{settled:?}") };
        assert_eq!(
            line["messages"].as_array().unwrap().len(),
            2 + usize::from(line["messages"][0]["role"] == "system")
        );
        assert_eq!(plan.tally().follow_ups_dropped["a reply, not a request"], 1);
        // A new attempt whose first answer is empty: rejected, its request indexed.
        let next = plan.launch();
        let a = next[0].attempt;
        plan.generated(a, request("Paint a fence?"));
        let (_, settled) = plan.generated(a, Generated { text: "  ".into(), ..request("") });
        assert!(
            matches!(&settled[..], [Outcome::Rejected { line, .. }] if line["reason"] == "empty answer" && line["indexed"] == true)
        );
        // Ignored: a generation for an attempt no longer running.
        assert_eq!(plan.generated(1, request("late")), (vec![], vec![]));
    }

    /// While an early attempt's request is still being written, later attempts whose requests are done wait for
    /// their judgement, and new attempts take their place in the generator (up to 8 times as many running).
    #[test]
    fn attempts_waiting_for_their_judgement_do_not_hold_the_generator_idle() {
        let mut plan = Synthesis::new(settings(100, (1, 1)), 2, described(), []);
        let mut pending = plan.launch();
        assert_eq!(pending.len(), 2);
        pending.remove(0); // attempt 0's request: still being written
        let mut written = 0;
        while let Some(ask) = pending.pop() {
            let text = format!("Request number {} about something", ask.attempt);
            let (asks, settled) =
                plan.generated(ask.attempt, Generated { text, tokens: 6, ended: true, special: false });
            assert!(asks.is_empty() && settled.is_empty(), "waits for attempt 0");
            pending.extend(plan.launch());
            written += 1;
        }
        assert_eq!((written, plan.running()), (15, 16), "1 generating and 15 waiting: 8 x 2 running at most");
    }

    /// When every request is rejected the run ends at --max-attempts, short of its count.
    #[test]
    fn a_run_whose_requests_are_all_rejected_ends_at_its_attempt_limit() {
        let mut plan = Synthesis::new(Settings { max_attempts: Some(25), ..settings(10, (1, 1)) }, 6, described(), []);
        let mut pending = plan.launch();
        let mut n = 0;
        while !plan.finished() {
            let ask = pending.pop().expect("pending while not finished");
            let runaway = Generated { text: "and so on and so on".into(), tokens: 64, ended: false, special: false };
            let (asks, _) = plan.generated(ask.attempt, runaway);
            pending.extend(asks);
            pending.extend(plan.launch());
            n += 1;
        }
        assert_eq!((n, plan.accepted(), plan.tally().attempts), (25, 0, 25));
    }
}
