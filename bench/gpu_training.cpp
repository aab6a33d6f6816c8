// bench/gpu_training.cpp -- bench_gpu_training: training steps/s of the MLP workload on the GPU
// (MIXTAPE_DEVICE=cuda's back end), fp32 and bf16 autocast, as one JSON object.
#include <mixtape/mixtape.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "runtime/cuda_executor.h"

namespace mt = mixtape;

namespace {

constexpr int64_t kBatch = 65536;
constexpr int kWarmupSteps = 3;
constexpr double kSeconds = 2.0;  // timed per configuration, after the warm-up

mt::Tensor random_normal(mt::Shape shape, std::mt19937_64& rng) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) v = normal(rng);
  return mt::tensor(values, std::move(shape));
}

// The MLP workload of bench_training: 32 -> width x4 (ReLU) -> 16, MSE, Adam 1e-3; the data is
// uploaded once and stays on the GPU. Steps are queued without reading the loss; the clock
// stops after the GPU has finished them.
std::string run(int64_t width, const char* precision) {
  mt::Generator gen(0);
  mt::MLP net({32, width, width, width, width, 16}, mt::Activation::Relu, &gen);
  mt::Adam optimizer(net.parameters(), mt::AdamOptions{.lr = 1e-3});
  std::mt19937_64 rng(0);
  mt::Tensor inputs = random_normal({kBatch, 32}, rng);
  mt::Tensor targets = random_normal({kBatch, 16}, rng);
  mt::PolicyPtr policy =
      mt::policy_by_name(std::string(precision) == "bf16" ? "autocast-bf16" : "fp32");
  mt::Tensor loss;
  auto step = [&] {
    optimizer.zero_grad();
    {
      mt::autocast guard(policy);
      loss = mt::mse_loss(net(inputs), targets);
    }
    loss.backward();
    optimizer.step();
  };
  for (int i = 0; i < kWarmupSteps; ++i) step();
  double first_loss = loss.item();
  mt::reset_execution_stats();
  using clock = std::chrono::steady_clock;
  auto start = clock::now();
  int steps = 0;
  double elapsed = 0;
  while (elapsed < kSeconds) {
    for (int i = 0; i < 10; ++i, ++steps) step();
    mt::cuda_synchronize();
    elapsed = std::chrono::duration<double>(clock::now() - start).count();
  }
  mt::ExecutionStats stats = mt::execution_stats();
  double last_loss = loss.item();
  return fmt::format(
      "{{\"width\": {}, \"batch\": {}, \"hidden_layers\": 4, \"precision\": \"{}\", "
      "\"steps\": {}, \"seconds\": {:.4f}, \"steps_per_s\": {:.2f}, \"ms_per_step\": {:.4f}, "
      "\"kernels_per_step\": {:.1f}, \"gemms_per_step\": {:.1f}, \"host_ops_per_step\": {:.1f}, "
      "\"programs_built\": {}, \"loss_after_warmup\": {:.6g}, \"final_loss\": {:.6g}}}",
      width, kBatch, precision, steps, elapsed, steps / elapsed, 1e3 * elapsed / steps,
      static_cast<double>(stats.kernels) / steps, static_cast<double>(stats.gemms) / steps,
      static_cast<double>(stats.host_ops) / steps, stats.programs_built, first_loss, last_loss);
}

}  // namespace

int main() {
  if (!mt::cuda_backend_available()) {
    std::string reason;
    for (char c : mt::cuda_backend_unavailable_reason()) {
      if (c == '"' || c == '\\') reason += '\\';
      reason += c;
    }
    std::printf("{\"benchmark\": \"gpu_training\", \"skipped\": \"%s\"}\n", reason.c_str());
    return 0;
  }
  try {
    mt::set_device(mt::Device::cuda);
    std::vector<std::string> results;
    for (int64_t width : {64, 128})
      for (const char* precision : {"fp32", "bf16"}) results.push_back(run(width, precision));
    std::string joined;
    for (const std::string& r : results) joined += (joined.empty() ? "" : ", ") + r;
    std::printf("{\"benchmark\": \"gpu_training\", \"device\": \"cuda\", \"results\": [%s]}\n",
                joined.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_training: %s\n", e.what());
    return 1;
  }
  return 0;
}
