//! Every kind of bad input gets its typed error — the shared
//! `kvjit_core::Error` variant where one fits, `RopeError` for the op's own
//! — from every way of calling the op (the reference function, the
//! reference kernel, the JIT kernel's `check`, `run` and `run_into`), all
//! with the same message, and a refused call leaves output and cache
//! byte-for-byte unchanged.
//!
//! The fixture is valid as built; each case breaks one thing, where it can
//! late in the batch, so that earlier valid sequences would already have
//! been rotated by an op that checks as it goes.

use kvjit_core::{
    CacheElement, DType, Error, KvCacheParams, PagedKVCacheCollection, Result, Target, Tensor, UNASSIGNED_PAGE,
};
use kvjit_jit::{CaptureText, JitError};
use kvjit_op::Compiled;
use kvjit_op::checks::StepArgs;
use kvjit_op::checks::StepDims;
use kvjit_op_rope::{JitKernel, ReferenceKernel, RopeError, RopeSpec, check_call, reference};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::paged::{self, B, LAYERS, MAX_PAGES, PAGE_SIZE, PAGES, S};
use kvjit_testkit::values::uniform;
use kvjit_testkit::{Guarded, Snapshot, cache_from_table, strided_view, u32s};
use rand::SeedableRng;
use rand::rngs::StdRng;

const U: u32 = UNASSIGNED_PAGE;

// The test kit's paged step (B = 3 sequences of S = 4, L = 2 layers, page
// size 2, P = 10 pages, 4 pages per sequence; see `kvjit_testkit::paged`)
// with Hq = 4, Hkv = 2, D = 8, and freqs for 8 positions.
const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const MAX_SEQ: usize = 8;
const BLOCKS: [usize; 6] = [PAGES, 2, LAYERS, PAGE_SIZE, HKV, D];

/// A valid call whose buffers hold random (non-NaN) bytes.
#[derive(Clone, Debug)]
struct Fixture {
    q: Tensor,
    cache: PagedKVCacheCollection,
    freqs: Tensor,
    layer_idx: Tensor,
    valid: Tensor,
    output: Tensor,
    spec: RopeSpec,
}

impl Fixture {
    fn new(dtype: DType) -> Self {
        let mut rng = StdRng::seed_from_u64(7);
        let cache = paged::cache(&mut rng, dtype, HKV, D, None);
        Self {
            q: uniform(&mut rng, dtype, &[B, S, HQ, D]),
            cache,
            freqs: uniform(&mut rng, dtype, &[MAX_SEQ, D]),
            layer_idx: paged::layer_idx(),
            valid: paged::valid_lengths(),
            output: uniform(&mut rng, dtype, &[B, S, HQ, D]),
            spec: RopeSpec {
                target: Target::Cpu,
                dtype,
                cache: paged::params(dtype, HKV, D, None),
                interleaved: false,
                num_q_heads: HQ,
                step: StepDims { batch: None, seq: None },
            },
        }
    }

    fn f32() -> Self {
        Self::new(DType::F32)
    }

    fn inputs(&self) -> [&Tensor; 4] {
        [&self.q, &self.freqs, &self.layer_idx, &self.valid]
    }

    fn step(&self) -> StepArgs<'_> {
        StepArgs { kv_collection: &self.cache, layer_idx: &self.layer_idx, valid_lengths: &self.valid }
    }

    /// Every way of calling the op, each on a copy of the fixture whose
    /// output and cache must be unchanged when it refuses; returns the
    /// verdicts by name. `check` must agree with `run`.
    fn verdicts(&self, with_function: bool) -> Vec<(&'static str, Result<()>)> {
        let ctx = DeviceContextPtr::cpu(2).unwrap();
        let mut verdicts = Vec::new();
        let mut record = |name: &'static str, f: &dyn Fn(&mut Fixture) -> Result<()>| {
            let mut fx = self.clone();
            let before = Snapshot::take(&fx.output, &fx.cache);
            let result = f(&mut fx);
            if result.is_err() {
                before.assert_unchanged(&fx.output, &fx.cache, name);
            }
            verdicts.push((name, result));
        };
        if with_function {
            record("reference::fused_qk_rope", &|fx| {
                reference::fused_qk_rope(
                    &fx.q,
                    &mut fx.cache,
                    &fx.freqs,
                    &fx.layer_idx,
                    &fx.valid,
                    fx.spec.interleaved,
                    &mut fx.output,
                )
                .map(|_| ())
            });
        }
        let reference = Compiled::new(ReferenceKernel::new(self.spec));
        let jit = Compiled::new(JitKernel::new(self.spec, CaptureText::default()).unwrap());
        for (name, kernel) in [("ReferenceKernel", &reference as &dyn Kernel), ("JitKernel", &jit)] {
            record(name, &|fx| {
                let checked = kernel.check(&fx.inputs(), &[&fx.cache]).map(|_| ());
                let inputs = [&fx.q, &fx.freqs, &fx.layer_idx, &fx.valid];
                let ran = kernel.run(&inputs, &mut [&mut fx.cache], std::slice::from_mut(&mut fx.output), &ctx);
                assert_eq!(format!("{checked:?}"), format!("{ran:?}"), "{name}: check and run disagree");
                ran
            });
        }
        record("JitKernel::run_into", &|fx| {
            let bytes = fx.output.as_bytes().to_vec();
            let mut out = Guarded::new(32, &bytes, 32);
            let tensors = [&fx.q, &fx.freqs, &fx.layer_idx, &fx.valid];
            let result = jit.kernel().run_into(&tensors, &mut [&mut fx.cache], out.body_mut(), &ctx);
            out.assert_guards("run_into");
            if result.is_err() {
                assert!(out.body() == bytes, "run_into wrote its output and refused");
            }
            result
        });
        verdicts
    }
}

/// Break `$fx` with `$break`, then assert every way of calling it refuses
/// with an error matching `$pat` (the same message from all), writing
/// nothing.
macro_rules! assert_rejected {
    ($fx:expr, $pat:pat $(if $guard:expr)?) => {
        assert_rejected!(@run $fx, true, $pat $(if $guard)?)
    };
    (kernels $fx:expr, $pat:pat $(if $guard:expr)?) => {
        assert_rejected!(@run $fx, false, $pat $(if $guard)?)
    };
    (@run $fx:expr, $function:expr, $pat:pat $(if $guard:expr)?) => {{
        let fx: Fixture = $fx;
        let verdicts = fx.verdicts($function);
        let first = format!("{}", verdicts[0].1.as_ref().err().map_or("accepted".into(), |e| e.to_string()));
        for (name, result) in &verdicts {
            assert!(
                matches!(result, Err($pat) $(if $guard)?),
                "{name}: expected {}, got {result:?}",
                stringify!($pat)
            );
            let message = result.as_ref().unwrap_err().to_string();
            assert_eq!(message, first, "{name} words the error differently");
        }
        first
    }};
}

fn op_error(e: &Error) -> Option<&RopeError> {
    e.op_error::<RopeError>()
}

/// The error `check_call` gives for a fixture.
fn reference_error(fx: &Fixture) -> Error {
    check_call(&fx.q, &fx.freqs, fx.step()).unwrap_err()
}

/// The fixture with a freqs table of 6 rows (sequence 2 needs 7).
fn fx_with_short_table() -> Fixture {
    let mut fx = Fixture::f32();
    fx.freqs = uniform(&mut StdRng::seed_from_u64(5), DType::F32, &[6, D]);
    fx
}

#[test]
fn the_fixture_itself_is_valid_everywhere() {
    for dtype in DType::FLOATS {
        let fx = Fixture::new(dtype);
        let shape = check_call(&fx.q, &fx.freqs, fx.step()).unwrap();
        assert_eq!(shape.cache_tokens, 9);
        for (name, result) in fx.verdicts(true) {
            result.unwrap_or_else(|e| panic!("{dtype} {name}: {e}"));
        }
    }
}

#[test]
fn wrong_dtypes_are_refused() {
    let mut fx = Fixture::f32();
    fx.freqs = uniform(&mut StdRng::seed_from_u64(1), DType::BF16, &[MAX_SEQ, D]);
    let msg = assert_rejected!(fx, Error::DTypeMismatch { arg, .. } if arg == "freqs_cis");
    assert_eq!(msg, "freqs_cis: expected dtype f32, got bf16");

    let mut fx = Fixture::f32();
    fx.layer_idx = Tensor::from_f32(DType::F32, &[], &[1.0]).unwrap();
    assert_rejected!(fx, Error::DTypeMismatch { arg, .. } if arg == "layer_idx");

    let mut fx = Fixture::f32();
    fx.valid = Tensor::from_f32(DType::F16, &[B], &[1.0; B]).unwrap();
    assert_rejected!(fx, Error::DTypeMismatch { arg, .. } if arg == "valid_lengths");

    // A kernel built for f32 handed bf16 activations.
    let mut fx = Fixture::f32();
    let mut rng = StdRng::seed_from_u64(2);
    fx.q = uniform(&mut rng, DType::BF16, &[B, S, HQ, D]);
    fx.freqs = uniform(&mut rng, DType::BF16, &[MAX_SEQ, D]);
    assert_rejected!(kernels fx, Error::DTypeMismatch { arg, .. } if arg == "q_proj");
}

#[test]
fn strided_tensors_are_refused() {
    // q_proj [3, 4, 4, 8] with S and Hq swapped in storage (a permutation
    // that is its own inverse needs equal swapped dims: S = Hq = 4).
    let mut fx = Fixture::f32();
    fx.q = strided_view(&fx.q, &[0, 2, 1, 3]);
    assert_rejected!(fx, Error::NotContiguous { arg } if arg == "q_proj");

    let mut fx = Fixture::f32();
    fx.freqs = strided_view(&uniform(&mut StdRng::seed_from_u64(3), DType::F32, &[D, D]), &[1, 0]);
    assert_rejected!(fx, Error::NotContiguous { arg } if arg == "freqs_cis");
}

#[test]
fn wrong_shapes_are_refused() {
    let mut rng = StdRng::seed_from_u64(4);
    let mut fx = Fixture::f32();
    fx.q = uniform(&mut rng, DType::F32, &[B, S, HQ * D]);
    assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "q_proj");

    let mut fx = Fixture::f32();
    fx.q = uniform(&mut rng, DType::F32, &[B, S, HQ, D + 2]);
    fx.output = uniform(&mut rng, DType::F32, &[B, S, HQ, D + 2]);
    assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "q_proj");

    // Hq = 3 is not a multiple of Hkv = 2.
    let mut fx = Fixture::f32();
    fx.q = uniform(&mut rng, DType::F32, &[B, S, 3, D]);
    let msg = assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "q_proj");
    assert!(msg.contains("Hq a positive multiple of 2"), "{msg}");

    let mut fx = Fixture::f32();
    fx.freqs = uniform(&mut rng, DType::F32, &[MAX_SEQ, D / 2]);
    assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "freqs_cis");

    let mut fx = Fixture::f32();
    fx.valid = u32s(&[1, 1]);
    assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "valid_lengths");

    let mut fx = Fixture::f32();
    fx.layer_idx = u32s(&[1, 1]);
    assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "layer_idx");

    // A cache for 2 sequences with a batch of 3.
    let mut fx = Fixture::f32();
    fx.cache = cache_from_table(DType::F32, BLOCKS, &[0, 0], &[1, U, U, U, 2, U, U, U], MAX_PAGES);
    assert_rejected!(fx, Error::ShapeMismatch { arg, .. } if arg == "kv_collection.cache_lengths");
}

#[test]
fn kernels_refuse_outputs_of_the_wrong_size() {
    let fx = Fixture::f32();
    let ctx = DeviceContextPtr::cpu(1).unwrap();
    let jit = Compiled::new(JitKernel::new(fx.spec, CaptureText::default()).unwrap());
    for kernel in [&Compiled::new(ReferenceKernel::new(fx.spec)) as &dyn Kernel, &jit] {
        let mut fx = fx.clone();
        fx.output = Tensor::zeros(DType::F32, &[B, S, HQ, D - 2]).unwrap();
        let before = Snapshot::take(&fx.output, &fx.cache);
        let inputs = [&fx.q, &fx.freqs, &fx.layer_idx, &fx.valid];
        let result = kernel.run(&inputs, &mut [&mut fx.cache], std::slice::from_mut(&mut fx.output), &ctx);
        assert!(matches!(result, Err(Error::ShapeMismatch { ref arg, .. }) if arg == "output"), "{result:?}");
        before.assert_unchanged(&fx.output, &fx.cache, "wrong output");
        let no_output = kernel.run(&inputs, &mut [&mut fx.cache], &mut [], &ctx);
        assert!(matches!(no_output, Err(Error::KernelArguments { .. })), "{no_output:?}");
        before.cache.assert_unchanged(&fx.cache, "no output");
    }
    let mut fx = fx.clone();
    let before = Snapshot::take(&fx.output, &fx.cache);
    let mut short = vec![0u8; B * S * HQ * D * 4 - 4];
    let tensors = [&fx.q, &fx.freqs, &fx.layer_idx, &fx.valid];
    let result = jit.kernel().run_into(&tensors, &mut [&mut fx.cache], &mut short, &ctx);
    assert!(matches!(result, Err(Error::ByteCount { .. })), "{result:?}");
    assert!(short.iter().all(|&b| b == 0));
    before.cache.assert_unchanged(&fx.cache, "run_into, short output");
}

#[test]
fn bad_lengths_and_layers_are_refused() {
    let mut fx = Fixture::f32();
    fx.layer_idx = Tensor::scalar_u32(LAYERS as u32);
    let msg = assert_rejected!(fx, Error::LayerOutOfRange { layer_idx: 2, num_layers: 2 });
    assert_eq!(msg, "layer_idx 2 out of range: cache has 2 layers");

    let mut fx = Fixture::f32();
    fx.valid = u32s(&[3, 2, 5]);
    assert_rejected!(fx, Error::ValidLengthTooLong { batch: 2, valid_length: 5, seq_len: 4 });

    // cache_lengths[2] + valid_lengths[2] overflows u32.
    let mut fx = Fixture::f32();
    fx.cache.cache_lengths_mut()[2] = u32::MAX - 1;
    assert_rejected!(fx, Error::SequenceTooLong { batch: 2, .. });
}

#[test]
fn positions_past_the_freqs_table_are_refused() {
    // Sequence 2's positions run to 6: a table of 6 rows misses the last.
    let msg = assert_rejected!(fx_with_short_table(), Error::Op { .. });
    assert!(matches!(
        op_error(&reference_error(&fx_with_short_table())),
        Some(RopeError::PositionOutOfRange { batch: 2, position: 6, cache_length: 3, token: 3, max_seq: 6 })
    ));
    assert_eq!(
        msg,
        "sequence 2: position 6 (cache_length 3 + token 3) has no row in freqs_cis, which holds 6 positions"
    );
    let mut fx = Fixture::f32();
    fx.freqs = Tensor::zeros(DType::F32, &[0, D]).unwrap();
    let msg = assert_rejected!(fx, Error::Op { .. });
    assert!(msg.starts_with("sequence 0: position 1 (cache_length 1 + token 0)"), "{msg}");
}

#[test]
fn bad_page_tables_are_refused() {
    // Sequence 2's last logical page unassigned.
    let mut fx = Fixture::f32();
    fx.cache.lookup_table_mut()[2 * MAX_PAGES + 3] = U;
    assert_rejected!(fx, Error::PhysicalPageOutOfRange { batch: 2, logical_page: 3, physical_page: U, num_pages: 10 });

    // A physical page past the cache.
    let mut fx = Fixture::f32();
    fx.cache.lookup_table_mut()[2 * MAX_PAGES + 1] = 10;
    assert_rejected!(fx, Error::PhysicalPageOutOfRange { physical_page: 10, .. });

    // Positions past the table's width (the freqs table is long enough).
    let mut fx = Fixture::f32();
    fx.cache.cache_lengths_mut()[2] = 6;
    fx.freqs = uniform(&mut StdRng::seed_from_u64(6), DType::F32, &[64, D]);
    assert_rejected!(fx, Error::LogicalPageOutOfRange { batch: 2, max_pages_per_seq: 4, .. });

    // Sequence 2's page 1 is sequence 0's page 0: position 3 of both?
    // Seq 0 writes positions 1..=3 → page 4 slot 1, page 7 slots 0, 1.
    // Point seq 2's logical page 1 (positions 2, 3: it writes 3 → slot 1)
    // at page 7: seq 0's position 3 is page 7 slot 1 too.
    let mut fx = Fixture::f32();
    fx.cache.lookup_table_mut()[2 * MAX_PAGES + 1] = 7;
    assert_rejected!(fx, Error::SlotCollision { page: 7, slot: 1, first_batch: 0, second_batch: 2, .. });
}

#[test]
fn kernels_refuse_calls_they_were_not_built_for() {
    // Another cache layout than the key's.
    let mut fx = Fixture::f32();
    fx.spec.cache.page_size = 4;
    let msg = assert_rejected!(kernels fx, Error::CacheLayout { what: "page_size", .. });
    assert_eq!(msg, "kv_collection: page_size is 2, but the op was built for 4");
    let mut fx = Fixture::f32();
    fx.spec.cache.element = CacheElement::BF16;
    let msg = assert_rejected!(kernels fx, Error::CacheLayout { what: "dtype", .. });
    assert_eq!(msg, "kv_collection: dtype is f32, but the op was built for bf16");

    // Another Hq (a valid multiple of Hkv) or a static B the call does not have.
    let mut fx = Fixture::f32();
    fx.spec.num_q_heads = 2;
    let msg = assert_rejected!(kernels fx, Error::NotBuiltFor { arg: "q_proj", .. });
    assert!(msg.starts_with("q_proj: expected shape [B, S, 2, 8]"), "{msg}");
    let mut fx = Fixture::f32();
    fx.spec.step.batch = Some(2);
    let msg = assert_rejected!(kernels fx, Error::NotBuiltFor { arg: "q_proj", .. });
    assert!(msg.starts_with("q_proj: expected shape [2, S, 4, 8]"), "{msg}");

    // Wrong argument counts.
    let fx = Fixture::f32();
    let kernel = Compiled::new(ReferenceKernel::new(fx.spec));
    let err = kernel.check(&[&fx.q], &[&fx.cache]).unwrap_err();
    assert!(matches!(&err, kvjit_core::Error::KernelArguments { .. }), "{err}");
    let err = kernel.check(&fx.inputs(), &[]).unwrap_err();
    assert!(matches!(&err, kvjit_core::Error::KernelArguments { .. }), "{err}");
}

#[test]
fn odd_head_sizes_are_refused() {
    let blocks = [4, 2, 1, 2, 1, 3];
    let cache = cache_from_table(DType::F32, blocks, &[0], &[0, U], 2);
    let q = Tensor::zeros(DType::F32, &[1, 1, 1, 3]).unwrap();
    let freqs = Tensor::zeros(DType::F32, &[4, 3]).unwrap();
    let err = check_call(
        &q,
        &freqs,
        StepArgs { kv_collection: &cache, layer_idx: &Tensor::scalar_u32(0), valid_lengths: &u32s(&[1]) },
    )
    .unwrap_err();
    assert_eq!(op_error(&err), Some(&RopeError::OddHeadSize { head_size: 3 }));
}

#[test]
fn the_jit_refuses_head_sizes_it_cannot_vectorize() {
    for d in [2, 4, 12, 2048] {
        let spec =
            RopeSpec { cache: KvCacheParams { head_size: d, ..Fixture::f32().spec.cache }, ..Fixture::f32().spec };
        let err = JitKernel::new(spec, CaptureText::default()).err().expect("refused");
        assert!(matches!(err, JitError::Unsupported { .. }), "{err}");
        assert!(err.to_string().contains("multiple of 8"), "{err}");
    }
}
