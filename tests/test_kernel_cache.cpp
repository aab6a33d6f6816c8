// tests/test_kernel_cache.cpp -- the 128-bit hash and the kernel cache (disk, processes, damage).
// Hash: pinned values, framing, collisions, avalanche. Cache: round trips across instances and
// processes, corrupt entries, unusable directories, the environment, concurrency, atomic writes;
// trust (forged entries, unsafe folders, links, FIFOs, huge files, the key file, read-only
// folders); the memory and disk caps.
#include <fmt/format.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>
#include <csignal>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "mixtape/codegen/hash.h"
#include "mixtape/codegen/kernel_cache.h"
#include "mixtape/codegen/lru_cache.h"

namespace mt = mixtape;
namespace fs = std::filesystem;

namespace {

std::span<const std::byte> bytes_of(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

std::vector<std::byte> random_bytes(size_t count, uint32_t seed) {
  std::mt19937 generator(seed);
  std::vector<std::byte> bytes(count);
  for (std::byte& byte : bytes) byte = std::byte(generator() & 0xFF);
  return bytes;
}

int differing_bits(const mt::Hash128& x, const mt::Hash128& y) {
  return std::popcount(x.lo ^ y.lo) + std::popcount(x.hi ^ y.hi);
}

// ---------------------------------------------------------------------------------------------
// Hash

// XXH3-128 as computed by Python's xxhash package (python3-xxhash), an independent implementation;
// the framed fields are b"s" + u64le(6) + b"matmul" + b"i" + i64le(-3) + b"d" + f64le(2.5) + b"i" +
// u64le(7). Cache file names depend on these values, so a change here orphans every cache on disk
// and must be a deliberate format change.
TEST(Hash, IsXxh3Of128BitsWithTypedFraming) {
  EXPECT_EQ(mt::hash_string("").hex(), "99aa06d3014798d86001c324468d497f");
  EXPECT_EQ(mt::hash_string("a").hex(), "a96faf705af16834e6c632b61e964e1f");
  EXPECT_EQ(mt::hash_string("mixtape kernel cache").hex(), "a88b2c88b58a18189e4cae83c81e3f63");
  std::vector<std::byte> counting(1000);
  for (size_t i = 0; i < counting.size(); ++i) counting[i] = std::byte(i * 7 % 251);
  EXPECT_EQ(mt::hash_bytes(counting).hex(), "5ed35fc6b4f0ef20d1eb8367bf3294e7");
  mt::Hasher fields;
  fields.update("matmul").update(int64_t{-3}).update(2.5).update(uint8_t{7});
  EXPECT_EQ(fields.finish().hex(), "e481f0689ebadcc64009d4a7e0d75587");
}

TEST(Hash, HexIsHighWordThenLowWordInLowercase) {
  EXPECT_EQ((mt::Hash128{0x1, 0xABCDEF}).hex(), "0000000000abcdef0000000000000001");
  EXPECT_EQ(mt::hash_string("x").hex().size(), 32u);
}

TEST(Hash, IncrementalEqualsOneShotForEverySplit) {
  for (size_t length : {0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 200}) {
    std::vector<std::byte> data = random_bytes(length, static_cast<uint32_t>(length));
    mt::Hash128 whole = mt::hash_bytes(data);
    for (size_t first = 0; first <= length; ++first) {
      for (size_t second = first; second <= length; second += 3) {
        mt::Hasher pieces;
        std::span<const std::byte> span(data);
        pieces.update_bytes(span.subspan(0, first));
        pieces.update_bytes(span.subspan(first, second - first));
        pieces.update_bytes(span.subspan(second));
        ASSERT_EQ(pieces.finish(), whole) << length << " split at " << first << ", " << second;
      }
    }
    mt::Hasher byte_by_byte;
    for (std::byte byte : data) byte_by_byte.update_bytes(std::span(&byte, 1));
    EXPECT_EQ(byte_by_byte.finish(), whole);
  }
  EXPECT_EQ(mt::hash_string("kernel"), mt::hash_bytes(bytes_of("kernel")));
}

TEST(Hash, FinishDoesNotDisturbTheHasher) {
  mt::Hasher hasher;
  hasher.update_bytes(bytes_of("abc"));
  mt::Hash128 early = hasher.finish();
  EXPECT_EQ(hasher.finish(), early);
  hasher.update_bytes(bytes_of("def"));
  EXPECT_EQ(hasher.finish(), mt::hash_string("abcdef"));
  EXPECT_NE(hasher.finish(), early);
}

TEST(Hash, DistinctInputsGiveDistinctHashesInBothHalves) {
  std::vector<std::string> inputs;
  inputs.push_back("");
  for (int a = 0; a < 256; ++a) {
    inputs.push_back(std::string(1, char(a)));
    for (int b = 0; b < 256; ++b) inputs.push_back(std::string{char(a), char(b)});
  }
  for (size_t zeros = 3; zeros <= 80; ++zeros) inputs.push_back(std::string(zeros, '\0'));
  for (int number = 0; number < 100'000; ++number) inputs.push_back(std::to_string(number) + "th");
  ASSERT_EQ(std::unordered_set<std::string>(inputs.begin(), inputs.end()).size(), inputs.size());
  std::unordered_set<uint64_t> low_halves, high_halves;
  for (const std::string& input : inputs) {
    mt::Hash128 hash = mt::hash_string(input);
    low_halves.insert(hash.lo);
    high_halves.insert(hash.hi);
  }
  // 166k inputs into 2^64 values: an honest collision has probability ~1e-9.
  EXPECT_EQ(low_halves.size(), inputs.size());
  EXPECT_EQ(high_halves.size(), inputs.size());
}

// Flipping any one input bit should flip each output bit with probability 1/2.
TEST(Hash, SingleBitFlipsAvalancheOverAllOutputBits) {
  for (size_t length : {3, 8, 64}) {
    std::vector<int64_t> flips_per_output_bit(128, 0);
    int64_t trials = 0;
    int fewest_changed_bits = 128;
    for (uint32_t sample = 0; sample < 200; ++sample) {
      std::vector<std::byte> data = random_bytes(length, 1000 + sample);
      mt::Hash128 original = mt::hash_bytes(data);
      for (size_t bit = 0; bit < 8 * length; ++bit) {
        data[bit / 8] ^= std::byte(1u << (bit % 8));
        mt::Hash128 flipped = mt::hash_bytes(data);
        data[bit / 8] ^= std::byte(1u << (bit % 8));
        fewest_changed_bits = std::min(fewest_changed_bits, differing_bits(original, flipped));
        for (int out = 0; out < 64; ++out) {
          flips_per_output_bit[out] += ((original.lo ^ flipped.lo) >> out) & 1;
          flips_per_output_bit[64 + out] += ((original.hi ^ flipped.hi) >> out) & 1;
        }
        ++trials;
      }
    }
    for (int out = 0; out < 128; ++out) {
      double rate = double(flips_per_output_bit[out]) / double(trials);
      EXPECT_GT(rate, 0.45) << "length " << length << " output bit " << out;
      EXPECT_LT(rate, 0.55) << "length " << length << " output bit " << out;
    }
    EXPECT_GE(fewest_changed_bits, 30) << "length " << length;
  }
}

TEST(Hash, TypedUpdatesFrameTheirFields) {
  auto digest = [](const std::function<void(mt::Hasher&)>& feed) {
    mt::Hasher hasher;
    feed(hasher);
    return hasher.finish();
  };
  EXPECT_NE(digest([](mt::Hasher& h) { h.update("ab").update("c"); }),
            digest([](mt::Hasher& h) { h.update("a").update("bc"); }));
  EXPECT_NE(digest([](mt::Hasher& h) { h.update(""); }), digest([](mt::Hasher&) {}));
  EXPECT_NE(digest([](mt::Hasher& h) { h.update(""); }),
            digest([](mt::Hasher& h) { h.update("").update(""); }));
  EXPECT_NE(digest([](mt::Hasher& h) { h.update(1); }),
            digest([](mt::Hasher& h) { h.update(1.0); }));
  EXPECT_NE(digest([](mt::Hasher& h) { h.update(0.0); }),
            digest([](mt::Hasher& h) { h.update(-0.0); }));
  EXPECT_NE(digest([](mt::Hasher& h) { h.update(1).update(2); }),
            digest([](mt::Hasher& h) { h.update(2).update(1); }));
  EXPECT_NE(digest([](mt::Hasher& h) { h.update("x"); }), mt::hash_string("x"));
  // Integers hash by value, whatever their type.
  EXPECT_EQ(digest([](mt::Hasher& h) { h.update(int32_t{-5}); }),
            digest([](mt::Hasher& h) { h.update(int64_t{-5}); }));
  EXPECT_EQ(digest([](mt::Hasher& h) { h.update(uint16_t{9}); }),
            digest([](mt::Hasher& h) { h.update(size_t{9}); }));
  enum class Backend : uint8_t { cpu = 1, cuda = 2 };
  EXPECT_EQ(digest([](mt::Hasher& h) { h.update(Backend::cuda); }),
            digest([](mt::Hasher& h) { h.update(2); }));
  EXPECT_EQ(digest([](mt::Hasher& h) { h.update(std::string("s")); }),
            digest([](mt::Hasher& h) { h.update("s"); }));
  EXPECT_EQ(digest([](mt::Hasher& h) { h.update(1.5f); }),
            digest([](mt::Hasher& h) { h.update(1.5); }));
}

// ---------------------------------------------------------------------------------------------
// Kernel cache helpers

class TemporaryDirectory {
 public:
  TemporaryDirectory() {
    std::string pattern = (fs::temp_directory_path() / "mixtape-kernel-cache-XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
    EXPECT_FALSE(path_.empty());
  }
  ~TemporaryDirectory() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Sets or clears environment variables for one test and restores them afterwards.
class ScopedEnvironment {
 public:
  void set(const std::string& name, const char* value) {
    const char* old = std::getenv(name.c_str());
    saved_.push_back({name, old ? std::optional<std::string>(old) : std::nullopt});
    if (value)
      ::setenv(name.c_str(), value, 1);
    else
      ::unsetenv(name.c_str());
  }
  ~ScopedEnvironment() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second)
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else
        ::unsetenv(it->first.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

std::vector<std::byte> object_for(std::string_view key, size_t size = 300) {
  std::vector<std::byte> object(size);
  uint64_t state = mt::hash_string(key).lo;
  for (std::byte& byte : object) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    byte = std::byte(state >> 56);
  }
  return object;
}

std::vector<std::byte> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::transform(chars.begin(), chars.end(), bytes.begin(), [](char c) { return std::byte(c); });
  return bytes;
}

void write_file(const std::string& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::string> directory_entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

bool only_entry_files(const std::string& dir) {
  for (const std::string& name : directory_entries(dir))
    if (name.size() != 32 + 5 || !name.ends_with(".mtkc")) return false;
  return true;
}

// Layout of an entry (see kernel_cache.cpp): magic, u32 version, u64 key length, u64 payload
// length, then key and payload, then a 32-byte HMAC-SHA256 of all that.
constexpr size_t header_bytes = 24;
constexpr size_t mac_bytes = 32;

// ---------------------------------------------------------------------------------------------
// Kernel cache

TEST(KernelCache, StoresAndLoadsInAFreshDirectory) {
  TemporaryDirectory dir;
  std::string cache_dir = dir.path() + "/nested/cache";  // created on demand
  mt::KernelCache cache(cache_dir);
  ASSERT_TRUE(cache.disk_enabled());
  EXPECT_EQ(cache.directory(), cache_dir);

  EXPECT_EQ(cache.load("kernel-a"), std::nullopt);
  std::vector<std::byte> object = object_for("kernel-a");
  cache.store("kernel-a", object);
  EXPECT_EQ(cache.load("kernel-a"), object);
  EXPECT_EQ(cache.load("kernel-b"), std::nullopt);

  std::string path = cache.entry_path("kernel-a");
  ASSERT_TRUE(fs::is_regular_file(path)) << path;
  EXPECT_EQ(fs::path(path).parent_path(), fs::path(cache_dir));
  std::vector<std::byte> file = read_file(path);
  ASSERT_EQ(file.size(), header_bytes + 8 + object.size() + mac_bytes);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file.data()), 4), "MTKC");
  EXPECT_TRUE(std::equal(object.begin(), object.end(), file.end() - mac_bytes - object.size()));

  // An empty object and one holding every byte value survive too; a store replaces.
  cache.store("empty", {});
  EXPECT_EQ(cache.load("empty"), std::vector<std::byte>{});
  std::vector<std::byte> every_byte(256);
  for (int i = 0; i < 256; ++i) every_byte[i] = std::byte(i);
  cache.store("kernel-a", every_byte);
  EXPECT_EQ(cache.load("kernel-a"), every_byte);

  mt::KernelCache::Stats stats = cache.stats();
  EXPECT_EQ(stats.memory_hits, 3);
  EXPECT_EQ(stats.disk_hits, 0);
  EXPECT_EQ(stats.misses, 2);
  EXPECT_EQ(stats.stores, 3);
  EXPECT_EQ(stats.corrupt_entries, 0);
  EXPECT_TRUE(only_entry_files(cache_dir));
  EXPECT_EQ(directory_entries(cache_dir).size(), 2u);
}

TEST(KernelCache, ASecondInstanceOnTheSameDirectoryGetsDiskHits) {
  TemporaryDirectory dir;
  std::string long_key(5000, 'k');  // keys are stored whole, however long
  {
    mt::KernelCache writer(dir.path());
    writer.store("kernel-a", object_for("kernel-a"));
    writer.store(long_key, object_for(long_key, 100'000));
  }
  mt::KernelCache reader(dir.path());
  EXPECT_EQ(reader.load("kernel-a"), object_for("kernel-a"));
  EXPECT_EQ(reader.load(long_key), object_for(long_key, 100'000));
  EXPECT_EQ(reader.load("kernel-a"), object_for("kernel-a"));
  EXPECT_EQ(reader.load("never-stored"), std::nullopt);
  mt::KernelCache::Stats stats = reader.stats();
  EXPECT_EQ(stats.disk_hits, 2);
  EXPECT_EQ(stats.memory_hits, 1);
  EXPECT_EQ(stats.misses, 1);
  EXPECT_EQ(stats.stores, 0);

  reader.clear_memory();
  EXPECT_EQ(reader.load("kernel-a"), object_for("kernel-a"));
  EXPECT_EQ(reader.stats().disk_hits, 3);
}

// A load that could not open an entry for want of descriptors (EMFILE) called it corrupt and
// deleted it: a good entry lost to a passing shortage. It is a miss now, and the entry stays.
TEST(KernelCache, AnEntryThatCannotBeOpenedNowIsKept) {
  TemporaryDirectory dir;
  { mt::KernelCache(dir.path()).store("kernel-a", object_for("kernel-a")); }
  mt::KernelCache reader(dir.path());
  struct rlimit before {};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &before), 0);
  std::vector<int> held;
  struct rlimit tight = before;
  tight.rlim_cur = 256;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
  for (int fd; (fd = ::dup(0)) >= 0;) held.push_back(fd);
  std::optional<std::vector<std::byte>> during = reader.load("kernel-a");
  for (int fd : held) ::close(fd);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &before), 0);
  EXPECT_EQ(during, std::nullopt);
  EXPECT_EQ(reader.stats().corrupt_entries, 0);
  EXPECT_EQ(reader.load("kernel-a"), object_for("kernel-a")) << "the entry is still there";
}

// One entry larger than the whole memory budget emptied the in-memory cache (the others were
// evicted before it was found not to fit, then it was dropped too).
TEST(LruCache, AnEntryLargerThanTheBudgetLeavesTheOthers) {
  mt::LruCache<std::string, int> cache(100);
  cache.put("a", 1, 30);
  cache.put("b", 2, 30);
  cache.put("huge", 3, 101);
  EXPECT_EQ(cache.find(std::string("huge")), nullptr);
  ASSERT_NE(cache.find(std::string("a")), nullptr);
  ASSERT_NE(cache.find(std::string("b")), nullptr);
}

// A forked child is a real second process: its own pid, memory and file descriptors.
TEST(KernelCache, SeparateProcessesShareEntries) {
  TemporaryDirectory dir;
  {
    mt::KernelCache parent(dir.path());
    parent.store("from-parent", object_for("from-parent"));
  }
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    mt::KernelCache cache(dir.path());
    bool read_parent_entry =
        cache.load("from-parent") == object_for("from-parent") && cache.stats().disk_hits == 1;
    cache.store("from-child", object_for("from-child"));
    ::_exit(read_parent_entry ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child did not read the parent's entry";
  mt::KernelCache again(dir.path());
  EXPECT_EQ(again.load("from-child"), object_for("from-child"));
  EXPECT_EQ(again.stats().disk_hits, 1);
}

// Processes racing to write the same entries (as parallel test runs or training jobs do) must
// leave only complete, valid entries and no temporary files.
TEST(KernelCache, ConcurrentProcessesAndThreadsLeaveOnlyValidEntries) {
  TemporaryDirectory dir;
  constexpr int processes = 3, threads = 3, keys = 12, rounds = 5;
  auto hammer = [&](int worker) {
    mt::KernelCache cache(dir.path());
    std::vector<std::thread> pool;
    bool all_loads_valid = true;
    std::mutex result_mutex;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        for (int round = 0; round < rounds; ++round) {
          for (int k = 0; k < keys; ++k) {
            int key_index = (k + t + worker) % keys;
            std::string key = "shared-" + std::to_string(key_index);
            std::vector<std::byte> object = object_for(key, 2000 + 100 * key_index);
            cache.store(key, object);
            if (round % 2 == 1) cache.clear_memory();
            if (cache.load(key) != object) {
              std::lock_guard lock(result_mutex);
              all_loads_valid = false;
            }
          }
        }
      });
    }
    for (std::thread& thread : pool) thread.join();
    return all_loads_valid && cache.stats().corrupt_entries == 0;
  };
  std::vector<pid_t> children;
  for (int worker = 0; worker < processes; ++worker) {
    pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) ::_exit(hammer(worker) ? 0 : 1);
    children.push_back(child);
  }
  EXPECT_TRUE(hammer(processes));
  for (pid_t child : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  EXPECT_TRUE(only_entry_files(dir.path()));
  EXPECT_EQ(directory_entries(dir.path()).size(), size_t(keys));
  mt::KernelCache reader(dir.path());
  for (int k = 0; k < keys; ++k) {
    std::string key = "shared-" + std::to_string(k);
    EXPECT_EQ(reader.load(key), object_for(key, 2000 + 100 * k)) << key;
  }
  EXPECT_EQ(reader.stats().disk_hits, keys);
}

struct Corruption {
  std::string name;
  std::string reason_fragment;
  std::function<void(std::vector<std::byte>& file, const std::vector<std::byte>& other_entry)>
      apply;
};

std::vector<Corruption> corruptions() {
  return {
      {"empty file", "truncated: 0 bytes", [](auto& file, auto&) { file.clear(); }},
      {"truncated header", "truncated: 20 bytes", [](auto& file, auto&) { file.resize(20); }},
      {"truncated payload", "truncated: header promises",
       [](auto& file, auto&) { file.pop_back(); }},
      {"trailing bytes", "1 unexpected bytes", [](auto& file, auto&) { file.push_back({}); }},
      {"flipped payload byte", "authentication failed",
       [](auto& file, auto&) { file[file.size() - mac_bytes - 5] ^= std::byte{0x10}; }},
      {"flipped MAC byte", "authentication failed",
       [](auto& file, auto&) { file[file.size() - 3] ^= std::byte{0x01}; }},
      {"wrong magic", "bad magic", [](auto& file, auto&) { file[0] = std::byte{'X'}; }},
      {"older format version", "format version 1, expected 2",
       [](auto& file, auto&) { file[4] = std::byte{1}; }},
      {"huge key length", "truncated: header promises",
       [](auto& file, auto&) { file[15] = std::byte{0x7F}; }},
      {"huge payload length", "truncated: header promises",
       [](auto& file, auto&) { file[23] = std::byte{0xFF}; }},
      {"same-length foreign key", "authentication failed",
       [](auto& file, auto&) { file[header_bytes] ^= std::byte{0x01}; }},
      {"another key's entry (a hash collision)", "different key",
       [](auto& file, auto& other) { file = other; }},
  };
}

TEST(KernelCache, CorruptEntriesAreReportedDeletedAndRepaired) {
  for (const Corruption& corruption : corruptions()) {
    SCOPED_TRACE(corruption.name);
    TemporaryDirectory dir;
    std::string key = "kernel-key";
    std::string other_key = "a-different-key";
    std::string path, other_path;
    {
      mt::KernelCache writer(dir.path());
      writer.store(key, object_for(key));
      writer.store(other_key, object_for(other_key, 50));
      path = writer.entry_path(key);
      other_path = writer.entry_path(other_key);
    }
    std::vector<std::byte> file = read_file(path);
    corruption.apply(file, read_file(other_path));
    write_file(path, file);

    mt::KernelCache reader(dir.path());
    testing::internal::CaptureStderr();
    std::optional<std::vector<std::byte>> loaded = reader.load(key);
    std::string warning = testing::internal::GetCapturedStderr();
    EXPECT_EQ(loaded, std::nullopt);
    EXPECT_EQ(reader.stats().corrupt_entries, 1);
    EXPECT_EQ(reader.stats().misses, 1);
    std::string expected_start = "mixtape: warning: kernel cache entry " + path + " is corrupt (";
    EXPECT_TRUE(warning.starts_with(expected_start)) << warning;
    EXPECT_TRUE(warning.ends_with("); recompiling\n")) << warning;
    EXPECT_NE(warning.find(corruption.reason_fragment), std::string::npos) << warning;
    EXPECT_EQ(std::count(warning.begin(), warning.end(), '\n'), 1) << warning;
    EXPECT_FALSE(fs::exists(path)) << "the corrupt entry was not deleted";

    // Gone now: a plain miss, silently. The other entry is untouched.
    testing::internal::CaptureStderr();
    EXPECT_EQ(reader.load(key), std::nullopt);
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
    EXPECT_EQ(reader.load(other_key), object_for(other_key, 50));

    // A store repairs it for everyone.
    reader.store(key, object_for(key));
    mt::KernelCache later(dir.path());
    EXPECT_EQ(later.load(key), object_for(key));
    EXPECT_EQ(later.stats().disk_hits, 1);
    EXPECT_EQ(later.stats().corrupt_entries, 0);
  }
}

TEST(KernelCache, AnEntryIsWarnedAboutOnlyOnce) {
  TemporaryDirectory dir;
  mt::KernelCache writer(dir.path());
  writer.store("k", object_for("k"));
  std::string path = writer.entry_path("k");
  std::vector<std::byte> good = read_file(path);
  std::vector<std::byte> bad = good;
  bad.back() ^= std::byte{1};

  mt::KernelCache reader(dir.path());
  testing::internal::CaptureStderr();
  for (int attempt = 0; attempt < 3; ++attempt) {
    write_file(path, bad);
    EXPECT_EQ(reader.load("k"), std::nullopt);
  }
  std::string warnings = testing::internal::GetCapturedStderr();
  EXPECT_EQ(std::count(warnings.begin(), warnings.end(), '\n'), 1) << warnings;
  EXPECT_EQ(reader.stats().corrupt_entries, 3);
  write_file(path, good);
  EXPECT_EQ(reader.load("k"), object_for("k"));
}

void expect_memory_only_with_warning(const std::string& dir) {
  SCOPED_TRACE(dir);
  testing::internal::CaptureStderr();
  mt::KernelCache cache(dir);
  std::string warning = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(cache.disk_enabled());
  EXPECT_EQ(cache.directory(), dir);
  EXPECT_EQ(cache.entry_path("k"), "");
  std::string expected_start =
      "mixtape: warning: kernel cache directory " + dir + " cannot be used (";
  EXPECT_TRUE(warning.starts_with(expected_start)) << warning;
  EXPECT_TRUE(warning.ends_with("); caching in memory only\n")) << warning;
  EXPECT_EQ(std::count(warning.begin(), warning.end(), '\n'), 1) << warning;

  testing::internal::CaptureStderr();
  EXPECT_EQ(cache.load("k"), std::nullopt);
  cache.store("k", object_for("k"));
  EXPECT_EQ(cache.load("k"), object_for("k"));
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(cache.stats().memory_hits, 1);
  EXPECT_EQ(cache.stats().misses, 1);
  EXPECT_EQ(cache.stats().stores, 1);
}

// Tests run as root, where permission bits do not stop writes, so unusable directories are made
// from paths that no user can create.
TEST(KernelCache, AnUnusableDirectoryMeansMemoryOnly) {
  TemporaryDirectory dir;
  std::string regular_file = dir.path() + "/a-file";
  write_file(regular_file, object_for("x", 10));
  expect_memory_only_with_warning(regular_file);
  expect_memory_only_with_warning(regular_file + "/cache");
  expect_memory_only_with_warning(regular_file + "/deeper/cache");
  expect_memory_only_with_warning("/proc/mixtape-kernel-cache-test");
  expect_memory_only_with_warning("/proc/self/mixtape-kernel-cache-test/sub");
  EXPECT_EQ(directory_entries(dir.path()), std::vector<std::string>{"a-file"});
}

TEST(KernelCache, AnUnwritableEntryIsKeptInMemory) {
  TemporaryDirectory dir;
  mt::KernelCache cache(dir.path());
  std::string path = cache.entry_path("blocked");
  fs::create_directories(path + "/occupied");  // rename() cannot replace a non-empty directory
  testing::internal::CaptureStderr();
  cache.store("blocked", object_for("blocked"));
  cache.store("blocked", object_for("blocked"));
  std::string warning = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(warning.starts_with("mixtape: warning: kernel cache entry " + path +
                                  " could not be written ("))
      << warning;
  EXPECT_EQ(std::count(warning.begin(), warning.end(), '\n'), 1) << warning;
  EXPECT_EQ(cache.load("blocked"), object_for("blocked"));

  mt::KernelCache other(dir.path());
  testing::internal::CaptureStderr();
  EXPECT_EQ(other.load("blocked"), std::nullopt);
  warning = testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("not a regular file"), std::string::npos) << warning;
  EXPECT_EQ(other.stats().corrupt_entries, 1);
  // No temporary files left behind by the failed renames, and the folder, refused, is removed
  // (it blocked the key for good before): the next store writes the entry.
  EXPECT_EQ(directory_entries(dir.path()), std::vector<std::string>{});
  other.store("blocked", object_for("blocked"));
  EXPECT_EQ(mt::KernelCache(dir.path()).load("blocked"), object_for("blocked"));
}

TEST(KernelCache, TheEnvironmentChoosesTheDirectory) {
  TemporaryDirectory dir;
  {
    ScopedEnvironment environment;
    environment.set("MIXTAPE_CACHE_DIR", (dir.path() + "/from-env").c_str());
    environment.set("HOME", (dir.path() + "/home").c_str());
    mt::KernelCache cache;
    EXPECT_EQ(cache.directory(), dir.path() + "/from-env");
    EXPECT_TRUE(cache.disk_enabled());
    cache.store("k", object_for("k"));
    EXPECT_TRUE(fs::is_regular_file(cache.entry_path("k")));
    EXPECT_EQ(fs::path(cache.entry_path("k")).parent_path(), fs::path(dir.path() + "/from-env"));
    // An explicit directory wins over the environment.
    mt::KernelCache explicit_dir(dir.path() + "/explicit");
    EXPECT_EQ(explicit_dir.directory(), dir.path() + "/explicit");
  }
  {
    ScopedEnvironment environment;
    environment.set("MIXTAPE_CACHE_DIR", "");
    environment.set("HOME", (dir.path() + "/home").c_str());
    mt::KernelCache cache;
    EXPECT_EQ(cache.directory(), dir.path() + "/home/.cache/mixtape");
    EXPECT_TRUE(cache.disk_enabled());
    EXPECT_TRUE(fs::is_directory(dir.path() + "/home/.cache/mixtape"));
  }
  {
    ScopedEnvironment environment;
    environment.set("MIXTAPE_CACHE_DIR", nullptr);
    environment.set("HOME", nullptr);
    testing::internal::CaptureStderr();
    mt::KernelCache cache;
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
    EXPECT_EQ(cache.directory(), "");
    EXPECT_FALSE(cache.disk_enabled());
    cache.store("k", object_for("k"));
    EXPECT_EQ(cache.load("k"), object_for("k"));
  }
}

// The process-wide cache exists once per process, so it is checked in a fresh child process each
// time (the parent never makes it), which keeps the test valid under --gtest_repeat.
TEST(KernelCache, TheProcessWideCacheIsMadeFromTheEnvironmentOnce) {
  TemporaryDirectory dir;
  std::string process_dir = dir.path() + "/process";
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::setenv("MIXTAPE_CACHE_DIR", process_dir.c_str(), 1);
    mt::KernelCache& cache = mt::kernel_cache();
    ::setenv("MIXTAPE_CACHE_DIR", (dir.path() + "/ignored-later").c_str(), 1);
    bool same_instance = &mt::kernel_cache() == &cache;
    bool from_environment = cache.directory() == process_dir && cache.disk_enabled();
    cache.store("process-wide", object_for("process-wide"));
    ::_exit(same_instance && from_environment ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  mt::KernelCache reader(process_dir);
  EXPECT_EQ(reader.load("process-wide"), object_for("process-wide"));
  EXPECT_FALSE(fs::exists(dir.path() + "/ignored-later"));
}

TEST(KernelCache, StoresNeverLeaveTemporaryFiles) {
  TemporaryDirectory dir;
  mt::KernelCache cache(dir.path());
  for (int i = 0; i < 50; ++i) {
    std::string key = "kernel-" + std::to_string(i % 10);
    cache.store(key, object_for(key, size_t(i) * 37));
  }
  EXPECT_TRUE(only_entry_files(dir.path()));
  EXPECT_EQ(directory_entries(dir.path()).size(), 10u);
}

// ---------------------------------------------------------------------------------------------
// Trust: only the user's own entries, in the user's own directory, are ever loaded.

constexpr uid_t nobody = 65534;

// Makes path (not following a link) belong to "nobody". Only root can: the caller skips when this
// fails.
bool give_to_nobody(const std::string& path) { return ::lchown(path.c_str(), nobody, nobody) == 0; }

mt::KernelCache::Options options_for(const std::string& dir, const std::string& key_file) {
  mt::KernelCache::Options options;
  options.directory = dir;
  options.key_file = key_file;
  return options;
}

// A directory holding a valid entry for "planted", written by this user with this user's key.
std::string directory_with_entry(const TemporaryDirectory& base, const std::string& key_file) {
  std::string dir = base.path() + "/cache";
  mt::KernelCache writer(options_for(dir, key_file));
  EXPECT_TRUE(writer.disk_enabled());
  writer.store("planted", object_for("planted"));
  return dir;
}

// A cache folder holding the entry "planted", with its key file, in a temporary folder.
struct PlantedCache {
  TemporaryDirectory base;
  std::string key_file = base.path() + "/cache.key";
  std::string dir = directory_with_entry(base, key_file);
};

// Constructs a cache on dir, expecting the disk refused with exactly one warning containing
// `reason`; then a load of "planted" must miss.
void expect_refused(const std::string& dir, const std::string& key_file,
                    const std::string& reason) {
  SCOPED_TRACE(dir + ": " + reason);
  testing::internal::CaptureStderr();
  mt::KernelCache cache(options_for(dir, key_file));
  EXPECT_EQ(cache.load("planted"), std::nullopt);
  std::string warning = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(cache.disk_enabled());
  EXPECT_EQ(cache.entry_path("planted"), "");
  EXPECT_NE(warning.find(reason), std::string::npos) << warning;
  EXPECT_TRUE(warning.ends_with("caching in memory only\n")) << warning;
  EXPECT_EQ(std::count(warning.begin(), warning.end(), '\n'), 1) << warning;
  EXPECT_EQ(cache.stats().disk_hits, 0);
}

TEST(KernelCacheTrust, TheDirectoryAndItsNewParentsAreCreatedPrivate) {
  TemporaryDirectory base;
  std::string dir = base.path() + "/a/b/cache";
  mode_t old_mask = ::umask(0);  // even a permissive umask leaves them 0700
  mt::KernelCache cache(options_for(dir, base.path() + "/cache.key"));
  ::umask(old_mask);
  ASSERT_TRUE(cache.disk_enabled());
  for (const std::string& path : {base.path() + "/a", base.path() + "/a/b", dir})
    EXPECT_EQ(fs::status(path).permissions(), fs::perms::owner_all) << path;
}

// The attack: a folder everybody may write (1777, like /tmp), an entry planted in it.
TEST(KernelCacheTrust, AGroupOrWorldWritableDirectoryIsRefused) {
  for (fs::perms mode : {fs::perms(01777), fs::perms(0777), fs::perms(0770), fs::perms(0702)}) {
    PlantedCache planted;
    auto& [base, key_file, dir] = planted;
    fs::permissions(dir, mode);
    expect_refused(dir, key_file, "is refused (writable by group or others");
  }
}

TEST(KernelCacheTrust, ADirectoryOwnedByAnotherUserIsRefused) {
  PlantedCache planted;
  auto& [base, key_file, dir] = planted;
  if (!give_to_nobody(dir)) GTEST_SKIP() << "chown to uid 65534 needs root";
  expect_refused(dir, key_file, "is refused (owned by uid 65534");
}

TEST(KernelCacheTrust, ADirectoryReachedThroughASymlinkIsRefused) {
  PlantedCache planted;
  auto& [base, key_file, dir] = planted;
  std::string link = base.path() + "/link";
  fs::create_directory_symlink(dir, link);
  expect_refused(link, key_file, "(it is a symbolic link)");
  expect_refused(link + "/", key_file, "(it is a symbolic link)");
}

// A complete, well-formed entry with every length and checksum right, written with another key:
// what anyone who can write the folder but does not know this user's secret can make.
TEST(KernelCacheTrust, AForgedEntryIsRejectedRecompiledAndOverwritten) {
  TemporaryDirectory base;
  std::string dir = base.path() + "/cache";
  std::string key_file = base.path() + "/victim.key";
  std::vector<std::byte> attacker_code = object_for("attacker code", 300);
  {
    mt::KernelCache attacker(options_for(dir, base.path() + "/attacker.key"));
    ASSERT_TRUE(attacker.disk_enabled());
    attacker.store("kernel", attacker_code);
  }
  mt::KernelCache victim(options_for(dir, key_file));
  ASSERT_TRUE(victim.disk_enabled());
  std::string path = victim.entry_path("kernel");
  ASSERT_TRUE(fs::is_regular_file(path));
  testing::internal::CaptureStderr();
  EXPECT_EQ(victim.load("kernel"), std::nullopt);  // never the attacker's bytes
  std::string warning = testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("authentication failed"), std::string::npos) << warning;
  EXPECT_EQ(victim.stats().corrupt_entries, 1);
  EXPECT_EQ(victim.stats().misses, 1);
  // The caller compiles and stores: the entry now holds the real object, for every process.
  victim.store("kernel", object_for("kernel"));
  mt::KernelCache later(options_for(dir, key_file));
  EXPECT_EQ(later.load("kernel"), object_for("kernel"));
  EXPECT_EQ(later.stats().disk_hits, 1);
}

TEST(KernelCacheTrust, EntriesThatAreLinksOrNotOursAreRefused) {
  PlantedCache planted;
  auto& [base, key_file, dir] = planted;
  mt::KernelCache cache(options_for(dir, key_file));
  std::string path = cache.entry_path("planted");
  std::string elsewhere = base.path() + "/valid-entry";
  fs::rename(path, elsewhere);
  fs::create_symlink(elsewhere, path);  // a valid entry, but through a link
  testing::internal::CaptureStderr();
  EXPECT_EQ(cache.load("planted"), std::nullopt);
  std::string warning = testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("(a symbolic link)"), std::string::npos) << warning;
  EXPECT_FALSE(fs::is_symlink(path));
  EXPECT_TRUE(fs::exists(elsewhere)) << "the link's target was touched";

  fs::copy_file(elsewhere, path);
  if (!give_to_nobody(path)) GTEST_SKIP() << "chown to uid 65534 needs root";
  mt::KernelCache fresh(options_for(dir, key_file));  // each entry is warned about once
  testing::internal::CaptureStderr();
  EXPECT_EQ(fresh.load("planted"), std::nullopt);
  warning = testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("owned by uid 65534"), std::string::npos) << warning;
  EXPECT_EQ(fresh.stats().corrupt_entries, 1);
}

// Waits up to `seconds` for child; kills it if it is still running then. Its exit code, or -1.
int wait_or_kill(pid_t child, int seconds) {
  for (int waited = 0; waited < seconds * 100; ++waited) {
    int status = 0;
    if (::waitpid(child, &status, WNOHANG) == child)
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    ::usleep(10'000);
  }
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  return -1;
}

TEST(KernelCacheTrust, AFifoAtAnEntryPathDoesNotHang) {
  PlantedCache planted;
  auto& [base, key_file, dir] = planted;
  mt::KernelCache probe(options_for(dir, key_file));
  std::string path = probe.entry_path("planted");
  fs::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  // In a child, so that a hang fails this test instead of blocking the suite.
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::freopen("/dev/null", "w", stderr);
    mt::KernelCache cache(options_for(dir, key_file));
    bool refused = cache.load("planted") == std::nullopt && cache.stats().corrupt_entries == 1;
    ::_exit(refused ? 0 : 1);
  }
  EXPECT_EQ(wait_or_kill(child, 20), 0) << "loading an entry that is a FIFO hung or succeeded";
  EXPECT_FALSE(fs::exists(path)) << "the FIFO was not deleted";
}

TEST(KernelCacheTrust, AnOversizedSparseEntryIsRejectedWithoutReadingIt) {
  PlantedCache planted;
  auto& [base, key_file, dir] = planted;
  mt::KernelCache probe(options_for(dir, key_file));
  std::string path = probe.entry_path("planted");
  auto make_sparse = [&] {  // 2 GiB, nearly all a hole: no disk used
    if (!fs::exists(path)) std::ofstream(path).close();
    fs::resize_file(path, uint64_t{2} << 30);
  };
  make_sparse();
  // In a child, whose peak resident memory shows whether the 2 GiB were read.
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::freopen("/dev/null", "w", stderr);
    struct rusage before, after;
    ::getrusage(RUSAGE_SELF, &before);
    mt::KernelCache cache(options_for(dir, key_file));
    bool refused = cache.load("planted") == std::nullopt && cache.stats().corrupt_entries == 1;
    ::getrusage(RUSAGE_SELF, &after);
    bool unread = after.ru_maxrss - before.ru_maxrss < 64 * 1024;  // KiB
    ::_exit(refused ? (unread ? 0 : 2) : 1);
  }
  EXPECT_EQ(wait_or_kill(child, 60), 0) << "1: loaded; 2: read into memory";
  EXPECT_FALSE(fs::exists(path)) << "the oversized entry was not deleted";
  make_sparse();
  testing::internal::CaptureStderr();
  EXPECT_EQ(probe.load("planted"), std::nullopt);
  std::string warning = testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("2147483648 bytes, over the 268435456-byte cap"), std::string::npos)
      << warning;
}

// Runs fn as uid/gid 65534 in a child when this process is root (permission bits do not stop
// root, so a read-only directory needs another user), else in this process. True when fn did.
bool as_unprivileged_user(const std::function<bool()>& fn, const std::string& stderr_file) {
  if (::geteuid() != 0) {
    testing::internal::CaptureStderr();
    bool ok = fn();
    std::ofstream(stderr_file) << testing::internal::GetCapturedStderr();
    return ok;
  }
  pid_t child = ::fork();
  if (child < 0) return false;
  if (child == 0) {
    bool ok = ::freopen(stderr_file.c_str(), "w", stderr) != nullptr &&
              ::setgroups(0, nullptr) == 0 && ::setgid(nobody) == 0 && ::setuid(nobody) == 0 &&
              fn();
    std::fflush(stderr);
    ::_exit(ok ? 0 : 1);
  }
  return wait_or_kill(child, 60) == 0;
}

// The issue: 21 valid entries in a read-only folder were all recompiled. They must all load.
TEST(KernelCacheTrust, AReadOnlyDirectoryIsStillRead) {
  TemporaryDirectory base;
  std::string dir = base.path() + "/cache", key_dir = base.path() + "/config";
  std::string stderr_file = base.path() + "/stderr";
  if (::geteuid() == 0) {  // the unprivileged user's own folders, reachable through base
    fs::permissions(base.path(), fs::perms(0711));
    fs::create_directory(dir);
    fs::create_directory(key_dir);
    ASSERT_TRUE(give_to_nobody(dir) && give_to_nobody(key_dir));
    std::ofstream(stderr_file).close();
    ASSERT_TRUE(give_to_nobody(stderr_file));
  }
  constexpr int entries = 21;
  bool ok = as_unprivileged_user(
      [&] {
        mt::KernelCache::Options options = options_for(dir, key_dir + "/cache.key");
        {
          mt::KernelCache writer(options);
          for (int i = 0; i < entries; ++i)
            writer.store(fmt::format("k{}", i), object_for(fmt::format("k{}", i)));
        }
        if (::chmod(dir.c_str(), 0500) != 0) return false;
        mt::KernelCache reader(options);
        if (!reader.disk_enabled()) return false;
        for (int i = 0; i < entries; ++i)
          if (reader.load(fmt::format("k{}", i)) != object_for(fmt::format("k{}", i))) return false;
        mt::KernelCache::Stats stats = reader.stats();
        if (stats.disk_hits != entries || stats.misses != 0) return false;
        // Stores stay in memory, with one warning however many.
        reader.store("new-1", object_for("new-1"));
        reader.store("new-2", object_for("new-2"));
        bool stored_in_memory = reader.load("new-1") == object_for("new-1");
        ::chmod(dir.c_str(), 0700);
        return stored_in_memory && !reader.disk_writable();
      },
      stderr_file);
  std::string warnings = std::string(reinterpret_cast<const char*>(read_file(stderr_file).data()),
                                     read_file(stderr_file).size());
  EXPECT_TRUE(ok) << warnings;
  EXPECT_EQ(std::count(warnings.begin(), warnings.end(), '\n'), 1) << warnings;
  EXPECT_NE(warnings.find("is read-only"), std::string::npos) << warnings;
}

// ---------------------------------------------------------------------------------------------
// The key file

TEST(KernelCacheKey, IsCreatedPrivateWithItsParents) {
  TemporaryDirectory base;
  std::string key_file = base.path() + "/config/mixtape/cache.key";
  mt::KernelCache cache(options_for(base.path() + "/cache", key_file));
  ASSERT_TRUE(cache.disk_enabled());
  EXPECT_EQ(cache.key_file(), key_file);
  EXPECT_EQ(fs::status(key_file).permissions(), fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(fs::file_size(key_file), 32u);
  EXPECT_EQ(fs::status(base.path() + "/config/mixtape").permissions(), fs::perms::owner_all);
  // A second cache reuses it: entries written by the first authenticate.
  std::vector<std::byte> key_bytes = read_file(key_file);
  cache.store("k", object_for("k"));
  mt::KernelCache again(options_for(base.path() + "/cache", key_file));
  EXPECT_EQ(again.load("k"), object_for("k"));
  EXPECT_EQ(read_file(key_file), key_bytes);
  // Two users' keys differ (32 random bytes each).
  mt::KernelCache other(options_for(base.path() + "/cache2", base.path() + "/other.key"));
  EXPECT_NE(read_file(base.path() + "/other.key"), key_bytes);
}

TEST(KernelCacheKey, AnUnsafeKeyFileTurnsTheDiskOff) {
  TemporaryDirectory base;
  std::string good_key = base.path() + "/good.key";
  std::string dir = directory_with_entry(base, good_key);
  std::vector<std::byte> secret = read_file(good_key);

  std::string readable = base.path() + "/readable.key";
  fs::copy_file(good_key, readable);
  fs::permissions(readable, fs::perms(0644));
  expect_refused(dir, readable, "readable or writable by group or others: mode 644");

  std::string link = base.path() + "/link.key";
  fs::create_symlink(good_key, link);
  expect_refused(dir, link, "it is a symbolic link");

  std::string short_key = base.path() + "/short.key";
  fs::copy_file(good_key, short_key);
  fs::resize_file(short_key, 16);
  expect_refused(dir, short_key, "16 bytes, not 32");

  expect_refused(dir, base.path(), "not a regular file");
  expect_refused(dir, dir + "/cache.key", "inside the cache directory");

  std::string foreign = base.path() + "/foreign.key";
  fs::copy_file(good_key, foreign);
  if (!give_to_nobody(foreign)) GTEST_SKIP() << "chown to uid 65534 needs root";
  expect_refused(dir, foreign, "owned by uid 65534");
}

// Processes starting at once with no key yet must all end up with the one key.
TEST(KernelCacheKey, ProcessesCreatingItAtOnceShareOneKey) {
  TemporaryDirectory base;
  std::string dir = base.path() + "/cache", key_file = base.path() + "/config/cache.key";
  constexpr int processes = 6;
  std::vector<pid_t> children;
  for (int i = 0; i < processes; ++i) {
    pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      mt::KernelCache cache(options_for(dir, key_file));
      cache.store(fmt::format("from-{}", i), object_for(fmt::format("from-{}", i)));
      ::_exit(cache.disk_writable() ? 0 : 1);
    }
    children.push_back(child);
  }
  for (pid_t child : children) EXPECT_EQ(wait_or_kill(child, 60), 0);
  mt::KernelCache reader(options_for(dir, key_file));
  for (int i = 0; i < processes; ++i)
    EXPECT_EQ(reader.load(fmt::format("from-{}", i)), object_for(fmt::format("from-{}", i)));
  EXPECT_EQ(reader.stats().disk_hits, processes);
  EXPECT_EQ(directory_entries(base.path() + "/config"), std::vector<std::string>{"cache.key"});
}

TEST(KernelCacheKey, TheEnvironmentChoosesTheKeyFile) {
  TemporaryDirectory base;
  std::string dir = base.path() + "/cache";
  ScopedEnvironment environment;
  environment.set("MIXTAPE_CACHE_KEY_FILE", (base.path() + "/explicit.key").c_str());
  environment.set("XDG_CONFIG_HOME", (base.path() + "/xdg").c_str());
  environment.set("HOME", (base.path() + "/home").c_str());
  EXPECT_EQ(mt::KernelCache(dir).key_file(), base.path() + "/explicit.key");
  environment.set("MIXTAPE_CACHE_KEY_FILE", "");
  EXPECT_EQ(mt::KernelCache(dir).key_file(), base.path() + "/xdg/mixtape/cache.key");
  environment.set("XDG_CONFIG_HOME", nullptr);
  EXPECT_EQ(mt::KernelCache(dir).key_file(), base.path() + "/home/.config/mixtape/cache.key");
  EXPECT_TRUE(fs::is_regular_file(base.path() + "/home/.config/mixtape/cache.key"));
}

// ---------------------------------------------------------------------------------------------
// Bounds

TEST(KernelCacheBounds, MemoryStaysWithinItsBudgetAndACyclingSetThatFitsIsReused) {
  TemporaryDirectory base;
  mt::KernelCache::Options options = options_for(base.path() + "/cache", base.path() + "/k.key");
  options.memory_bytes = 64 << 10;
  mt::KernelCache cache(options);
  // A sweep over many more shapes than fit.
  for (int i = 0; i < 1000; ++i) {
    cache.store(fmt::format("sweep-{}", i), object_for(fmt::format("sweep-{}", i), 1000));
    ASSERT_LE(cache.stats().memory_bytes, 64 << 10) << i;
  }
  mt::KernelCache::Stats stats = cache.stats();
  EXPECT_GT(stats.memory_entries, 40);
  EXPECT_LT(stats.memory_entries, 66);
  EXPECT_GT(stats.memory_evictions, 900);
  // The most recent are held; the oldest come back from disk.
  EXPECT_EQ(cache.load("sweep-999"), object_for("sweep-999", 1000));
  EXPECT_EQ(cache.load("sweep-0"), object_for("sweep-0", 1000));
  EXPECT_EQ(cache.stats().memory_hits, 1);
  EXPECT_EQ(cache.stats().disk_hits, 1);

  // 20 keys cycling, 20 KiB in all: after the first round every load is a memory hit.
  cache.clear_memory();
  for (int round = 0; round < 5; ++round)
    for (int i = 0; i < 20; ++i)
      EXPECT_EQ(cache.load(fmt::format("sweep-{}", i)),
                object_for(fmt::format("sweep-{}", i), 1000));
  EXPECT_EQ(cache.stats().memory_hits, 1 + 4 * 20);
  EXPECT_EQ(cache.stats().disk_hits, 1 + 20);
}

int64_t bytes_on_disk(const std::string& dir) {
  int64_t total = 0;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir))
    total += static_cast<int64_t>(entry.file_size());
  return total;
}

void set_age(const std::string& path, int seconds_ago) {
  struct timespec times[2];
  ::clock_gettime(CLOCK_REALTIME, &times[0]);
  times[0].tv_sec -= seconds_ago;
  times[1] = times[0];
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
}

TEST(KernelCacheBounds, TheDiskCapEvictsTheLeastRecentlyUsed) {
  TemporaryDirectory base;
  mt::KernelCache::Options options = options_for(base.path() + "/cache", base.path() + "/k.key");
  options.max_disk_bytes = 12000;  // about 11 entries of 1059 bytes
  auto key = [](int i) { return fmt::format("k{:02}", i); };
  {
    mt::KernelCache writer(options);
    for (int i = 0; i < 10; ++i) {
      writer.store(key(i), object_for(key(i), 1000));
      set_age(writer.entry_path(key(i)), 1000 - i);  // k00 oldest
    }
    EXPECT_EQ(writer.stats().disk_evictions, 0);
  }
  mt::KernelCache cache(options);
  // Used now: the two oldest become the most recent.
  EXPECT_EQ(cache.load(key(0)), object_for(key(0), 1000));
  EXPECT_EQ(cache.load(key(1)), object_for(key(1), 1000));
  cache.store(key(10), object_for(key(10), 1000));
  cache.store(key(11), object_for(key(11), 1000));
  EXPECT_LE(bytes_on_disk(options.directory), 12000);
  EXPECT_EQ(cache.stats().disk_evictions, 2);
  EXPECT_FALSE(fs::exists(cache.entry_path(key(2))));
  EXPECT_FALSE(fs::exists(cache.entry_path(key(3))));
  for (int i : {0, 1, 4, 9, 10, 11}) EXPECT_TRUE(fs::exists(cache.entry_path(key(i)))) << i;

  // A long sweep never takes the directory over the cap.
  for (int i = 12; i < 200; ++i) {
    cache.store(key(i), object_for(key(i), 1000));
    ASSERT_LE(bytes_on_disk(options.directory), 12000) << i;
  }
  EXPECT_TRUE(fs::exists(cache.entry_path(key(199))));
}

TEST(KernelCacheBounds, TheDiskCapComesFromTheEnvironment) {
  TemporaryDirectory base;
  ScopedEnvironment environment;
  environment.set("MIXTAPE_CACHE_MAX_BYTES", "3M");
  EXPECT_EQ(mt::KernelCache(options_for(base.path() + "/c", base.path() + "/k")).max_disk_bytes(),
            3 << 20);
  environment.set("MIXTAPE_CACHE_MAX_BYTES", nullptr);
  EXPECT_EQ(mt::KernelCache(options_for(base.path() + "/c", base.path() + "/k")).max_disk_bytes(),
            mt::KernelCache::default_max_disk_bytes);
  environment.set("MIXTAPE_CACHE_MAX_BYTES", "lots");
  testing::internal::CaptureStderr();
  EXPECT_EQ(mt::KernelCache(options_for(base.path() + "/c", base.path() + "/k")).max_disk_bytes(),
            mt::KernelCache::default_max_disk_bytes);
  EXPECT_NE(testing::internal::GetCapturedStderr().find("MIXTAPE_CACHE_MAX_BYTES=lots"),
            std::string::npos);
}

}  // namespace
