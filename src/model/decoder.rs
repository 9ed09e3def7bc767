//! The target's batch-1 decoding steps for the generation loops (speculative and greedy decoding, `generate`): one
//! cache reused across generations, and on a GPU the steps of the token counts asked for replayed from CUDA graphs
//! ([`CudaGraph`], captured at first use), one launch where the step's kernels take some 600. The prefill (its
//! length varies) runs eagerly, and so does every step where a graph does not apply (a token count not asked for,
//! such as a generation's last shorter blocks; a target with experts or sinks, or spread over devices; a capture
//! that failed).
use tch::{Kind, Tensor};

use super::{Decoded, KvCache, ModelError, Target};
use crate::ffi::graph::CudaGraph;

/// See the module documentation.
pub struct Decoder<'a> {
    target: &'a Target,
    cache: KvCache,
    graphs: Option<Graphs>,
    /// A bug planted on the target's side (tests of the lossless verdict only).
    #[cfg(test)]
    pub(crate) planted: Option<PlantedBug>,
}

/// Bugs on the target's side of speculative decoding that the lossless verdict must catch, planted by tests (in bf16
/// on a GPU too, where exact logit ties are common): a verdict that forgave them would forgive real ones.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum PlantedBug {
    /// Each verify block (several tokens after cached ones) decoded one position late: its positions (RoPE and
    /// cache slots) start one past the cached sequence.
    VerifyShifted,
    /// After a partial accept the cache is cropped one token too long: it keeps the first rejected token.
    CropOneLong,
}

/// The token counts to replay, the steps captured so far, and the device scalar their positions start at.
struct Graphs {
    counts: Vec<i64>,
    start: Tensor,
    steps: Vec<Captured>,
}

struct Captured {
    tokens: i64,
    graph: CudaGraph,
    /// The step's input, written before each replay.
    ids: Tensor,
    /// Where each replay writes.
    out: Decoded,
}

impl<'a> Decoder<'a> {
    /// Generations of up to `capacity` positions; steps of the token counts in `graphed` (1 for greedy decoding, the
    /// block size for verifying) replay from CUDA graphs where graphs apply, captured at their first use.
    pub fn new(target: &'a Target, capacity: i64, graphed: &[i64]) -> Result<Self, ModelError> {
        let cache = target.new_cache(capacity)?;
        let applies = !graphed.is_empty() && CudaGraph::available(target.device()) && target.graphable();
        let graphs = match applies {
            true => Some(Graphs {
                counts: graphed.to_vec(),
                start: Tensor::f_zeros([], (Kind::Int64, target.device()))?,
                steps: vec![],
            }),
            false => None,
        };
        Ok(Decoder {
            target,
            cache,
            graphs,
            #[cfg(test)]
            planted: None,
        })
    }

    pub fn target(&self) -> &'a Target {
        self.target
    }

    /// Whether steps are replayed from CUDA graphs.
    pub fn graphed(&self) -> bool {
        self.graphs.is_some()
    }

    /// Positions a generation may hold.
    pub fn capacity(&self) -> i64 {
        self.cache.capacity()
    }

    /// Positions held.
    pub fn len(&self) -> i64 {
        self.cache.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Keeps the first `len` positions (0: a new generation).
    pub fn crop(&mut self, len: i64) {
        #[cfg(test)]
        let len = match self.planted {
            Some(PlantedBug::CropOneLong) if len > 0 && len < self.cache.len() => len + 1,
            _ => len,
        };
        self.cache.crop(len);
    }

    /// Continues the sequence with `input_ids [1, T]`, as [`Target::decode`] does; the prefill (into an empty cache)
    /// returns the logits of its last position only ([`Target::decode_last`]). A step replayed from a graph returns
    /// the graph's outputs: valid until the next step.
    pub fn decode(&mut self, input_ids: &Tensor) -> Result<Decoded, ModelError> {
        let t = input_ids.size().get(1).copied().unwrap_or(0);
        let prefill = self.cache.is_empty();
        #[cfg(test)]
        if self.planted == Some(PlantedBug::VerifyShifted) && t > 1 && !prefill {
            self.cache.reserve(t + 1)?;
            self.cache.advance(1);
        }
        if prefill {
            return self.target.decode_last(input_ids, &mut self.cache);
        }
        let Some(graphs) = self.graphs.as_mut() else {
            return self.target.decode(input_ids, &mut self.cache);
        };
        self.cache.reserve(t)?;
        if (self.cache.len() + t) as usize > self.target.config().positions() {
            return self.target.decode(input_ids, &mut self.cache);
        }
        match graphs.step(self.target, &mut self.cache, input_ids) {
            Ok(Some(out)) => Ok(out),
            Ok(None) => self.target.decode(input_ids, &mut self.cache),
            Err(e) => {
                tracing::warn!("decoding without CUDA graphs from here: {e}");
                self.graphs = None;
                self.target.decode(input_ids, &mut self.cache)
            }
        }
    }
}

impl Graphs {
    /// Runs the step from its graph (captured at its first use); `None` when no graph takes it.
    fn step(&mut self, target: &Target, cache: &mut KvCache, ids: &Tensor) -> Result<Option<Decoded>, ModelError> {
        let t = ids.size()[1];
        if !self.counts.contains(&t) {
            return Ok(None);
        }
        let _ = self.start.f_fill_(cache.len())?;
        let index = match self.steps.iter().position(|c| c.tokens == t) {
            Some(i) => i,
            None => {
                let input = ids.f_detach_copy()?;
                let start = self.start.shallow_clone();
                let (graph, out) = CudaGraph::capture(target.device(), 2, || target.decode_at(&input, &start, cache))
                    .map_err(|e| ModelError::Torch(format!("capturing a {t}-token step: {e}")))?;
                self.steps.push(Captured { tokens: t, graph, ids: input, out });
                self.steps.len() - 1
            }
        };
        let step = &self.steps[index];
        step.ids.shallow_clone().f_copy_(ids)?;
        step.graph.replay().map_err(|e| ModelError::Torch(e.to_string()))?;
        cache.advance(t);
        Ok(Some(Decoded { logits: step.out.logits.shallow_clone(), taps: step.out.taps.shallow_clone() }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Depth, Preset};
    use tch::Device;

    /// The device-position step a graph captures computes what the eager step computes, at every position of a
    /// generation (verify blocks cropped back, as speculative decoding does), and leaves the same cache behind.
    #[test]
    fn the_step_a_graph_captures_is_the_eager_step() {
        let t = Preset::Tiny.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
        assert!(t.graphable());
        let prompt = Tensor::from_slice(&[257i64, 117, 10, 44, 9]).view([1, 5]);
        let (mut eager, mut indexed) = (t.new_cache(40).unwrap(), t.new_cache(40).unwrap());
        t.decode(&prompt, &mut eager).unwrap();
        t.decode(&prompt, &mut indexed).unwrap();
        let start = Tensor::zeros([], (Kind::Int64, Device::Cpu));
        for (i, (block, keep)) in [(4, 2), (1, 1), (4, 4), (3, 1), (1, 1)].into_iter().enumerate() {
            let ids =
                Tensor::from_slice(&(0..block).map(|j| 20 + 3 * i as i64 + j).collect::<Vec<_>>()).view([1, block]);
            let at = eager.len();
            let a = t.decode(&ids, &mut eager).unwrap();
            let _ = start.shallow_clone().fill_(indexed.len());
            let b = t.decode_at(&ids, &start, &mut indexed).unwrap();
            indexed.advance(block);
            let diff = |x: &Tensor, y: &Tensor| (x - y).abs().max().double_value(&[]);
            assert!(diff(&a.logits, &b.logits) < 1e-4, "step {i}: logits differ by {}", diff(&a.logits, &b.logits));
            assert!(diff(&a.taps, &b.taps) < 1e-4, "step {i}: taps");
            eager.crop(at + keep);
            indexed.crop(at + keep);
        }
        assert_eq!(eager.len(), indexed.len());
    }

    /// Without a GPU the decoder is the eager step over a reused cache.
    #[test]
    fn on_a_cpu_the_decoder_steps_eagerly_and_reuses_its_cache() {
        let t = Preset::Tiny.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
        let mut d = Decoder::new(&t, 16, &[1, 3]).unwrap();
        assert!(!d.graphed());
        let prompt = Tensor::from_slice(&[257i64, 117, 10]).view([1, 3]);
        let first = d.decode(&prompt).unwrap().logits;
        d.decode(&prompt.narrow(1, 0, 1)).unwrap();
        assert_eq!(d.len(), 4);
        d.crop(0);
        assert!(d.is_empty());
        let again = d.decode(&prompt).unwrap().logits;
        assert!(first.equal(&again), "a new generation in the same cache starts from nothing");
    }

    /// On a GPU: replayed steps compute what eager steps compute (blocks of two token counts, cropped back as
    /// speculative decoding does), one graph per token count.
    #[test]
    #[ignore = "needs a GPU"]
    fn replayed_steps_decode_what_eager_steps_decode() {
        let device = crate::ffi::graph::graph_gpu_for_tests();
        let t = Preset::Tiny.spec().build_target(Depth::Full, device, Kind::Float).unwrap();
        let mut graphed = Decoder::new(&t, 64, &[1, 4]).unwrap();
        let mut eager = Decoder::new(&t, 64, &[]).unwrap();
        assert!(graphed.graphed() && !eager.graphed());
        let prompt = Tensor::from_slice(&[257i64, 117, 10, 44, 9]).view([1, 5]).to_device(device);
        graphed.decode(&prompt).unwrap();
        eager.decode(&prompt).unwrap();
        for i in 0..7i64 {
            let block = [4, 1, 4, 2, 1, 4, 1][i as usize];
            let ids = Tensor::from_slice(&(0..block).map(|j| 30 + i * 5 + j).collect::<Vec<_>>())
                .view([1, block])
                .to_device(device);
            let at = eager.len();
            let a = eager.decode(&ids).unwrap();
            let b = graphed.decode(&ids).unwrap();
            for (x, y, what) in [(&a.logits, &b.logits, "logits"), (&a.taps, &b.taps, "taps")] {
                let diff = (x - y).abs().max().double_value(&[]);
                assert!(diff < 1e-3, "step {i}: {what} differ by {diff}");
            }
            eager.crop(at + 1);
            graphed.crop(at + 1);
        }
        let counts = graphed.graphs.as_ref().map(|g| g.steps.iter().map(|c| c.tokens).collect::<Vec<_>>());
        assert_eq!(counts, Some(vec![4, 1]), "one graph per token count asked for (2 runs eagerly)");
    }
}
