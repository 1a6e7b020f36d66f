//! Token ids of many strings, for comparing kvjit's tokenizer with another
//! (`scripts/tokenizer-diff.sh` compares it with llama.cpp's).
//!
//! ```sh
//! cargo run --release --example tokenize_jsonl -- MODEL.gguf STRINGS.jsonl   # or - for stdin, a line at a time
//! ```
//!
//! Each input line is a JSON string; each output line is
//! `{"plain": [ids], "special": [ids]}`: the ids without BOS, control tokens
//! left as text (`plain`) or parsed whole (`special`), or an error string.

use std::io::{BufRead, Write};

use kvjit::tokenizer::EncodeOptions;
use serde_json::{Value, json};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, strings] = args.as_slice() else {
        return Err("usage: tokenize_jsonl MODEL.gguf STRINGS.jsonl|-".into());
    };
    let gguf = kvjit::gguf::Gguf::open(std::path::Path::new(model))?;
    let tokenizer = kvjit::models::gguf::vocabulary_tokenizer(&gguf)?;
    let interactive = strings == "-";
    let input: Box<dyn std::io::Read> =
        if interactive { Box::new(std::io::stdin()) } else { Box::new(std::fs::File::open(strings)?) };
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for line in std::io::BufReader::new(input).lines() {
        let line = line?;
        if line.is_empty() {
            continue;
        }
        let text: String = serde_json::from_str(&line)?;
        let ids = |parse_special: bool| -> Value {
            match tokenizer.encode_with(&text, EncodeOptions { add_special: false, parse_special }) {
                Ok(ids) => json!(ids),
                Err(e) => json!(format!("ERROR: {e}")),
            }
        };
        writeln!(out, "{}", json!({"plain": ids(false), "special": ids(true)}))?;
        if interactive {
            out.flush()?;
        }
    }
    Ok(())
}
