// Host build of the FP8 codelets, exposed through a C ABI for ctypes.
//
// Two kinds of entry point:
//  * ius_vertex_*: construct one vertex exactly as the Poplar graph would on
//    one tile (fields connected to that tile's slice), then run compute() for
//    every worker. The Python emulator calls them tile by tile.
//  * ius_fused_cast_to_fp8: the CPU fast path. One pass for the amax, one for
//    scale + round + store, split over threads; it calls the same per-element
//    functions (fp8_arith.hpp) as the vertices.
// Both use splitRange (partition.hpp), which ius_partition exposes to Python.
//
// Status codes: 0 done, -1 bad arguments, -2 a vertex field connected to
// memory that breaks its declared alignment (Poplar would refuse the graph).
#include <cstdint>
#include <thread>
#include <vector>

#include "../fp8_codelets.cpp"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
// Runtime dispatch: an AVX2/F16C clone where the CPU has it, baseline SSE2
// elsewhere, so the library is fast here and still safe on any x86-64.
#define IUS_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#ifndef IUS_HOT
#define IUS_HOT
#endif

#define IUS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using Index = std::int64_t;

enum DType : int { kFloat32 = 0, kFloat16 = 1 };

constexpr int kAbiVersion = 1;
constexpr int kBadArguments = -1;
constexpr int kMisaligned = -2;

// Below this many elements a second thread costs more than it saves.
constexpr Index kMinElementsPerThread = Index(1) << 16;

template <typename T>
const T* offset(const void* base, Index elements) {
  return static_cast<const T*>(base) + elements;
}

// Runs every worker of a connected MultiVertex, unless a field was misaligned.
template <typename MultiVertexType>
int runWorkers(MultiVertexType& vertex, unsigned workers) {
  if (poplar::host_shim::misaligned()) return kMisaligned;
  poplar::host_shim::workerCount() = workers;
  for (unsigned w = 0; w < workers; ++w) {
    vertex.compute(w);
  }
  return 0;
}

template <typename T>
int runPartialAmax(const void* in, Index count, unsigned workers, float* partials) {
  PartialAmax<T> vertex;
  poplar::host_shim::misaligned() = false;
  vertex.in.connect(static_cast<const T*>(in), static_cast<std::size_t>(count));
  vertex.partials.connect(partials, workers);
  return runWorkers(vertex, workers);
}

template <typename T, unsigned E, bool Saturate>
int runCastToFp8(const void* in, Index count, unsigned workers, const int* log2Scale,
                 std::uint8_t* out) {
  CastToFp8<T, E, Saturate> vertex;
  poplar::host_shim::misaligned() = false;
  vertex.in.connect(static_cast<const T*>(in), static_cast<std::size_t>(count));
  vertex.log2Scale.connect(log2Scale);
  vertex.out.connect(out, static_cast<std::size_t>(count));
  return runWorkers(vertex, workers);
}

template <typename T, unsigned E>
int runCastFromFp8(const std::uint8_t* in, Index count, unsigned workers, const int* log2Scale,
                   void* out) {
  CastFromFp8<T, E> vertex;
  poplar::host_shim::misaligned() = false;
  vertex.in.connect(in, static_cast<std::size_t>(count));
  vertex.log2Scale.connect(log2Scale);
  vertex.out.connect(static_cast<T*>(out), static_cast<std::size_t>(count));
  return runWorkers(vertex, workers);
}

template <typename T>
int dispatchCastToFp8(const void* in, Index count, int exponentBits, int saturate,
                      unsigned workers, const int* log2Scale, std::uint8_t* out) {
  if (exponentBits == 4) {
    return saturate ? runCastToFp8<T, 4, true>(in, count, workers, log2Scale, out)
                    : runCastToFp8<T, 4, false>(in, count, workers, log2Scale, out);
  }
  if (exponentBits == 5) {
    return saturate ? runCastToFp8<T, 5, true>(in, count, workers, log2Scale, out)
                    : runCastToFp8<T, 5, false>(in, count, workers, log2Scale, out);
  }
  return kBadArguments;
}

IUS_HOT unsigned amaxKeyFloat(const float* x, Index count) {
  return ius::amaxKeyOfSpan(x, count);
}

IUS_HOT unsigned amaxKeyHalf(const half* x, Index count) { return ius::amaxKeyOfSpan(x, count); }

IUS_HOT void castFloat(const float* x, Index count, int exponentBits, bool saturate, float scale,
                       std::uint8_t* codes) {
  if (exponentBits == 4) {
    saturate ? ius::castToFp8Span<4, true>(x, count, scale, codes)
             : ius::castToFp8Span<4, false>(x, count, scale, codes);
  } else {
    saturate ? ius::castToFp8Span<5, true>(x, count, scale, codes)
             : ius::castToFp8Span<5, false>(x, count, scale, codes);
  }
}

IUS_HOT void castHalf(const half* x, Index count, int exponentBits, bool saturate, float scale,
                      std::uint8_t* codes) {
  if (exponentBits == 4) {
    saturate ? ius::castToFp8Span<4, true>(x, count, scale, codes)
             : ius::castToFp8Span<4, false>(x, count, scale, codes);
  } else {
    saturate ? ius::castToFp8Span<5, true>(x, count, scale, codes)
             : ius::castToFp8Span<5, false>(x, count, scale, codes);
  }
}

// One loop that casts one block (already in cache, compute-bound) while
// taking the amax of the next (streaming from memory, bandwidth-bound), so the
// two overlap in the core instead of alternating.
template <unsigned E, bool Saturate, typename T>
inline unsigned castAndAmaxSpans(const T* __restrict__ castIn, std::uint8_t* __restrict__ codes,
                                 Index castCount, float scale, const T* __restrict__ amaxIn,
                                 Index amaxCount) {
  const Index both = castCount < amaxCount ? castCount : amaxCount;
  unsigned key = 0;
  for (Index i = 0; i < both; ++i) {
    codes[i] = ius::encodeFp8<E, Saturate>(static_cast<float>(castIn[i]) * scale);
    key = ius::maxKey(key, ius::magnitudeKey(amaxIn[i]));
  }
  ius::castToFp8Span<E, Saturate>(castIn + both, castCount - both, scale, codes + both);
  return ius::maxKey(key, ius::amaxKeyOfSpan(amaxIn + both, amaxCount - both));
}

template <typename T>
inline unsigned castAndAmax(const T* castIn, std::uint8_t* codes, Index castCount, int exponentBits,
                            bool saturate, float scale, const T* amaxIn, Index amaxCount) {
  if (exponentBits == 4) {
    return saturate ? castAndAmaxSpans<4, true>(castIn, codes, castCount, scale, amaxIn, amaxCount)
                    : castAndAmaxSpans<4, false>(castIn, codes, castCount, scale, amaxIn, amaxCount);
  }
  return saturate ? castAndAmaxSpans<5, true>(castIn, codes, castCount, scale, amaxIn, amaxCount)
                  : castAndAmaxSpans<5, false>(castIn, codes, castCount, scale, amaxIn, amaxCount);
}

IUS_HOT unsigned castAndAmaxFloat(const float* castIn, std::uint8_t* codes, Index castCount,
                                  int exponentBits, bool saturate, float scale,
                                  const float* amaxIn, Index amaxCount) {
  return castAndAmax(castIn, codes, castCount, exponentBits, saturate, scale, amaxIn, amaxCount);
}

IUS_HOT unsigned castAndAmaxHalf(const half* castIn, std::uint8_t* codes, Index castCount,
                                 int exponentBits, bool saturate, float scale, const half* amaxIn,
                                 Index amaxCount) {
  return castAndAmax(castIn, codes, castCount, exponentBits, saturate, scale, amaxIn, amaxCount);
}

// Runs body(part, begin, end) for each of `parts` contiguous chunks, the last
// one on the calling thread.
template <typename Body>
void parallelChunks(Index count, unsigned parts, Body body) {
  std::vector<std::thread> threads;
  threads.reserve(parts);
  for (unsigned p = 0; p + 1 < parts; ++p) {
    const auto chunk = ius::splitRange<Index>(count, parts, p);
    threads.emplace_back(body, p, chunk.begin, chunk.end);
  }
  const auto last = ius::splitRange<Index>(count, parts, parts - 1);
  body(parts - 1, last.begin, last.end);
  for (auto& thread : threads) {
    thread.join();
  }
}

unsigned threadsFor(Index count, int requested) {
  Index threads = requested > 0 ? requested : 1;
  const Index useful = count / kMinElementsPerThread;
  threads = threads < useful ? threads : useful;
  return static_cast<unsigned>(threads > 1 ? threads : 1);
}

void castBlock(const void* in, Index begin, Index count, int dtype, int exponentBits,
               bool saturate, int log2Scale, std::uint8_t* codes) {
  const float scale = ius::powerOfTwo(log2Scale);
  if (dtype == kFloat32) {
    castFloat(offset<float>(in, begin), count, exponentBits, saturate, scale, codes + begin);
  } else {
    castHalf(offset<half>(in, begin), count, exponentBits, saturate, scale, codes + begin);
  }
}

unsigned amaxKeyBlock(const void* in, Index begin, Index count, int dtype) {
  return dtype == kFloat32 ? amaxKeyFloat(offset<float>(in, begin), count)
                           : amaxKeyHalf(offset<half>(in, begin), count);
}

// The amax pass and the cast pass run block by block, so the cast reads the
// block from cache instead of memory. Each block is cast with the scale of the
// amax seen so far in its chunk; the scale only falls as the amax grows, so a
// block needs casting again only if its scale is above the final one, which
// for most data is rare. Every code is finally produced with the final scale.
constexpr Index kFusedBlock = Index(1) << 15;
constexpr int kNotCast = 1 << 30;

struct ChunkResult {
  unsigned key = 0;
  std::vector<int> blockScales;
};

void fusedChunk(const void* in, Index begin, Index end, int dtype, int exponentBits,
                bool saturate, int margin, std::uint8_t* codes, ChunkResult& result) {
  const float formatMax =
      exponentBits == 4 ? ius::Fp8Spec<4>::maxValue : ius::Fp8Spec<5>::maxValue;
  auto blockCount = [&](Index block) { return end - block < kFusedBlock ? end - block : kFusedBlock; };
  if (begin >= end) return;
  result.key = amaxKeyBlock(in, begin, blockCount(begin), dtype);
  for (Index block = begin; block < end; block += kFusedBlock) {
    // The amax now covers this block: cast it with that scale while reading the next.
    const Index count = blockCount(block);
    const Index next = block + count;
    const Index nextCount = next < end ? blockCount(next) : 0;
    const ius::ScalingBias bias = ius::scalingBias(ius::floatFromKey(result.key), formatMax, margin);
    unsigned nextKey;
    if (bias.nonFinite) {
      nextKey = nextCount ? amaxKeyBlock(in, next, nextCount, dtype) : 0u;
      result.blockScales.push_back(kNotCast);
    } else {
      const float scale = ius::powerOfTwo(bias.log2Scale);
      nextKey = dtype == kFloat32
          ? castAndAmaxFloat(offset<float>(in, block), codes + block, count, exponentBits,
                             saturate, scale, offset<float>(in, next), nextCount)
          : castAndAmaxHalf(offset<half>(in, block), codes + block, count, exponentBits,
                            saturate, scale, offset<half>(in, next), nextCount);
      result.blockScales.push_back(bias.log2Scale);
    }
    result.key = ius::maxKey(result.key, nextKey);
  }
}

}  // namespace

IUS_EXPORT int ius_abi_version() { return kAbiVersion; }

IUS_EXPORT unsigned ius_partition_grain() { return ius::kPartitionGrain; }

// bounds[(tile * workers + worker) * 2 + {0, 1}] = absolute [begin, end).
IUS_EXPORT void ius_partition(Index count, unsigned tiles, unsigned workers, Index* bounds) {
  for (unsigned t = 0; t < tiles; ++t) {
    const auto tile = ius::splitRange<Index>(count, tiles, t);
    for (unsigned w = 0; w < workers; ++w) {
      const auto slice = ius::splitRange<Index>(tile.end - tile.begin, workers, w);
      Index* out = bounds + (static_cast<Index>(t) * workers + w) * 2;
      out[0] = tile.begin + slice.begin;
      out[1] = tile.begin + slice.end;
    }
  }
}

IUS_EXPORT int ius_vertex_partial_amax(const void* in, Index count, int dtype, unsigned workers,
                                       float* partials) {
  if (workers == 0) return kBadArguments;
  if (dtype == kFloat32) return runPartialAmax<float>(in, count, workers, partials);
  if (dtype == kFloat16) return runPartialAmax<half>(in, count, workers, partials);
  return kBadArguments;
}

IUS_EXPORT int ius_vertex_scaling_bias(const float* partials, Index count, int exponentBits,
                                       int margin, int* log2Scale, int* nonFinite) {
  if (exponentBits == 4) {
    ScalingBias<4> vertex;
    vertex.partials.connect(partials, static_cast<std::size_t>(count));
    vertex.log2Scale.connect(log2Scale);
    vertex.nonFinite.connect(nonFinite);
    vertex.margin = margin;
    vertex.compute();
  } else if (exponentBits == 5) {
    ScalingBias<5> vertex;
    vertex.partials.connect(partials, static_cast<std::size_t>(count));
    vertex.log2Scale.connect(log2Scale);
    vertex.nonFinite.connect(nonFinite);
    vertex.margin = margin;
    vertex.compute();
  } else {
    return kBadArguments;
  }
  return 0;
}

IUS_EXPORT int ius_vertex_cast_to_fp8(const void* in, Index count, int dtype, int exponentBits,
                                      int saturate, unsigned workers, int log2Scale,
                                      std::uint8_t* out) {
  if (workers == 0) return kBadArguments;
  if (dtype == kFloat32) {
    return dispatchCastToFp8<float>(in, count, exponentBits, saturate, workers, &log2Scale, out);
  }
  if (dtype == kFloat16) {
    return dispatchCastToFp8<half>(in, count, exponentBits, saturate, workers, &log2Scale, out);
  }
  return kBadArguments;
}

IUS_EXPORT int ius_vertex_cast_from_fp8(const std::uint8_t* in, Index count, int dtype,
                                        int exponentBits, unsigned workers, int log2Scale,
                                        void* out) {
  if (workers == 0) return kBadArguments;
  const bool f143 = exponentBits == 4;
  if (!f143 && exponentBits != 5) return kBadArguments;
  if (dtype == kFloat32) {
    return f143 ? runCastFromFp8<float, 4>(in, count, workers, &log2Scale, out)
                : runCastFromFp8<float, 5>(in, count, workers, &log2Scale, out);
  }
  if (dtype == kFloat16) {
    return f143 ? runCastFromFp8<half, 4>(in, count, workers, &log2Scale, out)
                : runCastFromFp8<half, 5>(in, count, workers, &log2Scale, out);
  }
  return kBadArguments;
}

// The fast path. With hasScale == 0 the scale comes from the amax (written to
// *amax); returns 1, with codes unspecified, when that amax is not finite.
IUS_EXPORT int ius_fused_cast_to_fp8(const void* in, Index count, int dtype, int exponentBits,
                                     int saturate, int hasScale, int log2Scale, int margin,
                                     int threads, std::uint8_t* codes, int* usedScale,
                                     float* amax) {
  if ((dtype != kFloat32 && dtype != kFloat16) || (exponentBits != 4 && exponentBits != 5)) {
    return kBadArguments;
  }
  if (hasScale && (log2Scale > 126 || log2Scale < -126)) return kBadArguments;
  const unsigned parts = threadsFor(count, threads);
  if (hasScale) {
    *usedScale = log2Scale;
    parallelChunks(count, parts, [&](unsigned, Index begin, Index end) {
      castBlock(in, begin, end - begin, dtype, exponentBits, saturate != 0, log2Scale, codes);
    });
    return 0;
  }

  std::vector<ChunkResult> chunks(parts);
  parallelChunks(count, parts, [&](unsigned part, Index begin, Index end) {
    fusedChunk(in, begin, end, dtype, exponentBits, saturate != 0, margin, codes, chunks[part]);
  });
  unsigned key = 0;
  for (const ChunkResult& chunk : chunks) key = ius::maxKey(key, chunk.key);
  *amax = ius::floatFromKey(key);
  const float formatMax =
      exponentBits == 4 ? ius::Fp8Spec<4>::maxValue : ius::Fp8Spec<5>::maxValue;
  const ius::ScalingBias bias = ius::scalingBias(*amax, formatMax, margin);
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
        const Index block = begin + static_cast<Index>(b) * kFusedBlock;
        const Index n = end - block < kFusedBlock ? end - block : kFusedBlock;
        castBlock(in, block, n, dtype, exponentBits, saturate != 0, bias.log2Scale, codes);
      }
    });
  }
  return 0;
}
