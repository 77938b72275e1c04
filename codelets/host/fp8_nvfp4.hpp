// The NVFP4 cast of a float32 matrix (`group_cast`'s "nvfp4" rule, round to nearest): E2M1
// elements in groups of groupRows x groupCols, each group with an E4M3 scale, and one float32
// scale for the whole tensor. In float32, each step rounded as the torch path rounds it:
//
//   g = amax(tensor) / (6 * 448)             (1 for an all-zero tensor)
//   d = E4M3(min(amax(group) / (6 * g), 448)) (round to nearest even)
//   value = E2M1(x / (d * g)) * (d * g)       (x / 1 where d * g is 0; E2M1 saturates at 6)
//
// A float32 subnormal rounds to zero in both formats, as the codec encodes it. Portable code:
// the compiler vectorises the rounding, whose only operations are IEEE divisions, products
// and nearbyint, so the values are the same on every CPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace ius {
namespace nvfp4 {

using Index = std::int64_t;

constexpr float kElementMax = 6.0f;    // E2M1's largest value
constexpr float kBlockScaleMax = 448.0f;  // E4M3's largest value
constexpr int kNonFinite = 1;

// |v| (finite, >= 0) to the nearest even value of a format with `mantissaBits` and smallest
// normal exponent `minExponent`: the grid's step at v's exponent is exact to divide by.
inline float roundMagnitude(float v, int mantissaBits, int minExponent) {
  if (!(v >= std::numeric_limits<float>::min())) return 0.0f;  // zero and float32 subnormals
  int exponent = 0;
  std::frexp(v, &exponent);  // v = m * 2**exponent, m in [0.5, 1)
  const int step = std::max(exponent - 1, minExponent) - mantissaBits;
  return std::ldexp(std::nearbyint(std::ldexp(v, -step)), step);
}

inline float e4m3(float v) { return roundMagnitude(v, 3, -6); }

inline float e2m1Saturated(float x) {
  const float magnitude = std::min(std::fabs(x), kElementMax);
  return std::copysign(std::min(roundMagnitude(magnitude, 1, 0), kElementMax), x);
}

// The values of the rows x cols row-major `in` into `out` (which may be `in`), each group's
// E4M3 scale d into blockScales ([ceil(rows / groupRows)][ceil(cols / groupCols)], may be
// null) and g into *tensorScale. Ragged last groups are smaller. Returns 0, or kNonFinite
// (nothing written) where the tensor's amax is not finite or g underflows to zero.
inline int quantise(const float* in, Index rows, Index cols, Index groupRows, Index groupCols,
                    float* out, float* blockScales, float* tensorScale) {
  float amax = 0.0f;
  bool nan = false;
  const Index count = rows * cols;
  for (Index i = 0; i < count; ++i) {
    amax = std::max(amax, std::fabs(in[i]));
    nan = nan || std::isnan(in[i]);
  }
  if (nan || !std::isfinite(amax)) return kNonFinite;
  const float g = amax > 0.0f ? amax / (kElementMax * kBlockScaleMax) : 1.0f;
  const float sixG = kElementMax * g;
  if (sixG == 0.0f) return kNonFinite;
  *tensorScale = g;
  const Index groupsAcross = (cols + groupCols - 1) / groupCols;
  std::vector<float> columnAmax(cols), decodeScale(groupsAcross), divisor(groupsAcross);
  for (Index band = 0; band * groupRows < rows; ++band) {
    const Index first = band * groupRows, last = std::min(rows, first + groupRows);
    std::fill(columnAmax.begin(), columnAmax.end(), 0.0f);
    for (Index r = first; r < last; ++r)
      for (Index c = 0; c < cols; ++c)
        columnAmax[c] = std::max(columnAmax[c], std::fabs(in[r * cols + c]));
    for (Index j = 0; j < groupsAcross; ++j) {
      const Index c0 = j * groupCols, c1 = std::min(cols, c0 + groupCols);
      const float groupAmax = *std::max_element(columnAmax.begin() + c0, columnAmax.begin() + c1);
      const float d = e4m3(std::min(groupAmax / sixG, kBlockScaleMax));
      if (blockScales != nullptr) blockScales[band * groupsAcross + j] = d;
      decodeScale[j] = d * g;
      divisor[j] = decodeScale[j] == 0.0f ? 1.0f : decodeScale[j];
    }
    for (Index r = first; r < last; ++r)
      for (Index c = 0; c < cols; ++c) {
        const Index j = c / groupCols;
        out[r * cols + c] = e2m1Saturated(in[r * cols + c] / divisor[j]) * decodeScale[j];
      }
  }
  return 0;
}

}  // namespace nvfp4
}  // namespace ius
