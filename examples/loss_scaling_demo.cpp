// examples/loss_scaling_demo.cpp -- why fp16 training needs loss scaling, shown on real data.
//
// The loss is weighted by 2^-20 (as an auxiliary loss, or a sum of many small terms, would be),
// which puts the true gradients of a digits MLP below fp16's smallest subnormal (2^-24). SGD's
// learning rate is raised by 2^20 to match, so in fp32 the weighting changes nothing. Four runs
// start from the same weights and see the same batches: fp32; autocast-f16 without scaling (the
// gradients underflow to zero and the model stops learning); autocast-f16 with dynamic loss
// scaling (it learns like fp32); autocast-bf16 without scaling (bf16 has fp32's range).
// --logdir DIR writes each run's TensorBoard event files into DIR/<run> (tools/plot_run.py DIR/*
// draws them: loss, loss scale with skipped steps, gradient underflow).
#include <mixtape/mixtape.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "example_cli.h"
#include "progress_line.h"

namespace mt = mixtape;

namespace {

constexpr double kLossWeight = 1.0 / 1048576;  // 2^-20, exact in every float type

struct Net : mt::Module {
  mt::Linear fc1{64, 128}, fc2{128, 128}, fc3{128, 10};
  Net() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    register_module("fc3", fc3);
  }
  mt::Tensor operator()(const mt::Tensor& x) const { return fc3(mt::relu(fc2(mt::relu(fc1(x))))); }
};

struct RunResult {
  std::string name;
  double underflow_fraction = 0;  // of the first step's weight-gradient values, zero vs fp32
  double final_loss = 0;          // unweighted cross-entropy, mean of the last 20 steps
  int64_t skipped_steps = 0;
  double final_scale = 1;
};

struct Setup {
  mt::TensorDataset train;
  int64_t steps;
  mt::NamedTensors initial;
  std::string logdir;  // empty: no event files
  int64_t growth_interval;
};

// Counts gradient values that are zero in this run although the fp32 run's are not.
double lost_fraction(const std::vector<std::vector<float>>& grads,
                     const std::vector<std::vector<float>>& reference) {
  int64_t lost = 0, total = 0;
  for (size_t t = 0; t < grads.size(); ++t)
    for (size_t i = 0; i < grads[t].size(); ++i)
      if (reference[t][i] != 0) {
        ++total;
        lost += grads[t][i] == 0;
      }
  return total ? static_cast<double>(lost) / static_cast<double>(total) : 0;
}

RunResult train(const Setup& setup, const std::string& name, const std::string& folder,
                const mt::PolicyPtr& policy, bool scaling,
                std::vector<std::vector<float>>* first_grads) {
  Net net;
  net.load_state_dict(setup.initial);
  mt::SGD optimizer(net.parameters(), {.lr = 0.05 / kLossWeight, .momentum = 0.9});
  mt::GradScaler scaler({.growth_interval = setup.growth_interval, .enabled = scaling});
  mt::DataLoader loader(setup.train, 64, true, /*seed=*/1);
  RunResult result{.name = name};
  std::unique_ptr<mt::SummaryWriter> writer =
      examples::open_logdir(setup.logdir.empty() ? "" : setup.logdir + "/" + folder);
  examples::ProgressLine progress(setup.steps, false, name);
  double loss_sum = 0;
  for (int64_t step = 1; step <= setup.steps; ++step) {
    if (writer) writer->set_step(step);
    mt::Batch batch = loader.next();
    optimizer.zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(policy);
      loss = mt::cross_entropy(net(batch.inputs), batch.targets);
    }
    scaler.scale(loss * kLossWeight).backward();
    if (step == 1) {
      std::vector<mt::Tensor> grads;
      for (auto& [param_name, p] : net.named_parameters())
        if (param_name.ends_with("weight")) grads.push_back(p.grad());
      mt::eval(grads);
      for (mt::Tensor& g : grads) {
        // Unscaled, as the optimizer will see them.
        mt::Tensor unscaled = g / scaler.scale(mt::scalar(1.0));
        first_grads->push_back(unscaled.to_vector<float>());
      }
    }
    scaler.step(optimizer);
    if (writer) {
      writer->add_scalar("loss", loss);
      writer->log_scaler(scaler);
      // Every 5th step: the share of weight-gradient values that are exactly zero (underflowed
      // in the 16-bit backward, besides ReLU's zeros) and what f16 would flush at scale 1.
      writer->log_gradient_health(net, 5);
    }
    scaler.update();
    if (step > setup.steps - 20) loss_sum += loss.item();
    if (progress.due(step)) progress.update(step, loss.item(), scaler.get_scale());
  }
  progress.finish();
  result.final_loss = loss_sum / 20;
  result.skipped_steps = scaler.skipped_steps();
  result.final_scale = scaler.get_scale();
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t steps = 300;
    std::string logdir;
    int64_t growth_interval = 2000;  // PyTorch's default
    CLI::App app(
        "Why fp16 training needs loss scaling: four runs of a digits MLP whose loss is "
        "weighted by 2^-20.",
        "loss_scaling_demo");
    app.add_option("steps", steps, "training steps of each run")
        ->check(examples::at_least(20))
        ->capture_default_str();
    examples::add_logdir(app, logdir);
    // The dynamic scaler doubles its scale after this many finite steps; a short interval (20
    // over 600 steps) shows it growing until gradients overflow, skipping and backing off.
    app.add_option("--growth-interval", growth_interval,
                   "finite steps before the dynamic scaler doubles its scale")
        ->check(examples::at_least(1))
        ->capture_default_str();
    examples::parse(app, argc, argv);
    mt::Digits digits = mt::load_digits(mt::default_data_dir() + "/digits.csv.gz");
    std::vector<float> pixels(digits.pixels.begin(), digits.pixels.begin() + 1437 * 64);
    for (float& p : pixels) p /= 16.0f;
    std::vector<int64_t> labels(digits.labels.begin(), digits.labels.begin() + 1437);
    mt::manual_seed(0);
    Net initial_net;
    Setup setup{mt::TensorDataset(std::move(pixels), {64}, std::move(labels)), steps,
                initial_net.state_dict(), logdir, growth_interval};

    std::vector<std::vector<float>> g32, g16, g16s, gbf;
    std::vector<RunResult> runs;
    runs.push_back(train(setup, "fp32", "fp32", mt::fp32_policy(), false, &g32));
    runs.push_back(
        train(setup, "fp16 (no scaling)", "fp16", mt::autocast_policy(mt::f16), false, &g16));
    runs.push_back(train(setup, "fp16 + dynamic scaling", "fp16_dynamic_scaling",
                         mt::autocast_policy(mt::f16), true, &g16s));
    runs.push_back(
        train(setup, "bf16 (no scaling)", "bf16", mt::autocast_policy(mt::bf16), false, &gbf));
    runs[0].underflow_fraction = lost_fraction(g32, g32);
    runs[1].underflow_fraction = lost_fraction(g16, g32);
    runs[2].underflow_fraction = lost_fraction(g16s, g32);
    runs[3].underflow_fraction = lost_fraction(gbf, g32);

    std::printf("%-24s %18s %16s %14s %12s\n", "run", "grads underflowed", "loss (last 20)",
                "skipped steps", "final scale");
    nlohmann::ordered_json json_runs = nlohmann::ordered_json::array();
    for (const RunResult& r : runs) {
      std::printf("%-24s %17.1f%% %16.4f %14lld %12g\n", r.name.c_str(), r.underflow_fraction * 100,
                  r.final_loss, static_cast<long long>(r.skipped_steps), r.final_scale);
      json_runs.push_back({{"run", r.name},
                           {"underflow_fraction", r.underflow_fraction},
                           {"final_loss", r.final_loss},
                           {"skipped_steps", r.skipped_steps},
                           {"final_scale", r.final_scale}});
    }
    nlohmann::ordered_json line{{"example", "loss_scaling_demo"},
                                {"steps", steps},
                                {"runs", std::move(json_runs)},
                                {"peak_bytes", mt::execution_stats().memory_peak_bytes}};
    std::printf("%s\n", line.dump().c_str());
    return 0;
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "loss_scaling_demo: error: %s\n", e.what());
    return 1;
  }
}
