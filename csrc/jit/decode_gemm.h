// The GEMMs of the native decode step (decode_step.cpp), compiled in decode_gemm.cpp: small
// cache-resident weights as register-blocked AXPYs against a transposed copy, large ("streamed")
// weights in nn.Linear's own [N, K] layout by an AVX-512 kernel that reads each weight row once
// a step. Split out of decode_step.cpp (one translation unit per concern: the GEMMs here, the
// decoder step there); the why and the numbers are next to each kernel in decode_gemm.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace fastgrpo {
namespace decode {

// Weights past this many floats (1 MiB, an L2's worth) are "streamed" (see streamed_layers in
// decoders.py, which decides per model): the caller passes every matrix of such a model in
// nn.Linear's own layout [N, K], q / k / v and gate / up as separate matrices (no concatenated
// or transposed copy per rollout: on SmolLM2-135M those copies moved 820 MB, ~0.7 s a rollout),
// and gemm_nk multiplies them into column ranges of the output. A streamed weight is read from
// DRAM once a step, so the kernel reads each weight row once for all input rows: 4 weight rows ×
// 4 input rows of dot products in 16 AVX-512 accumulators, 8 loads per 16 FMAs in the K loop, one
// horizontal sum per output. MKL's sgemm, the previous path for these weights, ran at ~4 GB/s of
// weights here (its AVX2 kernels on AMD, blocked for large M). Without AVX-512: at::mm.
constexpr int64_t kCachedWeight = 1 << 18;

// c[:, col0 : col0 + N] (= | +=) a · W^T (+ bias[:N]); `streamed`: wt is W [N, K] (see gemm_nk in
// decode_gemm.cpp), else the transposed W^T [K, N] of a cache-resident weight (then col0 = 0,
// N = c's width)
void gemm(const at::Tensor& a, const at::Tensor& wt, const at::Tensor& bias, at::Tensor& c, bool accumulate,
          bool streamed = false, int64_t col0 = 0);

// a · W^T (+ bias) into a new [rows, N] tensor (the layout of `wt` as for gemm)
at::Tensor linear(const at::Tensor& a, const at::Tensor& wt, const at::Tensor& bias, bool streamed = false);

// whether streamed weights run on gemm_nk (AVX-512) rather than at::mm
constexpr bool kStreamedKernel =
#if defined(__AVX512F__)
    true;
#else
    false;
#endif

}  // namespace decode
}  // namespace fastgrpo
