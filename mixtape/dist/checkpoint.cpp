// mixtape/dist/checkpoint.cpp -- dist::save_checkpoint (shards gathered, rank 0 writes) and
// dist::load_checkpoint (every process reads, ZeRO takes its shards), failing on all alike.
#include "mixtape/dist/checkpoint.h"

#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "mixtape/dist/exchange.h"
#include "mixtape/dist/zero.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/process_group.h"

namespace mixtape::dist {

void save_checkpoint(const std::string& path, const Module& module, const Optimizer* optimizer,
                     const Metadata& metadata, const GradScaler* scaler,
                     const CheckpointOptions& options) {
  std::unique_ptr<Optimizer> whole;
  std::string error;
  if (const auto* zero = dynamic_cast<const ZeroOptimizer*>(optimizer)) {
    try {  // every process gathers; one that fails tells the others below
      whole = zero->gathered();
      optimizer = whole.get();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (process_rank() == 0 && error.empty()) {
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
