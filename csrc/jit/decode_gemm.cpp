// The GEMMs of the native decode step (declared in decode_gemm.h, used by decode_step.cpp):
//   - cache-resident weights, transposed once per rollout ([K, N]): each output row is a sum of
//     weight rows scaled by the input, 4 rows × 64 columns held in registers, no horizontal sums;
//     the residual adds accumulate into the hidden state directly;
//   - streamed weights (past kCachedWeight floats) in nn.Linear's [N, K] layout: gemm_nk below.
// Compiled with the decode step (-O3 -march=native) by fastgrpo/native/decode_step.py.
#include "decode_gemm.h"

#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>

namespace fastgrpo {
namespace decode {
namespace {

constexpr int64_t kCols = 64;  // output columns per register block
constexpr int64_t kRows = 4;   // output rows per register block

// C[r : r + R] (= | +=) A[r : r + R] @ WT (+ bias): one block of R rows, all N columns
template <int64_t R>
void gemm_block(const float* A, int64_t r, int64_t K, const float* WT, int64_t N, const float* bias, float* C,
                bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += kCols) {
    const int64_t nb = N - n0 < kCols ? N - n0 : kCols;
    float acc[R][kCols];
    for (int64_t i = 0; i < R; ++i) {
      float* ci = C + (r + i) * N + n0;
      for (int64_t j = 0; j < nb; ++j) acc[i][j] = (accumulate ? ci[j] : 0.f) + (bias ? bias[n0 + j] : 0.f);
    }
    if (R == 4) {
      // the register block: 4 rows × 64 columns of accumulators, one weight row per k
      float* a0 = acc[0];
      float* a1 = acc[R > 1 ? 1 : 0];
      float* a2 = acc[R > 2 ? 2 : 0];
      float* a3 = acc[R > 3 ? 3 : 0];
      for (int64_t k = 0; k < K; ++k) {
        const float* w = WT + k * N + n0;
        const float x0 = A[r * K + k], x1 = A[(r + 1) * K + k], x2 = A[(r + 2) * K + k], x3 = A[(r + 3) * K + k];
#pragma omp simd
        for (int64_t j = 0; j < nb; ++j) {
          a0[j] += x0 * w[j];
          a1[j] += x1 * w[j];
          a2[j] += x2 * w[j];
          a3[j] += x3 * w[j];
        }
      }
    } else {
      for (int64_t k = 0; k < K; ++k) {
        const float* w = WT + k * N + n0;
        for (int64_t i = 0; i < R; ++i) {
          const float a = A[(r + i) * K + k];
#pragma omp simd
          for (int64_t j = 0; j < nb; ++j) acc[i][j] += a * w[j];
        }
      }
    }
    for (int64_t i = 0; i < R; ++i) {
      float* ci = C + (r + i) * N + n0;
      for (int64_t j = 0; j < nb; ++j) ci[j] = acc[i][j];
    }
  }
}


// kept out of line: a throwing check inside gemm() costs the blocked loop its vectorisation
// (measured: 165 → 433 µs a decode step)
__attribute__((noinline)) void check_gemm(const at::Tensor& a, const at::Tensor& wt, const at::Tensor& bias,
                                          const at::Tensor& c, bool streamed, int64_t col0) {
  const int64_t K = streamed ? wt.size(1) : wt.size(0), N = streamed ? wt.size(0) : wt.size(1);
  TORCH_CHECK(wt.dim() == 2 && K == a.size(1) && c.size(0) == a.size(0) && col0 >= 0 && col0 + N <= c.size(1) &&
                  (streamed || (col0 == 0 && c.size(1) == N)) && (!bias.numel() || bias.numel() >= N) &&
                  a.is_contiguous() && c.is_contiguous(),
              "lean_step: GEMM shapes [", a.size(0), ", ", a.size(1), "] x ", streamed ? "W [" : "W^T [", wt.size(0),
              ", ", wt.size(1), "] into columns ", col0, "+ of [", c.size(0), ", ", c.size(1), "] disagree");
}

#if defined(__AVX512F__)
// C[i, j] (= | +=) Σ_k A[i, k] · W[j, k] (+ bias[j]) for an MR × NR block
// `pf`: the next block's weight rows, prefetched a cache line per row and k step while this
// block computes, so the stream and the FMAs overlap (a SmolLM2 step's 120 GEMMs at 16 rows, one
// thread, CPU time on the loaded 2-core machine: 111 → 86 ms; MKL sgemm on the same: 115-145 ms)
template <int MR, int NR>
inline void nk_block(const float* A, int64_t K, const float* W, float* C, int64_t ldc, const float* bias,
                     bool accumulate, const float* pf) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 w[NR];
    if (pf)
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * K + k), _MM_HINT_T0);
    for (int j = 0; j < NR; ++j) w[j] = _mm512_loadu_ps(W + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_loadu_ps(A + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(x, w[j], acc[i][j]);
    }
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = _mm512_maskz_loadu_ps(m, W + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_maskz_loadu_ps(m, A + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(x, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float s = _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[j] : 0.f);
      C[i * ldc + j] = accumulate ? C[i * ldc + j] + s : s;
    }
}

// the first pass over the block's rows prefetches the next block (`pf`, null at the last)
template <int NR>
inline void nk_rows(const float* A, int64_t M, int64_t K, const float* W, float* C, int64_t ldc, const float* bias,
                    bool accumulate, const float* pf) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4, pf = nullptr) nk_block<4, NR>(A + i * K, K, W, C + i * ldc, ldc, bias, accumulate, pf);
  switch (M - i) {
    case 3: nk_block<3, NR>(A + i * K, K, W, C + i * ldc, ldc, bias, accumulate, pf); break;
    case 2: nk_block<2, NR>(A + i * K, K, W, C + i * ldc, ldc, bias, accumulate, pf); break;
    case 1: nk_block<1, NR>(A + i * K, K, W, C + i * ldc, ldc, bias, accumulate, pf); break;
    default: break;
  }
}

// C [M, N] (row stride ldc) (= | +=) A [M, K] · W [N, K]^T (+ bias): blocks of 4 weight rows over
// all input rows (the block's rows stay in L1 while every input row meets them), the blocks
// split over torch's threads
void gemm_nk(const float* A, int64_t M, int64_t K, const float* W, int64_t N, const float* bias, float* C,
             int64_t ldc, bool accumulate) {
  const int64_t blocks = (N + 3) / 4;
  // chunks of >= 16 blocks (64 weight rows, 144 KiB at K = 576): a thread wake-up per chunk amortised
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * 4, nr = N - n < 4 ? N - n : 4;
      const float* w = W + n * K;
      const float* bn = bias ? bias + n : nullptr;
      const float* pf = n + 8 <= N ? w + 4 * K : nullptr;  // the next full block, if any
      switch (nr) {
        case 4: nk_rows<4>(A, M, K, w, C + n, ldc, bn, accumulate, pf); break;
        case 3: nk_rows<3>(A, M, K, w, C + n, ldc, bn, accumulate, pf); break;
        case 2: nk_rows<2>(A, M, K, w, C + n, ldc, bn, accumulate, pf); break;
        default: nk_rows<1>(A, M, K, w, C + n, ldc, bn, accumulate, pf); break;
      }
    }
  });
}
#endif

}  // namespace

// c[:, col0 : col0 + N] (= | +=) a · W^T (+ bias[:N]); `streamed`: wt is W [N, K] (see gemm_nk),
// else the transposed W^T [K, N] of a cache-resident weight (then col0 = 0, N = c's width)
void gemm(const at::Tensor& a, const at::Tensor& wt, const at::Tensor& bias, at::Tensor& c, bool accumulate,
          bool streamed, int64_t col0) {
  check_gemm(a, wt, bias, c, streamed, col0);
  const int64_t M = a.size(0), K = a.size(1);
  if (streamed) {
    const int64_t N = wt.size(0);
#if defined(__AVX512F__)
    gemm_nk(a.data_ptr<float>(), M, K, wt.data_ptr<float>(), N, bias.numel() ? bias.data_ptr<float>() : nullptr,
            c.data_ptr<float>() + col0, c.size(1), accumulate);
#else
    at::Tensor out = c.narrow(1, col0, N);
    if (accumulate) {
      out.addmm_(a, wt.t());
    } else {
      out.copy_(at::mm(a, wt.t()));
    }
    if (bias.numel()) out.add_(bias.narrow(0, 0, N));
#endif
    return;
  }
  if (wt.numel() > kCachedWeight) {  // a large transposed weight (a tiny model's big lm_head)
    if (accumulate) {
      c.addmm_(a, wt);
    } else {
      at::mm_out(c, a, wt);
    }
    if (bias.numel()) c.add_(bias);
    return;
  }
  const int64_t N = wt.size(1);
  const float* A = a.data_ptr<float>();
  const float* WT = wt.data_ptr<float>();
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* C = c.data_ptr<float>();
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) gemm_block<kRows>(A, r, K, WT, N, B, C, accumulate);
  for (; r < M; ++r) gemm_block<1>(A, r, K, WT, N, B, C, accumulate);
}

at::Tensor linear(const at::Tensor& a, const at::Tensor& wt, const at::Tensor& bias, bool streamed) {
  at::Tensor c = at::empty({a.size(0), streamed ? wt.size(0) : wt.size(1)}, a.options());
  gemm(a, wt, bias, c, false, streamed);
  return c;
}

}  // namespace decode
}  // namespace fastgrpo
