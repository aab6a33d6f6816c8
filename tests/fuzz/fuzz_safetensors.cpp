// tests/fuzz/fuzz_safetensors.cpp -- libFuzzer target for the safetensors reader, in memory and
// from a file (the path load_tensors and load_checkpoint read checkpoints through).
//
// Every input must end in a File or an mt::Error, never a crash, sanitizer report, other
// exception or hang; and reading it from a file must agree with parsing it in memory.
// With MIXTAPE_FUZZ_WRITE_SEEDS=<folder> the target instead writes its seed corpus there (files
// the library writes) and exits; tests/fuzz/run_fuzz.sh does both.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "mixtape/dsl/error.h"
#include "mixtape/runtime/safetensors.h"

namespace st = mixtape::safetensors;
using mixtape::DType;

namespace {

template <typename T>
std::vector<std::byte> bytes_of(std::vector<T> values) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// Files shaped like what save_checkpoint writes (module, optimizer and scaler entries, their
// metadata), plus every dtype, 0-d and empty tensors and metadata that needs escaping.
std::vector<st::File> seed_files() {
  std::vector<st::File> files;
  st::File checkpoint;
  checkpoint.tensors = {
      {"fc1.weight", DType::f32, {2, 3}, bytes_of<float>({-0.0809f, 1, 2, 3, 4, 5})},
      {"fc1.bias", DType::f32, {2}, bytes_of<float>({0.5f, -1})},
      {"optimizer.fc1.weight.exp_avg", DType::f32, {2, 3}, bytes_of<float>({0, 0, 0, 0, 0, 0})},
      {"optimizer.fc1.weight.exp_avg_sq", DType::f32, {2, 3}, bytes_of<float>({1, 1, 1, 1, 1, 1})},
      {"scaler.scale", DType::f32, {}, bytes_of<float>({65536})},
      {"scaler.growth_tracker", DType::i64, {}, bytes_of<int64_t>({7})},
  };
  checkpoint.metadata = {{"format", "mixtape-checkpoint-1"},
                         {"optimizer.steps", "12"},
                         {"optimizer.kind", "adamw"},
                         {"scaler.growth_factor", "2"}};
  files.push_back(checkpoint);
  st::File dtypes;
  dtypes.tensors = {
      {"f64", DType::f64, {2}, bytes_of<double>({0.1, -1e300})},
      {"f16", DType::f16, {}, bytes_of<uint16_t>({0x3E00})},
      {"bf16", DType::bf16, {2, 1}, bytes_of<uint16_t>({0x3F80, 0xBF00})},
      {"i32", DType::i32, {0}, {}},
      {"i64", DType::i64, {1}, bytes_of<int64_t>({std::numeric_limits<int64_t>::min()})},
      {"bool", DType::boolean, {2}, bytes_of<uint8_t>({1, 0})},
      {"empty", DType::f32, {0, 4}, {}},
  };
  dtypes.metadata = {{"note", "\u00fcn\u00efc\u00f6d\u00e9 \"quoted\"\n"}};
  files.push_back(dtypes);
  files.push_back(st::File{});
  return files;
}

void write_seeds(const std::string& folder) {
  std::vector<st::File> files = seed_files();
  for (size_t i = 0; i < files.size(); ++i)
    st::write(folder + "/seed" + std::to_string(i), files[i]);
}

bool same(const st::File& a, const st::File& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const st::TensorData &x = a.tensors[i], &y = b.tensors[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || x.bytes != y.bytes)
      return false;
  }
  return true;
}

// The file each input is read from: an in-memory file (no disk traffic), opened by its path
// /proc/self/fd/N as read() opens any path.
int scratch_fd = -1;
std::string scratch_path;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* folder = std::getenv("MIXTAPE_FUZZ_WRITE_SEEDS")) {
    write_seeds(folder);
    std::exit(0);
  }
  scratch_fd = ::memfd_create("mixtape_fuzz", MFD_CLOEXEC);
  if (scratch_fd < 0) std::abort();
  scratch_path = "/proc/self/fd/" + std::to_string(scratch_fd);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  std::optional<st::File> parsed;
  try {
    parsed = st::parse(bytes, "fuzz");
    // What was read writes back and reads back the same.
    if (!same(st::parse(st::serialize(*parsed), "again"), *parsed)) std::abort();
  } catch (const mixtape::Error&) {
  }

  if (::ftruncate(scratch_fd, 0) != 0 ||
      ::pwrite(scratch_fd, data, size, 0) != static_cast<ssize_t>(size))
    std::abort();
  std::optional<st::File> read;
  try {
    read = st::read(scratch_path);
  } catch (const mixtape::Error&) {
  }
  if (parsed.has_value() != read.has_value() || (parsed && !same(*parsed, *read))) std::abort();
  return 0;
}
