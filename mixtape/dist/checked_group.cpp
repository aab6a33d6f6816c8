// mixtape/dist/checked_group.cpp -- checked_process_group: each collective's description
// gathered from every process and compared before the collective runs.
#include "mixtape/dist/checked_group.h"

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/exception.h"
#include "mixtape/dsl/node.h"

namespace mixtape::dist {
namespace {

enum class Kind : int64_t { all_to_all = 1, all_gather = 2, broadcast = 3 };

// One process's call, as the others see it: a fixed header and two per-process count lists
// (all_to_all: what it sends to and receives from each process; all_gather: what it expects
// from each), so that every process can check every pair and all reach the same verdict.
struct Call {
  Kind kind{};
  int64_t bytes = 0;  // sent (all_gather) or broadcast
  int64_t root = -1;  // broadcast
  std::vector<int64_t> sends, receives;
  std::string node;  // the graph node it is made for (collective_node()), or empty
};

// What travels of a call's node: its op and where it was built, cut to a fixed size.
constexpr size_t kNodeWords = 16;

std::string node_text(const Node* node) {
  if (!node) return "";
  std::string text =
      fmt::format("{} built at {}", op_name(node->op), short_location(node->origin.location));
  if (!node->origin.module_path.empty()) text += " in module '" + node->origin.module_path + "'";
  return text.substr(0, kNodeWords * sizeof(int64_t));
}

std::string describe(const Call& c) {
  std::string what;
  switch (c.kind) {
    case Kind::all_to_all: {
      int64_t sent = 0, received = 0;
      for (int64_t b : c.sends) sent += b;
      for (int64_t b : c.receives) received += b;
      what = fmt::format("all_to_all sending {} bytes and receiving {}", sent, received);
      break;
    }
    case Kind::all_gather:
      what = fmt::format("all_gather of {} bytes", c.bytes);
      break;
    case Kind::broadcast:
      what = fmt::format("broadcast of {} bytes from process {}", c.bytes, c.root);
      break;
    default:
      what = fmt::format("an unknown collective ({})", static_cast<int64_t>(c.kind));
  }
  return c.node.empty() ? what : fmt::format("{} (for {})", what, c.node);
}

class CheckedGroup : public ProcessGroup {
 public:
  explicit CheckedGroup(std::shared_ptr<ProcessGroup> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }

  void all_to_all(const std::byte* send, std::span<const int64_t> send_count,
                  std::span<const int64_t> send_at, std::byte* recv,
                  std::span<const int64_t> recv_count, std::span<const int64_t> recv_at) override {
    check({Kind::all_to_all,
           0,
           -1,
           {send_count.begin(), send_count.end()},
           {recv_count.begin(), recv_count.end()},
           {}});
    inner_->all_to_all(send, send_count, send_at, recv, recv_count, recv_at);
  }
  void all_gather(const std::byte* send, int64_t count, std::byte* recv,
                  std::span<const int64_t> counts, std::span<const int64_t> at) override {
    check({Kind::all_gather, count, -1, {}, {counts.begin(), counts.end()}, {}});
    inner_->all_gather(send, count, recv, counts, at);
  }
  void broadcast(std::byte* data, int64_t count, int root) override {
    check({Kind::broadcast, count, root, {}, {}, {}});
    inner_->broadcast(data, count, root);
  }

 private:
  // Every process's call, gathered, then the same checks on every process. The processes count
  // their collectives alike (one gather each), so the number only names the call.
  void check(Call call) {
    const int64_t number = made_++;
    const auto n = static_cast<size_t>(size());
    call.sends.resize(n, 0);
    call.receives.resize(n, 0);
    call.node = node_text(collective_node());
    std::vector<int64_t> mine{static_cast<int64_t>(call.kind), call.bytes, call.root};
    mine.insert(mine.end(), call.sends.begin(), call.sends.end());
    mine.insert(mine.end(), call.receives.begin(), call.receives.end());
    mine.resize(mine.size() + kNodeWords, 0);
    std::memcpy(mine.data() + 3 + 2 * n, call.node.data(), call.node.size());
    const size_t words = mine.size();  // 3 + 2n + kNodeWords
    const auto record = static_cast<int64_t>(words * sizeof(int64_t));
    std::vector<int64_t> all(words * n), counts(n, record), at(n);
    for (size_t q = 0; q < n; ++q) at[q] = static_cast<int64_t>(q) * record;
    inner_->all_gather(reinterpret_cast<const std::byte*>(mine.data()), record,
                       reinterpret_cast<std::byte*>(all.data()), counts, at);
    std::vector<Call> calls(n);
    for (size_t q = 0; q < n; ++q) {
      const int64_t* w = all.data() + q * words;
      const char* text = reinterpret_cast<const char*>(w + 3 + 2 * n);
      calls[q] = {static_cast<Kind>(w[0]),
                  w[1],
                  w[2],
                  {w + 3, w + 3 + n},
                  {w + 3 + n, w + 3 + 2 * n},
                  std::string(text, strnlen(text, kNodeWords * sizeof(int64_t)))};
    }
    auto differ = [&](size_t q, size_t s, const std::string& why) {
      fail(
          "dist: collective {} differs between the processes (MIXTAPE_DIST_DEBUG): process {} "
          "calls {}, process {} calls {}{}; every process must make the same collectives in the "
          "same order (was a node that makes one built on some processes only?)",
          number, q, describe(calls[q]), s, describe(calls[s]), why);
    };
    for (size_t q = 1; q < n; ++q)
      if (calls[q].kind != calls[0].kind || calls[q].node != calls[0].node) differ(0, q, "");
    for (size_t q = 0; q < n; ++q)
      for (size_t s = 0; s < n; ++s) {
        const Call &from = calls[q], &to = calls[s];
        switch (from.kind) {
          case Kind::broadcast:
            if (from.bytes != to.bytes || from.root != to.root) differ(q, s, "");
            break;
          case Kind::all_gather:
            if (to.receives[q] != from.bytes)
              differ(q, s,
                     fmt::format(", which expects {} bytes from process {}", to.receives[q], q));
            break;
          case Kind::all_to_all:
            if (from.sends[s] != to.receives[q])
              differ(q, s,
                     fmt::format(": process {} sends {} bytes to process {}, which expects {}", q,
                                 from.sends[s], s, to.receives[q]));
            break;
          default:
            differ(q, s, "");
        }
      }
  }

  std::shared_ptr<ProcessGroup> inner_;
  std::atomic<int64_t> made_{0};
};

}  // namespace

std::shared_ptr<ProcessGroup> checked_process_group(std::shared_ptr<ProcessGroup> inner) {
  if (!inner) fail("dist::checked_process_group: no process group to check");
  return std::make_shared<CheckedGroup>(std::move(inner));
}

}  // namespace mixtape::dist
