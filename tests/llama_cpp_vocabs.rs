//! kvjit's tokenizer against llama.cpp's own test vectors: the
//! vocabulary-only GGUF files of llama.cpp's `models/` (`ggml-vocab-NAME.gguf`)
//! and, for each, the strings of its `.inp` with the token ids llama.cpp's
//! `test-tokenizer-0` expects in its `.out` (no BOS, control tokens not
//! parsed: `llama_tokenize(text, add_special = false, parse_special =
//! false)`). The strings cover whitespace runs, digits, punctuation,
//! contractions, accents, CJK, emoji and code.
//!
//! `scripts/get-llama-cpp-vocabs.sh` fetches the files into
//! `models/llama-cpp-vocabs` (or `KVJIT_LLAMA_CPP_VOCABS`); without them each
//! test skips in one line. CI fetches them.

use std::path::PathBuf;

use kvjit::gguf::Gguf;
use kvjit::models::gguf::vocabulary_tokenizer;
use kvjit::tokenizer::EncodeOptions;

/// Where the script puts the files.
fn vocab_dir() -> PathBuf {
    std::env::var_os("KVJIT_LLAMA_CPP_VOCABS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/llama-cpp-vocabs"))
}

/// The `.inp` strings (joined by `\n__ggml_vocab_test__\n`, the file ending
/// in one) with the `.out` ids (a line each, space-separated), as
/// `test-tokenizer-0` reads them.
fn cases(inp: &str, out: &str) -> Vec<(String, Vec<u32>)> {
    const SEPARATOR: &str = "\n__ggml_vocab_test__\n";
    let mut texts: Vec<&str> = inp.split(SEPARATOR).collect();
    if texts.last() == Some(&"") {
        texts.pop();
    }
    let ids: Vec<Vec<u32>> =
        out.lines().map(|line| line.split_whitespace().map(|id| id.parse().expect("a token id")).collect()).collect();
    assert_eq!(texts.len(), ids.len(), "the .inp and .out files hold as many cases");
    texts.into_iter().map(str::to_string).zip(ids).collect()
}

/// Every case of `ggml-vocab-{name}.gguf` tokenized as llama.cpp does.
fn matches_llama_cpp(name: &str) {
    let dir = vocab_dir();
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    if !path.exists() {
        eprintln!("skipped: {} is absent (scripts/get-llama-cpp-vocabs.sh fetches it)", path.display());
        return;
    }
    let read = |ext: &str| std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.{ext}"))).unwrap();
    let cases = cases(&read("inp"), &read("out"));
    let gguf = Gguf::open(&path).unwrap();
    let tokenizer = vocabulary_tokenizer(&gguf).unwrap();
    let plain = EncodeOptions { add_special: false, parse_special: false };
    let differ: Vec<String> = cases
        .iter()
        .filter_map(|(text, want)| {
            let got = tokenizer.encode_with(text, plain).unwrap();
            (&got != want).then(|| format!("{text:?}: kvjit {got:?}, llama.cpp {want:?}"))
        })
        .collect();
    assert!(differ.is_empty(), "{name}: {} of {} cases differ:\n{}", differ.len(), cases.len(), differ.join("\n"));
    assert!(cases.len() >= 30, "{name}: only {} cases", cases.len());
}

#[test]
fn gpt2_matches_llama_cpp() {
    matches_llama_cpp("gpt-2");
}

#[test]
fn llama3_bpe_matches_llama_cpp() {
    matches_llama_cpp("llama-bpe");
}

#[test]
fn qwen2_matches_llama_cpp() {
    matches_llama_cpp("qwen2");
}

#[test]
fn llama2_sentencepiece_matches_llama_cpp() {
    matches_llama_cpp("llama-spm");
}

#[test]
fn phi3_sentencepiece_matches_llama_cpp() {
    matches_llama_cpp("phi-3");
}

#[test]
fn mpt_matches_llama_cpp() {
    matches_llama_cpp("mpt");
}

#[test]
fn starcoder_matches_llama_cpp() {
    matches_llama_cpp("starcoder");
}

#[test]
fn refact_matches_llama_cpp() {
    matches_llama_cpp("refact");
}

#[test]
fn command_r_matches_llama_cpp() {
    matches_llama_cpp("command-r");
}
