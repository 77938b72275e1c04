// Per-element FP8 arithmetic shared by the Poplar vertices and the host build.
//
// Everything here is plain, branch-free C++ on float32 bit patterns, so the
// same source compiles with popc for the IPU and with g++ for the host, where
// the span loops auto-vectorise. Formats are the IPU's FP8 formats:
//   ExponentBits 4: F143, E4M3 with bias 8, max 240   (== float8_e4m3fnuz)
//   ExponentBits 5: F152, E5M2 with bias 16, max 57344 (== float8_e5m2fnuz)
// Both have a single NaN code (0x80), no infinities and no negative zero;
// both have their largest finite magnitude at code 0x7f.
//
// Every rounding is done in integer arithmetic. With Poplar's stochastic
// rounding on (enableStochasticRounding), the IPU's float adds and float ->
// half conversions may round stochastically; the only float operations left
// are multiplies by powers of two, which are exact wherever the result matters
// (see castToFp8Span and castFromFp8Span).
//
// Scaling-bias convention: q = encode(x * 2^s), x ~= decode(q) * 2^-s, with
// s = clamp(floor(log2(max / amax)) - margin, -31, 31) and s = 0 for amax 0.
#pragma once

#include <cstring>
#include <type_traits>

namespace ius {

template <unsigned ExponentBits>
struct Fp8Spec;

template <>
struct Fp8Spec<4> {
  static constexpr int mantissaBits = 3;
  static constexpr int bias = 8;
  static constexpr float maxValue = 240.0f;
};

template <>
struct Fp8Spec<5> {
  static constexpr int mantissaBits = 2;
  static constexpr int bias = 16;
  static constexpr float maxValue = 57344.0f;
};

constexpr unsigned char kFp8NanCode = 0x80;
constexpr unsigned char kFp8MaxCode = 0x7f;
constexpr int kMaxLog2Scale = 31;
constexpr unsigned kFloatExponentMask = 0x7f800000u;
constexpr unsigned kFloatMagnitudeMask = 0x7fffffffu;

// memcpy is the portable bit cast (popc and g++ alike); compilers turn it into a move.
inline unsigned floatBits(float value) {
  unsigned bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float floatFromBits(unsigned bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// 2^exponent as a float, exact for |exponent| <= 126.
inline float powerOfTwo(int exponent) {
  return floatFromBits(static_cast<unsigned>(127 + exponent) << 23);
}

// 2^exponent as a float, exact for -149 <= exponent <= 127 (float32 subnormals
// below -126): the range of the MX recipe's E8M0 scales.
inline float powerOfTwoWide(int exponent) {
  return exponent >= -126 ? powerOfTwo(exponent)
                          : floatFromBits(1u << static_cast<unsigned>(exponent + 149));
}

// |x| as an unsigned key whose integer order is the order of magnitudes with
// every NaN above +inf. A max over keys is therefore a NaN-aware amax (a NaN
// wins, as x.abs().max() does), which std::max / fmax would not give.
template <typename T>
inline unsigned magnitudeKey(T x) {
  return floatBits(static_cast<float>(x)) & kFloatMagnitudeMask;
}

inline unsigned maxKey(unsigned a, unsigned b) { return a > b ? a : b; }

inline float floatFromKey(unsigned key) { return floatFromBits(key); }

inline bool keyIsFinite(unsigned key) { return key < kFloatExponentMask; }

template <typename T, typename Index>
inline unsigned amaxKeyOfSpan(const T* __restrict__ x, Index count) {
  unsigned key = 0;
  for (Index i = 0; i < count; ++i) {
    key = maxKey(key, magnitudeKey(x[i]));
  }
  return key;
}

// A finite float32 magnitude (sign bit clear) rounded to nearest, ties to
// even, onto a grid with MantissaBits stored bits whose smallest normal binade
// has the float32 exponent field MinNormalField, as the magnitude bits of that
// format: binade offset << MantissaBits plus the rounded significand, so a
// carry out of the top of a binade lands on the next binade's first code. The
// grid has subnormals below MinNormalField and no upper end: overflow is the
// caller's to decide. Integer arithmetic only.
template <int MantissaBits, int MinNormalField>
inline int roundMagnitude(int magnitude) {
  static_assert(MinNormalField + 23 - MantissaBits >= 25,
                "float32 subnormals must fall below half the grid's smallest step");
  const int rawField = magnitude >> 23;
  const int field = rawField > MinNormalField ? rawField : MinNormalField;
  // Significand bits below the grid's step: 23 - MantissaBits in a normal
  // binade, one more per binade below it. From 25 on, every significand
  // (< 2^24) rounds to 0, so 30 keeps the shifts in range without changing a
  // result; float32 zero and subnormals (rawField 0) land there too.
  const int unclamped = field - rawField + 23 - MantissaBits;
  const int shift = unclamped < 30 ? unclamped : 30;
  const int significand = (magnitude & 0x7fffff) | 0x800000;
  const int halfStepMinusOne = (1 << (shift - 1)) - 1;
  const int odd = (significand >> shift) & 1;
  const int steps = (significand + halfStepMinusOne + odd) >> shift;
  return ((field - MinNormalField) << MantissaBits) + steps;
}

// Round-to-nearest-even float32 -> FP8 code of a value already multiplied by
// the scale. Overflow is decided on the input (at or above max + half a step,
// ties-to-even rounds away from max): +-max when saturating, else NaN.
template <unsigned ExponentBits, bool Saturate>
inline unsigned char encodeFp8(float scaled) {
  using Spec = Fp8Spec<ExponentBits>;
  constexpr int mantissaBits = Spec::mantissaBits;
  constexpr int minNormalField = 127 + 1 - Spec::bias;
  constexpr int maxExponent = (1 << ExponentBits) - 1 - Spec::bias;
  constexpr int overflowBits =
      ((127 + maxExponent) << 23) | (((1 << (mantissaBits + 1)) - 1) << (22 - mantissaBits));
  constexpr int nanBits = 0x7f800000;

  // Signed ints throughout: magnitudes fit in 31 bits, and signed compares
  // are single vector instructions where unsigned ones are not.
  const int bits = static_cast<int>(floatBits(scaled));
  const int magnitude = bits & 0x7fffffff;
  int code = roundMagnitude<mantissaBits, minNormalField>(magnitude);
  code = magnitude >= overflowBits ? (Saturate ? kFp8MaxCode : kFp8NanCode) : code;
  code = magnitude > nanBits ? kFp8NanCode : code;
  // The sign goes on every non-zero code (0x80 already has it): there is no
  // negative zero, so a negative value that rounds to 0 encodes as 0x00.
  const int nonZeroMask = (-code) >> 8;  // all ones for code in 1..0x80, else 0
  code |= (bits >> 24) & 0x80 & nonZeroMask;
  return static_cast<unsigned char>(code);
}

// float32 -> IEEE binary16 bits, round to nearest even: what a float -> half
// conversion gives in round-to-nearest mode, without the conversion (which
// rounds stochastically under stochastic rounding). Overflow gives +-inf, NaN
// the quiet NaN with the input's sign.
inline unsigned short halfBitsFromFloat(float value) {
  constexpr int halfMinNormalField = 127 - 14;
  constexpr int halfInfinity = 0x7c00;
  constexpr int nanBits = 0x7f800000;
  const int bits = static_cast<int>(floatBits(value));
  const int magnitude = bits & 0x7fffffff;
  int code = roundMagnitude<10, halfMinNormalField>(magnitude);
  // Rounding 65520 and above already carries into the infinity code.
  code = code > halfInfinity ? halfInfinity : code;
  code = magnitude > nanBits ? 0x7e00 : code;
  return static_cast<unsigned short>(code | ((bits >> 16) & 0x8000));
}

// What a vertex stores for a float32 result: the value itself for float, the
// round-to-nearest-even half for half.
template <typename T>
inline T storedAs(float value) {
  if constexpr (std::is_same<T, float>::value) {
    return value;
  } else {
    static_assert(sizeof(T) == sizeof(unsigned short), "T is float or half");
    const unsigned short bits = halfBitsFromFloat(value);
    T stored;
    std::memcpy(&stored, &bits, sizeof stored);
    return stored;
  }
}

// FP8 code -> float32 (exact); the NaN code gives a quiet NaN.
template <unsigned ExponentBits>
inline float decodeFp8(unsigned char code) {
  using Spec = Fp8Spec<ExponentBits>;
  constexpr unsigned mantissaMask = (1u << Spec::mantissaBits) - 1u;
  const unsigned c = code;
  const unsigned sign = c >> 7;
  const unsigned magnitude = c & 0x7fu;
  const unsigned exponent = magnitude >> Spec::mantissaBits;
  const unsigned mantissa = magnitude & mantissaMask;

  const unsigned normalBits = (sign << 31) |
                              ((exponent + 127u - Spec::bias) << 23) |
                              (mantissa << (23 - Spec::mantissaBits));
  const float subnormalStep = powerOfTwo(1 - Spec::bias - Spec::mantissaBits);
  const float subnormal = static_cast<float>(static_cast<int>(mantissa)) * subnormalStep;
  const float value = exponent == 0 ? (sign ? -subnormal : subnormal) : floatFromBits(normalBits);
  return c == kFp8NanCode ? floatFromBits(0x7fc00000u) : value;
}

// The multiply by 2^s is exact unless the product leaves float32's normal
// range, and then the code does not depend on how it rounded: a product below
// 2^-126 encodes to 0 and one that overflows float32 is past every FP8 max.
template <unsigned ExponentBits, bool Saturate, typename T, typename Index>
inline void castToFp8Span(const T* __restrict__ x, Index count, float scale,
                          unsigned char* __restrict__ codes) {
  for (Index i = 0; i < count; ++i) {
    codes[i] = encodeFp8<ExponentBits, Saturate>(static_cast<float>(x[i]) * scale);
  }
}

// decode(code) has at most 4 significant bits and |s| <= 31, so the multiply
// by 2^-s stays inside float32's normal range and is exact.
template <unsigned ExponentBits, typename T, typename Index>
inline void castFromFp8Span(const unsigned char* __restrict__ codes, Index count, float scale,
                            T* __restrict__ y) {
  for (Index i = 0; i < count; ++i) {
    y[i] = storedAs<T>(decodeFp8<ExponentBits>(codes[i]) * scale);
  }
}

struct ScalingBias {
  int log2Scale;
  bool nonFinite;
};

// A positive finite float as significand * 2^exponent, significand a 24-bit
// integer with its top bit set (subnormals are normalised).
struct Normalised {
  unsigned significand;
  int exponent;
};

inline Normalised normalise(float positive) {
  const unsigned bits = floatBits(positive);
  const unsigned field = bits >> 23;
  unsigned significand = bits & 0x7fffffu;
  int exponent = static_cast<int>(field) - 127;
  if (field == 0) {
    exponent = -126;
    while ((significand & 0x800000u) == 0) {
      significand <<= 1;
      exponent -= 1;
    }
  } else {
    significand |= 0x800000u;
  }
  return Normalised{significand, exponent};
}

// floor(log2(formatMax / amax)) computed exactly from exponents and
// significands (no division, no log), then the margin and the clamp.
inline ScalingBias scalingBias(float amax, float formatMax, int margin) {
  const unsigned key = floatBits(amax) & kFloatMagnitudeMask;
  if (!keyIsFinite(key)) {
    return ScalingBias{0, true};
  }
  if (key == 0) {
    return ScalingBias{0, false};
  }
  const Normalised top = normalise(formatMax);
  const Normalised bottom = normalise(floatFromBits(key));
  const long long floorLog2 = static_cast<long long>(top.exponent) - bottom.exponent -
                              (top.significand < bottom.significand ? 1 : 0);
  long long scale = floorLog2 - margin;
  scale = scale > kMaxLog2Scale ? kMaxLog2Scale : scale;
  scale = scale < -kMaxLog2Scale ? -kMaxLog2Scale : scale;
  return ScalingBias{static_cast<int>(scale), false};
}

// ---------------------------------------------------------------------------
// Grouped recipes (rowwise, block, MX): a scale per group of elements.

// How a group's scale follows from its amax (the values of the vertices'
// `rule` field, and of the custom op's attribute):
//   kRuleAmax:    the AMAX rule above, with the margin;
//   kRuleMxFloor: OCP MX's E8M0 exponent e = floor(log2(amax)) - emax, emax the
//                 element format's largest exponent (elements above max saturate);
//   kRuleMxUp:    the smallest e with amax <= max * 2^e (nothing saturates).
// Both MX rules clamp e to -127..127 and give e = -127 for an all-zero group;
// in the package's convention s = -e.
constexpr int kRuleAmax = 0;
constexpr int kRuleMxFloor = 1;
constexpr int kRuleMxUp = 2;
constexpr int kMxScaleLimit = 127;

// An element grid: the IPU format with ExponentBits, or with Ocp the OCP
// format with the same bits (E4M3FN, max 448; E5M2, max 57344). Each OCP grid
// is twice the IPU one (one less exponent bias, the same subnormal steps) up
// to the OCP max, so an OCP value is encoded as the IPU code of half of it,
// clamped to half the OCP max: the IPU's own FP8 arithmetic then reads it.
template <unsigned ExponentBits, bool Ocp>
struct ElementGrid {
  static constexpr float maxValue =
      Ocp ? (ExponentBits == 4 ? 448.0f : 57344.0f) : Fp8Spec<ExponentBits>::maxValue;
  // log2 of the grid's step relative to the IPU format's.
  static constexpr int shift = Ocp ? 1 : 0;
};

inline ScalingBias mxScalingBias(float amax, float formatMax, bool roundUp) {
  const unsigned key = floatBits(amax) & kFloatMagnitudeMask;
  if (!keyIsFinite(key)) {
    return ScalingBias{0, true};
  }
  if (key == 0) {
    return ScalingBias{kMxScaleLimit, false};
  }
  const Normalised top = normalise(formatMax);
  const Normalised bottom = normalise(floatFromBits(key));
  int shared = roundUp ? bottom.exponent - top.exponent +
                             (bottom.significand > top.significand ? 1 : 0)
                       : bottom.exponent - top.exponent;
  shared = shared > kMxScaleLimit ? kMxScaleLimit : shared;
  shared = shared < -kMxScaleLimit ? -kMxScaleLimit : shared;
  return ScalingBias{-shared, false};
}

// A group's scale from its amax by `rule`; an unknown rule flags the group
// as non-finite (s = 0), so a bad graph cannot pass unnoticed.
inline ScalingBias groupScalingBias(float amax, float formatMax, int rule, int margin) {
  if (rule == kRuleAmax) return scalingBias(amax, formatMax, margin);
  if (rule == kRuleMxFloor || rule == kRuleMxUp) {
    return mxScalingBias(amax, formatMax, rule == kRuleMxUp);
  }
  return ScalingBias{0, true};
}

// codes = encode(clamp(x * 2^(s - shift))) on the grid: with Ocp, values are
// clamped to half the OCP max first (saturating: the OCP formats' overflow
// is not the IPU format's). The multiply is exact as in castToFp8Span.
template <unsigned ExponentBits, bool Saturate, bool Ocp, typename T, typename Index>
inline void castToGridSpan(const T* __restrict__ x, Index count, int log2Scale,
                           unsigned char* __restrict__ codes) {
  static_assert(Saturate || !Ocp, "the OCP grids saturate");
  using Grid = ElementGrid<ExponentBits, Ocp>;
  const float scale = powerOfTwoWide(log2Scale - Grid::shift);
  if (Ocp) {
    const int clampBits = static_cast<int>(floatBits(Grid::maxValue * 0.5f));
    for (Index i = 0; i < count; ++i) {
      const int bits = static_cast<int>(floatBits(static_cast<float>(x[i]) * scale));
      const int magnitude = bits & 0x7fffffff;
      // Integer compares: NaN (above the infinity bits) passes unclamped.
      const int clamped = magnitude > clampBits && magnitude <= 0x7f800000
                              ? (bits & static_cast<int>(0x80000000u)) | clampBits
                              : bits;
      codes[i] = encodeFp8<ExponentBits, true>(floatFromBits(static_cast<unsigned>(clamped)));
    }
  } else {
    castToFp8Span<ExponentBits, Saturate>(x, count, scale, codes);
  }
}

// values = decode(codes) * 2^(shift - s), exact: decode has at most 4
// significant bits, none below 2^-17, and |s| <= 127.
template <unsigned ExponentBits, bool Ocp, typename T, typename Index>
inline void castFromGridSpan(const unsigned char* __restrict__ codes, Index count, int log2Scale,
                             T* __restrict__ y) {
  const float scale = powerOfTwoWide(ElementGrid<ExponentBits, Ocp>::shift - log2Scale);
  castFromFp8Span<ExponentBits>(codes, count, scale, y);
}

}  // namespace ius
