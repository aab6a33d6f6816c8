// mixtape/jit/background_worker.h -- threads that run queued jobs in the background: on idle CPU
// time first, at normal priority once a job has waited long enough; held back while foreground work
// runs, drained and joined before static destruction when the process exits, and quiet across
// fork().
#pragma once

#include <sched.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace mixtape {

/// Runs jobs in order, on two threads of its own:
/// - one at idle priority (SCHED_IDLE, or the lowest real-time priority when the process runs
///   under one), which gets a core only when no other thread wants it, so it never slows the
///   foreground -- above all an OpenMP team, whose every region would otherwise wait for its
///   time slice;
/// - one at normal priority, which runs the jobs that have waited `patience`: a training loop's
///   OpenMP team spins between regions, so on a machine with few cores the idle thread may get
///   no time at all, and a long run should not stay on the jobs' slower fallback.
/// While a Hold exists (the JIT's foreground compiles, which use every core), and for
/// quiet_period after the last one ends, neither starts a job: foreground compiles come in
/// bursts (a new program's kernels, then the next program's a few milliseconds later), and
/// background work delays a burst by at most the jobs already running.
///
/// Exit: a job may run code whose function-local statics (LLVM's, OpenSSL's) are destroyed by
/// exit(). The first post() starts the threads and registers an atexit handler at that moment;
/// handlers and static destructors run in reverse order of registration, so the handler runs
/// before the destructors of every static constructed before the first post(). It stops the
/// worker (stop(): the running jobs finish, the queued ones are dropped, each with its on_drop),
/// so that exit waits for at most the jobs under way. The caller makes sure that the statics its
/// jobs use exist before the first post() (jit/llvm_jit.cpp tiers up a kernel of its own before
/// its first post() for that reason).
///
/// fork(): no job runs across it. A job holds locks (the JIT's and LLVM's, and under ASan the
/// allocator's) that a child made meanwhile would wait on forever, since the thread that held them
/// is not copied. The first post() registers fork handlers: before the fork each worker lets its
/// running jobs end (an idle-priority one raised to the forking thread's priority meanwhile) and
/// starts no other, drain() included, then holds its lock until the fork is done. The child's
/// copy has no threads: it starts threads of its own at its next post(), and runs what was queued.
/// A job must not fork, nor make, post to or destroy a worker. Only the workers' own threads are
/// quiesced: a fork while another thread of the process compiles or evaluates is not supported
/// (its locks would be the child's, held), as POSIX has it for any library.
class BackgroundWorker {
 public:
  using Job = std::function<void()>;
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds quiet_period{50};
  static constexpr std::chrono::milliseconds default_patience{2000};

  /// idle_thread false: the normal-priority thread alone (tests).
  explicit BackgroundWorker(std::chrono::milliseconds patience = default_patience,
                            bool idle_thread = true)
      : patience_(patience), use_idle_thread_(idle_thread) {}
  /// stop().
  ~BackgroundWorker();
  BackgroundWorker(const BackgroundWorker&) = delete;
  BackgroundWorker& operator=(const BackgroundWorker&) = delete;

  /// Queues job; false (and job dropped, on_drop not run) once stop() has run. on_drop, if any,
  /// runs instead of job should stop() drop it unrun (at exit, for one). Neither may throw.
  /// at_once: the normal-priority thread need not wait its patience for it (quiet periods still
  /// hold it back).
  bool post(Job job, Job on_drop = {}, bool at_once = false);
  /// Blocks until every job queued so far has run: the caller runs the queued ones itself (at
  /// its priority, holds or not), and waits for those already running.
  void drain();
  /// Lets the running jobs finish, drops the queued ones (running their on_drop on the caller's
  /// thread, after the threads are joined) and joins the threads. Idempotent.
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
  // A thread's loop: idle, it runs jobs as soon as it may; patient, those that have waited.
  void run(bool idle);
  // Runs the queue's first job with the lock let go meanwhile.
  void run_front(std::unique_lock<std::mutex>& lock);

  struct Queued {
    Job job, on_drop;
    Clock::time_point since;
  };
  const std::chrono::milliseconds patience_;
  const bool use_idle_thread_;
  mutable std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::deque<Queued> queue_;
  int running_ = 0;  // jobs running now, on the threads or in drain()
  bool stopping_ = false;
  int holds_ = 0;
  Clock::time_point quiet_from_{};  // the end of the last hold + quiet_period
  std::thread idle_thread_, patient_thread_;
  bool forking_ = false;  // a fork() is under way: no job starts
  // While a fork waits for a job on the idle thread, that thread's own priority, to restore.
  bool idle_priority_raised_ = false;
  int idle_policy_ = 0;
  sched_param idle_param_{};

  // The fork handlers' parts (background_worker.cpp registers them).
  void before_fork();
  void after_fork_in_parent();
  void after_fork_in_child();
  friend struct WorkerForkHandlers;
};

}  // namespace mixtape
