//! Generation on token ids: a compiled model graph (token ids → logits,
//! a paged KV cache) run as one prefill of every prompt, then decode steps
//! on the same executable and cache, each step's next token picked from
//! the logits ([`Sampling`]: greedy, or temperature / top-k / top-p with a
//! seed).
//!
//! The model is any graph whose inputs are token ids (a `mo.gather`'s
//! `ids`, `[batch, seq]`), valid lengths and `layer_idx` inputs, with one
//! KV cache and a `logits [batch, vocab]` output —
//! [`models::llama::model_graph`](crate::models::llama::model_graph)'s
//! shape. The roles are read from the graph's ops, as the scenario does.
//! Text (tokenizing, streaming decode) is the CLI's: this module is ids in,
//! ids out.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvjit_core::{KvCacheParams, PagedKVCacheCollection, Tensor};
use kvjit_graph::Graph;
use kvjit_runtime::{Executable, Executor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use kvjit_op_rope::FREQS_CIS as ROPE_TABLE;

use crate::models::llama::LOGITS;
use crate::scenario::Roles;
use crate::{Error, Registry, Result};

/// How the next token is picked from a step's logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the largest logit; the lowest id on a tie). Otherwise
    /// the logits are divided by it before the softmax.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (`None`: all).
    pub top_k: Option<usize>,
    /// Keep the most likely tokens whose probabilities sum to at least `p`
    /// (`None`: all).
    pub top_p: Option<f32>,
    /// Seed of the sampler's generator.
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: None, top_p: None, seed: 0 }
    }

    /// Refuse settings with no meaning (a negative or non-finite
    /// temperature, `top_k = 0`, `top_p` outside (0, 1]).
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::Usage(format!("--temperature must be finite and ≥ 0, got {}", self.temperature)));
        }
        if self.top_k == Some(0) {
            return Err(Error::Usage("--top-k must be at least 1".into()));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(Error::Usage(format!("--top-p must be in (0, 1], got {p}")));
        }
        Ok(())
    }
}

/// A sampler: [`Sampling`] and its generator's state.
pub struct Sampler {
    sampling: Sampling,
    rng: StdRng,
}

impl Sampler {
    /// A sampler seeded with `sampling.seed`.
    pub fn new(sampling: Sampling) -> Self {
        Self { rng: StdRng::seed_from_u64(sampling.seed), sampling }
    }

    /// The next token from one row of logits.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        let greedy = || argmax(logits);
        let Sampling { temperature, top_k, top_p, .. } = self.sampling;
        if temperature == 0.0 || top_k == Some(1) {
            return greedy();
        }
        // Most likely first (ties: lower id first), NaNs last.
        let mut order: Vec<usize> = (0..logits.len()).filter(|&i| !logits[i].is_nan()).collect();
        if order.is_empty() {
            return greedy();
        }
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        order.truncate(top_k.unwrap_or(order.len()).max(1));
        let max = logits[order[0]];
        let mut weights: Vec<f64> = order.iter().map(|&i| f64::from((logits[i] - max) / temperature).exp()).collect();
        let total: f64 = weights.iter().sum();
        if let Some(p) = top_p {
            let mut sum = 0.0;
            let keep = weights.iter().position(|w| {
                sum += w / total;
                sum >= f64::from(p)
            });
            let keep = keep.map_or(weights.len(), |k| k + 1);
            weights.truncate(keep);
            order.truncate(keep);
        }
        let total: f64 = weights.iter().sum();
        let mut target = self.rng.r#gen::<f64>() * total;
        for (&i, w) in order.iter().zip(&weights) {
            target -= w;
            if target < 0.0 {
                return i as u32;
            }
        }
        order[order.len() - 1] as u32
    }
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Tokens to generate per prompt, at most (at least 1).
    pub max_tokens: usize,
    /// How each token is picked.
    pub sampling: Sampling,
    /// Tokens that end a sequence (EOS); the stop token is kept in the
    /// output.
    pub stop: Vec<u32>,
    /// Keep every step's logits (`Generation::logits`).
    pub keep_logits: bool,
}

/// What a generation produced.
#[derive(Clone, Debug, Default)]
pub struct Generation {
    /// Per prompt, the generated tokens (a stop token included).
    pub tokens: Vec<Vec<u32>>,
    /// Per prompt, the logits each generated token was picked from (when
    /// kept): `logits[p][i]` chose `tokens[p][i]`.
    pub logits: Vec<Vec<Vec<f32>>>,
    /// Time of the prefill run (the first token's logits).
    pub prefill: Duration,
    /// Time of the decode runs.
    pub decode: Duration,
    /// Decode runs made.
    pub decode_steps: usize,
}

/// A compiled model and what its inputs are, ready to generate.
pub struct Model {
    exe: Executable,
    executor: Executor,
    ids: String,
    valid_lengths: String,
    layer_idx: BTreeMap<String, u32>,
    cache: String,
    cache_params: KvCacheParams,
    num_pages: usize,
    max_pages_per_seq: usize,
    vocab_size: usize,
    rope_positions: Option<usize>,
}

impl Model {
    /// Read the roles of `graph`'s inputs (the graph `exe` was compiled
    /// from): one token-ids input, one valid-lengths input, `layer_idx`
    /// inputs, one cache of static pages and table width, and a `logits`
    /// output.
    pub fn new(graph: &Graph, registry: &Registry, exe: Executable, executor: Executor) -> Result<Self> {
        let roles = Roles::of(graph, registry.ops())?;
        let not_a_model =
            |what: String| Error::Usage(format!("graph '{}' is not a model to generate with: {what}", graph.name()));
        let one = |names: Vec<String>, what: &str| match names.as_slice() {
            [name] => Ok(name.clone()),
            _ => Err(not_a_model(format!("it needs exactly one {what} input, it has {}", names.len()))),
        };
        let ids = one(roles.token_ids.keys().cloned().collect(), "token-ids")?;
        let valid_lengths = one(roles.valid_lengths.iter().cloned().collect(), "valid-lengths")?;
        let Some(logits) = graph.outputs().iter().find(|o| o.name == LOGITS) else {
            return Err(not_a_model(format!("it has no output '{LOGITS}'")));
        };
        let Some(vocab_size) =
            graph.value(logits.value).ty.as_tensor().and_then(|t| t.shape.last()?.as_static()).filter(|&v| v > 0)
        else {
            return Err(not_a_model(format!("its output '{LOGITS}' needs a static vocabulary (last) dimension")));
        };
        // The positions RoPE has a row for (the fewest, over its nodes'
        // tables): a sequence past them fails mid-generation otherwise.
        let mut rope_positions: Option<usize> = None;
        for node in graph.nodes() {
            let op = registry.ops().get(&node.op)?;
            for (spec, &table) in op.inputs().iter().zip(&node.inputs) {
                if spec.name == ROPE_TABLE
                    && let Some(rows) = graph.value(table).ty.as_tensor().and_then(|t| t.shape.first()?.as_static())
                {
                    rope_positions = Some(rope_positions.map_or(rows, |r| r.min(rows)));
                }
            }
        }
        let caches: Vec<_> = graph.kv_caches().collect();
        let [(_, cache)] = caches.as_slice() else {
            return Err(not_a_model(format!("it needs exactly one KV cache, it has {}", caches.len())));
        };
        let ty = cache.ty.as_kv_cache().expect("a cache value has a cache type");
        let (Some(num_pages), Some(max_pages_per_seq)) = (ty.num_pages.as_static(), ty.max_pages_per_seq.as_static())
        else {
            return Err(not_a_model("its cache's pages and table width must be static".into()));
        };
        Ok(Self {
            exe,
            executor,
            ids,
            valid_lengths,
            layer_idx: roles.layer_idx,
            cache: cache.name.clone().unwrap_or_default(),
            cache_params: ty.params(),
            num_pages,
            max_pages_per_seq,
            vocab_size,
            rope_positions,
        })
    }

    /// Token ids the model scores: the width of its `logits` rows.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Tokens a sequence may hold in the cache: prompt plus generated.
    pub fn context_length(&self) -> usize {
        self.max_pages_per_seq * self.cache_params.page_size
    }

    /// Sequences of `context` tokens the cache holds at once.
    pub fn max_batch(&self, context: usize) -> usize {
        self.num_pages / context.div_ceil(self.cache_params.page_size).max(1)
    }

    /// Whether [`generate`](Self::generate) can run `prompts` with
    /// `options`: refused in one line when the sampling settings have no
    /// meaning, `max_tokens` is 0, a prompt is empty, a sequence would
    /// outgrow the context, or the prompts' pages outgrow the cache.
    pub fn check(&self, prompts: &[Vec<u32>], options: &GenerateOptions) -> Result<()> {
        options.sampling.check()?;
        if options.max_tokens == 0 {
            return Err(Error::Usage("--max-tokens must be at least 1".into()));
        }
        if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
            return Err(Error::Usage("every prompt needs at least one token".into()));
        }
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let context = self.context_length();
        // Saturating: a --max-tokens near usize::MAX must not wrap past
        // the check.
        let total = longest.saturating_add(options.max_tokens);
        if total > context {
            return Err(Error::Usage(format!(
                "a prompt of {} plus {} to generate is past the context length {context}",
                count_tokens(longest),
                options.max_tokens
            )));
        }
        if let Some(rows) = self.rope_positions.filter(|&rows| total > rows) {
            return Err(Error::Usage(format!(
                "a prompt of {} plus {} to generate is past the {rows} positions of the model's RoPE table \
                 ({ROPE_TABLE})",
                count_tokens(longest),
                options.max_tokens
            )));
        }
        let batch = prompts.len();
        check_cache_fits_memory(&self.cache_params, self.num_pages, batch, self.max_pages_per_seq)?;
        // total ≤ context here, so neither product wraps.
        let pages_each = total.div_ceil(self.cache_params.page_size);
        if batch * pages_each > self.num_pages {
            return Err(Error::Usage(format!(
                "{batch} sequences of {} tokens need {} cache pages; the model's cache has {}",
                total,
                batch * pages_each,
                self.num_pages
            )));
        }
        Ok(())
    }

    /// Generate for every prompt side by side: one prefill of the prompts
    /// padded to the longest, then decode steps of one token each until
    /// every sequence has `max_tokens` tokens or stopped; `on_token(p,
    /// token)` sees each token as it is picked. Refused before anything
    /// runs as [`check`](Self::check) says.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<Generation> {
        self.check(prompts, options)?;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let batch = prompts.len();
        let cache = PagedKVCacheCollection::new(self.cache_params, self.num_pages, batch, self.max_pages_per_seq)?;
        let mut caches = BTreeMap::from([(self.cache.clone(), cache)]);
        let mut sampler = Sampler::new(options.sampling);
        let mut out =
            Generation { tokens: vec![Vec::new(); batch], logits: vec![Vec::new(); batch], ..Generation::default() };
        let mut live = vec![true; batch];

        // Prefill: the prompts padded to the longest.
        let mut ids = vec![0u32; batch * longest];
        for (p, prompt) in prompts.iter().enumerate() {
            ids[p * longest..][..prompt.len()].copy_from_slice(prompt);
        }
        let mut valid: Vec<u32> = prompts.iter().map(|p| p.len() as u32).collect();
        let started = Instant::now();
        let logits = self.step(&mut caches, Tensor::from_vec(&[batch, longest], ids)?, &valid)?;
        out.prefill = started.elapsed();
        let mut next = self.pick(&logits, &mut live, &valid, &mut sampler, options, &mut out, on_token);

        while live.iter().any(|&l| l) {
            valid = live.iter().map(|&l| u32::from(l)).collect();
            let started = Instant::now();
            let logits = self.step(&mut caches, Tensor::from_vec(&[batch, 1], next.clone())?, &valid)?;
            out.decode += started.elapsed();
            out.decode_steps += 1;
            next = self.pick(&logits, &mut live, &valid, &mut sampler, options, &mut out, on_token);
        }
        Ok(out)
    }

    /// One run: `ids [batch, seq]` with `valid` tokens per sequence, the
    /// cache reserved before and advanced after. Returns the logits as f32
    /// rows.
    fn step(
        &self,
        caches: &mut BTreeMap<String, PagedKVCacheCollection>,
        ids: Tensor,
        valid: &[u32],
    ) -> Result<Vec<f32>> {
        let mut inputs = BTreeMap::from([
            (self.ids.clone(), ids),
            (self.valid_lengths.clone(), Tensor::from_vec(&[valid.len()], valid.to_vec())?),
        ]);
        for (name, &layer) in &self.layer_idx {
            inputs.insert(name.clone(), Tensor::scalar_u32(layer));
        }
        let cache = caches.get_mut(&self.cache).expect("the model's cache");
        cache.reserve(valid)?;
        let output = self.executor.run(&self.exe, &inputs, caches)?;
        caches.get_mut(&self.cache).expect("the model's cache").advance(valid)?;
        Ok(output.outputs[LOGITS].to_f32_vec()?)
    }

    /// Pick each live sequence's next token from its row of `logits`;
    /// a sequence stops at a stop token or at `max_tokens`.
    #[allow(clippy::too_many_arguments, reason = "the generation loop's state, passed by the one caller")]
    fn pick(
        &self,
        logits: &[f32],
        live: &mut [bool],
        valid: &[u32],
        sampler: &mut Sampler,
        options: &GenerateOptions,
        out: &mut Generation,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Vec<u32> {
        let vocab = logits.len() / live.len();
        let mut next = vec![0u32; live.len()];
        for (p, row) in logits.chunks_exact(vocab).enumerate() {
            if !live[p] || valid[p] == 0 {
                continue;
            }
            let token = sampler.pick(row);
            next[p] = token;
            out.tokens[p].push(token);
            if options.keep_logits {
                out.logits[p].push(row.to_vec());
            }
            on_token(p, token);
            if options.stop.contains(&token) || out.tokens[p].len() >= options.max_tokens {
                live[p] = false;
            }
        }
        next
    }
}

/// `n` tokens in words: "1 token", "3 tokens".
pub fn count_tokens(n: usize) -> String {
    format!("{n} token{}", if n == 1 { "" } else { "s" })
}

/// The id of the largest logit, the lowest on a tie; NaNs are never the
/// largest (0 when every logit is NaN, or there is none). Two passes that
/// vectorize (a vocabulary's row per token: the branchy one-pass scan cost
/// ~1 % of a SmolLM2 decode step).
fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    // `v > m` is false for a NaN v: NaNs never enter the maxima.
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    logits.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// Refuse a KV cache of `params` (`num_pages` pages, `batch` sequences of
/// `max_pages_per_seq`) larger than this machine's memory, before anything
/// of it (or of the model it belongs to) is made.
pub(crate) fn check_cache_fits_memory(
    params: &KvCacheParams,
    num_pages: usize,
    batch: usize,
    max_pages_per_seq: usize,
) -> Result<()> {
    let cache_bytes = params.cache_bytes(num_pages, batch, max_pages_per_seq).unwrap_or(u64::MAX);
    match kvjit_runtime::physical_memory().filter(|&memory| cache_bytes > memory) {
        None => Ok(()),
        Some(memory) => Err(Error::Usage(format!(
            "the model's KV cache ({num_pages} pages of {} tokens) takes {:.1} GB, more than this machine's {:.1} GB of \
             memory: give a smaller --context or --max-batch (to kvjit import, for a model.json)",
            params.page_size,
            cache_bytes as f64 / 1e9,
            memory as f64 / 1e9
        ))),
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::argmax;

    /// The first index of the largest non-NaN value, by a plain scan.
    fn first_max(logits: &[f32]) -> u32 {
        let mut best: Option<usize> = None;
        for (i, &v) in logits.iter().enumerate() {
            if !v.is_nan() && best.is_none_or(|b| v > logits[b]) {
                best = Some(i);
            }
        }
        best.unwrap_or(0) as u32
    }

    #[test]
    fn argmax_is_the_first_largest_logit_and_never_a_nan() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for len in [0, 1, 2, 15, 16, 17, 100, 49152] {
            for _ in 0..20 {
                // Few distinct values (ties), infinities and NaNs.
                let logits: Vec<f32> = (0..len)
                    .map(|_| match rng.gen_range(0..20) {
                        0 => f32::NAN,
                        1 => f32::NEG_INFINITY,
                        2 => f32::INFINITY,
                        _ => rng.gen_range(-4i32..4) as f32 * 0.5,
                    })
                    .collect();
                assert_eq!(argmax(&logits), first_max(&logits), "{logits:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0, "all NaN: 0");
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, f32::NAN]), 1);
        assert_eq!(argmax(&[1.0, f32::NAN, 3.0, 3.0]), 2, "the lowest id of a tie");
    }
}
