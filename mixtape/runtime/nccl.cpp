// mixtape/runtime/nccl.cpp -- loads NCCL, holds the process's communicator, and runs grouped
// sends and receives on the compute stream with a timeout.
#include "mixtape/runtime/nccl.h"

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mixtape/dsl/error.h"
#include "mixtape/runtime/shared_library.h"

namespace mixtape::nccl {
namespace {

using Result = int;
struct CommOpaque;
using Comm = CommOpaque*;

struct Api {
  Result (*ncclGetVersion)(int* version);
  Result (*ncclGetUniqueId)(UniqueId* id);
  Result (*ncclCommInitRankConfig)(Comm* comm, int size, UniqueId id, int rank,
                                   abi::Config* config);
  Result (*ncclCommAbort)(Comm comm);
  Result (*ncclCommGetAsyncError)(Comm comm, Result* error);
  const char* (*ncclGetErrorString)(Result result);
  Result (*ncclGroupStart)();
  Result (*ncclGroupEnd)();
  Result (*ncclSend)(const void* data, size_t count, int type, int peer, Comm comm,
                     cuda::CUstream stream);
  Result (*ncclRecv)(void* data, size_t count, int type, int peer, Comm comm,
                     cuda::CUstream stream);
};

struct Library {
  Api api{};
  int version = 0;
  std::string reason;  // why the library is unusable; empty when it loaded whole
};

// The library stays loaded for the life of the process (communicators may outlive statics).
const Library& library() {
  static const Library* loaded = [] {
    auto* lib = new Library;
    const char* override_path = std::getenv("MIXTAPE_NCCL_LIBRARY");
    auto candidates = override_path && *override_path
                          ? std::vector<std::string>{override_path}
                          : std::vector<std::string>{"libnccl.so.2", "libnccl.so",
                                                     "/usr/local/cuda/lib64/libnccl.so.2",
                                                     "/usr/local/cuda/lib/libnccl.so.2"};
    void* handle = open_first_library(candidates, "NCCL", lib->reason);
    if (handle == nullptr) return lib;
#define MIXTAPE_BIND(name) \
  bind_symbol(handle, lib->api.name, #name, "the NCCL library", lib->reason, " (older than 2.14?)")
    MIXTAPE_BIND(ncclGetVersion);
    MIXTAPE_BIND(ncclGetUniqueId);
    MIXTAPE_BIND(ncclCommInitRankConfig);
    MIXTAPE_BIND(ncclCommAbort);
    MIXTAPE_BIND(ncclCommGetAsyncError);
    MIXTAPE_BIND(ncclGetErrorString);
    MIXTAPE_BIND(ncclGroupStart);
    MIXTAPE_BIND(ncclGroupEnd);
    MIXTAPE_BIND(ncclSend);
    MIXTAPE_BIND(ncclRecv);
#undef MIXTAPE_BIND
    if (lib->reason.empty() && lib->api.ncclGetVersion(&lib->version) != abi::kSuccess)
      lib->reason = "ncclGetVersion failed";
    return lib;
  }();
  return *loaded;
}

const Api& api() {
  // Checked without building the reason's text: every transfer passes here.
  if (!cuda::available() || !library().reason.empty())
    fail("NCCL is not available: {}", unavailable_reason());
  cuda::driver();  // the device's context current on this thread: NCCL's runtime calls use it
  return library().api;
}

void check(Result result, const char* call) {
  if (result == abi::kSuccess) return;
  fail("{} failed: {} (NCCL error {})", call, library().api.ncclGetErrorString(result), result);
}

std::mutex comm_mutex;
Comm comm = nullptr;
std::atomic<int> comm_size{0};
std::atomic<double> timeout_seconds{300};
// Set when a call failed or timed out: the communicator was aborted, and nothing may use it
// again (the other processes' halves of its work are gone). The size stays, so that collectives
// keep coming here and fail, instead of going to MPI while the other processes use NCCL.
std::atomic<bool> broken{false};

[[noreturn]] void abort_and_fail(const std::string& why) {
  broken = true;
  library().api.ncclCommAbort(comm);
  fail("dist: {}. This process can run no more collectives and should exit", why);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Waits, polling, for at most the timeout, until `done()` and NCCL's asynchronous state of the
// communicator say the work has finished; `started()` says when the clock may start (the work
// queued before it on the stream does not count). A failure or the timeout aborts the
// communicator. `what` names the work in the error.
template <typename Started, typename Done>
void wait_for(const char* what, Started started, Done done) {
  const Api& nccl = library().api;
  const double limit = timeout_seconds.load();
  auto start = std::chrono::steady_clock::now();
  bool counting = false;
  for (;;) {
    Result state = abi::kSuccess;
    bool finished = false;
    try {
      check(nccl.ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError");
      if (state != abi::kSuccess && state != abi::kInProgress)
        abort_and_fail(fmt::format("{} failed: {}", what, nccl.ncclGetErrorString(state)));
      finished = state == abi::kSuccess && done();
      if (!counting && started()) {
        counting = true;
        start = std::chrono::steady_clock::now();
      }
    } catch (const Error& e) {
      if (broken) throw;
      abort_and_fail(fmt::format("{}: {}", what, e.what()));
    }
    if (finished) return;
    const double waited = counting ? seconds_since(start) : 0;
    if (waited > limit)
      abort_and_fail(fmt::format(
          "{} waited {} s (dist::set_timeout) for the other processes: one of them has stopped "
          "or hangs",
          what, limit));
    if (waited < 0.002)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

std::string unavailable_reason() {
  // CUDA first: without a GPU the library (hundreds of megabytes) is not even mapped.
  if (!cuda::available()) return "CUDA is not available: " + cuda::unavailable_reason();
  return library().reason;
}

std::string load_library() { return library().reason; }

int version() { return library().reason.empty() ? library().version : 0; }

UniqueId unique_id() {
  UniqueId id;
  check(api().ncclGetUniqueId(&id), "ncclGetUniqueId");
  return id;
}

void init_communicator(int size, int rank, const UniqueId& id) {
  std::lock_guard lock(comm_mutex);
  if (comm != nullptr) fail("nccl: this process has joined a communicator already");
  abi::Config config;
  const Result result = api().ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (result != abi::kSuccess && result != abi::kInProgress) {
    if (comm != nullptr) library().api.ncclCommAbort(comm);
    comm = nullptr;
    check(result, "ncclCommInitRankConfig");
  }
  // Non-blocking: the processes connect in the background, and a missing one is a timeout.
  wait_for(
      "NCCL's communicator setup", [] { return true; }, [] { return true; });
  comm_size = size;
}

void leave_communicator() {
  std::lock_guard lock(comm_mutex);
  // A communicator a failure aborted already (broken) is not aborted twice.
  if (comm != nullptr && !broken && library().reason.empty()) library().api.ncclCommAbort(comm);
  comm = nullptr;
  comm_size = 0;
  broken = false;
}

int communicator_size() { return comm_size.load(); }

void set_timeout(double seconds) { timeout_seconds = seconds; }

void exchange(std::span<const Transfer> sends, std::span<const Transfer> receives) {
  std::lock_guard lock(comm_mutex);
  if (broken) fail("dist: an earlier NCCL call failed, so no other can run in this process");
  if (comm == nullptr) fail("nccl: no communicator (dist::init makes it)");
  const Api& nccl = api();
  cuda::CUstream stream = cuda::compute_stream().handle();
  // Events the driver may outlive: the clock starts when the work queued before the transfers
  // has run, and stops when they have.
  static cuda::Event* queued = new cuda::Event(false);
  static cuda::Event* finished = new cuda::Event(false);
  queued->record();
  check(nccl.ncclGroupStart(), "ncclGroupStart");
  // The group must end whatever fails inside it, or NCCL's thread-local group state stays open.
  Result first_error = abi::kSuccess;
  const char* failed_call = nullptr;
  auto note = [&](Result result, const char* call) {
    if (result != abi::kSuccess && result != abi::kInProgress && first_error == abi::kSuccess) {
      first_error = result;
      failed_call = call;
    }
  };
  for (const Transfer& t : sends)
    if (t.bytes > 0)
      note(nccl.ncclSend(reinterpret_cast<const void*>(t.address), static_cast<size_t>(t.bytes),
                         abi::kInt8, t.peer, comm, stream),
           "ncclSend");
  for (const Transfer& t : receives)
    if (t.bytes > 0)
      note(nccl.ncclRecv(reinterpret_cast<void*>(t.address), static_cast<size_t>(t.bytes),
                         abi::kInt8, t.peer, comm, stream),
           "ncclRecv");
  note(nccl.ncclGroupEnd(), "ncclGroupEnd");
  if (first_error != abi::kSuccess)
    abort_and_fail(fmt::format("{} failed: {}", failed_call, nccl.ncclGetErrorString(first_error)));
  // Wait here, as the MPI path waits: a dead peer leaves the stream blocked in NCCL's kernel,
  // which only an abort frees, and a host that moved on would queue work behind it forever.
  // ncclGroupEnd of a non-blocking communicator may return before the work is queued (its
  // state then reads ncclInProgress), so the end event is recorded once the state is settled.
  wait_for(
      "an NCCL transfer", [&] { return queued->done(); }, [] { return true; });
  finished->record();
  wait_for(
      "an NCCL transfer", [&] { return queued->done(); }, [&] { return finished->done(); });
}

}  // namespace mixtape::nccl
