// bench/gpt_step.h -- the GPT training step both training benchmarks time: forward under the
// policy, backward, gradient norm clipped at 1, one optimizer step; returns the loss.
#pragma once

#include <mixtape/mixtape.h>

#include <memory>

namespace bench {

/// `State` holds `model` (a CharGpt) and `optimizer`, both behind pointers.
template <typename State>
auto gpt_train_step(std::shared_ptr<State> state, mixtape::PolicyPtr policy) {
  return [state, policy](const mixtape::Tensor& inputs, const mixtape::Tensor& targets) {
    state->optimizer->zero_grad();
    mixtape::Tensor loss;
    {
      mixtape::autocast guard(policy);
      loss = state->model->loss(inputs, targets);
    }
    loss.backward();
    mixtape::clip_grad_norm(state->model->parameters(), 1.0);
    state->optimizer->step();
    return loss;
  };
}

}  // namespace bench
