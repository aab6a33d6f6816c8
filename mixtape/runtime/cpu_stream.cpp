// mixtape/runtime/cpu_stream.cpp -- the CPU stream's worker thread, its queue, its failures, and
// its exit and fork.
#include "mixtape/runtime/cpu_stream.h"

#include <omp.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mixtape/dsl/error.h"
#include "mixtape/runtime/device.h"

namespace mixtape {
namespace {

// Work queued ahead of the worker before submit() waits: one evaluation is usually one piece
// (more where host steps split it), and running further ahead only holds more memory.
constexpr int64_t kMaxQueued = 4;
// How long the worker spins for new work, and a reader for finished work, before sleeping:
// waking a sleeping thread costs several microseconds, a traced step's whole host side 15-30.
// The worker spins less: the next work is usually queued before the last has run, and a
// spinning worker takes a core from an OpenMP team the caller may start meanwhile.
constexpr std::chrono::microseconds kWorkerSpin{50}, kReaderSpin{200};

thread_local bool on_worker = false;

// Added to Storage::queued_writes and queued_uses of what failed work was to write, for good:
// every host access to it asks the stream, and then fails (Storage::settle_host), and work that
// reads it fails in turn. Far above any number of uses queued at once.
constexpr int32_t kNeverComputed = int32_t{1} << 24;

// This work's write of `s` has run, or failed: one atomic step, so that no reader sees the
// count at zero in between.
void written(Storage& s, bool computed) {
  // Marked once: each failed write adding the mark again overflowed the count after 128.
  if (computed || s.queued_writes.load(std::memory_order_acquire) >= kNeverComputed) {
    s.queued_writes.fetch_sub(1, std::memory_order_release);
    return;
  }
  s.queued_uses.fetch_add(kNeverComputed, std::memory_order_relaxed);
  s.queued_writes.fetch_add(kNeverComputed - 1, std::memory_order_release);
}

void pause_briefly() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until `done()` or `spin` has passed; whether done() held.
template <typename Done>
bool spin_until(std::chrono::microseconds spin, Done done) {
  auto give_up = std::chrono::steady_clock::now() + spin;
  for (int i = 0;; ++i) {
    if (done()) return true;
    pause_briefly();
    if (i % 64 == 63 && std::chrono::steady_clock::now() > give_up) return done();
  }
}

// Its destructor, at the end of a thread that queued work, drops that thread's failures.
struct ForgetFailuresAtThreadExit {
  ~ForgetFailuresAtThreadExit();
};

}  // namespace

class CpuStream {
 public:
  void submit(std::unique_ptr<StreamWork> work) {
    work->submitter_ = std::this_thread::get_id();
    // A thread that ends with a failure unreported takes it along: its id may be another
    // thread's later, which must not be handed that failure.
    thread_local ForgetFailuresAtThreadExit forget;
    (void)forget;
    // Without spinning: the work queued ahead keeps the worker busy while this thread wakes.
    wait_for(submitted_.load(std::memory_order_relaxed) - kMaxQueued + 1, false);
    collect();
    if (closed_.load()) {  // exiting (an evaluation in a static's destructor): run it here
      on_worker = true;
      run(*work);
      on_worker = false;
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!worker_.joinable()) {
      owner_ = ::getpid();
      worker_ = std::thread([this] { loop(); });
      std::atexit(stop_at_exit);
    }
    queue_.push_back(std::move(work));
    submitted_.fetch_add(1, std::memory_order_release);
    if (worker_waiting_) work_ready_.notify_one();
  }

  // Reports a failure of the work this thread queued, once: the values it left uncomputed
  // report it again when read. Another thread's failure is that thread's to report (its own
  // graphs, DESIGN.md section 2); this one's values that read it fail when read.
  void finish() {
    wait_for(submitted_.load(std::memory_order_acquire), true);
    collect();
    std::string failure;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto mine = std::ranges::find(failures_, std::this_thread::get_id(),
                                    &std::pair<std::thread::id, std::string>::first);
      if (mine != failures_.end()) {
        failure = std::move(mine->second);
        failures_.erase(mine);
      }
    }
    if (!failure.empty())
      fail(
          "an asynchronous CPU evaluation failed; what it was to compute, and what was computed "
          "from that, is lost: {}",
          failure);
  }

  // At exit: lets the queued work run, then joins the worker. Only in the process that started
  // it: a child made by fork() has no such thread.
  void stop() {
    if (::getpid() != owner_ || !worker_.joinable()) return;
    closed_.store(true);
    wait_for(submitted_.load(std::memory_order_acquire), false);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      work_ready_.notify_one();
      for (const auto& [thread, failure] : failures_)
        std::fprintf(stderr,
                     "mixtape: an asynchronous CPU evaluation failed and nothing read it: %s\n",
                     failure.c_str());
    }
    worker_.join();
    collect();
  }

  // Before fork(): nothing queued or held, so that the child (which has no worker) inherits
  // only finished values.
  void drain_for_fork() {
    wait_for(submitted_.load(std::memory_order_acquire), false);
    collect();
  }

  static void stop_at_exit();

  // Drops the failures of this thread's work, which it can no longer be told of.
  void forget_failures() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(failures_,
                  [](const auto& entry) { return entry.first == std::this_thread::get_id(); });
  }
  bool started() {
    std::lock_guard<std::mutex> lock(mutex_);
    return worker_.joinable();
  }

 private:
  // Drops the work that has run, on a thread that queues work (see ~StreamWork).
  void collect() {
    std::vector<std::unique_ptr<StreamWork>> done;
    std::lock_guard<std::mutex> lock(mutex_);
    done.swap(retired_);
  }

  // Until at least `count` pieces of work have finished; spinning a while first where the
  // caller waits to read a result.
  void wait_for(int64_t count, bool spin) {
    if (on_worker || completed_.load(std::memory_order_acquire) >= count) return;
    if (spin && spin_until(kReaderSpin,
                           [&] { return completed_.load(std::memory_order_acquire) >= count; }))
      return;
    waiters_.fetch_add(1);
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_done_.wait(lock, [&] { return completed_.load(std::memory_order_acquire) >= count; });
    }
    waiters_.fetch_sub(1);
  }

  // The work queued is small (cpu_executor.cpp, runs_on_one_thread): no team of its own.
  void loop() {
    on_worker = true;
    omp_set_num_threads(1);
    for (;;) {
      spin_until(kWorkerSpin, [&] {
        return submitted_.load(std::memory_order_acquire) >
               completed_.load(std::memory_order_relaxed);
      });
      std::unique_ptr<StreamWork> work;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        worker_waiting_ = true;
        work_ready_.wait(lock, [&] { return !queue_.empty() || stopping_; });
        worker_waiting_ = false;
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      run(*work);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        retired_.push_back(std::move(work));
      }
      completed_.fetch_add(1);
      if (waiters_.load() > 0) {
        std::lock_guard<std::mutex> lock(mutex_);
        work_done_.notify_all();
      }
    }
  }

  void run(StreamWork& work) {
    try {
      if (const char* missing = work.uncomputed_input()) fail("{}", missing);
      apply_flush_denormal();
      work.run();
      work.computed_ = true;
    } catch (const std::exception& e) {
      note_failure(work.submitter_, e.what());
    } catch (...) {
      note_failure(work.submitter_, "an unknown exception");
    }
    for (const auto& s : work.outputs_) written(*s, work.computed_);
    work.ran_ = true;
  }

  // The first failure of each thread's work.
  void note_failure(std::thread::id submitter, const char* what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::ranges::find(failures_, submitter, &std::pair<std::thread::id, std::string>::first) ==
        failures_.end())
      failures_.emplace_back(submitter, what);
  }

  std::mutex mutex_;
  std::condition_variable work_ready_, work_done_;
  std::deque<std::unique_ptr<StreamWork>> queue_;
  std::vector<std::unique_ptr<StreamWork>> retired_;  // run, to be dropped by collect()
  std::atomic<int64_t> submitted_{0}, completed_{0};
  std::atomic<int> waiters_{0};
  bool worker_waiting_ = false, stopping_ = false;
  std::atomic<bool> closed_{false};  // stopped at exit: later work runs on its caller's thread
  // Per thread that queued it, the first failure not yet reported; under mutex_.
  std::vector<std::pair<std::thread::id, std::string>> failures_;
  pid_t owner_ = 0;
  std::thread worker_;
};

namespace {

// Replaced, never destroyed: exit() stops it through stop_at_exit, and a child made by fork()
// starts a stream of its own (its copy of the parent's holds a thread object without a thread).
std::atomic<CpuStream*> the_stream{nullptr};

void drain_before_fork() {
  if (CpuStream* s = the_stream.load()) s->drain_for_fork();
}
void fresh_stream_in_child() {
  if (the_stream.load()) the_stream.store(new CpuStream);
}

CpuStream& stream() {
  static const bool made = [] {
    pthread_atfork(drain_before_fork, nullptr, fresh_stream_in_child);
    the_stream.store(new CpuStream);
    return true;
  }();
  (void)made;
  return *the_stream.load();
}

}  // namespace

ForgetFailuresAtThreadExit::~ForgetFailuresAtThreadExit() {
  if (CpuStream* s = the_stream.load()) s->forget_failures();
}

void CpuStream::stop_at_exit() {
  if (CpuStream* s = the_stream.load()) s->stop();
}

// Held first, then counted: a hold that fails (no memory) leaves no count that the destructor
// would not take back.
std::byte* StreamWork::read(const std::shared_ptr<Storage>& value) {
  if (value->host_stale.load()) value->host_data();  // a device value
  inputs_.push_back(value);
  value->queued_uses.fetch_add(1, std::memory_order_relaxed);
  return value->bytes.data();
}

std::byte* StreamWork::write(const std::shared_ptr<Storage>& value) {
  outputs_.push_back(value);
  value->queued_uses.fetch_add(1, std::memory_order_relaxed);
  value->queued_writes.fetch_add(1, std::memory_order_relaxed);
  return value->bytes.data();
}

// On the worker, when the work starts.
const char* StreamWork::uncomputed_input() const {
  for (const auto& s : inputs_)
    if (s->queued_writes.load(std::memory_order_acquire) >= kNeverComputed)
      return "it reads a value that earlier failed work did not compute";
  return nullptr;
}

// On a thread that queues work (CpuStream::collect), never the worker: each storage's
// use_count() and queued_uses then change together, as reusable_buffer (cpu_executor.cpp) reads
// them. What work that never ran was to write is never computed, as a failed work's is: reading
// it is an mt::Error (Storage::settle_host), and work reading it fails.
StreamWork::~StreamWork() {
  if (!ran_)
    for (const auto& s : outputs_) written(*s, false);
  for (const auto& s : outputs_) s->queued_uses.fetch_sub(1, std::memory_order_release);
  for (const auto& s : inputs_) s->queued_uses.fetch_sub(1, std::memory_order_release);
}

void submit_to_cpu_stream(std::unique_ptr<StreamWork> work) { stream().submit(std::move(work)); }

void finish_cpu_stream() {
  if (!on_worker) stream().finish();
}

bool on_cpu_stream() { return on_worker; }

// Before the worker starts there is nothing to do: starting it registers the handler, after
// every static that exists by then.
void keep_cpu_stream_ahead_of_exit() {
  CpuStream* s = the_stream.load();
  if (s && s->started()) std::atexit(CpuStream::stop_at_exit);
}

}  // namespace mixtape
