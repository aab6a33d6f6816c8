// mixtape/runtime/safetensors.cpp -- safetensors header encoding, strict validation and atomic file
// I/O.
#include "mixtape/runtime/safetensors.h"

#include <fcntl.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <new>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <unordered_map>
#include <unordered_set>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/host_memory.h"
#include "mixtape/dsl/json.h"
#include "mixtape/runtime/atomic_file.h"

// Header-only use of the system's xxHash: nothing to link, for mixtape or its consumers.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace mixtape::safetensors {

const TensorData* File::find(std::string_view name) const {
  for (const TensorData& tensor : tensors)
    if (tensor.name == name) return &tensor;
  return nullptr;
}

namespace {

constexpr std::string_view metadata_key = "__metadata__";
constexpr std::string_view checksum_key = "mixtape.checksum.xxh3_64";
/// The header's own checksum: the metadata and each tensor's name, dtype and shape (see
/// header_checksum). Files from before it was added have only the tensors' and still load.
constexpr std::string_view header_checksum_key = "mixtape.checksum.header_xxh3_64";
/// Entries of the reserved prefix that a file of ours holds at most.
constexpr size_t reserved_entries = 2;
constexpr size_t length_field_bytes = 8;
// One header member's values: a tensor entry needs 6 plus its rank, the metadata object one per
// entry plus itself. The parsed tree of a member costs ~50 bytes a value, so this caps it.
constexpr size_t max_member_values = 2 * max_metadata_entries + 16;

/// The checksum key that `key` is one damaged byte away from (same length, one byte different),
/// or "": the checksums cannot cover their own keys, so a key one byte from one is taken for a
/// damaged one, and refused, rather than for user metadata (which would turn the check off).
std::string_view near_checksum_key(std::string_view key) {
  for (std::string_view reserved : {checksum_key, header_checksum_key}) {
    if (key.size() != reserved.size() || key == reserved) continue;
    size_t differing = 0;
    for (size_t i = 0; i < key.size(); ++i) differing += key[i] != reserved[i];
    if (differing == 1) return reserved;
  }
  return {};
}

uint64_t checksum(std::span<const std::byte> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

/// The XXH3-64 of what the header says apart from the data offsets and our checksums: the
/// metadata entries sorted by key, then each tensor's name, dtype tag and shape sorted by name.
/// Each string is its length (u64 LE) and bytes, each count and dim a u64 LE, so no two headers
/// share an encoding and a reader in any language can recompute it. Sorted, so the file's JSON
/// member order (which other tools may change) does not matter. The tensors' own checksums cover
/// their bytes but not what the bytes mean: without this a damaged step count in the metadata,
/// or a shape [2, 8] read as [8, 2], would load silently.
template <typename Tensors>
uint64_t header_checksum(const std::vector<std::pair<std::string, std::string>>& metadata,
                         const Tensors& tensors) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  auto number = [&](uint64_t value) {
    std::byte bytes[8];
    for (size_t i = 0; i < 8; ++i) bytes[i] = static_cast<std::byte>(value >> (8 * i));
    XXH3_64bits_update(&state, bytes, sizeof bytes);
  };
  auto text = [&](std::string_view value) {
    number(value.size());
    XXH3_64bits_update(&state, value.data(), value.size());
  };
  std::vector<const std::pair<std::string, std::string>*> entries;
  for (const auto& entry : metadata) entries.push_back(&entry);
  std::sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
  number(entries.size());
  for (const auto* entry : entries) {
    text(entry->first);
    text(entry->second);
  }
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors[a].name < tensors[b].name; });
  number(order.size());
  for (size_t i : order) {
    text(tensors[i].name);
    text(safetensors_name(tensors[i].dtype));
    number(tensors[i].shape.size());
    for (int64_t dim : tensors[i].shape) number(static_cast<uint64_t>(dim));
  }
  return XXH3_64bits_digest(&state);
}

[[noreturn]] void not_safetensors(std::string_view origin, std::string_view why) {
  fail("not a safetensors file: {} ({})", origin, why);
}

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

/// Bytes a tensor of this dtype and shape needs, or nullopt when that overflows. The element
/// count is counted dim by dim in int64, as a tensor's shape (dsl/shape.h's checked_numel, which
/// the fuzz target does not link) and the reference reader count it, so a zero-size shape whose
/// leading dims overflow is refused here, not accepted and then failed, without the file's name,
/// by the tensor made from it.
std::optional<uint64_t> byte_size(DType dtype, const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t dim : shape)
    if (dim < 0 || __builtin_mul_overflow(count, dim, &count)) return std::nullopt;
  uint64_t total = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(count), size_of(dtype), &total))
    return std::nullopt;
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

/// Checks everything a reader would reject, so a bad File fails before touching the disk. Of a
/// File or a FileView (bytes held, or viewed).
template <typename Tensors>
void validate(const Tensors& file, std::string_view context) {
  std::unordered_set<std::string_view> names;
  for (const auto& tensor : file.tensors) {
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
  if (file.tensors.size() > max_tensors)
    fail("{}: {} tensors, more than the limit of {}", context, file.tensors.size(), max_tensors);
  if (file.metadata.size() + reserved_entries > max_metadata_entries)
    fail("{}: {} metadata entries, more than the limit of {}", context, file.metadata.size(),
         max_metadata_entries - reserved_entries);
  std::unordered_set<std::string_view> keys;
  for (const auto& [key, value] : file.metadata) {
    if (!keys.insert(key).second) fail("{}: duplicate metadata key '{}'", context, key);
    if (key.starts_with(reserved_metadata_prefix))
      fail("{}: metadata key '{}' uses the prefix '{}', which is reserved for mixtape's checksums",
           context, key, reserved_metadata_prefix);
    if (std::string_view near = near_checksum_key(key); !near.empty())
      fail("{}: metadata key '{}' is one byte from '{}', which is reserved for mixtape's checksums",
           context, key, near);
  }
}

/// The checksum entry: a JSON object, as text, of each tensor's name and the XXH3-64 of its
/// bytes as 16 lowercase hex digits. Text in a metadata string keeps the file readable by every
/// safetensors reader, which require metadata values to be strings.
template <typename Tensors>
std::string encode_checksums(const Tensors& file) {
  json::Value sums = json::Value::object();
  for (const auto& tensor : file.tensors)
    json::append(sums, tensor.name, fmt::format("{:016x}", checksum(tensor.bytes)));
  return json::dump(sums);
}

/// The length field plus the space-padded JSON header; the data section follows it directly.
template <typename Tensors>
std::string encode_header(const Tensors& file, std::string_view context) {
  validate(file, context);
  // validate() has checked that the names and keys are distinct; dumping checks the UTF-8 of
  // each, the checksum entry's tensor names first.
  std::string json_text;
  try {
    json::Value root = json::Value::object();
    if (!file.metadata.empty() || !file.tensors.empty()) {
      json::Value metadata = json::Value::object();
      for (const auto& [key, value] : file.metadata) json::append(metadata, key, value);
      if (!file.tensors.empty())
        json::append(metadata, std::string(checksum_key), encode_checksums(file));
      json::append(metadata, std::string(header_checksum_key),
                   fmt::format("{:016x}", header_checksum(file.metadata, file.tensors)));
      json::append(root, std::string(metadata_key), std::move(metadata));
    }
    uint64_t offset = 0;
    for (const auto& tensor : file.tensors) {
      uint64_t end = offset + tensor.bytes.size();
      json::append(root, tensor.name,
                   {{"dtype", safetensors_name(tensor.dtype)},
                    {"shape", tensor.shape},
                    {"data_offsets", {offset, end}}});
      offset = end;
    }
    json_text = json::dump(root);
  } catch (const Error& e) {
    fail("{}: tensor names and metadata must be valid UTF-8 ({})", context, e.what());
  }
  // Padding to 8 bytes keeps the data section aligned for readers that map the file.
  json_text.append((8 - json_text.size() % 8) % 8, ' ');
  if (json_text.size() > max_header_bytes)
    fail("{}: the header would be {} bytes, more than readers accept ({})", context,
         json_text.size(), max_header_bytes);
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

// ---- reading ----

struct Entry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

struct Layout {
  std::vector<Entry> entries;                                 // sorted by data offset
  std::vector<std::pair<std::string, std::string>> metadata;  // without the checksums
  std::vector<uint64_t> checksums;                            // per entry; empty when none
};

void check_header_length(uint64_t header_length, uint64_t total_size, std::string_view origin) {
  if (total_size < length_field_bytes)
    not_safetensors(origin,
                    fmt::format("{} bytes, too short for the 8-byte header length", total_size));
  // Checked first: random bytes give a length far larger than the file, which says more about
  // the file than the header cap does.
  if (header_length > total_size - length_field_bytes)
    not_safetensors(origin, fmt::format("its header length field says {} bytes, but the file "
                                        "has {} bytes",
                                        header_length, total_size));
  if (header_length > max_header_bytes)
    fail("{}: header length {} exceeds the limit of {} bytes", origin, header_length,
         max_header_bytes);
}

std::vector<std::pair<std::string, std::string>> read_metadata(const json::Value& value,
                                                               std::string_view origin) {
  // null is no metadata, as the reference reader (an Option) takes it.
  if (value.is_null()) return {};
  if (!value.is_object())
    fail("{}: '{}' must be an object, got {}", origin, metadata_key, value.type_name());
  if (value.size() > max_metadata_entries)
    fail("{}: {} metadata entries, more than the limit of {}", origin, value.size(),
         max_metadata_entries);
  std::vector<std::pair<std::string, std::string>> metadata;
  for (const auto& [key, entry] : value.items()) {
    if (!entry.is_string())
      fail("{}: metadata '{}' must be a string, got {}", origin, key, entry.type_name());
    metadata.emplace_back(key, entry.get<std::string>());
  }
  return metadata;
}

/// Reads a JSON array of non-negative integers; nullopt when it is anything else.
std::optional<std::vector<int64_t>> read_naturals(const json::Value& value) {
  if (!value.is_array()) return std::nullopt;
  std::vector<int64_t> numbers;
  for (const json::Value& element : value) {
    // The strict reader keeps only int64 integers.
    if (!element.is_number_integer() || element.get<int64_t>() < 0) return std::nullopt;
    numbers.push_back(element.get<int64_t>());
  }
  return numbers;
}

Entry read_entry(std::string name, const json::Value& value, uint64_t data_size,
                 std::string_view origin) {
  auto bad = [&](std::string_view what) { fail("{}: tensor '{}': {}", origin, name, what); };
  if (name.empty()) fail("{}: empty tensor name in header", origin);
  if (!value.is_object()) bad(fmt::format("expected an object, got {}", value.type_name()));
  for (const auto& [key, field] : value.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      bad(fmt::format("unexpected field '{}'", key));
  for (std::string_view key : {"dtype", "shape", "data_offsets"})
    if (!json::find(value, key)) bad(fmt::format("missing field '{}'", key));

  Entry entry;
  const json::Value& dtype = value.at("dtype");
  if (!dtype.is_string()) bad("'dtype' must be a string");
  const std::string& tag = dtype.get_ref<const std::string&>();
  std::optional<DType> parsed_dtype = dtype_from_tag(tag);
  if (!parsed_dtype) {
    std::vector<std::string_view> readable;
    for (DType known : all_dtypes) readable.push_back(safetensors_name(known));
    bad(fmt::format("dtype '{}' is not one mixtape reads ({})", tag, fmt::join(readable, ", ")));
  }
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
                    entry.end - entry.begin, tag, describe(entry.shape), *expected));
  entry.name = std::move(name);
  return entry;
}

/// Rejects a header naming one tensor twice. Sorting pointers costs 8 bytes a tensor, where a
/// hash set would cost ~50.
void check_unique_names(const std::vector<Entry>& entries, std::string_view origin) {
  std::vector<const std::string*> names;
  names.reserve(entries.size());
  for (const Entry& entry : entries) names.push_back(&entry.name);
  std::sort(names.begin(), names.end(), [](auto* a, auto* b) { return *a < *b; });
  for (size_t i = 1; i < names.size(); ++i)
    if (*names[i] == *names[i - 1])
      fail("{}: duplicate key \"{}\" in the header", origin, *names[i]);
}

/// A checksum as the file writes it: exactly 16 hex digits.
std::optional<uint64_t> parse_hex16(std::string_view hex) {
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(hex.data(), hex.data() + hex.size(), value, 16);
  if (hex.size() != 16 || ec != std::errc() || end != hex.data() + hex.size()) return std::nullopt;
  return value;
}

/// Moves the checksum entries out of the metadata, checks the header's, and matches the tensors'
/// to the entries; no entry means the file has no checksums of that kind. Any other key of the
/// reserved prefix is an error: a damaged byte in the key's name must not turn verification off
/// silently.
std::vector<uint64_t> take_checksums(Layout& layout, std::string_view origin) {
  std::optional<std::string> text, header_text;
  for (const auto& [key, value] : layout.metadata) {
    if (key.starts_with(reserved_metadata_prefix) && key != checksum_key &&
        key != header_checksum_key)
      fail(
          "{}: metadata '{}' uses the prefix reserved for checksums but is not '{}' or '{}': the "
          "file is damaged, or from a newer mixtape",
          origin, key, checksum_key, header_checksum_key);
    if (std::string_view near = near_checksum_key(key); !near.empty())
      fail("{}: metadata '{}' is one byte from '{}': the file is damaged", origin, key, near);
  }
  std::erase_if(layout.metadata, [&](auto& key_value) {
    std::optional<std::string>* taken = key_value.first == checksum_key          ? &text
                                        : key_value.first == header_checksum_key ? &header_text
                                                                                 : nullptr;
    if (taken) *taken = std::move(key_value.second);
    return taken != nullptr;
  });
  if (header_text) {
    std::optional<uint64_t> recorded = parse_hex16(*header_text);
    if (!recorded) fail("{}: metadata '{}' is not 16 hex digits", origin, header_checksum_key);
    uint64_t actual = header_checksum(layout.metadata, layout.entries);
    if (actual != *recorded)
      fail(
          "{}: the header is corrupt: its metadata and tensor names, dtypes and shapes hash to "
          "xxh3_64 {:016x}, the file recorded {:016x}",
          origin, actual, *recorded);
  }
  if (!text) return {};
  auto bad = [&](std::string_view what) {
    fail("{}: metadata '{}' {}", origin, checksum_key, what);
  };
  json::Value sums;
  try {
    sums = json::parse(*text, layout.entries.size() + 1);
  } catch (const Error& e) {
    bad(fmt::format("is not a JSON object of the tensors' checksums: {}", e.what()));
  }
  if (!sums.is_object()) bad("must hold a JSON object");
  std::unordered_map<std::string_view, uint64_t> by_name;
  for (const auto& [name, sum] : sums.items()) {
    std::optional<uint64_t> value =
        sum.is_string() ? parse_hex16(sum.get_ref<const std::string&>()) : std::nullopt;
    if (!value) bad(fmt::format("gives tensor '{}' a checksum that is not 16 hex digits", name));
    by_name.emplace(name, *value);
  }
  // Checksums for a different set of tensors mean a tool rewrote the file and kept ours.
  if (by_name.size() != layout.entries.size())
    bad(fmt::format("lists {} tensors, the file holds {}", by_name.size(), layout.entries.size()));
  std::vector<uint64_t> checksums;
  for (const Entry& entry : layout.entries) {
    auto found = by_name.find(entry.name);
    if (found == by_name.end()) bad(fmt::format("has no checksum for tensor '{}'", entry.name));
    checksums.push_back(found->second);
  }
  return checksums;
}

/// Checks tensor index (named name: file_from has moved the entries' names) against its checksum.
void verify_checksum(const Layout& layout, size_t index, std::string_view name,
                     std::span<const std::byte> bytes, std::string_view origin) {
  if (layout.checksums.empty()) return;
  uint64_t actual = checksum(bytes);
  if (actual != layout.checksums[index])
    fail(
        "{}: tensor '{}' is corrupt: its {} bytes hash to xxh3_64 {:016x}, the file recorded "
        "{:016x}",
        origin, name, bytes.size(), actual, layout.checksums[index]);
}

Layout read_header(std::string_view header, uint64_t data_size, std::string_view origin) {
  // The reference implementation requires this too; it tells a safetensors file from others.
  if (header.empty() || header[0] != '{')
    not_safetensors(origin, "its header is not a JSON object");

  // Member by member, so memory stays a small multiple of the header's size; what the members
  // say is checked as they arrive, so a hostile header is rejected early.
  Layout layout;
  bool have_metadata = false, member_failed = false;
  try {
    json::parse_members(header, max_member_values, [&](std::string key, json::Value value) {
      try {
        if (key == metadata_key) {
          if (have_metadata) fail("{}: duplicate key \"{}\" in the header", origin, key);
          have_metadata = true;
          layout.metadata = read_metadata(value, origin);
        } else {
          if (layout.entries.size() == max_tensors)
            fail("{}: more than {} tensors, the limit", origin, max_tensors);
          layout.entries.push_back(read_entry(std::move(key), value, data_size, origin));
        }
      } catch (const Error&) {
        member_failed = true;
        throw;
      }
    });
  } catch (const Error& e) {
    if (member_failed) throw;
    fail("{}: header is not valid JSON (offsets count from the header start): {}", origin,
         e.what());
  }
  check_unique_names(layout.entries, origin);

  // The spec requires the tensors to tile the data section exactly; anything else means a
  // corrupt or hand-crafted file, and gaps could hide appended payloads.
  // Stable, so empty tensors sharing an offset keep the header's order.
  std::stable_sort(layout.entries.begin(), layout.entries.end(),
                   [](const Entry& a, const Entry& b) {
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
  layout.checksums = take_checksums(layout, origin);
  return layout;
}

File file_from(Layout& layout) {
  File file;
  file.metadata = std::move(layout.metadata);
  file.tensors.reserve(layout.entries.size());
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

/// Sizes a tensor's buffer; running out of memory is an mt::Error naming what asked for how much.
void allocate(TensorData& tensor, uint64_t size, std::string_view origin) {
  try {
    tensor.bytes.resize(size);
  } catch (const std::bad_alloc&) {
    fail("{}: out of memory allocating {} bytes for tensor '{}'", origin, size, tensor.name);
  } catch (const std::length_error&) {
    fail("{}: out of memory allocating {} bytes for tensor '{}'", origin, size, tensor.name);
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
  File file = file_from(layout);
  for (size_t i = 0; i < layout.entries.size(); ++i) {
    std::span<const std::byte> span =
        data.subspan(layout.entries[i].begin, layout.entries[i].end - layout.entries[i].begin);
    verify_checksum(layout, i, file.tensors[i].name, span, origin);
    allocate(file.tensors[i], span.size(), origin);
    std::copy(span.begin(), span.end(), file.tensors[i].bytes.begin());
  }
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
  std::string header;
  try {
    header.resize(header_length);
  } catch (const std::bad_alloc&) {
    fail("{}: out of memory allocating {} bytes for the header", path, header_length);
  }
  read_exact(fd, header.data(), header.size(), path);
  // Every entry is checked to lie within the file's real size here, so what is allocated below
  // is data the file holds, never merely what its header claims.
  Layout layout = read_header(header, file_size - length_field_bytes - header_length, path);
  header = {};
  // Past the memory limit, the whole file is refused before any tensor is allocated.
  check_memory_request(file_size, fmt::format("loading '{}'", path));

  // Entries tile the data section in order, so their bytes can be read straight into place.
  File file = file_from(layout);
  for (size_t i = 0; i < layout.entries.size(); ++i) {
    TensorData& tensor = file.tensors[i];
    allocate(tensor, layout.entries[i].end - layout.entries[i].begin, path);
    read_exact(fd, tensor.bytes.data(), tensor.bytes.size(), path);
    verify_checksum(layout, i, tensor.name, tensor.bytes, path);
  }
  return file;
}

namespace {
template <typename Tensors>
void write_tensors(const std::string& path, const Tensors& file) {
  std::string header = encode_header(file, fmt::format("cannot write '{}'", path));
  write_file_atomically(path, [&](int fd) {
    write_all(fd, header.data(), header.size(), path);
    for (const auto& tensor : file.tensors)
      write_all(fd, tensor.bytes.data(), tensor.bytes.size(), path);
  });
}

}  // namespace

void write(const std::string& path, const File& file) { write_tensors(path, file); }
void write(const std::string& path, const FileView& file) { write_tensors(path, file); }

}  // namespace mixtape::safetensors
