//! SentencePiece (`tokenizer.ggml.model = "llama"`) vocabularies, encoded
//! as llama.cpp's `llm_tokenizer_spm_session` does (`src/llama-vocab.cpp`):
//!
//! 1. spaces become `▁` (U+2581), and a `▁` goes in front of a text that
//!    starts the input or follows a special token (`add_space_prefix`, on
//!    unless `tokenizer.ggml.add_space_prefix` says otherwise);
//! 2. the text is cut into its characters, and the adjacent pair whose
//!    joined text is a token with the highest score
//!    (`tokenizer.ggml.scores`; the leftmost pair among equals) is merged,
//!    again and again, until no pair joins into a token;
//! 3. each piece is its token, or, when a single character has none, the
//!    byte tokens (`<0xNN>`) of its UTF-8 bytes.
//!
//! No crate does this from a GGUF's scores (Hugging Face's `tokenizers`
//! wants merges a converter derives from the model file, and its unigram
//! model tokenizes differently), so it is written here: a priority queue
//! over a linked list of pieces, as llama.cpp's.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::{Result, TokenizerError};

/// The SentencePiece side of a tokenizer: what step 2 and 3 need besides
/// the vocabulary's text → id map.
#[derive(Debug)]
pub(crate) struct Spm {
    /// Each token's merge priority (higher merges first).
    scores: Vec<f32>,
    /// The token of each byte: `<0xNN>`, else the byte's own one-character
    /// token, else the unknown token.
    byte_tokens: Box<[Option<u32>; 256]>,
    /// Whether a `▁` goes in front of a text at the start or after a
    /// special token.
    pub(crate) add_space_prefix: bool,
}

/// SentencePiece's meta space: what a space is spelled as in the vocabulary.
pub(crate) const META_SPACE: char = '\u{2581}';

/// One piece of the text being merged: `len` bytes from `start`, linked to
/// its neighbours (`None` at the ends); merged-away pieces have `len` 0.
#[derive(Clone, Copy)]
struct Piece {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of the pieces `left` and `right` (adjacent when it was
/// made; `size` their joined length then, so a stale candidate is known).
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Ord for Candidate {
    /// The higher score first; among equal scores the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl Spm {
    /// The SentencePiece tables of a vocabulary of `tokens` (by id, with
    /// `token_to_id` their reverse) and `scores`, one per token;
    /// `unknown`: the unknown token, for bytes without a token.
    pub(crate) fn new(
        tokens: &[String],
        token_to_id: &HashMap<String, u32>,
        scores: Option<Vec<f32>>,
        unknown: Option<u32>,
        add_space_prefix: bool,
    ) -> Result<Self> {
        let invalid = |msg: String| TokenizerError::InvalidVocab(msg);
        let scores = scores
            .ok_or_else(|| invalid("a SentencePiece vocabulary needs its scores (tokenizer.ggml.scores)".into()))?;
        if scores.len() != tokens.len() {
            return Err(invalid(format!("{} scores for {} tokens", scores.len(), tokens.len())));
        }
        let byte_tokens = Box::new(std::array::from_fn(|b| {
            let own = (b < 0x80).then(|| char::from(b as u8).to_string());
            token_to_id
                .get(&format!("<0x{b:02X}>"))
                .or_else(|| own.and_then(|own| token_to_id.get(&own)))
                .copied()
                .or(unknown)
        }));
        Ok(Self { scores, byte_tokens, add_space_prefix })
    }

    /// Appends the ids of `text` (a text between special tokens) to `out`;
    /// `space_prefix`: it starts the input or follows a special token.
    pub(crate) fn encode(
        &self,
        text: &str,
        space_prefix: bool,
        token_to_id: &HashMap<String, u32>,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let mut spelled = String::with_capacity(text.len() + 3);
        if space_prefix && self.add_space_prefix {
            spelled.push(META_SPACE);
        }
        spelled.extend(text.chars().map(|c| if c == ' ' { META_SPACE } else { c }));
        if spelled.is_empty() {
            return Ok(());
        }
        let count = spelled.chars().count();
        let mut pieces: Vec<Piece> = spelled
            .char_indices()
            .enumerate()
            .map(|(i, (start, c))| Piece {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (i + 1 < count).then_some(i + 1),
            })
            .collect();
        let mut queue = BinaryHeap::new();
        let candidate = |pieces: &[Piece], left: Option<usize>, right: Option<usize>| {
            let (left, right) = (left?, right?);
            let (a, b) = (pieces[left], pieces[right]);
            let joined = &spelled[a.start..a.start + a.len + b.len];
            let id = *token_to_id.get(joined)?;
            Some(Candidate { score: self.scores[id as usize], left, right, size: joined.len() })
        };
        for i in 1..pieces.len() {
            queue.extend(candidate(&pieces, Some(i - 1), Some(i)));
        }
        while let Some(Candidate { left, right, size, .. }) = queue.pop() {
            let (a, b) = (pieces[left], pieces[right]);
            if a.len == 0 || b.len == 0 || a.len + b.len != size {
                continue;
            }
            pieces[left].len += b.len;
            pieces[right].len = 0;
            pieces[left].next = b.next;
            if let Some(next) = b.next {
                pieces[next].prev = Some(left);
            }
            queue.extend(candidate(&pieces, pieces[left].prev, Some(left)));
            queue.extend(candidate(&pieces, Some(left), pieces[left].next));
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let piece = pieces[i];
            let text = &spelled[piece.start..piece.start + piece.len];
            match token_to_id.get(text) {
                Some(&id) => out.push(id),
                None => {
                    for byte in text.bytes() {
                        let id = self.byte_tokens[usize::from(byte)].ok_or_else(|| {
                            TokenizerError::InvalidVocab(format!(
                                "byte {byte:#04x} of {text:?} has no token (no <0x{byte:02X}> and no unknown token)"
                            ))
                        })?;
                        out.push(id);
                    }
                }
            }
            at = piece.next;
        }
        Ok(())
    }
}
