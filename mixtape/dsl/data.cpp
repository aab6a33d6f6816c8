// mixtape/dsl/data.cpp -- file reading, the digits CSV parser, CharVocab, datasets and the
// DataLoader.
#include "mixtape/dsl/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>

#include "mixtape/dsl/error.h"

namespace mixtape {

// ---- files ----

namespace {
// A descriptor of the regular file at path, opened without waiting: a FIFO or a device there
// would block the open or never end, and is refused instead.
int open_regular_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail("cannot open {}: {}", path, std::strerror(errno));
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    int error = errno;
    ::close(fd);
    fail("cannot read {}: {}", path, std::strerror(error));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    fail("cannot read {}: {}", path,
         S_ISDIR(info.st_mode) ? "it is a folder" : "not a regular file");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}
}  // namespace

std::string read_file(const std::string& path) {
  int fd = open_regular_file(path);
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(::fdopen(fd, "rb"), &std::fclose);
  if (!file) {
    ::close(fd);
    fail("cannot open {}: {}", path, std::strerror(errno));
  }
  std::string data;
  char buffer[1 << 16];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof buffer, file.get())) > 0) data.append(buffer, got);
  // fopen succeeds on a directory on Linux; the failure only shows up when reading.
  if (std::ferror(file.get())) fail("cannot read {}: {}", path, std::strerror(errno));
  return data;
}

std::string read_gzip_file(const std::string& path, int64_t max_bytes) {
  const std::string packed = read_file(path);
  auto too_large = [&] {
    fail("cannot read gzip file {}: it inflates to more than {} bytes (read_gzip_file's max_bytes)",
         path, max_bytes);
  };
  // Not gzip (no magic bytes): the file as it is.
  if (packed.size() < 2 || static_cast<unsigned char>(packed[0]) != 0x1f ||
      static_cast<unsigned char>(packed[1]) != 0x8b) {
    if (static_cast<int64_t>(packed.size()) > max_bytes) too_large();
    return packed;
  }
  // Every member (pigz and `cat a.gz b.gz` write several), each checked to its trailer; what
  // follows the last must be another member. zlib's gzread stopped silently at anything that
  // was not a gzip header: a damaged second member lost the rest of the data without a word.
  z_stream z{};
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK)
    fail("cannot read gzip file {}: out of memory for the decompressor", path);
  struct End {
    z_stream& z;
    ~End() { inflateEnd(&z); }
  } end{z};
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(packed.data()));
  z.avail_in = static_cast<uInt>(std::min<size_t>(packed.size(), UINT32_MAX));
  size_t unread = packed.size() - z.avail_in;  // beyond avail_in's 32 bits
  std::string data;
  char buffer[1 << 16];
  for (;;) {
    if (z.avail_in == 0 && unread > 0) {
      z.avail_in = static_cast<uInt>(std::min<size_t>(unread, UINT32_MAX));
      unread -= z.avail_in;
    }
    z.next_out = reinterpret_cast<Bytef*>(buffer);
    z.avail_out = sizeof buffer;
    const int code = inflate(&z, Z_NO_FLUSH);
    const size_t got = sizeof buffer - z.avail_out;
    // A small file can inflate a thousandfold (a "gzip bomb"): stop at the cap, not at memory.
    if (static_cast<int64_t>(data.size() + got) > max_bytes) too_large();
    data.append(buffer, got);
    if (code == Z_STREAM_END) {
      if (z.avail_in == 0 && unread == 0) return data;
      // Zeros after the last member are padding (tape blocks), which gzip -d and Python accept.
      const char* rest = reinterpret_cast<const char*>(z.next_in);
      if (std::all_of(rest, packed.data() + packed.size(), [](char c) { return c == 0; }))
        return data;
      if (z.avail_in < 2 || z.next_in[0] != 0x1f || z.next_in[1] != 0x8b)
        fail("cannot read gzip file {}: {} bytes after the end of its gzip data are not gzip", path,
             z.avail_in + unread);
      inflateReset(&z);
      continue;
    }
    const bool stuck = got == 0 && z.avail_in == 0 && unread == 0;
    if ((code == Z_OK || code == Z_BUF_ERROR) && !stuck) continue;
    if (code == Z_OK || code == Z_BUF_ERROR)
      fail("cannot read gzip file {}: truncated (the gzip data ends early)", path);
    fail("cannot read gzip file {}: corrupt: {}", path, z.msg ? z.msg : "invalid data");
  }
}

std::string default_data_dir() {
  const char* env = std::getenv("MIXTAPE_DATA_DIR");
  if (env != nullptr && *env != '\0') return env;
#ifdef MIXTAPE_SOURCE_DATA_DIR
  return MIXTAPE_SOURCE_DATA_DIR;
#else
  return "examples/data";
#endif
}

// ---- digits ----

namespace {

constexpr int64_t kDigitPixels = 64;

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

// from_chars rather than strtod/stoi: locale independent, no exceptions, and it reports how much
// of the field it consumed, so "3x" is rejected instead of read as 3.
template <typename T>
bool parse_number(std::string_view text, T& value) {
  if (text.empty()) return false;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  return ec == std::errc() && end == text.data() + text.size();
}

}  // namespace

Digits load_digits(const std::string& path) {
  std::string text = read_gzip_file(path);
  Digits digits;
  std::string_view rest = text;
  int64_t line_number = 0;
  std::vector<std::string_view> fields;
  while (!rest.empty()) {
    ++line_number;
    size_t newline = rest.find('\n');
    std::string_view line = rest.substr(0, newline);
    rest = newline == std::string_view::npos ? std::string_view() : rest.substr(newline + 1);

    fields.clear();
    for (size_t start = 0;;) {
      size_t comma = line.find(',', start);
      fields.push_back(trim(line.substr(start, comma - start)));
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    if (static_cast<int64_t>(fields.size()) != kDigitPixels + 1) {
      fail("{}:{}: expected {} comma-separated fields (64 pixels and a label), found {}", path,
           line_number, kDigitPixels + 1, line.empty() ? 0 : fields.size());
    }
    for (int64_t i = 0; i < kDigitPixels; ++i) {
      double value;
      if (!parse_number(fields[i], value)) {
        fail("{}:{}: pixel {}: '{}' is not a number", path, line_number, i, fields[i]);
      }
      if (!(value >= 0 && value <= 16)) {
        fail("{}:{}: pixel {}: {} is outside 0..16", path, line_number, i, fields[i]);
      }
      digits.pixels.push_back(static_cast<float>(value));
    }
    int64_t label;
    if (!parse_number(fields[kDigitPixels], label)) {
      fail("{}:{}: label '{}' is not an integer", path, line_number, fields[kDigitPixels]);
    }
    if (label < 0 || label > 9) {
      fail("{}:{}: label {} is outside 0..9", path, line_number, label);
    }
    digits.labels.push_back(label);
  }
  if (digits.labels.empty()) fail("{}: no digits in the file", path);
  return digits;
}

// ---- CharVocab ----

namespace {

// Bytes as they would be written in a C string, so that control characters and stray UTF-8
// bytes in an error message are visible.
std::string describe_byte(char c) {
  auto byte = static_cast<unsigned char>(c);
  if (byte == '\n') return "'\\n'";
  if (byte == '\t') return "'\\t'";
  if (byte == '\r') return "'\\r'";
  if (byte >= 0x20 && byte < 0x7f) return fmt::format("'{}'", c);
  return fmt::format("'\\x{:02x}'", byte);
}

}  // namespace

CharVocab::CharVocab(std::string_view text) {
  if (text.empty()) fail("CharVocab: the text is empty, so there is no vocabulary");
  bool present[256] = {};
  for (char c : text) present[static_cast<unsigned char>(c)] = true;
  std::fill(std::begin(ids_), std::end(ids_), int16_t{-1});
  for (int byte = 0; byte < 256; ++byte) {
    if (!present[byte]) continue;
    ids_[byte] = static_cast<int16_t>(chars_.size());
    chars_.push_back(static_cast<char>(byte));
  }
}

std::vector<int64_t> CharVocab::encode(std::string_view text) const {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    int16_t id = ids_[static_cast<unsigned char>(text[i])];
    if (id < 0) {
      fail("CharVocab::encode: character {} at position {} is not in the vocabulary",
           describe_byte(text[i]), i);
    }
    ids[i] = id;
  }
  return ids;
}

std::string CharVocab::decode(const std::vector<int64_t>& ids) const {
  std::string text(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= size()) {
      fail("CharVocab::decode: id {} at position {} is outside [0, {})", ids[i], i, size());
    }
    text[i] = chars_[static_cast<size_t>(ids[i])];
  }
  return text;
}

// ---- datasets ----

Dataset::~Dataset() = default;

namespace {

int64_t example_numel(const Shape& shape, const char* what) {
  for (int64_t d : shape)
    if (d < 1) fail("TensorDataset: {} shape {} has a dimension below 1", what, to_string(shape));
  std::optional<int64_t> n = checked_numel(shape);  // a product past 2^63 wrapped before
  if (!n)
    fail("TensorDataset: {} shape {} has more elements than a 64-bit count holds", what,
         to_string(shape));
  return *n;
}

Shape batch_shape(int64_t batch, const Shape& example) {
  Shape shape{batch};
  shape.insert(shape.end(), example.begin(), example.end());
  return shape;
}

void check_index(const char* dataset, int64_t index, int64_t size) {
  if (index < 0 || index >= size) {
    fail("{}::get_batch: index {} is outside [0, {})", dataset, index, size);
  }
}

}  // namespace

TensorDataset::Examples TensorDataset::examples_of(const Tensor& t, const char* what) {
  if (!t.defined()) fail("TensorDataset: the {} are undefined", what);
  if (t.dim() < 1) fail("TensorDataset: the {} are 0-d; examples lie along a leading axis", what);
  eval({t});
  const Storage& values = *t.node()->value;
  if (values.count != t.numel())
    fail("TensorDataset: the {}' storage holds {} values for shape {}", what, values.count,
         to_string(t.shape()));
  Examples out{t.dtype(), Shape(t.shape().begin() + 1, t.shape().end()), 0, {}};
  out.numel = numel(out.shape);
  const std::byte* bytes = values.host_data();
  out.bytes.assign(bytes, bytes + values.size_bytes());
  return out;
}

TensorDataset::TensorDataset(const Tensor& inputs, const Tensor& targets)
    : inputs_(examples_of(inputs, "inputs")), targets_(examples_of(targets, "targets")) {
  count_ = inputs.shape()[0];
  if (count_ == 0 || targets.shape()[0] != count_)
    fail(
        "TensorDataset: inputs of shape {} and targets of shape {} are not the same, non-zero "
        "number of examples",
        to_string(inputs.shape()), to_string(targets.shape()));
}

TensorDataset::TensorDataset(std::vector<float> features, Shape feature_shape,
                             std::vector<int64_t> targets, Shape target_shape) {
  const int64_t feature_numel = example_numel(feature_shape, "feature");
  const int64_t target_numel = example_numel(target_shape, "target");
  auto n_features = static_cast<int64_t>(features.size());
  auto n_targets = static_cast<int64_t>(targets.size());
  if (n_features == 0 || n_features % feature_numel != 0) {
    fail(
        "TensorDataset: {} feature values are not a whole, non-zero number of examples of "
        "shape {}",
        n_features, to_string(feature_shape));
  }
  count_ = n_features / feature_numel;
  if (n_targets / target_numel != count_ || n_targets % target_numel != 0) {
    fail(
        "TensorDataset: {} examples of features need {} target values of shape {} each, "
        "got {}",
        count_, count_ * target_numel, to_string(target_shape), n_targets);
  }
  auto bytes_of = [](const auto& values) {
    const auto* first = reinterpret_cast<const std::byte*>(values.data());
    return std::vector<std::byte>(first, first + values.size() * sizeof(values[0]));
  };
  inputs_ = {f32, std::move(feature_shape), feature_numel, bytes_of(features)};
  targets_ = {i64, std::move(target_shape), target_numel, bytes_of(targets)};
}

Tensor TensorDataset::gather(const Examples& examples, std::span<const int64_t> indices) const {
  const auto batch = static_cast<int64_t>(indices.size());
  const size_t row = static_cast<size_t>(examples.numel) * size_of(examples.dtype);
  auto out =
      std::make_shared<Storage>(examples.dtype, batch * examples.numel, Storage::Uninitialized{});
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t i = indices[static_cast<size_t>(b)];
    check_index("TensorDataset", i, count_);
    std::memcpy(out->bytes.data() + static_cast<size_t>(b) * row,
                examples.bytes.data() + static_cast<size_t>(i) * row, row);
  }
  return from_storage(std::move(out), batch_shape(batch, examples.shape));
}

Batch TensorDataset::get_batch(std::span<const int64_t> indices) const {
  return {gather(inputs_, indices), gather(targets_, indices)};
}

TextWindows::TextWindows(std::vector<int64_t> tokens, int64_t context)
    : tokens_(std::move(tokens)), context_(context) {
  if (context_ < 1) fail("TextWindows: context length {} must be at least 1", context_);
  if (static_cast<int64_t>(tokens_.size()) <= context_) {
    fail("TextWindows: {} tokens make no window of context {} plus a next token", tokens_.size(),
         context_);
  }
}

int64_t TextWindows::size() const { return static_cast<int64_t>(tokens_.size()) - context_; }

Batch TextWindows::get_batch(std::span<const int64_t> indices) const {
  auto batch = static_cast<int64_t>(indices.size());
  std::vector<int64_t> inputs(static_cast<size_t>(batch * context_));
  std::vector<int64_t> targets(inputs.size());
  for (int64_t b = 0; b < batch; ++b) {
    int64_t i = indices[b];
    check_index("TextWindows", i, size());
    std::copy_n(tokens_.begin() + i, context_, inputs.begin() + b * context_);
    std::copy_n(tokens_.begin() + i + 1, context_, targets.begin() + b * context_);
  }
  return {tensor(inputs, {batch, context_}, i64), tensor(targets, {batch, context_}, i64)};
}

// ---- DataLoader ----

namespace {

// splitmix64 (Steele, Lea and Flood): tiny, fully specified, and good enough to drive a shuffle.
// std::mt19937 would be reproducible too, but std::uniform_int_distribution is not specified
// bit for bit, so orders would differ between standard libraries.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound) without modulo bias: draws below 2^64 mod bound are rejected so that
  // every residue is hit by the same number of accepted values.
  uint64_t below(uint64_t bound) {
    uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      uint64_t r = next();
      if (r >= threshold) return r % bound;
    }
  }

 private:
  uint64_t state_;
};

}  // namespace

DataLoader::DataLoader(const Dataset& data, int64_t batch_size, bool shuffle, uint64_t seed,
                       bool drop_last)
    : DataLoader(data, batch_size, shuffle, seed, Shard{}, drop_last) {}

DataLoader::DataLoader(const Dataset& data, int64_t batch_size, bool shuffle, uint64_t seed,
                       Shard shard, bool drop_last)
    : data_(&data),
      batch_size_(batch_size),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last),
      shard_(shard) {
  int64_t n = data.size();
  if (n < 1) fail("DataLoader: the dataset is empty");
  if (batch_size < 1) fail("DataLoader: batch_size {} must be at least 1", batch_size);
  if (shard.count < 1 || shard.index < 0 || shard.index >= shard.count)
    fail("DataLoader: shard {} of {} does not exist (0 <= index < count)", shard.index,
         shard.count);
  if (n < shard.count)
    fail("DataLoader: the dataset's {} examples leave shard {} of {} none", n, shard.index,
         shard.count);
  if (drop_last && batch_size > n / shard.count) {
    fail(
        "DataLoader: batch_size {} exceeds the {} examples{}, so with drop_last no batch is ever "
        "complete",
        batch_size, n / shard.count,
        shard.count > 1 ? fmt::format(" of each of {} shards", shard.count) : " of the dataset");
  }
  start_epoch();
}

namespace {
// The batches of an epoch of `examples` ((n + b - 1) / b overflowed for a batch size near 2^63).
int64_t batches_of(int64_t examples, int64_t batch_size, bool drop_last) {
  return examples / batch_size + (!drop_last && examples % batch_size != 0);
}
}  // namespace

int64_t DataLoader::batches_per_epoch() const {
  return batches_of(data_->size() / shard_.count, batch_size_, drop_last_);
}

void DataLoader::start_epoch() {
  int64_t n = data_->size();
  order_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order_[i] = i;
  if (!shuffle_) return;
  // Each epoch's permutation starts from the identity with its own stream, so it depends only on
  // (seed, epoch): a run resumed at epoch e sees exactly what the original run saw.
  // The epoch goes into the seed's stream, not beside it: a symmetric mix (the XOR of both
  // streams) gave seed s at epoch e the order of seed e at epoch s.
  SplitMix64 rng(SplitMix64(SplitMix64(seed_).next() + static_cast<uint64_t>(epoch_)).next());
  for (int64_t i = n - 1; i > 0; --i) {
    auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
    std::swap(order_[i], order_[j]);
  }
}

Batch DataLoader::next() {
  int64_t n = static_cast<int64_t>(order_.size()) / shard_.count;
  int64_t start = batch_ * batch_size_;  // below n: batch_ < batches_per_epoch()
  int64_t stop = batch_size_ >= n - start ? n : start + batch_size_;
  Batch batch;
  if (shard_.count == 1) {
    batch = data_->get_batch({order_.data() + start, static_cast<size_t>(stop - start)});
  } else {
    std::vector<int64_t> share;
    share.reserve(static_cast<size_t>(stop - start));
    for (int64_t k = start; k < stop; ++k) share.push_back(order_[k * shard_.count + shard_.index]);
    batch = data_->get_batch(share);
  }
  // Roll over eagerly so epoch() already names the epoch of the next batch, which is what a
  // training loop logging "epoch N" right after the last batch of an epoch expects.
  if (++batch_ == batches_per_epoch()) {
    ++epoch_;
    batch_ = 0;
    start_epoch();
  }
  return batch;
}

DataLoader::State DataLoader::state() const {
  return {.epoch = epoch_,
          .position = batch_,
          .order = order_,
          .batch_size = batch_size_,
          .shuffle = shuffle_,
          .seed = seed_,
          .drop_last = drop_last_,
          .shards = shard_.count};
}

// The position of this loader that `state` stands for: the same count of examples of the
// epoch's order taken by all processes together.
int64_t DataLoader::resumed_position(const State& state) const {
  if (state.shards == shard_.count) return state.position;
  // check_state bounds position, so taken is at most the dataset's size; a global batch whose
  // size overflows is larger than any such count.
  int64_t taken = state.position * state.batch_size * state.shards, global = 0;
  if (__builtin_mul_overflow(batch_size_, shard_.count, &global) || taken % global != 0)
    fail(
        "DataLoader::load_state: the state was taken by {} processes {} examples into the "
        "epoch, which is not a whole number of batches of {} processes ({} each); resume at an "
        "epoch's start or at a world size that divides it",
        state.shards, taken, shard_.count, batch_size_);
  return taken / global;
}

void DataLoader::check_state(const State& state) const {
  auto differs = [](const char* what, auto saved, auto own) {
    fail("DataLoader::load_state: the state is of a loader with {} {}, this one has {}", what,
         saved, own);
  };
  if (state.batch_size != batch_size_) differs("batch_size", state.batch_size, batch_size_);
  if (state.shuffle != shuffle_) differs("shuffle", state.shuffle, shuffle_);
  if (state.seed != seed_) differs("seed", state.seed, seed_);
  if (state.drop_last != drop_last_) differs("drop_last", state.drop_last, drop_last_);
  int64_t n = data_->size();
  if (static_cast<int64_t>(state.order.size()) != n)
    fail("DataLoader::load_state: the state's order has {} entries, the dataset has {} examples",
         state.order.size(), n);
  std::vector<bool> seen(static_cast<size_t>(n));
  for (size_t i = 0; i < state.order.size(); ++i) {
    int64_t index = state.order[i];
    if (index < 0 || index >= n || seen[static_cast<size_t>(index)])
      fail("DataLoader::load_state: the order is not a permutation of [0, {}): entry {} is {}{}", n,
           i, index, index >= 0 && index < n ? ", which comes twice" : "");
    seen[static_cast<size_t>(index)] = true;
  }
  if (state.epoch < 0) fail("DataLoader::load_state: epoch {} is negative", state.epoch);
  if (state.shards < 1 || state.shards > n)
    fail("DataLoader::load_state: the state is of {} shards, of a dataset of {}", state.shards, n);
  // A loader of `shards` shards has this many batches, each at most batch_size of its share
  // (so resumed_position's products stay within the dataset's size).
  const int64_t batches = batches_of(n / state.shards, state.batch_size, drop_last_);
  if (state.position < 0 || state.position >= batches)
    fail("DataLoader::load_state: position {} is outside the epoch's {} batches of {} shards",
         state.position, batches, state.shards);
  if (int64_t position = resumed_position(state); position >= batches_per_epoch())
    fail("DataLoader::load_state: position {} is outside the epoch's {} batches", position,
         batches_per_epoch());
}

void DataLoader::load_state(const State& state) {
  check_state(state);
  epoch_ = state.epoch;
  batch_ = resumed_position(state);
  order_ = state.order;
}

DataLoader::Iterator::Iterator(DataLoader* loader)
    : loader_(loader), epoch_(loader->epoch()), batch_(loader->next()) {}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  if (loader_ == nullptr) return *this;
  if (loader_->epoch() != epoch_) {
    // The batch just consumed was the epoch's last: next() has already moved on.
    loader_ = nullptr;
    batch_ = Batch();
  } else {
    batch_ = loader_->next();
  }
  return *this;
}

}  // namespace mixtape
