// mixtape/jit/background_worker.cpp -- the background worker's queue, holds, and its join at exit.
#include "mixtape/jit/background_worker.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <vector>

namespace mixtape {
namespace {

// The workers to stop at exit; each unregisters in its destructor, so the handler never sees a
// destroyed one. Never destroyed themselves: a worker may be destroyed after every static.
std::mutex& registry_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::vector<BackgroundWorker*>& registry() {
  static auto* workers = new std::vector<BackgroundWorker*>;
  return *workers;
}

void stop_all_at_exit() {
  std::vector<BackgroundWorker*> workers;
  {
    std::lock_guard lock(registry_mutex());
    workers = registry();
  }
  for (BackgroundWorker* worker : workers) worker->stop();
}

}  // namespace

// pthread_atfork's handlers, over every started worker. The registry's lock is held across the
// fork as well, so that no worker starts or ends meanwhile.
struct WorkerForkHandlers {
  static void before() {
    registry_mutex().lock();
    for (BackgroundWorker* worker : registry()) worker->before_fork();
  }
  static void in_parent() {
    for (BackgroundWorker* worker : registry()) worker->after_fork_in_parent();
    registry_mutex().unlock();
  }
  static void in_child() {
    for (BackgroundWorker* worker : registry()) worker->after_fork_in_child();
    registry_mutex().unlock();
  }
};

// A job on the idle thread gets a core only when nothing else wants one, which on a loaded
// machine may be long after the fork began to wait for it: for the wait, that thread runs at the
// forking thread's priority.
void BackgroundWorker::before_fork() {
  std::unique_lock lock(mutex_);
  forking_ = true;
  if (running_ > 0 && idle_thread_.joinable()) {
    pthread_t idle = idle_thread_.native_handle();
    int policy = 0;
    sched_param param{};
    idle_priority_raised_ = pthread_getschedparam(idle, &idle_policy_, &idle_param_) == 0 &&
                            pthread_getschedparam(pthread_self(), &policy, &param) == 0 &&
                            pthread_setschedparam(idle, policy, &param) == 0;
  }
  done_.wait(lock, [&] { return running_ == 0; });
  lock.release();  // held until the fork is done
}

void BackgroundWorker::after_fork_in_parent() {
  if (idle_priority_raised_)
    pthread_setschedparam(idle_thread_.native_handle(), idle_policy_, &idle_param_);
  idle_priority_raised_ = false;
  forking_ = false;
  mutex_.unlock();
  wake_.notify_all();
}

// The only thread is the one that forked, which holds the lock. The threads' handles name threads
// of the parent: they are set aside, never joined (a joinable std::thread must not be destroyed).
// The condition variables are made anew: the parent's threads were waiting on them, and those
// waiters are in their state but gone. Holds belong to threads that are gone too (should the
// forking thread hold one, its end does not count below zero: ~Hold).
void BackgroundWorker::after_fork_in_child() {
  static auto* parents_threads = new std::vector<std::thread>;  // reachable, never destroyed
  for (std::thread* thread : {&idle_thread_, &patient_thread_})
    if (thread->joinable()) parents_threads->push_back(std::move(*thread));
  new (&wake_) std::condition_variable;
  new (&done_) std::condition_variable;
  holds_ = 0;
  idle_priority_raised_ = false;
  forking_ = false;
  mutex_.unlock();
}

BackgroundWorker::~BackgroundWorker() {
  stop();
  std::lock_guard lock(registry_mutex());
  std::erase(registry(), this);
}

bool BackgroundWorker::post(Job job, Job on_drop, bool at_once) {
  bool start = false;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return false;
    // `since` only counts toward the patience.
    queue_.push_back({std::move(job), std::move(on_drop),
                      Clock::now() - (at_once ? patience_ : Clock::duration())});
    start = !patient_thread_.joinable();
  }
  if (start) {
    // A forked child's copy starts threads again, and is registered already.
    bool registered = false;
    {
      std::lock_guard lock(registry_mutex());
      registered = std::ranges::find(registry(), this) != registry().end();
      if (!registered) registry().push_back(this);
    }
    if (!registered) {
      static const bool handlers = [] {
        pthread_atfork(WorkerForkHandlers::before, WorkerForkHandlers::in_parent,
                       WorkerForkHandlers::in_child);
        return true;
      }();
      (void)handlers;
      std::atexit(stop_all_at_exit);
    }
    std::lock_guard lock(mutex_);
    // Decided again: another first post may have started them since (assigning over a running
    // std::thread terminates the process).
    if (!patient_thread_.joinable()) {
      if (use_idle_thread_) idle_thread_ = std::thread([this] { run(true); });
      patient_thread_ = std::thread([this] { run(false); });
    }
  }
  wake_.notify_all();
  return true;
}

void BackgroundWorker::run(bool idle) {
  if (idle) {
    // Under a real-time policy (chrt, as benchmarks run), the lowest real-time priority is the
    // same deal: below the process's own threads, not starved behind every other process.
    int policy = 0;
    sched_param param{};
    pthread_getschedparam(pthread_self(), &policy, &param);
    if (policy == SCHED_FIFO || policy == SCHED_RR) {
      param.sched_priority = sched_get_priority_min(policy);
    } else {
      policy = SCHED_IDLE;
      param.sched_priority = 0;
    }
    pthread_setschedparam(pthread_self(), policy, &param);
  }
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || (!queue_.empty() && holds_ == 0 && !forking_); });
    if (stopping_) break;
    // Quiet after the last hold; for the patient thread, the first job's patience spent too.
    Clock::time_point from = quiet_from_;
    if (!idle) from = std::max(from, queue_.front().since + patience_);
    if (Clock::now() < from) {
      // A hold, a post or a stop meanwhile notifies; the checks then start again.
      wake_.wait_until(lock, from);
      continue;
    }
    run_front(lock);
  }
}

void BackgroundWorker::run_front(std::unique_lock<std::mutex>& lock) {
  Job job = std::move(queue_.front().job);
  queue_.pop_front();
  ++running_;
  lock.unlock();
  job();
  job = nullptr;  // whatever the job holds is released outside the lock
  lock.lock();
  --running_;
  done_.notify_all();
}

void BackgroundWorker::drain() {
  std::unique_lock lock(mutex_);
  // The caller runs what is queued, at its own priority, and waits for what the threads run;
  // while a fork() is under way it starts nothing either.
  for (;;) {
    wake_.wait(lock, [&] { return !forking_; });
    if (stopping_ || queue_.empty()) break;
    run_front(lock);
  }
  done_.wait(lock, [&] { return running_ == 0; });
}

void BackgroundWorker::stop() {
  std::thread idle, patient;
  std::deque<Queued> dropped;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    dropped.swap(queue_);
    idle = std::move(idle_thread_);
    patient = std::move(patient_thread_);
  }
  wake_.notify_all();
  if (idle.joinable()) idle.join();
  if (patient.joinable()) patient.join();
  // Jobs a drain() runs on another thread finish too.
  {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return running_ == 0; });
  }
  for (Queued& queued : dropped)
    if (queued.on_drop) queued.on_drop();
}

size_t BackgroundWorker::pending() const {
  std::lock_guard lock(mutex_);
  return queue_.size() + static_cast<size_t>(running_);
}

BackgroundWorker::Hold::Hold(BackgroundWorker& worker) : worker_(worker) {
  std::lock_guard lock(worker_.mutex_);
  ++worker_.holds_;
}

BackgroundWorker::Hold::~Hold() {
  {
    std::lock_guard lock(worker_.mutex_);
    if (worker_.holds_ > 0) --worker_.holds_;
    worker_.quiet_from_ = std::chrono::steady_clock::now() + quiet_period;
  }
  worker_.wake_.notify_all();
}

}  // namespace mixtape
