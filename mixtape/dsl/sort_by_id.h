// mixtape/dsl/sort_by_id.h -- sort_by_id: (node id, item) pairs in creation order, for the graph
// walkers (backward's tape, the pending nodes of an evaluation).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace mixtape {

/// Sorts (id, item) pairs by id, ascending. The nodes a step makes have nearly consecutive ids
/// (they are made one after another, two apart: dsl/graph.cpp), so where the ids span little
/// more than twice their count they are placed by id in one pass, with no comparisons: the
/// traced loop sorts its pending nodes and its tape every step.
template <typename T>
void sort_by_id(std::vector<std::pair<uint64_t, T>>& items) {
  auto by_id = [](const auto& a, const auto& b) { return a.first < b.first; };
  size_t n = items.size();
  if (n < 32) return std::sort(items.begin(), items.end(), by_id);
  auto [lo, hi] = std::minmax_element(items.begin(), items.end(), by_id);
  uint64_t first = lo->first, range = hi->first - lo->first + 1;
  if (range > 8 * n || n > UINT32_MAX - 1) return std::sort(items.begin(), items.end(), by_id);
  thread_local std::vector<uint32_t> slots;  // 1 + the item's index, by id - first
  slots.assign(range, 0);
  for (size_t i = 0; i < n; ++i) {
    uint32_t& slot = slots[items[i].first - first];
    if (slot != 0) return std::sort(items.begin(), items.end(), by_id);  // a repeated id
    slot = static_cast<uint32_t>(i + 1);
  }
  thread_local std::vector<std::pair<uint64_t, T>> sorted;
  sorted.clear();
  sorted.reserve(n);
  for (uint32_t slot : slots)
    if (slot != 0) sorted.push_back(items[slot - 1]);
  items.swap(sorted);
}

}  // namespace mixtape
