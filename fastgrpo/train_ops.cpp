// Fused float32 CPU pieces of a Qwen2 / Qwen3 / Llama decoder layer for packed training
// (fastgrpo/fused_layer.py): RMSNorm (per row, and per head for Qwen3's q/k norms), RoPE, varlen
// causal attention with optional shared prefixes, and SiLU·up, each forward and backward in one
// pass over its rows.
//
// Every function takes dense row-major float32 tensors; the caller (fused_layer.py) checks
// shapes, dtypes and the segment table before calling, so the loops carry no checks (a
// throwing check inside a hot loop costs it its vectorisation, see lean_step.cpp).
//
// Layouts: a packed row of T tokens; `qkv` [T, (nq + 2 nk) · D] holds the q heads, then the k
// heads, then the v heads of each token (the column order of torch.cat([Wq, Wk, Wv])); `seg`
// int64 [S, 4] holds per segment (start, length, prefix start, prefix length): segment s's
// queries are its own tokens, its keys its prefix span (all visible) then its own tokens up to
// the query (causal). Rows past the last segment (ladder padding) attend nothing: output 0.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// e^x in float32, branch-free so that loops over it vectorise (Cephes expf: range reduction by
// ln 2, degree-6 polynomial; within 2 ulp of expf). Inputs below -88 give 0.
static inline __attribute__((always_inline)) float fexp(float x) {
  x = x < -88.0f ? -88.0f : (x > 88.0f ? 88.0f : x);
  // round to nearest by the 1.5·2^23 trick: vectorises where floor() would need -fno-trapping-math
  const float fi = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - fi * 0.693359375f + fi * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline at::Tensor empty_f32(std::initializer_list<int64_t> shape) {
  return at::empty(shape, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace

// y = w · x · rsqrt(mean(x²) + eps) per row; returns (y [T, H], rstd [T]).
std::vector<at::Tensor> rmsnorm_fwd(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor y = empty_f32({T, H}), rstd = empty_f32({T});
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* xr = xp + t * H;
      float* yr = yp + t * H;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < H; ++j) ss += xr[j] * xr[j];
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + e);
      rp[t] = r;
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) yr[j] = wp[j] * (xr[j] * r);
    }
  });
  return {y, rstd};
}

// Gradient of rmsnorm_fwd: (dx [T, H] (+ dres when given: the residual stream's gradient),
// dw [H]).
std::vector<at::Tensor> rmsnorm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                    const at::Tensor& rstd, const c10::optional<at::Tensor>& dres) {
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor dx = empty_f32({T, H});
  const int nt = at::get_num_threads();
  at::Tensor part = at::zeros({nt, H}, at::TensorOptions().dtype(at::kFloat));
  const float* gp = dy.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  const float* dp = dres.has_value() ? dres->data_ptr<float>() : nullptr;
  float* op = dx.data_ptr<float>();
  float* pp = part.data_ptr<float>();
  const float invH = 1.0f / static_cast<float>(H);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t end) {
    float* dw = pp + at::get_thread_num() * H;
    for (int64_t t = b; t < end; ++t) {
      const float* xr = xp + t * H;
      const float* gr = gp + t * H;
      float* orow = op + t * H;
      const float r = rp[t];
      float c = 0.0f;
#pragma omp simd reduction(+ : c)
      for (int64_t j = 0; j < H; ++j) {
        const float xh = xr[j] * r;
        c += gr[j] * wp[j] * xh;
        dw[j] += gr[j] * xh;
      }
      c *= invH;
      if (dp) {
        const float* dr = dp + t * H;
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) orow[j] = dr[j] + r * (gr[j] * wp[j] - xr[j] * r * c);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) orow[j] = r * (gr[j] * wp[j] - xr[j] * r * c);
      }
    }
  });
  return {dx, nt == 1 ? part[0] : part.sum(0)};
}

// RoPE in place on the first nh heads of every row of qkv [T, W] (cos / sin [T, D], the
// model's own tables: x·cos + rotate_half(x)·sin); backward=true applies the transpose (the
// gradient of the same map).
void rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t nh, int64_t D, bool backward) {
  const int64_t T = qkv.size(0), W = qkv.size(1), h2 = D / 2;
  float* p = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < nh; ++h) {
        float* x = p + t * W + h * D;
        // forward: x1' = x1 c1 - x2 s1, x2' = x2 c2 + x1 s2; the transpose:
        // g1 = d1 c1 + d2 s2, g2 = d2 c2 - d1 s1
#pragma omp simd
        for (int64_t j = 0; j < h2; ++j) {
          const float a = x[j], bb = x[j + h2];
          if (backward) {
            x[j] = a * c[j] + bb * s[j + h2];
            x[j + h2] = bb * c[j + h2] - a * s[j];
          } else {
            x[j] = a * c[j] - bb * s[j];
            x[j + h2] = bb * c[j + h2] + a * s[j + h2];
          }
        }
      }
    }
  });
}

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
                const float e = fexp(pr[j] - m);
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
                const float p = fexp(pr[j] - l);  // 0 where masked (-inf)
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

// a = silu(g) · u for gu [T, 2I] = [g ‖ u]; returns a [T, I].
at::Tensor silu_mul_fwd(const at::Tensor& gu) {
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor a = empty_f32({T, I});
  const float* p = gu.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* g = p + t * 2 * I;
      const float* u = g + I;
      float* ar = ap + t * I;
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) ar[j] = g[j] / (1.0f + fexp(-g[j])) * u[j];
    }
  });
  return a;
}

// Gradient of silu_mul_fwd: dgu [T, 2I].
at::Tensor silu_mul_bwd(const at::Tensor& da, const at::Tensor& gu) {
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor dgu = empty_f32({T, 2 * I});
  const float* p = gu.data_ptr<float>();
  const float* dp = da.data_ptr<float>();
  float* op = dgu.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* g = p + t * 2 * I;
      const float* u = g + I;
      const float* d = dp + t * I;
      float* dg = op + t * 2 * I;
      float* du = dg + I;
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) {
        const float sg = 1.0f / (1.0f + fexp(-g[j]));
        const float si = g[j] * sg;
        du[j] = d[j] * si;
        dg[j] = d[j] * u[j] * sg * (1.0f + g[j] * (1.0f - sg));
      }
    }
  });
  return dgu;
}

// Per-head RMSNorm (Qwen3's q_norm / k_norm) in place on the first nq + nk heads of every row
// of qkv [T, W]: the q heads scaled by wq [D], the k heads by wk [D]. Returns (pre [T, (nq + nk)
// · D], the values before; rstd [T, nq + nk]).
std::vector<at::Tensor> head_rmsnorm_(at::Tensor qkv, const at::Tensor& wq, const at::Tensor& wk, int64_t nq,
                                      int64_t nk, int64_t D, double eps) {
  const int64_t T = qkv.size(0), W = qkv.size(1), nh = nq + nk;
  at::Tensor pre = empty_f32({T, nh * D}), rstd = empty_f32({T, nh});
  float* p = qkv.data_ptr<float>();
  float* pp = pre.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  const float* wqp = wq.data_ptr<float>();
  const float* wkp = wk.data_ptr<float>();
  const float e = static_cast<float>(eps), invD = 1.0f / static_cast<float>(D);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      for (int64_t h = 0; h < nh; ++h) {
        float* x = p + t * W + h * D;
        float* keep = pp + (t * nh + h) * D;
        const float* w = h < nq ? wqp : wkp;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < D; ++d) {
          keep[d] = x[d];
          ss += x[d] * x[d];
        }
        const float r = 1.0f / std::sqrt(ss * invD + e);
        rp[t * nh + h] = r;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) x[d] = w[d] * (x[d] * r);
      }
    }
  });
  return {pre, rstd};
}

// Gradient of head_rmsnorm_, in place on dqkv's first nq + nk heads; returns (dwq [D], dwk [D]).
std::vector<at::Tensor> head_rmsnorm_bwd_(at::Tensor dqkv, const at::Tensor& pre, const at::Tensor& rstd,
                                          const at::Tensor& wq, const at::Tensor& wk, int64_t nq, int64_t nk,
                                          int64_t D) {
  const int64_t T = dqkv.size(0), W = dqkv.size(1), nh = nq + nk;
  const int nt = at::get_num_threads();
  at::Tensor part = at::zeros({nt, 2, D}, at::TensorOptions().dtype(at::kFloat));
  float* g = dqkv.data_ptr<float>();
  const float* pp = pre.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  const float* wqp = wq.data_ptr<float>();
  const float* wkp = wk.data_ptr<float>();
  float* partp = part.data_ptr<float>();
  const float invD = 1.0f / static_cast<float>(D);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t end) {
    float* dw = partp + at::get_thread_num() * 2 * D;
    for (int64_t t = b; t < end; ++t) {
      for (int64_t h = 0; h < nh; ++h) {
        float* gr = g + t * W + h * D;
        const float* x = pp + (t * nh + h) * D;
        const float* w = h < nq ? wqp : wkp;
        float* dww = dw + (h < nq ? 0 : D);
        const float r = rp[t * nh + h];
        float c = 0.0f;
#pragma omp simd reduction(+ : c)
        for (int64_t d = 0; d < D; ++d) {
          const float xh = x[d] * r;
          c += gr[d] * w[d] * xh;
          dww[d] += gr[d] * xh;
        }
        c *= invD;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) gr[d] = r * (gr[d] * w[d] - x[d] * r * c);
      }
    }
  });
  at::Tensor sum = nt == 1 ? part[0] : part.sum(0);
  return {sum[0], sum[1]};
}

// xT [C, R] of x [R, C], in 16 × 16 tiles (both sides touch whole cache lines): the weight
// gradients' left operand, which oneDNN would otherwise copy from a strided view on every call.
at::Tensor transpose(const at::Tensor& x) {
  const int64_t R = x.size(0), C = x.size(1);
  at::Tensor y = empty_f32({C, R});
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t B = 16;
  at::parallel_for(0, (R + B - 1) / B, 4, [&](int64_t b, int64_t end) {
    for (int64_t rb = b; rb < end; ++rb) {
      const int64_t r0 = rb * B, nr = std::min(B, R - r0);
      for (int64_t c0 = 0; c0 < C; c0 += B) {
        const int64_t nc = std::min(B, C - c0);
        if (nr == B && nc == B) {
          float tile[B][B];
          for (int64_t r = 0; r < B; ++r)
#pragma omp simd
            for (int64_t c = 0; c < B; ++c) tile[c][r] = xp[(r0 + r) * C + c0 + c];
          for (int64_t c = 0; c < B; ++c)
#pragma omp simd
            for (int64_t r = 0; r < B; ++r) yp[(c0 + c) * R + r0 + r] = tile[c][r];
        } else {
          for (int64_t c = 0; c < nc; ++c)
            for (int64_t r = 0; r < nr; ++r) yp[(c0 + c) * R + r0 + r] = xp[(r0 + r) * C + c0 + c];
        }
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("transpose", &transpose);
  m.def("head_rmsnorm_", &head_rmsnorm_);
  m.def("head_rmsnorm_bwd_", &head_rmsnorm_bwd_);
  m.def("rmsnorm_fwd", &rmsnorm_fwd);
  m.def("rmsnorm_bwd", &rmsnorm_bwd);
  m.def("rope_", &rope_);
  m.def("attn_fwd", &attn_fwd);
  m.def("attn_bwd", &attn_bwd);
  m.def("silu_mul_fwd", &silu_mul_fwd);
  m.def("silu_mul_bwd", &silu_mul_bwd);
}
