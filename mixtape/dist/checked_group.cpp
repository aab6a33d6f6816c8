// mixtape/dist/checked_group.cpp -- checked_process_group: each collective's description
// gathered from every process and compared before the collective runs.
#include "mixtape/dist/checked_group.h"

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "mixtape/dsl/error.h"

namespace mixtape::dist {
namespace {

enum class Kind : int64_t { all_to_all = 1, all_gather = 2, broadcast = 3 };

// One process's call, as the others see it: a fixed header and two per-process count lists
// (all_to_all: what it sends to and receives from each process; all_gather: what it expects
// from each), so that every process can check every pair and all reach the same verdict.
struct Call {
  Kind kind{};
  int64_t number = 0;  // collectives made through this group before it
  int64_t bytes = 0;   // sent (all_gather) or broadcast
  int64_t root = -1;   // broadcast
  std::vector<int64_t> sends, receives;
};

std::string describe(const Call& c) {
  switch (c.kind) {
    case Kind::all_to_all: {
      int64_t sent = 0, received = 0;
      for (int64_t b : c.sends) sent += b;
      for (int64_t b : c.receives) received += b;
      return fmt::format("all_to_all sending {} bytes and receiving {}", sent, received);
    }
    case Kind::all_gather:
      return fmt::format("all_gather of {} bytes", c.bytes);
    case Kind::broadcast:
      return fmt::format("broadcast of {} bytes from process {}", c.bytes, c.root);
  }
  return fmt::format("an unknown collective ({})", static_cast<int64_t>(c.kind));
}

class CheckedGroup : public ProcessGroup {
 public:
  explicit CheckedGroup(std::shared_ptr<ProcessGroup> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }

  void all_to_all(const std::byte* send, std::span<const int64_t> send_count,
                  std::span<const int64_t> send_at, std::byte* recv,
                  std::span<const int64_t> recv_count, std::span<const int64_t> recv_at) override {
    Call call{Kind::all_to_all,
              0,
              0,
              -1,
              {send_count.begin(), send_count.end()},
              {recv_count.begin(), recv_count.end()}};
    check(call);
    inner_->all_to_all(send, send_count, send_at, recv, recv_count, recv_at);
  }
  void all_gather(const std::byte* send, int64_t count, std::byte* recv,
                  std::span<const int64_t> counts, std::span<const int64_t> at) override {
    Call call{Kind::all_gather, 0, count, -1, {}, {counts.begin(), counts.end()}};
    check(call);
    inner_->all_gather(send, count, recv, counts, at);
  }
  void broadcast(std::byte* data, int64_t count, int root) override {
    check(Call{Kind::broadcast, 0, count, root, {}, {}});
    inner_->broadcast(data, count, root);
  }

 private:
  // Every process's call, gathered, then the same checks on every process.
  void check(Call call) {
    const int n = size();
    call.number = made_++;
    call.sends.resize(static_cast<size_t>(n), 0);
    call.receives.resize(static_cast<size_t>(n), 0);
    const size_t words = 4 + 2 * static_cast<size_t>(n);
    std::vector<int64_t> mine{static_cast<int64_t>(call.kind), call.number, call.bytes, call.root};
    mine.insert(mine.end(), call.sends.begin(), call.sends.end());
    mine.insert(mine.end(), call.receives.begin(), call.receives.end());
    std::vector<int64_t> all(words * static_cast<size_t>(n));
    const auto record = static_cast<int64_t>(words * sizeof(int64_t));
    std::vector<int64_t> counts(static_cast<size_t>(n), record), at(static_cast<size_t>(n));
    for (int q = 0; q < n; ++q) at[static_cast<size_t>(q)] = q * record;
    inner_->all_gather(reinterpret_cast<const std::byte*>(mine.data()), record,
                       reinterpret_cast<std::byte*>(all.data()), counts, at);
    std::vector<Call> calls(static_cast<size_t>(n));
    for (int q = 0; q < n; ++q) {
      const int64_t* w = all.data() + static_cast<size_t>(q) * words;
      Call& c = calls[static_cast<size_t>(q)];
      c.kind = static_cast<Kind>(w[0]), c.number = w[1], c.bytes = w[2], c.root = w[3];
      c.sends.assign(w + 4, w + 4 + n);
      c.receives.assign(w + 4 + n, w + 4 + 2 * n);
    }
    auto differ = [&](int q, int s, const std::string& why) {
      fail(
          "dist: collective {} differs between the processes (MIXTAPE_DIST_DEBUG): process {} "
          "calls {}, process {} calls {}{}; every process must make the same collectives in the "
          "same order (was a node that makes one built on some processes only?)",
          calls[0].number, q, describe(calls[static_cast<size_t>(q)]), s,
          describe(calls[static_cast<size_t>(s)]), why);
    };
    for (int q = 1; q < n; ++q)
      if (calls[static_cast<size_t>(q)].kind != calls[0].kind ||
          calls[static_cast<size_t>(q)].number != calls[0].number)
        differ(0, q,
               calls[static_cast<size_t>(q)].number != calls[0].number
                   ? fmt::format(" (its collective {})", calls[static_cast<size_t>(q)].number)
                   : "");
    for (int q = 0; q < n; ++q)
      for (int s = 0; s < n; ++s) {
        const Call &from = calls[static_cast<size_t>(q)], &to = calls[static_cast<size_t>(s)];
        switch (from.kind) {
          case Kind::broadcast:
            if (from.bytes != to.bytes || from.root != to.root) differ(q, s, "");
            break;
          case Kind::all_gather:
            if (to.receives[static_cast<size_t>(q)] != from.bytes)
              differ(q, s,
                     fmt::format(", which expects {} bytes from process {}",
                                 to.receives[static_cast<size_t>(q)], q));
            break;
          case Kind::all_to_all:
            if (from.sends[static_cast<size_t>(s)] != to.receives[static_cast<size_t>(q)])
              differ(q, s,
                     fmt::format(": process {} sends {} bytes to process {}, which expects {}", q,
                                 from.sends[static_cast<size_t>(s)], s,
                                 to.receives[static_cast<size_t>(q)]));
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
