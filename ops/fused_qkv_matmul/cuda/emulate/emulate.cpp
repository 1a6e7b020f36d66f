// Runs the exact kernel bodies of ../fused_qkv.cu on the CPU and checks them
// against a double-precision reference of the op contract.
//
// This is not a CUDA emulator in general: it supplies just the primitives
// fused_qkv.cu keeps in its KVJIT_EMULATE block (16-byte loads, cp.async,
// ldmatrix, mma.sync m16n8k16, warp shuffles, __syncthreads, bf16/f16
// rounding, and for the FP8 epilogue __ldcg, __threadfence, atomicAdd and
// the E4M3 convert), with the fragment layouts of the PTX ISA manual.
//
// Threads. A block runs as 256 fibers (ucontext), one per CUDA thread, on one
// OS thread; blocks run one after another. A fiber runs until it reaches a
// barrier (sync_block, or a warp collective: ldmatrix, mma, shuffle), then a
// deterministic scheduler resumes the runnable thread that comes first in a
// priority order of the warps and of the lanes within a warp. So between two
// __syncthreads the first warp runs as far as it can before the second
// starts, and so on: the most skewed schedule there is. Cases take turns
// with three orders:
//   asc   warps and lanes in ascending order;
//   desc  descending;
//   perm  a random permutation of the warps and one of the lanes, drawn again
//         (seeded) at every __syncthreads.
// Without a barrier between a write to shared memory and another warp's read
// of it, an order that runs the reader first shows it the old contents (or
// poison), and one that runs the writer first lets it run on to its next
// write before the reader comes. Finer interleavings (warps in lockstep) are
// not explored: it is the skewed schedules that expose a missing barrier. A
// run is deterministic for a seed.
//
// Shared memory. `__shared__` is `static thread_local`: one copy, as every
// fiber runs on the one OS thread, and the executable's TLS block is exactly
// the kernels' shared memory (this file declares no thread_local of its own).
// It is filled with 0xFF bytes, NaN in every dtype, before every block: what
// a block reads without having written it is NaN.
//
// cp.async is deferred, per thread, like the hardware's async-copy groups:
// cp_async16 records (dst, src, zero-fill) and fills the 16 destination bytes
// with 0xFF at once; cp_async_commit closes the thread's open group;
// cp_async_wait<N> performs, oldest first, every committed group but the
// newest N. A destination thus holds NaN from the issue until the issuing
// thread's wait: the copy clobbers the old contents as early, and lands as
// late, as the hardware may do either. A wait depth too shallow reads NaN, and
// refilling a stage that a warp still reads (a missing barrier) hands that
// warp NaN.
//
// Hazard checks, on top of the value checks. Shared memory is tracked in
// 16-byte chunks, with an epoch that every __syncthreads ends; a case fails
// when
//   - ldmatrix reads a chunk whose cp.async its issuer has not waited for;
//   - ldmatrix reads a chunk that a thread of another warp's wait_group
//     completed in the current epoch (wait_group makes a copy visible to its
//     own thread; other warps need a __syncthreads first);
//   - cp.async targets a chunk that another warp read with ldmatrix in the
//     current epoch (a stage refilled without a barrier), or one with a copy
//     still pending;
//   - a thread ends the kernel with copies not waited for, a 16-byte load or
//     copy is misaligned (or its shared address outside shared memory), or a
//     barrier is not reached by every thread (a deadlock).
// These see a missing barrier or wait whether or not the order at hand made
// it corrupt a value. Plain shared loads and stores (the f32 tiles, the
// split-K reductions) are not tracked; races on them show up through the
// poison and the orders.
//
// FP8 E4M3 caches (the _kvf8e4m3 variants). Blocks run one after another in
// the case's order (ascending, descending, or a seeded permutation), so the
// epilogue's "the block completing a g-block quantizes it" is exercised with
// every part order; a block quantizing too early reads the NaN-poisoned f32
// staging buffer. The check: Q and the staged f32 K/V against f64, then each
// g-block's codes and scale bit for bit against a port of
// kvjit_core::fp8::quantize_block applied to those same staged values,
// every other code and scale byte unchanged, guards intact, the counters
// back to zero. Cases put g-blocks inside one column tile and across two to
// four (decode tiles of 4 and 16 columns, prefill tiles of 64 and 128),
// g = 1 up to 320 (past the values a lane keeps in registers), odd q_dim,
// and g-blocks holding NaN and ±inf beside finite values, ±inf beside
// zeros only (scale 0), and zeros only. Before the cases, the software
// convert e4m3_sw (the sm_80 path; sm_90's hardware cvt needs a GPU:
// tests/cuda.rs) is checked on ~5.4M values, every tie among them, against
// the port of e4m3_from_f32 and a brute-force nearest-code search. What the
// sequential blocks cannot show is a missing __threadfence (memory ordering
// between concurrently running blocks).
//
// What it cannot check: that nvcc/ptxas compile the same code the same way,
// the memory model beyond the above, timing. That needs a GPU
// (scripts/gpu-check.sh).
//
// Build and run: scripts/emulate-cuda.sh (g++ -std=c++20 -O2; Linux/glibc for
// ucontext and the TLS block). `emulate [SEED] [--fail-fast]` exits 0 when
// every case passes. -DKVJIT_KERNEL_SOURCE='"path"' builds it on another copy
// of the kernels: scripts/emulate-cuda.sh --mutants does, to check that each
// of a set of broken wait depths and barriers fails.

#include <link.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define KVJIT_EMULATE 1
#ifndef KVJIT_KERNEL_SOURCE
#define KVJIT_KERNEL_SOURCE "../fused_qkv.cu"
#endif

// ---------------------------------------------------------------- CUDA surface

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local  // see "Shared memory" above
#define __align__(n) __attribute__((aligned(n)))

struct uint4 {
    uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return uint4{x, y, z, w}; }
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
dim3 threadIdx, blockIdx, gridDim;  // set by the scheduler on every switch
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

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

// ---------------------------------------------------------------- the machine

namespace emu {

constexpr int NT = 256, NW = NT / 32;
constexpr size_t STACK = 128 * 1024, PAGE = 4096;

enum class Order { Asc, Desc, Perm };
inline const char* order_name(Order o) { return o == Order::Asc ? "asc" : o == Order::Desc ? "desc" : "perm"; }

struct Copy {
    uint8_t* dst;
    const uint8_t* src;
    bool pred;  // false: zero-fill
};
struct Thread {
    ucontext_t ctx;
    std::vector<Copy> open;                 // issued since the last commit
    std::deque<std::vector<Copy>> groups;   // committed, not yet waited for; oldest first
    unsigned collectives = 0;               // warp collectives so far (parity picks the mailbox)
};
// A warp's mailboxes for collectives, two so that a lane may run one
// collective ahead of the slowest lane's read of the previous one.
struct Warp {
    int arrived = 0;
    uint64_t slot[2][32][8];
    uint8_t rows[2][32][16];  // ldmatrix: the 32 rows, read at once
};
// One 16-byte chunk of shared memory.
struct Chunk {
    int pending = -1;    // thread whose cp.async into it has not completed
    int landed_by = -1;  // thread whose wait_group completed the last copy into it
    uint64_t issued_epoch = 0, landed_epoch = 0, read_epoch = 0;
    unsigned read_warps = 0;  // warps that read it with ldmatrix in read_epoch
};

struct Machine {
    Thread thread[NT];
    Warp warp[NW];
    ucontext_t main;
    uint64_t ready[NT / 64] = {};
    int current = 0, live = 0, block_arrived = 0;
    uint64_t epoch = 0;
    Order order = Order::Asc;
    std::mt19937_64 rng;  // draws the perm order
    int warp_order[NW], lane_order[32];
    const std::function<void()>* kernel = nullptr;
    uint8_t* stacks = nullptr;
    uint8_t* smem = nullptr;
    size_t smem_bytes = 0;
    std::vector<Chunk> chunk;
    long hazards = 0;
    std::string first_hazard;
};
static Machine* mach = nullptr;

__attribute__((format(printf, 1, 2))) static void hazard(const char* fmt, ...) {
    if (mach->hazards++ > 0) return;
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char where[64];
    std::snprintf(where, sizeof where, "block (%u, %u): ", blockIdx.x, blockIdx.y);
    mach->first_hazard = std::string(where) + msg;
}

inline void set_ready(int t) { mach->ready[t >> 6] |= uint64_t{1} << (t & 63); }
inline void clear_ready(int t) { mach->ready[t >> 6] &= ~(uint64_t{1} << (t & 63)); }

// The priority order for the next epoch (block start, and every __syncthreads).
static void reorder() {
    Machine& m = *mach;
    for (int i = 0; i < NW; ++i) m.warp_order[i] = m.order == Order::Desc ? NW - 1 - i : i;
    for (int i = 0; i < 32; ++i) m.lane_order[i] = m.order == Order::Desc ? 31 - i : i;
    if (m.order == Order::Perm) {
        std::shuffle(m.warp_order, m.warp_order + NW, m.rng);
        std::shuffle(m.lane_order, m.lane_order + 32, m.rng);
    }
}

// The runnable thread first in priority order, or -1.
static int pick() {
    const Machine& m = *mach;
    for (int w : m.warp_order) {
        const uint32_t lanes = static_cast<uint32_t>(m.ready[w / 2] >> (32 * (w % 2)));
        if (!lanes) continue;
        for (int l : m.lane_order)
            if (lanes >> l & 1) return w * 32 + l;
    }
    return -1;
}

// Back to the scheduler; returns when it picks this thread again.
inline void suspend() { swapcontext(&mach->thread[mach->current].ctx, &mach->main); }

// Warp barrier; the last lane to arrive runs done(warp, mailbox) first.
inline void warp_sync(void (*done)(int, int), int bank) {
    const int t = mach->current, w = t / 32;
    Warp& ws = mach->warp[w];
    if (++ws.arrived == 32) {
        ws.arrived = 0;
        if (done) done(w, bank);
        mach->ready[w / 2] |= uint64_t{0xffffffffu} << (32 * (w % 2));
    } else {
        clear_ready(t);
    }
    suspend();
}

inline void block_sync() {
    if (++mach->block_arrived == NT) {
        mach->block_arrived = 0;
        ++mach->epoch;
        reorder();
        for (uint64_t& r : mach->ready) r = ~uint64_t{0};
    } else {
        clear_ready(mach->current);
    }
    suspend();
}

inline int next_bank() { return static_cast<int>(mach->thread[mach->current].collectives++ & 1); }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The chunk at p, or null (and a hazard) when p is not a 16-byte aligned shared address.
inline Chunk* chunk_at(const void* p, const char* what) {
    const auto* b = static_cast<const uint8_t*>(p);
    if (b < mach->smem || b + 16 > mach->smem + mach->smem_bytes || !aligned16(b)) {
        hazard("%s %p is not a 16-byte aligned shared-memory address", what, p);
        return nullptr;
    }
    return &mach->chunk[static_cast<size_t>(b - mach->smem) / 16];
}
inline size_t offset_of(const Chunk* c) { return static_cast<size_t>(c - mach->chunk.data()) * 16; }

inline void cp_async(uint8_t* dst, const uint8_t* src, bool pred) {
    const int t = mach->current, w = t / 32;
    Chunk* c = chunk_at(dst, "cp.async destination");
    if (!c) return;
    if (pred && !aligned16(src))
        hazard("thread %d: cp.async source %p is not 16-byte aligned", t, static_cast<const void*>(src));
    if (c->pending >= 0) {
        hazard("thread %d: cp.async into shared +%zu, whose cp.async by thread %d is still pending", t, offset_of(c),
               c->pending);
    } else if (c->read_epoch == mach->epoch && (c->read_warps & ~(1u << w))) {
        hazard("thread %d (warp %d): cp.async overwrites shared +%zu, which warp %d read since the last "
               "__syncthreads (stage refilled without a barrier)",
               t, w, offset_of(c), __builtin_ctz(c->read_warps & ~(1u << w)));
    }
    c->pending = t;
    c->issued_epoch = mach->epoch;
    std::memset(dst, 0xFF, 16);
    mach->thread[t].open.push_back(Copy{dst, src, pred});
}

inline void commit() {
    Thread& th = mach->thread[mach->current];
    th.groups.push_back(std::move(th.open));
    th.open.clear();
}

inline void wait_group(size_t n) {
    const int t = mach->current;
    Thread& th = mach->thread[t];
    while (th.groups.size() > n) {
        for (const Copy& cp : th.groups.front()) {
            if (cp.pred) {
                std::memcpy(cp.dst, cp.src, 16);
            } else {
                std::memset(cp.dst, 0, 16);
            }
            Chunk& c = mach->chunk[static_cast<size_t>(cp.dst - mach->smem) / 16];
            if (c.pending == t) c.pending = -1;
            c.landed_by = t;
            c.landed_epoch = mach->epoch;
        }
        th.groups.pop_front();
    }
}

// ldmatrix, run by the last lane to arrive: all 32 rows are read at once.
inline void ldmatrix_rows(int w, int bank) {
    Warp& ws = mach->warp[w];
    for (int l = 0; l < 32; ++l) {
        const auto* p = reinterpret_cast<const uint8_t*>(ws.slot[bank][l][0]);
        Chunk* c = chunk_at(p, "ldmatrix row address");
        if (!c) {
            std::memset(ws.rows[bank][l], 0xFF, 16);
            continue;
        }
        if (c->pending >= 0 && c->issued_epoch < mach->epoch) {
            hazard("warp %d: ldmatrix reads shared +%zu, whose cp.async by thread %d (issued before the last "
                   "__syncthreads) has not been waited for (cp.async.wait_group depth too shallow?)",
                   w, offset_of(c), c->pending);
        } else if (c->pending >= 0) {
            hazard("warp %d: ldmatrix reads shared +%zu, which thread %d refilled with a cp.async since the last "
                   "__syncthreads (a stage refilled while in use, or read with no barrier after its wait?)",
                   w, offset_of(c), c->pending);
        } else if (c->landed_epoch == mach->epoch && c->landed_by / 32 != w) {
            hazard("warp %d: ldmatrix reads shared +%zu, which thread %d's cp.async.wait_group completed with no "
                   "__syncthreads since",
                   w, offset_of(c), c->landed_by);
        }
        if (c->read_epoch != mach->epoch) {
            c->read_epoch = mach->epoch;
            c->read_warps = 0;
        }
        c->read_warps |= 1u << w;
        std::memcpy(ws.rows[bank][l], p, 16);
    }
}

static void fiber_main() {
    (*mach->kernel)();
    clear_ready(mach->current);
    --mach->live;
}  // returns to the scheduler through uc_link

static int find_tls(dl_phdr_info* info, size_t, void*) {
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        if (info->dlpi_phdr[i].p_type == PT_TLS) {
            mach->smem = static_cast<uint8_t*>(info->dlpi_tls_data);
            mach->smem_bytes = info->dlpi_phdr[i].p_memsz;
        }
    }
    return 1;  // the first module is the executable
}

static void init() {
    mach = new Machine;
    void* s = mmap(nullptr, NT * (STACK + PAGE), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (s == MAP_FAILED) {
        std::perror("mmap");
        std::exit(2);
    }
    mach->stacks = static_cast<uint8_t*>(s);
    for (int t = 0; t < NT; ++t) mprotect(mach->stacks + t * (STACK + PAGE), PAGE, PROT_NONE);  // guard pages
    dl_iterate_phdr(find_tls, nullptr);
    if (!mach->smem || mach->smem_bytes == 0 || !aligned16(mach->smem)) {
        std::fprintf(stderr, "emulate: cannot find the kernels' shared memory (the executable's TLS block)\n");
        std::exit(2);
    }
    mach->chunk.resize((mach->smem_bytes + 15) / 16);
}

// Runs one block (blockIdx set) to completion under the current order.
static void run_block(const std::function<void()>& kernel) {
    Machine& m = *mach;
    ++m.epoch;
    std::memset(m.smem, 0xFF, m.smem_bytes);  // uninitialized shared memory
    std::fill(m.chunk.begin(), m.chunk.end(), Chunk{});
    for (Warp& w : m.warp) w.arrived = 0;
    m.block_arrived = 0;
    m.kernel = &kernel;
    reorder();
    for (int t = 0; t < NT; ++t) {
        Thread& th = m.thread[t];
        th.open.clear();
        th.groups.clear();
        th.collectives = 0;
        getcontext(&th.ctx);
        th.ctx.uc_stack.ss_sp = m.stacks + t * (STACK + PAGE) + PAGE;
        th.ctx.uc_stack.ss_size = STACK;
        th.ctx.uc_link = &m.main;
        makecontext(&th.ctx, fiber_main, 0);
        set_ready(t);
    }
    m.live = NT;
    while (m.live > 0) {
        const int t = pick();
        if (t < 0) {
            hazard("deadlock: %d thread(s) wait at a barrier (%d at __syncthreads) that the others never reach",
                   m.live, m.block_arrived);
            break;  // the stuck fibers are abandoned; the next block makes new ones
        }
        m.current = t;
        threadIdx = dim3{static_cast<unsigned>(t), 0, 0};
        swapcontext(&m.main, &m.thread[t].ctx);
    }
    for (int t = 0; t < NT; ++t) {
        size_t n = m.thread[t].open.size();
        for (const auto& g : m.thread[t].groups) n += g.size();
        if (n) hazard("thread %d ends the kernel with %zu cp.async copies not waited for", t, n);
    }
}

}  // namespace emu

namespace kvjit {

inline uint4 ldg16(const void* p) {
    if (!emu::aligned16(p)) emu::hazard("thread %d: misaligned 16-byte global load from %p", emu::mach->current, p);
    uint4 v;
    std::memcpy(&v, p, 16);
    return v;
}
inline uint4 ldcs16(const void* p) { return ldg16(p); }
inline void sync_block() { emu::block_sync(); }

inline float shfl_xor(float v, int mask) {
    const int t = emu::mach->current, lane = t % 32, bank = emu::next_bank();
    emu::Warp& w = emu::mach->warp[t / 32];
    w.slot[bank][lane][0] = bits_of_f32(v);
    emu::warp_sync(nullptr, bank);
    return f32_of_bits(static_cast<uint32_t>(w.slot[bank][lane ^ mask][0]));
}

// Deferred: see "cp.async" in the header.
inline void cp_async16(void* smem, const void* src, bool pred) {
    emu::cp_async(static_cast<uint8_t*>(smem), static_cast<const uint8_t*>(src), pred);
}
inline void cp_async_commit() { emu::commit(); }
template <int N>
inline void cp_async_wait() {
    static_assert(N >= 0, "cp.async.wait_group takes a non-negative count");
    emu::wait_group(N);
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    const int t = emu::mach->current, lane = t % 32, bank = emu::next_bank();
    emu::Warp& w = emu::mach->warp[t / 32];
    w.slot[bank][lane][0] = reinterpret_cast<uint64_t>(smem);
    emu::warp_sync(emu::ldmatrix_rows, bank);
    for (int j = 0; j < 4; ++j) {
        // matrix j, row lane / 4 (its address came from lane 8j + lane / 4), elements 2·(lane % 4) + {0, 1}
        std::memcpy(&r[j], w.rows[bank][8 * j + lane / 4] + 4 * (lane % 4), 4);
    }
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
// Slots: a0..a3, b0, b1, then (c0, c1) and (c2, c3) as f32 bit pairs, in and out.
template <typename T>
void mma_tile(int warp, int bank) {
    auto& s = emu::mach->warp[warp].slot[bank];
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 2; ++i) {
            A[g][2 * t + i] = elem<T>(static_cast<uint32_t>(s[l][0]), i);
            A[g + 8][2 * t + i] = elem<T>(static_cast<uint32_t>(s[l][1]), i);
            A[g][2 * t + 8 + i] = elem<T>(static_cast<uint32_t>(s[l][2]), i);
            A[g + 8][2 * t + 8 + i] = elem<T>(static_cast<uint32_t>(s[l][3]), i);
            B[2 * t + i][g] = elem<T>(static_cast<uint32_t>(s[l][4]), i);
            B[2 * t + 8 + i][g] = elem<T>(static_cast<uint32_t>(s[l][5]), i);
        }
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        float d[4] = {f32_of_bits(static_cast<uint32_t>(s[l][6])), f32_of_bits(static_cast<uint32_t>(s[l][6] >> 32)),
                      f32_of_bits(static_cast<uint32_t>(s[l][7])), f32_of_bits(static_cast<uint32_t>(s[l][7] >> 32))};
        for (int e = 0; e < 4; ++e) {
            const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
            float sum = 0.f;
            for (int k = 0; k < 16; ++k) sum = std::fma(A[row][k], B[k][col], sum);
            d[e] += sum;
        }
        s[l][6] = bits_of_f32(d[0]) | static_cast<uint64_t>(bits_of_f32(d[1])) << 32;
        s[l][7] = bits_of_f32(d[2]) | static_cast<uint64_t>(bits_of_f32(d[3])) << 32;
    }
}

template <typename T>
inline void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    const int t = emu::mach->current, lane = t % 32, bank = emu::next_bank();
    auto& s = emu::mach->warp[t / 32].slot[bank][lane];
    for (int i = 0; i < 4; ++i) s[i] = a[i];
    s[4] = b[0];
    s[5] = b[1];
    s[6] = bits_of_f32(d[0]) | static_cast<uint64_t>(bits_of_f32(d[1])) << 32;
    s[7] = bits_of_f32(d[2]) | static_cast<uint64_t>(bits_of_f32(d[3])) << 32;
    emu::warp_sync(mma_tile<T>, bank);
    d[0] = f32_of_bits(static_cast<uint32_t>(s[6]));
    d[1] = f32_of_bits(static_cast<uint32_t>(s[6] >> 32));
    d[2] = f32_of_bits(static_cast<uint32_t>(s[7]));
    d[3] = f32_of_bits(static_cast<uint32_t>(s[7] >> 32));
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

// FP8 epilogue primitives. Blocks run one after another, so a block's
// stores are visible to every later block: the fence is a no-op and the
// atomic a plain read-modify-write. What this cannot show is a missing
// fence on the GPU; what it does show is the counting itself (a block that
// quantizes before every part of a g-block landed reads the NaN-poisoned
// scratch), under ascending, descending and random block orders.
inline unsigned f32_bits(float v) { return bits_of_f32(v); }
inline float ldcg(const float* p) { return *p; }
inline void fence_gpu() {}
inline unsigned atomic_add(unsigned* p, unsigned v) {
    const unsigned old = *p;
    *p = old + v;
    return old;
}
// The sm_80 path: the software convert of the kernel source.
inline unsigned e4m3_sw(float v);
inline unsigned to_e4m3(float v) { return e4m3_sw(v); }

}  // namespace kvjit

#include KVJIT_KERNEL_SOURCE

// ---------------------------------------------------------------- launching

// Blocks one after another, each as 256 fibers (see "Threads" above), in
// the case's order: ascending, descending, or a random permutation (the FP8
// epilogue's "last block of a g-block quantizes it" must hold in any order).
static void launch(dim3 grid, const std::function<void()>& kernel) {
    gridDim = grid;
    std::vector<dim3> blocks;
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) blocks.push_back(dim3{bx, by, 0});
    if (emu::mach->order == emu::Order::Desc) std::reverse(blocks.begin(), blocks.end());
    if (emu::mach->order == emu::Order::Perm) std::shuffle(blocks.begin(), blocks.end(), emu::mach->rng);
    for (const dim3& b : blocks) {
        blockIdx = b;
        emu::run_block(kernel);
    }
}

// ---------------------------------------------------------------- the check

enum class DT { F32, BF16, F16, F8 };  // F8: E4M3 codes (a cache dtype only)
static const char* dt_name(DT d) {
    return d == DT::F32 ? "f32" : d == DT::BF16 ? "bf16" : d == DT::F16 ? "f16" : "f8e4m3";
}
static size_t dt_size(DT d) { return d == DT::F32 ? 4 : d == DT::F8 ? 1 : 2; }
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
    DT t, c;  // c is ignored when g > 0
    bool decode;
    int batch, seq, k, q_dim, hkv, d, page, layers, pages, layer;
    int g = 0;             // > 0: an FP8 E4M3 cache with g values per scale (the _kvf8e4m3 variants)
    bool special = false;  // FP8: NaN, ±inf, ±inf-and-zeros and all-zero g-blocks among the K/V columns
};

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
        case DT::F8: break;  // FP8 cases take check_fp8
    }
}

// ---------------------------------------------------------------- FP8 E4M3

// The reference: kvjit_core::fp8::e4m3_from_f32 ported line by line (the
// kernels' e4m3_sw gets there another way).
static uint8_t e4m3_ref(float value) {
    const uint8_t sign = static_cast<uint8_t>((bits_of_f32(value) >> 24) & 0x80);
    if (std::isnan(value)) return sign | 0x7f;
    const float magnitude = std::fabs(value);
    if (magnitude >= 448.f) return sign | 0x7e;
    if (magnitude < f32_of_bits(0x3c800000u))  // nearbyint: ties to even in the default rounding mode
        return sign | static_cast<uint8_t>(std::nearbyint(magnitude * 512.f));
    const uint32_t bits = bits_of_f32(magnitude);
    const uint32_t rounded = (bits + 0x7ffffu + ((bits >> 20) & 1u)) >> 20;
    return sign | static_cast<uint8_t>(rounded - ((127u - 7u) << 3));
}

// A code's value from the OCP E4M3FN fields, in double (NaN for S.1111.111).
static double e4m3_value(uint8_t code) {
    const double sign = code & 0x80 ? -1.0 : 1.0;
    const int exponent = (code >> 3) & 0xf, mantissa = code & 7;
    if (exponent == 0xf && mantissa == 7) return NAN;
    if (exponent == 0) return sign * mantissa / 8.0 * std::ldexp(1.0, -6);
    return sign * (1.0 + mantissa / 8.0) * std::ldexp(1.0, exponent - 7);
}

// The nearest finite code by brute force (ties to the even code, past 448
// saturated, NaN to NaN with its sign): a third opinion for the convert check.
static uint8_t e4m3_nearest(float value) {
    static const std::vector<double> table = [] {
        std::vector<double> t(0x7f);
        for (int code = 0; code <= 0x7e; ++code) t[code] = e4m3_value(static_cast<uint8_t>(code));
        return t;
    }();
    const uint8_t sign = std::signbit(value) ? 0x80 : 0;
    if (std::isnan(value)) return sign | 0x7f;
    const double target = std::fabs(static_cast<double>(value));
    if (std::isinf(target)) return sign | 0x7e;
    int best = 0;
    for (int code = 1; code <= 0x7e; ++code) {
        const double d = std::fabs(table[code] - target), best_d = std::fabs(table[best] - target);
        if (d < best_d || (d == best_d && code % 2 == 0)) best = code;
    }
    return sign | static_cast<uint8_t>(best);
}

// kvjit_core::fp8::quantize_block on the same f32 values: the absmax of
// the finite values (±inf and NaN skipped), scale = absmax / 448, each code
// of x / scale (±inf saturates to ±448), or of x · 0 for a finite x when
// the scale is 0.
static float quantize_block_ref(const float* values, int g, uint8_t* codes) {
    float max = 0.f;
    for (int i = 0; i < g; ++i)
        if (std::isfinite(values[i])) max = std::fmax(max, std::fabs(values[i]));
    const float scale = max / 448.f;
    for (int i = 0; i < g; ++i)
        codes[i] = e4m3_ref(scale == 0.f && std::isfinite(values[i]) ? values[i] * 0.f : values[i] / scale);
    return scale;
}

static int failures = 0, failed_cases = 0;
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

// The kernels' software convert (the sm_80 path) against the port and the
// brute-force search: every (sign, exponent, top 11 mantissa bits) with the
// low 12 bits 0, 1, 0x7ff, 0x800 and 0xfff (every E4M3 tie, normal and
// subnormal, and its neighbours), every code's value and the midpoints
// between neighbouring codes with their f32 neighbours, ±0, ±inf, NaNs of
// both signs, f32 subnormals, and random bit patterns.
static void check_convert(unsigned long long seed) {
    std::printf("convert e4m3_sw (the sm_80 path) vs kvjit_core::fp8::e4m3_from_f32 and a brute-force search\n");
    std::fflush(stdout);
    const int before = failures;
    [&] {
        long n = 0;
        const uint32_t lows[] = {0u, 1u, 0x7ffu, 0x800u, 0xfffu};
        for (uint32_t top = 0; top < (1u << 20); ++top) {
            for (uint32_t low : lows) {
                const float v = f32_of_bits(top << 12 | low);
                const unsigned got = kvjit::e4m3_sw(v), want = e4m3_ref(v);
                CHECK(got == want, "e4m3_sw(%a = 0x%08x) = 0x%02x, e4m3_from_f32 gives 0x%02x", v, bits_of_f32(v), got,
                      want);
                ++n;
            }
        }
        std::vector<float> probe = {0.f, -0.f, INFINITY, -INFINITY, std::nanf(""), -std::nanf(""),
                                    f32_of_bits(0x7f800001u), f32_of_bits(0xffffffffu), f32_of_bits(1u),
                                    f32_of_bits(0x807fffffu), 448.f, -448.f, 464.f, 480.f, 1e30f, FLT_MAX};
        for (int code = 0; code < 256; ++code) {
            const double v = e4m3_value(static_cast<uint8_t>(code));
            if (std::isnan(v)) continue;
            probe.push_back(static_cast<float>(v));
            const double next = code == 0x7e || code == 0xfe ? v * 480.0 / 448.0 : e4m3_value(static_cast<uint8_t>(code + 1));
            const float mid = static_cast<float>((v + next) / 2);  // exact: a short binary fraction
            probe.push_back(mid);
            probe.push_back(std::nextafter(mid, 0.f));
            probe.push_back(std::nextafter(mid, 2 * mid));
        }
        std::mt19937_64 rng(seed);
        for (int i = 0; i < 200000; ++i) probe.push_back(f32_of_bits(static_cast<uint32_t>(rng())));
        for (float v : probe) {
            const unsigned got = kvjit::e4m3_sw(v), port = e4m3_ref(v), brute = e4m3_nearest(v);
            CHECK(port == brute, "the port: e4m3_from_f32(%a) = 0x%02x, the nearest code is 0x%02x", v, port, brute);
            CHECK(got == brute, "e4m3_sw(%a = 0x%08x) = 0x%02x, the nearest code is 0x%02x", v, bits_of_f32(v), got,
                  brute);
            ++n;
        }
        std::printf("  %ld values, bit for bit\n", n);
    }();
    if (failures > before) ++failed_cases;
    std::fflush(stdout);
    std::fflush(stderr);
}

template <typename T>
static void run_fp8(const Case& cs, Guarded& x, Guarded& w, Guarded& out, Guarded& codes, Guarded& scales,
                    Guarded& scratch, Guarded& counters, const std::vector<long long>& row_off, int M, int N,
                    long long kv_stride) {
    const T* xp = reinterpret_cast<const T*>(x.data());
    const T* wp = reinterpret_cast<const T*>(w.data());
    T* op = reinterpret_cast<T*>(out.data());
    uint8_t* cp = codes.data();
    float* sp = reinterpret_cast<float*>(scales.data());
    float* scr = reinterpret_cast<float*>(scratch.data());
    unsigned* cnt = reinterpret_cast<unsigned*>(counters.data());
    const long long* ro = row_off.data();
    const int K = cs.k, q_dim = cs.q_dim, kv_dim = cs.hkv * cs.d, g = cs.g;
    const bool f32 = kvjit::same_type<T, float>::value;
    if (cs.decode) {
        const int cols = f32 ? kvjit::DEC_SIMT_COLS : kvjit::DEC_MMA_COLS;
        launch(dim3{static_cast<unsigned>((N + cols - 1) / cols), 1, 1}, [&] {
            kvjit::decode_fp8<T>(xp, wp, op, cp, sp, ro, M, K, N, q_dim, kv_dim, kv_stride, g, scr, cnt);
        });
    } else {
        const int bm = f32 ? kvjit::PS_BM : kvjit::PF_BM, bn = f32 ? kvjit::PS_BN : kvjit::PF_BN;
        launch(dim3{static_cast<unsigned>((N + bn - 1) / bn), static_cast<unsigned>((M + bm - 1) / bm), 1}, [&] {
            kvjit::prefill_fp8<T>(xp, wp, op, cp, sp, ro, M, K, N, q_dim, kv_dim, kv_stride, g, scr, cnt);
        });
    }
}

// The f64 value of C[r, n].
static double c_f64(const std::vector<float>& xv, const std::vector<float>& wv, int K, int r, int n) {
    double s = 0;
    for (int k = 0; k < K; ++k)
        s += static_cast<double>(xv[static_cast<size_t>(r) * K + k]) * wv[static_cast<size_t>(n) * K + k];
    return s;
}

// An FP8 case: Q against f64; the f32 K/V the kernel staged in its scratch
// against f64; then every g-block of every valid row: codes and scale bit for
// bit what kvjit_core::fp8::quantize_block makes of those same f32 values;
// every other code and scale byte untouched, guards intact, counters left
// zero; the gather kernels read the written codes and scales back.
static void check_fp8(const Case& cs, const std::vector<float>& xv, const std::vector<float>& wv, Guarded& x,
                      Guarded& w, const std::vector<long long>& row_off, long long kv_stride, size_t cache_elems) {
    const int M = cs.batch * cs.seq, K = cs.k, kv_dim = cs.hkv * cs.d, N = cs.q_dim + 2 * kv_dim, g = cs.g;
    const int nblocks = 2 * kv_dim / g;
    const int bm = cs.t == DT::F32 ? kvjit::PS_BM : kvjit::PF_BM;
    const int row_tiles = cs.decode ? 1 : (M + bm - 1) / bm;
    Guarded out(static_cast<size_t>(M) * cs.q_dim * dt_size(cs.t)), codes(cache_elems), scales(cache_elems / g * 4),
        scratch(static_cast<size_t>(M) * 2 * kv_dim * 4), counters(static_cast<size_t>(row_tiles) * nblocks * 4);
    out.fill(0xFF);  // NaN everywhere
    codes.fill(0xFF);
    scales.fill(0xFF);
    scratch.fill(0xFF);
    counters.fill(0);  // the host zeroes them before every launch
    const std::vector<uint8_t> codes0(codes.data(), codes.data() + codes.bytes),
        scales0(scales.data(), scales.data() + scales.bytes);

    switch (cs.t) {
        case DT::F32: run_fp8<float>(cs, x, w, out, codes, scales, scratch, counters, row_off, M, N, kv_stride); break;
        case DT::BF16: run_fp8<kv_bf16>(cs, x, w, out, codes, scales, scratch, counters, row_off, M, N, kv_stride); break;
        case DT::F16: run_fp8<kv_f16>(cs, x, w, out, codes, scales, scratch, counters, row_off, M, N, kv_stride); break;
        case DT::F8: CHECK(false, "no FP8 compute dtype"); break;
    }
    CHECK(x.guards_intact() && w.guards_intact(), "input guard bytes changed");
    CHECK(out.guards_intact(), "output guard bytes changed");
    CHECK(codes.guards_intact() && scales.guards_intact(), "cache (codes or scales) guard bytes changed");
    CHECK(scratch.guards_intact() && counters.guards_intact(), "scratch or counters guard bytes changed");
    for (int i = 0; i < row_tiles * nblocks; ++i) {
        unsigned c;
        std::memcpy(&c, counters.data() + 4 * i, 4);
        CHECK(c == 0, "counter %d (row tile %d, g-block %d) is %u after the launch, not 0", i, i / nblocks, i % nblocks,
              c);
    }

    const double tol_scale = std::sqrt(static_cast<double>(K)) * 0.6 + 1.0;
    std::vector<uint8_t> outb(out.data(), out.data() + out.bytes);
    const float* staged = reinterpret_cast<const float*>(scratch.data());
    for (int r = 0; r < M; ++r) {
        for (int n = 0; n < N; ++n) {
            if (n >= cs.q_dim && row_off[r] < 0) continue;
            const double s = c_f64(xv, wv, K, r, n);
            const double got = n < cs.q_dim ? get(cs.t, outb, static_cast<size_t>(r) * cs.q_dim + n)
                                            : staged[static_cast<size_t>(r) * 2 * kv_dim + (n - cs.q_dim)];
            const double tol = (n < cs.q_dim ? eps(cs.t) : 1e-6) * (std::fabs(s) + tol_scale) + 1e-5 * tol_scale;
            if (std::isnan(s)) {
                CHECK(std::isnan(got), "C[%d, %d] = %g, expected NaN", r, n, got);
            } else if (std::isinf(s)) {
                CHECK(got == s, "C[%d, %d] = %g, expected %g", r, n, got, s);
            } else {
                CHECK(std::fabs(got - s) <= tol, "%s[%d, %d] = %g, expected %g", n < cs.q_dim ? "out" : "staged K/V",
                      r, n, got, s);
            }
        }
    }

    std::vector<uint8_t> written(cache_elems, 0), scale_written(cache_elems / g, 0);
    std::vector<uint8_t> want(g);
    long long nan_codes = 0, zero_blocks = 0, saturated = 0, inf_beside_finite = 0, inf_beside_zeros = 0;
    for (int r = 0; r < M; ++r) {
        if (row_off[r] < 0) continue;
        for (int b = 0; b < nblocks; ++b) {
            const int j = b * g;
            const long long at = row_off[r] + (j < kv_dim ? j : kv_stride + (j - kv_dim));
            const float want_scale =
                quantize_block_ref(&staged[static_cast<size_t>(r) * 2 * kv_dim + j], g, want.data());
            float got_scale;
            std::memcpy(&got_scale, scales.data() + (at / g) * 4, 4);
            CHECK(bits_of_f32(got_scale) == bits_of_f32(want_scale),
                  "row %d g-block %d: scale %a (0x%08x), quantize_block gives %a (0x%08x)", r, b, got_scale,
                  bits_of_f32(got_scale), want_scale, bits_of_f32(want_scale));
            zero_blocks += want_scale == 0.f;
            scale_written[at / g] = 1;
            for (int e = 0; e < g; ++e) {
                const uint8_t got = codes.data()[at + e];
                CHECK(got == want[e], "row %d g-block %d element %d: code 0x%02x, quantize_block gives 0x%02x (of %a)",
                      r, b, e, got, want[e], staged[static_cast<size_t>(r) * 2 * kv_dim + j + e]);
                nan_codes += (got & 0x7f) == 0x7f;
                saturated += (got & 0x7f) == 0x7e;
                if (std::isinf(staged[static_cast<size_t>(r) * 2 * kv_dim + j + e]))
                    ++(want_scale == 0.f ? inf_beside_zeros : inf_beside_finite);
                written[at + e] = 1;
            }
        }
    }
    for (size_t i = 0; i < cache_elems; ++i)
        CHECK(written[i] || codes.data()[i] == codes0[i], "code %zu changed but no valid token owns it", i);
    for (size_t i = 0; i < cache_elems / g; ++i)
        CHECK(scale_written[i] || std::memcmp(scales.data() + 4 * i, &scales0[4 * i], 4) == 0,
              "scale %zu changed but no valid token owns it", i);
    if (cs.special) {
        CHECK(nan_codes > 0 && zero_blocks > 0, "the NaN or the zero block reached no g-block");
        CHECK(g < 3 || inf_beside_finite > 0, "no ±inf beside finite values");
        CHECK(kv_dim / g < 2 || inf_beside_zeros > 0, "no ±inf beside zeros only");
    }

    // The gather kernels read back exactly the codes and scales written.
    std::vector<long long> offs, scale_offs;
    for (long long o : row_off)
        if (o >= 0) {
            offs.push_back(o);
            scale_offs.push_back(o / g);
        }
    if (!offs.empty()) {
        const int per = kv_dim / g;
        Guarded staged_codes(offs.size() * 2 * kv_dim), staged_scales(offs.size() * 2 * per * 4);
        run_gather<uint8_t>(codes, offs, kv_dim, kv_stride, staged_codes);
        run_gather<float>(scales, scale_offs, per, kv_stride / g, staged_scales);
        CHECK(staged_codes.guards_intact() && staged_scales.guards_intact(), "gather guard bytes changed");
        for (size_t i = 0; i < offs.size(); ++i)
            for (int e = 0; e < 2 * kv_dim; ++e) {
                const int kv = e >= kv_dim ? 1 : 0;
                const size_t at = static_cast<size_t>(offs[i] + kv * kv_stride + (e - kv * kv_dim));
                CHECK(staged_codes.data()[i * 2 * kv_dim + e] == codes.data()[at], "gathered code %zu/%d differs", i,
                      e);
                if ((e - kv * kv_dim) % g == 0)
                    CHECK(std::memcmp(staged_scales.data() + 4 * (i * 2 * per + e / g), scales.data() + 4 * (at / g),
                                      4) == 0,
                          "gathered scale %zu/%d differs", i, e / g);
            }
    }
    std::printf("  %lld NaN codes, %lld codes of ±448 (±inf: %lld beside finite values, %lld beside zeros only), "
                "%lld scales 0\n",
                nan_codes, saturated, inf_beside_finite, inf_beside_zeros, zero_blocks);
}

static void check_case(const Case& cs, std::mt19937_64& rng) {
    const int M = cs.batch * cs.seq, K = cs.k, kv_dim = cs.hkv * cs.d, N = cs.q_dim + 2 * kv_dim;
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
    if (cs.g > 0 && cs.special) {
        // W rows of K/V columns (x[r, 0] made nonzero, so a weight of ±inf at
        // k = 0 makes its column ±inf in every row): K block 0 holds a NaN
        // column and (g >= 3) a -inf one beside finite values (the scale of
        // those; the -inf saturates); the last K block (if not block 0) a
        // +inf column beside zeros only (scale 0, the +inf still ±448); the
        // first V block zeros only (scale 0, codes of x · 0); the last V
        // column (more than 2 blocks) +inf beside finite values.
        const int kvd = cs.hkv * cs.d, blocks = 2 * kvd / cs.g;
        auto set = [&](std::vector<float>& values, Guarded& buffer, size_t i, float v) {
            values[i] = v;
            if (cs.t == DT::F32) {
                std::memcpy(buffer.data() + i * 4, &v, 4);
            } else {
                const uint16_t b = cs.t == DT::BF16 ? bf16_bits(v) : f16_bits(v);
                std::memcpy(buffer.data() + i * 2, &b, 2);
            }
        };
        auto set_w = [&](int n, int k, float v) { set(wv, w, static_cast<size_t>(n) * K + k, v); };
        for (int r = 0; r < M; ++r)
            if (xv[static_cast<size_t>(r) * K] == 0.f) set(xv, x, static_cast<size_t>(r) * K, 0.5f);
        auto zero_block = [&](int first) {
            for (int j = first; j < first + cs.g; ++j)
                for (int k = 0; k < K; ++k) set_w(cs.q_dim + j, k, 0.f);
        };
        zero_block(kvd);
        set_w(cs.q_dim + std::min(1, cs.g - 1), 0, std::nanf(""));
        if (cs.g >= 3) set_w(cs.q_dim + cs.g - 1, 0, -INFINITY);
        if (kvd / cs.g >= 2) {
            zero_block(kvd - cs.g);
            set_w(cs.q_dim + kvd - cs.g, 0, INFINITY);
        }
        if (blocks > 2) set_w(cs.q_dim + 2 * kvd - 1, 0, INFINITY);
    }

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

    if (cs.g > 0) {
        check_fp8(cs, xv, wv, x, w, row_off, kv_stride, cache_elems);
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
        case DT::F8: CHECK(false, "no FP8 compute dtype"); break;
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
            case DT::F8: run_gather<uint8_t>(blocks, offs, kv_dim, kv_stride, staged); break;
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

// Case `index` of a run: its own random stream (its data does not depend on
// the cases before it) and its scheduling order, by turns; hazards fail a
// case as a check of their own.
static void run_case(const Case& cs, unsigned long long seed, size_t index) {
    std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), static_cast<uint32_t>(index)};
    std::mt19937_64 rng(seq);
    emu::mach->order = static_cast<emu::Order>(index % 3);
    emu::mach->rng.seed(rng());
    emu::mach->hazards = 0;
    emu::mach->first_hazard.clear();
    char fp8[48] = "";
    if (cs.g > 0) std::snprintf(fp8, sizeof fp8, " g=%d%s", cs.g, cs.special ? " special" : "");
    std::printf("%s %s kv%s B=%d S=%d K=%d q=%d hkv=%d d=%d p=%d L=%d layer=%d%s order=%s\n",
                cs.decode ? "decode " : "prefill", dt_name(cs.t), dt_name(cs.g > 0 ? DT::F8 : cs.c), cs.batch, cs.seq,
                cs.k, cs.q_dim, cs.hkv, cs.d, cs.page, cs.layers, cs.layer, fp8, emu::order_name(emu::mach->order));
    std::fflush(stdout);
    const int before = failures;
    check_case(cs, rng);
    if (emu::mach->hazards) {
        std::fprintf(stderr, "  FAIL: %ld hazard(s); the first: %s\n", emu::mach->hazards,
                     emu::mach->first_hazard.c_str());
        ++failures;
    }
    if (failures > before) ++failed_cases;
    std::fflush(stderr);
}

static int pages_for(int batch, int seq, int page) { return batch * ((seq + 2 * page) / page + 2); }

int main(int argc, char** argv) {
    unsigned long long seed = 7;
    bool fail_fast = false;  // stop after the first failing case (the mutation check)
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--fail-fast") {
            fail_fast = true;
        } else if (!a.empty() && a.find_first_not_of("0123456789") == std::string::npos) {
            seed = std::strtoull(a.c_str(), nullptr, 10);
        } else {
            std::fprintf(stderr, "usage: emulate [SEED] [--fail-fast]\n");
            return 2;
        }
    }
    emu::init();
    std::mt19937_64 rng(seed);
    const DT dts[] = {DT::F32, DT::BF16, DT::F16};
    std::vector<Case> cases;
    // Fixed shapes covering tails in every dimension, then random ones.
    int variant = 0;
    for (DT t : dts) {
        for (DT c : dts) {
            // decode: M <= 16, N not a multiple of the column tile, K not a multiple of 32
            cases.push_back(Case{t, c, true, 3, 5, 72, 24, 2, 6, 4, 2, 16, 1});
            // prefill: M and N both span two tiles with tails, odd pairs off
            cases.push_back(Case{t, c, false, 3, 50, 40, 132, 1, 8, 16, 2, 24, 1});
            // prefill, deep pipelines, every stage of the 3-stage cp.async ring reused many times:
            // M = 100 (one row tile) x N = 250 (two column tiles) with K = 520 / 544 / 584 (k-tiles of
            // PF_BK = 32: 17 with a tail, 17, 19 with a tail), and M = 140 (two row tiles) x N = 113
            // with K = 264 / 328 / 512 (9, 11 with tails, 16): every k-tile count mod 3, odd q_dim
            // too. f32 (PS_BK = 16): 17 to 37 k-steps.
            const int deep_k[] = {520, 544, 584}, mid_k[] = {264, 328, 512};
            const int deep = deep_k[variant % 3], mid = mid_k[variant % 3];
            cases.push_back(Case{t, c, false, 1, 100, deep, 90, 2, 40, 16, 2, pages_for(1, 100, 16), 1});
            cases.push_back(Case{t, c, false, 2, 70, mid, 65, 1, 24, 8, 1, pages_for(2, 70, 8), 0});
            ++variant;
        }
    }
    std::uniform_int_distribution<int> pick(0, 2);
    for (int i = 0; i < 6; ++i) {
        const bool decode = i % 2 == 0;
        Case cs{dts[pick(rng)], dts[pick(rng)], decode, 1, 1, 8, 2, 1, 2, 1, 1, 1, 0};
        cs.batch = std::uniform_int_distribution<int>(1, 4)(rng);
        cs.seq = decode ? std::uniform_int_distribution<int>(1, 16 / cs.batch)(rng)
                        : std::uniform_int_distribution<int>(1, 90)(rng);
        cs.k = 8 * std::uniform_int_distribution<int>(1, decode ? 12 : 72)(rng);  // prefill: up to 18 k-tiles
        cs.q_dim = std::uniform_int_distribution<int>(1, 70)(rng);  // odd q_dim takes the unpaired stores
        cs.hkv = std::uniform_int_distribution<int>(1, 3)(rng);
        cs.d = std::uniform_int_distribution<int>(1, 20)(rng);
        cs.page = std::uniform_int_distribution<int>(1, 8)(rng);
        cs.layers = std::uniform_int_distribution<int>(1, 3)(rng);
        cs.layer = std::uniform_int_distribution<int>(0, cs.layers - 1)(rng);
        cs.pages = pages_for(cs.batch, cs.seq, cs.page);
        cases.push_back(cs);
    }
    // the 8B decode shape's column count (N = 6144) with a short K
    cases.push_back(Case{DT::BF16, DT::BF16, true, 2, 1, 64, 4096, 8, 128, 16, 1, 4, 0});

    // FP8 E4M3 caches: g-blocks inside one column tile, across 2 to 4 of them
    // (g = 6 and 40 against 4- or 16-wide decode tiles, 96 and 160 against 64-
    // and 128-wide prefill tiles), g = 1, odd q_dim (unpaired stores), two and
    // three row tiles, g-blocks with NaN and ±inf, ±inf and zeros, zeros only ("special").
    const size_t first_fp8 = cases.size();
    auto fp8 = [&](Case cs, int g, bool special) {
        cs.g = g;
        cs.special = special;
        cases.push_back(cs);
    };
    for (DT t : dts) {
        fp8(Case{t, DT::F8, true, 3, 5, 72, 24, 2, 12, 4, 2, 16, 1}, 6, true);
        fp8(Case{t, DT::F8, true, 2, 3, 64, 13, 2, 40, 4, 2, pages_for(2, 3, 4), 0}, 40, false);
        fp8(Case{t, DT::F8, false, 3, 50, 40, 132, 2, 96, 16, 2, pages_for(3, 50, 16), 1}, 96, true);
        fp8(Case{t, DT::F8, false, 2, 70, 64, 70, 1, 160, 8, 1, pages_for(2, 70, 8), 0}, 160, true);
        fp8(Case{t, DT::F8, false, 1, 40, 24, 9, 1, 5, 4, 1, pages_for(1, 40, 4), 0}, 1, true);
    }
    for (int i = 0; i < 6; ++i) {
        const bool decode = i % 2 == 0;
        Case cs{dts[pick(rng)], DT::F8, decode, 1, 1, 8, 2, 1, 2, 1, 1, 1, 0};
        cs.batch = std::uniform_int_distribution<int>(1, 4)(rng);
        cs.seq = decode ? std::uniform_int_distribution<int>(1, 16 / cs.batch)(rng)
                        : std::uniform_int_distribution<int>(1, 90)(rng);
        cs.k = 8 * std::uniform_int_distribution<int>(1, decode ? 12 : 24)(rng);
        cs.q_dim = std::uniform_int_distribution<int>(1, 70)(rng);
        cs.hkv = std::uniform_int_distribution<int>(1, 3)(rng);
        cs.d = std::uniform_int_distribution<int>(1, 48)(rng);
        cs.page = std::uniform_int_distribution<int>(1, 8)(rng);
        cs.layers = std::uniform_int_distribution<int>(1, 3)(rng);
        cs.layer = std::uniform_int_distribution<int>(0, cs.layers - 1)(rng);
        cs.pages = pages_for(cs.batch, cs.seq, cs.page);
        std::vector<int> divisors;
        for (int g = 1; g <= cs.d; ++g)
            if (cs.d % g == 0) divisors.push_back(g);
        fp8(cs, divisors[std::uniform_int_distribution<size_t>(0, divisors.size() - 1)(rng)], rng() % 2 == 0);
    }
    // g past the values a lane keeps in registers (8 · 32 = 256): the second read of the scratch
    fp8(Case{DT::BF16, DT::F8, false, 1, 20, 16, 8, 1, 320, 4, 1, pages_for(1, 20, 4), 0}, 320, true);
    fp8(Case{DT::F32, DT::F8, true, 2, 2, 16, 5, 1, 264, 4, 1, pages_for(2, 2, 4), 0}, 264, true);
    // the 8B decode shape (N = 6144, D = g = 128) with a short K
    fp8(Case{DT::BF16, DT::F8, true, 2, 1, 64, 4096, 8, 128, 16, 1, 4, 0}, 128, false);

    // The convert, then the FP8 cases, then the rest (each case keeps its
    // index, which seeds its data and picks its order): FP8 mutants fail fast.
    check_convert(seed);
    std::vector<size_t> run_order;
    for (size_t i = first_fp8; i < cases.size(); ++i) run_order.push_back(i);
    for (size_t i = 0; i < first_fp8; ++i) run_order.push_back(i);
    for (size_t i : run_order) {
        if (fail_fast && failed_cases) break;
        run_case(cases[i], seed, i);
    }
    if (failed_cases) {
        std::fprintf(stderr, "%d case(s) failed\n", failed_cases);
        return 1;
    }
    std::printf("all %zu cases passed (%zu of them FP8), and the convert check\n", cases.size(),
                cases.size() - first_fp8);
    return 0;
}
