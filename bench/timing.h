// bench/timing.h -- the timing loop and command line shared by the C++ benchmark programs.
#pragma once

#include <mixtape/mixtape.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "runtime/device.h"

namespace bench {

namespace mt = mixtape;

/// How long to time one workload. The same rules as bench_common.measure in the Python peers.
struct TimingOptions {
  int warmup = 5;                // untimed steps first (at least one)
  int windows = 5;               // timed windows; the result is the median window rate
  double window_seconds = 1.0;   // steps per window are chosen to last about this long
  double budget_seconds = 60.0;  // fewer windows when the warm-up says they would take longer
};

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

/// Warm-up steps, then timed windows of K steps with K set from the warm-up step time (the same
/// rules, budget cuts included, as bench_common.measure in the Python peers). `step`
/// must return only when its work is done (a mixtape optimizer step evaluates before returning).
/// The result holds steps_per_s (median window) and how it was measured.
/// `after_warmup` (optional) runs between the warm-up and the first window, untimed.
inline mt::json::Object measure(const std::function<void()>& step, const TimingOptions& options,
                                const std::function<void()>& after_warmup = {}) {
  std::vector<double> warm_times;
  for (int i = 0; i < std::max(1, options.warmup); ++i) {
    auto start = std::chrono::steady_clock::now();
    step();
    warm_times.push_back(seconds_since(start));
    // Slow steps: two warm-up steps (the first one compiles) are enough once the steps after the
    // first have taken half the budget.
    double after_first = 0;
    for (size_t w = 1; w < warm_times.size(); ++w) after_first += warm_times[w];
    if (warm_times.size() >= 2 && after_first > options.budget_seconds / 2) break;
  }
  double estimate = warm_times.size() > 1
                        ? median(std::vector<double>(warm_times.begin() + 1, warm_times.end()))
                        : warm_times[0];
  int64_t per_window =
      std::max<int64_t>(1, std::llround(options.window_seconds / std::max(estimate, 1e-9)));
  int windows = options.windows;
  double planned = estimate * static_cast<double>(per_window) * windows;
  if (planned > options.budget_seconds)
    windows = std::max(
        1, static_cast<int>(options.budget_seconds / (estimate * static_cast<double>(per_window))));
  if (after_warmup) after_warmup();
  std::vector<double> rates;
  mt::json::Array window_rates;
  for (int w = 0; w < windows; ++w) {
    auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < per_window; ++i) step();
    double rate = static_cast<double>(per_window) / seconds_since(start);
    rates.push_back(rate);
    window_rates.push_back(std::round(rate * 1000) / 1000);
  }
  mt::json::Object result{{"steps_per_s", median(rates)},
                          {"window_steps_per_s", window_rates},
                          {"steps_per_window", per_window},
                          {"windows", windows},
                          {"warmup_steps", static_cast<int64_t>(warm_times.size())},
                          {"first_step_s", warm_times[0]}};
  if (windows < options.windows) result.emplace_back("windows_cut_by_budget", options.windows);
  return result;
}

inline void append(mt::json::Object& into, const mt::json::Object& from) {
  into.insert(into.end(), from.begin(), from.end());
}

inline void emit(const mt::json::Object& record) {
  std::printf("%s\n", mt::json::dump(record).c_str());
  std::fflush(stdout);
}

inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    if (comma > start) items.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return items;
}

/// The flags every bench program takes; `extra` handles the program's own flags (returns false
/// for a flag it does not know).
struct CommandLine {
  std::vector<std::string> workloads;
  std::vector<std::string> precisions{"fp32", "bf16"};
  TimingOptions timing;
  std::string step = "traced";  // bench_training: traced (every step) or compiled (mt::compile)
};

[[noreturn]] inline void usage_error(const char* program, const std::string& problem,
                                     const char* usage) {
  std::fprintf(stderr, "%s: %s\n%s", program, problem.c_str(), usage);
  std::exit(2);
}

inline CommandLine parse_command_line(int argc, char** argv, const char* program,
                                      const char* usage) {
  CommandLine line;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("%s", usage);
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error(program, "missing value for " + flag, usage);
    std::string value = argv[++i];
    auto number = [&] {
      char* end = nullptr;
      double v = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(v >= 0))
        usage_error(program, "not a non-negative number for " + flag + ": " + value, usage);
      return v;
    };
    if (flag == "--workloads")
      line.workloads = split_list(value);
    else if (flag == "--precisions")
      line.precisions = split_list(value);
    else if (flag == "--warmup")
      line.timing.warmup = static_cast<int>(number());
    else if (flag == "--windows")
      line.timing.windows = std::max(1, static_cast<int>(number()));
    else if (flag == "--window-seconds")
      line.timing.window_seconds = number();
    else if (flag == "--budget-seconds")
      line.timing.budget_seconds = number();
    else if (flag == "--step" && (value == "traced" || value == "compiled"))
      line.step = value;
    else
      usage_error(program, "unknown flag " + flag, usage);
  }
  if (line.workloads.empty()) usage_error(program, "--workloads is required", usage);
  for (const std::string& p : line.precisions)
    if (p != "fp32" && p != "bf16") usage_error(program, "precisions are fp32 and bf16", usage);
  return line;
}

/// The back-end selection this process was started with (run.py sets these per child) and what
/// the library made of it, so each record says what it measured.
inline mt::json::Object backend() {
  auto get = [](const char* name) -> mt::json::Value {
    const char* value = std::getenv(name);
    return value ? mt::json::Value(value) : mt::json::Value(nullptr);
  };
  return {{"device", mt::device_name(mt::current_device())},
          {"eager", mt::eager_mode()},
          {"MIXTAPE_DEVICE", get("MIXTAPE_DEVICE")},
          {"MIXTAPE_EAGER", get("MIXTAPE_EAGER")}};
}

/// The compiled back end's counters as JSON; `per_step` divides the per-launch counts by `steps`.
inline mt::json::Object stats_json(const mt::ExecutionStats& s, int64_t steps = 1) {
  double n = static_cast<double>(std::max<int64_t>(1, steps));
  auto per = [&](int64_t count) { return static_cast<double>(count) / n; };
  return {{"evaluations", per(s.evaluations)},
          {"kernels", per(s.kernels)},
          {"kernel_nodes", per(s.kernel_nodes)},
          {"gemms", per(s.gemms)},
          {"host_ops", per(s.host_ops)},
          {"bytes_read", per(s.bytes_read)},
          {"bytes_written", per(s.bytes_written)},
          {"kernels_compiled", s.kernels_compiled},
          {"kernels_from_disk", s.kernels_from_disk},
          {"compile_seconds", s.compile_seconds},
          {"load_seconds", s.load_seconds}};
}

}  // namespace bench
