// mixtape/jit/llvm_jit.h -- compiles LLVM IR text for the host CPU with ORC LLJIT, through the
// kernel cache.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mixtape/runtime/cpu_kernels.h"

namespace llvm {
class TargetMachine;
}

namespace mixtape {

/// A kernel loaded into the JIT. Its code stays mapped while the object lives: the last owner's
/// release removes it from the JIT (its own ORC ResourceTrackers), so that a process sweeping
/// many shapes holds the code of the kernels its cached programs still use, not of every kernel
/// it ever ran.
class JitKernel {
 public:
  ~JitKernel();
  JitKernel(const JitKernel&) = delete;
  JitKernel& operator=(const JitKernel&) = delete;

  /// The code to call: the fast tier's while a kernel compiled cold waits for its optimized
  /// code, then the optimized code (see LlvmJit::set_tiered). Both give the same bits.
  KernelFunction function() const { return entry_.load(std::memory_order_acquire); }
  /// Where function() reads from, for callers that keep the address and call many times
  /// (runtime/cpu_kernels.h): the swap to the optimized code is one atomic store there. The fast
  /// tier's code stays mapped as long as the kernel, so a call that read it still runs.
  const std::atomic<KernelFunction>& entry() const { return entry_; }
  /// Whether function() is the optimized code (CodeGenOpt::Aggressive), which it stays.
  bool optimized() const;
  /// The fast tier's code, mapped as long as the kernel; null when it was loaded optimized.
  KernelFunction fast_function() const;

 private:
  friend class LlvmJit;
  struct Private;
  explicit JitKernel(std::unique_ptr<Private> p);
  std::unique_ptr<Private> p_;
  mutable std::atomic<KernelFunction> entry_{nullptr};  // swapped under the JIT's mutex
};

class LlvmJit {
 public:
  static LlvmJit& instance();
  ~LlvmJit();

  /// The function `name` defined by `ir`: from this process's loaded kernels, else from the
  /// kernel cache (memory or disk), else compiled optimized for the host CPU (tiered: see
  /// set_tiered) and cached. A loaded kernel whose IR is `ir` but for the function's name (and
  /// comments) lends its code instead (Stats::same_code): the emitter names kernels by listings
  /// that include sizes the code does not read, so one model's kernels repeat under other names.
  std::shared_ptr<const JitKernel> load(const std::string& name, const std::string& ir);

  /// load() for many kernels at once: those neither loaded nor cached compile in parallel, on
  /// every core, each code once.
  struct KernelSource {
    std::string name;
    std::string ir;
  };
  std::vector<std::shared_ptr<const JitKernel>> load_all(const std::vector<KernelSource>& kernels);

  /// The relocatable object file of each kernel (its function `name`, position-independent,
  /// optimized), as load_all() would load it once optimized: from the kernel cache (after waiting
  /// for the tier-ups under way), else compiled (misses in parallel) and cached. The AOT packager
  /// links these into an artifact, so kernels the training run compiled are not compiled again.
  /// `cpu` empty: for the host CPU, with all its features; else for that LLVM CPU name
  /// ("x86-64-v3", "x86-64", "znver3") and only the features it implies (an mt::Error for a name
  /// LLVM does not know).
  std::vector<std::vector<std::byte>> objects(const std::vector<KernelSource>& kernels,
                                              const std::string& cpu = "");
  /// Whether LLVM knows the CPU name.
  bool known_cpu(const std::string& cpu) const;
  /// Those of `candidates` (LLVM feature names, runtime/cpu_features.h's table) that code
  /// compiled for `cpu` (empty: the host) may use.
  std::vector<std::string> cpu_features(const std::string& cpu,
                                        const std::vector<std::string>& candidates) const;

  /// LLVM version, host CPU name and features: what makes an object valid for this machine.
  std::string target() const;

  /// Tiered compilation, on unless $MIXTAPE_JIT_TIERED is 0. Both tiers run one short IR pipeline
  /// (SROA, simplification, LICM, loop deletion, the loop vectorizer: a third of -O3's time, and
  /// code as fast on the benchmarks' kernels; kernels without fast-math flags skip
  /// induction-variable simplification, a fifth of it). A kernel that load_all() finds neither
  /// loaded nor cached is compiled so that both tiers give the same bits:
  /// - tiered: to machine code with LLVM's fast instruction selection and register allocation
  ///   (CodeGenOpt::None), which runs at once. A kernel with fast-math flags (the emitter's
  ///   `fadd reassoc` sums, whose bits the vectorizer's choices decide) runs the pipeline with the
  ///   optimizing tier's target machine and keeps the optimized IR as bitcode, which a background
  ///   thread then emits with CodeGenOpt::Aggressive. A kernel without them, whose every operation
  ///   keeps its IEEE result under any pipeline, runs it with the fast tier's machine, and the
  ///   background thread compiles its IR afresh. Either way the background thread makes the object
  ///   an untiered compile makes, byte for byte, stores it in the kernel cache and swaps it in.
  ///   Only optimized objects are cached under a kernel's key, so a later process and the AOT
  ///   packager get those.
  /// - untiered: the pipeline and CodeGenOpt::Aggressive at once, as the background thread would.
  /// The background threads (jit/background_worker.h) run a tier-up on idle CPU time, or at
  /// normal priority once it has waited 2 s, and start nothing while foreground compiles run.
  /// Exit waits for the tier-ups under way and drops the others, each leaving a fast-tier entry
  /// in the kernel cache under a key of its own (its fast object and bitcode), never taken for
  /// optimized code: a later process that loads the kernel (tiered) starts from that fast code,
  /// compiling nothing, and tiers it up at once, without the 2 s patience.
  void set_tiered(bool tiered);
  bool tiered() const;
  /// Blocks until every tier-up queued so far has been swapped in (or has failed: the fast code
  /// then stays, and MIXTAPE_LOG=jit says why).
  void wait_for_tier_up();

  struct Stats {
    int64_t compiled = 0;            // IR compiled to machine code in the foreground
    int64_t fast_compiled = 0;       // of those, to fast code, optimized later in the background
    int64_t short_compiled = 0;      // of those, without fast-math flags (see set_tiered)
    int64_t tiered_up = 0;           // kernels whose optimized code was swapped in
    int64_t disk_loaded = 0;         // objects taken from the kernel cache
    int64_t fast_disk_loaded = 0;    // of those, fast-tier entries (see set_tiered)
    int64_t memory_hits = 0;         // already loaded in this process
    int64_t same_code = 0;           // given a loaded kernel's code: the same IR but for the name
    double compile_seconds = 0;      // wall time waited for compilation (parallel: the longest)
    double compile_cpu_seconds = 0;  // CPU time of those compiles, every thread's together
    double tier_up_seconds = 0;      // background thread's time on tier-ups
    double tier_up_cpu_seconds = 0;  // CPU time of the tier-ups (the primer's included)
    double load_seconds = 0;
    int64_t resident = 0;        // kernels loaded now (some owner still holds them)
    int64_t resident_bytes = 0;  // their object files' bytes (fast and optimized)
  };
  Stats stats() const;

 private:
  LlvmJit();
  // What compile_object() makes: the object (for the fast tier defining `name` + fast_suffix, so
  // that the optimized object's `name` can be loaded beside it), the optimized IR as bitcode for
  // the fast tier of a kernel with fast-math flags (short_pipeline: one without, whose tier-up
  // compiles the IR afresh), and the time its IR pipeline and its code generation took.
  struct Compiled {
    std::vector<std::byte> object;
    std::string bitcode;
    bool short_pipeline = false;
    double pipeline_seconds = 0, codegen_seconds = 0;
  };
  // What compile_object() is asked for: the optimizing tier's object, the fast tier's, or only the
  // optimized IR as bitcode.
  enum class Output { optimized_object, fast_object, optimized_bitcode };
  Compiled compile_object(const std::string& name, const std::string& ir, const std::string& cpu,
                          Output output);
  // Kernel-cache key of an object compiled from ir for cpu (empty: the host).
  std::string cache_key(const std::string& ir, const std::string& cpu) const;
  // A target machine for cpu (empty: the host's, with its features) and codegen level.
  std::unique_ptr<llvm::TargetMachine> target_machine(const std::string& cpu,
                                                      bool fast = false) const;
  // Compiles kernels[i] into compiled[i] for each i in missing, on every core, and when prime,
  // runs prime_tier_up() on one of them; returns the wall time.
  double compile_missing(const std::vector<KernelSource>& kernels,
                         const std::vector<size_t>& missing, std::vector<Compiled>& compiled,
                         const std::string& cpu, bool fast, bool prime);
  // Queues the optimizing compile of fast kernels, once prime_tier_up() has run.
  struct TierUp;
  void tier_up(std::vector<TierUp> jobs);
  // Compiles, swaps in and caches job's optimized object.
  void run_tier_up(TierUp& job);
  // The process's first call tiers up a small kernel of its own on the calling thread, so that
  // the statics a tier-up makes (LLVM's readers, IR pipeline and optimizing code generator,
  // OpenSSL's MAC for the cache) exist before the worker starts; the others return once it is
  // done.
  void prime_tier_up();
  friend class JitKernel;
  struct State;
  // Shared with every JitKernel, so the JIT outlives the last of them (static destruction order
  // is not known).
  std::shared_ptr<State> state_;
};

}  // namespace mixtape
