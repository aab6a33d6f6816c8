// jit/background_worker.cpp -- the background worker's queue, holds, and its join at exit.
#include "jit/background_worker.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
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
  for (BackgroundWorker* worker : workers) {
    worker->drain();
    worker->stop();
  }
}

}  // namespace

BackgroundWorker::~BackgroundWorker() {
  stop();
  std::lock_guard lock(registry_mutex());
  std::erase(registry(), this);
}

bool BackgroundWorker::post(Job job) {
  bool start = false;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return false;
    queue_.push_back(std::move(job));
    start = !thread_.joinable();
    if (start) owner_pid_ = ::getpid();
  }
  if (start) {
    {
      std::lock_guard lock(registry_mutex());
      registry().push_back(this);
    }
    std::atexit(stop_all_at_exit);
    std::lock_guard lock(mutex_);
    thread_ = std::thread([this] { run(); });
  }
  wake_.notify_one();
  return true;
}

void BackgroundWorker::run() {
  // Idle priority: any thread that wants this core preempts the worker at once -- above all an
  // OpenMP team member, whose whole team would otherwise wait for the worker's time slice. (An
  // unprivileged thread cannot raise its priority again, so waiting callers run jobs
  // themselves: drain().)
  sched_param param{};
  pthread_setschedparam(pthread_self(), SCHED_IDLE, &param);
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || (!queue_.empty() && holds_ == 0); });
    if (stopping_) break;
    if (std::chrono::steady_clock::now() < quiet_from_) {
      // A hold or a stop meanwhile notifies; the checks then start again.
      wake_.wait_until(lock, quiet_from_);
      continue;
    }
    run_front(lock);
  }
}

void BackgroundWorker::run_front(std::unique_lock<std::mutex>& lock) {
  Job job = std::move(queue_.front());
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
  if (owner_pid_ != ::getpid()) return;
  // The caller runs what is queued, at its own priority, and waits for what the worker runs.
  while (!stopping_ && !queue_.empty()) run_front(lock);
  done_.wait(lock, [&] { return running_ == 0; });
}

void BackgroundWorker::stop() {
  std::thread thread;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    queue_.clear();
    // A forked child has the object but not the thread: nothing to join, and the handle names
    // a thread of the parent, so it is left alone (a joinable std::thread must not be destroyed).
    if (thread_.joinable() && owner_pid_ != ::getpid()) {
      static auto* parents_threads = new std::vector<std::thread>;  // reachable, never destroyed
      parents_threads->push_back(std::move(thread_));
      return;
    }
    thread = std::move(thread_);
  }
  wake_.notify_one();
  if (thread.joinable()) thread.join();
  // Jobs a drain() runs on another thread finish too.
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return running_ == 0; });
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
    --worker_.holds_;
    worker_.quiet_from_ = std::chrono::steady_clock::now() + quiet_period;
  }
  worker_.wake_.notify_one();
}

}  // namespace mixtape
