// Shared float32 math of fastgrpo's native sources (decode_step.cpp, sampler.cpp,
// train_ops.cpp, train_attn.cpp), compiled into each.
#pragma once

#include <cstdint>
#include <cstring>

namespace fastgrpo {

// exp(x) in float32, ~1 ulp over the normal range (Cephes expf): x = k ln2 + r, |r| <= ln2 / 2,
// e^r by its degree-6 minimax polynomial, 2^k built in the exponent bits. Branch-free so that
// `#pragma omp simd` loops calling it vectorise (std::exp would stay a scalar libm call). Below
// ln(FLT_MIN) (so -inf too: masked positions / tokens) it returns exactly 0; NaN stays NaN;
// above 88 it saturates at e^88 (callers subtract a row maximum first, so their inputs are <= 0).
inline float exp_poly(float x) {
  const bool zero = x < -87.33654f;
  float xc = x > 88.f ? 88.f : x;
  xc = xc < -87.33654f ? -87.33654f : xc;
  // round-to-nearest of x / ln2 by the 1.5 * 2^23 shift (exact without -ffast-math)
  const float kf = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = xc - kf * 0.693359375f;
  r = r - kf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  const int32_t k = static_cast<int32_t>(kf);
  const uint32_t bits = static_cast<uint32_t>(k + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return zero ? 0.f : e * scale;
}

}  // namespace fastgrpo
