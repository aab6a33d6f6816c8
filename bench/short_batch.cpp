// bench/short_batch.cpp -- bench_short_batch: what a short last batch each epoch costs a training
// loop compiled with mt::compile, against the same loop dropping it (drop_last), in one JSON line.
#include <mixtape/dsl/error.h>
#include <mixtape/mixtape.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/peak.h"
#include "bench/timing.h"
#include "mixtape/dsl/json.h"

namespace mt = mixtape;

namespace {

constexpr const char* kUsage =
    "usage: bench_short_batch [--epochs N] [--batches N] [--batch N] [--short N]\n"
    "  Trains an MLP (64 -> 256 -> 256 -> 10, ReLU, cross-entropy, AdamW) through mt::compile on\n"
    "  random data: epochs of --batches full batches of --batch rows, with and without a last\n"
    "  batch of --short rows, and prints the median epoch's microseconds per example of both,\n"
    "  their ratio and the traces per epoch after the warm-up (JSON).\n";

struct Loop {
  double us_per_example = 0;
  double traces_per_epoch = 0;
};

// Median epoch time per example, over `epochs` epochs after three warm-up epochs.
Loop run(int64_t batches, int64_t batch, int64_t short_rows, int epochs) {
  mt::Generator gen(bench::kSeed);
  mt::MLP model({64, 256, 256, 10}, mt::Activation::Relu, &gen);
  mt::AdamW opt(model.parameters(), mt::AdamOptions{.lr = 1e-3});
  auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
    opt.zero_grad();
    mt::Tensor loss = mt::cross_entropy(model(x), y);
    loss.backward();
    opt.step();
    return loss;
  });
  std::vector<std::pair<mt::Tensor, mt::Tensor>> epoch;
  int64_t examples = 0;
  for (int64_t b = 0; b <= batches; ++b) {
    const int64_t rows = b < batches ? batch : short_rows;
    if (rows == 0) continue;
    mt::Tensor x = mt::randn({rows, 64}, mt::f32, &gen);
    mt::Tensor y = mt::randint(0, 10, {rows}, &gen);
    mt::eval({x, y});
    epoch.emplace_back(x, y);
    examples += rows;
  }
  std::vector<double> seconds;
  int64_t traces_before = 0;
  for (int e = 0; e < 3 + epochs; ++e) {
    if (e == 3) traces_before = step.stats().traces;
    auto start = std::chrono::steady_clock::now();
    mt::Tensor loss;
    for (const auto& [x, y] : epoch) loss = step(x, y);
    mt::eval({loss});
    mt::synchronize();
    if (e >= 3) seconds.push_back(bench::seconds_since(start));
  }
  return {bench::median(seconds) * 1e6 / static_cast<double>(examples),
          static_cast<double>(step.stats().traces - traces_before) / epochs};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int epochs = 20;
    int64_t batches = 15, batch = 64, short_rows = 17;
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--help") {
        std::fputs(kUsage, stdout);
        return 0;
      }
      if (i + 1 >= argc) mt::fail("{} needs a value\n{}", arg, kUsage);
      const int64_t value = std::stoll(argv[++i]);
      if (arg == "--epochs")
        epochs = static_cast<int>(value);
      else if (arg == "--batches")
        batches = value;
      else if (arg == "--batch")
        batch = value;
      else if (arg == "--short")
        short_rows = value;
      else
        mt::fail("unknown argument {}\n{}", arg, kUsage);
    }
    if (epochs < 1 || batches < 1 || batch < 1 || short_rows < 1 || short_rows >= batch)
      mt::fail("need epochs, batches, batch >= 1 and 1 <= short < batch\n{}", kUsage);
    const Loop dropped = run(batches, batch, 0, epochs);
    const Loop kept = run(batches, batch, short_rows, epochs);
    mt::json::Value line = mt::json::Value::object();
    line["workload"] = "mlp_short_batch";
    line["cpu_model"] = bench::cpu_model();
    line["batch"] = batch;
    line["short"] = short_rows;
    line["us_per_example_drop_last"] = dropped.us_per_example;
    line["us_per_example_short_batch"] = kept.us_per_example;
    line["ratio"] = kept.us_per_example / dropped.us_per_example;
    line["traces_per_epoch_drop_last"] = dropped.traces_per_epoch;
    line["traces_per_epoch_short_batch"] = kept.traces_per_epoch;
    std::printf("%s\n", line.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_short_batch: error: %s\n", e.what());
    return 1;
  }
}
