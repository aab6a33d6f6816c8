// mixtape/dist/init.cpp -- dist::init: MPI's process group (when this build has MPI and mpirun
// started the process), or one process and the reason why.
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "mixtape/dist/checked_group.h"
#include "mixtape/dist/dist.h"
#include "mixtape/dist/exchange.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/process_group.h"
#include "mixtape/runtime/cuda_driver.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/nccl.h"
#include "mixtape/runtime/program.h"

#ifdef MIXTAPE_HAVE_MPI
#include <mpi.h>
#endif

namespace mixtape::dist {
namespace {

std::atomic<double> timeout_seconds{300};

#ifdef MIXTAPE_HAVE_MPI

// Set when a collective timed out: its request is still posted, so this process makes no MPI
// call again (not even MPI_Finalize, which would wait for the processes that stopped).
std::atomic<bool> broken{false};

// MPI counts and displacements are ints: larger transfers are refused, not truncated.
int as_count(int64_t bytes, const char* call) {
  if (bytes < 0 || bytes > INT_MAX)
    fail("dist: {} of {} bytes exceeds MPI's int counts (at most {} bytes per process)", call,
         bytes, INT_MAX);
  return static_cast<int>(bytes);
}

std::vector<int> as_counts(std::span<const int64_t> bytes, const char* call) {
  std::vector<int> out;
  out.reserve(bytes.size());
  for (int64_t b : bytes) out.push_back(as_count(b, call));
  return out;
}

// Errors return (MPI_ERRORS_RETURN on our communicator) and become mt::Error naming the call.
void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  // A message longer than its receive buffer: the processes paired two different collectives.
  int error_class = MPI_SUCCESS;
  MPI_Error_class(code, &error_class);
  const char* why =
      error_class == MPI_ERR_TRUNCATE
          ? " (the processes made different collectives here: one made a call the others did "
            "not, such as dist::save_checkpoint on process 0 alone, which every process must "
            "call; MIXTAPE_DIST_DEBUG=1 names both calls)"
          : "";
  fail("dist: {} failed: {}{}", call, std::string(text, static_cast<size_t>(length)), why);
}

// Waits for a nonblocking collective, polling, for at most the timeout: a process that died or
// hangs makes the others fail with an mt::Error instead of waiting forever.
void wait(MPI_Request& request, const char* call) {
  const double limit = timeout_seconds.load();
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    int done = 0;
    check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), call);
    if (done) return;
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > limit) {
      broken = true;
      fail(
          "dist: {} waited {} s (dist::set_timeout) for the other processes: one of them has "
          "stopped or hangs. This process can run no more collectives and should exit",
          call, limit);
    }
    // Poll, yielding the core, for about as long as a transfer of a few megabytes takes: a
    // nonblocking collective moves only while MPI_Test runs, so sleeps between polls stall it
    // (a 3.3 MB reduction took twice as long with sleeps after the first 1000 polls). Then
    // sleep between polls: with more processes than cores, a longer spin takes the core from
    // the process it waits for (20 ms of it made a loaded machine's reductions 4x slower).
    if (waited < 0.002)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void check_not_broken() {
  if (broken) fail("dist: an earlier collective timed out, so no other can run in this process");
}

class MpiGroup : public ProcessGroup {
 public:
  MpiGroup() {
    // Errors of requests on the duplicate can surface on MPI_COMM_WORLD (MPI_Test), whose
    // default handler aborts the job: both return them, as mt::Error.
    check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_to_all(const std::byte* send, std::span<const int64_t> send_count,
                  std::span<const int64_t> send_at, std::byte* recv,
                  std::span<const int64_t> recv_count, std::span<const int64_t> recv_at) override {
    const char* call = "MPI_Alltoallv";
    std::vector<int> sc = as_counts(send_count, call), sa = as_counts(send_at, call),
                     rc = as_counts(recv_count, call), ra = as_counts(recv_at, call);
    check_not_broken();
    MPI_Request request;
    check(MPI_Ialltoallv(send, sc.data(), sa.data(), MPI_BYTE, recv, rc.data(), ra.data(), MPI_BYTE,
                         comm_, &request),
          call);
    wait(request, call);
  }
  void all_gather(const std::byte* send, int64_t count, std::byte* recv,
                  std::span<const int64_t> counts, std::span<const int64_t> at) override {
    const char* call = "MPI_Allgatherv";
    std::vector<int> c = as_counts(counts, call), a = as_counts(at, call);
    check_not_broken();
    MPI_Request request;
    check(MPI_Iallgatherv(send, as_count(count, call), MPI_BYTE, recv, c.data(), a.data(), MPI_BYTE,
                          comm_, &request),
          call);
    wait(request, call);
  }
  void broadcast(std::byte* data, int64_t count, int root) override {
    const char* call = "MPI_Bcast";
    check_not_broken();
    MPI_Request request;
    check(MPI_Ibcast(data, as_count(count, call), MPI_BYTE, root, comm_, &request), call);
    wait(request, call);
  }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

// Why this process keeps its device collectives off NCCL, empty when it can use it.
std::string nccl_reason_here(int processes) {
  const char* disabled = std::getenv("MIXTAPE_NCCL");
  if (disabled && std::string(disabled) == "0") return "MIXTAPE_NCCL=0";
  // NCCL allows 2048 operations in a group; an exchange posts two per process.
  if (processes > 1024) return fmt::format("{} processes: NCCL groups hold 1024 peers", processes);
  try {
    // A run on the CPU (MIXTAPE_DEVICE=cpu on a machine with GPUs) keeps CUDA unopened.
    if (current_device() != Device::cuda)
      return fmt::format("the run's device is {} (MIXTAPE_DEVICE or set_device before init)",
                         device_name(current_device()));
  } catch (const Error& e) {
    return e.what();
  }
  return nccl::unavailable_reason();
}

// "process q: its text" for the first process whose text is not empty; empty when none is.
std::string first_said(const std::vector<std::string>& texts) {
  for (size_t q = 0; q < texts.size(); ++q)
    if (!texts[q].empty()) return fmt::format("process {}: {}", q, texts[q]);
  return {};
}

// Makes the NCCL communicator when every process can use NCCL: all or none, agreed over MPI
// before and after (a process on MPI and another on NCCL would wait for each other forever).
// Returns why not, empty when made; never throws for NCCL's sake.
std::string join_nccl(ProcessGroup& group) {
  const int processes = group.size();
  std::string reason = nccl_reason_here(processes);
  // The GPU by UUID: CUDA_VISIBLE_DEVICES may number one GPU differently in two processes, or
  // two GPUs alike, and NCCL needs a GPU per process.
  std::string gpu;
  if (reason.empty()) try {
      const std::array<char, 16> uuid = cuda::device_uuid();
      gpu.assign(uuid.begin(), uuid.end());
    } catch (const Error& e) {
      reason = e.what();
    }
  if (std::string other = first_said(gather_text(group, reason)); !other.empty())
    return reason.empty() ? other : reason;
  const std::vector<std::string> gpus = gather_text(group, gpu);
  for (int q = 0; q < processes; ++q)
    for (int r = 0; r < q; ++r)
      if (gpus[r] == gpus[q])
        return fmt::format(
            "processes {} and {} share a GPU (NCCL needs a GPU per process; "
            "MIXTAPE_CUDA_DEVICE or CUDA_VISIBLE_DEVICES picks one)",
            r, q);
  // Rank 0's id, and whether it made one, to every process.
  struct {
    nccl::UniqueId id;
    int ok = 1;
  } offer;
  std::string failure;
  if (group.rank() == 0) try {
      offer.id = nccl::unique_id();
    } catch (const Error& e) {
      offer.ok = 0;
      failure = e.what();
    }
  group.broadcast(reinterpret_cast<std::byte*>(&offer), sizeof(offer), 0);
  if (!offer.ok) return failure.empty() ? "process 0 could not make an NCCL id" : failure;
  nccl::set_timeout(timeout_seconds.load());
  try {
    nccl::init_communicator(processes, group.rank(), offer.id);
  } catch (const Error& e) {
    failure = e.what();
  }
  const std::string other = first_said(gather_text(group, failure));
  if (other.empty()) return {};
  nccl::leave_communicator();
  return failure.empty() ? other : failure;
}

// The variables that mpirun (Open MPI's, or a PMI/PMIx launcher such as MPICH's or Slurm's)
// sets for the processes it starts.
const char* launcher_variable() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(name)) return name;
  return nullptr;
}

World join_mpi() {
  if (!launcher_variable())
    return {0, 1,
            "not started by an MPI launcher (no OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK in "
            "the environment): run it with mpirun -np N to train on N processes",
            "one process"};
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    // Steps run their collectives from one thread at a time; SERIALIZED lets that be any thread.
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    std::atexit([] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized && !broken) MPI_Finalize();
    });
    if (provided < MPI_THREAD_SERIALIZED)
      fail("dist::init: this MPI gives thread level {}, mixtape needs MPI_THREAD_SERIALIZED ({})",
           provided, static_cast<int>(MPI_THREAD_SERIALIZED));
  } else {
    // The caller initialized MPI: below SERIALIZED, only the thread that did may call it, so the
    // collectives stay on the evaluating thread (no overlap with the backward pass).
    int provided = 0;
    check(MPI_Query_thread(&provided), "MPI_Query_thread");
    if (provided < MPI_THREAD_SERIALIZED) set_overlap_collectives(false);
  }
  auto group = std::make_shared<MpiGroup>();
  World world{group->rank(), group->size(), "", "one process"};
  if (world.size == 1) {
    world.single_reason = "the MPI launcher started one process (mpirun -np 1)";
    return world;
  }
  world.nccl_reason = join_nccl(*group);
  // MIXTAPE_DIST_DEBUG=1: every collective checked to be the same on every process first. Rank
  // 0's setting holds for all (a launcher may hand the variable to some processes only), since a
  // checked process's collectives would not pair with an unchecked one's.
  const char* debug = std::getenv("MIXTAPE_DIST_DEBUG");
  int64_t checked = debug && std::string_view(debug) == "1" ? 1 : 0;
  group->broadcast(reinterpret_cast<std::byte*>(&checked), sizeof(checked), 0);
  if (checked == 1)
    set_process_group(checked_process_group(std::move(group)));
  else
    set_process_group(std::move(group));
  return world;
}

#else

World join_mpi() {
  return {0, 1,
          "this mixtape was built without MPI (install libopenmpi-dev and openmpi-bin, then "
          "configure again with -DMIXTAPE_MPI=ON)",
          "one process"};
}

#endif

std::once_flag joined;
World world;

}  // namespace

World init() {
  std::call_once(joined, [] { world = join_mpi(); });
  return world;
}

void set_timeout(double seconds) {
  if (!(seconds > 0)) fail("dist::set_timeout: {} s is not a positive time", seconds);
  timeout_seconds = seconds;
  nccl::set_timeout(seconds);
}

int rank() { return process_rank(); }
int world_size() { return process_count(); }
Shard shard() { return {process_rank(), process_count()}; }

}  // namespace mixtape::dist
