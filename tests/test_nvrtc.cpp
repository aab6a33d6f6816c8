// tests/test_nvrtc.cpp -- the CUDA emitter and NVRTC without a GPU: every kernel the CPU back end
// runs for five models under the five built-in policies compiles (CUBIN sm_80/sm_90, PTX through
// ptxas); golden CUDA sources; NVRTC errors; the kernel cache. CTest label `nvrtc`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "examples/char_gpt_model.h"
#include "examples/digits_model.h"
#include "mixtape/codegen/emit_cuda.h"
#include "mixtape/codegen/hash.h"
#include "mixtape/codegen/kernel_cache.h"
#include "mixtape/codegen/nvrtc.h"
#include "mixtape/precision_policy/policy.h"
#include "mixtape/runtime/cpu_executor.h"
#include "mixtape/runtime/cuda_attention.h"
#include "mixtape/runtime/cuda_fixed_kernels.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/program.h"
#include "test_util.h"

// Our hand-written NVRTC declarations (codegen/nvrtc.cpp) against the toolkit's header.
#if __has_include("/usr/local/cuda/include/nvrtc.h")
#include "/usr/local/cuda/include/nvrtc.h"
static_assert(NVRTC_SUCCESS == 0);
static_assert(std::is_same_v<decltype(&nvrtcCompileProgram),
                             nvrtcResult (*)(nvrtcProgram, int, const char* const*)>);
static_assert(std::is_same_v<decltype(&nvrtcCreateProgram),
                             nvrtcResult (*)(nvrtcProgram*, const char*, const char*, int,
                                             const char* const*, const char* const*)>);
static_assert(std::is_same_v<decltype(&nvrtcGetCUBIN), nvrtcResult (*)(nvrtcProgram, char*)>);
static_assert(std::is_same_v<decltype(&nvrtcVersion), nvrtcResult (*)(int*, int*)>);
static_assert(std::is_same_v<decltype(&nvrtcGetNumSupportedArchs), nvrtcResult (*)(int*)>);
static_assert(std::is_same_v<decltype(&nvrtcGetSupportedArchs), nvrtcResult (*)(int*)>);
static_assert(sizeof(nvrtcResult) == sizeof(int));
#endif

namespace mt = mixtape;
namespace kir = mixtape::kir;

namespace {

#define SKIP_WITHOUT_NVRTC()                                                            \
  do {                                                                                  \
    if (!mt::nvrtc_available()) {                                                       \
      GTEST_SKIP() << "NVRTC cannot be dlopened (tried libnvrtc.so.13, .so.12, "        \
                      "libnvrtc.so, $CUDA_HOME/lib64 and /usr/local/cuda/lib64): CUDA " \
                      "compilation is not tested";                                      \
    }                                                                                   \
  } while (0)

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

const char* policy_names[] = {"fp32", "autocast-f16", "autocast-bf16", "pure-f16", "pure-bf16"};

// Every kernel the CPU back end runs while `steps` runs, by name, and the multi-tensor form of
// each pointwise one that has one, named as the program builder names it. The CPU runs without
// multi-tensor steps here, so that every kernel is seen as it runs alone too (a set of one).
std::map<std::string, kir::Kernel> kernels_of(const std::function<void()>& steps) {
  std::map<std::string, kir::Kernel> seen;
  mt::Device previous = mt::current_device();
  bool multi_tensor = mt::multi_tensor_steps();
  mt::set_multi_tensor_steps(false);
  mt::set_device(mt::Device::cpu);
  mt::set_kernel_observer([&](const mt::LoweredKernel& lowered) {
    seen.emplace(lowered.kernel.name, lowered.kernel);
    std::vector<bool> zero_rank;
    for (const mt::Node* node : lowered.nodes) zero_rank.push_back(node->shape.empty());
    if (std::optional<kir::Kernel> flat = kir::multi_tensor_form(lowered.kernel, zero_rank)) {
      flat->name = "mt_" + mt::hash_string(kir::to_string(*flat)).hex();
      seen.emplace(flat->name, *flat);
    }
  });
  try {
    steps();
  } catch (...) {
    mt::set_kernel_observer({});
    mt::set_device(previous);
    mt::set_multi_tensor_steps(multi_tensor);
    throw;
  }
  mt::set_kernel_observer({});
  mt::set_device(previous);
  mt::set_multi_tensor_steps(multi_tensor);
  return seen;
}

// Two training steps: forward and loss under the policy, backward, GradScaler (enabled for f16
// policies, as PyTorch would), optimizer step; the loss is read each step.
void train(mt::Module& net, const std::function<mt::Tensor()>& loss_of, const std::string& policy,
           bool sgd) {
  mt::PolicyPtr p = mt::policy_by_name(policy);
  std::unique_ptr<mt::Optimizer> optimizer;
  if (sgd)
    optimizer =
        std::make_unique<mt::SGD>(net.parameters(), mt::SGDOptions{.lr = 0.05, .momentum = 0.9});
  else
    optimizer = std::make_unique<mt::AdamW>(net.parameters(),
                                            mt::AdamOptions{.lr = 1e-3, .weight_decay = 0.01});
  mt::GradScaler scaler({.enabled = policy.ends_with("-f16")});
  for (int step = 0; step < 2; ++step) {
    optimizer->zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(p);
      loss = loss_of();
    }
    scaler.scale(loss).backward();
    scaler.step(*optimizer);
    scaler.update();
    EXPECT_TRUE(std::isfinite(loss.item())) << policy;
  }
}

struct Model {
  std::string name;
  std::function<void(const std::string& policy)> train;
};

std::vector<Model> models() {
  std::vector<Model> list;
  list.push_back({"mlp", [](const std::string& policy) {
                    mt::manual_seed(1);
                    mt::MLP net({16, 32, 8}, mt::Activation::Gelu);
                    mt::Tensor x = mt::randn({8, 16});
                    mt::Tensor y = mt::tensor(std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}, {8});
                    train(
                        net, [&] { return mt::cross_entropy(net(x), y); }, policy, true);
                  }});
  list.push_back({"transformer_block", [](const std::string& policy) {
                    mt::manual_seed(2);
                    mt::TransformerBlock block(32, 4);
                    mt::Tensor x = mt::randn({2, 8, 32});
                    train(
                        block,
                        [&] {
                          mt::Tensor y = mt::cast(block(x), mt::f32);
                          return mt::mean(y * y);
                        },
                        policy, false);
                  }});
  list.push_back({"digits_mlp", [](const std::string& policy) {
                    mt::manual_seed(3);
                    DigitsMLP net;
                    mt::Tensor x = mt::randn({16, 64});
                    std::vector<int64_t> labels(16);
                    for (size_t i = 0; i < labels.size(); ++i) labels[i] = (i * 7) % 10;
                    mt::Tensor y = mt::tensor(labels, {16});
                    mt::CrossEntropyOptions options{.label_smoothing = 0.2};
                    train(
                        net, [&] { return mt::cross_entropy(net(x), y, options); }, policy, true);
                  }});
  list.push_back({"char_gpt", [](const std::string& policy) {
                    mt::Generator gen(4);
                    CharGpt net({.vocab = 11, .layers = 1, .heads = 2, .width = 16, .context = 8},
                                &gen);
                    std::vector<int64_t> tokens(16), targets(16);
                    for (size_t i = 0; i < tokens.size(); ++i) {
                      tokens[i] = (i * 3) % 11;
                      targets[i] = (i * 3 + 1) % 11;
                    }
                    mt::Tensor t = mt::tensor(tokens, {2, 8}), u = mt::tensor(targets, {2, 8});
                    train(
                        net, [&] { return net.loss(t, u); }, policy, false);
                  }});
  // The vision model: convolutions (oneDNN's on the CPU, cuDNN's on a GPU) between the kernels of
  // training-mode batch norm with its running statistics, ReLU, the residual adds and the mean.
  list.push_back({"digits_cnn", [](const std::string& policy) {
                    mt::manual_seed(5);
                    DigitsCnn net;
                    mt::Tensor x = mt::randn({8, 64});
                    mt::Tensor y = mt::tensor(std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}, {8});
                    train(
                        net, [&] { return mt::cross_entropy(net(x), y); }, policy, true);
                  }});
  return list;
}

bool has_kernel_entry(const std::string& ptx, const std::string& name) {
  return ptx.find(".entry " + name + "(") != std::string::npos;
}

// ptxas on `ptx` for `arch`; "" on success, else its output.
std::string run_ptxas(const std::string& ptxas, const std::string& ptx, const std::string& arch,
                      const std::string& stem) {
  std::filesystem::path dir = std::filesystem::temp_directory_path();
  std::string in = (dir / (stem + ".ptx")).string(), out = (dir / (stem + "." + arch)).string(),
              log = (dir / (stem + "." + arch + ".log")).string();
  std::ofstream(in, std::ios::binary) << ptx;
  std::string command =
      fmt::format("'{}' -arch={} '{}' -o '{}' > '{}' 2>&1", ptxas, arch, in, out, log);
  int status = std::system(command.c_str());
  std::string text;
  if (status != 0) {
    std::stringstream buffer;
    buffer << std::ifstream(log).rdbuf();
    text = fmt::format("ptxas -arch={} exited with {}: {}", arch, status, buffer.str());
  } else if (!std::filesystem::exists(out) || std::filesystem::file_size(out) == 0) {
    text = "ptxas wrote no CUBIN";
  }
  std::filesystem::remove(in);
  std::filesystem::remove(out);
  std::filesystem::remove(log);
  return text;
}

// What one compile job found wrong ("" when nothing): a CUBIN for sm_XX, or PTX for compute_80
// assembled by ptxas for sm_80 and sm_90.
std::string compile_job(const std::string& model, const std::string& source,
                        const std::vector<std::string>& names, const std::string& arch,
                        const std::string& ptxas) {
  std::string binary;
  try {
    binary = mt::compile_cuda(source, arch, model + ".cu");
  } catch (const mt::Error& error) {
    return error.what();
  }
  std::string problems;
  if (arch.starts_with("sm_")) {
    if (!binary.starts_with("\x7f"
                            "ELF"))
      problems += arch + " CUBIN is not ELF; ";
    for (const std::string& name : names)
      if (binary.find(name) == std::string::npos) problems += name + " missing from the CUBIN; ";
    return problems;
  }
  for (const std::string& name : names)
    if (!has_kernel_entry(binary, name)) problems += name + " missing from the PTX; ";
  if (!ptxas.empty())
    for (const char* target : {"sm_80", "sm_90"})
      problems +=
          run_ptxas(ptxas, binary, target, fmt::format("mixtape_nvrtc_{}_{}", model, ::getpid()));
  return problems;
}

TEST(Nvrtc, EveryKernelOfFiveModelsUnderEveryPolicyCompiles) {
  SKIP_WITHOUT_NVRTC();
  std::string ptxas = "/usr/local/cuda/bin/ptxas";
  if (!std::filesystem::exists(ptxas)) {
    std::printf("ptxas not found at %s: the PTX is not assembled\n", ptxas.c_str());
    ptxas.clear();
  }
  auto start = std::chrono::steady_clock::now();
  std::map<std::string, kir::Kernel> all;
  struct Program {
    std::string model, source;
    std::vector<std::string> names;
  };
  std::vector<Program> programs;
  int64_t pointwise = 0, reductions = 0, scalar_kernels = 0, multi_tensor = 0, vectorized = 0;
  for (const Model& model : models()) {
    std::map<std::string, kir::Kernel> fresh;
    for (const char* policy : policy_names) {
      std::map<std::string, kir::Kernel> seen = kernels_of([&] { model.train(policy); });
      std::printf("%-18s %-14s %3zu kernels\n", model.name.c_str(), policy, seen.size());
      EXPECT_GT(seen.size(), 3u) << model.name << " " << policy;
      for (auto& [name, kernel] : seen)
        if (!all.count(name)) fresh.emplace(name, kernel);
    }
    // One NVRTC program per model (the kernels no earlier model had) and arch: NVRTC's
    // per-program overhead dominates.
    Program program{model.name, "", {}};
    for (auto& [name, kernel] : fresh) {
      std::string source = mt::emit_cuda(kernel);
      vectorized += source.find("mt_pack<", source.find("#endif  // MIXTAPE_CUDA_PRELUDE")) !=
                    std::string::npos;
      program.source += source;
      program.names.push_back(name);
      mt::CudaLaunch launch = mt::cuda_launch_shape(kernel);
      EXPECT_GE(launch.grid, 1u);
      EXPECT_TRUE(launch.block >= 32 && launch.block <= 256 && launch.block % 32 == 0) << name;
      if (kernel.multi_tensor) {
        // At least 16 segments a launch: the widest kernel here (digits_cnn's gradient norm, a
        // reduction whose epilogue adds 20 other partial sums: 23 buffers a segment) takes 19.
        EXPECT_GE(mt::cuda_multi_tensor_capacity(kernel), 16) << name;
      }
      (kernel.multi_tensor ? multi_tensor : kernel.is_reduction() ? reductions : pointwise) += 1;
      scalar_kernels += kernel.scalars > 0;
    }
    std::printf("%-18s %3zu new kernels, %zu bytes of CUDA C++\n", model.name.c_str(), fresh.size(),
                program.source.size());
    all.insert(fresh.begin(), fresh.end());
    if (!fresh.empty()) programs.push_back(std::move(program));
  }
  double collect_seconds = seconds_since(start);

  // NVRTC and ptxas run single-threaded: two workers keep both cores busy.
  start = std::chrono::steady_clock::now();
  struct Job {
    const Program* program;
    std::string arch, problems;
  };
  std::vector<Job> jobs;
  for (const Program& program : programs)
    for (const char* arch : {"compute_80", "sm_80", "sm_90"}) jobs.push_back({&program, arch, ""});
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < jobs.size(); i = next++)
      jobs[i].problems = compile_job(jobs[i].program->model, jobs[i].program->source,
                                     jobs[i].program->names, jobs[i].arch, ptxas);
  };
  std::thread helper(worker);
  worker();
  helper.join();
  for (const Job& job : jobs)
    EXPECT_EQ(job.problems, "") << job.program->model << " for " << job.arch;

  mt::NvrtcStats stats = mt::nvrtc_stats();
  std::printf(
      "%zu distinct kernels (%lld multi-tensor, %lld other pointwise of which %lld vectorized, "
      "%lld other reductions; %lld with scalar slots); "
      "NVRTC %s: %lld programs compiled, %lld from the cache%s\n"
      "seconds: collecting on the CPU %.1f, NVRTC and ptxas %.1f (wall, 2 threads)\n",
      all.size(), static_cast<long long>(multi_tensor), static_cast<long long>(pointwise),
      static_cast<long long>(vectorized), static_cast<long long>(reductions),
      static_cast<long long>(scalar_kernels), mt::nvrtc_version().c_str(),
      static_cast<long long>(stats.compiled), static_cast<long long>(stats.cache_hits),
      ptxas.empty() ? "" : "; PTX assembled by ptxas for sm_80 and sm_90", collect_seconds,
      seconds_since(start));
  EXPECT_GT(all.size(), 50u);
  EXPECT_GT(reductions, 5);
  EXPECT_GT(scalar_kernels, 0);
  EXPECT_GT(multi_tensor, 20);
  EXPECT_GT(vectorized, 50);
}

// ---- golden sources: kernels built by hand, emitted text compared with tests/golden/ ----

kir::Value load(int32_t param, std::vector<int64_t> coeff, kir::Type type = kir::Type::f32) {
  kir::Value v{kir::Op::Load, type};
  v.param = param;
  v.map.coeff = std::move(coeff);
  return v;
}
kir::Value op(kir::Op o, kir::Type type, int32_t a, int32_t b = -1, int32_t c = -1) {
  kir::Value v{o, type};
  v.a = a;
  v.b = b;
  v.c = c;
  return v;
}
kir::Value constant(kir::Type type, double imm) {
  kir::Value v{kir::Op::Const, type};
  v.imm = imm;
  return v;
}
kir::Value round_to(int32_t a, mt::DType dtype) {
  kir::Value v = op(kir::Op::RoundTo, kir::Type::f32, a);
  v.dtype = dtype;
  return v;
}
kir::Value call(kir::Libm fn, kir::Type type, int32_t a) {
  kir::Value v{kir::Op::Call, type};
  v.a = a;
  v.param = static_cast<int32_t>(fn);
  return v;
}
kir::Value special(kir::Op o, kir::Type type, int32_t param) {
  kir::Value v{o, type};
  v.param = param;
  return v;
}

using kir::Op;
using kir::Type;

// gelu-ish chain in bf16 with a broadcast bias: y = bf16(tanh(bf16(x * w + b[j]))) over [4, 8].
kir::Kernel bf16_broadcast_chain() {
  kir::Kernel k;
  k.name = "golden_bf16_broadcast_chain";
  k.dims = {4, 8};
  k.params = {{mt::bf16, false}, {mt::bf16, false}, {mt::bf16, true}};
  k.body = {load(0, {8, 1}),
            constant(Type::f32, 0.5),
            op(Op::Mul, Type::f32, 0, 1),
            load(1, {0, 1}),
            op(Op::Add, Type::f32, 2, 3),
            round_to(4, mt::bf16),
            call(kir::Libm::Tanh, Type::f32, 5),
            round_to(6, mt::bf16)};
  k.stores = {{2, 7, kir::Affine{0, {8, 1}}}};
  return k;
}

// Softmax's statistics of each row of [6, 100] f16 logits: the NaN-propagating max and the sum,
// the epilogue storing max and log(sum) - as f32.
kir::Kernel row_max_and_sum() {
  kir::Kernel k;
  k.name = "golden_row_max_and_sum";
  k.dims = {6, 100};
  k.reduce_from = 1;
  k.params = {{mt::f16, false}, {mt::f32, true}, {mt::f32, true}};
  k.body = {load(0, {100, 1})};
  k.reductions = {{kir::ReduceKind::Max, Type::f32, 0}, {kir::ReduceKind::Sum, Type::f32, 0}};
  k.epilogue = {special(Op::Accumulated, Type::f32, 0), special(Op::Accumulated, Type::f32, 1),
                call(kir::Libm::Log, Type::f32, 1), op(Op::Sub, Type::f32, 2, 0)};
  k.epilogue_stores = {{1, 0, kir::Affine{0, {1, 0}}}, {2, 3, kir::Affine{0, {1, 0}}}};
  return k;
}

// Sums and maxima of 20000 bf16 values, over the rows of [3, 20000] (row = true: few outer points
// and many inner ones, so each row is split across blocks whose partials the last block to
// arrive folds through the workspace argument) or over the columns of a tall [20000, 6] matrix
// (a bias gradient: a block per 32 columns, a lane per column, its rows split likewise).
kir::Kernel sum_and_max(bool row) {
  kir::Kernel k;
  k.name = row ? "golden_split_row_sum_and_max" : "golden_column_sum_and_max";
  k.dims = {row ? 3 : 6, 20000};
  k.reduce_from = 1;
  k.params = {{mt::bf16, false}, {mt::f32, true}, {mt::f32, true}};
  k.body = {load(0, row ? std::vector<int64_t>{20000, 1} : std::vector<int64_t>{1, 6})};
  k.reductions = {{kir::ReduceKind::Sum, Type::f32, 0}, {kir::ReduceKind::Max, Type::f32, 0}};
  k.epilogue = {special(Op::Accumulated, Type::f32, 0), special(Op::Accumulated, Type::f32, 1)};
  k.epilogue_stores = {{1, 0, kir::Affine{0, {1, 0}}}, {2, 1, kir::Affine{0, {1, 0}}}};
  return k;
}
kir::Kernel split_row_sum_and_max() { return sum_and_max(true); }
kir::Kernel column_sum_and_max() { return sum_and_max(false); }

// A column sum of [64, 5] bf16 values into a bf16 accumulator (every partial rounded), stored
// as bf16: outer dim 5 (kept), inner dim 64 (reduced).
kir::Kernel half_accumulator_sum() {
  kir::Kernel k;
  k.name = "golden_half_accumulator_sum";
  k.dims = {5, 64};
  k.reduce_from = 1;
  k.params = {{mt::bf16, false}, {mt::bf16, true}};
  k.body = {load(0, {1, 5})};
  kir::Reduction sum{kir::ReduceKind::Sum, Type::f32, 0};
  sum.round_to = mt::bf16;
  k.reductions = {sum};
  k.epilogue = {special(Op::Accumulated, Type::f32, 0), round_to(0, mt::bf16)};
  k.epilogue_stores = {{1, 1, kir::Affine{0, {1, 0}}}};
  return k;
}

// An SGD step with the learning rate in a scalar slot, skipped when found_inf (a bool) is set:
// w' = found_inf ? w : w - lr * g, with an i32 step counter incremented alongside.
kir::Kernel scalar_sgd_step() {
  kir::Kernel k;
  k.name = "golden_scalar_sgd_step";
  k.dims = {300};
  k.scalars = 1;
  k.params = {{mt::f32, false}, {mt::f32, false}, {mt::boolean, false},
              {mt::i32, false}, {mt::f32, true},  {mt::i32, true}};
  k.body = {load(0, {1}),
            load(1, {1}),
            special(Op::Scalar, Type::f32, 0),
            op(Op::Mul, Type::f32, 2, 1),
            op(Op::Sub, Type::f32, 0, 3),
            load(2, {0}, Type::i1),
            op(Op::Select, Type::f32, 5, 0, 4),
            load(3, {0}, Type::i64),
            constant(Type::i64, 1),
            op(Op::Add, Type::i64, 7, 8),
            round_to(9, mt::i32)};
  k.body.back().type = Type::i64;
  k.stores = {{4, 6, kir::Affine{0, {1}}}, {5, 10, kir::Affine{0, {0}}}};
  return k;
}

// A row sum over two inner dims inside the grid-stride outer loop: with a constant inner stride
// this shape crashed NVRTC 13.0 (a segfault in its optimizer), hence the blockDim.x stride.
kir::Kernel two_inner_dims_sum() {
  kir::Kernel k;
  k.name = "two_inner_dims_sum";
  k.dims = {192, 2, 40};
  k.reduce_from = 1;
  k.params = {{mt::f16, false}, {mt::f16, false}, {mt::f16, true}, {mt::f16, true}};
  k.body = {load(0, {1, 7680, 192}), load(1, {1, 7680, 192}), op(Op::Add, Type::f32, 0, 1),
            round_to(2, mt::f16)};
  k.stores = {{2, 3, kir::Affine{0, {1, 7680, 192}}}};
  k.reductions = {{kir::ReduceKind::Sum, Type::f32, 3}};
  k.epilogue = {special(Op::Accumulated, Type::f32, 0), round_to(0, mt::f16)};
  k.epilogue_stores = {{3, 1, kir::Affine{0, {1, 0, 0}}}};
  return k;
}

// Softmax over the rows of [6, 100] f32 in three passes over each row: the max, the sum of
// exp(x - max), then exp(x - max) / sum stored; every thread of a block reads the first two
// passes' results.
kir::Kernel softmax_rows() {
  kir::Kernel k;
  k.name = "golden_softmax_rows";
  k.dims = {6, 100};
  k.reduce_from = 1;
  k.params = {{mt::f32, false}, {mt::f32, true}};
  k.body = {load(0, {100, 1})};
  kir::Pass sum_pass, store_pass;
  sum_pass.body = {load(0, {100, 1}), special(Op::Accumulated, Type::f32, 0),
                   op(Op::Sub, Type::f32, 0, 1), call(kir::Libm::Exp, Type::f32, 2)};
  store_pass.body = {load(0, {100, 1}),
                     special(Op::Accumulated, Type::f32, 0),
                     op(Op::Sub, Type::f32, 0, 1),
                     call(kir::Libm::Exp, Type::f32, 2),
                     special(Op::Accumulated, Type::f32, 1),
                     op(Op::Div, Type::f32, 3, 4)};
  store_pass.stores = {{1, 5, kir::Affine{0, {100, 1}}}};
  k.later_passes = {sum_pass, store_pass};
  k.reductions = {{kir::ReduceKind::Max, Type::f32, 0}, {kir::ReduceKind::Sum, Type::f32, 3}};
  k.reductions[1].pass = 1;
  return k;
}

// The SGD step above without its counter, in its multi-tensor form: every param of every
// segment is a pointer in the table, the found_inf flag 0-d.
kir::Kernel multi_tensor_sgd_step() {
  kir::Kernel k = scalar_sgd_step();
  k.params = {k.params[0], k.params[1], k.params[2], k.params[4]};
  k.body.erase(k.body.begin() + 7, k.body.end());
  k.stores = {{3, 6, kir::Affine{0, {1}}}};
  std::optional<kir::Kernel> flat = kir::multi_tensor_form(k, {false, false, true, false});
  EXPECT_TRUE(flat.has_value());
  flat->name = "golden_multi_tensor_sgd_step";
  return *flat;
}

// A pointwise f16/f32 chain whose maps are all the identity or a constant: each thread moves 4
// points per pack (16 bytes of f32, 8 of f16). Over [6, 42] the packs cover every point; over
// [250] two points are left for the tail loop. y = f16(x * scale + b), z = b * 2 with x f16,
// b f32 and scale a 0-d f32.
kir::Kernel vector_f16_chain(std::vector<int64_t> dims, const char* name) {
  kir::Kernel k;
  k.name = name;
  k.dims = dims;
  std::vector<int64_t> identity =
      dims.size() == 2 ? std::vector<int64_t>{dims[1], 1} : std::vector<int64_t>{1};
  std::vector<int64_t> zero(dims.size(), 0);
  k.params = {
      {mt::f16, false}, {mt::f32, false}, {mt::f32, false}, {mt::f16, true}, {mt::f32, true}};
  k.body = {load(0, identity),
            load(2, zero),
            op(Op::Mul, Type::f32, 0, 1),
            load(1, identity),
            op(Op::Add, Type::f32, 2, 3),
            round_to(4, mt::f16),
            constant(Type::f32, 2.0),
            op(Op::Mul, Type::f32, 3, 6)};
  k.stores = {{3, 5, kir::Affine{0, identity}}, {4, 7, kir::Affine{0, identity}}};
  return k;
}
kir::Kernel vector_f16_chain() { return vector_f16_chain({6, 42}, "golden_vector_f16_chain"); }

// GradScaler's inf check of a [4, 50] bf16 gradient, sum(g - g) into an f32 0-d flag (0, or
// NaN when an element is not finite), in its multi-tensor form: a block per gradient.
kir::Kernel multi_tensor_inf_check() {
  kir::Kernel k;
  k.dims = {4, 50};
  k.reduce_from = 0;
  k.params = {{mt::bf16, false}, {mt::f32, true}};
  k.body = {load(0, {50, 1}), op(Op::Sub, Type::f32, 0, 0)};
  k.reductions = {{kir::ReduceKind::Sum, Type::f32, 1}};
  k.epilogue = {special(Op::Accumulated, Type::f32, 0)};
  k.epilogue_stores = {{1, 0, kir::Affine{0, {0, 0}}}};
  std::optional<kir::Kernel> flat = kir::multi_tensor_form(k, {false, true});
  EXPECT_TRUE(flat.has_value());
  flat->name = "golden_multi_tensor_inf_check";
  return *flat;
}

class Golden : public ::testing::TestWithParam<std::pair<const char*, kir::Kernel (*)()>> {};

// Every source starts with the same guarded device helpers (codegen/emit_cuda.cpp's prelude);
// the golden files hold the kernel that follows them.
std::string kernel_after_prelude(const std::string& source) {
  const std::string prelude_end = "#endif  // MIXTAPE_CUDA_PRELUDE_V1\n";
  size_t at = source.find(prelude_end);
  EXPECT_EQ(source.rfind("#ifndef MIXTAPE_CUDA_PRELUDE_V1", 0), 0u) << "no prelude first";
  EXPECT_NE(at, std::string::npos) << "the prelude does not end";
  return at == std::string::npos ? source : source.substr(at + prelude_end.size());
}

TEST_P(Golden, EmittedCudaMatchesTheGoldenFile) {
  auto [file, make] = GetParam();
  std::string emitted = kernel_after_prelude(mt::emit_cuda(make()));
  std::filesystem::path path = std::filesystem::path(MIXTAPE_SOURCE_DIR) / "tests/golden" / file;
  const char* update = std::getenv("MIXTAPE_UPDATE_GOLDEN");
  if (update && std::string(update) == "1") {
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary) << emitted;
    std::printf("rewrote %s\n", path.c_str());
  }
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path << " is missing; create it with MIXTAPE_UPDATE_GOLDEN=1";
  std::stringstream golden;
  golden << in.rdbuf();
  if (emitted == golden.str()) return;
  // Name the first line that differs rather than print both sources.
  std::istringstream want(golden.str()), got(emitted);
  std::string want_line, got_line;
  int number = 0;
  while (true) {
    ++number;
    bool more_want = static_cast<bool>(std::getline(want, want_line));
    bool more_got = static_cast<bool>(std::getline(got, got_line));
    if (!more_want && !more_got) break;
    if (more_want != more_got || want_line != got_line) break;
  }
  ADD_FAILURE() << path << " differs from the emitted source at line " << number
                << ":\n  golden:  " << want_line << "\n  emitted: " << got_line
                << "\nIf the change is intended, rerun with MIXTAPE_UPDATE_GOLDEN=1 and review "
                   "the diff.";
}

TEST(Golden, AllGoldenKernelsCompileInOneProgram) {
  SKIP_WITHOUT_NVRTC();
  std::string source = mt::emit_cuda(bf16_broadcast_chain()) + mt::emit_cuda(row_max_and_sum()) +
                       mt::emit_cuda(half_accumulator_sum()) + mt::emit_cuda(scalar_sgd_step());
  source += mt::emit_cuda(two_inner_dims_sum()) + mt::emit_cuda(softmax_rows()) +
            mt::emit_cuda(multi_tensor_sgd_step()) + mt::emit_cuda(multi_tensor_inf_check()) +
            mt::emit_cuda(vector_f16_chain()) +
            mt::emit_cuda(vector_f16_chain({250}, "vector_f16_chain_with_tail")) +
            mt::emit_cuda(split_row_sum_and_max()) + mt::emit_cuda(column_sum_and_max());
  std::string ptx = mt::compile_cuda(source, "compute_90", "golden.cu");
  for (const char* name :
       {"golden_bf16_broadcast_chain", "golden_row_max_and_sum", "golden_half_accumulator_sum",
        "golden_scalar_sgd_step", "two_inner_dims_sum", "golden_softmax_rows",
        "golden_multi_tensor_sgd_step", "golden_multi_tensor_inf_check", "golden_vector_f16_chain",
        "vector_f16_chain_with_tail", "golden_split_row_sum_and_max", "golden_column_sum_and_max"})
    EXPECT_TRUE(has_kernel_entry(ptx, name)) << name;
  // The split reductions ask for their workspaces. Rows: 3 rows x 5 chunks of 4000, a block
  // each, with partial sums, maxima and their indices, 8 bytes each, then a 4-byte count per
  // row. Columns: one tile of 6 columns in 20 chunks of 1000 rows, a word per lane of each block
  // for sums and maxima, then one count.
  EXPECT_EQ(mt::cuda_launch_shape(split_row_sum_and_max()).workspace_bytes, 3 * 8 * 15 + 4 * 3);
  EXPECT_EQ(mt::cuda_launch_shape(split_row_sum_and_max()).grid, 15u);
  EXPECT_EQ(mt::cuda_launch_shape(column_sum_and_max()).workspace_bytes, 2 * 8 * 20 * 32 + 4);
  EXPECT_EQ(mt::cuda_launch_shape(column_sum_and_max()).grid, 20u);
  std::string ptxas = "/usr/local/cuda/bin/ptxas";
  if (std::filesystem::exists(ptxas)) {
    std::string ptx80 = mt::compile_cuda(source, "compute_80", "golden.cu");
    for (const char* target : {"sm_80", "sm_90"})
      EXPECT_EQ(run_ptxas(ptxas, ptx80, target, fmt::format("mixtape_golden_{}", ::getpid())), "")
          << target;
  }
  // Packs are single 16-byte (f32) and 8-byte (f16) accesses.
  std::string vector = mt::compile_cuda(mt::emit_cuda(vector_f16_chain()), "compute_90", "v.cu");
  EXPECT_NE(vector.find("ld.global.nc.v4.f32"), std::string::npos) << vector;
  EXPECT_NE(vector.find("st.global.v4.f32"), std::string::npos) << vector;
  EXPECT_NE(vector.find(".v4.u16"), std::string::npos) << vector;
  // The multi-tensor kernel's one argument is the whole table, as the executor fills it.
  EXPECT_NE(ptx.find(fmt::format("golden_multi_tensor_sgd_step_param_0[{}]",
                                 mt::cuda_multi_tensor_table_bytes)),
            std::string::npos);
  // IEEE arithmetic: nothing may be contracted into an FMA (the CPU rounds a*b and a*b+c apart).
  // libm bodies (tanhf, logf) use fma on purpose, so look at the SGD kernel alone.
  std::string sgd = mt::compile_cuda(mt::emit_cuda(scalar_sgd_step()), "compute_90", "sgd.cu");
  EXPECT_EQ(sgd.find("fma"), std::string::npos);
  EXPECT_NE(sgd.find("mul.rn.f32"), std::string::npos);
}

// The hand-written kernels (runtime/cuda_fixed_kernels.cpp) compile for both archs, and
// their PTX assembles: every entry the executor looks up is there.
TEST(Nvrtc, FixedKernelsCompile) {
  SKIP_WITHOUT_NVRTC();
  std::vector<std::string> names = {
      "mt_index_add",         "mt_random_fill",        "mt_convert",    "mt_conv2d",
      "mt_conv2d_input_grad", "mt_conv2d_weight_grad", "mt_max_pool2d", "mt_max_pool2d_grad"};
  for (int bytes : {1, 2, 4, 8}) {
    names.push_back(fmt::format("mt_copy_box_{}", bytes));
    names.push_back(fmt::format("mt_index_select_{}", bytes));
  }
  std::string ptxas = "/usr/local/cuda/bin/ptxas";
  if (!std::filesystem::exists(ptxas)) ptxas.clear();
  for (const char* arch : {"compute_80", "sm_80", "sm_90"})
    EXPECT_EQ(compile_job("fixed", mt::cuda_fixed_kernels_source(), names, arch, ptxas), "")
        << arch;
}

// Fused attention's modules, one per head dim (runtime/cuda_attention.h), compile to PTX that
// assembles (dim 128's only to PTX: its assembly alone takes longer than the rest of the suite).
TEST(Nvrtc, AttentionKernelsCompile) {
  SKIP_WITHOUT_NVRTC();
  std::string ptxas = "/usr/local/cuda/bin/ptxas";
  if (!std::filesystem::exists(ptxas)) ptxas.clear();
  for (int dim : {32, 64, 128}) {
    std::vector<std::string> names;
    for (const char* kernel : {"forward", "rows", "keys", "values"})
      names.push_back(fmt::format("mt_attention_{}_{}", kernel, dim));
    EXPECT_EQ(compile_job("attention", mt::cuda_attention_source(dim), names, "compute_80",
                          dim == 128 ? "" : ptxas),
              "")
        << dim;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, Golden,
    ::testing::Values(std::pair{"cuda_bf16_broadcast_chain.cu", &bf16_broadcast_chain},
                      std::pair{"cuda_row_max_and_sum.cu", &row_max_and_sum},
                      std::pair{"cuda_half_accumulator_sum.cu", &half_accumulator_sum},
                      std::pair{"cuda_scalar_sgd_step.cu", &scalar_sgd_step},
                      std::pair{"cuda_softmax_rows.cu", &softmax_rows},
                      std::pair{"cuda_multi_tensor_sgd_step.cu", &multi_tensor_sgd_step},
                      std::pair{"cuda_multi_tensor_inf_check.cu", &multi_tensor_inf_check},
                      std::pair{"cuda_split_row_sum_and_max.cu", &split_row_sum_and_max},
                      std::pair{"cuda_column_sum_and_max.cu", &column_sum_and_max},
                      std::pair{"cuda_vector_f16_chain.cu",
                                static_cast<kir::Kernel (*)()>(&vector_f16_chain)}),
    [](const auto& info) {
      std::string name = info.param.first;
      name = name.substr(5, name.size() - 8);
      return name;
    });

TEST(CudaLaunch, ShapesFollowTheKernel) {
  mt::CudaLaunch chain = mt::cuda_launch_shape(bf16_broadcast_chain());  // 32 points
  EXPECT_EQ(chain.grid, 1u);
  EXPECT_EQ(chain.block, 32u);
  mt::CudaLaunch rows = mt::cuda_launch_shape(row_max_and_sum());  // a block of 128 per row
  EXPECT_EQ(rows.grid, 6u);
  EXPECT_EQ(rows.block, 128u);
  mt::CudaLaunch half = mt::cuda_launch_shape(half_accumulator_sum());  // a thread per column
  EXPECT_EQ(half.grid, 1u);
  EXPECT_EQ(half.block, 32u);
  kir::Kernel big = scalar_sgd_step();
  big.dims = {1 << 24};
  mt::CudaLaunch wide = mt::cuda_launch_shape(big);
  EXPECT_EQ(wide.block, 256u);
  EXPECT_EQ(wide.grid, 8192u);  // grid-stride beyond that
  EXPECT_EQ(wide.shared_bytes, 0u);
  // Multi-tensor: 8-byte words for count and starts, then 4 pointers and 1 scalar per segment.
  kir::Kernel sgd = multi_tensor_sgd_step();
  int64_t capacity = mt::cuda_multi_tensor_capacity(sgd);
  EXPECT_EQ(capacity, (4096 / 8 - 2) / 6);
  EXPECT_LE(8 * (2 + capacity * 6), mt::cuda_multi_tensor_table_bytes);
  EXPECT_EQ(mt::cuda_launch_shape(sgd).block, 256u);
  auto pointwise_grid = [&](int64_t largest) {
    mt::CudaSegmentTable table;
    table.segments = 9;
    table.largest = largest;
    return mt::cuda_multi_tensor_launch(sgd, table).grid;
  };
  EXPECT_EQ(pointwise_grid(1), 1u);
  EXPECT_EQ(pointwise_grid(257), 2u);
  EXPECT_EQ(pointwise_grid(int64_t{1} << 30), 8192u);
  // Vectorized: 4 points a thread (f32 packs of 16 bytes), so 63 threads for [6, 42].
  mt::CudaLaunch packed = mt::cuda_launch_shape(vector_f16_chain());
  EXPECT_EQ(packed.grid, 1u);
  EXPECT_EQ(packed.block, 64u);
  // A reduction: blocks of 256, one per 32768 elements of a segment (at least one), numbered
  // in first_block (after count and starts); its workspace a word per block and a count per
  // segment. 2 params, no scalars: 3 words a segment.
  kir::Kernel check = multi_tensor_inf_check();
  int64_t check_capacity = mt::cuda_multi_tensor_capacity(check);
  EXPECT_EQ(check_capacity, (4096 / 8 - 3) / 4);
  std::vector<int64_t> starts = {0};
  for (int64_t extent : {int64_t{1}, int64_t{32768}, int64_t{32769}, int64_t{1} << 20, int64_t{0}})
    starts.push_back(starts.back() + extent);
  std::vector<uint64_t> pointers(10, 0);
  std::vector<mt::CudaSegmentTable> tables =
      mt::cuda_multi_tensor_tables(check, starts, pointers, {});
  ASSERT_EQ(tables.size(), 1u);
  EXPECT_EQ(tables[0].blocks, 1 + 1 + 2 + 32 + 1);
  const uint64_t* first_block = tables[0].words.data() + 1 + check_capacity + 1;
  EXPECT_EQ(std::vector<uint64_t>(first_block, first_block + 6),
            (std::vector<uint64_t>{0, 1, 2, 4, 36, 37}));
  mt::CudaLaunch reduction = mt::cuda_multi_tensor_launch(check, tables[0]);
  EXPECT_EQ(reduction.grid, 37u);
  EXPECT_EQ(reduction.block, 256u);
  EXPECT_EQ(reduction.workspace_bytes, 8u * 37 + 4 * 5);
  // Reductions with no outer points (a sum over the rows of a [0, 20000] tensor) are neither
  // split nor tiled: one block with nothing to do, no workspace.
  for (bool row : {true, false}) {
    kir::Kernel none = sum_and_max(row);
    none.dims[0] = 0;
    mt::CudaLaunch shape = mt::cuda_launch_shape(none);
    EXPECT_EQ(shape.grid, 1u) << row;
    EXPECT_EQ(shape.workspace_bytes, 0u) << row;
    EXPECT_NE(mt::emit_cuda(none).find("outer_total = 0"), std::string::npos) << row;
  }
  // No launch has more than 65535 blocks: segments of 2^30 take 32768 each, one a table.
  std::vector<int64_t> huge = {0, int64_t{1} << 30, int64_t{2} << 30, int64_t{3} << 30};
  tables = mt::cuda_multi_tensor_tables(check, huge, std::vector<uint64_t>(6, 0), {});
  ASSERT_EQ(tables.size(), 3u);
  for (const mt::CudaSegmentTable& table : tables) EXPECT_EQ(table.blocks, 32768);
}

// The device's arch when NVRTC has it, else PTX for the newest older one (a GPU newer than the
// toolkit), and a clear error for a GPU older than all of them.
TEST(Nvrtc, TargetFallsBackToPtxForAnUnknownNewerGpu) {
  SKIP_WITHOUT_NVRTC();
  std::vector<int> archs = mt::nvrtc_supported_archs();
  ASSERT_FALSE(archs.empty()) << "NVRTC " << mt::nvrtc_version() << " lists no archs";
  EXPECT_TRUE(std::is_sorted(archs.begin(), archs.end()));
  EXPECT_EQ(std::count(archs.begin(), archs.end(), 90), 1);
  EXPECT_EQ(mt::nvrtc_target(90), "sm_90");
  EXPECT_EQ(mt::nvrtc_target(archs.back() + 1), fmt::format("compute_{}", archs.back()));
  if (archs.front() > 10) {
    EXPECT_MT_ERROR(mt::nvrtc_target(10), "does not compile for sm_10",
                    fmt::format("sm_{}", archs.front()));
  }
  std::string ptx = mt::compile_cuda(mt::emit_cuda(bf16_broadcast_chain()),
                                     mt::nvrtc_target(archs.back() + 1), "future.cu");
  EXPECT_TRUE(has_kernel_entry(ptx, "golden_bf16_broadcast_chain"));
}

// ---- errors and the cache ----

TEST(Nvrtc, CompileErrorCarriesNvrtcsLog) {
  SKIP_WITHOUT_NVRTC();
  std::string bad =
      "extern \"C\" __global__ void broken(float* p) { p[0] = undeclared_value_xyz; }\n";
  EXPECT_MT_ERROR(mt::compile_cuda(bad, "sm_90", "broken.cu"), "NVRTC", "broken.cu", "sm_90",
                  "undeclared_value_xyz", "undefined");
  EXPECT_MT_ERROR(mt::compile_cuda(bad, "gfx90a"), "gfx90a", "sm_NN");
}

TEST(Nvrtc, SameSourceCompilesOnceThroughTheKernelCache) {
  SKIP_WITHOUT_NVRTC();
  // A source no earlier run has cached: the first call must compile.
  std::string source = fmt::format("// {} {}\n", ::getpid(),
                                   std::chrono::steady_clock::now().time_since_epoch().count()) +
                       mt::emit_cuda(bf16_broadcast_chain());
  mt::NvrtcStats before = mt::nvrtc_stats();
  std::string first = mt::compile_cuda(source, "compute_80");
  mt::NvrtcStats middle = mt::nvrtc_stats();
  EXPECT_EQ(middle.compiled, before.compiled + 1);
  std::string second = mt::compile_cuda(source, "compute_80");
  mt::NvrtcStats after = mt::nvrtc_stats();
  EXPECT_EQ(after.compiled, middle.compiled);
  EXPECT_EQ(after.cache_hits, middle.cache_hits + 1);
  EXPECT_EQ(first, second);
  // Another arch is another object.
  mt::compile_cuda(source, "compute_90");
  EXPECT_EQ(mt::nvrtc_stats().compiled, after.compiled + 1);
  // A fresh process finds it on disk.
  if (mt::kernel_cache().disk_enabled()) {
    mt::kernel_cache().clear_memory();
    int64_t disk_hits = mt::kernel_cache().stats().disk_hits;
    EXPECT_EQ(mt::compile_cuda(source, "compute_80"), first);
    EXPECT_EQ(mt::kernel_cache().stats().disk_hits, disk_hits + 1);
    EXPECT_EQ(mt::nvrtc_stats().compiled, after.compiled + 1);
  }
}

TEST(Nvrtc, VersionIsReported) {
  SKIP_WITHOUT_NVRTC();
  std::string version = mt::nvrtc_version();
  EXPECT_NE(version.find('.'), std::string::npos) << version;
  EXPECT_GE(std::atoi(version.c_str()), 11);
}

}  // namespace
