// The NVFP4 cast of a float32 matrix (`group_cast`'s "nvfp4" rule, round to nearest): E2M1
// elements in groups of groupRows x groupCols, each group with an E4M3 scale, and one float32
// scale for the whole tensor. In float32, each step rounded as the torch path rounds it:
//
//   g = amax(tensor) / (6 * 448)             (1 for an all-zero tensor)
//   d = E4M3(min(amax(group) / (6 * g), 448)) (round to nearest even)
//   value = E2M1(x / (d * g)) * (d * g)       (x / 1 where d * g is 0; E2M1 saturates at 6)
//
// A float32 subnormal rounds to zero in both formats, as the codec encodes it. Portable code:
// the compiler vectorises the rounding, whose only operations are IEEE divisions, products,
// sums and comparisons, so the values are the same on every CPU.
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

// Adding and taking away 2**23 rounds a float32 below 2**22 to an integer, to nearest even
// under the default rounding mode (the compiler may not fold it without -ffast-math).
constexpr float kRoundingShift = 8388608.0f;

inline float roundToInteger(float v) { return (v + kRoundingShift) - kRoundingShift; }

// A power of two 2**e, -126 <= e <= 127, from its bits.
inline float powerOfTwo(int e) {
  const std::uint32_t bits = std::uint32_t(e + 127) << 23;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// v (>= 0, at most 448) to the nearest E4M3 value, ties to even; 0 for a float32 subnormal.
// The grid's step at v's exponent (2**-9 below E4M3's smallest normal, 2**-6) divides v
// exactly, so the only rounding is to an integer.
inline float e4m3(float v) {
  if (!(v >= std::numeric_limits<float>::min())) return 0.0f;
  std::uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const int step = std::max(int(bits >> 23) - 127, -6) - 3;
  return roundToInteger(v * powerOfTwo(-step)) * powerOfTwo(step);
}

// x to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), ties to even,
// saturating at 6. Branch-free, so that the compiler vectorises it: the step is 0.5 below 2, 1
// below 4 and 2 above; a float32 subnormal rounds to zero, as the codec encodes it.
inline float e2m1Saturated(float x) {
  const float magnitude = std::min(std::fabs(x), kElementMax);
  const float step = magnitude < 2.0f ? 0.5f : (magnitude < 4.0f ? 1.0f : 2.0f);
  const float inverse = magnitude < 2.0f ? 2.0f : (magnitude < 4.0f ? 1.0f : 0.5f);
  return std::copysign(roundToInteger(magnitude * inverse) * step, x);
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
    for (Index r = first; r < last; ++r) {
      const float* row = in + r * cols;
      float* rowOut = out + r * cols;
      if (groupCols == 1) {  // (a scale per column: the vectorised loop runs along the row)
        for (Index c = 0; c < cols; ++c)
          rowOut[c] = e2m1Saturated(row[c] / divisor[c]) * decodeScale[c];
        continue;
      }
      for (Index j = 0; j < groupsAcross; ++j) {
        const Index c1 = std::min(cols, (j + 1) * groupCols);
        const float by = divisor[j], decode = decodeScale[j];
        for (Index c = j * groupCols; c < c1; ++c) rowOut[c] = e2m1Saturated(row[c] / by) * decode;
      }
    }
  }
  return 0;
}

}  // namespace nvfp4
}  // namespace ius
