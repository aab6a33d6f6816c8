// mixtape/runtime/nccl.h -- NCCL loaded with dlopen: the communicator of a data-parallel run on
// GPUs and the grouped point-to-point transfers the collective steps make on the compute stream.
#pragma once

#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "mixtape/runtime/cuda_driver.h"

namespace mixtape::nccl {

// The values of nccl.h that mixtape uses, declared here so that nothing links against the
// toolkit; tests/test_cuda_runtime.cpp checks them against nccl.h where it is installed.
namespace abi {
inline constexpr int kSuccess = 0;             // ncclSuccess
inline constexpr int kInProgress = 7;          // ncclInProgress
inline constexpr int kInt8 = 0;                // ncclInt8: transfers count bytes
inline constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
// ncclConfig_t as NCCL 2.14 laid it out, the first release with it: NCCL copies the first `size`
// bytes of a caller's config over its defaults and reads the fields by the caller's version,
// so later releases take it. Only `blocking` is set; the rest keep NCCL's "undefined".
struct Config {
  size_t size = sizeof(Config);
  unsigned magic = 0xcafebeef;
  unsigned version = 21400;  // NCCL_VERSION(2, 14, 0)
  int blocking = 0;          // calls return at once; progress shows in ncclCommGetAsyncError
  int cga_cluster_size = INT_MIN, min_ctas = INT_MIN, max_ctas = INT_MIN;
  const char* net_name = nullptr;
};
}  // namespace abi

/// ncclUniqueId: rank 0 makes it, every process gets it (dist::init broadcasts it through MPI).
struct UniqueId {
  std::array<char, abi::kUniqueIdBytes> bytes{};
};

/// Why NCCL cannot carry this process's device collectives, empty when it can: CUDA not
/// available, or load_library()'s reason. Never throws.
std::string unavailable_reason();
/// Loads libnccl.so.2 (MIXTAPE_NCCL_LIBRARY names another file) once per process: empty when it
/// loaded with every symbol mixtape calls, else why not. Never throws.
std::string load_library();
/// ncclGetVersion's code (e.g. 22809 for 2.28.9) when the library loaded, else 0.
int version();

/// Rank 0's id for init_communicator.
UniqueId unique_id();
/// Joins the communicator of `size` processes (every process calls it with rank 0's id) on
/// this process's CUDA device, waiting for the others for at most the timeout (an mt::Error
/// then, or when NCCL fails); the device collectives then use it (communicator_size()).
void init_communicator(int size, int rank, const UniqueId& id);
/// Aborts this process's communicator, if any, and forgets it: dist::init's way back to MPI
/// when another process could not join.
void leave_communicator();
/// The communicator's process count, 0 without one. After a failed or timed-out call it stays,
/// and every transfer fails: the other processes still send through NCCL.
int communicator_size();
/// How long a transfer waits for the other processes before it aborts the communicator and
/// fails (dist::set_timeout sets it; 300 s by default).
void set_timeout(double seconds);

/// `bytes` at `address` to or from process `peer`.
struct Transfer {
  cuda::CUdeviceptr address = 0;
  int64_t bytes = 0;
  int peer = 0;
};
/// Every send and receive in one NCCL group on the compute stream (queued after the work that
/// computes the sent bytes), then waits for them: polling, for at most the timeout, the
/// communicator's asynchronous errors too. A process that died or hangs makes this one abort
/// the communicator and fail with an mt::Error, after which no transfer runs here again.
void exchange(std::span<const Transfer> sends, std::span<const Transfer> receives);

}  // namespace mixtape::nccl
