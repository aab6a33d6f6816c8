// mixtape/dist/sharded_checkpoint.cpp -- dist::save_checkpoint_sharded and
// load_checkpoint_sharded: one safetensors file per process plus a JSON index (Hugging Face's
// layout), each process reading its own file at the same world size, all in turn at another.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <span>
#include <sstream>
#include <tuple>

#include "mixtape/dist/checkpoint.h"
#include "mixtape/dist/exchange.h"
#include "mixtape/dist/zero.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/json.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/process_group.h"
#include "mixtape/runtime/atomic_file.h"
#include "mixtape/runtime/file_digest.h"
#include "mixtape/runtime/safetensors.h"

namespace mixtape::dist {
namespace {

constexpr const char* kFormat = "mixtape-sharded-checkpoint-1";
constexpr const char* kIndexName = "checkpoint.safetensors.index.json";
constexpr std::string_view kOptimizerPrefix = "optimizer.";

// A save's shard files carry its id, so that a save over an earlier one writes new files beside
// the old ones and the index (renamed over the old index last) is the one point where the new
// save replaces the old: a save that dies before leaves the old one whole. `stem` is
// "checkpoint-<id>"; indexes of earlier versions name files "checkpoint-00001-of-00002...", whose
// stem is "checkpoint".
std::string file_name(const std::string& stem, int rank, int processes) {
  return fmt::format("{}-{:05d}-of-{:05d}.safetensors", stem, rank + 1, processes);
}

std::string stem_of(const std::string& id) { return "checkpoint-" + id; }

// Whether `file` is a shard file of some save (any id, or the earlier unnamed form).
bool is_shard_file(const std::string& file) {
  static const std::regex pattern(R"(checkpoint-(?:[0-9a-f]{16}-)?\d{5}-of-\d{5}\.safetensors)");
  return std::regex_match(file, pattern);
}

std::string in_dir(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / name).string();
}

bool is_optimizer_entry(const std::string& name) { return name.starts_with(kOptimizerPrefix); }

// The module path of the parameter an optimizer entry "optimizer.<path>.<state>" belongs to.
std::string parameter_of(const std::string& entry) {
  return std::string(optimizer_entry_name(entry).value().parameter);
}

// The state's name in an optimizer entry "optimizer.<path>.<state>".
std::string state_of(const std::string& entry) {
  return std::string(optimizer_entry_name(entry).value().entry);
}

// The optimizer's index of each of its parameters, by module path.
std::map<std::string, size_t> parameter_indices(const Module& module, const Optimizer& optimizer) {
  std::map<std::string, size_t> index;
  const NamedTensors named = module.named_parameters();
  for (size_t i = 0; i < optimizer.params().size(); ++i)
    for (const auto& [name, p] : named)
      if (p.same(optimizer.params()[i])) index.emplace(name, i);
  return index;
}

int64_t bytes_of(const Tensor& t) { return t.numel() * static_cast<int64_t>(size_of(t.dtype())); }

// The file (rank) that holds each replicated entry: the entries in order, cut into `processes`
// runs of about equal bytes. The same on every process, which holds the same entries.
std::vector<int> owners_of(const std::vector<int64_t>& bytes, int processes) {
  int64_t total = 0;
  for (int64_t b : bytes) total += b;
  std::vector<int> owner;
  int64_t before = 0;
  for (int64_t b : bytes) {
    const double share = total > 0 ? static_cast<double>(before) / static_cast<double>(total) : 0;
    owner.push_back(std::min(processes - 1, static_cast<int>(share * processes)));
    before += b;
  }
  return owner;
}

NamedTensors tensors_of(std::vector<safetensors::TensorData>&& data) {
  NamedTensors out;
  for (safetensors::TensorData& d : data) {
    auto storage = std::make_shared<Storage>(d.dtype, numel(d.shape), Storage::Uninitialized{});
    if (!d.bytes.empty()) std::memcpy(storage->host_data(), d.bytes.data(), d.bytes.size());
    out.emplace_back(std::move(d.name), from_storage(std::move(storage), d.shape));
  }
  return out;
}

std::string metadata_of(const safetensors::File& file, const std::string& key) {
  for (const auto& [k, v] : file.metadata)
    if (k == key) return v;
  return "";
}

// An id that the index and every shard file of one save carry (rank 0's, sent to all).
std::string new_checkpoint_id() {
  uint64_t id = 0;
  if (process_rank() == 0) {
    std::random_device device;
    id = (static_cast<uint64_t>(device()) << 32) ^ device() ^
         static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  }
  if (ProcessGroup* group = process_group(); group && group->size() > 1)
    group->broadcast(reinterpret_cast<std::byte*>(&id), sizeof(id), 0);
  return fmt::format("{:016x}", id);
}

// Where a sharded optimizer state lies: the whole state's shape, and per file the range of its
// flattened elements that file holds.
struct Pieces {
  Shape shape;
  std::vector<std::tuple<int, int64_t, int64_t>> parts;  // (file, begin, end)
};

struct Index {
  std::string path;
  int world_size = 0;
  std::string id;
  std::string stem;  // of its files' names (file_name)
  std::vector<std::string> model;
  Metadata metadata;
  std::map<std::string, int> weight_map;  // entry -> file
  std::map<std::string, Pieces> pieces;
};

// The index rank 0 writes, from what every process wrote (`written`: per process, JSON
// {"bytes": its file's tensor bytes, "pieces": [[name, begin, end, shape], ...]}).
json::Value make_index(const std::string& id, const Module& module, const Metadata& meta,
                       const std::vector<std::string>& whole_names, const std::vector<int>& owners,
                       const std::vector<std::string>& written) {
  const int processes = static_cast<int>(written.size());
  json::Value pieces = json::Value::object();
  int64_t total = 0;
  for (int q = 0; q < processes; ++q) {
    const json::Value mine = json::parse(written[q]);
    total += json::as_int(mine.at("bytes"));
    for (const json::Value& piece : mine.at("pieces")) {
      json::Value& entry = pieces[piece.at(0).get<std::string>()];
      if (entry.is_null()) entry = {{"shape", piece.at(3)}, {"files", json::Value::array()}};
      entry["files"].push_back(
          json::Value::array({file_name(stem_of(id), q, processes), piece.at(1), piece.at(2)}));
    }
  }
  json::Value index = json::Value::object();
  index["metadata"] = {
      {"format", kFormat}, {"world_size", processes}, {"checkpoint_id", id}, {"total_size", total}};
  json::Value entries = json::Value::object();
  for (const auto& [key, value] : meta) entries[key] = value;
  index["checkpoint_metadata"] = std::move(entries);
  index["model"] = describe_entries(module.state_dict());
  json::Value weight_map = json::Value::object();
  for (size_t k = 0; k < whole_names.size(); ++k)
    json::append(weight_map, whole_names[k], file_name(stem_of(id), owners[k], processes));
  index["weight_map"] = std::move(weight_map);
  index["pieces"] = std::move(pieces);
  // The XXH3-64 of the index as dumped so far: the shard files checksum their own headers, but
  // the checkpoint's metadata (its step, generators' offsets, loaders' places) lives here.
  index["checksum"] = {{"xxh3_64", digest_bytes(json::dump(index)).xxh3_64}};
  return index;
}

const json::Value& member(const json::Value& object, std::string_view key,
                          const std::string& path) {
  const json::Value* found = json::find(object, key);
  if (!found) fail("load_checkpoint_sharded {}: the index has no \"{}\"", path, key);
  return *found;
}

std::string text(const json::Value& value, std::string_view what, const std::string& path) {
  if (!value.is_string()) fail("load_checkpoint_sharded {}: {} is not a string", path, what);
  return value.get<std::string>();
}

// The rank whose file `name` is; the first name read decides the index's stem (this version's
// or the earlier one), which every other name must share.
int file_index(Index& index, const json::Value& name) {
  const std::string file = text(name, "a file name", index.path);
  for (const std::string& stem : {stem_of(index.id), std::string("checkpoint")}) {
    if (!index.stem.empty() && stem != index.stem) continue;
    int rank = 0, processes = 0;
    if (!file.starts_with(stem + "-") ||
        std::sscanf(file.c_str() + stem.size(), "-%d-of-%d", &rank, &processes) != 2 ||
        processes != index.world_size || rank < 1 || rank > processes ||
        file != file_name(stem, rank - 1, processes))
      continue;
    index.stem = stem;
    return rank - 1;
  }
  fail("load_checkpoint_sharded {}: '{}' is none of the index's {} shard files", index.path, file,
       index.world_size);
}

Index read_index(const std::string& dir) {
  Index index;
  index.path = in_dir(dir, kIndexName);
  std::ifstream in(index.path, std::ios::binary);
  if (!in) fail("load_checkpoint_sharded: cannot open {}: {}", index.path, std::strerror(errno));
  std::stringstream contents;
  contents << in.rdbuf();
  json::Value doc;
  try {
    doc = json::parse(contents.str());
  } catch (const Error& e) {
    fail("load_checkpoint_sharded {}: {}", index.path, e.what());
  }
  // A member of another name is a damaged one (a damaged "checksum" would turn the check off).
  if (!doc.is_object())
    fail("load_checkpoint_sharded {}: the index is not a JSON object", index.path);
  for (const auto& [key, value] : doc.items())
    if (key != "metadata" && key != "checkpoint_metadata" && key != "model" &&
        key != "weight_map" && key != "pieces" && key != "checksum")
      fail(
          "load_checkpoint_sharded {}: the index has an unknown member \"{}\": it is damaged, "
          "or from a newer mixtape",
          index.path, key);
  // Indices from before the checksum have none.
  if (const json::Value* sum = json::find(doc, "checksum")) {
    const std::string recorded =
        text(member(*sum, "xxh3_64", index.path), "checksum.xxh3_64", index.path);
    json::Value rest = doc;
    rest.erase("checksum");
    const std::string actual = digest_bytes(json::dump(rest)).xxh3_64;
    if (actual != recorded)
      fail(
          "load_checkpoint_sharded {}: the index is corrupt: it hashes to xxh3_64 {}, it "
          "recorded {}",
          index.path, actual, recorded);
  }
  const json::Value& meta = member(doc, "metadata", index.path);
  if (text(member(meta, "format", index.path), "metadata.format", index.path) != kFormat)
    fail("load_checkpoint_sharded {}: not a {} index", index.path, kFormat);
  index.world_size = static_cast<int>(json::as_int(member(meta, "world_size", index.path)));
  if (index.world_size < 1)
    fail("load_checkpoint_sharded {}: world_size {} is not positive", index.path, index.world_size);
  index.id = text(member(meta, "checkpoint_id", index.path), "checkpoint_id", index.path);
  // It names the shard files: 16 hex digits as new_checkpoint_id() writes, never a path ("../").
  if (index.id.size() != 16 || index.id.find_first_not_of("0123456789abcdef") != std::string::npos)
    fail("load_checkpoint_sharded {}: checkpoint_id '{}' is not 16 hex digits", index.path,
         index.id);
  for (const auto& [key, value] : member(doc, "checkpoint_metadata", index.path).items())
    index.metadata.emplace_back(key, text(value, key, index.path));
  for (const json::Value& line : member(doc, "model", index.path))
    index.model.push_back(text(line, "a model entry", index.path));
  for (const auto& [name, file] : member(doc, "weight_map", index.path).items())
    index.weight_map.emplace(name, file_index(index, file));
  for (const auto& [name, entry] : member(doc, "pieces", index.path).items()) {
    Pieces& pieces = index.pieces[name];
    for (const json::Value& size : member(entry, "shape", index.path))
      pieces.shape.push_back(json::as_int(size));
    for (const json::Value& part : member(entry, "files", index.path)) {
      if (!part.is_array() || part.size() != 3)
        fail("load_checkpoint_sharded {}: a part of '{}' is not [file, begin, end]", index.path,
             name);
      pieces.parts.emplace_back(file_index(index, part[0]), json::as_int(part[1]),
                                json::as_int(part[2]));
    }
  }
  if (index.stem.empty()) index.stem = stem_of(index.id);  // no entries: files of no data
  return index;
}

// The module must have the entries the checkpoint was saved from: the first difference named.
void check_model(const Index& index, const Module& module) {
  const std::vector<std::string> ours = describe_entries(module.state_dict());
  size_t i = 0;
  while (i < ours.size() && i < index.model.size() && ours[i] == index.model[i]) ++i;
  if (i == ours.size() && i == index.model.size()) return;
  fail(
      "load_checkpoint_sharded {}: the checkpoint is of another model: it has {} where the "
      "module has {} (entry {} of the parameters and buffers: name, shape, dtype)",
      index.path, i < index.model.size() ? index.model[i] : "nothing more",
      i < ours.size() ? ours[i] : "nothing more", i);
}

// Shard file q of the index, checked to belong to the same save.
safetensors::File read_shard(const std::string& dir, const Index& index, int q) {
  const std::string path = in_dir(dir, file_name(index.stem, q, index.world_size));
  std::error_code ignored;
  if (!std::filesystem::exists(path, ignored))
    fail(
        "load_checkpoint_sharded {}: shard {} of the save the index describes (checkpoint id {}) "
        "is not in the folder: the index is of another save, or the file was moved or removed",
        path, q, index.id);
  safetensors::File file = safetensors::read(path);
  if (metadata_of(file, "format") != kFormat || metadata_of(file, "checkpoint_id") != index.id ||
      metadata_of(file, "rank") != std::to_string(q))
    fail(
        "load_checkpoint_sharded {}: the file is not shard {} of the save the index describes "
        "(checkpoint id {} in the index, '{}' in the file): a save was interrupted or files of "
        "two saves were mixed",
        path, q, index.id, metadata_of(file, "checkpoint_id"));
  for (const safetensors::TensorData& data : file.tensors) {
    auto whole = index.weight_map.find(data.name);
    const bool where = whole != index.weight_map.end() && whole->second == q;
    const auto piece = index.pieces.find(data.name);
    const bool part = piece != index.pieces.end() &&
                      std::any_of(piece->second.parts.begin(), piece->second.parts.end(),
                                  [&](const auto& p) { return std::get<0>(p) == q; });
    if (!where && !part)
      fail("load_checkpoint_sharded {}: the index does not place '{}' in this file", path,
           data.name);
  }
  return file;
}

// Every whole entry the index names must have been read.
void check_complete(const Index& index, const NamedTensors& entries) {
  std::set<std::string> have;
  for (const auto& entry : entries) have.insert(entry.first);
  for (const auto& [name, file] : index.weight_map)
    if (!have.count(name))
      fail("load_checkpoint_sharded {}: '{}' is missing from {}", index.path, name,
           file_name(index.stem, file, index.world_size));
}

// The parts of a sharded optimizer entry, sorted by their first element, checked to cover it
// exactly (any order in the index).
std::vector<std::tuple<int64_t, int64_t, int>> covering_parts(const Index& index,
                                                              const std::string& name,
                                                              const Pieces& pieces) {
  std::vector<std::tuple<int64_t, int64_t, int>> ranges;
  for (const auto& [file, begin, end] : pieces.parts) ranges.emplace_back(begin, end, file);
  std::sort(ranges.begin(), ranges.end());
  int64_t at = 0;
  for (const auto& [begin, end, file] : ranges) {
    if (begin != at)
      fail(
          "load_checkpoint_sharded {}: the parts of '{}' do not cover it (elements {} to {} of {})",
          index.path, name, begin, end, file_name(index.stem, file, index.world_size));
    at = end;
  }
  if (at != numel(pieces.shape))
    fail("load_checkpoint_sharded {}: the parts of '{}' hold {} of its {} elements", index.path,
         name, at, numel(pieces.shape));
  return ranges;
}

// A sharded optimizer state, whole again from its parts (any order), which must cover it exactly.
Tensor assemble(const Index& index, const std::string& name, const Pieces& pieces,
                std::map<std::pair<std::string, int>, Tensor>& parts) {
  std::vector<Tensor> flat;
  for (const auto& [begin, end, file] : covering_parts(index, name, pieces)) {
    auto found = parts.find({name, file});
    if (found == parts.end() || found->second.numel() != end - begin)
      fail(
          "load_checkpoint_sharded {}: the parts of '{}' do not cover it (elements {} to {} of {})",
          index.path, name, begin, end, file_name(index.stem, file, index.world_size));
    flat.push_back(reshape(found->second, {-1}));
  }
  return reshape(flat.size() == 1 ? flat[0] : concat(flat), pieces.shape);
}

// Every file of the save, read by this process: the whole state.
NamedTensors read_all(const std::string& dir, const Index& index) {
  NamedTensors entries;
  std::map<std::pair<std::string, int>, Tensor> parts;
  for (int q = 0; q < index.world_size; ++q)
    for (auto& [name, value] : tensors_of(std::move(read_shard(dir, index, q).tensors))) {
      if (index.pieces.count(name))
        parts.emplace(std::pair(name, q), value);
      else
        entries.emplace_back(name, value);
    }
  check_complete(index, entries);
  std::vector<Tensor> assembled;
  for (const auto& [name, pieces] : index.pieces) {
    entries.emplace_back(name, assemble(index, name, pieces, parts));
    assembled.push_back(entries.back().second);
  }
  eval(assembled);
  return entries;
}

// Where sharded entry `name` lies in this run: its parameter (index into the optimizer's) and
// the elements [first, last) of it this process keeps. `problem` says instead why the entry does
// not fit the optimizer: of no parameter of it, or of another shape than the optimizer keeps.
// Only this run's shapes are read, so a hostile shape in the index costs nothing.
struct HeldPart {
  size_t param = 0;
  int64_t first = 0, last = 0;
  std::string problem;
};
HeldPart held_part(const Index& index, const std::string& name, const Pieces& pieces,
                   const std::map<std::string, size_t>& at, const Optimizer& optimizer,
                   const ZeroShards& shards) {
  HeldPart part;
  auto found = at.find(parameter_of(name));
  if (found == at.end()) {
    part.problem = fmt::format(
        "load_checkpoint_sharded {}: '{}' is the state of no parameter of this optimizer "
        "(another optimizer's parameters?)",
        index.path, name);
    return part;
  }
  part.param = found->second;
  const Shape expected =
      optimizer.state_shape(state_of(name), optimizer.params()[part.param].shape());
  if (pieces.shape != expected) {
    part.problem = fmt::format(
        "load_checkpoint_sharded {}: '{}' has shape {} in the index, where this run's optimizer "
        "keeps {}",
        index.path, name, to_string(pieces.shape), to_string(expected));
    return part;
  }
  std::tie(part.first, part.last) = shards.held_state(part.param, numel(expected));
  return part;
}

// A ZeRO optimizer's state at another world size than the save's: the files are read one after
// another, and of each sharded entry only the elements this process's shard holds are kept (a
// byte copy, exact), so that a process holds at most one file and its own shards at once, where
// reassembling the whole state first (read_all) made every process hold all of it. The entries
// come out as this run's shards, the shapes the optimizer keeps (local_shape); an entry of
// which this process holds nothing comes out as no entry.
NamedTensors read_held(const std::string& dir, const Index& index, const Module& module,
                       const Optimizer& optimizer, const ZeroShards& shards) {
  const std::map<std::string, size_t> at = parameter_indices(module, optimizer);
  struct Held : HeldPart {
    std::map<int, std::pair<int64_t, int64_t>> parts;  // file -> its range
    safetensors::TensorData data;                      // the held elements, filled file by file
    std::set<int> seen;
  };
  std::map<std::string, Held> held;
  for (const auto& [name, pieces] : index.pieces) {
    // The entry and this process's part of it, checked against this run's optimizer before any
    // file is read or any byte allocated.
    Held& h = held[name];
    static_cast<HeldPart&>(h) = held_part(index, name, pieces, at, optimizer, shards);
    if (!h.problem.empty()) fail("{}", h.problem);
    const int64_t local =
        numel(optimizer.state_shape(state_of(name), optimizer.local_shape(h.param)));
    if (local != h.last - h.first)
      fail(
          "load_checkpoint_sharded {}: '{}' is not sharded as this run's optimizer shards it "
          "({} elements held, {} expected)",
          index.path, name, h.last - h.first, local);
    for (const auto& [begin, end, file] : covering_parts(index, name, pieces))
      if (!h.parts.emplace(file, std::pair(begin, end)).second)
        fail("load_checkpoint_sharded {}: '{}' has two parts in {}", index.path, name,
             file_name(index.stem, file, index.world_size));
  }
  NamedTensors entries;
  for (int q = 0; q < index.world_size; ++q) {
    std::vector<safetensors::TensorData> whole;
    for (safetensors::TensorData& data : read_shard(dir, index, q).tensors) {
      auto found = held.find(data.name);
      if (found == held.end()) {
        whole.push_back(std::move(data));
        continue;
      }
      Held& h = found->second;
      auto part = h.parts.find(q);
      if (part == h.parts.end())
        fail("load_checkpoint_sharded {}: the index places no part of '{}' in {}", index.path,
             data.name, file_name(index.stem, q, index.world_size));
      const auto [begin, end] = part->second;
      if (numel(data.shape) != end - begin)
        fail("load_checkpoint_sharded {}: '{}' holds {} elements in {}, the index says {}",
             index.path, data.name, numel(data.shape), file_name(index.stem, q, index.world_size),
             end - begin);
      if (h.seen.empty()) {
        h.data.name = data.name;
        h.data.dtype = data.dtype;
        h.data.bytes.resize(static_cast<size_t>((h.last - h.first) * size_of(data.dtype)));
      } else if (data.dtype != h.data.dtype) {
        fail("load_checkpoint_sharded {}: the parts of '{}' are of two dtypes, {} and {}",
             index.path, data.name, name(h.data.dtype), name(data.dtype));
      }
      h.seen.insert(q);
      const int64_t from = std::max(begin, h.first), to = std::min(end, h.last);
      const auto element = static_cast<int64_t>(size_of(data.dtype));
      if (from < to)
        std::memcpy(h.data.bytes.data() + (from - h.first) * element,
                    data.bytes.data() + (from - begin) * element,
                    static_cast<size_t>((to - from) * element));
    }
    for (auto& entry : tensors_of(std::move(whole))) entries.push_back(std::move(entry));
  }
  check_complete(index, entries);
  std::vector<safetensors::TensorData> mine;
  for (auto& [name, h] : held) {
    if (h.seen.size() != h.parts.size())
      fail("load_checkpoint_sharded {}: a part of '{}' is missing from its file", index.path, name);
    // Every part read, which cover the entry (covering_parts) of the shape whose range
    // [first, last) this process holds: every held byte was copied.
    if (h.first == h.last) continue;  // none of it here: no entry, as take_shards gives none
    h.data.shape = optimizer.state_shape(state_of(name), optimizer.local_shape(h.param));
    mine.push_back(std::move(h.data));
  }
  for (auto& entry : tensors_of(std::move(mine))) entries.push_back(std::move(entry));
  return entries;
}

// Whether this process's file holds, of every sharded entry, exactly the elements this run's
// optimizer keeps here (held_state), so that its own file is all it needs to read. False for an
// entry of another shape or of no parameter of the optimizer: read_held then says which.
bool cut_as_saved(const Index& index, const Module& module, const Optimizer& optimizer,
                  const ZeroShards& shards) {
  const int rank = process_rank();
  const std::map<std::string, size_t> at = parameter_indices(module, optimizer);
  for (const auto& [name, pieces] : index.pieces) {
    const HeldPart part = held_part(index, name, pieces, at, optimizer, shards);
    if (!part.problem.empty()) return false;
    bool in_my_file = false;
    for (const auto& [file, begin, end] : pieces.parts)
      if (file == rank) {
        if (in_my_file || begin != part.first || end != part.last) return false;
        in_my_file = true;
      }
    if (!in_my_file && part.first != part.last) return false;
  }
  return true;
}

}  // namespace

void save_checkpoint_sharded(const std::string& dir, const Module& module,
                             const Optimizer* optimizer, const Metadata& metadata,
                             const GradScaler* scaler, const CheckpointOptions& options) {
  const int rank = process_rank(), processes = process_count();
  const auto* zero = dynamic_cast<const ZeroOptimizer*>(optimizer);
  const bool sharded_state = zero && processes > 1;
  const std::string index_path = in_dir(dir, kIndexName);
  std::string error;
  NamedTensors entries;
  Metadata meta;
  try {
    std::tie(entries, meta) =
        checkpoint_entries(index_path, module, optimizer, metadata, scaler, options);
  } catch (const std::exception& e) {
    error = e.what();
  }
  fail_together(error, "dist::save_checkpoint_sharded");
  // Evaluated on every process alike: a parameter that a ZeRO step all-gathers may be pending.
  std::vector<Tensor> values;
  for (const auto& entry : entries) values.push_back(entry.second);
  eval(values);

  NamedTensors mine;
  std::vector<std::string> whole_names;
  std::vector<int64_t> whole_bytes;
  json::Value my_pieces = json::Value::array();
  int64_t my_bytes = 0;
  std::map<std::string, size_t> parameter_index;
  if (sharded_state) parameter_index = parameter_indices(module, *optimizer);
  for (const auto& [name, value] : entries) {
    if (sharded_state && is_optimizer_entry(name)) {
      // This process's elements [first, last) of the entry's flattened state, and the whole
      // entry's shape: its parameter's for flat shards, its own for whole tensors.
      const size_t i = parameter_index.at(parameter_of(name));
      const ZeroShards& shards = zero->shards();
      auto [first, last] = shards.held_state(i, value.numel());
      const Shape whole_shape =
          shards.whole_tensors() ? value.shape() : optimizer->params()[i].shape();
      my_pieces.push_back(json::Value::array({name, first, last, whole_shape}));
      mine.emplace_back(name, value);
      my_bytes += bytes_of(value);
      continue;
    }
    whole_names.push_back(name);
    whole_bytes.push_back(bytes_of(value));
  }
  const std::vector<int> owners = owners_of(whole_bytes, processes);
  for (size_t k = 0, at = 0; k < entries.size(); ++k) {
    if (sharded_state && is_optimizer_entry(entries[k].first)) continue;
    if (owners[at] == rank) {
      mine.push_back(entries[k]);
      my_bytes += whole_bytes[at];
    }
    ++at;
  }
  const std::string written = json::dump({{"bytes", my_bytes}, {"pieces", std::move(my_pieces)}});
  const std::string id = new_checkpoint_id();
  try {
    std::filesystem::create_directories(dir);
    save_tensors(in_dir(dir, file_name(stem_of(id), rank, processes)), mine,
                 {{"format", kFormat},
                  {"checkpoint_id", id},
                  {"rank", std::to_string(rank)},
                  {"world_size", std::to_string(processes)}});
  } catch (const std::exception& e) {
    error = e.what();
  }
  fail_together(error, "dist::save_checkpoint_sharded");
  std::vector<std::string> everyone{written};
  if (ProcessGroup* group = process_group(); group && processes > 1)
    everyone = gather_text(*group, written);
  if (rank == 0) {
    try {
      const std::string index_text =
          json::dump(make_index(id, module, meta, whole_names, owners, everyone));
      write_file_atomically(index_path, [&](int fd) {
        write_all(fd, index_text.data(), index_text.size(), index_path);
      });
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  fail_together(error, "dist::save_checkpoint_sharded");
  // The new save is in place: earlier saves' shard files are no one's now. Every process removes
  // those it sees (a folder of each host's own, or one shared); a file another removed first, or
  // one that cannot be removed, is left (it costs space, not the checkpoint).
  std::error_code ignored;
  for (const auto& found : std::filesystem::directory_iterator(dir, ignored)) {
    const std::string file = found.path().filename().string();
    if (is_shard_file(file) && !file.starts_with(stem_of(id) + "-"))
      std::filesystem::remove(found.path(), ignored);
  }
}

void load_checkpoint_sharded(const std::string& dir, Module& module, Optimizer* optimizer,
                             Metadata* metadata, GradScaler* scaler,
                             const CheckpointOptions& options) {
  const int rank = process_rank(), processes = process_count();
  auto* zero = dynamic_cast<ZeroOptimizer*>(optimizer);
  std::string error;
  Index index;
  NamedTensors entries;
  std::string shared;  // at the same world size: this file's whole entries, for the others
  try {
    index = read_index(dir);
    check_model(index, module);
  } catch (const std::exception& e) {
    error = e.what();
  }
  fail_together(error, "dist::load_checkpoint_sharded");
  bool own_only = index.world_size == processes && (index.pieces.empty() || zero || !optimizer);
  // A ZeRO run reads only its own file where every process holds the pieces its own file has
  // (the same optimizer, cut the same way); else it takes its shards from all the files, as at
  // another world size.
  if (own_only && zero && !index.pieces.empty()) {
    const bool mine = processes > 1 && cut_as_saved(index, module, *optimizer, zero->shards());
    std::vector<std::string> everyone{mine ? "1" : "0"};
    if (ProcessGroup* group = process_group(); group && processes > 1)
      everyone = gather_text(*group, everyone[0]);
    own_only = std::all_of(everyone.begin(), everyone.end(),
                           [](const std::string& said) { return said == "1"; });
  }
  try {
    if (own_only) {
      safetensors::File own = read_shard(dir, index, rank);
      safetensors::File whole;
      std::vector<safetensors::TensorData> pieces;
      for (safetensors::TensorData& data : own.tensors)
        (index.pieces.count(data.name) ? pieces : whole.tensors).push_back(std::move(data));
      entries = tensors_of(std::move(pieces));
      const std::vector<std::byte> bytes = safetensors::serialize(whole);
      shared.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    } else if (zero && !index.pieces.empty()) {
      entries = read_held(dir, index, module, *optimizer, zero->shards());
    } else {
      entries = read_all(dir, index);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  fail_together(error, "dist::load_checkpoint_sharded");
  if (own_only) {
    std::vector<std::string> everyone{shared};
    if (ProcessGroup* group = process_group(); group && processes > 1)
      everyone = gather_text(*group, shared);
    try {
      for (int q = 0; q < processes; ++q) {
        auto bytes = std::as_bytes(std::span(everyone[q].data(), everyone[q].size()));
        NamedTensors theirs =
            tensors_of(safetensors::parse(bytes, file_name(index.stem, q, processes)).tensors);
        entries.insert(entries.end(), theirs.begin(), theirs.end());
      }
      check_complete(index, entries);
    } catch (const std::exception& e) {
      error = e.what();
    }
    fail_together(error, "dist::load_checkpoint_sharded");
  }
  // A ZeRO optimizer takes state saved whole through the plain rule and cuts its own shards
  // from it; sharded state comes as its shards (own_only, read_held).
  std::unique_ptr<Optimizer> whole;
  if (zero && index.pieces.empty()) whole = zero->plain();
  try {
    restore_checkpoint(index.path, entries, index.metadata, module, whole ? whole.get() : optimizer,
                       metadata, scaler, options);
  } catch (const std::exception& e) {
    error = e.what();
  }
  fail_together(error, "dist::load_checkpoint_sharded");
  if (whole) zero->take_shards(*whole);
}

}  // namespace mixtape::dist
