//! The CPU kernel: machine code Cranelift emits for one [`MhaSpec`].
//!
//! Baked in: D, Hq, Hkv, the page layout (K→V stride), dtypes, mask, window
//! and nothing else; B, S and the context lengths are read at run time.
//!
//! **Work items** are `(b, query block, key chunk)`, all KV heads: a block
//! of `QB` query positions; for each KV head the `G = Hq/Hkv` query heads
//! that share it (`QB·G` rows, padded to whole **row tiles** of 4), against
//! one chunk of `CH` key positions. Decode (S = 1) is split-KV flash
//! decoding when there are too few sequences to make [`TARGET_ITEMS`]
//! items: the chunks of one sequence run in parallel and each leaves a
//! partial `(max, sum, acc[D])` per row; the host merges the chunks of each
//! row in chunk order (`out = Σ e^{m_c−M}·acc_c / Σ e^{m_c−M}·l_c`, f32) and
//! rounds once to the dtype. With one chunk (prefill, or a decode of enough
//! sequences) each item is a whole (b, query block): it packs its own q
//! before its keys and writes its own output rows after them (the same
//! code, `ItemHooks`), in parallel and while its partials are in cache — a
//! 512-token prefill spent ~13 % of its time in the host's serial pack and
//! merge (19.97 → 17.6–18.0 ms). Prefill uses the same code with QB = 8
//! and, when there are enough items, one chunk. The cut depends on the call's
//! shapes and lengths only, never on the pool: the output is bit-identical
//! for any number of threads.
//!
//! Inside an item, keys go in blocks of up to [`KB`]. Each block is first
//! **gathered**: the K and V rows of its keys (all KV heads: `Hkv·D`
//! contiguous elements, consecutive slots of a page adjacent, so the
//! hardware prefetchers stream them) are copied, found through the
//! per-position table of row offsets, into a buffer of the invocation, KV
//! head major. Reading the cache's scattered single-head rows directly
//! stalled on one miss after another, and their 2 KB strides mapped a
//! block's rows onto a few L1 sets. Then per KV head and row tile (4 rows:
//! for Llama's G = 4 decode, all the query heads of the KV head, so every
//! K and V row is read once for all of them):
//!
//! ```text
//! S[j] = q_tile · K[p0+j]            (2 keys at a time: 4 rows × 2 keys of F32X4 FMAs along D,
//!                                     a 4×4 transpose-add per key gives the 4 rows' scores in
//!                                     the lanes of one F32X4; rows' keys outside their range → -inf)
//! m' = max(m, max_j S[j])            (per lane; a row with no key yet uses 0, so -inf − -inf never occurs)
//! P[j] = exp(S[j] − m'), α = exp(m − m')      (vector polynomial exp, kvjit_jit::ir::math)
//! l = α·l + Σ_j P[j]
//! acc = α·acc + Σ_j P[j]·V[p0+j]     (per 2 F32X4 of D: a 4 rows × 2 register tile, keys inner,
//!                                     4 keys per iteration; the block's key count is padded to a
//!                                     multiple of 4 with copies of its last key, whose P is 0)
//! ```
//!
//! The offsets table ([`key_row_offsets`]) is built on the host from one
//! checked [`locate`](kvjit_core::PagedKVCacheCollection::locate) per page.
//! It and the key chunks are indexed by a key's position relative to the first key
//! its sequence reads, so a sliding window far into a long context costs
//! the window's keys, not its end position, and positions fit the code's
//! i32 lanes (a call in which a sequence reads more than [`MAX_JIT_KEYS`]
//! keys is refused). q is pre-scaled by `scale`, widened to f32 and packed
//! per (b, query block) in row-tile order on the host (padded rows zero).
//!
//! **The 256-bit tier** (`MhaSpec::backend = Cpu(Avx2)`, key `cpu-avx2`):
//! decode items (query block of 1, so every row of a KV head reads the same
//! keys) skip the gather and the 128-bit loops: per KV head, the driver
//! calls the ahead-of-time AVX2/FMA micro-kernel
//! [`kvjit_jit::attention_kernel`] once over the item's key range, which
//! reads K/V in place from the cache pages through the same offsets table
//! (software-prefetching a block ahead and, from its last block, the first
//! block of the sequence's next chunk: the thread's next item), widens bf16/f16/FP8 in registers
//! (FP8: E4M3 bit manipulation and the per-key g-block scales, no
//! re-encoding pass) and leaves `(m, l, acc)` in the same tile layout, so
//! the chunking, the partials and the host merge are the Cranelift tier's
//! and the output stays bit-identical for any thread count. Prefill items
//! (a query block of up to 8 positions) call a micro-kernel the same way
//! with all the block's rows, each masked to its own key range: with D a
//! multiple of 16 (and 256-bit products; an FP8 cache's g a multiple of 8),
//! the GEMM-tile kernel ([`kvjit_jit::attention_kernel::prefill_kernel`]: K
//! and V rows widened, FP8 scaled, once per block of 64 keys, scores and
//! P·V through 6 × 16 register tiles, the softmax across rows; measured on
//! an AMD Zen 3, one thread, a query block against 512 keys, `cargo test
//! --release -p kvjit-jit --lib -- --ignored prefill_kernel_speed`:
//! Llama-3-8B's 32 rows of 128 f32 62 against 38–39 GFLOP/s, bf16 67–68
//! against 53, FP8 57 against 37; SmolLM2's 24 rows of 64 f32 55 against
//! 48, bf16 61–63 against 52, FP8 50–51 against 33); otherwise the decode
//! kernel's tiles of 4 rows. Caches it does not serve (D or g not a
//! multiple of 8) run the Cranelift code on that tier too; the Cranelift
//! tier (`Cpu(Cranelift)`) is the fallback on every CPU.
//!
//! **FP8 (E4M3) cache.** The gather reads 1 byte per element (and the
//! keys' `Hkv·D/g` f32 scales of K and of V) and re-encodes each code as
//! the bf16 bits of its unscaled value, which is exact
//! ([`kvjit_jit::ir::e4m3::ToBf16`]: byte operations, 16 codes at a time), into the same
//! block buffer a bf16 cache uses, with the keys' scales beside it; no
//! dequantized copy of anything is made. The loops then read the buffer
//! as bf16 (the same 2-instruction widening) and apply the scales in
//! registers, never per element in the inner loops:
//!
//! - scores, g = D: `S[j] = (q_tile · codes_j) · s_j`, one multiply of the
//!   4 rows' scores per key after the transpose-add; g < D: each widened
//!   F32X4 of K is multiplied by its g-block's scale (one multiply per 4
//!   elements, shared by the 4 rows);
//! - P·V: the softmax pass stores, per key and per g-block, `P[j]·s_j,blk`
//!   (4 rows) in place of `P[j]` (`l` sums the unscaled P), and the P·V
//!   loop over a block's elements uses those: its inner loop is the bf16
//!   one, unchanged.
//!
//! Against multiplying every element (`Σ q·(code·s)`, `Σ P·(code·s)`), each
//! product of a scale is rounded once more in f32: relative error ≤ 2⁻²⁴
//! of a score or of a P·V term, inside the tests' f32 tolerance.

use std::sync::Arc;

use half::{bf16, f16};
use std::mem::offset_of;

use kvjit_core::{CodeTier, DType, Element, KernelKey, KernelSpec, Result, Tensor, TensorData};
use kvjit_jit::attention_kernel::{
    DecodeKernel, DecodeWidth, decode_kernel, decode_supported, decode_width, prefill_kernel,
};
use kvjit_jit::cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value, types};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::addr::{self, Displacements};
use kvjit_jit::ir::e4m3::ToBf16;
use kvjit_jit::ir::math::exp_f32x4;
use kvjit_jit::ir::shuffle::transpose_sum;
use kvjit_jit::ir::{counted_loop, load_f32x4_raw, mem, splat_f32, when};
use kvjit_jit::{CaptureText, JitError, JitFunction, KernelArgs, KernelParams, compile_kernel};
use kvjit_op::{Compiled, JitSpec, Launch};

use crate::call::{CallShape, key_row_offsets};
use crate::{AttentionError, Mask, MhaSpec};

/// Keys per block (the scores, probabilities and K/V row addresses of one
/// block live in the item's scratch).
pub const KB: usize = 32;
/// Smallest chunk of key positions in split-KV (decode) launches of a
/// 16- or 32-bit cache (twice that for FP8), unless a call needs smaller
/// ones to make [`MIN_ITEMS`] items. Each item costs a
/// q packing, its first block's wait and a partial the host merges; with
/// a thread's items contiguous (a decode of equal sequences) 256 read faster
/// than 128 (measured as for [`MIN_ITEMS`], Xeon, 2 threads, batch 1, bf16,
/// from DRAM, 128 → 256: SmolLM2's heads at context 2048 87.2–87.8 →
/// 79.2–79.8 µs, Llama-3-8B's at 8192 1538–1569 → 1475–1482 µs, at 2048
/// 402–406 → 385–410), and longer ones no faster again (a count of items
/// the threads do not divide, 3 at 704 keys, read 99–101 µs). With
/// [`TARGET_ITEMS`] it still leaves a 2048-key sequence 8 items.
pub const MIN_CHUNK: usize = 256;
/// The smallest key chunk of `spec`'s split-KV launches: [`MIN_CHUNK`]
/// keys, twice that for a cache of 1-byte elements (FP8), whose keys read
/// half the bytes — the same bytes per item as a 16-bit cache's. Measured as
/// for [`MIN_ITEMS`] (FP8 with g = D, batch 1, 256 → 512 keys): Llama-3-8B's
/// heads at context 2048 260–266 → 250–251 µs, at 8192 1032–1040 → 984;
/// SmolLM2's at 2048 64.6–72.7 → 58.6–60.1; bf16 at 512 was no faster.
fn min_chunk(spec: &MhaSpec) -> usize {
    MIN_CHUNK * 2 / spec.cache.element.dtype().size_bytes().min(2)
}

/// Items a call is cut into at least, when its keys allow chunks of a
/// block: a short decode (SmolLM2 at context 128, batch 1: one sequence, one
/// chunk) would otherwise run on one thread (measured in `bench
/// --ops model`, A/B: its f32 attention at context 128 728–772 → 603–636 µs
/// a token with 8). Two, not more: each item packs its q, starts on a cold
/// block and leaves a partial to merge, which on short chunks cost more
/// than the threads gained. Measured on a Xeon (Emerald Rapids), 2
/// threads, batch 1, K/V from DRAM (`cargo test --release -p kvjit-bench
/// --lib -- --ignored decode_call_timing --nocapture`, medians, 8 → 2
/// items): SmolLM2's bf16 heads at context 128 13.6–14.0 → 10.7–11.0 µs,
/// 256 23.0 → 16.5, f32 at 128 17.9 → 14.4; Llama-3-8B's bf16 heads at
/// 128 58.9–61.2 → 45.4, 256 111 → 65.2.
pub const MIN_ITEMS: usize = 2;
/// Work items split-KV aims for: 8 per thread of a 16-thread pool (load
/// balance). A constant, not the pool's size: the launch plan, and so every
/// bit of the output, depends on the call only, never on the threads.
pub const TARGET_ITEMS: usize = 128;
/// The same for prefill, whose items (8 query positions each) carry 8×
/// the work per key: fewer key chunks, so fewer partials to merge (a
/// 512-token causal prefill, 64 query blocks, then runs unsplit: 29.8–31.6
/// → 25.8–26.2 ms in an A/B).
pub const TARGET_PREFILL_ITEMS: usize = 32;
/// The largest scratch a calling thread keeps for its next launch
/// ([`with_scratch`]: packed q, partials and, on the Cranelift path,
/// gather buffers); larger ones are freed after their call.
const RETAINED_SCRATCH_BYTES: usize = 128 << 20;

thread_local! {
    /// The scratch of this thread's last launch, reused by its next: no
    /// page faults or zeroing per call once warm.
    static SCRATCH: std::cell::RefCell<Option<Tensor>> = const { std::cell::RefCell::new(None) };
}

/// Fill the calling thread's retained launch scratch with NaN (if it has
/// one), so a test's next launch finds every value it did not write
/// poisoned, as outputs are.
#[doc(hidden)]
pub fn poison_scratch() {
    SCRATCH.with(|cell| {
        if let Some(scratch) = cell.borrow_mut().as_mut() {
            scratch.as_mut_slice::<f32>().expect("f32 scratch").fill(f32::NAN);
        }
    });
}

/// Run `f` on `floats` f32 of scratch of unspecified contents (a launch's
/// packed q, gather buffers and partials, each written before it is read):
/// the calling thread's retained buffer when it is large enough, else
/// fresh memory advised for huge pages, kept for the next call up to
/// [`RETAINED_SCRATCH_BYTES`]. Measured on a 512-token causal prefill
/// (Llama-3-8B heads, 34 MB of scratch, 2 threads): allocating it per
/// call spent ~30 % of the call faulting pages in, unmapping them and
/// zeroing heap memory (30–34 → 21–22 ms); 2048 tokens 306 → 273–287 ms.
fn with_scratch<R>(floats: usize, f: impl FnOnce(&mut [f32]) -> R) -> Result<R> {
    let fresh = || -> Result<Tensor> { Tensor::zeros_in_huge_pages(DType::F32, &[floats.max(1)]) };
    SCRATCH.with(|cell| {
        // A launch inside a launch on this thread (never kvjit's own) gets
        // its own buffer.
        let Ok(mut retained) = cell.try_borrow_mut() else {
            return Ok(f(&mut fresh()?.as_mut_slice::<f32>()?[..floats]));
        };
        if retained.as_ref().is_none_or(|t| t.numel() < floats) {
            *retained = None;
            *retained = Some(fresh()?);
        }
        let buffer = retained.as_mut().expect("just filled");
        let result = f(&mut buffer.as_mut_slice::<f32>()?[..floats]);
        if floats * 4 > RETAINED_SCRATCH_BYTES {
            *retained = None;
        }
        Ok(result)
    })
}
/// Query positions per work item in prefill.
pub const PREFILL_QUERY_BLOCK: usize = 8;
/// Rows per row tile (the lanes of an F32X4).
pub const ROW_TILE: usize = 4;
/// F32X4 accumulators along D per row in the P·V register tile.
const PV_VECTORS: usize = 2;
/// Keys per iteration of the P·V loop (the block's key count is padded to
/// a multiple of it).
const PV_UNROLL: usize = 4;

/// Byte layout of one item's scratch and state in the partials. `nb` is
/// the scale blocks per head of an FP8 cache (D/g), 1 for other caches.
mod layout {
    use super::KB;
    /// KB scores (then probabilities), one F32X4 (the row tile's 4 rows)
    /// per key, `nb` F32X4 apart (an FP8 cache's P·scale of block `blk`
    /// goes in the key's F32X4 number `blk`).
    pub const SCORES: usize = 0;
    /// Bytes from one key's scores to the next's.
    pub fn score_stride(nb: usize) -> usize {
        16 * nb
    }
    /// The current row tile's α (F32X4).
    pub fn alpha(nb: usize) -> usize {
        KB * score_stride(nb)
    }
    /// Row tiles, `tiles_per_head` per KV head, KV head major: `[m: F32X4,
    /// l: F32X4, lo: I32X4, hi: I32X4, acc: 4 rows × D f32]`.
    pub fn tiles(nb: usize) -> usize {
        alpha(nb) + 16
    }
    /// Within a tile.
    pub const M: usize = 0;
    pub const L: usize = 16;
    pub const LO: usize = 32;
    pub const HI: usize = 48;
    pub const ACC: usize = 64;
    /// f32 values of the scratch before the tiles.
    pub fn head_floats(nb: usize) -> usize {
        tiles(nb) / 4
    }
    /// f32 values of one tile.
    pub fn tile_floats(d: usize) -> usize {
        ACC / 4 + super::ROW_TILE * d
    }
}

/// The kernel's argument struct: `W = u64` is what the host passes,
/// `W = Value` the words as the emitter loaded them (one description for
/// both sides; each field read at its `offset_of!`).
#[repr(C)]
struct MhaArgs<W> {
    /// q, pre-scaled, as f32 `[B·query blocks, Hkv·tiles_per_head·4, D]`
    /// (rows in row-tile order, padded rows zero).
    q: W,
    /// The cache's blocks.
    blocks: W,
    /// i64 `[B, T]`: element offset of the K row (head 0) of each key the
    /// sequence reads, by its position relative to the sequence's first key.
    key_offsets: W,
    /// i64 `[B, 3]`: cache length, valid length and first key position read
    /// (`CallShape::key_ranges[b].0`) of each sequence.
    lengths: W,
    /// f32 partials: per item `[scratch | Hkv·tiles_per_head × (m, l, lo, hi, acc[4·D])]`
    /// (with `hooks`, an invocation's items use its first item's, one after
    /// another).
    partials: W,
    /// Row tiles per KV head in an item.
    tiles: W,
    /// T, the stride of the offsets table (≥ C·CH).
    stride: W,
    /// Query blocks per sequence.
    query_blocks: W,
    /// Query positions per block, QB.
    query_block: W,
    /// Key chunks per (b, query block), C.
    chunks: W,
    /// Key positions per chunk, CH.
    chunk: W,
    /// f32 values per item in the partials.
    item_floats: W,
    /// Block buffers: `items × block_buffer_bytes`; an invocation of items
    /// `[begin, end)` uses only buffer `begin`.
    buffers: W,
    /// An FP8 cache's f32 scales `[P, 2, L, page_size, Hkv, D/g]` (0 for
    /// other caches).
    scales: W,
    /// An [`ItemHooks`] when every item is a whole (b, query block) (one
    /// key chunk): each item packs its q before and writes its output rows
    /// after, in parallel, with the data it just wrote still in cache. 0:
    /// the host packs and merges.
    hooks: W,
}

// SAFETY: `MhaArgs<u64>` is `#[repr(C)]` with only u64 fields.
unsafe impl KernelArgs for MhaArgs<u64> {}

impl MhaArgs<Value> {
    /// Load every word of the argument struct, in order, at the kernel's entry.
    fn load(b: &mut FunctionBuilder, params: &KernelParams) -> Self {
        let mut field = |offset: usize| params.field(b, offset);
        MhaArgs {
            q: field(offset_of!(MhaArgs<u64>, q)),
            blocks: field(offset_of!(MhaArgs<u64>, blocks)),
            key_offsets: field(offset_of!(MhaArgs<u64>, key_offsets)),
            lengths: field(offset_of!(MhaArgs<u64>, lengths)),
            partials: field(offset_of!(MhaArgs<u64>, partials)),
            tiles: field(offset_of!(MhaArgs<u64>, tiles)),
            stride: field(offset_of!(MhaArgs<u64>, stride)),
            query_blocks: field(offset_of!(MhaArgs<u64>, query_blocks)),
            query_block: field(offset_of!(MhaArgs<u64>, query_block)),
            chunks: field(offset_of!(MhaArgs<u64>, chunks)),
            chunk: field(offset_of!(MhaArgs<u64>, chunk)),
            item_floats: field(offset_of!(MhaArgs<u64>, item_floats)),
            buffers: field(offset_of!(MhaArgs<u64>, buffers)),
            scales: field(offset_of!(MhaArgs<u64>, scales)),
            hooks: field(offset_of!(MhaArgs<u64>, hooks)),
        }
    }
}

/// The dtype of the K/V rows in the block buffer: the cache's, except that
/// an FP8 cache's codes are re-encoded as (exact) bf16.
fn buffer_dtype(spec: &MhaSpec) -> DType {
    match spec.cache.dtype() {
        DType::F8E4M3 => DType::BF16,
        other => other,
    }
}

/// Scale blocks per head of an FP8 cache (D/g), 1 for other caches.
fn scale_blocks(spec: &MhaSpec) -> usize {
    spec.cache.scale_granularity().map_or(1, |g| spec.cache.head_size / g)
}

/// Bytes of the K/V rows of one block buffer: `[2, Hkv, KB, D]` of
/// [`buffer_dtype`].
fn block_rows_bytes(spec: &MhaSpec) -> usize {
    2 * spec.cache.num_kv_heads * KB * spec.cache.head_size * buffer_dtype(spec).size_bytes()
}

/// Bytes of one block buffer: K then V rows of KB keys, KV head major
/// (`[2, Hkv, KB, D]` of [`buffer_dtype`]), then for an FP8 cache the keys'
/// scales, f32 `[2, Hkv, KB, D/g]`.
fn block_buffer_bytes(spec: &MhaSpec) -> usize {
    let scales = match spec.cache.dtype() {
        DType::F8E4M3 => 2 * spec.cache.num_kv_heads * KB * scale_blocks(spec) * 4,
        _ => 0,
    };
    block_rows_bytes(spec) + scales
}

/// Largest head size D the JIT kernel serves: its code is unrolled over D,
/// so compile time and code size grow with it (D = 1024: ~0.1 s, ~200 KB;
/// D = 8192: ~1 s, 1.2 MB). The reference kernel serves any D.
pub const MAX_JIT_HEAD_SIZE: usize = 1024;

/// Refuse specs the kernel cannot serve: D must be a multiple of 4 (whole
/// F32X4 vectors) and at most [`MAX_JIT_HEAD_SIZE`], an FP8 cache's granularity g a multiple of 4 dividing D
/// (each F32X4 of a head inside one scale block), and the fixed offsets must
/// fit the code's displacements.
pub(crate) fn supported(spec: &MhaSpec) -> Result<(), JitError> {
    let d = spec.cache.head_size;
    let reason = if spec.tier() == Some(CodeTier::Avx2) && !kvjit_jit::microkernel::avx2_available() {
        Some("the avx2 CPU tier needs an x86-64 CPU with AVX2, FMA and F16C; this CPU lacks them".to_string())
    } else if !d.is_multiple_of(4) {
        Some(format!("the CPU kernel needs head_size % 4 == 0 (whole F32X4 vectors), got {d}"))
    } else if d > MAX_JIT_HEAD_SIZE {
        Some(format!(
            "the CPU kernel serves head_size up to {MAX_JIT_HEAD_SIZE} (its code is unrolled over the head), got {d}"
        ))
    } else if let Err(reason) = spec.validate() {
        Some(reason)
    } else if let Some(g) = spec.cache.scale_granularity().filter(|g| !g.is_multiple_of(4)) {
        Some(format!(
            "the CPU kernel needs an f8e4m3 cache's scale_granularity to be a multiple of 4 (each F32X4 of a \
             head inside one scale block), got {g}"
        ))
    } else {
        let fits = || -> Option<()> {
            let cache = &spec.cache;
            let kv_stride = cache.num_layers.checked_mul(cache.page_size)?.checked_mul(cache.num_kv_heads)?;
            let kv_stride = kv_stride.checked_mul(d)?;
            let bytes = kv_stride.checked_mul(2 * spec.cache.dtype().size_bytes())?;
            let row = d.checked_mul(4 * (spec.num_heads + 2))?;
            (i64::try_from(bytes).is_ok() && i32::try_from(row).is_ok()).then_some(())
        };
        fits().is_none().then(|| "its sizes overflow the offsets the kernel computes".to_string())
    };
    match reason {
        Some(reason) => Err(JitError::Unsupported { key: spec.key().to_string(), reason }),
        None => displacements(spec).map(drop),
    }
}

/// The constant displacements of the kernel's loads and stores: within a
/// row tile's state, a tile's q rows, the item's scratch, the block buffer
/// and one cache row's K/V heads (an FP8 cache's scales included).
fn displacements(spec: &MhaSpec) -> Result<Displacements, JitError> {
    let largest = || -> Option<usize> {
        let d = spec.cache.head_size;
        let tile = layout::tile_floats(d).checked_mul(4)?;
        let q_rows = d.checked_mul(4 * ROW_TILE)?;
        let scratch = scale_blocks(spec).checked_mul(16 * KB)?.checked_add(16)?;
        let head = d.checked_mul(buffer_dtype(spec).size_bytes())?.checked_add(4 * scale_blocks(spec))?;
        let buffer = 2usize.checked_mul(spec.cache.num_kv_heads)?.checked_mul(KB)?.checked_mul(head)?;
        let cache_heads = spec.cache.num_kv_heads.checked_mul(d)?.checked_mul(spec.cache.dtype().size_bytes())?;
        [tile, q_rows, scratch, buffer, cache_heads].into_iter().max()
    };
    Displacements::up_to(&spec.key(), largest())
}

/// The 256-bit tier's micro-kernels for `spec`, one for decode (G rows per
/// KV head) and one for prefill blocks: on an AVX2 spec whose cache
/// (element type, D a multiple of 8, an FP8 cache's g a multiple of 8) the
/// micro-kernel serves; `None` on the Cranelift tier or otherwise (the
/// Cranelift path then runs everything on that tier too). Their products
/// run 512 bits wide where the CPU and the cache allow
/// ([`kvjit_jit::attention_kernel::decode_width`]). Prefill blocks run the
/// GEMM-tile kernel ([`prefill_kernel`]: D a multiple of 16, an FP8 cache's
/// g a multiple of 8) where the products are 256 bits wide, else the
/// decode kernel's tiles of 4 rows ([`prefill_choice`] overrides that).
fn native_kernels(spec: &MhaSpec) -> Option<(DecodeKernel, DecodeKernel)> {
    let cache = &spec.cache;
    let (dtype, d, g) = (cache.dtype(), cache.head_size, cache.scale_granularity());
    let serves = decode_supported(dtype, d, g);
    let kernel = |rows| decode_kernel(dtype, rows, d, g);
    let block = || match (prefill_choice(), decode_width(dtype, d, g)) {
        (PrefillKernel::RowTiles, _) | (PrefillKernel::Default, DecodeWidth::Zmm | DecodeWidth::ZmmHalf) => {
            kernel(ROW_TILE)
        }
        (PrefillKernel::GemmTiles, _) | (PrefillKernel::Default, DecodeWidth::Ymm) => {
            prefill_kernel(dtype, d, g).or_else(|| kernel(ROW_TILE))
        }
    };
    (spec.tier() == Some(CodeTier::Avx2) && serves).then(|| kernel(spec.group()).zip(block())).flatten()
}

/// Which micro-kernel prefill blocks take on the 256-bit tier.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PrefillKernel {
    /// The GEMM tiles where products are 256 bits wide, the decode
    /// kernel's row tiles where they are 512.
    Default,
    /// The GEMM tiles wherever they serve the cache
    /// (`KVJIT_ATTENTION_PREFILL=gemm`).
    GemmTiles,
    /// The decode kernel's tiles of 4 rows (`KVJIT_ATTENTION_PREFILL=rows`).
    RowTiles,
}

/// `KVJIT_ATTENTION_PREFILL`, read once: `gemm` or `rows` pick one prefill
/// kernel everywhere (to time one against the other on a host, or the
/// GEMM tiles against the 512-bit row tiles on an AVX-512 host); unset or
/// anything else keeps the default.
fn prefill_choice() -> PrefillKernel {
    static CHOICE: std::sync::OnceLock<PrefillKernel> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| match std::env::var("KVJIT_ATTENTION_PREFILL").as_deref() {
        Ok("gemm") => PrefillKernel::GemmTiles,
        Ok("rows") => PrefillKernel::RowTiles,
        _ => PrefillKernel::Default,
    })
}

/// Whether `spec` runs decode and prefill through the 256-bit
/// micro-kernel (the AVX2 tier, on a cache it serves).
pub fn runs_native(spec: &MhaSpec) -> bool {
    native_kernels(spec).is_some()
}

/// Compile the kernel for `spec` (or fetch it from the process-wide
/// registry). Kept IR/disassembly bypass the registry.
pub fn compile(spec: &MhaSpec, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
    let key = spec.key();
    kvjit_jit::compile_or_fetch(&key, capture, || emit_and_compile(spec, &key, capture))
}

fn emit_and_compile(spec: &MhaSpec, key: &KernelKey, capture: CaptureText) -> Result<JitFunction, JitError> {
    supported(spec)?;
    let disp = displacements(spec)?;
    compile_kernel(key, capture, |b, params| {
        let args = MhaArgs::load(b, &params);
        let e = Emitter { spec: *spec, disp, args, begin: params.begin, native: native_kernels(spec) };
        counted_loop(b, params.begin, params.end, 1, &[], |b, item, _| {
            // With hooks, an item's partials are merged before the next
            // item of the invocation starts: the invocation's items share
            // its first item's (kept in cache), as its block buffer.
            let hooked = b.ins().icmp_imm_s(IntCC::NotEqual, e.args.hooks, 0);
            let slot = b.ins().select(hooked, params.begin, item);
            when(b, hooked, |b| {
                kvjit_jit::ir::call_native(b, pack_group_q as *const () as usize, &[e.args.hooks, item])
            });
            e.emit_item(b, item, slot);
            when(b, hooked, |b| {
                kvjit_jit::ir::call_native(b, merge_group_rows as *const () as usize, &[e.args.hooks, item, slot])
            });
            Vec::new()
        });
    })
}

struct Emitter {
    spec: MhaSpec,
    /// The bound of every constant displacement ([`displacements`]).
    disp: Displacements,
    /// The argument words.
    args: MhaArgs<Value>,
    /// The invocation's first item (its block buffer's index).
    begin: Value,
    /// The 256-bit tier's decode micro-kernel, when the spec runs it.
    /// The micro-kernels of decode (G rows) and of prefill blocks (tiles
    /// of 4 rows), on the 256-bit tier.
    native: Option<(DecodeKernel, DecodeKernel)>,
}

/// What the native decode path of one item needs.
struct NativeRanges {
    /// This (b, query block)'s packed q.
    q_group: Value,
    /// The item's first row tile.
    tiles_base: Value,
    /// `b · T`: the sequence's row of the key-offset table.
    seq_offsets: Value,
    /// The relative key positions `[lo, hi)` the call reads.
    lo: Value,
    hi: Value,
    /// Keys of the sequence after `hi` the call may prefetch (at most a
    /// block): the next key chunk, which this thread's next item reads.
    ahead: Value,
    /// Query rows per KV head (`QB·G`).
    rows: Value,
}

/// What one row tile's pass over a key block needs.
struct TileBlock {
    /// Address of the tile's state (m, l, lo, hi, acc).
    tile: Value,
    /// Address of the tile's 4 f32 query rows.
    q: Value,
    /// This KV head's K and V rows of the block in the block buffer.
    k: Value,
    v: Value,
    /// An FP8 cache's: this KV head's K and V scales of the block in the
    /// block buffer (`[KB, D/g]` f32 each).
    scales: Option<(Value, Value)>,
    /// The item's scratch.
    scratch: Value,
    /// First key position of the block (i64).
    p0: Value,
    /// Keys of the block, padded to a multiple of [`PV_UNROLL`] (i64).
    n_pad: Value,
    /// `[p0, p0 + n)` as splat I32X4.
    p0_v: Value,
    end_v: Value,
}

fn iconst(b: &mut FunctionBuilder, v: i64) -> Value {
    b.ins().iconst(types::I64, v)
}

/// Copy `bytes` (a multiple of 4) from `src + from` to `dst + to` (both
/// within `disp`): 16 bytes at a time, then 8 and 4.
fn copy_bytes(
    b: &mut FunctionBuilder,
    disp: Displacements,
    (src, from): (Value, usize),
    (dst, to): (Value, usize),
    bytes: usize,
) {
    let mut o = 0;
    while o < bytes {
        let ty = match bytes - o {
            16.. => types::I32X4,
            8.. => types::I64,
            _ => types::I32,
        };
        let x = b.ins().load(ty, mem(), src, disp.of(from + o));
        b.ins().store(mem(), x, dst, disp.of(to + o));
        o += ty.bytes() as usize;
    }
}

/// An F32X4 comparison mask as F32X4 (for `bitselect`).
fn as_f32x4(b: &mut FunctionBuilder, v: Value) -> Value {
    b.ins().bitcast(types::F32X4, MemFlagsData::new(), v)
}

impl Emitter {
    /// `bytes` as a displacement ([`Displacements::of`]).
    #[track_caller]
    fn at(&self, bytes: usize) -> i32 {
        self.disp.of(bytes)
    }

    fn d(&self) -> usize {
        self.spec.cache.head_size
    }

    fn tile_bytes(&self) -> usize {
        4 * layout::tile_floats(self.spec.cache.head_size)
    }

    /// Elements from a K row to its V row: L·page_size·Hkv·D.
    fn kv_stride(&self) -> usize {
        let cache = &self.spec.cache;
        cache.num_layers * cache.page_size * cache.num_kv_heads * cache.head_size
    }

    /// Bytes of one K or V row of one KV head in the block buffer.
    fn row_bytes(&self) -> usize {
        self.d() * buffer_dtype(&self.spec).size_bytes()
    }

    /// Whether the cache is FP8 (codes and scales).
    fn fp8(&self) -> bool {
        self.spec.cache.dtype() == DType::F8E4M3
    }

    /// Scale blocks per head (D/g; 1 for other caches).
    fn nb(&self) -> usize {
        scale_blocks(&self.spec)
    }

    /// `F32X4` vectors of a head per scale block.
    fn block_vectors(&self) -> usize {
        self.spec.cache.head_size / 4 / self.nb()
    }

    /// Bytes from one key's scores (probabilities) to the next's.
    fn score_stride(&self) -> usize {
        layout::score_stride(self.nb())
    }

    fn emit_item(&self, b: &mut FunctionBuilder, item: Value, slot: Value) {
        let hkv_count = self.spec.cache.num_kv_heads;
        let chunks = self.args.chunks;
        let c = b.ins().urem(item, chunks);
        let group_index = b.ins().udiv(item, chunks);
        let nqb = self.args.query_blocks;
        let qb = b.ins().urem(group_index, nqb);
        let batch = b.ins().udiv(group_index, nqb);

        let item_bytes = b.ins().imul(slot, self.args.item_floats);
        let scratch = addr::element(b, self.args.partials, item_bytes, 4);
        let tiles_base = b.ins().iadd_imm_s(scratch, layout::tiles(self.nb()) as i64);
        let tiles_per_head = self.args.tiles;
        let tiles = b.ins().imul_imm_s(tiles_per_head, hkv_count as i64);
        let buffer = addr::element(b, self.args.buffers, self.begin, block_buffer_bytes(&self.spec));
        // This (b, query block)'s packed q: Hkv·tiles_per_head·4 rows of D f32.
        let q_group = b.ins().imul(group_index, tiles);
        let q_group = addr::element(b, self.args.q, q_group, ROW_TILE * self.d() * 4);

        // The sequence's lengths, its first key, and this block's valid
        // queries. Key positions from here on are relative to the first key
        // (`rebase`): below MAX_JIT_KEYS, so they fit the I32X4 lanes.
        let lengths_at = addr::element(b, self.args.lengths, batch, 24);
        let cl = b.ins().load(types::I64, mem(), lengths_at, 0);
        let valid = b.ins().load(types::I64, mem(), lengths_at, 8);
        let first_key = b.ins().load(types::I64, mem(), lengths_at, 16);
        let rebase = |b: &mut FunctionBuilder, (lo, hi): (Value, Value)| {
            (b.ins().isub(lo, first_key), b.ins().isub(hi, first_key))
        };
        let query_block = self.args.query_block;
        let s0 = b.ins().imul(qb, query_block);
        let s_end = b.ins().iadd(s0, query_block);
        let s_end = b.ins().smin(s_end, valid);

        // Every tile starts empty (m = -inf, l = 0, acc = 0), with each
        // row's key range ([0, 0) for padded rows).
        let zero = iconst(b, 0);
        counted_loop(b, zero, tiles, 1, &[], |b, t, _| {
            let tile = addr::element(b, tiles_base, t, self.tile_bytes());
            let ninf = splat_f32(b, f32::NEG_INFINITY);
            b.ins().store(mem(), ninf, tile, self.at(layout::M));
            let zv = splat_f32(b, 0.0);
            b.ins().store(mem(), zv, tile, self.at(layout::L));
            for i in 0..ROW_TILE * self.spec.cache.head_size / 4 {
                b.ins().store(mem(), zv, tile, self.at(layout::ACC + 16 * i));
            }
            // Rows of a head's tiles: r = (t % tiles_per_head)·4 + i.
            let t_in_head = b.ins().urem(t, tiles_per_head);
            let first_row = b.ins().imul_imm_s(t_in_head, ROW_TILE as i64);
            for i in 0..ROW_TILE {
                let r = b.ins().iadd_imm_s(first_row, i as i64);
                let (ds, _) = self.div_group(b, r);
                let s = b.ins().iadd(s0, ds);
                let range = self.row_range(b, cl, valid, s);
                let (lo, hi) = rebase(b, range);
                let real = b.ins().icmp(IntCC::SignedLessThan, s, s_end);
                let zero = iconst(b, 0);
                let lo = b.ins().select(real, lo, zero);
                let hi = b.ins().select(real, hi, zero);
                let lo = b.ins().ireduce(types::I32, lo);
                let hi = b.ins().ireduce(types::I32, hi);
                b.ins().store(mem(), lo, tile, self.at(layout::LO + 4 * i));
                b.ins().store(mem(), hi, tile, self.at(layout::HI + 4 * i));
            }
            Vec::new()
        });

        let any = b.ins().icmp(IntCC::SignedLessThan, s0, s_end);
        when(b, any, |b| {
            let s_last = b.ins().iadd_imm_s(s_end, -1);
            let range = self.row_range(b, cl, valid, s0);
            let (item_lo, _) = rebase(b, range);
            let range = self.row_range(b, cl, valid, s_last);
            let (_, item_hi) = rebase(b, range);
            let chunk = self.args.chunk;
            let c_lo = b.ins().imul(c, chunk);
            let c_hi = b.ins().iadd(c_lo, chunk);
            let lo = b.ins().smax(item_lo, c_lo);
            let hi = b.ins().smin(item_hi, c_hi);
            // The next chunk's first keys (items of a thread are
            // consecutive: its next item is this sequence's next chunk).
            let rest = b.ins().isub(item_hi, hi);
            let block = iconst(b, KB as i64);
            let ahead = b.ins().smin(rest, block);
            let stride = self.args.stride;
            let seq_offsets = b.ins().imul(batch, stride);
            // The Cranelift path: keys gathered per block into the buffer,
            // 128-bit loops, each row masked to its key range (the
            // Cranelift tier, and caches the micro-kernel does not serve).
            let gathered = |b: &mut FunctionBuilder, lo: Value, hi: Value| {
                let convert = self.fp8().then(|| ToBf16::new(b, self.disp));
                counted_loop(b, lo, hi, KB as i64, &[], |b, p0, _| {
                    let p0_end = b.ins().iadd_imm_s(p0, KB as i64);
                    let block_hi = b.ins().smin(p0_end, hi);
                    let n = b.ins().isub(block_hi, p0);
                    let n_pad = b.ins().iadd_imm_s(n, PV_UNROLL as i64 - 1);
                    let n_pad = b.ins().band_imm_s(n_pad, -(PV_UNROLL as i64));
                    self.emit_gather(b, buffer, seq_offsets, (p0, n, n_pad), convert.as_ref());
                    let p0_32 = b.ins().ireduce(types::I32, p0);
                    let p0_v = b.ins().splat(types::I32X4, p0_32);
                    let end_32 = b.ins().ireduce(types::I32, block_hi);
                    let end_v = b.ins().splat(types::I32X4, end_32);
                    let zero = iconst(b, 0);
                    let head_rows = KB * self.row_bytes();
                    counted_loop(b, zero, tiles, 1, &[], |b, t, _| {
                        let tile = addr::element(b, tiles_base, t, self.tile_bytes());
                        let q = addr::element(b, q_group, t, ROW_TILE * self.d() * 4);
                        let hkv = b.ins().udiv(t, tiles_per_head);
                        let k = addr::element(b, buffer, hkv, head_rows);
                        let v = b.ins().iadd_imm_s(k, (hkv_count * head_rows) as i64);
                        let scales = self.fp8().then(|| {
                            let head_scales = KB * self.nb() * 4;
                            let ks = addr::element(b, buffer, hkv, head_scales);
                            let ks = b.ins().iadd_imm_s(ks, block_rows_bytes(&self.spec) as i64);
                            let vs = b.ins().iadd_imm_s(ks, (hkv_count * head_scales) as i64);
                            (ks, vs)
                        });
                        let tb = TileBlock { tile, q, k, v, scales, scratch, p0, n_pad, p0_v, end_v };
                        self.emit_tile_block(b, &tb);
                        Vec::new()
                    });
                    Vec::new()
                });
            };
            match self.native {
                None => gathered(b, lo, hi),
                Some((decode_kernel, block_kernel)) => {
                    // The 256-bit tier. Decode (one query per item, every
                    // row of a KV head reading the same keys): the
                    // micro-kernel over the item's keys.
                    let decode = b.ins().icmp_imm_s(IntCC::Equal, query_block, 1);
                    when(b, decode, |b| {
                        let rows = iconst(b, self.spec.group() as i64);
                        let ranges = NativeRanges { q_group, tiles_base, seq_offsets, lo, hi, ahead, rows };
                        self.emit_native(b, decode_kernel, &ranges);
                    });
                    // Prefill: every key of the item through the micro-kernel,
                    // all rows of the block at once, each row masked to its
                    // own key range (the causal diagonal, a window's edge)
                    // by the kernel from the tiles' lo/hi.
                    let prefill = b.ins().icmp_imm_s(IntCC::NotEqual, query_block, 1);
                    when(b, prefill, |b| {
                        let group = iconst(b, self.spec.group() as i64);
                        let rows = b.ins().imul(query_block, group);
                        let ranges = NativeRanges { q_group, tiles_base, seq_offsets, lo, hi, ahead, rows };
                        self.emit_native(b, block_kernel, &ranges);
                    });
                }
            }
        });
    }

    /// The 256-bit tier: one call of the micro-kernel over the keys `[lo,
    /// hi)` for every KV head (block by block, all heads of a block
    /// together) and the item's `rows` query rows per KV head, reading K/V
    /// in place through the sequence's row of the offsets table and
    /// updating the heads' row tiles (`m`, `l`, `acc`) in the partials. The
    /// packed q and the tiles are head after head, `tiles_per_head =
    /// ceil(QB·G/4)` each, as the micro-kernel reads them.
    fn emit_native(&self, b: &mut FunctionBuilder, kernel: DecodeKernel, r: &NativeRanges) {
        let any = b.ins().icmp(IntCC::SignedLessThan, r.lo, r.hi);
        when(b, any, |b| {
            let d = self.d();
            let keys = b.ins().isub(r.hi, r.lo);
            let first = b.ins().iadd(r.seq_offsets, r.lo);
            let offsets = addr::element(b, self.args.key_offsets, first, 8);
            let scales = match self.fp8() {
                true => self.args.scales,
                false => iconst(b, 0),
            };
            let g = self.spec.cache.scale_granularity().unwrap_or(0);
            let [heads, d, kv_stride, g, tile_floats] =
                [self.spec.cache.num_kv_heads, d, self.kv_stride(), g, layout::tile_floats(d)]
                    .map(|c| iconst(b, c as i64));
            let rows = r.rows;
            let args = [
                r.q_group,
                self.args.blocks,
                offsets,
                keys,
                r.ahead,
                r.lo,
                heads,
                scales,
                r.tiles_base,
                rows,
                d,
                kv_stride,
                g,
                tile_floats,
            ];
            kvjit_jit::ir::call_native(b, kernel as usize, &args);
        });
    }

    /// Copy the K and V rows (all KV heads) of keys `p0 + j`, `j < n_pad`
    /// (`keys` = `(p0, n, n_pad)`), into the block buffer, KV head major;
    /// keys `j ≥ n` (padding) repeat key `n − 1`. Each key's rows are read whole and in order (`Hkv·D`
    /// contiguous elements each, consecutive keys of a page adjacent), so
    /// the hardware prefetchers stream them; everything after reads the
    /// buffer from cache. An FP8 cache's codes are re-encoded as bf16 on the
    /// way (`convert`), and the keys' K and V scales (`Hkv·D/g` contiguous
    /// f32 each) copied beside the rows.
    fn emit_gather(
        &self,
        b: &mut FunctionBuilder,
        buffer: Value,
        seq_offsets: Value,
        (p0, n, n_pad): (Value, Value, Value),
        convert: Option<&ToBf16>,
    ) {
        let csize = self.spec.cache.dtype().size_bytes();
        let src_row_bytes = self.d() * csize;
        let row_bytes = self.row_bytes();
        let head_rows = KB * row_bytes;
        let hkv_count = self.spec.cache.num_kv_heads;
        let nb = self.nb();
        let offsets = b.ins().iadd(seq_offsets, p0);
        let offsets = addr::element(b, self.args.key_offsets, offsets, 8);
        let last = b.ins().iadd_imm_s(n, -1);
        let zero = iconst(b, 0);
        counted_loop(b, zero, n_pad, 1, &[], |b, j, _| {
            let key = b.ins().smin(j, last);
            let at = addr::element(b, offsets, key, 8);
            let element = b.ins().load(types::I64, mem(), at, 0);
            let k_src = addr::element(b, self.args.blocks, element, csize);
            let v_src = b.ins().iadd_imm_s(k_src, (self.kv_stride() * csize) as i64);
            let dst = addr::element(b, buffer, j, row_bytes);
            for (kv, src) in [k_src, v_src].into_iter().enumerate() {
                for h in 0..hkv_count {
                    let from = h * src_row_bytes;
                    let to = (kv * hkv_count + h) * head_rows;
                    if let Some(convert) = convert {
                        convert.convert_row(b, src, from, dst, to, self.spec.cache.head_size);
                        continue;
                    }
                    copy_bytes(b, self.disp, (src, from), (dst, to), row_bytes);
                }
            }
            if convert.is_some() {
                // The key's scales: its row's element offset / g (rows are
                // whole heads, so the scales row is [page, kv, layer, slot, 0, 0]).
                let g = self.spec.cache.head_size / self.nb();
                let row = if g.is_power_of_two() {
                    b.ins().ushr_imm_u(element, i64::from(g.trailing_zeros()))
                } else {
                    let g = iconst(b, g as i64);
                    b.ins().udiv(element, g)
                };
                let k_scales = addr::element(b, self.args.scales, row, 4);
                let v_scales = b.ins().iadd_imm_s(k_scales, (self.kv_stride() / g * 4) as i64);
                let dst = addr::element(b, buffer, j, nb * 4);
                let rows_bytes = block_rows_bytes(&self.spec);
                for (kv, src) in [k_scales, v_scales].into_iter().enumerate() {
                    for h in 0..hkv_count {
                        let to = rows_bytes + (kv * hkv_count + h) * KB * nb * 4;
                        copy_bytes(b, self.disp, (src, h * nb * 4), (dst, to), nb * 4);
                    }
                }
            }
            Vec::new()
        });
    }

    /// `(r / G, r % G)`.
    fn div_group(&self, b: &mut FunctionBuilder, r: Value) -> (Value, Value) {
        let g = self.spec.group();
        if g.is_power_of_two() {
            let shift = g.trailing_zeros() as i64;
            let q = b.ins().ushr_imm_u(r, shift);
            let m = b.ins().band_imm_s(r, g as i64 - 1);
            (q, m)
        } else {
            let gv = iconst(b, g as i64);
            (b.ins().udiv(r, gv), b.ins().urem(r, gv))
        }
    }

    /// The key positions `[lo, hi)` query `s` reads.
    fn row_range(&self, b: &mut FunctionBuilder, cl: Value, valid: Value, s: Value) -> (Value, Value) {
        let own = b.ins().iadd(cl, s);
        let own_end = b.ins().iadd_imm_s(own, 1);
        let hi = match self.spec.mask {
            Mask::Causal => own_end,
            Mask::Null => b.ins().iadd(cl, valid),
        };
        let lo = match self.spec.window {
            Some(w) => {
                let lo = b.ins().iadd_imm_s(own_end, -(w as i64));
                let zero = iconst(b, 0);
                b.ins().smax(lo, zero)
            }
            None => iconst(b, 0),
        };
        (lo, hi)
    }

    /// One row tile against one key block, in three phases: the scores and
    /// their max per row, the online softmax, P·V.
    fn emit_tile_block(&self, b: &mut FunctionBuilder, tb: &TileBlock) {
        let (block_max, ninf) = self.emit_scores(b, tb);
        self.emit_softmax(b, tb, block_max, ninf);
        self.emit_pv(b, tb);
    }

    /// Scores of the tile's 4 rows against the block's keys, 2 keys at a
    /// time, into the scratch (-inf where a row does not read the key; an
    /// FP8 cache's K scales applied). Returns their max per row and the
    /// -inf splat the masking used.
    fn emit_scores(&self, b: &mut FunctionBuilder, tb: &TileBlock) -> (Value, Value) {
        let bdt = buffer_dtype(&self.spec);
        let bsize = bdt.size_bytes();
        let d = self.spec.cache.head_size;
        let dv = d / 4;
        let row_bytes = self.row_bytes();
        // FP8: scale blocks per head and F32X4 vectors per block (else 1 and dv).
        let (nb, vb) = (self.nb(), self.block_vectors());
        let stride = self.score_stride();
        // The rows' key ranges clipped to the block, as I32X4.
        let lo_v = b.ins().load(types::I32X4, mem(), tb.tile, self.at(layout::LO));
        let lo_v = b.ins().smax(lo_v, tb.p0_v);
        let hi_v = b.ins().load(types::I32X4, mem(), tb.tile, self.at(layout::HI));
        let hi_v = b.ins().smin(hi_v, tb.end_v);
        let zero = iconst(b, 0);
        let ninf = splat_f32(b, f32::NEG_INFINITY);
        let block_max = counted_loop(b, zero, tb.n_pad, 2, &[ninf], |b, j, carried| {
            let key = addr::element(b, tb.k, j, row_bytes);
            // FP8: the two keys' K scales, `nb` f32 each.
            let key_scales = tb.scales.map(|(ks, _)| addr::element(b, ks, j, nb * 4));
            let zv = splat_f32(b, 0.0);
            // acc[k][r]: key k, row r.
            let mut acc = [[zv; ROW_TILE]; 2];
            let mut block_scales = Vec::new();
            for i in 0..dv {
                // g < D: each F32X4 of K times its block's scale (the 4 rows
                // share it); g = D scales the scores after the sum instead.
                if let Some(ks) = key_scales.filter(|_| nb > 1 && i % vb == 0) {
                    block_scales = (0..2)
                        .map(|k| {
                            let x = b.ins().load(types::F32, mem(), ks, self.at(4 * (k * nb + i / vb)));
                            b.ins().splat(types::F32X4, x)
                        })
                        .collect();
                }
                let kv: Vec<Value> = (0..2)
                    .map(|k| {
                        let x = load_f32x4_raw(b, bdt, key, self.at(k * row_bytes + 4 * i * bsize));
                        match block_scales.get(k) {
                            Some(&scale) => b.ins().fmul(x, scale),
                            None => x,
                        }
                    })
                    .collect();
                for r in 0..ROW_TILE {
                    for (acc_k, &kv) in acc.iter_mut().zip(&kv) {
                        // A separate load per use (the FMA takes it from memory).
                        let qv = b.ins().load(types::F32X4, mem(), tb.q, self.at(4 * (r * d + 4 * i)));
                        acc_k[r] = b.ins().fma(qv, kv, acc_k[r]);
                    }
                }
            }
            let pos = b.ins().iadd(tb.p0, j);
            let pos = b.ins().ireduce(types::I32, pos);
            let mut max = carried[0];
            let scores = addr::element(b, tb.scratch, j, stride);
            for (k, &column) in acc.iter().enumerate() {
                let s = transpose_sum(b, column);
                let s = match key_scales {
                    Some(ks) if nb == 1 => {
                        let scale = b.ins().load(types::F32, mem(), ks, self.at(4 * k));
                        let scale = b.ins().splat(types::F32X4, scale);
                        b.ins().fmul(s, scale)
                    }
                    _ => s,
                };
                // Lanes whose row does not read this key → -inf.
                let p = b.ins().iadd_imm_s(pos, k as i64);
                let p = b.ins().splat(types::I32X4, p);
                let ge = b.ins().icmp(IntCC::SignedGreaterThanOrEqual, p, lo_v);
                let lt = b.ins().icmp(IntCC::SignedLessThan, p, hi_v);
                let inside = b.ins().band(ge, lt);
                let inside = as_f32x4(b, inside);
                let s = b.ins().bitselect(inside, s, ninf);
                b.ins().store(mem(), s, scores, self.at(layout::SCORES + k * stride));
                max = b.ins().fmax(max, s);
            }
            vec![max]
        })[0];
        (block_max, ninf)
    }

    /// The online softmax of the block, per row (lane), guarded against a
    /// row with no key yet: the new max `m` and its α = e^(m_old − m) (into
    /// the scratch, for P·V), each score replaced by its P = e^(s − m) (an
    /// FP8 cache's P times each of the key's V block scales), and
    /// `l = α·l + Σ P`.
    fn emit_softmax(&self, b: &mut FunctionBuilder, tb: &TileBlock, block_max: Value, ninf: Value) {
        let nb = self.nb();
        let stride = self.score_stride();
        let alpha_at = layout::alpha(nb);
        let m_old = b.ins().load(types::F32X4, mem(), tb.tile, self.at(layout::M));
        let m_new = b.ins().fmax(m_old, block_max);
        let empty = b.ins().fcmp(FloatCC::Equal, m_new, ninf);
        let empty = as_f32x4(b, empty);
        let zv = splat_f32(b, 0.0);
        let m_use = b.ins().bitselect(empty, zv, m_new);
        let alpha_arg = b.ins().fsub(m_old, m_use);
        let alpha = exp_f32x4(b, alpha_arg);
        b.ins().store(mem(), m_new, tb.tile, self.at(layout::M));
        b.ins().store(mem(), alpha, tb.scratch, self.at(alpha_at));
        let zero = iconst(b, 0);
        let psum = counted_loop(b, zero, tb.n_pad, 1, &[zv], |b, j, carried| {
            let scores = addr::element(b, tb.scratch, j, stride);
            let s = b.ins().load(types::F32X4, mem(), scores, self.at(layout::SCORES));
            let x = b.ins().fsub(s, m_use);
            let p = exp_f32x4(b, x);
            match tb.scales {
                // FP8: P times each of the key's V block scales, for P·V.
                Some((_, vs)) => {
                    let scales_at = addr::element(b, vs, j, nb * 4);
                    for blk in 0..nb {
                        let scale = b.ins().load(types::F32, mem(), scales_at, self.at(4 * blk));
                        let scale = b.ins().splat(types::F32X4, scale);
                        let scaled = b.ins().fmul(p, scale);
                        b.ins().store(mem(), scaled, scores, self.at(layout::SCORES + 16 * blk));
                    }
                }
                None => {
                    b.ins().store(mem(), p, scores, self.at(layout::SCORES));
                }
            }
            vec![b.ins().fadd(carried[0], p)]
        })[0];
        let l_old = b.ins().load(types::F32X4, mem(), tb.tile, self.at(layout::L));
        let l_new = b.ins().fma(alpha, l_old, psum);
        b.ins().store(mem(), l_new, tb.tile, self.at(layout::L));
    }

    /// `acc = α·acc + Σ_j P[j]·V[j]` for the tile's rows: a register tile of
    /// [`PV_VECTORS`] F32X4 of D per pass over the block's keys, each pass
    /// within one scale block (an FP8 cache's P[j] is P·scale of the pass's
    /// block).
    fn emit_pv(&self, b: &mut FunctionBuilder, tb: &TileBlock) {
        let bdt = buffer_dtype(&self.spec);
        let bsize = bdt.size_bytes();
        let d = self.spec.cache.head_size;
        let dv = d / 4;
        let row_bytes = self.row_bytes();
        let vb = self.block_vectors();
        let stride = self.score_stride();
        let alpha_at = layout::alpha(self.nb());
        let mut first = 0;
        while first < dv {
            let count = PV_VECTORS.min(dv - first).min(vb - first % vb);
            let blk = first / vb;
            let acc_at = |r: usize, i: usize| self.at(layout::ACC + 4 * (r * d + 4 * (first + i)));
            let mut accs = Vec::with_capacity(ROW_TILE * count);
            for r in 0..ROW_TILE {
                for i in 0..count {
                    let a = b.ins().load(types::F32X4, mem(), tb.tile, acc_at(r, i));
                    let alpha_r = b.ins().load(types::F32, mem(), tb.scratch, self.at(alpha_at + 4 * r));
                    let alpha_r = b.ins().splat(types::F32X4, alpha_r);
                    accs.push(b.ins().fmul(a, alpha_r));
                }
            }
            let zero = iconst(b, 0);
            let accs = counted_loop(b, zero, tb.n_pad, PV_UNROLL as i64, &accs, |b, j, accs| {
                let mut accs = accs.to_vec();
                let p_at = addr::element(b, tb.scratch, j, stride);
                let v_at = addr::element(b, tb.v, j, row_bytes);
                for u in 0..PV_UNROLL {
                    let vs: Vec<Value> = (0..count)
                        .map(|i| load_f32x4_raw(b, bdt, v_at, self.at(u * row_bytes + 4 * (first + i) * bsize)))
                        .collect();
                    for r in 0..ROW_TILE {
                        for (i, &v) in vs.iter().enumerate() {
                            let p_off = self.at(layout::SCORES + u * stride + 16 * blk + 4 * r);
                            let p = b.ins().load(types::F32, mem(), p_at, p_off);
                            let p = b.ins().splat(types::F32X4, p);
                            accs[r * count + i] = b.ins().fma(p, v, accs[r * count + i]);
                        }
                    }
                }
                accs
            });
            for r in 0..ROW_TILE {
                for i in 0..count {
                    b.ins().store(mem(), accs[r * count + i], tb.tile, acc_at(r, i));
                }
            }
            first += count;
        }
    }
}

/// Most keys one sequence's queries may read together in one call of the
/// JIT kernel (the code holds key positions, relative to the sequence's
/// first key, in i32 lanes); the reference kernel serves more.
pub const MAX_JIT_KEYS: usize = 1 << 30;

/// Refuse a validated call in which a sequence reads more than
/// [`MAX_JIT_KEYS`] keys ([`AttentionError::TooManyKeys`]).
fn check_key_span(shape: &CallShape) -> Result<()> {
    for (batch, &(lo, hi)) in shape.key_ranges.iter().enumerate() {
        if hi - lo > MAX_JIT_KEYS {
            return Err(AttentionError::TooManyKeys { batch, keys: hi - lo, max: MAX_JIT_KEYS }.into());
        }
    }
    Ok(())
}

/// The launch plan of one call: how queries and keys are cut into items.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    query_block: usize,
    query_blocks: usize,
    /// Row tiles per KV head.
    tiles: usize,
    /// Key positions per chunk; chunk c of a sequence holds its keys
    /// `first + c·chunk ..` (`first`: the first key it reads).
    chunk: usize,
    chunks: usize,
    /// Entries per sequence in the key-offset table (≥ chunks·chunk): sized
    /// by the keys a sequence reads, never by their absolute positions.
    stride: usize,
    /// f32 values of an item's scratch before its tiles.
    head_floats: usize,
    item_floats: usize,
    groups: usize,
    items: usize,
}

impl Plan {
    /// The sequence of group `group` (= b·query blocks + qb) and the first
    /// position of its query block, qb·QB.
    fn group(&self, group: usize) -> (usize, usize) {
        (group / self.query_blocks, group % self.query_blocks * self.query_block)
    }

    /// The plan of a call with at least one valid query (so B ≥ 1): a
    /// function of the call's shapes and lengths only.
    fn new(spec: &MhaSpec, shape: &CallShape) -> Self {
        let group = shape.group();
        // The most keys one sequence reads (a window's width, not its end).
        let span = shape.key_ranges.iter().map(|&(lo, hi)| hi - lo).max().unwrap_or(0).max(1);
        let query_block = shape.seq.clamp(1, PREFILL_QUERY_BLOCK);
        let query_blocks = shape.seq.div_ceil(query_block).max(1);
        let groups = shape.batch * query_blocks;
        // Split the keys only as far as needed to make TARGET_ITEMS items
        // (decode at small B; TARGET_PREFILL_ITEMS for prefill); chunks of
        // at least MIN_CHUNK.
        let target = if query_block > 1 { TARGET_PREFILL_ITEMS } else { TARGET_ITEMS };
        let want_chunks = target.div_ceil(groups).max(1);
        // Below MIN_CHUNK only when the groups alone make fewer than
        // MIN_ITEMS items (a short decode of a few sequences), never below a
        // block.
        let min_chunk = min_chunk(spec);
        let floor = match MIN_ITEMS.div_ceil(groups) {
            1 => min_chunk,
            want => (span / want / KB * KB).clamp(KB, min_chunk),
        };
        let chunk = span.div_ceil(want_chunks).next_multiple_of(KB).max(floor);
        let chunks = span.div_ceil(chunk);
        let tiles = (query_block * group).div_ceil(ROW_TILE);
        let head_floats = layout::head_floats(scale_blocks(spec));
        let item_floats = head_floats + shape.num_kv_heads * tiles * layout::tile_floats(spec.cache.head_size);
        Plan {
            query_block,
            query_blocks,
            tiles,
            chunk,
            chunks,
            stride: chunks * chunk + KB,
            head_floats,
            item_floats,
            groups,
            items: groups * chunks,
        }
    }
}

/// Whether a call's work items all cost the same: a decode (query blocks
/// of one position) whose sequences read equally many keys. Its launch then
/// gives each thread one contiguous range of items ([`kvjit_jit::launch`]),
/// so an item's last block prefetches the first block of the thread's next
/// item, the sequence's next chunk. Claimed one range at a time from the
/// last ([`kvjit_jit::launch_uneven`], which balances items of unequal
/// cost: causal prefill blocks, sequences of different lengths), the next
/// chunk was mostly another thread's, already read, and every item started
/// on a cold block. Measured as for [`MIN_ITEMS`] (Xeon, 2 threads, batch
/// 1, from DRAM, uneven → contiguous): Llama-3-8B's bf16 heads at context
/// 512 127.6 → 116.7 µs (8 items: 160.7 → 124.4), 2048 431.6 → 419.8;
/// SmolLM2's at 2048 91.2 → 85.7.
fn items_of_equal_cost(shape: &CallShape, plan: &Plan) -> bool {
    let span = |&(lo, hi): &(usize, usize)| hi - lo;
    plan.query_block == 1 && shape.key_ranges.windows(2).all(|pair| span(&pair[0]) == span(&pair[1]))
}

/// The op as JIT-compiled machine code for one spec ([`kvjit_op::Jit`]:
/// [`jit_kernel`] makes it ready to run; `run_into` runs it into
/// caller-owned bytes).
///
/// Tensor inputs, in order: `q`, `layer_idx`, `valid_lengths`; one cache;
/// one output.
pub type JitKernel = kvjit_op::Jit<MhaSpec>;

/// Compile (or fetch) the JIT kernel for `spec`, behind the runtime's
/// [`Kernel`](kvjit_runtime::Kernel) interface.
pub fn jit_kernel(spec: MhaSpec, capture: CaptureText) -> Result<Compiled<JitKernel>, JitError> {
    JitKernel::compiled(spec, capture)
}

/// Valid specs whose head size (a multiple of 4, at most
/// [`MAX_JIT_HEAD_SIZE`](crate::MAX_JIT_HEAD_SIZE)) and offsets the
/// generated code handles.
impl JitSpec for MhaSpec {
    fn supported(&self) -> Result<(), JitError> {
        supported(self)
    }

    fn compile(&self, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
        compile(self, capture)
    }

    /// No sequence reads more keys than the kernel handles
    /// ([`MAX_JIT_KEYS`]).
    fn check_limits(&self, shape: &CallShape) -> Result<()> {
        check_key_span(shape)
    }

    /// Run a checked call: `output` holds `B·S·Hq·D` elements of the
    /// dtype.
    fn launch(&self, shape: &CallShape, call: Launch<'_, '_>) -> Result<()> {
        let ([q, _, valid_lengths], cache, ctx) = (call.tensors(), &*call.caches[0], call.ctx);
        let valid = valid_lengths.as_slice::<u32>()?;
        // No valid query (B = 0, S = 0 or every row padded): every row
        // zero, nothing to launch. Otherwise B ≥ 1, which the plan needs,
        // and the merge writes every row (padded ones zero).
        if !valid.iter().any(|&v| v > 0) {
            call.output.fill(0);
        } else {
            let plan = Plan::new(self, shape);
            let offsets = key_row_offsets(shape, cache, plan.stride)?;
            let lengths: Vec<i64> = (0..shape.batch)
                .flat_map(|b| {
                    let first_key = shape.key_ranges[b].0 as i64;
                    [i64::from(cache.cache_lengths()[b]), i64::from(valid[b]), first_key]
                })
                .collect();
            // One reused scratch, carved at 64-byte multiples into the
            // packed q, the gather buffers and the partials, each written
            // before it is read: only the invocations' first items' buffers
            // are used, each filled by its gather before its tiles read it,
            // and none when the micro-kernel runs (it reads K/V in place);
            // every item writes its whole state in the partials
            // before the merge reads it.
            let gathers = !runs_native(self);
            let buffer_bytes = if gathers { plan.items * block_buffer_bytes(self) } else { 0 };
            let regions = [q_floats(shape, &plan), buffer_bytes.div_ceil(4), plan.items * plan.item_floats];
            let rounded = regions.map(|floats| floats.next_multiple_of(16));
            with_scratch(rounded.iter().sum(), |scratch| {
                let (packed_q, rest) = scratch.split_at_mut(rounded[0]);
                let (buffers, partials) = rest.split_at_mut(rounded[1]);
                let (packed_q, partials) = (&mut packed_q[..regions[0]], &mut partials[..regions[2]]);
                // q is contiguous (checked), so its storage is its elements.
                // One chunk: every item is a whole (b, query block) group,
                // packs its own q and writes its own output rows.
                // Every access to the packed q, the partials and the output
                // from here on goes through these pointers (the kernel's
                // and the hooks' alike).
                let hooked = plan.chunks == 1;
                let hooks = ItemHooks {
                    shape,
                    plan: &plan,
                    valid,
                    scale: self.scale,
                    q: q.data(),
                    packed_q: packed_q.as_mut_ptr(),
                    partials: partials.as_mut_ptr(),
                    dtype: self.dtype,
                    output: call.output.as_mut_ptr(),
                };
                let hooks_at = (&raw const hooks).cast::<u8>();
                if !hooked {
                    for group in 0..plan.groups {
                        // SAFETY: hooks is alive; one thread, before the
                        // launch: nothing else touches the packed q.
                        unsafe { pack_group_q(hooks_at, group as u64) };
                    }
                }
                let args = MhaArgs {
                    q: hooks.packed_q as u64,
                    blocks: cache.blocks().as_bytes().as_ptr() as u64,
                    key_offsets: offsets.as_ptr() as u64,
                    lengths: lengths.as_ptr() as u64,
                    partials: hooks.partials as u64,
                    tiles: plan.tiles as u64,
                    stride: plan.stride as u64,
                    query_blocks: plan.query_blocks as u64,
                    query_block: plan.query_block as u64,
                    chunks: plan.chunks as u64,
                    chunk: plan.chunk as u64,
                    item_floats: plan.item_floats as u64,
                    buffers: buffers.as_mut_ptr() as u64,
                    scales: cache.scales().map_or(0, |scales| scales.as_bytes().as_ptr() as u64),
                    hooks: if hooked { hooks_at as u64 } else { 0 },
                };
                let launch = match items_of_equal_cost(shape, &plan) {
                    true => kvjit_jit::launch::<MhaArgs<u64>>,
                    false => kvjit_jit::launch_uneven::<MhaArgs<u64>>,
                };
                // SAFETY: `code` was compiled by `emit_and_compile` for this
                // kernel's spec, reading `MhaArgs` at its fields' offsets.
                // `Compiled`'s checks (arity, dtypes, contiguity) and
                // `MhaSpec::check` validated the call against the spec (q is
                // contiguous [B, S, Hq, D] with the spec's Hq and D, the cache has
                // the spec's layout and B sequences, layer < L, valid_lengths[b] ≤
                // S, cl + v fits u32, and every page holding a key position in
                // `key_ranges[b]` is inside the lookup table and the cache), and
                // `check_key_span` that no sequence reads more than MAX_JIT_KEYS
                // keys (relative positions fit the code's i32 lanes). So:
                // item i reads q only in its group's `Hkv·tiles·4·D` values of
                // the packed q (groups·Hkv·tiles·4·D long, group = i / C <
                // groups); every K/V read is of a whole row `[page, kv, layer,
                // slot, 0..Hkv, 0..D]` at `offsets[b·T + p − lo_b]` (+ the K→V
                // stride) for a position p of the item's range, inside
                // `key_ranges[b] = [lo_b, hi_b)` (p − lo_b < c_hi ≤ C·CH < T;
                // padding keys repeat the block's last key), and each such
                // offset is a checked row of the blocks, leaving a whole K and V row (all heads)
                // inside `blocks`; for an FP8 spec the same check found the
                // cache FP8 with this g, and such a cache holds f32 scales
                // `[P, 2, L, page_size, Hkv, D/g]` (every constructor and
                // `set_scales` enforce it), so the scales of a row at element
                // offset o (a multiple of D = g·D/g) are the `Hkv·D/g` f32 at
                // o/g (+ the K→V stride / g for V), inside `scales` whenever the
                // row is inside `blocks`; `lengths` has 3·B words; each item reads and
                // writes only its own `item_floats` values of `partials`
                // (items·item_floats long) — with hooks, those of its
                // invocation's first item, which the invocation's items use
                // one after another, each merged before the next starts —,
                // and an invocation of items [begin,
                // end) only buffer `begin` of `buffers` (items buffers of
                // `block_buffer_bytes`, of unspecified contents: the gather
                // writes every row and scale of the block the tiles then
                // read; the pool's ranges are disjoint, so their first items
                // differ) — or, when `gathers` is false (the
                // micro-kernel's path, the only path such a call takes),
                // no buffer at all, so an empty `buffers` is never read or
                // written — so ranges write disjoint memory. `hooks`, when
                // set (one chunk: item i is group i), points to `hooks`,
                // alive until the launch returns and only read (its
                // references are to shared, immutable data; its pointers
                // are the ones the kernel uses), and the hooks item i calls
                // write only group i's packed q (before its tiles read it)
                // and group i's output rows (after its tiles wrote its
                // partials), disjoint across items. The
                // cache is only read. All buffers outlive the launch.
                unsafe { launch(call.code, &args, plan.items, ctx) };
                if !hooked {
                    for group in 0..plan.groups {
                        // SAFETY: hooks is alive; one thread, after the
                        // launch wrote every item's partials.
                        unsafe { merge_group_rows(hooks_at, group as u64, (group * plan.chunks) as u64) };
                    }
                }
            })?;
        }
        Ok(())
    }
}

/// What packing q and merging the partials of one (b, query block) group
/// need ([`pack_group_q`], [`merge_group_rows`]: called by the host or, when
/// the plan has one key chunk, by each item). Shared by the pool's threads
/// through a raw pointer and only read: its references are to immutable
/// call data, and what the groups write goes through its raw pointers to
/// disjoint regions.
struct ItemHooks<'a> {
    shape: &'a CallShape,
    plan: &'a Plan,
    valid: &'a [u32],
    scale: f32,
    /// The call's q, `[B, S, Hq, D]`.
    q: TensorData<'a>,
    /// The packed q, [`q_floats`] long.
    packed_q: *mut f32,
    /// The partials, `items·item_floats` long.
    partials: *mut f32,
    dtype: DType,
    /// The output, `B·S·Hq·D` elements of `dtype`.
    output: *mut u8,
}

/// Group `group`'s packed q: called by item `group` itself before its keys
/// (a one-chunk plan: item i is group i), or by the host for every group
/// before the launch.
///
/// # Safety
/// `hooks` points to the launch's live [`ItemHooks`], `group < groups`, and
/// nothing else reads or writes this group's packed q during the call.
unsafe extern "C" fn pack_group_q(hooks: *const u8, group: u64) {
    // SAFETY: the contract: a live ItemHooks.
    let hooks = unsafe { &*hooks.cast::<ItemHooks<'_>>() };
    let floats = group_q_floats(hooks.shape, hooks.plan);
    // SAFETY: group `group`'s region of the packed q (q_floats =
    // groups·floats long), touched by this call only.
    let dst = unsafe { std::slice::from_raw_parts_mut(hooks.packed_q.add(group as usize * floats), floats) };
    pack_group(hooks, group as usize, dst);
}

/// Group `group`'s output rows, merged from the partials of its chunks at
/// items `first_item ..`: called by the group's one item after its keys
/// (`first_item` its invocation's partials slot), or by the host for every
/// group after the launch (`first_item = group·C`).
///
/// # Safety
/// `hooks` points to the launch's live [`ItemHooks`], `group < groups`, the
/// partials at `first_item ..` (C items, inside the partials) are written
/// and not being written, and nothing else touches this group's output rows
/// during the call.
unsafe extern "C" fn merge_group_rows(hooks: *const u8, group: u64, first_item: u64) {
    // SAFETY: the contract: a live ItemHooks.
    let hooks = unsafe { &*hooks.cast::<ItemHooks<'_>>() };
    let rows = group_output_rows(hooks, group as usize);
    // SAFETY: the group's rows of the output (B·S·Hq·D elements), disjoint
    // from every other group's, touched by this call only.
    let out = unsafe { std::slice::from_raw_parts_mut(hooks.output.add(rows.start), rows.len()) };
    merge_group(hooks, (group as usize, first_item as usize), out);
}

/// q scaled and packed for one (b, query block) group: for each KV head,
/// `tiles·4` rows of D f32, row r = (position `r / G` of the block, head
/// `r % G` of the KV head's group); rows past the block or the sequence's
/// valid length are zero.
fn pack_group(hooks: &ItemHooks<'_>, group: usize, dst: &mut [f32]) {
    match hooks.q {
        TensorData::F32(q) => pack_group_of(hooks, q, group, dst),
        TensorData::BF16(q) => pack_group_of(hooks, q, group, dst),
        TensorData::F16(q) => pack_group_of(hooks, q, group, dst),
        _ => unreachable!("the spec's dtype is a compute float"),
    }
}

fn pack_group_of<T: Element>(hooks: &ItemHooks<'_>, q: &[T], group: usize, dst: &mut [f32]) {
    let (shape, plan) = (hooks.shape, hooks.plan);
    let (d, hq, g_size) = (shape.head_size, shape.num_heads, shape.group());
    let rows = plan.tiles * ROW_TILE;
    assert_eq!(dst.len(), group_q_floats(shape, plan), "a group's packed q");
    let (b, s0) = plan.group(group);
    for (hkv, dst) in dst.chunks_exact_mut(rows * d).enumerate() {
        for (r, dst) in dst.chunks_exact_mut(d).enumerate() {
            let (ds, g) = (r / g_size, r % g_size);
            let s = s0 + ds;
            if ds < plan.query_block && s < hooks.valid[b] as usize {
                let src = &q[((b * shape.seq + s) * hq + hkv * g_size + g) * d..][..d];
                for (o, &x) in dst.iter_mut().zip(src) {
                    *o = x.to_f32() * hooks.scale;
                }
            } else {
                dst.fill(0.0);
            }
        }
    }
}

/// f32 values of the packed q ([`pack_group`], every group).
fn q_floats(shape: &CallShape, plan: &Plan) -> usize {
    plan.groups * group_q_floats(shape, plan)
}

/// f32 values of one group's packed q.
fn group_q_floats(shape: &CallShape, plan: &Plan) -> usize {
    shape.num_kv_heads * plan.tiles * ROW_TILE * shape.head_size
}

/// The bytes of the output (`[B, S, Hq, D]` elements of the spec's dtype)
/// that hold group `group`'s rows: positions `[qb·QB, min(S, (qb+1)·QB))`
/// of sequence b, every head.
fn group_output_rows(hooks: &ItemHooks<'_>, group: usize) -> std::ops::Range<usize> {
    let (shape, plan) = (hooks.shape, hooks.plan);
    let (b, s0) = plan.group(group);
    let s1 = (s0 + plan.query_block).min(shape.seq);
    let position_bytes = shape.num_heads * shape.head_size * hooks.dtype.size_bytes();
    (b * shape.seq + s0) * position_bytes..(b * shape.seq + s1) * position_bytes
}

/// Combine the chunks' partials of every row of one group (its chunks' at
/// items `first_item ..`), always in chunk order, and round it once to the
/// dtype into `out` (the group's rows, [`group_output_rows`]); padded rows
/// and rows without a key are zero.
fn merge_group(hooks: &ItemHooks<'_>, (group, first_item): (usize, usize), out: &mut [u8]) {
    let (shape, plan, partials) = (hooks.shape, hooks.plan, hooks.partials);
    let row_bytes = shape.head_size * hooks.dtype.size_bytes();
    let (d, hq, g_size) = (shape.head_size, shape.num_heads, shape.group());
    let tile_floats = layout::tile_floats(d);
    let (b, s0) = plan.group(group);
    let mut acc = vec![0f32; d];
    for (ds, dst) in out.chunks_exact_mut(hq * row_bytes).enumerate() {
        let s = s0 + ds;
        for (h, dst) in dst.chunks_exact_mut(row_bytes).enumerate() {
            if s >= hooks.valid[b] as usize {
                dst.fill(0);
                continue;
            }
            let (hkv, g) = (h / g_size, h % g_size);
            let r = ds * g_size + g;
            let (tile, lane) = (hkv * plan.tiles + r / ROW_TILE, r % ROW_TILE);
            // (m, l, acc[D]) of row r in chunk c.
            let row = |c: usize| {
                let at = (first_item + c) * plan.item_floats + plan.head_floats + tile * tile_floats;
                // SAFETY: item first_item + c < items: its tile lies inside
                // the partials (items·item_floats long), written by the item.
                let state = unsafe { std::slice::from_raw_parts(partials.add(at), tile_floats) };
                let acc_at = layout::ACC / 4 + lane * d;
                (state[lane], state[4 + lane], &state[acc_at..acc_at + d])
            };
            // A NaN score (a NaN in K) makes its chunk's m NaN; keep it
            // (`f32::max` would drop it) so the row is NaN, as in the reference.
            let max = (0..plan.chunks)
                .map(|c| row(c).0)
                .fold(f32::NEG_INFINITY, |a, m| if a.is_nan() || m.is_nan() { f32::NAN } else { a.max(m) });
            if max == f32::NEG_INFINITY {
                dst.fill(0);
                continue;
            }
            acc.fill(0.0);
            let mut total = 0f32;
            for c in 0..plan.chunks {
                let (m, l, part) = row(c);
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let w = (m - max).exp();
                total += w * l;
                for (a, &x) in acc.iter_mut().zip(part) {
                    *a += w * x;
                }
            }
            let inv = 1.0 / total;
            for a in acc.iter_mut() {
                *a *= inv;
            }
            store_row(hooks.dtype, &acc, dst);
        }
    }
}

/// Round `values` once to `dtype` into `output`'s bytes.
fn store_row(dtype: DType, values: &[f32], output: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (dst, v) in output.chunks_exact_mut(4).zip(values) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::BF16 => {
            for (dst, v) in output.chunks_exact_mut(2).zip(values) {
                dst.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        DType::F16 => {
            for (dst, v) in output.chunks_exact_mut(2).zip(values) {
                dst.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        _ => unreachable!("the spec's dtype is a compute float"),
    }
}

#[cfg(test)]
mod tests {
    use kvjit_core::CacheElement;

    use super::*;
    use crate::AttentionConfig;
    use kvjit_core::{Backend, DType, KvCacheParams};

    /// The launch scratch is reused while large enough, replaced when not,
    /// dropped past the retention cap, and a nested use gets its own.
    #[test]
    fn launch_scratch_is_reused_within_its_cap() {
        let address = |floats: usize| with_scratch(floats, |s| (s.as_ptr() as usize, s.len())).unwrap();
        let (first, len) = address(1000);
        assert_eq!(len, 1000);
        assert_eq!(address(10).0, first, "a smaller request reuses the buffer");
        let (grown, len) = address(1 << 20);
        assert_eq!(len, 1 << 20);
        assert_eq!(address(1000).0, grown, "the grown buffer is kept");
        poison_scratch();
        with_scratch(4, |s| assert!(s.iter().all(|v| v.is_nan()), "poisoned: {s:?}")).unwrap();
        with_scratch(5, |outer| {
            outer.fill(1.0);
            let inner = with_scratch(5, |inner| {
                inner.fill(2.0);
                inner.as_ptr() as usize
            })
            .unwrap();
            assert_ne!(inner, outer.as_ptr() as usize, "a nested use has its own memory");
            assert!(outer.iter().all(|&v| v == 1.0));
        })
        .unwrap();
        let huge = RETAINED_SCRATCH_BYTES / 4 + 1;
        assert_eq!(address(huge).1, huge);
        SCRATCH.with(|cell| assert!(cell.borrow().is_none(), "scratch past the cap is freed"));
    }

    /// A causal decode spec on the Cranelift tier (plans do not depend on
    /// the tier): `num_heads` query heads on `num_kv_heads` of 64, page 16.
    fn plan_spec(dtype: DType, num_heads: usize, num_kv_heads: usize) -> MhaSpec {
        MhaSpec {
            backend: Backend::Cpu(CodeTier::Cranelift),
            dtype,
            cache: KvCacheParams {
                element: CacheElement::new(dtype, dtype.is_quantized().then_some(64)).unwrap(),
                num_layers: 1,
                page_size: 16,
                num_kv_heads,
                head_size: 64,
            },
            num_heads,
            mask: Mask::Causal,
            window: None,
            scale: 0.125,
            step: kvjit_op::checks::StepDims::ANY,
        }
    }

    /// The shape of a call of `spec` with `seq` query positions per
    /// sequence, each sequence reading its range of keys.
    fn call_shape(spec: &MhaSpec, seq: usize, key_ranges: Vec<(usize, usize)>) -> CallShape {
        CallShape {
            batch: key_ranges.len(),
            seq,
            num_heads: spec.num_heads,
            num_kv_heads: spec.cache.num_kv_heads,
            head_size: spec.cache.head_size,
            layer: 0,
            key_ranges,
        }
    }

    /// A decode step near u32::MAX tokens into a sequence with a 4096-key
    /// window, beside an idle one: the key-offset table (B·stride i64) and
    /// the chunks cover the window's keys, not its end position.
    #[test]
    fn the_key_table_is_sized_by_the_window_not_the_position() {
        let window = 4096;
        let spec = MhaSpec { window: Some(window), ..plan_spec(DType::BF16, 8, 2) };
        let cache_length = u32::MAX as usize - 10;
        let (lo, hi) = AttentionConfig::from(&spec).key_range(cache_length, 1, 0);
        assert_eq!(hi - lo, window);
        let plan = Plan::new(&spec, &call_shape(&spec, 1, vec![(lo, hi), (0, 0)]));
        assert!(plan.chunks * plan.chunk >= window, "{plan:?}: the chunks cover the window");
        assert!(plan.stride <= window + plan.chunk + KB, "{plan:?}: a table row of the window's keys");
        assert!(plan.items <= 2 * TARGET_ITEMS, "{plan:?}");
    }

    /// Decode items run as one contiguous range per thread when every
    /// sequence reads as many keys; sequences of different lengths, and
    /// prefill's causal query blocks, are balanced range by range.
    #[test]
    fn decodes_of_equal_sequences_launch_one_range_per_thread() {
        let spec = plan_spec(DType::F32, 8, 2);
        let equal = |seq: usize, key_ranges: Vec<(usize, usize)>| {
            let shape = call_shape(&spec, seq, key_ranges);
            items_of_equal_cost(&shape, &Plan::new(&spec, &shape))
        };
        assert!(equal(1, vec![(0, 700)]));
        assert!(equal(1, vec![(0, 700), (100, 800), (5, 705)]), "equal spans, different starts");
        assert!(!equal(1, vec![(0, 700), (0, 300)]));
        assert!(!equal(64, vec![(0, 64)]), "a causal prefill's query blocks differ");
    }

    /// A short decode is cut into MIN_ITEMS items when its keys allow
    /// chunks of a block (and into blocks when they do not); a long one
    /// keeps chunks of at least MIN_CHUNK; a batch that makes enough items
    /// is not cut.
    #[test]
    fn short_decodes_are_cut_into_enough_items() {
        let spec = plan_spec(DType::F32, 9, 3);
        let plan = |keys: &[usize]| Plan::new(&spec, &call_shape(&spec, 1, keys.iter().map(|&k| (0, k)).collect()));
        // Below MIN_ITEMS·MIN_CHUNK keys: MIN_ITEMS items or a few more,
        // of chunks of whole blocks below MIN_CHUNK.
        for keys in [2 * KB, 100, 128, 200, MIN_ITEMS * MIN_CHUNK - 1] {
            let p = plan(&[keys]);
            assert!((MIN_ITEMS..=2 * MIN_ITEMS).contains(&p.items), "{keys} keys: {p:?}");
            assert!(p.chunk.is_multiple_of(KB) && p.chunk < MIN_CHUNK, "{keys} keys: {p:?}");
            assert!(p.chunks * p.chunk >= keys && (p.chunks - 1) * p.chunk < keys, "{keys} keys: {p:?}");
        }
        for keys in [1, KB, KB + 1] {
            let p = plan(&[keys]);
            assert_eq!((p.chunk, p.chunks), (KB, keys.div_ceil(KB)), "{keys} keys: one block a chunk");
        }
        for keys in [MIN_ITEMS * MIN_CHUNK, 1000, 4096] {
            let p = plan(&[keys]);
            assert!(p.chunk >= MIN_CHUNK && p.items >= MIN_ITEMS, "{keys} keys: {p:?}");
        }
        // An FP8 cache's chunks are twice as long (the same bytes).
        let fp8 = plan_spec(DType::F8E4M3, 9, 3);
        let p = Plan::new(&fp8, &call_shape(&fp8, 1, vec![(0, 4096)]));
        assert_eq!((p.chunk, p.chunks), (2 * MIN_CHUNK, 4096 / (2 * MIN_CHUNK)), "{p:?}");
        for keys in [100, 128] {
            let p = plan(&[keys; MIN_ITEMS]);
            assert_eq!((p.chunks, p.items), (1, MIN_ITEMS), "a batch of {MIN_ITEMS} at {keys} keys: one chunk each");
        }
        let p = plan(&[100; 4]);
        assert!((MIN_ITEMS..=2 * MIN_ITEMS).contains(&p.items), "4 sequences of 100 keys: {p:?}");
        // A 100-token prefill: its 13 query blocks are enough items.
        let p = Plan::new(&spec, &call_shape(&spec, 100, vec![(0, 100)]));
        assert_eq!((p.query_blocks, p.chunks), (13, 1), "{p:?}");
    }
}
