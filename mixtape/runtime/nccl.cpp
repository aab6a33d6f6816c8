// mixtape/runtime/nccl.cpp -- loads NCCL, holds the process's communicator, and runs grouped
// sends and receives on the compute stream with a timeout.
#include "mixtape/runtime/nccl.h"

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mixtape/dsl/error.h"

namespace mixtape::nccl {
namespace {

using Result = int;
struct CommOpaque;
using Comm = CommOpaque*;

struct Api {
  Result (*ncclGetVersion)(int* version);
  Result (*ncclGetUniqueId)(UniqueId* id);
  Result (*ncclCommInitRank)(Comm* comm, int size, UniqueId id, int rank);
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
    std::string tried;
    void* handle = nullptr;
    auto candidates = override_path && *override_path
                          ? std::vector<std::string>{override_path}
                          : std::vector<std::string>{"libnccl.so.2", "libnccl.so",
                                                     "/usr/local/cuda/lib64/libnccl.so.2",
                                                     "/usr/local/cuda/lib/libnccl.so.2"};
    for (const std::string& path : candidates) {
      handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) break;
      tried += (tried.empty() ? "" : ", ") + path;
    }
    if (handle == nullptr) {
      lib->reason = fmt::format("cannot load NCCL (tried {})", tried);
      return lib;
    }
    auto bind = [&](auto& slot, const char* symbol) {
      slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(handle, symbol));
      if (slot == nullptr && lib->reason.empty())
        lib->reason = fmt::format("the NCCL library lacks {} (older than 2.7?)", symbol);
    };
#define MIXTAPE_BIND(name) bind(lib->api.name, #name)
    MIXTAPE_BIND(ncclGetVersion);
    MIXTAPE_BIND(ncclGetUniqueId);
    MIXTAPE_BIND(ncclCommInitRank);
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
  const std::string reason = unavailable_reason();
  if (!reason.empty()) fail("NCCL is not available: {}", reason);
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
// Set when a transfer failed or timed out: the communicator was aborted, and no transfer may use
// it again (the other processes' halves of the group are gone).
std::atomic<bool> broken{false};

[[noreturn]] void abort_and_fail(const std::string& why) {
  broken = true;
  comm_size = 0;
  library().api.ncclCommAbort(comm);
  fail("dist: {}. This process can run no more collectives and should exit", why);
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
  check(api().ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank");
  comm_size = size;
}

int communicator_size() { return comm_size.load(); }

void set_timeout(double seconds) { timeout_seconds = seconds; }

void exchange(std::span<const Transfer> sends, std::span<const Transfer> receives) {
  std::lock_guard lock(comm_mutex);
  if (broken) fail("dist: an earlier NCCL transfer failed, so no other can run in this process");
  if (comm == nullptr) fail("nccl: no communicator (dist::init makes it)");
  const Api& nccl = api();
  cuda::CUstream stream = cuda::compute_stream().handle();
  check(nccl.ncclGroupStart(), "ncclGroupStart");
  // The group must end whatever fails inside it, or NCCL's thread-local group state stays open.
  Result first_error = abi::kSuccess;
  const char* failed_call = nullptr;
  auto note = [&](Result result, const char* call) {
    if (result != abi::kSuccess && first_error == abi::kSuccess) {
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
  static cuda::Event* finished = new cuda::Event(false);  // the driver may go before statics
  finished->record();
  const double limit = timeout_seconds.load();
  const auto start = std::chrono::steady_clock::now();
  while (!finished->done()) {
    Result async = abi::kSuccess;
    check(nccl.ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError");
    if (async != abi::kSuccess && async != abi::kInProgress)
      abort_and_fail(fmt::format("an NCCL transfer failed: {}", nccl.ncclGetErrorString(async)));
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > limit)
      abort_and_fail(fmt::format(
          "an NCCL transfer waited {} s (dist::set_timeout) for the other processes: one of them "
          "has stopped or hangs",
          limit));
    if (waited < 0.002)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace mixtape::nccl
