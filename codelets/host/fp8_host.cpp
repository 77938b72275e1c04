// Host build of the FP8 codelets, exposed through a C ABI for ctypes.
//
// Three kinds of entry point:
//  * ius_vertex_*: construct one vertex exactly as the Poplar graph would on
//    one tile (fields connected to that tile's slice, or to its list of
//    regions for the ...Regions vertices), then run compute() for every
//    worker. The Python emulator calls them tile by tile.
//  * ius_amax_tree and ius_region_pieces: the placement rules of the graph
//    (placement.hpp, partition.hpp), for the emulator and the graph model.
//  * ius_fused_cast_to_fp8 and ius_fused_quantise: the CPU fast path
//    (fp8_fused.hpp): amax, scale and round in one streaming pass over threads,
//    to codes or straight to the rounded float32 values; bit for bit the
//    vertices' results.
//  * ius_group_quantise: the block forms of ius_fused_quantise (fp8_groups.hpp),
//    one scale per row, tile, column tile or square block; ius_group_quantise_pair
//    both tile casts of a GEMM operand (along its rows and its columns) at once, and
//    ius_rowwise_quantise_pair both per-row and per-column casts (fp8_rowwise.hpp).
//  * ius_nvfp4_quantise and ius_mx_subbyte_quantise: the casts to FP4 and FP6 elements
//    (NVFP4, and MX with E2M1, E2M3 or E3M2 elements; fp8_subbyte.hpp).
//  * ius_cast_figures: the statistics' figures of a cast (its counts and energies) in one
//    pass over the scaled input and its codes; ius_value_figures the same figures in one pass
//    over the input and the FP8 values it was rounded to (no codes made).
// Both use splitRange (partition.hpp), which ius_partition exposes to Python.
//
// Status codes: 0 done, -1 bad arguments, -2 a vertex field connected to
// memory that breaks its declared alignment (Poplar would refuse the graph).
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../placement.hpp"
#include "fp8_fused.hpp"
#include "fp8_groups.hpp"
#include "fp8_subbyte.hpp"
#include "fp8_rowwise.hpp"

#define IUS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using Index = std::int64_t;
using ius::fused::kFloat16;
using ius::fused::kFloat32;

constexpr int kAbiVersion = 6;
constexpr int kBadArguments = -1;
constexpr int kMisaligned = -2;

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

// A list-of-regions field: one inner vector per region, each connected (and
// its alignment checked) as the graph connects one region.
template <typename Inner, typename Pointer>
std::vector<Inner> connectRegions(const Pointer* regions, const Index* lengths, Index count) {
  std::vector<Inner> fields(static_cast<std::size_t>(count));
  for (Index r = 0; r < count; ++r) {
    fields[r].connect(regions[r], static_cast<std::size_t>(lengths[r]));
  }
  return fields;
}

template <typename T>
int runPartialAmaxRegions(const void* const* regions, const Index* lengths, Index count,
                          unsigned workers, float* partials) {
  PartialAmaxRegions<T> vertex;
  poplar::host_shim::misaligned() = false;
  auto in = connectRegions<poplar::Input<poplar::Vector<T>>>(
      reinterpret_cast<const T* const*>(regions), lengths, count);
  vertex.in.connect(in.data(), in.size());
  vertex.partials.connect(partials, workers);
  return runWorkers(vertex, workers);
}

template <typename T, unsigned E, bool Saturate>
int runCastToFp8Regions(const void* const* inRegions, std::uint8_t* const* outRegions,
                        const Index* lengths, Index count, unsigned workers,
                        const int* log2Scale) {
  using Vertex = CastToFp8Regions<T, E, Saturate>;
  Vertex vertex;
  poplar::host_shim::misaligned() = false;
  auto in = connectRegions<poplar::Input<poplar::Vector<T>>>(
      reinterpret_cast<const T* const*>(inRegions), lengths, count);
  auto out = connectRegions<typename std::remove_reference<decltype(vertex.out[0])>::type>(
      outRegions, lengths, count);
  vertex.in.connect(in.data(), in.size());
  vertex.log2Scale.connect(log2Scale);
  vertex.out.connect(out.data(), out.size());
  return runWorkers(vertex, workers);
}

template <typename T, unsigned E>
int runCastFromFp8Regions(const std::uint8_t* const* inRegions, void* const* outRegions,
                          const Index* lengths, Index count, unsigned workers,
                          const int* log2Scale) {
  using Vertex = CastFromFp8Regions<T, E>;
  Vertex vertex;
  poplar::host_shim::misaligned() = false;
  auto in = connectRegions<poplar::Input<poplar::Vector<unsigned char>>>(inRegions, lengths,
                                                                         count);
  auto out = connectRegions<typename std::remove_reference<decltype(vertex.out[0])>::type>(
      reinterpret_cast<T* const*>(outRegions), lengths, count);
  vertex.in.connect(in.data(), in.size());
  vertex.log2Scale.connect(log2Scale);
  vertex.out.connect(out.data(), out.size());
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

IUS_EXPORT int ius_vertex_max_partials(const float* partials, Index count, float* amax) {
  if (count < 0) return kBadArguments;
  MaxPartials vertex;
  vertex.partials.connect(partials, static_cast<std::size_t>(count));
  vertex.amax.connect(amax);
  vertex.compute();
  return 0;
}

IUS_EXPORT int ius_vertex_partial_amax_regions(const void* const* regions, const Index* lengths,
                                               Index count, int dtype, unsigned workers,
                                               float* partials) {
  if (workers == 0 || count < 0) return kBadArguments;
  if (dtype == kFloat32) {
    return runPartialAmaxRegions<float>(regions, lengths, count, workers, partials);
  }
  if (dtype == kFloat16) {
    return runPartialAmaxRegions<half>(regions, lengths, count, workers, partials);
  }
  return kBadArguments;
}

IUS_EXPORT int ius_vertex_cast_to_fp8_regions(const void* const* in, std::uint8_t* const* out,
                                              const Index* lengths, Index count, int dtype,
                                              int exponentBits, int saturate, unsigned workers,
                                              int log2Scale) {
  if (workers == 0 || count < 0 || (dtype != kFloat32 && dtype != kFloat16) ||
      (exponentBits != 4 && exponentBits != 5)) {
    return kBadArguments;
  }
  return ius::fused::withFormat(exponentBits, saturate != 0, [&](auto e, auto sat) {
    constexpr unsigned E = decltype(e)::value;
    constexpr bool S = decltype(sat)::value;
    return dtype == kFloat32
        ? runCastToFp8Regions<float, E, S>(in, out, lengths, count, workers, &log2Scale)
        : runCastToFp8Regions<half, E, S>(in, out, lengths, count, workers, &log2Scale);
  });
}

IUS_EXPORT int ius_vertex_cast_from_fp8_regions(const std::uint8_t* const* in, void* const* out,
                                                const Index* lengths, Index count, int dtype,
                                                int exponentBits, unsigned workers,
                                                int log2Scale) {
  if (workers == 0 || count < 0 || (dtype != kFloat32 && dtype != kFloat16) ||
      (exponentBits != 4 && exponentBits != 5)) {
    return kBadArguments;
  }
  const bool f143 = exponentBits == 4;
  if (dtype == kFloat32) {
    return f143 ? runCastFromFp8Regions<float, 4>(in, out, lengths, count, workers, &log2Scale)
                : runCastFromFp8Regions<float, 5>(in, out, lengths, count, workers, &log2Scale);
  }
  return f143 ? runCastFromFp8Regions<half, 4>(in, out, lengths, count, workers, &log2Scale)
              : runCastFromFp8Regions<half, 5>(in, out, lengths, count, workers, &log2Scale);
}

// The amax tree of placement.hpp over `leaves` tiles: writes each node's tile,
// parent (-1 for the root) and level, and returns the number of nodes, or -1
// when `capacity` (2 * leaves + 1 always suffices) is too small.
IUS_EXPORT Index ius_amax_tree(const std::uint32_t* leafTiles, Index leaves,
                               std::uint64_t rotation, Index capacity, Index* tiles,
                               Index* parents, Index* levels) {
  if (leaves < 0) return kBadArguments;
  const std::vector<unsigned> leafVector(leafTiles, leafTiles + leaves);
  const ius::AmaxTree tree = ius::planAmaxTree(leafVector, rotation);
  const auto nodes = static_cast<Index>(tree.tiles.size());
  if (nodes > capacity) return kBadArguments;
  for (Index i = 0; i < nodes; ++i) {
    tiles[i] = tree.tiles[i];
    parents[i] = tree.parents[i];
    levels[i] = tree.levels[i];
  }
  return nodes;
}

// Each worker's pieces of a tile holding `count` regions of the given lengths,
// as the ...Regions vertices split them: pieces[(worker * count + r) * 2 + {0, 1}]
// is the [begin, end) of region r worker `worker` gets (empty when equal).
IUS_EXPORT int ius_region_pieces(const Index* lengths, Index count, unsigned workers,
                                 Index* pieces) {
  if (workers == 0 || count < 0) return kBadArguments;
  for (Index i = 0; i < static_cast<Index>(workers) * count * 2; ++i) pieces[i] = 0;
  for (unsigned w = 0; w < workers; ++w) {
    ius::forEachPiece<Index>(
        static_cast<unsigned>(count), [&](unsigned r) { return lengths[r]; }, workers, w,
        [&](unsigned r, Index begin, Index end) {
          Index* out = pieces + (static_cast<Index>(w) * count + r) * 2;
          out[0] = begin;
          out[1] = end;
        });
  }
  return 0;
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
  const float formatMax = ius::fused::formatMax(exponentBits);
  return ius::fused::withFormat(exponentBits, saturate != 0, [&](auto e, auto sat) {
    constexpr unsigned E = decltype(e)::value;
    constexpr bool S = decltype(sat)::value;
    if (dtype == kFloat32) {
      const ius::fused::CastKernel<float, E, S> kernel{static_cast<const float*>(in), codes};
      return ius::fused::run(kernel, count, formatMax, hasScale != 0, log2Scale, margin,
                             threads, usedScale, amax);
    }
    const ius::fused::CastKernel<half, E, S> kernel{static_cast<const half*>(in), codes};
    return ius::fused::run(kernel, count, formatMax, hasScale != 0, log2Scale, margin, threads,
                           usedScale, amax);
  });
}

// out = decode(encode(in * 2^s)) * 2^-s for float32, without codes; the scale
// as in ius_fused_cast_to_fp8 (|log2Scale| <= 31 when given). Returns 1, with
// out unspecified, when the amax is not finite.
IUS_EXPORT int ius_fused_quantise(const float* in, Index count, int exponentBits, int saturate,
                                  int hasScale, int log2Scale, int margin, int threads,
                                  float* out, int* usedScale, float* amax) {
  if (exponentBits != 4 && exponentBits != 5) return kBadArguments;
  if (hasScale && (log2Scale > 31 || log2Scale < -31)) return kBadArguments;
  const float formatMax = ius::fused::formatMax(exponentBits);
  return ius::fused::withFormat(exponentBits, saturate != 0, [&](auto e, auto sat) {
    const ius::fused::QuantiseKernel<decltype(e)::value, decltype(sat)::value> kernel{in, out};
    return ius::fused::run(kernel, count, formatMax, hasScale != 0, log2Scale, margin, threads,
                           usedScale, amax);
  });
}

// Tuning for benchmarks: the fused block size in elements (>= 1024) and the
// widest SIMD kernels that may be used (2 AVX-512, 1 AVX2, 0 the portable
// loops). Returns the level in use afterwards (2, 1 or 0: the widest allowed
// that the CPU has); negative values leave a knob as it is.
IUS_EXPORT int ius_fused_tuning(Index blockElements, int simd) {
  auto& tuning = ius::fused::tuning();
  if (blockElements >= 1024) tuning.blockElements.store(blockElements);
  if (simd >= 0) tuning.simd.store(simd);
  return ius::fused::simdLevel();
}

// Checks the fast path's rounding against the vertex functions for `count`
// float32 bit patterns start, start + stride, ... (wrapping): codes and
// quantised values, both formats, both overflow policies, scales 2^log2Scale,
// in the portable loops and (where the CPU has them) the AVX2 and AVX-512
// kernels. Returns
// the number of mismatches; stride 1 from 0 with count 2^32 is every pattern.
IUS_EXPORT std::int64_t ius_fast_selftest(std::uint32_t start, std::uint32_t stride,
                                          std::int64_t count, int log2Scale) {
  constexpr Index kChunk = 4096;
  std::vector<float> x(kChunk), values(kChunk);
  std::vector<std::uint8_t> codes(kChunk);
  const float scale = ius::powerOfTwo(log2Scale), inverse = ius::powerOfTwo(-log2Scale);
  std::int64_t mismatches = 0;
  std::uint32_t pattern = start;
  auto& tuning = ius::fused::tuning();
  const int simd = tuning.simd.load();
  for (Index done = 0; done < count; done += kChunk) {
    const Index n = count - done < kChunk ? count - done : kChunk;
    for (Index i = 0; i < n; ++i, pattern += stride) x[i] = ius::floatFromBits(pattern);
    for (int useSimd = 0; useSimd < 3; ++useSimd) {
      tuning.simd.store(useSimd);
      if (ius::fused::simdLevel() != useSimd) break;
      for (int bits = 4; bits <= 5; ++bits) {
        for (int saturate = 0; saturate < 2; ++saturate) {
          mismatches += ius::fused::withFormat(bits, saturate != 0, [&](auto e, auto sat) {
            constexpr unsigned E = decltype(e)::value;
            constexpr bool S = decltype(sat)::value;
            const ius::fused::CastKernel<float, E, S> cast{x.data(), codes.data()};
            const ius::fused::QuantiseKernel<E, S> quantise{x.data(), values.data()};
            cast.apply(0, n, log2Scale);
            quantise.apply(0, n, log2Scale);
            int bad = 0;
            for (Index i = 0; i < n; ++i) {
              const std::uint8_t code = ius::encodeFp8<E, S>(x[i] * scale);
              const float value = ius::decodeFp8<E>(code) * inverse;
              bad += code != codes[i] || ius::floatBits(value) != ius::floatBits(values[i]);
            }
            return bad;
          });
        }
      }
    }
    tuning.simd.store(simd);
  }
  return mismatches;
}

// The amax pass alone (for the roofline benchmark): max |x| of float32 or
// float16 input over threads, NaN-aware, written to *amax.
IUS_EXPORT int ius_fused_amax(const void* in, Index count, int dtype, int threads, float* amax) {
  if (dtype != kFloat32 && dtype != kFloat16) return kBadArguments;
  const unsigned parts = ius::fused::threadsFor(count, threads);
  std::vector<unsigned> keys(parts, 0u);
  ius::fused::parallelChunks(count, parts, [&](unsigned part, Index begin, Index end) {
    keys[part] = dtype == kFloat32
        ? ius::fused::amaxFloat(static_cast<const float*>(in) + begin, end - begin)
        : ius::fused::amaxHalf(static_cast<const half*>(in) + begin, end - begin);
  });
  unsigned key = 0;
  for (unsigned k : keys) key = ius::maxKey(key, k);
  *amax = ius::floatFromKey(key);
  return 0;
}

// out = the values of in (rows x cols, row-major float32) rounded with one scale per
// groupRows x groupCols group (fp8_groups.hpp), each group's scale s written to
// scales[band * groupColumns + groupColumn]. rule: 0 the AMAX rule (formatMax, margin),
// 1 MX floor (emax), 2 MX round-up (formatMax). stepLog2 1 runs an OCP format on the IPU grid
// (clampMax its max / 2). Returns 1, values unspecified, when a group's amax is not finite.
IUS_EXPORT int ius_group_quantise(const float* in, Index rows, Index cols, Index groupRows,
                                  Index groupCols, int exponentBits, int saturate, int rule,
                                  float formatMax, int emax, int margin, int stepLog2,
                                  int threads, float* out, int* scales) {
  if ((exponentBits != 4 && exponentBits != 5) || rows < 0 || cols < 0 || groupRows < 1 ||
      groupCols < 1 || rule < 0 || rule > 2 || stepLog2 < 0 || stepLog2 > 1 ||
      !(formatMax > 0) || margin < 0 || margin > 31) {
    return kBadArguments;
  }
  if (rows == 0 || cols == 0) return 0;
  const ius::groups::Layout layout{rows, cols, groupRows, groupCols};
  const float clampMax = stepLog2 ? formatMax / 2 : 0.0f;
  const ius::groups::ScaleRule scaleRule{rule, formatMax, emax, margin, stepLog2, clampMax};
  return ius::fused::withFormat(exponentBits, saturate != 0, [&](auto e, auto sat) {
    return ius::groups::run<decltype(e)::value, decltype(sat)::value>(in, out, layout, scaleRule,
                                                                       threads, scales);
  });
}

// Both casts of a GEMM operand at once: rowOut with 1 x size tiles (rowScales, rows x
// ceil(cols / size)) and colOut with size x 1 column tiles (colScales, ceil(rows / size) x
// cols), from one read of `in`; arguments and status as ius_group_quantise.
IUS_EXPORT int ius_group_quantise_pair(const float* in, Index rows, Index cols, Index size,
                                       int exponentBits, int saturate, int rule, float formatMax,
                                       int emax, int margin, int stepLog2, int threads,
                                       float* rowOut, int* rowScales, float* colOut,
                                       int* colScales) {
  if ((exponentBits != 4 && exponentBits != 5) || rows < 0 || cols < 0 || size < 1 ||
      rule < 0 || rule > 2 || stepLog2 < 0 || stepLog2 > 1 || !(formatMax > 0) || margin < 0 ||
      margin > 31) {
    return kBadArguments;
  }
  if (rows == 0 || cols == 0) return 0;
  const ius::groups::Layout layout{rows, cols, size, 1};
  const float clampMax = stepLog2 ? formatMax / 2 : 0.0f;
  const ius::groups::ScaleRule scaleRule{rule, formatMax, emax, margin, stepLog2, clampMax};
  const ius::groups::TileOutput tiles{rowOut, rowScales};
  return ius::fused::withFormat(exponentBits, saturate != 0, [&](auto e, auto sat) {
    return ius::groups::run<decltype(e)::value, decltype(sat)::value>(
        in, colOut, layout, scaleRule, threads, colScales, &tiles);
  });
}

// Both casts of a rowwise GEMM operand at once: rowOut with one scale per row (rowScales, rows)
// and colOut with one per column (colScales, cols); arguments and status as
// ius_group_quantise with 1 x cols and rows x 1 groups, whose values these are.
IUS_EXPORT int ius_rowwise_quantise_pair(const float* in, Index rows, Index cols, int exponentBits,
                                         int saturate, int rule, float formatMax, int emax, int margin,
                                         int stepLog2, int threads, float* rowOut, int* rowScales,
                                         float* colOut, int* colScales) {
  if ((exponentBits != 4 && exponentBits != 5) || rows < 0 || cols < 0 || rule < 0 || rule > 2 ||
      stepLog2 < 0 || stepLog2 > 1 || !(formatMax > 0) || margin < 0 || margin > 31) {
    return kBadArguments;
  }
  if (rows == 0 || cols == 0) return 0;
  const float clampMax = stepLog2 ? formatMax / 2 : 0.0f;
  const ius::groups::ScaleRule scaleRule{rule, formatMax, emax, margin, stepLog2, clampMax};
  return ius::fused::withFormat(exponentBits, saturate != 0, [&](auto e, auto sat) {
    return ius::groups::rowwisePair<decltype(e)::value, decltype(sat)::value>(
        in, rows, cols, scaleRule, threads, rowOut, rowScales, colOut, colScales);
  });
}

// The NVFP4 cast of the rows x cols matrix `in` into `out` (may be `in`), groups of groupRows x
// groupCols (fp8_subbyte.hpp): each group's E4M3 scale into blockScales (may be null), the
// tensor's float32 scale into *tensorScale. Status 1 where the tensor's amax is not finite (or
// its scale underflows): nothing is written.
IUS_EXPORT int ius_nvfp4_quantise(const float* in, Index rows, Index cols, Index groupRows,
                                  Index groupCols, float* out, float* blockScales,
                                  float* tensorScale) {
  if (rows < 0 || cols < 0 || groupRows < 1 || groupCols < 1 || tensorScale == nullptr) {
    return kBadArguments;
  }
  *tensorScale = 1.0f;
  if (rows == 0 || cols == 0) return 0;
  return ius::subbyte::nvfp4(in, rows, cols, groupRows, groupCols, out, blockScales,
                             tensorScale);
}

// MX's cast with sub-byte elements (E2M1, E2M3, E3M2: a grid of mantissaBits, minExponent and
// formatMax) in groups of groupRows x groupCols (fp8_subbyte.hpp): each group's log2 scale
// s = -e into scales, e from emax (roundUp 0, OCP's floor rule) or formatMax (roundUp 1).
// Status 1 where an element is not finite: nothing is written.
IUS_EXPORT int ius_mx_subbyte_quantise(const float* in, Index rows, Index cols, Index groupRows,
                                       Index groupCols, int mantissaBits, int minExponent,
                                       float formatMax, int emax, int roundUp, float* out,
                                       int* scales) {
  if (rows < 0 || cols < 0 || groupRows < 1 || groupCols < 1 || mantissaBits < 1 ||
      mantissaBits > 3 || minExponent < -6 || minExponent > 0 || !(formatMax > 0) ||
      !(formatMax < 512) || roundUp < 0 || roundUp > 1) {
    return kBadArguments;
  }
  if (rows == 0 || cols == 0) return 0;
  const ius::subbyte::Grid grid{mantissaBits, minExponent, formatMax};
  return ius::subbyte::mx(in, rows, cols, groupRows, groupCols, grid, emax, roundUp != 0, out,
                          scales);
}

namespace {

// The figures' sources: for value i (or 16 from i), the scaled input, its decoded FP8 value
// and whether its code is a zero code.
// ius_cast_figures': the scaled input and its codes, decoded by a table.
struct CodeSource {
  const float* scaled;
  const std::uint8_t* codes;
  const float* table;
  int negativeZero;

  float scaledAt(Index i) const { return scaled[i]; }
  float decodedAt(Index i) const { return table[codes[i]]; }
  bool zeroCodeAt(Index i) const { return (codes[i] == 0) | (codes[i] == negativeZero); }
#ifdef IUS_HAVE_AVX2_KERNELS
  IUS_AVX512 void lanes(Index i, __m512& v, __m512& decoded, __mmask16& zeroCode) const {
    const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    v = _mm512_loadu_ps(scaled + i);
    decoded = _mm512_i32gather_ps(code, table, 4);
    zeroCode = _mm512_cmpeq_epi32_mask(code, _mm512_setzero_si512()) |
               _mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(negativeZero));
  }
#endif
};

// ius_value_figures': the input times 2^s, and the FP8 values (decoded times 2^-s) times 2^s,
// exact; a zero code is a zero value.
struct ValueSource {
  const float* x;
  const float* values;
  float scale;

  float scaledAt(Index i) const { return x[i] * scale; }
  float decodedAt(Index i) const { return values[i] * scale; }
  bool zeroCodeAt(Index i) const { return values[i] == 0.0f; }
#ifdef IUS_HAVE_AVX2_KERNELS
  IUS_AVX512 void lanes(Index i, __m512& v, __m512& decoded, __mmask16& zeroCode) const {
    const __m512 times = _mm512_set1_ps(scale), value = _mm512_loadu_ps(values + i);
    v = _mm512_mul_ps(_mm512_loadu_ps(x + i), times);
    decoded = _mm512_mul_ps(value, times);
    zeroCode = _mm512_cmp_ps_mask(value, _mm512_setzero_ps(), _CMP_EQ_OQ);
  }
#endif
};

// The figures' sums of values [from, n), in eight lanes of each kind (chains of dependent
// double additions and a branch per value would set the pace). Returns the elements done.
template <typename Source>
Index figuresPortable(const Source& source, Index from, Index n, float formatMax, double* sums,
                      float& amax) {
  constexpr int kLanes = 8;
  double signal[kLanes] = {}, error[kLanes] = {};
  Index counts[4] = {};
  for (Index i = from; i < n; ++i) {
    const float v = source.scaledAt(i), magnitude = std::fabs(v);
    const bool isFinite = magnitude <= std::numeric_limits<float>::max();
    counts[0] += isFinite;
    counts[1] += isFinite & (v != 0.0f);
    counts[2] += source.zeroCodeAt(i);
    counts[3] += magnitude > formatMax;
    const float kept = isFinite ? magnitude : 0.0f;
    amax = kept > amax ? kept : amax;
    const double x = isFinite ? double(v) : 0.0;
    const double e = isFinite ? double(v - source.decodedAt(i)) : 0.0;
    signal[i % kLanes] += x * x;
    error[i % kLanes] += e * e;
  }
  for (int k = 0; k < 4; ++k) sums[k] += double(counts[k]);
  for (int lane = 0; lane < kLanes; ++lane) {
    sums[4] += signal[lane];
    sums[5] += error[lane];
  }
  return n;
}

#ifdef IUS_HAVE_AVX2_KERNELS
// figuresPortable's sums of the whole vectors of 16 from 0; returns the elements done.
template <typename Source>
IUS_AVX512 Index figures512(const Source& source, Index n, float formatMax, double* sums,
                            float& amax) {
  const __m512 magnitudeMax = _mm512_set1_ps(std::numeric_limits<float>::max()), top = _mm512_set1_ps(formatMax);
  __m512d signal0 = _mm512_setzero_pd(), signal1 = signal0, error0 = signal0, error1 = signal0;
  __m512 largest = _mm512_setzero_ps();
  Index counts[4] = {};
  Index i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v, decoded;
    __mmask16 zeroCode;
    source.lanes(i, v, decoded, zeroCode);
    const __m512 magnitude = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
    const __mmask16 finite = _mm512_cmp_ps_mask(magnitude, magnitudeMax, _CMP_LE_OQ);
    counts[0] += __builtin_popcount(finite);
    counts[1] += __builtin_popcount(_mm512_mask_cmp_ps_mask(finite, v, _mm512_setzero_ps(), _CMP_NEQ_OQ));
    counts[2] += __builtin_popcount(zeroCode);
    counts[3] += __builtin_popcount(_mm512_cmp_ps_mask(magnitude, top, _CMP_GT_OQ));
    largest = _mm512_mask_max_ps(largest, finite, largest, magnitude);
    const __m512 x = _mm512_maskz_mov_ps(finite, v);
    const __m512 e = _mm512_maskz_sub_ps(finite, v, decoded);
    const __m512d xLow = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d xHigh = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    const __m512d eLow = _mm512_cvtps_pd(_mm512_castps512_ps256(e));
    const __m512d eHigh = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    signal0 = _mm512_fmadd_pd(xLow, xLow, signal0);
    signal1 = _mm512_fmadd_pd(xHigh, xHigh, signal1);
    error0 = _mm512_fmadd_pd(eLow, eLow, error0);
    error1 = _mm512_fmadd_pd(eHigh, eHigh, error1);
  }
  for (int k = 0; k < 4; ++k) sums[k] += double(counts[k]);
  sums[4] += _mm512_reduce_add_pd(_mm512_add_pd(signal0, signal1));
  sums[5] += _mm512_reduce_add_pd(_mm512_add_pd(error0, error1));
  const float vectorMax = _mm512_reduce_max_ps(largest);
  amax = vectorMax > amax ? vectorMax : amax;
  return i;
}
#endif

// The seven figures of a cast from its source (see ius_cast_figures).
template <typename Source>
void figures(const Source& source, Index n, float formatMax, double* out) {
  for (int index = 0; index < 6; ++index) out[index] = 0.0;
  float amax = 0.0f;
  Index done = 0;
#ifdef IUS_HAVE_AVX2_KERNELS
  if (ius::fused::simdLevel() == 2) done = figures512(source, n, formatMax, out, amax);
#endif
  figuresPortable(source, done, n, formatMax, out, amax);
  out[6] = double(amax);
}

}  // namespace

// The figures ipu_unit_scaling/fp8/stats.py records for a cast of n values: `scaled` (the input
// times 2^s) and its codes, decoded by `table` (256 values). out: [finite values, nonzero finite
// values, zero codes (code 0, and negativeZero where it is not -1), values past formatMax (inf
// included), the finite values' energy, that of their rounding errors (double sums), the
// finite values' amax]. Non-finite values count in none but the zero codes and the saturated.
// (The energies' summation order follows the SIMD level: they agree to rounding.)
IUS_EXPORT int ius_cast_figures(const float* scaled, const std::uint8_t* codes, Index n,
                                const float* table, int negativeZero, float formatMax, double* out) {
  if (n < 0 || negativeZero < -1 || negativeZero > 255) return kBadArguments;
  figures(CodeSource{scaled, codes, table, negativeZero}, n, formatMax, out);
  return 0;
}

// ius_cast_figures' figures of the cast of the float32 `x` (n values) with scale 2^log2Scale
// (|log2Scale| <= 31) that rounded it to the FP8 values `values` (ius_fused_quantise's
// output: each the decoded code times 2^-log2Scale), computed without the codes: the same
// figures for the same cast, its energies summed in another order only where the SIMD level
// differs.
IUS_EXPORT int ius_value_figures(const float* x, const float* values, Index n, int log2Scale,
                                 float formatMax, double* out) {
  if (n < 0 || log2Scale > 31 || log2Scale < -31) return kBadArguments;
  figures(ValueSource{x, values, ius::powerOfTwo(log2Scale)}, n, formatMax, out);
  return 0;
}
