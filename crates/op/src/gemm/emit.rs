//! The GEMM driver's emitter: the Cranelift IR of the schedule's loops and
//! each tier's tile, calling the op's [`Epilogue`] with every finished row
//! of a panel group.

use cranelift_codegen::ir::{InstBuilder, StackSlot, StackSlotData, StackSlotKind, Value, condcodes::IntCC, types};
use cranelift_frontend::FunctionBuilder;
use kvjit_core::{CodeTier, DType, KernelKey};
use kvjit_jit::ir::addr::{self, Displacements, Size};
use kvjit_jit::ir::{
    call_native, call_native_at, counted_loop, if_else, load_f32x4_raw, load_splat_f32x4, match_cases, mem,
    store_f32x4, store_lane, when,
};
use kvjit_jit::microkernel::{self, MAX_TILE_ROWS, TILE_COLUMNS};
use kvjit_jit::quant::QuantDot;
use kvjit_jit::{JitError, cranelift_codegen, cranelift_frontend, pointer_type};

use super::panels::PanelLayout;
use super::schedule::{AVX2_BLOCK_BYTES, AVX2_BLOCK_ROWS, K_UNROLL, MC, MR, NR, Schedule};

/// What an op does with the finished rows of C: stores them, with
/// whatever arithmetic its epilogue fuses, while they are in registers.
pub trait Epilogue {
    /// Store row `row` of the columns of `panel`: `vectors` holds, for each
    /// sibling weight of the panel group in turn, its F32X4 vectors of four
    /// columns each (`panel_columns / 4` per weight; lanes past
    /// `panel.width` are padding).
    fn store_row(&self, b: &mut FunctionBuilder, row: Value, panel: &PanelAt, vectors: &[Value]);
}

/// A panel group as the epilogue sees it.
#[derive(Clone, Copy, Debug)]
pub struct PanelAt {
    /// Which segment of the layout it belongs to.
    pub segment: usize,
    /// Its first column within its segment.
    pub column: Value,
    /// Columns it holds (the panel width, or fewer in a segment's last one).
    pub width: Size,
}

/// Where a segment's panel groups start and how many there are: constants
/// from the layout ([`SegmentBounds::of`]) or values an unspecialized
/// kernel computes from its arguments.
#[derive(Clone, Copy, Debug)]
pub struct SegmentBounds {
    /// Its first panel group.
    pub first_panel: Size,
    /// Whole panels.
    pub full: Size,
    /// Columns of the last, narrower panel (0: there is none).
    pub tail: Size,
}

impl SegmentBounds {
    /// Every segment of `layout`, its sizes baked in.
    pub fn of(layout: &PanelLayout) -> Vec<SegmentBounds> {
        let nr = layout.panel_columns();
        layout
            .segments()
            .iter()
            .map(|seg| SegmentBounds {
                first_panel: Size::Known(seg.first_panel),
                full: Size::Known(seg.columns / nr),
                tail: Size::Known(seg.columns % nr),
            })
            .collect()
    }
}

/// The constant displacements of a GEMM kernel's loads and stores: within
/// the rows of a Cranelift tile's activations (up to 6 rows of K f32,
/// bounding either tier), a k step of a weight panel, and a row of a
/// 256-bit tile's accumulators. `extra` bounds the epilogue's own.
pub fn displacements(key: &KernelKey, k: usize, extra: usize) -> Result<Displacements, JitError> {
    let tile_rows = k.checked_mul(4 * MAX_TILE_ROWS.max(MR));
    let largest = tile_rows.map(|rows| rows.max(K_UNROLL * NR * 4).max(TILE_COLUMNS * 4).max(extra));
    Displacements::up_to(key, largest)
}

/// Whether the panels of `groups` panel groups of `weights` sibling weights
/// over `k` (bytes per element `size`) and `rows` rows of activations can
/// be addressed with the i64 offsets the driver computes (either tier's
/// panel width).
pub fn addressable(k: usize, size: usize, groups: usize, weights: usize, rows: Option<usize>) -> bool {
    let fits = || -> Option<()> {
        let nr = TILE_COLUMNS.max(NR);
        let panel_bytes = k.checked_mul(nr * size)?.checked_mul(groups.checked_add(3)?)?.checked_mul(weights)?;
        i64::try_from(panel_bytes).ok()?;
        if let Some(rows) = rows {
            i64::try_from(rows).ok()?.checked_add(AVX2_BLOCK_ROWS.max(MC) as i64)?;
            i64::try_from(rows.checked_mul(k)?.checked_mul(4)?).ok()?;
        }
        Some(())
    };
    fits().is_some()
}

/// Rows up to which the 256-bit tier runs `dtype` block panels as one
/// integer GEMV per row ([`gemv_per_row`]) rather than decoding each k
/// block into f32 for the row tiles: batched decode and short prompts of
/// a quantized model. The crossover depends on how the tiles multiply
/// ([`kvjit_jit::quant::quant_dot`]). Measured against the
/// decoded route (`bench --ops blocks`, Llama-3-8B QKV and FFN shapes, 2
/// threads):
/// - with `vpdpbusd` on 512-bit registers (Intel Xeon, Emerald Rapids):
///   every format per row up to a whole first block. At M = 64 the 32-k
///   formats ran 1.04–1.86× bf16's prefill, q8_kmin 1.01–1.10×; Q4_K
///   1.47–1.51× (decoded 1.02×), Q5_K 1.08–1.12× (0.98–0.99×), Q6_K
///   1.07–1.09× (1.01–1.04×). At M = 128 (two runs, the bench's prefill
///   rows set to 128) per row against decoded: Q8_0 1.22–1.52× against
///   0.93–1.03×, Q4_1 1.59–1.95× against 0.92–1.03×, Q5_0 1.20–1.27×
///   against 0.89–1.02×, Q4_K 1.39–1.58× against 1.01–1.03×, Q6_K
///   1.00–1.19× against 1.01–1.02×; SmolLM2's 128-token prefill (K = 576
///   and 1536, `bench --ops model`, four interleaved pairs) 496–674 against
///   427–557 tok/s, three pairs of four ahead.
/// - with `vpdpbusd` (Intel, AVX-VNNI): Q8_0, Q4_0 and Q4_1 1.3–2.0×
///   faster at M = 4, 1.2–1.3× at 16, 1.0–1.2× at 64 (at 128 still ahead
///   on these shapes, but SmolLM2's 112-token prefill, K = 576, 2–7 %
///   slower); Q4_K 1.8–1.9× at 4, 1.2× at 16, even at 64; Q6_K 1.3–1.4× at
///   4, 0.8× at 16. On AMD Zen 4 (AVX512-VNNI on 256-bit registers) the
///   per-row route was 1.03–1.2× bf16's prefill at M = 16, 32 and 64, the
///   decoded route 0.65–1.0×.
/// - with AVX2 alone (`vpmaddubsw`, measured on Zen 4 with
///   `KVJIT_QUANT_DOT=avx2`): Q8_0 per row 0.63–0.70× bf16 at M = 8 against
///   0.49–0.52× decoded, but 0.58× against 0.65× at 16 and 0.62× against
///   1.0× at 64; Q4_0 and Q4_1 per row 0.85–0.93× against 0.72–0.79× at
///   16, 0.84–0.90× against 0.87–0.95× at 32 and 0.88–0.91× against
///   1.0–1.06× at 64.
///
/// Below the 192-row block, so only a first and only block can hold that
/// few rows.
pub fn gemv_rows(dtype: DType) -> usize {
    gemv_rows_on(dtype, kvjit_jit::quant::quant_dot())
}

/// [`gemv_rows`] for tiles that multiply as `dot` does.
pub fn gemv_rows_on(dtype: DType, dot: QuantDot) -> usize {
    match (dtype, dot) {
        (_, QuantDot::Vnni512) => AVX2_BLOCK_ROWS - 1,
        (DType::Q6K, _) => 4,
        // Q5_K's count is Q4_K's (not measured apart).
        (DType::Q4K | DType::Q5K, _) => 16,
        // q8_min's, q8_kmin's and IQ4_NL's count is Q8_0's (the same dot
        // products, IQ4_NL's after a table lookup; not measured apart).
        (DType::Q8_0 | DType::Q8Min | DType::Q8KMin | DType::Iq4Nl, QuantDot::Avx2) => 8,
        (_, QuantDot::Avx2) => 16,
        (_, QuantDot::Vnni256) => 64,
    }
}

/// Whether `m` rows against `dtype` panels on `tier` run the integer GEMV
/// once per row (activations quantized row by row) instead of decoding
/// each k block into f32 for the row tiles: a block format with an integer
/// GEMV on this CPU, on the 256-bit tier, 1 to [`gemv_rows`] rows. The
/// emitter and the activations follow this one rule.
pub fn gemv_per_row(tier: CodeTier, dtype: DType, m: usize) -> bool {
    tier == CodeTier::Avx2
        && dtype.is_block_format()
        && kvjit_jit::quant::has_quant_gemv(dtype)
        && (1..=gemv_rows(dtype)).contains(&m)
}

/// Row tiles per k block up to which the 256-bit tier's bf16/f16 tiles
/// read the panel as stored instead of from a widened copy
/// ([`GemmEmitter::widens_k_blocks`]): batched decode and short prompts.
/// Measured on the fused QKV (Llama-3-8B, bf16): as stored is 1.3–1.6×
/// faster at M = 2–12, 5 % at M = 42, even at 64, 3 % slower at 128.
const FEW_TILES: usize = 8;

/// The stack memory a GEMM kernel's 256-bit tier needs: its tiles'
/// accumulators and a widened k block of a bf16/f16 panel.
#[derive(Clone, Copy)]
pub struct Scratch {
    tile_buffer: Option<StackSlot>,
    widened_block: Option<StackSlot>,
    /// The Cranelift tier's finished tiles of the siblings before the last
    /// (kept here, not in registers, while the next sibling's k loop runs).
    sibling_tiles: Option<StackSlot>,
}

impl Scratch {
    /// The stack slots of a kernel on `tier` with `dtype` weights and
    /// `weights` siblings per panel group.
    pub fn new(b: &mut FunctionBuilder, tier: CodeTier, dtype: DType, weights: usize) -> Self {
        let avx2 = tier == CodeTier::Avx2;
        let mut slot =
            |bytes: usize| b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, bytes as u32, 5));
        Self {
            tile_buffer: avx2.then(|| slot(weights * AVX2_BLOCK_ROWS * TILE_COLUMNS * 4)),
            widened_block: (avx2 && dtype != DType::F32).then(|| slot(AVX2_BLOCK_BYTES)),
            sibling_tiles: (!avx2 && weights > 1).then(|| slot((weights - 1) * MR * NR * 4)),
        }
    }
}

/// The call's GEMM buffers, loaded once at entry.
#[derive(Clone, Copy)]
pub struct GemmBases {
    /// Activations as f32 (rows of K, or in tiles of `x_step` rows).
    pub x: Value,
    /// The packed weight.
    pub w: Value,
    /// The 256-bit tier's activation layout: rows interleaved in tiles of
    /// this many (see [`pack_activations`](super::pack_activations)); 1
    /// when X is one plain row or on the Cranelift tier.
    pub x_step: Value,
}

/// The GEMM driver of one kernel: C = X·W over the panel groups a launch's
/// work item range covers, each finished row handed to the epilogue.
///
/// ```text
/// for each block of block_rows rows:            (X block stays in cache across panels)
///   for each panel group p in the thread's range: (its weights' panels, read from DRAM once per block)
///     Cranelift tier: for each group of rows: a tile of F32X4 fmas in registers over all of K
///     256-bit tier:   for each weight of the group, for each k block (L1-sized; all of K when M = 1):
///                       for each group of 6 rows: call the AVX2 micro-kernel for the tile,
///                       adding into the block's accumulators on the stack
///     epilogue: every row of the group's columns
/// ```
pub struct GemmEmitter<'e> {
    /// Which code computes a tile.
    pub tier: CodeTier,
    /// The panels' dtype ([`PanelLayout::panel_dtype`]): a float, or a
    /// weight block format the 256-bit tier decodes as it reads.
    pub dtype: DType,
    /// K, baked in or read at run time (the 256-bit tier only).
    pub k: Size,
    /// Rows, when the key fixes them.
    pub m: Option<usize>,
    /// Sibling weights per panel group.
    pub weights: usize,
    /// The bound of every constant displacement ([`displacements`]).
    pub disp: Displacements,
    /// The call's buffers.
    pub bases: GemmBases,
    /// The 256-bit tier's stack memory.
    pub scratch: Scratch,
    /// What happens to each finished row.
    pub epilogue: &'e dyn Epilogue,
}

/// The panel loop's state, which every tile of the panel group shares.
#[derive(Clone, Copy)]
struct Panel {
    /// Address of the group's first packed panel.
    w: Value,
    at: PanelAt,
}

impl GemmEmitter<'_> {
    fn schedule(&self) -> Schedule {
        Schedule::of(self.tier)
    }

    /// Rows of the largest register tile.
    fn tile_rows(&self) -> usize {
        self.schedule().tile_rows
    }

    /// The schedule over panel groups `[panel_begin, panel_end)` of the
    /// segments `bounds`: blocks of `block_rows` rows, then the range's
    /// panel groups of each segment, then row tiles.
    pub fn emit(
        &self,
        b: &mut FunctionBuilder,
        m_arg: Value,
        panel_begin: Value,
        panel_end: Value,
        bounds: &[SegmentBounds],
    ) {
        let m = match self.m {
            Some(m) => b.ins().iconst(types::I64, m as i64),
            None => m_arg,
        };
        let (nr, mc) = (self.schedule().panel_columns, self.schedule().block_rows);
        let zero = b.ins().iconst(types::I64, 0);
        counted_loop(b, zero, m, mc as i64, &[], |b, block_start, _| {
            let block_end = b.ins().iadd_imm_s(block_start, mc as i64);
            let block_end = b.ins().smin(block_end, m);
            for (segment, &SegmentBounds { first_panel, full, tail }) in bounds.iter().enumerate() {
                // The segment's whole panels, then its narrower last one.
                let ranges = match (first_panel, full, tail) {
                    (Size::Known(first), Size::Known(full), Size::Known(tail)) => {
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
                        let offset = self.panel_bytes(b, index, self.weights);
                        let rel = b.ins().isub(index, first_panel);
                        let panel = Panel {
                            w: b.ins().iadd(self.bases.w, offset),
                            at: PanelAt { segment, column: b.ins().imul_imm_s(rel, nr as i64), width },
                        };
                        match self.tier {
                            CodeTier::Avx2 => self.emit_avx2_panel(b, block_start, block_end, panel),
                            CodeTier::Cranelift => self.emit_row_tiles(b, block_start, block_end, &|b, mr, row| {
                                self.emit_cranelift_tile(b, mr, row, panel)
                            }),
                        }
                        Vec::new()
                    });
                }
            }
            Vec::new()
        });
    }

    /// The address of sibling weight `j`'s panel in a group at `w`.
    fn sibling_panel(&self, b: &mut FunctionBuilder, w: Value, j: usize) -> Value {
        if j == 0 {
            return w;
        }
        let j = b.ins().iconst(types::I64, j as i64);
        let offset = self.panel_bytes(b, j, 1);
        b.ins().iadd(w, offset)
    }

    /// Bytes of `count` panels (times `per` each: the siblings of a
    /// group) over all of K: `count · per · K · panel_columns` elements of
    /// the panels' dtype, or for block panels that many weights' blocks
    /// (K is then known: the spec bakes it in).
    fn panel_bytes(&self, b: &mut FunctionBuilder, count: Value, per: usize) -> Value {
        let nr = self.schedule().panel_columns;
        match (self.dtype.is_block_format(), self.k) {
            (false, k) => k.times(b, count, (nr * per * self.dtype.size_bytes()) as i64),
            (true, Size::Known(k)) => {
                let bytes = self.dtype.storage_bytes(k * nr * per).expect("K is a multiple of the block");
                b.ins().imul_imm_s(count, bytes as i64)
            }
            (true, Size::Runtime(_)) => unreachable!("block weights are read by kernels that bake K in"),
        }
    }

    /// The byte offset of k value `kb` in a panel (a multiple of the
    /// block for block panels).
    fn panel_k_offset(&self, b: &mut FunctionBuilder, kb: Value) -> Value {
        let (block, block_bytes) = self.dtype.block();
        if block == 1 {
            return b.ins().imul_imm_s(kb, (TILE_COLUMNS * self.dtype.size_bytes()) as i64);
        }
        debug_assert!(block.is_power_of_two());
        let blocks = b.ins().ushr_imm_u(kb, block.trailing_zeros() as i64);
        b.ins().imul_imm_s(blocks, (TILE_COLUMNS * block_bytes) as i64)
    }

    /// Whether one row streams the whole panel through one micro-kernel
    /// call (the GEMV): every float dtype, and the block formats with an
    /// integer GEMV; the others (Q4_K, Q6_K) decode k blocks into f32 first,
    /// as for more rows.
    fn streams_one_row(&self) -> bool {
        !self.dtype.is_block_format() || kvjit_jit::quant::has_quant_gemv(self.dtype)
    }

    /// Whether `m` rows of block panels run the integer GEMV once per row
    /// ([`gemv_per_row`], the rule the activations follow).
    fn gemv_per_row(&self, m: usize) -> bool {
        gemv_per_row(self.tier, self.dtype, m)
    }

    /// Rows `[start, end)` of block panels, one integer GEMV over all of K
    /// per row: the first reads the panel from memory, the others from
    /// cache, and none decodes it into an f32 copy.
    fn emit_avx2_gemv_rows(&self, b: &mut FunctionBuilder, start: Value, end: Value, w: Value, c: Value) {
        let k = match self.k {
            Size::Known(k) => k,
            Size::Runtime(_) => unreachable!("block weights are read by kernels that bake K in"),
        };
        counted_loop(b, start, end, 1, &[], |b, row, _| {
            let kb = b.ins().iconst(types::I64, 0);
            self.emit_avx2_tile(b, true, (1, row, start), (kb, Size::Known(k)), (w, self.dtype), c);
            Vec::new()
        });
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
        let mr = self.tile_rows();
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

    /// One panel group of the 256-bit tier over rows `[start, end)`: each
    /// sibling's columns of C for those rows accumulate in its part of the
    /// stack buffer, k block by k block ([`GemmEmitter::k_block`]), each
    /// block of the panel (L1-sized) reused by every row tile while the next
    /// streams in; then the epilogue stores every row. With one row
    /// (decode) the whole of K is one block: a streaming GEMV.
    fn emit_avx2_panel(&self, b: &mut FunctionBuilder, start: Value, end: Value, panel: Panel) {
        let slot = self.scratch.tile_buffer.expect("the avx2 tier's kernels have a tile buffer");
        let sibling_bytes = AVX2_BLOCK_ROWS * TILE_COLUMNS * 4;
        let zero = b.ins().f32const(0.0);
        let zero = b.ins().splat(types::F32X4, zero);
        for j in 0..self.weights {
            let c = b.ins().stack_addr(pointer_type(), slot, (j * sibling_bytes) as i32);
            let w = self.sibling_panel(b, panel.w, j);
            counted_loop(b, start, end, 1, &[], |b, row, _| {
                let at = self.tile_row_address(b, c, start, row);
                for v in 0..TILE_COLUMNS / 4 {
                    b.ins().store(mem(), zero, at, self.disp.of(16 * v));
                }
                Vec::new()
            });
            let k_blocks = |b: &mut FunctionBuilder, widen: bool| {
                self.emit_avx2_k_blocks(b, start, end, w, c, Some((self.k_block(), widen)))
            };
            match self.m {
                Some(1) if self.streams_one_row() => self.emit_avx2_k_blocks(b, start, end, w, c, None),
                Some(m) if self.gemv_per_row(m) => self.emit_avx2_gemv_rows(b, start, end, w, c),
                Some(m) => k_blocks(b, self.widens_k_blocks(Some(m))),
                None if !self.streams_one_row() => k_blocks(b, self.widens_k_blocks(None)),
                None => {
                    // The generic kernel picks the schedule at run time: one
                    // row streams the whole of K (GEMV), more rows go k block
                    // by k block — read as stored for a few row tiles,
                    // widened first for more.
                    let rows = b.ins().isub(end, start);
                    let one_row = b.ins().icmp_imm_s(IntCC::Equal, rows, 1);
                    let more_rows = |b: &mut FunctionBuilder| {
                        // Block formats: a GEMV per row up to `gemv_rows`
                        // rows in all (`end` ≤ `gemv_rows` < block_rows
                        // only in the first and only block), decoded k
                        // blocks beyond; bf16/f16: as stored up to
                        // FEW_TILES tiles; f32: never widened.
                        let (counted, limit) = match self.dtype {
                            DType::F32 => return k_blocks(b, false),
                            d if d.is_block_format() => (end, gemv_rows(d)),
                            _ => (rows, FEW_TILES * self.tile_rows()),
                        };
                        let few = b.ins().icmp_imm_s(IntCC::SignedLessThanOrEqual, counted, limit as i64);
                        match self.dtype.is_block_format() {
                            true => if_else(
                                b,
                                few,
                                |b| self.emit_avx2_gemv_rows(b, start, end, w, c),
                                |b| k_blocks(b, true),
                            ),
                            false => if_else(b, few, |b| k_blocks(b, false), |b| k_blocks(b, true)),
                        }
                    };
                    if_else(b, one_row, |b| self.emit_avx2_k_blocks(b, start, end, w, c, None), more_rows);
                }
            }
        }
        counted_loop(b, start, end, 1, &[], |b, row, _| {
            let mut vectors = Vec::with_capacity(self.weights * TILE_COLUMNS / 4);
            for j in 0..self.weights {
                let c = b.ins().stack_addr(pointer_type(), slot, (j * sibling_bytes) as i32);
                let at = self.tile_row_address(b, c, start, row);
                vectors
                    .extend((0..TILE_COLUMNS / 4).map(|v| b.ins().load(types::F32X4, mem(), at, self.disp.of(16 * v))));
            }
            self.epilogue.store_row(b, row, &panel.at, &vectors);
            Vec::new()
        });
    }

    /// The row tiles of rows `[start, end)` over all of K for the panel at
    /// `w`, adding into the accumulators at `c`: in blocks of `k_block.0` k
    /// values (the last one shorter; with `k_block.1`, bf16/f16 blocks
    /// widened to f32 first, once for all the row tiles, and block formats
    /// decoded), or — `None`, the GEMV — all of K at once, read as stored.
    fn emit_avx2_k_blocks(
        &self,
        b: &mut FunctionBuilder,
        start: Value,
        end: Value,
        panel_w: Value,
        c: Value,
        k_block: Option<(usize, bool)>,
    ) {
        // The widened block holds k_block·16 f32 (AVX2_BLOCK_BYTES).
        let widened = self.scratch.widened_block.filter(|_| k_block.is_some_and(|(_, widen)| widen));
        let k_block = k_block.map(|(kc, _)| kc);
        debug_assert!(k_block.is_none_or(|kc| kc * TILE_COLUMNS * 4 <= AVX2_BLOCK_BYTES));
        let tiles = |b: &mut FunctionBuilder, kb: Value, kc: Size| {
            let offset = self.panel_k_offset(b, kb);
            let mut w = b.ins().iadd(panel_w, offset);
            let mut w_dtype = self.dtype;
            if let Some(slot) = widened {
                let widen = match self.dtype.is_block_format() {
                    true => kvjit_jit::quant::dequantize_block(self.dtype),
                    false => microkernel::widen_block(self.dtype),
                };
                let widen = widen.expect("the avx2 tier widens bf16 and f16 and decodes every block format");
                let one = b.ins().iconst(types::I64, 1);
                let count = kc.times(b, one, TILE_COLUMNS as i64);
                let out = b.ins().stack_addr(pointer_type(), slot, 0);
                call_native(b, widen as usize, &[w, count, out]);
                (w, w_dtype) = (out, DType::F32);
            }
            match k_block {
                // The GEMV: exactly one row (the callers branch on it).
                None => self.emit_avx2_tile(b, true, (1, start, start), (kb, kc), (w, w_dtype), c),
                Some(_) => self.emit_row_tiles(b, start, end, &|b, mr, row| {
                    self.emit_avx2_tile(b, false, (mr, row, start), (kb, kc), (w, w_dtype), c)
                }),
            }
        };
        match (self.k, k_block) {
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

    /// Whether the 256-bit tier widens (or decodes) each k block of a
    /// panel into f32 once for all its row tiles, for `rows` rows (`None`:
    /// any number): never for f32; always for the block formats (their only
    /// tile is the one-row integer GEMV); for bf16/f16 unless the rows need
    /// at most [`FEW_TILES`] tiles, which read the block as stored and widen
    /// it in registers — with so few readers the separate widening pass (a
    /// store and a reload of every value) costs more than it saves.
    fn widens_k_blocks(&self, rows: Option<usize>) -> bool {
        self.dtype != DType::F32
            && (self.dtype.is_block_format() || rows.is_none_or(|m| m > FEW_TILES * self.tile_rows()))
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
        whole_k: bool,
        (mr, row, start): (usize, Value, Value),
        (kb, kc): (Value, Size),
        (w, w_dtype): (Value, DType),
        c: Value,
    ) {
        let missing =
            "the caller checked this CPU runs the avx2 tier, which has a tile of every height up to MAX_TILE_ROWS";
        let constant = |b: &mut FunctionBuilder, tile: Option<microkernel::GemmTile>| {
            b.ins().iconst(pointer_type(), tile.expect(missing) as usize as i64)
        };
        let tile = match (w_dtype.is_block_format(), whole_k && mr == 1, self.k) {
            // Block panels reach a tile only as one streamed row (the
            // integer GEMV, on activations quantized per block, over all
            // of a known K).
            (true, _, Size::Known(k)) => constant(b, kvjit_jit::quant::quant_gemv(w_dtype, k).filter(|_| mr == 1)),
            (true, _, Size::Runtime(_)) => unreachable!("block weights are read by kernels that bake K in"),
            // One row over all of K: the GEMV, in the streams its panel's
            // length pays for, chosen as `gemv_tile` chooses when K is
            // known only at run time (so both give the same bytes).
            (false, true, Size::Known(k)) => constant(b, microkernel::gemv_tile(w_dtype, k)),
            (false, true, Size::Runtime(k)) => {
                let (one, many, min_k) = microkernel::gemv_tiles(w_dtype).expect(missing);
                let (one, many) = (constant(b, Some(one)), constant(b, Some(many)));
                let long = b.ins().icmp_imm_s(IntCC::UnsignedGreaterThanOrEqual, k, min_k as i64);
                b.ins().select(long, many, one)
            }
            (false, false, _) => constant(b, microkernel::gemm_tile(w_dtype, mr)),
        };
        let x = match (w_dtype.is_block_format(), self.k) {
            // Quantized activations: each row's K/32 blocks, row after row
            // (an integer GEMV reads all of K: kb is 0).
            (true, Size::Known(k)) => addr::element(b, self.bases.x, row, super::quantized_row_bytes(k)),
            // Tiles start at multiples of the packing step (or at row 0 of
            // a single plain row), so the tile's x starts at element row·K
            // + kb·step of the packed activations.
            _ => {
                let x_row = self.k.times(b, row, 1);
                let x_k = b.ins().imul(kb, self.bases.x_step);
                let x_element = b.ins().iadd(x_row, x_k);
                addr::element(b, self.bases.x, x_element, 4)
            }
        };
        let kc = kc.value(b);
        let c = self.tile_row_address(b, c, start, row);
        call_native_at(b, tile, &[x, self.bases.x_step, w, kc, c]);
    }

    /// The Cranelift tile: an `mr`×NR tile of C = X·Wᵀ in registers for
    /// each sibling weight in turn (the same k loop as a single weight's,
    /// so a SwiGLU's tiles cost what two matmuls' do and sum in the same
    /// order), then the epilogue of each row with every sibling's columns.
    fn emit_cranelift_tile(&self, b: &mut FunctionBuilder, mr: usize, row: Value, panel: Panel) {
        let last = self.weights - 1;
        // Siblings before the last park their tiles on the stack: carried
        // through the next k loop in registers they would crowd its
        // accumulators (measured 1.1x slower on a SwiGLU prefill).
        let parked = |b: &mut FunctionBuilder, j: usize, i: usize, h: usize| {
            let slot = self.scratch.sibling_tiles.expect("a Cranelift kernel with siblings has their slot");
            let at = b.ins().stack_addr(pointer_type(), slot, 0);
            (at, self.disp.of(((j * MR + i) * 2 + h) * 16))
        };
        for j in 0..last {
            let w = self.sibling_panel(b, panel.w, j);
            for (i, tile_row) in self.emit_cranelift_products(b, mr, row, w).into_iter().enumerate() {
                for (h, vector) in tile_row.into_iter().enumerate() {
                    let (at, offset) = parked(b, j, i, h);
                    b.ins().store(mem(), vector, at, offset);
                }
            }
        }
        let w = self.sibling_panel(b, panel.w, last);
        for (i, tile_row) in self.emit_cranelift_products(b, mr, row, w).into_iter().enumerate() {
            let mut vectors = Vec::with_capacity(2 * self.weights);
            for j in 0..last {
                for h in 0..2 {
                    let (at, offset) = parked(b, j, i, h);
                    vectors.push(b.ins().load(types::F32X4, mem(), at, offset));
                }
            }
            vectors.extend(tile_row);
            let r = b.ins().iadd_imm_s(row, i as i64);
            self.epilogue.store_row(b, r, &panel.at, &vectors);
        }
    }

    /// The `mr`×NR tile of one panel at `w` over all of K, in registers:
    /// per row its two F32X4 vectors. Small tiles split k over several
    /// accumulator sets so the FMA latency chain does not limit them.
    fn emit_cranelift_products(&self, b: &mut FunctionBuilder, mr: usize, row: Value, w: Value) -> Vec<[Value; 2]> {
        let Size::Known(k) = self.k else { unreachable!("the Cranelift tile unrolls a known K") };
        let w_dtype = self.dtype;
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
            let w_at = b.ins().iadd(w, w_off);
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
        (0..mr).map(|i| [accs[acc_index(0, i, 0)], accs[acc_index(0, i, 1)]]).collect()
    }
}

/// Store the first `width` columns of a tile row (F32X4 `vectors`, four
/// columns each) as `dtype` at `base`, rounded once.
pub fn store_columns(
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

/// Load the first `width` columns (known) of a row of `dtype` at `base` as
/// F32X4 vectors of four columns each (`vectors` of them; lanes past
/// `width` are 0), the counterpart of [`store_columns`] for an epilogue's
/// operand.
pub fn load_columns(
    b: &mut FunctionBuilder,
    disp: Displacements,
    dtype: DType,
    base: Value,
    width: usize,
    vectors: usize,
) -> Vec<Value> {
    let size = dtype.size_bytes();
    (0..vectors)
        .map(|h| {
            let lanes = width.saturating_sub(4 * h).min(4);
            if lanes == 4 {
                return kvjit_jit::ir::load_f32x4(b, dtype, base, disp.of(4 * h * size));
            }
            let zero = b.ins().f32const(0.0);
            let mut v = b.ins().splat(types::F32X4, zero);
            for lane in 0..lanes {
                let splat = load_splat_f32x4(b, dtype, base, disp.of((4 * h + lane) * size));
                let x = b.ins().extractlane(splat, 0);
                v = b.ins().insertlane(v, x, lane as u8);
            }
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generic kernel tells a call of at most `gemv_rows` rows by its
    /// first block ending there: only true while that is below a block.
    #[test]
    fn gemv_rows_fit_in_the_first_block() {
        let dots = [QuantDot::Avx2, QuantDot::Vnni256, QuantDot::Vnni512];
        for dtype in DType::BLOCK_FORMATS {
            for dot in dots {
                assert!((1..AVX2_BLOCK_ROWS).contains(&gemv_rows_on(dtype, dot)), "{dtype} {dot:?}");
            }
            // The slower a row's GEMV, the fewer rows it pays up to.
            for pair in dots.windows(2) {
                assert!(gemv_rows_on(dtype, pair[0]) <= gemv_rows_on(dtype, pair[1]), "{dtype} {pair:?}");
            }
            assert_eq!(gemv_rows(dtype), gemv_rows_on(dtype, kvjit_jit::quant::quant_dot()), "{dtype}");
            assert!((1..AVX2_BLOCK_ROWS).contains(&gemv_rows(dtype)), "{dtype}");
            assert!(!gemv_per_row(CodeTier::Cranelift, dtype, 1), "{dtype}");
            assert!(!gemv_per_row(CodeTier::Avx2, dtype, gemv_rows(dtype) + 1), "{dtype}");
            assert!(!gemv_per_row(CodeTier::Avx2, dtype, 0), "{dtype}");
        }
        assert!(!gemv_per_row(CodeTier::Avx2, DType::BF16, 1));
    }
}
