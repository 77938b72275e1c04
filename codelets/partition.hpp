// How a flat tensor is split across tiles, and a tile's data across workers.
//
// Used at both levels: by the PopART custom op's graph construction, by the
// MultiVertex codelets to pick each worker's share, and (through the host
// library) by the Python emulator and graph model. Keeping it in one header is
// what makes the emulator's split provably the graph's split.
#pragma once

namespace ius {

// Slices start on multiples of this many elements. On the IPU, workers must not
// share a 32-bit word of a uint8 output (sub-word writes are read-modify-write),
// and 8 elements keep float, half and uint8 slices 64-bit aligned.
constexpr unsigned kPartitionGrain = 8;

// Sub-word outputs (uint8 codes, half values) are 64-bit aligned, as poplibs
// does for its casts: a store narrower than 32 bits is a read-modify-write of
// its word, so two workers must never share one.
constexpr unsigned kSubWordAlignment = 8;

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
inline Range<Index> splitRange(Index length, unsigned parts, unsigned part,
                               Index grain = kPartitionGrain) {
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

template <typename Index>
inline Index grainsOf(Index length) {
  return (length + kPartitionGrain - 1) / kPartitionGrain;
}

// A tile's share for worker `part` of `parts` when the tile holds `regions`
// separate regions of sizeOf(r) elements (a tensor laid out by another op can
// leave several on a tile). Each region is cut into grains from its own start,
// and the tile's grains, region after region, are dealt out as splitRange deals
// elements: workers differ by at most one grain and every piece starts on a
// grain boundary of its region, so no two workers share a word of an aligned
// region. Calls visit(r, begin, end) for each piece, in region order. With one
// region this is splitRange(size, parts, part).
template <typename Index, typename SizeOf, typename Visit>
inline void forEachPiece(unsigned regions, SizeOf sizeOf, unsigned parts, unsigned part,
                         Visit visit) {
  Index total = 0;
  for (unsigned r = 0; r < regions; ++r) total += grainsOf<Index>(sizeOf(r));
  const Range<Index> mine = splitRange<Index>(total, parts, part, 1);
  Index first = 0;  // the tile-wide index of region r's first grain
  for (unsigned r = 0; r < regions && first < mine.end; ++r) {
    const Index length = sizeOf(r);
    const Index grains = grainsOf<Index>(length);
    const Index from = mine.begin > first ? mine.begin : first;
    const Index to = mine.end < first + grains ? mine.end : first + grains;
    if (to > from) {
      const Index begin = (from - first) * kPartitionGrain;
      const Index end = (to - first) * kPartitionGrain;
      visit(r, begin, end < length ? end : length);
    }
    first += grains;
  }
}

}  // namespace ius
