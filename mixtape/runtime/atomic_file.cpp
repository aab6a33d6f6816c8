// mixtape/runtime/atomic_file.cpp -- unique temporaries, sync, rename, and cleanup of dead writers'
// leftovers.
#include "mixtape/runtime/atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <filesystem>
#include <optional>
#include <string_view>
#include <system_error>

#include "mixtape/dsl/error.h"

namespace mixtape {
namespace {

namespace fs = std::filesystem;

std::string errno_message(int error = errno) {
  return std::error_code(error, std::generic_category()).message();
}

/// Linux's own limit on links followed while resolving one path.
constexpr int max_symlink_hops = 40;

/// Whether `entry` (lstat'ed as `info`) lies in a sticky folder anyone may write (/tmp) and belongs
/// neither to us nor to the folder's owner: anyone could have planted it there. The kernel's
/// fs.protected_symlinks and fs.protected_regular distrust the same entries.
bool planted_by_others(const fs::path& entry, const struct stat& info) {
  fs::path folder = entry.parent_path().empty() ? fs::path(".") : entry.parent_path();
  struct stat folder_info {};
  return ::stat(folder.c_str(), &folder_info) == 0 && (folder_info.st_mode & S_ISVTX) &&
         (folder_info.st_mode & S_IWOTH) && info.st_uid != ::geteuid() &&
         info.st_uid != folder_info.st_uid;
}

/// The file a chain of symbolic links at path ends in (path itself when it is no link). The
/// end need not exist: a dangling link is written through, creating its target, as a shell's
/// `>` redirection does.
fs::path resolve_symlinks(const std::string& path) {
  fs::path current = path;
  for (int hops = 0; hops <= max_symlink_hops; ++hops) {
    struct stat info {};
    if (::lstat(current.c_str(), &info) != 0 || !S_ISLNK(info.st_mode)) return current;
    // As the kernel's fs.protected_symlinks does for open(): a link planted by others is not
    // followed, or any user could point our save at any file we may replace.
    if (planted_by_others(current, info))
      fail(
          "refusing to follow the symbolic link '{}': it belongs to uid {}, in a shared folder "
          "where anyone may plant one",
          current.string(), info.st_uid);
    std::error_code error;
    fs::path target = fs::read_symlink(current, error);
    if (error) fail("reading the symbolic link '{}': {}", current.string(), error.message());
    current = target.is_absolute() ? target : current.parent_path() / target;
  }
  fail("more than {} symbolic links to follow", max_symlink_hops);
}

/// The pid in a temporary's name after "<target>.tmp.": "<pid>.<counter>.<16 hex digits>", or
/// the bare "<pid>" that earlier versions used. nullopt for any other name, which is not ours.
std::optional<pid_t> temporary_owner(std::string_view suffix) {
  auto digits = [](std::string_view s, bool hex) {
    return !s.empty() &&
           s.find_first_not_of(hex ? "0123456789abcdef" : "0123456789") == std::string_view::npos;
  };
  std::string_view pid_text = suffix.substr(0, suffix.find('.'));
  if (!digits(pid_text, false)) return std::nullopt;
  if (pid_text.size() != suffix.size()) {
    std::string_view rest = suffix.substr(pid_text.size() + 1);
    size_t dot = rest.find('.');
    if (dot == std::string_view::npos || !digits(rest.substr(0, dot), false)) return std::nullopt;
    std::string_view random = rest.substr(dot + 1);
    if (random.size() != 16 || !digits(random, true)) return std::nullopt;
  }
  pid_t pid = 0;
  auto [end, ec] = std::from_chars(pid_text.data(), pid_text.data() + pid_text.size(), pid);
  if (ec != std::errc() || pid <= 0) return std::nullopt;
  return pid;
}

/// Removes temporaries for target whose writer process is gone (killed mid-save). A live
/// writer's temporary, this process's own, and anything not of our naming stay.
void remove_stale_temporaries(const fs::path& target) {
  fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::string prefix = target.filename().string() + ".tmp.";
  DIR* listing = ::opendir(dir.c_str());
  if (!listing) return;  // creating the temporary will report what is wrong with the folder
  while (const dirent* entry = ::readdir(listing)) {
    std::string_view name = entry->d_name;
    if (!name.starts_with(prefix)) continue;
    std::optional<pid_t> owner = temporary_owner(name.substr(prefix.size()));
    if (!owner || *owner == ::getpid()) continue;
    if (::kill(*owner, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to signal)
    // A pid can look dead from here and be alive elsewhere (another pid namespace or host on a
    // shared folder): a writer holds an exclusive lock on its temporary until it is renamed, and
    // the kernel drops it when the writer dies, wherever it ran.
    int fd =
        ::openat(::dirfd(listing), entry->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0)
      ::unlinkat(::dirfd(listing), entry->d_name, 0);  // best effort: a race is harmless
    ::close(fd);
  }
  ::closedir(listing);
}

std::string temporary_name(const fs::path& target) {
  static std::atomic<uint64_t> counter{0};
  uint64_t random = 0;
  if (::getrandom(&random, sizeof random, 0) != sizeof random)
    random = static_cast<uint64_t>(::time(nullptr)) ^ reinterpret_cast<uintptr_t>(&random);
  return fmt::format("{}.tmp.{}.{}.{:016x}", target.string(), ::getpid(), counter++, random);
}

void sync_directory(const fs::path& target) {
  fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("opening the folder '{}' to sync it: {}", dir.string(), errno_message());
  int synced = ::fsync(fd);
  int error = errno;
  ::close(fd);
  // Some file systems cannot sync a directory (EINVAL); the rename is then as durable as it gets.
  if (synced != 0 && error != EINVAL)
    fail("syncing the folder '{}': {}", dir.string(), errno_message(error));
}

}  // namespace

void write_all(int fd, const void* data, size_t size, const std::string& what) {
  auto* cursor = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t written = ::write(fd, cursor, size);
    if (written < 0 && errno == EINTR) continue;
    if (written < 0) fail("writing '{}': {}", what, errno_message());
    cursor += written;
    size -= static_cast<size_t>(written);
  }
}

void write_file_atomically(const std::string& path, const std::function<void(int fd)>& fill) {
  std::string tmp_path;
  int fd = -1;
  try {
    fs::path target = resolve_symlinks(path);
    remove_stale_temporaries(target);
    struct stat existing {};
    // lstat: a link planted after resolve_symlinks must not lend us another file's owner and mode.
    const bool exists = ::lstat(target.c_str(), &existing) == 0;
    // A device or a pipe is not replaced by a file (a save to /dev/null as root would replace the
    // system's /dev/null), nor is a folder.
    if (exists && !S_ISREG(existing.st_mode) && !S_ISLNK(existing.st_mode))
      fail("'{}' is not a regular file (a device, a pipe or a folder); save to a file",
           target.string());
    // Nor does a file planted by others in a shared folder lend the new one its owner and mode
    // (root's checkpoint would become theirs to change before root loads it again).
    bool keep_mode = exists && S_ISREG(existing.st_mode) && !planted_by_others(target, existing);
    tmp_path = temporary_name(target);
    // 0600 until the final mode is set, so the data is never readable by more than the old file.
    fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                keep_mode ? 0600 : 0666);
    if (fd < 0) {
      std::string why = errno_message();
      std::string attempted = std::move(tmp_path);
      tmp_path.clear();  // not ours to remove
      fail("creating '{}': {}", attempted, why);
    }
    // Held until the rename, so that no cleaner (remove_stale_temporaries) takes it for a dead
    // writer's; uncontended, since cleaners only try.
    if (::flock(fd, LOCK_EX) != 0) fail("locking '{}': {}", tmp_path, errno_message());
    if (keep_mode) {
      // Only root may give a file away: anyone else's save leaves the file theirs (the call
      // fails, harmlessly), with its old mode.
      if ((existing.st_uid != ::geteuid() || existing.st_gid != ::getegid()) &&
          ::fchown(fd, existing.st_uid, existing.st_gid) != 0)
        errno = 0;
      if (::fchmod(fd, existing.st_mode & 07777) != 0)
        fail("setting the mode of '{}': {}", tmp_path, errno_message());
    }
    fill(fd);
    // Without the sync a crash right after the rename could leave an empty or torn file under
    // the final name on some file systems.
    if (::fsync(fd) != 0) fail("syncing '{}': {}", tmp_path, errno_message());
    if (::rename(tmp_path.c_str(), target.c_str()) != 0)
      fail("renaming '{}' over it: {}", tmp_path, errno_message());
    tmp_path.clear();
    int closed = ::close(fd);  // after the rename: the lock covers the temporary's whole life
    fd = -1;
    if (closed != 0) fail("closing '{}': {}", path, errno_message());
    sync_directory(target);  // makes the rename itself durable
  } catch (const Error& e) {
    if (fd >= 0) ::close(fd);
    if (!tmp_path.empty()) ::unlink(tmp_path.c_str());
    fail("cannot write '{}': {}", path, e.what());
  } catch (...) {
    if (fd >= 0) ::close(fd);
    if (!tmp_path.empty()) ::unlink(tmp_path.c_str());
    throw;
  }
}

}  // namespace mixtape
