// tests/test_async_evaluation.cpp -- the CPU stream (runtime/cpu_stream.h): optimizer steps queued
// on a worker thread give the bits of synchronous steps, reads and writes between them see and
// keep the right values, failures are reported and never read as values, and a child made by
// fork() finds a working stream.
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "mixtape/mixtape.h"
#include "mixtape/runtime/cpu_stream.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

class AsyncScope {
 public:
  explicit AsyncScope(bool on) : previous_(mt::async_evaluation()) { mt::set_async_evaluation(on); }
  ~AsyncScope() { mt::set_async_evaluation(previous_); }

 private:
  bool previous_;
};

enum class Rule { sgd, adam, adamw };

std::unique_ptr<mt::Optimizer> make_optimizer(Rule rule, std::vector<mt::Tensor> params) {
  switch (rule) {
    case Rule::sgd:
      return std::make_unique<mt::SGD>(std::move(params),
                                       mt::SGDOptions{.lr = 0.05, .momentum = 0.9});
    case Rule::adam:
      return std::make_unique<mt::Adam>(std::move(params), mt::AdamOptions{.lr = 1e-2});
    case Rule::adamw:
      return std::make_unique<mt::AdamW>(std::move(params),
                                         mt::AdamOptions{.lr = 1e-2, .weight_decay = 0.1});
  }
  return nullptr;
}

// What a run of the training loop leaves: every parameter's and optimizer state's bits, and
// the losses of its steps.
struct Result {
  std::vector<std::vector<uint32_t>> params, state;
  std::vector<uint32_t> losses;
  int64_t queued = 0;  // evaluations queued on the stream
  bool operator==(const Result& other) const {
    return params == other.params && state == other.state && losses == other.losses;
  }
};

struct Options {
  Rule rule = Rule::adam;
  bool bf16 = false;
  int steps = 8;
  bool read_every_step = false;  // a parameter read back after each step
  bool schedule = false;         // set_lr before each step
  bool lazy_probe = false;       // a value built from the parameters before each step, read after
  int64_t batch = 16, width = 32;
};

Result train(bool async, const Options& o) {
  AsyncScope scope(async);
  mt::Generator gen(3);
  mt::MLP net({8, o.width, o.width, 4}, mt::Activation::Relu, &gen);
  std::unique_ptr<mt::Optimizer> opt = make_optimizer(o.rule, net.parameters());
  mt::Tensor x = mt::randn({o.batch, 8}, mt::f32, &gen), y = mt::randn({o.batch, 4}, mt::f32, &gen);
  Result result;
  std::vector<mt::Tensor> losses, probes;
  mt::reset_execution_stats();
  for (int step = 0; step < o.steps; ++step) {
    if (o.schedule) opt->set_lr(0.01 / (1 + step));
    if (o.lazy_probe) probes.push_back(mt::sum(net(x)));  // before the step: its parameters
    opt->zero_grad();
    mt::Tensor loss;
    {
      std::optional<mt::autocast> guard;
      if (o.bf16) guard.emplace(mt::autocast_policy(mt::bf16));
      loss = mt::mse_loss(net(x), y);
    }
    loss.backward();
    opt->step();
    losses.push_back(loss);
    if (o.read_every_step) result.losses.push_back(f32_bits(net.parameters()[0])[5]);
  }
  result.queued = mt::execution_stats().evaluations_queued;
  for (const mt::Tensor& loss : losses) result.losses.push_back(f32_bits(loss)[0]);
  for (const mt::Tensor& probe : probes) result.losses.push_back(f32_bits(probe)[0]);
  for (size_t i = 0; i < net.parameters().size(); ++i) {
    result.params.push_back(f32_bits(net.parameters()[i]));
    for (const auto& [name, value] : opt->state(i)) result.state.push_back(f32_bits(value));
  }
  return result;
}

TEST(AsyncEvaluation, QueuedStepsGiveTheBitsOfSynchronousOnes) {
  for (Rule rule : {Rule::sgd, Rule::adam, Rule::adamw})
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "rule " << static_cast<int>(rule) << " bf16 " << bf16);
      Options o{.rule = rule, .bf16 = bf16};
      Result sync = train(false, o), queued = train(true, o);
      EXPECT_EQ(sync.queued, 0);
      EXPECT_GE(queued.queued, o.steps - 1);  // every step but the first run of its program
      EXPECT_TRUE(queued == sync);
    }
}

// A product of 2^23 flops (256 x 128 x 128) runs on the OpenMP team, so with a team of two its
// step is not queued; with a team of one it runs on one thread either way, and is queued, with
// the bits of the synchronous steps.
TEST(AsyncEvaluation, ATeamOfOneQueuesLargerProducts) {
  const int threads = omp_get_max_threads();
  const Options o{.rule = Rule::adam, .steps = 4, .batch = 256, .width = 128};
  omp_set_num_threads(2);
  EXPECT_EQ(train(true, o).queued, 0);
  omp_set_num_threads(1);
  const Result sync = train(false, o), queued = train(true, o);
  omp_set_num_threads(threads);
  EXPECT_GE(queued.queued, o.steps - 1);
  EXPECT_TRUE(queued == sync);
}

TEST(AsyncEvaluation, ReadsBetweenStepsSeeEachStepsResult) {
  Options o{.read_every_step = true};
  Result sync = train(false, o), queued = train(true, o);
  EXPECT_GE(queued.queued, o.steps - 1);
  EXPECT_TRUE(queued == sync);
}

// set_lr writes the rate's buffer in place, which a queued step reads: it waits for that step.
TEST(AsyncEvaluation, ARateSetBetweenQueuedStepsTakesEffectAtTheNextStep) {
  for (Rule rule : {Rule::sgd, Rule::adam}) {
    Options o{.rule = rule, .schedule = true};
    Result sync = train(false, o), queued = train(true, o);
    EXPECT_GE(queued.queued, o.steps - 1);
    EXPECT_TRUE(queued == sync);
  }
}

// A value built from the parameters before a step and read after it is computed from the
// parameters it was built on, although the step that replaced them ran on the stream.
TEST(AsyncEvaluation, AValueBuiltBeforeAQueuedStepKeepsItsParameters) {
  Options o{.rule = Rule::sgd, .lazy_probe = true};
  Result sync = train(false, o), queued = train(true, o);
  EXPECT_GE(queued.queued, o.steps - 1);
  EXPECT_TRUE(queued == sync);
}

// A child made by fork() while steps were queued inherits their results, and queues its own
// steps on a stream of its own.
TEST(AsyncEvaluation, AForkedChildTrainsOnAStreamOfItsOwn) {
  AsyncScope scope(true);
  mt::Generator gen(5);
  mt::MLP net({8, 16, 4}, mt::Activation::Relu, &gen);
  mt::Adam opt(net.parameters(), mt::AdamOptions{.lr = 1e-2});
  mt::Tensor x = mt::randn({8, 8}, mt::f32, &gen), y = mt::randn({8, 4}, mt::f32, &gen);
  auto step = [&] {
    opt.zero_grad();
    mt::mse_loss(net(x), y).backward();
    opt.step();
  };
  for (int i = 0; i < 4; ++i) step();
  int ends[2];
  ASSERT_EQ(::pipe(ends), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // leaves by _exit alone: the parent's exit handlers are not the child's
    ::close(ends[0]);
    try {
      for (int i = 0; i < 3; ++i) step();
      std::vector<uint32_t> bits = f32_bits(net.parameters()[0]);
      ssize_t size = static_cast<ssize_t>(bits.size() * sizeof(uint32_t));
      ::_exit(::write(ends[1], bits.data(), static_cast<size_t>(size)) == size ? 0 : 1);
    } catch (...) {
      ::_exit(2);
    }
  }
  ::close(ends[1]);
  for (int i = 0; i < 3; ++i) step();
  std::vector<uint32_t> expected = f32_bits(net.parameters()[0]), got(expected.size());
  ssize_t size = static_cast<ssize_t>(got.size() * sizeof(uint32_t));
  // The child's write fits the pipe's buffer: it ends without a reader, and a child that hangs is
  // killed, and the test fails, instead of the read waiting forever.
  ASSERT_EQ(wait_for_child(child, std::chrono::seconds(60)), 0);
  EXPECT_EQ(::read(ends[0], got.data(), static_cast<size_t>(size)), size);
  ::close(ends[0]);
  EXPECT_EQ(got, expected);
}

// Work for the stream made by hand: writes `value` into `out` after reading `in`, or throws.
class Fill final : public mt::StreamWork {
 public:
  Fill(std::shared_ptr<mt::Storage> out, float value, std::shared_ptr<mt::Storage> in = nullptr)
      : value_(value) {
    if (in) read(in);
    out_ = reinterpret_cast<float*>(write(out));
    count_ = out->count;
  }
  bool fails = false;
  void run() override {
    if (fails) mt::fail("the test's work fails here");
    for (int64_t i = 0; i < count_; ++i) out_[i] = value_;
  }

 private:
  float value_;
  float* out_ = nullptr;
  int64_t count_ = 0;
};

float first_value(const mt::Storage& s) { return reinterpret_cast<const float*>(s.host_data())[0]; }

// A memory limit reached by a queued bf16 step is an mt::Error of that step and loses nothing:
// the copies its products read in bf16 were allocated on the stream's worker, whose failure
// marked every buffer the step writes (the parameters Adam updates in place) never computed,
// so that the model could no longer be read or saved.
TEST(AsyncEvaluation, AMemoryLimitReachedByAQueuedStepLosesNoParameter) {
  AsyncScope scope(true);
  mt::Generator gen(1);
  mt::MLP net({64, 256, 256, 4}, mt::Activation::Relu, &gen);
  mt::Adam opt(net.parameters(), mt::AdamOptions{.lr = 1e-2});
  mt::Tensor x = mt::randn({8, 64}, mt::f32, &gen), y = mt::randn({8, 4}, mt::f32, &gen);
  auto step = [&] {
    opt.zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(mt::autocast_policy(mt::bf16));
      loss = mt::mse_loss(net(x), y);
    }
    loss.backward();
    opt.step();
    return loss.item();
  };
  for (int i = 0; i < 3; ++i) step();
  mt::synchronize();
  const mt::HostMemoryStats before = mt::host_memory_stats();
  int failures = 0;
  for (double fraction : {0.1, 0.3, 0.6}) {
    mt::set_memory_limit(before.live_bytes +
                         static_cast<int64_t>(fraction * (before.peak_bytes - before.live_bytes)));
    for (int i = 0; i < 2; ++i) {
      try {
        step();
      } catch (const mt::Error& e) {
        ++failures;
        EXPECT_NE(std::string(e.what()).find("memory"), std::string::npos) << e.what();
      }
    }
    mt::set_memory_limit(0);
    for (const mt::Tensor& p : net.parameters()) EXPECT_TRUE(std::isfinite(mt::sum(p).item()));
    EXPECT_TRUE(std::isfinite(step()));
  }
  EXPECT_GT(failures, 0);
}

// A product whose operand failed work never computed is an error each time it is read: the
// synchronous product took its buffer as its value before reading the operand, and the second
// read summed the unwritten buffer into a number.
TEST(AsyncEvaluation, AProductOfAValueNeverComputedStaysAnErrorWhenReadAgain) {
  auto never = std::make_shared<mt::Storage>(mt::f32, 16);
  auto bad = std::make_unique<Fill>(never, 1.0f);
  bad->fails = true;
  mt::submit_to_cpu_stream(std::move(bad));
  EXPECT_MT_ERROR(mt::synchronize(), "the test's work fails here");
  mt::Tensor y = mt::sum(mt::matmul(mt::ones({2, 4}), mt::from_storage(never, {4, 4})));
  EXPECT_MT_ERROR(y.item(), "never computed");
  EXPECT_MT_ERROR(y.item(), "never computed");
}

// Work dropped without running (no worker thread could be started) leaves what it was to write
// never computed, for host reads and for work queued after it alike: the work after it read the
// unwritten buffer and its result passed for computed.
TEST(AsyncEvaluation, WorkDroppedUnrunLeavesItsValuesNeverComputedForLaterWork) {
  auto dropped = std::make_shared<mt::Storage>(mt::f32, 4);
  auto derived = std::make_shared<mt::Storage>(mt::f32, 4);
  { Fill never_run(dropped, 1.0f); }
  mt::submit_to_cpu_stream(std::make_unique<Fill>(derived, 2.0f, dropped));
  EXPECT_MT_ERROR(mt::synchronize(), "earlier failed work did not compute");
  EXPECT_MT_ERROR(first_value(*dropped), "never computed");
  EXPECT_MT_ERROR(first_value(*derived), "never computed");
}

TEST(AsyncEvaluation, AFailureIsReportedOnceAndWhatItLeftIsNeverReadAsAValue) {
  auto failed = std::make_shared<mt::Storage>(mt::f32, 4);
  auto derived = std::make_shared<mt::Storage>(mt::f32, 4);
  auto unrelated = std::make_shared<mt::Storage>(mt::f32, 4);
  auto bad = std::make_unique<Fill>(failed, 1.0f);
  bad->fails = true;
  mt::submit_to_cpu_stream(std::move(bad));
  mt::submit_to_cpu_stream(std::make_unique<Fill>(derived, 2.0f, failed));
  mt::submit_to_cpu_stream(std::make_unique<Fill>(unrelated, 3.0f));
  EXPECT_MT_ERROR(mt::synchronize(), "asynchronous CPU evaluation failed",
                  "the test's work fails here");
  mt::synchronize();  // reported once
  EXPECT_MT_ERROR(first_value(*failed), "never computed");
  EXPECT_MT_ERROR(first_value(*derived), "never computed");
  EXPECT_MT_ERROR(failed->host_data(), "never computed");  // writing it too
  EXPECT_EQ(first_value(*unrelated), 3.0f);
  // The stream goes on.
  mt::submit_to_cpu_stream(std::make_unique<Fill>(unrelated, 4.0f));
  EXPECT_EQ(first_value(*unrelated), 4.0f);
  EXPECT_MT_ERROR(first_value(*failed), "never computed");
}

// A failure of work one thread queued is reported to that thread, not to another thread that
// synchronizes first (whose own, unrelated work was computed); a setting changed while a
// failure waits to be reported takes effect as the failure is reported.
TEST(AsyncEvaluation, AFailureIsReportedToTheThreadThatQueuedTheWork) {
  auto failed = std::make_shared<mt::Storage>(mt::f32, 4);
  std::thread other([&] {
    auto bad = std::make_unique<Fill>(failed, 1.0f);
    bad->fails = true;
    mt::submit_to_cpu_stream(std::move(bad));
  });
  other.join();  // its failure stays unreported: the thread is gone
  auto mine = std::make_shared<mt::Storage>(mt::f32, 4);
  mt::submit_to_cpu_stream(std::make_unique<Fill>(mine, 5.0f));
  EXPECT_NO_THROW(mt::synchronize());
  EXPECT_EQ(first_value(*mine), 5.0f);
  EXPECT_MT_ERROR(first_value(*failed), "never computed");

  auto bad = std::make_unique<Fill>(mine, 1.0f);
  bad->fails = true;
  mt::submit_to_cpu_stream(std::move(bad));
  const bool was = mt::flush_denormal();
  EXPECT_MT_ERROR(mt::set_flush_denormal(!was), "the test's work fails here");
  EXPECT_EQ(mt::flush_denormal(), !was);
  mt::set_flush_denormal(was);
}

// A failed write marks its storage never computed once: each failed write added the mark again,
// and after 128 the count wrapped and the storage read as a value.
TEST(AsyncEvaluation, ManyFailedWritesLeaveTheValueNeverComputed) {
  auto failed = std::make_shared<mt::Storage>(mt::f32, 4);
  for (int i = 0; i < 130; ++i) {
    auto bad = std::make_unique<Fill>(failed, 1.0f);
    bad->fails = true;
    mt::submit_to_cpu_stream(std::move(bad));
    EXPECT_THROW(mt::synchronize(), mt::Error);
  }
  EXPECT_MT_ERROR(first_value(*failed), "never computed");
}

// Copies `in`'s first value into every element of `out`: over a large `out`, slowly enough for a
// host access that does not wait to be caught.
class Copy final : public mt::StreamWork {
 public:
  Copy(const std::shared_ptr<mt::Storage>& in, const std::shared_ptr<mt::Storage>& out)
      : in_(reinterpret_cast<const float*>(read(in))),
        out_(reinterpret_cast<float*>(write(out))),
        count_(out->count) {}
  void run() override {
    for (int64_t i = 0; i < count_; ++i) out_[i] = in_[0];
  }

 private:
  const float* in_;
  float* out_;
  int64_t count_;
};

// A host write to a buffer that queued work reads waits for that work; a read of one that
// queued work writes waits too.
TEST(AsyncEvaluation, HostAccessWaitsForTheWorkThatUsesTheBuffer) {
  auto source = std::make_shared<mt::Storage>(mt::f32, 1 << 20);
  auto target = std::make_shared<mt::Storage>(mt::f32, 1 << 20);
  for (int round = 0; round < 20; ++round) {
    reinterpret_cast<float*>(source->host_data())[0] = static_cast<float>(round);
    mt::submit_to_cpu_stream(std::make_unique<Copy>(source, target));
    reinterpret_cast<float*>(source->host_data())[0] = -1.0f;  // waits for the copy
    const float* out = reinterpret_cast<const float*>(target->host_data());
    EXPECT_EQ(out[0], static_cast<float>(round));
    EXPECT_EQ(out[target->count - 1], static_cast<float>(round));
  }
}

}  // namespace
