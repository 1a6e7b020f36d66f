//! Shared fixtures of the RoPE tests: random valid calls (shapes, page
//! tables, lengths), an independent f64 model of the contract (to size
//! tolerances and to know which cache elements a call may touch), and the
//! checks every test runs on a JIT or reference result.

#![allow(dead_code, reason = "each test binary uses a different part of the fixtures")]

use std::collections::HashMap;

use kvjit_core::{CacheElement, DType, KvCacheParams, PagedKVCacheCollection, Target, Tensor, UNASSIGNED_PAGE};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_rope::{JitKernel, ReferenceKernel, RopeSpec};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::tolerance::ulp;
use kvjit_testkit::values::uniform_in;
use kvjit_testkit::{Guarded, nan_bytes, u32s, unravel};
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

/// Guard bytes on each side of a JIT output.
pub const GUARD: usize = 64;

/// One call's sizes and lengths.
#[derive(Clone, Debug)]
pub struct Case {
    pub dtype: DType,
    pub cache_dtype: DType,
    /// Values per scale: `Some` exactly for an `f8e4m3` cache.
    pub granularity: Option<usize>,
    pub interleaved: bool,
    pub batch: usize,
    pub seq: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub page_size: usize,
    pub layers: usize,
    pub layer: usize,
    pub cache_lengths: Vec<u32>,
    pub valid: Vec<u32>,
    /// Extra freqs rows past the last position used.
    pub extra_positions: usize,
    /// Extra physical pages nobody uses.
    pub extra_pages: usize,
    pub seed: u64,
}

/// A call's tensors and cache.
#[derive(Clone, Debug)]
pub struct Call {
    pub q: Tensor,
    pub cache: PagedKVCacheCollection,
    pub freqs: Tensor,
    pub layer_idx: Tensor,
    pub valid: Tensor,
}

impl Case {
    /// A small case to start from (set `granularity` for an FP8 cache).
    pub fn base(dtype: DType, cache_dtype: DType, interleaved: bool) -> Self {
        Self {
            dtype,
            cache_dtype,
            granularity: None,
            interleaved,
            batch: 2,
            seq: 3,
            hq: 4,
            hkv: 2,
            d: 16,
            page_size: 2,
            layers: 2,
            layer: 1,
            cache_lengths: vec![1, 0],
            valid: vec![3, 2],
            extra_positions: 2,
            extra_pages: 1,
            seed: 1,
        }
    }

    pub fn spec(&self) -> RopeSpec {
        RopeSpec {
            target: Target::Cpu,
            dtype: self.dtype,
            cache: KvCacheParams {
                element: CacheElement::new(self.cache_dtype, self.granularity).unwrap(),
                num_layers: self.layers,
                page_size: self.page_size,
                num_kv_heads: self.hkv,
                head_size: self.d,
            },
            interleaved: self.interleaved,
            num_q_heads: self.hq,
            step: StepDims { batch: None, seq: None },
        }
    }

    /// Logical pages each sequence needs for its valid tokens (at least one
    /// column in the table).
    fn pages_needed(&self, b: usize) -> usize {
        (self.cache_lengths[b] as usize + self.valid[b] as usize).div_ceil(self.page_size)
    }

    pub fn max_seq(&self) -> usize {
        let last = (0..self.batch).map(|b| self.cache_lengths[b] as usize + self.valid[b] as usize).max().unwrap_or(0);
        last + self.extra_positions
    }

    /// The call: page table with distinct shuffled physical pages for every
    /// logical page a sequence holds, random cache contents everywhere,
    /// random Q, and a real cos/sin table. An FP8 cache holds random codes
    /// (never zero or NaN) and random positive scales (blocks of magnitude
    /// up to 0.25..4).
    pub fn build(&self, rng: &mut StdRng) -> Call {
        let max_pages = (0..self.batch).map(|b| self.pages_needed(b)).max().unwrap_or(0) + 1;
        let needed: usize = (0..self.batch).map(|b| self.pages_needed(b)).sum();
        let num_pages = needed + self.extra_pages.max(1);
        let mut physical: Vec<u32> = (0..num_pages as u32).collect();
        physical.shuffle(rng);
        let mut table = vec![UNASSIGNED_PAGE; self.batch * max_pages];
        let mut next = physical.into_iter();
        for b in 0..self.batch {
            for logical in 0..self.pages_needed(b) {
                table[b * max_pages + logical] = next.next().unwrap();
            }
        }
        let params = KvCacheParams {
            element: CacheElement::new(self.cache_dtype, self.granularity).unwrap(),
            num_layers: self.layers,
            page_size: self.page_size,
            num_kv_heads: self.hkv,
            head_size: self.d,
        };
        let shape = [num_pages, 2, self.layers, self.page_size, self.hkv, self.d];
        let (blocks, scales) = match self.granularity {
            None => (uniform_in(rng, self.cache_dtype, &shape, -2.0, 2.0), None),
            Some(g) => {
                let codes = random_e4m3_codes(rng, shape.iter().product());
                let blocks = Tensor::from_le_bytes(DType::F8E4M3, &shape, &codes).unwrap();
                let scales_shape = [num_pages, 2, self.layers, self.page_size, self.hkv, self.d / g];
                let scales: Vec<f32> = (0..scales_shape.iter().product::<usize>())
                    .map(|_| rng.gen_range(0.25f32..4.0) / kvjit_core::fp8::E4M3_MAX)
                    .collect();
                (blocks, Some(Tensor::from_f32(DType::F32, &scales_shape, &scales).unwrap()))
            }
        };
        let mut cache = PagedKVCacheCollection::from_parts_with_scales(
            blocks,
            scales,
            self.cache_lengths.clone(),
            table,
            max_pages,
        )
        .unwrap();
        assert_eq!(*cache.params(), params);
        cache.max_seq_length = self.seq as u32;
        Call {
            q: uniform_in(rng, self.dtype, &[self.batch, self.seq, self.hq, self.d], -2.0, 2.0),
            cache,
            freqs: freqs_table(self.dtype, self.max_seq(), self.d, 10000.0),
            layer_idx: Tensor::scalar_u32(self.layer as u32),
            valid: u32s(&self.valid),
        }
    }
}

/// `count` random E4M3 codes, neither zero (±0) nor NaN.
pub fn random_e4m3_codes(rng: &mut StdRng, count: usize) -> Vec<u8> {
    (0..count)
        .map(|_| {
            loop {
                let code: u8 = rng.r#gen();
                if !matches!(code & 0x7f, 0 | 0x7f) {
                    break code;
                }
            }
        })
        .collect()
}

/// The cos/sin table `[positions, d]` of base `theta`, rounded to `dtype`.
pub fn freqs_table(dtype: DType, positions: usize, d: usize, theta: f64) -> Tensor {
    let mut values = Vec::with_capacity(positions * d);
    for pos in 0..positions {
        for j in 0..d / 2 {
            let angle = pos as f64 * theta.powf(-2.0 * j as f64 / d as f64);
            values.extend([angle.cos() as f32, angle.sin() as f32]);
        }
    }
    Tensor::from_f32(dtype, &[positions, d], &values).unwrap()
}

/// The pairs `(j, a, b)` of a head, written out independently of the crate.
pub fn pairs(d: usize, interleaved: bool) -> Vec<(usize, usize, usize)> {
    (0..d / 2).map(|j| if interleaved { (j, 2 * j, 2 * j + 1) } else { (j, j, j + d / 2) }).collect()
}

/// What one element must hold: the exact (f64) rotation of the inputs and
/// the magnitude of its two products (`|a·c| + |b·s|`).
#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub exact: f64,
    pub magnitude: f64,
}

/// Rotate one head (f64 values) by row `freqs` (f64), exactly as the
/// contract says; per element (exact, magnitude).
pub fn model_head(x: &[f64], freqs: &[f64], interleaved: bool) -> Vec<Model> {
    let mut out = vec![Model { exact: f64::NAN, magnitude: 0.0 }; x.len()];
    for (j, a, b) in pairs(x.len(), interleaved) {
        let (c, s) = (freqs[2 * j], freqs[2 * j + 1]);
        out[a] = Model { exact: x[a] * c - x[b] * s, magnitude: (x[a] * c).abs() + (x[b] * s).abs() };
        out[b] = Model { exact: x[b] * c + x[a] * s, magnitude: (x[b] * c).abs() + (x[a] * s).abs() };
    }
    out
}

/// Row-major index of `[page, kv, layer, slot, head, d]`, written out here.
pub fn block_index(shape: &[usize], idx: [usize; 6]) -> usize {
    kvjit_testkit::block_index(shape, idx)
}

/// The model of a whole call: per output element (None: a padded row,
/// exactly zero) and per cache element the call rotates.
pub struct Expected {
    pub output: Vec<Option<Model>>,
    pub cache: HashMap<usize, Model>,
}

pub fn expected(case: &Case, call: &Call) -> Expected {
    let (d, hq) = (case.d, case.hq);
    let q = call.q.to_f32_vec().unwrap();
    let freqs = call.freqs.to_f32_vec().unwrap();
    let shape = call.cache.blocks().shape().to_vec();
    let mut output = vec![None; case.batch * case.seq * hq * d];
    let mut cache = HashMap::new();
    let max_pages = call.cache.max_pages_per_seq();
    for b in 0..case.batch {
        for s in 0..case.valid[b] as usize {
            let r = b * case.seq + s;
            let pos = case.cache_lengths[b] as usize + s;
            let f: Vec<f64> = freqs[pos * d..(pos + 1) * d].iter().map(|&v| f64::from(v)).collect();
            for h in 0..hq {
                let at = (r * hq + h) * d;
                let x: Vec<f64> = q[at..at + d].iter().map(|&v| f64::from(v)).collect();
                for (i, m) in model_head(&x, &f, case.interleaved).into_iter().enumerate() {
                    output[at + i] = Some(m);
                }
            }
            let page = call.cache.lookup_table()[b * max_pages + pos / case.page_size] as usize;
            let slot = pos % case.page_size;
            // The K heads as the cache reads them (an FP8 cache's dequantized).
            let k = call.cache.read_slot(page, 0, case.layer, slot).unwrap();
            for h in 0..case.hkv {
                let at = block_index(&shape, [page, 0, case.layer, slot, h, 0]);
                let x: Vec<f64> = k[h * d..(h + 1) * d].iter().map(|&v| f64::from(v)).collect();
                for (i, m) in model_head(&x, &f, case.interleaved).into_iter().enumerate() {
                    assert!(cache.insert(at + i, m).is_none(), "the fixture gave two tokens one slot");
                }
            }
        }
    }
    Expected { output, cache }
}

/// How far a result of `dtype` may be from the reference's: one rounding
/// step of `dtype` (none for f32) plus the f32 arithmetic's error.
pub fn tolerance(dtype: DType, got: f64, want: f64, magnitude: f64) -> f64 {
    let rounding = if dtype == DType::F32 { 0.0 } else { ulp(dtype, got.abs().max(want.abs())) };
    rounding + 4.0 * magnitude / (1u64 << 24) as f64
}

/// How far the reference may be from the exact value: half a rounding step
/// of `dtype` (it rounds the f64 result once).
pub fn reference_tolerance(dtype: DType, exact: f64) -> f64 {
    ulp(dtype, exact) / 2.0 + exact.abs() / (1u64 << 24) as f64
}

/// One result of a call: its output bytes (guarded for the JIT) and cache.
pub struct Ran {
    pub output: Vec<u8>,
    pub cache: PagedKVCacheCollection,
}

pub fn run_reference(case: &Case, call: &Call) -> Ran {
    let kernel = Compiled::new(ReferenceKernel::new(case.spec()));
    let mut cache = call.cache.clone();
    let mut out = Tensor::zeros(case.dtype, &[case.batch, case.seq, case.hq, case.d]).unwrap();
    kvjit_testkit::poison(&mut out);
    let ctx = DeviceContextPtr::cpu(1).unwrap();
    kernel
        .run(
            &[&call.q, &call.freqs, &call.layer_idx, &call.valid],
            &mut [&mut cache],
            std::slice::from_mut(&mut out),
            &ctx,
        )
        .unwrap_or_else(|e| panic!("{case:?}: the reference refused: {e}"));
    Ran { output: out.as_bytes().to_vec(), cache }
}

pub fn jit_kernel(case: &Case) -> JitKernel {
    JitKernel::new(case.spec(), CaptureText::default()).unwrap_or_else(|e| panic!("{case:?}: {e}"))
}

/// Run the JIT with its output NaN-poisoned between canary guards.
pub fn run_jit(case: &Case, call: &Call, kernel: &JitKernel, ctx: &DeviceContextPtr) -> Ran {
    let mut cache = call.cache.clone();
    let count = case.batch * case.seq * case.hq * case.d;
    let mut out = Guarded::new(GUARD, &nan_bytes(case.dtype, count), GUARD);
    let tensors = [&call.q, &call.freqs, &call.layer_idx, &call.valid];
    kernel
        .run_into(&tensors, &mut [&mut cache], out.body_mut(), ctx)
        .unwrap_or_else(|e| panic!("{case:?}: the JIT refused: {e}"));
    out.assert_guards(&format!("{case:?}"));
    Ran { output: out.body().to_vec(), cache }
}

fn values(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    let n = bytes.len() / dtype.size_bytes();
    Tensor::from_le_bytes(dtype, &[n], bytes).unwrap().to_f32_vec().unwrap().into_iter().map(f64::from).collect()
}

/// Check a JIT result against the reference's and the model: outputs
/// within tolerance (padded rows exactly zero), the rotated K slots within
/// tolerance, every other cache byte — V, other layers, other slots, other
/// pages — identical to before the call, and the cache's metadata unchanged.
/// Also checks the reference against the exact model. For f32/bf16/f16
/// caches (an FP8 cache's checks are in `fp8_cache.rs`).
pub fn assert_matches(case: &Case, call: &Call, jit: &Ran, reference: &Ran) {
    assert_eq!(case.granularity, None, "FP8 caches have their own checks");
    let model = expected(case, call);
    assert_output_matches(case, &model, jit, reference);
    let before = call.cache.blocks().as_bytes();
    let shape = call.cache.blocks().shape();
    let size = case.cache_dtype.size_bytes();
    let (got, want) = (jit.cache.blocks().to_f32_vec().unwrap(), reference.cache.blocks().to_f32_vec().unwrap());
    let (got_bytes, want_bytes) = (jit.cache.blocks().as_bytes(), reference.cache.blocks().as_bytes());
    for i in 0..got.len() {
        let bytes = i * size..(i + 1) * size;
        let at = || format!("{case:?}: blocks{:?}", unravel(shape, i));
        match model.cache.get(&i) {
            Some(m) => {
                let (g, w) = (f64::from(got[i]), f64::from(want[i]));
                assert!((w - m.exact).abs() <= reference_tolerance(case.cache_dtype, m.exact), "{}: reference", at());
                let tol = tolerance(case.cache_dtype, g, w, m.magnitude);
                assert!(g.is_finite() && (g - w).abs() <= tol, "{}: jit {g} vs reference {w} (tol {tol:e})", at());
            }
            None => {
                assert!(got_bytes[bytes.clone()] == before[bytes.clone()], "{}: jit wrote it", at());
                assert!(want_bytes[bytes.clone()] == before[bytes], "{}: reference wrote it", at());
            }
        }
    }
    assert_metadata_unchanged(call, jit, reference);
}

/// The output half of [`assert_matches`]: padded rows exactly +0 in both,
/// the reference within half a rounding step of the exact model, the JIT
/// within [`tolerance`] of the reference.
pub fn assert_output_matches(case: &Case, model: &Expected, jit: &Ran, reference: &Ran) {
    let (got, want) = (values(case.dtype, &jit.output), values(case.dtype, &reference.output));
    let out_shape = [case.batch, case.seq, case.hq, case.d];
    for (i, m) in model.output.iter().enumerate() {
        let at = || format!("{case:?}: output{:?}", unravel(&out_shape, i));
        match m {
            None => {
                let size = case.dtype.size_bytes();
                assert!(jit.output[i * size..(i + 1) * size].iter().all(|&x| x == 0), "{}: padded, not +0", at());
                assert!(reference.output[i * size..(i + 1) * size].iter().all(|&x| x == 0), "{}: reference", at());
            }
            Some(m) => {
                let err = (want[i] - m.exact).abs();
                assert!(
                    err <= reference_tolerance(case.dtype, m.exact),
                    "{}: reference {} vs exact {}",
                    at(),
                    want[i],
                    m.exact
                );
                let tol = tolerance(case.dtype, got[i], want[i], m.magnitude);
                assert!(
                    got[i].is_finite() && (got[i] - want[i]).abs() <= tol,
                    "{}: jit {} vs reference {} (tol {tol:e})",
                    at(),
                    got[i],
                    want[i]
                );
            }
        }
    }
}

/// Neither run changed the cache's lengths, page table or MAX scalars.
pub fn assert_metadata_unchanged(call: &Call, jit: &Ran, reference: &Ran) {
    for ran in [jit, reference] {
        assert_eq!(ran.cache.cache_lengths(), call.cache.cache_lengths());
        assert_eq!(ran.cache.lookup_table(), call.cache.lookup_table());
        assert_eq!(ran.cache.max_seq_length, call.cache.max_seq_length);
        assert_eq!(ran.cache.max_cache_length, call.cache.max_cache_length);
    }
}

/// Draw a random case.
pub fn draw(rng: &mut StdRng) -> Case {
    let pick = |rng: &mut StdRng, items: &[usize]| *items.choose(rng).unwrap();
    let dtype = *DType::FLOATS.choose(rng).unwrap();
    let cache_dtype = *DType::FLOATS.choose(rng).unwrap();
    let d = pick(rng, &[24, 64, 72, 80, 128, 256]);
    let hkv = pick(rng, &[1, 4, 8]);
    let group = pick(rng, &[1, 4, 8]);
    let page_size = pick(rng, &[1, 2, 3, 5, 8, 16, 64, 256]);
    let batch = rng.gen_range(1..=3);
    let seq = rng.gen_range(1..=5);
    let layers = rng.gen_range(1..=3);
    let cache_lengths = (0..batch)
        .map(|_| match rng.gen_range(0..4) {
            0 => 0,
            1 => rng.gen_range(0..4),
            2 => (page_size as u32).saturating_sub(rng.gen_range(0..3)),
            _ => rng.gen_range(0..40),
        })
        .collect();
    let valid = (0..batch).map(|_| if rng.gen_bool(0.2) { 0 } else { rng.gen_range(0..=seq as u32) }).collect();
    Case {
        dtype,
        cache_dtype,
        granularity: None,
        interleaved: rng.gen_bool(0.5),
        batch,
        seq,
        hq: hkv * group,
        hkv,
        d,
        page_size,
        layers,
        layer: rng.gen_range(0..layers),
        cache_lengths,
        valid,
        extra_positions: rng.gen_range(0..3),
        extra_pages: rng.gen_range(0..3),
        seed: rng.r#gen(),
    }
}
