// mixtape/codegen/kernel_cache.cpp -- the kernel cache: directory and key checks, authenticated
// entry files, verified reads, atomic writes, the memory and disk caps.
#include "mixtape/codegen/kernel_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <utility>

#include <fmt/format.h>

#include "mixtape/codegen/hash.h"
#include "mixtape/dsl/byte_count.h"

namespace mixtape {

namespace {

// Entry file layout, all integers little-endian:
//   0  magic "MTKC"         4 bytes
//   4  format version       u32
//   8  key length           u64
//  16  payload length       u64
//  24  key bytes, then payload bytes
//  then HMAC-SHA256 under the user's secret of everything before it (32 bytes); the file ends
//  exactly there.
constexpr char entry_magic[4] = {'M', 'T', 'K', 'C'};
constexpr size_t header_bytes = 24;
constexpr size_t mac_bytes = 32;
constexpr size_t secret_bytes = 32;
// An eviction deletes down to this share of the cap, so that the stores right after it do not
// each start another directory scan.
constexpr double eviction_target = 0.9;
// A temporary file this old was left by a process that died between writing and renaming it.
constexpr time_t stale_temporary_seconds = 3600;

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

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd = -1) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

std::string temporary_name_for(const std::string& name) {
  return fmt::format("{}.tmp.{}.{}", name, ::getpid(), temporary_file_counter.fetch_add(1));
}

// Writes all of bytes to fd; an error number on failure.
int write_all(int fd, std::span<const std::byte> bytes) {
  size_t written = 0;
  while (written < bytes.size()) {
    ssize_t count = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (count < 0 && errno == EINTR) continue;
    if (count <= 0) return count < 0 ? errno : EIO;
    written += static_cast<size_t>(count);
  }
  return 0;
}

// Reads exactly count bytes (fewer if the file ends first); an error number on failure.
int read_up_to(int fd, std::byte* out, size_t count, size_t& got) {
  got = 0;
  while (got < count) {
    ssize_t n = ::read(fd, out + got, count - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  return 0;
}

// Creates file `name` in directory dir_fd holding bytes, mode 0600, atomically: written under a
// temporary name and renamed (or, with exclusive, linked, which fails if name exists). The error
// number on failure, with nothing left behind.
int write_file_atomically(int dir_fd, const std::string& name, std::span<const std::byte> bytes,
                          bool exclusive = false) {
  std::string temporary = temporary_name_for(name);
  int fd = ::openat(dir_fd, temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                    0600);
  if (fd < 0) return errno;
  int error = write_all(fd, bytes);
  // The key must survive a crash (entries written with it would otherwise be refused); an entry
  // torn by a crash is caught by its MAC and simply compiled again, cheaper than syncing each.
  if (error == 0 && exclusive && ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error == 0) {
    int status = exclusive ? ::linkat(dir_fd, temporary.c_str(), dir_fd, name.c_str(), 0)
                           : ::renameat(dir_fd, temporary.c_str(), dir_fd, name.c_str());
    if (status != 0) error = errno;
  }
  if (error != 0 || exclusive) ::unlinkat(dir_fd, temporary.c_str(), 0);
  return error;
}

// "a/b//c/" -> {"a", "b", "c"}; whether the path is absolute is the caller's to see.
std::vector<std::string> path_components(const std::string& path) {
  std::vector<std::string> parts;
  for (const std::filesystem::path& part : std::filesystem::path(path).relative_path())
    if (!part.empty()) parts.push_back(part.string());
  return parts;
}

// Opens directory `path` with each missing component created 0700, without following a symbolic
// link at the last component. The descriptor, or the reason it cannot be had.
struct OpenedDirectory {
  int fd = -1;
  std::string problem;
};
OpenedDirectory open_directory_creating(const std::string& path) {
  std::vector<std::string> parts = path_components(path);
  if (parts.empty()) return {-1, "not a directory path"};
  FileDescriptor current(::open(path[0] == '/' ? "/" : ".", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (current.get() < 0) return {-1, errno_text(errno)};
  for (size_t i = 0; i < parts.size(); ++i) {
    bool last = i + 1 == parts.size();
    if (::mkdirat(current.get(), parts[i].c_str(), 0700) != 0 && errno != EEXIST)
      return {-1, fmt::format("cannot create {}: {}", parts[i], errno_text(errno))};
    // The components above need only search permission (O_PATH); the directory itself is read.
    int flags = O_DIRECTORY | O_CLOEXEC | (last ? O_RDONLY | O_NOFOLLOW : O_PATH);
    int next = ::openat(current.get(), parts[i].c_str(), flags);
    if (next < 0) {
      int error = errno;
      struct stat info;
      if (last && ::fstatat(current.get(), parts[i].c_str(), &info, AT_SYMLINK_NOFOLLOW) == 0 &&
          S_ISLNK(info.st_mode))
        return {-1, "it is a symbolic link"};
      return {-1, error == ENOTDIR
                      ? fmt::format("{} is not a directory", parts[i])
                      : fmt::format("cannot open {}: {}", parts[i], errno_text(error))};
    }
    current.reset(next);
  }
  return {current.release(), ""};
}

// Whether the opened directory may hold code this user runs: ours, and no one else can write it.
std::string unsafe_directory(int fd) {
  struct stat info;
  if (::fstat(fd, &info) != 0) return errno_text(errno);
  if (!S_ISDIR(info.st_mode)) return "not a directory";
  if (info.st_uid != ::geteuid())
    return fmt::format("owned by uid {}, not by this user (uid {})", info.st_uid, ::geteuid());
  if ((info.st_mode & (S_IWGRP | S_IWOTH)) != 0)
    return fmt::format("writable by group or others: mode {:o}", info.st_mode & 07777);
  return "";
}

std::string directory_from_environment() {
  const char* configured = std::getenv("MIXTAPE_CACHE_DIR");
  if (configured != nullptr && *configured != '\0') return configured;
  const char* home = std::getenv("HOME");
  if (home != nullptr && *home != '\0') return std::string(home) + "/.cache/mixtape";
  return "";
}

std::string key_file_from_environment() {
  const char* configured = std::getenv("MIXTAPE_CACHE_KEY_FILE");
  if (configured != nullptr && *configured != '\0') return configured;
  // The XDG base directory specification ignores a relative XDG_CONFIG_HOME.
  const char* config = std::getenv("XDG_CONFIG_HOME");
  if (config != nullptr && config[0] == '/') return std::string(config) + "/mixtape/cache.key";
  const char* home = std::getenv("HOME");
  if (home != nullptr && *home != '\0') return std::string(home) + "/.config/mixtape/cache.key";
  return "";
}

// Reads the secret from the open key file after checking who may know it.
std::string read_secret(int fd, std::array<unsigned char, secret_bytes>& secret) {
  struct stat info;
  if (::fstat(fd, &info) != 0) return errno_text(errno);
  if (!S_ISREG(info.st_mode)) return "not a regular file";
  if (info.st_uid != ::geteuid())
    return fmt::format("owned by uid {}, not by this user (uid {})", info.st_uid, ::geteuid());
  if ((info.st_mode & 077) != 0)
    return fmt::format("readable or writable by group or others: mode {:o}", info.st_mode & 07777);
  if (info.st_size != static_cast<off_t>(secret_bytes))
    return fmt::format("{} bytes, not {}", info.st_size, secret_bytes);
  size_t got = 0;
  if (int error = read_up_to(fd, reinterpret_cast<std::byte*>(secret.data()), secret.size(), got))
    return errno_text(error);
  if (got != secret.size()) return "shorter than its size";
  return "";
}

// The user's secret from `path`, made (32 random bytes, 0600) when the file does not exist. Two
// processes making it at once each write their own under a temporary name and link it into
// place; the loser's link fails and it reads the winner's, so both use one key.
std::string load_or_create_secret(const std::string& path,
                                  std::array<unsigned char, secret_bytes>& secret,
                                  const struct stat& cache_directory) {
  std::filesystem::path file(path);
  std::string name = file.filename().string();
  if (name.empty() || name == "." || name == "..") return "not a file name";
  std::string parent = file.has_parent_path() ? file.parent_path().string() : ".";
  OpenedDirectory dir = open_directory_creating(parent);
  if (dir.fd < 0) return fmt::format("its directory {}: {}", parent, dir.problem);
  FileDescriptor dir_fd(dir.fd);
  struct stat dir_info;
  if (::fstat(dir_fd.get(), &dir_info) != 0) return errno_text(errno);
  if (dir_info.st_dev == cache_directory.st_dev && dir_info.st_ino == cache_directory.st_ino)
    return "it is inside the cache directory, where the entries it authenticates live";
  // Each pass returns, but for one: the file was missing and has just been made (by us or by a
  // process racing us), so the second pass reads it.
  for (int attempt = 0;; ++attempt) {
    FileDescriptor fd(
        ::openat(dir_fd.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (fd.get() >= 0) return read_secret(fd.get(), secret);
    if (errno == ELOOP) return "it is a symbolic link";
    if (errno != ENOENT || attempt > 0) return errno_text(errno);
    std::array<unsigned char, secret_bytes> fresh;
    if (RAND_bytes(fresh.data(), static_cast<int>(fresh.size())) != 1)
      return "OpenSSL's RAND_bytes found no randomness";
    int error = write_file_atomically(dir_fd.get(), name,
                                      std::as_bytes(std::span(fresh.data(), fresh.size())), true);
    OPENSSL_cleanse(fresh.data(), fresh.size());
    if (error != 0 && error != EEXIST)
      return fmt::format("cannot create it: {}", errno_text(error));
  }
}

std::array<unsigned char, mac_bytes> mac_of(const std::array<unsigned char, secret_bytes>& secret,
                                            std::span<const std::byte> bytes) {
  std::array<unsigned char, mac_bytes> mac{};
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), mac.data(), &length);
  return mac;
}

struct EntryRead {
  // unreadable: the entry could not be read now (too many open files, out of memory, an I/O
  // error): a miss that keeps the entry, which may well be good.
  enum class Outcome { missing, unreadable, corrupt, valid } outcome;
  std::vector<std::byte> payload;  // when valid
  std::string problem;             // when corrupt
};

EntryRead corrupt(std::string problem) {
  return {EntryRead::Outcome::corrupt, {}, std::move(problem)};
}

// Reads entry `name` of the directory and checks it against key. What the file is, who owns it
// and its size are checked on the open descriptor before any byte is read; no length in the
// header is trusted before it is compared with that size.
EntryRead read_entry(int dir_fd, const std::string& name, std::string_view key,
                     const std::array<unsigned char, secret_bytes>& secret) {
  FileDescriptor fd(::openat(dir_fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return {EntryRead::Outcome::missing, {}, {}};
    if (errno == ELOOP) return corrupt("a symbolic link");
    return {EntryRead::Outcome::unreadable, {}, "cannot open: " + errno_text(errno)};
  }
  struct stat info;
  if (::fstat(fd.get(), &info) != 0)
    return {EntryRead::Outcome::unreadable, {}, "cannot stat: " + errno_text(errno)};
  if (!S_ISREG(info.st_mode)) return corrupt("not a regular file");
  if (info.st_uid != ::geteuid())
    return corrupt(
        fmt::format("owned by uid {}, not by this user (uid {})", info.st_uid, ::geteuid()));
  if (info.st_size > KernelCache::max_entry_bytes)
    return corrupt(
        fmt::format("{} bytes, over the {}-byte cap", info.st_size, KernelCache::max_entry_bytes));
  std::vector<std::byte> file(static_cast<size_t>(info.st_size));
  size_t got = 0;
  if (int error = read_up_to(fd.get(), file.data(), file.size(), got))
    return {EntryRead::Outcome::unreadable, {}, "read failed: " + errno_text(error)};
  file.resize(got);  // shrank while reading
  // A hit is a use: the disk cap evicts by modification time. Fails harmlessly on a read-only
  // mount.
  ::futimens(fd.get(), nullptr);

  if (file.size() < header_bytes + mac_bytes)
    return corrupt(fmt::format("truncated: {} bytes, shorter than the {}-byte header and MAC",
                               file.size(), header_bytes + mac_bytes));
  if (std::memcmp(file.data(), entry_magic, sizeof entry_magic) != 0) return corrupt("bad magic");
  uint64_t version = get_le(file.data() + 4, 4);
  if (version != KernelCache::format_version)
    return corrupt(
        fmt::format("format version {}, expected {}", version, KernelCache::format_version));
  uint64_t key_length = get_le(file.data() + 8, 8);
  uint64_t payload_length = get_le(file.data() + 16, 8);
  uint64_t available = file.size() - header_bytes - mac_bytes;
  if (key_length > available || payload_length > available - key_length)
    return corrupt(fmt::format("truncated: header promises {} bytes, file has {}",
                               header_bytes + key_length + payload_length + mac_bytes,
                               file.size()));
  if (key_length + payload_length != available)
    return corrupt(fmt::format("{} unexpected bytes after the payload",
                               available - key_length - payload_length));
  std::span<const std::byte> signed_bytes(file.data(), file.size() - mac_bytes);
  std::array<unsigned char, mac_bytes> expected = mac_of(secret, signed_bytes);
  if (CRYPTO_memcmp(expected.data(), file.data() + signed_bytes.size(), mac_bytes) != 0)
    return corrupt("authentication failed: not written with this user's cache key");
  std::string_view stored_key(reinterpret_cast<const char*>(file.data() + header_bytes),
                              key_length);
  if (stored_key != key) return corrupt("it holds a different key");
  auto payload = file.begin() + static_cast<ptrdiff_t>(header_bytes + key_length);
  return {EntryRead::Outcome::valid,
          std::vector<std::byte>(payload, payload + static_cast<ptrdiff_t>(payload_length)),
          {}};
}

std::vector<std::byte> encode_entry(std::string_view key, std::span<const std::byte> payload,
                                    const std::array<unsigned char, secret_bytes>& secret) {
  std::vector<std::byte> file;
  file.reserve(header_bytes + key.size() + payload.size() + mac_bytes);
  for (char c : entry_magic) file.push_back(std::byte(c));
  put_u32(file, KernelCache::format_version);
  put_u64(file, key.size());
  put_u64(file, payload.size());
  auto key_bytes = std::as_bytes(std::span(key.data(), key.size()));
  file.insert(file.end(), key_bytes.begin(), key_bytes.end());
  file.insert(file.end(), payload.begin(), payload.end());
  std::array<unsigned char, mac_bytes> mac = mac_of(secret, file);
  for (unsigned char byte : mac) file.push_back(std::byte(byte));
  return file;
}

bool is_entry_name(std::string_view name) { return name.ends_with(".mtkc"); }

struct DiskEntry {
  std::string name;
  struct timespec modified;
  int64_t bytes;
};

// The directory's entry files (and, deleted on the way, temporary files left by dead processes).
std::vector<DiskEntry> list_entries(int dir_fd) {
  std::vector<DiskEntry> entries;
  int fd = ::dup(dir_fd);
  if (fd < 0) return entries;
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    ::close(fd);
    return entries;
  }
  ::rewinddir(dir);
  time_t now = ::time(nullptr);
  while (struct dirent* item = ::readdir(dir)) {
    std::string_view name = item->d_name;
    struct stat info;
    if (::fstatat(dir_fd, item->d_name, &info, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(info.st_mode))
      continue;
    if (is_entry_name(name))
      entries.push_back({std::string(name), info.st_mtim, static_cast<int64_t>(info.st_size)});
    else if (name.find(".mtkc.tmp.") != std::string_view::npos &&
             now - info.st_mtim.tv_sec > stale_temporary_seconds)
      ::unlinkat(dir_fd, item->d_name, 0);
  }
  ::closedir(dir);
  return entries;
}

int64_t max_disk_bytes_from(int64_t option) {
  if (option >= 0) return option;
  return byte_count_from_environment("MIXTAPE_CACHE_MAX_BYTES",
                                     KernelCache::default_max_disk_bytes);
}

}  // namespace

KernelCache::KernelCache(std::string dir) : KernelCache(Options{std::move(dir), "", -1, -1}) {}

KernelCache::KernelCache(Options options)
    : directory_(options.directory.empty() ? directory_from_environment()
                                           : std::move(options.directory)),
      max_disk_bytes_(max_disk_bytes_from(options.max_disk_bytes)),
      memory_(options.memory_bytes) {
  if (directory_.empty()) return;
  OpenedDirectory opened = open_directory_creating(directory_);
  if (opened.fd < 0) {
    fmt::print(stderr,
               "mixtape: warning: kernel cache directory {} cannot be used ({}); caching in "
               "memory only\n",
               directory_, opened.problem);
    return;
  }
  FileDescriptor dir_fd(opened.fd);
  if (std::string problem = unsafe_directory(dir_fd.get()); !problem.empty()) {
    fmt::print(stderr,
               "mixtape: warning: kernel cache directory {} is refused ({}): its entries would "
               "run as this user's code; caching in memory only\n",
               directory_, problem);
    return;
  }
  key_file_ = options.key_file.empty() ? key_file_from_environment() : std::move(options.key_file);
  struct stat dir_info;
  std::string problem = ::fstat(dir_fd.get(), &dir_info) != 0 ? errno_text(errno)
                        : key_file_.empty() ? "no MIXTAPE_CACHE_KEY_FILE, XDG_CONFIG_HOME or HOME"
                                            : load_or_create_secret(key_file_, secret_, dir_info);
  if (!problem.empty()) {
    fmt::print(stderr,
               "mixtape: warning: kernel cache key file {} cannot be used safely ({}); caching "
               "in memory only\n",
               key_file_.empty() ? "(none)" : key_file_, problem);
    OPENSSL_cleanse(secret_.data(), secret_.size());
    key_file_.clear();
    return;
  }
  directory_fd_ = dir_fd.release();
}

KernelCache::~KernelCache() {
  if (directory_fd_ >= 0) ::close(directory_fd_);
  OPENSSL_cleanse(secret_.data(), secret_.size());
}

bool KernelCache::disk_writable() const {
  std::lock_guard lock(mutex_);
  return directory_fd_ >= 0 && !stores_refused_;
}

std::string KernelCache::entry_path(std::string_view key) const {
  if (!disk_enabled()) return "";
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

void KernelCache::remember(std::string_view key, Object object) {
  // The map's node, list node and shared block: about 128 bytes beside the key and payload.
  int64_t bytes = static_cast<int64_t>(key.size() + object->size()) + 128;
  memory_.put(std::string(key), std::move(object), bytes);
}

std::optional<std::vector<std::byte>> KernelCache::load(std::string_view key) {
  std::lock_guard lock(mutex_);
  if (const Object* found = memory_.find(key)) {
    ++stats_.memory_hits;
    return **found;
  }
  if (disk_enabled()) {
    std::string path = entry_path(key);
    std::string name = path.substr(path.rfind('/') + 1);
    EntryRead entry = read_entry(directory_fd_, name, key, secret_);
    if (entry.outcome == EntryRead::Outcome::valid) {
      ++stats_.disk_hits;
      remember(key, std::make_shared<const std::vector<std::byte>>(entry.payload));
      return std::move(entry.payload);
    }
    if (entry.outcome == EntryRead::Outcome::unreadable)
      warn_once_about_entry("unreadable", path,
                            fmt::format("kernel cache entry {} cannot be read now ({}); "
                                        "recompiling, the entry is kept",
                                        path, entry.problem));
    if (entry.outcome == EntryRead::Outcome::corrupt) {
      ++stats_.corrupt_entries;
      warn_once_about_entry(
          "corrupt", path,
          fmt::format("kernel cache entry {} is corrupt ({}); recompiling", path, entry.problem));
      // A folder at the path (mixtape makes none) would block the key for good: removed whole.
      if (::unlinkat(directory_fd_, name.c_str(), 0) != 0 && errno == EISDIR) {
        std::error_code ignored;
        std::filesystem::remove_all(path, ignored);
      }
    }
  }
  ++stats_.misses;
  return std::nullopt;
}

void KernelCache::store(std::string_view key, std::span<const std::byte> object) {
  std::lock_guard lock(mutex_);
  ++stats_.stores;
  remember(key, std::make_shared<const std::vector<std::byte>>(object.begin(), object.end()));
  if (!disk_enabled() || stores_refused_) return;
  std::vector<std::byte> file = encode_entry(key, object, secret_);
  std::string path = entry_path(key);
  if (static_cast<int64_t>(file.size()) > max_entry_bytes) {
    warn_once_about_entry("too large", path,
                          fmt::format("kernel cache entry {} would be {} bytes, over the {}-byte "
                                      "cap; keeping it in memory only",
                                      path, file.size(), max_entry_bytes));
    return;
  }
  if (disk_bytes_ < 0) {
    disk_bytes_ = 0;
    for (const DiskEntry& entry : list_entries(directory_fd_)) disk_bytes_ += entry.bytes;
  }
  std::string name = path.substr(path.rfind('/') + 1);
  if (int error = write_file_atomically(directory_fd_, name, file)) {
    if (error == EACCES || error == EPERM || error == EROFS) {
      stores_refused_ = true;
      fmt::print(stderr,
                 "mixtape: warning: kernel cache directory {} is read-only ({}); its entries are "
                 "still read, new ones are kept in memory only\n",
                 directory_, errno_text(error));
      return;
    }
    warn_once_about_entry("unwritable", path,
                          fmt::format("kernel cache entry {} could not be written ({}); keeping it "
                                      "in memory only",
                                      path, errno_text(error)));
    return;
  }
  // A replaced entry is counted twice until the next scan: the estimate errs towards evicting.
  disk_bytes_ += static_cast<int64_t>(file.size());
  if (max_disk_bytes_ > 0 && disk_bytes_ > max_disk_bytes_) evict_from_disk();
}

void KernelCache::evict_from_disk() {
  std::vector<DiskEntry> entries = list_entries(directory_fd_);
  int64_t total = 0;
  for (const DiskEntry& entry : entries) total += entry.bytes;
  std::sort(entries.begin(), entries.end(), [](const DiskEntry& a, const DiskEntry& b) {
    if (a.modified.tv_sec != b.modified.tv_sec) return a.modified.tv_sec < b.modified.tv_sec;
    if (a.modified.tv_nsec != b.modified.tv_nsec) return a.modified.tv_nsec < b.modified.tv_nsec;
    return a.name < b.name;
  });
  auto target = static_cast<int64_t>(static_cast<double>(max_disk_bytes_) * eviction_target);
  for (const DiskEntry& entry : entries) {
    if (total <= target) break;
    if (::unlinkat(directory_fd_, entry.name.c_str(), 0) == 0) ++stats_.disk_evictions;
    total -= entry.bytes;  // gone either way: another process may have deleted it first
  }
  disk_bytes_ = total;
}

void KernelCache::clear_memory() {
  std::lock_guard lock(mutex_);
  memory_.clear();
}

KernelCache::Stats KernelCache::stats() const {
  std::lock_guard lock(mutex_);
  Stats stats = stats_;
  stats.memory_entries = static_cast<int64_t>(memory_.size());
  stats.memory_bytes = memory_.bytes();
  stats.memory_evictions = memory_.evictions();
  return stats;
}

KernelCache& kernel_cache() {
  static KernelCache cache;
  return cache;
}

}  // namespace mixtape
