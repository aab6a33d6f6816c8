// tests/test_dist.cpp -- data parallelism in one process (tests/mpi run two): dist::init says why
// the run is single, DataParallel then changes nothing, all_reduce is its input, and loader
// shards split each global batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "mixtape/dist/checkpoint.h"
#include "mixtape/dist/dist.h"
#include "mixtape/dist/zero.h"
#include "mixtape/dsl/process_group.h"
#include "tests/test_util.h"

#include <mixtape/mixtape.h>

namespace mt = mixtape;

namespace {

TEST(DistInit, WithoutALauncherTheRunIsOneProcessAndSaysWhy) {
  ASSERT_EQ(std::getenv("OMPI_COMM_WORLD_SIZE"), nullptr) << "run this test without mpirun";
  mt::dist::World world = mt::dist::init();
  EXPECT_EQ(world.rank, 0);
  EXPECT_EQ(world.size, 1);
  EXPECT_TRUE(world.single_reason.find("mpirun") != std::string::npos ||
              world.single_reason.find("without MPI") != std::string::npos)
      << world.single_reason;
  EXPECT_EQ(mt::dist::world_size(), 1);
  EXPECT_EQ(mt::dist::rank(), 0);
  EXPECT_EQ(mt::dist::shard().count, 1);
  EXPECT_EQ(mt::process_group(), nullptr);
  EXPECT_EQ(world.nccl_reason, "one process");
}

TEST(AllReduce, OfOneProcessIsItsInputInItsType) {
  mt::Tensor x = mt::tensor(std::vector<float>{1.5f, -2, 3e-8f, 65504}, {2, 2});
  for (mt::DType t : {mt::f32, mt::bf16, mt::f64, mt::i64}) {
    mt::Tensor y = mt::all_reduce(mt::cast(x, t));
    EXPECT_EQ(y.dtype(), t);
    EXPECT_EQ(y.shape(), x.shape());
    EXPECT_EQ(y.to_vector<double>(), mt::cast(x, t).to_vector<double>()) << mt::name(t);
  }
}

std::vector<float> train_three_steps(bool parallel, bool zero = false) {
  mt::manual_seed(5);
  mt::MLP net({4, 8, 3});
  std::optional<mt::dist::DataParallel> ddp;
  if (parallel) ddp.emplace(net);
  std::unique_ptr<mt::Optimizer> optimizer;
  if (zero)
    optimizer = std::make_unique<mt::dist::ZeroSGD>(net.parameters(),
                                                    mt::SGDOptions{.lr = 0.1, .momentum = 0.9});
  else
    optimizer =
        std::make_unique<mt::SGD>(net.parameters(), mt::SGDOptions{.lr = 0.1, .momentum = 0.9});
  mt::Optimizer& opt = *optimizer;
  mt::Tensor x = mt::randn({6, 4});
  mt::Tensor y = mt::tensor(std::vector<int64_t>{0, 1, 2, 0, 1, 2}, {6});
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    mt::cross_entropy(net(x), y).backward();
    opt.step();
  }
  if (ddp) {
    EXPECT_EQ(ddp->last_buckets(), 0) << "one process reduces nothing";
  }
  std::vector<float> all;
  for (const mt::Tensor& p : net.parameters()) {
    std::vector<float> v = p.to_vector<float>();
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

TEST(DataParallel, OfOneProcessChangesNothing) {
  mt::dist::init();
  EXPECT_EQ(train_three_steps(true), train_three_steps(false));
  mt::MLP net({4, 8, 3});
  EXPECT_MT_ERROR(mt::dist::DataParallel(net, {.bucket_bytes = 0}), "bucket_bytes 0");
  EXPECT_MT_ERROR(mt::dist::DataParallel(net, {.reduce_dtype = mt::i32}), "floating", "i32");
}

TEST(ReduceScatterAndAllGather, OfOneProcessAreTheirInput) {
  mt::Tensor x = mt::tensor(std::vector<float>{1.5f, -2, 3e-8f, 65504}, {4});
  EXPECT_EQ(mt::reduce_scatter(x).to_vector<float>(), x.to_vector<float>());
  EXPECT_EQ(mt::all_gather(mt::cast(x, mt::bf16)).dtype(), mt::bf16);
  EXPECT_EQ(mt::all_gather(x).to_vector<float>(), x.to_vector<float>());
  EXPECT_MT_ERROR(mt::reduce_scatter(mt::reshape(x, {2, 2})), "1-D", "[2, 2]");
  EXPECT_MT_ERROR(mt::all_gather(mt::reshape(x, {2, 2})), "1-D");
  EXPECT_MT_ERROR(mt::reduce_scatter(mt::gt(x, x)), "bool");
}

TEST(Zero, OfOneProcessIsThePlainOptimizerAndItsCheckpointsArePlain) {
  mt::dist::init();
  EXPECT_EQ(train_three_steps(true, true), train_three_steps(false));
  mt::manual_seed(5);
  mt::MLP net({4, 8, 3});
  mt::dist::ZeroAdamW zero(net.parameters(), {.lr = 0.01});
  EXPECT_STREQ(zero.kind(), "AdamW");
  EXPECT_EQ(zero.local_shape(0), net.layers[0]->weight.shape());
  for (int s = 0; s < 2; ++s) {
    zero.zero_grad();
    mt::sum(mt::square(net(mt::ones({2, 4})))).backward();
    zero.step();
  }
  const std::string path = testing::TempDir() + "zero_one_process.safetensors";
  mt::dist::save_checkpoint(path, net, &zero);
  mt::AdamW plain(net.parameters());
  mt::load_checkpoint(path, net, &plain);
  mt::dist::ZeroAdamW resumed(net.parameters());
  mt::dist::load_checkpoint(path, net, &resumed);
  EXPECT_EQ(plain.steps_taken(), 2);
  EXPECT_EQ(resumed.steps_taken(), 2);
  for (size_t i = 0; i < net.parameters().size(); ++i)
    for (size_t k = 0; k < 2; ++k) {
      std::vector<float> saved = zero.state(i)[k].second.to_vector<float>();
      EXPECT_EQ(plain.state(i)[k].second.to_vector<float>(), saved);
      EXPECT_EQ(resumed.state(i)[k].second.to_vector<float>(), saved);
    }
  mt::SGD other(net.parameters(), {.lr = 0.1});
  EXPECT_MT_ERROR(mt::dist::load_checkpoint(path, net, &other), "AdamW state",
                  "the optimizer is SGD");
  std::filesystem::remove(path);  // no file left in the temp folder
}

// Parameter groups under ZeRO: each group's options and rate, as the plain rule's; its checkpoint
// is the plain rule's, and loading one restores each group's rate into a ZeRO optimizer too (it
// kept the constructor's).
TEST(Zero, KeepsParameterGroupsAndRestoresTheirRates) {
  mt::dist::init();
  auto groups = [](const mt::MLP& net) {
    std::vector<mt::Tensor> matrices, vectors;
    for (const mt::Tensor& p : net.parameters()) (p.dim() > 1 ? matrices : vectors).push_back(p);
    return std::vector<mt::ParamGroup<mt::AdamOptions>>{
        {matrices, {.lr = 0.01, .weight_decay = 0.1}}, {vectors, {.lr = 0.03, .weight_decay = 0}}};
  };
  auto train = [&](mt::MLP& net, mt::Optimizer& opt) {
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      mt::sum(mt::square(net(mt::ones({2, 4})))).backward();
      opt.step();
    }
    std::vector<std::vector<float>> out;
    for (const mt::Tensor& p : net.parameters()) out.push_back(p.to_vector<float>());
    return out;
  };
  mt::manual_seed(5);
  mt::MLP net({4, 8, 3}), twin({4, 8, 3});
  twin.load_state_dict(net.state_dict());
  mt::dist::ZeroAdamW zero(groups(net));
  mt::AdamW plain(groups(twin));
  EXPECT_EQ(train(net, zero), train(twin, plain));
  EXPECT_EQ(zero.group_count(), 2u);
  zero.set_lr(1, 0.004);
  mt::AdamOptions changed = zero.options(0);  // options other than the rate are restored too
  changed.beta2 = 0.99;
  zero.set_options(0, changed);
  const std::string path = testing::TempDir() + "zero_groups.safetensors";
  mt::dist::save_checkpoint(path, net, &zero);
  mt::dist::ZeroAdamW resumed(groups(net));
  mt::dist::load_checkpoint(path, net, &resumed);
  EXPECT_EQ(resumed.lr(0), 0.01);
  EXPECT_EQ(resumed.lr(1), 0.004);
  EXPECT_EQ(resumed.options(0).beta2, 0.99);
  EXPECT_EQ(resumed.named_options(1), zero.named_options(1));
  mt::AdamW whole(groups(net));
  mt::load_checkpoint(path, net, &whole);
  EXPECT_EQ(whole.lr(1), 0.004);
  mt::dist::ZeroAdamW ungrouped(net.parameters());
  EXPECT_MT_ERROR(mt::dist::load_checkpoint(path, net, &ungrouped), "2 parameter groups");
  mt::MLP other({2, 2});
  EXPECT_MT_ERROR(zero.add_param_group({other.parameters(), {}}), "ZeRO cuts its shards");
  std::filesystem::remove(path);
}

// A ZeRO SGD whose schedule cycles its momentum (OneCycleLR) keeps momentum buffers its options
// alone (momentum 0) do not: its checkpoint, gathered into the plain rule with the schedules,
// saves and resumes bit for bit.
TEST(Zero, ACycledMomentumCheckpointsAndResumes) {
  mt::dist::init();
  auto run = [](bool resume) {
    mt::manual_seed(9);
    mt::MLP net({4, 8, 3});
    auto make = [&] {
      auto opt = std::make_unique<mt::dist::ZeroSGD>(net.parameters(), mt::SGDOptions{.lr = 0.1});
      opt->set_schedule(0, std::make_shared<mt::OneCycleLR>(0.1, 10));
      return opt;
    };
    auto opt = make();
    const std::string path = testing::TempDir() + "zero_cycled.safetensors";
    for (int s = 0; s < 4; ++s) {
      if (resume && s == 2) {
        mt::dist::save_checkpoint(path, net, opt.get());
        opt = make();
        mt::dist::load_checkpoint(path, net, opt.get());
        std::filesystem::remove(path);
      }
      opt->zero_grad();
      mt::sum(mt::square(net(mt::ones({2, 4})))).backward();
      opt->step();
    }
    std::vector<std::vector<float>> out;
    for (const mt::Tensor& p : net.parameters()) out.push_back(p.to_vector<float>());
    return out;
  };
  EXPECT_EQ(run(true), run(false));
}

// A bf16 parameter under ZeRO keeps f32 state beside its f32 master: entries set_options() turns
// on later (RMSprop's centered mean and momentum) start at the next step, as the plain rule's do.
TEST(Zero, StateTurnedOnBySetOptionsStartsForHalfParameters) {
  mt::dist::init();
  mt::Tensor w = mt::full({2, 3}, 0.5, mt::bf16);
  w.requires_grad_();
  mt::dist::Zero<mt::RMSprop> opt(std::vector<mt::Tensor>{w}, {.lr = 0.01});
  auto step = [&](double g) {
    w.set_grad(mt::full({2, 3}, g, mt::bf16));
    opt.step();
  };
  step(1.0);
  mt::RMSpropOptions options = opt.options(0);
  options.centered = true;
  options.momentum = 0.5;
  opt.set_options(0, options);
  step(0.5);
  step(0.25);
  std::vector<std::string> names;
  for (const auto& [name, value] : opt.state(0)) {
    names.push_back(name);
    EXPECT_EQ(value.dtype(), mt::f32) << name;
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names,
            (std::vector<std::string>{"grad_avg", "master", "momentum_buffer", "square_avg"}));
}

// Six AdamW steps of an MLP under the pure-bf16 policy, its first weight set to 0.25 by hand
// after the third: the model in f32 (the policy rounds its parameters where they are read), or
// made bf16 by Module::to and updated by ZeroAdamW or by the plain AdamW; both start from the same
// bf16 values. Returns the
// parameters and the optimizer's state of the first weight.
struct Bf16Run {
  std::vector<float> params;
  mt::NamedTensors first_state;
};
Bf16Run train_pure_bf16(bool bf16_model, bool zero) {
  mt::manual_seed(5);
  mt::MLP net({4, 8, 3});
  net.to(mt::bf16);  // both start from the same, bf16, values
  if (!bf16_model) net.to(mt::f32);
  std::unique_ptr<mt::Optimizer> opt;
  const mt::AdamOptions adam{.lr = 1e-3, .weight_decay = 0.1};
  if (zero)
    opt = std::make_unique<mt::dist::ZeroAdamW>(net.parameters(), adam);
  else
    opt = std::make_unique<mt::AdamW>(net.parameters(), adam);
  mt::Tensor x = mt::randn({6, 4});
  mt::Tensor y = mt::tensor(std::vector<int64_t>{0, 1, 2, 0, 1, 2}, {6});
  for (int s = 0; s < 6; ++s) {
    if (s == 3) {
      mt::Tensor w = net.layers[0]->weight;
      w.assign(mt::full(w.shape(), 0.25, w.dtype()));
    }
    opt->zero_grad();
    {
      mt::autocast guard(mt::pure_policy(mt::bf16));
      mt::cross_entropy(net(x), y).backward();
    }
    opt->step();
  }
  Bf16Run run{{}, opt->state(0)};
  for (const mt::Tensor& p : net.parameters()) {
    std::vector<float> v = mt::cast(p, mt::f32).to_vector<float>();
    run.params.insert(run.params.end(), v.begin(), v.end());
  }
  return run;
}

// A bf16 model under ZeRO keeps an f32 master of its shard (all of it with one process): the
// master is what the f32 model under the pure-bf16 policy holds, bit for bit, with the rule's
// state in f32, and the bf16 parameters are its rounding; a parameter assigned by hand is taken
// as assigned. The plain AdamW, updating the bf16 parameters themselves, drifts from it (updates
// below a parameter's bf16 spacing are lost).
TEST(Zero, KeepsF32MasterWeightsOfABf16Model) {
  mt::dist::init();
  Bf16Run f32_model = train_pure_bf16(false, false);
  Bf16Run zero = train_pure_bf16(true, true);
  Bf16Run plain = train_pure_bf16(true, false);
  EXPECT_EQ(zero.params, rounded_to(f32_model.params, mt::bf16));
  ASSERT_EQ(zero.first_state.size(), 3u);  // exp_avg, exp_avg_sq and the master
  EXPECT_EQ(zero.first_state[2].first, "master");
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(zero.first_state[k].second.dtype(), mt::f32);
  std::vector<float> first_weight(f32_model.params.begin(), f32_model.params.begin() + 32);
  EXPECT_EQ(zero.first_state[2].second.to_vector<float>(), first_weight);
  EXPECT_NE(plain.params, zero.params);
  // memory_report counts the master too before the first step: 3 f32 copies of every parameter.
  mt::MLP net({4, 8, 3});
  net.to(mt::bf16);
  mt::dist::ZeroAdamW opt(net.parameters());
  mt::Tensor loss = mt::sum(net(mt::ones({1, 4})));
  loss.backward();
  EXPECT_EQ(mt::memory_report(net, &opt, loss).optimizer_state, 3 * 4 * (4 * 8 + 8 + 8 * 3 + 3));
}

// A child that outlives its parent, or a parent that outlives its child, keeps no pointer to the
// other (the sanitizer suite reads what a dangling one would); a registration cycle is refused.
TEST(ModuleTree, ChildrenAndParentsMayOutliveEachOtherAndCyclesAreRefused) {
  struct Node : mt::Module {
    void adopt(const std::string& name, mt::Module& child) { register_module(name, child); }
  };
  mt::Linear encoder(3, 2);
  {
    Node holder;
    holder.adopt("encoder", encoder);
    EXPECT_EQ(encoder.path(), "encoder");
  }
  EXPECT_EQ(encoder.path(), "");
  EXPECT_EQ(encoder(mt::ones({1, 3})).shape(), (mt::Shape{1, 2}));
  Node wrapper;
  wrapper.adopt("encoder", encoder);  // free to join another
  EXPECT_EQ(wrapper.named_parameters().size(), 2u);
  {
    mt::Linear temporary(2, 2);
    wrapper.adopt("temporary", temporary);
    EXPECT_EQ(wrapper.named_parameters().size(), 4u);
  }
  EXPECT_EQ(wrapper.named_parameters().size(), 2u);
  Node a, b, c;
  a.adopt("b", b);
  b.adopt("c", c);
  EXPECT_MT_ERROR(c.adopt("a", a), "cannot register 'a'", "contains it");
  EXPECT_MT_ERROR(b.adopt("self", b), "own child");
  EXPECT_EQ(c.path(), "b.c");
}

// load_state_dict changes nothing unless every value fits and evaluates; a name given twice is
// refused. A computed buffer is stored as its values, so Module::to converts it.
TEST(ModuleState, LoadingIsAllOrNothingAndComputedBuffersConvert) {
  struct Net : mt::Module {
    mt::Linear fc{2, 2};
    Net() { register_module("fc", fc); }
  } net;
  const std::vector<float> weight = net.fc.weight.to_vector<float>();
  mt::NamedTensors bad = {
      {"fc.weight", mt::full({2, 2}, 9.0)},
      {"fc.bias",
       mt::embedding(mt::ones({2, 2}), mt::tensor(std::vector<int64_t>{0, 7}, {2}, mt::i64))}};
  bad[1].second = mt::sum(bad[1].second, {1});
  EXPECT_MT_ERROR(net.load_state_dict(bad), "out of range");
  EXPECT_EQ(net.fc.weight.to_vector<float>(), weight) << "nothing loaded";
  mt::NamedTensors twice = {{"fc.weight", mt::full({2, 2}, 9.0)},
                            {"fc.bias", mt::zeros({2})},
                            {"fc.bias", mt::ones({2})}};
  EXPECT_MT_ERROR(net.load_state_dict(twice), "'fc.bias' is given twice");
  struct Encoded : mt::Module {
    mt::Linear fc{2, 2};
    mt::Tensor table;
    Encoded() {
      register_module("fc", fc);
      table = register_buffer("table", mt::sin(mt::arange(4, mt::f32) * 0.5));
    }
  } encoded;
  encoded.to(mt::bf16);
  EXPECT_EQ(encoded.fc.weight.dtype(), mt::bf16);
  EXPECT_EQ(encoded.named_buffers()[0].second.dtype(), mt::bf16);
}

TEST(ModuleTo, ConvertsFloatingParametersAndBuffersInPlace) {
  mt::manual_seed(5);
  mt::Sequential net;
  mt::Linear& fc = net.emplace_back<mt::Linear>(3, 2);
  mt::BatchNorm1d& norm = net.emplace_back<mt::BatchNorm1d>(2);
  std::vector<float> weight = fc.weight.to_vector<float>();
  mt::sum(net(mt::ones({4, 3}))).backward();
  ASSERT_TRUE(fc.weight.grad().defined());
  mt::Tensor handle = fc.weight;  // a copy of the handle converts with it
  EXPECT_EQ(&net.to(mt::bf16), &net);
  EXPECT_EQ(handle.dtype(), mt::bf16);
  EXPECT_TRUE(handle.requires_grad());
  EXPECT_FALSE(handle.grad().defined()) << "a gradient of the old type is dropped";
  EXPECT_EQ(handle.to_vector<float>(), rounded_to(weight, mt::bf16));
  for (const auto& [name, buffer] : norm.named_buffers())
    EXPECT_EQ(buffer.dtype(), name == "num_batches_tracked" ? mt::i64 : mt::bf16) << name;
  mt::Tensor out = net(mt::ones({4, 3}, mt::bf16));
  EXPECT_EQ(out.dtype(), mt::bf16);
  mt::sum(out).backward();
  EXPECT_EQ(handle.grad().dtype(), mt::bf16);
  EXPECT_MT_ERROR(net.to(mt::i32), "floating", "i32");
  mt::Tensor ids = mt::tensor(std::vector<int64_t>{1, 2}, {2});
  EXPECT_MT_ERROR(ids.convert(mt::f32), "floating", "i64");
  mt::Tensor doubled = handle * 2.0;
  EXPECT_MT_ERROR(doubled.convert(mt::f32), "leaf", "mul");
}

// A bf16 model with batch norm trains under autocast with the plain AdamW, is saved (the running
// statistics, computed in f32 inside batch norm, in their bf16 type) and loaded (the state in
// the type the step keeps it in, bf16 as the parameters), and trains on.
TEST(ModuleTo, ABf16ModelIsSavedLoadedAndTrainsOn) {
  mt::manual_seed(5);
  mt::Sequential net;
  net.emplace_back<mt::Linear>(3, 4);
  mt::BatchNorm1d& norm = net.emplace_back<mt::BatchNorm1d>(4);
  net.to(mt::bf16);
  mt::AdamW opt(net.parameters(), {.lr = 1e-2});
  mt::Tensor x = mt::randn({8, 3});
  auto step = [&] {
    opt.zero_grad();
    mt::autocast guard(mt::bf16);
    mt::sum(mt::square(net(x))).backward();
    opt.step();
  };
  step();
  const std::string path = testing::TempDir() + "bf16_model.safetensors";
  mt::save_checkpoint(path, net, &opt);
  std::vector<float> mean = mt::cast(norm.running_mean, mt::f32).to_vector<float>();
  mt::load_checkpoint(path, net, &opt);
  EXPECT_EQ(norm.running_mean.dtype(), mt::bf16);
  EXPECT_EQ(mt::cast(norm.running_mean, mt::f32).to_vector<float>(), rounded_to(mean, mt::bf16));
  EXPECT_EQ(opt.state(0)[0].second.dtype(), mt::bf16);  // as the step made it
  step();
  for (const mt::Tensor& p : net.parameters()) EXPECT_EQ(p.dtype(), mt::bf16);
  std::filesystem::remove(path);
}

// Example i has feature i, so a batch's features name its examples.
std::vector<int64_t> examples_of(const mt::Batch& b) {
  std::vector<int64_t> ids;
  for (float f : b.inputs.to_vector<float>()) ids.push_back(static_cast<int64_t>(f));
  return ids;
}

TEST(DataLoaderShard, TheSharesOfAStepAreTheBatchOfOneProcessAtTheWorldsBatchSize) {
  std::vector<float> features(11);
  for (int i = 0; i < 11; ++i) features[i] = static_cast<float>(i);
  mt::TensorDataset set(features, {1}, std::vector<int64_t>(11, 0));
  mt::DataLoader whole(set, 4, true, 9);
  mt::DataLoader first(set, 2, true, 9, mt::Shard{0, 2}), second(set, 2, true, 9, {1, 2});
  ASSERT_EQ(whole.batches_per_epoch(), 2);
  EXPECT_EQ(first.batches_per_epoch(), 2);  // 5 examples each, the 11th left out
  for (int step = 0; step < 6; ++step) {    // three epochs
    std::vector<int64_t> expected = examples_of(whole.next());
    std::vector<int64_t> a = examples_of(first.next()), b = examples_of(second.next()), both = a;
    both.insert(both.end(), b.begin(), b.end());
    std::sort(expected.begin(), expected.end());
    std::sort(both.begin(), both.end());
    EXPECT_EQ(both, expected) << "step " << step;
    for (int64_t id : a) EXPECT_EQ(std::count(b.begin(), b.end(), id), 0);
  }
  EXPECT_MT_ERROR(mt::DataLoader(set, 2, true, 9, mt::Shard{2, 2}), "shard 2 of 2 does not exist");
  EXPECT_MT_ERROR(mt::DataLoader(set, 6, true, 9, mt::Shard{0, 2}), "batch_size 6 exceeds the 5",
                  "each of 2 shards");
  EXPECT_MT_ERROR(mt::DataLoader(set, 1, true, 9, mt::Shard{0, 12}), "11 examples",
                  "shard 0 of 12");
}

TEST(GradientHook, SeesEveryLeafGradientOnceAndCanReplaceIt) {
  mt::Tensor w = mt::ones({3}).requires_grad_(true);
  int calls = 0;
  int64_t id = mt::add_gradient_hook([&](mt::LeafGradients& grads) {
    ++calls;
    ASSERT_EQ(grads.size(), 1u);
    grads[0].second = grads[0].second * 2.0;
  });
  mt::sum(w * 3.0).backward();
  mt::remove_gradient_hook(id);
  mt::sum(w * 3.0).backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{9, 9, 9}));
}

// A hook that throws (a collective whose peer died) leaves the graph walkable, so the backward can
// be called again; a hook's gradient of the wrong shape is refused, not accumulated.
TEST(GradientHook, AFailedHookLeavesTheGraphWalkableAndAWrongShapeIsRefused) {
  mt::Tensor w = mt::ones({3}).requires_grad_(true);
  mt::Tensor loss = mt::sum(w * 3.0);
  int64_t id = mt::add_gradient_hook([](mt::LeafGradients&) { throw mt::Error("peer died"); });
  EXPECT_MT_ERROR(loss.backward(), "peer died");
  mt::remove_gradient_hook(id);
  EXPECT_FALSE(w.grad().defined());
  loss.backward();
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{3, 3, 3}));
  id = mt::add_gradient_hook([](mt::LeafGradients& grads) { grads[0].second = mt::ones({2}); });
  EXPECT_MT_ERROR(mt::sum(w * 3.0).backward(), "a gradient hook gave a gradient of shape [2]",
                  "parameter of shape [3]");
  mt::remove_gradient_hook(id);
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{3, 3, 3}));
}

}  // namespace
