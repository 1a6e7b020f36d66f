//! Every kind of bad input gets its exact `kvjit_core::Error` variant, and a
//! rejected call leaves output and cache byte-for-byte unchanged (DESIGN.md:
//! "Bad input gets a typed error before anything is written").
//!
//! The fixture is valid as built; each test breaks one thing. Where the
//! broken thing can sit late in the batch it does, so that earlier, valid
//! sequences would already have been written by an op that checks as it goes.

use kvjit_core::{
    Backend, CacheElement, CodeTier, DType, Error, KvCacheParams, PagedKVCacheCollection, Result, Tensor,
    UNASSIGNED_PAGE,
};
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_fused_qkv::{CallShape, FusedQkvSpec, ReferenceKernel, Sizes, reference::fused_qkv_matmul};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::paged::{self, B, LAYERS, MAX_PAGES, PAGE_SIZE, PAGES, S, TABLE, VALID};
use kvjit_testkit::values::uniform;
use kvjit_testkit::{Snapshot, cache_from_table, u32s};
use rand::SeedableRng;
use rand::rngs::StdRng;

const U: u32 = UNASSIGNED_PAGE;

// The test kit's paged step (B = 3 sequences of S = 4, L = 2 layers, page
// size 2, P = 10 pages, 4 pages per sequence; see `kvjit_testkit::paged`)
// with K = 5; Hkv = 2, D = 2 (kv_dim 4), q_dim = 4, so N = 12.
const K: usize = 5;
const HKV: usize = 2;
const D: usize = 2;
const Q_DIM: usize = 4;
const N: usize = Q_DIM + 2 * HKV * D;
const BLOCKS: [usize; 6] = [PAGES, 2, LAYERS, PAGE_SIZE, HKV, D];

/// A valid call whose buffers hold random (non-NaN) bytes.
#[derive(Clone, Debug)]
struct Fixture {
    hidden: Tensor,
    weight: Tensor,
    cache: PagedKVCacheCollection,
    layer_idx: Tensor,
    valid: Tensor,
    output: Tensor,
}

impl Fixture {
    fn new(dtype: DType) -> Self {
        let mut rng = StdRng::seed_from_u64(7);
        let cache = paged::cache(&mut rng, dtype, HKV, D, None);
        Self {
            hidden: uniform(&mut rng, dtype, &[B, S, K]),
            weight: uniform(&mut rng, dtype, &[N, K]),
            cache,
            layer_idx: paged::layer_idx(),
            valid: paged::valid_lengths(),
            output: uniform(&mut rng, dtype, &[B, S, Q_DIM]),
        }
    }

    fn f32() -> Self {
        Self::new(DType::F32)
    }

    fn call(&mut self) -> Result<CallShape> {
        fused_qkv_matmul(&self.hidden, &self.weight, &mut self.cache, &self.layer_idx, &self.valid, &mut self.output)
    }

    fn spec(&self) -> FusedQkvSpec {
        FusedQkvSpec {
            backend: Backend::Cpu(CodeTier::Cranelift),
            dtype: self.hidden.dtype(),
            weights: self.hidden.dtype(),
            cache: KvCacheParams {
                element: CacheElement::new(self.cache.blocks().dtype(), None).unwrap(),
                num_layers: LAYERS,
                page_size: PAGE_SIZE,
                num_kv_heads: HKV,
                head_size: D,
            },
            k: K,
            q_dim: Q_DIM,
            step: StepDims { batch: None, seq: None },
            sizes: Sizes::Baked,
        }
    }

    /// Run through [`ReferenceKernel`]: `check`, then `run`. Both must give
    /// the same verdict; returns `run`'s.
    fn call_kernel(&mut self, spec: FusedQkvSpec) -> Result<()> {
        let kernel = Compiled::new(ReferenceKernel::new(spec));
        let inputs = [&self.hidden, &self.weight, &self.layer_idx, &self.valid];
        let checked = kernel.check(&inputs, &[&self.cache]);
        let ctx = DeviceContextPtr::cpu(1).unwrap();
        let ran = kernel.run(&inputs, &mut [&mut self.cache], std::slice::from_mut(&mut self.output), &ctx);
        assert_eq!(
            format!("{:?}", checked.as_ref().err()),
            format!("{:?}", ran.as_ref().err()),
            "check and run disagree"
        );
        ran
    }
}

/// Call the op on `$fx` (or `via` some other call) and assert it fails with
/// an error matching `$pat` and leaves output and cache byte-identical.
macro_rules! assert_rejected {
    ($fx:expr, via $call:expr, $pat:pat $(if $guard:expr)?) => {{
        let fx: &mut Fixture = &mut $fx;
        let before = Snapshot::take(&fx.output, &fx.cache);
        let result = ($call)(&mut *fx);
        assert!(
            matches!(&result, Err($pat) $(if $guard)?),
            "expected {}, got {result:?}",
            stringify!($pat)
        );
        before.assert_unchanged(&fx.output, &fx.cache, stringify!($pat));
    }};
    ($fx:expr, $pat:pat $(if $guard:expr)?) => {
        assert_rejected!($fx, via Fixture::call, $pat $(if $guard)?)
    };
}

#[test]
fn the_fixture_itself_is_valid() {
    let mut fx = Fixture::f32();
    let shape = fx.call().unwrap();
    assert_eq!(shape.cache_tokens, 9);
    let mut fx = Fixture::f32();
    let spec = fx.spec();
    fx.call_kernel(spec).unwrap();
}

#[test]
fn weight_dtype_differs_from_hidden_state() {
    for (hidden, weight) in [(DType::F32, DType::BF16), (DType::BF16, DType::F16)] {
        let mut fx = Fixture::new(hidden);
        fx.weight = Fixture::new(weight).weight;
        assert_rejected!(fx, Error::DTypeMismatch { arg, expected, got }
            if arg == "weight" && *expected == hidden && *got == weight);
    }
}

#[test]
fn hidden_state_of_integers() {
    let mut fx = Fixture::f32();
    fx.hidden = Tensor::from_vec(&[B, S, K], vec![1u32; B * S * K]).unwrap();
    assert_rejected!(fx, Error::NotFloat { dtype: DType::U32, .. });
}

#[test]
fn output_of_the_wrong_dtype() {
    let mut fx = Fixture::f32();
    fx.output = Tensor::zeros(DType::F16, &[B, S, Q_DIM]).unwrap();
    assert_rejected!(fx, Error::DTypeMismatch { arg, expected: DType::F32, got: DType::F16 }
        if arg == "output");
}

#[test]
fn output_of_the_wrong_shape() {
    for shape in [
        vec![B, S, N],
        vec![B, S, Q_DIM + 1],
        vec![B, S - 1, Q_DIM],
        vec![B + 1, S, Q_DIM],
        vec![B * S, Q_DIM],
        vec![B, S, Q_DIM, 1],
    ] {
        let mut fx = Fixture::f32();
        fx.output = Tensor::zeros(DType::F32, &shape).unwrap();
        assert_rejected!(fx, Error::ShapeMismatch { arg, got, .. }
            if arg == "output" && *got == shape);
    }
}

#[test]
fn weight_with_the_wrong_k() {
    for k in [K - 1, K + 1] {
        let mut fx = Fixture::f32();
        fx.weight = Tensor::zeros(DType::F32, &[N, k]).unwrap();
        assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "weight");
    }
}

#[test]
fn weight_without_room_for_q_columns() {
    // N must exceed 2·kv_dim = 8: 8 leaves q_dim = 0, fewer cannot even hold K and V.
    for n in [8, 7, 1] {
        let mut fx = Fixture::f32();
        fx.weight = Tensor::zeros(DType::F32, &[n, K]).unwrap();
        fx.output = Tensor::zeros(DType::F32, &[B, S, n.saturating_sub(8)]).unwrap();
        assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "weight");
    }
}

#[test]
fn weight_of_the_wrong_rank() {
    for shape in [vec![N * K], vec![1, N, K]] {
        let mut fx = Fixture::f32();
        fx.weight = Tensor::zeros(DType::F32, &shape).unwrap();
        assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "weight");
    }
}

#[test]
fn hidden_state_of_the_wrong_rank() {
    for shape in [vec![B * S, K], vec![1, B, S, K]] {
        let mut fx = Fixture::f32();
        fx.hidden = Tensor::zeros(DType::F32, &shape).unwrap();
        assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "hidden_state");
    }
}

#[test]
fn valid_lengths_of_the_wrong_length() {
    for lengths in [&[3, 2][..], &[3, 2, 4, 0], &[]] {
        let mut fx = Fixture::f32();
        fx.valid = u32s(lengths);
        assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "valid_lengths");
    }
    let mut fx = Fixture::f32();
    fx.valid = Tensor::from_vec(&[B, 1], VALID.to_vec()).unwrap();
    assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "valid_lengths");
}

#[test]
fn valid_lengths_as_floats() {
    let mut fx = Fixture::f32();
    fx.valid = Tensor::from_f32(DType::F32, &[B], &[3.0, 2.0, 4.0]).unwrap();
    assert_rejected!(fx, Error::DTypeMismatch { arg, expected: DType::U32, got: DType::F32 }
        if arg == "valid_lengths");
}

#[test]
fn layer_idx_not_a_u32_scalar() {
    for shape in [vec![2], vec![1, 1]] {
        let mut fx = Fixture::f32();
        let count = shape.iter().product();
        fx.layer_idx = Tensor::from_vec(&shape, vec![0u32; count]).unwrap();
        assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "layer_idx");
    }
    let mut fx = Fixture::f32();
    fx.layer_idx = Tensor::from_f32(DType::F32, &[], &[0.0]).unwrap();
    assert_rejected!(fx, Error::DTypeMismatch { arg, .. } if arg == "layer_idx");
}

#[test]
fn valid_length_longer_than_the_padded_sequence() {
    let mut fx = Fixture::f32();
    fx.valid = u32s(&[3, 2, 5]);
    assert_rejected!(fx, Error::ValidLengthTooLong { batch: 2, valid_length: 5, seq_len: 4 });
}

#[test]
fn layer_idx_out_of_range() {
    for layer in [LAYERS as u32, u32::MAX] {
        let mut fx = Fixture::f32();
        fx.layer_idx = Tensor::scalar_u32(layer);
        assert_rejected!(fx, Error::LayerOutOfRange { layer_idx, num_layers: LAYERS }
            if *layer_idx == layer);
    }
}

#[test]
fn needed_logical_page_beyond_the_table() {
    // Seq 2 with 5 cached: positions 5..=8, and position 8 needs logical page 4.
    let mut fx = Fixture::f32();
    fx.cache.cache_lengths_mut()[2] = 5;
    assert_rejected!(
        fx,
        Error::LogicalPageOutOfRange { batch: 2, position: 8, logical_page: 4, max_pages_per_seq: MAX_PAGES }
    );
    // A cache length near u32::MAX must not wrap around to a small position:
    // the step's 4 valid tokens would take the sequence past u32::MAX (the
    // paged-step check every paged op shares, `kvjit_op::checks::check_step`).
    let mut fx = Fixture::f32();
    fx.cache.cache_lengths_mut()[2] = u32::MAX - 1;
    assert_rejected!(fx, Error::SequenceTooLong { batch: 2, tokens, .. }
        if *tokens == u64::from(u32::MAX - 1) + 4);
}

#[test]
fn physical_page_outside_the_cache() {
    for (bad, logical) in [(PAGES as u32, 3), (u32::MAX - 1, 1), (U, 2)] {
        let mut fx = Fixture::f32();
        fx.cache.lookup_table_mut()[2 * MAX_PAGES + logical] = bad;
        assert_rejected!(fx, Error::PhysicalPageOutOfRange {
            batch: 2,
            logical_page,
            physical_page,
            num_pages: PAGES,
        } if *logical_page == logical && *physical_page == bad);
    }
}

#[test]
fn two_sequences_sharing_a_slot() {
    // Seq 1's logical page 0 is seq 0's page 4: seq 0 writes position 1 there
    // (slot 1), and so does seq 1 at t = 1.
    let mut fx = Fixture::f32();
    fx.cache.lookup_table_mut()[MAX_PAGES] = 4;
    assert_rejected!(
        fx,
        Error::SlotCollision { first_batch: 0, first_t: 0, second_batch: 1, second_t: 1, page: 4, slot: 1 }
    );
}

#[test]
fn one_sequence_mapping_two_logical_pages_to_one_page() {
    // Seq 2's table [9, 0, 0, 3]: positions 3 (logical 1) and 5 (logical 2)
    // both land in page 0, slot 1.
    let mut fx = Fixture::f32();
    fx.cache.lookup_table_mut()[2 * MAX_PAGES + 2] = 0;
    assert_rejected!(
        fx,
        Error::SlotCollision { first_batch: 2, first_t: 0, second_batch: 2, second_t: 2, page: 0, slot: 1 }
    );
}

#[test]
fn padded_rows_sharing_a_slot_are_not_a_collision() {
    // Seq 1's padded rows (t = 2, 3 → logical page 1) would land in seq 0's
    // page 4, but padded rows write nothing, so the call is valid.
    let mut fx = Fixture::f32();
    fx.cache.lookup_table_mut()[MAX_PAGES + 1] = 4;
    let mut reference = Fixture::f32();
    assert_eq!(fx.call().unwrap(), reference.call().unwrap());
    assert_eq!(fx.cache.blocks().as_bytes(), reference.cache.blocks().as_bytes());
}

#[test]
fn cache_for_a_different_batch_size() {
    for batch in [B - 1, B + 1] {
        let mut fx = Fixture::f32();
        fx.cache = cache_from_table(DType::F32, BLOCKS, &vec![0; batch], &vec![0; batch * MAX_PAGES], MAX_PAGES);
        assert_rejected!(fx, Error::ShapeMismatch { .. });
    }
}

/// `t` with the same shape and values, stored with its axes reordered by
/// `perm` (which must be its own inverse), so the view is strided.
fn strided_copy(t: &Tensor, perm: &[usize]) -> Tensor {
    let stored = t.permuted(perm).unwrap().to_contiguous();
    let view = stored.permuted(perm).unwrap();
    assert_eq!(view.shape(), t.shape());
    assert!(!view.is_contiguous());
    view
}

#[test]
fn non_contiguous_arguments() {
    let mut fx = Fixture::f32();
    fx.hidden = strided_copy(&fx.hidden, &[1, 0, 2]);
    assert_rejected!(fx, Error::NotContiguous { arg } if arg == "hidden_state");

    let mut fx = Fixture::f32();
    fx.weight = strided_copy(&fx.weight, &[1, 0]);
    assert_rejected!(fx, Error::NotContiguous { arg } if arg == "weight");

    let mut fx = Fixture::f32();
    fx.output = strided_copy(&fx.output, &[1, 0, 2]);
    assert_rejected!(fx, Error::NotContiguous { arg } if arg == "output");
}

#[test]
fn a_rejected_call_leaves_the_buffers_usable() {
    let mut fresh = Fixture::f32();
    fresh.call().unwrap();

    let mut fx = Fixture::f32();
    fx.cache.lookup_table_mut()[2 * MAX_PAGES + 3] = U;
    assert_rejected!(fx, Error::PhysicalPageOutOfRange { .. });
    fx.valid = u32s(&[3, 2, 9]);
    assert_rejected!(fx, Error::ValidLengthTooLong { .. });
    // Repaired, the same buffers give what a fresh run gives.
    fx.cache.lookup_table_mut()[2 * MAX_PAGES + 3] = TABLE[2 * MAX_PAGES + 3];
    fx.valid = u32s(&VALID);
    fx.call().unwrap();
    assert_eq!(fx.output.as_bytes(), fresh.output.as_bytes());
    assert_eq!(fx.cache.blocks().as_bytes(), fresh.cache.blocks().as_bytes());
}

#[test]
fn kernel_rejects_a_cache_laid_out_differently_from_its_spec() {
    let fx = Fixture::f32();
    let spec = fx.spec();
    let variants: [(&str, KvCacheParams); 5] = [
        ("dtype", KvCacheParams { element: CacheElement::BF16, ..spec.cache }),
        ("num_layers", KvCacheParams { num_layers: LAYERS + 1, ..spec.cache }),
        ("page_size", KvCacheParams { page_size: PAGE_SIZE * 2, ..spec.cache }),
        ("num_kv_heads", KvCacheParams { num_kv_heads: 1, head_size: HKV * D, ..spec.cache }),
        ("head_size", KvCacheParams { head_size: D + 1, ..spec.cache }),
    ];
    for (field, cache) in variants {
        let spec = FusedQkvSpec { cache, ..spec };
        let mut fx = fx.clone();
        assert_rejected!(fx, via |fx: &mut Fixture| fx.call_kernel(spec),
            e if matches!(e, kvjit_core::Error::CacheLayout { what, .. } if *what == field));
    }
}

#[test]
fn kernel_rejects_a_hidden_state_whose_k_differs_from_its_spec() {
    // Hidden and weight agree with each other (K = 6) but not with the spec.
    let mut fx = Fixture::f32();
    let spec = fx.spec();
    let mut rng = StdRng::seed_from_u64(3);
    fx.hidden = uniform(&mut rng, DType::F32, &[B, S, K + 1]);
    fx.weight = uniform(&mut rng, DType::F32, &[N, K + 1]);
    assert_rejected!(fx, via |fx: &mut Fixture| fx.call_kernel(spec),
        e if matches!(e, kvjit_core::Error::NotBuiltFor { arg: "hidden_state", .. }));
}

#[test]
fn kernel_rejects_what_else_its_spec_baked_in() {
    let spec = Fixture::f32().spec();
    for (spec, arg) in [
        (FusedQkvSpec { step: StepDims { batch: Some(B + 1), ..spec.step }, ..spec }, "hidden_state"),
        (FusedQkvSpec { step: StepDims { seq: Some(S - 1), ..spec.step }, ..spec }, "hidden_state"),
        (FusedQkvSpec { q_dim: Q_DIM + 2, ..spec }, "weight"),
    ] {
        let mut fx = Fixture::f32();
        assert_rejected!(fx, via |fx: &mut Fixture| fx.call_kernel(spec),
            e if matches!(e, kvjit_core::Error::NotBuiltFor { arg: got, .. } if *got == arg));
    }
    // The spec's activation dtype.
    let mut fx = Fixture::f32();
    let bf16_spec = FusedQkvSpec { dtype: DType::BF16, ..spec };
    assert_rejected!(fx, via |fx: &mut Fixture| fx.call_kernel(bf16_spec),
        Error::DTypeMismatch { arg, .. } if arg == "hidden_state");
    // Bad input the spec does not know about still gets the op's own check.
    let mut fx = Fixture::f32();
    fx.cache.lookup_table_mut()[1] = U;
    assert_rejected!(fx, via |fx: &mut Fixture| fx.call_kernel(spec),
        Error::PhysicalPageOutOfRange { batch: 0, logical_page: 1, .. });
}

#[test]
fn kernel_rejects_the_wrong_number_of_arguments() {
    let mut fx = Fixture::f32();
    let kernel = Compiled::new(ReferenceKernel::new(fx.spec()));
    let before = Snapshot::take(&fx.output, &fx.cache);
    let ctx = DeviceContextPtr::cpu(1).unwrap();
    let three = [&fx.hidden, &fx.weight, &fx.layer_idx];
    let result = kernel.run(&three, &mut [&mut fx.cache], std::slice::from_mut(&mut fx.output), &ctx);
    assert!(matches!(&result, Err(e) if matches!(e, kvjit_core::Error::KernelArguments { .. })), "{result:?}");
    let four = [&fx.hidden, &fx.weight, &fx.layer_idx, &fx.valid];
    let mut other = fx.cache.clone();
    let result = kernel.run(&four, &mut [&mut fx.cache, &mut other], std::slice::from_mut(&mut fx.output), &ctx);
    assert!(matches!(&result, Err(e) if matches!(e, kvjit_core::Error::KernelArguments { .. })), "{result:?}");
    before.assert_unchanged(&fx.output, &fx.cache, "argument counts");
}

#[test]
fn kernel_rejects_the_wrong_number_of_outputs() {
    let mut fx = Fixture::f32();
    let kernel = Compiled::new(ReferenceKernel::new(fx.spec()));
    let before = Snapshot::take(&fx.output, &fx.cache);
    let ctx = DeviceContextPtr::cpu(1).unwrap();
    let inputs = [&fx.hidden, &fx.weight, &fx.layer_idx, &fx.valid];
    let mut outputs = [fx.output.clone(), fx.output.clone()];
    let result = kernel.run(&inputs, &mut [&mut fx.cache], &mut outputs, &ctx);
    assert!(matches!(&result, Err(e) if matches!(e, kvjit_core::Error::KernelArguments { .. })), "{result:?}");
    assert_eq!(outputs[0].as_bytes(), before.output, "output written");
    before.assert_unchanged(&fx.output, &fx.cache, "two outputs");
}

/// The blocks tensor cannot be swapped for one of another layout: the layout
/// kernels index by is fixed when the cache is made (these were bugs while
/// `blocks_mut` handed out the tensor itself).
#[test]
fn cache_blocks_keep_their_layout() {
    let mut fx = Fixture::f32();
    let before = fx.cache.blocks().as_bytes().to_vec();
    let strided = strided_copy(fx.cache.blocks(), &[0, 1, 2, 3, 5, 4]);
    assert!(matches!(fx.cache.set_blocks(strided), Err(Error::NotContiguous { .. })));
    let other_shape = Tensor::zeros(DType::F32, &[PAGES, 2, LAYERS, PAGE_SIZE, HKV, 1]).unwrap();
    assert!(matches!(fx.cache.set_blocks(other_shape), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(
        fx.cache.set_blocks(Tensor::zeros(DType::U32, &BLOCKS).unwrap()),
        Err(Error::DTypeMismatch { .. })
    ));
    assert!(matches!(
        fx.cache.set_blocks(Tensor::zeros(DType::BF16, &BLOCKS).unwrap()),
        Err(Error::DTypeMismatch { .. })
    ));
    assert!(matches!(fx.cache.blocks_slice_mut::<u32>(), Err(Error::WrongDType { .. })));
    assert_eq!(fx.cache.blocks().as_bytes(), before);
}
