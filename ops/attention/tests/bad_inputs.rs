//! Every bad call is refused before anything is written: the output keeps
//! its poison, the cache its bytes; empty calls (B = 0, S = 0) are no-ops;
//! what only the JIT refuses (more keys than it handles, head sizes above
//! its cap); and the graph-level definition.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{Case, jit, run_jit_on, scale_bytes};
use kvjit_core::{
    Backend, CacheElement, CodeTier, DType, Error, KernelKey, KernelSpec, KvCacheParams, PagedKVCacheCollection,
    Target, Tensor, UNASSIGNED_PAGE,
};
use kvjit_graph::{Dim, GraphBuilder, KvCacheType, OpDef, OpRegistry, specialize};
use kvjit_op::checks::StepDims;
use kvjit_op::{Compiled, Defined};
use kvjit_op_attention::cpu_jit::MAX_JIT_KEYS;
use kvjit_op_attention::{
    AttentionError, MAX_JIT_HEAD_SIZE, Mask, MhaOp, MhaParams, MhaSpec, ReferenceKernel, jit_kernel, mha,
};
use kvjit_runtime::{BuildOptions, DeviceContextPtr, Kernel, KernelBuilder, KernelImpl};
use kvjit_testkit::{Snapshot, poison, u32s};

fn base_case() -> Case {
    Case {
        dtype: DType::BF16,
        cache_dtype: DType::F16,
        batch: 2,
        seq: 3,
        num_heads: 4,
        num_kv_heads: 2,
        head_size: 8,
        page_size: 4,
        num_layers: 2,
        layer: 1,
        scale_granularity: None,
        cache_lengths: vec![5, 0],
        valid_lengths: vec![3, 2],
        mask: Mask::Causal,
        window: None,
        scale: 0.3,
        seed: 11,
        tier: common::default_tier(),
    }
}

/// Run `edit`ed arguments through the JIT and reference kernels; both must
/// refuse with an error `expect` accepts, writing nothing.
fn refused(what: &str, edit: impl Fn(&mut Vec<Tensor>, &mut PagedKVCacheCollection), expect: impl Fn(&Error) -> bool) {
    refused_by(&base_case(), what, edit, expect);
}

/// [`refused`] with kernels built for `case` (output and cache, scales
/// included, byte-identical afterwards).
fn refused_by(
    case: &Case,
    what: &str,
    edit: impl Fn(&mut Vec<Tensor>, &mut PagedKVCacheCollection),
    expect: impl Fn(&Error) -> bool,
) {
    let case = case.clone();
    let (mut inputs, mut cache) = case.inputs();
    edit(&mut inputs, &mut cache);
    let reference: Arc<dyn Kernel> = Arc::new(reference_kernel(&case));
    let kernels: [Arc<dyn Kernel>; 2] = [Arc::new(jit(&case)), reference];
    for kernel in kernels {
        let mut output = Tensor::zeros(case.dtype, &[2, 3, 4, 8]).unwrap();
        poison(&mut output);
        let before = Snapshot::take(&output, &cache);
        let scales_before = scale_bytes(&cache);
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let mut outputs = [output];
        let err =
            kernel.run(&refs, &mut [&mut cache], &mut outputs, &DeviceContextPtr::cpu(2).unwrap()).expect_err(what);
        assert!(expect(&err), "{what} ({}): unexpected error {err}", kernel.implementation());
        before.assert_unchanged(&outputs[0], &cache, what);
        assert!(scale_bytes(&cache) == scales_before, "{what}: the cache's scales changed");
        assert!(kernel.check(&refs, &[&cache]).is_err(), "{what}: check agrees");
    }
}

/// The reference kernel for `case`'s spec, as the runtime holds it.
fn reference_kernel(case: &Case) -> Compiled<ReferenceKernel> {
    Compiled::new(ReferenceKernel::new(case.spec()))
}

/// What `supports` answers for every CUDA key.
const NO_CUDA: &str = "no CUDA variant for op mo.mha.padded.paged yet";

/// The plain CPU tier (attention's code does not depend on the tier).
const CPU: Backend = Backend::Cpu(CodeTier::Cranelift);

fn op_error(err: &Error) -> Option<&AttentionError> {
    err.op_error::<AttentionError>()
}

#[test]
fn bad_calls_are_refused_with_nothing_written() {
    refused(
        "q dtype",
        |i, _| i[0] = Tensor::zeros(DType::F32, &[2, 3, 4, 8]).unwrap(),
        |e| matches!(e, Error::DTypeMismatch { .. }),
    );
    refused(
        "q head size",
        |i, _| i[0] = Tensor::zeros(DType::BF16, &[2, 3, 4, 4]).unwrap(),
        |e| matches!(e, Error::ShapeMismatch { .. }),
    );
    refused(
        "q heads not a multiple of Hkv",
        |i, _| i[0] = Tensor::zeros(DType::BF16, &[2, 3, 3, 8]).unwrap(),
        |e| matches!(op_error(e), Some(AttentionError::HeadGroups { .. })),
    );
    refused(
        "q heads not built for",
        |i, _| i[0] = Tensor::zeros(DType::BF16, &[2, 3, 8, 8]).unwrap(),
        |e| matches!(e, kvjit_core::Error::NotBuiltFor { .. }),
    );
    refused(
        "q batch",
        |i, _| i[0] = Tensor::zeros(DType::BF16, &[3, 3, 4, 8]).unwrap(),
        |e| matches!(e, Error::ShapeMismatch { .. }),
    );
    refused(
        "q not contiguous",
        |i, _| i[0] = kvjit_testkit::strided_view(&i[0], &[1, 0, 2, 3]),
        |e| matches!(e, Error::NotContiguous { .. } | Error::ShapeMismatch { .. }),
    );
    refused("layer out of range", |i, _| i[1] = Tensor::scalar_u32(2), |e| matches!(e, Error::LayerOutOfRange { .. }));
    refused(
        "layer_idx dtype",
        |i, _| i[1] = Tensor::zeros(DType::F32, &[]).unwrap(),
        |e| matches!(e, Error::DTypeMismatch { .. }),
    );
    refused("valid length > S", |i, _| i[2] = u32s(&[4, 1]), |e| matches!(e, Error::ValidLengthTooLong { .. }));
    refused("valid_lengths shape", |i, _| i[2] = u32s(&[1]), |e| matches!(e, Error::ShapeMismatch { .. }));
    refused(
        "length overflow",
        |_, c| c.cache_lengths_mut()[0] = u32::MAX - 1,
        |e| matches!(e, Error::SequenceTooLong { .. }),
    );
    refused(
        "unassigned page",
        |_, c| {
            let width = c.max_pages_per_seq();
            c.lookup_table_mut()[width] = UNASSIGNED_PAGE;
        },
        |e| matches!(e, Error::PhysicalPageOutOfRange { batch: 1, .. }),
    );
    refused(
        "page beyond the cache",
        |_, c| {
            let pages = c.num_pages() as u32;
            c.lookup_table_mut()[1] = pages;
        },
        |e| matches!(e, Error::PhysicalPageOutOfRange { batch: 0, .. }),
    );
    refused(
        "positions past the assigned pages",
        |_, c| c.cache_lengths_mut()[1] = 100,
        |e| matches!(e, Error::LogicalPageOutOfRange { .. } | Error::PhysicalPageOutOfRange { .. }),
    );
    refused(
        "positions past the lookup table",
        |_, c| {
            let width = c.max_pages_per_seq();
            c.lookup_table_mut()[width..].fill(0);
            c.cache_lengths_mut()[1] = (width * 4) as u32;
        },
        |e| matches!(e, Error::LogicalPageOutOfRange { batch: 1, .. }),
    );
    refused(
        "cache dtype",
        |_, c| *c = cache_like(c, DType::BF16, 4),
        |e| matches!(e, kvjit_core::Error::CacheLayout { what: "dtype", .. }),
    );
    refused(
        "cache page size",
        |_, c| *c = cache_like(c, DType::F16, 8),
        |e| matches!(e, kvjit_core::Error::CacheLayout { what: "page_size", .. }),
    );
    refused("argument count", |i, _| drop(i.pop()), |e| matches!(e, kvjit_core::Error::KernelArguments { .. }));
}

/// [`base_case`] with an FP8 cache of granularity 4 (D = 8: two scales per head).
fn fp8_case() -> Case {
    Case { cache_dtype: DType::F8E4M3, scale_granularity: Some(4), ..base_case() }
}

/// `c`'s layout and page table with an FP8 cache of granularity `g`
/// (random codes, scales 1).
fn fp8_cache_like(c: &PagedKVCacheCollection, g: usize) -> PagedKVCacheCollection {
    let shape = c.blocks().shape().to_vec();
    let codes: Vec<u8> = (0..c.blocks().numel()).map(|i| (i * 37 % 126) as u8).collect();
    let mut scales_shape = shape.clone();
    scales_shape[5] /= g;
    let scales = Tensor::from_f32(DType::F32, &scales_shape, &vec![1.0; c.blocks().numel() / g]).unwrap();
    PagedKVCacheCollection::from_parts_with_scales(
        Tensor::from_le_bytes(DType::F8E4M3, &shape, &codes).unwrap(),
        Some(scales),
        c.cache_lengths().to_vec(),
        c.lookup_table().to_vec(),
        c.max_pages_per_seq(),
    )
    .unwrap()
}

/// FP8 caches that do not match the kernel: refused before anything is
/// written (the granularity is part of the layout a kernel is built for).
#[test]
fn fp8_cache_mismatches_are_refused_with_nothing_written() {
    let layout = |what: &'static str| move |e: &Error| matches!(e, Error::CacheLayout { what: w, .. } if *w == what);
    // Built for g = 4: a g = 8 (one scale per head) or g = 2 cache.
    refused_by(&fp8_case(), "granularity 8 for 4", |_, c| *c = fp8_cache_like(c, 8), layout("scale_granularity"));
    refused_by(&fp8_case(), "granularity 2 for 4", |_, c| *c = fp8_cache_like(c, 2), layout("scale_granularity"));
    // Built for FP8, given f16; built for f16, given FP8.
    refused_by(&fp8_case(), "f16 cache for FP8", |_, c| *c = cache_like(c, DType::F16, 4), layout("dtype"));
    refused("FP8 cache for f16", |_, c| *c = fp8_cache_like(c, 4), layout("dtype"));
    // Every other check still runs first for an FP8 kernel.
    refused_by(
        &fp8_case(),
        "FP8: layer out of range",
        |i, _| i[1] = Tensor::scalar_u32(2),
        |e| matches!(e, Error::LayerOutOfRange { .. }),
    );
}

/// Specs with an impossible FP8 layout are not valid specs of the op (and
/// `supports` refuses their keys), and the JIT refuses granularities that
/// split an F32X4.
#[test]
fn fp8_specs_the_kernels_cannot_serve() {
    let spec = fp8_case().spec();
    spec.validate().unwrap();
    assert_eq!(spec.key().spec::<MhaSpec>(), Some(&spec));
    assert!(spec.key().to_string().contains(".kvf8e4m3.g4."), "{}", spec.key());
    Defined(MhaOp).supports(&spec.key()).unwrap();
    // An FP8 cache without g, or g on a float cache, cannot be written down.
    assert!(CacheElement::new(DType::F8E4M3, None).is_err(), "an FP8 cache needs g");
    assert!(CacheElement::new(DType::F16, Some(4)).is_err(), "g only for FP8");
    let bad = MhaSpec {
        cache: KvCacheParams { element: CacheElement::F8E4M3 { scale_granularity: 3 }, ..spec.cache },
        ..spec
    };
    assert!(bad.validate().is_err(), "g does not divide D");
    assert!(Defined(MhaOp).supports(&bad.key()).is_err(), "g does not divide D");
    // g = 6 divides D = 12 but splits F32X4 vectors: the reference serves it, the JIT not.
    let g6 = CacheElement::F8E4M3 { scale_granularity: 6 };
    let split = MhaSpec { cache: KvCacheParams { head_size: 12, element: g6, ..spec.cache }, ..spec };
    split.validate().unwrap();
    let err = Defined(MhaOp).supports(&split.key()).unwrap_err();
    assert!(err.contains("multiple of 4"), "{err}");
    assert!(jit_kernel(split, Default::default()).is_err());
}

fn cache_like(c: &PagedKVCacheCollection, dtype: DType, page_size: usize) -> PagedKVCacheCollection {
    let mut shape = c.blocks().shape().to_vec();
    shape[3] = page_size;
    let blocks = Tensor::zeros(dtype, &shape).unwrap();
    PagedKVCacheCollection::from_parts(
        blocks,
        c.cache_lengths().to_vec(),
        c.lookup_table().to_vec(),
        c.max_pages_per_seq(),
    )
    .unwrap()
}

/// An empty batch (B = 0: a server whose batch drained) and an empty step
/// (S = 0) are no-ops on every kernel — the JIT (symbolic or static S) and
/// the reference, f16 and FP8 caches, every mask, with and without a window:
/// `Ok`, the (empty) output's guards intact, the cache byte-identical.
#[test]
fn empty_batches_and_empty_steps_are_no_ops() {
    for base in [base_case(), fp8_case()] {
        for (mask, window) in [(Mask::Causal, None), (Mask::Null, Some(3))] {
            let empty_batch =
                Case { batch: 0, cache_lengths: vec![], valid_lengths: vec![], mask, window, ..base.clone() };
            let empty_decode_batch = Case { seq: 1, ..empty_batch.clone() };
            let empty_step = Case { seq: 0, valid_lengths: vec![0, 0], mask, window, ..base.clone() };
            for case in [empty_batch, empty_decode_batch, empty_step] {
                let what =
                    format!("B {}, S {}, {:?}, {mask:?}, window {window:?}", case.batch, case.seq, case.cache_dtype);
                let (inputs, mut cache) = case.inputs();
                let symbolic = jit(&case);
                for threads in [1, 3] {
                    let got = run_jit_on(&symbolic, &case, &inputs, &cache, threads);
                    assert!(got.is_empty(), "{what}: an empty output");
                }
                let static_seq = MhaSpec { step: StepDims { seq: Some(case.seq), ..case.spec().step }, ..case.spec() };
                let kernels: [Arc<dyn Kernel>; 3] = [
                    Arc::new(symbolic),
                    Arc::new(jit_kernel(static_seq, Default::default()).unwrap()),
                    Arc::new(reference_kernel(&case)),
                ];
                let shape = [case.batch, case.seq, case.num_heads, case.head_size];
                for kernel in kernels {
                    let refs: Vec<&Tensor> = inputs.iter().collect();
                    let specs = kernel.check(&refs, &[&cache]).unwrap();
                    assert_eq!(specs, vec![(case.dtype, shape.to_vec())], "{what}");
                    let mut outputs = [Tensor::zeros(case.dtype, &shape).unwrap()];
                    poison(&mut outputs[0]);
                    let before = Snapshot::take(&outputs[0], &cache);
                    kernel
                        .run(&refs, &mut [&mut cache], &mut outputs, &DeviceContextPtr::cpu(2).unwrap())
                        .unwrap_or_else(|e| panic!("{what} ({}): {e}", kernel.implementation()));
                    before.assert_unchanged(&outputs[0], &cache, &what);
                }
            }
        }
    }
}

/// A sequence reading more than `MAX_JIT_KEYS` keys in one call (a crafted
/// cache: 65536-token pages, every lookup-table entry aliasing page 0) is
/// refused by the JIT's check and run before anything is written, naming
/// the limit; exactly `MAX_JIT_KEYS` keys pass its check. (The reference
/// would serve it; not run: 2³⁰ keys.)
#[test]
fn more_keys_than_the_jit_handles_are_refused() {
    let page_size = 1 << 16;
    let case = Case {
        batch: 1,
        seq: 1,
        num_layers: 1,
        layer: 0,
        page_size,
        cache_lengths: vec![0], // for q, layer_idx and valid_lengths; the cache is built below
        valid_lengths: vec![1],
        ..base_case()
    };
    let max_pages = (MAX_JIT_KEYS + 1).div_ceil(page_size);
    let mut cache = PagedKVCacheCollection::new(case.cache_params(), 1, 1, max_pages).unwrap();
    cache.lookup_table_mut().fill(0);
    cache.cache_lengths_mut()[0] = MAX_JIT_KEYS as u32;
    let (inputs, _) = case.inputs();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let kernel = jit(&case);
    let err = kernel.check(&refs, &[&cache]).unwrap_err();
    let keys = MAX_JIT_KEYS + 1;
    assert!(
        matches!(op_error(&err), Some(&AttentionError::TooManyKeys { batch: 0, keys: k, max: MAX_JIT_KEYS }) if k == keys),
        "{err}"
    );
    assert!(err.to_string().contains(&format!("at most {MAX_JIT_KEYS}")), "{err}");
    let mut outputs = [Tensor::zeros(case.dtype, &[1, 1, 4, 8]).unwrap()];
    poison(&mut outputs[0]);
    let before = Snapshot::take(&outputs[0], &cache);
    let ctx = DeviceContextPtr::cpu(2).unwrap();
    let err = kernel.run(&refs, &mut [&mut cache], &mut outputs, &ctx).unwrap_err();
    assert!(matches!(op_error(&err), Some(AttentionError::TooManyKeys { .. })), "{err}");
    before.assert_unchanged(&outputs[0], &cache, "too many keys");
    let mut guarded = vec![0xa5u8; outputs[0].as_bytes().len()];
    let err = kernel.kernel().run_into(&refs, &mut [&mut cache], &mut guarded, &ctx).unwrap_err();
    assert!(matches!(op_error(&err), Some(AttentionError::TooManyKeys { .. })), "{err}");
    assert!(guarded.iter().all(|&x| x == 0xa5), "run_into wrote before refusing");
    // One key fewer: the JIT's check accepts it (and the reference's too).
    cache.cache_lengths_mut()[0] -= 1;
    kernel.check(&refs, &[&cache]).unwrap();
    reference_kernel(&case).check(&refs, &[&cache]).unwrap();
}

/// An attention graph on a cache of head size `head_size` (Hq 2, Hkv 1,
/// symbolic B and S).
fn attention_graph(registry: &OpRegistry, head_size: usize) -> kvjit_graph::Graph {
    let mut b = GraphBuilder::new("attention", registry);
    let q = b
        .input("q", DType::BF16, &[Dim::from("batch"), Dim::from("seq"), Dim::Static(2), Dim::Static(head_size)])
        .unwrap();
    let cache = KvCacheType {
        dtype: DType::BF16,
        num_layers: 1,
        page_size: 4,
        num_kv_heads: 1,
        head_size,
        scale_granularity: None,
        num_pages: Dim::Static(8),
        batch: Dim::from("batch"),
        max_pages_per_seq: Dim::Static(4),
    };
    let kv = b.kv_cache("kv_cache", cache).unwrap();
    let layer = b.input("layer_idx", DType::U32, &[]).unwrap();
    let valid = b.input("valid_lengths", DType::U32, &[Dim::from("batch")]).unwrap();
    let params = MhaParams {
        dtype: DType::BF16,
        mask: Mask::Causal,
        scale: None,
        local_window_size: None,
        num_kv_heads: 1,
        head_size,
        page_size: 4,
    };
    let out = mha(&mut b, [q, kv, layer, valid], params).unwrap();
    b.output("out", out).unwrap();
    b.finish().unwrap()
}

/// Head sizes above `MAX_JIT_HEAD_SIZE` (the JIT's code is unrolled over
/// D): `specialize` refuses them in one line naming the cap, the JIT kernel
/// too; the cap itself specializes; the reference kernel (built through
/// the op's `KernelBuilder`) serves D above the cap, every valid row written.
#[test]
fn head_sizes_above_the_jit_cap_are_refused_and_the_reference_serves_them() {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(MhaOp))).unwrap();
    let over = MAX_JIT_HEAD_SIZE + 4;
    let graph = attention_graph(&registry, over);
    let err = specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap_err().to_string();
    assert!(
        err.contains(&format!("head_size up to {MAX_JIT_HEAD_SIZE}")) && err.contains(&format!("got {over}")),
        "{err}"
    );
    assert!(!err.contains('\n'), "one line: {err}");
    specialize(&attention_graph(&registry, MAX_JIT_HEAD_SIZE), &registry, CPU, &BTreeMap::new()).unwrap();

    let case = Case {
        batch: 2,
        seq: 2,
        num_heads: 2,
        num_kv_heads: 1,
        head_size: over,
        num_layers: 1,
        layer: 0,
        cache_lengths: vec![3, 0],
        valid_lengths: vec![2, 1],
        ..base_case()
    };
    let err = jit_kernel(case.spec(), Default::default()).err().expect("the JIT refuses");
    assert!(err.to_string().contains(&format!("up to {MAX_JIT_HEAD_SIZE}")), "{err}");
    let options = BuildOptions { implementation: KernelImpl::Reference, ..BuildOptions::default() };
    let reference = Defined(MhaOp).build(&case.spec().key(), &[], &options).unwrap();
    let (inputs, mut cache) = case.inputs();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let mut outputs = [Tensor::zeros(case.dtype, &[2, 2, 2, over]).unwrap()];
    poison(&mut outputs[0]);
    reference.run(&refs, &mut [&mut cache], &mut outputs, &DeviceContextPtr::cpu(1).unwrap()).unwrap();
    let got = outputs[0].to_f32_vec().unwrap();
    let row = |b: usize, s: usize, h: usize| &got[((b * 2 + s) * 2 + h) * over..][..over];
    for (b, s) in [(0, 0), (0, 1), (1, 0)] {
        for h in 0..2 {
            assert!(
                row(b, s, h).iter().all(|x| x.is_finite()) && row(b, s, h).iter().any(|&x| x != 0.0),
                "row {b} {s}"
            );
        }
    }
    assert!((0..2).all(|h| row(1, 1, h).iter().all(|&x| x.to_bits() == 0)), "the padded row is zero");
}

/// A spec whose block buffer (the K and V rows of 32 keys, every KV head)
/// passes the 2³¹ − 1 bytes a load's or store's displacement encodes is
/// refused when its kernel is built — by `supports` and by the JIT, in one
/// line — never emitted with displacements that wrap.
#[test]
fn specs_whose_displacements_pass_i32_are_refused() {
    let base = base_case().spec();
    let cache = KvCacheParams { num_kv_heads: 16_384, head_size: 1024, ..base.cache };
    let spec = MhaSpec { num_heads: 16_384, cache, ..base };
    let err = Defined(MhaOp).supports(&spec.key()).unwrap_err();
    assert!(err.contains("displacement") && !err.contains('\n'), "{err}");
    match jit_kernel(spec, Default::default()) {
        Err(kvjit_jit::JitError::Unsupported { key, reason }) => {
            assert_eq!(key, spec.key().to_string());
            assert!(reason.contains("displacement"), "{reason}");
        }
        Err(other) => panic!("expected Unsupported, got {other}"),
        Ok(_) => panic!("a kernel was built for {spec:?}"),
    }
}

#[test]
fn window_pages_below_the_window_are_not_needed() {
    // With a window, pages wholly before every query's window are never
    // read: an unassigned entry there is fine.
    let mut case = base_case();
    case.window = Some(3);
    case.cache_lengths = vec![9, 0];
    let (inputs, mut cache) = case.inputs();
    cache.lookup_table_mut()[0] = UNASSIGNED_PAGE; // positions 0..4; lowest key read is 9+1-3 = 7
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let mut out = vec![0u8; 2 * 3 * 4 * 8 * 2];
    jit(&case).kernel().run_into(&refs, &mut [&mut cache], &mut out, &DeviceContextPtr::cpu(1).unwrap()).unwrap();
}

#[test]
fn the_op_definition_builds_graphs_and_refuses_cuda() {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(MhaOp))).unwrap();
    let mut b = GraphBuilder::new("attention", &registry);
    let q =
        b.input("q", DType::BF16, &[Dim::from("batch"), Dim::from("seq"), Dim::Static(32), Dim::Static(128)]).unwrap();
    let kv = b
        .kv_cache(
            "kv_cache",
            KvCacheType {
                dtype: DType::BF16,
                num_layers: 2,
                page_size: 16,
                num_kv_heads: 8,
                head_size: 128,
                scale_granularity: None,
                num_pages: Dim::Static(64),
                batch: Dim::from("batch"),
                max_pages_per_seq: Dim::Static(8),
            },
        )
        .unwrap();
    let layer = b.input("layer_idx", DType::U32, &[]).unwrap();
    let valid = b.input("valid_lengths", DType::U32, &[Dim::from("batch")]).unwrap();
    let params = MhaParams {
        dtype: DType::BF16,
        mask: Mask::Causal,
        scale: None,
        local_window_size: None,
        num_kv_heads: 8,
        head_size: 128,
        page_size: 16,
    };
    let out = mha(&mut b, [q, kv, layer, valid], params).unwrap();
    b.output("out", out).unwrap();
    b.finish().unwrap();
    // A bad node is refused when added.
    let wrong = MhaParams { head_size: 64, ..params };
    assert!(mha(&mut GraphBuilder::new("x", &registry), [q, kv, layer, valid], wrong).is_err());

    let spec = MhaSpec {
        backend: Backend::Cuda,
        dtype: DType::BF16,
        cache: KvCacheParams {
            element: CacheElement::BF16,
            num_layers: 2,
            page_size: 16,
            num_kv_heads: 8,
            head_size: 128,
        },
        num_heads: 32,
        mask: Mask::Causal,
        window: None,
        scale: 1.0 / 128f32.sqrt(),
        step: StepDims { batch: None, seq: None },
    };
    assert_eq!(Defined(MhaOp).supports(&spec.key()).unwrap_err(), NO_CUDA);
    let cpu = MhaSpec { backend: Backend::Cpu(CodeTier::Cranelift), ..spec };
    Defined(MhaOp).supports(&cpu.key()).unwrap();
    let odd = MhaSpec { cache: KvCacheParams { head_size: 30, ..cpu.cache }, ..cpu };
    assert!(Defined(MhaOp).supports(&odd.key()).unwrap_err().contains("head_size % 4"));
    let other = KernelKey::new("other", Target::Cpu, DType::F32);
    assert!(Defined(MhaOp).supports(&other).is_err());
}
