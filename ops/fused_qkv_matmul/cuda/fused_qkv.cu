// CUDA kernels of the fused QKV matmul with paged KV-cache write
// (MAX's generic_fused_qkv_matmul_kv_cache_bshd_paged).
//
// One kernel computes C = X·Wᵀ for X [M, K] (M = B·S rows) and W [N, K]
// (N = q_dim + 2·kv_dim) and stores C straight to its destinations, with no
// [M, N] intermediate:
//   column n <  q_dim:  out[r, n]                                   (every row)
//   column n >= q_dim:  blocks[row_off[r] + kv·kv_stride + j]       (row_off[r] >= 0 only)
// where kv = 0 (K) or 1 (V), j = n - q_dim - kv·kv_dim = h·D + d, and
// row_off[r] is the element offset of blocks[page, 0, layer, slot, 0, 0] for
// row r (-1 for padded rows). The host computes row_off with the same pass
// that validates the call (`cache_row_offsets` in call.rs), so every store
// here lands inside the buffers and no two rows share a slot; the kernels
// index memory without checks. kv_stride = L·page_size·Hkv·D is the distance
// from a slot's K to its V.
//
// Requirements checked by the host before any launch (cuda_kernel.rs):
// K % 8 == 0 (rows of X and W are 16-byte aligned, read as 16-byte vectors),
// every dimension fits in an int, and every buffer is a whole allocation
// (256-byte aligned). Paired stores are used only when q_dim and kv_dim are
// even (a uniform run-time switch).
//
// Schedules (the host picks by M; generic kernels pick per call):
//   decode  (M <= DEC_MAX_M): streams W exactly once. bf16/f16: one warp per
//           16 columns x (K split over 8 warps), mma.sync m16n8k16 with X as
//           the 16-row A operand loaded straight from global memory, split-K
//           reduction in shared memory. f32: SIMT, 4 columns per block, K
//           split over the 256 threads, warp-shuffle + shared reduction.
//   prefill (any M): bf16/f16: 128x128x32 tiles, 8 warps (2 x 4, 64x32 each),
//           3-stage cp.async pipeline into XOR-swizzled shared memory,
//           ldmatrix + mma.sync m16n8k16 (f32 accumulate). f32: SIMT 64x64x16
//           tiles, 4x4 outputs per thread.
// All arithmetic accumulates in f32; stores round to nearest even.
//
// FP8 E4M3 cache (variants `..._kvf8e4m3`: both schedules, every compute
// dtype). `blocks` holds one-byte codes and `scales` one f32 per g values of
// a token's head, [P, 2, L, page_size, Hkv, D / g]: the blocks' layout with D
// replaced by D / g, so a g-block whose first element is at blocks offset o
// (a multiple of g) has its scale at o / g. For every valid row and every
// g-block x of its K and V columns: scale = max|x| / 448 over the finite
// elements (±inf and NaN never set it; 0 when no finite one is nonzero),
// code = e4m3(x / scale), or e4m3(x · 0) for a finite x when scale == 0,
// rounded to nearest even and saturated to ±448 (so ±inf stores ±448, also
// in a block of scale 0), NaN kept: kvjit_core::fp8::quantize_block, bit
// for bit. g is a run-time argument, like D: it only bounds the
// epilogue's loops, and a template parameter would multiply the PTX per g
// and refuse every g not compiled in.
//
// A g-block may span the column tiles of several blocks (decode tiles are 4
// or 16 columns wide; g is 128 by default, up to D), so the FP8 epilogue
// runs in two steps inside the one launch (Fp8Epilogue):
//   1. each block stores the K/V columns of valid rows as f32 into
//      `scratch` [M, 2·kv_dim] instead of the cache (Q goes to `out` as
//      always);
//   2. after a __threadfence and a barrier, it counts itself in with one
//      atomicAdd per g-block its tile touches, on `counters` [row tiles,
//      2·kv_dim / g]. The block that completes a count (every column tile
//      covering that g-block has stored its part) resets the counter to 0
//      and quantizes the g-block for every valid row of its row tile,
//      reading the f32 values back through L2 (__ldcg): a group of up to 32
//      lanes per (row, g-block), a shuffle max-reduction for the absmax,
//      then one code per lane and element, and the scale.
// No block ever waits for another, so any launch order or residency works.
// `counters` must be zero when a launch starts: the host zeroes them on
// the stream before every launch (ready_counters in cuda_kernel.rs), as a
// launch that failed part-way may leave counts behind. A complete launch
// also leaves them zero (the block completing a count resets it), which the
// emulator checks: every part of every g-block was counted exactly once.
// The convert is cvt.rn.satfinite.e4m3x2.f32 on sm_90 and e4m3_sw, a
// software convert bit-identical to kvjit_core::fp8::e4m3_from_f32, on
// sm_80. NaN codes may differ from the CPU reference's in the sign bit
// only: NVIDIA GPU arithmetic returns the canonical NaN 0x7fffffff whatever
// its inputs, so the GEMM, x / scale and x · 0 hand the convert a positive
// NaN (code 0x7f) where the CPU's arithmetic may make a negative one (0xff);
// both decode as NaN. The hardware convert's own NaN code (PTX says only
// "NaN") is checked on a GPU by tests/cuda.rs, which also checks both
// converts bit for bit on every other input.
//
// Kernel names are generated below by KVJIT_VARIANTS and must equal
// `variant_key(..).symbol()` in cuda_kernel.rs (a unit test checks every
// name the Rust side can ask for against the PTX).
//
// The hardware primitives (loads, cp.async, ldmatrix, mma, shuffles,
// conversions) live in one block guarded by KVJIT_EMULATE so that
// emulate/emulate.cpp can run these exact kernel bodies on the CPU.

#ifndef KVJIT_EMULATE
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 kv_bf16;
typedef __half kv_f16;

namespace kvjit {

__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
// Weight rows in the decode schedule are read exactly once: stream them.
__device__ __forceinline__ uint4 ldcs16(const void* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ void sync_block() { __syncthreads(); }

__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

// 16-byte global -> shared copy; zero-fills the destination when !pred (no
// byte is read then, but `src` must still be a valid address expression).
__device__ __forceinline__ void cp_async16(void* smem, const void* src, bool pred) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int size = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices; lane i gives the address of row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// d += a·b for one m16n8k16 tile (A row-major 16x16, B "col" 16x8, f32 accumulators).
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <>
__device__ __forceinline__ void mma16816<kv_bf16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma16816<kv_f16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Round-to-nearest-even stores.
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ kv_bf16 from_f32<kv_bf16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ kv_f16 from_f32<kv_f16>(float v) { return __float2half_rn(v); }

// Two adjacent elements at an address aligned to their pair.
__device__ __forceinline__ void store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void store2(kv_bf16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store2(kv_f16* p, float a, float b) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}

// The four f32 of a 16-byte chunk.
__device__ __forceinline__ void as_f32x4(const uint4& raw, float (&f)[4]) {
    f[0] = __uint_as_float(raw.x);
    f[1] = __uint_as_float(raw.y);
    f[2] = __uint_as_float(raw.z);
    f[3] = __uint_as_float(raw.w);
}

// FP8 epilogue primitives.
__device__ __forceinline__ unsigned f32_bits(float v) { return __float_as_uint(v); }
// A load through L2 only (not the non-coherent L1): sees what other blocks
// stored before their __threadfence.
__device__ __forceinline__ float ldcg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ void fence_gpu() { __threadfence(); }
__device__ __forceinline__ unsigned atomic_add(unsigned* p, unsigned v) { return atomicAdd(p, v); }

__device__ __forceinline__ unsigned e4m3_sw(float v);  // below, shared with the emulator

// f32 -> E4M3 code. sm_90: the hardware convert (round to nearest even,
// saturate to ±448, NaN to NaN); it packs its first source into the high
// byte, so v goes second and lands in the low byte. Its NaN code is not
// documented beyond "NaN"; the GPU test e4m3_converts_on_the_gpu_match_the_reference
// (tests/cuda.rs) checks every other input bit for bit and reports it.
__device__ __forceinline__ unsigned to_e4m3(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(0.f), "f"(v));
    return r & 0xffu;
#else
    return e4m3_sw(v);
#endif
}

}  // namespace kvjit
#endif  // KVJIT_EMULATE

namespace kvjit {

constexpr int THREADS = 256;  // every kernel runs 256-thread blocks
constexpr int WARPS = THREADS / 32;
constexpr int DEC_MAX_M = 16;    // decode serves M <= 16 (one m16 tile)
constexpr int DEC_MMA_COLS = 16;  // bf16/f16 decode: columns per block (two n8 tiles)
constexpr int DEC_SIMT_COLS = 4;  // f32 decode: columns per block
constexpr int PF_BM = 128, PF_BN = 128, PF_BK = 32, PF_STAGES = 3;  // bf16/f16 prefill tile
constexpr int PS_BM = 64, PS_BN = 64, PS_BK = 16;                   // f32 prefill tile

constexpr float E4M3_MAX = 448.f;         // largest finite E4M3 value
constexpr float F32_MAX = 3.40282347e38f;  // largest finite f32
constexpr int FP8_REGS = 8;               // FP8 epilogue: values per lane kept in registers

// What a value adds to its g-block's absmax: |v| if v is finite; 0 for
// ±inf and NaN (the comparison is false for both), which never set a scale.
__device__ __forceinline__ float finite_magnitude(float v) {
    const float a = fabsf(v);
    return a <= F32_MAX ? a : 0.f;
}

// f32 -> E4M3 code (OCP E4M3FN), bit for bit kvjit_core::fp8::e4m3_from_f32
// by another route: round to nearest, ties to even; |v| >= 448 (and ±inf)
// saturates to ±448 (0x7e); NaN -> 0x7f with its sign; -0 -> 0x80.
__device__ __forceinline__ unsigned e4m3_sw(float v) {
    const unsigned u = f32_bits(v);
    const unsigned sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;   // NaN
    if (a >= 0x43e00000u) return sign | 0x7eu;  // >= 448 = 1.75 · 2^8
    const int e = static_cast<int>(a >> 23);    // biased f32 exponent
    if (e >= 121) {
        // >= 2^-6, a normal E4M3: round the mantissa to 3 bits on the bits
        // (a carry moves into the exponent), rebias 127 -> 7.
        const unsigned r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
        return sign | (r - (120u << 3));
    }
    if (e < 117) return sign;  // below 2^-10, half the smallest subnormal: ±0
    // Subnormal steps of 2^-9: the code is |v| · 2^9 = m · 2^-(141 - e) for
    // the 24-bit significand m, rounded to nearest even (at most 8, which is
    // the smallest normal's code).
    const unsigned m = (a & 0x7fffffu) | 0x800000u;
    const int sh = 141 - e;  // 21 ..= 24
    const unsigned q = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1);
    return sign | (q + ((rem > half || (rem == half && (q & 1u) != 0u)) ? 1u : 0u));
}

template <typename A, typename B>
struct same_type {
    static constexpr bool value = false;
};
template <typename A>
struct same_type<A, A> {
    static constexpr bool value = true;
};

// Where each column of C goes (see the file header).
template <typename T, typename C>
struct Epilogue {
    T* out;
    C* blocks;
    const long long* row_off;
    int M, N, q_dim, kv_dim;
    long long kv_stride;
    bool pairs;  // q_dim and kv_dim even: (col, col + 1) with col even never straddle a segment

    __device__ __forceinline__ void one(int row, int col, float v) const {
        if (row >= M || col >= N) return;
        if (col < q_dim) {
            out[static_cast<long long>(row) * q_dim + col] = from_f32<T>(v);
            return;
        }
        const long long off = row_off[row];
        if (off < 0) return;  // padded token: writes no cache
        int j = col - q_dim;
        long long kv = 0;
        if (j >= kv_dim) {
            j -= kv_dim;
            kv = kv_stride;
        }
        blocks[off + kv + j] = from_f32<C>(v);
    }

    // Columns col and col + 1 (col even).
    __device__ __forceinline__ void two(int row, int col, float v0, float v1) const {
        if (!pairs) {
            one(row, col, v0);
            one(row, col + 1, v1);
            return;
        }
        if (row >= M || col >= N) return;  // N is even, so col + 1 < N too
        if (col < q_dim) {
            store2(out + static_cast<long long>(row) * q_dim + col, v0, v1);
            return;
        }
        const long long off = row_off[row];
        if (off < 0) return;
        int j = col - q_dim;
        long long kv = 0;
        if (j >= kv_dim) {
            j -= kv_dim;
            kv = kv_stride;
        }
        // off and kv_stride are multiples of kv_dim, j is even: the pair is aligned.
        store2(blocks + off + kv + j, v0, v1);
    }

    // Every store was final: nothing left to do (see Fp8Epilogue::finish).
    __device__ __forceinline__ void finish(int, int, int, int, int, int*) const {}
};

// The FP8 cache's epilogue (see the file header): Q as above; K/V of valid
// rows staged as f32 in `scratch`, quantized by finish().
template <typename T>
struct Fp8Epilogue {
    T* out;
    unsigned char* codes;  // the cache's blocks
    float* scales;         // the cache's scales
    float* scratch;        // [M, 2·kv_dim] f32
    unsigned* counters;    // [row tiles, 2·kv_dim / g], zero when the launch starts
    const long long* row_off;
    int M, N, q_dim, kv_dim, g;
    long long kv_stride;
    bool pairs;

    __device__ __forceinline__ float* staged(int row, int col) const {
        return scratch + static_cast<long long>(row) * (2 * kv_dim) + (col - q_dim);
    }

    __device__ __forceinline__ void one(int row, int col, float v) const {
        if (row >= M || col >= N) return;
        if (col < q_dim) {
            out[static_cast<long long>(row) * q_dim + col] = from_f32<T>(v);
            return;
        }
        if (row_off[row] < 0) return;  // padded token: writes no cache
        *staged(row, col) = v;
    }

    __device__ __forceinline__ void two(int row, int col, float v0, float v1) const {
        if (!pairs) {
            one(row, col, v0);
            one(row, col + 1, v1);
            return;
        }
        if (row >= M || col >= N) return;
        if (col < q_dim) {
            store2(out + static_cast<long long>(row) * q_dim + col, v0, v1);
            return;
        }
        if (row_off[row] < 0) return;
        store2(staged(row, col), v0, v1);  // kv_dim and col - q_dim even: 8-byte aligned
    }

    // Called by every thread of the block after its last one()/two(). The
    // block's tile is rows [m0, m0 + tile_m) x columns [n0, n0 + tile_n) of
    // C, and `tile_row` its row tile (the counters' row); `flags` is shared
    // memory for tile_n ints that the block no longer reads (written only
    // after the first barrier below, so it may alias the main loop's tiles).
    __device__ __forceinline__ void finish(int tile_row, int m0, int tile_m, int n0, int tile_n, int* flags) const {
        const int kv0 = max(n0, q_dim) - q_dim, kv1 = min(n0 + tile_n, N) - q_dim;
        if (kv1 <= kv0) return;  // Q columns only (the same for every thread)
        const int b0 = kv0 / g, nb = (kv1 - 1) / g - b0 + 1;  // g-blocks touched, nb <= tile_n
        const int tid = threadIdx.x;
        // Release: this thread's scratch stores are visible device-wide
        // before the counts below (issued after the barrier).
        fence_gpu();
        sync_block();
        if (tid < nb) {
            const int first = q_dim + (b0 + tid) * g;  // the g-block's first column
            const unsigned parts = static_cast<unsigned>((first + g - 1) / tile_n - first / tile_n + 1);
            unsigned* count = counters + static_cast<long long>(tile_row) * (2 * kv_dim / g) + b0 + tid;
            const bool last = atomic_add(count, 1u) == parts - 1u;
            if (last) *count = 0u;  // every part is in: back to zero
            fence_gpu();            // acquire: the other parts' stores, before the barrier
            flags[tid] = last ? 1 : 0;
        }
        sync_block();

        // Items (row, g-block) of the completed g-blocks, to groups of S
        // lanes (a power of two <= min(g, 32), inside one warp): absmax by
        // a shuffle max over the group, then each lane codes its elements
        // e = sub, sub + S, ...; the first FP8_REGS of them stay in
        // registers between the two passes (all of them when g <= 8·S, so
        // up to g = 256), the rest are read again. Every lane runs the same
        // trip count (the shuffles need the whole warp); lanes without an
        // item carry off = -1 along.
        int S = 1;
        while (S < 32 && 2 * S <= g) S *= 2;
        const int groups = THREADS / S, grp = tid / S, sub = tid % S;
        const int items = min(tile_m, M - m0) * nb;
        for (int base = 0; base < items; base += groups) {
            const int item = base + grp, i = item % nb, row = m0 + item / nb;
            const long long off = (item < items && flags[i]) ? row_off[row] : -1;
            const int j = (b0 + i) * g;  // first K/V column of the g-block (0 <= j < 2·kv_dim)
            const float* src = off >= 0 ? staged(row, q_dim + j) : scratch;
            const int n = off >= 0 ? g : 0;  // elements this group codes
            float v[FP8_REGS];
            float amax = 0.f;
#pragma unroll
            for (int r = 0; r < FP8_REGS; ++r) {
                const int e = sub + r * S;
                v[r] = e < n ? ldcg(src + e) : 0.f;
                amax = fmaxf(amax, finite_magnitude(v[r]));
            }
            for (int e = sub + FP8_REGS * S; e < n; e += S) amax = fmaxf(amax, finite_magnitude(ldcg(src + e)));
            for (int mask = S / 2; mask > 0; mask >>= 1) amax = fmaxf(amax, shfl_xor(amax, mask));
            if (off >= 0) {
                const float scale = amax / E4M3_MAX;
                // blocks offset of the g-block's first element: K at off + j,
                // V at off + kv_stride + (j - kv_dim); a multiple of g.
                const long long at = off + (j < kv_dim ? j : kv_stride + (j - kv_dim));
#pragma unroll
                for (int r = 0; r < FP8_REGS; ++r) {
                    const int e = sub + r * S;
                    if (e < n) codes[at + e] = code_of(v[r], scale);
                }
                for (int e = sub + FP8_REGS * S; e < n; e += S) codes[at + e] = code_of(ldcg(src + e), scale);
                if (sub == 0) scales[at / g] = scale;
            }
        }
    }

    // x's code in a g-block of scale `scale`: x / scale (±inf / scale is
    // ±inf, saturated to ±448); in a block of scale 0, a finite x codes
    // x · 0 (±0, not 0 / 0), and ±inf and NaN still x / scale (±448, NaN).
    __device__ __forceinline__ static unsigned char code_of(float x, float scale) {
        return static_cast<unsigned char>(to_e4m3(scale == 0.f && fabsf(x) <= F32_MAX ? x * 0.f : x / scale));
    }
};

// ---------------------------------------------------------------- decode, bf16/f16

// Block: 8 warps on 16 columns [n0, n0 + 16); warp w takes the 32-wide
// k-blocks w, w + 8, ... Within a k-block, lane (g = lane / 4, t = lane % 4)
// loads elements [8t, 8t + 8) of X rows g and g + 8 and of W rows n0 + g and
// n0 + 8 + g as 16-byte vectors. Since C sums over k, any permutation of k
// applied to both operands gives the same result: the mma's logical k
// {2t, 2t+1, 2t+8, 2t+9} of its first k16 step are taken as physical
// 8t + {0, 1, 2, 3}, and those of the second step as 8t + {4, 5, 6, 7}. That
// makes every register operand a piece of one 16-byte load.
template <typename T, typename Ep>
__device__ __forceinline__ void decode_mma(const T* x, const T* w, const Ep& ep, int M, int K) {
    __shared__ float red[WARPS][DEC_MAX_M][DEC_MMA_COLS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * DEC_MMA_COLS;
    const int N = ep.N;
    const T* wrow0 = w + static_cast<long long>(min(n0 + g, N - 1)) * K;
    const T* wrow1 = w + static_cast<long long>(min(n0 + 8 + g, N - 1)) * K;
    const bool lo = g < M, hi = g + 8 < M;
    const T* xlo = x + static_cast<long long>(lo ? g : 0) * K;
    const T* xhi = x + static_cast<long long>(hi ? g + 8 : 0) * K;
    const uint4 zero = make_uint4(0, 0, 0, 0);

    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const int kblocks = (K + 31) / 32;
#pragma unroll 4
    for (int kb = warp; kb < kblocks; kb += WARPS) {
        const int k = kb * 32 + t * 8;
        const bool kin = k < K;  // K % 8 == 0: a chunk is wholly in or out
        const uint4 alo = (kin && lo) ? ldg16(xlo + k) : zero;
        const uint4 ahi = (kin && hi) ? ldg16(xhi + k) : zero;
        const uint4 b0 = kin ? ldcs16(wrow0 + k) : zero;
        const uint4 b1 = kin ? ldcs16(wrow1 + k) : zero;
        const uint32_t a_first[4] = {alo.x, ahi.x, alo.y, ahi.y};
        const uint32_t a_second[4] = {alo.z, ahi.z, alo.w, ahi.w};
        const uint32_t b0_first[2] = {b0.x, b0.y}, b0_second[2] = {b0.z, b0.w};
        const uint32_t b1_first[2] = {b1.x, b1.y}, b1_second[2] = {b1.z, b1.w};
        mma16816<T>(acc[0], a_first, b0_first);
        mma16816<T>(acc[0], a_second, b0_second);
        mma16816<T>(acc[1], a_first, b1_first);
        mma16816<T>(acc[1], a_second, b1_second);
    }
    // Accumulator (row g or g + 8, column tile·8 + 2t + {0, 1}).
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
        const int c = tile * 8 + 2 * t;
        red[warp][g][c] = acc[tile][0];
        red[warp][g][c + 1] = acc[tile][1];
        red[warp][g + 8][c] = acc[tile][2];
        red[warp][g + 8][c + 1] = acc[tile][3];
    }
    sync_block();
    const int m = threadIdx.x / DEC_MMA_COLS, c = threadIdx.x % DEC_MMA_COLS;  // 256 = 16 x 16
    if (m < M) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < WARPS; ++i) s += red[i][m][c];
        ep.one(m, n0 + c, s);
    }
    ep.finish(0, 0, DEC_MAX_M, n0, DEC_MMA_COLS, reinterpret_cast<int*>(&red[0][0][0]));
}

// ---------------------------------------------------------------- decode, f32

// Block: 4 columns; thread i takes 16-byte chunks i, i + 256, ... of K for
// all 4 weight rows and every row of X; warp shuffles then shared memory
// reduce the 256 partial sums of each (row, column).
template <typename Ep>
__device__ __forceinline__ void decode_simt(const float* x, const float* w, const Ep& ep, int M, int K) {
    __shared__ float red[WARPS][DEC_MAX_M][DEC_SIMT_COLS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n0 = blockIdx.x * DEC_SIMT_COLS;
    const int chunks = K / 4;
    const float* wrow[DEC_SIMT_COLS];
#pragma unroll
    for (int c = 0; c < DEC_SIMT_COLS; ++c) wrow[c] = w + static_cast<long long>(min(n0 + c, ep.N - 1)) * K;

    float acc[DEC_MAX_M][DEC_SIMT_COLS];
#pragma unroll
    for (int m = 0; m < DEC_MAX_M; ++m)
#pragma unroll
        for (int c = 0; c < DEC_SIMT_COLS; ++c) acc[m][c] = 0.f;

#pragma unroll 2
    for (int ch = tid; ch < chunks; ch += THREADS) {
        float wv[DEC_SIMT_COLS][4];
#pragma unroll
        for (int c = 0; c < DEC_SIMT_COLS; ++c) as_f32x4(ldcs16(wrow[c] + ch * 4), wv[c]);
#pragma unroll
        for (int m = 0; m < DEC_MAX_M; ++m) {
            if (m < M) {
                float xv[4];
                as_f32x4(ldg16(x + static_cast<long long>(m) * K + ch * 4), xv);
#pragma unroll
                for (int c = 0; c < DEC_SIMT_COLS; ++c)
#pragma unroll
                    for (int v = 0; v < 4; ++v) acc[m][c] = fmaf(xv[v], wv[c][v], acc[m][c]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < DEC_MAX_M; ++m) {
        if (m < M) {  // M is uniform: every lane takes the same branch
#pragma unroll
            for (int c = 0; c < DEC_SIMT_COLS; ++c) {
                float v = acc[m][c];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) v += shfl_xor(v, off);
                if (lane == 0) red[warp][m][c] = v;
            }
        }
    }
    sync_block();
    if (tid < DEC_MAX_M * DEC_SIMT_COLS) {
        const int m = tid / DEC_SIMT_COLS, c = tid % DEC_SIMT_COLS;
        if (m < M) {
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < WARPS; ++i) s += red[i][m][c];
            ep.one(m, n0 + c, s);
        }
    }
    ep.finish(0, 0, DEC_MAX_M, n0, DEC_SIMT_COLS, reinterpret_cast<int*>(&red[0][0][0]));
}

// ---------------------------------------------------------------- prefill, bf16/f16

// Shared tiles are 128 rows x 32 k = 4 chunks of 16 bytes per row; chunk c of
// row r is stored at r·4 + (c ^ ((r >> 1) & 3)), so the 8 rows an ldmatrix
// reads (8 consecutive rows, one chunk each) hit 8 distinct 16-byte bank
// groups.
__device__ __forceinline__ int swz(int row, int chunk) { return row * 4 + (chunk ^ ((row >> 1) & 3)); }

template <typename T, typename Ep>
__device__ __forceinline__ void prefill_mma(const T* x, const T* w, const Ep& ep, int M, int K) {
    constexpr int CHUNKS = PF_BM * PF_BK * 2 / 16;  // 16-byte chunks per operand tile (512)
    static_assert(PF_BM == PF_BN, "A and B tiles share one layout");
    __shared__ __align__(128) uint4 smem[PF_STAGES][2][CHUNKS];  // 48 KiB

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2;  // 64-row slab of the block tile
    const int wn = warp & 3;   // 32-column slab
    const int m0 = blockIdx.y * PF_BM, n0 = blockIdx.x * PF_BN;
    const int N = ep.N;
    const int ktiles = (K + PF_BK - 1) / PF_BK;

    auto load_tile = [&](int stage, int kt) {
        const int k0 = kt * PF_BK;
#pragma unroll
        for (int i = 0; i < CHUNKS / THREADS; ++i) {
            const int id = tid + i * THREADS;
            const int row = id >> 2, c = id & 3;
            const int k = k0 + c * 8;
            const bool a_in = k < K && m0 + row < M;
            const bool b_in = k < K && n0 + row < N;
            cp_async16(&smem[stage][0][swz(row, c)], x + (a_in ? static_cast<long long>(m0 + row) * K + k : 0), a_in);
            cp_async16(&smem[stage][1][swz(row, c)], w + (b_in ? static_cast<long long>(n0 + row) * K + k : 0), b_in);
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
    for (int s = 0; s < PF_STAGES - 1; ++s) {
        if (s < ktiles) load_tile(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        // Tile kt has landed (at most STAGES - 2 younger groups pending), and
        // every warp is done with the stage the prefetch below overwrites
        // (the one computed in iteration kt - 1).
        cp_async_wait<PF_STAGES - 2>();
        sync_block();
        const int next = kt + PF_STAGES - 1;
        if (next < ktiles) load_tile(next % PF_STAGES, next);
        cp_async_commit();

        const uint4* As = smem[kt % PF_STAGES][0];
        const uint4* Bs = smem[kt % PF_STAGES][1];
#pragma unroll
        for (int ks = 0; ks < PF_BK / 16; ++ks) {
            uint32_t a[4][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                // matrices: rows 0-7 / 8-15 of the m16 tile x k 0-7 / 8-15 = a0..a3
                const int row = wm * 64 + mi * 16 + (lane & 15);
                ldmatrix_x4(a[mi], &As[swz(row, ks * 2 + (lane >> 4))]);
            }
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                const int row = wn * 32 + p * 16 + (lane & 7) + ((lane >> 4) << 3);
                uint32_t r[4];
                ldmatrix_x4(r, &Bs[swz(row, ks * 2 + ((lane >> 3) & 1))]);
                b[2 * p][0] = r[0];
                b[2 * p][1] = r[1];
                b[2 * p + 1][0] = r[2];
                b[2 * p + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) mma16816<T>(acc[mi][ni], a[mi], b[ni]);
        }
    }
    cp_async_wait<0>();

    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
        const int row = m0 + wm * 64 + mi * 16 + g;
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const int col = n0 + wn * 32 + ni * 8 + 2 * t;
            ep.two(row, col, acc[mi][ni][0], acc[mi][ni][1]);
            ep.two(row + 8, col, acc[mi][ni][2], acc[mi][ni][3]);
        }
    }
    ep.finish(blockIdx.y, m0, PF_BM, n0, PF_BN, reinterpret_cast<int*>(&smem[0][0][0]));
}

// ---------------------------------------------------------------- prefill, f32

// 64x64 block tile, k in steps of 16 staged through shared memory stored
// k-major (transposed); thread (tx, ty) computes rows ty + 16i, columns
// tx + 16j.
template <typename Ep>
__device__ __forceinline__ void prefill_simt(const float* x, const float* w, const Ep& ep, int M, int K) {
    __shared__ float As[PS_BK][PS_BM + 4];
    __shared__ float Bs[PS_BK][PS_BN + 4];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int m0 = blockIdx.y * PS_BM, n0 = blockIdx.x * PS_BN;
    const int lrow = tid >> 2, lk = (tid & 3) * 4;  // each thread stages 4 k of one row of each tile
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

    for (int k0 = 0; k0 < K; k0 += PS_BK) {
        const int k = k0 + lk;  // K % 8 == 0: k < K means k + 3 < K
        float av[4] = {0.f, 0.f, 0.f, 0.f}, bv[4] = {0.f, 0.f, 0.f, 0.f};
        if (k < K && m0 + lrow < M) as_f32x4(ldg16(x + static_cast<long long>(m0 + lrow) * K + k), av);
        if (k < K && n0 + lrow < ep.N) as_f32x4(ldg16(w + static_cast<long long>(n0 + lrow) * K + k), bv);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            As[lk + e][lrow] = av[e];
            Bs[lk + e][lrow] = bv[e];
        }
        sync_block();
#pragma unroll
        for (int kk = 0; kk < PS_BK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        sync_block();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) ep.one(m0 + ty + 16 * i, n0 + tx + 16 * j, acc[i][j]);
    ep.finish(blockIdx.y, m0, PS_BM, n0, PS_BN, reinterpret_cast<int*>(&As[0][0]));
}

// ---------------------------------------------------------------- entry bodies

template <typename T, typename C>
__device__ __forceinline__ Epilogue<T, C> make_epilogue(T* out, C* blocks, const long long* row_off, int M, int N,
                                                        int q_dim, int kv_dim, long long kv_stride) {
    Epilogue<T, C> ep;
    ep.out = out;
    ep.blocks = blocks;
    ep.row_off = row_off;
    ep.M = M;
    ep.N = N;
    ep.q_dim = q_dim;
    ep.kv_dim = kv_dim;
    ep.kv_stride = kv_stride;
    ep.pairs = (q_dim % 2 == 0) && (kv_dim % 2 == 0);
    return ep;
}

// Grid: (ceil(N / cols), 1), cols = DEC_SIMT_COLS for f32, DEC_MMA_COLS otherwise. M <= DEC_MAX_M.
template <typename T, typename C>
__device__ __forceinline__ void decode(const T* x, const T* w, T* out, C* blocks, const long long* row_off, int M,
                                       int K, int N, int q_dim, int kv_dim, long long kv_stride) {
    const Epilogue<T, C> ep = make_epilogue<T, C>(out, blocks, row_off, M, N, q_dim, kv_dim, kv_stride);
    if constexpr (same_type<T, float>::value) {
        decode_simt(x, w, ep, M, K);
    } else {
        decode_mma<T>(x, w, ep, M, K);
    }
}

// Grid: (ceil(N / BN), ceil(M / BM)), (BM, BN) = (PS_BM, PS_BN) for f32, (PF_BM, PF_BN) otherwise.
template <typename T, typename C>
__device__ __forceinline__ void prefill(const T* x, const T* w, T* out, C* blocks, const long long* row_off, int M,
                                        int K, int N, int q_dim, int kv_dim, long long kv_stride) {
    const Epilogue<T, C> ep = make_epilogue<T, C>(out, blocks, row_off, M, N, q_dim, kv_dim, kv_stride);
    if constexpr (same_type<T, float>::value) {
        prefill_simt(x, w, ep, M, K);
    } else {
        prefill_mma<T>(x, w, ep, M, K);
    }
}

template <typename T>
__device__ __forceinline__ Fp8Epilogue<T> make_fp8_epilogue(T* out, unsigned char* codes, float* scales,
                                                            const long long* row_off, int M, int N, int q_dim,
                                                            int kv_dim, long long kv_stride, int g, float* scratch,
                                                            unsigned* counters) {
    Fp8Epilogue<T> ep;
    ep.out = out;
    ep.codes = codes;
    ep.scales = scales;
    ep.scratch = scratch;
    ep.counters = counters;
    ep.row_off = row_off;
    ep.M = M;
    ep.N = N;
    ep.q_dim = q_dim;
    ep.kv_dim = kv_dim;
    ep.g = g;
    ep.kv_stride = kv_stride;
    ep.pairs = (q_dim % 2 == 0) && (kv_dim % 2 == 0);
    return ep;
}

// The FP8-cache variants: decode's and prefill's grids and schedules, with
// the FP8 epilogue. g divides D (so kv_dim and kv_stride); `scratch` holds
// M·2·kv_dim f32; `counters` holds (row tiles)·2·kv_dim / g zeros, row tiles
// = 1 for decode, ceil(M / BM) for prefill.
template <typename T>
__device__ __forceinline__ void decode_fp8(const T* x, const T* w, T* out, unsigned char* codes, float* scales,
                                           const long long* row_off, int M, int K, int N, int q_dim, int kv_dim,
                                           long long kv_stride, int g, float* scratch, unsigned* counters) {
    const Fp8Epilogue<T> ep =
        make_fp8_epilogue<T>(out, codes, scales, row_off, M, N, q_dim, kv_dim, kv_stride, g, scratch, counters);
    if constexpr (same_type<T, float>::value) {
        decode_simt(x, w, ep, M, K);
    } else {
        decode_mma<T>(x, w, ep, M, K);
    }
}

template <typename T>
__device__ __forceinline__ void prefill_fp8(const T* x, const T* w, T* out, unsigned char* codes, float* scales,
                                            const long long* row_off, int M, int K, int N, int q_dim, int kv_dim,
                                            long long kv_stride, int g, float* scratch, unsigned* counters) {
    const Fp8Epilogue<T> ep =
        make_fp8_epilogue<T>(out, codes, scales, row_off, M, N, q_dim, kv_dim, kv_stride, g, scratch, counters);
    if constexpr (same_type<T, float>::value) {
        prefill_simt(x, w, ep, M, K);
    } else {
        prefill_mma<T>(x, w, ep, M, K);
    }
}

// Converts n values with to_e4m3 (the architecture's convert: hardware on
// sm_90) into `hw` and with e4m3_sw into `sw`, for the GPU test of both
// converts against kvjit_core::fp8::e4m3_from_f32.
__device__ __forceinline__ void e4m3_probe(const float* in, unsigned char* hw, unsigned char* sw, int n) {
    for (int i = blockIdx.x * THREADS + threadIdx.x; i < n; i += gridDim.x * THREADS) {
        hw[i] = static_cast<unsigned char>(to_e4m3(in[i]));
        sw[i] = static_cast<unsigned char>(e4m3_sw(in[i]));
    }
}

// Copies the K and V of `rows` cache rows out of `blocks` into
// staged[i, kv, j] = blocks[offs[i] + kv·kv_stride + j], so the host can
// mirror what a launch wrote with one copy. Grid: (rows, 1).
template <typename C>
__device__ __forceinline__ void gather(const C* blocks, const long long* offs, int kv_dim, long long kv_stride,
                                       C* staged) {
    const long long i = blockIdx.x;
    const long long off = offs[i];
    for (int e = threadIdx.x; e < 2 * kv_dim; e += THREADS) {
        const int kv = e >= kv_dim ? 1 : 0;
        staged[i * 2 * kv_dim + e] = blocks[off + kv * kv_stride + (e - kv * kv_dim)];
    }
}

}  // namespace kvjit

// ---------------------------------------------------------------- entry points

#define KVJIT_FUSED_PARAMS(T, C)                                                                                     \
    const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ out, C *__restrict__ blocks,                   \
        const long long *__restrict__ row_off, int M, int K, int N, int q_dim, int kv_dim, long long kv_stride
#define KVJIT_FUSED_ARGS x, w, out, blocks, row_off, M, K, N, q_dim, kv_dim, kv_stride

// Names: <op>_<schedule>_cuda_<dtype>_kv<cache dtype>, the symbol of
// `variant_key` in cuda_kernel.rs.
#define KVJIT_VARIANTS(TN, T, CN, C)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                                                \
        fused_qkv_bshd_paged_decode_cuda_##TN##_kv##CN(KVJIT_FUSED_PARAMS(T, C)) {                                   \
        kvjit::decode<T, C>(KVJIT_FUSED_ARGS);                                                                       \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                                                \
        fused_qkv_bshd_paged_prefill_cuda_##TN##_kv##CN(KVJIT_FUSED_PARAMS(T, C)) {                                  \
        kvjit::prefill<T, C>(KVJIT_FUSED_ARGS);                                                                      \
    }

// FP8 cache: blocks are codes, with the scales, g, the scratch and the counters.
#define KVJIT_FP8_PARAMS(T)                                                                                          \
    const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ out, unsigned char *__restrict__ blocks,       \
        float *__restrict__ scales, const long long *__restrict__ row_off, int M, int K, int N, int q_dim,         \
        int kv_dim, long long kv_stride, int g, float *__restrict__ scratch, unsigned *__restrict__ counters
#define KVJIT_FP8_ARGS x, w, out, blocks, scales, row_off, M, K, N, q_dim, kv_dim, kv_stride, g, scratch, counters

#define KVJIT_FP8_VARIANTS(TN, T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                                                \
        fused_qkv_bshd_paged_decode_cuda_##TN##_kvf8e4m3(KVJIT_FP8_PARAMS(T)) {                                      \
        kvjit::decode_fp8<T>(KVJIT_FP8_ARGS);                                                                        \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                                                \
        fused_qkv_bshd_paged_prefill_cuda_##TN##_kvf8e4m3(KVJIT_FP8_PARAMS(T)) {                                     \
        kvjit::prefill_fp8<T>(KVJIT_FP8_ARGS);                                                                       \
    }

#define KVJIT_GATHER(CN, C)                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) fused_qkv_bshd_paged_gather_cuda_##CN(                         \
        const C *__restrict__ blocks, const long long *__restrict__ offs, int kv_dim, long long kv_stride,           \
        C *__restrict__ staged) {                                                                                    \
        kvjit::gather<C>(blocks, offs, kv_dim, kv_stride, staged);                                                   \
    }

KVJIT_VARIANTS(f32, float, f32, float)
KVJIT_VARIANTS(f32, float, bf16, kv_bf16)
KVJIT_VARIANTS(f32, float, f16, kv_f16)
KVJIT_VARIANTS(bf16, kv_bf16, f32, float)
KVJIT_VARIANTS(bf16, kv_bf16, bf16, kv_bf16)
KVJIT_VARIANTS(bf16, kv_bf16, f16, kv_f16)
KVJIT_VARIANTS(f16, kv_f16, f32, float)
KVJIT_VARIANTS(f16, kv_f16, bf16, kv_bf16)
KVJIT_VARIANTS(f16, kv_f16, f16, kv_f16)
KVJIT_FP8_VARIANTS(f32, float)
KVJIT_FP8_VARIANTS(bf16, kv_bf16)
KVJIT_FP8_VARIANTS(f16, kv_f16)
KVJIT_GATHER(f32, float)
KVJIT_GATHER(bf16, kv_bf16)
KVJIT_GATHER(f16, kv_f16)
KVJIT_GATHER(f8e4m3, unsigned char)

extern "C" __global__ void __launch_bounds__(256) fused_qkv_bshd_paged_e4m3_probe_cuda_f32(
    const float *__restrict__ in, unsigned char *__restrict__ hw, unsigned char *__restrict__ sw, int n) {
    kvjit::e4m3_probe(in, hw, sw, n);
}
