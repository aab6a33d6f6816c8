// codegen/kernel_cache.h -- compiled kernel objects cached in memory and on disk across processes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace mixtape {

/// Maps a key to the bytes a backend compiled for it (an object file, PTX, CUBIN). Backend-neutral:
/// the caller folds everything that determines the object -- source text, backend, target
/// architecture, compiler version, codegen version -- into the key.
///
/// Entries live in memory and, when a directory is usable, on disk as "<hash of key>.mtkc", each a
/// header (magic "MTKC", format version, key and payload lengths, payload checksum), the full key
/// and the payload. Files are written to a temporary name in the same directory and renamed, so
/// concurrent processes never see partial entries. Every read is verified; a corrupt, truncated or
/// foreign entry is reported once on stderr, deleted and treated as a miss. A directory that
/// cannot be created or written is reported once and the cache works in memory only. Nothing here
/// throws for disk trouble. All members are safe to call from several threads.
class KernelCache {
 public:
  /// The on-disk layout version. Part of the header and of every file name, so caches written by
  /// a different layout are neither read nor overwritten.
  static constexpr uint32_t format_version = 1;

  /// dir: "" => $MIXTAPE_CACHE_DIR if set and non-empty, else $HOME/.cache/mixtape, else memory
  /// only. The directory (and its parents) are created if missing.
  explicit KernelCache(std::string dir = "");
  KernelCache(const KernelCache&) = delete;
  KernelCache& operator=(const KernelCache&) = delete;

  /// The object stored under key, from memory or else from disk; nullopt on a miss.
  std::optional<std::vector<std::byte>> load(std::string_view key);

  /// Keeps object under key in memory and, when the disk is enabled, on disk (replacing any
  /// previous entry).
  void store(std::string_view key, std::span<const std::byte> object);

  /// Forgets the in-memory entries, so the next loads go to disk as a fresh process would.
  void clear_memory();

  bool disk_enabled() const { return disk_enabled_; }
  /// The directory chosen at construction ("" when none was found), even if it proved unusable.
  const std::string& directory() const { return directory_; }
  /// The file an entry for key lives in; "" when the disk is not enabled.
  std::string entry_path(std::string_view key) const;

  struct Stats {
    int64_t memory_hits = 0;
    int64_t disk_hits = 0;
    int64_t misses = 0;  // every load that returned nullopt, corrupt entries included
    int64_t stores = 0;
    int64_t corrupt_entries = 0;  // entries found corrupt on disk and deleted
  };
  Stats stats() const;

 private:
  struct KeyHash {
    using is_transparent = void;
    size_t operator()(std::string_view key) const { return std::hash<std::string_view>{}(key); }
  };

  // One line on stderr the first time this kind of problem is seen with this entry.
  void warn_once_about_entry(std::string_view kind, const std::string& path,
                             const std::string& message);

  std::string directory_;
  bool disk_enabled_ = false;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::vector<std::byte>, KeyHash, std::equal_to<>> memory_;
  std::unordered_set<std::string> warned_entries_;
  Stats stats_;
};

/// The process-wide cache, made on first use from the environment (see the constructor).
KernelCache& kernel_cache();

}  // namespace mixtape
