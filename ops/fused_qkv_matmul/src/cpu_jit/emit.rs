//! The emitter of the fused op's kernel: the platform's GEMM driver
//! ([`kvjit_op::gemm::GemmEmitter`]) with this op's epilogue — Q columns
//! to the output, K/V columns into the cache at each valid row's slot —
//! and the checks of what that code can address ([`addressable`]).

use std::mem::offset_of;
use std::sync::Arc;

use kvjit_core::{CodeTier, KernelSpec, Result};
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, Value, condcodes::IntCC, types};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::addr::{self, Displacements, Size};
use kvjit_jit::ir::{mem, when};
use kvjit_jit::{CaptureText, JitError, JitFunction, compile_kernel};
use kvjit_op::gemm::{self, Epilogue, GemmBases, GemmEmitter, PanelAt, Scratch, SegmentBounds, store_columns};

use super::{GemmArgs, code_tier, kv_store_dtype, kv_store_stride, layout};
use crate::{FusedQkvSpec, Sizes as SpecSizes};

/// The segments of the packed weight, in order: where their columns go.
const Q: usize = 0;
const V: usize = 2;

/// Refuse specs whose offsets the generated code could not form (on either
/// tier): byte offsets of the cache and of rows must fit in i64, and the
/// constant displacements ([`gemm::displacements`]) in i32.
pub(crate) fn addressable(spec: &FusedQkvSpec) -> Result<(), JitError> {
    let fits = || -> Option<()> {
        let kv_stride = spec.cache.num_layers.checked_mul(spec.cache.page_size)?.checked_mul(spec.kv_dim())?;
        let blocks_bytes = kv_stride.checked_mul(2)?.checked_mul(spec.cache.dtype().size_bytes())?;
        let n = spec.q_dim.checked_add(spec.kv_dim().checked_mul(2)?)?;
        let groups = n.div_ceil(gemm::NR);
        let rows = spec.step.batch.zip(spec.step.seq).map(|(b, s)| b.checked_mul(s));
        let rows = match rows {
            Some(rows) => Some(rows?),
            None => None,
        };
        // Panels of f32 at most (the Cranelift tier's dequantized blocks).
        let panel_size = spec.weights.size_bytes().max(4);
        (i64::try_from(blocks_bytes).is_ok() && gemm::addressable(spec.k, panel_size, groups, 1, rows)).then_some(())
    };
    fits().ok_or_else(|| JitError::Unsupported {
        key: spec.key().to_string(),
        reason: "its sizes overflow the offsets the kernel computes".into(),
    })?;
    gemm::displacements(&spec.key(), spec.k, 0).map(drop)
}

/// Compile the kernel for a CPU `spec` on the tier it names (or fetch it
/// from the process-wide registry, under the spec's key). Kept
/// IR/disassembly bypass the registry so the texts always exist.
pub fn compile(spec: &FusedQkvSpec, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
    let tier = code_tier(spec)?;
    kvjit_jit::compile_or_fetch(&spec.key(), capture, || emit_and_compile(spec, tier, capture))
}

/// Emit and compile the kernel of `spec` on `tier` (the tier it names,
/// checked to run here by [`code_tier`]).
pub(super) fn emit_and_compile(
    spec: &FusedQkvSpec,
    tier: CodeTier,
    capture: CaptureText,
) -> Result<JitFunction, JitError> {
    addressable(spec)?;
    let disp = gemm::displacements(&spec.key(), spec.k, 0)?;
    let key = spec.key();
    let runtime_sizes = spec.sizes == SpecSizes::Runtime;
    if runtime_sizes && tier != CodeTier::Avx2 {
        return Err(JitError::Unsupported {
            key: key.to_string(),
            reason: "the unspecialized kernel exists on the avx2 tier only (the Cranelift tile unrolls K)".into(),
        });
    }
    if runtime_sizes && spec.weights.is_block_format() {
        return Err(JitError::Unsupported {
            key: key.to_string(),
            reason: "block weights are read by kernels that bake K in (the unspecialized kernel reads it)".into(),
        });
    }
    compile_kernel(&key, capture, |b, params| {
        let field = |b: &mut FunctionBuilder, offset: usize| params.field(b, offset);
        let bases = GemmBases {
            x: field(b, offset_of!(GemmArgs, x)),
            w: field(b, offset_of!(GemmArgs, w)),
            x_step: field(b, offset_of!(GemmArgs, x_step)),
        };
        let m_arg = field(b, offset_of!(GemmArgs, m));
        let sizes = match runtime_sizes {
            true => Sizes {
                k: Size::Runtime(field(b, offset_of!(GemmArgs, k))),
                q_dim: Size::Runtime(field(b, offset_of!(GemmArgs, q_dim))),
                kv_dim: Size::Runtime(field(b, offset_of!(GemmArgs, kv_dim))),
                kv_stride: Size::Runtime(field(b, offset_of!(GemmArgs, kv_stride))),
            },
            false => Sizes {
                k: Size::Known(spec.k),
                q_dim: Size::Known(spec.q_dim),
                kv_dim: Size::Known(spec.kv_dim()),
                kv_stride: Size::Known(kv_store_stride(spec)),
            },
        };
        let epilogue = QkvStore {
            spec: *spec,
            disp,
            sizes,
            out: field(b, offset_of!(GemmArgs, out)),
            blocks: field(b, offset_of!(GemmArgs, blocks)),
            row_offsets: field(b, offset_of!(GemmArgs, row_offsets)),
        };
        let bounds = segment_bounds(b, spec, tier, sizes);
        let m = spec.step.batch.zip(spec.step.seq).map(|(b, s)| b * s).filter(|_| !runtime_sizes);
        let panels = super::layout(spec, tier).panel_dtype(spec.weights);
        let emitter = GemmEmitter {
            tier,
            dtype: panels,
            k: sizes.k,
            m,
            weights: 1,
            disp,
            bases,
            scratch: Scratch::new(b, tier, panels, 1),
            epilogue: &epilogue,
        };
        emitter.emit(b, m_arg, params.begin, params.end, &bounds);
    })
}

/// Which sizes a kernel bakes in: all the spec's (a specialized or generic
/// kernel), or none but the dtypes (an unspecialized kernel, which reads K,
/// the column counts and the cache's K→V stride from its argument words).
#[derive(Clone, Copy)]
struct Sizes {
    k: Size,
    q_dim: Size,
    kv_dim: Size,
    kv_stride: Size,
}

/// Each segment (Q, K, V) with its first panel, its whole panels and the
/// width of its last, narrower one (0: none) — constants from the layout,
/// or computed from the column counts an unspecialized kernel reads.
fn segment_bounds(b: &mut FunctionBuilder, spec: &FusedQkvSpec, tier: CodeTier, sizes: Sizes) -> Vec<SegmentBounds> {
    let layout = layout(spec, tier);
    let nr = layout.panel_columns();
    let (Size::Runtime(q_dim), Size::Runtime(kv_dim)) = (sizes.q_dim, sizes.kv_dim) else {
        return SegmentBounds::of(&layout);
    };
    let split = |b: &mut FunctionBuilder, columns: Value| {
        let full = b.ins().ushr_imm_u(columns, nr.trailing_zeros() as i64);
        let tail = b.ins().band_imm_s(columns, nr as i64 - 1);
        let panels = b.ins().iadd_imm_s(columns, nr as i64 - 1);
        let panels = b.ins().ushr_imm_u(panels, nr.trailing_zeros() as i64);
        (full, tail, panels)
    };
    let (q_full, q_tail, q_panels) = split(b, q_dim);
    let (kv_full, kv_tail, kv_panels) = split(b, kv_dim);
    let zero = b.ins().iconst(types::I64, 0);
    let v_first = b.ins().iadd(q_panels, kv_panels);
    let bounds = |first, full, tail| SegmentBounds {
        first_panel: Size::Runtime(first),
        full: Size::Runtime(full),
        tail: Size::Runtime(tail),
    };
    vec![bounds(zero, q_full, q_tail), bounds(q_panels, kv_full, kv_tail), bounds(v_first, kv_full, kv_tail)]
}

/// The fused op's epilogue: a row's Q columns to the output, its K and V
/// columns into the cache at the row's slot (skipped for padded rows,
/// whose slot is -1), rounded once to their dtypes.
struct QkvStore {
    spec: FusedQkvSpec,
    disp: Displacements,
    sizes: Sizes,
    /// The Q output, `[M, q_dim]`.
    out: Value,
    /// The cache's blocks (an FP8 cache's f32 staging rows).
    blocks: Value,
    /// Per row, the element offset of its K in `blocks` (-1: padded row).
    row_offsets: Value,
}

impl Epilogue for QkvStore {
    fn store_row(&self, b: &mut FunctionBuilder, r: Value, panel: &PanelAt, vectors: &[Value]) {
        if panel.segment == Q {
            let element = self.sizes.q_dim.times(b, r, 1);
            let element = b.ins().iadd(element, panel.column);
            let base = addr::element(b, self.out, element, self.spec.dtype.size_bytes());
            store_columns(b, self.disp, self.spec.dtype, base, panel.width, vectors);
            return;
        }
        let slot_at = addr::element(b, self.row_offsets, r, 8);
        let slot = b.ins().load(types::I64, mem(), slot_at, 0);
        let writes = b.ins().icmp_imm_s(IntCC::SignedGreaterThanOrEqual, slot, 0);
        when(b, writes, |b| {
            let element = match (panel.segment, self.sizes.kv_stride) {
                (V, Size::Known(stride)) => b.ins().iadd_imm_s(slot, stride as i64),
                (V, Size::Runtime(stride)) => b.ins().iadd(slot, stride),
                _ => slot,
            };
            let element = b.ins().iadd(element, panel.column);
            let dtype = kv_store_dtype(&self.spec);
            let base = addr::element(b, self.blocks, element, dtype.size_bytes());
            store_columns(b, self.disp, dtype, base, panel.width, vectors);
        });
    }
}
