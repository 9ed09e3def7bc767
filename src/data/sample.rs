//! One conversation as the trainer sees it: the rendered conversation's token ids and its loss mask.
use std::time::{Duration, Instant};

use super::SampleId;
use super::chat::{ChatError, ChatTemplate, Conversation};
use super::tokenize::{TextTokenizer, loss_mask};

/// Token ids and the loss mask (1 on tokens the assistant produced) of one conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub id: SampleId,
    pub input_ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
}

impl Sample {
    pub fn supervised(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m != 0).count()
    }
}

/// Renders `conv` with the template, tokenizes the rendering, and masks the assistant spans.
pub fn build_sample(
    template: &ChatTemplate,
    tokenizer: &TextTokenizer,
    conv: &Conversation,
) -> Result<Sample, ChatError> {
    build_sample_timed(template, tokenizer, conv).map(|(s, _)| s)
}

/// [`build_sample`], also returning the time spent rendering (spans included) and tokenizing.
pub fn build_sample_timed(
    template: &ChatTemplate,
    tokenizer: &TextTokenizer,
    conv: &Conversation,
) -> Result<(Sample, [Duration; 2]), ChatError> {
    let t0 = Instant::now();
    let rendered = template.render_supervised(conv)?;
    let t1 = Instant::now();
    let encoded = tokenizer.encode(&rendered.text).map_err(ChatError::Template)?;
    let sample = Sample {
        id: conv.id.clone(),
        loss_mask: loss_mask(&encoded.offsets, &rendered.supervised),
        input_ids: encoded.ids,
    };
    Ok((sample, [t1 - t0, t1.elapsed()]))
}
