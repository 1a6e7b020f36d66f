//! [`JitKernel`]: the kernel built for a key (the constant weight packed,
//! the code compiled for the resolved tier and, by policy, for each seen
//! shape) and run (activations packed for the tier, an FP8 cache's staging
//! rows, the argument words, the launches).

use std::sync::Arc;

use kvjit_core::{CodeTier, Error, KernelKey, KernelSpec, PagedKVCacheCollection, PreparedConstant, Result, Tensor};
use kvjit_jit::{CaptureText, JitError, JitFunction, SeenShapes};
use kvjit_op::checks::StepDims;
use kvjit_op::gemm::{PackedWeights, PanelLayout, activations};
use kvjit_op::{BoxError, Call, Constants, CpuBuild, CpuKernel, OpKernel};
use kvjit_runtime::{CodeInfo, ConstantInput, DeviceContextPtr};

use super::emit::{compile, emit_and_compile};
use super::fp8_store::{Fp8StoreArgs, compile_fp8_store};
use super::{GemmArgs, code_tier, kv_store_stride, layout};
use crate::spec::check_against;
use crate::{CallShape, CheckedCall, FusedQkvError, FusedQkvSpec, OP_NAME, QkvArgs, Sizes};

/// The fused op as JIT-compiled machine code for one CPU spec, on the tier
/// the spec names (wrap it in [`kvjit_op::Compiled`] for the runtime's
/// `Kernel` interface).
///
/// Tensor inputs, in order: `hidden_state`, `weight`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub struct JitKernel {
    spec: FusedQkvSpec,
    /// The tier the code runs on (the spec's).
    tier: CodeTier,
    /// The spec's key, naming the generic code in the seen-shape log.
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
    /// that very tensor or the packed one itself
    /// ([`same_data`](kvjit_op::gemm::same_data)); any other weight is
    /// packed for its call.
    constant_weight: Option<PackedWeights>,
}

impl JitKernel {
    /// Compile (or fetch) the kernel for a CPU `spec` on the tier it names;
    /// pack `weight` now when it is a graph constant. Calls whose weight is
    /// that same tensor (the same allocation) use the packed copy; calls
    /// with any other weight pack theirs per call. A 256-bit spec on a CPU
    /// without the tier is refused.
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
        let tier = code_tier(&spec)?;
        let constant_weight = Self::pack_constant(&spec, tier, weight);
        Self::with_constant(spec, tier, constant_weight, capture, specialize_shapes)
    }

    /// The unspecialized kernel, a baseline for what specialization buys:
    /// the same generator with only the dtypes baked in — K, the Q/K/V
    /// column counts and the cache's K→V stride are read from argument
    /// words, M at run time, and one compiled kernel serves every spec of
    /// these dtypes ([`Sizes::Runtime`]: `…kany.qany.hkvany…`). Calls are
    /// validated against `spec` as for any kernel. 256-bit tier only (the
    /// Cranelift tile unrolls K).
    pub fn unspecialized(spec: FusedQkvSpec, weight: Option<Arc<Tensor>>) -> Result<Self, JitError> {
        let spec = FusedQkvSpec { sizes: Sizes::Runtime, ..spec.generic() };
        let tier = code_tier(&spec)?;
        let constant_weight = Self::pack_constant(&spec, tier, weight);
        Self::with_constant(spec, tier, constant_weight, CaptureText::default(), false)
    }

    /// Like [`with_policy`](Self::with_policy), with the weight already
    /// packed (a prepared constant from a compiled artifact): no packing at
    /// build. Calls pass that packed tensor itself as the weight. A weight in
    /// another layout (another tier's panels included), dtype or size is
    /// refused.
    pub fn with_prepared_weight(
        spec: FusedQkvSpec,
        prepared: &PreparedConstant,
        capture: CaptureText,
        specialize_shapes: bool,
    ) -> Result<Self> {
        let tier = code_tier(&spec).map_err(|e| Error::op(OP_NAME, e))?;
        let layout = layout(&spec, tier);
        let constant = PackedWeights::prepared(&layout, layout.panel_dtype(spec.weights), prepared)
            .map_err(|(expected, got)| FusedQkvError::PreparedWeight { expected, got })?;
        Self::with_constant(spec, tier, Some(constant), capture, specialize_shapes).map_err(|e| Error::op(OP_NAME, e))
    }

    /// A graph constant `weight` (of the spec's dtype and `[N, K]`) and its
    /// panels for `tier`; anything else is packed per call.
    fn pack_constant(spec: &FusedQkvSpec, tier: CodeTier, weight: Option<Arc<Tensor>>) -> Option<PackedWeights> {
        let layout = layout(spec, tier);
        weight
            .filter(|w| w.dtype() == spec.weights && w.shape() == [spec.n(), spec.k] && w.is_contiguous())
            .map(|w| PackedWeights::pack(&layout, vec![w]).expect("a weight of the layout's shape and format packs"))
    }

    fn with_constant(
        spec: FusedQkvSpec,
        tier: CodeTier,
        constant_weight: Option<PackedWeights>,
        capture: CaptureText,
        specialize_shapes: bool,
    ) -> Result<Self, JitError> {
        let code = compile(&spec, capture)?;
        let fp8_store = match spec.cache.dtype().is_quantized() {
            true => Some(compile_fp8_store(&spec)?),
            false => None,
        };
        let layout = layout(&spec, tier);
        let generic = spec.step.batch.is_none() || spec.step.seq.is_none();
        Ok(Self {
            key: spec.key(),
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
        let spec = FusedQkvSpec { step: StepDims::fixed(shape.batch, shape.seq), ..self.spec };
        let key = spec.key();
        seen.code_for(&[("B", shape.batch), ("S", shape.seq)], (&self.code, &self.key), &key, || {
            emit_and_compile(&spec, self.tier, CaptureText::default())
        })
    }

    /// The tier the kernel's code runs on.
    pub fn tier(&self) -> CodeTier {
        self.tier
    }

    /// The packed constant weight, which calls may pass as the weight.
    fn packed_weight(&self) -> Option<&Tensor> {
        self.constant_weight.as_ref().map(|c| &**c.packed())
    }

    /// Run with the Q output written into raw bytes (exactly `B·S·q_dim`
    /// elements of the dtype), so callers — tests with guard regions around
    /// the output, benchmarks reusing a buffer — choose where it lives.
    /// Validates everything first, like the runtime's `Kernel::run`.
    pub fn run_into(&self, args: QkvArgs<'_>, output: &mut [u8], ctx: &DeviceContextPtr) -> Result<()> {
        let tensors = [args.hidden_state, args.weight, args.layer_idx, args.valid_lengths];
        kvjit_op::check_dtypes::<FusedQkvSpec>(self.spec.dtype, &tensors)?;
        let checked = self.check(&tensors, &[&*args.kv_collection])?;
        let shape = checked.shape;
        let expected = shape.batch * shape.seq * shape.q_dim * self.spec.dtype.size_bytes();
        if output.len() != expected {
            return Err(Error::ByteCount {
                dtype: self.spec.dtype,
                shape: shape.output_shape(),
                expected,
                got: output.len(),
            });
        }
        self.launch(&checked, args, output, ctx)
    }
}

/// Sizes the generated code can address. Building packs a constant weight
/// into panels now; a prepared one (from an artifact) is taken as it is,
/// its layout checked.
impl CpuKernel for JitKernel {
    fn supported(spec: &FusedQkvSpec) -> Result<(), JitError> {
        super::addressable(spec)
    }

    fn build(spec: &FusedQkvSpec, constants: &Constants, build: &CpuBuild) -> Result<Self, BoxError> {
        Ok(match constants.get(1).and_then(Option::as_ref) {
            Some(ConstantInput::Prepared(prepared)) => {
                Self::with_prepared_weight(*spec, prepared, build.capture, build.specialize_shapes)?
            }
            weight => {
                let weight = weight.and_then(ConstantInput::plain).cloned();
                Self::with_policy(*spec, weight, build.capture, build.specialize_shapes)?
            }
        })
    }
}

impl OpKernel for JitKernel {
    type Spec = FusedQkvSpec;
    const IMPLEMENTATION: &'static str = "jit";

    fn spec(&self) -> &FusedQkvSpec {
        &self.spec
    }

    /// The spec's check; a call may pass the kernel's packed constant
    /// weight itself.
    fn check(&self, tensors: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<CheckedCall> {
        check_against(&self.spec, tensors, caches, self.packed_weight())
    }

    fn run(&self, checked: CheckedCall, call: Call<'_, '_>, ctx: &DeviceContextPtr) -> Result<()> {
        let [hidden_state, weight, layer_idx, valid_lengths] = call.tensors();
        let args = QkvArgs { hidden_state, weight, kv_collection: &mut *call.caches[0], layer_idx, valid_lengths };
        self.launch(&checked, args, call.outputs[0].as_bytes_mut(), ctx)
    }

    fn code_info(&self) -> CodeInfo {
        self.code.code_info()
    }

    fn prepared_constants(&self) -> Vec<(usize, PreparedConstant)> {
        let Some(constant) = &self.constant_weight else { return Vec::new() };
        vec![(
            1,
            PreparedConstant {
                layout: self.layout.id(self.layout.panel_dtype(self.spec.weights)),
                data: constant.packed().clone(),
            },
        )]
    }
}

impl JitKernel {
    /// Run a checked call: `checked` came from [`OpKernel::check`] on
    /// exactly these arguments and `output` holds `B·S·q_dim` elements.
    fn launch(
        &self,
        checked: &CheckedCall,
        args: QkvArgs<'_>,
        output: &mut [u8],
        ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let CheckedCall { shape, row_offsets } = checked;
        let QkvArgs { hidden_state, weight, kv_collection: cache, .. } = args;
        let rows = shape.batch * shape.seq;
        let panels = self.layout.panel_dtype(self.spec.weights);
        let (x, x_step) = activations(hidden_state, rows, self.spec.k, self.tier, panels);
        let packed_now;
        let packed = match self.constant_weight.as_ref().and_then(|c| c.panels_for(&[weight])) {
            Some(panels) => panels,
            None => {
                packed_now = self.layout.pack(&[weight])?;
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
        let (blocks, store_offsets) = match &mut staging {
            Some((stage, offsets)) => (stage.as_mut_ptr() as u64, offsets.as_ptr() as u64),
            None => (cache.blocks_bytes_mut().as_mut_ptr() as u64, row_offsets.as_ptr() as u64),
        };
        let args = GemmArgs {
            x: x.as_ptr() as u64,
            w: packed.as_bytes().as_ptr() as u64,
            out: output.as_mut_ptr() as u64,
            blocks,
            row_offsets: store_offsets,
            m: rows as u64,
            x_step: x_step as u64,
            // Read by the unspecialized kernel only; the others bake them in.
            k: self.spec.k as u64,
            q_dim: self.spec.q_dim as u64,
            kv_dim: kv_dim as u64,
            kv_stride: kv_store_stride(&self.spec) as u64,
        };
        if rows == 0 {
            return Ok(());
        }
        let code = self.code_for(shape);
        // SAFETY: `code` was compiled by `emit_and_compile` for this kernel's
        // spec (or the same spec with this call's B and S baked in), reading
        // `GemmArgs` at its fields' offsets. The check (`check_against`)
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
            let args = Fp8StoreArgs {
                stage: stage.as_ptr() as u64,
                row_offsets: row_offsets.as_ptr() as u64,
                blocks: blocks.as_mut_ptr() as u64,
                scales: scales.as_mut_ptr() as u64,
                kv_dim: kv_dim as u64,
                kv_stride: self.spec.kv_stride() as u64,
                g: self.spec.cache.scale_granularity().unwrap_or(1) as u64,
            };
            // SAFETY: `store` was compiled by `compile_fp8_store` for this
            // spec's kv_dim, g and K→V stride (or reads them from these
            // fields, set from the same spec). The check matched the cache
            // against the spec (f8e4m3, this granularity, layout), and the
            // cache keeps its scales `[P, 2, L, page, Hkv, D/g]` f32 for
            // exactly those params. For each row r < M in a launch range the
            // kernel reads the staged `stage[r·2·kv_dim ..][..2·kv_dim]`
            // (`stage` holds M rows, written by the launch above) and, when
            // `row_offsets[r] ≥ 0`, writes kv_dim codes at that offset and at
            // offset + kv_stride — slots `write_rows` validated inside the
            // blocks, distinct per row — and kv_dim / g scales at those
            // offsets divided by g (inside the scales, which mirror the
            // blocks' layout with D / g per head). Different rows write
            // different slots, so the ranges write disjoint memory.
            unsafe { kvjit_jit::launch(store, &args, rows, ctx) };
        }
        Ok(())
    }
}
