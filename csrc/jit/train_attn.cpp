// Varlen causal attention of a packed row for the fused training layers (fastgrpo/fused_layer.py),
// forward and backward, bound into train_ops' module (train_ops.cpp declares them). Layouts as
// train_ops.cpp describes: qkv [T, (nq + 2 nk) · D]; seg int64 [S, 4] = (start, length, prefix
// start, prefix length); segment s's queries are its own tokens, its keys its prefix span (all
// visible) then its own tokens up to the query. Rows past the last segment attend nothing.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "native_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

using fastgrpo::exp_poly;

namespace {

struct SegView {
  int64_t a, n, ps, pl;
  inline int64_t key_row(int64_t j) const { return j < pl ? ps + j : a + (j - pl); }
};

constexpr int64_t kBlock = 16;  // keys per score block: one 512-bit register of float32
constexpr int64_t kRows = 4;    // queries per block: each key / value row loaded once for all four

inline int64_t round_up(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

// Transposed copy [D, Lp] of head `col`'s D columns of the segment's key rows, zero past Lk.
template <int64_t DT>
inline void gather_t(float* out, const float* base, int64_t W, int64_t col, const SegView& v, int64_t Lk,
                     int64_t Lp, int64_t D_) {
  const int64_t D = DT ? DT : D_;
  for (int64_t j = 0; j < Lk; ++j) {
    const float* k = base + v.key_row(j) * W + col;
    for (int64_t d = 0; d < D; ++d) out[d * Lp + j] = k[d];
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = Lk; j < Lp; ++j) out[d * Lp + j] = 0.0f;
}

// out[r][j] = Σ_d a_r[d]·scale·MT[d][j] for the kRows rows a_r, over the key blocks covering
// j < nmax; entries j ≥ lim[r] get `fill`. out rows are Lp apart.
template <int64_t DT>
inline void rows_times_t(float* out, const float* const* a, float scale, const float* MT, int64_t Lp, int64_t D_,
                         int64_t nmax, const int64_t* lim, float fill) {
  const int64_t D = DT ? DT : D_;
  for (int64_t jb = 0; jb < nmax; jb += kBlock) {
    float acc[kRows][kBlock] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float* m = MT + d * Lp + jb;
      for (int64_t r = 0; r < kRows; ++r) {
        const float ad = a[r][d] * scale;
#pragma omp simd
        for (int64_t u = 0; u < kBlock; ++u) acc[r][u] += ad * m[u];
      }
    }
    for (int64_t r = 0; r < kRows; ++r)
#pragma omp simd
      for (int64_t u = 0; u < kBlock; ++u) out[r * Lp + jb + u] = jb + u < lim[r] ? acc[r][u] : fill;
  }
}

inline float block_max(const float* s, int64_t n) {  // n a multiple of kBlock
  float m[kBlock];
  for (int64_t u = 0; u < kBlock; ++u) m[u] = s[u];
  for (int64_t jb = kBlock; jb < n; jb += kBlock)
#pragma omp simd
    for (int64_t u = 0; u < kBlock; ++u) m[u] = s[jb + u] > m[u] ? s[jb + u] : m[u];
  float r = m[0];
  for (int64_t u = 1; u < kBlock; ++u) r = m[u] > r ? m[u] : r;
  return r;
}

// DT: the head dim as a compile-time constant (0: the runtime `D_`), so that the loops over a
// head's D floats are a fixed number of vector operations. A block of kRows queries of one
// head: rows past the segment's end repeat its last query (their results are not written).
template <int64_t DT>
void attn_fwd_impl(const at::Tensor& qkv, const at::Tensor& seg, int64_t nq, int64_t nk, int64_t D_, double scale_,
                   at::Tensor& o, at::Tensor& lse) {
  const int64_t D = DT ? DT : D_;
  const int64_t W = qkv.size(1), S = seg.size(0), G = nq / nk;
  const float* qp = qkv.data_ptr<float>();
  const int64_t* sg = seg.data_ptr<int64_t>();
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float scale = static_cast<float>(scale_);
  const int64_t koff = nq * D, voff = (nq + nk) * D;
  at::parallel_for(0, S, 1, [&](int64_t b, int64_t end) {
    std::vector<float> kt, sc, oa;
    for (int64_t s = b; s < end; ++s) {
      const SegView v{sg[4 * s], sg[4 * s + 1], sg[4 * s + 2], sg[4 * s + 3]};
      if (v.n <= 0) continue;
      const int64_t Lk = v.pl + v.n, Lp = round_up(Lk);
      kt.resize(D * Lp);
      sc.resize(kRows * Lp);
      oa.resize(kRows * D);
      float* KT = kt.data();
      float* P = sc.data();
      float* acc = oa.data();
      for (int64_t kh = 0; kh < nk; ++kh) {
        gather_t<DT>(KT, qp, W, koff + kh * D, v, Lk, Lp, D);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kh * G + g;
          for (int64_t i0 = 0; i0 < v.n; i0 += kRows) {
            const int64_t nr = std::min(kRows, v.n - i0), nmax = v.pl + i0 + nr;
            const float* q[kRows];
            int64_t lim[kRows];
            for (int64_t r = 0; r < kRows; ++r) {
              const int64_t i = i0 + std::min(r, nr - 1);
              q[r] = qp + (v.a + i) * W + h * D;
              lim[r] = v.pl + i + 1;
            }
            rows_times_t<DT>(P, q, scale, KT, Lp, D, nmax, lim, -INFINITY);
            const int64_t nb = round_up(nmax);
            float inv[kRows];
            for (int64_t r = 0; r < kRows; ++r) {
              float* pr = P + r * Lp;
              const float m = block_max(pr, nb);
              float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
              for (int64_t j = 0; j < nb; ++j) {
                const float e = exp_poly(pr[j] - m);
                pr[j] = e;
                sum += e;
              }
              inv[r] = 1.0f / sum;
              if (r < nr) lp[(v.a + i0 + r) * nq + h] = m + std::log(sum);
            }
            std::fill(acc, acc + kRows * D, 0.0f);
            for (int64_t j = 0; j < nmax; ++j) {
              const float* vr = qp + v.key_row(j) * W + voff + kh * D;
              for (int64_t r = 0; r < kRows; ++r) {
                const float pj = P[r * Lp + j];
                float* ar = acc + r * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ar[d] += pj * vr[d];
              }
            }
            for (int64_t r = 0; r < nr; ++r) {
              float* orow = op + (v.a + i0 + r) * nq * D + h * D;
              const float* ar = acc + r * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) orow[d] = ar[d] * inv[r];
            }
          }
        }
      }
    }
  });
}

template <int64_t DT>
void attn_bwd_impl(const at::Tensor& dout, const at::Tensor& qkv, const at::Tensor& o, const at::Tensor& lse,
                   const at::Tensor& seg, int64_t nq, int64_t nk, int64_t D_, double scale_, at::Tensor& dqkv) {
  const int64_t D = DT ? DT : D_;
  const int64_t W = qkv.size(1), S = seg.size(0), G = nq / nk;
  const float* qp = qkv.data_ptr<float>();
  const float* gp = dout.data_ptr<float>();
  const float* op = o.data_ptr<float>();
  const float* lp = lse.data_ptr<float>();
  const int64_t* sg = seg.data_ptr<int64_t>();
  float* dp = dqkv.data_ptr<float>();
  const float scale = static_cast<float>(scale_);
  const int64_t koff = nq * D, voff = (nq + nk) * D;
  // the key / value gradients of each segment go to their own slot of `kv` (a prefix is read
  // by several segments), summed into dqkv afterwards, one segment at a time
  std::vector<int64_t> base(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = sg[4 * s + 1];
    base[s + 1] = base[s] + (n > 0 ? (sg[4 * s + 3] + n) * nk * 2 * D : 0);
  }
  std::vector<float> kv(static_cast<size_t>(base[S]), 0.0f);
  at::parallel_for(0, S, 1, [&](int64_t b, int64_t end) {
    std::vector<float> kt, vt, sc, dps, qa;
    for (int64_t s = b; s < end; ++s) {
      const SegView v{sg[4 * s], sg[4 * s + 1], sg[4 * s + 2], sg[4 * s + 3]};
      if (v.n <= 0) continue;
      const int64_t Lk = v.pl + v.n, Lp = round_up(Lk);
      kt.resize(D * Lp);
      vt.resize(D * Lp);
      sc.resize(kRows * Lp);
      dps.resize(kRows * Lp);
      qa.resize(kRows * D);
      float* KT = kt.data();
      float* VT = vt.data();
      float* P = sc.data();
      float* dS = dps.data();
      float* dqa = qa.data();
      for (int64_t kh = 0; kh < nk; ++kh) {
        float* dK = kv.data() + base[s] + kh * 2 * Lk * D;
        float* dV = dK + Lk * D;
        gather_t<DT>(KT, qp, W, koff + kh * D, v, Lk, Lp, D);
        gather_t<DT>(VT, qp, W, voff + kh * D, v, Lk, Lp, D);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kh * G + g;
          for (int64_t i0 = 0; i0 < v.n; i0 += kRows) {
            const int64_t nr = std::min(kRows, v.n - i0), nmax = v.pl + i0 + nr, nb = round_up(nmax);
            const float* q[kRows];
            const float* dO[kRows];
            int64_t lim[kRows];
            for (int64_t r = 0; r < kRows; ++r) {
              const int64_t row = v.a + i0 + std::min(r, nr - 1);
              q[r] = qp + row * W + h * D;
              dO[r] = gp + row * nq * D + h * D;
              lim[r] = r < nr ? v.pl + i0 + r + 1 : 0;  // a repeated row contributes nothing
            }
            rows_times_t<DT>(P, q, scale, KT, Lp, D, nmax, lim, -INFINITY);
            rows_times_t<DT>(dS, dO, 1.0f, VT, Lp, D, nmax, lim, 0.0f);
            for (int64_t r = 0; r < kRows; ++r) {
              float* pr = P + r * Lp;
              float* sr = dS + r * Lp;
              const int64_t row = v.a + i0 + std::min(r, nr - 1);
              const float l = lp[row * nq + h];
              const float* Or = op + row * nq * D + h * D;
              float Di = 0.0f;
#pragma omp simd reduction(+ : Di)
              for (int64_t d = 0; d < D; ++d) Di += dO[r][d] * Or[d];
#pragma omp simd
              for (int64_t j = 0; j < nb; ++j) {
                const float p = exp_poly(pr[j] - l);  // 0 where masked (-inf)
                pr[j] = p;
                sr[j] = p * (sr[j] - Di) * scale;
              }
            }
            std::fill(dqa, dqa + kRows * D, 0.0f);
            for (int64_t j = 0; j < nmax; ++j) {
              const float* kr = qp + v.key_row(j) * W + koff + kh * D;
              float* dk = dK + j * D;
              float* dvv = dV + j * D;
              for (int64_t r = 0; r < kRows; ++r) {
                const float ds = dS[r * Lp + j];
                float* ar = dqa + r * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ar[d] += ds * kr[d];
              }
              // this key's gradient summed over the block's rows before one read-modify-write
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) {
                float k = dk[d], vv = dvv[d];
                for (int64_t r = 0; r < kRows; ++r) {
                  k += dS[r * Lp + j] * q[r][d];
                  vv += P[r * Lp + j] * dO[r][d];
                }
                dk[d] = k;
                dvv[d] = vv;
              }
            }
            for (int64_t r = 0; r < nr; ++r) {
              float* dq = dp + (v.a + i0 + r) * W + h * D;
              const float* ar = dqa + r * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) dq[d] = ar[d];
            }
          }
        }
      }
    }
  });
  for (int64_t s = 0; s < S; ++s) {
    const SegView v{sg[4 * s], sg[4 * s + 1], sg[4 * s + 2], sg[4 * s + 3]};
    if (v.n <= 0) continue;
    const int64_t Lk = v.pl + v.n;
    for (int64_t kh = 0; kh < nk; ++kh) {
      const float* dK = kv.data() + base[s] + kh * 2 * Lk * D;
      const float* dV = dK + Lk * D;
      for (int64_t j = 0; j < Lk; ++j) {
        float* rk = dp + v.key_row(j) * W + koff + kh * D;
        float* rv = dp + v.key_row(j) * W + voff + kh * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          rk[d] += dK[j * D + d];
          rv[d] += dV[j * D + d];
        }
      }
    }
  }
}

}  // namespace

// Causal attention over the packed segments: returns (o [T, nq·D], lse [T, nq]).
std::vector<at::Tensor> attn_fwd(const at::Tensor& qkv, const at::Tensor& seg, int64_t nq, int64_t nk, int64_t D,
                                 double scale) {
  const int64_t T = qkv.size(0);
  at::Tensor o = at::zeros({T, nq * D}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor lse = at::zeros({T, nq}, at::TensorOptions().dtype(at::kFloat));
  switch (D) {
    case 16: attn_fwd_impl<16>(qkv, seg, nq, nk, D, scale, o, lse); break;
    case 32: attn_fwd_impl<32>(qkv, seg, nq, nk, D, scale, o, lse); break;
    case 64: attn_fwd_impl<64>(qkv, seg, nq, nk, D, scale, o, lse); break;
    case 128: attn_fwd_impl<128>(qkv, seg, nq, nk, D, scale, o, lse); break;
    default: attn_fwd_impl<0>(qkv, seg, nq, nk, D, scale, o, lse);
  }
  return {o, lse};
}

// Gradient of attn_fwd with respect to qkv (before RoPE's transpose): dqkv [T, W].
at::Tensor attn_bwd(const at::Tensor& dout, const at::Tensor& qkv, const at::Tensor& o, const at::Tensor& lse,
                    const at::Tensor& seg, int64_t nq, int64_t nk, int64_t D, double scale) {
  at::Tensor dqkv = at::zeros({qkv.size(0), qkv.size(1)}, at::TensorOptions().dtype(at::kFloat));
  switch (D) {
    case 16: attn_bwd_impl<16>(dout, qkv, o, lse, seg, nq, nk, D, scale, dqkv); break;
    case 32: attn_bwd_impl<32>(dout, qkv, o, lse, seg, nq, nk, D, scale, dqkv); break;
    case 64: attn_bwd_impl<64>(dout, qkv, o, lse, seg, nq, nk, D, scale, dqkv); break;
    case 128: attn_bwd_impl<128>(dout, qkv, o, lse, seg, nq, nk, D, scale, dqkv); break;
    default: attn_bwd_impl<0>(dout, qkv, o, lse, seg, nq, nk, D, scale, dqkv);
  }
  return dqkv;
}

