// tests/test_util.h -- helpers shared by the test files.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/tensor.h"

/// A fixture whose every test has a fresh folder of its own, removed after it; path(name) names
/// a file in it.
class TestWithFolder : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("mixtape_test_" + std::string(info->test_suite_name()) + "_" +
            std::to_string(::getpid()) + "_" + info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::filesystem::path dir_;
};

/// Expects `statement` to throw mt::Error whose message contains every given fragment.
#define EXPECT_MT_ERROR(statement, ...)                                         \
  do {                                                                          \
    try {                                                                       \
      statement;                                                                \
      ADD_FAILURE() << "no mt::Error from " #statement;                         \
    } catch (const ::mixtape::Error& error) {                                   \
      for (const std::string& fragment : std::vector<std::string>{__VA_ARGS__}) \
        EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)  \
            << "missing \"" << fragment << "\" in: " << error.what();           \
    }                                                                           \
  } while (0)

/// Waits up to `limit` for the child process to end: its exit status, 128 + the signal that
/// killed it, or -1 when it had not ended by then (a hang: it is killed and reaped).
inline int wait_for_child(pid_t child, std::chrono::milliseconds limit) {
  int status = 0;
  for (auto waited = std::chrono::milliseconds(0); waited < limit;
       waited += std::chrono::milliseconds(10)) {
    if (::waitpid(child, &status, WNOHANG) == child)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    ::usleep(10'000);
  }
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  return -1;
}

/// f32 values rounded to nearest even in `dtype` and widened back.
/// The shard file of process `rank` (0-based) of `world` in the sharded checkpoint folder `dir`
/// (its name carries the save's id): its path, or "" where there is none or more than one.
inline std::string shard_file(const std::string& dir, int rank, int world) {
  char suffix[64];
  std::snprintf(suffix, sizeof suffix, "-%05d-of-%05d.safetensors", rank + 1, world);
  std::string found;
  int count = 0;
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ignored)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("checkpoint-") && name.ends_with(suffix)) {
      found = entry.path().string();
      ++count;
    }
  }
  return count == 1 ? found : "";
}

inline std::vector<float> rounded_to(const std::vector<float>& values, ::mixtape::DType dtype) {
  ::mixtape::Tensor t = ::mixtape::tensor(values, {static_cast<int64_t>(values.size())});
  return ::mixtape::cast(::mixtape::cast(t, dtype), ::mixtape::f32).to_vector<float>();
}

/// A float tensor's values widened (exactly) to f32, as bit patterns: what tests that expect two
/// runs to agree bit for bit compare.
inline std::vector<uint32_t> f32_bits(const ::mixtape::Tensor& t) {
  std::vector<uint32_t> bits;
  for (float v : ::mixtape::cast(t, ::mixtape::f32).to_vector<float>())
    bits.push_back(std::bit_cast<uint32_t>(v));
  return bits;
}
