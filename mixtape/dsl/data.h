// mixtape/dsl/data.h -- data files, the bundled example data sets, character vocabularies and
// loaders.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixtape/dsl/shape.h"
#include "mixtape/dsl/tensor.h"

namespace mixtape {

// ---- files ----

/// The whole file as bytes; mt::Error naming the path when it cannot be opened or read, or is no
/// regular file (a FIFO would block for ever).
std::string read_file(const std::string& path);
/// The decompressed contents of a gzip file. Files that are not gzip are returned as they are, so
/// callers need not care whether a data set was shipped compressed. mt::Error naming the path for
/// a missing or unreadable file (a FIFO or device too: only regular files are read), for a
/// corrupt or truncated gzip stream (every member of a multi-member file is read and checked, and
/// bytes after the last that are not gzip are an error, as for gzip -d), and for one that
/// inflates past max_bytes.
std::string read_gzip_file(const std::string& path, int64_t max_bytes = int64_t{1} << 30);

/// The directory the examples and tests read their data from: $MIXTAPE_DATA_DIR when set and not
/// empty, else the source tree's examples/data as recorded by the build, else "examples/data".
std::string default_data_dir();

// ---- the digits data set (examples/data/digits.csv.gz) ----

/// UCI optdigits as shipped by scikit-learn: 8x8 images of handwritten digits.
struct Digits {
  std::vector<float> pixels;    // [count(), 64], row-major, the raw 0..16 values
  std::vector<int64_t> labels;  // [count()], 0..9
  int64_t count() const { return static_cast<int64_t>(labels.size()); }
};

/// Parses the digits CSV (gzip or plain): per line 64 pixel values in 0..16 then an integer label
/// in 0..9, comma separated. Malformed input throws mt::Error as "path:line: what is wrong".
Digits load_digits(const std::string& path);

// ---- characters as tokens ----

/// Byte-level vocabulary for character language models: the distinct bytes of a text, sorted, so
/// the ids do not depend on the order in which characters first appear.
class CharVocab {
 public:
  /// mt::Error for an empty text (a model needs at least one token).
  explicit CharVocab(std::string_view text);

  int64_t size() const { return static_cast<int64_t>(chars_.size()); }
  /// The vocabulary's bytes in id order.
  const std::string& chars() const { return chars_; }
  /// mt::Error naming the character and its position for a byte not in the vocabulary.
  std::vector<int64_t> encode(std::string_view text) const;
  /// mt::Error naming the id and its position for an id outside [0, size()).
  std::string decode(const std::vector<int64_t>& ids) const;

 private:
  std::string chars_;
  int16_t ids_[256];  // byte -> id, -1 when absent
};

// ---- datasets and loaders (in the manner of torch.utils.data) ----

struct Batch {
  Tensor inputs;
  Tensor targets;
};

/// A finite, indexable set of examples that can gather any subset of them into one batch.
class Dataset {
 public:
  virtual ~Dataset();
  virtual int64_t size() const = 0;
  /// The examples at `indices`, stacked along a new leading axis of length indices.size().
  virtual Batch get_batch(std::span<const int64_t> indices) const = 0;
};

/// Examples held in host memory, as torch.utils.data.TensorDataset of two tensors: example i is
/// (inputs[i], targets[i]), of any dtypes (f32 images, i64 token ids, f32 regression targets, i64
/// class labels). Batches stack them: inputs [B, inputs.shape[1:]...] and targets
/// [B, targets.shape[1:]...], in their own dtypes.
class TensorDataset : public Dataset {
 public:
  /// Copies the two tensors' values (evaluating them). mt::Error unless both are defined, have a
  /// leading axis, and hold the same non-zero number of examples.
  TensorDataset(const Tensor& inputs, const Tensor& targets);
  /// From host vectors: f32 features and i64 targets of fixed per-example shapes ({} for one class
  /// label per example). mt::Error unless both hold the same whole, non-zero number of examples.
  TensorDataset(std::vector<float> features, Shape feature_shape, std::vector<int64_t> targets,
                Shape target_shape = {});

  int64_t size() const override { return count_; }
  Batch get_batch(std::span<const int64_t> indices) const override;

  /// One example's input and target shapes.
  const Shape& feature_shape() const { return inputs_.shape; }
  const Shape& target_shape() const { return targets_.shape; }

 private:
  // One side's examples: their dtype, one example's shape and elements, and their bytes, example
  // after example.
  struct Examples {
    DType dtype = f32;
    Shape shape;
    int64_t numel = 0;
    std::vector<std::byte> bytes;
  };
  static Examples examples_of(const Tensor& t, const char* what);
  Tensor gather(const Examples& examples, std::span<const int64_t> indices) const;
  Examples inputs_, targets_;
  int64_t count_ = 0;
};

/// Next-token windows over a token stream: example i is (tokens[i, i+T), tokens[i+1, i+T+1)), so
/// batches are i64 inputs and targets of shape [B, T].
class TextWindows : public Dataset {
 public:
  /// mt::Error unless context >= 1 and there is at least one full window (size > context).
  TextWindows(std::vector<int64_t> tokens, int64_t context);

  int64_t size() const override;
  Batch get_batch(std::span<const int64_t> indices) const override;

  int64_t context() const { return context_; }

 private:
  std::vector<int64_t> tokens_;
  int64_t context_;
};

/// A process's share of every epoch in data-parallel training: process `index` of `count` takes
/// the examples at positions index, index + count, index + 2 count, ... of the epoch's order, as
/// PyTorch's DistributedSampler does; the last size() % count of the order are left out, so that
/// every process has as many batches. With one seed on every process, the shares of one step
/// are the batch one process would take at count times the batch size. dist::shard() is this
/// process's.
struct Shard {
  int64_t index = 0;
  int64_t count = 1;
};

/// Batches from a dataset, epoch after epoch. Each epoch visits every example at most once, in
/// order or, with `shuffle`, in a permutation that depends only on (seed, epoch), so a run can be
/// reproduced (and resumed) exactly, on any platform and standard library. With `drop_last` the
/// size() % batch_size examples that do not fill a batch are skipped in that epoch; without it
/// the last batch of each epoch is shorter. drop_last defaults to true, where PyTorch's
/// DataLoader keeps the short batch: every batch then has one shape, which a compiled step
/// replays; pass false to see every example (an evaluation loop).
///
/// The loader refers to `data`, which must outlive it.
class DataLoader {
 public:
  /// One pass over the rest of the current epoch (a whole epoch when started at its beginning):
  /// an input iterator that advances the loader itself, as next() does.
  class Iterator {
   public:
    using iterator_concept = std::input_iterator_tag;
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using reference = const Batch&;
    using pointer = const Batch*;

    Iterator() = default;
    const Batch& operator*() const { return batch_; }
    const Batch* operator->() const { return &batch_; }
    Iterator& operator++();
    void operator++(int) { ++*this; }
    friend bool operator==(const Iterator& it, std::default_sentinel_t) {
      return it.loader_ == nullptr;
    }

   private:
    friend class DataLoader;
    explicit Iterator(DataLoader* loader);

    DataLoader* loader_ = nullptr;  // null once the epoch is exhausted
    int64_t epoch_ = 0;
    Batch batch_;
  };

  /// mt::Error for an empty dataset, batch_size < 1, or batch_size > data.size() with drop_last
  /// (no batch could ever be made).
  DataLoader(const Dataset& data, int64_t batch_size, bool shuffle, uint64_t seed,
             bool drop_last = true);
  // A loader keeps a reference to its dataset, so a temporary one would dangle.
  DataLoader(const Dataset&& data, int64_t batch_size, bool shuffle, uint64_t seed,
             bool drop_last = true) = delete;
  /// Batches of `shard`'s share of each epoch only; mt::Error unless 0 <= index < count and the
  /// share holds at least one example (one batch with drop_last).
  DataLoader(const Dataset& data, int64_t batch_size, bool shuffle, uint64_t seed, Shard shard,
             bool drop_last = true);
  DataLoader(const Dataset&& data, int64_t batch_size, bool shuffle, uint64_t seed, Shard shard,
             bool drop_last = true) = delete;

  int64_t batches_per_epoch() const;
  /// The next batch, moving on to the next epoch (and its permutation) after the last one.
  Batch next();
  /// Epochs completed so far, which is also the epoch the next batch comes from.
  int64_t epoch() const { return epoch_; }

  Iterator begin() { return Iterator(this); }
  std::default_sentinel_t end() const { return {}; }

  const Dataset& dataset() const { return *data_; }
  int64_t batch_size() const { return batch_size_; }
  const Shard& shard() const { return shard_; }

  /// Where a loader stands, for checkpoints, plus the settings that decide how it goes on.
  struct State {
    int64_t epoch = 0;           // epoch() when it was taken
    int64_t position = 0;        // index within the epoch of the next batch
    std::vector<int64_t> order;  // the epoch's example order, a permutation of the dataset
    int64_t batch_size = 0;
    bool shuffle = false;
    uint64_t seed = 0;
    bool drop_last = true;
    int64_t shards = 1;  // the Shard::count of the loader it was taken from (its world size)
  };
  State state() const;
  /// mt::Error, changing nothing, unless `state` could have been taken from a loader like this
  /// one: the same batch size, shuffle, seed and drop_last (else later epochs would differ), an
  /// order that is a permutation of [0, dataset size), 0 <= position < batches_per_epoch() and
  /// epoch >= 0. A state of another number of shards resumes where the processes together
  /// stopped (position * batch_size * shards examples into the epoch's order); mt::Error where
  /// that is not a whole number of this loader's global batches (batch_size * count).
  void check_state(const State& state) const;
  /// Restores a state after check_state(): next() then returns exactly the batches the loader
  /// it was taken from would have returned, mid-epoch included.
  void load_state(const State& state);

 private:
  void start_epoch();
  int64_t resumed_position(const State& state) const;

  const Dataset* data_;
  int64_t batch_size_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  Shard shard_;
  int64_t epoch_ = 0;
  int64_t batch_ = 0;           // index within the epoch of the next batch
  std::vector<int64_t> order_;  // the current epoch's example order
};

}  // namespace mixtape
