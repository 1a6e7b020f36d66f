// The second half of the GPU check's baseline (tests/cuda.rs, feature
// `cublas`): cuBLAS computes C = X·Wᵀ into an [M, N] buffer, then this kernel
// scatters C the way the fused kernel's epilogue does — Q columns to out, K/V
// columns of valid rows (row_off[r] >= 0) into the paged cache. Not used by
// kvjit itself; it exists so the fused kernel is timed against "GEMM, then
// scatter" with the same cache layout.
//
// One block per row; each thread moves 16-byte chunks (8 bf16). Needs
// q_dim % 8 == 0 and kv_dim % 8 == 0 (the host checks).

#include <cuda_bf16.h>
#include <stdint.h>

extern "C" __global__ void __launch_bounds__(256)
    fused_qkv_bshd_paged_baseline_scatter_cuda_bf16(const __nv_bfloat16* __restrict__ c, __nv_bfloat16* __restrict__ out,
                                                    __nv_bfloat16* __restrict__ blocks,
                                                    const long long* __restrict__ row_off, int N, int q_dim, int kv_dim,
                                                    long long kv_stride) {
    const long long r = blockIdx.x;
    const uint4* src = reinterpret_cast<const uint4*>(c + r * N);
    const long long off = row_off[r];
    for (int chunk = threadIdx.x; chunk < N / 8; chunk += blockDim.x) {
        const int col = chunk * 8;
        const uint4 v = src[chunk];
        if (col < q_dim) {
            *reinterpret_cast<uint4*>(out + r * q_dim + col) = v;
        } else if (off >= 0) {
            int j = col - q_dim;
            long long kv = 0;
            if (j >= kv_dim) {
                j -= kv_dim;
                kv = kv_stride;
            }
            *reinterpret_cast<uint4*>(blocks + off + kv + j) = v;
        }
    }
}
