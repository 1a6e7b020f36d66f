//! The 256-bit tier's prefill attention as GEMM tiles (a child of the
//! decode kernel's `x86` module: its `exp8` and state layout).
//!
//! One call serves the [`DecodeKernel`] ABI for a block of query rows (a
//! query block's positions × the GQA group, per KV head) over a run of
//! keys, leaving the same `(m, l, acc)` tiles, so the op's driver, split
//! and merge are unchanged. Where the decode micro-kernel scores one row
//! tile of 4 against 2 keys at a time through horizontal sums, and widens
//! every K and V vector again for each row tile, this kernel multiplies
//! whole blocks through register tiles of 6 × 16:
//!
//! ```text
//! per KV head: qᵀ [D × R8] packed once per call (rows padded to 8 with zeros)
//! per block of PB = 64 keys (K and V rows widened once into f32 rows [PB × D],
//! the next block's prefetched):
//!   Sᵀ[j][r]  = Σ_d K[j][d] · qᵀ[d][r]     6 keys × 16 rows a tile (12 accumulators, K broadcast;
//!                                          a last panel of 8 rows: 6 × 8)
//!   online softmax across rows, 8 rows a vector (a row's keys outside its
//!   [lo, hi) set to −inf, no horizontal sums): m, l, α; Pᵀ in place of Sᵀ
//!   acc[r] ·= α_r (rows whose max moved)
//!   acc[r][d] += Σ_j Pᵀ[j][r] · V[j][d]   6 rows × 16 of D a tile (P broadcast)
//! ```
//!
//! `acc` lives in a row-major copy for the call and goes back to the
//! tiles at its end. f32, bf16, f16 and FP8 (E4M3: codes widened and
//! times their g-block's scale once per block, g a multiple of 8) caches
//! with D a multiple of 16; the op keeps the decode kernel for other D.

use std::arch::x86_64::*;

use super::super::decode_supported;
use super::{DecodeKernel, E4M3_UNIT, E4m3, Elem, STATE_ACC, STATE_HI, STATE_LO, STATE_TILE_ROWS, exp8};
use crate::microkernel::x86::{Bf16, F16, F32};

/// Keys per block: the P·V tiles' depth (longer blocks spread each tile
/// call's fixed cost over more FMAs).
pub(super) const PREFILL_BLOCK_KEYS: usize = 64;
/// Rows of a register tile (12 accumulators of the 16 ymm registers).
const TILE_ROWS: usize = 6;
/// Columns of a register tile: two vectors.
const TILE_COLUMNS: usize = 16;

/// `c[i·c_row + j] += Σ_{kk<k} x[i·x_row + kk·x_k] · w[kk·w_k + j]` for
/// `i < MR`, `j < 8·NV` (NV: 1 or 2 vectors of columns).
///
/// # Safety
/// Every address the sums name is readable (and `c`'s writable), for
/// `i < MR`, `kk < k`, `j < 16`; AVX2, FMA.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const MR: usize, const NV: usize>(
    x: *const f32,
    (x_row, x_k): (usize, usize),
    (w, w_k): (*const f32, usize),
    k: usize,
    (c, c_row): (*mut f32, usize),
) {
    let mut acc = [[_mm256_setzero_ps(); NV]; MR];
    for kk in 0..k {
        // SAFETY: row kk of w's 8·NV columns and x[i, kk] (the caller's).
        unsafe {
            let wp = w.add(kk * w_k);
            let wv: [__m256; NV] = std::array::from_fn(|v| _mm256_loadu_ps(wp.add(8 * v)));
            for (i, row) in acc.iter_mut().enumerate() {
                let xb = _mm256_broadcast_ss(&*x.add(i * x_row + kk * x_k));
                for (a, w) in row.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xb, *w, *a);
                }
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (v, a) in row.iter().enumerate() {
            // SAFETY: c's row i, 8·NV f32 (the caller's).
            unsafe {
                let at = c.add(i * c_row + 8 * v);
                _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), *a));
            }
        }
    }
}

/// [`tile`] for `rows` ≤ [`TILE_ROWS`] rows (the remainder of a range).
///
/// # Safety
/// As [`tile`]'s for `rows` rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn partial_tile(
    rows: usize,
    x: *const f32,
    xs: (usize, usize),
    w: (*const f32, usize),
    k: usize,
    c: (*mut f32, usize),
) {
    // SAFETY: the caller's, for `rows` rows.
    unsafe {
        match rows {
            6 => tile::<6, 2>(x, xs, w, k, c),
            5 => tile::<5, 2>(x, xs, w, k, c),
            4 => tile::<4, 2>(x, xs, w, k, c),
            3 => tile::<3, 2>(x, xs, w, k, c),
            2 => tile::<2, 2>(x, xs, w, k, c),
            1 => tile::<1, 2>(x, xs, w, k, c),
            _ => {}
        }
    }
}

/// Where a call's keys are: the [`DecodeKernel`] arguments that locate
/// their rows (and an FP8 cache's scales, g elements a scale).
#[derive(Clone, Copy)]
struct Cache {
    blocks: *const u8,
    key_offsets: *const i64,
    kv_stride: usize,
    scales: *const f32,
    g: usize,
}

/// A call's state tiles per KV head, their rows (`rows` rounded up to
/// whole tiles of 4), and those rows rounded up to 8 (qᵀ's and Sᵀ's width).
fn padded_rows(rows: usize) -> (usize, usize, usize) {
    let head_tiles = rows.div_ceil(STATE_TILE_ROWS);
    let tile_rows = head_tiles * STATE_TILE_ROWS;
    (head_tiles, tile_rows, tile_rows.next_multiple_of(8))
}

/// A thread's scratch, f32, kept for its next call: qᵀ, K and V rows of a
/// block, Sᵀ/Pᵀ, `acc`. A call sizes it ([`Scratch::fit`]) and writes
/// every part before reading it, so it needs no clearing in between.
#[derive(Default)]
struct Scratch {
    /// `[D][R8]`.
    q_t: Vec<f32>,
    /// `[PB][D]` each (keys past a block's count zero).
    k: Vec<f32>,
    v: Vec<f32>,
    /// `[PB][R8]`: the scores, then the probabilities.
    s_t: Vec<f32>,
    /// `[rows of the tiles][D]`.
    acc: Vec<f32>,
    /// Per row (R8; rows past the tiles' masked): the running max and
    /// sum, the key range, a block's rescale α.
    m: Vec<f32>,
    l: Vec<f32>,
    lo: Vec<i32>,
    hi: Vec<i32>,
    alpha: Vec<f32>,
}

impl Scratch {
    /// At least the sizes a call with head size `d` and these padded rows
    /// uses.
    fn fit(&mut self, d: usize, tile_rows: usize, r8: usize) {
        let keys = PREFILL_BLOCK_KEYS.next_multiple_of(TILE_ROWS);
        for (part, len) in [
            (&mut self.q_t, d * r8),
            (&mut self.k, keys * d),
            (&mut self.v, PREFILL_BLOCK_KEYS * d),
            (&mut self.s_t, keys * r8),
            (&mut self.acc, tile_rows * d),
            (&mut self.m, r8),
            (&mut self.l, r8),
            (&mut self.alpha, r8),
        ] {
            if part.len() < len {
                part.resize(len, 0.0);
            }
        }
        for part in [&mut self.lo, &mut self.hi] {
            if part.len() < r8 {
                part.resize(r8, 0);
            }
        }
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// The prefill kernel (the [`DecodeKernel`] ABI; `ahead` unused: a call's
/// last block prefetches the next head's first, not the next chunk) for
/// elements `E` (FP8: each widened vector of 8 times its g-block's scale,
/// once per block for all the rows).
///
/// # Safety
/// As [`DecodeKernel`]'s contract, with `E` the cache's element type, D a
/// multiple of 16 (and an FP8 cache's g a multiple of 8 dividing D); AVX2,
/// FMA, F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe extern "C" fn prefill<E: Elem>(
    q: *const f32,
    blocks: *const u8,
    key_offsets: *const i64,
    keys: usize,
    _ahead: usize,
    first_key: i64,
    heads: usize,
    scales: *const f32,
    state: *mut f32,
    rows: usize,
    head_size: usize,
    kv_stride: usize,
    granularity: usize,
    tile_floats: usize,
) {
    let d = head_size;
    let (head_tiles, tile_rows, r8) = padded_rows(rows);
    SCRATCH.with_borrow_mut(|scratch| {
        scratch.fit(d, tile_rows, r8);
        for h in 0..heads {
            // SAFETY: head h's q rows and state tiles (the contract); its
            // K/V rows at key_offsets[j] + h·D (+ kv_stride) for j < keys.
            unsafe {
                prefill_head::<E>(
                    q.add(h * tile_rows * d),
                    state.add(h * head_tiles * tile_floats),
                    Cache { blocks, key_offsets, kv_stride, scales, g: granularity.max(1) },
                    (h * d, (h + 1 < heads).then_some((h + 1) * d)),
                    (keys, first_key),
                    (rows, d, tile_floats),
                    scratch,
                )
            };
        }
    });
}

/// One KV head of [`prefill`].
///
/// # Safety
/// `q` holds the head's `ceil(rows/4)·4` rows of D f32, `state` its tiles
/// of `tile_floats`; the cache rows (and an FP8 cache's scales: that of
/// element offset `o` at `scales[o / g]`) as [`DecodeKernel`] promises;
/// AVX2, FMA, F16C. `next_head` (the next KV head's row offset, if any) is
/// only prefetched from the last block on.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefill_head<E: Elem>(
    q: *const f32,
    state: *mut f32,
    Cache { blocks, key_offsets, kv_stride, scales, g }: Cache,
    (head, next_head): (usize, Option<usize>),
    (keys, first_key): (usize, i64),
    (rows, d, tile_floats): (usize, usize, usize),
    scratch: &mut Scratch,
) {
    let (_, tile_rows, r8) = padded_rows(rows);
    let Scratch { q_t, k: k_rows, v: v_rows, s_t, acc, m, l, lo, hi, alpha } = scratch;
    // Row r of the tiles: tile r/4, lane r%4 of m (l 4 on, lo and hi at
    // STATE_LO and STATE_HI words on), its acc row D·(r%4) into the
    // tile's acc.
    let lane = |r: usize| (r / STATE_TILE_ROWS) * tile_floats + r % STATE_TILE_ROWS;
    let acc_row = |r: usize| (r / STATE_TILE_ROWS) * tile_floats + STATE_ACC + (r % STATE_TILE_ROWS) * d;
    // qᵀ (rows past the tiles' zero), acc, m, l, lo, hi per row (the
    // scratch may be longer than this call's sizes: only r8 columns of qᵀ
    // and rows of the per-row arrays are read).
    q_t[..d * r8].fill(0.0);
    m[..r8].fill(f32::NEG_INFINITY);
    l[..r8].fill(0.0);
    lo[..r8].fill(0);
    hi[..r8].fill(0);
    for r in 0..tile_rows {
        // SAFETY: row r < ceil(rows/4)·4 of q; its tile's m, l, lo, hi
        // and acc row (state holds the head's tiles).
        unsafe {
            for (dd, &value) in std::slice::from_raw_parts(q.add(r * d), d).iter().enumerate() {
                q_t[dd * r8 + r] = value;
            }
            let t = state.add(lane(r));
            (m[r], l[r]) = (*t, *t.add(4));
            let words = state.cast::<i32>().add(lane(r));
            (lo[r], hi[r]) = (*words.add(STATE_LO), *words.add(STATE_HI));
            let row = state.add(acc_row(r));
            acc[r * d..(r + 1) * d].copy_from_slice(std::slice::from_raw_parts(row, d));
        }
    }
    let pb = PREFILL_BLOCK_KEYS;
    let mut p0 = 0;
    while p0 < keys {
        let n = (keys - p0).min(pb);
        // The block's K and V rows widened (keys past n zero: their
        // scores are masked, their probabilities 0).
        for j in 0..pb.next_multiple_of(TILE_ROWS) {
            let (k_row, v_row) = (&mut k_rows[j * d..(j + 1) * d], v_rows.get_mut(j * d..(j + 1) * d));
            if j >= n {
                k_row.fill(0.0);
                if let Some(v_row) = v_row {
                    v_row.fill(0.0);
                }
                continue;
            }
            // SAFETY: key p0 + j < keys: its offset, its K and V rows of
            // this head (D elements each) in the cache and, FP8, their
            // scales (the contract; g divides every offset's 8-run).
            unsafe {
                let at = (*key_offsets.add(p0 + j)) as usize + head;
                let v_at = at + kv_stride;
                let v_row = v_row.expect("j < n ≤ PB");
                // The same key of the next block (from the last block on,
                // the next head's first block), into L2 while this block
                // computes (a prefetch never faults; an offset is read only
                // for a key of the call).
                let next = match (p0 + pb + j < keys, next_head) {
                    (true, _) => Some((*key_offsets.add(p0 + pb + j)) as usize + head),
                    (false, Some(next_head)) => Some((*key_offsets.add(j)) as usize + next_head),
                    (false, None) => None,
                };
                if let Some(next) = next {
                    for line in (0..d * E::BYTES).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T1>(blocks.wrapping_add(next * E::BYTES + line).cast());
                        _mm_prefetch::<_MM_HINT_T1>(blocks.wrapping_add((next + kv_stride) * E::BYTES + line).cast());
                    }
                }
                for dd in (0..d).step_by(8) {
                    let mut k = E::load8(blocks.add((at + dd) * E::BYTES));
                    let mut v = E::load8(blocks.add((v_at + dd) * E::BYTES));
                    if E::SCALED {
                        let unit = _mm256_set1_ps(E4M3_UNIT);
                        k = _mm256_mul_ps(k, _mm256_mul_ps(_mm256_broadcast_ss(&*scales.add((at + dd) / g)), unit));
                        v = _mm256_mul_ps(v, _mm256_mul_ps(_mm256_broadcast_ss(&*scales.add((v_at + dd) / g)), unit));
                    }
                    _mm256_storeu_ps(k_row.as_mut_ptr().add(dd), k);
                    _mm256_storeu_ps(v_row.as_mut_ptr().add(dd), v);
                }
            }
        }
        // Sᵀ = K · qᵀ.
        let key_tiles = n.next_multiple_of(TILE_ROWS);
        s_t[..key_tiles * r8].fill(0.0);
        for j0 in (0..key_tiles).step_by(TILE_ROWS) {
            for c0 in (0..r8).step_by(TILE_COLUMNS) {
                let (x, w) = (k_rows[j0 * d..].as_ptr(), q_t[c0..].as_ptr());
                let c = s_t[j0 * r8 + c0..].as_mut_ptr();
                // SAFETY: K rows j0..j0 + 6 ≤ key_tiles of D; qᵀ columns
                // c0..c0 + 16 (or the last 8) ≤ R8 of D rows; Sᵀ rows j0..
                // of R8.
                unsafe {
                    match r8 - c0 {
                        8 => tile::<TILE_ROWS, 1>(x, (d, 1), (w, r8), d, (c, r8)),
                        _ => tile::<TILE_ROWS, 2>(x, (d, 1), (w, r8), d, (c, r8)),
                    }
                };
            }
        }
        // The online softmax, 8 rows a vector.
        let pos0 = first_key + p0 as i64;
        for r0 in (0..r8).step_by(8) {
            // SAFETY: 8 lanes of each per-row array (r8 a multiple of 8)
            // and of Sᵀ rows j < n.
            unsafe {
                let lo_v = _mm256_loadu_si256(lo.as_ptr().add(r0).cast());
                let hi_v = _mm256_loadu_si256(hi.as_ptr().add(r0).cast());
                let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
                // Whether every row of the vector reads every key of the
                // block (no mask to apply: most blocks of a long prefill).
                let first = _mm256_set1_epi32(pos0 as i32);
                let last = _mm256_set1_epi32((pos0 + n as i64 - 1) as i32);
                let outside = _mm256_or_si256(_mm256_cmpgt_epi32(lo_v, first), _mm256_cmpgt_epi32(last, hi_v));
                let whole = _mm256_testz_si256(outside, outside) != 0
                    && _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(last, hi_v))) == 0;
                // Four running maxima and NaN flags (independent chains).
                let mut block_max = [ninf; 4];
                let mut nan = [_mm256_setzero_ps(); 4];
                for j in 0..n {
                    let at = s_t.as_mut_ptr().add(j * r8 + r0);
                    let mut s = _mm256_loadu_ps(at);
                    if !whole {
                        let pos = _mm256_set1_epi32((pos0 + j as i64) as i32);
                        // lo ≤ pos < hi: not (lo > pos), and hi > pos.
                        let inside = _mm256_andnot_si256(_mm256_cmpgt_epi32(lo_v, pos), _mm256_cmpgt_epi32(hi_v, pos));
                        s = _mm256_blendv_ps(ninf, s, _mm256_castsi256_ps(inside));
                        _mm256_storeu_ps(at, s);
                    }
                    block_max[j % 4] = _mm256_max_ps(block_max[j % 4], s);
                    nan[j % 4] = _mm256_or_ps(nan[j % 4], _mm256_cmp_ps::<_CMP_UNORD_Q>(s, s));
                }
                let block_max =
                    _mm256_max_ps(_mm256_max_ps(block_max[0], block_max[1]), _mm256_max_ps(block_max[2], block_max[3]));
                let nan = _mm256_or_ps(_mm256_or_ps(nan[0], nan[1]), _mm256_or_ps(nan[2], nan[3]));
                let m_old = _mm256_loadu_ps(m.as_ptr().add(r0));
                // NaN-propagating max of the old max and the block's.
                let nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(m_old, m_old));
                let m_new = _mm256_blendv_ps(_mm256_max_ps(m_old, block_max), _mm256_set1_ps(f32::NAN), nan);
                // A row with no key yet subtracts 0 (−inf − −inf never occurs).
                let none = _mm256_cmp_ps::<_CMP_EQ_OQ>(m_new, ninf);
                let m_use = _mm256_blendv_ps(m_new, _mm256_setzero_ps(), none);
                let a = exp8(_mm256_sub_ps(m_old, m_use));
                let mut sums = [_mm256_setzero_ps(); 4];
                for j in 0..n {
                    let at = s_t.as_mut_ptr().add(j * r8 + r0);
                    let p = exp8(_mm256_sub_ps(_mm256_loadu_ps(at), m_use));
                    _mm256_storeu_ps(at, p);
                    sums[j % 4] = _mm256_add_ps(sums[j % 4], p);
                }
                let sum = _mm256_add_ps(_mm256_add_ps(sums[0], sums[1]), _mm256_add_ps(sums[2], sums[3]));
                let l_at = l.as_mut_ptr().add(r0);
                _mm256_storeu_ps(l_at, _mm256_fmadd_ps(a, _mm256_loadu_ps(l_at), sum));
                _mm256_storeu_ps(m.as_mut_ptr().add(r0), m_new);
                _mm256_storeu_ps(alpha.as_mut_ptr().add(r0), a);
            }
        }
        for (r, &a) in alpha.iter().enumerate().take(rows) {
            if a != 1.0 {
                acc[r * d..(r + 1) * d].iter_mut().for_each(|x| *x *= a);
            }
        }
        // acc += P · V, rows of the query block (the tiles' padded rows
        // have P = 0), in tiles of as even a height as 6 allows (32 rows:
        // 6, 6, 5, 5, 5, 5, not a 2-row tile of 4 accumulator chains).
        let row_tiles = rows.div_ceil(TILE_ROWS);
        for t in 0..row_tiles {
            let (r0, r1) = (rows * t / row_tiles, rows * (t + 1) / row_tiles);
            let mr = r1 - r0;
            for d0 in (0..d).step_by(TILE_COLUMNS) {
                // SAFETY: Pᵀ columns r0..r0 + mr of rows j < n (R8 wide);
                // V rows j < n, columns d0..d0 + 16 ≤ D; acc rows r0.. of D.
                unsafe {
                    partial_tile(
                        mr,
                        s_t.as_ptr().add(r0),
                        (1, r8),
                        (v_rows.as_ptr().add(d0), d),
                        n,
                        (acc.as_mut_ptr().add(r0 * d + d0), d),
                    )
                };
            }
        }
        p0 += pb;
    }
    for r in 0..tile_rows {
        // SAFETY: as on entry.
        unsafe {
            let t = state.add(lane(r));
            (*t, *t.add(4)) = (m[r], l[r]);
            let row = state.add(acc_row(r));
            std::slice::from_raw_parts_mut(row, d).copy_from_slice(&acc[r * d..(r + 1) * d]);
        }
    }
}

/// The prefill kernel for a cache the decode kernel serves
/// ([`decode_supported`]: f32, bf16, f16, or f8e4m3 with g a multiple of 8
/// dividing D) with head size `head_size` a multiple of 16; `None`
/// otherwise.
pub(crate) fn kernel(cache: kvjit_core::DType, head_size: usize, granularity: Option<usize>) -> Option<DecodeKernel> {
    use kvjit_core::DType;
    if !head_size.is_multiple_of(TILE_COLUMNS) || !decode_supported(cache, head_size, granularity) {
        return None;
    }
    Some(match cache {
        DType::F32 => prefill::<F32>,
        DType::BF16 => prefill::<Bf16>,
        DType::F16 => prefill::<F16>,
        DType::F8E4M3 => prefill::<E4m3>,
        _ => return None,
    })
}
