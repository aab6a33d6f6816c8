// tests/aot_test_util.h -- what the AOT tests share: a kernel table from an export's IR, an open
// artifact, the autocast scope of a policy name, and bit-for-bit comparisons of outputs and of
// checkpoints.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <mixtape/mixtape.h>

#include <fmt/format.h>

#include "examples/digits_model.h"
#include "mixtape/jit/aot_export.h"
#include "mixtape/jit/llvm_jit.h"
#include "mixtape/runtime/aot_runtime.h"
#include "mixtape/runtime/cpu_features.h"

namespace mixtape::aot_test {

namespace mt = mixtape;

inline std::string temp_dir(const std::string& what) {
  auto dir =
      std::filesystem::temp_directory_path() / fmt::format("mixtape_aot_{}_{}", what, getpid());
  std::filesystem::remove_all(dir);
  return dir.string();
}

// The artifact's kernel table, from the exported IR compiled by this process's JIT: the same
// object code the artifact's libraries hold, without building them.
// One variant, "native", for this CPU's features (`features`, which a test may change).
struct Table {
  std::vector<std::string> keys;
  std::vector<std::shared_ptr<const mt::JitKernel>> code;
  std::vector<mixtape_aot_kernel> entries;
  std::vector<std::string> features = mt::host_cpu_features();
  std::vector<const char*> feature_names;
  mixtape_aot_variant variant{};
  std::string manifest_xxh3;
  explicit Table(const mt::aot::Exported& exported) : manifest_xxh3(exported.manifest_xxh3) {
    for (const auto& k : exported.kernels) {
      keys.push_back(k.key);
      code.push_back(mt::LlvmJit::instance().load(k.symbol, k.llvm_ir));
    }
    for (size_t i = 0; i < keys.size(); ++i)
      entries.push_back({keys[i].c_str(), code[i]->function()});
    bind();
  }
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;
  // Points the variant at the current features and entries.
  const mixtape_aot_variant* bind() {
    feature_names.clear();
    for (const std::string& f : features) feature_names.push_back(f.c_str());
    variant = {"native", feature_names.data(), static_cast<int64_t>(feature_names.size()),
               entries.data(), static_cast<int64_t>(entries.size())};
    return &variant;
  }
};

// The digits MLP exported once (dynamic batch up to 16) into a temporary folder, with its kernel
// table: what the suites of bad-input tests open, copy and edit. The folder goes with it.
struct DigitsArtifact {
  std::unique_ptr<DigitsMLP> net;
  std::string dir;
  std::unique_ptr<Table> table;
  explicit DigitsArtifact(const std::string& what) : dir(temp_dir(what)) {
    mt::manual_seed(1);
    net = std::make_unique<DigitsMLP>();
    mt::aot::Options o{.name = "digits", .dynamic_batch = {.max = 16}, .module = net.get()};
    auto exported =
        mt::aot::export_function([this](const mt::Tensor& x) { return (*net)(x); },
                                 {mt::aot::input("x", {16, 64}, mt::f32)}, {"logits"}, dir, o);
    table = std::make_unique<Table>(exported);
  }
  DigitsArtifact(const DigitsArtifact&) = delete;
  DigitsArtifact& operator=(const DigitsArtifact&) = delete;
  ~DigitsArtifact() { std::filesystem::remove_all(dir); }
};

struct Model {
  mixtape_aot_model* m = nullptr;
  Model(const std::string& dir, const std::string& name, const Table& table,
        const char* device = "cpu") {
    int code = mixtape_aot_open(dir.c_str(), name.c_str(), table.manifest_xxh3.c_str(), device,
                                &table.variant, 1, &m);
    EXPECT_EQ(code, 0) << mixtape_aot_error(nullptr);
  }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  ~Model() { mixtape_aot_close(m); }
};

// The autocast scope of a test's policy name: "fp32" (none), "bf16" or "f16".
inline std::unique_ptr<mt::autocast> policy_scope(const std::string& policy) {
  if (policy == "bf16") return std::make_unique<mt::autocast>(mt::bf16);
  if (policy == "f16") return std::make_unique<mt::autocast>(mt::f16);
  return nullptr;
}

// The digits MLP's training step as the AOT tests export it: AdamW 1e-3 and a loss scaler
// (enabled for "f16") under a test's policy name. The model is made by the constructor, so seed
// the default generator first.
struct DigitsTrainer {
  std::string policy;
  DigitsMLP net;
  mt::AdamW opt{net.parameters(), {.lr = 1e-3}};
  mt::GradScaler scaler;
  explicit DigitsTrainer(const std::string& policy_name)
      : policy(policy_name), scaler({.init_scale = 1024, .enabled = policy_name == "f16"}) {}
  mt::Tensor step(const mt::Tensor& x, const mt::Tensor& y) {
    opt.zero_grad();
    mt::Tensor loss;
    {
      auto scope = policy_scope(policy);
      loss = mt::cross_entropy(net(x), y);
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    return loss;
  }
  auto step_function() {
    return [this](const mt::Tensor& x, const mt::Tensor& y) { return step(x, y); };
  }
};

// The index of the first element whose bytes differ, or the size when all are equal.
template <typename T>
size_t first_difference(const std::vector<T>& got, const std::vector<T>& expected) {
  if (got.size() != expected.size()) return 0;
  size_t first = 0;
  while (first < got.size() && std::memcmp(&got[first], &expected[first], sizeof(T)) == 0) ++first;
  return first;
}

// The two checkpoint files hold the same tensors, bit for bit, and the same metadata.
inline void expect_same_checkpoint(const std::string& saved, const std::string& reference) {
  mt::Metadata ours, theirs;
  auto a = mt::load_tensors(saved, &ours), b = mt::load_tensors(reference, &theirs);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    auto found = std::find_if(b.begin(), b.end(), [&](auto& e) { return e.first == a[i].first; });
    ASSERT_NE(found, b.end()) << a[i].first;
    EXPECT_EQ(a[i].second.dtype(), found->second.dtype()) << a[i].first;
    auto x = mt::cast(a[i].second, mt::f64).to_vector<double>();
    auto y = mt::cast(found->second, mt::f64).to_vector<double>();
    ASSERT_EQ(x.size(), y.size()) << a[i].first;
    EXPECT_EQ(first_difference(x, y), x.size()) << a[i].first;
  }
  std::sort(ours.begin(), ours.end());
  std::sort(theirs.begin(), theirs.end());
  EXPECT_EQ(ours, theirs);
}

}  // namespace mixtape::aot_test
