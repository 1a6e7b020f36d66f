//! The CUDA kernel: what holds without a GPU (it builds, validates exactly as
//! the CPU kernels do, refuses a CPU context, the committed PTX matches its
//! sources), and, on a machine with a CUDA device, the problems the CPU
//! kernels are tested with — random shapes in every dtype pair (FP8 E4M3
//! caches included, with random granularities), poisoned output, cache and
//! scales, guard regions around every device buffer, bad inputs, several
//! steps over one resident cache — checked against the reference, and the
//! E4M3 converts (hardware on sm_90, software on sm_80) against
//! `kvjit_core::fp8::e4m3_from_f32` bit for bit.
//!
//! Tests that need a device print `skipped: no CUDA device (<reason>)` and
//! return when there is none (`KVJIT_REQUIRE_CUDA=1` makes that a failure).
//! `scripts/gpu-check.sh` runs this file on a GPU machine, including the
//! ignored timing test (feature `cublas`).

use std::sync::Arc;

use kvjit_core::{
    Backend, CacheElement, CodeTier, DType, Error, KernelSpec, KvCacheParams, PagedKVCacheCollection, Target, Tensor,
};
use kvjit_cuda::{CudaDevice, KernelArg};
use kvjit_op::Compiled;
use kvjit_op::checks::StepArgs;
use kvjit_op::checks::StepDims;
use kvjit_op_fused_qkv::cuda_kernel::{PTX, PTX_MODULE, Schedule, e4m3_probe_key, variant_key};
use kvjit_op_fused_qkv::{CheckedCall, CudaKernel, FusedQkvSpec, ReferenceKernel, Sizes, check_call, reference};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::tolerance::F32_TOL_PER_K;
use kvjit_testkit::{CacheSnapshot, Guarded, Tolerance, cuda_or_skip};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Random problems per (dtype, cache dtype) pair and schedule.
const CASES_PER_PAIR: usize = 6;
/// Guard bytes on each side of every buffer in the guarded launch (a multiple
/// of 256 keeps the kernels' alignment).
const GUARD: usize = 256;

/// One call's arguments, on the host.
#[derive(Clone)]
struct Problem {
    spec: FusedQkvSpec,
    hidden: Tensor,
    weight: Arc<Tensor>,
    layer: Tensor,
    valid: Tensor,
    cache: PagedKVCacheCollection,
    output: Tensor,
}

impl Problem {
    fn inputs(&self) -> [&Tensor; 4] {
        [&self.hidden, &self.weight, &self.layer, &self.valid]
    }
}

struct Draw {
    dtype: DType,
    cache_dtype: DType,
    batch: usize,
    seq: usize,
    k: usize,
    q_dim: usize,
    hkv: usize,
    d: usize,
    page_size: usize,
    layers: usize,
    static_dims: bool,
    /// FP8 caches: values per scale (a divisor of `d`).
    g: Option<usize>,
}

fn draw(rng: &mut StdRng, dtype: DType, cache_dtype: DType, schedule: Schedule) -> Draw {
    let batch = rng.gen_range(1..=4);
    let seq = match schedule {
        Schedule::Decode => rng.gen_range(1..=16 / batch),
        Schedule::Prefill => rng.gen_range(17 / batch + 1..=200 / batch),
    };
    let mut draw = Draw {
        dtype,
        cache_dtype,
        batch,
        seq,
        k: 8 * rng.gen_range(1..=40),
        q_dim: rng.gen_range(1..=150),
        hkv: rng.gen_range(1..=4),
        d: rng.gen_range(1..=40),
        page_size: rng.gen_range(1..=16),
        layers: rng.gen_range(1..=3),
        static_dims: rng.gen_bool(0.5),
        g: None,
    };
    if cache_dtype == DType::F8E4M3 {
        let divisors: Vec<usize> = (1..=draw.d).filter(|&g| draw.d.is_multiple_of(g)).collect();
        draw.g = Some(divisors[rng.gen_range(0..divisors.len())]);
    }
    draw
}

/// A random call: shuffled page allocation, random cached history and valid
/// lengths (sequence 0 full), NaN-poisoned output and cache (an FP8 cache's
/// scales too).
fn problem(rng: &mut StdRng, d: &Draw) -> Problem {
    let kv_dim = d.hkv * d.d;
    let n = d.q_dim + 2 * kv_dim;
    let history: Vec<u32> = (0..d.batch).map(|_| rng.gen_range(0..=3 * d.page_size as u32)).collect();
    let mut valid: Vec<u32> = (0..d.batch).map(|_| rng.gen_range(0..=d.seq as u32)).collect();
    valid[0] = d.seq as u32;
    let max_pages_per_seq = (3 * d.page_size + d.seq) / d.page_size + 2;
    let num_pages = d.batch * max_pages_per_seq + 3;
    let params = KvCacheParams {
        element: CacheElement::new(d.cache_dtype, d.g).unwrap(),
        num_layers: d.layers,
        page_size: d.page_size,
        num_kv_heads: d.hkv,
        head_size: d.d,
    };
    let mut cache = PagedKVCacheCollection::new(params, num_pages, d.batch, max_pages_per_seq).unwrap();
    let mut order: Vec<u32> = (0..num_pages as u32).collect();
    order.shuffle(rng);
    cache.set_allocation_order(order).unwrap();
    cache.reserve(&history).unwrap();
    cache.advance(&history).unwrap();
    cache.reserve(&valid).unwrap();
    cache.fill_blocks_f32(f32::NAN).unwrap();
    cache.fill_scales(f32::NAN).unwrap();
    let mut output = Tensor::zeros(d.dtype, &[d.batch, d.seq, d.q_dim]).unwrap();
    output.fill_f32(f32::NAN).unwrap();
    Problem {
        spec: FusedQkvSpec {
            backend: Backend::Cuda,
            dtype: d.dtype,
            weights: d.dtype,
            cache: KvCacheParams {
                element: CacheElement::new(d.cache_dtype, d.g).unwrap(),
                num_layers: d.layers,
                page_size: d.page_size,
                num_kv_heads: d.hkv,
                head_size: d.d,
            },
            k: d.k,
            q_dim: d.q_dim,
            step: StepDims { batch: d.static_dims.then_some(d.batch), seq: d.static_dims.then_some(d.seq) },
            sizes: Sizes::Baked,
        },
        hidden: Tensor::random(d.dtype, &[d.batch, d.seq, d.k], rng, -1.0, 1.0).unwrap(),
        weight: Arc::new(Tensor::random(d.dtype, &[n, d.k], rng, -1.0, 1.0).unwrap()),
        layer: Tensor::scalar_u32(rng.gen_range(0..d.layers as u32)),
        valid: Tensor::from_vec(&[d.batch], valid).unwrap(),
        cache,
        output,
    }
}

/// What the reference writes for `p`.
fn reference_result(p: &Problem) -> (Tensor, PagedKVCacheCollection) {
    let (mut output, mut cache) = (p.output.clone(), p.cache.clone());
    reference::fused_qkv_matmul(&p.hidden, &p.weight, &mut cache, &p.layer, &p.valid, &mut output).unwrap();
    (output, cache)
}

/// `Σ_k |x_k·w_k|` for every (row, column): the scale of f32 accumulation error.
fn abs_products(p: &Problem) -> Vec<f64> {
    let x = p.hidden.to_f32_vec().unwrap();
    let w = p.weight.to_f32_vec().unwrap();
    let (k, n) = (p.spec.k, p.weight.shape()[0]);
    let m = x.len() / k;
    let mut sums = vec![0.0; m * n];
    for r in 0..m {
        for c in 0..n {
            sums[r * n + c] = (0..k).map(|i| (x[r * k + i] as f64 * w[c * k + i] as f64).abs()).sum();
        }
    }
    sums
}

/// Within [`Tolerance::RelativeToTerms`]: both sides rounded once to `store`
/// from f32 sums of the same `k` products, `abs_sum = Σ_k |x_k·w_k|`.
fn close(got: f32, want: f32, store: DType, k: usize, abs_sum: f64) -> bool {
    got.is_finite() && Tolerance::RelativeToTerms { dtype: store, k, abs_sum }.allows(got.into(), want.into())
}

/// Compare a CUDA result with the reference: Q everywhere, K/V where the
/// reference wrote (within tolerance), and every cache element the reference
/// left poisoned byte-identical.
fn assert_matches_reference(p: &Problem, output: &Tensor, cache: &PagedKVCacheCollection, what: &str) {
    let (ref_out, ref_cache) = reference_result(p);
    let sums = abs_products(p);
    let n = p.weight.shape()[0];
    let (q_dim, k) = (p.spec.q_dim, p.spec.k);
    let (got, want) = (output.to_f32_vec().unwrap(), ref_out.to_f32_vec().unwrap());
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        let (r, c) = (i / q_dim, i % q_dim);
        assert!(close(g, w, p.spec.dtype, k, sums[r * n + c]), "{what}: output[row {r}, col {c}] = {g}, reference {w}");
    }
    if p.spec.cache.dtype() == DType::F8E4M3 {
        assert_fp8_cache_matches_reference(p, cache, &ref_cache, &sums, what);
        assert_eq!(cache.cache_lengths(), p.cache.cache_lengths(), "{what}: the op never changes cache lengths");
        assert_eq!(cache.lookup_table(), p.cache.lookup_table(), "{what}");
        return;
    }
    let elem = p.spec.cache.dtype().size_bytes();
    let (poisoned, got_bytes, want_bytes) =
        (p.cache.blocks().as_bytes(), cache.blocks().as_bytes(), ref_cache.blocks().as_bytes());
    let (got, want) = (cache.blocks().to_f32_vec().unwrap(), ref_cache.blocks().to_f32_vec().unwrap());
    // Which (row, column) of C each written element came from, for its tolerance.
    let CheckedCall { shape, row_offsets: offsets } = check_call(
        &p.hidden,
        &p.weight,
        StepArgs { kv_collection: &p.cache, layer_idx: &p.layer, valid_lengths: &p.valid },
    )
    .unwrap();
    let kv_stride = p.spec.cache.num_layers * p.spec.cache.page_size * shape.kv_dim;
    let mut source = std::collections::HashMap::new();
    for (r, &off) in offsets.iter().enumerate().filter(|(_, o)| **o >= 0) {
        for j in 0..2 * shape.kv_dim {
            let (kv, j_in) = (j / shape.kv_dim, j % shape.kv_dim);
            source.insert(off as usize + kv * kv_stride + j_in, (r, q_dim + j));
        }
    }
    for i in 0..got.len() {
        let bytes = i * elem..(i + 1) * elem;
        match source.get(&i) {
            Some(&(r, c)) => assert!(
                close(got[i], want[i], p.spec.cache.dtype(), k, sums[r * n + c]),
                "{what}: cache element {i} (row {r}, col {c}) = {}, reference {}",
                got[i],
                want[i]
            ),
            None => {
                assert_eq!(want_bytes[bytes.clone()], poisoned[bytes.clone()], "{what}: reference wrote element {i}");
                assert_eq!(
                    got_bytes[bytes.clone()],
                    poisoned[bytes],
                    "{what}: cache element {i} changed; no token owns it"
                );
            }
        }
    }
    assert_eq!(cache.cache_lengths(), p.cache.cache_lengths(), "{what}: the op never changes cache lengths");
    assert_eq!(cache.lookup_table(), p.cache.lookup_table(), "{what}");
}

/// An FP8 cache against the reference's, per g-block of every written row:
/// the scales within the f32 accumulation bound of the block's largest
/// value (/ 448), and every dequantized element `code · scale` within half
/// an E4M3 step at the GPU's scale (2⁻⁴ relative, or 2⁻¹⁰·scale among the
/// subnormal codes) plus the accumulation bound of the reference's f32
/// value; every code and scale no token owns byte-identical to the poison.
/// (The GPU's f32 C may differ from the reference's in the last bits — a
/// different summation order — so codes may differ by one step where C/scale
/// sits near a rounding boundary: the values are checked, not the codes.)
fn assert_fp8_cache_matches_reference(
    p: &Problem,
    cache: &PagedKVCacheCollection,
    ref_cache: &PagedKVCacheCollection,
    sums: &[f64],
    what: &str,
) {
    use kvjit_core::fp8::e4m3_to_f32;
    let g = p.spec.cache.scale_granularity().expect("an FP8 spec has a granularity");
    let CheckedCall { shape, row_offsets: offsets } = check_call(
        &p.hidden,
        &p.weight,
        StepArgs { kv_collection: &p.cache, layer_idx: &p.layer, valid_lengths: &p.valid },
    )
    .unwrap();
    let (n, q_dim, k, kv_dim) = (p.weight.shape()[0], p.spec.q_dim, p.spec.k, shape.kv_dim);
    let kv_stride = p.spec.kv_stride();
    let (codes, ref_codes, poisoned) =
        (cache.blocks().as_bytes(), ref_cache.blocks().as_bytes(), p.cache.blocks().as_bytes());
    let (scales, ref_scales, poisoned_scales) = (
        cache.scales().unwrap().to_f32_vec().unwrap(),
        ref_cache.scales().unwrap().to_f32_vec().unwrap(),
        p.cache.scales().unwrap().as_bytes(),
    );
    // The reference's f32 C of the K/V columns (its output holds only Q).
    let x = p.hidden.to_f32_vec().unwrap();
    let w = p.weight.to_f32_vec().unwrap();
    let c_ref = |r: usize, c: usize| -> f32 {
        (0..k).fold(0f32, |acc, i| acc + x[r * k + i] * w[c * k + i]) // the reference's order
    };
    let mut written = vec![false; codes.len()];
    let mut scale_written = vec![false; scales.len()];
    for (r, &off) in offsets.iter().enumerate().filter(|(_, o)| **o >= 0) {
        for b in 0..2 * kv_dim / g {
            let j = b * g;
            let at = off as usize + if j < kv_dim { j } else { kv_stride + j - kv_dim };
            let (scale, ref_scale) = (scales[at / g], ref_scales[at / g]);
            scale_written[at / g] = true;
            let acc = |c: usize| k as f64 * F32_TOL_PER_K * sums[r * n + c];
            let worst_acc = (0..g).map(|e| acc(q_dim + j + e)).fold(0.0, f64::max);
            let scale_bound = worst_acc / 448.0 + f64::from(ref_scale) * 2f64.powi(-22) + 1e-30;
            assert!(
                (f64::from(scale) - f64::from(ref_scale)).abs() <= scale_bound,
                "{what}: row {r} g-block {b}: scale {scale}, reference {ref_scale} (bound {scale_bound:e})"
            );
            for e in 0..g {
                let c = q_dim + j + e;
                let want = f64::from(c_ref(r, c));
                let got = f64::from(e4m3_to_f32(codes[at + e])) * f64::from(scale);
                let bound = (2f64.powi(-4) * (want.abs() + acc(c)) + 2f64.powi(-10) * f64::from(scale) + acc(c))
                    * (1.0 + 1e-6)
                    + 1e-30;
                assert!(
                    (got - want).abs() <= bound,
                    "{what}: row {r} col {c}: code {:#04x} · scale {scale} = {got}, reference value {want} (reference \
                     code {:#04x} · {ref_scale}; bound {bound:e})",
                    codes[at + e],
                    ref_codes[at + e]
                );
                written[at + e] = true;
            }
        }
    }
    for (i, &mine) in written.iter().enumerate() {
        if !mine {
            assert_eq!(ref_codes[i], poisoned[i], "{what}: reference wrote code {i}");
            assert_eq!(codes[i], poisoned[i], "{what}: code {i} changed; no token owns it");
        }
    }
    for (i, &mine) in scale_written.iter().enumerate() {
        if !mine {
            assert_eq!(scales[i].to_le_bytes(), poisoned_scales[4 * i..4 * i + 4], "{what}: scale {i} changed");
        }
    }
}

/// Byte-for-byte equality of everything a call may change in a cache (NaN
/// poison compares equal to itself here, unlike with `==` on the values),
/// an FP8 cache's scales included.
fn unchanged(after: &PagedKVCacheCollection, before: &PagedKVCacheCollection) -> bool {
    let scales = |c: &PagedKVCacheCollection| c.scales().map(|s| s.as_bytes().to_vec());
    CacheSnapshot::take(after) == CacheSnapshot::take(before) && scales(after) == scales(before)
}

fn run_cuda(
    kernel: &Compiled<CudaKernel>,
    p: &Problem,
    ctx: &DeviceContextPtr,
) -> kvjit_core::Result<(Tensor, PagedKVCacheCollection)> {
    let (mut output, mut cache) = (p.output.clone(), p.cache.clone());
    kernel.run(&p.inputs(), &mut [&mut cache], std::slice::from_mut(&mut output), ctx)?;
    Ok((output, cache))
}

// ------------------------------------------------------------- without a GPU

#[test]
fn the_cuda_kernel_builds_and_validates_like_the_cpu_kernels_without_a_gpu() {
    let mut rng = StdRng::seed_from_u64(1);
    let d = draw(&mut rng, DType::BF16, DType::F16, Schedule::Prefill);
    let p = problem(&mut rng, &d);
    let cuda = Compiled::new(CudaKernel::new(p.spec, Some(p.weight.clone())).unwrap());
    let reference =
        Compiled::new(ReferenceKernel::new(FusedQkvSpec { backend: Backend::Cpu(CodeTier::Cranelift), ..p.spec }));
    assert_eq!(cuda.implementation(), "cuda");
    assert_eq!(cuda.key().to_string(), p.spec.key().to_string());
    assert_eq!(cuda.check(&p.inputs(), &[&p.cache]).unwrap(), reference.check(&p.inputs(), &[&p.cache]).unwrap());

    // The same refusal, word for word, for each kind of bad argument.
    let mut bad = p.clone();
    bad.layer = Tensor::scalar_u32(p.spec.cache.num_layers as u32);
    let mut too_long = p.clone();
    too_long.valid =
        Tensor::from_vec(&[p.hidden.shape()[0]], vec![p.hidden.shape()[1] as u32 + 1; p.hidden.shape()[0]]).unwrap();
    let mut wrong_dtype = p.clone();
    wrong_dtype.hidden = Tensor::zeros(DType::F32, p.hidden.shape()).unwrap();
    for (what, bad) in [("layer", &bad), ("valid length", &too_long), ("dtype", &wrong_dtype)] {
        let cuda_err = cuda.check(&bad.inputs(), &[&bad.cache]).unwrap_err().to_string();
        let ref_err = reference.check(&bad.inputs(), &[&bad.cache]).unwrap_err().to_string();
        assert_eq!(cuda_err, ref_err, "{what}");
    }
}

/// The FP8 comparison the GPU tests use, checked where it can be without a
/// GPU: it accepts the reference's own result, and rejects a code two steps
/// off, a scale 1% off, and a code or a scale changed where no token wrote.
#[test]
fn the_fp8_comparison_accepts_the_reference_and_rejects_wrong_codes_and_scales() {
    let mut rng = StdRng::seed_from_u64(11);
    for schedule in Schedule::ALL {
        let d = draw(&mut rng, DType::BF16, DType::F8E4M3, schedule);
        let p = problem(&mut rng, &d);
        let g = d.g.unwrap();
        let (output, cache) = reference_result(&p);
        assert_matches_reference(&p, &output, &cache, "the reference itself");
        let CheckedCall { shape, row_offsets: offsets } = check_call(
            &p.hidden,
            &p.weight,
            StepArgs { kv_collection: &p.cache, layer_idx: &p.layer, valid_lengths: &p.valid },
        )
        .unwrap();
        let written = *offsets.iter().find(|&&o| o >= 0).unwrap() as usize + shape.kv_dim - 1; // a K element
        // The poison (NaN codes and scales) is what no token wrote.
        let untouched = (0..cache.blocks().as_bytes().len()).find(|&i| cache.blocks().as_bytes()[i] == 0x7f);
        let rejects = |edit: &dyn Fn(&mut PagedKVCacheCollection), what: &str| {
            let mut bad = cache.clone();
            edit(&mut bad);
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                assert_matches_reference(&p, &output, &bad, what);
            }));
            assert!(caught.is_err(), "{what}: accepted");
        };
        rejects(&|c| c.blocks_bytes_mut()[written] ^= 0x02, "a code two steps off");
        rejects(
            &|c| {
                let scales = c.blocks_and_scales_mut().1.unwrap();
                scales[written / g] *= 1.01;
            },
            "a scale 1% off",
        );
        if let Some(i) = untouched {
            rejects(&|c| c.blocks_bytes_mut()[i] ^= 0x01, "a code no token owns");
        }
        let unwritten_scale = cache.scales().unwrap().to_f32_vec().unwrap().iter().position(|v| v.is_nan());
        if let Some(i) = unwritten_scale {
            rejects(&|c| c.blocks_and_scales_mut().1.unwrap()[i] = 1.0, "a scale no token owns");
        }
    }
}

#[test]
fn running_on_a_cpu_context_is_an_error_that_writes_nothing() {
    let mut rng = StdRng::seed_from_u64(2);
    let d = draw(&mut rng, DType::F32, DType::F32, Schedule::Decode);
    let p = problem(&mut rng, &d);
    let kernel = Compiled::new(CudaKernel::new(p.spec, None).unwrap());
    let (mut output, mut cache) = (p.output.clone(), p.cache.clone());
    let err = kernel
        .run(&p.inputs(), &mut [&mut cache], std::slice::from_mut(&mut output), &DeviceContextPtr::cpu(1).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("runs on a CUDA device context, not a cpu one"), "{err}");
    assert!(output.as_bytes() == p.output.as_bytes(), "output written");
    assert!(unchanged(&cache, &p.cache), "cache written");
}

#[test]
fn a_cuda_context_is_a_device_or_a_typed_reason() {
    match DeviceContextPtr::cuda(0) {
        Ok(ctx) => {
            let device = ctx.cuda_context().expect("a CUDA context").device();
            eprintln!(
                "CUDA device 0: {} (sm_{}{})",
                device.name(),
                device.compute_capability().0,
                device.compute_capability().1
            );
            assert_eq!(ctx.target(), Target::Cuda);
            assert!(ctx.cpu_context().is_none());
        }
        Err(e) => {
            let message = e.to_string();
            assert!(message.starts_with("CUDA target unavailable: "), "{message}");
            assert!(kvjit_runtime::cuda_availability().is_err());
            eprintln!("skipped: no CUDA device ({message})");
        }
    }
}

/// Every `.cu` in `cuda/` has both PTX images, generated from its current
/// text (the unit test in `cuda_kernel.rs` covers the embedded one; this one
/// covers the baseline the GPU check embeds too).
#[test]
fn every_cuda_source_has_current_ptx_for_both_architectures() {
    use sha2::{Digest, Sha256};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let mut sources = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "cu") {
            continue;
        }
        sources += 1;
        let sha: String = Sha256::digest(std::fs::read(&path).unwrap()).iter().map(|b| format!("{b:02x}")).collect();
        for arch in [80, 90] {
            let ptx_path = path.with_extension(format!("compute_{arch}.ptx"));
            let ptx = std::fs::read_to_string(&ptx_path).unwrap_or_else(|e| panic!("{}: {e}", ptx_path.display()));
            assert!(
                ptx.lines().take(5).any(|l| l == format!("// kvjit-source-sha256: {sha}")),
                "{} is stale: run scripts/gen-ptx.sh",
                ptx_path.display()
            );
        }
    }
    assert!(sources >= 2, "fused_qkv.cu and baseline.cu");
}

// ------------------------------------------------------------- on a GPU

#[test]
fn cuda_matches_the_reference_on_random_shapes() {
    let Some(ctx) = cuda_or_skip() else { return };
    let mut rng = StdRng::seed_from_u64(3);
    let floats = [DType::F32, DType::BF16, DType::F16];
    for dtype in floats {
        for cache_dtype in [DType::F32, DType::BF16, DType::F16, DType::F8E4M3] {
            for schedule in Schedule::ALL {
                for case in 0..CASES_PER_PAIR {
                    let d = draw(&mut rng, dtype, cache_dtype, schedule);
                    let p = problem(&mut rng, &d);
                    let what = format!(
                        "{dtype}/kv{cache_dtype} {} case {case}: B={} S={} K={} q={} hkv={} d={} g={:?} p={} L={} \
                         static={}",
                        schedule.name(),
                        d.batch,
                        d.seq,
                        d.k,
                        d.q_dim,
                        d.hkv,
                        d.d,
                        d.g,
                        d.page_size,
                        d.layers,
                        d.static_dims
                    );
                    // Half the cases with the weight as a build-time constant.
                    let constant = case % 2 == 0;
                    let kernel = Compiled::new(CudaKernel::new(p.spec, constant.then(|| p.weight.clone())).unwrap());
                    let (output, cache) = run_cuda(&kernel, &p, &ctx).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_matches_reference(&p, &output, &cache, &what);
                    // A second call on the same kernel and cache (resident
                    // copy, cached constant weight) gives the same bytes.
                    let (again, again_cache) = run_cuda(&kernel, &p, &ctx).unwrap();
                    assert_eq!(again.as_bytes(), output.as_bytes(), "{what}: second run");
                    assert_eq!(again_cache.blocks().as_bytes(), cache.blocks().as_bytes(), "{what}: second run");
                    let scales = |c: &PagedKVCacheCollection| c.scales().map(|s| s.as_bytes().to_vec());
                    assert_eq!(scales(&again_cache), scales(&cache), "{what}: second run");
                }
            }
        }
    }
}

#[test]
fn bad_inputs_on_the_gpu_path_write_nothing() {
    let Some(ctx) = cuda_or_skip() else { return };
    let mut rng = StdRng::seed_from_u64(4);
    for cache_dtype in [DType::BF16, DType::F8E4M3] {
        let d = draw(&mut rng, DType::BF16, cache_dtype, Schedule::Prefill);
        let p = problem(&mut rng, &d);
        bad_inputs_write_nothing(&ctx, &p);
    }
}

fn bad_inputs_write_nothing(ctx: &DeviceContextPtr, p: &Problem) {
    let kernel = Compiled::new(CudaKernel::new(p.spec, None).unwrap());
    let mut cases = Vec::new();
    let mut bad = p.clone();
    bad.layer = Tensor::scalar_u32(99);
    cases.push(("layer out of range", bad));
    let mut bad = p.clone();
    let b = p.hidden.shape()[0];
    bad.valid = Tensor::from_vec(&[b], vec![p.hidden.shape()[1] as u32 + 1; b]).unwrap();
    cases.push(("valid length too long", bad));
    let mut bad = p.clone();
    let first_page = p.cache.cache_lengths()[0] as usize / p.spec.cache.page_size; // sequence 0 writes a token there
    bad.cache.lookup_table_mut()[first_page] = p.cache.num_pages() as u32 + 5;
    cases.push(("page not in the cache", bad));
    if b > 1 {
        // Two sequences pointing at the same pages: two writers of one slot.
        let mut bad = p.clone();
        let width = p.cache.max_pages_per_seq();
        let first: Vec<u32> = bad.cache.lookup_table()[..width].to_vec();
        bad.cache.lookup_table_mut()[width..2 * width].copy_from_slice(&first);
        let lengths = bad.cache.cache_lengths()[0];
        bad.cache.cache_lengths_mut()[1] = lengths;
        let mut valid = bad.valid.as_slice::<u32>().unwrap().to_vec();
        valid[1] = 1;
        bad.valid = Tensor::from_vec(&[b], valid).unwrap();
        cases.push(("slot collision", bad));
    }
    for (what, bad) in cases {
        let (mut output, mut cache) = (bad.output.clone(), bad.cache.clone());
        let err = kernel.run(&bad.inputs(), &mut [&mut cache], std::slice::from_mut(&mut output), ctx).unwrap_err();
        let (mut ref_out, mut ref_cache) = (bad.output.clone(), bad.cache.clone());
        let ref_err =
            reference::fused_qkv_matmul(&bad.hidden, &bad.weight, &mut ref_cache, &bad.layer, &bad.valid, &mut ref_out)
                .unwrap_err();
        assert_eq!(err.to_string(), ref_err.to_string(), "{what}");
        assert!(!matches!(err, Error::Io { .. }), "{what}: refused on the host, not by the device");
        assert!(output.as_bytes() == bad.output.as_bytes(), "{what}: output written");
        assert!(unchanged(&cache, &bad.cache), "{what}: cache written");
    }
}

/// A prefill and decode steps through two kernels (two layers) sharing one
/// cache, whose blocks (and an FP8 cache's scales) stay resident on the
/// device: after every step the host cache equals the reference's, step
/// after step; a bf16 cache, then an FP8 one with g = 8.
#[test]
fn steps_over_one_resident_cache_match_the_reference() {
    let Some(ctx) = cuda_or_skip() else { return };
    for (cache_dtype, g) in [(DType::BF16, None), (DType::F8E4M3, Some(8))] {
        steps_over_one_resident_cache(&ctx, cache_dtype, g);
    }
}

fn steps_over_one_resident_cache(ctx: &DeviceContextPtr, cache_dtype: DType, g: Option<usize>) {
    let mut rng = StdRng::seed_from_u64(5);
    let (batch, k, q_dim, hkv, d, page_size, layers) = (3, 64, 64, 2, 16, 4, 2);
    let params = KvCacheParams {
        element: CacheElement::new(cache_dtype, g).unwrap(),
        num_layers: layers,
        page_size,
        num_kv_heads: hkv,
        head_size: d,
    };
    let mut cache = PagedKVCacheCollection::new(params, 40, batch, 12).unwrap();
    let mut order: Vec<u32> = (0..40).collect();
    order.shuffle(&mut rng);
    cache.set_allocation_order(order).unwrap();
    cache.fill_blocks_f32(f32::NAN).unwrap();
    cache.fill_scales(f32::NAN).unwrap();
    let weights: Vec<Arc<Tensor>> = (0..layers)
        .map(|_| Arc::new(Tensor::random(DType::BF16, &[q_dim + 2 * hkv * d, k], &mut rng, -1.0, 1.0).unwrap()))
        .collect();
    let spec = FusedQkvSpec {
        backend: Backend::Cuda,
        dtype: DType::BF16,
        weights: DType::BF16,
        cache: KvCacheParams {
            element: CacheElement::new(cache_dtype, g).unwrap(),
            num_layers: layers,
            page_size,
            num_kv_heads: hkv,
            head_size: d,
        },
        k,
        q_dim,
        step: StepDims { batch: None, seq: None },
        sizes: Sizes::Baked,
    };
    let kernels: Vec<Compiled<CudaKernel>> =
        weights.iter().map(|w| Compiled::new(CudaKernel::new(spec, Some(w.clone())).unwrap())).collect();
    // (seq, valid lengths): a padded prefill, then three decode steps.
    let steps: [(usize, Vec<u32>); 4] =
        [(20, vec![20, 7, 13]), (1, vec![1, 1, 1]), (1, vec![1, 0, 1]), (1, vec![1, 1, 1])];
    for (step, (seq, valid)) in steps.iter().enumerate() {
        cache.reserve(valid).unwrap();
        let hidden = Tensor::random(DType::BF16, &[batch, *seq, k], &mut rng, -1.0, 1.0).unwrap();
        let valid_t = Tensor::from_vec(&[batch], valid.clone()).unwrap();
        for (layer, kernel) in kernels.iter().enumerate() {
            // The reference starts from exactly what the previous CUDA calls left in the host cache.
            let p = Problem {
                spec,
                hidden: hidden.clone(),
                weight: weights[layer].clone(),
                layer: Tensor::scalar_u32(layer as u32),
                valid: valid_t.clone(),
                cache: cache.clone(),
                output: Tensor::zeros(DType::BF16, &[batch, *seq, q_dim]).unwrap(),
            };
            let mut output = p.output.clone();
            kernel.run(&p.inputs(), &mut [&mut cache], std::slice::from_mut(&mut output), ctx).unwrap();
            assert_matches_reference(&p, &output, &cache, &format!("kv{cache_dtype}: step {step} layer {layer}"));
        }
        cache.advance(valid).unwrap();
    }
}

/// Every device buffer of a launch sits between guard bytes that must stay
/// untouched; the fused kernel is launched directly, each schedule, with
/// offsets from the same validation `run` uses.
#[test]
fn guard_regions_around_every_device_buffer_stay_untouched() {
    let Some(ctx) = cuda_or_skip() else { return };
    let device = ctx.cuda_context().unwrap().device().clone();
    let mut rng = StdRng::seed_from_u64(6);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for schedule in Schedule::ALL {
            let mut d = draw(&mut rng, dtype, DType::BF16, schedule);
            d.q_dim |= 1; // odd: unpaired stores at the segment edges
            let p = problem(&mut rng, &d);
            let what = format!("{dtype} {}", schedule.name());
            let (output, blocks) = guarded_launch(&device, &p, schedule, &what);
            let mut cache = p.cache.clone();
            cache.blocks_bytes_mut().copy_from_slice(&blocks);
            let output = Tensor::from_le_bytes(dtype, p.output.shape(), &output).unwrap();
            assert_matches_reference(&p, &output, &cache, &what);
        }
    }
    // FP8 caches: codes, scales, the f32 staging buffer and the counters too.
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for schedule in Schedule::ALL {
            let mut d = draw(&mut rng, dtype, DType::F8E4M3, schedule);
            d.q_dim |= 1;
            let p = problem(&mut rng, &d);
            let what = format!("{dtype}/kvf8e4m3 g={:?} {}", d.g, schedule.name());
            let (output, blocks, scales) = guarded_fp8_launch(&device, &p, schedule, &what);
            let mut cache = p.cache.clone();
            cache.blocks_bytes_mut().copy_from_slice(&blocks);
            let shape = p.cache.scales().unwrap().shape().to_vec();
            cache.set_scales(Tensor::from_le_bytes(DType::F32, &shape, &scales).unwrap()).unwrap();
            let output = Tensor::from_le_bytes(dtype, p.output.shape(), &output).unwrap();
            assert_matches_reference(&p, &output, &cache, &what);
        }
    }
}

/// [`guarded_launch`] of an FP8 variant: returns output, codes and scales
/// bytes after checking every guard (scratch and counters included) and
/// that the counters are back to zero.
fn guarded_fp8_launch(
    device: &Arc<CudaDevice>,
    p: &Problem,
    schedule: Schedule,
    what: &str,
) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let g = p.spec.cache.scale_granularity().unwrap();
    let CheckedCall { shape, row_offsets: offsets } = check_call(
        &p.hidden,
        &p.weight,
        StepArgs { kv_collection: &p.cache, layer_idx: &p.layer, valid_lengths: &p.valid },
    )
    .unwrap();
    let offset_bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
    let rows = shape.batch * shape.seq;
    let counters = rows.div_ceil(64) * (2 * shape.kv_dim / g);
    let hosts = [
        guarded(p.hidden.as_bytes()),
        guarded(p.weight.as_bytes()),
        guarded(p.output.as_bytes()),
        guarded(p.cache.blocks().as_bytes()),
        guarded(p.cache.scales().unwrap().as_bytes()),
        guarded(&offset_bytes),
        guarded(&vec![0xff; rows * 2 * shape.kv_dim * 4]), // the f32 staging buffer, NaN
        guarded(&vec![0; counters * 4]),                   // counters start at zero
    ];
    let mut buffers = Vec::new();
    for host in &hosts {
        let mut buffer = device.alloc(host.all().len()).unwrap();
        device.upload(host.all(), &mut buffer).unwrap();
        buffers.push(buffer);
    }
    let at = |i: usize| KernelArg::Address(buffers[i].address() + GUARD as u64);
    let kv_stride = p.spec.kv_stride();
    let function = device.function(PTX_MODULE, &PTX, &variant_key(&p.spec, schedule).symbol()).unwrap();
    let args = [
        at(0),
        at(1),
        at(2),
        at(3),
        at(4),
        at(5),
        KernelArg::I32(rows as i32),
        KernelArg::I32(shape.k as i32),
        KernelArg::I32(shape.n as i32),
        KernelArg::I32(shape.q_dim as i32),
        KernelArg::I32(shape.kv_dim as i32),
        KernelArg::I64(kv_stride as i64),
        KernelArg::I32(g as i32),
        at(6),
        at(7),
    ];
    // SAFETY: the FP8 variants' parameter list (x, w, out, blocks, scales,
    // row_off, M, K, N, q_dim, kv_dim, kv_stride, g, scratch, counters) for
    // the problem's compute dtype; every pointer is GUARD bytes into a
    // buffer holding the whole tensor after it: the scales of the cache
    // (g divides D), a staging buffer of M·2·kv_dim f32, ceil(M / 64)·2·
    // kv_dim / g zeroed counters; offsets from the `check_call` that accepted
    // the call; K % 8 == 0; decode gets at most 16 rows.
    unsafe { device.launch(&function, schedule.launch_shape(p.spec.dtype, rows, shape.n), &args) }.unwrap();
    let mut back = hosts.clone();
    for (buffer, host) in buffers.iter().zip(&mut back) {
        host.all_mut().fill(0x55); // a download that wrote nothing fails the guards
        device.download(buffer, host.all_mut()).unwrap();
    }
    device.synchronize().unwrap();
    for (i, host) in back.iter().enumerate() {
        host.assert_guards(&format!("{what}: buffer {i}"));
        if i < 2 || i == 5 || i == 7 {
            assert!(host == &hosts[i], "{what}: buffer {i} changed (the counters must end at zero)");
        }
    }
    (back[2].body().to_vec(), back[3].body().to_vec(), back[4].body().to_vec())
}

/// Both E4M3 converts of the kernels, on the GPU, against
/// `kvjit_core::fp8::e4m3_from_f32`: the architecture's (`cvt.rn.satfinite.
/// e4m3x2.f32` on sm_90; the software one below that) and the software one
/// the sm_80 variants use, on every (sign, exponent, top 11 mantissa bits)
/// with the low 12 bits 0, 1, 0x7ff, 0x800, 0xfff (every E4M3 tie and its
/// neighbours), special values and a million random bit patterns. Bit for
/// bit, except the sign of the hardware's NaN code, which PTX does not
/// specify: it is reported (the kernels never feed it a negative NaN: GPU
/// arithmetic returns the positive canonical NaN).
#[test]
fn e4m3_converts_on_the_gpu_match_the_reference() {
    use kvjit_core::fp8::e4m3_from_f32;
    let Some(ctx) = cuda_or_skip() else { return };
    let device = ctx.cuda_context().unwrap().device().clone();
    let mut values: Vec<f32> = vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, 448.0, 464.0];
    for top in 0u32..1 << 20 {
        for low in [0u32, 1, 0x7ff, 0x800, 0xfff] {
            values.push(f32::from_bits(top << 12 | low));
        }
    }
    let mut rng = StdRng::seed_from_u64(10);
    values.extend((0..1_000_000).map(|_| f32::from_bits(rng.r#gen())));
    let n = values.len();
    let input: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut in_dev = device.alloc(input.len()).unwrap();
    device.upload(&input, &mut in_dev).unwrap();
    let (hw_dev, sw_dev) = (device.alloc(n).unwrap(), device.alloc(n).unwrap());
    let probe = device.function(PTX_MODULE, &PTX, &e4m3_probe_key().symbol()).unwrap();
    let args =
        [KernelArg::Buffer(&in_dev), KernelArg::Buffer(&hw_dev), KernelArg::Buffer(&sw_dev), KernelArg::I32(n as i32)];
    let shape = kvjit_cuda::LaunchShape { grid: (4096, 1, 1), block: (256, 1, 1) };
    // SAFETY: the probe's parameters (in, hw, sw, n): n f32 in, n bytes out
    // each (a grid-stride loop bounded by n).
    unsafe { device.launch(&probe, shape, &args) }.unwrap();
    let (mut hw, mut sw) = (vec![0u8; n], vec![0u8; n]);
    device.download(&hw_dev, &mut hw).unwrap();
    device.download(&sw_dev, &mut sw).unwrap();
    device.synchronize().unwrap();
    let (major, minor) = device.compute_capability();
    let mut nan_codes = std::collections::BTreeMap::new();
    for (i, &v) in values.iter().enumerate() {
        let want = e4m3_from_f32(v);
        assert_eq!(sw[i], want, "software convert of {v:e} ({:#010x})", v.to_bits());
        if v.is_nan() {
            assert_eq!(hw[i] & 0x7f, 0x7f, "sm_{major}{minor} convert of NaN ({:#010x})", v.to_bits());
            *nan_codes.entry((v.is_sign_negative(), hw[i])).or_insert(0usize) += 1;
        } else {
            assert_eq!(hw[i], want, "sm_{major}{minor} convert of {v:e} ({:#010x})", v.to_bits());
        }
    }
    eprintln!(
        "sm_{major}{minor}: {n} values; NaN codes of the {} convert (negative input?, code) -> count: {nan_codes:?}",
        if major >= 9 { "hardware" } else { "software" }
    );
}

fn guarded(data: &[u8]) -> Guarded {
    Guarded::new(GUARD, data, GUARD)
}

/// Launch `schedule`'s variant on guarded copies of `p`; return the output
/// and cache bytes after checking every guard.
fn guarded_launch(device: &Arc<CudaDevice>, p: &Problem, schedule: Schedule, what: &str) -> (Vec<u8>, Vec<u8>) {
    let CheckedCall { shape, row_offsets: offsets } = check_call(
        &p.hidden,
        &p.weight,
        StepArgs { kv_collection: &p.cache, layer_idx: &p.layer, valid_lengths: &p.valid },
    )
    .unwrap();
    let offset_bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
    let hosts = [
        guarded(p.hidden.as_bytes()),
        guarded(p.weight.as_bytes()),
        guarded(p.output.as_bytes()),
        guarded(p.cache.blocks().as_bytes()),
        guarded(&offset_bytes),
    ];
    let mut buffers = Vec::new();
    for host in &hosts {
        let mut buffer = device.alloc(host.all().len()).unwrap();
        device.upload(host.all(), &mut buffer).unwrap();
        buffers.push(buffer);
    }
    let at = |i: usize| KernelArg::Address(buffers[i].address() + GUARD as u64);
    let rows = shape.batch * shape.seq;
    let kv_stride = p.spec.cache.num_layers * p.spec.cache.page_size * shape.kv_dim;
    let function = device.function(PTX_MODULE, &PTX, &variant_key(&p.spec, schedule).symbol()).unwrap();
    let args = [
        at(0),
        at(1),
        at(2),
        at(3),
        at(4),
        KernelArg::I32(rows as i32),
        KernelArg::I32(shape.k as i32),
        KernelArg::I32(shape.n as i32),
        KernelArg::I32(shape.q_dim as i32),
        KernelArg::I32(shape.kv_dim as i32),
        KernelArg::I64(kv_stride as i64),
    ];
    // SAFETY: the arguments follow the fused kernels' parameter list for
    // this variant's dtypes (the problem's); every pointer is GUARD bytes
    // into a buffer holding the whole tensor after it (uploaded above);
    // `offsets` come from the `check_call` that accepted the
    // call; K % 8 == 0 (drawn so); the decode schedule gets at most 16 rows.
    unsafe { device.launch(&function, schedule.launch_shape(p.spec.dtype, rows, shape.n), &args) }.unwrap();
    let mut back = hosts.clone();
    for (buffer, host) in buffers.iter().zip(&mut back) {
        host.all_mut().fill(0); // a download that wrote nothing fails the guards
        device.download(buffer, host.all_mut()).unwrap();
    }
    device.synchronize().unwrap();
    for (i, host) in back.iter().enumerate() {
        host.assert_guards(&format!("{what}: buffer {i}"));
        if i != 2 && i != 3 {
            assert!(host == &hosts[i], "{what}: input buffer {i} changed");
        }
    }
    (back[2].body().to_vec(), back[3].body().to_vec())
}

// ------------------------------------------------------------- timing

/// The 8B QKV shape (K = 4096, q_dim = 4096, 8 KV heads of 128, bf16, page
/// size 16) at M = 1, 16, 256, 2048: the fused kernel against cuBLAS GEMM
/// into `[M, N]` plus a scatter kernel, both timed with CUDA events (mean of
/// 20 launches after 3 warm-ups), and `Kernel::run` end to end (host
/// validation, uploads, downloads) with a wall clock. Decode is compared
/// with the device-to-device copy bandwidth measured here.
#[cfg(feature = "cublas")]
#[test]
#[ignore = "GPU timing; scripts/gpu-check.sh runs it"]
fn time_8b_qkv_against_cublas_gemm_plus_scatter() {
    use kvjit_cuda::cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
    use kvjit_cuda::{DeviceBuffer, LaunchShape, PtxImage};

    let Some(ctx) = cuda_or_skip() else { return };
    let device = ctx.cuda_context().unwrap().device().clone();
    const BASELINE: [PtxImage; 2] = [
        PtxImage { arch: 80, ptx: include_str!("../cuda/baseline.compute_80.ptx") },
        PtxImage { arch: 90, ptx: include_str!("../cuda/baseline.compute_90.ptx") },
    ];
    let (k, q_dim, hkv, d, page_size) = (4096usize, 4096usize, 8usize, 128usize, 16usize);
    let kv_dim = hkv * d;
    let n = q_dim + 2 * kv_dim;
    let (warmup, iters) = (3, 20);
    let mut rng = StdRng::seed_from_u64(8);

    // HBM copy bandwidth: 2 GiB read + written by a device-to-device copy.
    let bytes = 1usize << 30;
    let src = device.alloc(bytes).unwrap();
    let mut dst = device.alloc(bytes).unwrap();
    device.copy(&src, &mut dst, bytes).unwrap();
    let ms = device.elapsed_ms(|| (0..5).try_for_each(|_| device.copy(&src, &mut dst, bytes))).unwrap() / 5.0;
    let copy_gbs = 2.0 * bytes as f64 / (ms as f64 * 1e-3) / 1e9;
    drop((src, dst));

    let blas_handle = CudaBlas::new(device.stream().clone()).unwrap();
    let scatter =
        device.function("fused_qkv_baseline", &BASELINE, "fused_qkv_bshd_paged_baseline_scatter_cuda_bf16").unwrap();
    println!(
        "device: {} (sm_{}{}), copy bandwidth {copy_gbs:.0} GB/s",
        device.name(),
        device.compute_capability().0,
        device.compute_capability().1
    );
    println!(
        "8B QKV: K={k} N={n} (q {q_dim}, kv 2x{kv_dim}), bf16, page size {page_size}; kernel times are CUDA-event means of {iters}"
    );
    println!(
        "{:>6} {:>10} {:>10} {:>14} {:>8} {:>10} {:>9} {:>12} {:>10} {:>9}",
        "M", "schedule", "fused us", "cuBLAS+sc us", "ratio", "W GB/s", "% copy", "run() us", "fp8 us", "fp8/bf16"
    );
    for m in [1usize, 16, 256, 2048] {
        let batch = if m <= 16 { m } else { (m / 256).max(1) };
        let seq = m / batch;
        let schedule = Schedule::for_rows(m);
        let pages_per_seq = seq.div_ceil(page_size) + 1;
        let params = KvCacheParams {
            dtype: DType::BF16,
            num_layers: 1,
            page_size,
            num_kv_heads: hkv,
            head_size: d,
            scale_granularity: None,
        };
        let mut cache = PagedKVCacheCollection::new(params, batch * pages_per_seq + 1, batch, pages_per_seq).unwrap();
        let valid = vec![seq as u32; batch];
        cache.reserve(&valid).unwrap();
        let spec = FusedQkvSpec {
            backend: Backend::Cuda,
            dtype: DType::BF16,
            weights: DType::BF16,
            cache: KvCacheParams {
                dtype: DType::BF16,
                num_layers: 1,
                page_size,
                num_kv_heads: hkv,
                head_size: d,
                scale_granularity: None,
            },
            k,
            q_dim,
            batch: Some(batch),
            seq: Some(seq),
            sizes: Sizes::Baked,
        };
        let p = Problem {
            spec,
            hidden: Tensor::random(DType::BF16, &[batch, seq, k], &mut rng, -1.0, 1.0).unwrap(),
            weight: Arc::new(Tensor::random(DType::BF16, &[n, k], &mut rng, -0.05, 0.05).unwrap()),
            layer: Tensor::scalar_u32(0),
            valid: Tensor::from_vec(&[batch], valid.clone()).unwrap(),
            output: Tensor::zeros(DType::BF16, &[batch, seq, q_dim]).unwrap(),
            cache,
        };
        let CheckedCall { shape, row_offsets } = check_call(
            &p.hidden,
            &p.weight,
            StepArgs { kv_collection: &p.cache, layer_idx: &p.layer, valid_lengths: &p.valid },
        )
        .unwrap();
        let offsets: Vec<u8> = row_offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
        let upload = |bytes: &[u8]| -> DeviceBuffer {
            let mut b = device.alloc(bytes.len()).unwrap();
            device.upload(bytes, &mut b).unwrap();
            b
        };
        let (x, w, row_off) = (upload(p.hidden.as_bytes()), upload(p.weight.as_bytes()), upload(&offsets));
        let (out, blocks) = (upload(p.output.as_bytes()), upload(p.cache.blocks().as_bytes()));
        let (out_base, blocks_base) = (upload(p.output.as_bytes()), upload(p.cache.blocks().as_bytes()));
        let c = device.alloc(m * n * 2).unwrap();
        let kv_stride = page_size * kv_dim;
        let fused = device.function(PTX_MODULE, &PTX, &variant_key(&spec, schedule).symbol()).unwrap();
        let fused_args = [
            KernelArg::Buffer(&x),
            KernelArg::Buffer(&w),
            KernelArg::Buffer(&out),
            KernelArg::Buffer(&blocks),
            KernelArg::Buffer(&row_off),
            KernelArg::I32(m as i32),
            KernelArg::I32(k as i32),
            KernelArg::I32(n as i32),
            KernelArg::I32(q_dim as i32),
            KernelArg::I32(kv_dim as i32),
            KernelArg::I64(kv_stride as i64),
        ];
        let fused_shape = schedule.launch_shape(DType::BF16, m, n);
        // SAFETY: the fused kernels' parameter list for bf16/bf16; buffers
        // hold the whole validated tensors; offsets from check_call of a
        // call it accepted; K % 8 == 0.
        let launch_fused = || unsafe { device.launch(&fused, fused_shape, &fused_args) };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let baseline = || -> kvjit_cuda::Result<()> {
            // Row-major C[M, N] = X·Wᵀ is column-major Cᵀ = op(W)·X with W
            // seen as a K×N column-major matrix, transposed.
            // SAFETY: every pointer is a live device buffer of the sizes the
            // dimensions describe (X M·K, W N·K, C M·N bf16), on the handle's
            // stream (the device's).
            unsafe {
                blas::gemm_ex(
                    *blas_handle.handle(),
                    blas_sys::cublasOperation_t::CUBLAS_OP_T,
                    blas_sys::cublasOperation_t::CUBLAS_OP_N,
                    n as i32,
                    m as i32,
                    k as i32,
                    (&alpha as *const f32).cast(),
                    w.address() as *const std::ffi::c_void,
                    blas_sys::cudaDataType::CUDA_R_16BF,
                    k as i32,
                    x.address() as *const std::ffi::c_void,
                    blas_sys::cudaDataType::CUDA_R_16BF,
                    k as i32,
                    (&beta as *const f32).cast(),
                    c.address() as *mut std::ffi::c_void,
                    blas_sys::cudaDataType::CUDA_R_16BF,
                    n as i32,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                )
            }
            .map_err(|e| kvjit_cuda::CudaError::Unavailable(format!("cublasGemmEx: {e:?}")))?;
            let args = [
                KernelArg::Buffer(&c),
                KernelArg::Buffer(&out_base),
                KernelArg::Buffer(&blocks_base),
                KernelArg::Buffer(&row_off),
                KernelArg::I32(n as i32),
                KernelArg::I32(q_dim as i32),
                KernelArg::I32(kv_dim as i32),
                KernelArg::I64(kv_stride as i64),
            ];
            // SAFETY: the baseline scatter's parameters; one block per row of
            // C (M); q_dim and kv_dim are multiples of 8 (its requirement);
            // offsets as above.
            unsafe { device.launch(&scatter, LaunchShape { grid: (m as u32, 1, 1), block: (256, 1, 1) }, &args) }
        };
        for _ in 0..warmup {
            launch_fused().unwrap();
            baseline().unwrap();
        }
        let fused_ms = device.elapsed_ms(|| (0..iters).try_for_each(|_| launch_fused())).unwrap() / iters as f32;
        let base_ms = device.elapsed_ms(|| (0..iters).try_for_each(|_| baseline())).unwrap() / iters as f32;

        // The same call into an FP8 cache (g = 128): what the quantizing
        // epilogue costs against the bf16 store (issue 14's target: within
        // 10% at M >= 16).
        let fp8_spec = FusedQkvSpec {
            cache: KvCacheParams { dtype: DType::F8E4M3, scale_granularity: Some(128), ..spec.cache },
            ..spec
        };
        let fp8 = device.function(PTX_MODULE, &PTX, &variant_key(&fp8_spec, schedule).symbol()).unwrap();
        let cache_elems = p.cache.blocks().as_bytes().len() / 2;
        let (codes, fp8_scales) = (device.alloc(cache_elems).unwrap(), device.alloc(cache_elems / 128 * 4).unwrap());
        let fp8_scratch = device.alloc(m * 2 * kv_dim * 4).unwrap();
        let mut counters = device.alloc(m.div_ceil(64) * (2 * kv_dim / 128) * 4).unwrap();
        device.zero(&mut counters).unwrap();
        let fp8_args = [
            KernelArg::Buffer(&x),
            KernelArg::Buffer(&w),
            KernelArg::Buffer(&out),
            KernelArg::Buffer(&codes),
            KernelArg::Buffer(&fp8_scales),
            KernelArg::Buffer(&row_off),
            KernelArg::I32(m as i32),
            KernelArg::I32(k as i32),
            KernelArg::I32(n as i32),
            KernelArg::I32(q_dim as i32),
            KernelArg::I32(kv_dim as i32),
            KernelArg::I64(kv_stride as i64),
            KernelArg::I32(128),
            KernelArg::Buffer(&fp8_scratch),
            KernelArg::Buffer(&counters),
        ];
        // SAFETY: the FP8 variants' parameters for bf16; the codes and scales
        // buffers have the bf16 cache's element count (and / 128 scales), the
        // staging buffer M·2·kv_dim f32, the counters ceil(M / 64)·2·kv_dim / 128
        // zeroed; offsets as above (element offsets, the same for both caches).
        let launch_fp8 = || unsafe { device.launch(&fp8, fused_shape, &fp8_args) };
        for _ in 0..warmup {
            launch_fp8().unwrap();
        }
        let fp8_ms = device.elapsed_ms(|| (0..iters).try_for_each(|_| launch_fp8())).unwrap() / iters as f32;

        // Same results (bf16 outputs of two f32 accumulations).
        let (mut q_fused, mut q_base) = (vec![0u8; p.output.as_bytes().len()], vec![0u8; p.output.as_bytes().len()]);
        device.download(&out, &mut q_fused).unwrap();
        device.download(&out_base, &mut q_base).unwrap();
        let (a, b) = (
            Tensor::from_le_bytes(DType::BF16, p.output.shape(), &q_fused).unwrap().to_f32_vec().unwrap(),
            Tensor::from_le_bytes(DType::BF16, p.output.shape(), &q_base).unwrap().to_f32_vec().unwrap(),
        );
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / (y.abs() + 1e-2)).fold(0.0f32, f32::max);
        assert!(worst < 0.05, "M={m}: fused and cuBLAS Q differ by {worst} (relative)");

        // End to end through the Kernel interface (host validation and copies included).
        let kernel = Compiled::new(CudaKernel::new(spec, Some(p.weight.clone())).unwrap());
        run_cuda(&kernel, &p, &ctx).unwrap();
        let start = std::time::Instant::now();
        for _ in 0..5 {
            run_cuda(&kernel, &p, &ctx).unwrap();
        }
        let run_us = start.elapsed().as_secs_f64() * 1e6 / 5.0;

        let weight_gbs = (n * k * 2) as f64 / (fused_ms as f64 * 1e-3) / 1e9;
        println!(
            "{m:>6} {:>10} {:>10.1} {:>14.1} {:>8.2} {:>10.0} {:>8.0}% {:>12.0} {:>10.1} {:>9.3}",
            schedule.name(),
            fused_ms * 1e3,
            base_ms * 1e3,
            base_ms / fused_ms,
            weight_gbs,
            100.0 * weight_gbs / copy_gbs,
            run_us,
            fp8_ms * 1e3,
            fp8_ms / fused_ms
        );
    }
    println!("ratio = cuBLAS+scatter time / fused time (> 1: fused is faster); W GB/s = weight bytes / fused time");
    println!("fp8 = the same fused call into an f8e4m3 cache (g = 128); fp8/bf16 = its time / the bf16 store's");
}

/// An FP8 cache's device copy holds its scales beside the codes: uploaded
/// with the blocks, current across the kernel's own writes (codes and scales
/// mirrored into the host: a second call uploads nothing and matches the
/// reference again), stale after a host write to the scales alone.
#[test]
fn an_fp8_cache_keeps_its_scales_on_the_device_with_its_blocks() {
    let Some(ctx) = cuda_or_skip() else { return };
    let device = ctx.cuda_context().unwrap().device().clone();
    let mut rng = StdRng::seed_from_u64(12);
    let d = draw(&mut rng, DType::BF16, DType::F8E4M3, Schedule::Decode);
    let p = problem(&mut rng, &d);
    let kernel = Compiled::new(CudaKernel::new(p.spec, Some(p.weight.clone())).unwrap());
    let (mut output, mut cache) = (p.output.clone(), p.cache.clone());
    let call = |cache: &mut PagedKVCacheCollection, output: &mut Tensor| {
        kernel.run(&p.inputs(), &mut [cache], std::slice::from_mut(output), &ctx).unwrap();
        device.kv_cache_uploads()
    };
    let first = call(&mut cache, &mut output);
    assert_matches_reference(&p, &output, &cache, "first call");
    // The same call again on the updated cache: the reference starts from it too.
    let again = Problem { cache: cache.clone(), ..p.clone() };
    assert_eq!(
        call(&mut cache, &mut output),
        first,
        "the kernel's own writes (codes and scales) left the copy current"
    );
    assert_matches_reference(&again, &output, &cache, "second call");
    cache.blocks_and_scales_mut().1.unwrap()[0] = 7.0; // a host edit of the scales alone
    assert_eq!(call(&mut cache, &mut output), first + 1, "a host write to the scales makes the copy stale");
}
