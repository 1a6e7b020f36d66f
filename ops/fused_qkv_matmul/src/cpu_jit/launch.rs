//! [`JitKernel`]: the kernel built for a key (the constant weight packed,
//! the code compiled for the resolved tier and, by policy, for each seen
//! shape) and run (activations packed for the tier, an FP8 cache's staging
//! rows, the argument words, the launches).

use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use kvjit_core::{
    CpuTier, Error, KernelKey, PagedKVCacheCollection, PreparedConstant, Result, Tensor, TensorData, bf16, f16,
};
use kvjit_jit::microkernel::{self, MAX_TILE_ROWS};
use kvjit_jit::{CaptureText, JitError, JitFunction, SeenShapes};
use kvjit_runtime::{CodeInfo, DeviceContextPtr, Kernel, OutputSpec};

use super::emit::{compile_sized, emit_and_compile};
use super::fp8_store::{compile_fp8_store, fp8_arg};
use super::schedule::Schedule;
use super::{arg, kv_store_stride, tier_key, unspecialized_key};
use crate::call::cache_row_offsets;
use crate::kernel::{check_against_spec_with, checked_call_with, same_data};
use crate::panels::PanelLayout;
use crate::{CallShape, FusedQkvError, FusedQkvSpec, OP_NAME, QkvArgs};

/// The fused op as JIT-compiled machine code for one kernel key.
///
/// Tensor inputs, in order: `hidden_state`, `weight`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub struct JitKernel {
    spec: FusedQkvSpec,
    /// The resolved tier the code runs on.
    tier: CpuTier,
    key: KernelKey,
    /// Kernels specialized for shapes seen at run time, by (B, S), when the
    /// key leaves them symbolic and the policy asks for it.
    seen_shapes: Option<SeenShapes>,
    layout: PanelLayout,
    code: Arc<JitFunction>,
    /// The kernel quantizing staged K/V into an FP8 cache (FP8 caches only).
    fp8_store: Option<Arc<JitFunction>>,
    /// The graph's constant weight and its packed copy, made at build (or
    /// taken prepared from an artifact). Used only when a call's weight is
    /// that very tensor or the packed one itself ([`same_data`]); any other
    /// weight is packed for its call.
    constant_weight: Option<PackedConstant>,
}

/// A constant weight (absent when it came prepared) and its panels.
struct PackedConstant {
    plain: Option<Arc<Tensor>>,
    packed: Arc<Tensor>,
}

impl PackedConstant {
    /// The panels to use for a call's `weight`, if it is this constant.
    fn panels_for(&self, weight: &Tensor) -> Option<&Tensor> {
        let is_plain = self.plain.as_deref().is_some_and(|plain| same_data(plain, weight));
        (is_plain || same_data(&self.packed, weight)).then_some(&*self.packed)
    }
}

impl JitKernel {
    /// Compile (or fetch) the kernel for `spec` on the widest tier this CPU
    /// runs; pack `weight` now when it is a graph constant. Calls whose
    /// weight is that same tensor (the same allocation) use the packed copy;
    /// calls with any other weight pack theirs per call.
    pub fn new(spec: FusedQkvSpec, weight: Option<Arc<Tensor>>, capture: CaptureText) -> Result<Self, JitError> {
        Self::with_policy(spec, weight, capture, false)
    }

    /// Like [`new`](Self::new); with `specialize_shapes`, a kernel whose key
    /// leaves B or S symbolic also compiles (and caches, process-wide) a
    /// kernel for each (B, S) it runs with, up to [`MAX_SEEN_SHAPES`](super::MAX_SEEN_SHAPES) per
    /// kernel, and runs that one instead of the generic code.
    pub fn with_policy(
        spec: FusedQkvSpec,
        weight: Option<Arc<Tensor>>,
        capture: CaptureText,
        specialize_shapes: bool,
    ) -> Result<Self, JitError> {
        Self::with_tier(spec, weight, capture, specialize_shapes, CpuTier::Auto)
    }

    /// Like [`with_policy`](Self::with_policy), on the CPU tier `requested`
    /// (`Auto`: the widest this CPU runs; `Avx2` on a CPU without it is
    /// refused).
    pub fn with_tier(
        spec: FusedQkvSpec,
        weight: Option<Arc<Tensor>>,
        capture: CaptureText,
        specialize_shapes: bool,
        requested: CpuTier,
    ) -> Result<Self, JitError> {
        let tier = microkernel::resolve_tier(requested)?;
        let layout = PanelLayout::new(&spec, Schedule::of(tier).panel_columns);
        let constant_weight = match weight {
            Some(w) if w.dtype() == spec.dtype && w.shape() == [spec.n(), spec.k] && w.is_contiguous() => {
                Some(PackedConstant {
                    packed: Arc::new(layout.pack(&w).expect("a float weight packs")),
                    plain: Some(w),
                })
            }
            _ => None,
        };
        Self::with_constant(spec, tier, constant_weight, capture, specialize_shapes, false)
    }

    /// The unspecialized kernel, a baseline for what specialization buys:
    /// the same generator with only the dtypes baked in — K, the Q/K/V
    /// column counts and the cache's K→V stride are read from argument
    /// words, M at run time, and one compiled kernel serves every spec of
    /// these dtypes (`…kany.qany.hkvany…`). Calls are validated against
    /// `spec` as for any kernel. 256-bit tier only (the Cranelift tile
    /// unrolls K).
    pub fn unspecialized(
        spec: FusedQkvSpec,
        weight: Option<Arc<Tensor>>,
        requested: CpuTier,
    ) -> Result<Self, JitError> {
        let generic = FusedQkvSpec { batch: None, seq: None, ..spec };
        let tier = microkernel::resolve_tier(requested)?;
        let layout = PanelLayout::new(&generic, Schedule::of(tier).panel_columns);
        let constant_weight =
            weight.filter(|w| w.dtype() == spec.dtype && w.shape() == [spec.n(), spec.k] && w.is_contiguous()).map(
                |w| PackedConstant { packed: Arc::new(layout.pack(&w).expect("a float weight packs")), plain: Some(w) },
            );
        Self::with_constant(generic, tier, constant_weight, CaptureText::default(), false, true)
    }

    /// Like [`with_tier`](Self::with_tier), with the weight already packed
    /// (a prepared constant from a compiled artifact): no packing at build.
    /// Calls pass that packed tensor itself as the weight. A weight in
    /// another layout (another tier's panels included), dtype or size is
    /// refused.
    pub fn with_prepared_weight(
        spec: FusedQkvSpec,
        prepared: &PreparedConstant,
        capture: CaptureText,
        specialize_shapes: bool,
        requested: CpuTier,
    ) -> Result<Self> {
        let tier = microkernel::resolve_tier(requested).map_err(|e| Error::op(OP_NAME, e))?;
        let layout = PanelLayout::new(&spec, Schedule::of(tier).panel_columns);
        let expected = layout.id(spec.dtype);
        let data = &prepared.data;
        if prepared.layout != expected
            || data.dtype() != spec.dtype
            || data.shape() != [layout.packed_len()]
            || !data.is_contiguous()
        {
            return Err(FusedQkvError::PreparedWeight {
                expected: format!("{expected} ({}[{}])", spec.dtype, layout.packed_len()),
                got: format!("{} ({}{:?})", prepared.layout, data.dtype(), data.shape()),
            }
            .into());
        }
        let constant = PackedConstant { plain: None, packed: data.clone() };
        Self::with_constant(spec, tier, Some(constant), capture, specialize_shapes, false)
            .map_err(|e| Error::op(OP_NAME, e))
    }

    fn with_constant(
        spec: FusedQkvSpec,
        tier: CpuTier,
        constant_weight: Option<PackedConstant>,
        capture: CaptureText,
        specialize_shapes: bool,
        runtime_sizes: bool,
    ) -> Result<Self, JitError> {
        let code = compile_sized(&spec, tier, runtime_sizes, capture)?;
        let fp8_store = match spec.cache_dtype.is_quantized() {
            true => Some(compile_fp8_store(&spec, runtime_sizes)?),
            false => None,
        };
        let layout = PanelLayout::new(&spec, Schedule::of(tier).panel_columns);
        let generic = spec.batch.is_none() || spec.seq.is_none();
        Ok(Self {
            key: if runtime_sizes { unspecialized_key(&spec, tier) } else { tier_key(&spec, tier) },
            tier,
            seen_shapes: (specialize_shapes && generic).then(SeenShapes::new),
            spec,
            layout,
            code,
            fp8_store,
            constant_weight,
        })
    }

    /// The code to run for a call of this shape: a kernel specialized for it
    /// when the policy allows, else this kernel's own.
    fn code_for(&self, shape: &CallShape) -> Arc<JitFunction> {
        let Some(seen) = &self.seen_shapes else { return self.code.clone() };
        let spec = FusedQkvSpec { batch: Some(shape.batch), seq: Some(shape.seq), ..self.spec };
        let key = tier_key(&spec, self.tier);
        seen.code_for(&[("B", shape.batch), ("S", shape.seq)], (&self.code, &self.key), &key, || {
            emit_and_compile(&spec, self.tier, &key, CaptureText::default(), false)
        })
    }

    /// The tier the kernel's code runs on.
    pub fn tier(&self) -> CpuTier {
        self.tier
    }
}

/// The 256-bit tier's activation layout: rows in tiles of `step`, each
/// tile k-major with its rows interleaved (`[M/step][K][step]`, the last
/// tile zero-padded), so a tile's micro-kernel reads one sequential stream
/// of x instead of `step` rows 4·K bytes apart (which share L1 sets when K is
/// a multiple of 1024).
fn pack_activations(x: &[f32], rows: usize, k: usize, step: usize) -> Vec<f32> {
    let tiles = rows.div_ceil(step);
    let mut packed = vec![0f32; tiles * k * step];
    if k == 0 {
        return packed; // no elements
    }
    for (t, tile) in packed.chunks_exact_mut(k * step).enumerate() {
        for i in 0..step.min(rows - t * step) {
            let row = &x[(t * step + i) * k..][..k];
            for (slot, &value) in tile[i..].iter_mut().step_by(step).zip(row) {
                *slot = value;
            }
        }
    }
    packed
}

fn hidden_as_f32(hidden: &Tensor) -> std::borrow::Cow<'_, [f32]> {
    let convert = |len: usize, f: &dyn Fn(&mut [f32])| {
        let mut out = vec![0f32; len];
        f(&mut out);
        std::borrow::Cow::Owned(out)
    };
    match hidden.data() {
        TensorData::F32(x) => std::borrow::Cow::Borrowed(x),
        TensorData::BF16(x) => convert(x.len(), &|out| <[bf16]>::convert_to_f32_slice(x, out)),
        TensorData::F16(x) => convert(x.len(), &|out| <[f16]>::convert_to_f32_slice(x, out)),
        TensorData::U32(_) | TensorData::F8E4M3(_) => {
            unreachable!("check_call accepts hidden states of the compute floats only")
        }
    }
}

impl Kernel for JitKernel {
    fn key(&self) -> &KernelKey {
        &self.key
    }

    fn implementation(&self) -> &'static str {
        "jit"
    }

    fn code_info(&self) -> CodeInfo {
        self.code.code_info()
    }

    fn check(&self, inputs: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<Vec<OutputSpec>> {
        let shape = check_against_spec_with(&self.spec, inputs, caches, self.packed_weight())?;
        Ok(vec![(self.spec.dtype, shape.output_shape())])
    }

    fn prepared_constants(&self) -> Vec<(usize, PreparedConstant)> {
        let Some(constant) = &self.constant_weight else { return Vec::new() };
        vec![(1, PreparedConstant { layout: self.layout.id(self.spec.dtype), data: constant.packed.clone() })]
    }

    fn run(
        &self,
        inputs: &[&Tensor],
        caches: &mut [&mut PagedKVCacheCollection],
        outputs: &mut [Tensor],
        ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let call = checked_call_with(&self.spec, inputs, caches, outputs, self.packed_weight())?;
        let args = QkvArgs {
            hidden_state: call.hidden,
            weight: call.weight,
            kv_collection: call.cache,
            layer_idx: call.layer_idx,
            valid_lengths: call.valid_lengths,
        };
        self.launch(&call.shape, args, call.output.as_bytes_mut(), ctx)
    }
}

impl JitKernel {
    /// The packed constant weight, which calls may pass as the weight.
    fn packed_weight(&self) -> Option<&Tensor> {
        self.constant_weight.as_ref().map(|c| &*c.packed)
    }

    /// Run with the Q output written into raw bytes (exactly `B·S·q_dim`
    /// elements of the dtype), so callers — tests with guard regions around
    /// the output, benchmarks reusing a buffer — choose where it lives.
    /// Validates everything first, like [`Kernel::run`].
    pub fn run_into(&self, args: QkvArgs<'_>, output: &mut [u8], ctx: &DeviceContextPtr) -> Result<()> {
        let inputs = [args.hidden_state, args.weight, args.layer_idx, args.valid_lengths];
        let shape = check_against_spec_with(&self.spec, &inputs, &[&*args.kv_collection], self.packed_weight())?;
        let expected = shape.batch * shape.seq * shape.q_dim * self.spec.dtype.size_bytes();
        if output.len() != expected {
            return Err(Error::ByteCount {
                dtype: self.spec.dtype,
                shape: shape.output_shape(),
                expected,
                got: output.len(),
            });
        }
        self.launch(&shape, args, output, ctx)
    }

    /// Run a validated call: `shape` came from `check_against_spec` on
    /// exactly these arguments and `output` holds `B·S·q_dim` elements.
    fn launch(&self, shape: &CallShape, args: QkvArgs<'_>, output: &mut [u8], ctx: &DeviceContextPtr) -> Result<()> {
        let shape = *shape;
        let QkvArgs { hidden_state, weight, kv_collection: cache, valid_lengths, .. } = args;
        let row_offsets = cache_row_offsets(&shape, cache, valid_lengths)?;
        let rows = shape.batch * shape.seq;
        let x = hidden_as_f32(hidden_state);
        let x_step = match self.tier {
            CpuTier::Avx2 if rows > 1 => MAX_TILE_ROWS,
            _ => 1,
        };
        let x = if x_step > 1 { std::borrow::Cow::Owned(pack_activations(&x, rows, self.spec.k, x_step)) } else { x };
        let packed_now;
        let packed = match self.constant_weight.as_ref().and_then(|c| c.panels_for(weight)) {
            Some(panels) => panels,
            None => {
                packed_now = self.layout.pack(weight)?;
                &packed_now
            }
        };
        // An FP8 cache's K/V go to f32 staging rows first (see the module
        // docs): row r's K at r·2·kv_dim, its V kv_dim after.
        let kv_dim = self.spec.kv_dim();
        let mut staging = match self.fp8_store {
            Some(_) => {
                let offsets =
                    row_offsets.iter().enumerate().map(|(r, &o)| if o < 0 { -1 } else { (r * 2 * kv_dim) as i64 });
                Some((vec![0f32; rows * 2 * kv_dim], offsets.collect::<Vec<i64>>()))
            }
            None => None,
        };
        let mut args = [0u64; arg::COUNT];
        args[arg::X] = x.as_ptr() as u64;
        args[arg::W] = packed.as_bytes().as_ptr() as u64;
        args[arg::OUT] = output.as_mut_ptr() as u64;
        (args[arg::BLOCKS], args[arg::ROW_OFFSETS]) = match &mut staging {
            Some((stage, offsets)) => (stage.as_mut_ptr() as u64, offsets.as_ptr() as u64),
            None => (cache.blocks_bytes_mut().as_mut_ptr() as u64, row_offsets.as_ptr() as u64),
        };
        args[arg::M] = rows as u64;
        args[arg::X_STEP] = x_step as u64;
        // Read by the unspecialized kernel only; the others bake them in.
        args[arg::K] = self.spec.k as u64;
        args[arg::Q_DIM] = self.spec.q_dim as u64;
        args[arg::KV_DIM] = kv_dim as u64;
        args[arg::KV_STRIDE] = kv_store_stride(&self.spec) as u64;
        if shape.batch * shape.seq == 0 {
            return Ok(());
        }
        let code = self.code_for(&shape);
        // SAFETY: `code` was compiled by `emit_and_compile` for this kernel's
        // spec (or the same spec with this call's B and S baked in), reading
        // the argument words in `arg`'s layout. `check_against_spec`
        // validated every argument against the spec (dtypes, contiguity, K,
        // q_dim, cache layout, B·S rows, valid lengths ≤ S, every valid
        // token's page and slot inside the cache and no two tokens sharing
        // one), so for any panel range every load stays inside `x` (M·K f32;
        // packed in tiles of `x_step` rows, ⌈M/x_step⌉·x_step·K, where a
        // tile reads rows < x_step of its own tile)
        // and the packed weight (built for this layout), every Q store inside
        // `output` (M·q_dim, checked by the caller), and every K/V store at
        // `row_offsets[r] + col (+ kv_stride)` inside `blocks`, distinct per
        // row — or, for an FP8 cache, at the staging offsets `r·2·kv_dim +
        // col (+ kv_dim)` inside the staging buffer of M·2·kv_dim f32, the
        // store dtype and stride the code was compiled with
        // (`kv_store_dtype`, `kv_store_stride`); different panel ranges
        // write different columns. `x`, `packed`, the offsets, the staging
        // buffer and the borrowed output and cache outlive the launch.
        unsafe { kvjit_jit::launch(&code, &args, self.layout.total_panels(), ctx) };
        if let (Some(store), Some((stage, _))) = (&self.fp8_store, &staging) {
            let (blocks, scales) = cache.blocks_and_scales_mut();
            let scales = scales.expect("an f8e4m3 cache has scales, and the spec check accepted only such a cache");
            let mut words = [0u64; fp8_arg::COUNT];
            words[fp8_arg::STAGE] = stage.as_ptr() as u64;
            words[fp8_arg::ROW_OFFSETS] = row_offsets.as_ptr() as u64;
            words[fp8_arg::BLOCKS] = blocks.as_mut_ptr() as u64;
            words[fp8_arg::SCALES] = scales.as_mut_ptr() as u64;
            words[fp8_arg::KV_DIM] = kv_dim as u64;
            words[fp8_arg::KV_STRIDE] = self.spec.kv_stride() as u64;
            words[fp8_arg::G] = self.spec.scale_granularity.unwrap_or(1) as u64;
            // SAFETY: `store` was compiled by `compile_fp8_store` for this
            // spec's kv_dim, g and K→V stride (or reads them from these
            // words, set from the same spec). `check_against_spec` checked
            // the cache against the spec (f8e4m3, this granularity, layout),
            // and the cache keeps its scales `[P, 2, L, page, Hkv, D/g]` f32
            // for exactly those params. For each row r < M in a launch range
            // the kernel reads the staged `stage[r·2·kv_dim ..][..2·kv_dim]`
            // (`stage` holds M rows, written by the launch above) and, when
            // `row_offsets[r] ≥ 0`, writes kv_dim codes at that offset and at
            // offset + kv_stride — slots `locate` validated inside the
            // blocks, distinct per row — and kv_dim / g scales at those
            // offsets divided by g (inside the scales, which mirror the
            // blocks' layout with D / g per head). Different rows write
            // different slots, so the ranges write disjoint memory.
            unsafe { kvjit_jit::launch(store, &words, rows, ctx) };
        }
        Ok(())
    }
}
