//! Streaming decoding: text out as soon as whole UTF-8 characters are in.

use crate::{Result, Tokenizer};

/// Turns generated ids into text as they come. A token's bytes may end in
/// the middle of a UTF-8 character (byte-level BPE splits an emoji or a CJK
/// character over several tokens); those bytes wait for the next token, so
/// [`push`](Self::push) never returns half a character. Bytes that can never
/// form a character become U+FFFD.
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    pending: Vec<u8>,
    skip_special: bool,
}

impl<'t> StreamDecoder<'t> {
    pub(crate) fn new(tokenizer: &'t Tokenizer) -> Self {
        Self { tokenizer, pending: Vec::new(), skip_special: false }
    }

    /// Leaves control and unknown tokens (EOS, `<|im_start|>`) out of the
    /// text instead of showing their text.
    pub fn skip_special(mut self, skip: bool) -> Self {
        self.skip_special = skip;
        self
    }

    /// Adds token `id`; returns the text that is now complete (possibly
    /// empty). An id past the vocabulary is an error and changes nothing.
    pub fn push(&mut self, id: u32) -> Result<String> {
        let piece = self.tokenizer.piece(id, self.skip_special)?;
        self.pending.extend_from_slice(piece);
        Ok(self.take_complete())
    }

    /// The bytes still waiting (an unfinished character), as text with
    /// U+FFFD for them; the decoder is empty afterwards.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }

    /// Whether bytes of an unfinished character are waiting.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Everything in `pending` up to an unfinished character at its end.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..valid]).expect("valid_up_to bytes are UTF-8"),
                    );
                    match e.error_len() {
                        // Invalid bytes that no continuation can repair.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + n;
                        }
                        // An unfinished character at the end: keep it.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
