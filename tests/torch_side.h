// tests/torch_side.h -- a test suite whose reference is a PyTorch script of tests/torch/, run
// once per suite on the files the C++ side wrote.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace torch_side {

namespace fs = std::filesystem;

inline constexpr const char* kPython = "/usr/bin/python3";
inline constexpr int kNoTorch = 77;  // the scripts' exit status when torch or numpy is missing

inline std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

struct Outcome {
  fs::path dir;       // the inputs the test wrote and the outputs torch wrote
  std::string skip;   // why torch did not run (no python, no torch)
  std::string error;  // writing the inputs or the Python run failed
};

/// A fixture for the tests of one PyTorch script. `Side` names the script
/// (`static constexpr const char* kScript`, a file of tests/torch/) and writes its inputs
/// (`static void write_inputs(const fs::path&)`); the script gets the folder as its argument.
template <typename Side>
class Suite : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    Outcome& run = state();
    if (!run.dir.empty() || !run.skip.empty()) return;
    if (::access(kPython, X_OK) != 0) {
      run.skip = std::string(kPython) + " not found; PyTorch parity not checked";
      return;
    }
    run.dir = fs::temp_directory_path() /
              (std::string("mixtape_") + Side::kScript + "_" + std::to_string(::getpid()));
    fs::remove_all(run.dir);
    fs::create_directories(run.dir);
    try {
      using Clock = std::chrono::steady_clock;
      auto start = Clock::now();
      Side::write_inputs(run.dir);
      auto written = Clock::now();
      fs::path script = fs::path(MIXTAPE_SOURCE_DIR) / "tests" / "torch" / Side::kScript;
      fs::path log = run.dir / "torch.log";
      std::string command = "OMP_NUM_THREADS=1 " + std::string(kPython) + " '" + script.string() +
                            "' '" + run.dir.string() + "' > '" + log.string() + "' 2>&1";
      int status = std::system(command.c_str());
      std::string output = read_text(log);
      while (!output.empty() && std::isspace(static_cast<unsigned char>(output.back())))
        output.pop_back();
      if (WIFEXITED(status) && WEXITSTATUS(status) == kNoTorch) {
        run.skip = std::string(kPython) + ": " + output + "; PyTorch parity not checked";
        return;
      }
      if (status != 0) run.error = "the torch side failed:\n" + output;
      std::chrono::duration<double> prepare = written - start, python = Clock::now() - written;
      std::printf("[  torch   ] inputs written in %.2f s; python run %.2f s: %s\n", prepare.count(),
                  python.count(), output.c_str());
    } catch (const std::exception& e) {
      run.error = std::string("writing the inputs failed: ") + e.what();
    }
  }

  static void TearDownTestSuite() {
    Outcome& run = state();
    if (!run.dir.empty()) fs::remove_all(run.dir);
    run = Outcome{};
  }

  static Outcome& state() {
    static Outcome run;
    return run;
  }

 protected:
  void SetUp() override {
    if (!state().skip.empty()) GTEST_SKIP() << state().skip;
    ASSERT_TRUE(state().error.empty()) << state().error;
  }
};

}  // namespace torch_side
