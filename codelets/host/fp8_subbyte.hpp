// Casts to the sub-byte element formats, round to nearest: E2M1 (FP4), E2M3 and E3M2 (FP6),
// in groups of groupRows x groupCols of a row-major float32 matrix, as `group_cast` makes them
// with its "nvfp4" and "mx" rules. Each step in float32, rounded as the torch path rounds it:
//
//   NVFP4 (E2M1 elements, an E4M3 scale per group, a float32 scale g per tensor):
//     g = amax(tensor) / (6 * 448)                (1 for an all-zero tensor)
//     d = E4M3(min(amax(group) / (6 * g), 448))    (round to nearest even)
//     value = E2M1(x / (d * g)) * (d * g)          (x / 1 where d * g is 0)
//   MX (an E8M0 scale 2**e per group, e from the group's amax as `mx_shared_exponents`):
//     value = element(x * 2**-e) * 2**e
//
// Elements saturate at the format's max; a float32 subnormal rounds to zero, as the codec
// encodes it. Portable code: the rounding is branch-free IEEE products, sums and
// comparisons (and NVFP4's divisions), which the compiler vectorises, so the values are the
// same on every CPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "fp8_groups.hpp"

namespace ius {
namespace subbyte {

using Index = std::int64_t;

constexpr int kNonFinite = 1;
using groups::kMxScaleLimit;  // E8M0 encodes 2**-127 .. 2**127

// An element format's grid: its mantissa bits, smallest normal exponent and largest value.
struct Grid {
  int mantissaBits;
  int minExponent;
  float max;
};

constexpr Grid kE2M1{1, 0, 6.0f};  // NVFP4's elements
constexpr Grid kE4M3{3, -6, 448.0f};  // NVFP4's group scales

// Adding and taking away 2**23 rounds a float32 below 2**22 to an integer, to nearest even
// under the default rounding mode (the compiler may not fold it without -ffast-math).
inline float roundToInteger(float v) {
  constexpr float kShift = 8388608.0f;
  return (v + kShift) - kShift;
}

// 2**e for -126 <= e <= 127, from its bits.
inline float powerOfTwo(int e) {
  const std::uint32_t bits = std::uint32_t(e + 127) << 23;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Finite x to the nearest value of `grid`, ties to even, saturating at its max. The grid's
// step at x's exponent (its subnormal step below its smallest normal) scales x exactly, so
// the one rounding is to an integer; a float32 subnormal (exponent field 0) takes the
// subnormal step and rounds to zero.
inline float roundToGrid(float x, const Grid& grid) {
  const float magnitude = std::min(std::fabs(x), grid.max);
  std::uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof bits);
  const int step = std::max(int(bits >> 23) - 127, grid.minExponent) - grid.mantissaBits;
  return std::copysign(roundToInteger(magnitude * powerOfTwo(-step)) * powerOfTwo(step), x);
}

// A group's two factors: value = element(x / divide) * decode for NVFP4, element(x * scale) *
// decode for MX.
struct Factors {
  float apply;
  float decode;
};

// Whether every element of `in` is finite, and the largest magnitude. (A magnitude's bits
// order as its value does, NaN's above infinity's, so one integer maximum, which the compiler
// vectorises, finds both.)
inline bool finiteAmax(const float* in, Index count, float* amax) {
  std::int32_t top = 0;
  for (Index i = 0; i < count; ++i) {
    std::int32_t bits;
    std::memcpy(&bits, in + i, sizeof bits);
    top = std::max(top, std::int32_t(bits & 0x7fffffff));
  }
  std::memcpy(amax, &top, sizeof top);
  return top < 0x7f800000;
}

// The largest of n magnitudes (non-negative floats): an integer maximum of their bits, which
// the compiler vectorises, where a comparison per element would branch.
inline float largest(const float* magnitudes, Index n) {
  std::int32_t top = 0;
  for (Index i = 0; i < n; ++i) {
    std::int32_t bits;
    std::memcpy(&bits, magnitudes + i, sizeof bits);
    top = std::max(top, bits);
  }
  float value;
  std::memcpy(&value, &top, sizeof value);
  return value;
}

// The values of the rows x cols `in` into `out` (which may be `in`): a band of groupRows rows
// at a time, each group's amax from the band's column maxima, its factors from
// `factorsOf(groupAmax, band, group)`, then every value of the band rounded. Divide: x is
// divided by the factor rather than multiplied (NVFP4).
template <bool Divide, typename FactorsOf>
void castBands(const float* in, Index rows, Index cols, Index groupRows, Index groupCols,
               const Grid& grid, float* out, FactorsOf factorsOf) {
  const Index groupsAcross = (cols + groupCols - 1) / groupCols;
  const Grid g = grid;
  // (each column's factors, so that one vectorised loop runs along every row of the band)
  std::vector<float> columnAmax(cols), apply(cols), decode(cols);
  for (Index band = 0; band * groupRows < rows; ++band) {
    const Index first = band * groupRows, last = std::min(rows, first + groupRows);
    std::fill(columnAmax.begin(), columnAmax.end(), 0.0f);
    for (Index r = first; r < last; ++r)
      for (Index c = 0; c < cols; ++c)
        columnAmax[c] = std::max(columnAmax[c], std::fabs(in[r * cols + c]));
    for (Index j = 0; j < groupsAcross; ++j) {
      const Index c0 = j * groupCols, c1 = std::min(cols, c0 + groupCols);
      const Factors f = factorsOf(largest(columnAmax.data() + c0, c1 - c0), band, j);
      std::fill(apply.begin() + c0, apply.begin() + c1, f.apply);
      std::fill(decode.begin() + c0, decode.begin() + c1, f.decode);
    }
    const float* a = apply.data();
    const float* d = decode.data();
    for (Index r = first; r < last; ++r) {
      const float* row = in + r * cols;
      float* rowOut = out + r * cols;
      for (Index c = 0; c < cols; ++c)
        rowOut[c] = roundToGrid(Divide ? row[c] / a[c] : row[c] * a[c], g) * d[c];
    }
  }
}

// NVFP4: each group's E4M3 scale d into blockScales ([ceil(rows / groupRows)][ceil(cols /
// groupCols)], may be null), g into *tensorScale. Returns 0, or kNonFinite (nothing written)
// where an element is not finite or g underflows to zero.
inline int nvfp4(const float* in, Index rows, Index cols, Index groupRows, Index groupCols,
                 float* out, float* blockScales, float* tensorScale) {
  float amax = 0.0f;
  if (!finiteAmax(in, rows * cols, &amax)) return kNonFinite;
  const float g = amax > 0.0f ? amax / (kE2M1.max * kE4M3.max) : 1.0f;
  const float sixG = kE2M1.max * g;
  if (sixG == 0.0f) return kNonFinite;
  *tensorScale = g;
  const Index groupsAcross = (cols + groupCols - 1) / groupCols;
  castBands<true>(in, rows, cols, groupRows, groupCols, kE2M1, out,
                  [&](float groupAmax, Index band, Index j) {
                    const float d = roundToGrid(std::min(groupAmax / sixG, kE4M3.max),
                                                kE4M3);
                    if (blockScales != nullptr) blockScales[band * groupsAcross + j] = d;
                    const float decode = d * g;
                    return Factors{decode == 0.0f ? 1.0f : decode, decode};
                  });
  return 0;
}

// OCP MX's E8M0 exponent e of a finite amax: floor(log2(amax)) - emax, or with roundUp the
// smallest e with amax <= formatMax * 2**e; clamped to +-127, -127 for zero.
inline int mxExponent(float amax, float formatMax, int emax, bool roundUp) {
  if (amax == 0.0f) return -kMxScaleLimit;
  int exponent = 0, maxExponent = 0;
  const float mantissa = std::frexp(amax, &exponent);
  const float maxMantissa = std::frexp(formatMax, &maxExponent);
  const int e = roundUp ? exponent - maxExponent + (mantissa > maxMantissa ? 1 : 0)
                        : exponent - 1 - emax;
  return std::max(-kMxScaleLimit, std::min(kMxScaleLimit, e));
}

// MX with `grid`'s elements: each group's log2 scale s = -e into scales (int32, laid out as
// nvfp4's blockScales). Returns 0, or kNonFinite (nothing written) where an element is not
// finite.
inline int mx(const float* in, Index rows, Index cols, Index groupRows, Index groupCols,
              const Grid& grid, int emax, bool roundUp, float* out, int* scales) {
  float amax = 0.0f;
  if (!finiteAmax(in, rows * cols, &amax)) return kNonFinite;
  const Index groupsAcross = (cols + groupCols - 1) / groupCols;
  castBands<false>(in, rows, cols, groupRows, groupCols, grid, out,
                   [&](float groupAmax, Index band, Index j) {
                     const int e = mxExponent(groupAmax, grid.max, emax, roundUp);
                     scales[band * groupsAcross + j] = -e;
                     // (2**-127 is a float32 subnormal: ldexp makes it exactly)
                     return Factors{std::ldexp(1.0f, -e), std::ldexp(1.0f, e)};
                   });
  return 0;
}

}  // namespace subbyte
}  // namespace ius
