//! The decisions of batched generation ([`super::batched`]), apart from any tensor: which cache row each waiting
//! sequence takes and when (continuous batching: a row freed by a finished sequence is refilled from the queue), which
//! prompts are prefilled together, what token and position each row feeds the next step, how many keys the step reads,
//! and when a sequence is finished. A plain state machine driven by events (`submit`, `admit`, `started`, `stepped`),
//! so the tests can drive it without a model.
use std::collections::VecDeque;

use super::sampling::Sampling;

/// One sequence to generate: its prompt, the most tokens it may add, how and with what seed it draws them, and
/// whatever the caller tags it with (where its answer goes).
#[derive(Debug)]
pub struct Job<T> {
    pub prompt: Vec<i64>,
    pub limit: usize,
    pub seed: u64,
    pub sampling: Sampling,
    pub tag: T,
}

/// A generated sequence: its new tokens (a stop token last when it ended there) and its tag.
#[derive(Debug, PartialEq)]
pub struct Done<T> {
    pub tokens: Vec<i64>,
    pub tag: T,
}

/// Prompts to prefill together, right-padded to the longest: the rows they take and their jobs' prompts, seeds and
/// samplings.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Prefill {
    pub rows: Vec<usize>,
    pub prompts: Vec<Vec<i64>>,
    pub seeds: Vec<u64>,
    pub samplings: Vec<Sampling>,
}

impl Prefill {
    pub fn width(&self) -> usize {
        self.prompts.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// What one step feeds each of the first `rows` cache rows (free rows among them feed token 0 at position 0,
/// harmless: a row is written from position 0 by the prefill that takes it).
#[derive(Debug, Clone, PartialEq)]
pub struct StepInput {
    pub rows: usize,
    pub tokens: Vec<i64>,
    pub positions: Vec<i64>,
    pub seeds: Vec<u64>,
    /// How each row draws (free rows: greedy).
    pub samplings: Vec<Sampling>,
    /// Tokens generated so far per row: the step index of the token drawn next.
    pub steps: Vec<i64>,
    /// The keys every row's attention reads (a multiple of `key_bucket` covering each row's position).
    pub keys: i64,
}

struct Row<T> {
    job: Job<T>,
    generated: Vec<i64>,
}

/// See the module documentation.
pub struct Schedule<T> {
    rows: Vec<Option<Row<T>>>,
    queue: VecDeque<Job<T>>,
    stop: Vec<i64>,
    /// Free rows that trigger an admission while others still run: every row waits while a prefill runs, and a
    /// prefill costs several steps whatever it holds (34-38 ms against a 4.6 ms step of 256 rows, synthesis on an
    /// H100), so refilling one row per step would crawl.
    refill_at: usize,
    /// Most padded prompt tokens one prefill runs.
    prefill_tokens: usize,
    key_bucket: i64,
}

impl<T> Schedule<T> {
    /// `rows` cache rows; a sequence ends after a token of `stop` or at its job's limit.
    pub fn new(rows: usize, stop: Vec<i64>, prefill_tokens: usize, key_bucket: i64) -> Self {
        Schedule {
            rows: (0..rows).map(|_| None).collect(),
            queue: VecDeque::new(),
            stop,
            refill_at: (rows / 8).max(1),
            prefill_tokens: prefill_tokens.max(1),
            key_bucket: key_bucket.max(1),
        }
    }

    /// Queues `job`; a job with nothing to generate (an empty prompt or no token allowed) is done at once.
    pub fn submit(&mut self, job: Job<T>) -> Option<Done<T>> {
        if job.prompt.is_empty() || job.limit == 0 {
            return Some(Done { tokens: Vec::new(), tag: job.tag });
        }
        self.queue.push_back(job);
        None
    }

    /// Sequences generating now.
    pub fn active(&self) -> usize {
        self.rows.iter().filter(|r| r.is_some()).count()
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Nothing generating and nothing waiting.
    pub fn idle(&self) -> bool {
        self.active() == 0 && self.queue.is_empty()
    }

    /// Moves waiting jobs into free rows (the lowest first), when enough rows are free or none runs: the prefills
    /// to run now, shortest prompts first, each within the prefill token budget (one prompt at least).
    pub fn admit(&mut self) -> Vec<Prefill> {
        let free: Vec<usize> = (0..self.rows.len()).filter(|&r| self.rows[r].is_none()).collect();
        let admit_now = !self.queue.is_empty() && (free.len() >= self.refill_at || self.active() == 0);
        if !admit_now {
            return Vec::new();
        }
        let count = free.len().min(self.queue.len());
        let mut taken: Vec<(usize, Job<T>)> = free.into_iter().take(count).zip(self.queue.drain(..count)).collect();
        taken.sort_by_key(|(_, job)| job.prompt.len());
        let mut prefills: Vec<Prefill> = Vec::new();
        for (row, job) in taken {
            let fits = prefills.last().is_some_and(|p| (p.rows.len() + 1) * job.prompt.len() <= self.prefill_tokens);
            if !fits {
                prefills.push(Prefill::default());
            }
            let p = prefills.last_mut().expect("pushed above");
            p.rows.push(row);
            p.prompts.push(job.prompt.clone());
            p.seeds.push(job.seed);
            p.samplings.push(job.sampling);
            self.rows[row] = Some(Row { job, generated: Vec::new() });
        }
        prefills
    }

    /// Records each row's new token (`tokens[i]` for row `rows[i]`), freeing the rows whose sequence ended.
    fn record(&mut self, rows: impl IntoIterator<Item = (usize, i64)>) -> Vec<Done<T>> {
        let mut done = Vec::new();
        for (r, token) in rows {
            let Some(row) = self.rows[r].as_mut() else {
                continue;
            };
            row.generated.push(token);
            if row.generated.len() >= row.job.limit || self.stop.contains(&token) {
                let row = self.rows[r].take().expect("checked above");
                done.push(Done { tokens: row.generated, tag: row.job.tag });
            }
        }
        done
    }

    /// A prefill's first tokens, one per row of `prefill`.
    pub fn started(&mut self, prefill: &Prefill, tokens: &[i64]) -> Vec<Done<T>> {
        self.record(prefill.rows.iter().copied().zip(tokens.iter().copied()))
    }

    /// The next step's inputs, over the first rows up to the last generating one (rounded up to a power of two, so
    /// that few step shapes recur); `None` when nothing generates.
    pub fn step_input(&self) -> Option<StepInput> {
        let last = self.rows.iter().rposition(|r| r.is_some())?;
        let rows = (last + 1).next_power_of_two().min(self.rows.len());
        let mut input = StepInput {
            rows,
            tokens: vec![0; rows],
            positions: vec![0; rows],
            seeds: vec![0; rows],
            samplings: vec![Sampling::Greedy; rows],
            steps: vec![0; rows],
            keys: 0,
        };
        for (r, row) in self.rows[..rows].iter().enumerate() {
            let Some(row) = row else {
                continue;
            };
            let position = (row.job.prompt.len() + row.generated.len() - 1) as i64;
            input.tokens[r] = *row.generated.last().expect("a generating row has its first token");
            input.positions[r] = position;
            input.seeds[r] = row.job.seed;
            input.samplings[r] = row.job.sampling;
            input.steps[r] = row.generated.len() as i64;
            input.keys = input.keys.max(position + 1);
        }
        input.keys = (input.keys + self.key_bucket - 1) / self.key_bucket * self.key_bucket;
        Some(input)
    }

    /// A step's tokens, one per row of its input (free rows' ignored).
    pub fn stepped(&mut self, tokens: &[i64]) -> Vec<Done<T>> {
        self.record(tokens.iter().copied().enumerate())
    }

    /// Drops the jobs, running or waiting, whose tag says nobody waits for them any more (their rows free for others).
    pub fn cancel(&mut self, gone: impl Fn(&T) -> bool) {
        for row in &mut self.rows {
            if row.as_ref().is_some_and(|r| gone(&r.job.tag)) {
                *row = None;
            }
        }
        self.queue.retain(|j| !gone(&j.tag));
    }

    /// Every job, running or waiting, taken out (a failure answers them all).
    pub fn drain(&mut self) -> Vec<T> {
        let running = self.rows.iter_mut().filter_map(Option::take).map(|r| r.job.tag);
        let mut tags: Vec<T> = running.collect();
        tags.extend(self.queue.drain(..).map(|j| j.tag));
        tags
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(tag: u32, prompt_len: usize, limit: usize) -> Job<u32> {
        let prompt = (0..prompt_len as i64).map(|i| 100 + i).collect();
        Job { prompt, limit, seed: tag as u64, sampling: Sampling::Greedy, tag }
    }

    /// Rows refill from the queue as sequences end, several at once once enough rows are free; every step feeds
    /// each row its last token at its own position; the keys read cover the longest row, in buckets.
    #[test]
    fn rows_are_refilled_as_sequences_end() {
        // 16 rows: a refill waits for 2 free rows while others run.
        let mut s: Schedule<u32> = Schedule::new(16, vec![7], 64, 8);
        for tag in 0..20 {
            assert!(s.submit(job(tag, 3 + tag as usize % 4, 5)).is_none());
        }
        let prefills = s.admit();
        assert_eq!(s.active(), 16);
        assert_eq!(s.queued(), 4);
        // Shortest prompts first, at most 64 padded tokens each.
        let widths: Vec<usize> = prefills.iter().map(Prefill::width).collect();
        assert!(widths.windows(2).all(|w| w[0] <= w[1]), "{widths:?}");
        assert!(prefills.iter().all(|p| p.rows.len() * p.width() <= 64));
        assert_eq!(prefills.iter().map(|p| p.rows.len()).sum::<usize>(), 16);
        for p in &prefills {
            let first: Vec<i64> = p.rows.iter().map(|&r| if r == 3 { 7 } else { 1 }).collect();
            let done = s.started(p, &first);
            // Row 3 drew the stop token first: done with it alone.
            for d in &done {
                assert_eq!(d.tokens, vec![7]);
            }
        }
        assert_eq!(s.active(), 15);
        assert!(s.admit().is_empty(), "one free row waits for a second");
        let input = s.step_input().unwrap();
        assert_eq!(input.rows, 16);
        assert_eq!(input.tokens[0], 1);
        assert_eq!((input.tokens[3], input.positions[3]), (0, 0), "a free row feeds token 0 at position 0");
        assert_eq!(input.steps[0], 1);
        let longest = input.positions.iter().max().unwrap() + 1;
        assert_eq!(input.keys, (longest + 7) / 8 * 8);
        // Row 5 ends: two rows free, two jobs admitted into rows 3 and 5.
        let mut tokens = vec![2; 16];
        tokens[5] = 7;
        assert_eq!(s.stepped(&tokens).len(), 1);
        let prefills = s.admit();
        let mut rows: Vec<usize> = prefills.iter().flat_map(|p| p.rows.clone()).collect();
        rows.sort();
        assert_eq!(rows, vec![3, 5]);
        assert_eq!(s.queued(), 2);
    }

    /// Jobs nobody waits for any more are dropped, running or queued, and their rows refilled.
    #[test]
    fn cancelled_jobs_free_their_rows() {
        let mut s: Schedule<u32> = Schedule::new(2, vec![], 1000, 4);
        for tag in 0..4 {
            s.submit(job(tag, 2, 5));
        }
        for p in s.admit() {
            s.started(&p, &vec![1; p.rows.len()]);
        }
        assert_eq!((s.active(), s.queued()), (2, 2));
        s.cancel(|&tag| tag == 0 || tag == 3);
        assert_eq!((s.active(), s.queued()), (1, 1));
        let prefills = s.admit();
        assert_eq!(prefills.len(), 1);
        assert_eq!(prefills[0].rows, vec![0], "job 2 takes the row job 0 left");
        assert_eq!(prefills[0].seeds, vec![2]);
    }

    /// Sequences end at their limit; jobs with nothing to do are done at once; when few rows generate the step covers
    /// only the rows up to the last one, rounded to a power of two; a failure drains every job.
    #[test]
    fn limits_and_narrow_steps() {
        let mut s: Schedule<u32> = Schedule::new(8, vec![], 1000, 4);
        assert_eq!(s.submit(job(9, 0, 5)), Some(Done { tokens: vec![], tag: 9 }));
        assert_eq!(s.submit(job(8, 3, 0)), Some(Done { tokens: vec![], tag: 8 }));
        s.submit(job(0, 2, 2));
        s.submit(job(1, 5, 3));
        s.submit(job(2, 4, 3));
        let prefills = s.admit();
        assert_eq!(prefills.len(), 1, "one prefill within the budget");
        assert_eq!(prefills[0].rows, vec![0, 2, 1], "rows by arrival, prefilled shortest first");
        assert!(s.started(&prefills[0], &[10, 11, 12]).is_empty());
        let input = s.step_input().unwrap();
        assert_eq!(input.rows, 4, "3 rows generate: the step covers 4");
        assert_eq!(input.positions[..3], [2, 5, 4]);
        assert_eq!(input.keys, 8);
        let done = s.stepped(&[20, 21, 22, 0]);
        assert_eq!(done, vec![Done { tokens: vec![10, 20], tag: 0 }]);
        let done = s.stepped(&[0, 31, 32, 0]);
        assert_eq!(done.len(), 2);
        assert_eq!(done[0], Done { tokens: vec![12, 21, 31], tag: 1 });
        assert!(s.idle() && s.step_input().is_none());
        s.submit(job(3, 2, 2));
        s.submit(job(4, 2, 2));
        s.admit();
        s.submit(job(5, 2, 2));
        let mut drained = s.drain();
        drained.sort();
        assert_eq!(drained, vec![3, 4, 5]);
        assert!(s.idle());
    }
}
