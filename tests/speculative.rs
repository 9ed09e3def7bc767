//! Speculative decoding through the public API on the tiny target: the cached target equals the uncached one, the
//! drafter's decoding pass equals its training forward, and speculative output equals plain greedy output token
//! for token, with acceptance counts that a wrong cache crop or an off-by-one would change.
use dflash::model::speculative::{DFlashProposer, Proposer, greedy, speculative};
use dflash::model::{
    BlockAttention, Decoder, Depth, Drafter, DrafterConfig, Init, LayerAttention, ModelError, Preset, Target,
};
use tch::{Device, Kind, Tensor};

const BS: usize = 4;

/// The target's steps for one generation (eager: these run on the CPU).
fn decoder(t: &Target) -> Decoder<'_> {
    Decoder::new(t, 128, &[]).unwrap()
}

fn target() -> Target {
    Preset::Tiny.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap()
}

fn drafter(seed: u64) -> Drafter {
    Drafter::new(DrafterConfig::for_preset(Preset::Tiny, BS), Device::Cpu, Kind::Float, Init::Portable(seed)).unwrap()
}

fn prompt(len: usize, salt: i64) -> Vec<i64> {
    (0..len as i64).map(|i| (i * 37 + salt * 11 + 3) % 250).collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn cached_decoding_equals_the_whole_sequence_at_once() {
    let t = target();
    let ids = prompt(23, 1);
    let all = Tensor::from_slice(&ids).view([1, 23]);
    let logits = t.logits(&all, &[23]).unwrap();
    let taps = t.capture(&all, &[23]).unwrap();
    // Prefill 10, one token, then a block of 8, then 4: every split of the sequence.
    let mut cache = t.new_cache(32).unwrap();
    let mut start = 0;
    for len in [10, 1, 8, 4] {
        let step = t.decode(&all.narrow(1, start, len), &mut cache).unwrap();
        assert!(max_diff(&step.logits, &logits.narrow(1, start, len)) < 1e-4, "logits at {start}..+{len}");
        assert!(max_diff(&step.taps, &taps.narrow(1, start, len)) < 1e-4, "tapped states at {start}..+{len}");
        start += len;
    }
    assert_eq!(cache.len(), 23);
    // Cropping and continuing differently is what a rejected draft does.
    cache.crop(15);
    let step = t.decode(&all.narrow(1, 15, 8), &mut cache).unwrap();
    assert!(max_diff(&step.logits, &logits.narrow(1, 15, 8)) < 1e-4);
}

/// Draft layers with sliding windows and causal blocks, as vLLM and SGLang run them: a window of 5 that cuts the
/// context, one of 3 (under the block size) both ways, and a causal full layer.
fn restricted_layers() -> Vec<Vec<LayerAttention>> {
    let slide = |w: i64, causal: bool| LayerAttention { window: Some(w), causal };
    vec![
        vec![slide(5, true), LayerAttention::default()],
        vec![slide(3, false), slide(3, false)],
        vec![LayerAttention { window: None, causal: true }; 2],
    ]
}

fn drafter_with(seed: u64, layers: Vec<LayerAttention>) -> Drafter {
    let cfg = DrafterConfig::for_preset(Preset::Tiny, BS).with_layer_attention(layers).unwrap();
    Drafter::new(cfg, Device::Cpu, Kind::Float, Init::Portable(seed)).unwrap()
}

#[test]
fn the_drafting_pass_equals_the_training_forward() {
    let plain = drafting_pass_against_training(drafter(3));
    for layers in restricted_layers() {
        let restricted = drafting_pass_against_training(drafter_with(3, layers.clone()));
        assert!(max_diff(&plain, &restricted) > 1e-3, "{layers:?} changes nothing");
    }
}

/// Drafts one block after a context that arrives in two parts and compares it with the training forward of the
/// same block; returns the drafted states.
fn drafting_pass_against_training(d: Drafter) -> Tensor {
    let t = target();
    let (anchor, width) = (13i64, d.config().context_width() as i64);
    tch::manual_seed(0);
    let hidden = Tensor::randn([1, anchor + BS as i64, width], (Kind::Float, Device::Cpu));
    let block_ids = Tensor::from_slice(&[42i64, 319, 319, 319]).view([1, BS as i64]);
    let embeddings = t.embed(&block_ids);
    let positions = Tensor::arange_start(anchor, anchor + BS as i64, (Kind::Int64, Device::Cpu)).view([1, -1]);
    let attention =
        BlockAttention::new(&[anchor], None, 1, BS, anchor + BS as i64, 16, Kind::Float, Device::Cpu).unwrap();
    let trained = tch::no_grad(|| d.forward(&hidden, &embeddings, &positions, &attention));
    // The context arrives in two parts, as it does over decoding steps; the first pass drafts another block.
    let weights = d.decode_weights().unwrap();
    let mut cache = d.new_cache(64).unwrap();
    let _ = d.draft(&weights, &hidden.narrow(1, 0, 6), &embeddings, &mut cache).unwrap();
    let drafted = d.draft(&weights, &hidden.narrow(1, 6, anchor - 6), &embeddings, &mut cache).unwrap();
    assert_eq!(cache.len(), anchor);
    assert!(max_diff(&drafted, &trained) < 1e-4, "{:?}: {}", d.config().layer_attention, max_diff(&drafted, &trained));
    drafted
}

/// The pass a CUDA graph captures (positions and the new context's length from device scalars, a whole block of
/// context rows written, the rest of them garbage) drafts what the eager pass drafts, and leaves a cache from which
/// an eager pass drafts the same again.
#[test]
fn the_drafting_pass_at_a_device_position_equals_the_eager_pass() {
    drafting_at_a_device_position(drafter(7));
    for layers in restricted_layers() {
        drafting_at_a_device_position(drafter_with(7, layers));
    }
}

fn drafting_at_a_device_position(d: Drafter) {
    let t = target();
    let width = d.config().context_width() as i64;
    let weights = d.decode_weights().unwrap();
    let (mut eager, mut indexed) = (d.new_cache(40).unwrap(), d.new_cache(40).unwrap());
    tch::manual_seed(1);
    let states = Tensor::randn([1, 128, width], (Kind::Float, Device::Cpu));
    let embeddings = t.embed(&Tensor::from_slice(&[42i64, 319, 319, 319]).view([1, BS as i64]));
    let _ = d.draft(&weights, &states.narrow(1, 0, 9), &embeddings, &mut eager).unwrap();
    let _ = d.draft(&weights, &states.narrow(1, 0, 9), &embeddings, &mut indexed).unwrap();
    let (start, count) = (Tensor::zeros([], (Kind::Int64, Device::Cpu)), Tensor::zeros([], (Kind::Int64, Device::Cpu)));
    let mut at = 9;
    for n in [1i64, 4, 2, 3, 1, 4] {
        let new = states.narrow(1, at, n);
        // The rows past the new context hold whatever the previous pass left there.
        let context = Tensor::randn([1, BS as i64, width], (Kind::Float, Device::Cpu)) * 10.0;
        context.narrow(1, 0, n).copy_(&new);
        let _ = start.shallow_clone().fill_(indexed.len());
        let _ = count.shallow_clone().fill_(n);
        let a = d.draft(&weights, &new, &embeddings, &mut eager).unwrap();
        let b = d.draft_at(&weights, &context, &start, &count, &embeddings, &mut indexed).unwrap();
        indexed.advance(n);
        assert!(max_diff(&a, &b) < 1e-5, "{n} new context rows at {at}: {}", max_diff(&a, &b));
        at += n;
    }
    assert_eq!(eager.len(), indexed.len());
    let a = d.draft(&weights, &states.narrow(1, at, 2), &embeddings, &mut eager).unwrap();
    let b = d.draft(&weights, &states.narrow(1, at, 2), &embeddings, &mut indexed).unwrap();
    assert!(max_diff(&a, &b) < 1e-5, "an eager pass after device-position passes: {}", max_diff(&a, &b));
    let mut full = d.new_cache(128).unwrap();
    let _ = d.draft(&weights, &states.narrow(1, 0, 125), &embeddings, &mut full).unwrap();
    let context = Tensor::zeros([1, BS as i64, width], (Kind::Float, Device::Cpu));
    let refused = d.draft_at(&weights, &context, &start, &count, &embeddings, &mut full);
    assert!(refused.is_err(), "125 of 128 positions held: a pass writing 8 more must be refused");
}

#[test]
fn speculative_output_equals_greedy_output() {
    let t = target();
    let d = drafter(5);
    // One proposer for every generation: each starts from nothing.
    let mut proposer = DFlashProposer::new(&d, &t, 128, false).unwrap();
    for (i, (prompt_len, max_new)) in
        [(1, 9), (2, 1), (3, 2), (5, 4), (7, 5), (17, 16), (30, 33), (40, 12)].into_iter().enumerate()
    {
        let p = prompt(prompt_len, i as i64);
        let reference = greedy(&mut decoder(&t), &p, max_new, &[]).unwrap();
        assert_eq!(reference.tokens.len(), max_new);
        let out = speculative(&mut decoder(&t), &mut proposer, BS, &p, max_new, &[]).unwrap();
        assert_eq!(out.tokens, reference.tokens, "prompt {prompt_len} tokens, {max_new} new");
        // The prefill makes the first token; every verify step keeps at least its bonus token.
        assert_eq!(out.accepted.iter().sum::<usize>() + 1, max_new);
        assert!(out.accepted.iter().all(|&a| (1..=BS).contains(&a)));
    }
}

#[test]
fn a_stop_token_inside_a_block_ends_both_the_same_way() {
    let t = target();
    let d = drafter(5);
    let p = prompt(9, 4);
    let free = greedy(&mut decoder(&t), &p, 24, &[]).unwrap().tokens;
    // Stop at a token first generated mid-way: generation must end right after its first occurrence.
    let (at, stop) = free
        .iter()
        .enumerate()
        .skip(6)
        .find(|(i, tok)| !free[..*i].contains(tok))
        .map(|(i, t)| (i, *t))
        .expect("the tiny target generates a new token after the 6th");
    let reference = greedy(&mut decoder(&t), &p, 24, &[stop]).unwrap();
    assert_eq!(reference.tokens, free[..=at]);
    let mut proposer = DFlashProposer::new(&d, &t, 64, false).unwrap();
    let out = speculative(&mut decoder(&t), &mut proposer, BS, &p, 24, &[stop]).unwrap();
    assert_eq!(out.tokens, reference.tokens);
}

/// A test double that proposes the target's own greedy continuation, checking on the way that the decoder hands
/// it the context of exactly the accepted tokens.
struct Oracle {
    sequence: Vec<i64>,
    with_states: usize,
    width: i64,
}

impl Proposer for Oracle {
    fn propose(&mut self, new_context: &Tensor, last: i64, count: usize) -> Result<Vec<i64>, ModelError> {
        assert_eq!(new_context.size()[2], self.width);
        self.with_states += new_context.size()[1] as usize;
        assert_eq!(last, self.sequence[self.with_states], "the last accepted token follows the context");
        Ok(self.sequence[self.with_states + 1..self.with_states + 1 + count].to_vec())
    }
}

#[test]
fn a_perfect_proposer_is_accepted_whole_and_a_random_drafter_hardly_at_all() {
    let t = target();
    let p = prompt(11, 9);
    let max_new = 1 + 3 * BS + 2;
    let mut sequence = p.clone();
    sequence.extend(greedy(&mut decoder(&t), &p, max_new + BS, &[]).unwrap().tokens);
    let width = (t.taps().len() * t.config().hidden_size) as i64;
    let mut oracle = Oracle { sequence, with_states: 0, width };
    let out = speculative(&mut decoder(&t), &mut oracle, BS, &p, max_new, &[]).unwrap();
    assert_eq!(out.accepted, [BS, BS, BS, 2], "every verify step but the last accepts the whole block");

    let d = drafter(7);
    let (mut steps, mut kept) = (0, 0);
    for salt in 0..6 {
        let p = prompt(12, 100 + salt);
        let mut proposer = DFlashProposer::new(&d, &t, 64, false).unwrap();
        let out = speculative(&mut decoder(&t), &mut proposer, BS, &p, 24, &[]).unwrap();
        steps += out.accepted.len();
        kept += out.accepted.iter().sum::<usize>();
    }
    let mean = kept as f64 / steps as f64;
    assert!(mean < 1.6, "an untrained drafter should rarely be accepted: {mean}");
}
