// Poplar vertices for tile-local FP8 amax, scaling bias and casts.
//
// Compiled by popc for the IPU (graph.addCodelets or popc), and by g++ against
// host_shim/ for the host library; the source is the same and the arithmetic
// lives in fp8_arith.hpp. Graph layout (see custom_ops/fp8_graph.cpp), every
// vertex on the tile where its data already is:
//   every tile holding input:  PartialAmax<T>        -> one partial per worker
//   a tree over those tiles:   MaxPartials           -> the amax of a group's partials
//   its root:                  ScalingBias<E>        -> log2 scale, non-finite flag
//   every tile holding input:  CastToFp8<T, E, Sat>  -> uint8 codes
// and CastFromFp8<T, E> for the way back. E is the number of exponent bits:
// 4 for F143, 5 for F152. A tile whose data lies in one contiguous region runs
// the vertex above; a tile holding several regions runs its ...Regions variant,
// which takes the list of regions (as poplibs' 2D element-wise vertices do)
// instead of having them copied together first.
#include <poplar/HalfFloat.hpp>
#include <poplar/Vertex.hpp>

#include "fp8_arith.hpp"
#include "partition.hpp"

using namespace poplar;

// Sub-word outputs are ius::kSubWordAlignment (8-byte) aligned. Worker slices
// start on multiples of ius::kPartitionGrain (8) elements of an aligned
// region, so they start on 8-byte boundaries too.
using ius::kSubWordAlignment;

// The absolute maximum of this worker's slice of the tile's input, NaN-aware.
template <typename T>
class PartialAmax : public MultiVertex {
 public:
  Input<Vector<T>> in;
  Output<Vector<float>> partials;  // numWorkers() entries, one per worker

  bool compute(unsigned workerId) {
    const auto slice = ius::splitRange(in.size(), numWorkers(), workerId);
    unsigned key = 0;
    if (slice.end > slice.begin) {
      key = ius::amaxKeyOfSpan(&in[slice.begin], slice.end - slice.begin);
    }
    partials[workerId] = ius::floatFromKey(key);
    return true;
  }
};

template class PartialAmax<float>;
template class PartialAmax<half>;

template <typename T>
class PartialAmaxRegions : public MultiVertex {
 public:
  Vector<Input<Vector<T>>> in;
  Output<Vector<float>> partials;  // numWorkers() entries, one per worker

  bool compute(unsigned workerId) {
    unsigned key = 0;
    ius::forEachPiece<unsigned>(
        unsigned(in.size()), [&](unsigned r) { return unsigned(in[r].size()); }, numWorkers(),
        workerId,
        [&](unsigned r, unsigned begin, unsigned end) {
          key = ius::maxKey(key, ius::amaxKeyOfSpan(&in[r][begin], end - begin));
        });
    partials[workerId] = ius::floatFromKey(key);
    return true;
  }
};

template class PartialAmaxRegions<float>;
template class PartialAmaxRegions<half>;

// One inner node of the amax tree: the NaN-aware amax of its group's partials.
class MaxPartials : public Vertex {
 public:
  Input<Vector<float>> partials;
  Output<float> amax;

  bool compute() {
    unsigned key = 0;
    for (unsigned i = 0; i < partials.size(); ++i) {
      key = ius::maxKey(key, ius::magnitudeKey(partials[i]));
    }
    *amax = ius::floatFromKey(key);
    return true;
  }
};

// The root of the amax tree: reduces its partials to the amax and turns it
// into the log2 scaling bias. A vertex cannot raise, so a non-finite amax writes scale 0
// and sets nonFinite; the host side turns that into an error.
template <unsigned ExponentBits>
class ScalingBias : public Vertex {
 public:
  Input<Vector<float>> partials;
  Output<int> log2Scale;
  Output<int> nonFinite;
  int margin;

  bool compute() {
    unsigned key = 0;
    for (unsigned i = 0; i < partials.size(); ++i) {
      key = ius::maxKey(key, ius::magnitudeKey(partials[i]));
    }
    const ius::ScalingBias bias = ius::scalingBias(
        ius::floatFromKey(key), ius::Fp8Spec<ExponentBits>::maxValue, margin);
    *log2Scale = bias.log2Scale;
    *nonFinite = bias.nonFinite ? 1 : 0;
    return true;
  }
};

template class ScalingBias<4>;
template class ScalingBias<5>;

// codes = encode(in * 2^log2Scale), round to nearest even, saturating to
// +-max or giving NaN on overflow.
template <typename T, unsigned ExponentBits, bool Saturate>
class CastToFp8 : public MultiVertex {
 public:
  Input<Vector<T>> in;
  Input<int> log2Scale;
  Output<Vector<unsigned char, VectorLayout::SPAN, kSubWordAlignment>> out;

  bool compute(unsigned workerId) {
    const auto slice = ius::splitRange(in.size(), numWorkers(), workerId);
    if (slice.end > slice.begin) {
      ius::castToFp8Span<ExponentBits, Saturate>(
          &in[slice.begin], slice.end - slice.begin, ius::powerOfTwo(*log2Scale),
          &out[slice.begin]);
    }
    return true;
  }
};

template class CastToFp8<float, 4, true>;
template class CastToFp8<float, 4, false>;
template class CastToFp8<float, 5, true>;
template class CastToFp8<float, 5, false>;
template class CastToFp8<half, 4, true>;
template class CastToFp8<half, 4, false>;
template class CastToFp8<half, 5, true>;
template class CastToFp8<half, 5, false>;

template <typename T, unsigned ExponentBits, bool Saturate>
class CastToFp8Regions : public MultiVertex {
 public:
  Vector<Input<Vector<T>>> in;
  Input<int> log2Scale;
  Vector<Output<Vector<unsigned char, VectorLayout::SPAN, kSubWordAlignment>>> out;

  bool compute(unsigned workerId) {
    const float scale = ius::powerOfTwo(*log2Scale);
    ius::forEachPiece<unsigned>(
        unsigned(in.size()), [&](unsigned r) { return unsigned(in[r].size()); }, numWorkers(),
        workerId,
        [&](unsigned r, unsigned begin, unsigned end) {
          ius::castToFp8Span<ExponentBits, Saturate>(&in[r][begin], end - begin, scale,
                                                     &out[r][begin]);
        });
    return true;
  }
};

template class CastToFp8Regions<float, 4, true>;
template class CastToFp8Regions<float, 4, false>;
template class CastToFp8Regions<float, 5, true>;
template class CastToFp8Regions<float, 5, false>;
template class CastToFp8Regions<half, 4, true>;
template class CastToFp8Regions<half, 4, false>;
template class CastToFp8Regions<half, 5, true>;
template class CastToFp8Regions<half, 5, false>;

// out = decode(codes) * 2^-log2Scale.
template <typename T, unsigned ExponentBits>
class CastFromFp8 : public MultiVertex {
 public:
  Input<Vector<unsigned char>> in;
  Input<int> log2Scale;
  Output<Vector<T, VectorLayout::SPAN, kSubWordAlignment>> out;

  bool compute(unsigned workerId) {
    const auto slice = ius::splitRange(in.size(), numWorkers(), workerId);
    if (slice.end > slice.begin) {
      ius::castFromFp8Span<ExponentBits>(&in[slice.begin], slice.end - slice.begin,
                                         ius::powerOfTwo(-*log2Scale), &out[slice.begin]);
    }
    return true;
  }
};

template class CastFromFp8<float, 4>;
template class CastFromFp8<float, 5>;
template class CastFromFp8<half, 4>;
template class CastFromFp8<half, 5>;

template <typename T, unsigned ExponentBits>
class CastFromFp8Regions : public MultiVertex {
 public:
  Vector<Input<Vector<unsigned char>>> in;
  Input<int> log2Scale;
  Vector<Output<Vector<T, VectorLayout::SPAN, kSubWordAlignment>>> out;

  bool compute(unsigned workerId) {
    const float scale = ius::powerOfTwo(-*log2Scale);
    ius::forEachPiece<unsigned>(
        unsigned(in.size()), [&](unsigned r) { return unsigned(in[r].size()); }, numWorkers(),
        workerId,
        [&](unsigned r, unsigned begin, unsigned end) {
          ius::castFromFp8Span<ExponentBits>(&in[r][begin], end - begin, scale, &out[r][begin]);
        });
    return true;
  }
};

template class CastFromFp8Regions<float, 4>;
template class CastFromFp8Regions<float, 5>;
template class CastFromFp8Regions<half, 4>;
template class CastFromFp8Regions<half, 5>;
