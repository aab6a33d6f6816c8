// jit/background_worker.h -- one thread that runs queued jobs in the background, held back while
// foreground work runs, and stopped and joined before static destruction when the process exits.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace mixtape {

/// Runs jobs one at a time, in order, on a thread of its own at idle priority (SCHED_IDLE: it
/// gets a core only when no other thread wants it). While a Hold exists (the JIT's
/// foreground compiles, which use every core), and for quiet_period after the last one ends, it
/// starts no new job: foreground compiles come in bursts (a new program's kernels, then the next
/// program's a few milliseconds later), and background work delays a burst by at most the job
/// already running.
///
/// Exit: a job may run code whose function-local statics (LLVM's, OpenSSL's) are destroyed by
/// exit(). The first post() starts the thread and registers an atexit handler at that moment;
/// handlers and static destructors run in reverse order of registration, so the handler runs
/// before the destructors of every static constructed before the first post(). It runs the
/// queued jobs (drain(): the exiting thread and the worker), then joins the thread. The caller
/// makes sure that the statics its jobs use exist before the first post() (jit/llvm_jit.cpp runs
/// its first job on the calling thread for that reason). In a child made by fork(), which has no
/// such thread, the handler does nothing.
class BackgroundWorker {
 public:
  using Job = std::function<void()>;
  static constexpr std::chrono::milliseconds quiet_period{50};

  BackgroundWorker() = default;
  /// stop().
  ~BackgroundWorker();
  BackgroundWorker(const BackgroundWorker&) = delete;
  BackgroundWorker& operator=(const BackgroundWorker&) = delete;

  /// Queues job; false (and job dropped) once stop() has run. Jobs must not throw.
  bool post(Job job);
  /// Blocks until every job queued so far has run: the caller runs the queued ones itself (at
  /// its priority, holds or not), and waits for those already running.
  void drain();
  /// Lets the running job finish, drops the queued ones and joins the thread. Idempotent.
  void stop();
  /// Jobs queued or running now.
  size_t pending() const;

  /// While one lives, the worker starts no new job.
  class Hold {
   public:
    explicit Hold(BackgroundWorker& worker);
    ~Hold();
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    BackgroundWorker& worker_;
  };

 private:
  void run();
  // Runs the queue's first job with the lock let go meanwhile.
  void run_front(std::unique_lock<std::mutex>& lock);

  mutable std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::deque<Job> queue_;
  int running_ = 0;  // jobs running now, on the worker or in drain()
  bool stopping_ = false;
  int holds_ = 0;
  std::chrono::steady_clock::time_point quiet_from_{};  // the end of the last hold + quiet_period
  std::thread thread_;
  int owner_pid_ = 0;  // the process that started the thread
};

}  // namespace mixtape
