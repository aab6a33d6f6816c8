// codegen/llvm_jit.cpp -- LLVM IR text -> host machine code: O3 pipeline, object emission, ORC
// LLJIT.
#include "codegen/llvm_jit.h"

#include <llvm/ExecutionEngine/Orc/ExecutionUtils.h>
#include <llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h>
#include <llvm/ExecutionEngine/Orc/LLJIT.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/LegacyPassManager.h>
#include <llvm/IR/Module.h>
#include <llvm/IR/Verifier.h>
#include <llvm/IRReader/IRReader.h>
#include <llvm/Passes/PassBuilder.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/SourceMgr.h>
#include <llvm/Support/TargetSelect.h>
#include <llvm/Support/raw_ostream.h>
#include <llvm/Target/TargetMachine.h>
#include <llvm/TargetParser/Host.h>

#include <chrono>
#include <mutex>
#include <unordered_map>

#include "codegen/kernel_cache.h"
#include "dsl/error.h"
#include "dsl/log.h"

namespace mixtape {
namespace {

// Bumped whenever emitted code for the same IR could change (pipeline, flags): part of the key.
constexpr int jit_version = 1;

std::string to_text(llvm::Error error) {
  std::string text;
  llvm::handleAllErrors(std::move(error),
                        [&](const llvm::ErrorInfoBase& info) { text += info.message(); });
  return text;
}

template <typename T>
T unwrap(llvm::Expected<T> value, const char* what) {
  if (!value) fail("LLVM JIT: {}: {}", what, to_text(value.takeError()));
  return std::move(*value);
}

}  // namespace

struct LlvmJit::State {
  std::mutex mutex;
  std::unique_ptr<llvm::orc::LLJIT> jit;
  std::unique_ptr<llvm::TargetMachine> machine;
  std::string cpu, features;
  std::unordered_map<std::string, KernelFunction> loaded;
  Stats stats;
};

LlvmJit::LlvmJit() : state_(std::make_unique<State>()) {
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
  state_->machine = unwrap(builder.createTargetMachine(), "creating the target machine");
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

std::vector<std::byte> LlvmJit::compile_object(const std::string& name, const std::string& ir) {
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
  module->setDataLayout(state_->machine->createDataLayout());
  module->setTargetTriple(state_->machine->getTargetTriple().str());
  std::string problems;
  llvm::raw_string_ostream verify_os(problems);
  if (llvm::verifyModule(*module, &verify_os))
    fail("LLVM JIT: kernel {} is invalid IR: {}", name, verify_os.str());

  llvm::LoopAnalysisManager loops;
  llvm::FunctionAnalysisManager functions;
  llvm::CGSCCAnalysisManager cgscc;
  llvm::ModuleAnalysisManager modules;
  llvm::PassBuilder passes(state_->machine.get());
  passes.registerModuleAnalyses(modules);
  passes.registerCGSCCAnalyses(cgscc);
  passes.registerFunctionAnalyses(functions);
  passes.registerLoopAnalyses(loops);
  passes.crossRegisterProxies(loops, functions, cgscc, modules);
  passes.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O3).run(*module, modules);

  llvm::SmallVector<char, 0> object;
  llvm::raw_svector_ostream os(object);
  llvm::legacy::PassManager codegen;
  if (state_->machine->addPassesToEmitFile(codegen, os, nullptr, llvm::CGFT_ObjectFile))
    fail("LLVM JIT: the target cannot emit object files");
  codegen.run(*module);
  const auto* begin = reinterpret_cast<const std::byte*>(object.data());
  return std::vector<std::byte>(begin, begin + object.size());
}

KernelFunction LlvmJit::load(const std::string& name, const std::string& ir) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto found = state_->loaded.find(name);
  if (found != state_->loaded.end()) {
    ++state_->stats.memory_hits;
    return found->second;
  }
  auto start = std::chrono::steady_clock::now();
  std::string key = fmt::format("llvm-jit v{}\n{}\n{}", jit_version, target(), ir);
  KernelCache& cache = kernel_cache();
  std::optional<std::vector<std::byte>> object = cache.load(key);
  bool compiled = !object;
  if (compiled) {
    object = compile_object(name, ir);
    cache.store(key, *object);
  }
  llvm::StringRef bytes(reinterpret_cast<const char*>(object->data()), object->size());
  auto buffer = llvm::MemoryBuffer::getMemBufferCopy(bytes, name);
  if (llvm::Error error = state_->jit->addObjectFile(std::move(buffer)))
    fail("LLVM JIT: loading kernel {}: {}", name, to_text(std::move(error)));
  auto address = unwrap(state_->jit->lookup(name), "looking up a kernel");
  auto function = address.toPtr<KernelFunction>();
  state_->loaded.emplace(name, function);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  (compiled ? state_->stats.compiled : state_->stats.disk_loaded) += 1;
  (compiled ? state_->stats.compile_seconds : state_->stats.load_seconds) += seconds;
  if (log_enabled("jit"))
    log_line("jit", "{} {} in {:.2f} ms", compiled ? "compiled" : "loaded from disk", name,
             seconds * 1e3);
  return function;
}

}  // namespace mixtape
