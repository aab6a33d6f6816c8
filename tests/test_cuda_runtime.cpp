// tests/test_cuda_runtime.cpp -- CUDA runtime without a GPU: allocator, no-driver fallback, ABI.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mixtape/runtime/cublaslt.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/cuda_driver.h"
#include "mixtape/runtime/cudnn.h"
#include "mixtape/runtime/nccl.h"
#include "tests/test_util.h"

#if defined(MIXTAPE_HAVE_CUDA_HEADERS)
#include <cstddef>

#include <cublasLt.h>
#include <cuda.h>
#if __has_include(<nccl.h>)
#include <nccl.h>
#define MIXTAPE_HAVE_NCCL_HEADER 1
#endif
#if __has_include(<cudnn.h>)
#include <cudnn.h>
#define MIXTAPE_HAVE_CUDNN_HEADER 1
#endif
#endif

namespace mt = mixtape;
namespace cu = mixtape::cuda;

namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Host memory with a capacity, so running out is real: a request past it gets nullptr, as
// cuMemAlloc's CUDA_ERROR_OUT_OF_MEMORY does. Counts what the allocator asks of it.
struct HostBackendLog {
  size_t used = 0;
  int allocations = 0, releases = 0, synchronizations = 0, refused = 0;
  std::map<void*, size_t> live;
};

class HostBackend : public cu::MemoryBackend {
 public:
  HostBackend(size_t capacity, HostBackendLog* log) : capacity_(capacity), log_(log) {}
  void* allocate(size_t bytes) override {
    if (log_->used + bytes > capacity_) {
      ++log_->refused;
      return nullptr;
    }
    void* ptr = std::aligned_alloc(512, bytes);
    if (ptr == nullptr) throw mt::Error("host allocation failed");
    log_->used += bytes;
    log_->live[ptr] = bytes;
    ++log_->allocations;
    return ptr;
  }
  void release(void* ptr) override {
    auto it = log_->live.find(ptr);
    ASSERT_NE(it, log_->live.end()) << "released a pointer the backend never gave out";
    log_->used -= it->second;
    log_->live.erase(it);
    ++log_->releases;
    std::free(ptr);
  }
  void synchronize() override { ++log_->synchronizations; }
  std::string describe() const override { return "host test backend"; }

 private:
  size_t capacity_;
  HostBackendLog* log_;
};

struct AllocatorFixture : ::testing::Test {
  HostBackendLog log;
  std::unique_ptr<cu::CachingAllocator> allocator;
  void make(size_t capacity = 1024 * kMiB) {
    TearDown();
    log = HostBackendLog();
    allocator =
        std::make_unique<cu::CachingAllocator>(std::make_unique<HostBackend>(capacity, &log));
  }
  void SetUp() override { make(); }
  // The allocator returns only its cached blocks; the ones a test left in use are freed here.
  void TearDown() override {
    allocator.reset();
    for (const auto& [ptr, bytes] : log.live) std::free(ptr);
    log.live.clear();
  }
};

TEST(CachingAllocatorRounding, SizeClasses) {
  using A = cu::CachingAllocator;
  EXPECT_EQ(A::round_size(0), 512u);
  EXPECT_EQ(A::round_size(1), 512u);
  EXPECT_EQ(A::round_size(512), 512u);
  EXPECT_EQ(A::round_size(513), 1024u);
  EXPECT_EQ(A::round_size(1000 * 1000), 1000448u);  // 1954 * 512
  EXPECT_EQ(A::round_size(kMiB), kMiB);
  EXPECT_EQ(A::round_size(kMiB + 1), 2 * kMiB);
  EXPECT_EQ(A::round_size(2 * kMiB), 2 * kMiB);
  EXPECT_EQ(A::round_size(2 * kMiB + 1), 4 * kMiB);
  EXPECT_EQ(A::round_size(9 * kMiB), 10 * kMiB);
}

TEST_F(AllocatorFixture, FreedBlockIsReusedWithoutTheBackend) {
  void* first = allocator->allocate(1000);
  EXPECT_EQ(allocator->block_size(first), 1024u);
  std::memset(first, 0xAB, 1000);  // the block is real, writable memory
  allocator->deallocate(first);
  void* second = allocator->allocate(900);  // same class: 1024
  EXPECT_EQ(second, first);
  cu::AllocatorStats stats = allocator->stats();
  EXPECT_EQ(stats.alloc_count, 2);
  EXPECT_EQ(stats.cache_hits, 1);
  EXPECT_EQ(stats.backend_allocs, 1);
  EXPECT_EQ(log.allocations, 1);
  EXPECT_EQ(log.synchronizations, 0);  // reuse on the same stream needs no synchronization
  allocator->deallocate(second);
}

TEST_F(AllocatorFixture, BestFitWithinTwiceTheRequest) {
  void* b4096 = allocator->allocate(4096);
  void* b2048 = allocator->allocate(2048);
  void* b8192 = allocator->allocate(8192);
  allocator->deallocate(b4096);
  allocator->deallocate(b2048);
  allocator->deallocate(b8192);
  EXPECT_EQ(allocator->allocate(1500), b2048);  // 1536: 2048 is the smallest that fits
  EXPECT_EQ(allocator->allocate(5000), b8192);  // 5120: 8192 <= 2 * 5120
  void* fresh = allocator->allocate(100);       // 512: 4096 is more than twice that
  EXPECT_NE(fresh, b4096);
  EXPECT_EQ(log.allocations, 4);
  EXPECT_EQ(allocator->stats().cache_hits, 2);
}

TEST_F(AllocatorFixture, SmallAndLargeClassesDoNotMix) {
  void* large = allocator->allocate(2 * kMiB);
  allocator->deallocate(large);
  void* small = allocator->allocate(kMiB);  // rounds to 1 MiB, small; 2 MiB is within 2x
  EXPECT_NE(small, large);
  EXPECT_EQ(allocator->block_size(small), kMiB);
  EXPECT_EQ(allocator->allocate(2 * kMiB - 5), large);  // the large request takes it
}

TEST_F(AllocatorFixture, BlocksAreReusedOnlyOnTheirStream) {
  void* on_one = allocator->allocate(4096, /*stream=*/1);
  allocator->deallocate(on_one);
  void* on_two = allocator->allocate(4096, /*stream=*/2);
  EXPECT_NE(on_two, on_one);
  EXPECT_EQ(allocator->allocate(4096, /*stream=*/1), on_one);
  EXPECT_EQ(log.allocations, 2);
}

TEST_F(AllocatorFixture, StatsTrackAllocatedReservedAndPeaks) {
  void* a = allocator->allocate(3 * kMiB);  // 4 MiB block
  void* b = allocator->allocate(100);       // 512
  cu::AllocatorStats s = allocator->stats();
  EXPECT_EQ(s.allocated, 4 * kMiB + 512);
  EXPECT_EQ(s.reserved, 4 * kMiB + 512);
  allocator->deallocate(a);
  s = allocator->stats();
  EXPECT_EQ(s.allocated, 512u);
  EXPECT_EQ(s.reserved, 4 * kMiB + 512);  // cached, still held
  EXPECT_EQ(s.peak_allocated, 4 * kMiB + 512);
  void* c = allocator->allocate(4 * kMiB);  // reuses a's block
  EXPECT_EQ(c, a);
  void* d = allocator->allocate(kMiB + 1);  // new 2 MiB block
  s = allocator->stats();
  EXPECT_EQ(s.allocated, 6 * kMiB + 512);
  EXPECT_EQ(s.reserved, 6 * kMiB + 512);
  EXPECT_EQ(s.peak_allocated, 6 * kMiB + 512);
  EXPECT_EQ(s.peak_reserved, 6 * kMiB + 512);
  EXPECT_EQ(s.alloc_count, 4);
  EXPECT_EQ(s.cache_hits, 1);
  allocator->deallocate(c);
  allocator->deallocate(d);
  allocator->reset_peak_stats();
  s = allocator->stats();
  EXPECT_EQ(s.peak_allocated, 512u);
  EXPECT_EQ(s.peak_reserved, 6 * kMiB + 512);
  allocator->deallocate(b);
  EXPECT_EQ(log.used, 6 * kMiB + 512);
}

TEST_F(AllocatorFixture, EmptyCacheReleasesOnlyFreeBlocks) {
  void* kept = allocator->allocate(kMiB);
  void* freed1 = allocator->allocate(4 * kMiB);
  void* freed2 = allocator->allocate(512);
  allocator->deallocate(freed1);
  allocator->deallocate(freed2);
  allocator->empty_cache();
  EXPECT_EQ(log.releases, 2);
  EXPECT_EQ(log.synchronizations, 1);  // queued work is waited for once before releasing
  EXPECT_EQ(log.live.size(), 1u);
  EXPECT_EQ(log.live.count(kept), 1u);
  cu::AllocatorStats s = allocator->stats();
  EXPECT_EQ(s.reserved, kMiB);
  EXPECT_EQ(s.allocated, kMiB);
  allocator->empty_cache();  // nothing cached: no synchronization
  EXPECT_EQ(log.synchronizations, 1);
  allocator->deallocate(kept);
}

TEST_F(AllocatorFixture, OutOfMemoryFreesTheCacheRetriesThenFails) {
  make(8 * kMiB);
  void* cached = allocator->allocate(4 * kMiB);
  allocator->deallocate(cached);
  // 6 MiB does not fit beside the cached 4 MiB block (too small to reuse): the cache goes back
  // to the backend and the retry succeeds.
  void* big = allocator->allocate(6 * kMiB);
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(log.refused, 1);
  EXPECT_EQ(log.releases, 1);
  EXPECT_EQ(log.synchronizations, 1);
  EXPECT_EQ(allocator->stats().reserved, 6 * kMiB);
  // 4 MiB more cannot fit even with an empty cache: an error naming the sizes.
  EXPECT_MT_ERROR(allocator->allocate(3 * kMiB + 7), "out of device memory", "4.00 MiB",
                  "3145735 bytes requested", "6.00 MiB allocated", "host test backend");
  EXPECT_EQ(log.refused, 2);  // no retry without a cache to free
  cu::AllocatorStats s = allocator->stats();
  EXPECT_EQ(s.allocated, 6 * kMiB);
  EXPECT_EQ(s.reserved, 6 * kMiB);
  allocator->deallocate(big);
}

TEST_F(AllocatorFixture, ForeignAndDoubleFreesAreErrors) {
  int local = 0;
  EXPECT_MT_ERROR(allocator->deallocate(&local), "not allocated by this allocator");
  void* p = allocator->allocate(64);
  allocator->deallocate(p);
  EXPECT_MT_ERROR(allocator->deallocate(p), "freed twice");
  allocator->deallocate(nullptr);  // like free(nullptr)
}

bool driver_loadable() {
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle != nullptr) dlclose(handle);
  return handle != nullptr;
}

void expect_unavailable_everywhere(const std::string& library_fragment) {
  EXPECT_FALSE(cu::available());
  std::string reason = cu::unavailable_reason();
  EXPECT_NE(reason.find(library_fragment), std::string::npos) << reason;
  EXPECT_EQ(reason.find('\n'), std::string::npos) << reason;
  try {
    cu::require_available();
    ADD_FAILURE() << "require_available() did not throw";
  } catch (const mt::Error& error) {
    std::string what = error.what();
    EXPECT_EQ(what, "CUDA is not available: " + reason);
    EXPECT_EQ(what.find('\n'), std::string::npos);
  }
  EXPECT_MT_ERROR(cu::device_name(), "CUDA is not available");
  EXPECT_MT_ERROR(cu::device_allocator(), "CUDA is not available");
  EXPECT_MT_ERROR(cu::DeviceBuffer(16), "CUDA is not available");
  EXPECT_FALSE(cu::cublaslt_available());
  EXPECT_NE(cu::cublaslt_unavailable_reason().find("CUDA is not available"), std::string::npos);
  cu::MatmulDesc desc;
  desc.m = desc.n = desc.k = 8;
  float x[64] = {};
  EXPECT_MT_ERROR(cu::matmul(desc, {x, x, x}), "cuBLASLt is not available");
}

TEST(CudaDriver, UnavailableWithoutADriver) {
  if (driver_loadable())
    GTEST_SKIP() << "libcuda.so.1 is installed; the child-process test covers this";
  expect_unavailable_everywhere("libcuda.so.1");
}

// The CUDA libraries must be loaded only on demand: mapped in no process that has not asked.
std::vector<std::string> mapped_cuda_libraries() {
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> found;
  for (std::string line; std::getline(maps, line);)
    for (const char* name : {"libcuda.so", "libcublas", "libnvrtc", "libcudart"})
      if (line.find(name) != std::string::npos) found.push_back(line);
  return found;
}

// Run by CudaFallback.ChildProcessWithoutDriverRunsCleanly in a fresh process whose
// MIXTAPE_CUDA_DRIVER and LD_LIBRARY_PATH point into an empty directory (disabled otherwise).
TEST(CudaFallbackChild, DISABLED_NoDriver) {
  EXPECT_TRUE(mapped_cuda_libraries().empty()) << mapped_cuda_libraries().front();
  const char* driver = std::getenv("MIXTAPE_CUDA_DRIVER");
  ASSERT_NE(driver, nullptr);
  expect_unavailable_everywhere(driver);
  EXPECT_NE(cu::unavailable_reason().find("libcuda.so.1"), std::string::npos);
  EXPECT_TRUE(mapped_cuda_libraries().empty()) << mapped_cuda_libraries().front();
}

// Runs this binary's (disabled) test `filter` in a child process with `environment` set, and
// expects it to pass alone.
void expect_child_passes(const std::string& filter,
                         const std::vector<std::pair<std::string, std::string>>& environment) {
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    dup2(out[1], STDOUT_FILENO);
    dup2(out[1], STDERR_FILENO);
    close(out[0]);
    for (const auto& [name, value] : environment) setenv(name.c_str(), value.c_str(), 1);
    const std::string flag = "--gtest_filter=" + filter;
    execl("/proc/self/exe", "test_cuda_runtime", "--gtest_also_run_disabled_tests", flag.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  std::string output;
  char buffer[4096];
  for (ssize_t n; (n = read(out[0], buffer, sizeof(buffer))) > 0;) output.append(buffer, n);
  close(out[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "child died: " << output;
  EXPECT_EQ(WEXITSTATUS(status), 0) << output;
  EXPECT_NE(output.find("[  PASSED  ] 1 test"), std::string::npos) << output;
}

TEST(CudaFallback, ChildProcessWithoutDriverRunsCleanly) {
  namespace fs = std::filesystem;
  fs::path empty = fs::temp_directory_path() / ("mixtape_no_cuda_" + std::to_string(getpid()));
  fs::create_directories(empty);
  expect_child_passes("CudaFallbackChild.DISABLED_NoDriver",
                      {{"MIXTAPE_CUDA_DRIVER", (empty / "libcuda.so.1").string()},
                       {"LD_LIBRARY_PATH", empty.string()}});
  fs::remove_all(empty);
}

// NCCL is loaded on demand, and a missing library is a reason, not a failure: the collectives
// then run through MPI in host memory (runtime/cuda_collectives.h).
TEST(NcclFallbackChild, DISABLED_NoLibrary) {
  const std::string path = std::getenv("MIXTAPE_NCCL_LIBRARY");
  EXPECT_EQ(mt::nccl::version(), 0);
  const std::string reason = mt::nccl::load_library();
  EXPECT_NE(reason.find("cannot load NCCL"), std::string::npos) << reason;
  EXPECT_NE(reason.find(path), std::string::npos) << reason;
  EXPECT_FALSE(mt::nccl::unavailable_reason().empty());
  EXPECT_EQ(mt::nccl::communicator_size(), 0);
  EXPECT_MT_ERROR(mt::nccl::unique_id(), "NCCL is not available");
  EXPECT_MT_ERROR(mt::nccl::exchange({}, {}), "no communicator");
}

TEST(NcclFallback, AMissingLibraryIsAReason) {
  expect_child_passes("NcclFallbackChild.DISABLED_NoLibrary",
                      {{"MIXTAPE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2"}});
}

// Where the toolkit's NCCL is installed (as on this project's build machines), it loads without
// a GPU, with every symbol mixtape calls; without CUDA the reason to keep off it is CUDA's.
TEST(Nccl, TheInstalledLibraryLoads) {
  if (!mt::nccl::load_library().empty())
    GTEST_SKIP() << "no NCCL here: " << mt::nccl::load_library();
  EXPECT_GE(mt::nccl::version(), 20700);  // ncclSend/ncclRecv came in 2.7
  if (!cu::available())
    EXPECT_NE(mt::nccl::unavailable_reason().find("CUDA is not available"), std::string::npos);
  else
    EXPECT_EQ(mt::nccl::unavailable_reason(), "");
}

// cuDNN is loaded on demand. Where the toolkit's is installed (as on this project's build
// machines) the library loads without a GPU and reports its version; without CUDA the reason to
// keep off it is CUDA's, and asking it for a convolution is an mt::Error naming that.
TEST(Cudnn, TheInstalledLibraryLoads) {
  const size_t version = cu::cudnn_library_version();
  if (version == 0) GTEST_SKIP() << "no cuDNN here";
  EXPECT_GE(version, 90000u);
#if defined(MIXTAPE_HAVE_CUDNN_HEADER)
  EXPECT_EQ(version / 10000, static_cast<size_t>(CUDNN_MAJOR));
#endif
  if (cu::available()) return;  // tests/gpu covers a machine with a GPU
  EXPECT_FALSE(cu::cudnn_available());
  EXPECT_NE(cu::cudnn_unavailable_reason().find("CUDA is not available"), std::string::npos);
  cu::CudnnConvDesc desc;
  desc.geometry = {1, 1, 3, 3, 1, 3, 3, 1, 1, {}};
  EXPECT_MT_ERROR(cu::cudnn_conv_algorithm(desc), "cuDNN is not available");
}

// What cuDNN's int descriptors and its output-size rule can hold, decided without a GPU.
TEST(Cudnn, SupportedProblems) {
  cu::CudnnConvDesc d;
  d.geometry = {2, 4, 9, 9, 6, 3, 3, 5, 5, {}};  // 3x3, stride 2, padding 1
  d.geometry.window.stride[0] = d.geometry.window.stride[1] = 2;
  d.geometry.window.pad[0] = d.geometry.window.pad[1] = 1;
  for (mt::DType t : {mt::f32, mt::f16, mt::bf16}) {
    d.dtype = t;
    for (mt::OpCode op :
         {mt::OpCode::Conv2d, mt::OpCode::Conv2dInputGrad, mt::OpCode::Conv2dWeightGrad}) {
      d.op = op;
      EXPECT_TRUE(cu::cudnn_conv_supported(d)) << mt::name(t);
    }
  }
  cu::CudnnConvDesc other = d;
  other.dtype = mt::f64;
  EXPECT_FALSE(cu::cudnn_conv_supported(other));
  other = d;
  other.op = mt::OpCode::MaxPool2d;
  EXPECT_FALSE(cu::cudnn_conv_supported(other));
  other = d;
  other.geometry.oh = 4;  // not the floor of (9 + 2 - 3) / 2 + 1
  EXPECT_FALSE(cu::cudnn_conv_supported(other));
  other = d;
  other.geometry.window.groups = 4;  // divides the 4 input channels but not the 6 outputs
  EXPECT_FALSE(cu::cudnn_conv_supported(other));
  other = d;
  other.geometry.n = int64_t{1} << 31;  // past an int
  EXPECT_FALSE(cu::cudnn_conv_supported(other));
  other = d;
  other.geometry.n = int64_t{1} << 24;  // every size an int, x's 2^24 * 324 elements not
  EXPECT_FALSE(cu::cudnn_conv_supported(other));
}

// Which of cuDNN's heuristic results a convolution may run on, kept in the heuristic's order:
// successes only, deterministic ones only (backward ALGO_0 and filter ALGO_3 use atomics), no FFT
// or Winograd (other arithmetic than a direct convolution's), at most 1 GiB of workspace, and FMA
// math where TF32 is not allowed.
TEST(Cudnn, UsableAlgorithmsAreDeterministicDirectAndInOrder) {
  namespace abi = cu::cudnn_abi;
  constexpr int kOk = abi::kStatusSuccess, kDet = abi::kDeterministic, kNonDet = 0;
  constexpr size_t kMiB = size_t{1} << 20;
  auto perf = [](int algo, int status, size_t memory, int determinism, int math) {
    return abi::AlgoPerf{algo, status, 0.1f, memory, determinism, math, {}};
  };
  auto algos = [](const std::vector<cu::CudnnAlgorithm>& usable) {
    std::vector<int> out;
    for (const cu::CudnnAlgorithm& a : usable) out.push_back(a.algo);
    return out;
  };
  const std::vector<abi::AlgoPerf> forward = {
      perf(6, kOk, kMiB, kDet, abi::kTensorOpMath),         // Winograd
      perf(1, kOk, 8 * kMiB, kDet, abi::kTensorOpMath),     // IMPLICIT_PRECOMP_GEMM
      perf(4, kOk, kMiB, kDet, abi::kTensorOpMath),         // FFT
      perf(0, 3000, 0, kDet, abi::kTensorOpMath),           // NOT_SUPPORTED
      perf(2, kOk, 2048 * kMiB, kDet, abi::kTensorOpMath),  // GEMM, 2 GiB of workspace
      perf(0, kOk, 0, kDet, abi::kFmaMath),                 // IMPLICIT_GEMM
      perf(3, kOk, 0, kNonDet, abi::kTensorOpMath)};        // DIRECT, said nondeterministic
  EXPECT_EQ(algos(cu::cudnn_usable_algorithms(mt::OpCode::Conv2d, forward, false)),
            (std::vector<int>{1, 0}));
  EXPECT_EQ(algos(cu::cudnn_usable_algorithms(mt::OpCode::Conv2d, forward, true)),
            (std::vector<int>{0}));
  const std::vector<cu::CudnnAlgorithm> kept =
      cu::cudnn_usable_algorithms(mt::OpCode::Conv2d, forward, false);
  EXPECT_EQ(kept[0].workspace, 8 * kMiB);
  EXPECT_EQ(kept[0].math_type, abi::kTensorOpMath);
  const std::vector<abi::AlgoPerf> backward = {
      perf(0, kOk, 0, kNonDet, abi::kTensorOpMath), perf(2, kOk, 0, kDet, abi::kTensorOpMath),
      perf(3, kOk, 0, kDet, abi::kTensorOpMath), perf(1, kOk, 0, kDet, abi::kTensorOpMath),
      perf(5, kOk, 0, kDet, abi::kTensorOpMath)};
  // Data: ALGO_1 (2, 3 and 5 are FFT, FFT_TILING and WINOGRAD_NONFUSED). Filter: ALGO_3 where
  // cuDNN reports it deterministic, then ALGO_1 (2 is FFT, 5 WINOGRAD_NONFUSED).
  EXPECT_EQ(algos(cu::cudnn_usable_algorithms(mt::OpCode::Conv2dInputGrad, backward, false)),
            (std::vector<int>{1}));
  EXPECT_EQ(algos(cu::cudnn_usable_algorithms(mt::OpCode::Conv2dWeightGrad, backward, false)),
            (std::vector<int>{3, 1}));
  EXPECT_TRUE(cu::cudnn_usable_algorithms(mt::OpCode::Conv2d, {}, false).empty());
}

#if defined(MIXTAPE_HAVE_CUDA_HEADERS)
// mixtape's declarations must match the toolkit's.
static_assert(cu::driver_abi::kSuccess == CUDA_SUCCESS);
static_assert(cu::driver_abi::kErrorOutOfMemory == CUDA_ERROR_OUT_OF_MEMORY);
static_assert(cu::driver_abi::kErrorNotReady == CUDA_ERROR_NOT_READY);
static_assert(cu::driver_abi::kAttributeMultiprocessorCount ==
              CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
static_assert(cu::driver_abi::kAttributeComputeCapabilityMajor ==
              CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
static_assert(cu::driver_abi::kAttributeComputeCapabilityMinor ==
              CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
static_assert(cu::driver_abi::kStreamNonBlocking == CU_STREAM_NON_BLOCKING);
static_assert(cu::driver_abi::kEventDefault == CU_EVENT_DEFAULT);
static_assert(cu::driver_abi::kEventDisableTiming == CU_EVENT_DISABLE_TIMING);
static_assert(sizeof(cu::CUdeviceptr) == sizeof(::CUdeviceptr));
static_assert(sizeof(cu::CUresult) == sizeof(::CUresult));

#if defined(MIXTAPE_HAVE_NCCL_HEADER)
static_assert(mt::nccl::abi::kSuccess == ncclSuccess);
static_assert(mt::nccl::abi::kInProgress == ncclInProgress);
static_assert(mt::nccl::abi::kInt8 == ncclInt8);
static_assert(mt::nccl::abi::kUniqueIdBytes == NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(mt::nccl::UniqueId) == sizeof(ncclUniqueId));
// mixtape's config is the leading fields of today's, as NCCL 2.14 defined them.
static_assert(offsetof(mt::nccl::abi::Config, magic) == offsetof(ncclConfig_t, magic));
static_assert(offsetof(mt::nccl::abi::Config, version) == offsetof(ncclConfig_t, version));
static_assert(offsetof(mt::nccl::abi::Config, blocking) == offsetof(ncclConfig_t, blocking));
static_assert(offsetof(mt::nccl::abi::Config, max_ctas) == offsetof(ncclConfig_t, maxCTAs));
static_assert(offsetof(mt::nccl::abi::Config, net_name) == offsetof(ncclConfig_t, netName));
static_assert(sizeof(mt::nccl::abi::Config) == offsetof(ncclConfig_t, splitShare));
#endif

static_assert(cu::lt_abi::kStatusSuccess == CUBLAS_STATUS_SUCCESS);
static_assert(cu::lt_abi::kStatusNotSupported == CUBLAS_STATUS_NOT_SUPPORTED);
static_assert(cu::lt_abi::kOpN == CUBLAS_OP_N);
static_assert(cu::lt_abi::kOpT == CUBLAS_OP_T);
static_assert(cu::lt_abi::kComputeF32 == CUBLAS_COMPUTE_32F);
static_assert(cu::lt_abi::kComputeF32FastTf32 == CUBLAS_COMPUTE_32F_FAST_TF32);
static_assert(cu::lt_abi::kDataF32 == CUDA_R_32F);
static_assert(cu::lt_abi::kDataF16 == CUDA_R_16F);
static_assert(cu::lt_abi::kDataBf16 == CUDA_R_16BF);
static_assert(cu::lt_abi::kDescTransA == CUBLASLT_MATMUL_DESC_TRANSA);
static_assert(cu::lt_abi::kDescTransB == CUBLASLT_MATMUL_DESC_TRANSB);
static_assert(cu::lt_abi::kDescEpilogue == CUBLASLT_MATMUL_DESC_EPILOGUE);
static_assert(cu::lt_abi::kDescBiasPointer == CUBLASLT_MATMUL_DESC_BIAS_POINTER);
static_assert(cu::lt_abi::kDescBiasBatchStride == CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE);
static_assert(cu::lt_abi::kDescEpilogueAuxPointer == CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER);
static_assert(cu::lt_abi::kDescEpilogueAuxLd == CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD);
static_assert(cu::lt_abi::kDescEpilogueAuxBatchStride ==
              CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE);
static_assert(cu::lt_abi::kLayoutBatchCount == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT);
static_assert(cu::lt_abi::kLayoutStridedBatchOffset == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET);
static_assert(cu::lt_abi::kPrefMaxWorkspaceBytes == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES);
static_assert(cu::lt_abi::kPrefReductionSchemeMask == CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK);
static_assert(cu::lt_abi::kReductionInplace == CUBLASLT_REDUCTION_SCHEME_INPLACE);
static_assert(cu::lt_abi::kReductionComputeType == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
static_assert(cu::lt_abi::kPrefMinAlignmentA == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES);
static_assert(cu::lt_abi::kPrefMinAlignmentB == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES);
static_assert(cu::lt_abi::kPrefMinAlignmentC == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES);
static_assert(cu::lt_abi::kPrefMinAlignmentD == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES);
static_assert(cu::lt_abi::kEpilogueDefault == CUBLASLT_EPILOGUE_DEFAULT);
static_assert(cu::lt_abi::kEpilogueBias == CUBLASLT_EPILOGUE_BIAS);
static_assert(cu::lt_abi::kEpilogueReluBias == CUBLASLT_EPILOGUE_RELU_BIAS);
static_assert(cu::lt_abi::kEpilogueReluAuxBias == CUBLASLT_EPILOGUE_RELU_AUX_BIAS);
static_assert(cu::lt_abi::kEpilogueGeluBias == CUBLASLT_EPILOGUE_GELU_BIAS);
static_assert(cu::lt_abi::kEpilogueGeluAuxBias == CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
static_assert(cu::lt_abi::kEpilogueDreluBgrad == CUBLASLT_EPILOGUE_DRELU_BGRAD);
static_assert(cu::lt_abi::kEpilogueDgeluBgrad == CUBLASLT_EPILOGUE_DGELU_BGRAD);
static_assert(cu::lt_abi::kHeuristicResultBytes == sizeof(cublasLtMatmulHeuristicResult_t));
static_assert(cu::lt_abi::kHeuristicStateOffset ==
              offsetof(cublasLtMatmulHeuristicResult_t, state));
static_assert(sizeof(cublasLtMatmulAlgo_t) == 64);

#if defined(MIXTAPE_HAVE_CUDNN_HEADER)
static_assert(cu::cudnn_abi::kStatusSuccess == CUDNN_STATUS_SUCCESS);
static_assert(cu::cudnn_abi::kDataFloat == CUDNN_DATA_FLOAT);
static_assert(cu::cudnn_abi::kDataHalf == CUDNN_DATA_HALF);
static_assert(cu::cudnn_abi::kDataBfloat16 == CUDNN_DATA_BFLOAT16);
static_assert(cu::cudnn_abi::kTensorNchw == CUDNN_TENSOR_NCHW);
static_assert(cu::cudnn_abi::kCrossCorrelation == CUDNN_CROSS_CORRELATION);
static_assert(cu::cudnn_abi::kDefaultMath == CUDNN_DEFAULT_MATH);
static_assert(cu::cudnn_abi::kTensorOpMath == CUDNN_TENSOR_OP_MATH);
static_assert(cu::cudnn_abi::kFmaMath == CUDNN_FMA_MATH);
static_assert(cu::cudnn_abi::kDeterministic == CUDNN_DETERMINISTIC);
static_assert(cu::cudnn_abi::kFwdAlgoDirect == CUDNN_CONVOLUTION_FWD_ALGO_DIRECT);
static_assert(CUDNN_CONVOLUTION_FWD_ALGO_FFT == cu::cudnn_abi::kFwdAlgoDirect + 1);
static_assert(cu::cudnn_abi::kBwdDataAlgo1 == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1);
static_assert(CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT == cu::cudnn_abi::kBwdDataAlgo1 + 1);
static_assert(cu::cudnn_abi::kBwdFilterAlgo3 == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3);
static_assert(cu::cudnn_abi::kBwdFilterAlgoFft == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT);
static_assert(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD == cu::cudnn_abi::kBwdFilterAlgo3 + 1);
// The algorithm-choice structures (deprecated in cuDNN 9, with the API they belong to).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
template <typename Perf>
constexpr bool laid_out_as_algo_perf() {
  using P = cu::cudnn_abi::AlgoPerf;
  return sizeof(Perf) == sizeof(P) && offsetof(Perf, algo) == offsetof(P, algo) &&
         offsetof(Perf, status) == offsetof(P, status) &&
         offsetof(Perf, time) == offsetof(P, time) &&
         offsetof(Perf, memory) == offsetof(P, memory) &&
         offsetof(Perf, determinism) == offsetof(P, determinism) &&
         offsetof(Perf, mathType) == offsetof(P, math_type) && sizeof(cudnnStatus_t) == sizeof(int);
}
static_assert(laid_out_as_algo_perf<cudnnConvolutionFwdAlgoPerf_t>());
static_assert(laid_out_as_algo_perf<cudnnConvolutionBwdDataAlgoPerf_t>());
static_assert(laid_out_as_algo_perf<cudnnConvolutionBwdFilterAlgoPerf_t>());
#pragma GCC diagnostic pop
#endif
#endif

}  // namespace
