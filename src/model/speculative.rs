//! Speculative decoding with a DFlash drafter, greedy (temperature 0), as inference engines run it: what the
//! acceptance length measured during training must predict.
//!
//! After the prompt's prefill, each step: the drafter reads the target states of the tokens accepted since its last
//! pass (its context cache keeps the earlier ones) and drafts `bs - 1` tokens from `[last accepted token, MASK x
//! (bs - 1)]` in one forward pass; the target verifies `[last accepted token, drafted...]` in one forward pass; the
//! longest prefix of drafted tokens equal to the target's own argmax is accepted, plus the target's next token
//! (the bonus); the target's cache is cropped to the accepted tokens. [`greedy`] is the reference the result must
//! equal: the target alone, one token per step.
use tch::Tensor;

use crate::profile::span;

use super::drafter::DraftWeights;
use super::generate::cached_generation;
use super::{Decoder, Drafter, KvCache, ModelError, Target};

/// Proposes the tokens of a block: the DFlash drafter, or a test double.
pub trait Proposer {
    /// Proposes `count` (at most block size - 1) tokens to follow `last`, given the target states `[1, n, taps * hidden]` of the `n` tokens
    /// accepted since the previous call (the prompt, at the first call); `last` itself has no state yet.
    fn propose(&mut self, new_context: &Tensor, last: i64, count: usize) -> Result<Vec<i64>, ModelError>;
}

/// The DFlash drafter as a [`Proposer`]: its context cache, weights cast for decoding, and the target's frozen
/// embedding and LM head.
pub struct DFlashProposer<'a> {
    drafter: &'a Drafter,
    target: &'a Target,
    weights: DraftWeights,
    cache: KvCache,
}

impl<'a> DFlashProposer<'a> {
    /// A proposer for sequences of up to `capacity` tokens.
    pub fn new(drafter: &'a Drafter, target: &'a Target, capacity: i64) -> Result<Self, ModelError> {
        Ok(DFlashProposer { drafter, target, weights: drafter.decode_weights()?, cache: drafter.new_cache(capacity)? })
    }
}

impl Proposer for DFlashProposer<'_> {
    fn propose(&mut self, new_context: &Tensor, last: i64, count: usize) -> Result<Vec<i64>, ModelError> {
        let cfg = self.drafter.config();
        let mut block = vec![cfg.mask_token_id; cfg.block_size];
        block[0] = last;
        let ids = Tensor::f_from_slice(&block)?.f_view([1, block.len() as i64])?.f_to(self.target.device())?;
        let embeddings = tch::no_grad(|| self.target.embed(&ids));
        let context = new_context.f_to_kind(self.drafter.kind())?;
        let hidden = self.drafter.draft(&self.weights, &context, &embeddings, &mut self.cache)?;
        let slots = (count as i64).min(cfg.block_size as i64 - 1);
        let _p = span("drafter.lm_head");
        let logits = tch::no_grad(|| hidden.narrow(1, 1, slots).f_linear(self.target.lm_head(), None::<Tensor>))?;
        Ok(Vec::try_from(logits.f_argmax(-1, false)?.f_flatten(0, -1)?)?)
    }
}

/// What one speculative generation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecOutput {
    /// Generated tokens (a stop token included, nothing after it).
    pub tokens: Vec<i64>,
    /// Tokens kept per target verify step, the bonus token included.
    pub accepted: Vec<usize>,
}

/// The target's plain greedy output, one token per step.
#[derive(Debug, Clone, PartialEq)]
pub struct GreedyOutput {
    pub tokens: Vec<i64>,
    /// Top-1 minus top-2 logit (f32) at each generated position: how close each choice was to a tie.
    pub top2_gaps: Vec<f32>,
}

pub(crate) fn ids_tensor(target: &Target, ids: &[i64]) -> Result<Tensor, ModelError> {
    Ok(Tensor::f_from_slice(ids)?.f_view([1, ids.len() as i64])?.f_to(target.device())?)
}

fn argmax_rows(logits: &Tensor) -> Result<Vec<i64>, ModelError> {
    Ok(Vec::try_from(logits.f_argmax(-1, false)?.f_flatten(0, -1)?)?)
}

/// Checks a generation of `max_new` tokens after `prompt` fits the model and `decoder`'s cache, and empties the
/// cache for it.
pub(crate) fn begin_generation(decoder: &mut Decoder, prompt: &[i64], max_new: usize) -> Result<(), ModelError> {
    if prompt.is_empty() {
        return Err(ModelError::Batch("a prompt needs at least one token".into()));
    }
    let limit = decoder.target().config().max_position_embeddings as i64;
    let needed = prompt.len() as i64 + max_new as i64;
    if needed > limit {
        return Err(ModelError::Batch(format!(
            "a prompt of {} tokens plus {max_new} new ones exceeds max_position_embeddings {limit}",
            prompt.len()
        )));
    }
    if needed > decoder.capacity() {
        return Err(ModelError::Batch(format!(
            "a prompt of {} tokens plus {max_new} new ones exceeds the decoder's {} positions",
            prompt.len(),
            decoder.capacity()
        )));
    }
    decoder.crop(0);
    Ok(())
}

/// Speculative greedy generation of up to `max_new` tokens after `prompt`, stopping after any token of `stop`,
/// with blocks of `block_size` (the drafter's) proposed by `proposer`, the target's steps run by `decoder`.
pub fn speculative(
    decoder: &mut Decoder,
    proposer: &mut impl Proposer,
    block_size: usize,
    prompt: &[i64],
    max_new: usize,
    stop: &[i64],
) -> Result<SpecOutput, ModelError> {
    let mut out = SpecOutput { tokens: Vec::new(), accepted: Vec::new() };
    if max_new == 0 {
        return Ok(out);
    }
    begin_generation(decoder, prompt, max_new)?;
    let target = decoder.target();
    let prefill = decoder.decode(&ids_tensor(target, prompt)?)?;
    let first = argmax_rows(&prefill.logits.narrow(1, prompt.len() as i64 - 1, 1))?[0];
    out.tokens.push(first);
    let mut context = prefill.taps;
    while out.tokens.len() < max_new && !stop.contains(&first) {
        let last = *out.tokens.last().expect("one token at least");
        let start = decoder.len();
        // Drafted tokens past the limit could never be kept: verify only what can be.
        let count = (block_size - 1).min(max_new - out.tokens.len() - 1);
        let drafted = if count == 0 { Vec::new() } else { proposer.propose(&context, last, count)? };
        let mut block = vec![last];
        block.extend_from_slice(&drafted);
        let verified = decoder.decode(&ids_tensor(target, &block)?)?;
        let posterior = argmax_rows(&verified.logits)?;
        let agree = drafted.iter().zip(&posterior).take_while(|(d, p)| d == p).count();
        // Kept: the agreeing drafted tokens and the target's own next token, up to a stop token or the limit.
        let mut kept = 0;
        for &token in drafted[..agree].iter().chain(std::iter::once(&posterior[agree])) {
            if out.tokens.len() == max_new {
                break;
            }
            out.tokens.push(token);
            kept += 1;
            if stop.contains(&token) {
                break;
            }
        }
        out.accepted.push(kept);
        if out.tokens.last().is_some_and(|t| stop.contains(t)) {
            break;
        }
        // The cache keeps `last` and the accepted drafted tokens; the bonus token has no state yet.
        decoder.crop(start + agree as i64 + 1);
        // A view of the step's output, read by the next proposal before the next step overwrites it.
        context = verified.taps.narrow(1, 0, agree as i64 + 1);
    }
    Ok(out)
}

/// Plain greedy generation with the target alone, one token per step: the reference for [`speculative`].
pub fn greedy(decoder: &mut Decoder, prompt: &[i64], max_new: usize, stop: &[i64]) -> Result<GreedyOutput, ModelError> {
    if max_new == 0 {
        return Ok(GreedyOutput { tokens: Vec::new(), top2_gaps: Vec::new() });
    }
    begin_generation(decoder, prompt, max_new)?;
    let mut top2_gaps = Vec::new();
    let tokens = cached_generation(decoder, prompt, max_new, stop, |last| {
        let (top, index) = last.f_topk(2, 0, true, true)?;
        let top: Vec<f32> = Vec::try_from(top)?;
        top2_gaps.push(top[0] - top.get(1).copied().unwrap_or(f32::NEG_INFINITY));
        Ok(index.f_int64_value(&[0])?)
    })?;
    Ok(GreedyOutput { tokens, top2_gaps })
}
