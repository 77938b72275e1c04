// Poplar vertices for tile-local FP8 amax, scaling bias and casts.
//
// Compiled by popc for the IPU (graph.addCodelets or `popc -O3`), and by g++
// against host_shim/ for the host library; the source is the same and the
// arithmetic lives in fp8_arith.hpp. Graph layout (see custom_ops/):
//   every tile holding input:  PartialAmax<T>        -> one partial per worker
//   one tile:                  ScalingBias<E>        -> log2 scale, non-finite flag
//   every tile holding input:  CastToFp8<T, E, Sat>  -> uint8 codes
// and CastFromFp8<T, E> for the way back. E is the number of exponent bits:
// 4 for F143, 5 for F152.
#include <poplar/HalfFloat.hpp>
#include <poplar/Vertex.hpp>

#include "fp8_arith.hpp"
#include "partition.hpp"

using namespace poplar;

// Sub-word outputs (uint8 codes, half values) are 64-bit aligned, as poplibs
// does for its casts: a store narrower than 32 bits is a read-modify-write of
// its word, so two workers must never share one. Worker slices start on
// multiples of ius::kPartitionGrain (8) elements of an aligned region, so they
// start on 8-byte boundaries too.
constexpr unsigned kSubWordAlignment = 8;

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

// Reduces every tile's partials to the amax and turns it into the log2
// scaling bias. A vertex cannot raise, so a non-finite amax writes scale 0
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
