//! The emitter: the Cranelift IR of one spec's kernel on one tier — the
//! schedule's loops, each tier's tile, the fused epilogue — and the checks
//! of what that code can address ([`addressable`], `displacements`).

use std::mem::offset_of;
use std::sync::Arc;

use kvjit_core::{CodeTier, DType, KernelSpec, Result};
use kvjit_jit::cranelift_codegen::ir::{
    InstBuilder, StackSlot, StackSlotData, StackSlotKind, Value, condcodes::IntCC, types,
};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::addr::{self, Displacements, Size};
use kvjit_jit::ir::{
    call_native, counted_loop, if_else, load_f32x4_raw, load_splat_f32x4, match_cases, mem, store_f32x4, store_lane,
    when,
};
use kvjit_jit::microkernel::{self, MAX_TILE_ROWS, TILE_COLUMNS};
use kvjit_jit::{CaptureText, JitError, JitFunction, compile_kernel, pointer_type};

use super::schedule::{AVX2_BLOCK_BYTES, AVX2_BLOCK_ROWS, K_UNROLL, MC, MR, NR, Schedule};
use super::{GemmArgs, code_tier, kv_store_dtype, kv_store_stride};
use crate::panels::PanelLayout;
use crate::panels::{Destination, Segment};
use crate::{FusedQkvSpec, Sizes as SpecSizes};

/// Refuse specs whose offsets the generated code could not form (on either
/// tier): byte offsets of the cache and of rows must fit in i64, and the
/// constant displacements ([`displacements`]) in i32.
pub(crate) fn addressable(spec: &FusedQkvSpec) -> Result<(), JitError> {
    let fits = || -> Option<()> {
        let (nr, mc) = (TILE_COLUMNS.max(NR), AVX2_BLOCK_ROWS.max(MC));
        let kv_stride = spec.cache.num_layers.checked_mul(spec.cache.page_size)?.checked_mul(spec.kv_dim())?;
        let blocks_bytes = kv_stride.checked_mul(2)?.checked_mul(spec.cache.dtype().size_bytes())?;
        let n = spec.q_dim.checked_add(spec.kv_dim().checked_mul(2)?)?;
        let panel_bytes = spec.k.checked_mul(nr * spec.dtype.size_bytes())?.checked_mul(n.div_ceil(NR) + 3)?;
        if let (Some(batch), Some(seq)) = (spec.step.batch, spec.step.seq) {
            let rows = i64::try_from(batch.checked_mul(seq)?).ok()?;
            rows.checked_add(mc as i64)?;
        }
        (i64::try_from(blocks_bytes).is_ok() && i64::try_from(panel_bytes).is_ok()).then_some(())
    };
    fits().ok_or_else(|| JitError::Unsupported {
        key: spec.key().to_string(),
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
    Displacements::up_to(&spec.key(), largest)
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
    let disp = displacements(spec)?;
    let key = spec.key();
    let runtime_sizes = spec.sizes == SpecSizes::Runtime;
    if runtime_sizes && tier != CodeTier::Avx2 {
        return Err(JitError::Unsupported {
            key: key.to_string(),
            reason: "the unspecialized kernel exists on the avx2 tier only (the Cranelift tile unrolls K)".into(),
        });
    }
    compile_kernel(&key, capture, |b, params| {
        let field = |b: &mut FunctionBuilder, offset: usize| params.field(b, offset);
        let bases = Bases {
            x: field(b, offset_of!(GemmArgs, x)),
            w: field(b, offset_of!(GemmArgs, w)),
            out: field(b, offset_of!(GemmArgs, out)),
            blocks: field(b, offset_of!(GemmArgs, blocks)),
            row_offsets: field(b, offset_of!(GemmArgs, row_offsets)),
            x_step: field(b, offset_of!(GemmArgs, x_step)),
        };
        let m_arg = field(b, offset_of!(GemmArgs, m));
        let sizes = runtime_sizes.then(|| Sizes {
            k: Size::Runtime(field(b, offset_of!(GemmArgs, k))),
            q_dim: Size::Runtime(field(b, offset_of!(GemmArgs, q_dim))),
            kv_dim: Size::Runtime(field(b, offset_of!(GemmArgs, kv_dim))),
            kv_stride: Size::Runtime(field(b, offset_of!(GemmArgs, kv_stride))),
        });
        // The 256-bit tiles hand their accumulators back through this slot.
        let avx2 = tier == CodeTier::Avx2;
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
    tier: CodeTier,
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
    /// The activation layout of the 256-bit tier (`GemmArgs::x_step`).
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
        tier: CodeTier,
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
        let m = spec.step.batch.zip(spec.step.seq).map(|(b, s)| b * s).filter(|_| runtime_sizes.is_none());
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
                            CodeTier::Avx2 => self.emit_avx2_panel(b, block_start, block_end, panel),
                            CodeTier::Cranelift => self.emit_row_groups(b, block_start, block_end, panel),
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
        match_cases(b, rest, &remainders, |b, mr| tile(b, mr, full_end));
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
                self.emit_avx2_tile(b, (mr, row, start), (kb, kc), (w, w_dtype), c)
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

    /// One call of the ahead-of-time micro-kernel (its address baked into
    /// the code) for `mr` rows from `row` (the tile block starting at
    /// `start`) and k values `[kb, kb + kc)`, reading the block's weights `w`
    /// (at k = kb, of its dtype); it adds into those rows' accumulators in
    /// the stack buffer.
    fn emit_avx2_tile(
        &self,
        b: &mut FunctionBuilder,
        (mr, row, start): (usize, Value, Value),
        (kb, kc): (Value, Size),
        (w, w_dtype): (Value, DType),
        c: Value,
    ) {
        let tile = microkernel::gemm_tile(w_dtype, mr).expect(
            "code_tier checked this CPU runs the avx2 tier, which has a tile of every height up to MAX_TILE_ROWS",
        );
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
            // A multiply, not addr::element's shift: on the bf16 Cranelift
            // tile the shift form ran 1.9x slower at M = 4 (measured side by
            // side, Intel Xeon; the IR otherwise identical).
            let w_off = b.ins().imul_imm_s(kk, (NR * w_size) as i64);
            let w_at = b.ins().iadd(panel.w, w_off);
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
