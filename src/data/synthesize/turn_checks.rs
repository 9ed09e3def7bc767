//! Whether a user turn the target wrote is a request worth answering. The target, opened at a user turn, mostly writes
//! one; the rest is what these checks reject, each reason counted in the summary: special tokens inside (the model
//! wrote a template's markup, not a person's text), no end of turn within the length bound (a runaway), nothing or
//! too little, and a reply instead of a request (the model answered as the assistant would: "Sure! Here is...").
use super::near_duplicates::words;

/// What the target generated for one turn.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Generated {
    pub text: String,
    /// Tokens generated, the end-of-turn token included.
    pub tokens: usize,
    /// It ended at an end-of-turn token (not at its token limit).
    pub ended: bool,
    /// It holds a special token before its end.
    pub special: bool,
}

/// The bounds a user turn must keep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TurnBounds {
    /// Fewest tokens, its end of turn included.
    pub min_tokens: usize,
    /// Most tokens: a turn with no end of turn by then is a runaway.
    pub max_tokens: usize,
}

/// Why a user turn is not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TurnRejection {
    SpecialTokens,
    Runaway,
    Empty,
    TooShort,
    NotARequest,
}

impl TurnRejection {
    /// Its name in the summary and the rejected file.
    pub fn reason(self) -> &'static str {
        match self {
            TurnRejection::SpecialTokens => "special tokens in the request",
            TurnRejection::Runaway => "runaway request (no end of turn within the length bound)",
            TurnRejection::Empty => "empty request",
            TurnRejection::TooShort => "too short a request",
            TurnRejection::NotARequest => "a reply, not a request",
        }
    }
}

/// How a reply opens: the model speaking as the assistant, not as a user.
const REPLY_OPENINGS: &[&str] = &[
    "sure",
    "certainly",
    "of course",
    "absolutely",
    "here is",
    "here s",
    "here are",
    "i m sorry",
    "i am sorry",
    "i apologize",
    "as an ai",
    "great question",
    "you re welcome",
    "how can i help",
    "how can i assist",
    "hello how can i",
    "hi how can i",
    "assistant",
];

/// Why `turn` is not a request to keep, if it is not.
pub fn check_user_turn(turn: &Generated, bounds: TurnBounds) -> Result<(), TurnRejection> {
    if turn.special {
        return Err(TurnRejection::SpecialTokens);
    }
    if !turn.ended {
        return Err(TurnRejection::Runaway);
    }
    let words = words(&turn.text);
    if words.is_empty() {
        return Err(TurnRejection::Empty);
    }
    if turn.tokens < bounds.min_tokens {
        return Err(TurnRejection::TooShort);
    }
    let opening = words.iter().take(4).cloned().collect::<Vec<_>>().join(" ");
    let is_opening = |o: &&str| opening == *o || opening.starts_with(&format!("{o} "));
    if REPLY_OPENINGS.iter().any(is_opening) {
        return Err(TurnRejection::NotARequest);
    }
    Ok(())
}

/// The first word of a request, lowercased (what the spread report counts).
pub fn first_word(text: &str) -> String {
    words(text).into_iter().next().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(text: &str, tokens: usize) -> Generated {
        Generated { text: text.into(), tokens, ended: true, special: false }
    }

    #[test]
    fn requests_pass_and_each_kind_of_reject_is_named() {
        let bounds = TurnBounds { min_tokens: 4, max_tokens: 256 };
        assert_eq!(check_user_turn(&turn("Can you suggest a place to eat on a budget?", 12), bounds), Ok(()));
        assert_eq!(check_user_turn(&turn("Surely the moon is made of rock, isn't it?", 12), bounds), Ok(()));
        let cases = [
            (Generated { special: true, ..turn("Hi<|im_start|>assistant", 8) }, TurnRejection::SpecialTokens),
            (Generated { ended: false, ..turn("I am writing a very long", 256) }, TurnRejection::Runaway),
            (turn("  \n ", 3), TurnRejection::Empty),
            (turn("?!", 5), TurnRejection::Empty),
            (turn("Hi", 2), TurnRejection::TooShort),
            (turn("Sure! Here is a list of the best restaurants:", 12), TurnRejection::NotARequest),
            (turn("I'm sorry, I can't help with that.", 10), TurnRejection::NotARequest),
            (turn("Here's a poem about the sea", 9), TurnRejection::NotARequest),
            (turn("Assistant: the answer is 4", 9), TurnRejection::NotARequest),
        ];
        for (generated, want) in cases {
            assert_eq!(check_user_turn(&generated, bounds), Err(want), "{generated:?}");
        }
        assert_eq!(first_word("  What's the best way?"), "what");
    }
}
