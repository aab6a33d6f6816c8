// mixtape/dsl/reusable_buffers.cpp -- the thread's innermost list of values whose buffers an
// evaluation may compute into.
#include "mixtape/dsl/reusable_buffers.h"

#include <algorithm>

namespace mixtape {
namespace {
thread_local const ReusableBuffers* innermost = nullptr;
}  // namespace

ReusableBuffers::ReusableBuffers(std::vector<std::pair<const Node*, long>> nodes)
    : nodes_(std::move(nodes)), outer_(innermost) {
  std::sort(nodes_.begin(), nodes_.end());
  innermost = this;
}

ReusableBuffers::~ReusableBuffers() { innermost = outer_; }

long reusable_holders(const Node* node) {
  if (!innermost) return -1;
  const auto& nodes = innermost->nodes_;
  auto found = std::lower_bound(nodes.begin(), nodes.end(), std::pair<const Node*, long>(node, -1));
  return found != nodes.end() && found->first == node ? found->second : -1;
}

}  // namespace mixtape
