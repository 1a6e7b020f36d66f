//! The pre-tokenizers that `tokenizer.ggml.pre` names: the regexes that cut
//! text into words before BPE merges run inside each word.
//!
//! Each is a list of regexes applied in turn, as llama.cpp's
//! `unicode_regex_split` does: every regex splits every piece so far into its
//! matches and the text between them, all kept (Hugging Face's `Split` with
//! the `Isolated` behaviour). The regexes are llama.cpp's
//! (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`), which are the Hugging Face
//! `tokenizer.json` ones with `(?i:…)` spelled out.

/// GPT-2's word regex (also the regex of Hugging Face's `ByteLevel`
/// pre-tokenizer, which adds a final `|\s+` that changes nothing here: text a
/// regex leaves unmatched is kept as a piece anyway).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's word regex: digits in runs of at most three, letters with one
/// leading non-letter, newlines grouped.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's word regex: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How one `tokenizer.ggml.pre` value pre-tokenizes, and the vocabulary
/// flags llama.cpp ties to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreTokenizerSpec {
    /// The regexes, applied in turn.
    pub regexes: &'static [&'static str],
    /// A word that is itself a token is that token, merges or not (Llama 3).
    pub ignore_merges: bool,
    /// Whether BOS is added when the GGUF does not say
    /// (`tokenizer.ggml.add_bos_token` absent).
    pub add_bos_default: bool,
}

/// The names accepted, for the error that refuses another.
pub(crate) const KNOWN: &str = "smollm, llama-bpe (llama3, llama-v3, falcon3, pixtral), gpt-2 (gpt2, phi-2, mpt, olmo), \
     qwen2 (deepseek-r1-qwen, stablelm2), starcoder, refact, command-r, codeshell, default";

/// The pre-tokenizer `name` names (`None`: the key is absent, which llama.cpp
/// reads as `default`), or `None` for a name not supported here.
pub(crate) fn lookup(name: Option<&str>) -> Option<PreTokenizerSpec> {
    let plain = |regexes| PreTokenizerSpec { regexes, ignore_merges: false, add_bos_default: false };
    Some(match name.unwrap_or("default") {
        // Digits one by one, then GPT-2's regex (Hugging Face: `Digits`
        // with individual_digits, then `ByteLevel`).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" => plain(&[r"\p{N}", GPT2]),
        "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "pixtral" => {
            PreTokenizerSpec { regexes: &[LLAMA3], ignore_merges: true, add_bos_default: true }
        }
        "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" => plain(&[GPT2]),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" => plain(&[QWEN2]),
        "default" => plain(&[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]),
        _ => return None,
    })
}
