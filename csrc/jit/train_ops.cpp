// Fused float32 CPU pieces of a Qwen2 / Qwen3 / Llama decoder layer for packed training
// (fastgrpo/fused_layer.py): RMSNorm (per row, and per head for Qwen3's q/k norms), RoPE, varlen
// causal attention with optional shared prefixes, and SiLU·up, each forward and backward in one
// pass over its rows.
//
// Every function takes dense row-major float32 tensors; the caller (fused_layer.py) checks
// shapes, dtypes and the segment table before calling, so the loops carry no checks (a
// throwing check inside a hot loop costs it its vectorisation, see decode_step.cpp).
//
// Layouts: a packed row of T tokens; `qkv` [T, (nq + 2 nk) · D] holds the q heads, then the k
// heads, then the v heads of each token (the column order of torch.cat([Wq, Wk, Wv])); `seg`
// int64 [S, 4] holds per segment (start, length, prefix start, prefix length): segment s's
// queries are its own tokens, its keys its prefix span (all visible) then its own tokens up to
// the query (causal). Rows past the last segment (ladder padding) attend nothing: output 0.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "native_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using fastgrpo::exp_poly;

inline at::Tensor empty_f32(std::initializer_list<int64_t> shape) {
  return at::empty(shape, at::TensorOptions().dtype(at::kFloat));
}

// The gradient of y = w · x · r (r = rsqrt(mean(x²) + eps)) over one vector of n values: out =
// add + r · (g·w − x·r·mean(g·w·x·r)) (add may be null; out may alias g), and dw += g · x · r.
// Shared by the row norm and Qwen3's per-head norms.
inline void rms_grad(const float* g, const float* x, const float* w, float r, int64_t n, const float* add,
                     float* out, float* dw) {
  float c = 0.0f;
#pragma omp simd reduction(+ : c)
  for (int64_t j = 0; j < n; ++j) {
    const float xh = x[j] * r;
    c += g[j] * w[j] * xh;
    dw[j] += g[j] * xh;
  }
  c /= static_cast<float>(n);
  if (add) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = add[j] + r * (g[j] * w[j] - x[j] * r * c);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = r * (g[j] * w[j] - x[j] * r * c);
  }
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
namespace {

// rows [b, end) of rmsnorm_bwd, accumulating the weight gradient into dw. Out of line: inlined
// into the OpenMP-outlined lambda, GCC vectorised the row loop with gathers (4x slower).
__attribute__((noinline)) void rmsnorm_bwd_rows(int64_t b, int64_t end, int64_t H, const float* gp, const float* xp,
                                                const float* wp, const float* rp, const float* dp, float* op,
                                                float* dw) {
  for (int64_t t = b; t < end; ++t)
    rms_grad(gp + t * H, xp + t * H, wp, rp[t], H, dp ? dp + t * H : nullptr, op + t * H, dw);
}

}  // namespace

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
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t end) {
    rmsnorm_bwd_rows(b, end, H, gp, xp, wp, rp, dp, op, pp + at::get_thread_num() * H);
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

// train_attn.cpp
std::vector<at::Tensor> attn_fwd(const at::Tensor& qkv, const at::Tensor& seg, int64_t nq, int64_t nk, int64_t D,
                                 double scale);
at::Tensor attn_bwd(const at::Tensor& dout, const at::Tensor& qkv, const at::Tensor& o, const at::Tensor& lse,
                    const at::Tensor& seg, int64_t nq, int64_t nk, int64_t D, double scale);

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
      for (int64_t j = 0; j < I; ++j) ar[j] = g[j] / (1.0f + exp_poly(-g[j])) * u[j];
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
        const float sg = 1.0f / (1.0f + exp_poly(-g[j]));
        const float si = g[j] * sg;
        du[j] = d[j] * si;
        dg[j] = d[j] * u[j] * sg * (1.0f + g[j] * (1.0f - sg));
      }
    }
  });
  return dgu;
}

namespace {

// rows [b, end) of head_rmsnorm_ (out of line for the reason given at rmsnorm_bwd_rows)
__attribute__((noinline)) void head_rmsnorm_rows(int64_t b, int64_t end, int64_t W, int64_t nq, int64_t nh, int64_t D,
                                                 float e, float* p, float* pp, float* rp, const float* wqp,
                                                 const float* wkp) {
  const float invD = 1.0f / static_cast<float>(D);
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
}

// rows [b, end) of head_rmsnorm_bwd_, accumulating the two weight gradients into dw [2, D]
__attribute__((noinline)) void head_rmsnorm_bwd_rows(int64_t b, int64_t end, int64_t W, int64_t nq, int64_t nh,
                                                     int64_t D, float* g, const float* pp, const float* rp,
                                                     const float* wqp, const float* wkp, float* dw) {
  for (int64_t t = b; t < end; ++t)
    for (int64_t h = 0; h < nh; ++h) {
      float* gr = g + t * W + h * D;  // in place
      rms_grad(gr, pp + (t * nh + h) * D, h < nq ? wqp : wkp, rp[t * nh + h], D, nullptr, gr,
               dw + (h < nq ? 0 : D));
    }
}

}  // namespace

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
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t end) {
    head_rmsnorm_rows(b, end, W, nq, nh, D, e, p, pp, rp, wqp, wkp);
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
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t end) {
    head_rmsnorm_bwd_rows(b, end, W, nq, nh, D, g, pp, rp, wqp, wkp, partp + at::get_thread_num() * 2 * D);
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
