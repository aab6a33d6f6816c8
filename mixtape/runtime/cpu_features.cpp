// mixtape/runtime/cpu_features.cpp -- x86 feature detection through GCC's __builtin_cpu_supports.
#include "mixtape/runtime/cpu_features.h"

#include <algorithm>
#include <string_view>

namespace mixtape {
namespace {

struct Feature {
  const char* name;
  bool present;
};

// __builtin_cpu_supports takes only string literals, hence one line per feature. Baseline x86-64
// (sse, sse2) is left out: no x86-64 CPU lacks it. The builtin checks XCR0 too, so a CPU whose
// OS does not save the AVX-512 or AMX registers counts as lacking them, as it must.
std::vector<Feature> feature_table() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#define MIXTAPE_FEATURE(name) \
  { name, __builtin_cpu_supports(name) != 0 }
  return {
      MIXTAPE_FEATURE("sse3"),
      MIXTAPE_FEATURE("ssse3"),
      MIXTAPE_FEATURE("sse4.1"),
      MIXTAPE_FEATURE("sse4.2"),
      MIXTAPE_FEATURE("popcnt"),
      MIXTAPE_FEATURE("lzcnt"),
      MIXTAPE_FEATURE("movbe"),
      MIXTAPE_FEATURE("bmi"),
      MIXTAPE_FEATURE("bmi2"),
      MIXTAPE_FEATURE("adx"),
      MIXTAPE_FEATURE("aes"),
      MIXTAPE_FEATURE("pclmul"),
      MIXTAPE_FEATURE("sha"),
      MIXTAPE_FEATURE("prfchw"),
      MIXTAPE_FEATURE("avx"),
      MIXTAPE_FEATURE("f16c"),
      MIXTAPE_FEATURE("fma"),
      MIXTAPE_FEATURE("avx2"),
      MIXTAPE_FEATURE("avxvnni"),
      MIXTAPE_FEATURE("gfni"),
      MIXTAPE_FEATURE("vaes"),
      MIXTAPE_FEATURE("vpclmulqdq"),
      MIXTAPE_FEATURE("avx512f"),
      MIXTAPE_FEATURE("avx512cd"),
      MIXTAPE_FEATURE("avx512bw"),
      MIXTAPE_FEATURE("avx512dq"),
      MIXTAPE_FEATURE("avx512vl"),
      MIXTAPE_FEATURE("avx512ifma"),
      MIXTAPE_FEATURE("avx512vbmi"),
      MIXTAPE_FEATURE("avx512vbmi2"),
      MIXTAPE_FEATURE("avx512vnni"),
      MIXTAPE_FEATURE("avx512bitalg"),
      MIXTAPE_FEATURE("avx512vpopcntdq"),
      MIXTAPE_FEATURE("avx512bf16"),
      MIXTAPE_FEATURE("avx512fp16"),
      MIXTAPE_FEATURE("amx-tile"),
      MIXTAPE_FEATURE("amx-int8"),
      MIXTAPE_FEATURE("amx-bf16"),
  };
#undef MIXTAPE_FEATURE
#else
  return {};
#endif
}

const std::vector<Feature>& features() {
  static const std::vector<Feature> table = feature_table();
  return table;
}

}  // namespace

std::vector<std::string> known_cpu_features() {
  std::vector<std::string> names;
  for (const Feature& f : features()) names.push_back(f.name);
  return names;
}

std::vector<std::string> host_cpu_features() {
  std::vector<std::string> present;
  for (const Feature& feature : features())
    if (feature.present) present.emplace_back(feature.name);
  return present;
}

std::vector<std::string> missing_cpu_features(const std::vector<std::string>& required) {
  std::vector<std::string> missing;
  for (const std::string& name : required) {
    auto known = std::find_if(features().begin(), features().end(),
                              [&](const Feature& f) { return std::string_view(f.name) == name; });
    if (known == features().end() || !known->present) missing.push_back(name);
  }
  return missing;
}

bool cpu_runs_x86_64_v4() {
  static const bool runs =
      missing_cpu_features({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}).empty();
  return runs;
}

}  // namespace mixtape
