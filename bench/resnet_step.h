// bench/resnet_step.h -- the ResNet training step both training benchmarks time (bench_training's
// resnet18, bench_gpu_training's resnet50): one synthetic batch, cross-entropy, SGD.
#pragma once

#include <mixtape/mixtape.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "bench/timing.h"
#include "examples/resnet_model.h"

namespace bench {

/// `base` ("resnet18"), or `base` followed by any of _b<batch>, _s<image size> (once each, in
/// that order; images of 32 pixels or more): the workload's batch and image size, else the
/// defaults given.
inline bool parse_resnet_name(const std::string& name, const std::string& base,
                              int64_t default_batch, int64_t default_size, int64_t& batch,
                              int64_t& size) {
  batch = default_batch, size = default_size;
  if (name.rfind(base, 0) != 0) return false;
  const std::string rest = name.substr(base.size());
  long long value = 0;
  int consumed = 0;
  size_t at = 0;
  if (std::sscanf(rest.c_str(), "_b%lld%n", &value, &consumed) == 1 && value > 0)
    batch = value, at += static_cast<size_t>(consumed);
  consumed = 0;
  if (std::sscanf(rest.c_str() + at, "_s%lld%n", &value, &consumed) == 1 && value >= 32)
    size = value, at += static_cast<size_t>(consumed);
  return at == rest.size();
}

/// `Net` (examples/resnet_model.h, torchvision's layout) with `classes` outputs on one synthetic
/// batch made once: inputs N(0, 1) [batch, 3, size, size] and uniform labels; cross-entropy, SGD
/// lr 0.01 momentum 0.9. Batch norm in training mode: its running statistics are updated in the
/// step, as in the peers.
template <typename Net>
Workload resnet_workload(int64_t batch, int64_t classes, int64_t size,
                         const mixtape::PolicyPtr& policy, StepMode mode) {
  namespace mt = mixtape;
  struct State {
    mt::Generator gen{kSeed};
    std::unique_ptr<Net> model;
    std::unique_ptr<mt::SGD> optimizer;
    mt::Tensor inputs, targets;
  };
  auto state = std::make_shared<State>();
  state->model = std::make_unique<Net>(classes, &state->gen);
  state->optimizer = std::make_unique<mt::SGD>(state->model->parameters(),
                                               mt::SGDOptions{.lr = 0.01, .momentum = 0.9});
  std::mt19937_64 rng(kSeed);
  state->inputs = random_normal({batch, 3, size, size}, rng);
  std::uniform_int_distribution<int64_t> label(0, classes - 1);
  std::vector<int64_t> labels(static_cast<size_t>(batch));
  for (int64_t& l : labels) l = label(rng);
  state->targets = mt::tensor(labels, {batch});
  auto train = autocast_train_step(
      state, policy, [](auto& s, const mt::Tensor& inputs, const mt::Tensor& targets) {
        return mt::cross_entropy((*s.model)(inputs), targets);
      });
  auto next_batch = [state] { return std::pair(state->inputs, state->targets); };
  return make_workload(train, next_batch, mode,
                       {{"batch", batch},
                        {"image", mt::json::Value::array({3, size, size})},
                        {"classes", classes},
                        {"optimizer", "sgd"},
                        {"images_per_step", batch},
                        {"parameters", parameter_count(*state->model)}});
}

}  // namespace bench
