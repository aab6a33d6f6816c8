// tests/test_cpu_features.cpp -- host CPU feature detection against the kernel's /proc/cpuinfo.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "mixtape/runtime/cpu_features.h"

namespace mt = mixtape;

namespace {

// LLVM's name of each feature in the table -> Linux's flag in /proc/cpuinfo.
const std::map<std::string, std::string> linux_flag = {
    {"sse3", "pni"},
    {"ssse3", "ssse3"},
    {"sse4.1", "sse4_1"},
    {"sse4.2", "sse4_2"},
    {"popcnt", "popcnt"},
    {"lzcnt", "abm"},
    {"movbe", "movbe"},
    {"bmi", "bmi1"},
    {"bmi2", "bmi2"},
    {"adx", "adx"},
    {"aes", "aes"},
    {"pclmul", "pclmulqdq"},
    {"sha", "sha_ni"},
    {"prfchw", "3dnowprefetch"},
    {"avx", "avx"},
    {"f16c", "f16c"},
    {"fma", "fma"},
    {"avx2", "avx2"},
    {"avxvnni", "avx_vnni"},
    {"gfni", "gfni"},
    {"vaes", "vaes"},
    {"vpclmulqdq", "vpclmulqdq"},
    {"avx512f", "avx512f"},
    {"avx512cd", "avx512cd"},
    {"avx512bw", "avx512bw"},
    {"avx512dq", "avx512dq"},
    {"avx512vl", "avx512vl"},
    {"avx512ifma", "avx512ifma"},
    {"avx512vbmi", "avx512vbmi"},
    {"avx512vbmi2", "avx512_vbmi2"},
    {"avx512vnni", "avx512_vnni"},
    {"avx512bitalg", "avx512_bitalg"},
    {"avx512vpopcntdq", "avx512_vpopcntdq"},
    {"avx512bf16", "avx512_bf16"},
    {"avx512fp16", "avx512_fp16"},
    {"amx-tile", "amx_tile"},
    {"amx-int8", "amx_int8"},
    {"amx-bf16", "amx_bf16"},
};

std::set<std::string> cpuinfo_flags() {
  std::ifstream file("/proc/cpuinfo");
  std::string line;
  while (std::getline(file, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string word; words >> word;) flags.insert(word);
    return flags;
  }
  return {};
}

}  // namespace

TEST(CpuFeatures, AgreeWithProcCpuinfo) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "features are detected on x86-64 only";
#endif
  std::set<std::string> flags = cpuinfo_flags();
  ASSERT_FALSE(flags.empty()) << "no flags line in /proc/cpuinfo";
  std::set<std::string> expected;
  for (const auto& [feature, flag] : linux_flag)
    if (flags.contains(flag)) expected.insert(feature);
  std::vector<std::string> host = mt::host_cpu_features();
  std::set<std::string> got(host.begin(), host.end());
  EXPECT_EQ(got.size(), host.size()) << "a feature is listed twice";
  EXPECT_EQ(got, expected);
  for (const std::string& feature : host) EXPECT_TRUE(linux_flag.contains(feature)) << feature;
}

TEST(CpuFeatures, MissingAreThoseTheCpuLacksAndUnknownNames) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "features are detected on x86-64 only";
#endif
  std::set<std::string> flags = cpuinfo_flags();
  std::vector<std::string> all, lacking;
  for (const auto& [feature, flag] : linux_flag) {
    all.push_back(feature);
    if (!flags.contains(flag)) lacking.push_back(feature);
  }
  all.push_back("avx10.9-9000");  // a name this build does not know: it cannot be checked
  lacking.push_back("avx10.9-9000");
  EXPECT_EQ(mt::missing_cpu_features(all), lacking);
  EXPECT_TRUE(mt::missing_cpu_features(mt::host_cpu_features()).empty());
  EXPECT_TRUE(mt::missing_cpu_features({}).empty());
}
