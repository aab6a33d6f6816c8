// tests/test_cuda_on_host.cpp -- CUDA kernels run without a GPU: every kernel the CPU back end
// launches for a few programs is printed by emit_cuda and compiled as host C++ (CUDA's
// intrinsics as the IEEE operations they are; blocks one after another, a block that uses
// barriers or warp shuffles as one std::thread per CUDA thread). Pointwise kernels must store
// the CPU back end's bits, reductions its values up to the order of their sums; the fixed
// kernels (runtime/cuda_fixed_kernels.cpp) the reference's bits.
//
// This checks what the emitters decide (indexing, packs and their tails, segment tables, the
// block and warp trees, passes, conversions and rounding) on every machine; tests/gpu/ checks
// the same kernels on a GPU.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "mixtape/codegen/emit_cuda.h"
#include "mixtape/dsl/attention.h"
#include "mixtape/dsl/conv.h"
#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/optim.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/dsl/vision.h"
#include "mixtape/precision_policy/policy.h"
#include "mixtape/runtime/all_reduce.h"
#include "mixtape/runtime/cpu_executor.h"
#include "mixtape/runtime/cuda_attention.h"
#include "mixtape/runtime/cuda_fixed_kernels.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/movement_plan.h"
#include "mixtape/runtime/program.h"
#include "mixtape/runtime/random_fill.h"
#include "mixtape/runtime/reference_executor.h"

namespace mt = mixtape;
namespace kir = mixtape::kir;
namespace fs = std::filesystem;

namespace {

// CUDA's keywords, thread indices and intrinsics for a host compiler. The prelude's two f16
// conversions are inline PTX; they become dsl/half.h's exact conversions (both round to nearest
// even and keep subnormals).
constexpr const char* shim = R"(#include <barrier>
#include <cmath>
#include <memory>
#include <thread>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
#include "mixtape/dsl/half.h"
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(n)
#define __shared__ static  // blocks run one at a time, so a static is one block's memory
struct mt_dim3 { unsigned x = 0; };
static mt_dim3 blockIdx, blockDim, gridDim;
static thread_local mt_dim3 threadIdx;
// A block that cooperates (barriers, shuffles) runs as one std::thread per CUDA thread.
static std::barrier<>* mt_block_barrier = nullptr;
static std::vector<std::unique_ptr<std::barrier<>>> mt_warp_barriers;
static unsigned char mt_lanes[8][32][8];
static void __syncthreads() { mt_block_barrier->arrive_and_wait(); }
template <typename T> static T mt_exchange(T v, int from_lane) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  std::memcpy(mt_lanes[warp][lane], &v, sizeof(T));
  mt_warp_barriers[warp]->arrive_and_wait();
  T out = v;
  if (from_lane >= 0 && from_lane < 32) std::memcpy(&out, mt_lanes[warp][from_lane], sizeof(T));
  mt_warp_barriers[warp]->arrive_and_wait();
  return out;
}
template <typename T> static T __shfl_down_sync(unsigned, T v, int offset) {
  return mt_exchange(v, static_cast<int>(threadIdx.x % 32) + offset);
}
template <typename T> static T __shfl_sync(unsigned, T v, int lane) { return mt_exchange(v, lane); }
// Split reductions: blocks run one after another here, so the last block of an outer point to
// arrive is its last chunk, and every other block's partial is in memory before it.
static unsigned atomicAdd(unsigned* address, unsigned value) {
  unsigned old = *address;
  *address = old + value;
  return old;
}
static void __threadfence() {}
static void __syncwarp() { mt_warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }
template <typename T> static T __ldcg(const T* address) { return *address; }
template <typename F> static void mt_run_grid(unsigned grid, unsigned block, bool cooperative,
                                              F call) {
  gridDim.x = grid;
  blockDim.x = block;
  for (blockIdx.x = 0; blockIdx.x < grid; ++blockIdx.x) {
    if (!cooperative) {
      for (threadIdx.x = 0; threadIdx.x < block; ++threadIdx.x) call();
      continue;
    }
    std::barrier<> barrier(block);
    mt_block_barrier = &barrier;
    mt_warp_barriers.clear();
    for (unsigned w = 0; w < block / 32; ++w)
      mt_warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; ++t)
      threads.emplace_back([t, &call] {
        threadIdx.x = t;
        call();
      });
    for (std::thread& thread : threads) thread.join();
  }
}
template <typename T> static T mt_bits(const void* p) { T t; std::memcpy(&t, p, sizeof(T)); return t; }
static float __fadd_rn(float a, float b) { return a + b; }
static float __fsub_rn(float a, float b) { return a - b; }
static float __fmul_rn(float a, float b) { return a * b; }
static float __fdiv_rn(float a, float b) { return a / b; }
static float __fsqrt_rn(float a) { return std::sqrt(a); }
static double __dadd_rn(double a, double b) { return a + b; }
static double __dsub_rn(double a, double b) { return a - b; }
static double __dmul_rn(double a, double b) { return a * b; }
static double __ddiv_rn(double a, double b) { return a / b; }
static double __dsqrt_rn(double a) { return std::sqrt(a); }
static float __double2float_rn(double a) { return static_cast<float>(a); }
static float __ll2float_rn(long long a) { return static_cast<float>(a); }
static double __ll2double_rn(long long a) { return static_cast<double>(a); }
static float __uint_as_float(unsigned u) { return mt_bits<float>(&u); }
static unsigned __float_as_uint(float f) { return mt_bits<unsigned>(&f); }
static float __int_as_float(int i) { return mt_bits<float>(&i); }
static double __longlong_as_double(long long i) { return mt_bits<double>(&i); }
using std::signbit;
static std::vector<char> mt_read(const char* path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}
static void mt_write(const char* path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
)";

// The prelude with its inline-PTX f16 conversions replaced.
std::string host_prelude() {
  std::string prelude = mt::cuda_prelude();
  auto replace_function = [&](const std::string& signature, const std::string& body) {
    size_t at = prelude.find(signature);
    EXPECT_NE(at, std::string::npos) << signature;
    if (at == std::string::npos) return;
    size_t end = prelude.find("\n}\n", at);
    prelude.replace(at, end + 3 - at, signature + " " + body + "\n");
  };
  replace_function("static __device__ __forceinline__ float mt_f16_to_f32(unsigned short h) {",
                   "return mixtape::f16_bits_to_f32(h); }");
  replace_function("static __device__ __forceinline__ unsigned short mt_f32_to_f16(float f) {",
                   "return mixtape::f32_to_f16_bits(f); }");
  return prelude;
}

// One observed launch: the kernel, its inputs' bytes when it ran, its scalars, and the nodes
// whose values it stored (kept alive, and compared once the evaluation is done).
struct Launch {
  kir::Kernel kernel;
  std::vector<std::vector<char>> inputs;  // per param (empty for outputs), all segments
  std::vector<std::shared_ptr<const mt::Node>> nodes;
  std::vector<int64_t> counts;   // each node's elements
  std::vector<int64_t> extents;  // per segment
  std::vector<double> scalars;
};

std::vector<Launch> observe(const std::function<void()>& program) {
  std::vector<Launch> launches;
  mt::Device previous = mt::current_device();
  mt::set_device(mt::Device::cpu);
  mt::set_kernel_observer([&](const mt::LoweredKernel& lowered) {
    Launch launch{lowered.kernel, {}, {}, {}, {}, lowered.scalars};
    size_t per_segment = lowered.kernel.params.size();
    for (size_t i = 0; i < lowered.nodes.size(); ++i) {
      launch.nodes.push_back(lowered.nodes[i]->shared_from_this());
      launch.counts.push_back(lowered.nodes[i]->numel());
      // A segment's extent: its largest buffer (the others are 0-d, or a whole reduction's 0-d
      // result).
      if (lowered.kernel.multi_tensor) {
        size_t segment = i / per_segment;
        if (launch.extents.size() <= segment) launch.extents.push_back(0);
        launch.extents[segment] = std::max(launch.extents[segment], lowered.nodes[i]->numel());
      }
      const mt::kir::Param& param = lowered.kernel.params[i % per_segment];
      if (param.output) {
        launch.inputs.emplace_back();
        continue;
      }
      const mt::Storage& value = *lowered.nodes[i]->value;
      launch.inputs.emplace_back(
          reinterpret_cast<const char*>(value.host_data()),
          reinterpret_cast<const char*>(value.host_data()) + value.size_bytes());
    }
    launches.push_back(std::move(launch));
  });
  try {
    program();
  } catch (...) {
    mt::set_kernel_observer({});
    mt::set_device(previous);
    throw;
  }
  mt::set_kernel_observer({});
  mt::set_device(previous);
  return launches;
}

// What a multi-tensor table holds for buffer i's pointer until the host program swaps in the
// buffer's address (no start, pointer or scalar of these tests has this bit pattern).
constexpr uint64_t pointer_tag = 0xB0F0A5A5A5A50000ull;

// A double as a C++ expression of exactly its value (inf and NaN by their bits).
std::string double_literal(double value) {
  if (std::isfinite(value)) return fmt::format("{:a}", value);
  uint64_t bits;
  std::memcpy(&bits, &value, 8);
  return fmt::format("std::bit_cast<double>(0x{:016X}ULL)", bits);
}

// A split reduction's grid, run as `call`: its workspace (`workspace`, zero at first) must be
// zero again after each launch, so it runs twice on it, and the second run's results are the
// ones compared.
std::string launch_twice(const mt::CudaLaunch& shape, bool cooperative, const std::string& call) {
  std::string run = fmt::format("mt_run_grid({}, {}, {}, [&] {{ {}; }});", shape.grid, shape.block,
                                cooperative, call);
  return fmt::format(
      "    {}\n    {}\n"
      "    for (unsigned char byte : workspace)\n"
      "      if (byte != 0) {{ std::puts(\"{}: workspace not left zero\"); return 1; }}\n",
      run, run, call);
}

// The host driver of launch `k`: reads its inputs, runs its grid, writes its outputs.
std::string driver(const Launch& launch, size_t k, const fs::path& dir) {
  const kir::Kernel& kernel = launch.kernel;
  size_t per_segment = kernel.params.size();
  auto file = [&](size_t i, const char* kind) {
    return (dir / fmt::format("k{}_{}.{}", k, i, kind)).string();
  };
  std::string out = "  {\n";
  for (size_t i = 0; i < launch.nodes.size(); ++i) {
    const kir::Param& param = kernel.params[i % per_segment];
    if (param.output)
      out += fmt::format("    std::vector<char> b{}({});\n", i,
                         launch.counts[i] * static_cast<int64_t>(mt::size_of(param.dtype)));
    else
      out += fmt::format("    std::vector<char> b{} = mt_read(\"{}\");\n", i, file(i, "in"));
  }
  auto pointer = [&](size_t i) {
    const kir::Param& param = kernel.params[i % per_segment];
    return fmt::format("reinterpret_cast<{}{}*>(b{}.data())", param.output ? "" : "const ",
                       mt::cuda_element_type(param.dtype), i);
  };
  std::string source = mt::emit_cuda(kernel);
  bool cooperative = source.find("__shfl") != std::string::npos ||
                     source.find("__syncthreads") != std::string::npos;
  if (kernel.multi_tensor) {
    // The executor's own tables (cuda_multi_tensor_tables), with buffer i's pointer as the
    // placeholder pointer_tag | i, which the program swaps for the buffer's address.
    std::vector<int64_t> starts = {0};
    for (int64_t extent : launch.extents) starts.push_back(starts.back() + extent);
    std::vector<uint64_t> placeholders;
    for (size_t i = 0; i < launch.nodes.size(); ++i) placeholders.push_back(pointer_tag | i);
    out += "    std::vector<char*> buffers = {";
    for (size_t i = 0; i < launch.nodes.size(); ++i)
      out += fmt::format("{}b{}.data()", i ? ", " : "", i);
    out += "};\n";
    for (const mt::CudaSegmentTable& table :
         mt::cuda_multi_tensor_tables(kernel, starts, placeholders, launch.scalars)) {
      if (table.largest == 0 && !kernel.is_reduction()) continue;
      mt::CudaLaunch shape = mt::cuda_multi_tensor_launch(kernel, table);
      out += fmt::format("    {{\n      std::vector<unsigned long long> words = {{{}ull}};\n",
                         fmt::join(table.words, "ull, "));
      out += fmt::format(
          "      for (unsigned long long& w : words)\n"
          "        if ((w & ~0xFFFFull) == {}ull)\n"
          "          w = reinterpret_cast<unsigned long long>(buffers[w & 0xFFFF]);\n"
          "      {}_segments table;\n"
          "      static_assert(sizeof(table) <= {});\n"
          "      std::memcpy(&table, words.data(), sizeof(table));\n",
          pointer_tag, kernel.name, mt::cuda_multi_tensor_table_bytes);
      if (!kernel.is_reduction()) {
        out += fmt::format("      mt_run_grid({}, {}, {}, [&] {{ {}(table); }});\n    }}\n",
                           shape.grid, shape.block, cooperative, kernel.name);
        continue;
      }
      out +=
          fmt::format("      std::vector<unsigned char> workspace({});\n", shape.workspace_bytes);
      out += launch_twice(shape, cooperative, kernel.name + "(table, workspace.data())");
      out += "    }\n";
    }
  } else {
    mt::CudaLaunch shape = mt::cuda_launch_shape(kernel);
    std::vector<std::string> args;
    for (size_t i = 0; i < launch.nodes.size(); ++i) args.push_back(pointer(i));
    for (double scalar : launch.scalars) args.push_back(double_literal(scalar));
    if (shape.workspace_bytes == 0) {
      out += fmt::format("    mt_run_grid({}, {}, {}, [&] {{ {}({}); }});\n", shape.grid,
                         shape.block, cooperative, kernel.name, fmt::join(args, ", "));
    } else {
      out += fmt::format("    std::vector<unsigned char> workspace({});\n", shape.workspace_bytes);
      args.push_back("workspace.data()");
      out += launch_twice(shape, cooperative,
                          fmt::format("{}({})", kernel.name, fmt::join(args, ", ")));
    }
  }
  for (size_t i = 0; i < launch.nodes.size(); ++i)
    if (kernel.params[i % per_segment].output)
      out += fmt::format("    mt_write(\"{}\", b{});\n", file(i, "out"), i);
  return out + "  }\n";
}

// Where a reduction kernel's output `got` is further from the CPU's than the sums' order
// explains (a few units of the stored type's last place, relative to the larger), or "".
std::string first_difference(const std::vector<char>& got, const mt::Storage& want, double ulps) {
  if (got.size() != static_cast<size_t>(want.size_bytes()))
    return fmt::format("{} bytes vs {}", got.size(), want.size_bytes());
  mt::Storage actual(want.dtype, want.count);
  std::memcpy(actual.host_data(), got.data(), got.size());
  double ulp = want.dtype == mt::f16    ? 0x1p-10
               : want.dtype == mt::bf16 ? 0x1p-7
               : want.dtype == mt::f64  ? 0x1p-52
                                        : 0x1p-23;
  for (int64_t i = 0; i < want.count; ++i) {
    double a = mt::load_element<double>(actual, i), e = mt::load_element<double>(want, i);
    if (a == e || (std::isnan(a) && std::isnan(e))) continue;
    // f32 layer_norm divides differences of a mean-centred row: an absolute term covers them.
    if (std::fabs(a - e) <= ulps * ulp * std::max(std::fabs(a), std::fabs(e)) + 1e-5) continue;
    return fmt::format("element {}: {} on the host-run CUDA, {} on the CPU", i, a, e);
  }
  return "";
}

// The fixed kernels' CUDA with the host prelude in place of the device one.
std::string fixed_kernels_on_host() {
  return host_prelude() +
         mt::cuda_fixed_kernels_source().substr(std::string(mt::cuda_prelude()).size());
}

// What a host-run program wrote to `path`.
std::vector<char> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

std::vector<char> bytes_of(const mt::Storage& storage) {
  const char* data = reinterpret_cast<const char*>(storage.host_data());
  return std::vector<char>(data, data + storage.size_bytes());
}

// Builds `program` (host C++ holding CUDA kernels, with the shim) in `dir` and runs it.
bool compile_and_run(const fs::path& dir, const std::string& program, const std::string& what) {
  std::ofstream(dir / "kernels.cpp") << program;
  std::string command = fmt::format(
      "c++ -std=c++20 -O0 -ffp-contract=off -w -I'{}' '{}' -o '{}' > '{}' 2>&1", MIXTAPE_SOURCE_DIR,
      (dir / "kernels.cpp").string(), (dir / "kernels").string(), (dir / "log.txt").string());
  if (std::system(command.c_str()) != 0) {
    std::ifstream log(dir / "log.txt");
    std::string text((std::istreambuf_iterator<char>(log)), {});
    ADD_FAILURE() << what << ": the CUDA does not compile as host C++ (" << dir
                  << "/kernels.cpp):\n"
                  << text.substr(0, 4000);
    return false;
  }
  int status = std::system((dir / "kernels").string().c_str());
  EXPECT_EQ(status, 0) << what;
  return status == 0;
}

// Runs `calls` (fixed-kernel calls that leave output o in the vector out<o>) as a host program in
// a fresh folder named for `what`, and expects output o to hold `outs[o]`'s bytes.
void expect_fixed_kernel_outputs(const std::string& calls, const std::vector<mt::Tensor>& outs,
                                 const std::string& what) {
  fs::path dir = fs::temp_directory_path() / fmt::format("mixtape_cuda_{}_{}", what, ::getpid());
  fs::create_directories(dir);
  std::string main_text = "int main() {\n" + calls;
  for (size_t o = 0; o < outs.size(); ++o)
    main_text +=
        fmt::format("  mt_write(\"{}\", out{});\n", (dir / fmt::format("out{}", o)).string(), o);
  main_text += "}\n";
  ASSERT_TRUE(compile_and_run(dir, std::string(shim) + fixed_kernels_on_host() + main_text, what));
  for (size_t o = 0; o < outs.size(); ++o)
    EXPECT_EQ(read_bytes(dir / fmt::format("out{}", o)), bytes_of(*outs[o].node()->value))
        << what << " output " << o;
  fs::remove_all(dir);
}

// Runs every observed launch's CUDA on the host and compares what each stored with the CPU
// back end's value of that node; returns how many were compared.
// Reductions may differ by `ulps` of the stored type (4: sums of a few hundred terms).
int64_t check_on_host(const std::vector<Launch>& launches, const std::string& what,
                      double ulps = 4) {
  fs::path dir = fs::temp_directory_path() / fmt::format("mixtape_cuda_host_{}", ::getpid());
  fs::create_directories(dir);
  std::string source = std::string(shim) + host_prelude();
  std::string main_text = "int main() {\n";
  std::set<std::string> defined;
  for (size_t k = 0; k < launches.size(); ++k) {
    const Launch& launch = launches[k];
    if (defined.insert(launch.kernel.name).second) {
      const std::string prelude_end = "#endif  // MIXTAPE_CUDA_PRELUDE_V1\n";
      std::string kernel = mt::emit_cuda(launch.kernel);
      source += kernel.substr(kernel.find(prelude_end) + prelude_end.size());
    }
    for (size_t i = 0; i < launch.inputs.size(); ++i)
      if (!launch.kernel.params[i % launch.kernel.params.size()].output)
        std::ofstream(dir / fmt::format("k{}_{}.in", k, i), std::ios::binary)
            .write(launch.inputs[i].data(), static_cast<std::streamsize>(launch.inputs[i].size()));
    main_text += driver(launch, k, dir);
  }
  if (!compile_and_run(dir, source + main_text + "}\n", what)) return 0;
  int64_t compared = 0;
  for (size_t k = 0; k < launches.size(); ++k) {
    const Launch& launch = launches[k];
    size_t per_segment = launch.kernel.params.size();
    for (size_t i = 0; i < launch.nodes.size(); ++i) {
      if (!launch.kernel.params[i % per_segment].output) continue;
      const mt::Node& node = *launch.nodes[i];
      if (!node.value) continue;  // released after its last reader
      std::vector<char> got = read_bytes(dir / fmt::format("k{}_{}.out", k, i));
      std::vector<char> want = bytes_of(*node.value);
      std::string where = fmt::format("{}: kernel {} param {} (segment {})", what,
                                      launch.kernel.name, i % per_segment, i / per_segment);
      if (launch.kernel.is_reduction())  // CUDA sums in another order than the CPU
        EXPECT_EQ(first_difference(got, *node.value, ulps), "") << where;
      else
        EXPECT_EQ(got, want) << where << "\n" << mt::emit_cuda(launch.kernel);
      ++compared;
    }
  }
  fs::remove_all(dir);
  return compared;
}

mt::Tensor values(mt::Shape shape, mt::DType dtype, uint64_t seed) {
  mt::Generator gen(seed);
  mt::Tensor x = mt::cast(mt::randn(shape, mt::f32, &gen) * 3.0, dtype);
  mt::eval({x});
  return x;
}

// Pointwise chains in every float dtype: whole-tensor (packed, with a tail: 1001 is odd) and
// broadcast (scalar code), activations, comparisons, where, casts to integers and bool.
TEST(CudaOnHost, PointwiseKernelsStoreTheCpusBits) {
  for (mt::DType dtype : {mt::f32, mt::f16, mt::bf16, mt::f64}) {
    std::vector<mt::Tensor> outs;
    auto launches = observe([&] {
      mt::Tensor x = values({7, 143}, dtype, 1), y = values({7, 143}, dtype, 2);
      mt::Tensor row = values({143}, dtype, 3);
      outs = {mt::gelu(x) * y + 0.5,
              mt::where(x > y, mt::exp(x), mt::tanh(y)),
              mt::sigmoid(x + row),
              mt::cast(mt::relu(x) * 4.0, mt::i32),
              mt::cast(mt::abs(y) < 1.0, mt::f32),
              mt::erf(mt::reshape(x, {1001})) / 3.0};
      mt::eval(outs);
    });
    EXPECT_GE(launches.size(), 3u);
    EXPECT_GE(check_on_host(launches, std::string(mt::name(dtype))), 6) << mt::name(dtype);
  }
}

// Reductions as CUDA runs them, each block's threads together: row statistics a block per row
// (softmax, log_softmax and layer_norm are multi-pass kernels, their passes' results shared
// through shared memory), short rows a thread per row, column sums (short columns a thread per
// column; 600 rows of 40 columns in tiles of 32, the second tile part idle), whole-tensor sums
// and max with NaN, and independent whole sums as one multi-tensor reduction.
TEST(CudaOnHost, ReductionKernelsMatchTheCpu) {
  for (mt::DType dtype : {mt::f32, mt::bf16, mt::f16}) {
    int64_t multi_pass = 0, multi_tensor = 0;
    auto launches = observe([&] {
      mt::Tensor x = values({12, 300}, dtype, 5), w = values({300}, dtype, 6);
      mt::Tensor b = values({300}, dtype, 7), shortrows = values({40, 20}, dtype, 8);
      // Whole numbers, so that its column sums are exact in any order.
      mt::Tensor tall = mt::cast(mt::cast(values({600, 40}, dtype, 15), mt::i32), dtype);
      mt::Tensor with_nan = mt::where(x > 5.0, mt::full({}, NAN, dtype), x);
      std::vector<mt::Tensor> outs = {mt::softmax(x),
                                      mt::log_softmax(shortrows),
                                      mt::layer_norm(x, w, b),
                                      mt::sum(x, {0}),
                                      mt::max(with_nan, {1}),
                                      mt::mean(x * x),
                                      mt::max(x),
                                      mt::sum(w * w),
                                      mt::sum(b * b),
                                      mt::sum(tall, {0})};
      mt::eval(outs);
    });
    for (const Launch& launch : launches) {
      multi_pass += launch.kernel.pass_count() > 1;
      multi_tensor += launch.kernel.multi_tensor && launch.kernel.is_reduction();
    }
    EXPECT_GE(multi_pass, 2) << mt::name(dtype);
    EXPECT_GE(multi_tensor, 1) << mt::name(dtype);
    EXPECT_GE(check_on_host(launches, std::string(mt::name(dtype))), 10) << mt::name(dtype);
  }
}

// Reductions over few outer points and many inner ones, which CUDA splits across blocks (each
// block a chunk, the last to arrive folding the chunks' partials): whole-tensor sum and max
// (sharing a kernel, the max carrying its index through the NaN), column sums and maxima of a
// tall matrix, row means of a few long rows, and an integer count. The values are positive, so
// the two orders' sums differ by rounding alone: the CPU adds a column's 9000 terms one after
// another (an error of order sqrt(n) ulps, about 100 here), so 256 ulps (1.5e-5) are allowed,
// where a chunk lost or counted twice is a third of the sum. Multi-tensor steps are off so that
// the whole-tensor reductions run as the kernels they lower to.
TEST(CudaOnHost, SplitReductionsMatchTheCpu) {
  bool multi_tensor = mt::multi_tensor_steps();
  mt::set_multi_tensor_steps(false);
  for (mt::DType dtype : {mt::f32, mt::bf16}) {
    int64_t split = 0;
    auto launches = observe([&] {
      auto positive = [&](mt::Shape shape, uint64_t seed) {
        mt::Tensor v = mt::cast(mt::abs(values(shape, dtype, seed)) + 1.0, dtype);
        mt::eval({v});
        return v;
      };
      mt::Tensor x = positive({12000}, 9), tall = positive({8200, 6}, 10);
      mt::Tensor rows = positive({2, 8200}, 11);
      mt::Tensor with_nan = mt::where(x > 9.0, mt::full({}, NAN, dtype), x);
      std::vector<mt::Tensor> outs = {mt::sum(x * x),      mt::max(with_nan),
                                      mt::sum(tall, {0}),  mt::max(tall, {0}),
                                      mt::mean(rows, {1}), mt::sum(mt::cast(x > 3.0, mt::i32))};
      mt::eval(outs);
    });
    for (const Launch& launch : launches)
      split += mt::cuda_launch_shape(launch.kernel).workspace_bytes > 0;
    EXPECT_GE(split, 4) << mt::name(dtype);
    EXPECT_GE(check_on_host(launches, std::string(mt::name(dtype)), 256), 6) << mt::name(dtype);
  }
  mt::set_multi_tensor_steps(multi_tensor);
}

// Whole sums of several tensors as one multi-tensor reduction (the loss scaler's inf checks,
// clipping's squared norms): each segment takes a block per 32768 elements, the last of a
// segment's blocks folding their partials, so segments of 70000, 40000 and 5 elements take 3, 2
// and 1 blocks of one launch.
TEST(CudaOnHost, MultiTensorReductionsSplitLargeSegments) {
  for (mt::DType dtype : {mt::f32, mt::bf16}) {
    int64_t blocks = 0;
    auto launches = observe([&] {
      mt::Tensor a = values({70000}, dtype, 12), b = values({200, 200}, dtype, 13);
      mt::Tensor c = values({5}, dtype, 14);
      mt::eval({mt::sum(a - a), mt::sum(b - b), mt::sum(c - c), mt::sum(mt::abs(a)),
                mt::sum(mt::abs(b)), mt::sum(mt::abs(c))});
    });
    for (const Launch& launch : launches) {
      if (!launch.kernel.multi_tensor || !launch.kernel.is_reduction()) continue;
      std::vector<int64_t> starts = {0};
      for (int64_t extent : launch.extents) starts.push_back(starts.back() + extent);
      std::vector<uint64_t> pointers(launch.nodes.size(), 0);
      for (const mt::CudaSegmentTable& table :
           mt::cuda_multi_tensor_tables(launch.kernel, starts, pointers, launch.scalars))
        blocks += table.blocks;
    }
    EXPECT_EQ(blocks, 2 * (3 + 2 + 1)) << mt::name(dtype);
    EXPECT_GE(check_on_host(launches, std::string(mt::name(dtype)), 16), 6) << mt::name(dtype);
  }
}

// An optimizer's updates as multi-tensor kernels: 45 parameters of different sizes (some under
// one pack), AdamW with a learning rate in a scalar slot: more segments than one launch's table
// holds, so the tables the executor builds are launched in chunks.
TEST(CudaOnHost, MultiTensorUpdatesStoreTheCpusBits) {
  std::vector<mt::Tensor> params;
  const int64_t sizes[] = {3, 64, 1000, 5, 257};
  for (int i = 0; i < 45; ++i) {
    int64_t n = sizes[i % 5];
    params.push_back(
        mt::tensor(values({n}, mt::f32, 100 + i).to_vector<float>(), {n}).requires_grad_());
  }
  mt::AdamW optimizer(params, mt::AdamOptions{.lr = 1e-2, .weight_decay = 0.1});
  int64_t multi_tensor = 0, compared = 0, chunked = 0;
  for (int step = 0; step < 2; ++step) {
    auto launches = observe([&] {
      optimizer.zero_grad();
      mt::Tensor loss = mt::sum(params[0] * params[0]);
      for (size_t i = 1; i < params.size(); ++i) loss = loss + mt::sum(params[i] * params[i]);
      loss.backward();
      optimizer.step();
      mt::eval(params);
      for (size_t i = 0; i < params.size(); ++i)
        for (const auto& [name, state] : optimizer.state(i)) mt::eval({state});
    });
    for (const Launch& launch : launches) {
      multi_tensor += launch.kernel.multi_tensor;
      if (launch.kernel.multi_tensor && static_cast<int64_t>(launch.extents.size()) >
                                            mt::cuda_multi_tensor_capacity(launch.kernel))
        ++chunked;
    }
    compared += check_on_host(launches, fmt::format("AdamW step {}", step));
  }
  EXPECT_GT(multi_tensor, 0);
  EXPECT_GT(chunked, 0);
  EXPECT_GE(compared, 90);
}

// ---- the fixed kernels (runtime/cuda_fixed_kernels.cpp) against the reference executor.

// Bytes as a C++ initializer of the program (small test tensors, kernel arguments).
std::string bytes_literal(const void* data, size_t size) {
  std::string text = "{";
  for (size_t i = 0; i < size; ++i)
    text += fmt::format("{}{}", i ? "," : "", static_cast<const unsigned char*>(data)[i]);
  return text + "}";
}
std::string bytes_literal(const mt::Storage& value) {
  return bytes_literal(value.host_data(), static_cast<size_t>(value.size_bytes()));
}

std::string grid_call(int64_t elements, const std::string& call) {
  int64_t grid = std::clamp<int64_t>((elements + 255) / 256, 1, 8192);
  return fmt::format("  mt_run_grid({}, 256, false, [&] {{ {}; }});\n", grid, call);
}

std::string box_literal(const mt::CopyBox& box) {
  std::vector<int64_t> shape = box.shape, src = box.src_stride, dst = box.dst_stride;
  shape.resize(8, 0);
  src.resize(8, 0);
  dst.resize(8, 0);
  return fmt::format("mt_box{{{}, {}, {}, {}, {{{}}}, {{{}}}, {{{}}}}}", box.count(), box.src_base,
                     box.dst_base, box.shape.size(), fmt::join(shape, ","), fmt::join(src, ","),
                     fmt::join(dst, ","));
}

// Concat and unslice (box copies), index_select and index_add (with its plan), computed by the
// fixed kernels from the reference's inputs, and random fills: the reference's bytes.
TEST(CudaOnHost, FixedKernelsStoreTheReferencesBits) {
  mt::Device previous = mt::current_device();
  mt::set_device(mt::Device::reference);
  mt::Tensor a = values({4, 5, 6}, mt::f16, 1), b = values({4, 3, 6}, mt::f16, 2);
  mt::Tensor table = values({11, 6}, mt::f32, 3), grad = values({9, 6}, mt::f16, 4);
  mt::Tensor index = mt::tensor(std::vector<int64_t>{3, 0, 3, 10, 3, 7, 0, 2, 9}, {9});
  mt::Tensor start = mt::cast(table, mt::bf16);
  mt::eval({index, start});
  mt::Tensor joined = mt::concat({a, b, a}, 1);
  mt::Tensor placed = mt::unslice(b, {1, 0, 2}, {2, 2, 1}, {9, 6, 9});
  mt::Tensor rows = mt::index_select(table, index);
  mt::Tensor summed = mt::index_add(start, index, grad);
  std::vector<mt::Tensor> outs = {joined, placed, rows, summed};
  // The plans come from the pending nodes, as the CUDA executor makes them.
  std::vector<mt::CopyBox> concat = mt::concat_boxes(*joined.node());
  mt::CopyBox window = mt::unslice_box(*placed.node());
  mt::IndexAddPlan plan = mt::index_add_plan(mt::checked_indices(*summed.node()), 11);
  mt::eval(outs);
  const mt::Storage& base = *start.node()->value;
  mt::set_device(previous);

  std::string main_text = "int main() {\n";
  auto buffer = [&](const char* name, const mt::Storage& value) {
    main_text += fmt::format("  std::vector<char> {} = {};\n", name, bytes_literal(value));
  };
  buffer("a", *a.node()->value);
  buffer("b", *b.node()->value);
  buffer("table", *table.node()->value);
  buffer("grad", *grad.node()->value);
  buffer("base", base);
  std::vector<std::string> names = {"joined", "placed", "rows", "summed"};
  for (size_t o = 0; o < outs.size(); ++o)
    main_text +=
        fmt::format("  std::vector<char> {}({});\n", names[o], outs[o].node()->value->size_bytes());
  // concat: each input's box; unslice: zeros, then the window's box.
  const char* concat_inputs[] = {"a", "b", "a"};
  for (size_t i = 0; i < concat.size(); ++i)
    main_text += grid_call(concat[i].count(),
                           fmt::format("mt_copy_box_2(reinterpret_cast<const unsigned short*>({}"
                                       ".data()), reinterpret_cast<unsigned short*>(joined.data()),"
                                       " {})",
                                       concat_inputs[i], box_literal(concat[i])));
  main_text += grid_call(window.count(),
                         fmt::format("mt_copy_box_2(reinterpret_cast<const unsigned short*>(b."
                                     "data()), reinterpret_cast<unsigned short*>(placed.data()), "
                                     "{})",
                                     box_literal(window)));
  main_text += fmt::format("  std::vector<long long> index = {{{}}};\n",
                           fmt::join(index.to_vector<int64_t>(), ","));
  main_text += grid_call(rows.numel(),
                         "mt_index_select_4(reinterpret_cast<const unsigned*>(table.data()), "
                         "index.data(), reinterpret_cast<unsigned*>(rows.data()), 54, 9, 11, 6)");
  main_text += fmt::format("  std::vector<long long> offsets = {{{}}}, order = {{{}}};\n",
                           fmt::join(plan.offsets, ","), fmt::join(plan.order, ","));
  main_text += grid_call(
      summed.numel(),
      fmt::format("mt_index_add(base.data(), {}, grad.data(), {}, offsets.data(), order.data(), "
                  "summed.data(), {}, 66, 9, 11, 6)",
                  static_cast<int>(base.dtype), static_cast<int>(grad.node()->value->dtype),
                  static_cast<int>(summed.node()->precision.storage_type)));
  // rand in bf16 and randn in f16, 1001 elements (a partial last block) whose Philox counters
  // cross 2^32: fill_* on the host.
  std::vector<std::unique_ptr<mt::Storage>> draws;
  for (int normal : {0, 1}) {
    mt::DType dtype = normal ? mt::f16 : mt::bf16;
    draws.push_back(std::make_unique<mt::Storage>(dtype, 1001));
    (normal ? mt::fill_normal : mt::fill_uniform)(*draws.back(), 77, 0xFFFFFFF0u);
    std::string name = fmt::format("draw{}", normal);
    names.push_back(name);
    main_text += fmt::format("  std::vector<char> {}(2002);\n", name);
    // The offset is the generator's, read from device memory.
    main_text += fmt::format("  unsigned long long {}_offset = 0xFFFFFFF0ull;\n", name);
    main_text +=
        grid_call(251, fmt::format("mt_random_fill({}.data(), {}, {}, 1001, 77, &{}_offset)", name,
                                   static_cast<int>(dtype), normal, name));
  }
  fs::path dir = fs::temp_directory_path() / fmt::format("mixtape_cuda_fixed_{}", ::getpid());
  fs::create_directories(dir);
  for (const std::string& name : names)
    main_text += fmt::format("  mt_write(\"{}\", {});\n", (dir / (name + ".out")).string(), name);
  main_text += "}\n";
  ASSERT_TRUE(compile_and_run(dir, std::string(shim) + fixed_kernels_on_host() + main_text,
                              "fixed kernels"));
  for (size_t o = 0; o < names.size(); ++o) {
    const mt::Storage& want = o < outs.size() ? *outs[o].node()->value : *draws[o - outs.size()];
    EXPECT_EQ(read_bytes(dir / (names[o] + ".out")), bytes_of(want)) << names[o];
  }
  fs::remove_all(dir);
}

// The rank-order sum of the collectives on the GPU (mt_rank_order_sum,
// runtime/cuda_collectives.cpp) stores the host path's bits (runtime/all_reduce.cpp), which every
// process of a run adds alike: 3 pieces of 1001 elements (a partial last block), in every dtype and
// accumulator, values of mixed magnitudes so that another order or accumulator would round
// otherwise; and f32 against a plain left-to-right f32 loop.
TEST(CudaOnHost, RankOrderSumStoresTheHostPathsBits) {
  constexpr int processes = 3;
  constexpr int64_t width = 1001;
  struct Case {
    mt::DType dtype, accum;
  };
  const Case cases[] = {{mt::f32, mt::f32}, {mt::bf16, mt::f32},   {mt::f16, mt::f32},
                        {mt::f64, mt::f64}, {mt::f32, mt::f64},    {mt::i64, mt::i64},
                        {mt::i32, mt::i64}, {mt::boolean, mt::i64}};
  std::string calls;
  std::vector<mt::Tensor> wants;  // output c: case c
  std::vector<float> plain(width);
  for (size_t c = 0; c < std::size(cases); ++c) {
    const auto [dtype, accum] = cases[c];
    mt::Tensor drawn = values({processes * width}, mt::f64, 20 + c);
    std::vector<double> v = drawn.to_vector<double>();
    for (size_t i = 0; i < v.size(); ++i)
      v[i] *= i % 7 == 0 ? 1e6 : i % 5 == 0 ? 1e-4 : i % 11 == 0 ? 0 : 1;
    mt::Storage pieces(dtype, processes * width);
    for (int64_t i = 0; i < pieces.count; ++i)
      if (mt::is_floating(dtype))
        mt::store_element(pieces, i, v[i]);
      else
        mt::store_element(pieces, i, static_cast<int64_t>(v[i]));
    auto want = std::make_shared<mt::Storage>(dtype, width);
    mt::add_pieces_on_host(pieces, processes, width, accum, *want);
    if (c == 0) {
      for (int64_t i = 0; i < width; ++i) {
        float acc = pieces.as<float>()[i];
        for (int q = 1; q < processes; ++q) acc += pieces.as<float>()[q * width + i];
        plain[i] = acc;
      }
      EXPECT_EQ(0, std::memcmp(plain.data(), want->host_data(), width * sizeof(float)));
    }
    calls += fmt::format("  std::vector<char> in{0} = {1}, out{0}({2});\n", c,
                         bytes_literal(pieces), want->size_bytes());
    calls += grid_call(
        width, fmt::format("mt_rank_order_sum(in{0}.data(), out{0}.data(), {1}, "
                           "{2}, {3}, {4})",
                           c, static_cast<int>(dtype), static_cast<int>(accum), width, processes));
    wants.push_back(mt::from_storage(std::move(want), {width}));
  }
  expect_fixed_kernel_outputs(calls, wants, "rank_order_sum");
}

// The three convolution kernels on windows with strides, padding, dilation and groups, in f32,
// f16 and bf16 and under autocast (f32 operands rounded to bf16 by the kernel): the reference's
// bytes.
TEST(CudaOnHost, ConvolutionKernelsStoreTheReferencesBits) {
  mt::Device previous = mt::current_device();
  mt::set_device(mt::Device::reference);
  mt::ConvWindow window;
  window.stride[0] = 2, window.pad[0] = 1, window.pad[1] = 2, window.dil[1] = 2, window.groups = 2;
  const mt::Shape x_shape = {2, 4, 7, 6}, w_shape = {6, 2, 3, 3}, y_shape = {2, 6, 4, 6};
  // Each convolution with its operands (the graph drops a node's inputs once it has a value).
  std::vector<std::array<mt::Tensor, 3>> convs;
  auto add = [&](mt::Tensor a, mt::Tensor b, auto make) { convs.push_back({a, b, make(a, b)}); };
  add(values(x_shape, mt::f32, 1), values(w_shape, mt::f32, 2),
      [&](auto& x, auto& w) { return mt::conv2d_forward(x, w, window); });
  add(values(y_shape, mt::bf16, 3), values(w_shape, mt::bf16, 4),
      [&](auto& gy, auto& w) { return mt::conv2d_input_grad(gy, w, x_shape, window); });
  add(values(x_shape, mt::f16, 5), values(y_shape, mt::f16, 6),
      [&](auto& x, auto& gy) { return mt::conv2d_weight_grad(x, gy, w_shape, window); });
  {
    mt::autocast guard(mt::bf16);
    add(values({3, 3, 5, 5}, mt::f32, 7), values({5, 3, 2, 2}, mt::f32, 8),
        [&](auto& x, auto& w) { return mt::conv2d(x, w); });
  }
  std::vector<mt::Tensor> outs;
  std::vector<mt::ConvGeometry> geometry;
  std::vector<mt::OpCode> ops;
  for (auto& conv : convs) {
    ops.push_back(conv[2].node()->op);
    ASSERT_EQ(mt::op_info(conv[2].node()->op).kind, mt::OpKind::Conv);
    ASSERT_EQ(conv[2].node()->inputs[0].get(), conv[0].node().get());
    geometry.push_back(mt::ConvGeometry::of(*conv[2].node()));
    outs.push_back(conv[2]);
  }
  mt::eval(outs);
  mt::set_device(previous);
  // The autocast convolution reads f32 values and computes in bf16: the kernel rounds them.
  EXPECT_EQ(outs[3].node()->precision.compute, mt::bf16);

  std::string calls;
  const char* kernels[] = {"mt_conv2d", "mt_conv2d_input_grad", "mt_conv2d_weight_grad"};
  for (size_t o = 0; o < outs.size(); ++o) {
    const mt::Node& node = *outs[o].node();
    const mt::Storage &a = *convs[o][0].node()->value, &b = *convs[o][1].node()->value;
    const mt::ConvGeometry& g = geometry[o];
    const mt::ConvWindow& w = g.window;
    calls += fmt::format("  std::vector<char> a{0} = {1}, b{0} = {2}, out{0}({3});\n", o,
                         bytes_literal(a), bytes_literal(b), node.value->size_bytes());
    calls += grid_call(
        node.numel(),
        fmt::format(
            "{}(a{}.data(), b{}.data(), out{}.data(), mt_conv{{{}, {}, {}, {}, {}, {}, {}, "
            "{}, {}, {{{}, {}}}, {{{}, {}}}, {{{}, {}}}, {}, {}, {}, {}, {}, {}, 0}})",
            kernels[ops[o] == mt::OpCode::Conv2d            ? 0
                    : ops[o] == mt::OpCode::Conv2dInputGrad ? 1
                                                            : 2],
            o, o, o, g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.oh, g.ow, w.stride[0], w.stride[1],
            w.pad[0], w.pad[1], w.dil[0], w.dil[1], w.groups, static_cast<int>(a.dtype),
            static_cast<int>(b.dtype), static_cast<int>(node.precision.storage_type),
            static_cast<int>(node.precision.compute), static_cast<int>(node.precision.accum)));
  }
  expect_fixed_kernel_outputs(calls, outs, "conv");
}

// The two max-pooling kernels on windows with strides, padding, dilation and ceil mode, on values
// with ties (rounded to integers), -inf and NaN, in f32, bf16, f16 and f64: the reference's bytes
// (picks, and the gradient's sums in its order and rounding).
TEST(CudaOnHost, MaxPoolKernelsStoreTheReferencesBits) {
  mt::Device previous = mt::current_device();
  mt::set_device(mt::Device::reference);
  struct Pool {
    mt::Tensor x, gy, out;
    mt::PoolGeometry geometry;  // read before the evaluation drops the node's inputs
  };
  std::vector<Pool> pools;
  auto tied = [](mt::Shape shape, mt::DType dtype, uint64_t seed) {
    mt::Tensor t = mt::cast(mt::round(values(shape, mt::f32, seed) * 0.5), dtype);
    mt::eval({t});
    return t;
  };
  // x with -inf in a whole plane and NaNs (two in one window), then max_pool2d and its gradient.
  auto add = [&](mt::Shape shape, mt::DType dtype, uint64_t seed, mt::Size2 k, mt::Size2 s,
                 mt::Size2 p, mt::Size2 d, bool ceil_mode) {
    std::vector<double> v = tied(shape, mt::f64, seed).to_vector<double>();
    const size_t plane = static_cast<size_t>(shape[2] * shape[3]);
    std::fill(v.end() - static_cast<std::ptrdiff_t>(plane), v.end(), -INFINITY);
    if (dtype == mt::f32 || dtype == mt::f64) v[1] = v[2] = v[v.size() / 2] = NAN;
    mt::Tensor x = mt::tensor(v, shape, dtype);
    mt::Tensor y = mt::max_pool2d(x, k, s, p, d, ceil_mode);
    const mt::PoolGeometry forward = mt::PoolGeometry::of(*y.node());
    mt::eval({y});
    mt::Tensor gy = values(y.shape(), dtype, seed + 1);
    mt::Tensor grad = mt::max_pool2d_grad(x, gy, mt::PoolWindow::from(y.node()->attrs.window));
    pools.push_back({x, mt::Tensor(), y, forward});
    pools.push_back({x, gy, grad, mt::PoolGeometry::of(*grad.node())});
  };
  add({2, 3, 11, 10}, mt::f32, 1, 3, 2, 1, 1, false);
  add({1, 2, 6, 7}, mt::bf16, 2, 2, 1, 0, 1, false);
  add({2, 2, 9, 8}, mt::f16, 3, {2, 3}, {1, 2}, 1, {2, 1}, true);
  add({1, 3, 8, 7}, mt::f64, 4, 3, 3, 1, 1, true);
  std::vector<mt::Tensor> outs;
  for (const Pool& p : pools) outs.push_back(p.out);
  mt::eval(outs);
  mt::set_device(previous);

  std::string calls;
  for (size_t o = 0; o < pools.size(); ++o) {
    const mt::Node& node = *pools[o].out.node();
    const bool backward = node.op == mt::OpCode::MaxPool2dGrad;
    ASSERT_EQ(mt::op_info(node.op).kind, mt::OpKind::Pool);
    ASSERT_EQ(backward, o % 2 == 1);
    const mt::Storage& x = *pools[o].x.node()->value;
    const mt::PoolGeometry& g = pools[o].geometry;
    const mt::PoolWindow& w = g.window;
    const mt::DType g_dtype = backward ? pools[o].gy.node()->value->dtype : x.dtype;
    const std::string args = fmt::format(
        "mt_pool{{{}, {}, {}, {}, {}, {}, {{{}, {}}}, {{{}, {}}}, {{{}, {}}}, {{{}, {}}}, {}, {}, "
        "{}, {}}}",
        g.n, g.c, g.h, g.w, g.oh, g.ow, w.kernel[0], w.kernel[1], w.stride[0], w.stride[1],
        w.pad[0], w.pad[1], w.dil[0], w.dil[1], static_cast<int>(x.dtype),
        static_cast<int>(g_dtype), static_cast<int>(node.precision.storage_type),
        node.precision.storage_type == mt::f64 || g_dtype == mt::f64 ? 1 : 0);
    calls += fmt::format(
        "  std::vector<char> x{0} = {1}, gy{0} = {2}, out{0}({3});\n", o, bytes_literal(x),
        backward ? bytes_literal(*pools[o].gy.node()->value) : "{}", node.value->size_bytes());
    calls += grid_call(
        node.numel(),
        backward ? fmt::format("mt_max_pool2d_grad(x{0}.data(), gy{0}.data(), out{0}.data(), {1})",
                               o, args)
                 : fmt::format("mt_max_pool2d(x{0}.data(), out{0}.data(), {1})", o, args));
  }
  expect_fixed_kernel_outputs(calls, outs, "pool");
}

// Fused attention's four kernels (runtime/cuda_attention.h) on the host against the reference's
// materialized loops: f32 causal with d != dv and a length no tile divides; bf16 heads under a
// broadcast bool mask with a row that sees no key; f16 with an additive f32 mask and dropout. The
// kernels sum in f32 in their own order (and the reference in its), so the outputs agree to a few
// units of the stored type's last place, relative to the output's largest element.
TEST(CudaOnHost, AttentionKernelsMatchTheReference) {
  mt::Device previous = mt::current_device();
  mt::set_device(mt::Device::reference);
  struct Case {
    mt::Tensor q, k, v, mask, y, go, grads;
    bool causal;
    double scale;
    mt::AttentionDropout dropout;
    // Read before evaluation drops the nodes' inputs: the launches' arguments, as the CUDA back
    // end makes them, and the dropout stream's offset.
    mt::AttentionLaunch forward_launch, backward_launch;
    uint64_t offset;
  };
  std::vector<Case> cases;
  auto add = [&](mt::Shape batch, int64_t tq, int64_t tk, int64_t d, int64_t dv, mt::DType dtype,
                 mt::Tensor mask, bool causal, double p, uint64_t seed) {
    auto shaped = [&](int64_t rows, int64_t width, uint64_t s) {
      mt::Shape shape = batch;
      shape.push_back(rows);
      shape.push_back(width);
      return mt::cast(values(shape, mt::f32, s) * 0.3, dtype);
    };
    Case c{shaped(tq, d, seed),
           shaped(tk, d, seed + 1),
           shaped(tk, dv, seed + 2),
           mask,
           {},
           shaped(tq, dv, seed + 3),
           {},
           causal,
           1.0 / std::sqrt(static_cast<double>(d)),
           {},
           {},
           {},
           0};
    mt::eval({c.q, c.k, c.v, c.go});  // the kernels read their values
    if (mask.defined()) mt::eval({mask});
    mt::Shape weights = batch;
    weights.push_back(tq);
    weights.push_back(tk);
    mt::Generator gen(seed + 4);
    if (p > 0) c.dropout = mt::AttentionDropout::draw(p, &gen, weights);
    c.y = mt::attention_forward(c.q, c.k, c.v, mask, causal, c.scale, c.dropout);
    c.forward_launch = mt::attention_launch(*c.y.node()).value();
    mt::eval({c.y});  // the backward node reads its dtype
    c.grads = mt::attention_backward(c.q, c.k, c.v, c.y, c.go, mask, causal, c.scale, c.dropout);
    c.backward_launch = mt::attention_launch(*c.grads.node()).value();
    if (p > 0) {
      mt::eval({c.dropout.offset});
      c.offset = mt::DropoutDraw::of(*c.grads.node()).offset;
    }
    cases.push_back(c);
  };
  add({2}, 37, 37, 16, 24, mt::f32, mt::Tensor(), true, 0, 1);
  std::vector<float> bits(19 * 45);  // row 3 sees no key
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = (i * 7 + i / 45) % 5 != 0 && i / 45 != 3;
  add({1, 2}, 19, 45, 40, 40, mt::bf16, mt::tensor(bits, {1, 1, 19, 45}) > 0.5, false, 0, 10);
  add({2}, 21, 21, 8, 8, mt::f16, values({1, 21, 21}, mt::f32, 20), false, 0.3, 30);
  std::vector<mt::Tensor> outs;
  for (const Case& c : cases) outs.insert(outs.end(), {c.y, c.grads});
  mt::eval(outs);
  mt::set_device(previous);

  fs::path dir = fs::temp_directory_path() / fmt::format("mixtape_cuda_attention_{}", ::getpid());
  fs::create_directories(dir);
  std::string main_text = "int main() {\n";
  for (size_t n = 0; n < cases.size(); ++n) {
    const Case& c = cases[n];
    const mt::Node &forward = *c.y.node(), &backward = *c.grads.node();
    ASSERT_EQ(forward.op, mt::OpCode::Attention);
    ASSERT_EQ(backward.op, mt::OpCode::AttentionBackward);
    const mt::AttentionKernelArgs& g = c.backward_launch.args;
    const int dim = c.backward_launch.dim;
    EXPECT_EQ(c.forward_launch.dim, dim);
    std::vector<long long> offsets = c.backward_launch.mask_batch;
    if (offsets.empty()) offsets.push_back(0);
    // The arguments' bytes, copied into the kernels' mt_attention: its layout is checked too.
    auto args_bytes = [](const mt::AttentionKernelArgs& args) {
      return bytes_literal(&args, sizeof args);
    };
    main_text += fmt::format(
        "  {{\n  std::vector<char> q = {}, k = {}, v = {}, o = {}, go = {}, mask = {};\n"
        "  std::vector<long long> mask_batch = {{{}}};\n"
        "  std::vector<unsigned long long> offset = {{{}ull}};\n"
        "  std::vector<char> y({}), grads({});\n"
        "  std::vector<float> stats({});\n"
        "  static_assert(sizeof(mt_attention) == {});\n"
        "  const unsigned char forward_bytes[] = {}, backward_bytes[] = {};\n"
        "  mt_attention fa, ba;\n"
        "  std::memcpy(&fa, forward_bytes, sizeof fa);\n"
        "  std::memcpy(&ba, backward_bytes, sizeof ba);\n",
        bytes_literal(*c.q.node()->value), bytes_literal(*c.k.node()->value),
        bytes_literal(*c.v.node()->value), bytes_literal(*c.y.node()->value),
        bytes_literal(*c.go.node()->value),
        g.mask_kind ? bytes_literal(*c.mask.node()->value) : "{0}", fmt::join(offsets, ", "),
        c.offset, forward.value->size_bytes(), backward.value->size_bytes(),
        mt::kAttentionRowStats * g.batch * g.tq, sizeof(mt::AttentionKernelArgs),
        args_bytes(c.forward_launch.args), args_bytes(g));
    auto blocks = [&](int64_t rows) { return g.batch * ((rows + 127) / 128); };
    main_text += fmt::format(
        "  mt_run_grid({}, 128, true, [&] {{ mt_attention_forward_{}(q.data(), k.data(), "
        "v.data(), mask.data(), mask_batch.data(), offset.data(), y.data(), fa); }});\n",
        blocks(g.tq), dim);
    main_text += fmt::format(
        "  mt_run_grid({}, 128, true, [&] {{ mt_attention_rows_{}(q.data(), k.data(), v.data(), "
        "o.data(), go.data(), mask.data(), mask_batch.data(), offset.data(), stats.data(), "
        "grads.data(), ba); }});\n",
        blocks(g.tq), dim);
    for (const char* kernel : {"keys", "values"})
      main_text += fmt::format(
          "  mt_run_grid({}, 128, true, [&] {{ mt_attention_{}_{}(q.data(), k.data(), v.data(), "
          "go.data(), mask.data(), mask_batch.data(), offset.data(), stats.data(), grads.data(), "
          "ba); }});\n",
          blocks(g.tk), kernel, dim);
    main_text += fmt::format("  mt_write(\"{}\", y);\n  mt_write(\"{}\", grads);\n  }}\n",
                             (dir / fmt::format("y{}", n)).string(),
                             (dir / fmt::format("grads{}", n)).string());
  }
  main_text += "}\n";
  // The dim-32 module's source (the fixed kernels', then attention's) with the host prelude, and
  // the dim-64 kernels.
  const std::string kernels =
      host_prelude() +
      mt::cuda_attention_source(32).substr(std::string(mt::cuda_prelude()).size()) +
      "MT_ATTENTION_KERNELS(64)\n";
  ASSERT_TRUE(compile_and_run(dir, std::string(shim) + kernels + main_text, "attention"));
  for (size_t n = 0; n < cases.size(); ++n)
    for (const auto& [name, tensor] : {std::pair{"y", cases[n].y}, {"grads", cases[n].grads}}) {
      const mt::Storage& want = *tensor.node()->value;
      std::vector<char> got = read_bytes(dir / fmt::format("{}{}", name, n));
      ASSERT_EQ(got.size(), static_cast<size_t>(want.size_bytes())) << name << n;
      mt::Storage actual(want.dtype, want.count);
      std::memcpy(actual.host_data(), got.data(), got.size());
      double largest = 0;
      for (int64_t i = 0; i < want.count; ++i)
        largest = std::max(largest, std::fabs(mt::load_element<double>(want, i)));
      const double unit = want.dtype == mt::f16    ? 0x1p-10
                          : want.dtype == mt::bf16 ? 0x1p-7
                                                   : 0x1p-20;
      for (int64_t i = 0; i < want.count; ++i) {
        const double a = mt::load_element<double>(actual, i), e = mt::load_element<double>(want, i);
        ASSERT_LE(std::fabs(a - e), unit * (std::fabs(e) + 2 * largest))
            << name << " of case " << n << ", element " << i << ": " << a << " on the host-run "
            << "CUDA, " << e << " in the reference";
      }
    }
  fs::remove_all(dir);
}

}  // namespace
