// The host fast path: amax + scale + round in one streaming pass, over threads.
//
// Two outputs share one driver: FP8 codes (the cast), or the float32 values
// decode(encode(x * 2^s)) * 2^-s (the quantise that FP8 simulation needs, with
// no codes in between). With a given scale the work is one elementwise pass.
// With the scale from the amax, each thread's chunk is processed block by
// block: the block just read is rounded from cache while the amax of the next
// streams in from memory (one loop does both, so they overlap in the core).
// Each block is rounded with the scale of the amax seen so far in its chunk;
// that scale only falls as the amax grows, so a block is redone only if its
// scale is above the final one, which for most data is rare.
//
// float32 runs the AVX-512 kernels of fp8_simd.hpp where the CPU has AVX-512F,
// its AVX2 kernels where it has AVX2, else fp8_fast.hpp's portable loops; float16 runs the vertex code (fp8_arith.hpp).
// All give the vertices' results bit for bit.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "../fp8_codelets.cpp"
#include "fp8_fast.hpp"
#include "fp8_simd.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
// Runtime dispatch for the portable loops: an AVX2/F16C clone where the CPU
// has it, baseline SSE2 elsewhere.
#define IUS_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#ifndef IUS_HOT
#define IUS_HOT
#endif

namespace ius {
namespace fused {

using Index = std::int64_t;

enum DType : int { kFloat32 = 0, kFloat16 = 1 };

// Tuning knobs, process-wide (the roofline benchmark sweeps them).
struct Tuning {
  std::atomic<Index> blockElements{Index(1) << 15};  // 128 KiB of float32: in L2 with the next
  // Widest SIMD kernels allowed: 2 AVX-512 (where the CPU has it), 1 AVX2, 0 portable loops.
  std::atomic<int> simd{2};
};

inline Tuning& tuning() {
  static Tuning instance;
  return instance;
}

// Below this many elements a second thread costs more than it saves.
constexpr Index kMinElementsPerThread = Index(1) << 16;

inline bool avx512() {
#ifdef IUS_HAVE_AVX2_KERNELS
  static const bool supported = __builtin_cpu_supports("avx512f");
  return supported && tuning().simd.load(std::memory_order_relaxed) >= 2;
#else
  return false;
#endif
}

inline bool avx2() {
#ifdef IUS_HAVE_AVX2_KERNELS
  static const bool supported = __builtin_cpu_supports("avx2");
  return supported && tuning().simd.load(std::memory_order_relaxed) >= 1;
#else
  return false;
#endif
}

// The SIMD level in use: 2 AVX-512, 1 AVX2, 0 the portable loops.
inline int simdLevel() { return avx512() ? 2 : (avx2() ? 1 : 0); }

// ---------------------------------------------------------------- element loops

IUS_HOT inline unsigned amaxFloatPortable(const float* x, Index count) {
  return amaxKeyOfSpan(x, count);
}

IUS_HOT inline unsigned amaxHalf(const half* x, Index count) { return amaxKeyOfSpan(x, count); }

inline unsigned amaxFloat(const float* x, Index count) {
#ifdef IUS_HAVE_AVX2_KERNELS
  if (avx512()) return simd512::amaxKey(x, count);
  if (avx2()) return simd::amaxKey(x, count);
#endif
  return amaxFloatPortable(x, count);
}

template <unsigned E, bool Saturate>
IUS_HOT void encodeFloatPortable(const float* x, Index count, float scale, std::uint8_t* codes) {
  fast::encodeSpan<E, Saturate>(x, count, scale, codes);
}

template <unsigned E, bool Saturate>
IUS_HOT void quantiseFloatPortable(const float* x, Index count, float scale, float inverse,
                                   float* out) {
  fast::quantiseSpan<E, Saturate>(x, count, scale, inverse, out);
}

template <unsigned E, bool Saturate>
IUS_HOT void encodeHalf(const half* x, Index count, float scale, std::uint8_t* codes) {
  castToFp8Span<E, Saturate>(x, count, scale, codes);
}

// Rounds [begin, begin + count) of one input with one scale, and (unless
// nextCount is 0) returns the amax key of [next, next + nextCount).
template <typename T, unsigned E, bool Saturate>
struct CastKernel {
  const T* in;
  std::uint8_t* codes;

  void apply(Index begin, Index count, int log2Scale) const {
    const float scale = powerOfTwo(log2Scale);
    if constexpr (std::is_same<T, float>::value) {
#ifdef IUS_HAVE_AVX2_KERNELS
      if (avx512()) return simd512::encode<E, Saturate>(in + begin, count, scale, codes + begin);
      if (avx2()) return simd::encode<E, Saturate>(in + begin, count, scale, codes + begin);
#endif
      encodeFloatPortable<E, Saturate>(in + begin, count, scale, codes + begin);
    } else {
      encodeHalf<E, Saturate>(in + begin, count, scale, codes + begin);
    }
  }

  unsigned amax(Index begin, Index count) const {
    if constexpr (std::is_same<T, float>::value) {
      return amaxFloat(in + begin, count);
    } else {
      return amaxHalf(in + begin, count);
    }
  }

  unsigned applyAndAmax(Index begin, Index count, int log2Scale, Index next,
                        Index nextCount) const {
#ifdef IUS_HAVE_AVX2_KERNELS
    if constexpr (std::is_same<T, float>::value) {
      if (avx512()) {
        return simd512::encodeAndAmax<E, Saturate>(in + begin, codes + begin, count,
                                                   powerOfTwo(log2Scale), in + next, nextCount);
      }
      if (avx2()) {
        return simd::encodeAndAmax<E, Saturate>(in + begin, codes + begin, count,
                                                powerOfTwo(log2Scale), in + next, nextCount);
      }
    }
#endif
    apply(begin, count, log2Scale);
    return nextCount ? amax(next, nextCount) : 0u;
  }
};

template <unsigned E, bool Saturate>
struct QuantiseKernel {
  const float* in;
  float* out;

  void apply(Index begin, Index count, int log2Scale) const {
    const float scale = powerOfTwo(log2Scale), inverse = powerOfTwo(-log2Scale);
#ifdef IUS_HAVE_AVX2_KERNELS
    if (avx512()) return simd512::quantise<E, Saturate>(in + begin, count, scale, inverse, out + begin);
    if (avx2()) return simd::quantise<E, Saturate>(in + begin, count, scale, inverse, out + begin);
#endif
    quantiseFloatPortable<E, Saturate>(in + begin, count, scale, inverse, out + begin);
  }

  unsigned amax(Index begin, Index count) const { return amaxFloat(in + begin, count); }

  unsigned applyAndAmax(Index begin, Index count, int log2Scale, Index next,
                        Index nextCount) const {
#ifdef IUS_HAVE_AVX2_KERNELS
    if (avx512()) {
      return simd512::quantiseAndAmax<E, Saturate>(in + begin, out + begin, count,
                                                   powerOfTwo(log2Scale), powerOfTwo(-log2Scale),
                                                   in + next, nextCount);
    }
    if (avx2()) {
      return simd::quantiseAndAmax<E, Saturate>(in + begin, out + begin, count,
                                                powerOfTwo(log2Scale), powerOfTwo(-log2Scale),
                                                in + next, nextCount);
    }
#endif
    apply(begin, count, log2Scale);
    return nextCount ? amax(next, nextCount) : 0u;
  }
};

// ---------------------------------------------------------------- driver

// Runs body(part, begin, end) for each of `parts` contiguous chunks, the last
// one on the calling thread.
template <typename Body>
void parallelChunks(Index count, unsigned parts, Body body) {
  std::vector<std::thread> threads;
  threads.reserve(parts);
  for (unsigned p = 0; p + 1 < parts; ++p) {
    const auto chunk = splitRange<Index>(count, parts, p);
    threads.emplace_back(body, p, chunk.begin, chunk.end);
  }
  const auto last = splitRange<Index>(count, parts, parts - 1);
  body(parts - 1, last.begin, last.end);
  for (auto& thread : threads) {
    thread.join();
  }
}

inline unsigned threadsFor(Index count, int requested) {
  Index threads = requested > 0 ? requested : 1;
  const Index useful = count / kMinElementsPerThread;
  threads = threads < useful ? threads : useful;
  return static_cast<unsigned>(threads > 1 ? threads : 1);
}

constexpr int kNotRounded = 1 << 30;

struct ChunkResult {
  unsigned key = 0;
  std::vector<int> blockScales;
};

template <typename Kernel>
void fusedChunk(const Kernel& kernel, Index begin, Index end, Index block, float formatMax,
                int margin, ChunkResult& result) {
  if (begin >= end) return;
  auto blockCount = [&](Index at) { return end - at < block ? end - at : block; };
  result.key = kernel.amax(begin, blockCount(begin));
  for (Index at = begin; at < end; at += block) {
    // The amax now covers this block: round it with that scale while reading the next.
    const Index count = blockCount(at);
    const Index next = at + count;
    const Index nextCount = next < end ? blockCount(next) : 0;
    const ScalingBias bias = scalingBias(floatFromKey(result.key), formatMax, margin);
    unsigned nextKey;
    if (bias.nonFinite) {
      nextKey = nextCount ? kernel.amax(next, nextCount) : 0u;
      result.blockScales.push_back(kNotRounded);
    } else {
      nextKey = kernel.applyAndAmax(at, count, bias.log2Scale, next, nextCount);
      result.blockScales.push_back(bias.log2Scale);
    }
    result.key = maxKey(result.key, nextKey);
  }
}

// With hasScale, rounds with 2^log2Scale; else derives the scale from the amax
// (written to *amax) with margin, and returns 1 without finishing when that
// amax is not finite. *usedScale is the scale applied.
template <typename Kernel>
int run(const Kernel& kernel, Index count, float formatMax, bool hasScale, int log2Scale,
        int margin, int threads, int* usedScale, float* amax) {
  const unsigned parts = threadsFor(count, threads);
  if (hasScale) {
    *usedScale = log2Scale;
    parallelChunks(count, parts, [&](unsigned, Index begin, Index end) {
      kernel.apply(begin, end - begin, log2Scale);
    });
    return 0;
  }
  const Index block = tuning().blockElements.load(std::memory_order_relaxed);
  std::vector<ChunkResult> chunks(parts);
  parallelChunks(count, parts, [&](unsigned part, Index begin, Index end) {
    fusedChunk(kernel, begin, end, block, formatMax, margin, chunks[part]);
  });
  unsigned key = 0;
  for (const ChunkResult& chunk : chunks) key = maxKey(key, chunk.key);
  *amax = floatFromKey(key);
  const ScalingBias bias = scalingBias(*amax, formatMax, margin);
  if (bias.nonFinite) return 1;
  *usedScale = bias.log2Scale;

  bool stale = false;
  for (const ChunkResult& chunk : chunks) {
    for (int scale : chunk.blockScales) stale = stale || scale != bias.log2Scale;
  }
  if (stale) {
    parallelChunks(count, parts, [&](unsigned part, Index begin, Index end) {
      const std::vector<int>& scales = chunks[part].blockScales;
      for (std::size_t b = 0; b < scales.size(); ++b) {
        if (scales[b] == bias.log2Scale) continue;
        const Index at = begin + static_cast<Index>(b) * block;
        kernel.apply(at, end - at < block ? end - at : block, bias.log2Scale);
      }
    });
  }
  return 0;
}

inline float formatMax(int exponentBits) {
  return exponentBits == 4 ? Fp8Spec<4>::maxValue : Fp8Spec<5>::maxValue;
}

// Calls f(std::integral_constant<unsigned, E>, std::bool_constant<Saturate>).
template <typename F>
int withFormat(int exponentBits, bool saturate, F f) {
  if (exponentBits == 4) {
    return saturate ? f(std::integral_constant<unsigned, 4>(), std::true_type())
                    : f(std::integral_constant<unsigned, 4>(), std::false_type());
  }
  return saturate ? f(std::integral_constant<unsigned, 5>(), std::true_type())
                  : f(std::integral_constant<unsigned, 5>(), std::false_type());
}

}  // namespace fused
}  // namespace ius
