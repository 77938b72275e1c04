// Host-only FP8 rounding: the same results as fp8_arith.hpp's encodeFp8 and
// decodeFp8(encodeFp8(x)), with fewer operations per element.
//
// The vertex code rounds in integer arithmetic only, because on the IPU a float
// add may round stochastically. On the host the float unit rounds to nearest
// even, so the FP8 subnormal range can be rounded by the classic magic-number
// add: |x| + 2^(m + 23) - 2^(m + 23) leaves |x| rounded to a multiple of 2^m,
// the subnormal step. The normal range rounds the float32 bit pattern to the
// format's mantissa width, the carry running into the exponent. No variable
// shifts, so the loops vectorise to a few instructions per element.
//
// Equality with the vertex functions is checked over every float32 bit
// pattern by `ius_fast_selftest` (exposed for the test suite, which runs a
// strided subset; the full sweep is a standalone check).
#pragma once

#include <cstdint>

#include "../fp8_arith.hpp"

namespace ius {
namespace fast {

template <unsigned ExponentBits>
struct Grid {
  using Spec = Fp8Spec<ExponentBits>;
  static constexpr int mantissaBits = Spec::mantissaBits;
  static constexpr int shift = 23 - mantissaBits;
  // float32 exponent field of the format's smallest normal, and its bit pattern.
  static constexpr int minNormalField = 127 + 1 - Spec::bias;
  static constexpr std::int32_t minNormalBits = minNormalField << 23;
  // 2^(subnormal step exponent + 23): adding it rounds to a multiple of the step.
  static constexpr std::int32_t magicBits = (minNormalField - mantissaBits + 23) << 23;
  static constexpr int maxExponent = (1 << ExponentBits) - 1 - Spec::bias;
  // Magnitudes from here round past max (as encodeFp8 decides overflow).
  static constexpr std::int32_t overflowBits =
      ((127 + maxExponent) << 23) | (((1 << (mantissaBits + 1)) - 1) << (22 - mantissaBits));
  static constexpr std::int32_t maxBits =
      ((127 + maxExponent) << 23) | (((1 << mantissaBits) - 1) << (23 - mantissaBits));
  static constexpr std::int32_t infBits = 0x7f800000;
  static constexpr std::int32_t quietNanBits = 0x7fc00000;
  static constexpr std::int32_t maxCode = kFp8MaxCode;
  static constexpr std::int32_t nanCode = kFp8NanCode;
  // Code magnitude = (rounded float32 bits >> shift) - codeOffset in the normal range.
  static constexpr std::int32_t codeOffset = (minNormalField - 1) << mantissaBits;
};

inline std::int32_t bitsOf(float value) { return static_cast<std::int32_t>(floatBits(value)); }

inline float fromBits(std::int32_t bits) { return floatFromBits(static_cast<unsigned>(bits)); }

// |scaled| (as magnitude bits) rounded to nearest even on the grid, as float32
// bits; no overflow handling (magnitudes at or past overflowBits are the
// caller's).
template <unsigned ExponentBits>
inline std::int32_t roundedMagnitude(std::int32_t magnitude) {
  using G = Grid<ExponentBits>;
  constexpr std::int32_t low = (1 << G::shift) - 1;
  const std::int32_t normal =
      (magnitude + (low >> 1) + ((magnitude >> G::shift) & 1)) & ~low;
  const float magic = fromBits(G::magicBits);
  const std::int32_t subnormal = bitsOf((fromBits(magnitude) + magic) - magic);
  return magnitude < G::minNormalBits ? subnormal : normal;
}

// encodeFp8<ExponentBits, Saturate>(scaled), bit for bit.
template <unsigned ExponentBits, bool Saturate>
inline std::uint8_t encode(float scaled) {
  using G = Grid<ExponentBits>;
  const std::int32_t bits = bitsOf(scaled);
  const std::int32_t magnitude = bits & 0x7fffffff;
  const float magic = fromBits(G::magicBits);
  const std::int32_t subnormal = bitsOf(fromBits(magnitude) + magic) - G::magicBits;
  constexpr std::int32_t low = (1 << G::shift) - 1;
  const std::int32_t normal =
      ((magnitude + (low >> 1) + ((magnitude >> G::shift) & 1)) >> G::shift) - G::codeOffset;
  std::int32_t code = magnitude < G::minNormalBits ? subnormal : normal;
  code = magnitude >= G::overflowBits ? (Saturate ? G::maxCode : G::nanCode) : code;
  code = magnitude > G::infBits ? G::nanCode : code;
  // Sign on every non-zero code; 0x80 already has it. No negative zero.
  code |= code != 0 ? (bits >> 24) & 0x80 : 0;
  return static_cast<std::uint8_t>(code);
}

// decodeFp8(encodeFp8<ExponentBits, Saturate>(scaled)), bit for bit, without
// the code: the value on the grid, +0 for zero, quiet NaN (positive) for NaN.
template <unsigned ExponentBits, bool Saturate>
inline float quantise(float scaled) {
  using G = Grid<ExponentBits>;
  const std::int32_t bits = bitsOf(scaled);
  const std::int32_t magnitude = bits & 0x7fffffff;
  std::int32_t value = roundedMagnitude<ExponentBits>(magnitude);
  value = magnitude >= G::overflowBits ? (Saturate ? G::maxBits : G::quietNanBits) : value;
  value = magnitude > G::infBits ? G::quietNanBits : value;
  // The sign on every non-zero value but NaN (the FP8 NaN decodes to +NaN).
  const std::int32_t signed_ = value | (bits & static_cast<std::int32_t>(0x80000000u));
  value = (value != 0) & (value != G::quietNanBits) ? signed_ : value;
  return fromBits(value);
}

template <unsigned ExponentBits, bool Saturate, typename Index>
inline void encodeSpan(const float* __restrict__ x, Index count, float scale,
                       std::uint8_t* __restrict__ codes) {
  for (Index i = 0; i < count; ++i) {
    codes[i] = encode<ExponentBits, Saturate>(x[i] * scale);
  }
}

// out = decode(encode(x * 2^s)) * 2^-s; the last multiply is exact (at most
// four significant bits, |s| <= 31).
template <unsigned ExponentBits, bool Saturate, typename Index>
inline void quantiseSpan(const float* __restrict__ x, Index count, float scale, float inverse,
                         float* __restrict__ out) {
  for (Index i = 0; i < count; ++i) {
    out[i] = quantise<ExponentBits, Saturate>(x[i] * scale) * inverse;
  }
}

}  // namespace fast
}  // namespace ius
