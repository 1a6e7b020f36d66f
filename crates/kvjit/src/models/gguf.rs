//! A Llama-family model from its GGUF file: the [`LlamaConfig`] its
//! hyper-parameters describe, the whole model graph
//! ([`model_graph`](super::llama::model_graph)) with its constants named as
//! the file names its tensors, and the tokenizer its metadata holds.
//!
//! The graph refers to the file for every weight (`weights` names the
//! GGUF; no weight is copied). Matrices stored in a weight block format
//! kvjit decodes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K)
//! stay in it: the graph declares them in that format, they are borrowed
//! from the mapping, and the matmuls, the fused QKV projection and the
//! embedding gather decode them as they read ([`ImportOptions::dequantize`]
//! dequantizes them into the model's dtype instead). The parts of a fused
//! QKV weight that differ in format are held in a format that holds each
//! exactly (Q4_0, Q5_0 and IQ4_NL beside Q8_0: Q8_0; parts in other mixes of Q8_0, Q4_0,
//! Q4_1, Q5_0, Q5_1 and IQ4_NL, such as Q5_K_M's Q5_1 Q and K beside a
//! Q8_0 V, are held as kvjit's q8_min blocks of exactly their values,
//! 1.125 bytes a weight, and parts in mixes of Q4_K, Q5_K and Q6_K, such
//! as Q4_K_M's Q4_K Q and K beside a Q6_K V on rows of a multiple of 256,
//! as its q8_kmin super-blocks, 1.203 bytes a weight). Q2_K, Q3_K and
//! IQ4_XS matrices, which have no kernels of their own, are held as
//! q8_kmin too (exactly: each is `S·i − M` per 16 with one rounding); f16
//! and bf16 matrices (and Q2_K, Q3_K or IQ4_XS ones with a scale that is
//! not finite) are converted into the model's dtype as the model loads. The fused QKV weight is the file's `attn_q`,
//! `attn_k` and `attn_v` stacked (in their format when all three share
//! one). llama.cpp's converter
//! permutes Q and K rows for pairwise RoPE, so the model rotates
//! interleaved pairs.

use std::path::{Path, PathBuf};

use kvjit_core::{DType, WeightLoad};
use kvjit_gguf::Gguf;
use kvjit_graph::{Graph, OpRegistry, graph_from_json_with_gguf};
use kvjit_tokenizer::{Tokenizer, VocabSpec};

use super::llama::{LayerConfig, LlamaConfig, model_graph_file};
use crate::{Error, Result};

/// How an imported model is held: its dtype, and the paged cache it is
/// compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImportOptions {
    /// Activation dtype (and the weights', except those kept in their block
    /// format).
    pub dtype: DType,
    /// Dequantize weights stored in a block format into `dtype` (instead of
    /// keeping their blocks).
    pub dequantize: bool,
    /// Tokens a sequence may hold (prompt plus generated).
    pub context: usize,
    /// Sequences the cache holds at that context.
    pub max_batch: usize,
    /// Tokens per cache page.
    pub page_size: usize,
    /// The KV cache's dtype (`None`: `dtype`).
    pub cache_dtype: Option<DType>,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self { dtype: DType::F32, dequantize: false, context: 2048, max_batch: 4, page_size: 16, cache_dtype: None }
    }
}

/// The model `gguf` describes, as kvjit builds it. Architectures other than
/// `llama` are refused naming theirs; a missing hyper-parameter is refused
/// naming its key.
pub fn llama_config(gguf: &Gguf, options: &ImportOptions) -> Result<LlamaConfig> {
    let arch = gguf.architecture()?;
    if arch != "llama" {
        return Err(Error::Usage(format!(
            "{}: architecture '{}' is not supported (kvjit imports 'llama' models)",
            gguf.path().display(),
            arch.escape_debug()
        )));
    }
    let key = |suffix: &str| gguf.arch_key(suffix);
    let hidden = gguf.get_u32(&key("embedding_length")?)? as usize;
    let heads = gguf.get_u32(&key("attention.head_count")?)? as usize;
    let kv_heads = gguf.get_u32_opt(&key("attention.head_count_kv")?)?.map_or(heads, |h| h as usize);
    let head_size = match gguf.get_u32_opt(&key("attention.key_length")?)? {
        Some(d) => d as usize,
        None if heads > 0 => hidden / heads,
        None => 0,
    };
    let vocab = match gguf.get_u32_opt(&key("vocab_size")?)? {
        Some(v) => v as usize,
        None => gguf.tensor_info("token_embd.weight").and_then(|t| t.shape().first().copied()).unwrap_or(0),
    };
    check_buildable(gguf, [hidden, heads, kv_heads, head_size, vocab], options)?;
    let num_layers = layer_count(gguf)?;
    let refuse = |problem: String| Error::Usage(format!("{}: {problem}", gguf.path().display()));
    if let Some(rotated) = gguf.get_u32_opt(&key("rope.dimension_count")?)?
        && rotated as usize != head_size
    {
        // llama.cpp refuses the same: a Llama model rotates whole heads.
        return Err(refuse(format!(
            "{} is {rotated}, but a llama model rotates whole heads of {head_size}",
            key("rope.dimension_count")?
        )));
    }
    let rope_theta = f64::from(gguf.get_f32_opt(&key("rope.freq_base")?)?.unwrap_or(10000.0));
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(refuse(format!("{} is {rope_theta}; RoPE needs a positive base", key("rope.freq_base")?)));
    }
    let pages_per_seq = options.context / options.page_size;
    let num_pages = pages_per_seq.checked_mul(options.max_batch).ok_or_else(|| {
        Error::Usage(format!(
            "{}: --max-batch {} of --context {} is more cache pages than can be counted",
            gguf.path().display(),
            options.max_batch,
            options.context
        ))
    })?;
    let name = gguf.get_str_opt("general.name")?.unwrap_or("model");
    let name: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    Ok(LlamaConfig {
        layer: LayerConfig {
            name,
            dtype: options.dtype,
            cache_dtype: options.cache_dtype,
            hidden_size: hidden,
            num_q_heads: heads,
            num_kv_heads: kv_heads,
            head_size,
            page_size: options.page_size,
            num_layers,
            num_pages,
            max_pages_per_seq: pages_per_seq,
            weight_seed: 0,
        },
        ffn_size: gguf.get_u32(&key("feed_forward_length")?)? as usize,
        rope_theta,
        llama3_scaling: None,
        rope_freq_factors: rope_freq_factors(gguf, head_size)?,
        rope_interleaved: true,
        rms_norm_eps: f64::from(gguf.get_f32(&key("attention.layer_norm_rms_epsilon")?)?),
        vocab_size: vocab,
        tie_word_embeddings: gguf.tensor_info("output.weight").is_none(),
    })
}

/// The model's `block_count`, checked against the file's tensors before
/// anything is built per layer: a count of 0, or one past the layers the
/// file holds (a crafted count of 2³² − 1 would otherwise build billions
/// of layers before the first missing weight is noticed), is refused
/// naming the first missing layer.
fn layer_count(gguf: &Gguf) -> Result<usize> {
    let key = gguf.arch_key("block_count")?;
    let count = gguf.get_u32(&key)? as usize;
    if count == 0 {
        return Err(Error::Usage(format!("{}: {key} is 0", gguf.path().display())));
    }
    if let Some(missing) = (0..count).find(|i| gguf.tensor_info(&format!("blk.{i}.attn_norm.weight")).is_none()) {
        return Err(Error::Usage(format!(
            "{}: {key} is {count}, but the file has no layer {missing} (tensor 'blk.{missing}.attn_norm.weight' not \
             found)",
            gguf.path().display()
        )));
    }
    Ok(count)
}

/// Refuse, one cause a line, a model kvjit cannot build: a hyper-parameter
/// of 0 (`sizes`: hidden, heads, KV heads, head size, vocabulary), heads
/// not a multiple of the KV heads, a cache that is not whole pages, or
/// dtypes the model's ops do not compute or cache in.
fn check_buildable(gguf: &Gguf, sizes: [usize; 5], options: &ImportOptions) -> Result<()> {
    let refuse = |problem: String| Err(Error::Usage(format!("{}: {problem}", gguf.path().display())));
    let names = ["hidden size", "attention heads", "KV heads", "head size", "vocabulary"];
    if let Some((name, _)) = names.iter().zip(sizes).find(|(_, size)| *size == 0) {
        return refuse(format!("the model's {name} is 0"));
    }
    let [_, heads, kv_heads, ..] = sizes;
    if !heads.is_multiple_of(kv_heads) {
        return refuse(format!("{heads} attention heads are not a multiple of {kv_heads} KV heads"));
    }
    let page = options.page_size;
    if page == 0 {
        return refuse("cache pages of 0 tokens".into());
    }
    if options.context == 0 || !options.context.is_multiple_of(page) {
        let whole = options.context / page * page;
        let choices = if whole == 0 { format!("{page}") } else { format!("{whole} or {}", whole + page) };
        return refuse(format!(
            "--context {} is not a whole number of {page}-token cache pages (take {choices})",
            options.context
        ));
    }
    if options.max_batch == 0 {
        return refuse("--max-batch must be at least 1".into());
    }
    if !matches!(options.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return refuse(format!("--dtype {}: the model computes in f32, bf16 or f16", options.dtype));
    }
    if let Some(cache) =
        options.cache_dtype.filter(|d| !matches!(d, DType::F32 | DType::BF16 | DType::F16 | DType::F8E4M3))
    {
        return refuse(format!("--kv-cache-dtype {cache}: the KV cache holds f32, bf16, f16 or f8e4m3"));
    }
    Ok(())
}

/// Whether `path` is a GGUF file: named `.gguf`, or a regular file
/// starting with GGUF's magic (a file saved under another name). Only a
/// regular file is opened (opening a FIFO would block).
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read as _;
    let mut magic = [0u8; 4];
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        || kvjit_core::open_regular_file(path)
            .is_ok_and(|(mut f, _)| f.read_exact(&mut magic).is_ok() && magic == kvjit_gguf::MAGIC)
}

/// The divisors of the RoPE frequencies `gguf` asks for, if any: its
/// `rope_freqs.weight` (`head_size / 2` values; llama.cpp's converter
/// writes Llama-3.1 scaling so), times the factor of `rope.scaling.type`
/// `linear`. Other scaling types (YaRN, LongRoPE) are refused naming theirs.
fn rope_freq_factors(gguf: &Gguf, head_size: usize) -> Result<Option<Vec<f64>>> {
    let refuse = |problem: String| Error::Usage(format!("{}: {problem}", gguf.path().display()));
    let mut factors: Option<Vec<f64>> = None;
    if let Some(info) = gguf.tensor_info("rope_freqs.weight") {
        if info.shape() != [head_size / 2] {
            return Err(refuse(format!(
                "rope_freqs.weight has shape {:?}; head size {head_size} takes [{}]",
                info.shape(),
                head_size / 2
            )));
        }
        let values = gguf.tensor("rope_freqs.weight", DType::F32)?.to_f32_vec()?;
        if let Some(bad) = values.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
            return Err(refuse(format!("rope_freqs.weight holds {bad}; RoPE frequency factors must be positive")));
        }
        factors = Some(values.into_iter().map(f64::from).collect());
    }
    let scaling = gguf.get_str_opt(&gguf.arch_key("rope.scaling.type")?)?;
    match scaling {
        None | Some("none") => {}
        Some("linear") => {
            let key = gguf.arch_key("rope.scaling.factor")?;
            let factor = f64::from(gguf.get_f32(&key)?);
            if !(factor.is_finite() && factor > 0.0) {
                return Err(refuse(format!("{key} is {factor}; linear RoPE scaling needs a positive factor")));
            }
            let each = factors.get_or_insert_with(|| vec![1.0; head_size / 2]);
            each.iter_mut().for_each(|f| *f *= factor);
        }
        Some(other) => {
            return Err(refuse(format!(
                "RoPE scaling '{other}' is not supported (kvjit reads 'linear' and rope_freqs)"
            )));
        }
    }
    Ok(factors)
}

/// The GGUF tensor name of a model-graph constant: `embed_tokens` →
/// `token_embd.weight`, `layers.3.o_proj` → `blk.3.attn_output.weight`, the
/// fused QKV weight → `blk.N.attn_qkv.weight` (stacked from its parts when
/// loaded), … `None` for constants the file does not hold (the RoPE
/// table, a recipe).
fn gguf_name(name: &str, num_layers: usize) -> Option<String> {
    let model = match name {
        "embed_tokens" => Some("token_embd.weight"),
        "final_norm" => Some("output_norm.weight"),
        "lm_head" => Some("output.weight"),
        _ => None,
    };
    if let Some(model) = model {
        return Some(model.into());
    }
    let (layer, weight) = match name.strip_prefix("layers.").and_then(|rest| rest.split_once('.')) {
        Some((layer, weight)) => (layer.parse::<usize>().ok()?, weight),
        None if num_layers == 1 => (0, name),
        None => return None,
    };
    let tensor = match weight {
        "attn_norm" => "attn_norm",
        "qkv_weight" => "attn_qkv",
        "o_proj" => "attn_output",
        "ffn_norm" => "ffn_norm",
        "gate_proj" => "ffn_gate",
        "up_proj" => "ffn_up",
        "down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{tensor}.weight"))
}

/// The block format a matrix constant keeps: the format of the GGUF
/// tensor `name` when kvjit decodes it, or q8_kmin for Q2_K, Q3_K and
/// IQ4_XS, which it holds exactly; for a stacked QKV weight, that of
/// all three parts, else the first of Q8_0, q8_min and q8_kmin that holds
/// every part exactly (Q5_0 Q and K beside a Q8_0 V: Q8_0; Q5_1 beside
/// Q8_0: q8_min; Q4_K beside Q6_K: q8_kmin).
fn kept_format(gguf: &Gguf, name: &str) -> Option<DType> {
    // A type without kernels of its own (Q2_K, Q3_K, IQ4_XS) in q8_kmin.
    let format = |name: &str| {
        let stored = gguf.tensor_info(name)?.ggml_type().block_format();
        stored.or_else(|| gguf.holds_exactly(name, DType::Q8KMin).then_some(DType::Q8KMin))
    };
    match name.strip_suffix("attn_qkv.weight").filter(|_| gguf.tensor_info(name).is_none()) {
        Some(prefix) => {
            let names = ["attn_q", "attn_k", "attn_v"].map(|p| format!("{prefix}{p}.weight"));
            let parts = names.clone().map(|name| format(&name));
            let common = [DType::Q8_0, DType::Q8Min, DType::Q8KMin]
                .into_iter()
                .find(|&f| names.iter().all(|n| gguf.holds_exactly(n, f)));
            parts[0].filter(|f| parts.iter().all(|p| *p == Some(*f))).or(common)
        }
        None => format(name),
    }
}

/// The graph file of the model in `gguf`: [`model_graph_file`] of
/// [`llama_config`], every weight constant renamed to its tensor in the
/// file (and declared in its block format, unless `options.dequantize`),
/// its random recipe dropped, and `weights` naming the file as
/// `weights_name`.
pub fn model_graph_json(gguf: &Gguf, ops: &OpRegistry, options: &ImportOptions, weights_name: &str) -> Result<String> {
    graph_json_of(gguf, &llama_config(gguf, options)?, ops, options, weights_name)
}

/// [`model_graph_json`] of the `config` already read from `gguf`.
fn graph_json_of(
    gguf: &Gguf,
    config: &LlamaConfig,
    ops: &OpRegistry,
    options: &ImportOptions,
    weights_name: &str,
) -> Result<String> {
    // The random weights stay recipes (never drawn): each becomes the
    // file's tensor below.
    let mut json: serde_json::Value =
        serde_json::from_str(&model_graph_file(config, ops)?).map_err(kvjit_graph::GraphError::from)?;
    let values = json.get_mut("values").and_then(|v| v.as_array_mut()).expect("a graph file has values");
    for value in values {
        let Some(entry) = value.as_object_mut() else { continue };
        if entry.get("kind").and_then(|k| k.as_str()) != Some("constant") {
            continue;
        }
        let Some(name) = entry.get("name").and_then(|n| n.as_str()) else { continue };
        if let Some(tensor) = gguf_name(name, config.layer.num_layers) {
            let matrix = entry.get("shape").and_then(|s| s.as_array()).is_some_and(|s| s.len() == 2);
            if let Some(format) = kept_format(gguf, &tensor).filter(|_| matrix && !options.dequantize) {
                entry.insert("dtype".into(), format.name().into());
            }
            entry.insert("name".into(), tensor.into());
            entry.remove("init");
        }
    }
    json.as_object_mut().expect("a graph file is an object").insert("weights".into(), weights_name.into());
    Ok(serde_json::to_string_pretty(&json).map_err(kvjit_graph::GraphError::from)? + "\n")
}

/// The model graph of the GGUF file at `path`, built in memory with its
/// weights from the file.
pub fn load_model(path: &Path, ops: &OpRegistry, options: &ImportOptions, mode: WeightLoad) -> Result<Graph> {
    let gguf = Gguf::open_with(path, mode)?;
    // The cache this model will run with, refused past this machine's
    // memory before the graph (its RoPE table of --context rows) is built.
    let config = llama_config(&gguf, options)?;
    let layer = &config.layer;
    let params = layer.cache_type().try_params()?;
    crate::generate::check_cache_fits_memory(&params, layer.num_pages, options.max_batch, layer.max_pages_per_seq)?;
    let text = graph_json_of(&gguf, &config, ops, options, "model.gguf")?;
    Ok(graph_from_json_with_gguf(&text, ops, path, mode)?)
}

/// What loading `gguf` with `options` does to its quantized matrices that
/// the kernels do not read in their own blocks, one line per kind (none
/// when every quantized matrix stays in its blocks, or `--dequantize` asked
/// for all of them in the dtype): Q2_K, Q3_K and IQ4_XS held as q8_kmin,
/// types dequantized into the model's dtype (a block whose scale is not
/// finite), with the bytes a weight each costs, and the fused QKV weights
/// whose parts differ in type.
pub fn weight_notes(gguf: &Gguf, options: &ImportOptions) -> Vec<String> {
    use std::collections::BTreeMap;
    if options.dequantize {
        return Vec::new();
    }
    let (mut held, mut dequantized) = (BTreeMap::new(), BTreeMap::new());
    for info in gguf.tensors().iter().filter(|t| t.shape().len() == 2 && t.ggml_type().block_size() > 1) {
        let ty = info.ggml_type();
        match (ty.block_format(), kept_format(gguf, info.name())) {
            (Some(_), _) => {}
            (None, Some(_)) => *held.entry(ty.name()).or_insert(0usize) += 1,
            (None, None) => *dequantized.entry(ty.name()).or_insert(0usize) += 1,
        }
    }
    let list = |counts: &BTreeMap<&str, usize>| {
        counts.iter().map(|(name, n)| format!("{n} {name}")).collect::<Vec<_>>().join(", ")
    };
    let mut notes = Vec::new();
    if !held.is_empty() {
        notes.push(format!(
            "note: {} matrices held as the q8_kmin blocks of the same values ({} bytes a weight)",
            list(&held),
            DType::Q8KMin.bytes_per_element()
        ));
    }
    if !dequantized.is_empty() {
        let dtype = options.dtype;
        let cheaper = match dtype {
            DType::F32 => " (--dtype bf16 halves that)",
            _ => "",
        };
        notes.push(format!(
            "note: {} matrices dequantized to {dtype} at load, {} bytes a weight{cheaper}; kvjit's kernels read \
             {} blocks as they are",
            list(&dequantized),
            dtype.size_bytes(),
            DType::BLOCK_FORMATS
                .into_iter()
                .filter(|f| !matches!(f, DType::Q8Min | DType::Q8KMin))
                .map(|f| f.name().to_uppercase())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    notes.extend(mixed_qkv_notes(gguf, options));
    notes
}

/// One note per way the fused QKV weights whose parts the file stores in
/// different quantized types load (as Q8_0 or q8_min blocks of the same
/// values, or dequantized into the dtype), with how many and the types.
fn mixed_qkv_notes(gguf: &Gguf, options: &ImportOptions) -> Vec<String> {
    use std::collections::BTreeMap;
    let mut mixed: BTreeMap<(String, String), usize> = BTreeMap::new();
    for info in gguf.tensors() {
        let Some(prefix) = info.name().strip_suffix("attn_q.weight") else { continue };
        let qkv = format!("{prefix}attn_qkv.weight");
        let parts = ["attn_q", "attn_k", "attn_v"].map(|p| gguf.tensor_info(&format!("{prefix}{p}.weight")));
        let [Some(q), Some(k), Some(v)] = parts else { continue };
        let types: std::collections::BTreeSet<&str> = [q, k, v].iter().map(|t| t.ggml_type().name()).collect();
        let quantized = [q, k, v].iter().all(|t| t.ggml_type().block_size() > 1);
        if types.len() < 2 || !quantized || gguf.tensor_info(&qkv).is_some() {
            continue;
        }
        let loads_as = match kept_format(gguf, &qkv) {
            Some(format) => {
                format!("as the {format} blocks of the same values ({} bytes a weight)", format.bytes_per_element())
            }
            None => format!("dequantized to {} ({} bytes a weight)", options.dtype, options.dtype.size_bytes()),
        };
        let types = types.into_iter().collect::<Vec<_>>().join(" + ");
        *mixed.entry((types, loads_as)).or_insert(0) += 1;
    }
    mixed
        .into_iter()
        .map(|((types, loads_as), n)| format!("note: {n} fused QKV weights of parts in {types} load {loads_as}"))
        .collect()
}

/// `kvjit import`: write `dir/model.json`, the model graph of the GGUF at
/// `gguf_path` referring to it. The graph file may only name a weights
/// file in its own folder: a GGUF elsewhere is hard-linked into `dir`
/// (copied where the file system cannot link). Returns the graph file and
/// the GGUF path it names.
pub fn import(gguf_path: &Path, dir: &Path, ops: &OpRegistry, options: &ImportOptions) -> Result<(PathBuf, PathBuf)> {
    let gguf = Gguf::open(gguf_path)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::Usage(format!("{}: {e}", dir.display())))?;
    let file_name =
        gguf_path.file_name().ok_or_else(|| Error::Usage(format!("{} names no file", gguf_path.display())))?;
    let inside = dir.join(file_name);
    if !same_file(gguf_path, &inside) {
        if inside.exists() {
            return Err(Error::Usage(format!(
                "{} exists and is another file; import into another folder",
                inside.display()
            )));
        }
        if std::fs::hard_link(gguf_path, &inside).is_err() {
            std::fs::copy(gguf_path, &inside).map_err(|e| Error::Usage(format!("{}: {e}", inside.display())))?;
        }
    }
    let text = model_graph_json(&gguf, ops, options, &file_name.to_string_lossy())?;
    let graph_path = dir.join("model.json");
    std::fs::write(&graph_path, text).map_err(|e| Error::Usage(format!("{}: {e}", graph_path.display())))?;
    Ok((graph_path, inside))
}

/// Whether `a` and `b` are one file: one path, one inode (the hard link
/// an earlier import made), or the same bytes (the copy it made where the
/// file system cannot link) — so importing again into a folder works.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::io::Read as _;
    if a.canonicalize().ok().zip(b.canonicalize().ok()).is_some_and(|(a, b)| a == b) {
        return true;
    }
    let (Ok(meta_a), Ok(meta_b)) = (std::fs::metadata(a), std::fs::metadata(b)) else { return false };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        if (meta_a.dev(), meta_a.ino()) == (meta_b.dev(), meta_b.ino()) {
            return true;
        }
    }
    if meta_a.len() != meta_b.len() {
        return false;
    }
    let (Ok((mut file_a, _)), Ok((mut file_b, _))) =
        (kvjit_core::open_regular_file(a), kvjit_core::open_regular_file(b))
    else {
        return false;
    };
    let (mut chunk_a, mut chunk_b) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let Ok(n) = file_a.read(&mut chunk_a) else { return false };
        if n == 0 {
            return true;
        }
        if file_b.read_exact(&mut chunk_b[..n]).is_err() || chunk_a[..n] != chunk_b[..n] {
            return false;
        }
    }
}

/// The tokenizer the GGUF's metadata describes (`tokenizer.ggml.*`,
/// `tokenizer.chat_template`), for a model scoring `vocab_size` token ids:
/// a vocabulary of another size is refused before it is built (as
/// llama.cpp does), since ids past its end would have no text and ids past
/// the model's would never be scored.
pub fn tokenizer(gguf: &Gguf, vocab_size: usize) -> Result<Tokenizer> {
    let tokens = gguf.get_str_array("tokenizer.ggml.tokens")?;
    if tokens.len() != vocab_size {
        return Err(Error::Usage(format!(
            "{}: tokenizer.ggml.tokens holds {} tokens, but the model scores {vocab_size} (its logits' width)",
            gguf.path().display(),
            tokens.len()
        )));
    }
    tokenizer_of(gguf, tokens)
}

/// The tokenizer of the GGUF's vocabulary, whatever its size: for what
/// scores nothing (`kvjit tokenize`, comparisons with other tokenizers,
/// vocabulary-only files).
pub fn vocabulary_tokenizer(gguf: &Gguf) -> Result<Tokenizer> {
    tokenizer_of(gguf, gguf.get_str_array("tokenizer.ggml.tokens")?)
}

/// The tokenizer of `tokens` (the GGUF's `tokenizer.ggml.tokens`) and the
/// rest of the GGUF's tokenizer metadata.
fn tokenizer_of(gguf: &Gguf, tokens: Vec<&str>) -> Result<Tokenizer> {
    let owned = |v: Vec<&str>| v.into_iter().map(str::to_string).collect::<Vec<_>>();
    let spec = VocabSpec {
        model: gguf.get_str("tokenizer.ggml.model")?.to_string(),
        pre: gguf.get_str_opt("tokenizer.ggml.pre")?.map(str::to_string),
        tokens: owned(tokens),
        merges: gguf.get_str_array_opt("tokenizer.ggml.merges")?.map(owned).unwrap_or_default(),
        token_types: gguf.get_i32_array_opt("tokenizer.ggml.token_type")?,
        bos: gguf.get_u32_opt("tokenizer.ggml.bos_token_id")?,
        eos: gguf.get_u32_opt("tokenizer.ggml.eos_token_id")?,
        add_bos: gguf.get_bool_opt("tokenizer.ggml.add_bos_token")?,
        add_space_prefix: gguf.get_bool_opt("tokenizer.ggml.add_space_prefix")?,
        chat_template: gguf.get_str_opt("tokenizer.chat_template")?.map(str::to_string),
        scores: gguf.get_f32_array_opt("tokenizer.ggml.scores")?,
    };
    Tokenizer::from_spec(spec).map_err(|e| Error::Usage(format!("{}: tokenizer: {e}", gguf.path().display())))
}

/// The GGUF file a graph file takes its weights from (its `weights`,
/// confined to its folder as when the graph is loaded): where the
/// tokenizer of a model written by [`import`] is.
pub fn gguf_of_graph_file(path: &Path) -> Result<PathBuf> {
    let refuse = |problem: String| Error::Usage(format!("{}: {problem}", path.display()));
    let not_a_model = |why: String| refuse(format!("not a GGUF file, a compiled artifact or a model.json: {why}"));
    // A regular file only (reading a FIFO would block).
    let bytes = kvjit_core::read_regular_file(path).map_err(|e| match e {
        kvjit_core::Error::Io { source, .. } => refuse(source.to_string()),
        other => Error::from(other),
    })?;
    let text = String::from_utf8(bytes).map_err(|_| not_a_model("not UTF-8 text".into()))?;
    let json = kvjit_core::json::parse_strict(text.as_bytes()).map_err(|e| not_a_model(format!("as JSON, {e}")))?;
    let weights = json.get("weights").and_then(|w| w.as_str()).filter(|w| w.to_ascii_lowercase().ends_with(".gguf"));
    let weights = weights.ok_or_else(|| {
        refuse("the graph file names no .gguf weights, so there is no tokenizer (write one with kvjit import)".into())
    })?;
    Ok(kvjit_graph::confined_weights_path(path, weights)?)
}
