// codegen/kernel_cache.cpp -- the kernel cache: entry file layout, verified reads, atomic writes.
#include "codegen/kernel_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include "codegen/hash.h"

namespace mixtape {

namespace {

// Entry file layout, all integers little-endian:
//   0  magic "MTKC"         4 bytes
//   4  format version       u32
//   8  key length           u64
//  16  payload length       u64
//  24  payload checksum     Hash128 of the payload, lo then hi
//  40  key bytes, then payload bytes; the file ends exactly there.
constexpr char entry_magic[4] = {'M', 'T', 'K', 'C'};
constexpr size_t header_bytes = 40;

// Distinguishes the temporary files of threads and cache instances within one process; the pid
// distinguishes processes.
std::atomic<uint64_t> temporary_file_counter{0};

void put_u32(std::vector<std::byte>& out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(std::byte((value >> (8 * i)) & 0xFF));
}

void put_u64(std::vector<std::byte>& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(std::byte((value >> (8 * i)) & 0xFF));
}

uint64_t get_le(const std::byte* bytes, int count) {
  uint64_t value = 0;
  for (int i = 0; i < count; ++i) value |= uint64_t(bytes[i]) << (8 * i);
  return value;
}

std::string errno_text(int error) { return std::strerror(error); }

std::string temporary_path_next_to(const std::string& path) {
  return fmt::format("{}.tmp.{}.{}", path, ::getpid(), temporary_file_counter.fetch_add(1));
}

// Writes all of bytes to a new file at path; an error description on failure.
std::optional<std::string> write_new_file(const std::string& path,
                                          std::span<const std::byte> bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return errno_text(errno);
  size_t written = 0;
  while (written < bytes.size()) {
    ssize_t count = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (count < 0 && errno == EINTR) continue;
    if (count <= 0) {
      int error = count < 0 ? errno : EIO;
      ::close(fd);
      return errno_text(error);
    }
    written += static_cast<size_t>(count);
  }
  if (::close(fd) != 0) return errno_text(errno);
  return std::nullopt;
}

// Without an fsync a crash right after the rename can leave a torn entry behind; the verified read
// catches that and the kernel is simply compiled again, which is cheaper than syncing every store.
std::optional<std::string> write_file_atomically(const std::string& path,
                                                 std::span<const std::byte> bytes) {
  std::string temporary = temporary_path_next_to(path);
  std::optional<std::string> problem = write_new_file(temporary, bytes);
  if (!problem && ::rename(temporary.c_str(), path.c_str()) != 0) problem = errno_text(errno);
  if (problem) ::unlink(temporary.c_str());
  return problem;
}

// Creates dir if needed and proves a file can be created in it; the reason when it cannot.
std::optional<std::string> prepare_directory(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return error.message();
  if (!std::filesystem::is_directory(dir, error)) return std::string("not a directory");
  std::string probe = temporary_path_next_to(dir + "/.probe");
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return errno_text(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return std::nullopt;
}

std::string directory_from_environment() {
  const char* configured = std::getenv("MIXTAPE_CACHE_DIR");
  if (configured != nullptr && *configured != '\0') return configured;
  const char* home = std::getenv("HOME");
  if (home != nullptr && *home != '\0') return std::string(home) + "/.cache/mixtape";
  return "";
}

struct EntryRead {
  enum class Outcome { missing, corrupt, valid } outcome;
  std::vector<std::byte> payload;  // when valid
  std::string problem;             // when corrupt
};

EntryRead corrupt(std::string problem) {
  return {EntryRead::Outcome::corrupt, {}, std::move(problem)};
}

// Reads the entry at path and checks it against key; never trusts a length before comparing it
// with the file's real size, so a damaged header cannot cause a huge allocation.
EntryRead read_entry(const std::string& path, std::string_view key) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return {EntryRead::Outcome::missing, {}, {}};
    return corrupt("cannot open: " + errno_text(errno));
  }
  struct stat info;
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    return corrupt("not a regular file");
  }
  std::vector<std::byte> file(static_cast<size_t>(info.st_size));
  size_t read_so_far = 0;
  while (read_so_far < file.size()) {
    ssize_t count = ::read(fd, file.data() + read_so_far, file.size() - read_so_far);
    if (count < 0 && errno == EINTR) continue;
    if (count < 0) {
      int error = errno;
      ::close(fd);
      return corrupt("read failed: " + errno_text(error));
    }
    if (count == 0) break;  // shrank while reading
    read_so_far += static_cast<size_t>(count);
  }
  ::close(fd);
  file.resize(read_so_far);

  if (file.size() < header_bytes)
    return corrupt(fmt::format("truncated: {} bytes, shorter than the {}-byte header", file.size(),
                               header_bytes));
  if (std::memcmp(file.data(), entry_magic, sizeof entry_magic) != 0) return corrupt("bad magic");
  uint64_t version = get_le(file.data() + 4, 4);
  if (version != KernelCache::format_version)
    return corrupt(
        fmt::format("format version {}, expected {}", version, KernelCache::format_version));
  uint64_t key_length = get_le(file.data() + 8, 8);
  uint64_t payload_length = get_le(file.data() + 16, 8);
  Hash128 checksum{get_le(file.data() + 24, 8), get_le(file.data() + 32, 8)};
  uint64_t available = file.size() - header_bytes;
  if (key_length > available || payload_length > available - key_length)
    return corrupt(fmt::format("truncated: header promises {} bytes, file has {}",
                               header_bytes + key_length + payload_length, file.size()));
  if (key_length + payload_length != available)
    return corrupt(fmt::format("{} unexpected bytes after the payload",
                               available - key_length - payload_length));
  std::string_view stored_key(reinterpret_cast<const char*>(file.data() + header_bytes),
                              key_length);
  if (stored_key != key) return corrupt("it holds a different key");
  std::span<const std::byte> payload(file.data() + header_bytes + key_length, payload_length);
  if (hash_bytes(payload) != checksum) return corrupt("payload checksum mismatch");
  return {EntryRead::Outcome::valid, std::vector<std::byte>(payload.begin(), payload.end()), {}};
}

std::vector<std::byte> encode_entry(std::string_view key, std::span<const std::byte> payload) {
  std::vector<std::byte> file;
  file.reserve(header_bytes + key.size() + payload.size());
  for (char c : entry_magic) file.push_back(std::byte(c));
  put_u32(file, KernelCache::format_version);
  put_u64(file, key.size());
  put_u64(file, payload.size());
  Hash128 checksum = hash_bytes(payload);
  put_u64(file, checksum.lo);
  put_u64(file, checksum.hi);
  auto key_bytes = std::as_bytes(std::span(key.data(), key.size()));
  file.insert(file.end(), key_bytes.begin(), key_bytes.end());
  file.insert(file.end(), payload.begin(), payload.end());
  return file;
}

}  // namespace

KernelCache::KernelCache(std::string dir)
    : directory_(dir.empty() ? directory_from_environment() : std::move(dir)) {
  if (directory_.empty()) return;
  if (std::optional<std::string> problem = prepare_directory(directory_)) {
    fmt::print(stderr,
               "mixtape: warning: kernel cache directory {} is not writable ({}); caching in "
               "memory only\n",
               directory_, *problem);
    return;
  }
  disk_enabled_ = true;
}

std::string KernelCache::entry_path(std::string_view key) const {
  if (!disk_enabled_) return "";
  // The layout version is part of the name, so processes with different layouts sharing one
  // directory keep separate entries instead of deleting each other's.
  Hash128 name = Hasher().update(format_version).update(key).finish();
  return fmt::format("{}/{}.mtkc", directory_, name.hex());
}

void KernelCache::warn_once_about_entry(std::string_view kind, const std::string& path,
                                        const std::string& message) {
  if (warned_entries_.insert(fmt::format("{} {}", kind, path)).second)
    fmt::print(stderr, "mixtape: warning: {}\n", message);
}

std::optional<std::vector<std::byte>> KernelCache::load(std::string_view key) {
  std::lock_guard lock(mutex_);
  if (auto found = memory_.find(key); found != memory_.end()) {
    ++stats_.memory_hits;
    return found->second;
  }
  if (disk_enabled_) {
    std::string path = entry_path(key);
    EntryRead entry = read_entry(path, key);
    if (entry.outcome == EntryRead::Outcome::valid) {
      ++stats_.disk_hits;
      memory_.emplace(std::string(key), entry.payload);
      return std::move(entry.payload);
    }
    if (entry.outcome == EntryRead::Outcome::corrupt) {
      ++stats_.corrupt_entries;
      warn_once_about_entry(
          "corrupt", path,
          fmt::format("kernel cache entry {} is corrupt ({}); recompiling", path, entry.problem));
      ::unlink(path.c_str());
    }
  }
  ++stats_.misses;
  return std::nullopt;
}

void KernelCache::store(std::string_view key, std::span<const std::byte> object) {
  std::lock_guard lock(mutex_);
  ++stats_.stores;
  memory_.insert_or_assign(std::string(key), std::vector<std::byte>(object.begin(), object.end()));
  if (!disk_enabled_) return;
  std::string path = entry_path(key);
  if (std::optional<std::string> problem = write_file_atomically(path, encode_entry(key, object)))
    warn_once_about_entry("unwritable", path,
                          fmt::format("kernel cache entry {} could not be written ({}); keeping it "
                                      "in memory only",
                                      path, *problem));
}

void KernelCache::clear_memory() {
  std::lock_guard lock(mutex_);
  memory_.clear();
}

KernelCache::Stats KernelCache::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

KernelCache& kernel_cache() {
  static KernelCache cache;
  return cache;
}

}  // namespace mixtape
