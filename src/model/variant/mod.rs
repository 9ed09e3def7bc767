//! The members of the DFlash family dflash trains, registered in one place. Every variant shares the backbone (the
//! Qwen3 layers over the target's context features), the objective, checkpoints and exports; a variant adds parts
//! around them (DFlash 2: convolutions around the sublayers, a selector that walks the block). The backbone asks a
//! variant for its parts ([`Variant::sublayer_convs`], [`Variant::selector`]), never which variant it is; a variant's
//! own code and sizes live in its folder (`dflash2/`), and this file is the only one that names each variant.
//! docs/development.md, "Adding a drafter variant", lists what a new one touches.
use serde_json::{Value, json};

pub mod dflash2;

use dflash2::Dflash2Shape;
use dflash2::candidate_selector::SelectorShape;
use dflash2::dynamic_conv::ConvShape;

/// The DFlash-family drafters dflash trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Variant {
    /// The paper's drafter.
    #[default]
    DFlash,
    /// z-lab's DFlash 2: a two-tap dynamic convolution around both sublayers of every layer, and a top-K candidate
    /// selector that walks the drafted block token by token.
    DFlash2(Dflash2Shape),
}

/// A variant as the files name it.
pub struct Registration {
    /// `draft_model.variant`, and speculators' `speculators_model_type` and algorithm.
    pub name: &'static str,
    /// The published `architectures` entry (z-lab's layout).
    pub architecture: &'static str,
    /// The keys of its sizes, under `[draft_model]`, in `dflash_config` and at the top level of speculators' layout.
    pub keys: &'static [&'static str],
    /// The variant with its sizes in `keys` order.
    build: fn(&[usize]) -> Variant,
}

/// Every variant, the paper's first.
pub const REGISTERED: [Registration; 2] = [
    Registration { name: "dflash", architecture: "DFlashDraftModel", keys: &[], build: |_| Variant::DFlash },
    Registration {
        name: "dflash2",
        architecture: "DFlash2DraftModel",
        keys: &dflash2::KEYS,
        build: |sizes| Variant::DFlash2(Dflash2Shape::from_values(sizes)),
    },
];

impl Registration {
    /// The variant, its sizes read by `size` (a key of [`Registration::keys`] in, the size out, or the caller's
    /// error naming where it looked).
    pub fn build<E>(&self, mut size: impl FnMut(&'static str) -> Result<usize, E>) -> Result<Variant, E> {
        let sizes = self.keys.iter().map(|key| size(key)).collect::<Result<Vec<_>, E>>()?;
        Ok((self.build)(&sizes))
    }
}

impl Variant {
    /// The variant named `name` (`draft_model.variant`, speculators' model type).
    pub fn named(name: &str) -> Option<&'static Registration> {
        REGISTERED.iter().find(|r| r.name == name)
    }

    /// The variant whose published architecture is `architecture`.
    pub fn of_architecture(architecture: &str) -> Option<&'static Registration> {
        REGISTERED.iter().find(|r| r.architecture == architecture)
    }

    /// The registered names, quoted, for an error: `"dflash" or "dflash2"`.
    pub fn names() -> String {
        either(REGISTERED.iter().map(|r| format!("\"{}\"", r.name)))
    }

    /// The registered architectures, as `[..]` lists, for an error.
    pub fn architectures() -> String {
        either(REGISTERED.iter().map(|r| format!("[\"{}\"]", r.architecture)))
    }

    fn registration(self) -> &'static Registration {
        match self {
            Variant::DFlash => &REGISTERED[0],
            Variant::DFlash2(_) => &REGISTERED[1],
        }
    }

    pub fn name(self) -> &'static str {
        self.registration().name
    }

    /// The published `architectures` entry.
    pub fn architecture(self) -> &'static str {
        self.registration().architecture
    }

    /// Its sizes as `(key, size)`, in the order of its registration's keys.
    pub fn sizes(self) -> Vec<(&'static str, usize)> {
        let values = match self {
            Variant::DFlash => Vec::new(),
            Variant::DFlash2(shape) => shape.values().to_vec(),
        };
        self.registration().keys.iter().copied().zip(values).collect()
    }

    /// Whether its sizes fit a drafter of `hidden` channels, a vocabulary of `vocab` and blocks of `block_size`.
    pub fn validate(self, hidden: usize, vocab: usize, block_size: usize) -> Result<(), String> {
        match self {
            Variant::DFlash => Ok(()),
            Variant::DFlash2(shape) => shape.validate(hidden, vocab, block_size),
        }
    }

    /// What a published config of this variant may carry that dflash does not train, refused; `field` reads a key
    /// of its `dflash_config` (or the top level).
    pub fn refuse_untrained(self, field: &dyn Fn(&str) -> Option<Value>) -> Result<(), String> {
        match self {
            Variant::DFlash => Ok(()),
            Variant::DFlash2(_) => dflash2::refuse_untrained(field),
        }
    }

    /// Its keys written into a published `dflash_config` (z-lab's layout) of a drafter with blocks of `block_size`.
    pub fn write_dflash_config(self, dflash_config: &mut Value, block_size: usize) {
        if let Variant::DFlash2(_) = self {
            // The released DFlash 2 drafters carry the block size here too.
            dflash_config["block_size"] = json!(block_size);
        }
        for (key, size) in self.sizes() {
            dflash_config[key] = json!(size);
        }
    }

    /// As a config sets it: `variant = "dflash2", conv_kernel_size = 2, ...`.
    pub fn describe(self) -> String {
        let mut parts = vec![format!("variant = \"{}\"", self.name())];
        parts.extend(self.sizes().into_iter().map(|(key, size)| format!("{key} = {size}")));
        parts.join(", ")
    }

    /// The dynamic convolutions around each layer's attention and MLP, if the variant has them.
    pub fn sublayer_convs(self) -> Option<ConvShape> {
        match self {
            Variant::DFlash => None,
            Variant::DFlash2(shape) => Some(shape.convs()),
        }
    }

    /// The candidate selector that walks a drafted block (and trains with its own loss), if the variant has one.
    pub fn selector(self) -> Option<SelectorShape> {
        match self {
            Variant::DFlash => None,
            Variant::DFlash2(shape) => Some(shape.selector()),
        }
    }
}

/// `a, b or c`.
fn either(items: impl Iterator<Item = String>) -> String {
    let items: Vec<String> = items.collect();
    match items.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => items.join(""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each registration builds the variant that names it back, and the lists an error shows read as before.
    #[test]
    fn every_registration_round_trips() {
        for r in &REGISTERED {
            let variant = r.build(|_| Ok::<usize, ()>(3)).unwrap();
            assert_eq!((variant.name(), variant.architecture()), (r.name, r.architecture));
            assert_eq!(variant.sizes().iter().map(|(k, _)| *k).collect::<Vec<_>>(), r.keys);
            assert_eq!(Variant::named(r.name).map(|n| n.architecture), Some(r.architecture));
            assert_eq!(Variant::of_architecture(r.architecture).map(|n| n.name), Some(r.name));
        }
        assert_eq!(Variant::names(), "\"dflash\" or \"dflash2\"");
        assert_eq!(Variant::architectures(), "[\"DFlashDraftModel\"] or [\"DFlash2DraftModel\"]");
        let shape = Dflash2Shape { conv_group_size: 8, ..Default::default() };
        assert_eq!(
            Variant::DFlash2(shape).describe(),
            "variant = \"dflash2\", conv_kernel_size = 2, conv_group_size = 8, selector_rank = 256, selector_top_k = 16"
        );
        assert_eq!(Variant::DFlash.describe(), "variant = \"dflash\"");
    }
}
