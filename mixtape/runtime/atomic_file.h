// mixtape/runtime/atomic_file.h -- replacing a file so that readers see the old or the new one,
// never a mix.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace mixtape {

/// Replaces the file at path with what fill writes to the descriptor it is given, the way SQLite
/// and safetensors' writers do: fill writes a temporary "<target>.tmp.<pid>.<counter>.<random>"
/// in the target's directory (created O_EXCL, so concurrent writers never share one), which is
/// synced, renamed over the target, and the directory synced. Readers and a crash at any point
/// see the old file or the new one whole; of two concurrent writers the last rename wins.
///
/// - A symbolic link at path is written through: the file it (finally) points to is replaced,
///   and the link stays. A link in a sticky, world-writable folder (/tmp) that belongs neither to
///   the effective user nor to the folder's owner is refused, as fs.protected_symlinks does.
/// - An existing file keeps its permission bits (and its owner and group where the process may
///   set them); a new file gets 0666 less the umask.
/// - Temporaries of this naming for the same target left by processes that no longer exist (a
///   writer killed mid-save) are removed first; those of live processes are left alone. A writer
///   holds an exclusive flock on its temporary until the rename, and only temporaries that can
///   be locked are removed, so a writer whose pid merely looks dead from here (another pid
///   namespace or host sharing the folder) keeps its own.
///
/// Throws mt::Error naming path on any failure (fill's mt::Errors included); the temporary is
/// removed then and the old file is untouched.
void write_file_atomically(const std::string& path, const std::function<void(int fd)>& fill);

/// Writes all of data to fd, retrying short writes; mt::Error naming `what` on failure.
void write_all(int fd, const void* data, size_t size, const std::string& what);

}  // namespace mixtape
