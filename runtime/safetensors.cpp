// runtime/safetensors.cpp -- safetensors header encoding, strict validation and atomic file I/O.
#include "runtime/safetensors.h"

#include <fcntl.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <system_error>
#include <unordered_set>

#include "dsl/error.h"
#include "dsl/json.h"

namespace mixtape::safetensors {

const TensorData* File::find(std::string_view name) const {
  for (const TensorData& tensor : tensors)
    if (tensor.name == name) return &tensor;
  return nullptr;
}

namespace {

constexpr std::string_view metadata_key = "__metadata__";
constexpr size_t length_field_bytes = 8;
constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::f16,    DType::bf16,
                                DType::i32, DType::i64, DType::boolean};

std::optional<DType> dtype_from_tag(std::string_view tag) {
  for (DType dtype : all_dtypes)
    if (safetensors_name(dtype) == tag) return dtype;
  return std::nullopt;
}

std::string describe(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

/// Bytes a tensor of this dtype and shape needs, or nullopt when that overflows 64 bits. Dims
/// must already be known to be non-negative. A zero dim wins over any overflow among the others.
std::optional<uint64_t> byte_size(DType dtype, const std::vector<int64_t>& shape) {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  uint64_t total = size_of(dtype);
  for (int64_t dim : shape)
    if (__builtin_mul_overflow(total, static_cast<uint64_t>(dim), &total)) return std::nullopt;
  return total;
}

uint64_t load_u64_le(const std::byte* in) {
  uint64_t value = 0;
  for (size_t i = 0; i < length_field_bytes; ++i) value |= static_cast<uint64_t>(in[i]) << (8 * i);
  return value;
}

void store_u64_le(std::byte* out, uint64_t value) {
  for (size_t i = 0; i < length_field_bytes; ++i) out[i] = static_cast<std::byte>(value >> (8 * i));
}

// ---- writing ----

/// Checks everything a reader would reject, so a bad File fails before touching the disk.
void validate(const File& file, std::string_view context) {
  std::unordered_set<std::string_view> names;
  for (const TensorData& tensor : file.tensors) {
    if (tensor.name.empty()) fail("{}: tensor names must not be empty", context);
    if (tensor.name == metadata_key)
      fail("{}: '{}' is reserved for metadata and cannot name a tensor", context, metadata_key);
    if (!names.insert(tensor.name).second)
      fail("{}: duplicate tensor name '{}'", context, tensor.name);
    for (int64_t dim : tensor.shape)
      if (dim < 0)
        fail("{}: tensor '{}' has negative dim in shape {}", context, tensor.name,
             describe(tensor.shape));
    std::optional<uint64_t> expected = byte_size(tensor.dtype, tensor.shape);
    if (!expected)
      fail("{}: tensor '{}' shape {} is too large", context, tensor.name, describe(tensor.shape));
    if (*expected != tensor.bytes.size())
      fail("{}: tensor '{}' has {} bytes but {} with shape {} needs {}", context, tensor.name,
           tensor.bytes.size(), safetensors_name(tensor.dtype), describe(tensor.shape), *expected);
  }
  std::unordered_set<std::string_view> keys;
  for (const auto& [key, value] : file.metadata)
    if (!keys.insert(key).second) fail("{}: duplicate metadata key '{}'", context, key);
}

/// The length field plus the space-padded JSON header; the data section follows it directly.
std::string encode_header(const File& file, std::string_view context) {
  validate(file, context);
  json::Object root;
  if (!file.metadata.empty()) {
    json::Object metadata;
    for (const auto& [key, value] : file.metadata) metadata.emplace_back(key, value);
    root.emplace_back(metadata_key, std::move(metadata));
  }
  uint64_t offset = 0;
  for (const TensorData& tensor : file.tensors) {
    json::Array shape(tensor.shape.begin(), tensor.shape.end());
    uint64_t end = offset + tensor.bytes.size();
    root.emplace_back(tensor.name, json::Object{{"dtype", safetensors_name(tensor.dtype)},
                                                {"shape", std::move(shape)},
                                                {"data_offsets", json::Array{offset, end}}});
    offset = end;
  }
  std::string json_text;
  try {
    json_text = json::dump(root);
  } catch (const Error& e) {
    fail("{}: tensor names and metadata must be valid UTF-8 ({})", context, e.what());
  }
  // Padding to 8 bytes keeps the data section aligned for readers that map the file.
  json_text.append((8 - json_text.size() % 8) % 8, ' ');
  std::string header(length_field_bytes, '\0');
  store_u64_le(reinterpret_cast<std::byte*>(header.data()), json_text.size());
  return header + json_text;
}

std::string errno_message() { return std::error_code(errno, std::generic_category()).message(); }

/// Closes a descriptor when a read fails halfway.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(int fd, const void* data, size_t size, const std::string& tmp_path) {
  auto* cursor = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t written = ::write(fd, cursor, size);
    if (written < 0 && errno == EINTR) continue;
    if (written < 0) fail("writing '{}': {}", tmp_path, errno_message());
    cursor += written;
    size -= static_cast<size_t>(written);
  }
}

// ---- reading ----

struct Entry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

struct Layout {
  std::vector<Entry> entries;  // sorted by data offset
  std::vector<std::pair<std::string, std::string>> metadata;
};

void check_header_length(uint64_t header_length, uint64_t total_size, std::string_view origin) {
  if (total_size < length_field_bytes)
    fail("{}: file is {} bytes, too short for the 8-byte header length", origin, total_size);
  if (header_length > max_header_bytes)
    fail("{}: header length {} exceeds the limit of {} bytes", origin, header_length,
         max_header_bytes);
  if (header_length > total_size - length_field_bytes)
    fail("{}: header length {} runs past the end of the {}-byte file", origin, header_length,
         total_size);
}

std::vector<std::pair<std::string, std::string>> read_metadata(const json::Value& value,
                                                               std::string_view origin) {
  if (!value.is_object())
    fail("{}: '{}' must be an object, got {}", origin, metadata_key, json::kind_name(value.kind()));
  std::vector<std::pair<std::string, std::string>> metadata;
  for (const auto& [key, entry] : value.as_object()) {
    if (!entry.is_string())
      fail("{}: metadata '{}' must be a string, got {}", origin, key,
           json::kind_name(entry.kind()));
    metadata.emplace_back(key, entry.as_string());
  }
  return metadata;
}

/// Reads a JSON array of non-negative integers; nullopt when it is anything else.
std::optional<std::vector<int64_t>> read_naturals(const json::Value& value) {
  if (!value.is_array()) return std::nullopt;
  std::vector<int64_t> numbers;
  for (const json::Value& element : value.as_array()) {
    if (!element.is_integer() || element.as_int() < 0) return std::nullopt;
    numbers.push_back(element.as_int());
  }
  return numbers;
}

Entry read_entry(const std::string& name, const json::Value& value, uint64_t data_size,
                 std::string_view origin) {
  auto bad = [&](std::string_view what) { fail("{}: tensor '{}': {}", origin, name, what); };
  if (name.empty()) fail("{}: empty tensor name in header", origin);
  if (!value.is_object()) bad(fmt::format("expected an object, got {}", kind_name(value.kind())));
  for (const auto& [key, field] : value.as_object())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      bad(fmt::format("unexpected field '{}'", key));
  for (std::string_view key : {"dtype", "shape", "data_offsets"})
    if (!value.find(key)) bad(fmt::format("missing field '{}'", key));

  Entry entry;
  entry.name = name;
  const json::Value& dtype = value.at("dtype");
  if (!dtype.is_string()) bad("'dtype' must be a string");
  std::optional<DType> parsed_dtype = dtype_from_tag(dtype.as_string());
  if (!parsed_dtype) bad(fmt::format("unknown dtype '{}'", dtype.as_string()));
  entry.dtype = *parsed_dtype;

  std::optional<std::vector<int64_t>> shape = read_naturals(value.at("shape"));
  if (!shape) bad("'shape' must be an array of non-negative integers");
  entry.shape = std::move(*shape);

  std::optional<std::vector<int64_t>> offsets = read_naturals(value.at("data_offsets"));
  if (!offsets || offsets->size() != 2)
    bad("'data_offsets' must be an array of two non-negative integers");
  entry.begin = static_cast<uint64_t>((*offsets)[0]);
  entry.end = static_cast<uint64_t>((*offsets)[1]);
  if (entry.begin > entry.end)
    bad(fmt::format("data_offsets begin {} is after end {}", entry.begin, entry.end));
  if (entry.end > data_size)
    bad(fmt::format("data_offsets end {} is beyond the {}-byte data section", entry.end,
                    data_size));

  std::optional<uint64_t> expected = byte_size(entry.dtype, entry.shape);
  if (!expected) bad(fmt::format("shape {} is too large", describe(entry.shape)));
  if (*expected != entry.end - entry.begin)
    bad(fmt::format("data_offsets span {} bytes but {} with shape {} needs {}",
                    entry.end - entry.begin, dtype.as_string(), describe(entry.shape), *expected));
  return entry;
}

Layout read_header(std::string_view header, uint64_t data_size, std::string_view origin) {
  json::Value root;
  try {
    root = json::parse(header);
  } catch (const Error& e) {
    fail("{}: header is not valid JSON (offsets count from the header start): {}", origin,
         e.what());
  }
  if (!root.is_object())
    fail("{}: header must be a JSON object, got {}", origin, json::kind_name(root.kind()));

  Layout layout;
  for (const auto& [key, value] : root.as_object()) {
    if (key == metadata_key)
      layout.metadata = read_metadata(value, origin);
    else
      layout.entries.push_back(read_entry(key, value, data_size, origin));
  }

  // The spec requires the tensors to tile the data section exactly; anything else means a
  // corrupt or hand-crafted file, and gaps could hide appended payloads.
  std::sort(layout.entries.begin(), layout.entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry& entry : layout.entries) {
    if (entry.begin < covered)
      fail("{}: tensors '{}' [{}, {}) and '{}' [{}, {}) overlap", origin, previous->name,
           previous->begin, previous->end, entry.name, entry.begin, entry.end);
    if (entry.begin > covered)
      fail("{}: gap in the data section: bytes [{}, {}) belong to no tensor", origin, covered,
           entry.begin);
    covered = entry.end;
    previous = &entry;
  }
  if (covered != data_size)
    fail("{}: gap in the data section: bytes [{}, {}) belong to no tensor", origin, covered,
         data_size);
  return layout;
}

File file_from(Layout&& layout) {
  File file;
  file.metadata = std::move(layout.metadata);
  for (Entry& entry : layout.entries)
    file.tensors.push_back({.name = std::move(entry.name),
                            .dtype = entry.dtype,
                            .shape = std::move(entry.shape),
                            .bytes = {}});
  return file;
}

void read_exact(int fd, void* data, size_t size, const std::string& path) {
  auto* cursor = static_cast<char*>(data);
  while (size > 0) {
    ssize_t got = ::read(fd, cursor, size);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail("{}: read failed: {}", path, errno_message());
    if (got == 0) fail("{}: file ended early (was it truncated while being read?)", path);
    cursor += got;
    size -= static_cast<size_t>(got);
  }
}

}  // namespace

std::vector<std::byte> serialize(const File& file) {
  std::string header = encode_header(file, "safetensors");
  std::vector<std::byte> out(header.size());
  std::copy_n(reinterpret_cast<const std::byte*>(header.data()), header.size(), out.begin());
  for (const TensorData& tensor : file.tensors)
    out.insert(out.end(), tensor.bytes.begin(), tensor.bytes.end());
  return out;
}

File parse(std::span<const std::byte> bytes, std::string_view origin) {
  uint64_t header_length = bytes.size() >= length_field_bytes ? load_u64_le(bytes.data()) : 0;
  check_header_length(header_length, bytes.size(), origin);
  std::span<const std::byte> header = bytes.subspan(length_field_bytes, header_length);
  std::span<const std::byte> data = bytes.subspan(length_field_bytes + header_length);
  Layout layout =
      read_header(std::string_view(reinterpret_cast<const char*>(header.data()), header.size()),
                  data.size(), origin);
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const Entry& entry : layout.entries) spans.emplace_back(entry.begin, entry.end);
  File file = file_from(std::move(layout));
  for (size_t i = 0; i < spans.size(); ++i)
    file.tensors[i].bytes.assign(data.begin() + spans[i].first, data.begin() + spans[i].second);
  return file;
}

File read(const std::string& path) {
  // O_NONBLOCK keeps a FIFO at path from hanging the open; fstat then rejects it.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail("cannot open '{}' for reading: {}", path, errno_message());
  FdCloser closer{fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0) fail("cannot stat '{}': {}", path, errno_message());
  if (!S_ISREG(info.st_mode)) fail("'{}' is not a regular file", path);
  auto file_size = static_cast<uint64_t>(info.st_size);

  // Validate the length field against the real file size before allocating anything by it.
  std::byte length_field[length_field_bytes] = {};
  if (file_size >= length_field_bytes) read_exact(fd, length_field, length_field_bytes, path);
  uint64_t header_length = file_size >= length_field_bytes ? load_u64_le(length_field) : 0;
  check_header_length(header_length, file_size, path);
  std::string header(header_length, '\0');
  read_exact(fd, header.data(), header.size(), path);
  Layout layout = read_header(header, file_size - length_field_bytes - header_length, path);

  // Entries tile the data section in order, so their bytes can be read straight into place.
  std::vector<uint64_t> sizes;
  for (const Entry& entry : layout.entries) sizes.push_back(entry.end - entry.begin);
  File file = file_from(std::move(layout));
  for (size_t i = 0; i < sizes.size(); ++i) {
    file.tensors[i].bytes.resize(sizes[i]);
    read_exact(fd, file.tensors[i].bytes.data(), sizes[i], path);
  }
  return file;
}

void write(const std::string& path, const File& file) {
  std::string context = fmt::format("cannot write '{}'", path);
  std::string header = encode_header(file, context);
  std::string tmp_path = fmt::format("{}.tmp.{}", path, ::getpid());
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("{}: creating '{}': {}", context, tmp_path, errno_message());
  try {
    write_all(fd, header.data(), header.size(), tmp_path);
    for (const TensorData& tensor : file.tensors)
      write_all(fd, tensor.bytes.data(), tensor.bytes.size(), tmp_path);
    // Without the sync a crash right after the rename could leave an empty or torn file under
    // the final name on some file systems.
    if (::fsync(fd) != 0) fail("syncing '{}': {}", tmp_path, errno_message());
    int closed = ::close(fd);
    fd = -1;
    if (closed != 0) fail("closing '{}': {}", tmp_path, errno_message());
    if (::rename(tmp_path.c_str(), path.c_str()) != 0)
      fail("renaming '{}' over it: {}", tmp_path, errno_message());
  } catch (const Error& e) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp_path.c_str());
    fail("{}: {}", context, e.what());
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp_path.c_str());
    throw;
  }
}

}  // namespace mixtape::safetensors
