// mixtape/codegen/kernel_cache.h -- compiled kernel objects cached in memory and on disk across
// processes.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "mixtape/codegen/lru_cache.h"

namespace mixtape {

/// Maps a key to the bytes a backend compiled for it (an object file, PTX, CUBIN). Backend-neutral:
/// the caller folds everything that determines the object -- source text, backend, target
/// architecture, compiler version, codegen version -- into the key.
///
/// The entries are machine code that mixtape runs, so only their owner may put them there:
/// - The directory is created 0700. It is refused (one warning, then memory only) when it is a
///   symbolic link, not a directory, not owned by the effective user, or writable by group or
///   others. Everything after that check goes through the directory's open descriptor.
/// - Each entry is opened with O_NOFOLLOW | O_NONBLOCK and must be a regular file owned by the
///   effective user and at most max_entry_bytes long, checked with fstat before reading (a FIFO
///   cannot block, a huge sparse file is not read).
/// - Each entry carries an HMAC-SHA256 (OpenSSL) of its header, key and payload, keyed by a
///   per-user secret of 32 random bytes kept outside the directory, in the key file (see
///   Options::key_file), which is created 0600 and must be a regular file owned by the user and
///   readable by no one else. Without a usable key the disk cache is off (one warning). An entry
///   that fails any check is reported once, deleted and treated as a miss: the caller compiles
///   again and its store replaces the entry.
/// - A directory that passes the checks but cannot be written (chmod 0500, a read-only mount) is
///   still read; stores then stay in memory, with one warning.
///
/// Entries are files "<hash of key>.mtkc": a header (magic "MTKC", format version, key and
/// payload lengths), the full key, the payload and the MAC. Files are written to a temporary name
/// in the same directory and renamed, so concurrent processes never see partial entries.
///
/// Both levels are bounded. In memory, entries are least-recently-used within
/// memory_cache_bytes() ($MIXTAPE_MEMORY_CACHE_BYTES). On disk, a store that takes the directory
/// over max_disk_bytes ($MIXTAPE_CACHE_MAX_BYTES, default 1 GiB) deletes the least recently used
/// entries (by modification time, which every disk hit refreshes), as ccache's max_size does.
/// Nothing here throws for disk trouble. All members are safe to call from several threads.
class KernelCache {
 public:
  /// The on-disk layout version. Part of the header and of every file name, so caches written by
  /// a different layout are neither read nor overwritten. 2: the payload checksum became a MAC.
  static constexpr uint32_t format_version = 2;
  /// The largest entry read or written: CUDA images and CPU objects are at most a few MiB, so a
  /// bigger file is damage or an attack, refused before it is read into memory.
  static constexpr int64_t max_entry_bytes = int64_t{256} << 20;
  /// The disk cap unless $MIXTAPE_CACHE_MAX_BYTES says otherwise (0 there: no cap).
  static constexpr int64_t default_max_disk_bytes = int64_t{1} << 30;

  struct Options {
    /// "" => $MIXTAPE_CACHE_DIR if set and non-empty, else $HOME/.cache/mixtape, else memory
    /// only. The directory (and its missing parents) are created 0700.
    std::string directory;
    /// The secret's file; "" => $MIXTAPE_CACHE_KEY_FILE if set and non-empty, else
    /// $XDG_CONFIG_HOME/mixtape/cache.key, else $HOME/.config/mixtape/cache.key. Created (with
    /// its missing parents, 0700) on first use; it must not be inside the cache directory.
    std::string key_file;
    /// Bytes of entries on disk; < 0 => $MIXTAPE_CACHE_MAX_BYTES or default_max_disk_bytes;
    /// 0 => no cap.
    int64_t max_disk_bytes = -1;
    /// Bytes of entries in memory; < 0 => memory_cache_bytes().
    int64_t memory_bytes = -1;
  };

  explicit KernelCache(std::string dir = "");
  explicit KernelCache(Options options);
  ~KernelCache();
  KernelCache(const KernelCache&) = delete;
  KernelCache& operator=(const KernelCache&) = delete;

  /// The object stored under key, from memory or else from disk; nullopt on a miss.
  std::optional<std::vector<std::byte>> load(std::string_view key);

  /// Keeps object under key in memory and, when the disk is writable, on disk (replacing any
  /// previous entry).
  void store(std::string_view key, std::span<const std::byte> object);

  /// Forgets the in-memory entries, so the next loads go to disk as a fresh process would.
  void clear_memory();

  /// Whether entries are read from disk (stores may still be refused: disk_writable()).
  bool disk_enabled() const { return directory_fd_ >= 0; }
  /// Whether stores reach the disk: enabled, and no store has found the directory read-only.
  bool disk_writable() const;
  /// The directory chosen at construction ("" when none was found), even if it proved unusable.
  const std::string& directory() const { return directory_; }
  /// The key file chosen at construction ("" when none was found or the disk is not used).
  const std::string& key_file() const { return key_file_; }
  /// The file an entry for key lives in; "" when the disk is not enabled.
  std::string entry_path(std::string_view key) const;
  /// The disk cap in bytes (0: none).
  int64_t max_disk_bytes() const { return max_disk_bytes_; }

  struct Stats {
    int64_t memory_hits = 0;
    int64_t disk_hits = 0;
    int64_t misses = 0;  // every load that returned nullopt, rejected entries included
    int64_t stores = 0;
    int64_t corrupt_entries = 0;  // entries on disk refused (damaged, forged, not ours), deleted
    int64_t memory_entries = 0;   // held in memory now
    int64_t memory_bytes = 0;     // their bytes (keys and payloads), within the memory budget
    int64_t memory_evictions = 0;
    int64_t disk_evictions = 0;  // entry files deleted to keep the directory under its cap
  };
  Stats stats() const;

 private:
  struct KeyHash {
    using is_transparent = void;
    size_t operator()(std::string_view key) const { return std::hash<std::string_view>{}(key); }
  };
  using Object = std::shared_ptr<const std::vector<std::byte>>;

  // One line on stderr the first time this kind of problem is seen with this entry.
  void warn_once_about_entry(std::string_view kind, const std::string& path,
                             const std::string& message);
  void remember(std::string_view key, Object object);
  // Deletes the least recently used entries until the directory is under its cap (mutex held).
  void evict_from_disk();

  std::string directory_;
  std::string key_file_;
  int directory_fd_ = -1;        // the checked directory, or -1: memory only
  bool stores_refused_ = false;  // a store found the directory read-only
  std::array<unsigned char, 32> secret_{};
  int64_t max_disk_bytes_ = 0;
  int64_t disk_bytes_ = -1;  // approximate bytes of entries on disk; -1 until first counted
  mutable std::mutex mutex_;
  LruCache<std::string, Object, std::string_view, KeyHash, std::equal_to<>> memory_;
  std::unordered_set<std::string> warned_entries_;
  Stats stats_;
};

/// The process-wide cache, made on first use from the environment (see Options).
KernelCache& kernel_cache();

}  // namespace mixtape
