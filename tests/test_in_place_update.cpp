// tests/test_in_place_update.cpp -- optimizer steps that compute the new parameters and state
// into the old ones' buffers (dsl/reusable_buffers.h): the same bits as fresh buffers, old values
// kept wherever something still holds them, and a clear error for a graph kept across the step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mixtape/dsl/host_memory.h"
#include "mixtape/mixtape.h"
#include "mixtape/runtime/program.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

// Shapes of a small conv net's and an MLP's parameters, and a scalar.
const std::vector<mt::Shape> kShapes = {{16, 8, 3, 3}, {16}, {10, 64}, {10}, {}};

// Parameters and a gradient per step made from one seed, so two sets are equal.
struct Problem {
  std::vector<mt::Tensor> params;
  std::vector<std::vector<mt::Tensor>> grads;  // [step][param]
  explicit Problem(int steps) {
    mt::Generator gen(7);
    for (const mt::Shape& shape : kShapes) {
      params.push_back(mt::randn(shape, mt::f32, &gen).detach());
      mt::eval({params.back()});
      params.back() = mt::tensor(params.back().to_vector<float>(), shape);
      params.back().requires_grad_();
    }
    for (int s = 0; s < steps; ++s) {
      grads.emplace_back();
      for (const mt::Shape& shape : kShapes)
        grads.back().push_back(mt::randn(shape, mt::f32, &gen));
      mt::eval(grads.back());
    }
  }
};

using MakeOptimizer = std::function<std::unique_ptr<mt::Optimizer>(std::vector<mt::Tensor>)>;

const std::vector<std::pair<std::string, MakeOptimizer>>& optimizers() {
  static const std::vector<std::pair<std::string, MakeOptimizer>> list = {
      {"SGD momentum",
       [](std::vector<mt::Tensor> p) {
         return std::make_unique<mt::SGD>(std::move(p),
                                          mt::SGDOptions{.lr = 0.05, .momentum = 0.9});
       }},
      {"AdamW",
       [](std::vector<mt::Tensor> p) {
         return std::make_unique<mt::AdamW>(std::move(p),
                                            mt::AdamOptions{.lr = 1e-2, .weight_decay = 0.1});
       }},
  };
  return list;
}

}  // namespace

// One set steps freely; the other's parameters and state are held by tensors taken before each
// step (of the parameter's node, and the state(i) tensors), which keeps the step out of their
// buffers. Both give the same bits, the held tensors keep the old values, and the free set's
// parameters stay in the buffers the set had.
TEST(InPlaceUpdate, TheSameBitsAsFreshBuffersAndHeldValuesKeepTheirs) {
  constexpr int kSteps = 4;
  for (const auto& [name, make] : optimizers()) {
    SCOPED_TRACE(name);
    Problem free_set(kSteps), held_set(kSteps);
    std::unique_ptr<mt::Optimizer> free_opt = make(free_set.params);
    std::unique_ptr<mt::Optimizer> held_opt = make(held_set.params);
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < kShapes.size(); ++i) {
        free_set.params[i].set_grad(free_set.grads[step][i]);
        held_set.params[i].set_grad(held_set.grads[step][i]);
      }
      std::vector<const mt::Storage*> before;  // every buffer the free set held
      for (size_t i = 0; i < kShapes.size(); ++i) {
        before.push_back(free_set.params[i].node()->value.get());
        for (const auto& [entry, value] : free_opt->state(i))
          before.push_back(value.node()->value.get());
      }
      mt::reset_execution_stats();
      free_opt->step();
      // Every parameter and every state entry, but SGD's momentum buffer on the first step, which
      // copies the gradient (torch's clone); AdamW's moments start as zeros it writes over.
      const bool adam = name == "AdamW";
      const int64_t per_param = adam ? 3 : (step == 0 ? 1 : 2);
      EXPECT_EQ(mt::execution_stats().outputs_in_place,
                per_param * static_cast<int64_t>(kShapes.size()));
      // From the second step no new buffer: each parameter is in one the set held before.
      for (size_t i = 0; i < kShapes.size() && step > 0; ++i)
        EXPECT_NE(std::find(before.begin(), before.end(), free_set.params[i].node()->value.get()),
                  before.end())
            << "parameter " << i;

      std::vector<mt::Tensor> old_params;
      std::vector<mt::NamedTensors> old_state;
      std::vector<std::vector<uint32_t>> old_bits, old_state_bits;
      for (size_t i = 0; i < kShapes.size(); ++i) {
        old_params.emplace_back(held_set.params[i].node());
        old_bits.push_back(f32_bits(old_params.back()));
        old_state.push_back(held_opt->state(i));
        for (const auto& [entry, value] : old_state.back())
          old_state_bits.push_back(f32_bits(value));
      }
      mt::reset_execution_stats();
      held_opt->step();
      // Nothing held is written; on the first step AdamW's moments are zeros no one holds yet.
      EXPECT_EQ(mt::execution_stats().outputs_in_place,
                step == 0 && adam ? 2 * static_cast<int64_t>(kShapes.size()) : 0);
      for (size_t i = 0; i < kShapes.size(); ++i) {
        EXPECT_EQ(f32_bits(old_params[i]), old_bits[i]) << "held parameter " << i;
        EXPECT_EQ(f32_bits(free_set.params[i]), f32_bits(held_set.params[i])) << "parameter " << i;
        mt::NamedTensors free_state = free_opt->state(i), held_state = held_opt->state(i);
        ASSERT_EQ(free_state.size(), held_state.size());
        for (size_t s = 0; s < free_state.size(); ++s)
          EXPECT_EQ(f32_bits(free_state[s].second), f32_bits(held_state[s].second))
              << "state " << free_state[s].first << " of parameter " << i;
      }
      // The state handed out before the step still reads as it was: the step left its buffers.
      size_t entry_index = 0;
      for (size_t i = 0; i < kShapes.size(); ++i)
        for (const auto& [entry, value] : old_state[i])
          EXPECT_EQ(f32_bits(value), old_state_bits[entry_index++])
              << "held state " << entry << " of parameter " << i;
    }
  }
}

// A graph kept across the step that reads an old parameter after it (a second gradient of one
// loss, mt::grad with the graph kept): a clear error naming the in-place update, where computing
// with the new value would be wrong. PyTorch refuses the same ("modified by an inplace
// operation"). A tensor of the old value held across the step keeps the step out of its buffer.
TEST(InPlaceUpdate, AGraphKeptAcrossTheStepIsAClearError) {
  for (bool hold : {false, true}) {
    SCOPED_TRACE(hold ? "old value held" : "nothing held");
    mt::Tensor w = mt::tensor(std::vector<float>(64, 1.f), {8, 8});
    w.requires_grad_();
    mt::Tensor x = mt::tensor(std::vector<float>(40, 0.5f), {5, 8});
    x.requires_grad_();
    mt::SGD opt({w}, mt::SGDOptions{.lr = 0.05});
    mt::Tensor loss = mt::sum(mt::square(mt::matmul(x, w)));
    w.set_grad(mt::grad({loss}, {w})[0]);
    mt::Tensor old = hold ? w.detach() : mt::Tensor();
    mt::reset_execution_stats();
    opt.step();
    EXPECT_EQ(mt::execution_stats().outputs_in_place, hold ? 0 : 1);
    if (hold) {
      // d/dx sum((x w)^2) = 2 (x w) w^T with the old w (all ones): 2 * 4 * 8 = 64.
      EXPECT_EQ(mt::grad({loss}, {x})[0].to_vector<float>(), std::vector<float>(40, 64.f));
      EXPECT_EQ(old.to_vector<float>(), std::vector<float>(64, 1.f));
    } else {
      EXPECT_MT_ERROR((void)mt::grad({loss}, {x})[0].to_vector<float>(), "matmul reads",
                      "updated in place", "x.detach()");
    }
    EXPECT_NO_THROW((void)w.to_vector<float>());  // the parameter reads as the step left it
  }
}

// The update no longer holds a second copy of the parameters and state while it runs: an AdamW
// step over 4 MiB of parameters raises the host allocator's peak by less than one copy of them
// (fresh buffers took another 12 MiB: parameters and both moments).
TEST(InPlaceUpdate, TheUpdateAllocatesNoSecondCopy) {
  mt::Tensor w = mt::tensor(std::vector<float>(1 << 20, 0.f), {1024, 1024});
  w.requires_grad_();
  mt::AdamW opt({w}, mt::AdamOptions{.lr = 1e-3});
  mt::Tensor g = mt::ones({1024, 1024});
  mt::eval({g});
  for (int step = 0; step < 3; ++step) {
    w.set_grad(g);
    mt::reset_host_memory_peak();
    const int64_t live = mt::host_memory_stats().live_bytes;
    opt.step();
    if (step == 0) continue;  // the first step makes the state
    EXPECT_LT(mt::host_memory_stats().peak_bytes - live, int64_t{4} << 20) << "step " << step;
  }
}

// mt::compile's replays compute the update straight into the state buffers they would swap the
// new values into, with the traced loop's bits.
TEST(InPlaceUpdate, CompiledStepsUpdateTheirStateInPlace) {
  for (const auto& [name, make] : optimizers()) {
    SCOPED_TRACE(name);
    mt::manual_seed(5);
    mt::MLP traced_net({8, 32, 32, 4}, mt::Activation::Relu);
    mt::manual_seed(5);
    mt::MLP compiled_net({8, 32, 32, 4}, mt::Activation::Relu);
    std::unique_ptr<mt::Optimizer> traced_opt = make(traced_net.parameters());
    std::unique_ptr<mt::Optimizer> compiled_opt = make(compiled_net.parameters());
    mt::Tensor x = mt::randn({16, 8}), y = mt::randn({16, 4});
    auto train = [](mt::MLP& net, mt::Optimizer& opt, const mt::Tensor& x, const mt::Tensor& y) {
      opt.zero_grad();
      mt::Tensor loss = mt::mse_loss(net(x), y);
      loss.backward();
      opt.step();
      return loss;
    };
    auto compiled_step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
      return train(compiled_net, *compiled_opt, x, y);
    });
    for (int step = 0; step < 6; ++step) {
      const float traced_loss = static_cast<float>(train(traced_net, *traced_opt, x, y).item());
      mt::reset_execution_stats();
      const float compiled_loss = static_cast<float>(compiled_step(x, y).item());
      if (step >= 3) {
        EXPECT_GT(mt::execution_stats().outputs_in_place, 0) << "step " << step;
      }
      EXPECT_EQ(compiled_loss, traced_loss) << "step " << step;
      std::vector<mt::Tensor> a = traced_net.parameters(), b = compiled_net.parameters();
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_EQ(f32_bits(b[i]), f32_bits(a[i])) << "parameter " << i << " after step " << step;
    }
    EXPECT_GE(compiled_step.stats().replays, 3);
  }
}

// Optimizers whose state starts at zero (torch's Adam, AdamW, RMSprop, Lion make it so on the
// first step) start it as stored zeros, so the first step's update is the program of every later
// step: the second step builds nothing (no kernel is compiled for the first step alone), and the
// first step writes its state into those zeros in place, as later steps write theirs. The bits are
// those of the same update on zeros made by hand (bits of a zero start: 0 * beta + x is x, -0
// becomes +0).
TEST(InPlaceUpdate, ZeroStartedStateMakesTheFirstStepTheProgramOfEveryStep) {
  const std::vector<std::pair<std::string, MakeOptimizer>> kinds = {
      {"Adam",
       [](std::vector<mt::Tensor> p) {
         return std::make_unique<mt::Adam>(std::move(p), mt::AdamOptions{.lr = 1e-2});
       }},
      {"AdamW", optimizers()[1].second},
      {"RMSprop centered momentum",
       [](std::vector<mt::Tensor> p) {
         return std::make_unique<mt::RMSprop>(
             std::move(p), mt::RMSpropOptions{.momentum = 0.9, .centered = true});
       }},
      {"Lion", [](std::vector<mt::Tensor> p) { return std::make_unique<mt::Lion>(std::move(p)); }},
  };
  const bool programs = mt::current_device() != mt::Device::reference;
  for (const auto& [name, make] : kinds) {
    SCOPED_TRACE(name);
    Problem run(3), by_hand(3);
    std::unique_ptr<mt::Optimizer> opt = make(run.params);
    std::vector<int64_t> in_place;
    for (int step = 0; step < 3; ++step) {
      for (size_t i = 0; i < kShapes.size(); ++i) run.params[i].set_grad(run.grads[step][i]);
      mt::reset_execution_stats();
      opt->step();
      const mt::ExecutionStats stats = mt::execution_stats();
      if (programs && step > 0) {
        EXPECT_EQ(stats.programs_built, 0) << "step " << step;
        EXPECT_EQ(stats.kernels_compiled, 0) << "step " << step;
      }
      // The first step writes over its zeros what later steps write over their state.
      in_place.push_back(stats.outputs_in_place);
    }
    EXPECT_EQ(in_place[0], in_place[1]);
    EXPECT_EQ(in_place[1], in_place[2]);
    // The same three steps from state loaded as zeros before the first.
    std::unique_ptr<mt::Optimizer> loaded = make(by_hand.params);
    for (size_t i = 0; i < kShapes.size(); ++i) {
      mt::NamedTensors zeros;
      for (const auto& [entry, value] : opt->state(i))
        zeros.emplace_back(entry,
                           mt::tensor(std::vector<float>(value.numel(), 0.0f), value.shape()));
      loaded->load_state(i, zeros);
    }
    for (int step = 0; step < 3; ++step) {
      for (size_t i = 0; i < kShapes.size(); ++i)
        by_hand.params[i].set_grad(by_hand.grads[step][i]);
      loaded->step();
    }
    for (size_t i = 0; i < kShapes.size(); ++i)
      EXPECT_EQ(f32_bits(run.params[i]), f32_bits(by_hand.params[i])) << "parameter " << i;
  }
}

// Under autocast the matmuls read 16-bit copies of the weights, kept for the program run; the
// update still computes into the weights' buffers (the copies are dropped with the old values),
// with the bits of fresh buffers (MIXTAPE_IN_PLACE=0's).
TEST(InPlaceUpdate, AutocastStepsUpdateTheirWeightsInPlace) {
  std::vector<std::vector<uint32_t>> results[2];
  for (int run = 0; run < 2; ++run) {
    mt::set_in_place_outputs(run == 0);
    mt::manual_seed(9);
    mt::MLP net({8, 32, 4}, mt::Activation::Relu);
    mt::SGD opt(net.parameters(), mt::SGDOptions{.lr = 0.05, .momentum = 0.9});
    mt::Tensor x = mt::randn({16, 8}), y = mt::randn({16, 4});
    for (int step = 0; step < 4; ++step) {
      opt.zero_grad();
      mt::Tensor loss;
      {
        mt::autocast guard(mt::autocast_policy(mt::bf16));
        loss = mt::mse_loss(net(x), y);
      }
      loss.backward();
      mt::reset_execution_stats();
      opt.step();
      // Every parameter, and from the second step its momentum buffer.
      EXPECT_EQ(mt::execution_stats().outputs_in_place, run == 1    ? 0
                                                        : step == 0 ? 4
                                                                    : 8)
          << "step " << step;
    }
    for (const mt::Tensor& p : net.parameters()) results[run].push_back(f32_bits(p));
  }
  mt::set_in_place_outputs(true);
  EXPECT_EQ(results[0], results[1]);
}
