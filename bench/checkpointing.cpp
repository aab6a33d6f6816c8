// bench/checkpointing.cpp -- bench_checkpointing: the char GPT's traced training step with and
// without activation checkpointing of every block: CPU time per step, stored-values peak and the
// measured process peak (bench/checkpointing.py runs it with the PyTorch peer).
#include <mixtape/mixtape.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench/gpt_step.h"
#include "bench/timing.h"
#include "examples/char_gpt_model.h"

namespace {

using bench::median;
using bench::process_cpu_seconds;

constexpr uint64_t kSeed = 1234;

struct State {
  mt::Generator gen{kSeed};
  std::unique_ptr<CharGpt> model;
  std::unique_ptr<mt::AdamW> optimizer;
  std::unique_ptr<mt::TextWindows> windows;
  std::unique_ptr<mt::DataLoader> loader;
};

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: bench_checkpointing [--policy fp32|autocast-bf16|...] [--windows N] "
               "[--steps-per-window N] [--batch N] [--context N] [--layers N]\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string policy_name = "fp32";
  int windows = 7;
  int64_t per_window = 4, batch = 12, context = 64, layers = 4;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) usage();
    std::string value = argv[++i];
    if (flag == "--policy")
      policy_name = value;
    else if (flag == "--windows")
      windows = std::atoi(value.c_str());
    else if (flag == "--steps-per-window")
      per_window = std::atoll(value.c_str());
    else if (flag == "--batch")
      batch = std::atoll(value.c_str());
    else if (flag == "--context")
      context = std::atoll(value.c_str());
    else if (flag == "--layers")
      layers = std::atoll(value.c_str());
    else
      usage();
  }
  if (windows < 1 || per_window < 1 || batch < 1 || context < 1 || layers < 1) usage();
  try {
    mt::PolicyPtr policy = mt::policy_by_name(policy_name);
    // nanoGPT's CPU settings, as bench_training's char_gpt and the peer.
    auto state = std::make_shared<State>();
    std::string text = mt::read_file(mt::default_data_dir() + "/fortunes.txt");
    mt::CharVocab vocab(text);
    GptConfig config{
        .vocab = vocab.size(), .layers = layers, .heads = 4, .width = 128, .context = context};
    state->windows = std::make_unique<mt::TextWindows>(vocab.encode(text), config.context);
    state->loader = std::make_unique<mt::DataLoader>(*state->windows, batch, true, kSeed);
    state->model = std::make_unique<CharGpt>(config, &state->gen);
    state->optimizer = std::make_unique<mt::AdamW>(
        state->model->parameters(),
        mt::AdamOptions{.lr = 1e-3, .beta2 = 0.99, .weight_decay = 0.1});
    auto train = bench::gpt_train_step(state, policy);
    auto step = [&] {
      mt::Batch b = state->loader->next();
      train(b.inputs, b.targets).item();
    };
    // Both modes' programs are built in the warm-up; then windows alternate between the modes,
    // so that a change of the machine's load falls on both.
    struct Mode {
      const char* name;
      bool checkpoint;
      std::vector<double> cpu_per_step, wall_per_step;
      int64_t stored_peak = 0, memory_peak = 0;
    };
    std::vector<Mode> modes{{"plain", false, {}, {}}, {"checkpoint", true, {}, {}}};
    auto select = [](const Mode& mode) {
      mt::clear_checkpoints();
      if (mode.checkpoint) mt::checkpoint("blocks.*");
    };
    for (Mode& mode : modes) {
      select(mode);
      for (int i = 0; i < 3; ++i) step();
      mt::reset_execution_stats();
      step();
      mode.stored_peak = mt::execution_stats().peak_bytes;
      mode.memory_peak = mt::execution_stats().memory_peak_bytes;
    }
    for (int w = 0; w < windows; ++w)
      for (Mode& mode : modes) {
        select(mode);
        auto start = std::chrono::steady_clock::now();
        double cpu_start = process_cpu_seconds();
        for (int64_t i = 0; i < per_window; ++i) step();
        mode.cpu_per_step.push_back((process_cpu_seconds() - cpu_start) /
                                    static_cast<double>(per_window));
        mode.wall_per_step.push_back(bench::seconds_since(start) / static_cast<double>(per_window));
      }
    mt::json::Value record{{"bench", "checkpointing"}, {"system", "mixtape"},
                           {"policy", policy_name},    {"batch", batch},
                           {"context", context},       {"layers", layers},
                           {"windows", windows},       {"steps_per_window", per_window}};
    for (const Mode& mode : modes)
      record.emplace(mode.name,
                     mt::json::Value{{"cpu_ms_per_step", median(mode.cpu_per_step) * 1e3},
                                     {"wall_ms_per_step", median(mode.wall_per_step) * 1e3},
                                     {"stored_peak_bytes", mode.stored_peak},
                                     {"peak_bytes", mode.memory_peak}});
    record.emplace("cpu_time_ratio", median(modes[1].cpu_per_step) / median(modes[0].cpu_per_step));
    record.emplace("stored_peak_ratio", static_cast<double>(modes[1].stored_peak) /
                                            static_cast<double>(modes[0].stored_peak));
    bench::emit(record);
    return 0;
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "bench_checkpointing: %s\n", e.what());
    return 1;
  }
}
