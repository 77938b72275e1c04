// Both casts of a GEMM operand under the rowwise recipe, from two reads of it: one scale per
// row (the GEMM that reduces over the columns) and one per column (the GEMM that reduces over
// the rows), the values those of fp8_groups.hpp's 1 x cols and rows x 1 groups bit for bit
// (the same keys, scalesOf and rounding lanes). A column's amax needs every row before any of
// it rounds, so the first read takes both amaxes (each row's, and per thread the running
// column keys) and the second rounds each row both ways; the two casts one group form at a
// time read the operand four times (twice per form, the column form mostly from memory).
#pragma once

#include <vector>

#include "fp8_groups.hpp"

namespace ius {
namespace groups {

#ifdef IUS_HAVE_AVX2_KERNELS
// The row's amax key; columnKeys (one per column) take the row's keys.
IUS_AVX512 inline unsigned rowColumnKeys512(const float* row, Index cols, unsigned* columnKeys) {
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i rowKey = _mm512_setzero_si512();
  Index c = 0;
  for (; c + 16 <= cols; c += 16) {
    const __m512i k = _mm512_and_si512(_mm512_loadu_si512(row + c), magnitude);
    rowKey = _mm512_max_epu32(rowKey, k);
    _mm512_storeu_si512(columnKeys + c, _mm512_max_epu32(_mm512_loadu_si512(columnKeys + c), k));
  }
  unsigned key = _mm512_reduce_max_epu32(rowKey);
  for (; c < cols; ++c) {
    const unsigned k = magnitudeKey(row[c]);
    key = maxKey(key, k);
    columnKeys[c] = maxKey(columnKeys[c], k);
  }
  return key;
}

IUS_AVX2 inline unsigned rowColumnKeys256(const float* row, Index cols, unsigned* columnKeys) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  __m256i rowKey = _mm256_setzero_si256();
  Index c = 0;
  for (; c + 8 <= cols; c += 8) {
    const __m256i k = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)), magnitude);
    rowKey = _mm256_max_epu32(rowKey, k);
    __m256i* column = reinterpret_cast<__m256i*>(columnKeys + c);
    _mm256_storeu_si256(column, _mm256_max_epu32(_mm256_loadu_si256(column), k));
  }
  unsigned key = simd::reduceMaxKey(rowKey);
  for (; c < cols; ++c) {
    const unsigned k = magnitudeKey(row[c]);
    key = maxKey(key, k);
    columnKeys[c] = maxKey(columnKeys[c], k);
  }
  return key;
}
#endif

inline unsigned rowColumnKeys(int level, const float* row, Index cols, unsigned* columnKeys) {
#ifdef IUS_HAVE_AVX2_KERNELS
  if (level == 2) return rowColumnKeys512(row, cols, columnKeys);
  if (level == 1) return rowColumnKeys256(row, cols, columnKeys);
#endif
  (void)level;
  unsigned key = 0;
  for (Index c = 0; c < cols; ++c) {
    const unsigned k = magnitudeKey(row[c]);
    key = maxKey(key, k);
    columnKeys[c] = maxKey(columnKeys[c], k);
  }
  return key;
}

// rowOut: each row rounded with its own scale (rowScales, rows of them); colOut: each column
// with its own (colScales, cols). Returns 0, or 1 where an amax was not finite (the values of
// that group are then unspecified).
template <unsigned E, bool S>
int rowwisePair(const float* in, Index rows, Index cols, const ScaleRule& rule, int threads,
                float* rowOut, int* rowScales, float* colOut, int* colScales) {
  const int level = fused::simdLevel();
  const unsigned parts = fused::threadsFor(rows * cols, threads);
  const bool stream = level > 0 && rows * cols * Index(sizeof(float)) * 2 >= kStreamBytes;
  std::vector<unsigned> rowKeys(static_cast<std::size_t>(rows));
  std::vector<std::vector<unsigned>> columnKeys(parts);
  fused::parallelChunks(rows, parts, [&](unsigned part, Index begin, Index end) {
    std::vector<unsigned>& keys = columnKeys[part];
    keys.assign(static_cast<std::size_t>(cols), 0u);
    for (Index r = begin; r < end; ++r) rowKeys[r] = rowColumnKeys(level, in + r * cols, cols, keys.data());
  });
  std::vector<unsigned>& columnKey = columnKeys[0];
  for (unsigned part = 1; part < parts; ++part) {
    if (columnKeys[part].empty()) continue;  // (a part given no rows)
    for (Index c = 0; c < cols; ++c) columnKey[c] = maxKey(columnKey[c], columnKeys[part][c]);
  }
  const Normalised top = normalise(rule.formatMax);
  std::vector<float> rowFactors(static_cast<std::size_t>(2 * rows)), columnFactors(static_cast<std::size_t>(2 * cols));
  const float *rowScale = rowFactors.data(), *rowInverse = rowScale + rows;
  const float *scale = columnFactors.data(), *inverse = scale + cols;
  bool finite = scalesOf(level, rowKeys.data(), rows, rule, top, rowScales, rowFactors.data(),
                         rowFactors.data() + rows);
  finite = scalesOf(level, columnKey.data(), cols, rule, top, colScales, columnFactors.data(),
                    columnFactors.data() + cols) && finite;
  fused::parallelChunks(rows, parts, [&](unsigned, Index begin, Index end) {
    for (Index r = begin; r < end; ++r) {
      const float* row = in + r * cols;
      roundRow<E, S>(level, row, cols, Factors{rowScale[r], rowInverse[r]}, rule.clampMax, rowOut + r * cols,
                     stream);
      float* target = colOut + r * cols;
      Index c = 0;
#ifdef IUS_HAVE_AVX2_KERNELS
      if (level == 2) c = lanesQuantise512<E, S>(row, cols, scale, inverse, rule.clampMax, target, stream);
      else if (level == 1) c = lanesQuantise256<E, S>(row, cols, scale, inverse, rule.clampMax, target, stream);
#endif
      for (; c < cols; ++c) target[c] = quantiseOne<E, S>(row[c], scale[c], inverse[c], rule.clampMax);
    }
    endStreaming(stream);
  });
  return finite ? 0 : 1;
}

}  // namespace groups
}  // namespace ius
