// Block forms of the host fast path: amax + scale + round to float32 values with one scale per
// group of a row-major float32 matrix, the groups being rectangles of groupRows x groupCols:
//
//   1 x size      a tile along a row (the block recipe's 1x128 tiles, MX's 32-element blocks);
//   size x size   a square block (the block recipe's 128x128 weight blocks);
//   size x 1      a tile down a column: the same tiles for the transposed matrix, so that a GEMM
//                 reducing over the rows gets its operand without a transposing copy;
//   1 x cols, rows x 1, rows x cols: per row, per column, per tensor.
//
// A ragged last group (a size that does not divide the matrix) is a smaller group. Each group's
// scale 2^s follows from its amax by one of two rules: the package's AMAX rule (scalingBias,
// clamped to +-31, 0 for an all-zero group) or OCP MX's E8M0 shared exponent e (floor or
// round-up of log2(amax) against the element format's emax, clamped to +-127, -127 for an
// all-zero group; s = -e). The element rounding is fp8_fast.hpp's on the F143/F152 grid; the
// OCP formats run on that grid at half scale (stepLog2 = 1), clamped to half their max first,
// exactly as ipu_unit_scaling/fp8/group_cast.py composes them, a zero keeping its input's sign
// (the OCP formats have -0), so the values are its torch path's values bit for bit. A group
// whose amax is not finite makes the call return 1 (its values are then unspecified).
//
// Two loops, both reading each group twice while it is in cache (amax, then round):
//  * span groups (tiles along a row, groupRows == 1, and whole rows): in batches of groups, the
//    amax keys of each group's row segments, then the scales, then the segments rounded with
//    one scale each;
//  * band groups (column tiles, groupCols == 1, and blocks): a band of groupRows rows is taken
//    in chunks as wide as the matrix (up to a bound), read row by row in both passes; the amax
//    runs down the rows with one column per SIMD lane, a block's key is the max of its
//    columns', and each row is rounded with per-column (or per-block) scales.
// The scales of many groups are computed at once in SIMD lanes (scalesOf).
#pragma once

#include <cstdint>
#include <vector>

#include "fp8_fused.hpp"

namespace ius {
namespace groups {

using Index = std::int64_t;

enum Rule : int { kAmaxRule = 0, kMxFloor = 1, kMxUp = 2 };

constexpr int kMxScaleLimit = 127;
constexpr int kNonFiniteScale = 1 << 30;

struct Layout {
  Index rows, cols, groupRows, groupCols;
  Index bands() const { return (rows + groupRows - 1) / groupRows; }
  Index groupColumns() const { return (cols + groupCols - 1) / groupCols; }
};

struct ScaleRule {
  int rule;
  float formatMax;  // the target format's max (AMAX rule, MX round-up)
  int emax;         // its largest exponent (MX floor)
  int margin;       // AMAX rule only
  int stepLog2;     // 1 for the OCP formats on the IPU grid, else 0
  float clampMax;   // formatMax / 2^stepLog2 when stepLog2 != 0, else 0 (no clamp)
};

// 2^e in float32 for -149 <= e <= 127 (subnormal below -126), exactly.
inline float exactPowerOfTwo(int e) {
  if (e >= -126) return powerOfTwo(e);
  return floatFromBits(1u << (e + 149));
}

// The scale s of a group with this amax key, or kNonFiniteScale. Integer arithmetic on the
// normalised significands and exponents (as scalingBias), the format's max normalised once.
inline int groupScale(unsigned key, const ScaleRule& rule, const Normalised& top) {
  if (!keyIsFinite(key)) return kNonFiniteScale;
  if (key == 0) return rule.rule == kAmaxRule ? 0 : kMxScaleLimit;  // MX: e = -127
  const Normalised amax = normalise(floatFromKey(key));  // amax = significand * 2^(exponent - 23)
  if (rule.rule == kAmaxRule) {
    const int floorLog2 = top.exponent - amax.exponent - (top.significand < amax.significand ? 1 : 0);
    const int scale = floorLog2 - rule.margin;
    return scale > kMaxLog2Scale ? kMaxLog2Scale : (scale < -kMaxLog2Scale ? -kMaxLog2Scale : scale);
  }
  // MX: floor(log2(amax)) - emax, or the smallest e with amax <= formatMax * 2^e.
  int shared = rule.rule == kMxFloor
                   ? amax.exponent - rule.emax
                   : amax.exponent - top.exponent + (amax.significand > top.significand ? 1 : 0);
  shared = shared > kMxScaleLimit ? kMxScaleLimit : (shared < -kMxScaleLimit ? -kMxScaleLimit : shared);
  return -shared;
}

// The multiplier into the grid and the one back, as group_cast.py computes them in float32.
struct Factors {
  float scale, inverse;
};

// (2^s / 2^step is 2^(s - step) exactly: |s| <= 127 and step <= 1 stay above 2^-149.)
inline Factors factorsOf(int s, const ScaleRule& rule) {
  return Factors{exactPowerOfTwo(s - rule.stepLog2), exactPowerOfTwo(-s) * powerOfTwo(rule.stepLog2)};
}

inline float clampTo(float y, float limit) { return y < -limit ? -limit : (y > limit ? limit : y); }

// Outputs of at least this many bytes are written with streaming stores (put512).
constexpr Index kStreamBytes = Index(1) << 24;

inline bool streamable(const float* row, bool stream) {
  return stream && (reinterpret_cast<std::uintptr_t>(row) & 63) == 0;
}

// ---------------------------------------------------------------- many scales at once

// s, scale and inverse of n groups from their amax keys (s[i] is kNonFiniteScale for a
// non-finite amax, whose group is then rounded with s = 0); returns whether all were finite.
inline bool scalesPortable(const unsigned* keys, Index n, const ScaleRule& rule, const Normalised& top,
                           int* s, float* scale, float* inverse) {
  bool finite = true;
  for (Index i = 0; i < n; ++i) {
    const int value = groupScale(keys[i], rule, top);
    s[i] = value;
    finite = finite && value != kNonFiniteScale;
    const Factors f = factorsOf(value == kNonFiniteScale ? 0 : value, rule);
    scale[i] = f.scale;
    inverse[i] = f.inverse;
  }
  return finite;
}

#ifdef IUS_HAVE_AVX2_KERNELS
// The vector forms compute groupScale and factorsOf in integer lanes, the same integers for
// a normal or zero amax; a vector holding a subnormal amax (normalising it needs a count of
// leading zeros) takes the scalar form. Lanes hold keys <= 0x7fffffff, so signed compares
// order them.

// 2^e as float bits for -149 <= e <= 127, subnormal below -126 (exactPowerOfTwo).
IUS_AVX512 inline __m512i powerOfTwoBits16(__m512i e) {
  const __m512i normal = _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23);
  const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(1), _mm512_add_epi32(e, _mm512_set1_epi32(149)));
  return _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(-126)), normal, subnormal);
}

IUS_AVX512 bool scales512(const unsigned* keys, Index n, const ScaleRule& rule, const Normalised& top,
                          int* s, float* scale, float* inverse) {
  bool finite = true;
  const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512();
  const __m512i topExponent = _mm512_set1_epi32(top.exponent);
  const __m512i topSignificand = _mm512_set1_epi32(static_cast<int>(top.significand));
  const __m512 stepFactor = _mm512_set1_ps(powerOfTwo(rule.stepLog2));
  Index i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i k = _mm512_loadu_si512(keys + i);
    const __mmask16 isZero = _mm512_cmpeq_epi32_mask(k, zero);
    if (_mm512_mask_cmplt_epi32_mask(static_cast<__mmask16>(~isZero), k, _mm512_set1_epi32(0x800000)) != 0) {
      finite = scalesPortable(keys + i, 16, rule, top, s + i, scale + i, inverse + i) && finite;
      continue;
    }
    const __mmask16 nonFinite = _mm512_cmpgt_epi32_mask(k, _mm512_set1_epi32(0x7f7fffff));
    const __m512i exponent = _mm512_sub_epi32(_mm512_srli_epi32(k, 23), _mm512_set1_epi32(127));
    const __m512i significand = _mm512_or_si512(_mm512_and_si512(k, _mm512_set1_epi32(0x7fffff)),
                                                _mm512_set1_epi32(0x800000));
    const __mmask16 above = _mm512_cmpgt_epi32_mask(significand, topSignificand);
    __m512i value;
    if (rule.rule == kAmaxRule) {
      __m512i floorLog2 = _mm512_sub_epi32(topExponent, exponent);
      floorLog2 = _mm512_mask_sub_epi32(floorLog2, above, floorLog2, one);
      value = _mm512_sub_epi32(floorLog2, _mm512_set1_epi32(rule.margin));
      value = _mm512_min_epi32(_mm512_max_epi32(value, _mm512_set1_epi32(-kMaxLog2Scale)),
                               _mm512_set1_epi32(kMaxLog2Scale));
      value = _mm512_mask_mov_epi32(value, isZero, zero);
    } else {
      __m512i shared;
      if (rule.rule == kMxFloor) {
        shared = _mm512_sub_epi32(exponent, _mm512_set1_epi32(rule.emax));
      } else {
        shared = _mm512_sub_epi32(exponent, topExponent);
        shared = _mm512_mask_add_epi32(shared, above, shared, one);
      }
      shared = _mm512_min_epi32(_mm512_max_epi32(shared, _mm512_set1_epi32(-kMxScaleLimit)),
                                _mm512_set1_epi32(kMxScaleLimit));
      value = _mm512_mask_mov_epi32(_mm512_sub_epi32(zero, shared), isZero, _mm512_set1_epi32(kMxScaleLimit));
    }
    _mm512_storeu_si512(s + i, _mm512_mask_mov_epi32(value, nonFinite, _mm512_set1_epi32(kNonFiniteScale)));
    finite = finite && nonFinite == 0;
    const __m512i used = _mm512_mask_mov_epi32(value, nonFinite, zero);
    _mm512_storeu_ps(scale + i, _mm512_castsi512_ps(powerOfTwoBits16(
                                    _mm512_sub_epi32(used, _mm512_set1_epi32(rule.stepLog2)))));
    _mm512_storeu_ps(inverse + i, _mm512_mul_ps(_mm512_castsi512_ps(powerOfTwoBits16(_mm512_sub_epi32(zero, used))),
                                                stepFactor));
  }
  return scalesPortable(keys + i, n - i, rule, top, s + i, scale + i, inverse + i) && finite;
}

IUS_AVX2 inline __m256i powerOfTwoBits8(__m256i e) {
  const __m256i normal = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23);
  const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(1), _mm256_add_epi32(e, _mm256_set1_epi32(149)));
  return _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(-126), e));
}

IUS_AVX2 bool scales256(const unsigned* keys, Index n, const ScaleRule& rule, const Normalised& top,
                        int* s, float* scale, float* inverse) {
  bool finite = true;
  const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
  const __m256i topExponent = _mm256_set1_epi32(top.exponent);
  const __m256i topSignificand = _mm256_set1_epi32(static_cast<int>(top.significand));
  const __m256 stepFactor = _mm256_set1_ps(powerOfTwo(rule.stepLog2));
  Index i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + i));
    const __m256i isZero = _mm256_cmpeq_epi32(k, zero);
    const __m256i subnormal = _mm256_andnot_si256(isZero, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x800000), k));
    if (!_mm256_testz_si256(subnormal, subnormal)) {
      finite = scalesPortable(keys + i, 8, rule, top, s + i, scale + i, inverse + i) && finite;
      continue;
    }
    const __m256i nonFinite = _mm256_cmpgt_epi32(k, _mm256_set1_epi32(0x7f7fffff));
    const __m256i exponent = _mm256_sub_epi32(_mm256_srli_epi32(k, 23), _mm256_set1_epi32(127));
    const __m256i significand = _mm256_or_si256(_mm256_and_si256(k, _mm256_set1_epi32(0x7fffff)),
                                                _mm256_set1_epi32(0x800000));
    const __m256i above = _mm256_and_si256(_mm256_cmpgt_epi32(significand, topSignificand), one);
    __m256i value;
    if (rule.rule == kAmaxRule) {
      value = _mm256_sub_epi32(_mm256_sub_epi32(_mm256_sub_epi32(topExponent, exponent), above),
                               _mm256_set1_epi32(rule.margin));
      value = _mm256_min_epi32(_mm256_max_epi32(value, _mm256_set1_epi32(-kMaxLog2Scale)),
                               _mm256_set1_epi32(kMaxLog2Scale));
      value = _mm256_andnot_si256(isZero, value);
    } else {
      __m256i shared = rule.rule == kMxFloor
                           ? _mm256_sub_epi32(exponent, _mm256_set1_epi32(rule.emax))
                           : _mm256_add_epi32(_mm256_sub_epi32(exponent, topExponent), above);
      shared = _mm256_min_epi32(_mm256_max_epi32(shared, _mm256_set1_epi32(-kMxScaleLimit)),
                                _mm256_set1_epi32(kMxScaleLimit));
      value = _mm256_blendv_epi8(_mm256_sub_epi32(zero, shared), _mm256_set1_epi32(kMxScaleLimit), isZero);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + i),
                        _mm256_blendv_epi8(value, _mm256_set1_epi32(kNonFiniteScale), nonFinite));
    finite = finite && _mm256_testz_si256(nonFinite, nonFinite);
    const __m256i used = _mm256_andnot_si256(nonFinite, value);
    _mm256_storeu_ps(scale + i, _mm256_castsi256_ps(powerOfTwoBits8(
                                    _mm256_sub_epi32(used, _mm256_set1_epi32(rule.stepLog2)))));
    _mm256_storeu_ps(inverse + i, _mm256_mul_ps(_mm256_castsi256_ps(powerOfTwoBits8(_mm256_sub_epi32(zero, used))),
                                                stepFactor));
  }
  return scalesPortable(keys + i, n - i, rule, top, s + i, scale + i, inverse + i) && finite;
}
#endif

inline bool scalesOf(int level, const unsigned* keys, Index n, const ScaleRule& rule, const Normalised& top,
                     int* s, float* scale, float* inverse) {
#ifdef IUS_HAVE_AVX2_KERNELS
  if (level == 2) return scales512(keys, n, rule, top, s, scale, inverse);
  if (level == 1) return scales256(keys, n, rule, top, s, scale, inverse);
#endif
  (void)level;
  return scalesPortable(keys, n, rule, top, s, scale, inverse);
}

// ---------------------------------------------------------------- element rounding

// With clampMax (an OCP format on the IPU grid) a zero keeps the sign of its input: the OCP
// formats have -0, F143 and F152 do not.
inline float withSignOf(float value, float input) {
  return floatFromBits(floatBits(value) | (floatBits(input) & 0x80000000u));
}

template <unsigned E, bool S>
IUS_HOT inline void quantisePortable(const float* x, Index n, Factors f, float clampMax, float* out) {
  if (clampMax > 0) {
    for (Index i = 0; i < n; ++i) {
      const float y = clampTo(x[i] * f.scale, clampMax);
      out[i] = withSignOf(fast::quantise<E, S>(y) * f.inverse, y);
    }
  } else {
    for (Index i = 0; i < n; ++i) out[i] = fast::quantise<E, S>(x[i] * f.scale) * f.inverse;
  }
}

#ifdef IUS_HAVE_AVX2_KERNELS
// quantise16 for the values of a group with a finite amax, which hold no NaN or infinity:
// the step 2^(e + shift) takes the value's sign, so adding and subtracting it rounds the
// signed value (a negative one that rounds to zero comes out +0, as F143 and F152 have no
// -0), and only the overflow lanes are replaced (reachable where the scale was clamped).
template <unsigned E, bool S>
IUS_AVX512 inline __m512 quantiseFinite16(__m512 x, __m512 scale, __m512 inverse) {
  using G = fast::Grid<E>;
  const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(x, scale));
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i exponent = _mm512_max_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7f800000)),
                                            _mm512_set1_epi32(G::minNormalBits));
  const __m512 step = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_add_epi32(exponent, _mm512_set1_epi32(G::shift << 23)), sign));
  __m512i value = _mm512_castps_si512(_mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(bits), step), step));
  const __mmask16 overflow = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                     _mm512_set1_epi32(G::overflowBits - 1));
  value = S ? _mm512_mask_or_epi32(value, overflow, sign, _mm512_set1_epi32(G::maxBits))
            : _mm512_mask_mov_epi32(value, overflow, _mm512_set1_epi32(G::quietNanBits));
  return _mm512_mul_ps(_mm512_castsi512_ps(value), inverse);
}

template <unsigned E, bool S>
IUS_AVX2 inline __m256 quantiseFinite8(__m256 x, __m256 scale, __m256 inverse) {
  using G = fast::Grid<E>;
  const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(x, scale));
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i exponent = _mm256_max_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7f800000)),
                                            _mm256_set1_epi32(G::minNormalBits));
  const __m256 step = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_add_epi32(exponent, _mm256_set1_epi32(G::shift << 23)), sign));
  __m256i value = _mm256_castps_si256(_mm256_sub_ps(_mm256_add_ps(_mm256_castsi256_ps(bits), step), step));
  const __m256i overflow = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                              _mm256_set1_epi32(G::overflowBits - 1));
  const __m256i replacement = S ? _mm256_or_si256(sign, _mm256_set1_epi32(G::maxBits))
                                : _mm256_set1_epi32(G::quietNanBits);
  value = _mm256_blendv_epi8(value, replacement, overflow);
  return _mm256_mul_ps(_mm256_castsi256_ps(value), inverse);
}

// With clampMax, quantisePortable's clamped branch: |y| <= clampMax, a point of the grid
// below its max, cannot round past it, and a group with a finite amax holds no NaN or
// infinity, so the rounding needs neither quantise16's overflow nor its NaN lanes: the add
// and subtract of 2^(e + shift) on the magnitude, then the sign (on zeros too) and the
// inverse scale, exact in either order. It starts from |x| and x's sign, which the pair
// kernel takes once for its two roundings of each value: |clamp(x * s)| = min(|x| * s,
// clampMax), and x * s has the sign of x.
template <unsigned E>
IUS_AVX512 inline __m512 roundClamped512(__m512i magnitudeOfX, __m512i sign, __m512 scale, __m512 inverse,
                                         __m512 limit) {
  using G = fast::Grid<E>;
  const __m512 y = _mm512_min_ps(_mm512_mul_ps(_mm512_castsi512_ps(magnitudeOfX), scale), limit);
  const __m512i exponent = _mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7f800000)),
                                            _mm512_set1_epi32(G::minNormalBits));
  const __m512 step = _mm512_castsi512_ps(_mm512_add_epi32(exponent, _mm512_set1_epi32(G::shift << 23)));
  const __m512 value = _mm512_sub_ps(_mm512_add_ps(y, step), step);
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign)), inverse);
}

template <unsigned E>
IUS_AVX2 inline __m256 roundClamped256(__m256i magnitudeOfX, __m256i sign, __m256 scale, __m256 inverse,
                                       __m256 limit) {
  using G = fast::Grid<E>;
  const __m256 y = _mm256_min_ps(_mm256_mul_ps(_mm256_castsi256_ps(magnitudeOfX), scale), limit);
  const __m256i exponent = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(y), _mm256_set1_epi32(0x7f800000)),
                                            _mm256_set1_epi32(G::minNormalBits));
  const __m256 step = _mm256_castsi256_ps(_mm256_add_epi32(exponent, _mm256_set1_epi32(G::shift << 23)));
  const __m256 value = _mm256_sub_ps(_mm256_add_ps(y, step), step);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(value), sign)), inverse);
}

// Stores of an output too large to stay in cache stream past it: a plain store reads each line
// before writing it, a third more memory traffic for a cast, and a GEMM reading an output that
// large takes it from memory either way. Streaming stores need 64-byte aligned rows
// (streamable); they are ordered by the sfence at the end of each worker's part (run).
IUS_AVX512 inline void put512(float* p, __m512 v, bool stream) {
  if (stream) {
    _mm512_stream_ps(p, v);
  } else {
    _mm512_storeu_ps(p, v);
  }
}

IUS_AVX2 inline void put256(float* p, __m256 v, bool stream) {
  if (stream) {
    _mm256_stream_ps(p, v);
  } else {
    _mm256_storeu_ps(p, v);
  }
}

template <unsigned E, bool S>
IUS_AVX512 inline __m512 quantiseLanes512(__m512 x, __m512 scale, __m512 inverse, float clampMax) {
  if (clampMax > 0) {
    const __m512i bits = _mm512_castps_si512(x);
    return roundClamped512<E>(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                              _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u))), scale,
                              inverse, _mm512_set1_ps(clampMax));
  }
  return quantiseFinite16<E, S>(x, scale, inverse);
}

template <unsigned E, bool S>
IUS_AVX2 inline __m256 quantiseLanes256(__m256 x, __m256 scale, __m256 inverse, float clampMax) {
  if (clampMax > 0) {
    const __m256i bits = _mm256_castps_si256(x);
    return roundClamped256<E>(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                              _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u))), scale,
                              inverse, _mm256_set1_ps(clampMax));
  }
  return quantiseFinite8<E, S>(x, scale, inverse);
}

// Per-column amax keys of rows [r0, r1), columns [c0, c0 + width), for the whole vectors of
// the chunk; returns how many columns they covered.
IUS_AVX512 inline Index lanesAmax512(const float* in, Index cols, Index r0, Index r1, Index c0,
                                     Index width, unsigned* key) {
  const Index vectors = width / 16 * 16;
  Index r = r0;
  for (; r + 4 <= r1; r += 4) {  // four rows a pass: one load and store of the keys for four
    const float* row = in + r * cols + c0;
    for (Index c = 0; c < vectors; c += 16) {
      const __m512i a = simd512::maxKey16(_mm512_loadu_si512(key + c), row + c);
      const __m512i b = simd512::maxKey16(a, row + cols + c);
      const __m512i d = simd512::maxKey16(b, row + 2 * cols + c);
      _mm512_storeu_si512(key + c, simd512::maxKey16(d, row + 3 * cols + c));
    }
  }
  for (; r < r1; ++r) {
    const float* row = in + r * cols + c0;
    for (Index c = 0; c < vectors; c += 16) {
      const __m512i k = _mm512_loadu_si512(key + c);
      _mm512_storeu_si512(key + c, simd512::maxKey16(k, row + c));
    }
  }
  return vectors;
}

IUS_AVX2 inline Index lanesAmax256(const float* in, Index cols, Index r0, Index r1, Index c0,
                                   Index width, unsigned* key) {
  const Index vectors = width / 8 * 8;
  for (Index r = r0; r < r1; ++r) {
    const float* row = in + r * cols + c0;
    for (Index c = 0; c < vectors; c += 8) {
      const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(key + c), simd::maxKey8(k, row + c));
    }
  }
  return vectors;
}

// One row segment rounded with per-column factors; returns the columns done.
template <unsigned E, bool S>
IUS_AVX512 inline Index lanesQuantise512(const float* row, Index width, const float* scale,
                                         const float* inverse, float clampMax, float* out, bool stream) {
  stream = streamable(out, stream);
  Index c = 0;
  for (; c + 16 <= width; c += 16) {
    put512(out + c, quantiseLanes512<E, S>(_mm512_loadu_ps(row + c), _mm512_loadu_ps(scale + c),
                                           _mm512_loadu_ps(inverse + c), clampMax), stream);
  }
  return c;
}

// Two rows (a row apart in `in` and `out`) with one load of the factors.
template <unsigned E, bool S>
IUS_AVX512 inline Index lanesQuantiseTwo512(const float* row, Index cols, Index width, const float* scale,
                                            const float* inverse, float clampMax, float* out, bool stream) {
  stream = streamable(out, stream) && streamable(out + cols, stream);
  Index c = 0;
  for (; c + 16 <= width; c += 16) {
    const __m512 f = _mm512_loadu_ps(scale + c), g = _mm512_loadu_ps(inverse + c);
    put512(out + c, quantiseLanes512<E, S>(_mm512_loadu_ps(row + c), f, g, clampMax), stream);
    put512(out + cols + c, quantiseLanes512<E, S>(_mm512_loadu_ps(row + cols + c), f, g, clampMax), stream);
  }
  return c;
}

template <unsigned E, bool S>
IUS_AVX2 inline Index lanesQuantise256(const float* row, Index width, const float* scale,
                                       const float* inverse, float clampMax, float* out, bool stream) {
  stream = streamable(out, stream);
  Index c = 0;
  for (; c + 8 <= width; c += 8) {
    put256(out + c, quantiseLanes256<E, S>(_mm256_loadu_ps(row + c), _mm256_loadu_ps(scale + c),
                                           _mm256_loadu_ps(inverse + c), clampMax), stream);
  }
  return c;
}
// A row segment rounded with one scale; the scalar tail as quantisePortable.
template <unsigned E, bool S>
IUS_AVX512 inline void roundRow512(const float* row, Index width, Factors f, float clampMax, float* target,
                                   bool stream) {
  const __m512 scales = _mm512_set1_ps(f.scale), inverses = _mm512_set1_ps(f.inverse);
  const Index vectors = width / 16 * 16;
  stream = streamable(target, stream);
  for (Index c = 0; c < vectors; c += 16) {
    put512(target + c, quantiseLanes512<E, S>(_mm512_loadu_ps(row + c), scales, inverses, clampMax), stream);
  }
  if (vectors < width) quantisePortable<E, S>(row + vectors, width - vectors, f, clampMax, target + vectors);
}

template <unsigned E, bool S>
IUS_AVX2 inline void roundRow256(const float* row, Index width, Factors f, float clampMax, float* target,
                                 bool stream) {
  const __m256 scales = _mm256_set1_ps(f.scale), inverses = _mm256_set1_ps(f.inverse);
  const Index vectors = width / 8 * 8;
  stream = streamable(target, stream);
  for (Index c = 0; c < vectors; c += 8) {
    put256(target + c, quantiseLanes256<E, S>(_mm256_loadu_ps(row + c), scales, inverses, clampMax), stream);
  }
  if (vectors < width) quantisePortable<E, S>(row + vectors, width - vectors, f, clampMax, target + vectors);
}
#endif

template <unsigned E, bool S>
inline void roundRow(int level, const float* row, Index width, Factors f, float clampMax, float* target,
                     bool stream) {
#ifdef IUS_HAVE_AVX2_KERNELS
  if (level == 2) return roundRow512<E, S>(row, width, f, clampMax, target, stream);
  if (level == 1) return roundRow256<E, S>(row, width, f, clampMax, target, stream);
#endif
  (void)level;
  (void)stream;
  quantisePortable<E, S>(row, width, f, clampMax, target);
}

// ---------------------------------------------------------------- span groups

// A span group's rows and columns, [r0, r1) x [c0, c1).
struct Span {
  Index r0, r1, c0, c1;
};

inline Span spanOf(const Layout& l, Index band, Index column) {
  const Index r0 = band * l.groupRows, c0 = column * l.groupCols;
  return Span{r0, r0 + l.groupRows < l.rows ? r0 + l.groupRows : l.rows, c0,
              c0 + l.groupCols < l.cols ? c0 + l.groupCols : l.cols};
}

// Groups first, first + 1, ... in (band, groupColumn) order, with no division per group (an
// integer division costs more than rounding MX's 32 elements).
struct SpanWalk {
  const Layout& l;
  Index perBand, band, column;
  SpanWalk(const Layout& layout, Index first)
      : l(layout), perBand(layout.groupColumns()), band(first / perBand), column(first % perBand) {}
  Span next() {
    const Span g = spanOf(l, band, column);
    if (++column == perBand) {
      column = 0;
      ++band;
    }
    return g;
  }
};

// Span groups are taken in batches of kBatch, in three passes over a batch (its data stays
// in L1/L2): the amax keys, the scales, the rounding. No pass waits on the one before for
// each group, so the CPU overlaps consecutive groups: MX's 32-element tiles are two AVX-512
// vectors each, too short to hide a chain of amax, reduction, scale and rounding per group.
constexpr Index kBatch = 64;

// Passes 1 and 3 for each SIMD level: keys[i] of group first + i, and the rounding of group
// first + i with factors scale[i], inverse[i].
IUS_HOT inline void spanKeysPortable(const float* in, const Layout& l, Index first, Index n,
                                     unsigned* keys) {
  SpanWalk walk(l, first);
  for (Index i = 0; i < n; ++i) {
    const Span g = walk.next();
    unsigned key = 0;
    for (Index r = g.r0; r < g.r1; ++r) key = maxKey(key, amaxKeyOfSpan(in + r * l.cols + g.c0, g.c1 - g.c0));
    keys[i] = key;
  }
}

template <unsigned E, bool S>
IUS_HOT void spanRoundPortable(const float* in, float* out, const Layout& l, const ScaleRule& rule,
                               Index first, Index n, const float* scale, const float* inverse) {
  SpanWalk walk(l, first);
  for (Index i = 0; i < n; ++i) {
    const Span g = walk.next();
    for (Index r = g.r0; r < g.r1; ++r) {
      quantisePortable<E, S>(in + r * l.cols + g.c0, g.c1 - g.c0, Factors{scale[i], inverse[i]}, rule.clampMax,
                             out + r * l.cols + g.c0);
    }
  }
}

#ifdef IUS_HAVE_AVX2_KERNELS
IUS_AVX512 void spanKeys512(const float* in, const Layout& l, Index first, Index n, unsigned* keys) {
  SpanWalk walk(l, first);
  for (Index i = 0; i < n; ++i) {
    const Span g = walk.next();
    const Index width = g.c1 - g.c0, vectors = width / 16 * 16;
    __m512i key = _mm512_setzero_si512();
    unsigned tail = 0;
    for (Index r = g.r0; r < g.r1; ++r) {
      const float* row = in + r * l.cols + g.c0;
      for (Index c = 0; c < vectors; c += 16) key = simd512::maxKey16(key, row + c);
      for (Index c = vectors; c < width; ++c) tail = maxKey(tail, magnitudeKey(row[c]));
    }
    keys[i] = maxKey(tail, _mm512_reduce_max_epu32(key));
  }
}

template <unsigned E, bool S>
IUS_AVX512 void spanRound512(const float* in, float* out, const Layout& l, const ScaleRule& rule,
                             Index first, Index n, const float* scale, const float* inverse, bool stream) {
  SpanWalk walk(l, first);
  for (Index i = 0; i < n; ++i) {
    const Span g = walk.next();
    const Index width = g.c1 - g.c0;
    for (Index r = g.r0; r < g.r1; ++r) {
      roundRow512<E, S>(in + r * l.cols + g.c0, width, Factors{scale[i], inverse[i]}, rule.clampMax,
                        out + r * l.cols + g.c0, stream);
    }
  }
}

IUS_AVX2 void spanKeys256(const float* in, const Layout& l, Index first, Index n, unsigned* keys) {
  SpanWalk walk(l, first);
  for (Index i = 0; i < n; ++i) {
    const Span g = walk.next();
    const Index width = g.c1 - g.c0, vectors = width / 8 * 8;
    __m256i key = _mm256_setzero_si256();
    unsigned tail = 0;
    for (Index r = g.r0; r < g.r1; ++r) {
      const float* row = in + r * l.cols + g.c0;
      for (Index c = 0; c < vectors; c += 8) key = simd::maxKey8(key, row + c);
      for (Index c = vectors; c < width; ++c) tail = maxKey(tail, magnitudeKey(row[c]));
    }
    keys[i] = maxKey(tail, simd::reduceMaxKey(key));
  }
}

template <unsigned E, bool S>
IUS_AVX2 void spanRound256(const float* in, float* out, const Layout& l, const ScaleRule& rule,
                           Index first, Index n, const float* scale, const float* inverse, bool stream) {
  SpanWalk walk(l, first);
  for (Index i = 0; i < n; ++i) {
    const Span g = walk.next();
    const Index width = g.c1 - g.c0;
    for (Index r = g.r0; r < g.r1; ++r) {
      roundRow256<E, S>(in + r * l.cols + g.c0, width, Factors{scale[i], inverse[i]}, rule.clampMax,
                        out + r * l.cols + g.c0, stream);
    }
  }
}
#endif

#ifdef IUS_HAVE_AVX2_KERNELS
// Tiles 1 x size of whole vectors on rows of whole tiles (MX's 1x32 blocks, the block
// recipe's 1x128 tiles) lie one after another in memory: group first + i starts at
// in + (first + i) * size. Sixteen groups' keys come from one reduction across sixteen
// vectors (each a group's lane maxima), instead of sixteen reductions of one vector each;
// each group then rounds with its factors broadcast. Keys, scales and values are
// spanGroups' own (the same maxima, scales512 and quantiseLanes512).
IUS_AVX512 inline __m512i maxKeysOfSixteen(const __m512i* v) {
  __m512i w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k) {  // each 128-bit lane: v[2k]'s maxima in 0, 2, v[2k+1]'s in 1, 3
    w[k] = _mm512_max_epu32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                            _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
  }
  for (int k = 0; k < 4; ++k) {  // each 128-bit lane: v[4k + j]'s maximum over it in lane j
    x[k] = _mm512_max_epu32(_mm512_unpacklo_epi64(w[2 * k], w[2 * k + 1]),
                            _mm512_unpackhi_epi64(w[2 * k], w[2 * k + 1]));
  }
  for (int k = 0; k < 2; ++k) {  // 128-bit lanes paired: v[8k + j] over half the vector
    y[k] = _mm512_max_epu32(_mm512_shuffle_i32x4(x[2 * k], x[2 * k + 1], 0x88),
                            _mm512_shuffle_i32x4(x[2 * k], x[2 * k + 1], 0xdd));
  }
  return _mm512_max_epu32(_mm512_shuffle_i32x4(y[0], y[1], 0x88), _mm512_shuffle_i32x4(y[0], y[1], 0xdd));
}

template <unsigned E, bool S>
IUS_AVX512 bool contiguousTiles512(const float* in, float* out, const Layout& l, const ScaleRule& rule,
                                   Index begin, Index end, int* scales, bool stream) {
  const Index size = l.groupCols, vectors = size / 16;
  const Normalised top = normalise(rule.formatMax);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  alignas(64) unsigned keys[kBatch];
  float scale[kBatch], inverse[kBatch];
  bool finite = true;
  for (Index first = begin; first < end; first += kBatch) {
    const Index n = end - first < kBatch ? end - first : kBatch;
    const float* base = in + first * size;
    Index i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512i v[16];
      for (int g = 0; g < 16; ++g) {
        const float* group = base + (i + g) * size;
        __m512i key = _mm512_and_si512(_mm512_loadu_si512(group), magnitude);
        for (Index c = 1; c < vectors; ++c) {
          key = _mm512_max_epu32(key, _mm512_and_si512(_mm512_loadu_si512(group + 16 * c), magnitude));
        }
        v[g] = key;
      }
      _mm512_store_si512(keys + i, maxKeysOfSixteen(v));
    }
    for (; i < n; ++i) keys[i] = simd512::amaxKey(base + i * size, size);
    finite = scales512(keys, n, rule, top, scales + first, scale, inverse) && finite;
    float* target = out + first * size;
    const bool streamed = streamable(target, stream);
    for (i = 0; i < n; ++i) {
      const __m512 f = _mm512_set1_ps(scale[i]), g = _mm512_set1_ps(inverse[i]);
      for (Index c = 0; c < size; c += 16) {
        put512(target + i * size + c,
               quantiseLanes512<E, S>(_mm512_loadu_ps(base + i * size + c), f, g, rule.clampMax), streamed);
      }
    }
  }
  return finite;
}
#endif

// Groups [begin, end) in (band, groupColumn) order, each writing its scale; returns false when
// some group's amax is not finite (that group is rounded with scale 0: unspecified values).
template <unsigned E, bool S>
bool spanGroups(const float* in, float* out, const Layout& l, const ScaleRule& rule, Index begin,
                Index end, int level, int* scales, bool stream) {
#ifdef IUS_HAVE_AVX2_KERNELS
  if (level == 2 && l.groupRows == 1 && l.groupCols % 16 == 0 && l.cols % l.groupCols == 0) {
    return contiguousTiles512<E, S>(in, out, l, rule, begin, end, scales, stream);
  }
#endif
  const Normalised top = normalise(rule.formatMax);
  unsigned keys[kBatch];
  float scale[kBatch], inverse[kBatch];
  bool finite = true;
  for (Index first = begin; first < end; first += kBatch) {
    const Index n = end - first < kBatch ? end - first : kBatch;
#ifdef IUS_HAVE_AVX2_KERNELS
    if (level == 2) {
      spanKeys512(in, l, first, n, keys);
    } else if (level == 1) {
      spanKeys256(in, l, first, n, keys);
    } else {
      spanKeysPortable(in, l, first, n, keys);
    }
#else
    spanKeysPortable(in, l, first, n, keys);
#endif
    finite = scalesOf(level, keys, n, rule, top, scales + first, scale, inverse) && finite;
#ifdef IUS_HAVE_AVX2_KERNELS
    if (level == 2) {
      spanRound512<E, S>(in, out, l, rule, first, n, scale, inverse, stream);
    } else if (level == 1) {
      spanRound256<E, S>(in, out, l, rule, first, n, scale, inverse, stream);
    } else {
      spanRoundPortable<E, S>(in, out, l, rule, first, n, scale, inverse);
    }
#else
    spanRoundPortable<E, S>(in, out, l, rule, first, n, scale, inverse);
    (void)stream;
#endif
  }
  return finite;
}

// ---------------------------------------------------------------- band groups

// Lane groups (groupCols == 1) and blocks (groupRows > 1, groupCols > 1) are taken a band of
// groupRows rows at a time, in chunks of whole groups as wide as the matrix up to a bound, and
// each pass reads the chunk row by row, in memory order: a block's rows lie a row apart, and
// at a power-of-two row length (4096 float32 columns: 16 KiB) rows read in short segments
// alias in the caches' sets. The chunk is read twice (amax, then round); the second read
// finds it in L2 or L3.
inline Index bandChunkWidth(Index bandRows, Index groupCols) {
  const Index columns = (Index(1) << 22) / (bandRows > 0 ? bandRows : 1);  // 16 MiB of float32
  const Index rounded = columns / 64 * 64;
  const Index width = rounded < 64 ? 64 : rounded;
  return (width + groupCols - 1) / groupCols * groupCols;
}

// A scalar element with per-column factors: a plain inline loop body, as the lane tails run
// it once per element (quantisePortable is a target_clones function, called, not inlined).
template <unsigned E, bool S>
inline float quantiseOne(float x, float scale, float inverse, float clampMax) {
  if (clampMax > 0) {
    const float y = clampTo(x * scale, clampMax);
    return withSignOf(fast::quantise<E, S>(y) * inverse, y);
  }
  return fast::quantise<E, S>(x * scale) * inverse;
}

// Chunk [c0, c1) of a band (c0 a multiple of groupCols): per-column amax keys down the rows,
// each group's key the max of its columns' (blocks), the scales, then the rows rounded, with
// a vector of per-column factors (lanes) or each group's own (blocks). Returns false when a
// group's amax is not finite (that group is rounded with scale 0: unspecified values).
template <unsigned E, bool S>
bool bandChunk(const float* in, float* out, const Layout& l, const ScaleRule& rule, Index band,
               Index c0, Index c1, int level, int* scales, std::vector<unsigned>& keys,
               std::vector<float>& factors, bool stream) {
  const Index r0 = band * l.groupRows, r1 = r0 + l.groupRows < l.rows ? r0 + l.groupRows : l.rows;
  const Index width = c1 - c0, size = l.groupCols;
  keys.assign(static_cast<std::size_t>(width), 0u);
  unsigned* key = keys.data();
  Index vectorEnd = 0;
#ifdef IUS_HAVE_AVX2_KERNELS
  if (level == 2) vectorEnd = lanesAmax512(in, l.cols, r0, r1, c0, width, key);
  else if (level == 1) vectorEnd = lanesAmax256(in, l.cols, r0, r1, c0, width, key);
#endif
  for (Index r = r0; r < r1; ++r) {
    const float* row = in + r * l.cols + c0;
    for (Index c = vectorEnd; c < width; ++c) key[c] = maxKey(key[c], magnitudeKey(row[c]));
  }
  const Index groups = (width + size - 1) / size;
  if (size > 1) {
    for (Index j = 0; j < groups; ++j) {  // key[j] is read before it is written
      const Index end = (j + 1) * size < width ? (j + 1) * size : width;
      unsigned groupKey = 0;
      for (Index c = j * size; c < end; ++c) groupKey = maxKey(groupKey, key[c]);
      key[j] = groupKey;
    }
  }
  factors.resize(static_cast<std::size_t>(2 * groups));
  float* scale = factors.data();
  float* inverse = scale + groups;
  const bool finite = scalesOf(level, key, groups, rule, normalise(rule.formatMax),
                               scales + band * l.groupColumns() + c0 / size, scale, inverse);
  for (Index r = r0; r < r1; ++r) {
    const float* row = in + r * l.cols + c0;
    float* target = out + r * l.cols + c0;
    if (size > 1) {
      for (Index j = 0; j < groups; ++j) {
        const Index begin = j * size, end = begin + size < width ? begin + size : width;
        roundRow<E, S>(level, row + begin, end - begin, Factors{scale[j], inverse[j]}, rule.clampMax,
                       target + begin, stream);
      }
      continue;
    }
    Index c = 0;
#ifdef IUS_HAVE_AVX2_KERNELS
    if (level == 2 && r + 1 < r1) {
      c = lanesQuantiseTwo512<E, S>(row, l.cols, width, scale, inverse, rule.clampMax, target, stream);
      for (Index t = c; t < width; ++t) {
        target[l.cols + t] = quantiseOne<E, S>(row[l.cols + t], scale[t], inverse[t], rule.clampMax);
      }
      ++r;  // the next row is done
    } else if (level == 2) {
      c = lanesQuantise512<E, S>(row, width, scale, inverse, rule.clampMax, target, stream);
    } else if (level == 1) {
      c = lanesQuantise256<E, S>(row, width, scale, inverse, rule.clampMax, target, stream);
    }
#endif
    for (; c < width; ++c) target[c] = quantiseOne<E, S>(row[c], scale[c], inverse[c], rule.clampMax);
  }
  return finite;
}

#ifdef IUS_HAVE_AVX2_KERNELS
// Both casts of a band chunk of whole tiles (size x 1 column tiles and 1 x size row tiles, size
// a multiple of the SIMD width) in two reads of the chunk, as bandChunk's: the first takes the column keys
// down the rows and each row's tile keys, the second rounds each vector both ways.
struct PairBuffers {
  std::vector<unsigned> tileKeys;
  std::vector<float> tileFactors;
};

template <unsigned E, bool S>
IUS_AVX512 bool pairChunk512(const float* in, float* out, const Layout& l,
                             const ScaleRule& rule, Index band, Index c0, Index c1, int* scales,
                             float* tileOut, int* tileScales, std::vector<unsigned>& keys,
                             std::vector<float>& factors, PairBuffers& pair, bool stream) {
  const Index size = l.groupRows;
  const Index r0 = band * size, r1 = r0 + size < l.rows ? r0 + size : l.rows, rows = r1 - r0;
  const Index width = c1 - c0, perRow = width / size, tilesPerRow = (l.cols + size - 1) / size;
  keys.assign(static_cast<std::size_t>(width), 0u);
  pair.tileKeys.resize(static_cast<std::size_t>(rows * perRow));
  unsigned* key = keys.data();
  const __m512i magnitudeMask = _mm512_set1_epi32(0x7fffffff);
  Index r = r0;
  for (; r + 4 <= r1; r += 4) {  // four rows a pass: one load and store of the column keys
    const float* row = in + r * l.cols + c0;
    unsigned* tileKey = pair.tileKeys.data() + (r - r0) * perRow;
    for (Index t = 0; t < perRow; ++t) {
      __m512i m0 = _mm512_setzero_si512(), m1 = m0, m2 = m0, m3 = m0;
      for (Index c = t * size; c < (t + 1) * size; c += 16) {
        const __m512i v0 = _mm512_and_si512(_mm512_loadu_si512(row + c), magnitudeMask);
        const __m512i v1 = _mm512_and_si512(_mm512_loadu_si512(row + l.cols + c), magnitudeMask);
        const __m512i v2 = _mm512_and_si512(_mm512_loadu_si512(row + 2 * l.cols + c), magnitudeMask);
        const __m512i v3 = _mm512_and_si512(_mm512_loadu_si512(row + 3 * l.cols + c), magnitudeMask);
        const __m512i rows = _mm512_max_epu32(_mm512_max_epu32(v0, v1), _mm512_max_epu32(v2, v3));
        _mm512_storeu_si512(key + c, _mm512_max_epu32(_mm512_loadu_si512(key + c), rows));
        m0 = _mm512_max_epu32(m0, v0);
        m1 = _mm512_max_epu32(m1, v1);
        m2 = _mm512_max_epu32(m2, v2);
        m3 = _mm512_max_epu32(m3, v3);
      }
      tileKey[t] = _mm512_reduce_max_epu32(m0);
      tileKey[perRow + t] = _mm512_reduce_max_epu32(m1);
      tileKey[2 * perRow + t] = _mm512_reduce_max_epu32(m2);
      tileKey[3 * perRow + t] = _mm512_reduce_max_epu32(m3);
    }
  }
  for (; r < r1; ++r) {
    const float* row = in + r * l.cols + c0;
    unsigned* tileKey = pair.tileKeys.data() + (r - r0) * perRow;
    for (Index t = 0; t < perRow; ++t) {
      __m512i tileMax = _mm512_setzero_si512();
      for (Index c = t * size; c < (t + 1) * size; c += 16) {
        const __m512i v = _mm512_and_si512(_mm512_loadu_si512(row + c), magnitudeMask);
        _mm512_storeu_si512(key + c, _mm512_max_epu32(_mm512_loadu_si512(key + c), v));
        tileMax = _mm512_max_epu32(tileMax, v);
      }
      tileKey[t] = _mm512_reduce_max_epu32(tileMax);
    }
  }
  const Normalised top = normalise(rule.formatMax);
  factors.resize(static_cast<std::size_t>(2 * width));
  float* scale = factors.data();
  float* inverse = scale + width;
  bool finite = scales512(key, width, rule, top, scales + band * l.cols + c0, scale, inverse);
  pair.tileFactors.resize(static_cast<std::size_t>(2 * rows * perRow));
  float* tileScale = pair.tileFactors.data();
  float* tileInverse = tileScale + rows * perRow;
  if (perRow == tilesPerRow) {  // whole rows: the band's tile scales are consecutive
    finite = scales512(pair.tileKeys.data(), rows * perRow, rule, top, tileScales + r0 * tilesPerRow,
                       tileScale, tileInverse) && finite;
  } else {
    for (Index r = r0; r < r1; ++r) {
      const Index k = (r - r0) * perRow;
      finite = scales512(pair.tileKeys.data() + k, perRow, rule, top, tileScales + r * tilesPerRow + c0 / size,
                         tileScale + k, tileInverse + k) && finite;
    }
  }
  for (Index r = r0; r < r1; ++r) {
    const float* row = in + r * l.cols + c0;
    float* columnTarget = out + r * l.cols + c0;
    float* tileTarget = tileOut + r * l.cols + c0;
    const bool columnStream = streamable(columnTarget, stream), tileStream = streamable(tileTarget, stream);
    const Index k = (r - r0) * perRow;
    for (Index t = 0; t < perRow; ++t) {
      const __m512 ts = _mm512_set1_ps(tileScale[k + t]), ti = _mm512_set1_ps(tileInverse[k + t]);
      if (rule.clampMax > 0) {  // |x| and its sign once for both roundings
        const __m512 limit = _mm512_set1_ps(rule.clampMax);
        for (Index c = t * size; c < (t + 1) * size; c += 16) {
          const __m512i bits = _mm512_loadu_si512(row + c);
          const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
          const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
          put512(columnTarget + c, roundClamped512<E>(magnitude, sign, _mm512_loadu_ps(scale + c),
                                                      _mm512_loadu_ps(inverse + c), limit), columnStream);
          put512(tileTarget + c, roundClamped512<E>(magnitude, sign, ts, ti, limit), tileStream);
        }
        continue;
      }
      for (Index c = t * size; c < (t + 1) * size; c += 16) {
        const __m512 x = _mm512_loadu_ps(row + c);
        put512(columnTarget + c, quantiseLanes512<E, S>(x, _mm512_loadu_ps(scale + c),
                                                        _mm512_loadu_ps(inverse + c), rule.clampMax), columnStream);
        put512(tileTarget + c, quantiseLanes512<E, S>(x, ts, ti, rule.clampMax), tileStream);
      }
    }
  }
  return finite;
}
// The AVX2 form of pairChunk512.
template <unsigned E, bool S>
IUS_AVX2 bool pairChunk256(const float* in, float* out, const Layout& l,
                             const ScaleRule& rule, Index band, Index c0, Index c1, int* scales,
                             float* tileOut, int* tileScales, std::vector<unsigned>& keys,
                             std::vector<float>& factors, PairBuffers& pair, bool stream) {
  const Index size = l.groupRows;
  const Index r0 = band * size, r1 = r0 + size < l.rows ? r0 + size : l.rows, rows = r1 - r0;
  const Index width = c1 - c0, perRow = width / size, tilesPerRow = (l.cols + size - 1) / size;
  keys.assign(static_cast<std::size_t>(width), 0u);
  pair.tileKeys.resize(static_cast<std::size_t>(rows * perRow));
  unsigned* key = keys.data();
  const __m256i magnitudeMask = _mm256_set1_epi32(0x7fffffff);
  for (Index r = r0; r < r1; ++r) {
    const float* row = in + r * l.cols + c0;
    unsigned* tileKey = pair.tileKeys.data() + (r - r0) * perRow;
    for (Index t = 0; t < perRow; ++t) {
      __m256i tileMax = _mm256_setzero_si256();
      for (Index c = t * size; c < (t + 1) * size; c += 8) {
        const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)), magnitudeMask);
        __m256i* k = reinterpret_cast<__m256i*>(key + c);
        _mm256_storeu_si256(k, _mm256_max_epu32(_mm256_loadu_si256(k), v));
        tileMax = _mm256_max_epu32(tileMax, v);
      }
      tileKey[t] = simd::reduceMaxKey(tileMax);
    }
  }
  const Normalised top = normalise(rule.formatMax);
  factors.resize(static_cast<std::size_t>(2 * width));
  float* scale = factors.data();
  float* inverse = scale + width;
  bool finite = scales256(key, width, rule, top, scales + band * l.cols + c0, scale, inverse);
  pair.tileFactors.resize(static_cast<std::size_t>(2 * rows * perRow));
  float* tileScale = pair.tileFactors.data();
  float* tileInverse = tileScale + rows * perRow;
  if (perRow == tilesPerRow) {  // whole rows: the band's tile scales are consecutive
    finite = scales256(pair.tileKeys.data(), rows * perRow, rule, top, tileScales + r0 * tilesPerRow,
                       tileScale, tileInverse) && finite;
  } else {
    for (Index r = r0; r < r1; ++r) {
      const Index k = (r - r0) * perRow;
      finite = scales256(pair.tileKeys.data() + k, perRow, rule, top, tileScales + r * tilesPerRow + c0 / size,
                         tileScale + k, tileInverse + k) && finite;
    }
  }
  for (Index r = r0; r < r1; ++r) {
    const float* row = in + r * l.cols + c0;
    float* columnTarget = out + r * l.cols + c0;
    float* tileTarget = tileOut + r * l.cols + c0;
    const bool columnStream = streamable(columnTarget, stream), tileStream = streamable(tileTarget, stream);
    const Index k = (r - r0) * perRow;
    for (Index t = 0; t < perRow; ++t) {
      const __m256 ts = _mm256_set1_ps(tileScale[k + t]), ti = _mm256_set1_ps(tileInverse[k + t]);
      if (rule.clampMax > 0) {  // |x| and its sign once for both roundings
        const __m256 limit = _mm256_set1_ps(rule.clampMax);
        for (Index c = t * size; c < (t + 1) * size; c += 8) {
          const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
          const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
          const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
          put256(columnTarget + c, roundClamped256<E>(magnitude, sign, _mm256_loadu_ps(scale + c),
                                                      _mm256_loadu_ps(inverse + c), limit), columnStream);
          put256(tileTarget + c, roundClamped256<E>(magnitude, sign, ts, ti, limit), tileStream);
        }
        continue;
      }
      for (Index c = t * size; c < (t + 1) * size; c += 8) {
        const __m256 x = _mm256_loadu_ps(row + c);
        put256(columnTarget + c, quantiseLanes256<E, S>(x, _mm256_loadu_ps(scale + c),
                                                        _mm256_loadu_ps(inverse + c), rule.clampMax), columnStream);
        put256(tileTarget + c, quantiseLanes256<E, S>(x, ts, ti, rule.clampMax), tileStream);
      }
    }
  }
  return finite;
}
#endif

// ---------------------------------------------------------------- driver

// Rounds `in` (rows x cols, row-major) into `out` with one scale per group, written to
// `scales` (bands x groupColumns, row-major). Returns 0, or 1 when some group's amax is not
// finite (its scale is kNonFiniteScale, the values unspecified).
//
// With `tiles` (lane groups of size x 1 only), the same call also rounds `in` into
// tiles->out with 1 x size tiles (scales tiles->scales, rows x ceil(cols / size)): both casts
// a GEMM operand needs, the one along its rows and the one along its columns, from one read
// of the input, as each band chunk is rounded both ways while it is in cache.
// Orders a worker's streaming stores before the caller reads its output.
inline void endStreaming(bool stream) {
#ifdef IUS_HAVE_AVX2_KERNELS
  if (stream) _mm_sfence();
#endif
  (void)stream;
}

struct TileOutput {
  float* out;
  int* scales;
};

template <unsigned E, bool S>
int run(const float* in, float* out, const Layout& l, const ScaleRule& rule, int threads,
        int* scales, const TileOutput* tiles = nullptr) {
  const int level = fused::simdLevel();
  // Bands: column groups and blocks; span groups: tiles along a row (and a whole column).
  const bool bands = (l.groupCols == 1 && (l.cols > 1 || tiles != nullptr)) || (l.groupRows > 1 && l.groupCols > 1);
  const Index size = l.groupRows;
  Index chunk = bands ? bandChunkWidth(l.groupRows < l.rows ? l.groupRows : l.rows, l.groupCols) : 1;
  if (tiles != nullptr) chunk = (chunk + size - 1) / size * size;  // whole tiles per chunk
  const Index perBand = bands ? (l.cols + chunk - 1) / chunk : l.groupColumns();
  const Index items = l.bands() * perBand;
  const Layout tileLayout{l.rows, l.cols, 1, size};
  const Index tilesPerRow = tileLayout.groupColumns();
  const unsigned parts = fused::threadsFor(l.rows * l.cols, threads);
  const bool stream = level > 0 && l.rows * l.cols * Index(sizeof(float)) * (tiles ? 2 : 1) >= kStreamBytes;
  std::vector<char> finite(parts, 1);
  fused::parallelChunks(items, parts, [&](unsigned part, Index begin, Index end) {
    if (!bands) {
      finite[part] = spanGroups<E, S>(in, out, l, rule, begin, end, level, scales, stream);
      endStreaming(stream);
      return;
    }
    std::vector<unsigned> keys;
    std::vector<float> factors;
    bool ok = true;
#ifdef IUS_HAVE_AVX2_KERNELS
    PairBuffers pair;
#endif
    for (Index item = begin; item < end; ++item) {
      const Index band = item / perBand, c0 = item % perBand * chunk;
      const Index c1 = c0 + chunk < l.cols ? c0 + chunk : l.cols;
#ifdef IUS_HAVE_AVX2_KERNELS
      if (tiles != nullptr && level == 2 && size % 16 == 0 && (c1 - c0) % size == 0) {
        ok = pairChunk512<E, S>(in, out, l, rule, band, c0, c1, scales, tiles->out, tiles->scales, keys,
                                factors, pair, stream) && ok;
        continue;
      }
      if (tiles != nullptr && level == 1 && size % 8 == 0 && (c1 - c0) % size == 0) {
        ok = pairChunk256<E, S>(in, out, l, rule, band, c0, c1, scales, tiles->out, tiles->scales, keys,
                                factors, pair, stream) && ok;
        continue;
      }
#endif
      ok = bandChunk<E, S>(in, out, l, rule, band, c0, c1, level, scales, keys, factors, stream) && ok;
      if (tiles == nullptr) continue;
      const Index r1 = (band + 1) * size < l.rows ? (band + 1) * size : l.rows;
      if (c0 == 0 && c1 == l.cols) {  // whole rows: the band's tiles are consecutive groups
        ok = spanGroups<E, S>(in, tiles->out, tileLayout, rule, band * size * tilesPerRow, r1 * tilesPerRow,
                              level, tiles->scales, stream) && ok;
        continue;
      }
      for (Index r = band * size; r < r1; ++r) {
        const Index first = r * tilesPerRow + c0 / size, last = r * tilesPerRow + (c1 + size - 1) / size;
        ok = spanGroups<E, S>(in, tiles->out, tileLayout, rule, first, last, level, tiles->scales, stream) && ok;
      }
    }
    finite[part] = ok;
    endStreaming(stream);
  });
  for (char ok : finite) {
    if (!ok) return 1;
  }
  return 0;
}

}  // namespace groups
}  // namespace ius
