// AVX2 and AVX-512 versions of the host fast path's float32 loops (fp8_fast.hpp),
// for x86-64 CPUs that have them; fp8_fused.hpp picks the widest the CPU has at
// run time.
//
// Written with intrinsics because the compiler's own vectorisation of the same
// expressions spends most of its instructions repacking 32-bit lanes into
// bytes one vector at a time: here four vectors of codes are packed together
// and the sign is applied to the packed bytes, about 2.5 instructions per
// element against 7. Results are fp8_fast.hpp's bit for bit (the tails use it).
//
// The AVX-512 versions (AVX-512F only) are the same arithmetic on 16 lanes, with
// the selects in mask registers and the codes narrowed to bytes by one
// truncating move (vpmovdb), the sign OR-ed in under a mask before it: about
// half the instructions per element of the AVX2 kernels, which matters where
// two cores can stream memory faster than the AVX2 rounding keeps up.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define IUS_HAVE_AVX2_KERNELS 1

#include <immintrin.h>

#include <cstdint>

#include "fp8_fast.hpp"

#define IUS_AVX2 __attribute__((target("avx2")))

namespace ius {

// How far ahead (in floats: 2 KiB) the fused amax-and-round loops prefetch the block whose amax
// they take. Each core rounds one block from cache while the next streams in from memory, and
// without the hint the stream's loads stall the loop: +30% amax + cast throughput on one core of
// the AMD EPYC (2,330 to 3,060 Melem/s).
constexpr std::int64_t kAmaxPrefetch = 512;

// Prefetches amaxIn[i + kAmaxPrefetch]: past the block, that is the start of the next one. The
// address is made as an integer (no pointer past the array); a prefetch never faults.
inline void prefetchAmax(const float* amaxIn, std::int64_t i) {
  const std::uintptr_t ahead =
      reinterpret_cast<std::uintptr_t>(amaxIn + i) + kAmaxPrefetch * sizeof(float);
  _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
}

namespace simd {

using Index = std::int64_t;

// Magnitude codes (0..0x80) of eight scaled values, in 32-bit lanes.
template <unsigned ExponentBits, bool Saturate>
IUS_AVX2 inline __m256i magnitudeCodes(__m256i magnitude) {
  using G = fast::Grid<ExponentBits>;
  const __m256i magic = _mm256_set1_epi32(G::magicBits);
  const __m256i subnormal = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(magnitude), _mm256_castsi256_ps(magic))),
      magic);
  // (magnitude + half - 1 + odd) >> shift, less the code offset, folded into one constant
  // (magnitude is at least the offset wherever this is selected).
  constexpr std::int32_t bias = ((1 << G::shift) - 1) / 2 - (G::codeOffset << G::shift);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, G::shift), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(magnitude, _mm256_set1_epi32(bias)), odd), G::shift);
  const __m256i isSubnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(G::minNormalBits), magnitude);
  __m256i code = _mm256_blendv_epi8(normal, subnormal, isSubnormal);
  const __m256i overflow = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(G::overflowBits - 1));
  if (Saturate) {
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(G::maxCode), overflow);
    const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(G::infBits));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(G::nanCode), nan);
  } else {  // overflow, inf and NaN all give the NaN code
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(G::nanCode), overflow);
  }
  return code;
}

// Four vectors of 32-bit lanes to 32 bytes in order (signed saturation; the
// values fit).
IUS_AVX2 inline __m256i packBytes(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

IUS_AVX2 inline __m256i packCodes(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Encodes 32 values at x into 32 codes; returns nothing, stores unaligned.
template <unsigned ExponentBits, bool Saturate>
IUS_AVX2 inline void encode32(const float* x, __m256 scale, std::uint8_t* codes) {
  const __m256i magnitudeMask = _mm256_set1_epi32(0x7fffffff);
  __m256i code[4], sign[4];
  for (int k = 0; k < 4; ++k) {
    const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), scale));
    code[k] = magnitudeCodes<ExponentBits, Saturate>(_mm256_and_si256(bits, magnitudeMask));
    sign[k] = _mm256_srai_epi32(bits, 31);
  }
  const __m256i packed = packCodes(code[0], code[1], code[2], code[3]);
  const __m256i negative = packBytes(sign[0], sign[1], sign[2], sign[3]);
  // The sign goes on every non-zero code (0x80 has it already); there is no -0.
  const __m256i zero = _mm256_cmpeq_epi8(packed, _mm256_setzero_si256());
  const __m256i signBits = _mm256_and_si256(_mm256_andnot_si256(zero, negative), _mm256_set1_epi8(-128));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), _mm256_or_si256(packed, signBits));
}

IUS_AVX2 inline __m256i maxKey8(__m256i key, const float* x) {
  const __m256i magnitude = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
                                             _mm256_set1_epi32(0x7fffffff));
  return _mm256_max_epu32(key, magnitude);
}

IUS_AVX2 inline unsigned reduceMaxKey(__m256i key) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(key), _mm256_extracti128_si256(key, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return static_cast<unsigned>(_mm_cvtsi128_si32(m));
}

IUS_AVX2 inline unsigned amaxKey(const float* x, Index count) {
  __m256i key0 = _mm256_setzero_si256(), key1 = _mm256_setzero_si256();
  Index i = 0;
  for (; i + 16 <= count; i += 16) {
    key0 = maxKey8(key0, x + i);
    key1 = maxKey8(key1, x + i + 8);
  }
  unsigned key = reduceMaxKey(_mm256_max_epu32(key0, key1));
  for (; i < count; ++i) key = maxKey(key, magnitudeKey(x[i]));
  return key;
}

template <unsigned ExponentBits, bool Saturate>
IUS_AVX2 inline void encode(const float* x, Index count, float scale, std::uint8_t* codes) {
  const __m256 scales = _mm256_set1_ps(scale);
  Index i = 0;
  for (; i + 32 <= count; i += 32) encode32<ExponentBits, Saturate>(x + i, scales, codes + i);
  fast::encodeSpan<ExponentBits, Saturate>(x + i, count - i, scale, codes + i);
}

// Encodes castIn while taking the amax key of amaxIn, in one loop, so that a
// block read from cache is cast while the next streams in from memory.
template <unsigned ExponentBits, bool Saturate>
IUS_AVX2 inline unsigned encodeAndAmax(const float* castIn, std::uint8_t* codes, Index castCount,
                                       float scale, const float* amaxIn, Index amaxCount) {
  const __m256 scales = _mm256_set1_ps(scale);
  const Index both = castCount < amaxCount ? castCount : amaxCount;
  __m256i key0 = _mm256_setzero_si256(), key1 = _mm256_setzero_si256();
  Index i = 0;
  for (; i + 32 <= both; i += 32) {
    prefetchAmax(amaxIn, i);
    prefetchAmax(amaxIn, i + 16);
    encode32<ExponentBits, Saturate>(castIn + i, scales, codes + i);
    key0 = maxKey8(maxKey8(key0, amaxIn + i), amaxIn + i + 8);
    key1 = maxKey8(maxKey8(key1, amaxIn + i + 16), amaxIn + i + 24);
  }
  const unsigned key = reduceMaxKey(_mm256_max_epu32(key0, key1));
  encode<ExponentBits, Saturate>(castIn + i, castCount - i, scale, codes + i);
  return maxKey(key, amaxKey(amaxIn + i, amaxCount - i));
}

// decode(encode(x * scale)) * inverse for eight values.
template <unsigned ExponentBits, bool Saturate>
IUS_AVX2 inline __m256 quantise8(__m256 x, __m256 scale, __m256 inverse) {
  using G = fast::Grid<ExponentBits>;
  const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(x, scale));
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  // Rounding by adding and subtracting 2^(e + shift), as quantise16 does.
  const __m256i exponent = _mm256_max_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7f800000)),
                                            _mm256_set1_epi32(G::minNormalBits));
  const __m256 step = _mm256_castsi256_ps(_mm256_add_epi32(exponent, _mm256_set1_epi32(G::shift << 23)));
  __m256i value = _mm256_castps_si256(_mm256_sub_ps(_mm256_add_ps(_mm256_castsi256_ps(magnitude), step), step));
  const __m256i overflow = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(G::overflowBits - 1));
  __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(G::infBits));
  if (Saturate) {
    value = _mm256_blendv_epi8(value, _mm256_set1_epi32(G::maxBits), overflow);
  } else {
    nan = _mm256_or_si256(nan, overflow);
  }
  // The sign on every non-zero value (no -0); NaN decodes to +NaN.
  const __m256i zero = _mm256_cmpeq_epi32(value, _mm256_setzero_si256());
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<std::int32_t>(0x80000000u)));
  value = _mm256_or_si256(value, _mm256_andnot_si256(zero, sign));
  value = _mm256_blendv_epi8(value, _mm256_set1_epi32(G::quietNanBits), nan);
  return _mm256_mul_ps(_mm256_castsi256_ps(value), inverse);
}

template <unsigned ExponentBits, bool Saturate>
IUS_AVX2 inline void quantise(const float* x, Index count, float scale, float inverse, float* out) {
  const __m256 scales = _mm256_set1_ps(scale), inverses = _mm256_set1_ps(inverse);
  Index i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(out + i, quantise8<ExponentBits, Saturate>(_mm256_loadu_ps(x + i), scales, inverses));
  }
  fast::quantiseSpan<ExponentBits, Saturate>(x + i, count - i, scale, inverse, out + i);
}

template <unsigned ExponentBits, bool Saturate>
IUS_AVX2 inline unsigned quantiseAndAmax(const float* castIn, float* out, Index castCount, float scale,
                                         float inverse, const float* amaxIn, Index amaxCount) {
  const __m256 scales = _mm256_set1_ps(scale), inverses = _mm256_set1_ps(inverse);
  const Index both = castCount < amaxCount ? castCount : amaxCount;
  __m256i key0 = _mm256_setzero_si256(), key1 = _mm256_setzero_si256();
  Index i = 0;
  for (; i + 16 <= both; i += 16) {
    prefetchAmax(amaxIn, i);
    _mm256_storeu_ps(out + i, quantise8<ExponentBits, Saturate>(_mm256_loadu_ps(castIn + i), scales, inverses));
    _mm256_storeu_ps(out + i + 8,
                     quantise8<ExponentBits, Saturate>(_mm256_loadu_ps(castIn + i + 8), scales, inverses));
    key0 = maxKey8(key0, amaxIn + i);
    key1 = maxKey8(key1, amaxIn + i + 8);
  }
  const unsigned key = reduceMaxKey(_mm256_max_epu32(key0, key1));
  quantise<ExponentBits, Saturate>(castIn + i, castCount - i, scale, inverse, out + i);
  return maxKey(key, amaxKey(amaxIn + i, amaxCount - i));
}

}  // namespace simd

// ---------------------------------------------------------------- AVX-512F

#define IUS_AVX512 __attribute__((target("avx512f")))

namespace simd512 {

using Index = std::int64_t;

// Magnitude codes (0..0x80) of sixteen scaled values, in 32-bit lanes.
template <unsigned ExponentBits, bool Saturate>
IUS_AVX512 inline __m512i magnitudeCodes(__m512i magnitude) {
  using G = fast::Grid<ExponentBits>;
  const __m512i magic = _mm512_set1_epi32(G::magicBits);
  const __m512i subnormal = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(magnitude), _mm512_castsi512_ps(magic))),
      magic);
  constexpr std::int32_t bias = ((1 << G::shift) - 1) / 2 - (G::codeOffset << G::shift);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, G::shift), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(magnitude, _mm512_set1_epi32(bias)), odd), G::shift);
  const __mmask16 isSubnormal = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(G::minNormalBits), magnitude);
  __m512i code = _mm512_mask_blend_epi32(isSubnormal, normal, subnormal);
  const __mmask16 overflow = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(G::overflowBits - 1));
  if (Saturate) {
    code = _mm512_mask_mov_epi32(code, overflow, _mm512_set1_epi32(G::maxCode));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(G::infBits));
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(G::nanCode));
  } else {  // overflow, inf and NaN all give the NaN code
    code = _mm512_mask_mov_epi32(code, overflow, _mm512_set1_epi32(G::nanCode));
  }
  return code;
}

// Encodes 16 values at x into 16 codes (unaligned store).
template <unsigned ExponentBits, bool Saturate>
IUS_AVX512 inline void encode16(const float* x, __m512 scale, std::uint8_t* codes) {
  const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x), scale));
  __m512i code = magnitudeCodes<ExponentBits, Saturate>(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)));
  // The sign goes on every non-zero code (0x80 has it already); there is no -0.
  const __mmask16 negative = _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512());
  const __mmask16 nonzero = _mm512_test_epi32_mask(code, code);
  code = _mm512_mask_or_epi32(code, negative & nonzero, code, _mm512_set1_epi32(0x80));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(code));
}

IUS_AVX512 inline __m512i maxKey16(__m512i key, const float* x) {
  return _mm512_max_epu32(key, _mm512_and_si512(_mm512_loadu_si512(x), _mm512_set1_epi32(0x7fffffff)));
}

IUS_AVX512 inline unsigned amaxKey(const float* x, Index count) {
  __m512i key0 = _mm512_setzero_si512(), key1 = _mm512_setzero_si512();
  Index i = 0;
  for (; i + 32 <= count; i += 32) {
    key0 = maxKey16(key0, x + i);
    key1 = maxKey16(key1, x + i + 16);
  }
  unsigned key = _mm512_reduce_max_epu32(_mm512_max_epu32(key0, key1));
  for (; i < count; ++i) key = maxKey(key, magnitudeKey(x[i]));
  return key;
}

template <unsigned ExponentBits, bool Saturate>
IUS_AVX512 inline void encode(const float* x, Index count, float scale, std::uint8_t* codes) {
  const __m512 scales = _mm512_set1_ps(scale);
  Index i = 0;
  for (; i + 32 <= count; i += 32) {
    encode16<ExponentBits, Saturate>(x + i, scales, codes + i);
    encode16<ExponentBits, Saturate>(x + i + 16, scales, codes + i + 16);
  }
  fast::encodeSpan<ExponentBits, Saturate>(x + i, count - i, scale, codes + i);
}

// Encodes castIn while taking the amax key of amaxIn, in one loop (see the AVX2 form).
template <unsigned ExponentBits, bool Saturate>
IUS_AVX512 inline unsigned encodeAndAmax(const float* castIn, std::uint8_t* codes, Index castCount,
                                         float scale, const float* amaxIn, Index amaxCount) {
  const __m512 scales = _mm512_set1_ps(scale);
  const Index both = castCount < amaxCount ? castCount : amaxCount;
  __m512i key0 = _mm512_setzero_si512(), key1 = _mm512_setzero_si512();
  Index i = 0;
  for (; i + 32 <= both; i += 32) {
    prefetchAmax(amaxIn, i);
    prefetchAmax(amaxIn, i + 16);
    encode16<ExponentBits, Saturate>(castIn + i, scales, codes + i);
    encode16<ExponentBits, Saturate>(castIn + i + 16, scales, codes + i + 16);
    key0 = maxKey16(key0, amaxIn + i);
    key1 = maxKey16(key1, amaxIn + i + 16);
  }
  const unsigned key = _mm512_reduce_max_epu32(_mm512_max_epu32(key0, key1));
  encode<ExponentBits, Saturate>(castIn + i, castCount - i, scale, codes + i);
  return maxKey(key, amaxKey(amaxIn + i, amaxCount - i));
}

// decode(encode(x * scale)) * inverse for sixteen values.
template <unsigned ExponentBits, bool Saturate>
IUS_AVX512 inline __m512 quantise16(__m512 x, __m512 scale, __m512 inverse) {
  using G = fast::Grid<ExponentBits>;
  const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(x, scale));
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  // Adding 2^(e + shift), e the exponent of |y| or, below the grid's normals, of its smallest
  // normal, rounds |y| to nearest even on the grid's step at e (the subnormal step below):
  // the sum's ulp is that step. Subtracting it again is exact. (Magnitudes whose 2^(e + shift)
  // would overflow are past the format's max and replaced below.)
  const __m512i exponent = _mm512_max_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7f800000)),
                                            _mm512_set1_epi32(G::minNormalBits));
  const __m512 step = _mm512_castsi512_ps(_mm512_add_epi32(exponent, _mm512_set1_epi32(G::shift << 23)));
  __m512i value = _mm512_castps_si512(_mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(magnitude), step), step));
  const __mmask16 overflow = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(G::overflowBits - 1));
  __mmask16 nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(G::infBits));
  if (Saturate) {
    value = _mm512_mask_mov_epi32(value, overflow, _mm512_set1_epi32(G::maxBits));
  } else {
    nan = nan | overflow;
  }
  // The sign on every non-zero value (no -0); NaN decodes to +NaN.
  const __mmask16 nonzero = _mm512_test_epi32_mask(value, value);
  value = _mm512_mask_or_epi32(value, nonzero, value,
                               _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<std::int32_t>(0x80000000u))));
  value = _mm512_mask_mov_epi32(value, nan, _mm512_set1_epi32(G::quietNanBits));
  return _mm512_mul_ps(_mm512_castsi512_ps(value), inverse);
}

template <unsigned ExponentBits, bool Saturate>
IUS_AVX512 inline void quantise(const float* x, Index count, float scale, float inverse, float* out) {
  const __m512 scales = _mm512_set1_ps(scale), inverses = _mm512_set1_ps(inverse);
  Index i = 0;
  for (; i + 16 <= count; i += 16) {
    _mm512_storeu_ps(out + i, quantise16<ExponentBits, Saturate>(_mm512_loadu_ps(x + i), scales, inverses));
  }
  fast::quantiseSpan<ExponentBits, Saturate>(x + i, count - i, scale, inverse, out + i);
}

template <unsigned ExponentBits, bool Saturate>
IUS_AVX512 inline unsigned quantiseAndAmax(const float* castIn, float* out, Index castCount, float scale,
                                           float inverse, const float* amaxIn, Index amaxCount) {
  const __m512 scales = _mm512_set1_ps(scale), inverses = _mm512_set1_ps(inverse);
  const Index both = castCount < amaxCount ? castCount : amaxCount;
  __m512i key0 = _mm512_setzero_si512(), key1 = _mm512_setzero_si512();
  Index i = 0;
  for (; i + 32 <= both; i += 32) {
    prefetchAmax(amaxIn, i);
    prefetchAmax(amaxIn, i + 16);
    _mm512_storeu_ps(out + i, quantise16<ExponentBits, Saturate>(_mm512_loadu_ps(castIn + i), scales, inverses));
    _mm512_storeu_ps(out + i + 16,
                     quantise16<ExponentBits, Saturate>(_mm512_loadu_ps(castIn + i + 16), scales, inverses));
    key0 = maxKey16(key0, amaxIn + i);
    key1 = maxKey16(key1, amaxIn + i + 16);
  }
  const unsigned key = _mm512_reduce_max_epu32(_mm512_max_epu32(key0, key1));
  quantise<ExponentBits, Saturate>(castIn + i, castCount - i, scale, inverse, out + i);
  return maxKey(key, amaxKey(amaxIn + i, amaxCount - i));
}

}  // namespace simd512
}  // namespace ius

#endif
