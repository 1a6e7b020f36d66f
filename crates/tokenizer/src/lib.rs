//! kvjit's tokenizer: the vocabulary a GGUF file carries in its `tokenizer.*`
//! metadata (byte-level BPE, `gpt2`, or SentencePiece, `llama`), turned into
//! a tokenizer that gives the same token ids as llama.cpp, plus the model's
//! chat template.
//!
//! The input is plain data ([`VocabSpec`]), so this crate does not depend on
//! the GGUF reader: whoever reads the file fills the spec from its keys
//! (`tokenizer.ggml.model`, `.pre`, `.tokens`, `.merges`, `.token_type`,
//! `.bos_token_id`, `.eos_token_id`, `.add_bos_token`, `.scores` and
//! `tokenizer.chat_template`).
//!
//! # How text becomes ids
//!
//! Encoding follows llama.cpp's `llama_vocab::tokenize` for a BPE vocabulary
//! (`src/llama-vocab.cpp`):
//!
//! 1. **Special tokens.** Control (token type 3) and user-defined (4) tokens
//!    are cut out of the text as whole tokens, longest first, before anything
//!    else; so `<|im_start|>` is one id, never split by BPE. Control tokens
//!    are only matched when special parsing is on ([`EncodeOptions`]);
//!    user-defined ones always are.
//! 2. **Pre-tokenizer.** The text between them is cut into words by the
//!    regexes `tokenizer.ggml.pre` names (`smollm`: digits one by one, then
//!    GPT-2's regex; `llama-bpe`: Llama 3's regex, digits in runs of up to
//!    three; `gpt2`: GPT-2's regex). An unknown name is refused in one line.
//! 3. **Byte-level BPE.** Each word's UTF-8 bytes are spelled in GPT-2's byte
//!    alphabet and merged by the ranked merges.
//!
//! A SentencePiece vocabulary (`llama`) takes step 1 as above and then
//! llama.cpp's score-driven merges instead of 2 and 3 (see `spm.rs`).
//!
//! Steps 2 and 3 run on Hugging Face's [`tokenizers`] crate (a `BPE` model
//! from the GGUF vocabulary and merges, `Split` pre-tokenizers with the
//! Isolated behaviour, `ByteLevel` without its own regex), built with
//! `default-features = false` and its pure-Rust `fancy-regex` engine, so the
//! build needs nothing but Rust and crates (no oniguruma, no C++). Step 1 is
//! done here because its rules (control tokens only when asked, longest
//! first) are llama.cpp's, not Hugging Face's added-vocabulary ones.
//!
//! # Decoding
//!
//! Each token stands for bytes: a normal token for its text read back through
//! the byte alphabet (SentencePiece: its text with `▁` read as a space), a
//! special token for its text, a byte token `<0xNN>` for that byte. [`Tokenizer::decode`] joins them; [`StreamDecoder`] hands out
//! text as soon as the bytes so far form whole UTF-8 characters, so a
//! character split over two tokens (an emoji is often two or three) is never
//! shown in halves.
//!
//! Checked against llama.cpp's own test vectors (`tests/llama_cpp_vocabs.rs`
//! in the `kvjit` crate: GPT-2, Llama 3, Qwen 2, MPT, StarCoder, Refact,
//! Command-R, and Llama 2's and Phi-3's SentencePiece vocabularies). Not done: llama.cpp's `clean_spaces` post-processing of decoded text (which removes
//! the space before `?`, `!`, `.`, `,` for `gpt2`/`llama-bpe`, not `smollm`)
//! is not applied; per-token `lstrip`/`rstrip` attributes (not in GGUF) are
//! ignored.

mod bytes;
mod chat;
mod pretok;
mod spm;
mod stream;

use std::collections::{HashMap, HashSet};

use tokenizers::SplitDelimiterBehavior;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};

pub use chat::ChatMessage;
pub use stream::StreamDecoder;

/// A vocabulary as a GGUF file's `tokenizer.*` metadata holds it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VocabSpec {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"`
    /// (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer (`smollm`, `llama-bpe`,
    /// `gpt2`, …). Absent means llama.cpp's `default`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: the token texts, by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.merges`: `"a b"`, highest priority first.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control,
    /// 4 user-defined, 5 unused, 6 byte (absent: all normal).
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.add_bos_token` (absent: the pre-tokenizer's default,
    /// true for `llama-bpe` and SentencePiece only, as in llama.cpp).
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece; absent: true).
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template`: a Jinja template.
    pub chat_template: Option<String>,
    /// `tokenizer.ggml.scores`: SentencePiece's merge priorities, one per
    /// token (needed there; unused by BPE).
    pub scores: Option<Vec<f32>>,
}

/// What a token is, from `tokenizer.ggml.token_type` (llama.cpp's
/// `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenKind {
    /// 0, or any value not below.
    Undefined,
    /// 1: an ordinary BPE token.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: a control token (`<|im_start|>`, EOS, …): matched whole in text
    /// only when special parsing is on.
    Control,
    /// 4: a user-defined token: always matched whole in text.
    UserDefined,
    /// 5: reserved and never produced.
    Unused,
    /// 6: a byte token `<0xNN>`.
    Byte,
}

impl TokenKind {
    /// The kind a GGUF `token_type` value stands for.
    pub fn from_gguf(value: i32) -> Self {
        match value {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }

    /// Control and unknown tokens: the ones special parsing and
    /// special-skipping decoding are about.
    pub fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown)
    }
}

/// Why a tokenizer could not be built or used. Each displays as one line.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.ggml.model` names a kind of vocabulary not supported.
    #[error("tokenizer model '{0}' is not supported (byte-level BPE, 'gpt2', and SentencePiece, 'llama', are)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer not supported.
    #[error("unknown pre-tokenizer '{name}' (tokenizer.ggml.pre); supported: {known}")]
    UnknownPreTokenizer {
        /// The name read.
        name: String,
        /// The names supported.
        known: &'static str,
    },
    /// The vocabulary is inconsistent (a duplicate token, a bad merge, a
    /// special token id past the end, …).
    #[error("invalid tokenizer vocabulary: {0}")]
    InvalidVocab(String),
    /// A token id past the end of the vocabulary was given to decode.
    #[error("token id {id} is out of range (vocabulary of {n_tokens} tokens)")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        n_tokens: usize,
    },
    /// The model has no `tokenizer.chat_template`.
    #[error("the model has no chat template (tokenizer.chat_template)")]
    NoChatTemplate,
    /// The chat template failed to parse or render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// The BPE engine failed.
    #[error("tokenizer: {0}")]
    Backend(String),
}

/// Results of this crate.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// How [`Tokenizer::encode_with`] treats special tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EncodeOptions {
    /// Add BOS in front when the vocabulary asks for it
    /// ([`Tokenizer::adds_bos`]); llama.cpp's `add_special`.
    pub add_special: bool,
    /// Match control tokens written in the text (`<|im_start|>`) as whole
    /// tokens; when off they are tokenized as plain text. llama.cpp's
    /// `parse_special`.
    pub parse_special: bool,
}

/// How the text between special tokens becomes ids.
enum Engine {
    /// Byte-level BPE on Hugging Face's pipeline.
    Bpe(Box<tokenizers::Tokenizer>),
    /// SentencePiece's score-driven merges.
    Spm(spm::Spm),
}

/// A tokenizer built from a GGUF vocabulary (byte-level BPE or
/// SentencePiece).
pub struct Tokenizer {
    model: String,
    pre: Option<String>,
    tokens: Vec<String>,
    kinds: Vec<TokenKind>,
    /// The bytes each token decodes to (special tokens: their text).
    pieces: Vec<Vec<u8>>,
    token_to_id: HashMap<String, u32>,
    /// Control, user-defined and unknown tokens, longest text first.
    specials: Vec<u32>,
    engine: Engine,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    eog: Vec<u32>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.model)
            .field("pre", &self.pre)
            .field("n_tokens", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

/// Texts llama.cpp treats as end of generation wherever they are in a
/// vocabulary (besides EOS), as control tokens: its list in
/// `llama_vocab::impl::load` (llama.cpp of llama-cpp-python 0.3.36). A
/// token among them is a control token whatever the file says, so it is
/// not matched in text without special parsing (Phi-3 marks `</s>`
/// user-defined; Qwen 2's vocabulary holds it as a normal token).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "[e~[",
];

impl Tokenizer {
    /// Builds the tokenizer a GGUF's metadata describes. Every failure is one
    /// line: an unsupported model or pre-tokenizer, a duplicate token, a
    /// merge without a space or naming tokens not in the vocabulary, a
    /// BOS/EOS id past the end, a malformed byte token, fewer token types
    /// than tokens.
    ///
    /// A byte-level vocabulary need not have all 256 byte tokens (SmolLM2's
    /// lacks 21 bytes that UTF-8 text rarely or never holds, such as 0x04
    /// and 0xC0): a byte without a token is dropped when encoding, as
    /// llama.cpp and Hugging Face do.
    pub fn from_spec(spec: VocabSpec) -> Result<Self> {
        // SentencePiece has no pre-tokenizer (llama.cpp ignores the key).
        let sentencepiece = match spec.model.as_str() {
            "gpt2" => false,
            "llama" => true,
            other => return Err(TokenizerError::UnsupportedModel(other.into())),
        };
        let pre = match sentencepiece {
            true => None,
            false => Some(pretok::lookup(spec.pre.as_deref()).ok_or_else(|| TokenizerError::UnknownPreTokenizer {
                name: spec.pre.clone().unwrap_or_default(),
                known: pretok::KNOWN,
            })?),
        };
        let invalid = |msg: String| TokenizerError::InvalidVocab(msg);
        let n_tokens = spec.tokens.len();
        if n_tokens == 0 {
            return Err(invalid("no tokens (tokenizer.ggml.tokens)".into()));
        }
        if u32::try_from(n_tokens).is_err() {
            return Err(invalid(format!("{n_tokens} tokens is more than u32 ids")));
        }

        // Token texts (an empty one is renamed as llama.cpp does) and ids.
        let tokens: Vec<String> = spec
            .tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| if t.is_empty() { format!("[EMPTY_{i}]") } else { t })
            .collect();
        let mut token_to_id = HashMap::with_capacity(n_tokens);
        for (i, t) in tokens.iter().enumerate() {
            if let Some(prev) = token_to_id.insert(t.clone(), i as u32) {
                return Err(invalid(format!("duplicate token {t:?} (ids {prev} and {i})")));
            }
        }

        // Kinds; the end-of-generation tokens llama.cpp finds by text are
        // control tokens whatever the file says.
        let mut kinds = match &spec.token_types {
            None => vec![TokenKind::Normal; n_tokens],
            Some(types) if types.len() < n_tokens => {
                return Err(invalid(format!("{} token types for {n_tokens} tokens", types.len())));
            }
            Some(types) => types[..n_tokens].iter().map(|&t| TokenKind::from_gguf(t)).collect(),
        };
        let check_id = |what: &str, id: Option<u32>| -> Result<Option<u32>> {
            match id {
                Some(id) if id as usize >= n_tokens => {
                    Err(invalid(format!("{what} token id {id} is past the vocabulary of {n_tokens}")))
                }
                id => Ok(id),
            }
        };
        let bos = check_id("BOS", spec.bos)?;
        let eos = check_id("EOS", spec.eos)?;
        let add_bos = spec.add_bos.unwrap_or(pre.as_ref().is_none_or(|pre| pre.add_bos_default));
        if add_bos && bos.is_none() {
            return Err(invalid("BOS is to be added but there is no BOS token id".into()));
        }
        let mut eog: Vec<u32> = eos.into_iter().collect();
        for text in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*text) {
                if !eog.contains(&id) {
                    eog.push(id);
                }
                kinds[id as usize] = TokenKind::Control;
            }
        }
        eog.sort_unstable();

        // What each token decodes to.
        let mut pieces = Vec::with_capacity(n_tokens);
        for (text, kind) in tokens.iter().zip(&kinds) {
            pieces.push(match kind {
                TokenKind::Normal if sentencepiece => text.replace(spm::META_SPACE, " ").into_bytes(),
                TokenKind::Normal => bytes::decode_byte_level(text),
                TokenKind::Control | TokenKind::Unknown | TokenKind::UserDefined => text.as_bytes().to_vec(),
                TokenKind::Byte => vec![
                    parse_byte_token(text)
                        .ok_or_else(|| invalid(format!("byte token {text:?} is not of the form <0xNN>")))?,
                ],
                TokenKind::Unused | TokenKind::Undefined => Vec::new(),
            });
        }

        let mut specials: Vec<u32> = (0..n_tokens as u32)
            .filter(|&id| {
                matches!(kinds[id as usize], TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown)
            })
            .collect();
        specials.sort_by_key(|&id| std::cmp::Reverse(tokens[id as usize].len()));

        let engine = match &pre {
            Some(pre) => Engine::Bpe(Box::new(build_bpe(&tokens, &spec.merges, pre)?)),
            None => {
                let unknown = kinds.iter().position(|&k| k == TokenKind::Unknown).map(|id| id as u32);
                let add_space_prefix = spec.add_space_prefix.unwrap_or(true);
                Engine::Spm(spm::Spm::new(&tokens, &token_to_id, spec.scores, unknown, add_space_prefix)?)
            }
        };

        Ok(Self {
            model: spec.model,
            pre: spec.pre,
            tokens,
            kinds,
            pieces,
            token_to_id,
            specials,
            engine,
            bos,
            eos,
            add_bos,
            eog,
            chat_template: spec.chat_template,
        })
    }

    /// Token ids of `text`. `add_special` both adds BOS when the vocabulary
    /// asks for it and matches control tokens written in the text
    /// (`<|im_start|>`) as whole tokens: what a prompt built by
    /// [`apply_chat_template`](Self::apply_chat_template) needs. For the two
    /// separately, see [`encode_with`](Self::encode_with).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, EncodeOptions { add_special, parse_special: add_special })
    }

    /// Token ids of `text`, as llama.cpp's
    /// `llama_tokenize(text, add_special, parse_special)`.
    pub fn encode_with(&self, text: &str, options: EncodeOptions) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if options.add_special && self.add_bos {
            out.extend(self.bos);
        }
        // SentencePiece spells a space in front of a text that starts the
        // input or follows a special token (llama.cpp's `is_prev_special`).
        let mut after_special = true;
        for fragment in self.partition(text, options.parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    match &self.engine {
                        Engine::Bpe(bpe) => {
                            let encoding = bpe.encode(t, false).map_err(|e| TokenizerError::Backend(e.to_string()))?;
                            // Bytes without a token are placeholders past
                            // the vocabulary ([`build_bpe`]): dropped.
                            let n_tokens = self.tokens.len() as u32;
                            out.extend(encoding.get_ids().iter().filter(|&&id| id < n_tokens));
                        }
                        Engine::Spm(spm) => spm.encode(t, after_special, &self.token_to_id, &mut out)?,
                    }
                    after_special = false;
                }
            }
        }
        Ok(out)
    }

    /// Cuts `text` at the special tokens it contains, longest token first
    /// (llama.cpp's `tokenizer_st_partition`).
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut fragments = vec![Fragment::Text(text)];
        if text.is_empty() {
            return Vec::new();
        }
        for &id in &self.specials {
            if !parse_special && self.kinds[id as usize].is_special() {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            if !fragments.iter().any(|f| matches!(f, Fragment::Text(t) if t.contains(needle))) {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(at) = rest.find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + needle.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// The text of `ids`, special tokens included as their text (so
    /// `decode(encode(t, true)) == t` when BOS is not added). Bytes that do
    /// not form UTF-8 (possible for arbitrary ids) become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, false)
    }

    /// The text of `ids`; with `skip_special`, control and unknown tokens
    /// (BOS, EOS, `<|im_start|>`) are left out, as llama.cpp's
    /// `token_to_piece(…, special = false)`.
    ///
    /// A SentencePiece vocabulary that spells a space in front of the text
    /// drops it again from the first token, as llama.cpp's `detokenize`
    /// (which keeps it after a BOS it skips).
    pub fn decode_with(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let mut bytes = Vec::new();
        let mut strip_space = matches!(&self.engine, Engine::Spm(spm) if spm.add_space_prefix);
        let mut ids = ids;
        if skip_special && self.add_bos && ids.first().is_some_and(|&id| Some(id) == self.bos) {
            strip_space = false;
            ids = &ids[1..];
        }
        for &id in ids {
            let piece = self.piece(id, skip_special)?;
            let skip = if strip_space { piece.iter().take_while(|&&b| b == b' ').count() } else { 0 };
            bytes.extend_from_slice(&piece[skip..]);
            strip_space = false;
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The bytes token `id` stands for.
    fn piece(&self, id: u32, skip_special: bool) -> Result<&[u8]> {
        let i = id as usize;
        if i >= self.tokens.len() {
            return Err(TokenizerError::TokenOutOfRange { id, n_tokens: self.tokens.len() });
        }
        if skip_special && self.kinds[i].is_special() {
            return Ok(&[]);
        }
        Ok(&self.pieces[i])
    }

    /// The bytes token `id` decodes to (special tokens: their text); `None`
    /// past the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(Vec::as_slice)
    }

    /// A streaming decoder: feed it generated ids one at a time and it hands
    /// out text as soon as whole UTF-8 characters are there. Special tokens
    /// are shown as their text (see [`StreamDecoder::skip_special`]).
    pub fn decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    /// The BOS token id, if the vocabulary has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The EOS token id, if the vocabulary has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether [`encode`](Self::encode) with `add_special` puts BOS first.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether generation stops at `id`: EOS, or a token llama.cpp treats as
    /// end of generation by its text (`<|im_end|>`, `<|endoftext|>`,
    /// `<|eot_id|>`, …).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The number of tokens (the model's vocabulary size).
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The vocabulary text of token `id`.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The kind of token `id`.
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// The id of the token whose vocabulary text is `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// `tokenizer.ggml.model`.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// `tokenizer.ggml.pre`.
    pub fn pre(&self) -> Option<&str> {
        self.pre.as_deref()
    }

    /// `tokenizer.chat_template`.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders the chat template for `messages`, with `bos_token` and
    /// `eos_token` set to those tokens' texts and `add_generation_prompt`
    /// (the assistant's header at the end). Encode the result with
    /// [`encode`](Self::encode)`(…, true)` so its control tokens stay whole.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or(TokenizerError::NoChatTemplate)?;
        let text_of = |id: Option<u32>| id.and_then(|i| self.token_text(i)).unwrap_or("");
        chat::render(template, messages, add_generation_prompt, text_of(self.bos), text_of(self.eos))
    }
}

/// A piece of the text being encoded: a special token, or text between.
enum Fragment<'t> {
    Token(u32),
    Text(&'t str),
}

/// The byte of a `<0xNN>` token: exactly two hex digits, nothing else.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The Hugging Face pipeline for text between special tokens: the
/// pre-tokenizer's regexes as Isolated splits, the byte alphabet, BPE.
///
/// A byte the vocabulary has no token for stays in its word as a
/// placeholder token past the vocabulary's ids (no merge names it, so its
/// neighbours do not merge across it) and is dropped from the output
/// ([`Tokenizer::encode_with`]): llama.cpp's behaviour. Dropping it before
/// the merges joined its neighbours (`" \u{4}<"` gave `Ġ<` where llama.cpp
/// gives `Ġ`, `<`).
fn build_bpe(tokens: &[String], merges: &[String], pre: &pretok::PreTokenizerSpec) -> Result<tokenizers::Tokenizer> {
    let invalid = |msg: String| TokenizerError::InvalidVocab(msg);
    let mut vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let n_tokens = tokens.len() as u32;
    for (b, c) in bytes::byte_to_char().iter().enumerate() {
        vocab.entry(c.to_string()).or_insert(n_tokens + b as u32);
    }
    // "a b", split at the first space after the first byte (llama.cpp); a
    // pair given twice keeps its first (highest) rank.
    let mut seen = HashSet::with_capacity(merges.len());
    let mut pairs: Merges = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        let first = m.chars().next().map_or(0, char::len_utf8);
        let at = m[first..]
            .find(' ')
            .map(|p| p + first)
            .ok_or_else(|| invalid(format!("merge {i} {m:?} is not two tokens")))?;
        let (a, b) = (&m[..at], &m[at + 1..]);
        if a.is_empty() || b.is_empty() {
            return Err(invalid(format!("merge {i} {m:?} is not two tokens")));
        }
        if seen.insert((a, b)) {
            pairs.push((a.to_owned(), b.to_owned()));
        }
    }
    let model = BPE::builder()
        .vocab_and_merges(vocab, pairs)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| invalid(format!("merges: {e}")))?;
    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
    for re in pre.regexes {
        let split = Split::new(SplitPattern::Regex((*re).to_owned()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| TokenizerError::Backend(format!("pre-tokenizer regex {re:?}: {e}")))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(Sequence::new(steps)));
    Ok(tokenizer)
}
