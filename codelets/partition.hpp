// How a flat tensor is split across tiles, and a tile's slice across workers.
//
// One function, used at both levels: by the PopART custom op to map the input
// and the vertices to tiles, by the MultiVertex codelets to pick each worker's
// slice, and (through the host library) by the Python emulator. Keeping it in
// one header is what makes the emulator's split provably the graph's split.
#pragma once

namespace ius {

// Slices start on multiples of this many elements. On the IPU, workers must not
// share a 32-bit word of a uint8 output (sub-word writes are read-modify-write),
// and 8 elements keep float, half and uint8 slices 64-bit aligned.
constexpr unsigned kPartitionGrain = 8;

template <typename Index>
struct Range {
  Index begin;
  Index end;
};

// Part `part` of `parts` for `length` elements: whole grains are shared as
// evenly as possible (the first `grains % parts` parts get one more), so parts
// differ by at most one grain, the last non-empty part may end mid-grain, and
// parts beyond the number of grains are empty.
template <typename Index>
inline Range<Index> splitRange(Index length, unsigned parts, unsigned part) {
  const Index grain = kPartitionGrain;
  const Index grains = (length + grain - 1) / grain;
  const Index base = grains / parts;
  const Index extra = grains % parts;
  const Index p = part;
  const Index firstGrain = p * base + (p < extra ? p : extra);
  const Index lastGrain = firstGrain + base + (p < extra ? 1 : 0);
  const Index begin = firstGrain * grain;
  const Index end = lastGrain * grain;
  return Range<Index>{begin < length ? begin : length, end < length ? end : length};
}

}  // namespace ius
