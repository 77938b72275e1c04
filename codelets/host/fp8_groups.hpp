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
// exactly as ipu_unit_scaling/fp8/group_cast.py composes them, so the values are its values bit
// for bit. A group whose amax is not finite makes the call return 1 without rounding it.
//
// Two loops, both reading each group twice while it is in cache (amax, then round):
//  * span groups (groupCols > 1): per group, the amax of its row segments, one scalar scale,
//    the segments rounded with fp8_simd.hpp's span kernels;
//  * lane groups (groupCols == 1): a band of groupRows rows is taken in column chunks small
//    enough for L1/L2; the amax runs down the rows with one column per SIMD lane, and each
//    row segment is rounded with a vector of per-column scales.
#pragma once

#include <cmath>
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

// The scale s of a group with this amax key, or kNonFiniteScale.
inline int groupScale(unsigned key, const ScaleRule& rule) {
  if (!keyIsFinite(key)) return kNonFiniteScale;
  if (rule.rule == kAmaxRule) return scalingBias(floatFromKey(key), rule.formatMax, rule.margin).log2Scale;
  if (key == 0) return kMxScaleLimit;  // e = -127
  int exponent = 0;
  const float mantissa = std::frexp(floatFromKey(key), &exponent);
  int shared;
  if (rule.rule == kMxFloor) {
    shared = exponent - 1 - rule.emax;
  } else {
    int maxExponent = 0;
    const float maxMantissa = std::frexp(rule.formatMax, &maxExponent);
    shared = exponent - maxExponent + (mantissa > maxMantissa ? 1 : 0);
  }
  shared = shared > kMxScaleLimit ? kMxScaleLimit : (shared < -kMxScaleLimit ? -kMxScaleLimit : shared);
  return -shared;
}

// The multiplier into the grid and the one back, as group_cast.py computes them in float32.
struct Factors {
  float scale, inverse;
};

inline Factors factorsOf(int s, const ScaleRule& rule) {
  const float step = powerOfTwo(rule.stepLog2);
  return Factors{exactPowerOfTwo(s) / step, exactPowerOfTwo(-s) * step};
}

inline float clampTo(float y, float limit) { return y < -limit ? -limit : (y > limit ? limit : y); }

// ---------------------------------------------------------------- per-level row segments

template <unsigned E, bool S>
IUS_HOT inline void quantisePortable(const float* x, Index n, Factors f, float clampMax, float* out) {
  if (clampMax > 0) {
    for (Index i = 0; i < n; ++i) out[i] = fast::quantise<E, S>(clampTo(x[i] * f.scale, clampMax)) * f.inverse;
  } else {
    for (Index i = 0; i < n; ++i) out[i] = fast::quantise<E, S>(x[i] * f.scale) * f.inverse;
  }
}

inline unsigned amaxSpan(const float* x, Index n, int level) {
#ifdef IUS_HAVE_AVX2_KERNELS
  if (level == 2) return simd512::amaxKey(x, n);
  if (level == 1) return simd::amaxKey(x, n);
#endif
  return fused::amaxFloatPortable(x, n);
}

#ifdef IUS_HAVE_AVX2_KERNELS
template <unsigned E, bool S>
IUS_AVX512 inline __m512 quantiseLanes512(__m512 x, __m512 scale, __m512 inverse, float clampMax) {
  if (clampMax > 0) {
    const __m512 limit = _mm512_set1_ps(clampMax);
    const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x, scale), _mm512_sub_ps(_mm512_setzero_ps(), limit)), limit);
    return simd512::quantise16<E, S>(y, _mm512_set1_ps(1.0f), inverse);
  }
  return simd512::quantise16<E, S>(x, scale, inverse);
}

template <unsigned E, bool S>
IUS_AVX2 inline __m256 quantiseLanes256(__m256 x, __m256 scale, __m256 inverse, float clampMax) {
  if (clampMax > 0) {
    const __m256 limit = _mm256_set1_ps(clampMax);
    const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x, scale), _mm256_sub_ps(_mm256_setzero_ps(), limit)), limit);
    return simd::quantise8<E, S>(y, _mm256_set1_ps(1.0f), inverse);
  }
  return simd::quantise8<E, S>(x, scale, inverse);
}

template <unsigned E, bool S>
IUS_AVX512 void quantiseSpan512(const float* x, Index n, Factors f, float clampMax, float* out) {
  const __m512 scale = _mm512_set1_ps(f.scale), inverse = _mm512_set1_ps(f.inverse);
  Index i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, quantiseLanes512<E, S>(_mm512_loadu_ps(x + i), scale, inverse, clampMax));
  }
  quantisePortable<E, S>(x + i, n - i, f, clampMax, out + i);
}

template <unsigned E, bool S>
IUS_AVX2 void quantiseSpan256(const float* x, Index n, Factors f, float clampMax, float* out) {
  const __m256 scale = _mm256_set1_ps(f.scale), inverse = _mm256_set1_ps(f.inverse);
  Index i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, quantiseLanes256<E, S>(_mm256_loadu_ps(x + i), scale, inverse, clampMax));
  }
  quantisePortable<E, S>(x + i, n - i, f, clampMax, out + i);
}

// Per-column amax keys of rows [r0, r1), columns [c0, c0 + width), for the whole vectors of
// the chunk; returns how many columns they covered.
IUS_AVX512 inline Index lanesAmax512(const float* in, Index cols, Index r0, Index r1, Index c0,
                                     Index width, unsigned* key) {
  const Index vectors = width / 16 * 16;
  for (Index r = r0; r < r1; ++r) {
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
                                         const float* inverse, float clampMax, float* out) {
  Index c = 0;
  for (; c + 16 <= width; c += 16) {
    _mm512_storeu_ps(out + c, quantiseLanes512<E, S>(_mm512_loadu_ps(row + c), _mm512_loadu_ps(scale + c),
                                                     _mm512_loadu_ps(inverse + c), clampMax));
  }
  return c;
}

template <unsigned E, bool S>
IUS_AVX2 inline Index lanesQuantise256(const float* row, Index width, const float* scale,
                                       const float* inverse, float clampMax, float* out) {
  Index c = 0;
  for (; c + 8 <= width; c += 8) {
    _mm256_storeu_ps(out + c, quantiseLanes256<E, S>(_mm256_loadu_ps(row + c), _mm256_loadu_ps(scale + c),
                                                     _mm256_loadu_ps(inverse + c), clampMax));
  }
  return c;
}
#endif

template <unsigned E, bool S>
inline void quantiseSpan(const float* x, Index n, Factors f, float clampMax, float* out, int level) {
#ifdef IUS_HAVE_AVX2_KERNELS
  if (level == 2) return quantiseSpan512<E, S>(x, n, f, clampMax, out);
  if (level == 1) return quantiseSpan256<E, S>(x, n, f, clampMax, out);
#endif
  quantisePortable<E, S>(x, n, f, clampMax, out);
}

// ---------------------------------------------------------------- span groups

// Group (band, groupColumn); writes its scale, returns false when its amax is not finite.
template <unsigned E, bool S>
bool spanGroup(const float* in, float* out, const Layout& l, const ScaleRule& rule, Index band,
               Index column, int level, int* scales) {
  const Index r0 = band * l.groupRows, r1 = r0 + l.groupRows < l.rows ? r0 + l.groupRows : l.rows;
  const Index c0 = column * l.groupCols, c1 = c0 + l.groupCols < l.cols ? c0 + l.groupCols : l.cols;
  unsigned key = 0;
  for (Index r = r0; r < r1; ++r) key = maxKey(key, amaxSpan(in + r * l.cols + c0, c1 - c0, level));
  const int s = groupScale(key, rule);
  scales[band * l.groupColumns() + column] = s;
  if (s == kNonFiniteScale) return false;
  const Factors f = factorsOf(s, rule);
  for (Index r = r0; r < r1; ++r) {
    quantiseSpan<E, S>(in + r * l.cols + c0, c1 - c0, f, rule.clampMax, out + r * l.cols + c0, level);
  }
  return true;
}

// ---------------------------------------------------------------- lane groups

// Columns per chunk of a band: the band's chunk stays in cache between the two passes.
inline Index laneChunkWidth(Index bandRows) {
  const Index columns = (Index(1) << 15) / (bandRows > 0 ? bandRows : 1);  // 128 KiB of float32
  const Index rounded = columns / 64 * 64;
  return rounded < 64 ? 64 : rounded;
}

// Chunk [c0, c1) of a band: per-column amax keys down the rows, then the scales, then the rows
// rounded. Returns false when a column's amax is not finite (that column is left unrounded).
template <unsigned E, bool S>
bool laneChunk(const float* in, float* out, const Layout& l, const ScaleRule& rule, Index band,
               Index c0, Index c1, int level, int* scales, std::vector<unsigned>& keys,
               std::vector<float>& factors) {
  const Index r0 = band * l.groupRows, r1 = r0 + l.groupRows < l.rows ? r0 + l.groupRows : l.rows;
  const Index width = c1 - c0;
  keys.assign(static_cast<std::size_t>(width), 0u);
  factors.resize(static_cast<std::size_t>(2 * width));
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
  float* scale = factors.data();
  float* inverse = scale + width;
  bool finite = true;
  for (Index c = 0; c < width; ++c) {
    const int s = groupScale(key[c], rule);
    scales[band * l.cols + c0 + c] = s;
    // A non-finite column is rounded with scale 0 and reported; its values are unspecified.
    const Factors f = factorsOf(s == kNonFiniteScale ? 0 : s, rule);
    finite = finite && s != kNonFiniteScale;
    scale[c] = f.scale;
    inverse[c] = f.inverse;
  }
  for (Index r = r0; r < r1; ++r) {
    const float* row = in + r * l.cols + c0;
    float* target = out + r * l.cols + c0;
    Index c = 0;
#ifdef IUS_HAVE_AVX2_KERNELS
    if (level == 2) c = lanesQuantise512<E, S>(row, width, scale, inverse, rule.clampMax, target);
    else if (level == 1) c = lanesQuantise256<E, S>(row, width, scale, inverse, rule.clampMax, target);
#endif
    for (; c < width; ++c) {
      quantisePortable<E, S>(row + c, 1, Factors{scale[c], inverse[c]}, rule.clampMax, target + c);
    }
  }
  return finite;
}

// ---------------------------------------------------------------- driver

// Rounds `in` (rows x cols, row-major) into `out` with one scale per group, written to
// `scales` (bands x groupColumns, row-major). Returns 0, or 1 when some group's amax is not
// finite (its scale is kNonFiniteScale, the values unspecified).
template <unsigned E, bool S>
int run(const float* in, float* out, const Layout& l, const ScaleRule& rule, int threads, int* scales) {
  const int level = fused::simdLevel();
  const bool lanes = l.groupCols == 1 && l.cols > 1;
  const Index chunk = lanes ? laneChunkWidth(l.groupRows < l.rows ? l.groupRows : l.rows) : 1;
  const Index perBand = lanes ? (l.cols + chunk - 1) / chunk : l.groupColumns();
  const Index items = l.bands() * perBand;
  const unsigned parts = fused::threadsFor(l.rows * l.cols, threads);
  std::vector<char> finite(parts, 1);
  fused::parallelChunks(items, parts, [&](unsigned part, Index begin, Index end) {
    std::vector<unsigned> keys;
    std::vector<float> factors;
    bool ok = true;
    for (Index item = begin; item < end; ++item) {
      const Index band = item / perBand, within = item % perBand;
      if (lanes) {
        const Index c0 = within * chunk, c1 = c0 + chunk < l.cols ? c0 + chunk : l.cols;
        ok = laneChunk<E, S>(in, out, l, rule, band, c0, c1, level, scales, keys, factors) && ok;
      } else {
        ok = spanGroup<E, S>(in, out, l, rule, band, within, level, scales) && ok;
      }
    }
    finite[part] = ok;
  });
  for (char ok : finite) {
    if (!ok) return 1;
  }
  return 0;
}

}  // namespace groups
}  // namespace ius
