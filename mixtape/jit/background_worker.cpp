// mixtape/jit/background_worker.cpp -- the background worker's queue, holds, and its join at exit.
#include "mixtape/jit/background_worker.h"

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
  for (BackgroundWorker* worker : workers) worker->stop();
}

}  // namespace

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
    if (start) owner_pid_ = ::getpid();
  }
  if (start) {
    {
      std::lock_guard lock(registry_mutex());
      registry().push_back(this);
    }
    std::atexit(stop_all_at_exit);
    std::lock_guard lock(mutex_);
    if (use_idle_thread_) idle_thread_ = std::thread([this] { run(true); });
    patient_thread_ = std::thread([this] { run(false); });
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
    wake_.wait(lock, [&] { return stopping_ || (!queue_.empty() && holds_ == 0); });
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
  if (owner_pid_ != ::getpid()) return;
  // The caller runs what is queued, at its own priority, and waits for what the threads run.
  while (!stopping_ && !queue_.empty()) run_front(lock);
  done_.wait(lock, [&] { return running_ == 0; });
}

void BackgroundWorker::stop() {
  std::thread idle, patient;
  std::deque<Queued> dropped;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    dropped.swap(queue_);
    // A forked child has the object but not the threads: nothing to join, and the handles name
    // threads of the parent, so they are left alone (a joinable std::thread must not be
    // destroyed). Nor is there anything to wait for, on this call or a later one: running_
    // counts the parent's jobs, which no thread of the child will finish.
    if (owner_pid_ != 0 && owner_pid_ != ::getpid()) {
      static auto* parents_threads = new std::vector<std::thread>;  // reachable, never destroyed
      for (std::thread* thread : {&idle_thread_, &patient_thread_})
        if (thread->joinable()) parents_threads->push_back(std::move(*thread));
      return;
    }
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
    --worker_.holds_;
    worker_.quiet_from_ = std::chrono::steady_clock::now() + quiet_period;
  }
  worker_.wake_.notify_all();
}

}  // namespace mixtape
