// The built-in engine's per-step sampling as one pass per row (LeanStepper's native sampler,
// bound into the lean_step module next to the decode step; see rollout/decoders.py): the draw,
// the log-prob of the drawn token, the stop-token check and the bookkeeping writes that were
// ~15 ATen calls a step in torch_engine.py.
#include <torch/extension.h>

#include "native_math.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using fastgrpo::exp_poly;

namespace {

constexpr int64_t kBlock = 16;  // tokens per partial sum of the inverse-CDF scan (one AVX-512 vector)

// One row's draw. Sampling (temperature > 0): inverse CDF with one uniform u in [0, 1) on
// e_v = exp(z_v / T - max): the first v whose running sum exceeds u · Σ e, found through
// per-block sums (a vocabulary of 152 K scans 9.5 K block sums, then one block of 16), so
// a token with e_v = 0 (a -inf logit: masked) can never be the first to exceed it. Greedy
// (temperature 0): the first maximum, as torch.argmax, with the τ = 1 log-prob. The log-prob is
// z_y / T - max - log Σ e in float64. Returns false for a row whose logits are not finite (a
// NaN, a +inf, or every token masked): no token is defined there.
bool draw_row(const float* z, int64_t V, float temperature, float u, float* e, double* bsum, int64_t& tok,
              float& lp) {
  float zmax = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : zmax)
  for (int64_t v = 0; v < V; ++v) zmax = z[v] > zmax ? z[v] : zmax;
  const bool greedy = temperature == 0.f;
  const bool scaled = !greedy && temperature != 1.f;
  // max_v fl(z_v / T) = fl(max z / T) (division by T > 0 is monotone): the same maximum torch's
  // logsumexp of the divided logits subtracts
  const float mx = scaled ? zmax / temperature : zmax;
  if (scaled) {
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) e[v] = exp_poly(z[v] / temperature - mx);
  } else {
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) e[v] = exp_poly(z[v] - mx);
  }
  // block sums: float within a block of 16 (one vector; a float64 accumulator here would not
  // vectorise: 5x slower), float64 across blocks
  const int64_t nb = (V + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t k = 0; k < nb; ++k) {
    const int64_t lo = k * kBlock, hi = lo + kBlock < V ? lo + kBlock : V;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t v = lo; v < hi; ++v) acc += e[v];
    bsum[k] = acc;
    total += acc;  // in block order: the scan below re-adds the same sums in the same order
  }
  if (!(total > 0.0 && total < std::numeric_limits<double>::infinity())) return false;
  if (greedy) {
    tok = 0;
    while (z[tok] != zmax) ++tok;
  } else {
    const double target = static_cast<double>(u) * total;  // < total for u < 1
    double cum = 0.0;
    int64_t k = 0;
    while (k + 1 < nb && cum + bsum[k] <= target) cum += bsum[k++];
    const int64_t lo = k * kBlock, hi = lo + kBlock < V ? lo + kBlock : V;
    tok = -1;
    for (int64_t v = lo; v < hi; ++v) {
      if (e[v] > 0.f) tok = v;  // the last positive one, should rounding leave the sum short
      cum += static_cast<double>(e[v]);
      if (cum > target && e[v] > 0.f) break;
    }
    if (tok < 0) return false;
  }
  const double zy = scaled ? static_cast<double>(z[tok] / temperature) : static_cast<double>(z[tok]);
  lp = static_cast<float>(zy - static_cast<double>(mx) - std::log(total));
  return true;
}

__attribute__((noinline)) void check_sample(const at::Tensor& logits, const at::Tensor& u, int64_t t,
                                            const at::Tensor& rows, const at::Tensor& stop_ids, const at::Tensor& nxt,
                                            const at::Tensor& alive, const at::Tensor& out_tok,
                                            const at::Tensor& out_lp, const at::Tensor& length,
                                            const at::Tensor& stopped, bool greedy) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "sample_step: logits must be contiguous float32 [rows, vocab]");
  const int64_t b = logits.size(0), B = out_tok.size(0), T = out_tok.size(1);
  TORCH_CHECK(out_tok.dim() == 2 && out_tok.is_contiguous() && out_tok.scalar_type() == at::kLong &&
                  out_lp.sizes() == out_tok.sizes() && out_lp.is_contiguous() && out_lp.scalar_type() == at::kFloat,
              "sample_step: out_tok int64 and out_lp float32 must be contiguous [batch, budget]");
  TORCH_CHECK(t >= 0 && t < T, "sample_step: step ", t, " outside the budget of ", T);
  TORCH_CHECK(greedy || (u.dim() == 2 && u.size(0) == B && u.size(1) > t && u.is_contiguous() &&
                         u.scalar_type() == at::kFloat),
              "sample_step: uniforms must be contiguous float32 [batch, > step]");
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == b && rows.is_contiguous() && rows.scalar_type() == at::kLong &&
                  nxt.dim() == 1 && nxt.size(0) == b && nxt.is_contiguous() && nxt.scalar_type() == at::kLong &&
                  alive.dim() == 1 && alive.size(0) == b && alive.is_contiguous() && alive.scalar_type() == at::kBool,
              "sample_step: rows / nxt (int64) and alive (bool) must be contiguous [", b, "]");
  TORCH_CHECK(length.dim() == 1 && length.size(0) == B && length.is_contiguous() && length.scalar_type() == at::kLong &&
                  stopped.dim() == 1 && stopped.size(0) == B && stopped.is_contiguous() &&
                  stopped.scalar_type() == at::kBool && stop_ids.dim() == 1 && stop_ids.is_contiguous() &&
                  stop_ids.scalar_type() == at::kLong,
              "sample_step: length (int64), stopped (bool) [batch] and stop_ids (int64) must be contiguous");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < B, "sample_step: row ", rp[i], " outside the batch");
}

__attribute__((noinline)) void bad_logits(int64_t i, int64_t t) {
  TORCH_CHECK_VALUE(false, "sampling: the logits of batch row ", i, " at step ", t,
                    " are not finite (a NaN, a +inf, or every token masked to -inf): no token can be drawn");
}

}  // namespace

// One decode step's sampling for a batch, in one pass per row (see draw_row): for batch row i
// (original row rows[i]) draws token y from softmax(logits[i] / temperature) with the uniform
// u[rows[i], t] (greedy when temperature == 0; u may then be empty), and writes nxt[i] = y,
// out_tok[rows[i], t] = y, out_lp[rows[i], t] = its log-prob. A row still alive whose y is in
// stop_ids finishes: alive[i] = false, length[rows[i]] = t + 1, stopped[rows[i]] = true.
// Returns the number of rows that finished. Non-finite logits: ValueError.
int64_t sample_step(const at::Tensor& logits, double temperature, const at::Tensor& u, int64_t t,
                    const at::Tensor& rows, const at::Tensor& stop_ids, at::Tensor& nxt, at::Tensor& alive,
                    at::Tensor& out_tok, at::Tensor& out_lp, at::Tensor& length, at::Tensor& stopped) {
  TORCH_CHECK_VALUE(temperature >= 0.0, "sample_step: temperature ", temperature, " must be >= 0");
  const bool greedy = temperature == 0.0;
  TORCH_CHECK_VALUE(greedy || static_cast<float>(temperature) > 0.f, "sample_step: temperature ", temperature,
                    " underflows float32; use 0 for greedy");
  check_sample(logits, u, t, rows, stop_ids, nxt, alive, out_tok, out_lp, length, stopped, greedy);
  const int64_t b = logits.size(0), V = logits.size(1), T = out_tok.size(1);
  const int64_t Tu = greedy ? 0 : u.size(1), n_stop = stop_ids.numel();
  const float* zp = logits.data_ptr<float>();
  const float* up = greedy ? nullptr : u.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = stop_ids.data_ptr<int64_t>();
  int64_t* np = nxt.data_ptr<int64_t>();
  bool* ap = alive.data_ptr<bool>();
  int64_t* tp = out_tok.data_ptr<int64_t>();
  float* lpp = out_lp.data_ptr<float>();
  int64_t* lenp = length.data_ptr<int64_t>();
  bool* stp = stopped.data_ptr<bool>();
  std::vector<float> e(static_cast<size_t>(V));
  std::vector<double> bsum(static_cast<size_t>((V + kBlock - 1) / kBlock));
  const float temp = static_cast<float>(temperature);
  int64_t n_done = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t r = rp[i];
    int64_t tok = 0;
    float lp = 0.f;
    if (!draw_row(zp + i * V, V, temp, greedy ? 0.f : up[r * Tu + t], e.data(), bsum.data(), tok, lp)) bad_logits(i, t);
    np[i] = tok;
    tp[r * T + t] = tok;
    lpp[r * T + t] = lp;
    if (ap[i]) {
      bool stop = false;
      for (int64_t j = 0; j < n_stop; ++j) stop |= sp[j] == tok;
      if (stop) {
        ap[i] = false;
        lenp[r] = t + 1;
        stp[r] = true;
        ++n_done;
      }
    }
  }
  return n_done;
}

