// Poplar vertices for the grouped FP8 recipes: rowwise (a scale per row),
// block (per 1 x n tile of a row, or per n x n block) and MX (32-element
// tiles sharing an E8M0 exponent).
//
// A group's scale comes from the group's own amax, so the graph puts each
// group whole on one tile and the amax never leaves it: where the per-tensor
// graph (fp8_codelets.cpp) reduces every tile's partials in a tree, a group
// is the tile-local amax without the reduction. A group lies in the tile's
// memory as one or more segments (its row pieces: one for a row or a 1 x n
// tile, up to n for an n x n block), listed group after group; groupEnds[g]
// is one past group g's last segment. Workers take whole groups
// (splitRange over groups with a grain of 1): each reads its groups, writes
// their scales (32-bit, one per group) and the codes of their segments, each
// segment an 8-byte aligned output of its own, so no two workers share a word.
//
//   GroupCastToFp8<T, E, Saturate, Ocp>:  segments -> codes, log2Scales, nonFinite
//   GroupCastFromFp8<T, E, Ocp>:          codes, log2Scales -> decode(codes) * 2^-s
//
// E is 4 (F143) or 5 (F152); with Ocp the elements are OCP E4M3FN / E5M2,
// held as the IPU code of half the value (ius::ElementGrid). The rule field is
// ius::kRuleAmax (margin applies), kRuleMxFloor or kRuleMxUp. A non-finite
// amax gives s = 0 and sets the group's nonFinite flag: a vertex cannot raise.
// Compiled by popc into the same .gp as fp8_codelets.cpp, and by g++ against
// host_shim/ for the host library (fp8_block_host.cpp).
#include <poplar/HalfFloat.hpp>
#include <poplar/Vertex.hpp>

#include "fp8_arith.hpp"
#include "partition.hpp"

using namespace poplar;

template <typename T, unsigned ExponentBits, bool Saturate, bool Ocp>
class GroupCastToFp8 : public MultiVertex {
 public:
  Vector<Input<Vector<T>>> in;         // the tile's segments, group after group
  Input<Vector<unsigned>> groupEnds;   // per group: one past its last segment
  Vector<Output<Vector<unsigned char, VectorLayout::SPAN, ius::kSubWordAlignment>>> out;
  Output<Vector<int>> log2Scales;      // per group
  Output<Vector<int>> nonFinite;       // per group: 1 when its amax is inf or NaN
  int rule;
  int margin;

  bool compute(unsigned workerId) {
    const auto mine = ius::splitRange<unsigned>(unsigned(groupEnds.size()), numWorkers(),
                                                workerId, 1u);
    for (unsigned g = mine.begin; g < mine.end; ++g) {
      const unsigned first = g == 0 ? 0u : groupEnds[g - 1];
      const unsigned last = groupEnds[g];
      unsigned key = 0;
      for (unsigned s = first; s < last; ++s) {
        if (in[s].size() > 0) key = ius::maxKey(key, ius::amaxKeyOfSpan(&in[s][0], in[s].size()));
      }
      const ius::ScalingBias bias = ius::groupScalingBias(
          ius::floatFromKey(key), ius::ElementGrid<ExponentBits, Ocp>::maxValue, rule, margin);
      log2Scales[g] = bias.log2Scale;
      nonFinite[g] = bias.nonFinite ? 1 : 0;
      for (unsigned s = first; s < last; ++s) {
        if (in[s].size() > 0) {
          ius::castToGridSpan<ExponentBits, Saturate, Ocp>(&in[s][0], in[s].size(),
                                                           bias.log2Scale, &out[s][0]);
        }
      }
    }
    return true;
  }
};

template class GroupCastToFp8<float, 4, true, false>;
template class GroupCastToFp8<float, 4, false, false>;
template class GroupCastToFp8<float, 4, true, true>;
template class GroupCastToFp8<float, 5, true, false>;
template class GroupCastToFp8<float, 5, false, false>;
template class GroupCastToFp8<float, 5, true, true>;
template class GroupCastToFp8<half, 4, true, false>;
template class GroupCastToFp8<half, 4, false, false>;
template class GroupCastToFp8<half, 4, true, true>;
template class GroupCastToFp8<half, 5, true, false>;
template class GroupCastToFp8<half, 5, false, false>;
template class GroupCastToFp8<half, 5, true, true>;

template <typename T, unsigned ExponentBits, bool Ocp>
class GroupCastFromFp8 : public MultiVertex {
 public:
  Vector<Input<Vector<unsigned char>>> in;  // the codes' segments, group after group
  Input<Vector<unsigned>> groupEnds;
  Input<Vector<int>> log2Scales;
  Vector<Output<Vector<T, VectorLayout::SPAN, ius::kSubWordAlignment>>> out;

  bool compute(unsigned workerId) {
    const auto mine = ius::splitRange<unsigned>(unsigned(groupEnds.size()), numWorkers(),
                                                workerId, 1u);
    for (unsigned g = mine.begin; g < mine.end; ++g) {
      const unsigned first = g == 0 ? 0u : groupEnds[g - 1];
      for (unsigned s = first; s < groupEnds[g]; ++s) {
        if (in[s].size() > 0) {
          ius::castFromGridSpan<ExponentBits, Ocp>(&in[s][0], in[s].size(), log2Scales[g],
                                                   &out[s][0]);
        }
      }
    }
    return true;
  }
};

template class GroupCastFromFp8<float, 4, false>;
template class GroupCastFromFp8<float, 4, true>;
template class GroupCastFromFp8<float, 5, false>;
template class GroupCastFromFp8<float, 5, true>;
template class GroupCastFromFp8<half, 4, false>;
template class GroupCastFromFp8<half, 4, true>;
template class GroupCastFromFp8<half, 5, false>;
template class GroupCastFromFp8<half, 5, true>;
