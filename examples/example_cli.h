// examples/example_cli.h -- the examples' command lines (CLI11): the flags they share, defined
// once, the checks on their values, and one way to fail (one line naming the flag, exit 2).
#pragma once

#include <mixtape/mixtape.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <string>

namespace examples {

namespace mt = mixtape;

/// Why `text` is not a decimal number as the flags take them, or "". CLI11 reads an integer
/// flag in C's base 0, where 010 is 8 and 0x10 is 16, while the checks below read the text as a
/// decimal double: a leading 0 before a digit or a letter is refused, so both read alike.
inline std::string not_decimal(const std::string& text) {
  size_t at = !text.empty() && (text[0] == '-' || text[0] == '+') ? 1 : 0;
  if (text.size() > at + 1 && text[at] == '0' &&
      std::isalnum(static_cast<unsigned char>(text[at + 1])))
    return "write " + text + " in decimal, without a leading 0";
  return "";
}

/// A finite decimal number for which `ok` holds; `rule` says which ("at least 1"), in --help
/// and errors.
inline CLI::Validator number_that(const std::string& rule, std::function<bool(double)> ok) {
  return {[rule, ok](std::string& text) -> std::string {
            double value = 0;
            if (!CLI::detail::lexical_cast(text, value)) return "not a number: " + text;
            if (std::string why = not_decimal(text); !why.empty()) return why;
            if (!std::isfinite(value)) return "must be a finite number, got " + text;
            // CLI11 saturates an integer flag beyond int64 at 2^63 - 1 without a word.
            if (std::fabs(value) >= 0x1p63) return "must be below 2^63, got " + text;
            return ok(value) ? "" : "must be " + rule + ", got " + text;
          },
          rule};
}

/// A seed: a whole decimal number in [0, 2^64) (CLI11 wraps -1 and 2^64 to 2^64 - 1).
inline CLI::Validator seed_value() {
  return {[](std::string& text) -> std::string {
            uint64_t value = 0;
            const char* end = text.data() + text.size();
            auto [stop, error] = std::from_chars(text.data(), end, value);
            if (error != std::errc() || stop != end || !not_decimal(text).empty())
              return "must be a whole decimal number in [0, 2^64), got " + text;
            return "";
          },
          "[0, 2^64)"};
}

/// The factor of --loss-scale static:N: a normal f32 number (GradScaler's range), or nothing.
inline std::optional<double> static_scale(const std::string& text) {
  double factor = 0;
  if (!text.starts_with("static:") || !CLI::detail::lexical_cast(text.substr(7), factor))
    return std::nullopt;
  if (!(factor >= std::numeric_limits<float>::min() && factor <= std::numeric_limits<float>::max()))
    return std::nullopt;
  return factor;
}

/// Why `text` is no path, or "": an empty --load would be taken as no --load at all.
inline std::string empty_path(const std::string& text) {
  return text.empty() ? "needs a path, got an empty one" : "";
}

/// A file or folder name: not empty.
inline CLI::Validator path_value() {
  return {[](std::string& text) { return empty_path(text); }, "PATH"};
}

/// Why a file or folder cannot be made inside `folder` (which must exist), or "".
inline std::string unwritable_folder(const std::filesystem::path& folder) {
  std::error_code error;
  if (!std::filesystem::exists(folder, error))
    return "the folder " + folder.string() + " does not exist";
  if (!std::filesystem::is_directory(folder, error)) return folder.string() + " is not a folder";
  if (::access(folder.c_str(), W_OK | X_OK) != 0)
    return "cannot write into " + folder.string() + ": " + std::strerror(errno);
  return "";
}

/// A folder the run writes into at its end (--export, --logdir): one that exists, or can be
/// made, writable. Checked with the flags, so that a bad one is found before training, not
/// after it (the trained model lost), and by every process of a distributed run alike.
inline CLI::Validator output_folder() {
  return {[](std::string& text) -> std::string {
            if (text.empty()) return empty_path(text);
            std::filesystem::path existing = text;  // its nearest part that exists
            std::error_code error;
            while (!existing.empty() && !std::filesystem::exists(existing, error))
              existing = existing.parent_path();
            return unwritable_folder(existing.empty() ? "." : existing);
          },
          "DIR"};
}

/// A file the run writes at its end (--save): not a folder, in a folder that exists, writable.
inline CLI::Validator output_file() {
  return {[](std::string& text) -> std::string {
            if (text.empty()) return empty_path(text);
            std::filesystem::path path = text;
            std::error_code error;
            if (std::filesystem::is_directory(path, error)) return text + " is a folder";
            std::filesystem::path folder = path.parent_path();
            return unwritable_folder(folder.empty() ? "." : folder);
          },
          "FILE"};
}

inline CLI::Validator at_least(double min) {
  return number_that("at least " + CLI::detail::to_string(min),
                     [min](double v) { return v >= min; });
}

inline CLI::Validator in_range(double min, double max) {
  return number_that(
      "in [" + CLI::detail::to_string(min) + ", " + CLI::detail::to_string(max) + "]",
      [min, max](double v) { return v >= min && v <= max; });
}

/// The training settings the examples share.
struct TrainingFlags {
  std::string policy = "fp32";
  std::string loss_scale = "none";  // none | static:N | dynamic
  uint64_t seed = 0;
  bool json_only = false;
  bool compile = true;  // the step through mt::compile (traced twice, then replayed)
  std::string logdir;   // TensorBoard event files of the run
};

/// --steps N, N >= 1.
inline void add_steps(CLI::App& app, int64_t& steps) {
  app.add_option("--steps", steps, "training steps")->check(at_least(1))->capture_default_str();
}

/// --logdir DIR.
inline void add_logdir(CLI::App& app, std::string& logdir) {
  app.add_option("--logdir", logdir, "write the run's TensorBoard event files into DIR")
      ->check(output_folder())
      ->type_name("DIR");
}

/// --policy, --loss-scale, --seed, --json, --[no-]compile and --logdir.
inline void add_training_flags(CLI::App& app, TrainingFlags& f) {
  app.add_option("--policy", f.policy, "precision policy")
      ->type_name("fp32|autocast-f16|autocast-bf16|pure-f16|pure-bf16")
      ->check(CLI::Validator(
          [](std::string& name) -> std::string {
            try {
              mt::policy_by_name(name);
              return "";
            } catch (const mt::Error& e) {
              return e.what();
            }
          },
          ""))
      ->capture_default_str();
  app.add_option("--loss-scale", f.loss_scale, "loss scaling")
      ->type_name("none|static:N|dynamic")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            if (text == "none" || text == "dynamic") return "";
            if (static_scale(text)) return "";
            return "must be none, static:N (2^-126 <= N <= 3.4e38, normal floats) or dynamic, "
                   "got '" +
                   text + "'";
          },
          ""))
      ->capture_default_str();
  app.add_option("--seed", f.seed, "seed of the weights, batches and sampling")
      ->check(seed_value())
      ->capture_default_str();
  app.add_flag("--json", f.json_only, "print only the JSON line of results");
  app.add_flag("--compile,!--no-compile", f.compile,
               "run the step through mt::compile (default) or trace it every step");
  add_logdir(app, f.logdir);
}

/// The scaler `loss_scale` (checked by add_training_flags) asks for.
inline mt::GradScalerOptions scaler_options(const std::string& loss_scale) {
  mt::GradScalerOptions scaling{.enabled = loss_scale != "none",
                                .dynamic = loss_scale == "dynamic"};
  if (std::optional<double> factor = static_scale(loss_scale)) scaling.init_scale = *factor;
  return scaling;
}

/// A command-line mistake the flags' own checks cannot see: one line, exit status 2.
[[noreturn]] inline void usage_error(const std::string& program, const std::string& problem) {
  std::fprintf(stderr, "%s: %s (see --help)\n", program.c_str(), problem.c_str());
  std::exit(2);
}

/// --distributed: data parallel over the processes mpirun started (--batch per process). Rank 0
/// alone prints, writes the log (--logdir: its own share of each batch's loss, as DDP scripts log)
/// and exports (--export: the trained model, and a training step of one process).
inline void add_distributed(CLI::App& app, bool& distributed) {
  app.add_flag("--distributed", distributed,
               "data parallel over the processes mpirun started (--batch per process)");
}

/// What --distributed does first: joins mpirun's processes (saying on stderr why a run is a
/// single process) and leaves standard output to rank 0, which alone prints.
inline void join_processes(const std::string& program) {
  mt::dist::World world = mt::dist::init();
  if (world.size == 1)
    std::fprintf(stderr, "%s --distributed: %s\n", program.c_str(), world.single_reason.c_str());
  if (world.rank != 0 && !std::freopen("/dev/null", "w", stdout)) {
    std::fprintf(stderr, "%s: cannot silence rank %d's output\n", program.c_str(), world.rank);
    std::exit(1);
  }
}

/// Ends a training example's JSON line with what they all report (the loss scaler, whether the
/// step was compiled and how often it replayed, the processes of a --distributed run) and
/// prints it.
template <typename CompileStats>
void print_json_line(nlohmann::ordered_json line, const mt::GradScaler& scaler, bool compiled,
                     const CompileStats& stats, bool distributed) {
  line["final_scale"] = scaler.get_scale();
  line["skipped_steps"] = scaler.skipped_steps();
  line["step"] = compiled ? "compiled" : "traced";
  line["replayed_steps"] = stats.replays;
  // The process's measured memory high-water mark (host values and workspace, plus device).
  line["peak_bytes"] = mt::execution_stats().memory_peak_bytes;
  if (distributed) line["world_size"] = static_cast<int64_t>(mt::dist::world_size());
  std::printf("%s\n", line.dump().c_str());
}

/// Parses argv: --help prints the flags and exits 0, a bad flag or value is usage_error.
inline void parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::ParseError& e) {
    usage_error(app.get_name(), e.what());
  }
}

}  // namespace examples
