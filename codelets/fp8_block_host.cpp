// Host entry points (C ABI, for ctypes) of the grouped-recipe vertices
// (fp8_block_codelets.cpp), linked into the same host library as
// host/fp8_host.cpp. Each constructs one vertex as the Poplar graph does on
// one tile (its segment fields connected to that tile's segments, each
// alignment checked), then runs compute() for every worker; the Python
// emulator (ipu_unit_scaling/fp8/codelet_blocks.py) calls them tile by tile.
//
// Status codes, as host/fp8_host.cpp's: 0 done, -1 bad arguments, -2 a field
// connected to memory that breaks its declared alignment.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fp8_block_codelets.cpp"
#include "placement.hpp"

#define IUS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using Index = std::int64_t;
constexpr int kFloat32 = 0;  // ipu_unit_scaling.fp8.host_library's dtype codes
constexpr int kFloat16 = 1;
constexpr int kBadArguments = -1;
constexpr int kMisaligned = -2;

// The arguments every call shares: the tile's segments and its groups.
struct Segments {
  const Index* lengths;
  Index count;
  const unsigned* groupEnds;
  Index groups;
  unsigned workers;
};

template <typename Field, typename Pointer>
std::vector<Field> connectSegments(const Pointer* pointers, const Segments& segments) {
  std::vector<Field> fields(static_cast<std::size_t>(segments.count));
  for (Index s = 0; s < segments.count; ++s) {
    fields[s].connect(pointers[s], static_cast<std::size_t>(segments.lengths[s]));
  }
  return fields;
}

template <typename Vertex>
int runWorkers(Vertex& vertex, unsigned workers) {
  if (poplar::host_shim::misaligned()) return kMisaligned;
  poplar::host_shim::workerCount() = workers;
  for (unsigned w = 0; w < workers; ++w) vertex.compute(w);
  return 0;
}

template <typename T, unsigned E, bool Saturate, bool Ocp>
int runCastTo(const void* const* in, std::uint8_t* const* out, const Segments& segments,
              int rule, int margin, int* log2Scales, int* nonFinite) {
  using Vertex = GroupCastToFp8<T, E, Saturate, Ocp>;
  Vertex vertex;
  poplar::host_shim::misaligned() = false;
  auto inFields = connectSegments<poplar::Input<poplar::Vector<T>>>(
      reinterpret_cast<const T* const*>(in), segments);
  auto outFields =
      connectSegments<typename std::remove_reference<decltype(vertex.out[0])>::type>(out,
                                                                                     segments);
  vertex.in.connect(inFields.data(), inFields.size());
  vertex.out.connect(outFields.data(), outFields.size());
  vertex.groupEnds.connect(segments.groupEnds, static_cast<std::size_t>(segments.groups));
  vertex.log2Scales.connect(log2Scales, static_cast<std::size_t>(segments.groups));
  vertex.nonFinite.connect(nonFinite, static_cast<std::size_t>(segments.groups));
  vertex.rule = rule;
  vertex.margin = margin;
  return runWorkers(vertex, segments.workers);
}

template <typename T, unsigned E, bool Ocp>
int runCastFrom(const std::uint8_t* const* in, void* const* out, const Segments& segments,
                const int* log2Scales) {
  using Vertex = GroupCastFromFp8<T, E, Ocp>;
  Vertex vertex;
  poplar::host_shim::misaligned() = false;
  auto inFields = connectSegments<poplar::Input<poplar::Vector<unsigned char>>>(in, segments);
  auto outFields = connectSegments<typename std::remove_reference<decltype(vertex.out[0])>::type>(
      reinterpret_cast<T* const*>(out), segments);
  vertex.in.connect(inFields.data(), inFields.size());
  vertex.out.connect(outFields.data(), outFields.size());
  vertex.groupEnds.connect(segments.groupEnds, static_cast<std::size_t>(segments.groups));
  vertex.log2Scales.connect(log2Scales, static_cast<std::size_t>(segments.groups));
  return runWorkers(vertex, segments.workers);
}

// The segment ends must be increasing and end at the last segment.
bool validGroups(const Segments& segments) {
  if (segments.workers == 0 || segments.count < 0 || segments.groups < 0) return false;
  Index previous = 0;
  for (Index g = 0; g < segments.groups; ++g) {
    const Index end = segments.groupEnds[g];
    if (end < previous || end > segments.count) return false;
    previous = end;
  }
  return previous == segments.count;
}

template <typename T, unsigned E>
int castToGrid(const void* const* in, std::uint8_t* const* out, const Segments& segments,
               int saturate, int ocp, int rule, int margin, int* log2Scales, int* nonFinite) {
  if (ocp) {  // the OCP grids saturate (OCP MX)
    return saturate ? runCastTo<T, E, true, true>(in, out, segments, rule, margin, log2Scales,
                                                  nonFinite)
                    : kBadArguments;
  }
  return saturate
             ? runCastTo<T, E, true, false>(in, out, segments, rule, margin, log2Scales, nonFinite)
             : runCastTo<T, E, false, false>(in, out, segments, rule, margin, log2Scales,
                                             nonFinite);
}

template <typename T>
int dispatchCastTo(const void* const* in, std::uint8_t* const* out, const Segments& segments,
                   int exponentBits, int saturate, int ocp, int rule, int margin,
                   int* log2Scales, int* nonFinite) {
  if (exponentBits == 4) {
    return castToGrid<T, 4>(in, out, segments, saturate, ocp, rule, margin, log2Scales,
                            nonFinite);
  }
  if (exponentBits == 5) {
    return castToGrid<T, 5>(in, out, segments, saturate, ocp, rule, margin, log2Scales,
                            nonFinite);
  }
  return kBadArguments;
}

template <typename T>
int dispatchCastFrom(const std::uint8_t* const* in, void* const* out, const Segments& segments,
                     int exponentBits, int ocp, const int* log2Scales) {
  if (exponentBits == 4) {
    return ocp ? runCastFrom<T, 4, true>(in, out, segments, log2Scales)
               : runCastFrom<T, 4, false>(in, out, segments, log2Scales);
  }
  if (exponentBits == 5) {
    return ocp ? runCastFrom<T, 5, true>(in, out, segments, log2Scales)
               : runCastFrom<T, 5, false>(in, out, segments, log2Scales);
  }
  return kBadArguments;
}

}  // namespace

IUS_EXPORT int ius_vertex_group_cast_to_fp8(const void* const* in, std::uint8_t* const* out,
                                            const Index* lengths, Index count,
                                            const unsigned* groupEnds, Index groups, int dtype,
                                            int exponentBits, int saturate, int ocp, int rule,
                                            int margin, unsigned workers, int* log2Scales,
                                            int* nonFinite) {
  const Segments segments{lengths, count, groupEnds, groups, workers};
  if (!validGroups(segments)) return kBadArguments;
  if (dtype == kFloat32) {
    return dispatchCastTo<float>(in, out, segments, exponentBits, saturate, ocp, rule, margin,
                                 log2Scales, nonFinite);
  }
  if (dtype == kFloat16) {
    return dispatchCastTo<half>(in, out, segments, exponentBits, saturate, ocp, rule, margin,
                                log2Scales, nonFinite);
  }
  return kBadArguments;
}

IUS_EXPORT int ius_vertex_group_cast_from_fp8(const std::uint8_t* const* in, void* const* out,
                                              const Index* lengths, Index count,
                                              const unsigned* groupEnds, Index groups,
                                              const int* log2Scales, int dtype,
                                              int exponentBits, int ocp, unsigned workers) {
  const Segments segments{lengths, count, groupEnds, groups, workers};
  if (!validGroups(segments)) return kBadArguments;
  if (dtype == kFloat32) {
    return dispatchCastFrom<float>(in, out, segments, exponentBits, ocp, log2Scales);
  }
  if (dtype == kFloat16) {
    return dispatchCastFrom<half>(in, out, segments, exponentBits, ocp, log2Scales);
  }
  return kBadArguments;
}

// The graph's plan of the groups (ius::planGroups): with null arrays, only the
// segment and group counts; else also the segments and group ends, into
// arrays of those sizes.
IUS_EXPORT int ius_group_plan(Index rows, Index cols, int kind, Index size, Index* segments,
                              Index* groups, Index* starts, Index* lengths, Index* groupEnds) {
  if (kind != ius::kGroupRow && kind != ius::kGroupTile && kind != ius::kGroupBlock) {
    return kBadArguments;
  }
  const ius::GroupPlan plan = ius::planGroups(rows, cols, kind, size);
  *segments = static_cast<Index>(plan.starts.size());
  *groups = static_cast<Index>(plan.groupEnds.size());
  if (starts == nullptr || lengths == nullptr || groupEnds == nullptr) return 0;
  for (std::size_t s = 0; s < plan.starts.size(); ++s) {
    starts[s] = plan.starts[s];
    lengths[s] = plan.lengths[s];
  }
  for (std::size_t g = 0; g < plan.groupEnds.size(); ++g) groupEnds[g] = plan.groupEnds[g];
  return 0;
}
