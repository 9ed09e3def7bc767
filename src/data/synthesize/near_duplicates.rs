//! Exact and near duplicates among the requests a synthesis keeps: a request is a duplicate of an earlier attempt's
//! when their normalised texts are equal, and a near duplicate when the Jaccard similarity of their word-bigram sets
//! is at least the threshold, estimated by MinHash (64 hashes) and found through LSH (16 bands of 4: a pair at
//! similarity 0.7 becomes a candidate with probability 0.99, one at 0.3 with 0.12; candidates are then checked on
//! their signatures).
//!
//! Each entry carries its attempt, and a query sees only earlier attempts: decisions are made in attempt order, so
//! after a resume (when later attempts' requests are already indexed) attempt `i` is judged against exactly what it
//! was judged against in an uninterrupted run. The hashes are fixed functions (FNV-1a and splitmix64), the same on
//! every machine and build. No crate fits: those on crates.io draw their hash seeds at random or are unmaintained.
use std::collections::HashMap;

use crate::model::sampling::splitmix64;

const HASHES: usize = 64;
const BANDS: usize = 16;
const ROWS: usize = HASHES / BANDS;

/// The words of `text`, lowercased, split at everything that is not a letter or digit.
pub fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).map(str::to_lowercase).collect()
}

/// 64-bit FNV-1a of `bytes`.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// A text's MinHash signature over its word bigrams (a single word: the word itself).
fn signature(words: &[String]) -> [u32; HASHES] {
    let shingles: Vec<u64> = match words.len() {
        0 => Vec::new(),
        1 => vec![fnv1a(words[0].as_bytes())],
        _ => words.windows(2).map(|w| fnv1a(format!("{} {}", w[0], w[1]).as_bytes())).collect(),
    };
    let mut sig = [u32::MAX; HASHES];
    for s in shingles {
        for (k, slot) in sig.iter_mut().enumerate() {
            let h = splitmix64(s ^ splitmix64(k as u64)) as u32;
            *slot = (*slot).min(h);
        }
    }
    sig
}

/// Why a request is not kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Duplicate {
    /// The same words as this earlier attempt's.
    Exact(u64),
    /// This earlier attempt's at about this similarity.
    Near(u64, f64),
}

/// The requests kept so far (see the module documentation).
pub struct DuplicateIndex {
    threshold: f64,
    exact: HashMap<u64, u64>,
    signatures: Vec<(u64, [u32; HASHES])>,
    bands: HashMap<u64, Vec<u32>>,
}

impl DuplicateIndex {
    /// Near duplicates at Jaccard similarity `threshold` and above (above 1: exact duplicates only).
    pub fn new(threshold: f64) -> Self {
        DuplicateIndex { threshold, exact: HashMap::new(), signatures: Vec::new(), bands: HashMap::new() }
    }

    pub fn len(&self) -> usize {
        self.signatures.len()
    }

    pub fn is_empty(&self) -> bool {
        self.signatures.is_empty()
    }

    /// Whether `text` duplicates an attempt before `attempt` in the index: the earliest such attempt.
    pub fn check(&self, attempt: u64, text: &str) -> Option<Duplicate> {
        let words = words(text);
        let exact = self.exact.get(&fnv1a(words.join(" ").as_bytes())).filter(|&&a| a < attempt);
        if let Some(&a) = exact {
            return Some(Duplicate::Exact(a));
        }
        if self.threshold > 1.0 {
            return None;
        }
        let sig = signature(&words);
        let mut best: Option<(u64, f64)> = None;
        for key in band_keys(&sig) {
            for &entry in self.bands.get(&key).into_iter().flatten() {
                let (other, other_sig) = &self.signatures[entry as usize];
                if *other >= attempt || best.is_some_and(|(b, _)| b <= *other) {
                    continue;
                }
                let same = sig.iter().zip(other_sig).filter(|(a, b)| a == b).count();
                let similarity = same as f64 / HASHES as f64;
                if similarity >= self.threshold {
                    best = Some((*other, similarity));
                }
            }
        }
        best.map(|(a, s)| Duplicate::Near(a, s))
    }

    /// Adds `attempt`'s `text`.
    pub fn insert(&mut self, attempt: u64, text: &str) {
        let words = words(text);
        let first = self.exact.entry(fnv1a(words.join(" ").as_bytes())).or_insert(attempt);
        *first = (*first).min(attempt);
        let sig = signature(&words);
        let entry = self.signatures.len() as u32;
        for key in band_keys(&sig) {
            self.bands.entry(key).or_default().push(entry);
        }
        self.signatures.push((attempt, sig));
    }
}

/// The LSH key of each band of `sig`.
fn band_keys(sig: &[u32; HASHES]) -> impl Iterator<Item = u64> + '_ {
    (0..BANDS).map(move |b| {
        let rows = &sig[b * ROWS..(b + 1) * ROWS];
        rows.iter().fold(splitmix64(b as u64), |h, &v| splitmix64(h ^ u64::from(v)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The true Jaccard similarity of two texts' bigram sets.
    fn jaccard(a: &str, b: &str) -> f64 {
        let set = |t: &str| -> std::collections::HashSet<String> { words(t).windows(2).map(|w| w.join(" ")).collect() };
        let (a, b) = (set(a), set(b));
        a.intersection(&b).count() as f64 / a.union(&b).count() as f64
    }

    #[test]
    fn exact_duplicates_ignore_case_and_punctuation_and_see_only_earlier_attempts() {
        let mut index = DuplicateIndex::new(0.8);
        index.insert(3, "How do I bake bread?");
        assert_eq!(index.check(7, "how do I  bake BREAD"), Some(Duplicate::Exact(3)));
        assert_eq!(index.check(2, "How do I bake bread?"), None, "attempt 3 comes after 2");
        assert_eq!(index.check(9, "How do I bake a cake?"), None);
        index.insert(1, "how do i bake bread");
        assert_eq!(index.check(7, "How do I bake bread?"), Some(Duplicate::Exact(1)), "the earliest");
    }

    /// Pairs at a true similarity of 0.9 and above are found; pairs at 0.5 and below are not (the signature's
    /// estimate is within about 0.1 of the truth at 64 hashes).
    #[test]
    fn near_duplicates_are_found_by_similarity() {
        let base: Vec<String> = (0..40).map(|i| format!("w{i}")).collect();
        let text = |changed: usize| -> String {
            base.iter()
                .enumerate()
                .map(|(i, w)| if i < changed { format!("x{i}") } else { w.clone() })
                .collect::<Vec<_>>()
                .join(" ")
        };
        let mut index = DuplicateIndex::new(0.8);
        index.insert(0, &text(0));
        let close = text(1);
        assert!(jaccard(&text(0), &close) >= 0.9);
        assert!(matches!(index.check(1, &close), Some(Duplicate::Near(0, s)) if s >= 0.8));
        let far = text(20);
        assert!(jaccard(&text(0), &far) <= 0.5);
        assert_eq!(index.check(1, &far), None);
        let unrelated = "Write a haiku about the autumn moon over the sea";
        assert_eq!(index.check(1, unrelated), None);
        assert_eq!(index.len(), 1);
        // Above 1: exact duplicates only.
        let mut exact_only = DuplicateIndex::new(1.01);
        exact_only.insert(0, &text(0));
        assert_eq!(exact_only.check(1, &close), None);
    }
}
