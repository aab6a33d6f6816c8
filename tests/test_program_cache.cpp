// tests/test_program_cache.cpp -- the in-memory caches stay bounded over shape sweeps: programs
// are least-recently-used within a byte budget, a program a caller still holds stays usable, and
// the JIT frees the code of kernels no program uses any more.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <memory>
#include <vector>

#include "mixtape/codegen/lru_cache.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/jit/llvm_jit.h"
#include "mixtape/precision_policy/assign.h"
#include "mixtape/runtime/cpu_executor.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/program.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

// Sets the in-memory caches' budget for one test.
class ScopedMemoryBudget {
 public:
  explicit ScopedMemoryBudget(int64_t bytes) : saved_(mt::memory_cache_bytes()) {
    mt::set_memory_cache_bytes(bytes);
  }
  ~ScopedMemoryBudget() { mt::set_memory_cache_bytes(saved_); }

 private:
  int64_t saved_;
};

// A small graph whose program depends on n (its kernel's dims do).
mt::Tensor graph_for(int64_t n) { return (mt::ones({n}) * 2.0 + 1.0).sum(); }

// Builds (or finds) the program for graph_for(n) in `cache`, with a loader whose owners are
// recorded in `owners`, so that the test sees which programs' kernels are still owned.
std::shared_ptr<const mt::Program> program_for(mt::ProgramCache& cache, int64_t n,
                                               std::vector<std::weak_ptr<int>>& owners) {
  mt::Tensor out = graph_for(n);
  std::vector<mt::Node*> pending = mt::pending_nodes({out.node()});
  mt::assign_precision(pending);
  mt::FusionOptions options;
  options.fuse = true;
  mt::Signature sig = mt::sign(pending, {out.node().get()}, true, "program-cache-test");
  return cache.get(pending, options, sig, [&](const mt::kir::Kernel&) {
    auto owner = std::make_shared<int>(0);
    owners.push_back(owner);
    return mt::KernelRef{0, owner};
  });
}

int64_t alive(const std::vector<std::weak_ptr<int>>& owners) {
  int64_t count = 0;
  for (const auto& owner : owners) count += !owner.expired();
  return count;
}

// The issue: the cache was cleared whole at 256 programs, so 3,000 cycling shapes got no reuse.
// 300 cycling shapes that fit the budget are each built once.
TEST(ProgramCache, ACyclingSetOfShapesWithinTheBudgetIsReused) {
  mt::ProgramCache cache(int64_t{64} << 20);
  std::vector<std::weak_ptr<int>> owners;
  mt::reset_execution_stats();
  for (int round = 0; round < 3; ++round)
    for (int64_t n = 1; n <= 300; ++n) program_for(cache, n, owners);
  mt::ExecutionStats stats = mt::execution_stats();
  EXPECT_EQ(stats.programs_built, 300);
  EXPECT_EQ(stats.programs_reused, 600);
  EXPECT_EQ(cache.stats().programs, 300);
  EXPECT_EQ(cache.stats().evictions, 0);
}

TEST(ProgramCache, AShapeSweepStaysWithinTheBudgetAndFreesEvictedKernels) {
  std::vector<std::weak_ptr<int>> owners;
  mt::ProgramCache probe(int64_t{1} << 30);
  int64_t one_program = mt::approximate_bytes(*program_for(probe, 7, owners));
  ASSERT_GT(one_program, 0);
  owners.clear();

  int64_t budget = 10 * one_program + one_program / 2;  // ten programs
  mt::ProgramCache cache(budget);
  // A caller (an mt::compile plan) holds the first program through the sweep.
  std::shared_ptr<const mt::Program> held = program_for(cache, 1, owners);
  for (int64_t n = 2; n <= 500; ++n) {
    program_for(cache, n, owners);
    ASSERT_LE(cache.stats().bytes, budget) << n;
  }
  mt::ProgramCache::Stats stats = cache.stats();
  EXPECT_EQ(stats.programs, 10);
  EXPECT_EQ(stats.evictions, 490);
  // The kernels of the ten cached programs and of the held one are owned; the rest were freed.
  EXPECT_EQ(alive(owners), 11 * static_cast<int64_t>(owners.size()) / 500);
  EXPECT_FALSE(owners[0].expired()) << "the held program's kernel was freed under it";
  ASSERT_FALSE(held->steps.empty());
  held.reset();
  EXPECT_TRUE(owners[0].expired());

  // Least recently used: touching an old program keeps it over newer ones.
  mt::reset_execution_stats();
  program_for(cache, 491, owners);  // the oldest held, now the most recent
  for (int64_t n = 1000; n < 1009; ++n) program_for(cache, n, owners);
  program_for(cache, 491, owners);
  EXPECT_EQ(mt::execution_stats().programs_reused, 2);
}

// Through the CPU back end: a sweep over many shapes keeps the JIT's loaded kernels and the
// program cache bounded, and shapes revisited within the budget are not compiled again.
TEST(ProgramCache, TheCpuBackEndFreesTheCodeOfEvictedPrograms) {
  mt::Device previous = mt::current_device();
  mt::set_device(mt::Device::cpu);
  {
    ScopedMemoryBudget budget(96 << 10);
    int64_t resident_before = mt::LlvmJit::instance().stats().resident;
    for (int64_t n = 101; n <= 140; ++n) {
      EXPECT_EQ(graph_for(n).item(), 3.0 * static_cast<double>(n));
      ASSERT_LE(mt::cpu_program_cache_stats().bytes, 96 << 10) << n;
    }
    mt::LlvmJit::Stats jit = mt::LlvmJit::instance().stats();
    EXPECT_LT(jit.resident - resident_before, 30) << "kernels of evicted programs stayed loaded";
    EXPECT_GT(mt::cpu_program_cache_stats().programs, 2);

    // The last few shapes fit the budget: cycling them builds and compiles nothing.
    for (int64_t n = 138; n <= 140; ++n) graph_for(n).item();
    mt::reset_execution_stats();
    for (int round = 0; round < 3; ++round)
      for (int64_t n = 138; n <= 140; ++n)
        EXPECT_EQ(graph_for(n).item(), 3.0 * static_cast<double>(n));
    mt::ExecutionStats stats = mt::execution_stats();
    EXPECT_EQ(stats.programs_built, 0);
    EXPECT_EQ(stats.programs_reused, 9);
    EXPECT_EQ(stats.kernels_compiled + stats.kernels_from_disk, 0);
  }
  mt::set_device(previous);
}

// Run only by the next test, in a fresh process: the CPU back end's first use makes its program
// cache before the JIT, so at exit the cached programs' kernels outlive the LlvmJit instance.
TEST(ProgramCache, DISABLED_ExitAfterRunningOnTheCpu) {
  mt::set_device(mt::Device::cpu);
  EXPECT_EQ(graph_for(5).item(), 15.0);
}

TEST(ProgramCache, AProcessExitsCleanlyWhileItsProgramsStillHoldKernels) {
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const char* args[] = {"test_program_cache", "--gtest_filter=*DISABLED_ExitAfterRunningOnTheCpu",
                          "--gtest_also_run_disabled_tests", nullptr};
    ::freopen("/dev/null", "w", stdout);
    ::execv("/proc/self/exe", const_cast<char* const*>(args));
    ::_exit(127);
  }
  EXPECT_EQ(wait_for_child(child, std::chrono::minutes(1)), 0) << "-1: the process hung at exit";
}

}  // namespace
