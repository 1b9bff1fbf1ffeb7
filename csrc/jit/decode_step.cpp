// One decode step of a Qwen2 / Qwen3 / Llama decoder, float32 on CPU: the native twin of
// fastgrpo/rollout/decoders.py's LeanStepper.step (same math, same weights, same mask).
//
// Why: at the built-in engine's sizes (hidden 64–128, a few dozen rows) a decode step from
// Python is ~45 small ATen calls, each costing more in dispatch, allocation and interpreter time
// than in arithmetic, and MKL's sgemm runs its AVX2 path on AMD CPUs. Here the step is plain
// loops compiled for the host (-march=native, so AVX-512 where the CPU has it):
//   - GEMMs against weights transposed once per rollout ([K, N]): each output row is a sum of
//     weight rows scaled by the input, 4 rows × 64 columns held in registers, no horizontal sums;
//     the residual adds accumulate into the hidden state directly (decode_gemm.h / .cpp, with
//     the AVX-512 kernel for weights too large to copy);
//   - the K cache is kept transposed ([B, Hkv, D, S]) so that the scores of a query are D
//     contiguous AXPYs over the cached positions; the values ([B, Hkv, S, D]) are summed the
//     same way; RoPE is applied as the new k goes into the cache;
//   - Qwen3's q_norm / k_norm (an RMSNorm over each head's D values, before RoPE) run on a row's
//     q and k heads in place, just before that row's RoPE (the row is still in L1);
//   - RMSNorm in one pass per row; SiLU·up by a polynomial exp (Cephes' expf: Cody-Waite
//     reduction, degree-6 minimax, ~1 ulp) written so the loop vectorises; the attention softmax
//     stays one ATen call over all rows (a per-row softmax loop here measured slower: 320 vs
//     250 µs a 64-row step at 68 keys).
// `sample_step`, the engine's per-step sampling in one pass per row, lives in sampler.cpp and
// is bound into this module; the polynomial exp is ../native_math.h's.
// The same step serves LeanStepper.native_prefill (the prompt fed a position at a time): there a
// left-pad query sees no key, and attends to nothing (output 0) instead of producing NaNs.
// JIT-compiled by fastgrpo/native/decode_step.py (torch.utils.cpp_extension) on first use; the
// Python step is the fallback and the reference (tests compare the two). The math follows
// transformers' modeling_qwen2 / modeling_qwen3 / modeling_llama as the Python step does; it departs only in
// float32 rounding: summation order (GEMMs accumulate over k in order, dot products in SIMD
// lanes) and the polynomial exp.
#include <torch/extension.h>

#include "decode_gemm.h"
#include "native_math.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using fastgrpo::exp_poly;
using fastgrpo::decode::gemm;
using fastgrpo::decode::kCachedWeight;
using fastgrpo::decode::linear;

constexpr int64_t kPerLayer = 12;  // weights a layer in lean_step's WT (see there)
constexpr int64_t kStreamed = 3;   // and in WS, for a streamed layer (k, v, up)

// the bias entries [off, off + n) of a layer's concatenated bias (empty: none)
inline at::Tensor bias_part(const at::Tensor& bias, int64_t off, int64_t n) {
  return bias.numel() ? bias.narrow(0, off, n) : bias;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t rows = x.size(0), h = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * h;
    float* o = op + r * h;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < h; ++d) acc += xr[d] * xr[d];
    const float inv = 1.f / std::sqrt(acc / static_cast<float>(h) + static_cast<float>(eps));
#pragma omp simd
    for (int64_t d = 0; d < h; ++d) o[d] = wp[d] * (xr[d] * inv);
  }
  return out;
}

// Qwen3's per-head RMSNorm, in place on n heads of D values at x: the formula of rms_norm above
// (one float accumulator, 1 / sqrt), head j < nq with qw, the rest with kw
inline void head_norm(float* x, int64_t n, int64_t nq, int64_t D, const float* qw, const float* kw, float eps) {
  for (int64_t j = 0; j < n; ++j) {
    float* xj = x + j * D;
    const float* w = j < nq ? qw : kw;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; ++d) acc += xj[d] * xj[d];
    const float inv = 1.f / std::sqrt(acc / static_cast<float>(D) + eps);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) xj[d] = w[d] * (xj[d] * inv);
  }
}

// every weight: float32 and contiguous (the loops index raw memory)
void check_weights(const std::vector<at::Tensor>& W) {
  for (const at::Tensor& t : W)
    TORCH_CHECK(!t.numel() || (t.is_contiguous() && t.scalar_type() == at::kFloat),
                "lean_step: weights must be contiguous float32");
}

}  // namespace

// ids [b] / pos [b] int64; slot: the cache position written (width + step); returns logits [b, V].
// WT: 12 tensors per layer (input norm, post norm, qkv weight^T, qkv bias, o weight^T, o bias,
// gate-up weight^T, gate-up bias, down weight^T, down bias, q_norm, k_norm), an empty tensor for a
// missing bias and for the head norms of a model without them (Qwen2 / Llama). WS: empty, or
// for a model whose layers are streamed (see gemm_nk) 3 per layer (k, v, up weights): then WT's
// matrices are nn.Linear's own [N, K] ones, slot 2 = q, 6 = gate (q/k/v and gate/up apart, the
// biases still concatenated). KT[i]: [b, Hkv, D, S] (transposed keys), V[i]: [b, Hkv, S, D];
// lm_wt: [H, vocab], or the lm_head weight [vocab, H] when lm_streamed.
at::Tensor lean_step(const at::Tensor& ids, const at::Tensor& pos, int64_t slot, const at::Tensor& embed,
                     const at::Tensor& cos_t, const at::Tensor& sin_t, const at::Tensor& mask_bias,
                     const std::vector<at::Tensor>& WT, const std::vector<at::Tensor>& WS,
                     const std::vector<at::Tensor>& KT,
                     const std::vector<at::Tensor>& V, const at::Tensor& norm_w, const at::Tensor& lm_wt,
                     const at::Tensor& lm_b, int64_t nh, int64_t nkv, int64_t D, double scaling, double eps,
                     bool want_logits, bool lm_streamed) {
  TORCH_CHECK(WT.size() == kPerLayer * KT.size() && KT.size() == V.size() &&
                  (WS.empty() || WS.size() == kStreamed * KT.size()),
              "lean_step: expected ", kPerLayer, " weights (and none or ", kStreamed,
              " streamed ones) and one K / V cache per layer");
  TORCH_CHECK(embed.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong && pos.scalar_type() == at::kLong,
              "lean_step: float32 weights and int64 ids / positions expected");
  const int64_t b = ids.size(0), S = mask_bias.size(1), g = nh / nkv, half = D / 2;
  const int64_t nq = nh + 2 * nkv, keys = slot + 1;
  TORCH_CHECK(nkv > 0 && nh % nkv == 0 && D % 2 == 0, "lean_step: heads ", nh, " / ", nkv, ", head dim ", D);
  TORCH_CHECK(slot >= 0 && slot < S && mask_bias.size(0) == b && pos.size(0) == b && ids.is_contiguous() &&
                  pos.is_contiguous() && mask_bias.is_contiguous() && mask_bias.scalar_type() == at::kFloat,
              "lean_step: slot ", slot, " outside the cache of ", S, " positions, or rows / layouts disagree");
  TORCH_CHECK(cos_t.is_contiguous() && sin_t.is_contiguous() && cos_t.size(1) == D && sin_t.sizes() == cos_t.sizes(),
              "lean_step: RoPE tables must be contiguous [positions, ", D, "]");
  for (size_t i = 0; i < KT.size(); ++i) {
    TORCH_CHECK(KT[i].is_contiguous() && V[i].is_contiguous() && KT[i].scalar_type() == at::kFloat &&
                    V[i].scalar_type() == at::kFloat && KT[i].sizes() == at::IntArrayRef({b, nkv, D, S}) &&
                    V[i].sizes() == at::IntArrayRef({b, nkv, S, D}),
                "lean_step: layer ", i, ": caches must be contiguous float32 K^T [b, Hkv, D, S] and V [b, Hkv, S, D]");
  }
  check_weights(WT);
  check_weights(WS);
  check_weights({norm_w, lm_wt, lm_b});
  {
    const int64_t H = embed.size(1);
    TORCH_CHECK(norm_w.numel() == H, "lean_step: final norm weight of ", norm_w.numel(), " for hidden ", H);
    for (size_t i = 0; i < KT.size(); ++i) {
      const at::Tensor* w = &WT[i * kPerLayer];
      const bool nk = !WS.empty();  // streamed: q, k, v apart, [N, K] each
      TORCH_CHECK(w[0].numel() == H && w[1].numel() == H && w[2].dim() == 2 && w[2].size(nk ? 1 : 0) == H &&
                      w[2].size(nk ? 0 : 1) == (nk ? nh : nq) * D,
                  "lean_step: layer ", i, ": norm weights [", H, "] and a q/k/v weight^T [", H, ", ", nq * D,
                  "] (or a q weight [", nh * D, ", ", H, "] in a streamed layer) expected");
      // here, not in the loops: the head norms are read D floats at a time without a check
      TORCH_CHECK((w[10].numel() == D && w[11].numel() == D) || (!w[10].numel() && !w[11].numel()),
                  "lean_step: layer ", i, ": q_norm / k_norm weights of ", w[10].numel(), " / ", w[11].numel(),
                  " for head dim ", D, " (both ", D, ", or both empty)");
    }
  }
  {
    const int64_t* pp = pos.data_ptr<int64_t>();
    for (int64_t r = 0; r < b; ++r)
      TORCH_CHECK(pp[r] >= 0 && pp[r] < cos_t.size(0), "lean_step: position ", pp[r], " outside the RoPE table");
  }
  const int64_t* pos_p = pos.data_ptr<int64_t>();
  const float* cos_p = cos_t.data_ptr<float>();
  const float* sin_p = sin_t.data_ptr<float>();
  const float* mask_p = mask_bias.data_ptr<float>();
  const float sc = static_cast<float>(scaling);

  at::Tensor x = embed.index_select(0, ids);
  at::Tensor q = at::empty({b, nh, D}, x.options());
  at::Tensor o = at::empty({b, nh * D}, x.options());
  at::Tensor score = at::empty({b, nh, keys}, x.options());
  at::Tensor act = at::empty({b, 0}, x.options());
  const float eps_f = static_cast<float>(eps);
  for (size_t i = 0; i < KT.size(); ++i) {
    const at::Tensor* w = &WT[i * kPerLayer];
    const bool nk = !WS.empty();  // a streamed layer (see gemm_nk)
    const at::Tensor* ws = nk ? &WS[i * kStreamed] : nullptr;  // k, v, up
    at::Tensor qkv;                      // [b, nq * D]
    if (nk) {
      const at::Tensor xn = rms_norm(x, w[0], eps);
      qkv = at::empty({b, nq * D}, x.options());
      gemm(xn, w[2], bias_part(w[3], 0, nh * D), qkv, false, true, 0);
      gemm(xn, ws[0], bias_part(w[3], nh * D, nkv * D), qkv, false, true, nh * D);
      gemm(xn, ws[1], bias_part(w[3], (nh + nkv) * D, nkv * D), qkv, false, true, (nh + nkv) * D);
    } else {
      qkv = linear(rms_norm(x, w[0], eps), w[2], w[3]);
    }
    float* qkv_p = qkv.data_ptr<float>();
    const float* qn_p = w[10].numel() ? w[10].data_ptr<float>() : nullptr;  // Qwen3's head norms
    const float* kn_p = w[11].numel() ? w[11].data_ptr<float>() : nullptr;
    float* k_p = KT[i].data_ptr<float>();
    float* v_p = V[i].data_ptr<float>();
    float* q_p = q.data_ptr<float>();
    float* s_p = score.data_ptr<float>();
    // RoPE on q and k (k straight into its cache column, v into its cache row), then the
    // masked, scaled scores: score[j, t] = mask[t] + scale · Σ_d q[j, d] · K^T[d, t]
    {
      std::vector<float> rot(static_cast<size_t>(D));
      for (int64_t r = 0; r < b; ++r) {
        const float* c = cos_p + pos_p[r] * D;
        const float* sn = sin_p + pos_p[r] * D;
        const float* src = qkv_p + r * nq * D;
        if (qn_p) head_norm(qkv_p + r * nq * D, nh + nkv, nh, D, qn_p, kn_p, eps_f);  // q, k heads; not v
        for (int64_t j = 0; j < nh + nkv; ++j) {
          const float* xj = src + j * D;
          float* dst = j < nh ? q_p + (r * nh + j) * D : rot.data();
          for (int64_t d = 0; d < half; ++d) dst[d] = xj[d] * c[d] + xj[d + half] * sn[d];
          for (int64_t d = half; d < D; ++d) dst[d] = xj[d] * c[d] + xj[d - half] * sn[d];
          if (j >= nh) {
            float* kcol = k_p + (r * nkv + (j - nh)) * D * S + slot;
            for (int64_t d = 0; d < D; ++d) kcol[d * S] = rot[d];
          }
        }
        for (int64_t j = 0; j < nkv; ++j) {
          const float* vj = src + (nh + nkv + j) * D;
          float* dst = v_p + ((r * nkv + j) * S + slot) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = vj[d];
        }
        const float* mrow = mask_p + r * S;
        // the G query heads of a KV head share each read of its cached keys (the cache is the
        // traffic here: [D, keys] floats per row and KV head, streamed from L2 / L3)
        for (int64_t kh = 0; kh < nkv; ++kh) {
          const float* kt = k_p + (r * nkv + kh) * D * S;
          float* s0 = s_p + (r * nh + kh * g) * keys;
#pragma omp simd
          for (int64_t t = 0; t < g * keys; ++t) s0[t] = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            const float* kd = kt + d * S;
            for (int64_t jj = 0; jj < g; ++jj) {
              const float qd = q_p[(r * nh + kh * g + jj) * D + d];
              float* sj = s0 + jj * keys;
#pragma omp simd
              for (int64_t t = 0; t < keys; ++t) sj[t] += qd * kd[t];
            }
          }
          // masked and scaled; the softmax is one ATen call over every row below (its vectorised
          // exp: 250 vs 320 µs a 64-row step at 68 keys against a per-row loop here)
          for (int64_t jj = 0; jj < g; ++jj) {
            float* sj = s0 + jj * keys;
#pragma omp simd
            for (int64_t t = 0; t < keys; ++t) sj[t] = mrow[t] + sc * sj[t];
          }
        }
      }
    }
    at::Tensor prob = at::_softmax(score, -1, false);
    {
      // A query that sees no key at all (a left-pad position during LeanStepper's native
      // prefill, every key masked) attends to nothing: probabilities 0 (the softmax gave NaN),
      // output 0, so the pad slot's K / V stay finite (and masked later).
      float* pr = prob.data_ptr<float>();
      for (int64_t r = 0; r < b; ++r) {
        const float* mrow = mask_p + r * S;
        bool seen = false;
        for (int64_t t = 0; t < keys && !seen; ++t) seen = mrow[t] > -std::numeric_limits<float>::infinity();
        if (!seen) std::fill(pr + r * nh * keys, pr + (r + 1) * nh * keys, 0.f);
      }
    }
    const float* p_p = prob.data_ptr<float>();
    float* o_p = o.data_ptr<float>();
    // o = P V: each query head's weighted sum of its KV head's cached values, the G heads
    // sharing each read of a value row
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t kh = 0; kh < nkv; ++kh) {
        const float* vc = v_p + (r * nkv + kh) * S * D;
        float* o0 = o_p + (r * nh + kh * g) * D;
        const float* p0 = p_p + (r * nh + kh * g) * keys;
#pragma omp simd
        for (int64_t d = 0; d < g * D; ++d) o0[d] = 0.f;
        for (int64_t t = 0; t < keys; ++t) {
          const float* vt = vc + t * D;
          for (int64_t jj = 0; jj < g; ++jj) {
            const float pt = p0[jj * keys + t];
            float* oj = o0 + jj * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) oj[d] += pt * vt[d];
          }
        }
      }
    }
    gemm(o, w[4], w[5], x, true, nk);                          // x += o W_o^T (+ b_o)
    at::Tensor gu;                                             // [b, 2I]: gate ‖ up
    if (nk) {
      const at::Tensor xn = rms_norm(x, w[1], eps);
      const int64_t I = w[6].size(0);
      gu = at::empty({b, 2 * I}, x.options());
      gemm(xn, w[6], bias_part(w[7], 0, I), gu, false, true, 0);
      gemm(xn, ws[2], bias_part(w[7], I, I), gu, false, true, I);
    } else {
      gu = linear(rms_norm(x, w[1], eps), w[6], w[7]);
    }
    const int64_t I = gu.size(1) / 2;
    if (act.size(1) != I) act = at::empty({b, I}, x.options());
    {
      // SiLU(gate) · up, as ATen's silu: g / (1 + e^-g)
      const float* gp = gu.data_ptr<float>();
      float* ap = act.data_ptr<float>();
      for (int64_t r = 0; r < b; ++r) {
        const float* gr = gp + r * 2 * I;
        float* ar = ap + r * I;
#pragma omp simd
        for (int64_t j = 0; j < I; ++j) ar[j] = gr[j] / (1.f + exp_poly(-gr[j])) * gr[I + j];
      }
    }
    gemm(act, w[8], w[9], x, true, nk);                        // x += act W_down^T (+ b_down)
  }
  // a prefill position before the prompt's last needs only its K / V (written above), not logits
  if (!want_logits) return at::Tensor();
  return linear(rms_norm(x, norm_w, eps), lm_wt, lm_b, lm_streamed);
}

// sampler.cpp
int64_t sample_step(const at::Tensor& logits, double temperature, const at::Tensor& u, int64_t t,
                    const at::Tensor& rows, const at::Tensor& stop_ids, at::Tensor& nxt, at::Tensor& alive,
                    at::Tensor& out_tok, at::Tensor& out_lp, at::Tensor& length, at::Tensor& stopped);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lean_step", &lean_step, "one float32 CPU decode step of a Qwen2 / Qwen3 / Llama decoder (see decode_step.cpp)");
  // weights past this many floats go in nn.Linear's [N, K] layout, the rest transposed ([K, N])
  m.attr("streamed_weight") = kCachedWeight;
  m.attr("streamed_kernel") = fastgrpo::decode::kStreamedKernel;  // gemm_nk; else streamed weights go to at::mm
  m.def("sample_step", &sample_step,
        "one decode step's sampling, log-probs, stop check and bookkeeping for a batch (see decode_step.cpp)");
}
