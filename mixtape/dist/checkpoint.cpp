// mixtape/dist/checkpoint.cpp -- dist::save_checkpoint (shards gathered, rank 0 writes) and
// dist::load_checkpoint (every process reads, ZeRO takes its shards), failing on all alike.
#include "mixtape/dist/checkpoint.h"

#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "mixtape/dist/zero.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/process_group.h"

namespace mixtape::dist {
namespace {

// Every process says whether it failed (`error` not empty); the first that did sends its message
// and every process throws it, so that none goes on to a collective the others never join.
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

}  // namespace

void save_checkpoint(const std::string& path, const Module& module, const Optimizer* optimizer,
                     const Metadata& metadata, const GradScaler* scaler,
                     const CheckpointOptions& options) {
  std::unique_ptr<Optimizer> whole;
  if (const auto* zero = dynamic_cast<const ZeroOptimizer*>(optimizer)) {
    whole = zero->gathered();
    optimizer = whole.get();
  }
  std::string error;
  if (process_rank() == 0) {
    try {
      mixtape::save_checkpoint(path, module, optimizer, metadata, scaler, options);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  fail_together(error, "dist::save_checkpoint");
}

void load_checkpoint(const std::string& path, Module& module, Optimizer* optimizer,
                     Metadata* metadata, GradScaler* scaler, const CheckpointOptions& options) {
  auto* zero = dynamic_cast<ZeroOptimizer*>(optimizer);
  std::unique_ptr<Optimizer> whole;
  std::string error;
  try {
    // A ZeRO optimizer's state is loaded whole into a plain one first (mt::load_checkpoint
    // checks it all), and sharded only once every process has read the file.
    if (zero) whole = zero->plain();
    mixtape::load_checkpoint(path, module, zero ? whole.get() : optimizer, metadata, scaler,
                             options);
  } catch (const std::exception& e) {
    error = e.what();
  }
  fail_together(error, "dist::load_checkpoint");
  if (zero) zero->take_shards(*whole);
}

}  // namespace mixtape::dist
