// examples/progress_line.h -- the examples' progress line (step, loss, steps/s, ETA, loss scale),
// rewritten in place on a terminal, and their --logdir summary writer.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include <mixtape/mixtape.h>

namespace examples {

/// One line that shows how a long run is going, redrawn with \r at most ten times a second.
/// Off when stdout is not a terminal (logs and pipes get no carriage returns) or when the
/// example prints only its JSON line.
class ProgressLine {
 public:
  /// `label` (e.g. the run's name) starts the line.
  ProgressLine(int64_t total_steps, bool json_only, std::string label = "")
      : total_(total_steps),
        on_(!json_only && isatty(STDOUT_FILENO) != 0),
        label_(label.empty() ? "" : label + ": ") {}
  ~ProgressLine() { finish(); }
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  /// Whether update() would draw at this step: ask first, so that the loss (a host read, which
  /// waits for the step) is read only when it is shown.
  bool due(int64_t step) const {
    return on_ && (step == total_ || Clock::now() - last_ >= std::chrono::milliseconds(100));
  }
  /// Draws the line; scale <= 0 leaves the loss scale out (no scaler).
  void update(int64_t step, double loss, double scale = 0) {
    if (!on_) return;
    last_ = Clock::now();
    double seconds = std::chrono::duration<double>(last_ - start_).count();
    double rate = seconds > 0 ? static_cast<double>(step) / seconds : 0;
    double eta = rate > 0 ? static_cast<double>(total_ - step) / rate : 0;
    std::string line = fmt::format("{}step {}/{}  loss {:.4f}  {:.1f} steps/s  ETA {}", label_,
                                   step, total_, loss, rate, clock_time(eta));
    if (scale > 0) line += fmt::format("  scale {:g}", scale);
    // Padding clears what a longer previous line left.
    std::printf("\r%-*s", static_cast<int>(std::max(line.size(), width_)), line.c_str());
    width_ = line.size();
    std::fflush(stdout);
    drawn_ = true;
  }
  /// Ends the line (before other output), so the next print starts on a fresh one.
  void finish() {
    if (drawn_) std::printf("\n");
    drawn_ = false;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static std::string clock_time(double seconds) {
    auto s = static_cast<int64_t>(seconds + 0.5);
    return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                     : fmt::format("{}:{:02}", s / 60, s % 60);
  }
  int64_t total_;
  bool on_;
  std::string label_;
  bool drawn_ = false;
  size_t width_ = 0;
  Clock::time_point start_ = Clock::now(), last_{};
};

/// The writer behind --logdir DIR, or null without the flag.
inline std::unique_ptr<mixtape::SummaryWriter> open_logdir(const std::string& dir) {
  return dir.empty() ? nullptr : std::make_unique<mixtape::SummaryWriter>(dir);
}

}  // namespace examples
