// Runs the exact kernel bodies of ../fused_qkv.cu on the CPU and checks them
// against a double-precision reference of the op contract.
//
// This is not a CUDA emulator in general: it supplies just the primitives
// fused_qkv.cu keeps in its KVJIT_EMULATE block (16-byte loads, cp.async,
// ldmatrix, mma.sync m16n8k16, warp shuffles, __syncthreads, bf16/f16
// rounding), with the fragment layouts of the PTX ISA manual, and runs each
// block as 256 OS threads (one per CUDA thread; blocks one after another, so
// a function-local `static` is exactly one block's shared memory). Races the
// kernels' barriers should prevent would show up here as wrong results.
// What it cannot check: that nvcc/ptxas compile the same code the same way,
// real memory ordering, timing. That needs a GPU (scripts/gpu-check.sh).
//
// Build and run: scripts/emulate-cuda.sh (g++ -std=c++20 -O2 -pthread).
// Exit status 0 when every case passes.

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define KVJIT_EMULATE 1

// ---------------------------------------------------------------- CUDA surface

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint4 {
    uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return uint4{x, y, z, w}; }
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
thread_local dim3 threadIdx, blockIdx;
dim3 gridDim;
inline int min(int a, int b) { return a < b ? a : b; }

struct kv_bf16 {
    uint16_t bits;
};
struct kv_f16 {
    uint16_t bits;
};

static float f32_of_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static uint32_t bits_of_f32(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
static uint16_t bf16_bits(float v) {  // round to nearest even, NaN stays NaN
    uint32_t u = bits_of_f32(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}
static uint16_t f16_bits(float v) {  // _Float16 conversion rounds to nearest even
    _Float16 h = static_cast<_Float16>(v);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
}
static float bf16_value(uint16_t b) { return f32_of_bits(static_cast<uint32_t>(b) << 16); }
static float f16_value(uint16_t b) {
    _Float16 h;
    std::memcpy(&h, &b, 2);
    return static_cast<float>(h);
}

// One block's synchronization state (blocks run one at a time).
struct Warp {
    std::barrier<> bar{32};
    uint64_t slot[32][8];
};
struct Block {
    std::barrier<> bar{256};
    Warp warp[8];
};
static Block* g_block = nullptr;

namespace kvjit {

inline uint4 ldg16(const void* p) {
    uint4 v;
    std::memcpy(&v, p, 16);
    return v;
}
inline uint4 ldcs16(const void* p) { return ldg16(p); }
inline void sync_block() { g_block->bar.arrive_and_wait(); }

inline float shfl_xor(float v, int mask) {
    Warp& w = g_block->warp[threadIdx.x / 32];
    const unsigned lane = threadIdx.x % 32;
    w.slot[lane][0] = bits_of_f32(v);
    w.bar.arrive_and_wait();
    const float r = f32_of_bits(static_cast<uint32_t>(w.slot[lane ^ mask][0]));
    w.bar.arrive_and_wait();
    return r;
}

// Synchronous: the copy is done when the call returns (a superset of the
// orders the hardware allows, so a missing wait/barrier shows up as a race).
inline void cp_async16(void* smem, const void* src, bool pred) {
    if (pred) {
        std::memcpy(smem, src, 16);
    } else {
        std::memset(smem, 0, 16);
    }
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    Warp& w = g_block->warp[threadIdx.x / 32];
    const unsigned lane = threadIdx.x % 32;
    w.slot[lane][0] = reinterpret_cast<uint64_t>(smem);
    w.bar.arrive_and_wait();
    for (int j = 0; j < 4; ++j) {
        // matrix j, row lane / 4 (its address came from lane 8j + lane / 4), elements 2·(lane % 4) + {0, 1}
        const auto* row = reinterpret_cast<const uint8_t*>(w.slot[8 * j + lane / 4][0]);
        std::memcpy(&r[j], row + 4 * (lane % 4), 4);
    }
    w.bar.arrive_and_wait();
}

template <typename T>
float elem(uint32_t reg, int half);
template <>
float elem<kv_bf16>(uint32_t reg, int half) {
    return bf16_value(static_cast<uint16_t>(half ? reg >> 16 : reg & 0xffff));
}
template <>
float elem<kv_f16>(uint32_t reg, int half) {
    return f16_value(static_cast<uint16_t>(half ? reg >> 16 : reg & 0xffff));
}

// Fragment layouts of mma.m16n8k16 (.bf16/.f16, f32 accumulators), PTX ISA
// "Matrix Fragments for mma.m16n8k16 with floating point type":
// g = lane >> 2, t = lane % 4;
// A: a0 (g, 2t+i), a1 (g+8, 2t+i), a2 (g, 2t+8+i), a3 (g+8, 2t+8+i);
// B: b0 (k 2t+i, n g), b1 (k 2t+8+i, n g); C: c0,c1 (g, 2t+i), c2,c3 (g+8, 2t+i).
template <typename T>
inline void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    Warp& w = g_block->warp[threadIdx.x / 32];
    const unsigned lane = threadIdx.x % 32;
    for (int i = 0; i < 4; ++i) w.slot[lane][i] = a[i];
    w.slot[lane][4] = b[0];
    w.slot[lane][5] = b[1];
    w.bar.arrive_and_wait();
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 2; ++i) {
            A[g][2 * t + i] = elem<T>(static_cast<uint32_t>(w.slot[l][0]), i);
            A[g + 8][2 * t + i] = elem<T>(static_cast<uint32_t>(w.slot[l][1]), i);
            A[g][2 * t + 8 + i] = elem<T>(static_cast<uint32_t>(w.slot[l][2]), i);
            A[g + 8][2 * t + 8 + i] = elem<T>(static_cast<uint32_t>(w.slot[l][3]), i);
            B[2 * t + i][g] = elem<T>(static_cast<uint32_t>(w.slot[l][4]), i);
            B[2 * t + 8 + i][g] = elem<T>(static_cast<uint32_t>(w.slot[l][5]), i);
        }
    }
    w.bar.arrive_and_wait();
    const int g = lane >> 2, t = lane & 3;
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float s = 0.f;
        for (int k = 0; k < 16; ++k) s = std::fma(A[row][k], B[k][col], s);
        d[e] += s;
    }
}

template <typename T>
T from_f32(float v);
template <>
inline float from_f32<float>(float v) {
    return v;
}
template <>
inline kv_bf16 from_f32<kv_bf16>(float v) {
    return kv_bf16{bf16_bits(v)};
}
template <>
inline kv_f16 from_f32<kv_f16>(float v) {
    return kv_f16{f16_bits(v)};
}
template <typename C>
inline void store2(C* p, float a, float b) {
    p[0] = from_f32<C>(a);
    p[1] = from_f32<C>(b);
}
inline void as_f32x4(const uint4& raw, float (&f)[4]) {
    f[0] = f32_of_bits(raw.x);
    f[1] = f32_of_bits(raw.y);
    f[2] = f32_of_bits(raw.z);
    f[3] = f32_of_bits(raw.w);
}

}  // namespace kvjit

#include "../fused_qkv.cu"

// ---------------------------------------------------------------- launching

// 256 threads per launch; each runs every block in turn, with a block-wide
// barrier between blocks so one block's shared memory (the statics) is never
// overwritten while another thread still uses it.
static void launch(dim3 grid, const std::function<void()>& kernel) {
    gridDim = grid;
    auto block = std::make_unique<Block>();
    g_block = block.get();
    std::vector<std::thread> threads;
    threads.reserve(256);
    for (unsigned tid = 0; tid < 256; ++tid) {
        threads.emplace_back([&, tid] {
            threadIdx = dim3{tid, 0, 0};
            for (unsigned by = 0; by < grid.y; ++by) {
                for (unsigned bx = 0; bx < grid.x; ++bx) {
                    blockIdx = dim3{bx, by, 0};
                    kernel();
                    g_block->bar.arrive_and_wait();
                }
            }
        });
    }
    for (auto& t : threads) t.join();
    g_block = nullptr;
}

// ---------------------------------------------------------------- the check

enum class DT { F32, BF16, F16 };
static const char* dt_name(DT d) { return d == DT::F32 ? "f32" : d == DT::BF16 ? "bf16" : "f16"; }
static size_t dt_size(DT d) { return d == DT::F32 ? 4 : 2; }
static float round_to(DT d, float v) {
    return d == DT::F32 ? v : d == DT::BF16 ? bf16_value(bf16_bits(v)) : f16_value(f16_bits(v));
}
static void put(DT d, std::vector<uint8_t>& buf, size_t i, float v) {
    if (d == DT::F32) {
        std::memcpy(&buf[i * 4], &v, 4);
    } else {
        const uint16_t b = d == DT::BF16 ? bf16_bits(v) : f16_bits(v);
        std::memcpy(&buf[i * 2], &b, 2);
    }
}
static float get(DT d, const std::vector<uint8_t>& buf, size_t i) {
    if (d == DT::F32) {
        float v;
        std::memcpy(&v, &buf[i * 4], 4);
        return v;
    }
    uint16_t b;
    std::memcpy(&b, &buf[i * 2], 2);
    return d == DT::BF16 ? bf16_value(b) : f16_value(b);
}
// Relative precision of a dtype's stores (half an ulp at 1.0, doubled).
static double eps(DT d) { return d == DT::F32 ? 1e-6 : d == DT::BF16 ? 1.0 / 128 : 1.0 / 1024; }

// A buffer with guard bytes on both sides; the kernel gets the middle.
struct Guarded {
    static constexpr size_t GUARD = 256;
    std::vector<uint8_t> all;
    size_t bytes;
    explicit Guarded(size_t n) : all(checked(n) + 2 * GUARD, 0xA5), bytes(n) {}
    static size_t checked(size_t n) {
        if (n > (size_t{1} << 36)) std::abort();  // test buffers are small; also bounds n for the optimizer
        return n;
    }
    uint8_t* data() { return all.data() + GUARD; }
    void fill(uint8_t byte) { std::fill(all.begin() + GUARD, all.begin() + GUARD + checked(bytes), byte); }
    bool guards_intact() const {
        for (size_t i = 0; i < GUARD; ++i)
            if (all[i] != 0xA5 || all[GUARD + bytes + i] != 0xA5) return false;
        return true;
    }
};

struct Case {
    DT t, c;
    bool decode;
    int batch, seq, k, q_dim, hkv, d, page, layers, pages, layer;
};

static int failures = 0;
#define CHECK(cond, ...)                          \
    do {                                          \
        if (!(cond)) {                            \
            std::fprintf(stderr, "  FAIL: ");     \
            std::fprintf(stderr, __VA_ARGS__);    \
            std::fprintf(stderr, "\n");           \
            ++failures;                           \
            return;                               \
        }                                         \
    } while (0)

template <typename T, typename C>
static void run_kernel(const Case& cs, bool decode, Guarded& x, Guarded& w, Guarded& out, Guarded& blocks,
                       const std::vector<long long>& row_off, int M, int N, long long kv_stride) {
    const T* xp = reinterpret_cast<const T*>(x.data());
    const T* wp = reinterpret_cast<const T*>(w.data());
    T* op = reinterpret_cast<T*>(out.data());
    C* bp = reinterpret_cast<C*>(blocks.data());
    const long long* ro = row_off.data();
    const int K = cs.k, q_dim = cs.q_dim, kv_dim = cs.hkv * cs.d;
    const bool f32 = kvjit::same_type<T, float>::value;
    if (decode) {
        const int cols = f32 ? kvjit::DEC_SIMT_COLS : kvjit::DEC_MMA_COLS;
        launch(dim3{static_cast<unsigned>((N + cols - 1) / cols), 1, 1},
               [&] { kvjit::decode<T, C>(xp, wp, op, bp, ro, M, K, N, q_dim, kv_dim, kv_stride); });
    } else {
        const int bm = f32 ? kvjit::PS_BM : kvjit::PF_BM, bn = f32 ? kvjit::PS_BN : kvjit::PF_BN;
        launch(dim3{static_cast<unsigned>((N + bn - 1) / bn), static_cast<unsigned>((M + bm - 1) / bm), 1},
               [&] { kvjit::prefill<T, C>(xp, wp, op, bp, ro, M, K, N, q_dim, kv_dim, kv_stride); });
    }
}

template <typename C>
static void run_gather(Guarded& blocks, const std::vector<long long>& offs, int kv_dim, long long kv_stride,
                       Guarded& staged) {
    const C* bp = reinterpret_cast<const C*>(blocks.data());
    C* sp = reinterpret_cast<C*>(staged.data());
    launch(dim3{static_cast<unsigned>(offs.size()), 1, 1},
           [&] { kvjit::gather<C>(bp, offs.data(), kv_dim, kv_stride, sp); });
}

template <typename T>
static void dispatch_c(const Case& cs, Guarded& x, Guarded& w, Guarded& out, Guarded& blocks,
                       const std::vector<long long>& ro, int M, int N, long long kv_stride) {
    switch (cs.c) {
        case DT::F32: run_kernel<T, float>(cs, cs.decode, x, w, out, blocks, ro, M, N, kv_stride); break;
        case DT::BF16: run_kernel<T, kv_bf16>(cs, cs.decode, x, w, out, blocks, ro, M, N, kv_stride); break;
        case DT::F16: run_kernel<T, kv_f16>(cs, cs.decode, x, w, out, blocks, ro, M, N, kv_stride); break;
    }
}

static void run_case(const Case& cs, std::mt19937_64& rng) {
    const int M = cs.batch * cs.seq, K = cs.k, kv_dim = cs.hkv * cs.d, N = cs.q_dim + 2 * kv_dim;
    std::printf("%s %s kv%s B=%d S=%d K=%d q=%d hkv=%d d=%d p=%d L=%d layer=%d\n", cs.decode ? "decode " : "prefill",
                dt_name(cs.t), dt_name(cs.c), cs.batch, cs.seq, K, cs.q_dim, cs.hkv, cs.d, cs.page, cs.layers,
                cs.layer);
    std::fflush(stdout);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);

    // Inputs, already rounded to their dtype so the reference sees the same values.
    std::vector<float> xv(static_cast<size_t>(M) * K), wv(static_cast<size_t>(N) * K);
    Guarded x(xv.size() * dt_size(cs.t)), w(wv.size() * dt_size(cs.t));
    std::vector<uint8_t> tmp;
    auto fill = [&](std::vector<float>& v, Guarded& g) {
        tmp.assign(v.size() * dt_size(cs.t), 0);
        for (size_t i = 0; i < v.size(); ++i) {
            v[i] = round_to(cs.t, uni(rng));
            put(cs.t, tmp, i, v[i]);
        }
        std::memcpy(g.data(), tmp.data(), tmp.size());
    };
    fill(xv, x);
    fill(wv, w);

    // The page table: shuffled pages, random history and valid lengths.
    std::vector<int> valid(cs.batch), hist(cs.batch);
    std::vector<int> perm(cs.pages);
    for (int i = 0; i < cs.pages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    const long long slot_elems = kv_dim;
    const long long kv_stride = static_cast<long long>(cs.layers) * cs.page * kv_dim;
    const long long page_elems = 2 * kv_stride;
    const size_t cache_elems = static_cast<size_t>(cs.pages) * static_cast<size_t>(cs.layers) * cs.page * kv_dim * 2;
    std::vector<long long> row_off(M, -1);
    int next_page = 0;
    for (int b = 0; b < cs.batch; ++b) {
        valid[b] = std::uniform_int_distribution<int>(0, cs.seq)(rng);
        if (b == 0) valid[b] = cs.seq;  // at least one full sequence
        hist[b] = std::uniform_int_distribution<int>(0, 2 * cs.page)(rng);
        const int end = hist[b] + valid[b];
        const int first_page = hist[b] / cs.page, last_page = end == 0 ? -1 : (end - 1) / cs.page;
        std::vector<int> table(last_page + 1, -1);
        for (int lp = first_page; lp <= last_page; ++lp) table[lp] = perm[next_page++];
        for (int t = 0; t < valid[b]; ++t) {
            const int pos = hist[b] + t;
            const int page = table[pos / cs.page], slot = pos % cs.page;
            row_off[static_cast<size_t>(b) * cs.seq + t] =
                static_cast<long long>(page) * page_elems +
                (static_cast<long long>(cs.layer) * cs.page + slot) * slot_elems;  // [page, 0, layer, slot, 0, 0]
        }
    }
    if (next_page > cs.pages) {
        std::fprintf(stderr, "  bad case: needs %d pages\n", next_page);
        ++failures;
        return;
    }

    // Poisoned output and cache.
    Guarded out(static_cast<size_t>(M) * cs.q_dim * dt_size(cs.t)), blocks(cache_elems * dt_size(cs.c));
    out.fill(0xFF);  // NaN in every dtype
    blocks.fill(0xFF);
    const std::vector<uint8_t> poisoned_cache(blocks.data(), blocks.data() + blocks.bytes);

    switch (cs.t) {
        case DT::F32: dispatch_c<float>(cs, x, w, out, blocks, row_off, M, N, kv_stride); break;
        case DT::BF16: dispatch_c<kv_bf16>(cs, x, w, out, blocks, row_off, M, N, kv_stride); break;
        case DT::F16: dispatch_c<kv_f16>(cs, x, w, out, blocks, row_off, M, N, kv_stride); break;
    }
    CHECK(x.guards_intact() && w.guards_intact(), "input guard bytes changed");
    CHECK(out.guards_intact(), "output guard bytes changed");
    CHECK(blocks.guards_intact(), "cache guard bytes changed");

    // Reference, f64.
    std::vector<uint8_t> outb(out.data(), out.data() + out.bytes), cacheb(blocks.data(), blocks.data() + blocks.bytes);
    std::vector<uint8_t> expect_written(cache_elems, 0);
    const double scale = std::sqrt(static_cast<double>(K)) * 0.6 + 1.0;
    for (int r = 0; r < M; ++r) {
        for (int n = 0; n < N; ++n) {
            double s = 0;
            for (int k = 0; k < K; ++k)
                s += static_cast<double>(xv[static_cast<size_t>(r) * K + k]) * wv[static_cast<size_t>(n) * K + k];
            if (n < cs.q_dim) {
                const float got = get(cs.t, outb, static_cast<size_t>(r) * cs.q_dim + n);
                const double tol = eps(cs.t) * (std::fabs(s) + scale) + 1e-5 * scale;
                CHECK(std::fabs(got - s) <= tol, "out[%d, %d] = %g, expected %g", r, n, got, s);
            } else if (row_off[r] >= 0) {
                const int j = n - cs.q_dim, kv = j >= kv_dim ? 1 : 0;
                const size_t at = static_cast<size_t>(row_off[r] + kv * kv_stride + (j - kv * kv_dim));
                expect_written[at] = 1;
                const float got = get(cs.c, cacheb, at);
                const double tol = std::max(eps(cs.t), eps(cs.c)) * (std::fabs(s) + scale) + 1e-5 * scale;
                CHECK(std::fabs(got - s) <= tol, "cache (row %d, col %d) = %g, expected %g", r, n, got, s);
            }
        }
    }
    const size_t es = dt_size(cs.c);
    for (size_t i = 0; i < cache_elems; ++i) {
        if (!expect_written[i]) {
            CHECK(std::memcmp(&cacheb[i * es], &poisoned_cache[i * es], es) == 0,
                  "cache element %zu changed but no valid token owns it", i);
        }
    }

    // The gather kernel reads back exactly the rows the launch wrote.
    std::vector<long long> offs;
    for (long long o : row_off)
        if (o >= 0) offs.push_back(o);
    if (!offs.empty()) {
        Guarded staged(offs.size() * 2 * kv_dim * es);
        switch (cs.c) {
            case DT::F32: run_gather<float>(blocks, offs, kv_dim, kv_stride, staged); break;
            case DT::BF16: run_gather<kv_bf16>(blocks, offs, kv_dim, kv_stride, staged); break;
            case DT::F16: run_gather<kv_f16>(blocks, offs, kv_dim, kv_stride, staged); break;
        }
        CHECK(staged.guards_intact(), "gather guard bytes changed");
        for (size_t i = 0; i < offs.size(); ++i)
            for (int e = 0; e < 2 * kv_dim; ++e) {
                const int kv = e >= kv_dim ? 1 : 0;
                const size_t at = static_cast<size_t>(offs[i] + kv * kv_stride + (e - kv * kv_dim));
                CHECK(std::memcmp(staged.data() + (i * 2 * kv_dim + e) * es, &cacheb[at * es], es) == 0,
                      "gather row %zu element %d differs", i, e);
            }
    }
}

int main(int argc, char** argv) {
    const unsigned long long seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 7;
    std::mt19937_64 rng(seed);
    const DT dts[] = {DT::F32, DT::BF16, DT::F16};
    std::vector<Case> cases;
    // Fixed shapes covering tails in every dimension, then random ones.
    for (DT t : dts) {
        for (DT c : dts) {
            // decode: M <= 16, N not a multiple of the column tile, K not a multiple of 32
            cases.push_back(Case{t, c, true, 3, 5, 72, 24, 2, 6, 4, 2, 16, 1});
            // prefill: M and N both span two tiles with tails, odd pairs off
            cases.push_back(Case{t, c, false, 3, 50, 40, 132, 1, 8, 16, 2, 24, 1});
        }
    }
    std::uniform_int_distribution<int> pick(0, 2);
    for (int i = 0; i < 6; ++i) {
        const bool decode = i % 2 == 0;
        Case cs{dts[pick(rng)], dts[pick(rng)], decode, 1, 1, 8, 2, 1, 2, 1, 1, 1, 0};
        cs.batch = std::uniform_int_distribution<int>(1, 4)(rng);
        cs.seq = decode ? std::uniform_int_distribution<int>(1, 16 / cs.batch)(rng)
                        : std::uniform_int_distribution<int>(1, 90)(rng);
        cs.k = 8 * std::uniform_int_distribution<int>(1, 12)(rng);
        cs.q_dim = std::uniform_int_distribution<int>(1, 70)(rng);  // odd q_dim takes the unpaired stores
        cs.hkv = std::uniform_int_distribution<int>(1, 3)(rng);
        cs.d = std::uniform_int_distribution<int>(1, 20)(rng);
        cs.page = std::uniform_int_distribution<int>(1, 8)(rng);
        cs.layers = std::uniform_int_distribution<int>(1, 3)(rng);
        cs.layer = std::uniform_int_distribution<int>(0, cs.layers - 1)(rng);
        cs.pages = cs.batch * ((cs.seq + 2 * cs.page) / cs.page + 2);
        cases.push_back(cs);
    }
    // the 8B decode shape's column count (N = 6144) with a short K
    cases.push_back(Case{DT::BF16, DT::BF16, true, 2, 1, 64, 4096, 8, 128, 16, 1, 4, 0});

    for (const Case& cs : cases) run_case(cs, rng);
    if (failures) {
        std::fprintf(stderr, "%d case(s) failed\n", failures);
        return 1;
    }
    std::printf("all %zu cases passed\n", cases.size());
    return 0;
}
