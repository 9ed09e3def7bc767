//! One conversation as the trainer sees it: the rendered conversation's token ids and its loss mask.
use super::chat::{ChatError, ChatTemplate, Conversation};
use super::tokenize::{TextTokenizer, loss_mask};

/// Token ids and the loss mask (1 on tokens the assistant produced) of one conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub id: u64,
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
    let rendered = template.render_supervised(conv)?;
    let encoded = tokenizer
        .encode(&rendered.text)
        .map_err(ChatError::Template)?;
    Ok(Sample {
        id: conv.id,
        loss_mask: loss_mask(&encoded.offsets, &rendered.supervised),
        input_ids: encoded.ids,
    })
}
