// tests/test_tiered_jit.cpp -- the JIT's two tiers: fast code at once, then the optimized object
// swapped in from the background; the same bits from both, only optimized objects in the kernel
// cache (a new process and the AOT packager get those), and a clean exit while tier-ups run.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "mixtape/codegen/kernel_cache.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/jit/background_worker.h"
#include "mixtape/jit/llvm_jit.h"
#include "mixtape/runtime/device.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

// Every run of this binary starts from an empty kernel cache of its own, so that its kernels are
// compiled (and tiered) rather than found on disk; the children it starts inherit it.
const std::filesystem::path cache_dir = [] {
  std::string dir = (std::filesystem::temp_directory_path() / "mixtape-tiered-XXXXXX").string();
  if (!::getenv("MIXTAPE_TIERED_TEST_CHILD")) {
    if (!::mkdtemp(dir.data())) std::abort();
    ::setenv("MIXTAPE_CACHE_DIR", dir.c_str(), 1);
    return std::filesystem::path(dir);
  }
  return std::filesystem::path(::getenv("MIXTAPE_CACHE_DIR"));
}();

class RemoveCacheDir : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!::getenv("MIXTAPE_TIERED_TEST_CHILD")) std::filesystem::remove_all(cache_dir);
  }
};
const auto* remove_cache_dir = ::testing::AddGlobalTestEnvironment(new RemoveCacheDir);

mt::LlvmJit& jit() { return mt::LlvmJit::instance(); }

// A kernel over rows of `width` floats: out[r] = the sum of row r, a `fadd reassoc` reduction that
// the vectorizer splits into several partial sums -- other bits than a sequential sum, so a
// tier without the IR pipeline would show. `tag` makes the kernel (and its cache key) unique.
mt::LlvmJit::KernelSource row_sum_kernel(const std::string& tag, int width = 1000) {
  std::string name = "tiered_row_sum_" + tag;
  std::string ir = fmt::format(R"(; tiered JIT test kernel {0}
define void @{0}(ptr noalias nocapture readonly %params, i64 %begin, i64 %end) #0 {{
entry:
  %in = load ptr, ptr %params
  %pout = getelementptr inbounds ptr, ptr %params, i64 1
  %out = load ptr, ptr %pout
  br label %row
row:
  %r = phi i64 [ %begin, %entry ], [ %r.next, %row.end ]
  %more = icmp slt i64 %r, %end
  br i1 %more, label %body.pre, label %exit
body.pre:
  %base = mul nsw i64 %r, {1}
  br label %body
body:
  %j = phi i64 [ 0, %body.pre ], [ %j.next, %body ]
  %acc = phi float [ 0.0, %body.pre ], [ %acc.next, %body ]
  %at = add nsw i64 %base, %j
  %p = getelementptr inbounds float, ptr %in, i64 %at
  %v = load float, ptr %p
  %acc.next = fadd reassoc float %acc, %v
  %j.next = add nsw i64 %j, 1
  %again = icmp slt i64 %j.next, {1}
  br i1 %again, label %body, label %row.end
row.end:
  %q = getelementptr inbounds float, ptr %out, i64 %r
  store float %acc.next, ptr %q
  %r.next = add nsw i64 %r, 1
  br label %row
exit:
  ret void
}}
attributes #0 = {{ nounwind "prefer-vector-width"="512" "min-legal-vector-width"="0" }}
)",
                               name, width);
  return {name, ir};
}

std::string unique_tag() {
  static int counter = 0;
  return fmt::format("{}_{}_{}", ::getpid(),
                     std::chrono::steady_clock::now().time_since_epoch().count(), counter++);
}

// Rows of floats whose magnitudes span many binades, so that the order of a sum changes its bits.
std::vector<float> spread_values(int rows, int width) {
  std::mt19937 random(7);
  std::uniform_real_distribution<float> mantissa(-1, 1);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::vector<float> values(static_cast<size_t>(rows) * width);
  for (float& v : values) v = std::ldexp(mantissa(random), exponent(random));
  return values;
}

std::vector<float> run_row_sum(mt::KernelFunction function, const std::vector<float>& in,
                               int rows) {
  std::vector<float> out(rows);
  void* params[] = {const_cast<float*>(in.data()), out.data()};
  function(params, 0, rows);
  return out;
}

// The process's first tier-up runs on the caller's thread (jit/llvm_jit.cpp says why); the tests
// want the ones after it, which run in the background.
void prime_tier_up() {
  static bool primed = [] {
    mt::LlvmJit::KernelSource kernel = row_sum_kernel("primer_" + unique_tag(), 8);
    jit().load(kernel.name, kernel.ir);
    return true;
  }();
  (void)primed;
}

class TieredJit : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = jit().tiered();
    jit().set_tiered(true);
    prime_tier_up();
  }
  void TearDown() override {
    jit().wait_for_tier_up();
    jit().set_tiered(saved_);
  }

 private:
  bool saved_ = true;
};

TEST_F(TieredJit, FastCodeRunsFirstThenTheOptimizedCodeWithTheSameBits) {
  mt::LlvmJit::KernelSource source = row_sum_kernel(unique_tag());
  mt::LlvmJit::Stats before = jit().stats();
  std::shared_ptr<const mt::JitKernel> kernel = jit().load(source.name, source.ir);
  mt::LlvmJit::Stats loaded = jit().stats();
  EXPECT_EQ(loaded.compiled - before.compiled, 1);
  EXPECT_EQ(loaded.fast_compiled - before.fast_compiled, 1);
  EXPECT_GT(loaded.compile_cpu_seconds, before.compile_cpu_seconds);
  mt::KernelFunction fast = kernel->fast_function();
  ASSERT_NE(fast, nullptr) << "a kernel compiled cold with tiering on starts with fast code";

  jit().wait_for_tier_up();
  mt::LlvmJit::Stats after = jit().stats();
  EXPECT_EQ(after.tiered_up - loaded.tiered_up, 1);
  EXPECT_GT(after.tier_up_seconds, loaded.tier_up_seconds);
  EXPECT_GT(after.tier_up_cpu_seconds, loaded.tier_up_cpu_seconds);
  EXPECT_TRUE(kernel->optimized());
  mt::KernelFunction optimized = kernel->function();
  ASSERT_NE(optimized, fast) << "the optimized code was not swapped in";

  const int rows = 64, width = 1000;
  std::vector<float> in = spread_values(rows, width);
  std::vector<float> fast_out = run_row_sum(fast, in, rows);
  std::vector<float> optimized_out = run_row_sum(optimized, in, rows);
  EXPECT_EQ(std::memcmp(fast_out.data(), optimized_out.data(), rows * sizeof(float)), 0)
      << "the tiers give different bits";
  // Both are the vectorized sum: a sequential one gives other bits for some row, and the double
  // sum is close to each.
  int differs_from_sequential = 0;
  for (int r = 0; r < rows; ++r) {
    float sequential = 0;
    double exact = 0;
    for (int j = 0; j < width; ++j) {
      sequential += in[r * width + j];
      exact += in[r * width + j];
    }
    differs_from_sequential += sequential != fast_out[r];
    EXPECT_NEAR(fast_out[r], exact, 1e-3 * (std::abs(exact) + 1)) << "row " << r;
  }
  EXPECT_GT(differs_from_sequential, 0) << "the fast tier did not vectorize the sum";
}

TEST_F(TieredJit, TheOptimizedObjectIsTheOneAnUntieredCompileMakes) {
  mt::LlvmJit::KernelSource source = row_sum_kernel(unique_tag());
  std::shared_ptr<const mt::JitKernel> kernel = jit().load(source.name, source.ir);
  jit().wait_for_tier_up();
  ASSERT_TRUE(kernel->optimized());
  // From the cache, where the tier-up put it: nothing is compiled.
  int64_t compiled = jit().stats().compiled;
  std::vector<std::byte> tiered = jit().objects({source})[0];
  EXPECT_EQ(jit().stats().compiled, compiled) << "the tier-up did not cache its object";
  // The same IR under another key (a comment line): compiled at the optimizing tier at once.
  mt::LlvmJit::KernelSource again{source.name, source.ir + "; compiled untiered\n"};
  std::vector<std::byte> untiered = jit().objects({again})[0];
  EXPECT_EQ(jit().stats().compiled, compiled + 1);
  ASSERT_EQ(tiered.size(), untiered.size());
  EXPECT_EQ(std::memcmp(tiered.data(), untiered.data(), tiered.size()), 0)
      << "the tiered-up object differs from an untiered compile of the same IR";
}

TEST_F(TieredJit, UntieredCompilesTheOptimizedCodeAtOnce) {
  jit().set_tiered(false);
  mt::LlvmJit::KernelSource source = row_sum_kernel(unique_tag());
  mt::LlvmJit::Stats before = jit().stats();
  std::shared_ptr<const mt::JitKernel> kernel = jit().load(source.name, source.ir);
  mt::LlvmJit::Stats after = jit().stats();
  EXPECT_EQ(after.compiled - before.compiled, 1);
  EXPECT_EQ(after.fast_compiled, before.fast_compiled);
  EXPECT_TRUE(kernel->optimized());
  EXPECT_EQ(kernel->fast_function(), nullptr);
  // Cached at once: objects() compiles nothing.
  jit().objects({source});
  EXPECT_EQ(jit().stats().compiled, after.compiled);
}

// A pointwise kernel without fast-math flags: out[i] = expf(in[i]) * 0.75 + sqrt(|in[i]|) / in[i],
// vectorized but for the call. `tag` makes the kernel unique.
mt::LlvmJit::KernelSource pointwise_kernel(const std::string& tag) {
  std::string name = "tiered_pointwise_" + tag;
  std::string ir = fmt::format(R"(; tiered JIT test kernel {0}
declare float @expf(float)
declare float @llvm.sqrt.f32(float)
declare float @llvm.fabs.f32(float)
define void @{0}(ptr noalias nocapture readonly %params, i64 %begin, i64 %end) #0 {{
entry:
  %in = load ptr, ptr %params
  %pout = getelementptr inbounds ptr, ptr %params, i64 1
  %out = load ptr, ptr %pout
  %i.addr = alloca i64
  store i64 %begin, ptr %i.addr
  br label %head
head:
  %i = load i64, ptr %i.addr
  %more = icmp slt i64 %i, %end
  br i1 %more, label %body, label %exit
body:
  %p = getelementptr inbounds float, ptr %in, i64 %i
  %x = load float, ptr %p
  %e = call float @expf(float %x)
  %a = fmul float %e, 0.75
  %f = call float @llvm.fabs.f32(float %x)
  %s = call float @llvm.sqrt.f32(float %f)
  %d = fdiv float %s, %x
  %y = fadd float %a, %d
  %q = getelementptr inbounds float, ptr %out, i64 %i
  store float %y, ptr %q
  %i.next = add nsw i64 %i, 1
  store i64 %i.next, ptr %i.addr
  br label %head
exit:
  ret void
}}
attributes #0 = {{ nounwind "prefer-vector-width"="512" "min-legal-vector-width"="0" }}
)",
                               name);
  return {name, ir};
}

// Without fast-math flags a kernel's fast tier runs the IR pipeline with its own target machine,
// and still gives the optimized code's bits; its tier-up compiles the IR afresh into the object an
// untiered compile makes.
// Kernels whose IR differs only in the function's name (and in comments) share one compile and
// one load, while their code lives; one that differs in anything else (here a constant) does not.
TEST_F(TieredJit, KernelsOfTheSameCodeUnderOtherNamesShareOneCompile) {
  std::string tag = unique_tag();
  std::vector<mt::LlvmJit::KernelSource> kernels = {row_sum_kernel(tag + "_a", 96),
                                                    row_sum_kernel(tag + "_b", 96),
                                                    row_sum_kernel(tag + "_c", 95)};
  mt::LlvmJit::Stats before = jit().stats();
  std::vector<std::shared_ptr<const mt::JitKernel>> loaded = jit().load_all(kernels);
  mt::LlvmJit::Stats after = jit().stats();
  EXPECT_EQ(after.compiled - before.compiled, 2);
  EXPECT_EQ(after.same_code - before.same_code, 1);
  EXPECT_EQ(loaded[0], loaded[1]);
  EXPECT_NE(loaded[0], loaded[2]);
  std::vector<float> in = spread_values(4, 96);
  std::vector<float> sums = run_row_sum(loaded[1]->function(), in, 4);
  for (int r = 0; r < 4; ++r) {
    float sequential = 0;
    for (int j = 0; j < 96; ++j) sequential += in[static_cast<size_t>(r) * 96 + j];
    EXPECT_NEAR(sums[r], sequential, 1e-3 * std::fabs(sequential) + 1e-6) << "row " << r;
  }
  // A later call finds the loaded code under its other name.
  mt::LlvmJit::KernelSource later = row_sum_kernel(tag + "_d", 96);
  EXPECT_EQ(jit().load(later.name, later.ir), loaded[0]);
  EXPECT_EQ(jit().stats().compiled, after.compiled);
  // Once its last owner lets go, the code is gone and a kernel of it is compiled again.
  jit().wait_for_tier_up();
  loaded.clear();
  mt::LlvmJit::KernelSource again = row_sum_kernel(tag + "_e", 96);
  std::shared_ptr<const mt::JitKernel> recompiled = jit().load(again.name, again.ir);
  EXPECT_EQ(jit().stats().compiled, after.compiled + 1);
  EXPECT_EQ(run_row_sum(
                recompiled->fast_function() ? recompiled->fast_function() : recompiled->function(),
                in, 4),
            sums);
}

TEST_F(TieredJit, AKernelWithoutFastMathTakesTheShortPipelineWithTheSameBits) {
  mt::LlvmJit::KernelSource source = pointwise_kernel(unique_tag());
  mt::LlvmJit::Stats before = jit().stats();
  std::shared_ptr<const mt::JitKernel> kernel = jit().load(source.name, source.ir);
  mt::LlvmJit::Stats loaded = jit().stats();
  EXPECT_EQ(loaded.fast_compiled - before.fast_compiled, 1);
  EXPECT_EQ(loaded.short_compiled - before.short_compiled, 1);
  mt::KernelFunction fast = kernel->fast_function();
  ASSERT_NE(fast, nullptr);
  jit().wait_for_tier_up();
  ASSERT_TRUE(kernel->optimized());
  mt::KernelFunction optimized = kernel->function();
  ASSERT_NE(optimized, fast);

  const int n = 4099;  // not a multiple of any vector width: the scalar remainder runs too
  std::vector<float> in = spread_values(1, n);
  in[5] = 0.0f;  // 0/0: a NaN from both
  in[6] = -std::numeric_limits<float>::denorm_min();
  auto run = [&](mt::KernelFunction function) {
    std::vector<float> out(n);
    void* params[] = {in.data(), out.data()};
    function(params, 0, n);
    return out;
  };
  std::vector<float> fast_out = run(fast), optimized_out = run(optimized);
  EXPECT_EQ(std::memcmp(fast_out.data(), optimized_out.data(), n * sizeof(float)), 0)
      << "the tiers give different bits";
  for (int i : {0, 1, 100, n - 1}) {
    float x = in[i];
    EXPECT_EQ(fast_out[i], std::exp(x) * 0.75f + std::sqrt(std::abs(x)) / x) << "element " << i;
  }

  int64_t compiled = jit().stats().compiled;
  std::vector<std::byte> tiered = jit().objects({source})[0];
  EXPECT_EQ(jit().stats().compiled, compiled) << "the tier-up did not cache its object";
  std::vector<std::byte> untiered = jit().objects({{source.name, source.ir + "; again\n"}})[0];
  ASSERT_EQ(tiered.size(), untiered.size());
  EXPECT_EQ(std::memcmp(tiered.data(), untiered.data(), tiered.size()), 0)
      << "the tiered-up object differs from an untiered compile of the same IR";
}

// A graph with reductions (softmax: max and sum), transcendental functions and bf16 rounding,
// evaluated on the CPU back end.
std::vector<float> graph_result(int64_t rows, int64_t cols) {
  std::vector<float> values = spread_values(static_cast<int>(rows), static_cast<int>(cols));
  for (float& v : values) v = std::tanh(v);
  mt::Tensor x = mt::tensor(values, {rows, cols});
  mt::Tensor y = mt::softmax(mt::exp(x) * 0.5, -1);
  mt::Tensor z = mt::cast(mt::cast(y * 3.0 + x, mt::bf16), mt::f32).sum({1});
  return z.to_vector<float>();
}

TEST_F(TieredJit, AGraphGivesTheSameBitsBeforeAndAfterTierUp) {
  mt::set_device(mt::Device::cpu);
  const int64_t rows = 29, cols = 301;  // shapes no other test uses: new kernels
  mt::LlvmJit::Stats before = jit().stats();
  std::vector<float> fast = graph_result(rows, cols);
  mt::LlvmJit::Stats loaded = jit().stats();
  int64_t new_kernels = loaded.fast_compiled - before.fast_compiled;
  EXPECT_GT(new_kernels, 0);
  jit().wait_for_tier_up();
  EXPECT_GE(jit().stats().tiered_up - loaded.tiered_up, new_kernels);
  std::vector<float> optimized = graph_result(rows, cols);
  EXPECT_EQ(jit().stats().compiled, loaded.compiled) << "the second run compiled again";
  ASSERT_EQ(fast.size(), optimized.size());
  EXPECT_EQ(std::memcmp(fast.data(), optimized.data(), fast.size() * sizeof(float)), 0);
}

// A [rows, cols, 1] tensor, whose kernels loop over a dimension of size 1: the IR pipeline
// deletes such a loop, so that the loop around it vectorizes. The pointwise result and the sums
// of both tiers have the same bits, and the pointwise one is the reference executor's.
std::vector<std::vector<float>> size_one_results(int64_t rows, int64_t cols) {
  std::vector<float> values = spread_values(static_cast<int>(rows), static_cast<int>(cols));
  mt::Tensor x = mt::tensor(values, {rows, cols, 1});
  mt::Tensor y = mt::rsqrt(x * x + 1e-3);
  mt::Tensor sums = (x * y).sum({1});
  return {y.to_vector<float>(), sums.to_vector<float>()};
}

TEST_F(TieredJit, LoopsOverDimensionsOfSizeOneGiveTheSameBitsInBothTiers) {
  mt::set_device(mt::Device::cpu);
  const int64_t rows = 37, cols = 211;  // shapes no other test uses: new kernels
  mt::LlvmJit::Stats before = jit().stats();
  std::vector<std::vector<float>> fast = size_one_results(rows, cols);
  mt::LlvmJit::Stats loaded = jit().stats();
  int64_t new_kernels = loaded.fast_compiled - before.fast_compiled;
  EXPECT_GT(new_kernels, 0);
  jit().wait_for_tier_up();
  EXPECT_GE(jit().stats().tiered_up - loaded.tiered_up, new_kernels);
  std::vector<std::vector<float>> optimized = size_one_results(rows, cols);
  EXPECT_EQ(jit().stats().compiled, loaded.compiled) << "the second run compiled again";
  mt::set_device(mt::Device::reference);
  std::vector<std::vector<float>> reference = size_one_results(rows, cols);
  mt::set_device(mt::Device::cpu);
  for (size_t r = 0; r < fast.size(); ++r) {
    ASSERT_EQ(fast[r].size(), optimized[r].size());
    EXPECT_EQ(std::memcmp(fast[r].data(), optimized[r].data(), fast[r].size() * sizeof(float)), 0)
        << "result " << r << ": the tiers give different bits";
  }
  ASSERT_EQ(fast[0].size(), reference[0].size());
  EXPECT_EQ(std::memcmp(fast[0].data(), reference[0].data(), fast[0].size() * sizeof(float)), 0)
      << "the pointwise result is not the reference executor's";
  for (size_t i = 0; i < reference[1].size(); ++i)
    EXPECT_NEAR(fast[1][i], reference[1][i], 1e-4 * (std::abs(reference[1][i]) + 1)) << i;
}

// The normal-priority thread (here alone) runs a job once it has waited its patience, not before:
// on a machine whose cores a training loop keeps busy, the idle thread may get no time at all.
TEST(BackgroundWorker, AJobRunsAtNormalPriorityOnceItHasWaitedItsPatience) {
  using namespace std::chrono;
  mt::BackgroundWorker worker(milliseconds(200), /*idle_thread=*/false);
  std::atomic<bool> ran{false};
  int policy = -1;
  auto start = steady_clock::now();
  worker.post([&] {
    sched_param param{};
    pthread_getschedparam(pthread_self(), &policy, &param);
    ran = true;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(ran) << "it ran before its patience";
  while (!ran && steady_clock::now() - start < seconds(5)) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(ran) << "it never ran";
  EXPECT_GE(steady_clock::now() - start, milliseconds(200));
  worker.drain();
  EXPECT_NE(policy, SCHED_IDLE);
}

// stop() (and so exit) drops what is queued, running each job's on_drop instead, and waits only
// for what runs.
TEST(BackgroundWorker, StopDropsTheQueuedJobsAndRunsTheirOnDrop) {
  using namespace std::chrono;
  mt::BackgroundWorker worker(seconds(30), /*idle_thread=*/false);
  int ran = 0, dropped = 0;
  worker.post([&] { ++ran; }, [&] { ++dropped; });
  worker.drain();  // runs it: no drop
  worker.post([&] { ++ran; }, [&] { ++dropped; });
  worker.post([&] { ++ran; });
  auto start = steady_clock::now();
  worker.stop();
  EXPECT_LT(steady_clock::now() - start, seconds(5)) << "stop() waited for the queued jobs";
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(dropped, 1);
  EXPECT_FALSE(worker.post([&] { ++ran; }, [&] { ++dropped; }));
  worker.stop();
  EXPECT_EQ(dropped, 1);
}

// Two threads posting a fresh worker's first jobs at once start its threads once: the second
// start assigned over a running std::thread, which terminates the process.
TEST(BackgroundWorker, TwoFirstPostsAtOnceStartOneSetOfThreads) {
  std::atomic<int> ran{0};
  for (int round = 0; round < 300; ++round) {
    mt::BackgroundWorker worker(std::chrono::milliseconds(0), /*idle_thread=*/false);
    std::barrier both(2);
    auto poster = [&] {
      both.arrive_and_wait();
      worker.post([&] { ++ran; }, {}, /*at_once=*/true);
    };
    std::thread a(poster), b(poster);
    a.join();
    b.join();
    worker.drain();
  }
  EXPECT_EQ(ran, 600);
}

// A job posted at_once runs on the normal-priority thread without waiting its patience.
TEST(BackgroundWorker, AJobPostedAtOnceSkipsThePatience) {
  using namespace std::chrono;
  mt::BackgroundWorker worker(seconds(30), /*idle_thread=*/false);
  std::atomic<bool> ran{false};
  auto start = steady_clock::now();
  worker.post([&] { ran = true; }, {}, /*at_once=*/true);
  while (!ran && steady_clock::now() - start < seconds(5)) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(ran) << "it waited for its patience";
  worker.stop();
}

TEST(BackgroundWorker, AHoldKeepsJobsWaitingAndDrainRunsThemOnTheCaller) {
  using namespace std::chrono;
  mt::BackgroundWorker worker(milliseconds(20));
  std::atomic<int> ran{0};
  std::thread::id ran_on;
  {
    mt::BackgroundWorker::Hold hold(worker);
    worker.post([&] {
      ran_on = std::this_thread::get_id();
      ++ran;
    });
    std::this_thread::sleep_for(150ms);  // past the patience and the quiet period
    EXPECT_EQ(ran, 0) << "a job started during a hold";
    EXPECT_EQ(worker.pending(), 1u);
    worker.drain();
  }
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(worker.pending(), 0u);
}

// fork() waits for the job under way, so that the child never inherits a lock the job held
// (the JIT's, LLVM's, ASan's allocator's; a child of a parent tiering up hung once in CI, in
// test_async_evaluation): the child finds the job's lock free, where it found it held before.
// The child then runs jobs on threads of its own, the one queued before the fork too.
TEST(BackgroundWorker, AForkWaitsForTheRunningJobAndTheChildRunsJobsOnThreadsOfItsOwn) {
  using std::chrono::milliseconds;
  mt::BackgroundWorker worker(milliseconds(0), /*idle_thread=*/false);
  std::mutex held_by_the_job;
  std::atomic<bool> started{false}, queued_ran{false}, posted_ran{false};
  worker.post([&] {
    std::lock_guard lock(held_by_the_job);
    started = true;
    std::this_thread::sleep_for(milliseconds(300));
  });
  while (!started) std::this_thread::yield();
  worker.post([&] { queued_ran = true; });  // behind the first, on the worker's one thread
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // leaves by _exit alone
    bool lock_free = held_by_the_job.try_lock();
    if (lock_free) held_by_the_job.unlock();
    worker.post([&] { posted_ran = true; });
    for (int i = 0; i < 500 && !(queued_ran && posted_ran); ++i)
      std::this_thread::sleep_for(milliseconds(10));
    bool ran = queued_ran && posted_ran;
    worker.stop();
    ::_exit(!lock_free ? 1 : !ran ? 2 : 0);
  }
  EXPECT_EQ(wait_for_child(child, milliseconds(10'000)), 0)
      << "1: the child found the job's lock held; 2: the child's jobs did not run; -1: it hung";
  worker.drain();
  EXPECT_TRUE(queued_ran);
}

// Runs this binary's test `filter` in a child with `env` set; its exit status (-1: killed after
// a minute, a hang).
int run_child(const std::string& filter, const std::vector<std::string>& env) {
  pid_t child = ::fork();
  if (child < 0) return -2;
  if (child == 0) {
    ::setenv("MIXTAPE_TIERED_TEST_CHILD", "1", 1);
    for (const std::string& entry : env) ::putenv(const_cast<char*>(entry.c_str()));
    std::string filter_flag = "--gtest_filter=" + filter;
    const char* args[] = {"test_tiered_jit", filter_flag.c_str(), "--gtest_also_run_disabled_tests",
                          nullptr};
    if (!::freopen("/dev/null", "w", stdout)) ::_exit(126);
    ::execv("/proc/self/exe", const_cast<char* const*>(args));
    ::_exit(127);
  }
  return wait_for_child(child, std::chrono::minutes(1));
}

// Run by the next test in a child: the tagged kernel, found on disk, optimized.
TEST(TieredJitChild, DISABLED_LoadsTheOptimizedObjectFromDisk) {
  jit().set_tiered(true);
  mt::LlvmJit::KernelSource source = row_sum_kernel(::getenv("MIXTAPE_TIERED_TEST_TAG"));
  std::shared_ptr<const mt::JitKernel> kernel = jit().load(source.name, source.ir);
  EXPECT_EQ(jit().stats().disk_loaded, 1);
  EXPECT_EQ(jit().stats().compiled, 0);
  EXPECT_TRUE(kernel->optimized());
  EXPECT_EQ(kernel->fast_function(), nullptr);
}

TEST_F(TieredJit, ANewProcessLoadsTheOptimizedObjectFromDisk) {
  if (!mt::kernel_cache().disk_writable()) GTEST_SKIP() << "no writable kernel cache directory";
  std::string tag = unique_tag();
  mt::LlvmJit::KernelSource source = row_sum_kernel(tag);
  std::shared_ptr<const mt::JitKernel> kernel = jit().load(source.name, source.ir);
  ASSERT_NE(kernel->fast_function(), nullptr);
  jit().wait_for_tier_up();
  EXPECT_EQ(run_child("TieredJitChild.DISABLED_LoadsTheOptimizedObjectFromDisk",
                      {"MIXTAPE_TIERED_TEST_TAG=" + tag}),
            0);
}

// The tagged kernels of the exit test: a `fadd reassoc` sum (its tier-up reads the bitcode) and a
// pointwise kernel (its tier-up compiles the IR afresh).
std::vector<mt::LlvmJit::KernelSource> exit_test_kernels() {
  std::string tag = ::getenv("MIXTAPE_TIERED_TEST_TAG");
  return {row_sum_kernel(tag), pointwise_kernel(tag)};
}

// Run by the next test in a child: the tagged kernels compiled fast, and the process exits at once.
TEST(TieredJitChild, DISABLED_CompilesFastAndExits) {
  jit().set_tiered(true);
  prime_tier_up();
  std::vector<std::shared_ptr<const mt::JitKernel>> kernels = jit().load_all(exit_test_kernels());
  for (const auto& kernel : kernels) {
    EXPECT_NE(kernel->fast_function(), nullptr);
    EXPECT_FALSE(kernel->optimized());
  }
}

// Run by the next test in a child: the tagged kernels start from the fast-tier entries the first
// child's exit left (nothing compiled, the fast code at once), then tier up without the usual
// patience to code with the same bits, which is cached.
TEST(TieredJitChild, DISABLED_StartsFromTheFastTierEntriesAndTiersUpAtOnce) {
  using namespace std::chrono;
  jit().set_tiered(true);
  std::vector<mt::LlvmJit::KernelSource> sources = exit_test_kernels();
  auto start = steady_clock::now();
  std::vector<std::shared_ptr<const mt::JitKernel>> kernels = jit().load_all(sources);
  mt::LlvmJit::Stats loaded = jit().stats();
  EXPECT_EQ(loaded.compiled, 0);
  EXPECT_EQ(loaded.disk_loaded, 2);
  EXPECT_EQ(loaded.fast_disk_loaded, 2) << "the first process ran its tier-ups at exit";
  std::vector<mt::KernelFunction> fast;
  for (const auto& kernel : kernels) {
    fast.push_back(kernel->fast_function());
    ASSERT_NE(fast.back(), nullptr);
  }
  // Tier-ups owed by an earlier process are posted at once, without the patience (2 s), which
  // BackgroundWorker.AJobPostedAtOnceSkipsThePatience checks: no time bound here, as the worker
  // runs at idle priority and a loaded machine (a sanitizer build, a parallel ctest) may starve
  // it for longer than the patience.
  auto all_optimized = [&] {
    for (const auto& kernel : kernels)
      if (!kernel->optimized()) return false;
    return true;
  };
  while (!all_optimized() && steady_clock::now() - start < seconds(60))
    std::this_thread::sleep_for(milliseconds(1));
  EXPECT_TRUE(all_optimized()) << "the owed tier-ups did not run";
  jit().wait_for_tier_up();
  EXPECT_EQ(jit().stats().tiered_up, 2);
  const int rows = 16, width = 1000;
  std::vector<float> in = spread_values(rows, width);
  for (size_t k = 0; k < kernels.size(); ++k) {
    ASSERT_TRUE(kernels[k]->optimized());
    // Both kernels take (in, out) and run over [0, rows): the row sum writes `rows` sums, the
    // pointwise kernel `rows` elements.
    std::vector<float> a = run_row_sum(fast[k], in, rows);
    std::vector<float> b = run_row_sum(kernels[k]->function(), in, rows);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), rows * sizeof(float)), 0) << sources[k].name;
  }
}

// Run by the next test in a child: the tagged kernels, found on disk, optimized.
TEST(TieredJitChild, DISABLED_LoadsTheOptimizedObjectsFromDisk) {
  jit().set_tiered(true);
  std::vector<std::shared_ptr<const mt::JitKernel>> kernels = jit().load_all(exit_test_kernels());
  EXPECT_EQ(jit().stats().disk_loaded, 2);
  EXPECT_EQ(jit().stats().compiled, 0);
  for (const auto& kernel : kernels) EXPECT_TRUE(kernel->optimized());
}

// An exit drops the tier-ups not done (it waits for none of them), leaving fast-tier entries, never
// read as optimized code: the next process starts from them without compiling, tiers them up at
// once and caches the optimized objects for the one after.
TEST(TieredJitExit, TierUpsLeftAtExitAreDroppedAndTheNextProcessTiersUpTheirEntries) {
  if (!mt::kernel_cache().disk_writable()) GTEST_SKIP() << "no writable kernel cache directory";
  std::string tag = "MIXTAPE_TIERED_TEST_TAG=" + unique_tag();
  EXPECT_EQ(run_child("TieredJitChild.DISABLED_CompilesFastAndExits", {tag}), 0);
  EXPECT_EQ(
      run_child("TieredJitChild.DISABLED_StartsFromTheFastTierEntriesAndTiersUpAtOnce", {tag}), 0);
  EXPECT_EQ(run_child("TieredJitChild.DISABLED_LoadsTheOptimizedObjectsFromDisk", {tag}), 0)
      << "the second process did not cache the optimized objects";
}

// Run by the next test in children: kernels compiled fast, then an exit at some moment of their
// tier-ups (queued, waiting for quiet, compiling, publishing).
TEST(TieredJitChild, DISABLED_ExitsWhileTieringUp) {
  jit().set_tiered(true);
  std::vector<mt::LlvmJit::KernelSource> sources;
  for (int i = 0; i < 8; ++i) sources.push_back(row_sum_kernel(unique_tag(), 100 + 37 * i));
  std::vector<std::shared_ptr<const mt::JitKernel>> kernels = jit().load_all(sources);
  EXPECT_EQ(jit().stats().fast_compiled, 8);
  std::this_thread::sleep_for(
      std::chrono::milliseconds(std::atoi(::getenv("MIXTAPE_TIERED_TEST_EXIT_AFTER_MS"))));
  if (::getenv("MIXTAPE_TIERED_TEST_DROP_KERNELS")) kernels.clear();
}

TEST(TieredJitExit, AProcessExitsCleanlyWhileTieringUp) {
  // 0: all queued; 52-60: at the end of the quiet period, the first jobs running; 80: more done.
  // Dropping the kernels first makes the jobs find them gone.
  for (int ms : {0, 52, 60, 80})
    for (bool drop : {false, true}) {
      std::vector<std::string> env = {fmt::format("MIXTAPE_TIERED_TEST_EXIT_AFTER_MS={}", ms)};
      if (drop) env.push_back("MIXTAPE_TIERED_TEST_DROP_KERNELS=1");
      EXPECT_EQ(run_child("TieredJitChild.DISABLED_ExitsWhileTieringUp", env), 0)
          << "exit " << ms << " ms after loading" << (drop ? ", kernels dropped" : "")
          << " (-1: it hung)";
    }
}

}  // namespace
