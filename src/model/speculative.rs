//! Speculative decoding with a DFlash drafter, greedy (temperature 0), as inference engines run it: what the
//! acceptance length measured during training must predict.
//!
//! After the prompt's prefill, each step: the drafter reads the target states of the tokens accepted since its last
//! pass (its context cache keeps the earlier ones) and drafts `bs - 1` tokens from `[last accepted token, MASK x
//! (bs - 1)]` in one forward pass; the target verifies `[last accepted token, drafted...]` in one forward pass; the
//! longest prefix of drafted tokens equal to the target's own argmax is accepted, plus the target's next token
//! (the bonus); the target's cache is cropped to the accepted tokens. [`greedy`] is the reference the result must
//! equal: the target alone, one token per step.
use tch::{Kind, Tensor};

use crate::ffi::graph::CudaGraph;
use crate::profile::span;

use super::choice::{Choice, greedy_choice, greedy_token_ids};
use super::drafter::DraftWeights;
use super::generate::{begin_generation, cached_generation, ids_tensor};
use super::{Decoder, Drafter, KvCache, ModelError, Target};

/// Proposes the tokens of a block: the DFlash drafter, or a test double.
pub trait Proposer {
    /// Proposes `count` (at most block size - 1) tokens to follow `last`, given the target states `[1, n, taps * hidden]` of the `n` tokens
    /// accepted since the previous call (the prompt, at the first call); `last` itself has no state yet.
    fn propose(&mut self, new_context: &Tensor, last: i64, count: usize) -> Result<Vec<i64>, ModelError>;

    /// Forgets the context: the next call starts a new generation.
    fn restart(&mut self) {}
}

/// The DFlash drafter as a [`Proposer`]: its context cache, weights cast for decoding, and the target's frozen
/// embedding and LM head. On a GPU, passes after the prompt's replay from a CUDA graph ([`DraftGraph`]).
pub struct DFlashProposer<'a> {
    drafter: &'a Drafter,
    target: &'a Target,
    weights: DraftWeights,
    cache: KvCache,
    /// Whether passes may replay from a graph (cleared when a capture fails).
    graphs: bool,
    graph: Option<DraftGraph>,
}

/// A drafting pass captured whole (embedding, drafter, LM head, argmax) at a device position
/// ([`Drafter::draft_at`]), with the buffers each replay reads and writes.
struct DraftGraph {
    graph: CudaGraph,
    /// `[1, bs, taps * hidden]`: the new context in its first rows.
    context: Tensor,
    start: Tensor,
    count: Tensor,
    /// `[1, bs]`: `[last accepted token, MASK...]`.
    ids: Tensor,
    /// `[1, bs - 1]`: the drafted tokens, written by each replay.
    drafted: Tensor,
}

impl<'a> DFlashProposer<'a> {
    /// A proposer for sequences of up to `capacity` tokens; `cuda_graphs` lets its passes replay from a CUDA graph
    /// where the drafter and the target share a CUDA device.
    pub fn new(drafter: &'a Drafter, target: &'a Target, capacity: i64, cuda_graphs: bool) -> Result<Self, ModelError> {
        let graphs = cuda_graphs && CudaGraph::available(drafter.device()) && drafter.device() == target.device();
        // A pass at a device position writes a whole block of context rows, then the block, past the context; an
        // eager pass writes the block past the context (for the decoding kernels).
        let block = drafter.config().block_size as i64;
        let room = if graphs { 2 * block } else { block };
        Ok(DFlashProposer {
            drafter,
            target,
            weights: drafter.decode_weights()?,
            cache: drafter.new_cache(capacity + room)?,
            graphs,
            graph: None,
        })
    }

    /// Drafts with `drafter`'s weights from now on, copied into the ones this proposer's graph reads: another
    /// checkpoint of the drafter it was made with (the same configuration).
    pub fn load(&mut self, drafter: &Drafter) -> Result<(), ModelError> {
        if drafter.config() != self.drafter.config() {
            return Err(ModelError::Mismatch(
                "the drafter to load has another configuration than the one decoding was set up for".into(),
            ));
        }
        self.weights.copy_from(&drafter.decode_weights()?)
    }

    /// Whether a pass was replayed from a CUDA graph.
    pub fn graphed(&self) -> bool {
        self.graph.is_some()
    }

    /// The pass from its graph (captured at first use); `None` where none applies: the prompt's pass (its length
    /// varies), or a pass that would not fit the cache.
    fn replay(&mut self, new_context: &Tensor, last: i64) -> Result<Option<Vec<i64>>, ModelError> {
        let bs = self.drafter.config().block_size as i64;
        let n = new_context.size()[1];
        if !self.graphs || self.cache.is_empty() || n > bs || self.cache.len() + 2 * bs > self.cache.capacity() {
            return Ok(None);
        }
        let device = self.drafter.device();
        let graph = match self.graph.take() {
            Some(graph) => graph,
            None => {
                let (drafter, target, weights) = (self.drafter, self.target, &self.weights);
                let width = new_context.size()[2];
                let context = Tensor::f_zeros([1, bs, width], (drafter.kind(), device))?;
                let (start, count) =
                    (Tensor::f_zeros([], (Kind::Int64, device))?, Tensor::f_zeros([], (Kind::Int64, device))?);
                let mask = drafter.config().mask_token_id;
                let ids = Tensor::f_full([1, bs], mask, (Kind::Int64, device))?;
                write_inputs(&context, &start, &count, &ids, new_context, self.cache.len(), last)?;
                let cache = &mut self.cache;
                let (graph, drafted) = CudaGraph::capture(device, 2, || -> Result<Tensor, ModelError> {
                    let embeddings = target.embed(&ids);
                    let hidden = drafter.draft_at(weights, &context, &start, &count, &embeddings, cache)?;
                    let slots = hidden.f_narrow(1, 1, bs - 1)?;
                    let logits = slots.f_linear(target.lm_head(), None::<Tensor>)?;
                    drafter.drafted_tokens(weights, &slots, &logits, &ids.f_select(1, 0)?)
                })
                .map_err(|e| ModelError::Torch(format!("capturing a drafting pass: {e}")))?;
                DraftGraph { graph, context, start, count, ids, drafted }
            }
        };
        let g = &graph;
        write_inputs(&g.context, &g.start, &g.count, &g.ids, new_context, self.cache.len(), last)?;
        g.graph.replay().map_err(|e| ModelError::Torch(e.to_string()))?;
        self.cache.advance(n);
        let drafted = Vec::try_from(g.drafted.f_flatten(0, -1)?)?;
        self.graph = Some(graph);
        Ok(Some(drafted))
    }
}

/// Writes a graphed pass's inputs: the new context into the first rows of `context` (the rows after it are ignored),
/// its length into `count`, where it starts into `start`, and `last` ahead of the mask tokens of `ids`.
fn write_inputs(
    context: &Tensor,
    start: &Tensor,
    count: &Tensor,
    ids: &Tensor,
    new_context: &Tensor,
    at: i64,
    last: i64,
) -> Result<(), ModelError> {
    let n = new_context.size()[1];
    context.f_narrow(1, 0, n)?.f_copy_(new_context)?;
    let _ = start.shallow_clone().f_fill_(at)?;
    let _ = count.shallow_clone().f_fill_(n)?;
    let _ = ids.f_narrow(1, 0, 1)?.f_fill_(last)?;
    Ok(())
}

impl Proposer for DFlashProposer<'_> {
    fn propose(&mut self, new_context: &Tensor, last: i64, count: usize) -> Result<Vec<i64>, ModelError> {
        let cfg = self.drafter.config();
        let slots = count.min(cfg.block_size - 1);
        match self.replay(new_context, last) {
            Ok(Some(drafted)) => return Ok(drafted[..slots].to_vec()),
            Ok(None) => {}
            Err(e) => {
                // The cache's length has not moved: the eager pass below rewrites what the failed one wrote.
                tracing::warn!("drafting without CUDA graphs from here: {e}");
                (self.graphs, self.graph) = (false, None);
            }
        }
        let mut block = vec![cfg.mask_token_id; cfg.block_size];
        block[0] = last;
        let ids = Tensor::f_from_slice(&block)?.f_view([1, block.len() as i64])?.f_to(self.target.device())?;
        let embeddings = tch::no_grad(|| self.target.embed(&ids));
        let context = new_context.f_to_kind(self.drafter.kind())?;
        let hidden = self.drafter.draft(&self.weights, &context, &embeddings, &mut self.cache)?;
        let _p = span("drafter.lm_head");
        let drafted = tch::no_grad(|| {
            let slots = hidden.narrow(1, 1, slots as i64);
            let logits = slots.f_linear(self.target.lm_head(), None::<Tensor>)?;
            self.drafter.drafted_tokens(&self.weights, &slots, &logits, &ids.f_select(1, 0)?)
        })?;
        Ok(Vec::try_from(drafted.f_flatten(0, -1)?)?)
    }

    fn restart(&mut self) {
        self.cache.crop(0);
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
    /// The choice at each generated position: how close it was to a tie.
    pub choices: Vec<Choice>,
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
    proposer.restart();
    let target = decoder.target();
    let prefill = decoder.decode(&ids_tensor(target, prompt)?)?;
    let first = greedy_token_ids(&prefill.logits)?[0];
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
        let posterior = greedy_token_ids(&verified.logits)?;
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
        return Ok(GreedyOutput { tokens: Vec::new(), choices: Vec::new() });
    }
    begin_generation(decoder, prompt, max_new)?;
    let mut choices = Vec::new();
    let tokens = cached_generation(decoder, prompt, max_new, stop, |last| {
        let choice = greedy_choice(last)?;
        choices.push(choice);
        Ok(choice.token)
    })?;
    Ok(GreedyOutput { tokens, choices })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Depth, DrafterConfig, Init, Preset};

    /// On a GPU: passes replayed from the drafting graph draft what eager passes draft (f32, so the order of the
    /// softmax's sum cannot flip a token), over generations that reuse the proposer and its graph; for DFlash and for
    /// DFlash 2, whose selector walks the block inside the graph.
    #[test]
    #[ignore = "needs a GPU"]
    fn replayed_drafting_passes_draft_what_eager_passes_draft() {
        let shape =
            crate::model::variant::dflash2::Dflash2Shape { conv_group_size: 8, selector_rank: 8, ..Default::default() };
        for variant in [crate::model::Variant::DFlash, crate::model::Variant::DFlash2(shape)] {
            replayed_passes_draft_what_eager_passes_draft(variant);
        }
    }

    fn replayed_passes_draft_what_eager_passes_draft(variant: crate::model::Variant) {
        let device = crate::ffi::graph::graph_gpu_for_tests();
        let t = Preset::Tiny.spec().build_target(Depth::Full, device, Kind::Float).unwrap();
        let cfg = DrafterConfig::for_preset(Preset::Tiny, 4).with_variant(variant).unwrap();
        let d = Drafter::new(cfg, device, Kind::Float, Init::Portable(3)).unwrap();
        let mut graphed = DFlashProposer::new(&d, &t, 64, true).unwrap();
        let mut eager = DFlashProposer::new(&d, &t, 64, false).unwrap();
        let width = d.config().context_width() as i64;
        tch::manual_seed(2);
        let states = Tensor::randn([1, 40, width], (Kind::Float, device));
        for generation in 0..2 {
            graphed.restart();
            eager.restart();
            let (mut at, mut last) = (0, 17);
            for n in [5 + generation, 1, 4, 2, 3, 1] {
                let new = states.narrow(1, at, n);
                let a = eager.propose(&new, last, 3).unwrap();
                let b = graphed.propose(&new, last, 3).unwrap();
                assert_eq!(a, b, "generation {generation}, {n} new context rows");
                last = a[0];
                at += n;
            }
        }
        assert!(graphed.graphed() && !eager.graphed());
        // Another checkpoint loaded into the graphed proposer: its replays draft what a fresh proposer of it drafts.
        let other = Drafter::new(d.config().clone(), device, Kind::Float, Init::Portable(4)).unwrap();
        graphed.load(&other).unwrap();
        let mut fresh = DFlashProposer::new(&other, &t, 64, false).unwrap();
        assert_eq!(drafts(&mut graphed, &states), drafts(&mut fresh, &states));
        assert!(graphed_replays_stayed(&d, &t));
    }

    /// Whether a proposer keeps replaying after a load (it is the point of loading in place).
    fn graphed_replays_stayed(d: &Drafter, t: &Target) -> bool {
        let mut p = DFlashProposer::new(d, t, 64, true).unwrap();
        let states = Tensor::randn([1, 40, d.config().context_width() as i64], (Kind::Float, d.device()));
        drafts(&mut p, &states);
        let graph = p.graph.as_ref().map(|g| g.drafted.data_ptr());
        p.load(d).unwrap();
        drafts(&mut p, &states);
        graph.is_some() && graph == p.graph.as_ref().map(|g| g.drafted.data_ptr())
    }

    /// The blocks `p` drafts over one generation from `states` (each anchor fixed, so any two proposers can be
    /// compared).
    fn drafts(p: &mut DFlashProposer, states: &Tensor) -> Vec<Vec<i64>> {
        p.restart();
        let mut at = 0;
        [5, 1, 4, 2, 3, 1]
            .into_iter()
            .enumerate()
            .map(|(i, n)| {
                let block = p.propose(&states.narrow(1, at, n), 17 + i as i64, 3).unwrap();
                at += n;
                block
            })
            .collect()
    }

    /// A checkpoint loaded into a proposer made with another drafts what a proposer made with it drafts, and the
    /// first drafter drafted otherwise; a drafter of another shape is refused.
    #[test]
    fn a_loaded_checkpoint_drafts_as_a_proposer_made_with_it() {
        let device = tch::Device::Cpu;
        let t = Preset::Tiny.spec().build_target(Depth::Full, device, Kind::Float).unwrap();
        let cfg = DrafterConfig::for_preset(Preset::Tiny, 4);
        let [first, second] =
            [3, 4].map(|seed| Drafter::new(cfg.clone(), device, Kind::Float, Init::Portable(seed)).unwrap());
        tch::manual_seed(2);
        let states = Tensor::randn([1, 40, cfg.context_width() as i64], (Kind::Float, device));
        let mut p = DFlashProposer::new(&first, &t, 64, false).unwrap();
        let before = drafts(&mut p, &states);
        p.load(&second).unwrap();
        let after = drafts(&mut p, &states);
        assert_eq!(after, drafts(&mut DFlashProposer::new(&second, &t, 64, false).unwrap(), &states));
        assert_ne!(before, after, "the two drafters must draft differently for this to show anything");
        let deeper = DrafterConfig::for_target(
            &Preset::Tiny.spec().target,
            3,
            None,
            4,
            cfg.target_layer_ids.clone(),
            cfg.mask_token_id,
        )
        .unwrap();
        let other = Drafter::new(deeper, device, Kind::Float, Init::Portable(3)).unwrap();
        assert!(matches!(p.load(&other), Err(ModelError::Mismatch(_))));
    }
}
