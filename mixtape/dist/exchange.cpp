// mixtape/dist/exchange.cpp -- describe_entries, gather_text and fail_together: host messages
// between the processes of a run, outside the steps.
#include "mixtape/dist/exchange.h"

#include <cstdint>

#include "mixtape/dsl/error.h"

namespace mixtape::dist {

std::vector<std::string> describe_entries(const NamedTensors& state) {
  std::vector<std::string> lines;
  for (const auto& [name, t] : state)
    lines.push_back(fmt::format("{} {} {}", name, to_string(t.shape()), mixtape::name(t.dtype())));
  return lines;
}

std::vector<std::string> gather_text(ProcessGroup& group, const std::string& mine) {
  const int n = group.size();
  std::vector<int64_t> lengths(n), one(n, sizeof(int64_t)), at(n);
  for (int q = 0; q < n; ++q) at[q] = q * static_cast<int64_t>(sizeof(int64_t));
  const int64_t length = static_cast<int64_t>(mine.size());
  group.all_gather(reinterpret_cast<const std::byte*>(&length), sizeof(int64_t),
                   reinterpret_cast<std::byte*>(lengths.data()), one, at);
  std::vector<int64_t> offsets(n);
  int64_t total = 0;
  for (int q = 0; q < n; ++q) {
    offsets[q] = total;
    total += lengths[q];
  }
  std::string all(static_cast<size_t>(total), '\0');
  group.all_gather(reinterpret_cast<const std::byte*>(mine.data()), length,
                   reinterpret_cast<std::byte*>(all.data()), lengths, offsets);
  std::vector<std::string> texts;
  for (int q = 0; q < n; ++q) texts.push_back(all.substr(offsets[q], lengths[q]));
  return texts;
}

void fail_together(const std::string& error, const char* call) {
  ProcessGroup* group = process_group();
  if (!group || group->size() == 1) {
    if (!error.empty()) fail("{}", error);
    return;
  }
  const int processes = group->size();
  const uint8_t failed = error.empty() ? 0 : 1;
  std::vector<uint8_t> all(processes);
  std::vector<int64_t> counts(processes, 1), at(processes);
  for (int q = 0; q < processes; ++q) at[q] = q;
  group->all_gather(reinterpret_cast<const std::byte*>(&failed), 1,
                    reinterpret_cast<std::byte*>(all.data()), counts, at);
  int first = 0;
  while (first < processes && !all[first]) ++first;
  if (first == processes) return;
  std::string message = group->rank() == first ? error : std::string();
  int64_t length = static_cast<int64_t>(message.size());
  group->broadcast(reinterpret_cast<std::byte*>(&length), sizeof(length), first);
  message.resize(static_cast<size_t>(length));
  group->broadcast(reinterpret_cast<std::byte*>(message.data()), length, first);
  if (group->rank() == first) fail("{}", message);
  fail("{}: process {} failed: {}", call, first, message);
}

}  // namespace mixtape::dist
