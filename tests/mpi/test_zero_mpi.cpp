// tests/mpi/test_zero_mpi.cpp -- ZeRO-1 on two processes (ctest label mpi): ZeroAdamW against
// plain data parallel (fp32, autocast-bf16 with dynamic scaling, an inf on one rank only),
// optimizer-state bytes per rank, checkpoints (ordinary and sharded) resumed at 2 ranks and at 1,
// another model's checkpoint or a corrupt shard refused on every rank, mt::compile replaying
// ZeRO steps, and no_sync's gradient accumulation under ZeRO.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "mixtape/dist/checkpoint.h"
#include "mixtape/dist/dist.h"
#include "mixtape/dist/zero.h"
#include "mixtape/dsl/json.h"
#include "mixtape/dsl/process_group.h"
#include "mixtape/mixtape.h"
#include "mixtape/runtime/all_reduce.h"
#include "mixtape/runtime/safetensors.h"
#include "tests/test_util.h"

namespace mt = mixtape;

namespace {

constexpr int64_t kBatch = 32;  // per rank; one process alone takes both ranks' rows
constexpr int64_t kFeatures = 64, kClasses = 4;
constexpr int kSteps = 20;

// 64 -> 32 -> 4 and a learned temperature: 2213 parameters, an odd count, so the flat buffer is
// padded by one element, and rank 0's shard ends inside fc1.weight, so it holds none of the
// other tensors.
struct Net : mt::Module {
  mt::Linear fc1{kFeatures, 32}, fc2{32, kClasses};
  mt::Tensor temperature;
  Net() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    temperature = register_parameter("temperature", mt::ones({1}));
  }
  mt::Tensor operator()(const mt::Tensor& x) const { return fc2(mt::gelu(fc1(x))) * temperature; }
};

// The global batch of every step, made once: inputs from a seeded normal, labels from a fixed
// random linear teacher.
struct Data {
  std::vector<float> x;
  std::vector<int64_t> y;
};
const Data& data() {
  static const Data d = [] {
    mt::Generator gen(11);
    const int64_t rows = kSteps * 2 * kBatch;
    mt::Tensor x = mt::randn({rows, kFeatures}, mt::f32, &gen);
    mt::Tensor teacher = mt::randn({kFeatures, kClasses}, mt::f32, &gen);
    return Data{x.to_vector<float>(), mt::argmax(mt::matmul(x, teacher), 1).to_vector<int64_t>()};
  }();
  return d;
}

// Rows [first, first + count) of the global batch of step s.
std::pair<mt::Tensor, mt::Tensor> batch(int s, int64_t first, int64_t count) {
  const int64_t at = s * 2 * kBatch + first;
  const Data& d = data();
  std::vector<float> x(d.x.begin() + at * kFeatures, d.x.begin() + (at + count) * kFeatures);
  std::vector<int64_t> y(d.y.begin() + at, d.y.begin() + at + count);
  return {mt::tensor(x, {count, kFeatures}), mt::tensor(y, {count}, mt::i64)};
}

std::vector<float> flat_parameters(const mt::Module& m) {
  std::vector<mt::Tensor> flat;
  for (const mt::Tensor& p : m.parameters()) flat.push_back(mt::reshape(p, {-1}));
  return mt::concat(flat).to_vector<float>();
}

// Rank 0's values, on every rank.
std::vector<float> rank0s(std::vector<float> values) {
  if (mt::ProcessGroup* group = mt::process_group())
    group->broadcast(reinterpret_cast<std::byte*>(values.data()),
                     static_cast<int64_t>(values.size() * sizeof(float)), 0);
  return values;
}

// No process group while it lives, as in a run without mpirun: one process.
class WithoutProcessGroup {
 public:
  WithoutProcessGroup() : group_(mt::exchange_process_group(nullptr)) {}
  ~WithoutProcessGroup() { mt::exchange_process_group(group_); }
  WithoutProcessGroup(const WithoutProcessGroup&) = delete;
  WithoutProcessGroup& operator=(const WithoutProcessGroup&) = delete;

 private:
  std::shared_ptr<mt::ProcessGroup> group_;
};

// zero_alone: a ZeRO optimizer in one process (every rank alike, at both ranks' rows).
enum class Kind { data_parallel, zero, alone, zero_alone };

// The update rule: AdamW with weight decay, SGD with momentum, and the other elementwise rules.
enum class Rule { adamw, sgd, rmsprop, adagrad, lion, adafactor };

// `Rule` over the parameters: ZeRO's or the plain one.
template <class Rule, class Options>
std::unique_ptr<mt::Optimizer> either(bool zero, const std::vector<mt::Tensor>& params,
                                      const Options& options) {
  if (zero) return std::make_unique<mt::dist::Zero<Rule>>(params, options);
  return std::make_unique<Rule>(params, options);
}

std::unique_ptr<mt::Optimizer> make_optimizer(Rule rule, bool zero,
                                              const std::vector<mt::Tensor>& params) {
  switch (rule) {
    case Rule::adamw:
      return either<mt::AdamW>(zero, params, mt::AdamOptions{.lr = 1e-3, .weight_decay = 0.01});
    case Rule::sgd:
      return either<mt::SGD>(zero, params, mt::SGDOptions{.lr = 0.05, .momentum = 0.9});
    case Rule::rmsprop:
      return either<mt::RMSprop>(
          zero, params,
          mt::RMSpropOptions{.lr = 1e-3, .weight_decay = 0.01, .momentum = 0.5, .centered = true});
    case Rule::adagrad:
      return either<mt::Adagrad>(
          zero, params,
          mt::AdagradOptions{.lr = 0.05, .lr_decay = 0.01, .initial_accumulator_value = 0.1});
    case Rule::lion:
      return either<mt::Lion>(zero, params, mt::LionOptions{.lr = 1e-4, .weight_decay = 0.1});
    case Rule::adafactor:
      return either<mt::Adafactor>(zero, params, mt::AdafactorOptions{.beta1 = 0.9});
  }
  return nullptr;
}

struct Options {
  Kind kind = Kind::zero;
  Rule rule = Rule::adamw;
  bool bf16 = false;
  // Under the pure-bf16 policy: ZeRO trains the model made bf16 (Module::to; f32 master shards),
  // data parallel and one process the f32 model from the same bf16 values, reducing in bf16.
  bool pure_bf16 = false;
  double max_norm = 0.05;  // the clipping norm: below the gradients' at every step
  bool compiled = false;
  int bad_step = -1;       // rank 1 alone multiplies its gradients by inf at this step
  int first_step = 0;      // steps first_step .. last_step - 1 are run
  int last_step = kSteps;  // where a checkpoint is saved (save_at) or loaded (load)
  int save_at = -1;
  std::string load = {};
  std::string path = {};
  bool sharded = false;  // save_checkpoint_sharded and load_checkpoint_sharded
  int unfreeze_at = -1;  // fc1 frozen before the optimizer and DataParallel are made, until then
};

struct Outcome {
  std::vector<float> params;
  std::vector<double> losses;  // the global batch's mean loss of each step run
  std::vector<double> norms;   // clip_grad_norm's of each traced step
  std::vector<double> scales;
  std::vector<bool> skipped;
  int64_t replays = 0;
};

// AdamW with weight decay (or SGD with momentum), dynamic loss scaling and clipping: ZeRO or
// plain data parallel at kBatch rows per rank, or one process alone (on every rank alike)
// at both ranks' rows.
Outcome train(const Options& o) {
  const bool alone = o.kind == Kind::alone || o.kind == Kind::zero_alone;
  const int rank = mt::dist::rank();
  std::optional<WithoutProcessGroup> one_process;
  if (o.kind == Kind::zero_alone) one_process.emplace();
  mt::manual_seed(7);
  Net net;
  auto set_fc1_trainable = [&](bool on) {
    for (mt::Tensor p : {net.fc1.weight, net.fc1.bias}) p.requires_grad_(on);
  };
  if (o.unfreeze_at >= 0) set_fc1_trainable(false);
  mt::dist::DataParallelOptions parallel;
  if (o.pure_bf16) {
    net.to(mt::bf16);
    if (o.kind != Kind::zero) net.to(mt::f32);
    parallel.reduce_dtype = mt::bf16;
  }
  std::optional<mt::dist::DataParallel> ddp;
  if (!alone) ddp.emplace(net, parallel);
  std::unique_ptr<mt::Optimizer> optimizer =
      make_optimizer(o.rule, o.kind == Kind::zero || o.kind == Kind::zero_alone, net.parameters());
  mt::Optimizer& opt = *optimizer;
  mt::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 4});
  if (!o.load.empty() && o.sharded && alone) {
    // One process, as a run without mpirun is: no process group while it loads.
    WithoutProcessGroup loading_alone;
    mt::dist::load_checkpoint_sharded(o.load, net, &opt, nullptr, &scaler);
  } else if (!o.load.empty() && o.sharded) {
    mt::dist::load_checkpoint_sharded(o.load, net, &opt, nullptr, &scaler);
  } else if (!o.load.empty()) {
    if (alone)
      mt::load_checkpoint(o.load, net, &opt, nullptr, &scaler);
    else
      mt::dist::load_checkpoint(o.load, net, &opt, nullptr, &scaler);
  }
  std::vector<mt::Tensor> losses, norms;
  auto step = [&](const mt::Tensor& x, const mt::Tensor& y) {
    opt.zero_grad();
    mt::Tensor loss;
    {
      std::optional<mt::autocast> guard;
      if (o.bf16) guard.emplace(mt::bf16);
      if (o.pure_bf16) guard.emplace(mt::pure_policy(mt::bf16));
      loss = mt::cross_entropy(net(x), y);
    }
    scaler.scale(loss).backward();
    scaler.unscale_(opt);
    mt::Tensor norm = mt::clip_grad_norm(net.parameters(), o.max_norm);
    if (!o.compiled) norms.push_back(norm);
    scaler.step(opt);
    scaler.update();
    return loss;
  };
  auto compiled = mt::compile(step);
  Outcome r;
  // Each process alone saves its own files (rank 0's at `path`).
  const std::string save_path = o.kind == Kind::zero_alone && rank > 0 ? o.path + "_rank1" : o.path;
  for (int s = o.first_step; s < o.last_step; ++s) {
    if (s == o.unfreeze_at) set_fc1_trainable(true);
    auto [x, y] = alone ? batch(s, 0, 2 * kBatch) : batch(s, rank * kBatch, kBatch);
    if (s == o.bad_step && rank == 1) {  // the same calls as step(), which make collectives
      opt.zero_grad();
      scaler.scale(mt::cross_entropy(net(x), y)).backward();
      for (mt::Tensor p : net.parameters()) p.set_grad(p.grad() * INFINITY);
      scaler.unscale_(opt);
      mt::clip_grad_norm(net.parameters(), o.max_norm);
      scaler.step(opt);
      scaler.update();
      losses.push_back(mt::full({}, NAN));
    } else {
      losses.push_back(o.compiled && s != o.bad_step ? compiled(x, y) : step(x, y));
    }
    // Each loss now, as its step left it: a loss that tracing left unevaluated (the backward pass
    // does not read it) would else be computed at the end, fused with the others in other
    // kernels, whose sums may add in another order (an ulp apart on AVX-512).
    mt::eval({losses.back()});
    if (s + 1 == o.save_at && o.sharded)
      mt::dist::save_checkpoint_sharded(save_path, net, &opt, {}, &scaler);
    else if (s + 1 == o.save_at)
      mt::dist::save_checkpoint(save_path, net, &opt, {}, &scaler);
    EXPECT_EQ(flat_parameters(net), rank0s(flat_parameters(net)))
        << "rank " << rank << "'s parameters differ from rank 0's after step " << s;
  }
  mt::Tensor mean = mt::stack(losses);
  if (!alone) mean = mt::all_reduce(mean) / 2.0;
  r.losses = mean.to_vector<double>();
  if (!norms.empty()) r.norms = mt::stack(norms).to_vector<double>();
  r.params = flat_parameters(net);
  r.scales = scaler.scale_history();
  r.skipped = scaler.skip_history();
  r.replays = compiled.stats().replays;
  return r;
}

// The largest |a - b| / max(|b|, 0.01), which rank 0 prints.
double worst_difference(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst =
        std::max(worst, std::fabs(double(a[i]) - b[i]) / std::max(std::fabs(double(b[i])), 1e-2));
  if (mt::dist::rank() == 0) std::printf("worst relative difference %.3g\n", worst);
  return worst;
}

std::vector<float> as_floats(const std::vector<double>& v) { return {v.begin(), v.end()}; }

std::vector<std::string>& job_files();

class Zero : public ::testing::Test {
 public:
  // Rank 0 wrote the files; every rank has finished with them once the suite is over.
  static void TearDownTestSuite() {
    mt::all_reduce(mt::scalar(1.0, mt::f64)).item();  // both ranks are done reading
    if (mt::dist::rank() == 0)
      for (const std::string& file : job_files()) std::filesystem::remove_all(file);
  }

 protected:
  void SetUp() override {
    if (mt::dist::init().size != 2)
      GTEST_SKIP() << "needs two processes (mpirun -np 2): " << mt::dist::init().single_reason;
  }
};

// Twenty steps of ZeRO against plain data parallel, and ZeRO again. AdamW's steps divide by the
// gradients' own size, which magnifies a change in the last bit of a gradient near zero: so
// with AdamW the clipping norm is one the gradients never reach (the gradients are then the same
// bits, per element summed in rank order, and so are the updates), and the global norm itself
// is compared; SGD's steps are clipped at every step.
void expect_zero_equals_data_parallel(bool bf16) {
  for (bool sgd : {false, true}) {
    SCOPED_TRACE(sgd ? "SGD, clipped" : "AdamW");
    const double max_norm = sgd ? 0.05 : 1e3;
    const Rule rule = sgd ? Rule::sgd : Rule::adamw;
    Outcome zero = train({.rule = rule, .bf16 = bf16, .max_norm = max_norm});
    Outcome plain =
        train({.kind = Kind::data_parallel, .rule = rule, .bf16 = bf16, .max_norm = max_norm});
    EXPECT_LE(worst_difference(zero.params, plain.params), 1e-6);
    EXPECT_LE(worst_difference(as_floats(zero.losses), as_floats(plain.losses)), 1e-6);
    // The global norm: each rank's shard's squares, all-reduced, against the whole gradient's:
    // a few f32 roundings apart (added in another order).
    EXPECT_LE(worst_difference(as_floats(zero.norms), as_floats(plain.norms)), 2e-6);
    if (sgd) {
      EXPECT_GT(*std::min_element(zero.norms.begin(), zero.norms.end()), max_norm);
    }
    EXPECT_EQ(zero.scales, plain.scales);
    Outcome again = train({.rule = rule, .bf16 = bf16, .max_norm = max_norm});
    EXPECT_EQ(zero.params, again.params) << "runs repeat bit for bit";
  }
}

TEST_F(Zero, EqualsPlainDataParallelInFp32) { expect_zero_equals_data_parallel(false); }

TEST_F(Zero, EqualsPlainDataParallelUnderAutocastBf16WithDynamicScaling) {
  expect_zero_equals_data_parallel(true);
}

// Layers frozen when the optimizer and DataParallel are made (a fine-tuning run's backbone) and
// unfrozen later are averaged from then on, under ZeRO and plain data parallel, as one process
// at both ranks' rows trains them (PyTorch's DDP would leave them out: the ranks drifted apart).
TEST_F(Zero, LayersFrozenWhenMadeAreAveragedOnceUnfrozen) {
  const Outcome alone = train({.kind = Kind::alone, .max_norm = 1e3, .unfreeze_at = 5});
  for (Kind kind : {Kind::zero, Kind::data_parallel}) {
    SCOPED_TRACE(kind == Kind::zero ? "ZeRO" : "data parallel");
    const Outcome both = train({.kind = kind, .max_norm = 1e3, .unfreeze_at = 5});
    EXPECT_LE(worst_difference(both.params, alone.params), 1e-5);
  }
}

TEST_F(Zero, OneRanksInfSkipsTheStepOnEveryRank) {
  Outcome r = train({.bad_step = 5});
  ASSERT_EQ(r.skipped.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) EXPECT_EQ(r.skipped[s], s == 5) << "step " << s;
  EXPECT_EQ(r.scales[5], r.scales[4] / 2) << "the scale backs off on every rank";
}

TEST_F(Zero, CompiledStepsReplayTheShardedStep) {
  Outcome traced = train({});
  Outcome compiled = train({.compiled = true});
  EXPECT_EQ(traced.params, compiled.params);
  EXPECT_EQ(traced.losses, compiled.losses);
  if (mt::current_device() != mt::Device::reference) {  // which has no programs to replay
    EXPECT_GE(compiled.replays, kSteps - 3) << "the steps after the first traces are replays";
  }
}

// Five steps of SGD with momentum, each of two micro-batches per rank (half a rank's rows each),
// the first under no_sync; or one process alone at both ranks' rows in one backward. Counts
// the collectives of the no_sync micro-steps.
std::vector<float> accumulate(Kind kind, int64_t& no_sync_collectives) {
  mt::manual_seed(7);
  Net net;
  const mt::SGDOptions sgd{.lr = 0.05, .momentum = 0.9};
  std::optional<mt::dist::DataParallel> ddp;
  std::unique_ptr<mt::Optimizer> opt;
  if (kind == Kind::alone) {
    opt = std::make_unique<mt::SGD>(net.parameters(), sgd);
  } else {
    ddp.emplace(net);
    if (kind == Kind::zero)
      opt = std::make_unique<mt::dist::ZeroSGD>(net.parameters(), sgd);
    else
      opt = std::make_unique<mt::SGD>(net.parameters(), sgd);
  }
  const int64_t half = kBatch / 2, first = mt::dist::rank() * kBatch;
  for (int s = 0; s < 5; ++s) {
    opt->zero_grad();
    if (kind == Kind::alone) {
      auto [x, y] = batch(s, 0, 2 * kBatch);
      mt::cross_entropy(net(x), y).backward();
    } else {
      {
        auto guard = ddp->no_sync();
        auto [x, y] = batch(s, first, half);
        mt::reset_collective_stats();
        (mt::cross_entropy(net(x), y) / 2.0).backward();
        std::vector<mt::Tensor> grads;
        for (const mt::Tensor& p : net.parameters()) grads.push_back(p.grad());
        mt::eval(grads);
        no_sync_collectives += mt::collective_stats().calls;
      }
      auto [x, y] = batch(s, first + half, half);
      (mt::cross_entropy(net(x), y) / 2.0).backward();
    }
    opt->step();
  }
  return flat_parameters(net);
}

TEST_F(Zero, NoSyncHoldsBackTheReduceScatterAndTheNextBackwardReducesTheSum) {
  int64_t collectives = 0;
  std::vector<float> zero = accumulate(Kind::zero, collectives);
  std::vector<float> plain = accumulate(Kind::data_parallel, collectives);
  EXPECT_EQ(collectives, 0) << "no collective in a no_sync micro-step";
  std::vector<float> alone = accumulate(Kind::alone, collectives);
  EXPECT_LE(worst_difference(zero, plain), 1e-6);
  EXPECT_LE(worst_difference(zero, alone), 1e-6);
}

// The optimizer-state bytes memory_report counts on each rank, before the first step (the
// estimate) and after it.
std::pair<int64_t, int64_t> state_bytes(bool zero, Rule rule = Rule::adamw) {
  mt::manual_seed(7);
  Net net;
  mt::dist::DataParallel ddp(net);
  std::unique_ptr<mt::Optimizer> opt = make_optimizer(rule, zero, net.parameters());
  std::pair<int64_t, int64_t> bytes;
  for (int s = 0; s < 2; ++s) {
    auto [x, y] = batch(s, mt::dist::rank() * kBatch, kBatch);
    opt->zero_grad();
    mt::Tensor loss = mt::cross_entropy(net(x), y);
    loss.backward();
    mt::MemoryReport report = mt::memory_report(net, opt.get(), loss);
    EXPECT_EQ(report.optimizer_state_estimated, s == 0);
    (s == 0 ? bytes.first : bytes.second) = report.optimizer_state;
    opt->step();
  }
  return bytes;
}

// A file of this run's ranks alone: ctest runs this test and its reference-executor twin at the
// same time, and a shared name let one run resume from the other's checkpoint. The ranks of one
// mpirun on one host share their parent, the launcher.
std::vector<std::string>& job_files() {
  static std::vector<std::string> files;
  return files;
}

std::string job_file(const std::string& name) {
  job_files().push_back(testing::TempDir() + "mixtape_zero_" + std::to_string(::getppid()) + "_" +
                        name);
  return job_files().back();
}

// One step's gradient health and logs, ZeRO's or plain data parallel's: each rank a
// SummaryWriter into `dir`, logging the gradients' norm and health as every rank must under ZeRO.
// `local`: fc1.weight's gradient as this rank holds it, through the overload that combines nothing.
mt::GradientHealth logged_step(bool zero, const std::string& dir, std::string& path,
                               mt::GradientHealth& local) {
  mt::manual_seed(7);
  Net net;
  mt::dist::DataParallel ddp(net);
  std::unique_ptr<mt::Optimizer> opt = make_optimizer(Rule::adamw, zero, net.parameters());
  mt::SummaryWriter writer(dir);
  path = writer.path();
  writer.set_step(1);
  auto [x, y] = batch(0, mt::dist::rank() * kBatch, kBatch);
  opt->zero_grad();
  mt::cross_entropy(net(x), y).backward();
  writer.log_grad_norm(net.parameters());
  writer.log_gradient_health(net, 1);
  // At 1e-4 the gradients' values fall where f16 is subnormal or zero: every count is in play.
  local = mt::gradient_health(mt::NamedTensors{{"fc1.weight", net.fc1.weight.grad()}}, 1e-4);
  return mt::gradient_health(net, 1e-4);
}

// Under ZeRO a rank holds its part of each gradient and zeros elsewhere; gradient_health adds
// the ranks' counts up to the whole gradient's, as plain data parallel (every rank the whole
// reduced gradient, the same bits) counts them. A SummaryWriter on each rank writes one file,
// rank 0's: the other's makes none, and its logging makes the collectives rank 0's does.
TEST_F(Zero, GradientHealthCountsTheWholeGradientsAndRankZeroAloneWritesTheLog) {
  const std::string zero_dir = job_file("logs_zero"), plain_dir = job_file("logs_plain");
  std::string zero_path, plain_path;
  mt::GradientHealth zero_local, plain_local;
  mt::GradientHealth zero = logged_step(true, zero_dir, zero_path, zero_local);
  mt::GradientHealth plain = logged_step(false, plain_dir, plain_path, plain_local);
  ASSERT_EQ(zero.rows.size(), plain.rows.size());
  std::vector<mt::GradientHealthRow> rows = zero.rows, expected = plain.rows;
  rows.push_back(zero.total);
  expected.push_back(plain.total);
  for (size_t i = 0; i < rows.size(); ++i) {
    const mt::GradientHealthRow &got = rows[i], &want = expected[i];
    SCOPED_TRACE(want.name);
    EXPECT_EQ(got.numel, want.numel);
    EXPECT_EQ(got.nonzero, want.nonzero);
    EXPECT_EQ(got.nonfinite, want.nonfinite);
    EXPECT_EQ(got.amax, want.amax);
    for (auto [a, b] : {std::pair{got.f16, want.f16}, std::pair{got.bf16, want.bf16}}) {
      EXPECT_EQ(a.zero, b.zero);
      EXPECT_EQ(a.subnormal, b.subnormal);
      EXPECT_EQ(a.overflow, b.overflow);
    }
  }
  EXPECT_GT(plain.total.f16.zero, 0) << "the scale puts some values below f16's range";
  EXPECT_GT(plain.total.f16.subnormal, 0);
  // Each rank holds a part of fc1.weight (rank 0 its first 1107 of 2048 elements): its own
  // count is not the whole one, which plain data parallel's rank holds.
  auto fc1 = std::ranges::find(plain.rows, "fc1.weight", &mt::GradientHealthRow::name);
  ASSERT_NE(fc1, plain.rows.end());
  EXPECT_EQ(plain_local.total.nonzero, fc1->nonzero);
  EXPECT_LT(zero_local.total.nonzero, fc1->nonzero);
  EXPECT_GT(zero_local.total.nonzero, 0);
  if (mt::dist::rank() == 1) {
    EXPECT_EQ(zero_path, "");
    EXPECT_EQ(plain_path, "");
  } else {
    EXPECT_NE(zero_path, "");
  }
  mt::all_reduce(mt::scalar(1.0, mt::f64)).item();  // both writers are gone
  for (const std::string& dir : {zero_dir, plain_dir}) {
    auto files = std::distance(std::filesystem::directory_iterator(dir),
                               std::filesystem::directory_iterator());
    EXPECT_EQ(files, 1) << dir;
  }
  // Asked to, every process writes a file of its own.
  const std::string own_dirs[] = {job_file("logs_own_0"), job_file("logs_own_1")};
  EXPECT_NE(mt::SummaryWriter(own_dirs[mt::dist::rank()], {.every_process = true}).path(), "");
}

// Inside no_sync a ZeRO rank's gradients are its own whole local ones, not shards: the health
// and the norm count them as they are, as plain data parallel's no_sync gradients are (adding
// the ranks' counts gave up to twice the elements); the backward after folds them in and
// shards them again.
TEST_F(Zero, InsideNoSyncTheGradientsAreCountedAsEachRankHoldsThem) {
  mt::manual_seed(7);
  Net net;
  mt::dist::DataParallel ddp(net);
  mt::dist::ZeroAdamW opt(net.parameters());
  mt::NamedTensors grads;
  auto local_health = [&] {
    grads.clear();
    for (const auto& [name, p] : net.named_parameters()) grads.emplace_back(name, p.grad());
    return mt::gradient_health(grads, 1e-4);
  };
  const int64_t first = mt::dist::rank() * kBatch;
  {
    auto guard = ddp.no_sync();
    auto [x, y] = batch(0, first, kBatch);
    mt::cross_entropy(net(x), y).backward();
    mt::GradientHealth health = mt::gradient_health(net, 1e-4), local = local_health();
    EXPECT_EQ(health.total.nonzero, local.total.nonzero);
    EXPECT_EQ(health.total.f16.zero, local.total.f16.zero);
    EXPECT_GT(local.total.nonzero, local.total.numel / 2) << "whole local gradients, no shard";
    double squares = 0;
    for (const auto& [name, g] : grads)
      for (float v : mt::cast(g, mt::f32).to_vector<float>()) squares += double(v) * v;
    EXPECT_NEAR(mt::grad_norm(net.parameters()).item(), std::sqrt(squares),
                1e-5 * std::sqrt(squares));
  }
  auto [x, y] = batch(0, first, kBatch);
  mt::cross_entropy(net(x), y).backward();
  EXPECT_LT(local_health().total.nonzero, mt::gradient_health(net, 1e-4).total.nonzero)
      << "sharded again: the whole gradients' count is more than this rank's shards";
}

TEST_F(Zero, EachRankKeepsHalfTheOptimizerState) {
  auto [plain_estimate, plain] = state_bytes(false);
  auto [zero_estimate, zero] = state_bytes(true);
  EXPECT_EQ(plain, 2 * 4 * 2213) << "AdamW: two f32 tensors per parameter";
  EXPECT_EQ(zero_estimate, zero);
  // One rank holds one padding element, which has no state: the two shards add up to the whole.
  mt::Tensor both = mt::all_reduce(mt::scalar(static_cast<double>(zero), mt::f64));
  EXPECT_EQ(both.item(), static_cast<double>(plain));
  EXPECT_LE(std::abs(zero - plain / 2), 2 * 4) << "half, give or take one padding element";
  if (mt::dist::rank() == 0)
    std::printf("optimizer state per rank: %ld of %ld bytes\n", zero, plain);
}

// RMSprop (centered, with momentum and weight decay), Adagrad (a decaying rate and a starting sum)
// and Lion (decoupled weight decay) are sharded as AdamW is: twenty steps equal plain data
// parallel's (the clipping norm one the gradients never reach, as for AdamW: the first two divide
// by the gradients' size and Lion takes their sign, so the gradients must be the same bits);
// each rank keeps half the state, which memory_report estimates before the first step; a
// checkpoint ZeRO saved (the shards gathered) resumes two ranks bit for bit, and one process
// with the plain rule along the same curve.
TEST_F(Zero, RMSpropAdagradAndLionAreShardedAsAdamWIs) {
  const std::string path = job_file("rules_checkpoint.safetensors");
  for (auto [rule, name, copies] :
       {std::tuple{Rule::rmsprop, "RMSprop", 3}, std::tuple{Rule::adagrad, "Adagrad", 1},
        std::tuple{Rule::lion, "Lion", 1}}) {
    SCOPED_TRACE(name);
    Outcome zero = train({.rule = rule, .max_norm = 1e3, .save_at = 10, .path = path});
    Outcome plain = train({.kind = Kind::data_parallel, .rule = rule, .max_norm = 1e3});
    EXPECT_LE(worst_difference(zero.params, plain.params), 1e-6);
    EXPECT_LE(worst_difference(as_floats(zero.losses), as_floats(plain.losses)), 1e-6);
    Outcome two = train({.rule = rule, .max_norm = 1e3, .first_step = 10, .load = path});
    EXPECT_EQ(two.params, zero.params) << "the same world size resumes bit for bit";
    Outcome one =
        train({.kind = Kind::alone, .rule = rule, .max_norm = 1e3, .first_step = 10, .load = path});
    std::vector<double> tail(zero.losses.begin() + 10, zero.losses.end());
    EXPECT_LE(worst_difference(as_floats(one.losses), as_floats(tail)), 1e-5);
    auto [plain_estimate, plain_bytes] = state_bytes(false, rule);
    auto [zero_estimate, zero_bytes] = state_bytes(true, rule);
    EXPECT_EQ(plain_bytes, copies * 4 * 2213);
    EXPECT_EQ(plain_estimate, plain_bytes);
    EXPECT_EQ(zero_estimate, zero_bytes);
    EXPECT_LE(std::abs(zero_bytes - plain_bytes / 2), copies * 4) << "half, give or take padding";
  }
}

// A bf16 model under ZeRO, under the pure-bf16 policy: each rank keeps f32 masters of its shard.
// Twenty steps equal plain data parallel's on the f32 model (whose parameters are the masters,
// which the policy rounds where it reads them) reducing its gradients in bf16, as ZeRO reduces
// the bf16 model's: bit for bit, the bf16 parameters the masters' rounding. A checkpoint ZeRO
// saved resumes two ranks bit for bit, so the masters are in it. Each rank keeps half of
// AdamW's state and of the masters (3 f32 values per parameter over 2 ranks).
TEST_F(Zero, ABf16ModelKeepsF32MasterShards) {
  const std::string path = job_file("bf16_checkpoint.safetensors");
  Outcome zero = train({.pure_bf16 = true, .max_norm = 1e3, .save_at = 10, .path = path});
  Outcome plain = train({.kind = Kind::data_parallel, .pure_bf16 = true, .max_norm = 1e3});
  EXPECT_EQ(zero.params, rounded_to(plain.params, mt::bf16));
  EXPECT_NE(zero.params, plain.params) << "the f32 model's parameters are not all bf16 values";
  EXPECT_EQ(zero.losses, plain.losses);
  Outcome two = train({.pure_bf16 = true, .max_norm = 1e3, .first_step = 10, .load = path});
  EXPECT_EQ(two.params, zero.params) << "the same world size resumes bit for bit";
  mt::manual_seed(7);
  Net net;
  net.to(mt::bf16);
  mt::dist::DataParallel ddp(net);
  mt::dist::ZeroAdamW opt(net.parameters());
  auto [x, y] = batch(0, mt::dist::rank() * kBatch, kBatch);
  mt::Tensor loss = mt::cross_entropy(net(x), y);
  loss.backward();
  const int64_t bytes = mt::memory_report(net, &opt, loss).optimizer_state;
  EXPECT_LE(std::abs(bytes - 3 * 4 * 2213 / 2), 3 * 4) << "half, give or take padding";
}

// Both ranks wait here until both have arrived.
void barrier() { mt::all_reduce(mt::scalar(1.0, mt::f64)).item(); }

// Rewrites the JSON index of the sharded save in `dir` through `edit`, without its checksum: an
// index as earlier versions wrote it, which loads unverified, so that the checks behind the
// checksum see the edits.
void edit_index(const std::string& dir, const std::function<void(mt::json::Value&)>& edit) {
  const std::string path = dir + "/checkpoint.safetensors.index.json";
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  mt::json::Value index = mt::json::parse(text);
  index.erase("checksum");
  edit(index);
  std::ofstream(path) << mt::json::dump(index);
}

// `from`, a two-process sharded save, rewritten into `to` as a save of `files` files whose first
// holds every entry (each optimizer state listed as a piece of one part) and the others none:
// one process's save that shards its state as ZeRO does (files = 1), or a two-process save cut
// otherwise than this run's ZeRO cuts it (files = 2). Each process reads its pieces from an offset
// of its own.
void all_in_the_first_file(const std::string& from, const std::string& to, int files) {
  auto file_name = [&](int q) {
    return fmt::format("checkpoint-{:05d}-of-{:05d}.safetensors", q + 1, files);
  };
  // Written with the names of earlier versions (no save id), which are still read.
  mt::safetensors::File first = mt::safetensors::read(shard_file(from, 0, 2));
  mt::safetensors::File second = mt::safetensors::read(shard_file(from, 1, 2));
  mt::safetensors::File all;
  for (mt::safetensors::File* file : {&first, &second})
    for (mt::safetensors::TensorData& data : file->tensors) {
      mt::safetensors::TensorData* have = nullptr;
      for (mt::safetensors::TensorData& t : all.tensors)
        if (t.name == data.name) have = &t;
      if (!have) {
        all.tensors.push_back(data);
        continue;
      }
      // A state's second part, after its first: the parts are in rank order.
      have->bytes.insert(have->bytes.end(), data.bytes.begin(), data.bytes.end());
      have->shape = {have->shape.at(0) + data.shape.at(0)};
    }
  std::filesystem::create_directories(to);
  for (int q = 0; q < files; ++q) {
    mt::safetensors::File file;
    if (q == 0) file.tensors = all.tensors;
    file.metadata = first.metadata;
    for (auto& [key, value] : file.metadata) {
      if (key == "world_size") value = std::to_string(files);
      if (key == "rank") value = std::to_string(q);
    }
    mt::safetensors::write(to + "/" + file_name(q), file);
  }
  std::filesystem::copy_file(from + "/checkpoint.safetensors.index.json",
                             to + "/checkpoint.safetensors.index.json");
  edit_index(to, [&](mt::json::Value& index) {
    index["metadata"]["world_size"] = files;
    for (auto& [name, file] : index["weight_map"].items()) file = file_name(0);
    for (auto& [name, piece] : index["pieces"].items()) {
      int64_t elements = 1;
      for (const auto& size : piece["shape"]) elements *= size.get<int64_t>();
      piece["files"] =
          mt::json::Value::array({mt::json::Value::array({file_name(0), 0, elements})});
    }
  });
}

// Adafactor's factored statistics need whole matrices, so ZeroAdafactor shards whole
// parameters: fc1.weight, 2048 of the 2213 elements, on rank 0, the rest on rank 1. Twenty steps
// equal plain data parallel's; the two ranks' state adds up to the plain run's; a
// checkpoint saved at step 10, ordinary (the state gathered from its holders) or sharded,
// resumes two ranks bit for bit and one process with the plain Adafactor along the same curve.
TEST_F(Zero, AdafactorShardsWholeParameters) {
  const std::string path = job_file("adafactor_checkpoint.safetensors");
  const std::string dir = job_file("adafactor_sharded");
  const Options zero_run{.rule = Rule::adafactor, .max_norm = 1e3};
  Options saving = zero_run;
  saving.save_at = 10;
  saving.path = path;
  Outcome zero = train(saving);
  Options plain_run = zero_run;
  plain_run.kind = Kind::data_parallel;
  Outcome plain = train(plain_run);
  // Adafactor's row, column and RMS sums run in other kernels than plain data parallel's, whose
  // sums may add in another order: to f32 reduction-order rounding.
  EXPECT_LE(worst_difference(zero.params, plain.params), 1e-6);
  EXPECT_LE(worst_difference(as_floats(zero.losses), as_floats(plain.losses)), 1e-6);
  std::vector<double> tail(zero.losses.begin() + 10, zero.losses.end());
  for (bool sharded : {false, true}) {
    SCOPED_TRACE(sharded ? "sharded checkpoint" : "checkpoint");
    Options resume = zero_run;
    resume.first_step = 10;
    resume.load = sharded ? dir : path;
    resume.sharded = sharded;
    if (sharded) {
      Options save = zero_run;
      save.last_step = save.save_at = 10;
      save.path = dir;
      save.sharded = true;
      train(save);
    }
    EXPECT_EQ(train(resume).params, zero.params) << "the same world size resumes bit for bit";
    resume.kind = Kind::alone;
    EXPECT_LE(worst_difference(as_floats(train(resume).losses), as_floats(tail)), 1e-5);
    // ZeroAdafactor in one process holds every parameter: it takes all the whole tensors.
    resume.kind = Kind::zero_alone;
    EXPECT_LE(worst_difference(as_floats(train(resume).losses), as_floats(tail)), 1e-5);
    if (sharded) {
      // The same tensors in one file of another world size, cut again at two processes: each
      // takes the whole tensors it holds and none of the others'.
      const std::string one_file = job_file("adafactor_one_file");
      if (mt::dist::rank() == 0) all_in_the_first_file(dir, one_file, 1);
      barrier();
      resume.kind = Kind::zero;
      resume.load = one_file;
      EXPECT_EQ(train(resume).params, zero.params) << "the same state, read as shards";
    }
  }
  auto [plain_estimate, plain_bytes] = state_bytes(false, Rule::adafactor);
  auto [zero_estimate, zero_bytes] = state_bytes(true, Rule::adafactor);
  EXPECT_EQ(plain_estimate, plain_bytes);
  EXPECT_EQ(zero_estimate, zero_bytes);
  EXPECT_LT(zero_bytes, plain_bytes);
  mt::Tensor both = mt::all_reduce(mt::scalar(static_cast<double>(zero_bytes), mt::f64));
  EXPECT_EQ(both.item(), static_cast<double>(plain_bytes));
}

// Whole parameters go largest first to the process holding the fewest elements, as PyTorch's
// ZeroRedundancyOptimizer places them: sizes 3, 4 and 3 make runs of 4 and 6 elements (cut
// evenly in the optimizer's order they made 7 and 3), laid out in another order than the
// optimizer's. Three steps equal plain data parallel's Adafactor.
TEST_F(Zero, AdafactorPlacesTheLargestParameterFirst) {
  struct Three : mt::Module {
    mt::Tensor a, b, c;
    Three() {
      a = register_parameter("a", mt::full({3}, 0.5));
      b = register_parameter("b", mt::full({2, 2}, -0.25));
      c = register_parameter("c", mt::full({3}, 0.75));
    }
  };
  const int rank = mt::dist::rank();
  auto train_three = [&](bool zero) {
    Three net;
    mt::dist::DataParallel ddp(net);
    std::unique_ptr<mt::Optimizer> opt = make_optimizer(Rule::adafactor, zero, net.parameters());
    if (zero) {
      const mt::dist::ZeroShards& shards = dynamic_cast<mt::dist::ZeroOptimizer&>(*opt).shards();
      EXPECT_EQ(shards.groups().at(0).shard, 6);
      EXPECT_EQ(shards.held(1).second - shards.held(1).first, rank == 0 ? 4 : 0) << "b";
      EXPECT_EQ(shards.held(0).second - shards.held(0).first, rank == 1 ? 3 : 0) << "a";
      EXPECT_EQ(shards.held(2).second - shards.held(2).first, rank == 1 ? 3 : 0) << "c";
    }
    for (int s = 0; s < 3; ++s) {
      opt->zero_grad();
      mt::Tensor loss = mt::sum(mt::square(net.a * (rank + 1.0))) + mt::sum(net.b * net.b * net.b) +
                        mt::sum(net.c * (s + 1.0));
      loss.backward();
      opt->step();
    }
    return flat_parameters(net);
  };
  std::vector<float> zero = train_three(true), plain = train_three(false);
  EXPECT_NE(zero.front(), 0.5f) << "the steps moved a";
  EXPECT_NE(zero.back(), 0.75f) << "the steps moved c";
  EXPECT_LE(worst_difference(zero, plain), 1e-6);
}

// Zero-element parameters under whole-parameter shards: one placed after the last rank's full
// run, which no rank holds, and a dtype of nothing else. They train, and the state gathers.
TEST_F(Zero, AdafactorTakesZeroElementParameters) {
  struct Odd : mt::Module {
    mt::Tensor a, b, none, half_none;
    Odd() {
      a = register_parameter("a", mt::ones({2, 5}));
      b = register_parameter("b", mt::ones({10}));
      none = register_parameter("none", mt::ones({0}));
      half_none = register_parameter("half_none", mt::ones({0}, mt::bf16));
    }
  } net;
  mt::dist::DataParallel ddp(net);
  mt::dist::ZeroAdafactor opt(net.parameters(), {.beta1 = 0.9});
  for (int s = 0; s < 2; ++s) {
    opt.zero_grad();
    mt::Tensor loss = mt::sum(mt::square(net.a)) + mt::sum(net.b * 0.5) + mt::sum(net.none) +
                      mt::sum(mt::cast(net.half_none, mt::f32));
    loss.backward();
    opt.step();
  }
  std::unique_ptr<mt::Optimizer> whole = opt.gathered();
  EXPECT_EQ(whole->steps_taken(), 2);
  EXPECT_EQ(whole->state(0).size(), 3u) << "a: exp_avg, exp_avg_sq_row, exp_avg_sq_col";
  EXPECT_EQ(whole->state(1).size(), 2u) << "b: exp_avg, exp_avg_sq";
  EXPECT_TRUE(whole->state(2).empty());
  EXPECT_TRUE(whole->state(3).empty());
  EXPECT_NE(net.a.to_vector<float>(), std::vector<float>(10, 1.0f)) << "the step moved a";
}

TEST_F(Zero, CheckpointsResumeAtTwoRanksAndAtOne) {
  const std::string path = job_file("zero_checkpoint.safetensors");
  Outcome uninterrupted = train({.save_at = 10, .path = path});
  // The file is an ordinary checkpoint of the whole state, written by rank 0.
  Outcome two = train({.first_step = 10, .load = path});
  EXPECT_EQ(two.params, uninterrupted.params) << "the same world size resumes bit for bit";
  std::vector<double> tail(uninterrupted.losses.begin() + 10, uninterrupted.losses.end());
  EXPECT_EQ(two.losses, tail);
  // One process at both ranks' rows, with the plain AdamW, goes on along the same curve (to
  // the rounding of its other reduction order).
  Outcome one = train({.kind = Kind::alone, .first_step = 10, .load = path});
  EXPECT_LE(worst_difference(as_floats(one.losses), as_floats(tail)), 1e-5);
  EXPECT_LE(worst_difference(one.params, uninterrupted.params), 1e-5);
  // And ZeRO takes the shards of a checkpoint that plain data parallel wrote.
  const std::string plain_path = job_file("plain_checkpoint.safetensors");
  train({.kind = Kind::data_parallel, .last_step = 10, .save_at = 10, .path = plain_path});
  Outcome from_plain = train({.first_step = 10, .load = plain_path});
  EXPECT_LE(worst_difference(from_plain.params, uninterrupted.params), 1e-6);
}

TEST_F(Zero, ShardedCheckpointsResumeAtTwoRanksBitForBitAndAtOne) {
  const std::string dir = job_file("sharded_checkpoint");
  Outcome uninterrupted = train({.save_at = 10, .path = dir, .sharded = true});
  EXPECT_TRUE(std::filesystem::exists(dir + "/checkpoint.safetensors.index.json"));
  EXPECT_NE(shard_file(dir, 0, 2), "");
  EXPECT_NE(shard_file(dir, 1, 2), "");
  Outcome two = train({.first_step = 10, .load = dir, .sharded = true});
  EXPECT_EQ(two.params, uninterrupted.params) << "the same world size resumes bit for bit";
  std::vector<double> tail(uninterrupted.losses.begin() + 10, uninterrupted.losses.end());
  EXPECT_EQ(two.losses, tail);
  // One process reads both files and the plain AdamW takes the reassembled state.
  Outcome one = train({.kind = Kind::alone, .first_step = 10, .load = dir, .sharded = true});
  EXPECT_LE(worst_difference(as_floats(one.losses), as_floats(tail)), 1e-5);
  EXPECT_LE(worst_difference(one.params, uninterrupted.params), 1e-5);
  // Plain data parallel at two ranks reassembles ZeRO's shards too; and ZeRO cuts the state
  // that plain data parallel saved whole into its shards.
  Outcome plain =
      train({.kind = Kind::data_parallel, .first_step = 10, .load = dir, .sharded = true});
  EXPECT_LE(worst_difference(plain.params, uninterrupted.params), 1e-6);
  const std::string plain_dir = job_file("plain_sharded_checkpoint");
  train({.kind = Kind::data_parallel,
         .last_step = 10,
         .save_at = 10,
         .path = plain_dir,
         .sharded = true});
  Outcome from_plain = train({.first_step = 10, .load = plain_dir, .sharded = true});
  EXPECT_LE(worst_difference(from_plain.params, uninterrupted.params), 1e-6);
}

// A ZeRO run takes its shards of a sharded save made at another world size, reading the files
// in turn and keeping only the elements its shard holds: 2 processes' files into one process,
// and one process's file into 2 (each process copying its elements from its own offset). Each
// continues the run it resumes. A one-process ZeRO save, which keeps its state whole, loads at
// 2 processes too.
TEST_F(Zero, ShardedCheckpointsMoveBetweenWorldSizesAsShards) {
  const std::string dir = job_file("resharded_from_two");
  Outcome uninterrupted = train({.save_at = 10, .path = dir, .sharded = true});
  Outcome one = train({.kind = Kind::zero_alone, .first_step = 10, .load = dir, .sharded = true});
  EXPECT_LE(worst_difference(one.params, uninterrupted.params), 1e-5);

  const std::string one_file = job_file("resharded_one_file");
  if (mt::dist::rank() == 0) all_in_the_first_file(dir, one_file, 1);
  barrier();
  Outcome two = train({.first_step = 10, .load = one_file, .sharded = true});
  EXPECT_EQ(two.params, uninterrupted.params) << "the same state, cut again, resumes bit for bit";
  // At the same world size, a save cut otherwise than this run's ZeRO cuts it: each process
  // takes its shards from the files as at another world size.
  const std::string other_cut = job_file("resharded_other_cut");
  if (mt::dist::rank() == 0) all_in_the_first_file(dir, other_cut, 2);
  barrier();
  Outcome recut = train({.first_step = 10, .load = other_cut, .sharded = true});
  EXPECT_EQ(recut.params, uninterrupted.params) << "the same state, in other files";

  const std::string single = job_file("resharded_from_one");
  job_file("resharded_from_one_rank1");  // rank 1's own one-process save, which nothing reads
  Outcome alone = train({.kind = Kind::zero_alone, .save_at = 10, .path = single, .sharded = true});
  barrier();  // rank 0's files are written before rank 1 reads them
  Outcome from_alone = train({.first_step = 10, .load = single, .sharded = true});
  EXPECT_LE(worst_difference(from_alone.params, alone.params), 1e-5);
  std::vector<double> tail(alone.losses.begin() + 10, alone.losses.end());
  EXPECT_LE(worst_difference(as_floats(from_alone.losses), as_floats(tail)), 1e-5);
}

TEST_F(Zero, AnotherModelOrACorruptShardOrAnotherSavesIndexIsAnErrorOnEveryRank) {
  const std::string dir = job_file("refused_sharded"), other_dir = job_file("other_sharded");
  const int rank = mt::dist::rank();
  mt::manual_seed(7);
  Net net;
  mt::dist::DataParallel ddp(net);
  mt::dist::ZeroAdamW opt(net.parameters());
  auto [x, y] = batch(0, rank * kBatch, kBatch);
  mt::cross_entropy(net(x), y).backward();
  opt.step();  // so that each rank's file holds its shards of the state
  mt::dist::save_checkpoint_sharded(dir, net, &opt);
  mt::dist::save_checkpoint_sharded(other_dir, net, &opt);
  const std::vector<float> before = flat_parameters(net);

  struct Other : mt::Module {
    mt::Linear fc1{kFeatures, 8};
    Other() { register_module("fc1", fc1); }
  };
  Other other;
  mt::AdamW other_opt(other.parameters());
  EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(dir, other, &other_opt), "another model",
                  "the module has fc1.weight [8, 64] f32");

  // The last byte of rank 1's file, a tensor's: its checksum fails. Rank 0 reads only its own
  // file, and hears of rank 1's failure.
  const std::string second = shard_file(dir, 1, 2);
  ASSERT_NE(second, "");
  barrier();
  if (rank == 1) {
    std::fstream file(second, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-1, std::ios::end);
    char last = 0;
    file.get(last);
    file.seekp(-1, std::ios::end);
    file.put(static_cast<char>(last ^ 0x5a));
  }
  barrier();
  EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(dir, net, &opt), "-00002-of-00002.safetensors");
  if (rank == 0) {
    EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(dir, net, &opt), "process 1 failed");
  } else {
    EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(dir, net, &opt), "is corrupt");
  }
  // At one process every file is read, so the corrupt one fails there too.
  {
    std::shared_ptr<mt::ProcessGroup> group = mt::exchange_process_group(nullptr);
    mt::AdamW alone(net.parameters());
    EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(dir, net, &alone), "is corrupt");
    mt::dist::ZeroAdamW zero_alone(net.parameters());  // reads the files in turn
    EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(dir, net, &zero_alone), "is corrupt");
    mt::exchange_process_group(group);
  }
  barrier();
  if (rank == 0) std::filesystem::remove(second);
  barrier();
  EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(dir, net, &opt), "-00002-of-00002.safetensors");

  // An index whose parts of a state are cut elsewhere than its files are: each part's file
  // holds another number of elements than the index says, at the saved world size and at 1.
  const std::string moved_dir = job_file("moved_cut_sharded");
  mt::dist::save_checkpoint_sharded(moved_dir, net, &opt);
  if (rank == 0)
    edit_index(moved_dir, [](mt::json::Value& index) {
      mt::json::Value& files = index["pieces"]["optimizer.fc1.weight.exp_avg"]["files"];
      ASSERT_EQ(files.size(), 2u);
      files[0][2] = files[0][2].get<int64_t>() + 1;
      files[1][1] = files[1][1].get<int64_t>() + 1;
    });
  barrier();
  EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(moved_dir, net, &opt), "fc1.weight.exp_avg");
  {
    WithoutProcessGroup alone;
    mt::dist::ZeroAdamW zero_alone(net.parameters());
    EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(moved_dir, net, &zero_alone),
                    "'optimizer.fc1.weight.exp_avg' holds");
  }
  // And a state whose shape in the index is not its parameter's (here 2^62 + 1 elements, whose
  // bytes would overflow a size): refused before any file is read. Both processes have read the
  // index before process 0 rewrites it.
  barrier();
  if (rank == 0)
    edit_index(moved_dir, [](mt::json::Value& index) {
      index["pieces"]["optimizer.fc1.weight.exp_avg"]["shape"] =
          mt::json::Value::array({(int64_t{1} << 62) + 1});
    });
  barrier();
  {
    WithoutProcessGroup alone;
    mt::dist::ZeroAdamW zero_alone(net.parameters());
    EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(moved_dir, net, &zero_alone),
                    "'optimizer.fc1.weight.exp_avg' has shape [4611686018427387905] in the index",
                    "keeps [32, 64]");
  }

  // The other save's index over this one's files: the files are not of the save it describes.
  if (rank == 0)
    std::filesystem::copy_file(other_dir + "/checkpoint.safetensors.index.json",
                               dir + "/checkpoint.safetensors.index.json",
                               std::filesystem::copy_options::overwrite_existing);
  barrier();
  EXPECT_MT_ERROR(mt::dist::load_checkpoint_sharded(dir, net, &opt), "checkpoint id");
  EXPECT_EQ(flat_parameters(net), before);
  EXPECT_EQ(opt.steps_taken(), 1);
  // And the intact save loads.
  mt::dist::load_checkpoint_sharded(other_dir, net, &opt);
  EXPECT_EQ(flat_parameters(net), before);
}

TEST_F(Zero, AnotherModelsCheckpointIsAnErrorOnEveryRank) {
  const std::string other_path = job_file("other_model.safetensors");
  struct Other : mt::Module {
    mt::Linear fc1{kFeatures, 8};
    Other() { register_module("fc1", fc1); }
  };
  Other other;
  mt::AdamW other_opt(other.parameters());
  mt::dist::save_checkpoint(other_path, other, &other_opt);
  mt::manual_seed(7);
  Net net;
  mt::dist::DataParallel ddp(net);
  mt::dist::ZeroAdamW opt(net.parameters());
  const std::string path = job_file("own_model.safetensors");
  mt::dist::save_checkpoint(path, net, &opt);
  const std::vector<float> before = flat_parameters(net);
  EXPECT_MT_ERROR(mt::dist::load_checkpoint(other_path, net, &opt),
                  "group 0 of the file has 2 parameters, the optimizer's has 5");
  // A file that only rank 1 cannot read is an error on rank 0 too, naming the process.
  const std::string mine = mt::dist::rank() == 1 ? path + ".missing" : path;
  EXPECT_MT_ERROR(mt::dist::load_checkpoint(mine, net, &opt), ".missing");
  try {
    mt::dist::load_checkpoint(mine, net, &opt);
  } catch (const mt::Error& e) {
    if (mt::dist::rank() == 0) {
      EXPECT_NE(std::string(e.what()).find("process 1"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(flat_parameters(net), before);
  EXPECT_EQ(opt.steps_taken(), 0);
}

// Rank 0's bytes of `values`, compared with this rank's.
bool same_as_rank0(std::vector<float> values) {
  std::vector<float> rank0 = values;
  mt::process_group()->broadcast(reinterpret_cast<std::byte*>(rank0.data()),
                                 static_cast<int64_t>(rank0.size() * sizeof(float)), 0);
  return rank0 == values;
}

// ZeRO over every parameter beside DataParallel (the README's pattern) leaves DataParallel no
// gradient to reduce; the running statistics are still rank 0's after every step.
TEST_F(Zero, BatchNormBuffersFollowRankZeroWhenZeroShardsEveryParameter) {
  struct BnNet : mt::Module {
    mt::Linear l1{5, 4}, l2{4, 2};
    mt::BatchNorm1d bn{4};
    BnNet() {
      register_module("l1", l1);
      register_module("bn", bn);
      register_module("l2", l2);
    }
  };
  mt::manual_seed(1);
  BnNet net;
  mt::dist::DataParallel ddp(net);
  mt::dist::ZeroAdamW opt(net.parameters(), {.lr = 1e-2});
  for (int s = 0; s < 3; ++s) {
    mt::Generator gen(100 + s * 10 + mt::dist::rank());  // each rank its own batch
    mt::Tensor x = mt::randn({8, 5}, mt::f32, &gen);
    opt.zero_grad();
    mt::Tensor y = net.l2(mt::relu(net.bn(net.l1(x))));
    mt::mean(y * y).backward();
    opt.step();
    EXPECT_TRUE(same_as_rank0(net.l1.weight.to_vector<float>())) << "step " << s;
    EXPECT_TRUE(same_as_rank0(net.bn.running_mean.to_vector<float>())) << "step " << s;
    EXPECT_TRUE(same_as_rank0(net.bn.running_var.to_vector<float>())) << "step " << s;
  }
}

// A first parameter of no elements has no state; the gathered state and the checkpoint keep
// every other parameter's, as a plain AdamW has it.
TEST_F(Zero, AnEmptyFirstParameterLeavesTheOthersStateInTheGatheredCheckpoint) {
  struct Small : mt::Module {
    mt::Tensor e, w, b;
    Small() {
      mt::Generator gen(3);
      e = register_parameter("e", mt::zeros({0}));
      w = register_parameter("w", mt::randn({5, 3}, mt::f32, &gen));
      b = register_parameter("b", mt::randn({3}, mt::f32, &gen));
    }
    mt::Tensor loss(const mt::Tensor& x) const {
      mt::Tensor y = mt::matmul(x, w) + b;
      return mt::mean(y * y) + mt::sum(e);
    }
  };
  Small plain_net, zero_net;
  mt::dist::DataParallel plain_ddp(plain_net), zero_ddp(zero_net);
  mt::AdamW plain(plain_net.parameters(), {.lr = 1e-2});
  mt::dist::ZeroAdamW zero(zero_net.parameters(), {.lr = 1e-2});
  for (int s = 0; s < 3; ++s) {
    mt::Generator gen(100 + s * 10 + mt::dist::rank());
    mt::Tensor x = mt::randn({4, 5}, mt::f32, &gen);
    plain.zero_grad();
    plain_net.loss(x).backward();
    plain.step();
    zero.zero_grad();
    zero_net.loss(x).backward();
    zero.step();
  }
  const std::string path = job_file("empty_first.safetensors");
  mt::dist::save_checkpoint(path, zero_net, &zero);
  Small loaded_net;
  mt::AdamW loaded(loaded_net.parameters(), {.lr = 1e-2});
  mt::dist::load_checkpoint(path, loaded_net, &loaded);
  // (The empty parameter itself has state of no elements in the plain AdamW and none under
  // ZeRO, which holds none of it: the same nothing.)
  for (size_t i = 1; i < 3; ++i) {
    const mt::NamedTensors want = plain.state(i), got = loaded.state(i);
    ASSERT_EQ(got.size(), want.size()) << "parameter " << i;
    for (size_t k = 0; k < want.size(); ++k) {
      EXPECT_EQ(got[k].first, want[k].first);
      EXPECT_EQ(got[k].second.to_vector<float>(), want[k].second.to_vector<float>())
          << "parameter " << i << " " << want[k].first;
    }
  }
  EXPECT_EQ(loaded.steps_taken(), 3);
}

// A head that no rank's backward reaches after the first step keeps no gradient, so AdamW leaves
// it alone (no weight decay, no momentum), as one process does and as PyTorch DDP's
// find_unused_parameters; under plain data parallel and under ZeRO.
TEST_F(Zero, AParameterNoRankReachedIsNotStepped) {
  struct Heads : mt::Module {
    mt::Linear body{5, 4}, head_a{4, 1}, head_b{4, 1};
    Heads() {
      register_module("body", body);
      register_module("head_a", head_a);
      register_module("head_b", head_b);
    }
    mt::Tensor loss(const mt::Tensor& x, bool use_b) const {
      mt::Tensor h = mt::relu(body(x));
      mt::Tensor y = use_b ? head_b(h) : head_a(h);
      return mt::mean(y * y);
    }
  };
  // 0: one process; 1: DataParallel; 2: DataParallel and ZeRO. Every rank takes the same batch,
  // so the average is exact.
  auto run = [](int kind) {
    mt::manual_seed(1);
    Heads net;
    std::optional<mt::dist::DataParallel> ddp;
    if (kind > 0) ddp.emplace(net);
    std::unique_ptr<mt::Optimizer> opt;
    if (kind == 2)
      opt = std::make_unique<mt::dist::ZeroAdamW>(net.parameters(), mt::AdamOptions{.lr = 1e-2});
    else
      opt = std::make_unique<mt::AdamW>(net.parameters(), mt::AdamOptions{.lr = 1e-2});
    for (int s = 0; s < 4; ++s) {
      mt::Generator gen(100 + s);
      mt::Tensor x = mt::randn({4, 5}, mt::f32, &gen);
      opt->zero_grad();
      net.loss(x, s == 0).backward();
      opt->step();
      if (s > 0) {
        EXPECT_FALSE(net.head_b.weight.grad().defined()) << "kind " << kind << " step " << s;
      }
    }
    return net.head_b.weight.to_vector<float>();
  };
  std::vector<float> alone;
  {
    auto group = mt::exchange_process_group(nullptr);
    alone = run(0);
    mt::exchange_process_group(group);
  }
  EXPECT_EQ(run(1), alone);
  EXPECT_EQ(run(2), alone);
}

// Processes that freeze different parameters would pair one's gradient with another's in the
// buckets: refused at construction, on every rank, naming the parameter.
TEST_F(Zero, ModelsThatFreezeDifferentParametersAreRefused) {
  mt::manual_seed(7);
  Net net;
  (mt::dist::rank() == 0 ? net.fc1.bias : net.temperature).requires_grad_(false);
  EXPECT_MT_ERROR(mt::dist::DataParallel ddp(net), "the models differ", "no_grad");
}

}  // namespace
