//! z-lab's DFlash 2 (issue 49): DFlash's backbone with a two-tap dynamic convolution around both sublayers of every
//! layer ([`dynamic_conv`]) and a top-K candidate selector that walks the drafted block token by token
//! ([`candidate_selector`]). This file holds its four sizes: their keys in the published files, their defaults and
//! what each must satisfy.
use serde_json::Value;

pub mod candidate_selector;
pub mod dynamic_conv;

use candidate_selector::SelectorShape;
use dynamic_conv::ConvShape;

/// DFlash 2's sizes, as z-lab's `dflash_config` (and speculators' `DFlash2SpeculatorConfig`) name them; the defaults
/// are speculators 0.9.0's and the released drafters'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dflash2Shape {
    /// Taps of each dynamic convolution (the token and the `K - 1` before it in its block).
    pub conv_kernel_size: usize,
    /// Channels sharing one dynamic coefficient.
    pub conv_group_size: usize,
    /// Rank of the selector's codebooks.
    pub selector_rank: usize,
    /// Unary candidates the selector rescores per slot.
    pub selector_top_k: usize,
}

impl Default for Dflash2Shape {
    fn default() -> Self {
        Dflash2Shape { conv_kernel_size: 2, conv_group_size: 16, selector_rank: 256, selector_top_k: 16 }
    }
}

/// DFlash 2's keys in `dflash_config` (z-lab's layout, which vLLM and SGLang read), at the top level of speculators'
/// layout and under `[draft_model]`.
pub const KEYS: [&str; 4] = ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"];

impl Dflash2Shape {
    /// The four sizes in [`KEYS`] order.
    pub fn values(&self) -> [usize; 4] {
        [self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k]
    }

    /// The sizes in [`KEYS`] order.
    pub fn from_values(v: &[usize]) -> Self {
        Dflash2Shape { conv_kernel_size: v[0], conv_group_size: v[1], selector_rank: v[2], selector_top_k: v[3] }
    }

    /// The convolutions' part of the shape.
    pub fn convs(&self) -> ConvShape {
        ConvShape { taps: self.conv_kernel_size, group: self.conv_group_size }
    }

    /// The selector's part of the shape.
    pub fn selector(&self) -> SelectorShape {
        SelectorShape { rank: self.selector_rank, top_k: self.selector_top_k }
    }

    /// Whether the sizes fit a drafter of `hidden` channels, a vocabulary of `vocab` and blocks of `block_size`.
    pub fn validate(&self, hidden: usize, vocab: usize, block_size: usize) -> Result<(), String> {
        let [k, g, r, top] = self.values();
        if k < 1 || k > block_size {
            return Err(format!("`conv_kernel_size` ({k}) must be between 1 and the block size ({block_size})"));
        }
        if g < 1 || !hidden.is_multiple_of(g) {
            return Err(format!("`conv_group_size` ({g}) must divide the hidden size ({hidden})"));
        }
        if r < 1 {
            return Err("`selector_rank` must be at least 1".into());
        }
        if top < 1 || top > vocab {
            return Err(format!("`selector_top_k` ({top}) must be between 1 and the vocabulary ({vocab})"));
        }
        Ok(())
    }
}

/// What a published DFlash 2 `dflash_config` may carry that dflash does not train: vLLM's optional scales, refused
/// unless neutral. `field` reads a key of the config.
pub fn refuse_untrained(field: &dyn Fn(&str) -> Option<Value>) -> Result<(), String> {
    for (key, neutral) in [("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", 0.0)]
    {
        if let Some(x) = field(key).filter(|x| !x.is_null())
            && x.as_f64() != Some(neutral)
        {
            return Err(format!(
                "`dflash_config.{key}` is {x}: dflash trains and drafts DFlash 2 without it (only {neutral})"
            ));
        }
    }
    Ok(())
}
