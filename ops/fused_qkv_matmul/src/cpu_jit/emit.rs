//! The CPU kernel: machine code Cranelift emits for one [`FusedQkvSpec`] on
//! one CPU tier.
//!
//! Everything the spec fixes is a constant in the code: K, the Q/K/V column
//! ranges, the K→V stride of the cache, dtypes, and — for a fully specialized
//! key — the row count M. The weight is packed once (at graph build when it
//! is a constant) into panels of the tier's width (8 columns on the
//! Cranelift tier, 16 on the 256-bit tier), k-major (`[K][width]`), one run
//! of panels per Q, K and V segment, each zero-padded to a whole panel.
//!
//! The driver — the loops, the schedule, the fused epilogue, the threading —
//! is always Cranelift-emitted code specialized for the key. Only the
//! innermost tile differs between the tiers ([`Schedule::of`]):
//!
//! ```text
//! for each block of block_rows rows:            (X block stays in cache across panels)
//!   for each panel p in the thread's range:     (a weight panel, read from DRAM once per block)
//!     Cranelift tier: for each group of 4 rows: a 4×8 tile of F32X4 fmas in registers over all of K
//!     256-bit tier:   for each k block (L1-sized; all of K when M = 1):
//!                       for each group of 6 rows: call the AVX2 micro-kernel for the tile,
//!                       adding into the block's accumulators on the stack
//!     epilogue: Q columns → output[r, col]; K/V columns → blocks[row_offset[r] + col]
//!               (skipped for padded rows: row_offset = -1), rounded to the dtype
//! ```
//!
//! The 256-bit tier reads activations packed per 6-row tile
//! (`pack_activations`: one sequential stream per tile); one row (decode)
//! is a GEMV that streams each panel as four sequential streams. A generic
//! kernel (M read at run time) picks between the GEMV and the blocked
//! schedule per call.
//!
//! **FP8 caches.** With an `f8e4m3` cache the epilogue stores each row's
//! K/V columns as f32 into a staging buffer (`[M, 2·Hkv·D]`, a few KiB per
//! decode step, still in L1/L2 when read back), and a second Cranelift
//! kernel of the same launch sequence quantizes every valid row's g-blocks
//! into the cache, rows split between the threads
//! ([`kvjit_jit::ir::e4m3::quantize_block`]: absmax of the finite values,
//! scale, round to nearest even with saturation, exactly as the reference). A g-block spans several
//! panels, and panels are split between threads, so its absmax is only
//! known once every panel of the row is done: the staging is where the
//! epilogue hands the block over.
//!
//! With M ≤ block_rows (decode) every weight panel is read from memory
//! exactly once for all rows, and the panels are split between the worker
//! threads: the kernel streams the weight once. Each output element is
//! computed by one call with the same code whatever the thread count, so
//! results are bit-identical for any number of threads.

use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use kvjit_core::{
    CpuTier, DType, Error, KernelKey, KeyField, PagedKVCacheCollection, PreparedConstant, Result, Target, Tensor,
    TensorData, bf16, f16,
};
use kvjit_jit::cranelift_codegen::ir::{
    InstBuilder, StackSlot, StackSlotData, StackSlotKind, Value, condcodes::IntCC, types,
};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::addr::{self, Displacements, Size};
use kvjit_jit::ir::{
    call_native, counted_loop, e4m3, if_else, load_f32x4_raw, load_splat_f32x4, mem, store_f32x4, store_lane, when,
};
use kvjit_jit::microkernel::{self, MAX_TILE_ROWS, TILE_COLUMNS};
use kvjit_jit::{CaptureText, CompileCause, JitError, JitFunction, SeenShapes, compile_kernel, pointer_type};
use kvjit_runtime::{CodeInfo, DeviceContextPtr, Kernel, OutputSpec};

use crate::call::cache_row_offsets;
use crate::kernel::{check_against_spec_with, checked_call_with, same_data};
pub use crate::panels::PanelLayout;
use crate::panels::{Destination, Segment};
use crate::{CallShape, FusedQkvError, FusedQkvSpec, OP_NAME, QkvArgs};

/// Columns per weight panel of the Cranelift tier (two F32X4 vectors).
pub const NR: usize = 8;
/// Rows per register tile of the Cranelift tier.
pub const MR: usize = 4;
/// Rows per block of the Cranelift tier: the X block that stays in cache
/// while panels stream by.
pub const MC: usize = 64;

/// The loop-nest sizes of a tier (see the module docs for the loops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Columns per weight panel (the packed layout's width).
    pub panel_columns: usize,
    /// Rows of the largest register tile.
    pub tile_rows: usize,
    /// Rows per block (the X block kept in cache while panels stream by).
    pub block_rows: usize,
}

impl Schedule {
    /// The schedule of a resolved tier (`Auto` is never built: kernels
    /// resolve it first).
    pub fn of(tier: CpuTier) -> Self {
        match tier {
            CpuTier::Avx2 => {
                Schedule { panel_columns: TILE_COLUMNS, tile_rows: MAX_TILE_ROWS, block_rows: AVX2_BLOCK_ROWS }
            }
            CpuTier::Auto | CpuTier::Cranelift => Schedule { panel_columns: NR, tile_rows: MR, block_rows: MC },
        }
    }
}

/// Rows per block of the 256-bit tier: 32 tiles of 6 rows, an X block of
/// 3 MiB at K = 4096 (in L3 while each thread's panels stream by; each
/// panel stays in L2 for the block's 32 tiles).
pub const AVX2_BLOCK_ROWS: usize = 192;

/// Bytes of a k block of a panel on the 256-bit tier, as f32 (half a 32 KiB
/// L1): 256 values of k × 16 columns.
pub const AVX2_BLOCK_BYTES: usize = 16 << 10;
/// k values per iteration of the micro-kernel loop (amortizes the loop's
/// overhead and the accumulator moves on its back edge).
pub const K_UNROLL: usize = 4;

/// Shapes a generic kernel specializes for, at most (the shared policy's
/// limit, [`kvjit_jit::MAX_SEEN_SHAPES`]).
pub use kvjit_jit::MAX_SEEN_SHAPES;
/// The compile log of the CPU JIT (every op's kernels: the registry is
/// shared), re-exported where this op's users look for it.
pub use kvjit_jit::compile_log;

/// Refuse specs whose offsets the generated code could not form (on either
/// tier): byte offsets of the cache and of rows must fit in i64, and the
/// constant displacements ([`displacements`]) in i32.
pub(crate) fn addressable(spec: &FusedQkvSpec) -> Result<(), JitError> {
    let fits = || -> Option<()> {
        let (nr, mc) = (TILE_COLUMNS.max(NR), AVX2_BLOCK_ROWS.max(MC));
        let kv_stride = spec.num_layers.checked_mul(spec.page_size)?.checked_mul(spec.kv_dim())?;
        let blocks_bytes = kv_stride.checked_mul(2)?.checked_mul(spec.cache_dtype.size_bytes())?;
        let n = spec.q_dim.checked_add(spec.kv_dim().checked_mul(2)?)?;
        let panel_bytes = spec.k.checked_mul(nr * spec.dtype.size_bytes())?.checked_mul(n.div_ceil(NR) + 3)?;
        if let (Some(batch), Some(seq)) = (spec.batch, spec.seq) {
            let rows = i64::try_from(batch.checked_mul(seq)?).ok()?;
            rows.checked_add(mc as i64)?;
        }
        (i64::try_from(blocks_bytes).is_ok() && i64::try_from(panel_bytes).is_ok()).then_some(())
    };
    fits().ok_or_else(|| JitError::Unsupported {
        key: spec.kernel_key().to_string(),
        reason: "its sizes overflow the offsets the kernel computes".into(),
    })?;
    displacements(spec).map(drop)
}

/// The constant displacements of the kernel's loads and stores: within the
/// rows of a Cranelift tile's activations (up to 6 rows of K f32, bounding
/// either tier), a k step of a weight panel, and a row of a 256-bit tile's
/// accumulators.
fn displacements(spec: &FusedQkvSpec) -> Result<Displacements, JitError> {
    let tile_rows = spec.k.checked_mul(4 * MAX_TILE_ROWS.max(MR));
    let largest = tile_rows.map(|rows| rows.max(K_UNROLL * NR * 4).max(TILE_COLUMNS * 4));
    Displacements::up_to(&spec.kernel_key(), largest)
}

/// The kernel's argument words ([`kvjit_jit::KernelParams::arg`]), in
/// order; the work items of a launch are weight panels.
mod arg {
    /// Activations as f32 rows, `[M, K]`.
    pub const X: usize = 0;
    /// The packed weight.
    pub const W: usize = 1;
    /// The Q output, `[M, q_dim]`.
    pub const OUT: usize = 2;
    /// The cache's blocks.
    pub const BLOCKS: usize = 3;
    /// Per row, the element offset of its K in `blocks` (-1: padded row).
    pub const ROW_OFFSETS: usize = 4;
    /// Rows M (read when the key leaves B or S symbolic).
    pub const M: usize = 5;
    /// The 256-bit tier's activation layout: rows interleaved in tiles of
    /// this many (see [`super::pack_activations`]); 1 when X is one plain row.
    pub const X_STEP: usize = 6;
    /// K (read by an unspecialized kernel only, like the next three).
    pub const K: usize = 7;
    /// Q columns.
    pub const Q_DIM: usize = 8;
    /// K (and V) columns, Hkv·D.
    pub const KV_DIM: usize = 9;
    /// Elements from a token's K to its V in the blocks, L·page_size·Hkv·D.
    pub const KV_STRIDE: usize = 10;
    /// Words in all.
    pub const COUNT: usize = 11;
}

/// The key of the JIT kernel for `spec` on a resolved `tier`: the op's key
/// with the tier named in its target (`…cpu-avx2…`).
pub fn tier_key(spec: &FusedQkvSpec, tier: CpuTier) -> KernelKey {
    spec.kernel_key().with_variant(tier.name())
}

/// The key of the unspecialized kernel for `spec`'s dtypes on `tier`: every
/// size left to run time (`…cpu-avx2.f32.kany.qany.hkvany.dany.pany.lany.kvf32.bany.sany`).
pub fn unspecialized_key(spec: &FusedQkvSpec, tier: CpuTier) -> KernelKey {
    let any = KeyField::Dynamic;
    KernelKey::new(crate::spec::KERNEL_NAME, spec.target, spec.dtype)
        .with_variant(tier.name())
        .with("k", any)
        .with("q", any)
        .with("hkv", any)
        .with("d", any)
        .with("p", any)
        .with("l", any)
        .with("kv", KeyField::DType(spec.cache_dtype))
        .with_if("g", spec.scale_granularity.map(|_| any))
        .with("b", any)
        .with("s", any)
}

/// Compile the kernel for `spec` on a resolved `tier` (or fetch it from the
/// process-wide registry). Kept IR/disassembly bypass the registry so the
/// texts always exist.
pub fn compile(spec: &FusedQkvSpec, tier: CpuTier, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
    compile_sized(spec, tier, false, capture)
}

/// [`compile`], or with `runtime_sizes` the unspecialized kernel.
fn compile_sized(
    spec: &FusedQkvSpec,
    tier: CpuTier,
    runtime_sizes: bool,
    capture: CaptureText,
) -> Result<Arc<JitFunction>, JitError> {
    let key = if runtime_sizes { unspecialized_key(spec, tier) } else { tier_key(spec, tier) };
    let build = || emit_and_compile(spec, tier, &key, capture, runtime_sizes);
    if capture.clif || capture.disasm {
        return build().map(Arc::new);
    }
    kvjit_jit::kernels().get_or_compile(&key, CompileCause::GraphBuild, build)
}

fn emit_and_compile(
    spec: &FusedQkvSpec,
    tier: CpuTier,
    key: &KernelKey,
    capture: CaptureText,
    runtime_sizes: bool,
) -> Result<JitFunction, JitError> {
    addressable(spec)?;
    let disp = displacements(spec)?;
    if tier == CpuTier::Auto {
        return Err(JitError::Unsupported { key: key.to_string(), reason: "the CPU tier was not resolved".into() });
    }
    if runtime_sizes && tier != CpuTier::Avx2 {
        return Err(JitError::Unsupported {
            key: key.to_string(),
            reason: "the unspecialized kernel exists on the avx2 tier only (the Cranelift tile unrolls K)".into(),
        });
    }
    // Resolving again refuses a 256-bit kernel on a CPU without AVX2.
    microkernel::resolve_tier(tier)?;
    compile_kernel(key, capture, |b, params| {
        let bases = Bases {
            x: params.arg(b, arg::X),
            w: params.arg(b, arg::W),
            out: params.arg(b, arg::OUT),
            blocks: params.arg(b, arg::BLOCKS),
            row_offsets: params.arg(b, arg::ROW_OFFSETS),
            x_step: params.arg(b, arg::X_STEP),
        };
        let m_arg = params.arg(b, arg::M);
        let sizes = runtime_sizes.then(|| Sizes {
            k: Size::Runtime(params.arg(b, arg::K)),
            q_dim: Size::Runtime(params.arg(b, arg::Q_DIM)),
            kv_dim: Size::Runtime(params.arg(b, arg::KV_DIM)),
            kv_stride: Size::Runtime(params.arg(b, arg::KV_STRIDE)),
        });
        // The 256-bit tiles hand their accumulators back through this slot.
        let avx2 = tier == CpuTier::Avx2;
        let mut slot =
            |bytes: usize| b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, bytes as u32, 5));
        let tile_buffer = avx2.then(|| slot(AVX2_BLOCK_ROWS * TILE_COLUMNS * 4));
        let widened_block = (avx2 && spec.dtype != DType::F32).then(|| slot(AVX2_BLOCK_BYTES));
        Emitter::new(spec, tier, disp, bases, (tile_buffer, widened_block), sizes).emit(
            b,
            m_arg,
            params.begin,
            params.end,
        );
    })
}

/// The dtype the epilogue stores K/V in: the cache's, or f32 into the
/// staging buffer of an FP8 cache.
fn kv_store_dtype(spec: &FusedQkvSpec) -> DType {
    if spec.cache_dtype.is_quantized() { DType::F32 } else { spec.cache_dtype }
}

/// Elements from a row's K to its V where the epilogue stores them: the
/// cache's K→V stride, or Hkv·D in an FP8 cache's staging rows.
fn kv_store_stride(spec: &FusedQkvSpec) -> usize {
    if spec.cache_dtype.is_quantized() { spec.kv_dim() } else { spec.kv_stride() }
}

/// The argument words of the FP8 store kernel; its work items are rows.
mod fp8_arg {
    /// The staged K/V, f32 `[M, 2·kv_dim]` (each row's K then V).
    pub const STAGE: usize = 0;
    /// Per row, the element offset of its K in the cache's blocks (-1:
    /// padded row, nothing stored).
    pub const ROW_OFFSETS: usize = 1;
    /// The cache's blocks (one byte per element).
    pub const BLOCKS: usize = 2;
    /// The cache's f32 scales.
    pub const SCALES: usize = 3;
    /// Hkv·D (read by the unspecialized kernel only, like the next two).
    pub const KV_DIM: usize = 4;
    /// Elements from a token's K to its V in the blocks.
    pub const KV_STRIDE: usize = 5;
    /// Values per scale, g.
    pub const G: usize = 6;
    /// Words in all.
    pub const COUNT: usize = 7;
}

/// The key of the FP8 store kernel for `spec` (sizes left to run time for
/// the unspecialized kernel).
fn fp8_store_key(spec: &FusedQkvSpec, runtime_sizes: bool) -> KernelKey {
    let size = |n: usize| if runtime_sizes { KeyField::Dynamic } else { KeyField::size(n) };
    KernelKey::new("fused_qkv_fp8_store", Target::Cpu, DType::F32)
        .with("kvdim", size(spec.kv_dim()))
        .with("g", size(spec.scale_granularity.unwrap_or(0)))
        .with("kvs", size(spec.kv_stride()))
}

/// Compile (or fetch) the kernel quantizing an FP8 cache's staged rows:
/// for each valid row in the thread's range, K then V, each g-block of
/// Hkv·D values with its own scale (`e4m3::quantize_block`), codes at the
/// row's page slot and scales at the same index divided by g.
fn compile_fp8_store(spec: &FusedQkvSpec, runtime_sizes: bool) -> Result<Arc<JitFunction>, JitError> {
    let key = fp8_store_key(spec, runtime_sizes);
    let Some(g) = spec.scale_granularity else {
        return Err(JitError::Unsupported {
            key: key.to_string(),
            reason: "an f8e4m3 cache needs a granularity".into(),
        });
    };
    let build = || {
        compile_kernel(&key, CaptureText::default(), |b, params| {
            let word = |b: &mut FunctionBuilder, i: usize| params.arg(b, i);
            let (stage, row_offsets, blocks, scales) = (
                word(b, fp8_arg::STAGE),
                word(b, fp8_arg::ROW_OFFSETS),
                word(b, fp8_arg::BLOCKS),
                word(b, fp8_arg::SCALES),
            );
            let sized = |b: &mut FunctionBuilder, i: usize, n: usize| {
                let size = if runtime_sizes { Size::Runtime(word(b, i)) } else { Size::Known(n) };
                size.value(b)
            };
            let kv_dim = sized(b, fp8_arg::KV_DIM, spec.kv_dim());
            let kv_stride = sized(b, fp8_arg::KV_STRIDE, spec.kv_stride());
            let g = sized(b, fp8_arg::G, g);
            let blocks_per_row = b.ins().udiv(kv_dim, g);
            let g_bytes = b.ins().ishl_imm_u(g, 2);
            let row_floats = b.ins().ishl_imm_u(kv_dim, 1);
            counted_loop(b, params.begin, params.end, 1, &[], |b, row, _| {
                let at = addr::element(b, row_offsets, row, 8);
                let slot = b.ins().load(types::I64, mem(), at, 0);
                let writes = b.ins().icmp_imm_s(IntCC::SignedGreaterThanOrEqual, slot, 0);
                when(b, writes, |b| {
                    let first = b.ins().imul(row, row_floats);
                    for kv in 0..2 {
                        let (element, staged) = if kv == 0 {
                            (slot, first)
                        } else {
                            (b.ins().iadd(slot, kv_stride), b.ins().iadd(first, kv_dim))
                        };
                        let src = addr::element(b, stage, staged, 4);
                        let codes = b.ins().iadd(blocks, element);
                        let scale_index = b.ins().udiv(element, g);
                        let scale_at = addr::element(b, scales, scale_index, 4);
                        let zero = b.ins().iconst(types::I64, 0);
                        counted_loop(b, zero, blocks_per_row, 1, &[], |b, block, _| {
                            let src_at = b.ins().imul(block, g_bytes);
                            let src_at = b.ins().iadd(src, src_at);
                            let codes_at = b.ins().imul(block, g);
                            let codes_at = b.ins().iadd(codes, codes_at);
                            let scale = addr::element(b, scale_at, block, 4);
                            e4m3::quantize_block(b, src_at, g, codes_at, scale);
                            Vec::new()
                        });
                    }
                });
                Vec::new()
            });
        })
    };
    kvjit_jit::kernels().get_or_compile(&key, CompileCause::GraphBuild, build)
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

/// The emitter's state for one kernel body — everything the loop nest and
/// the tiles share — so each level of the schedule takes the builder, this
/// context and only what its own loop adds (rustc_codegen_cranelift's
/// `FunctionCx` is the model).
struct Emitter {
    spec: FusedQkvSpec,
    /// Which code computes a tile.
    tier: CpuTier,
    schedule: Schedule,
    /// The bound of every constant displacement ([`displacements`]).
    disp: Displacements,
    /// The accumulators of a block's rows for one panel, `[block_rows][16]`
    /// f32 on the stack (the 256-bit tier only).
    tile_buffer: Option<StackSlot>,
    /// A k block of a bf16/f16 panel widened to f32 (the 256-bit tier with
    /// 2-byte weights only).
    widened_block: Option<StackSlot>,
    layout: PanelLayout,
    /// Sizes baked in or read at run time.
    sizes: Sizes,
    /// Rows, when the key fixes them.
    m: Option<usize>,
    /// The call's buffers.
    bases: Bases,
}

/// The call's buffer addresses, loaded once at entry.
#[derive(Clone, Copy)]
struct Bases {
    x: Value,
    w: Value,
    out: Value,
    blocks: Value,
    row_offsets: Value,
    /// The activation layout of the 256-bit tier ([`arg::X_STEP`]).
    x_step: Value,
}

/// Where a segment's panels start and how many there are.
#[derive(Clone, Copy)]
struct SegmentBounds {
    first_panel: Size,
    /// Whole panels.
    full: Size,
    /// Columns of the last, narrower panel (0: there is none).
    tail: Size,
}

/// The panel loop's state, which every tile of the panel shares.
#[derive(Clone, Copy)]
struct Panel {
    /// Address of the packed panel.
    w: Value,
    /// Its first column within its segment.
    column: Value,
    /// Where its columns go.
    destination: Destination,
    /// Columns it holds (NR, or fewer in a segment's last panel).
    width: Size,
}

impl Emitter {
    fn new(
        spec: &FusedQkvSpec,
        tier: CpuTier,
        disp: Displacements,
        bases: Bases,
        (tile_buffer, widened_block): (Option<StackSlot>, Option<StackSlot>),
        runtime_sizes: Option<Sizes>,
    ) -> Self {
        let schedule = Schedule::of(tier);
        let layout = PanelLayout::new(spec, schedule.panel_columns);
        let baked = Sizes {
            k: Size::Known(spec.k),
            q_dim: Size::Known(spec.q_dim),
            kv_dim: Size::Known(spec.kv_dim()),
            kv_stride: Size::Known(kv_store_stride(spec)),
        };
        let m = spec.batch.zip(spec.seq).map(|(b, s)| b * s).filter(|_| runtime_sizes.is_none());
        let sizes = runtime_sizes.unwrap_or(baked);
        Self { spec: *spec, tier, schedule, disp, tile_buffer, widened_block, layout, sizes, m, bases }
    }

    /// The schedule: blocks of `block_rows` rows, then this invocation's
    /// panels of each segment, then row groups of `tile_rows`.
    fn emit(&self, b: &mut FunctionBuilder, m_arg: Value, panel_begin: Value, panel_end: Value) {
        let m = match self.m {
            Some(m) => b.ins().iconst(types::I64, m as i64),
            None => m_arg,
        };
        let (nr, mc) = (self.schedule.panel_columns, self.schedule.block_rows);
        let zero = b.ins().iconst(types::I64, 0);
        counted_loop(b, zero, m, mc as i64, &[], |b, block_start, _| {
            let block_end = b.ins().iadd_imm_s(block_start, mc as i64);
            let block_end = b.ins().smin(block_end, m);
            for (seg, bounds) in self.segment_bounds(b) {
                let SegmentBounds { first_panel, full, tail } = bounds;
                // The segment's whole panels, then its narrower last one.
                let ranges = match (full, tail) {
                    (Size::Known(full), Size::Known(tail)) => {
                        let first = match first_panel {
                            Size::Known(first) => first,
                            Size::Runtime(_) => unreachable!("known column counts give a known first panel"),
                        };
                        [(first, full, Size::Known(nr)), (first + full, usize::from(tail > 0), Size::Known(tail))]
                            .into_iter()
                            .filter(|&(_, count, _)| count > 0)
                            .map(|(first, count, width)| {
                                let lo = b.ins().iconst(types::I64, first as i64);
                                let hi = b.ins().iconst(types::I64, (first + count) as i64);
                                (lo, hi, width)
                            })
                            .collect::<Vec<_>>()
                    }
                    _ => {
                        let first = first_panel.value(b);
                        let full = full.value(b);
                        let tail = tail.value(b);
                        let whole_end = b.ins().iadd(first, full);
                        let has_tail = b.ins().icmp_imm_s(IntCC::NotEqual, tail, 0);
                        let has_tail = b.ins().uextend(types::I64, has_tail);
                        let tail_end = b.ins().iadd(whole_end, has_tail);
                        vec![(first, whole_end, Size::Known(nr)), (whole_end, tail_end, Size::Runtime(tail))]
                    }
                };
                let first_panel = first_panel.value(b);
                for (lo, hi, width) in ranges {
                    let lo = b.ins().smax(lo, panel_begin);
                    let hi = b.ins().smin(hi, panel_end);
                    counted_loop(b, lo, hi, 1, &[], |b, index, _| {
                        let offset = self.sizes.k.times(b, index, (nr * self.spec.dtype.size_bytes()) as i64);
                        let rel = b.ins().isub(index, first_panel);
                        let panel = Panel {
                            w: b.ins().iadd(self.bases.w, offset),
                            column: b.ins().imul_imm_s(rel, nr as i64),
                            destination: seg.destination,
                            width,
                        };
                        match self.tier {
                            CpuTier::Avx2 => self.emit_avx2_panel(b, block_start, block_end, panel),
                            CpuTier::Auto | CpuTier::Cranelift => {
                                self.emit_row_groups(b, block_start, block_end, panel)
                            }
                        }
                        Vec::new()
                    });
                }
            }
            Vec::new()
        });
    }

    /// Each segment (Q, K, V) with its first panel, its whole panels and the
    /// width of its last, narrower one (0: none) — constants from the layout,
    /// or computed from the column counts an unspecialized kernel reads.
    fn segment_bounds(&self, b: &mut FunctionBuilder) -> Vec<(Segment, SegmentBounds)> {
        let nr = self.schedule.panel_columns;
        let (Size::Runtime(q_dim), Size::Runtime(kv_dim)) = (self.sizes.q_dim, self.sizes.kv_dim) else {
            return self
                .layout
                .segments
                .iter()
                .map(|seg| {
                    let bounds = SegmentBounds {
                        first_panel: Size::Known(seg.first_panel),
                        full: Size::Known(seg.columns / nr),
                        tail: Size::Known(seg.columns % nr),
                    };
                    (*seg, bounds)
                })
                .collect();
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
        self.layout
            .segments
            .iter()
            .zip([bounds(zero, q_full, q_tail), bounds(q_panels, kv_full, kv_tail), bounds(v_first, kv_full, kv_tail)])
            .map(|(seg, bounds)| (*seg, bounds))
            .collect()
    }

    /// Tiles of `tile_rows` rows over `[start, end)`, then one smaller tile
    /// for the rest. Blocks start at multiples of `block_rows`, itself a
    /// multiple of `tile_rows`, so with a known M the rest is known too.
    fn emit_row_groups(&self, b: &mut FunctionBuilder, start: Value, end: Value, panel: Panel) {
        self.emit_row_tiles(b, start, end, &|b, mr, row| self.emit_cranelift_tile(b, mr, row, panel));
    }

    /// Tiles of `tile_rows` rows over `[start, end)` (`tile(b, rows, first
    /// row)` emits one), then one smaller tile for the rest. Blocks start at
    /// multiples of `block_rows`, itself a multiple of `tile_rows`, so with a
    /// known M the rest is known too.
    fn emit_row_tiles(
        &self,
        b: &mut FunctionBuilder,
        start: Value,
        end: Value,
        tile: &dyn Fn(&mut FunctionBuilder, usize, Value),
    ) {
        let mr = self.schedule.tile_rows;
        let rows = b.ins().isub(end, start);
        let whole = if mr.is_power_of_two() {
            b.ins().band_imm_s(rows, !(mr as i64 - 1))
        } else {
            let tiles = b.ins().udiv_imm_u(rows, mr as i64);
            b.ins().imul_imm_s(tiles, mr as i64)
        };
        let full_end = b.ins().iadd(start, whole);
        counted_loop(b, start, full_end, mr as i64, &[], |b, row, _| {
            tile(b, mr, row);
            Vec::new()
        });
        let rest = b.ins().isub(end, full_end);
        let remainders: Vec<usize> = match self.m {
            Some(m) => Some(m % mr).filter(|&r| r > 0).into_iter().collect(),
            None => (1..mr).collect(),
        };
        let done = b.create_block();
        for mr in remainders {
            let this = b.create_block();
            let next = b.create_block();
            let is_this = b.ins().icmp_imm_s(IntCC::Equal, rest, mr as i64);
            b.ins().brif(is_this, this, &[], next, &[]);
            b.switch_to_block(this);
            tile(b, mr, full_end);
            b.ins().jump(done, &[]);
            b.switch_to_block(next);
        }
        b.ins().jump(done, &[]);
        b.switch_to_block(done);
    }

    /// One panel of the 256-bit tier over rows `[start, end)`: the panel's
    /// columns of C for those rows accumulate in the stack buffer, k block
    /// by k block ([`Emitter::k_block`]), each block of the panel (L1-sized)
    /// reused by every row tile while the next streams in; then the epilogue
    /// stores every row. With one row (decode) the whole of K is one block:
    /// a streaming GEMV.
    fn emit_avx2_panel(&self, b: &mut FunctionBuilder, start: Value, end: Value, panel: Panel) {
        let slot = self.tile_buffer.expect("the avx2 tier's kernels have a tile buffer");
        let ptr = pointer_type();
        let c = b.ins().stack_addr(ptr, slot, 0);
        let zero = b.ins().f32const(0.0);
        let zero = b.ins().splat(types::F32X4, zero);
        counted_loop(b, start, end, 1, &[], |b, row, _| {
            let at = self.tile_row_address(b, c, start, row);
            for v in 0..TILE_COLUMNS / 4 {
                b.ins().store(mem(), zero, at, self.disp.of(16 * v));
            }
            Vec::new()
        });
        match self.m {
            Some(1) => self.emit_avx2_k_blocks(b, start, end, panel, c, None),
            Some(_) => self.emit_avx2_k_blocks(b, start, end, panel, c, Some(self.k_block())),
            None => {
                // The generic kernel picks the schedule at run time: one row
                // streams the whole of K (GEMV), more rows go k block by k
                // block.
                let rows = b.ins().isub(end, start);
                let one_row = b.ins().icmp_imm_s(IntCC::Equal, rows, 1);
                if_else(
                    b,
                    one_row,
                    |b| self.emit_avx2_k_blocks(b, start, end, panel, c, None),
                    |b| self.emit_avx2_k_blocks(b, start, end, panel, c, Some(self.k_block())),
                );
            }
        }
        counted_loop(b, start, end, 1, &[], |b, row, _| {
            let at = self.tile_row_address(b, c, start, row);
            let vectors: Vec<Value> =
                (0..TILE_COLUMNS / 4).map(|v| b.ins().load(types::F32X4, mem(), at, self.disp.of(16 * v))).collect();
            self.emit_store_row(b, row, 0, panel, &vectors);
            Vec::new()
        });
    }

    /// The row tiles of rows `[start, end)` over all of K, adding into the
    /// accumulators at `c`: in blocks of `k_block` k values (the last one
    /// shorter; bf16/f16 blocks widened to f32 first, once for all the row
    /// tiles), or — `None`, the GEMV — all of K at once, read as stored.
    fn emit_avx2_k_blocks(
        &self,
        b: &mut FunctionBuilder,
        start: Value,
        end: Value,
        panel: Panel,
        c: Value,
        k_block: Option<usize>,
    ) {
        let size = self.spec.dtype.size_bytes();
        // The widened block holds k_block·16 f32 (AVX2_BLOCK_BYTES).
        let widened = self.widened_block.filter(|_| k_block.is_some());
        debug_assert!(k_block.is_none_or(|kc| kc * TILE_COLUMNS * 4 <= AVX2_BLOCK_BYTES));
        let tiles = |b: &mut FunctionBuilder, kb: Value, kc: Size| {
            let mut w = addr::element(b, panel.w, kb, TILE_COLUMNS * size);
            let mut w_dtype = self.spec.dtype;
            if let Some(slot) = widened {
                let widen = microkernel::widen_block(self.spec.dtype)
                    .expect("the avx2 tier has widening kernels for bf16 and f16");
                let one = b.ins().iconst(types::I64, 1);
                let count = kc.times(b, one, TILE_COLUMNS as i64);
                let out = b.ins().stack_addr(pointer_type(), slot, 0);
                call_native(b, widen as usize, &[w, count, out]);
                (w, w_dtype) = (out, DType::F32);
            }
            self.emit_row_tiles(b, start, end, &|b, mr, row| {
                self.emit_avx2_tile(b, mr, row, start, kb, kc, (w, w_dtype), c)
            });
        };
        match (self.sizes.k, k_block) {
            (k, None) => {
                let kb = b.ins().iconst(types::I64, 0);
                tiles(b, kb, k);
            }
            (Size::Known(k), Some(kc)) => {
                let whole = k - k % kc;
                if whole > 0 {
                    let first = b.ins().iconst(types::I64, 0);
                    let last = b.ins().iconst(types::I64, whole as i64);
                    counted_loop(b, first, last, kc as i64, &[], |b, kb, _| {
                        tiles(b, kb, Size::Known(kc));
                        Vec::new()
                    });
                }
                if whole < k {
                    let kb = b.ins().iconst(types::I64, whole as i64);
                    tiles(b, kb, Size::Known(k - whole));
                }
            }
            (Size::Runtime(k), Some(kc)) => {
                debug_assert!(kc.is_power_of_two());
                let whole = b.ins().band_imm_s(k, !(kc as i64 - 1));
                let first = b.ins().iconst(types::I64, 0);
                counted_loop(b, first, whole, kc as i64, &[], |b, kb, _| {
                    tiles(b, kb, Size::Known(kc));
                    Vec::new()
                });
                let rest = b.ins().isub(k, whole);
                let has_rest = b.ins().icmp_imm_s(IntCC::NotEqual, rest, 0);
                when(b, has_rest, |b| tiles(b, whole, Size::Runtime(rest)));
            }
        }
    }

    /// k values per block of the 256-bit schedule for more than one row:
    /// a block of the panel, as f32, fills half of a 32 KiB L1 (256 values
    /// of k; bf16/f16 blocks are widened into such a block first) and every
    /// row tile of the block reuses it. One row (decode) streams the whole of
    /// K instead: nothing to reuse, and half the bytes to read for bf16.
    fn k_block(&self) -> usize {
        AVX2_BLOCK_BYTES / (TILE_COLUMNS * 4)
    }

    /// The address of row `row`'s accumulators in the stack buffer of a
    /// block starting at `start`.
    fn tile_row_address(&self, b: &mut FunctionBuilder, c: Value, start: Value, row: Value) -> Value {
        let index = b.ins().isub(row, start);
        addr::element(b, c, index, TILE_COLUMNS * 4)
    }

    /// One call of the ahead-of-time micro-kernel for `mr` rows from `row`
    /// and k values `[kb, kb + kc)` (its address baked into the code),
    /// reading the block's weights `w` (at k = kb, of its dtype); it adds
    /// into those rows' accumulators in the stack buffer.
    #[allow(clippy::too_many_arguments)]
    fn emit_avx2_tile(
        &self,
        b: &mut FunctionBuilder,
        mr: usize,
        row: Value,
        start: Value,
        kb: Value,
        kc: Size,
        (w, w_dtype): (Value, DType),
        c: Value,
    ) {
        let tile = microkernel::gemm_tile(w_dtype, mr)
            .expect("emit_and_compile resolved the avx2 tier, which has a tile of every height up to MAX_TILE_ROWS");
        // Tiles start at multiples of the packing step (or at row 0 of a
        // single plain row), so the tile's x starts at element row·K +
        // kb·step of the packed activations.
        let x_row = self.sizes.k.times(b, row, 1);
        let x_k = b.ins().imul(kb, self.bases.x_step);
        let x_element = b.ins().iadd(x_row, x_k);
        let x = addr::element(b, self.bases.x, x_element, 4);
        let kc = kc.value(b);
        let c = self.tile_row_address(b, c, start, row);
        call_native(b, tile as usize, &[x, self.bases.x_step, w, kc, c]);
    }

    /// The Cranelift tile: an `mr`×NR tile of C = X·Wᵀ in registers, then
    /// its epilogue. Small tiles split k over several accumulator sets so
    /// the FMA latency chain does not limit them.
    fn emit_cranelift_tile(&self, b: &mut FunctionBuilder, mr: usize, row: Value, panel: Panel) {
        let k = self.layout.k;
        let w_dtype = self.spec.dtype;
        let w_size = w_dtype.size_bytes();
        let at = |bytes: usize| self.disp.of(bytes);
        let sets = match mr {
            1 => 4,
            2 => 2,
            _ => 1,
        };
        let zero = b.ins().f32const(0.0);
        let zero = b.ins().splat(types::F32X4, zero);
        let x_rows = addr::element(b, self.bases.x, row, k * 4);
        // Accumulator index: (set, row, half).
        let acc_index = |set: usize, i: usize, h: usize| (set * mr + i) * 2 + h;
        // `count` consecutive k values from `kk`; k value u uses accumulator
        // set u % sets. Each FMA gets its own broadcast load of x: a splat
        // with one use folds into `vbroadcastss mem`, while a shared one costs
        // a register copy per FMA (x64 FMAs overwrite a multiplicand).
        let step = |b: &mut FunctionBuilder, kk: Value, count: usize, accs: &mut [Value]| {
            let x_at = addr::element(b, x_rows, kk, 4);
            let w_at = addr::element(b, panel.w, kk, NR * w_size);
            for u in 0..count {
                let halves = [
                    load_f32x4_raw(b, w_dtype, w_at, at(u * NR * w_size)),
                    load_f32x4_raw(b, w_dtype, w_at, at((u * NR + 4) * w_size)),
                ];
                for i in 0..mr {
                    for (h, &w) in halves.iter().enumerate() {
                        let xb = load_splat_f32x4(b, DType::F32, x_at, at((i * k + u) * 4));
                        let acc = &mut accs[acc_index(u % sets, i, h)];
                        *acc = b.ins().fma(xb, w, *acc);
                    }
                }
            }
        };
        let main = k - k % K_UNROLL;
        let start = b.ins().iconst(types::I64, 0);
        let end = b.ins().iconst(types::I64, main as i64);
        let mut accs = counted_loop(b, start, end, K_UNROLL as i64, &vec![zero; sets * mr * 2], |b, kk, carried| {
            let mut accs = carried.to_vec();
            step(b, kk, K_UNROLL, &mut accs);
            accs
        });
        if main < k {
            let kk = b.ins().iconst(types::I64, main as i64);
            step(b, kk, k - main, &mut accs);
        }
        for set in 1..sets {
            for i in 0..mr {
                for h in 0..2 {
                    accs[acc_index(0, i, h)] = b.ins().fadd(accs[acc_index(0, i, h)], accs[acc_index(set, i, h)]);
                }
            }
        }
        for i in 0..mr {
            let halves = [accs[acc_index(0, i, 0)], accs[acc_index(0, i, 1)]];
            self.emit_store_row(b, row, i, panel, &halves);
        }
    }

    /// Store row `row + i` of a tile (its F32X4 vectors, four columns each)
    /// where its panel's columns go.
    fn emit_store_row(&self, b: &mut FunctionBuilder, row: Value, i: usize, panel: Panel, vectors: &[Value]) {
        let r = b.ins().iadd_imm_s(row, i as i64);
        match panel.destination {
            Destination::Q => {
                let element = self.sizes.q_dim.times(b, r, 1);
                let element = b.ins().iadd(element, panel.column);
                let base = addr::element(b, self.bases.out, element, self.spec.dtype.size_bytes());
                emit_store_columns(b, self.disp, self.spec.dtype, base, panel.width, vectors);
            }
            Destination::K | Destination::V => {
                let slot_at = addr::element(b, self.bases.row_offsets, r, 8);
                let slot = b.ins().load(types::I64, mem(), slot_at, 0);
                let writes = b.ins().icmp_imm_s(IntCC::SignedGreaterThanOrEqual, slot, 0);
                when(b, writes, |b| {
                    let element = match (panel.destination, self.sizes.kv_stride) {
                        (Destination::V, Size::Known(stride)) => b.ins().iadd_imm_s(slot, stride as i64),
                        (Destination::V, Size::Runtime(stride)) => b.ins().iadd(slot, stride),
                        _ => slot,
                    };
                    let element = b.ins().iadd(element, panel.column);
                    let dtype = kv_store_dtype(&self.spec);
                    let base = addr::element(b, self.bases.blocks, element, dtype.size_bytes());
                    emit_store_columns(b, self.disp, dtype, base, panel.width, vectors);
                });
            }
        }
    }
}

/// Store the first `width` columns of a tile row (F32X4 `vectors`, four
/// columns each) as `dtype` at `base`.
fn emit_store_columns(
    b: &mut FunctionBuilder,
    disp: Displacements,
    dtype: DType,
    base: Value,
    width: Size,
    vectors: &[Value],
) {
    let size = dtype.size_bytes();
    for (h, &value) in vectors.iter().enumerate() {
        match width {
            Size::Known(width) => {
                let lanes = width.saturating_sub(4 * h).min(4);
                if lanes == 4 {
                    store_f32x4(b, dtype, value, base, disp.of(4 * h * size));
                } else {
                    for lane in 0..lanes {
                        store_lane(b, dtype, value, lane as u8, base, disp.of((4 * h + lane) * size));
                    }
                }
            }
            // A last panel whose width only the run knows: each lane
            // is stored when its column exists.
            Size::Runtime(width) => {
                for lane in 0..4 {
                    let column = 4 * h + lane;
                    let exists = b.ins().icmp_imm_s(IntCC::UnsignedGreaterThan, width, column as i64);
                    when(b, exists, |b| store_lane(b, dtype, value, lane as u8, base, disp.of(column * size)));
                }
            }
        }
    }
}

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
    /// kernel for each (B, S) it runs with, up to [`MAX_SEEN_SHAPES`] per
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
        CodeInfo {
            compile_time: self.code.compile_time(),
            code_size: self.code.code_size(),
            ir: self.code.clif().map(str::to_string),
            disasm: self.code.disasm().map(str::to_string),
        }
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
