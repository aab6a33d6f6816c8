// mixtape/jit/llvm_jit.cpp -- LLVM IR text -> host machine code: IR pipeline, object emission
// (fast, then optimized in the background), ORC LLJIT.
#include "mixtape/jit/llvm_jit.h"

#include <llvm/Bitcode/BitcodeReader.h>
#include <llvm/Bitcode/BitcodeWriter.h>
#include <llvm/ExecutionEngine/Orc/ExecutionUtils.h>
#include <llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h>
#include <llvm/ExecutionEngine/Orc/LLJIT.h>
#include <llvm/IR/InstIterator.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/LegacyPassManager.h>
#include <llvm/IR/Module.h>
#include <llvm/IR/Operator.h>
#include <llvm/IR/Verifier.h>
#include <llvm/IRReader/IRReader.h>
#include <llvm/MC/MCSubtargetInfo.h>
#include <llvm/Passes/PassBuilder.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/SourceMgr.h>
#include <llvm/Support/TargetSelect.h>
#include <llvm/Support/raw_ostream.h>
#include <llvm/Target/TargetMachine.h>
#include <llvm/TargetParser/Host.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "mixtape/codegen/hash.h"
#include "mixtape/codegen/kernel_cache.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/log.h"
#include "mixtape/jit/background_worker.h"

namespace mixtape {
namespace {

// Bumped whenever emitted code for the same IR could change (pipeline, flags): part of the key.
// 3: position-independent code, so that the AOT packager links cached objects into shared
// libraries. 4: one short IR pipeline (ir_pipeline) in both tiers, for every kernel. 5: kernels
// without fast-math flags skip induction-variable simplification (pointwise_pipeline).
constexpr int jit_version = 5;

std::string to_text(llvm::Error error) {
  std::string text;
  llvm::handleAllErrors(std::move(error),
                        [&](const llvm::ErrorInfoBase& info) { text += info.message(); });
  return text;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The calling thread's CPU time: on a loaded machine a compile's wall time counts the other
// processes' turns too.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

template <typename T>
T unwrap(llvm::Expected<T> value, const char* what) {
  if (!value) fail("LLVM JIT: {}: {}", what, to_text(value.takeError()));
  return std::move(*value);
}

// The fast tier's object defines the kernel's function under this suffix, so that the optimized
// object, which defines the plain name (as cached objects and AOT artifacts do), can be added to
// the same JITDylib beside it.
constexpr const char* fast_suffix = ".fast";

bool tiered_from_environment() {
  const char* value = std::getenv("MIXTAPE_JIT_TIERED");
  return !(value && std::string_view(value) == "0");
}

// The IR pipeline of both tiers: promote the emitter's loop counters to registers, simplify the
// index arithmetic, hoist what the loops do not change, delete the loops over dimensions of size 1
// (so that the loop around them is the innermost one, and vectorizes), and vectorize -- what the
// pointwise, reduction and layout loops need to run at vector speed. It takes a third of the -O3
// pipeline's time (a quarter on reductions, where -O3 was three quarters of the fast tier's time),
// and its code at CodeGenOpt::Aggressive ran as fast as -O3's on the 245 kernels of the demo and
// the benchmarks (bench/README.md, "The first step").
constexpr const char* ir_pipeline =
    "function(sroa,early-cse,instcombine,simplifycfg,loop-mssa(loop-rotate,licm),"
    "loop(indvars,loop-deletion),simplifycfg,loop-vectorize,instcombine,simplifycfg)";

// ir_pipeline without induction-variable simplification, its costliest pass after the vectorizer
// (a fifth of the pipeline), for kernels without fast-math flags, whose bits no pipeline changes.
// Loop deletion still finds the size-1 loops (SCEV reads their trip count off the rotated loop).
// Its vector code was that of ir_pipeline on the demo's 26 kernels and on the 307 of char_gpt,
// the MLPs, digits_cnn, digits_mlp and resnet18 but for 6 divisions by a broadcast scalar (batch
// norm's), vectorized 8-wide without interleaving; the loops' exit tests differ in form (`icmp
// slt` for `icmp eq`).
// Kernels with fast-math flags keep ir_pipeline: it decides how their sums are split, and so
// their bits.
constexpr const char* pointwise_pipeline =
    "function(sroa,early-cse,instcombine,simplifycfg,loop-mssa(loop-rotate,licm),"
    "loop(loop-deletion),simplifycfg,loop-vectorize,instcombine,simplifycfg)";

// Whether an instruction of module carries a fast-math flag (the emitter's `fadd reassoc` sums):
// the pipeline then picks the bits (the vectorizer splits such a sum into as many partial sums as
// its cost model chooses), so both tiers must run the same one, with the same target machine.
bool has_fast_math(const llvm::Module& module) {
  for (const llvm::Function& function : module)
    for (const llvm::Instruction& inst : llvm::instructions(function))
      if (const auto* op = llvm::dyn_cast<llvm::FPMathOperator>(&inst))
        if (op->getFastMathFlags().any()) return true;
  return false;
}

// Runs ir_pipeline on module (pointwise_pipeline on one without fast-math flags), for machine's
// target.
void run_pipeline(llvm::Module& module, llvm::TargetMachine& machine, bool fast_math) {
  llvm::LoopAnalysisManager loops;
  llvm::FunctionAnalysisManager functions;
  llvm::CGSCCAnalysisManager cgscc;
  llvm::ModuleAnalysisManager modules;
  llvm::PassBuilder passes(&machine);
  passes.registerModuleAnalyses(modules);
  passes.registerCGSCCAnalyses(cgscc);
  passes.registerFunctionAnalyses(functions);
  passes.registerLoopAnalyses(loops);
  passes.crossRegisterProxies(loops, functions, cgscc, modules);
  llvm::ModulePassManager pipeline;
  if (llvm::Error e =
          passes.parsePassPipeline(pipeline, fast_math ? ir_pipeline : pointwise_pipeline))
    fail("LLVM JIT: the IR pipeline does not parse: {}", to_text(std::move(e)));
  pipeline.run(module, modules);
}

// Renames the kernel's function for the fast tier's object (fast_suffix says why).
void rename_fast(llvm::Module& module, const std::string& name) {
  llvm::Function* function = module.getFunction(name);
  if (!function) fail("LLVM JIT: kernel {} does not define a function of that name", name);
  function->setName(name + fast_suffix);
}

// module -> object file with machine's codegen level.
std::vector<std::byte> emit_object(llvm::Module& module, llvm::TargetMachine& machine) {
  llvm::SmallVector<char, 0> object;
  llvm::raw_svector_ostream os(object);
  llvm::legacy::PassManager codegen;
  if (machine.addPassesToEmitFile(codegen, os, nullptr, llvm::CGFT_ObjectFile))
    fail("LLVM JIT: the target cannot emit object files");
  codegen.run(module);
  const auto* begin = reinterpret_cast<const std::byte*>(object.data());
  return std::vector<std::byte>(begin, begin + object.size());
}

// Target machines cost about a millisecond to make, and each makes its subtarget anew at its
// first function (more again); one serves one compile at a time, so the idle ones are kept, per
// CPU and codegen level. A reused one emits the same bytes as a new one.
class MachinePool {
 public:
  // A pooled target machine, back in the pool when the lease ends.
  class Lease {
   public:
    Lease(MachinePool& pool, std::string key, std::unique_ptr<llvm::TargetMachine> machine)
        : pool_(pool), key_(std::move(key)), machine_(std::move(machine)) {}
    ~Lease() {
      std::lock_guard<std::mutex> lock(pool_.mutex_);
      pool_.idle_[key_].push_back(std::move(machine_));
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    llvm::TargetMachine* operator->() const { return machine_.get(); }
    llvm::TargetMachine& operator*() const { return *machine_; }

   private:
    MachinePool& pool_;
    std::string key_;
    std::unique_ptr<llvm::TargetMachine> machine_;
  };

  // An idle machine for key, else make()'s.
  template <typename Make>
  Lease lease(const std::string& key, Make make) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::vector<std::unique_ptr<llvm::TargetMachine>>& idle = idle_[key];
      if (!idle.empty()) {
        std::unique_ptr<llvm::TargetMachine> machine = std::move(idle.back());
        idle.pop_back();
        return Lease(*this, key, std::move(machine));
      }
    }
    return Lease(*this, key, make());
  }

 private:
  std::mutex mutex_;
  std::map<std::string, std::vector<std::unique_ptr<llvm::TargetMachine>>> idle_;
};

}  // namespace

// An optimizing compile to do in the background: the fast kernel, what makes its optimized
// object (its optimized IR as bitcode, or for a kernel without fast-math flags, its IR text to
// compile afresh), and where that object is cached.
struct LlvmJit::TierUp {
  std::weak_ptr<const JitKernel> kernel;
  std::string name, key, bitcode, ir;
  // The fast object, for the fast-tier entry that replaces the tier-up should exit() drop it
  // (empty: the kernel came from such an entry).
  std::vector<std::byte> fast_object;
  // Owed by an earlier process (the kernel came from a fast-tier entry): no patience.
  bool at_once = false;
};

namespace {

// The kernel-cache key of a kernel's fast-tier entry, beside `key`, its optimized object's. A
// process that exits before a kernel's tier-up leaves one instead of the optimized object: the
// fast object and what its tier-up needs. The next process that loads the kernel runs that fast
// code at once and tiers it up without the usual patience, so that the optimized code is made by
// a process that runs it, and the fast code is never taken for final.
std::string fast_entry_key(const std::string& key) { return "fast tier\n" + key; }

constexpr char fast_entry_magic[4] = {'M', 'T', 'F', 'T'};

// A fast-tier entry: the magic, the object's length (8 bytes, host order: the key names the
// host), the object, then the optimized IR as bitcode (none: the tier-up compiles the IR afresh).
std::vector<std::byte> pack_fast_entry(const std::vector<std::byte>& object,
                                       const std::string& bitcode) {
  uint64_t size = object.size();
  std::vector<std::byte> entry(sizeof fast_entry_magic + sizeof size + object.size() +
                               bitcode.size());
  std::byte* at = entry.data();
  std::memcpy(at, fast_entry_magic, sizeof fast_entry_magic);
  std::memcpy(at += sizeof fast_entry_magic, &size, sizeof size);
  std::memcpy(at += sizeof size, object.data(), object.size());
  if (!bitcode.empty()) std::memcpy(at + object.size(), bitcode.data(), bitcode.size());
  return entry;
}

// The object and bitcode of a fast-tier entry; false when it is not one.
bool unpack_fast_entry(const std::vector<std::byte>& entry, std::vector<std::byte>& object,
                       std::string& bitcode) {
  uint64_t size = 0;
  const size_t header = sizeof fast_entry_magic + sizeof size;
  if (entry.size() < header ||
      std::memcmp(entry.data(), fast_entry_magic, sizeof fast_entry_magic) != 0)
    return false;
  std::memcpy(&size, entry.data() + sizeof fast_entry_magic, sizeof size);
  if (size == 0 || size > entry.size() - header) return false;
  const std::byte* begin = entry.data() + header;
  object.assign(begin, begin + size);
  bitcode.assign(reinterpret_cast<const char*>(begin + size), entry.size() - header - size);
  return true;
}

// What a kernel's code depends on: its IR without comment lines and with its function's name
// taken out, hashed. The emitter names a kernel by its whole listing, dims included, yet leaves out
// of the IR what the code does not read (the rows of a row loop the executor splits, a
// one-dimensional kernel's length): kernels of one shape of code under different names, such as
// a model's initializers `x * a + b` at its parameters' shapes, then share one compile and one
// load.
std::string code_key(const std::string& name, const std::string& ir) {
  std::string text;
  text.reserve(ir.size());
  const std::string call = "@" + name + "(";
  for (size_t at = 0; at < ir.size();) {
    size_t end = std::min(ir.find('\n', at), ir.size());
    std::string_view line(ir.data() + at, end - at);
    at = end + 1;
    if (line.starts_with(';')) continue;
    for (size_t from = 0;;) {
      size_t found = line.find(call, from);
      text.append(line.substr(from, found - from));
      if (found == std::string_view::npos) break;
      text += "@(";
      from = found + call.size();
    }
    text += '\n';
  }
  return hash_string(text).hex();
}

}  // namespace

struct LlvmJit::State {
  std::mutex mutex;
  std::unique_ptr<llvm::orc::LLJIT> jit;
  std::optional<llvm::orc::JITTargetMachineBuilder> builder;  // the host's target machines
  std::unique_ptr<llvm::TargetMachine> machine;
  std::string cpu, features;
  std::atomic<bool> tiered{tiered_from_environment()};

  MachinePool machines;

  // Runs the tier-ups; declared last of what its jobs use, so that it is stopped first.
  BackgroundWorker worker;
  // prime_tier_up() has run; prime_mutex is held while it runs, so that no other thread posts
  // (and so starts the worker and its exit handler) before it ends.
  std::mutex prime_mutex;
  std::atomic<bool> worker_primed{false};
  // An entry expires when its kernel's last owner lets go; the kernel's destructor then erases
  // it (under the mutex) as it removes the code.
  std::unordered_map<std::string, std::weak_ptr<const JitKernel>> loaded;
  // The loaded kernels by code_key(): a kernel of the same code under another name gets theirs.
  // An expired entry is replaced, or erased by its kernel's destructor.
  std::unordered_map<std::string, std::weak_ptr<const JitKernel>> by_code;
  Stats stats;

  // The loaded kernel `name`, or null when there is none. A kernel whose last owner has just let
  // go is waited for (the lock released meanwhile) until its destructor has removed its code, so
  // that the caller may define the symbol again.
  std::shared_ptr<const JitKernel> live(const std::string& name,
                                        std::unique_lock<std::mutex>& lock) {
    for (;;) {
      auto found = loaded.find(name);
      if (found == loaded.end()) return nullptr;
      if (std::shared_ptr<const JitKernel> kernel = found->second.lock()) return kernel;
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
    }
  }
};

struct JitKernel::Private {
  // First, so destroyed last: the trackers' destructors still call into the JIT, which the last
  // kernel alive at exit keeps (after the LlvmJit instance is gone).
  std::shared_ptr<LlvmJit::State> state;
  std::string name, code;                          // code: its code_key()
  llvm::orc::ResourceTrackerSP tracker;            // the code loaded first (fast or optimized)
  llvm::orc::ResourceTrackerSP optimized_tracker;  // the optimized code swapped in later
  bool optimized = false;                          // under the state's mutex
  KernelFunction fast = nullptr;                   // the fast tier's code, if any
  int64_t bytes = 0;
};

JitKernel::JitKernel(std::unique_ptr<Private> p) : p_(std::move(p)) {}

JitKernel::~JitKernel() {
  LlvmJit::State& state = *p_->state;
  std::lock_guard<std::mutex> lock(state.mutex);
  state.loaded.erase(p_->name);
  auto same_code = state.by_code.find(p_->code);
  if (same_code != state.by_code.end() && same_code->second.expired())
    state.by_code.erase(same_code);
  // Removing code cannot fail in a way the caller could act on; the bytes are then leaked.
  for (llvm::orc::ResourceTrackerSP* tracker : {&p_->tracker, &p_->optimized_tracker})
    if (*tracker) {
      llvm::consumeError((*tracker)->remove());
      *tracker = nullptr;
    }
  --state.stats.resident;
  state.stats.resident_bytes -= p_->bytes;
}

bool JitKernel::optimized() const {
  std::lock_guard<std::mutex> lock(p_->state->mutex);
  return p_->optimized;
}

KernelFunction JitKernel::fast_function() const { return p_->fast; }

LlvmJit::LlvmJit() : state_(std::make_shared<State>()) {
  llvm::InitializeNativeTarget();
  llvm::InitializeNativeTargetAsmPrinter();
  llvm::InitializeNativeTargetAsmParser();
  auto builder = unwrap(llvm::orc::JITTargetMachineBuilder::detectHost(), "detecting the host");
  state_->cpu = llvm::sys::getHostCPUName().str();
  llvm::StringMap<bool> host_features;
  llvm::SubtargetFeatures features;
  if (llvm::sys::getHostCPUFeatures(host_features))
    for (auto& feature : host_features) features.AddFeature(feature.first(), feature.second);
  state_->features = features.getString();
  builder.setCPU(state_->cpu);
  builder.addFeatures(features.getFeatures());
  builder.setCodeGenOptLevel(llvm::CodeGenOpt::Aggressive);
  // The same objects go into AOT artifacts' shared libraries (jit/aot_package.h), which need
  // position-independent code; the JIT links it as well.
  builder.setRelocationModel(llvm::Reloc::PIC_);
  state_->machine = unwrap(builder.createTargetMachine(), "creating the target machine");
  state_->builder = builder;
  state_->jit = unwrap(llvm::orc::LLJITBuilder().setJITTargetMachineBuilder(builder).create(),
                       "creating the ORC LLJIT");
  // Kernels call the C library's math functions (expf, tanhf, ...): resolve them in-process.
  auto generator = unwrap(llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess(
                              state_->jit->getDataLayout().getGlobalPrefix()),
                          "opening the process's symbols");
  state_->jit->getMainJITDylib().addGenerator(std::move(generator));
}

LlvmJit::~LlvmJit() = default;

LlvmJit& LlvmJit::instance() {
  static LlvmJit jit;
  return jit;
}

std::string LlvmJit::target() const {
  return fmt::format("llvm{}-{}-{}", LLVM_VERSION_STRING, state_->cpu, state_->features);
}

LlvmJit::Stats LlvmJit::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

LlvmJit::Compiled LlvmJit::compile_object(const std::string& name, const std::string& ir,
                                          const std::string& cpu, Output output) {
  const bool fast = output == Output::fast_object;
  llvm::LLVMContext context;
  llvm::SMDiagnostic diagnostic;
  std::unique_ptr<llvm::Module> module =
      llvm::parseIR(llvm::MemoryBufferRef(ir, name), diagnostic, context);
  if (!module) {
    std::string message;
    llvm::raw_string_ostream os(message);
    diagnostic.print(name.c_str(), os, false);
    fail("LLVM JIT: kernel {} does not parse: {}", name, os.str());
  }
  std::string problems;
  llvm::raw_string_ostream verify_os(problems);
  if (llvm::verifyModule(*module, &verify_os))
    fail("LLVM JIT: kernel {} is invalid IR: {}", name, verify_os.str());
  auto start = std::chrono::steady_clock::now();
  Compiled compiled;
  // Without fast-math flags every operation keeps its IEEE result whatever the target machine's
  // cost model makes of the loops, so the fast tier runs the pipeline with its own machine and the
  // tier-up compiles the IR afresh.
  const bool fast_math = has_fast_math(*module);
  compiled.short_pipeline = fast && !fast_math;
  if (compiled.short_pipeline) {
    auto quick = state_->machines.lease("fast " + cpu, [&] { return target_machine(cpu, true); });
    module->setDataLayout(quick->createDataLayout());
    module->setTargetTriple(quick->getTargetTriple().str());
    run_pipeline(*module, *quick, false);
    compiled.pipeline_seconds = seconds_since(start);
    rename_fast(*module, name);
    compiled.object = emit_object(*module, *quick);
    compiled.codegen_seconds = seconds_since(start) - compiled.pipeline_seconds;
    return compiled;
  }
  // The IR pipeline runs with the optimizing tier's machine whatever the tier, so that both emit
  // the same optimized IR (kept as bitcode for the tier-up).
  auto optimizing = state_->machines.lease("opt " + cpu, [&] { return target_machine(cpu); });
  module->setDataLayout(optimizing->createDataLayout());
  module->setTargetTriple(optimizing->getTargetTriple().str());
  run_pipeline(*module, *optimizing, fast_math);
  compiled.pipeline_seconds = seconds_since(start);
  if (output == Output::optimized_object) {
    compiled.object = emit_object(*module, *optimizing);
    compiled.codegen_seconds = seconds_since(start) - compiled.pipeline_seconds;
    return compiled;
  }
  {
    // Use-list order is kept, so the optimized object made from the bitcode later is the one
    // this module would give.
    llvm::raw_string_ostream os(compiled.bitcode);
    llvm::WriteBitcodeToFile(*module, os, /*ShouldPreserveUseListOrder=*/true);
  }
  if (output == Output::optimized_bitcode) return compiled;
  rename_fast(*module, name);
  auto quick = state_->machines.lease("fast " + cpu, [&] { return target_machine(cpu, true); });
  auto codegen_start = std::chrono::steady_clock::now();
  compiled.object = emit_object(*module, *quick);
  compiled.codegen_seconds = seconds_since(codegen_start);
  return compiled;
}

std::string LlvmJit::cache_key(const std::string& ir, const std::string& cpu) const {
  return fmt::format("llvm-jit v{}\n{}\n{}", jit_version, cpu.empty() ? target() : "cpu " + cpu,
                     ir);
}

std::unique_ptr<llvm::TargetMachine> LlvmJit::target_machine(const std::string& cpu,
                                                             bool fast) const {
  llvm::CodeGenOpt::Level level = fast ? llvm::CodeGenOpt::None : llvm::CodeGenOpt::Aggressive;
  if (cpu.empty()) {
    llvm::orc::JITTargetMachineBuilder builder = *state_->builder;
    builder.setCodeGenOptLevel(level);
    return unwrap(builder.createTargetMachine(), "creating the target machine");
  }
  // A named CPU brings its own features; nothing of the host's is added.
  llvm::orc::JITTargetMachineBuilder builder(state_->builder->getTargetTriple());
  builder.setCPU(cpu);
  builder.setCodeGenOptLevel(level);
  builder.setRelocationModel(llvm::Reloc::PIC_);
  return unwrap(builder.createTargetMachine(), "creating the target machine for a named CPU");
}

bool LlvmJit::known_cpu(const std::string& cpu) const {
  return state_->machine->getMCSubtargetInfo()->isCPUStringValid(cpu);
}

std::vector<std::string> LlvmJit::cpu_features(const std::string& cpu,
                                               const std::vector<std::string>& candidates) const {
  std::unique_ptr<llvm::TargetMachine> machine = target_machine(cpu);
  std::vector<std::string> out;
  for (const std::string& feature : candidates)
    if (machine->getMCSubtargetInfo()->checkFeatures("+" + feature)) out.push_back(feature);
  return out;
}

namespace {

// The optimized object of a fast kernel: its bitcode (the optimized IR) emitted with
// CodeGenOpt::Aggressive.
std::vector<std::byte> emit_optimized(const std::string& name, const std::string& bitcode,
                                      llvm::TargetMachine& machine) {
  llvm::LLVMContext context;
  std::unique_ptr<llvm::Module> module = unwrap(
      llvm::parseBitcodeFile(llvm::MemoryBufferRef(bitcode, name), context), "reading bitcode");
  return emit_object(*module, machine);
}

}  // namespace

double LlvmJit::compile_missing(const std::vector<KernelSource>& kernels,
                                const std::vector<size_t>& missing, std::vector<Compiled>& compiled,
                                const std::string& cpu, bool fast, bool prime) {
  // Cache misses compile in parallel, one LLVM context and target machine per thread: a new
  // model's first step waits for its slowest share, not for the sum.
  auto start = std::chrono::steady_clock::now();
  if (missing.empty()) return 0;
  // These use every core: the background tier-ups wait meanwhile.
  BackgroundWorker::Hold hold(state_->worker);
  // Largest first (IR size stands in for compile time), so that no big kernel starts last while
  // the other threads idle.
  std::vector<size_t> order = missing;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return kernels[a].ir.size() > kernels[b].ir.size(); });
  std::mutex error_mutex;
  std::optional<Error> error;
  double cpu_seconds = 0;  // guarded by error_mutex
  // The primer, when asked for, comes last: a thread with no kernel left runs it, so that with
  // fewer kernels than cores it costs no wall time. The team is sized by the cores, not by the
  // user's omp_set_num_threads (a training loop pinned to one thread still compiles on all).
  const size_t jobs = order.size() + (prime ? 1 : 0);
  const int threads =
      static_cast<int>(std::min<size_t>(jobs, std::max(1u, std::thread::hardware_concurrency())));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (size_t k = 0; k < jobs; ++k) {
    if (k == order.size()) {
      prime_tier_up();
      continue;
    }
    size_t i = order[k];
    double cpu_start = thread_cpu_seconds();
    try {
      compiled[i] = compile_object(kernels[i].name, kernels[i].ir, cpu,
                                   fast ? Output::fast_object : Output::optimized_object);
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = e;
    }
    std::lock_guard<std::mutex> lock(error_mutex);
    cpu_seconds += thread_cpu_seconds() - cpu_start;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stats.compile_cpu_seconds += cpu_seconds;
  }
  if (error) throw *error;
  return seconds_since(start);
}

std::vector<std::vector<std::byte>> LlvmJit::objects(const std::vector<KernelSource>& kernels,
                                                     const std::string& cpu) {
  if (!cpu.empty() && !known_cpu(cpu)) fail("LLVM: '{}' is not a CPU this LLVM knows", cpu);
  // Kernels this process compiled fast are cached once optimized: wait for those, rather than
  // compile them again.
  wait_for_tier_up();
  std::vector<Compiled> compiled(kernels.size());
  std::vector<std::string> keys(kernels.size());
  std::vector<size_t> missing;
  for (size_t i = 0; i < kernels.size(); ++i) {
    keys[i] = cache_key(kernels[i].ir, cpu);
    if (auto cached = kernel_cache().load(keys[i]))
      compiled[i].object = std::move(*cached);
    else
      missing.push_back(i);
  }
  double compile_seconds = compile_missing(kernels, missing, compiled, cpu, false, false);
  for (size_t i : missing) kernel_cache().store(keys[i], compiled[i].object);
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stats.compiled += static_cast<int64_t>(missing.size());
    state_->stats.compile_seconds += compile_seconds;
  }
  std::vector<std::vector<std::byte>> result;
  for (Compiled& c : compiled) result.push_back(std::move(c.object));
  return result;
}

std::shared_ptr<const JitKernel> LlvmJit::load(const std::string& name, const std::string& ir) {
  return load_all({{name, ir}})[0];
}

namespace {

// Adds object to the JIT under a new tracker of dylib and looks symbol up; the tracker and the
// address. The state's mutex is held.
std::pair<llvm::orc::ResourceTrackerSP, KernelFunction> add_object(
    llvm::orc::LLJIT& jit, const std::vector<std::byte>& object, const std::string& name,
    const std::string& symbol) {
  llvm::StringRef bytes(reinterpret_cast<const char*>(object.data()), object.size());
  auto buffer = llvm::MemoryBuffer::getMemBufferCopy(bytes, symbol);
  llvm::orc::ResourceTrackerSP tracker = jit.getMainJITDylib().createResourceTracker();
  if (llvm::Error e = jit.addObjectFile(tracker, std::move(buffer))) {
    llvm::consumeError(tracker->remove());
    fail("LLVM JIT: loading kernel {}: {}", name, to_text(std::move(e)));
  }
  auto address = jit.lookup(symbol);
  if (!address) {
    std::string problem = to_text(address.takeError());
    llvm::consumeError(tracker->remove());
    fail("LLVM JIT: looking up kernel {}: {}", name, problem);
  }
  return {tracker, address->toPtr<KernelFunction>()};
}

}  // namespace

std::vector<std::shared_ptr<const JitKernel>> LlvmJit::load_all(
    const std::vector<KernelSource>& kernels) {
  // Declared before any lock: should a kernel made here be dropped (an error midway), its
  // destructor takes the lock.
  std::vector<std::shared_ptr<const JitKernel>> result(kernels.size());
  std::vector<Compiled> compiled(kernels.size());
  std::vector<std::string> keys(kernels.size());
  std::vector<size_t> missing;
  std::vector<bool> from_fast_entry(kernels.size());
  std::vector<TierUp> tier_ups;
  bool fast = tiered();
  auto start = std::chrono::steady_clock::now();
  // A kernel whose code an earlier one of this call shares (code_key()) takes that one's.
  constexpr size_t no_kernel = static_cast<size_t>(-1);
  std::vector<size_t> same_code_as(kernels.size(), no_kernel);
  std::unordered_map<std::string, size_t> first_with_code;
  std::vector<std::string> codes;
  for (const KernelSource& kernel : kernels) codes.push_back(code_key(kernel.name, kernel.ir));
  {
    std::unique_lock<std::mutex> lock(state_->mutex);
    for (size_t i = 0; i < kernels.size(); ++i) {
      if ((result[i] = state_->live(kernels[i].name, lock))) {
        ++state_->stats.memory_hits;
        continue;
      }
      auto loaded = state_->by_code.find(codes[i]);
      if (loaded != state_->by_code.end() && (result[i] = loaded->second.lock())) {
        ++state_->stats.same_code;
        continue;
      }
      auto [first, is_first] = first_with_code.emplace(codes[i], i);
      if (!is_first) {
        same_code_as[i] = first->second;
        continue;
      }
      keys[i] = cache_key(kernels[i].ir, "");
      if (auto cached = kernel_cache().load(keys[i])) {
        compiled[i].object = std::move(*cached);
        continue;
      }
      // Untiered, a fast-tier entry is no use: the kernel is compiled optimized at once.
      if (fast) {
        auto entry = kernel_cache().load(fast_entry_key(keys[i]));
        if (entry && unpack_fast_entry(*entry, compiled[i].object, compiled[i].bitcode)) {
          compiled[i].short_pipeline = compiled[i].bitcode.empty();
          from_fast_entry[i] = true;
          continue;
        }
      }
      missing.push_back(i);
    }
  }
  double load_seconds = seconds_since(start);
  double compile_seconds =
      compile_missing(kernels, missing, compiled, "", fast, fast && !state_->worker_primed);
  {
    std::unique_lock<std::mutex> lock(state_->mutex);
    for (size_t i = 0; i < kernels.size(); ++i) {
      if (result[i] || same_code_as[i] != no_kernel) continue;
      const std::string& name = kernels[i].name;
      if ((result[i] = state_->live(name, lock))) continue;  // a racing call loaded it meanwhile
      bool was_compiled = std::find(missing.begin(), missing.end(), i) != missing.end();
      bool is_fast = (was_compiled && fast) || from_fast_entry[i];
      // Only optimized objects are cached under their key: the fast ones are replaced within the
      // run, or left under another (fast_entry_key()).
      if (was_compiled && !is_fast) kernel_cache().store(keys[i], compiled[i].object);
      auto load_start = std::chrono::steady_clock::now();
      auto p = std::make_unique<JitKernel::Private>();
      p->name = name;
      p->code = codes[i];
      p->state = state_;
      p->bytes = static_cast<int64_t>(compiled[i].object.size());
      p->optimized = !is_fast;
      KernelFunction function;
      std::tie(p->tracker, function) =
          add_object(*state_->jit, compiled[i].object, name, is_fast ? name + fast_suffix : name);
      if (is_fast) p->fast = function;
      std::shared_ptr<JitKernel> kernel(new JitKernel(std::move(p)));
      kernel->entry_.store(function, std::memory_order_release);
      state_->loaded.emplace(name, kernel);
      state_->by_code[codes[i]] = kernel;
      ++state_->stats.resident;
      state_->stats.resident_bytes += kernel->p_->bytes;
      if (is_fast)
        tier_ups.push_back({kernel, name, std::move(keys[i]), std::move(compiled[i].bitcode),
                            compiled[i].short_pipeline ? kernels[i].ir : std::string(),
                            was_compiled ? compiled[i].object : std::vector<std::byte>(),
                            from_fast_entry[i]});
      result[i] = std::move(kernel);
      load_seconds += seconds_since(load_start);
      (was_compiled ? state_->stats.compiled : state_->stats.disk_loaded) += 1;
      if (from_fast_entry[i]) ++state_->stats.fast_disk_loaded;
      if (is_fast && was_compiled) ++state_->stats.fast_compiled;
      if (is_fast && was_compiled && compiled[i].short_pipeline) ++state_->stats.short_compiled;
      if (log_enabled("jit") && !was_compiled)
        log_line("jit", "loaded from disk{} {}", from_fast_entry[i] ? " (fast tier)" : "", name);
      if (log_enabled("jit") && was_compiled)
        log_line("jit", "compiled{} {}: IR pipeline {:.2f} ms, code {:.2f} ms",
                 !is_fast                     ? ""
                 : compiled[i].short_pipeline ? " (fast tier, without fast-math flags)"
                                              : " (fast tier)",
                 name, compiled[i].pipeline_seconds * 1e3, compiled[i].codegen_seconds * 1e3);
    }
    for (size_t i = 0; i < kernels.size(); ++i)
      if (same_code_as[i] != no_kernel) {
        result[i] = result[same_code_as[i]];
        ++state_->stats.same_code;
      }
    state_->stats.compile_seconds += compile_seconds;
    state_->stats.load_seconds += load_seconds;
    if (log_enabled("jit") && !missing.empty())
      log_line("jit", "compiled {} kernels in {:.1f} ms", missing.size(), compile_seconds * 1e3);
  }
  if (!tier_ups.empty()) tier_up(std::move(tier_ups));
  return result;
}

void LlvmJit::set_tiered(bool tiered) { state_->tiered.store(tiered); }

bool LlvmJit::tiered() const { return state_->tiered.load(); }

void LlvmJit::wait_for_tier_up() { state_->worker.drain(); }

void LlvmJit::run_tier_up(TierUp& job) {
  State* state = state_.get();
  // What fails leaves the kernel on its fast code, which gives the same bits; MIXTAPE_LOG=jit
  // says why. Nothing escapes: a job runs on the worker.
  auto start = std::chrono::steady_clock::now();
  double cpu_start = thread_cpu_seconds();
  try {
    std::vector<std::byte> object;
    if (!job.ir.empty()) {
      object = compile_object(job.name, job.ir, "", Output::optimized_object).object;
    } else {
      auto machine = state->machines.lease("opt ", [&] { return target_machine(""); });
      object = emit_optimized(job.name, job.bitcode, *machine);
    }
    kernel_cache().store(job.key, object);
    // Let go after the lock: should this be the kernel's last owner, its destructor takes it.
    std::shared_ptr<const JitKernel> kernel = job.kernel.lock();
    std::lock_guard<std::mutex> lock(state->mutex);
    state->stats.tier_up_seconds += seconds_since(start);
    state->stats.tier_up_cpu_seconds += thread_cpu_seconds() - cpu_start;
    if (!kernel) return;  // gone meanwhile; its object is cached for the next one
    auto [tracker, function] = add_object(*state->jit, object, job.name, job.name);
    JitKernel::Private& p = *kernel->p_;
    p.optimized_tracker = tracker;
    p.optimized = true;
    p.bytes += static_cast<int64_t>(object.size());
    state->stats.resident_bytes += static_cast<int64_t>(object.size());
    kernel->entry_.store(function, std::memory_order_release);
    ++state->stats.tiered_up;
    if (log_enabled("jit")) log_line("jit", "tiered up {}", job.name);
  } catch (const std::exception& e) {
    if (log_enabled("jit"))
      log_line("jit", "{} keeps its fast code: the optimizing compile failed: {}", job.name,
               e.what());
  }
}

namespace {

// The kernel prime_tier_up() tiers up: a `fadd reassoc` sum, which the IR pipeline vectorizes.
constexpr const char* primer_name = "mt_tier_up_primer";
constexpr const char* primer_ir = R"(; mixtape: the tier-up primer
define void @mt_tier_up_primer(ptr noalias nocapture readonly %params, i64 %begin, i64 %end) {
entry:
  %in = load ptr, ptr %params
  %pout = getelementptr inbounds ptr, ptr %params, i64 1
  %out = load ptr, ptr %pout
  %any = icmp slt i64 %begin, %end
  br i1 %any, label %loop, label %exit
loop:
  %i = phi i64 [ %begin, %entry ], [ %i.next, %loop ]
  %acc = phi float [ 0.0, %entry ], [ %acc.next, %loop ]
  %at = getelementptr inbounds float, ptr %in, i64 %i
  %x = load float, ptr %at
  %acc.next = fadd reassoc float %acc, %x
  %i.next = add nsw i64 %i, 1
  %more = icmp slt i64 %i.next, %end
  br i1 %more, label %loop, label %exit
exit:
  %sum = phi float [ 0.0, %entry ], [ %acc.next, %loop ]
  store float %sum, ptr %out
  ret void
}
)";

}  // namespace

void LlvmJit::prime_tier_up() {
  std::lock_guard<std::mutex> lock(state_->prime_mutex);
  if (state_->worker_primed) return;
  // Both kinds of tier-up in one: the primer's IR parsed, through the IR pipeline and out as
  // bitcode, then read back and emitted at CodeGenOpt::Aggressive, and cached (the rest of what
  // compiling IR afresh does, the foreground has done).
  auto start = std::chrono::steady_clock::now();
  try {
    TierUp job;
    job.name = primer_name;
    job.key = cache_key(primer_ir, "");
    double cpu_start = thread_cpu_seconds();
    job.bitcode = compile_object(primer_name, primer_ir, "", Output::optimized_bitcode).bitcode;
    double pipeline_seconds = seconds_since(start);
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stats.tier_up_cpu_seconds += thread_cpu_seconds() - cpu_start;
    }
    run_tier_up(job);
    if (log_enabled("jit"))
      log_line("jit", "primed the tier-ups in {:.1f} ms (IR pipeline {:.1f} ms)",
               seconds_since(start) * 1e3, pipeline_seconds * 1e3);
  } catch (const std::exception& e) {
    if (log_enabled("jit")) log_line("jit", "the tier-up primer failed: {}", e.what());
  }
  state_->worker_primed = true;
}

void LlvmJit::tier_up(std::vector<TierUp> jobs) {
  // The statics a job makes must exist before the worker's first post() registers its exit
  // handler (jit/background_worker.h): exit() then destroys them after it has stopped the worker.
  // load_all() has most often primed already, on a core its foreground compile left idle.
  prime_tier_up();
  // The LlvmJit instance and its state outlive the worker, which exit() stops first. A tier-up
  // that exit() drops leaves a fast-tier entry instead (fast_entry_key()), so that the process
  // does not wait for optimized code it will not run.
  for (TierUp& job : jobs) {
    auto shared = std::make_shared<TierUp>(std::move(job));
    BackgroundWorker::Job on_drop;
    if (!shared->fast_object.empty())
      on_drop = [shared] {
        try {
          kernel_cache().store(fast_entry_key(shared->key),
                               pack_fast_entry(shared->fast_object, shared->bitcode));
        } catch (const std::exception&) {
          // Nothing lost but time: the next process compiles the kernel again.
        }
      };
    state_->worker.post([this, shared] { run_tier_up(*shared); }, std::move(on_drop),
                        shared->at_once);
  }
}

}  // namespace mixtape
