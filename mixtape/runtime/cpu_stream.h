// mixtape/runtime/cpu_stream.h -- the CPU stream: a worker thread that runs queued evaluation work
// in order, so that the thread that queued it goes on tracing (asynchronous evaluation).
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "mixtape/dsl/node.h"

namespace mixtape {

/// Work for the stream: the arithmetic of part of an evaluation whose graph bookkeeping (every
/// node's value, the memory plan) is done. The storages it reads and writes are held until it
/// has run; until then a host read of one it writes waits for it, and so does a host write of
/// any of them (Storage::host_data). It starts after the work queued before it has finished.
class StreamWork {
 public:
  StreamWork() = default;
  StreamWork(const StreamWork&) = delete;
  StreamWork& operator=(const StreamWork&) = delete;
  /// Work destroyed without having run (no worker could be started) fails as work that threw:
  /// what it was to write is never computed, for host reads and later work alike.
  virtual ~StreamWork();
  /// The arithmetic, on the worker thread. An exception fails this work: what it was to write
  /// is never computed (reading it is an mt::Error), nor is what later work computes from
  /// that; the next finish_cpu_stream() on the thread that queued it reports the failure.
  virtual void run() = 0;
  /// Holds `value`, which the work reads, and returns the address of its bytes, which the work
  /// reads without waiting (what writes them is queued before it). A value on a device is
  /// fetched to the host now.
  std::byte* read(const std::shared_ptr<Storage>& value);
  /// Holds `value`, which the work writes: host reads of it wait until the work has run.
  std::byte* write(const std::shared_ptr<Storage>& value);
  bool holds_nothing() const { return inputs_.empty() && outputs_.empty(); }

 private:
  friend class CpuStream;
  const char* uncomputed_input() const;
  std::vector<std::shared_ptr<Storage>> inputs_, outputs_;
  bool ran_ = false, computed_ = false;
  std::thread::id submitter_;  // the thread that queued it, to which its failure is reported
};

/// Queues `work` behind everything queued before. Waits first while a few pieces of work are
/// queued already, so that the caller runs at most about one evaluation ahead.
void submit_to_cpu_stream(std::unique_ptr<StreamWork> work);

// finish_cpu_stream() (which waits for everything queued, then reports a failure of queued work
// once) and on_cpu_stream() are declared beside Storage (dsl/node.h), whose host reads call them.

/// Makes sure the stream is drained and joined at exit before the static objects that exist now
/// are destroyed (its work uses them: kernel caches, oneDNN's primitives). Call after work of a
/// new kind ran synchronously for the first time, which made any statics such work needs.
void keep_cpu_stream_ahead_of_exit();

}  // namespace mixtape
