// mixtape/jit/aot_export.cpp -- traces the function or step, names its state, and writes the plan,
// the weights, the libraries (jit/aot_package.h) and the manifest that ties them together.
#include "mixtape/jit/aot_export.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <map>
#include <regex>
#include <set>

#include <unistd.h>

#include "mixtape/codegen/emit_llvm.h"
#include "mixtape/codegen/nvrtc.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/json.h"
#include "mixtape/jit/aot_cuda.h"
#include "mixtape/jit/aot_package.h"
#include "mixtape/jit/llvm_jit.h"
#include "mixtape/precision_policy/grad_scaler.h"
#include "mixtape/precision_policy/policy.h"
#include "mixtape/runtime/aot_plan.h"
#include "mixtape/runtime/atomic_file.h"
#include "mixtape/runtime/checkpoint.h"
#include "mixtape/runtime/compile.h"
#include "mixtape/runtime/cpu_features.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/file_digest.h"
#include "mixtape/runtime/safetensors.h"
#include "mixtape/runtime/step_plan.h"

namespace mixtape::aot {
namespace {

using json::Value;

struct Named {
  std::vector<std::pair<StoragePtr, PlanBuffer>> buffers;  // the checkpoint's tensors first
  std::vector<std::pair<std::string, std::string>> metadata;
  StoragePtr steps;  // the optimizer's step count (metadata "optimizer.steps")
  // Parameters that count their own steps (they skipped some): (parameter path, buffer index);
  // metadata "optimizer.<path>.steps" where it differs from the optimizer's.
  std::vector<std::pair<std::string, size_t>> param_steps;
  struct Drawn {
    std::string name;
    uint64_t seed;
    StoragePtr offset;  // metadata "generator.<name>.offset"
  };
  std::vector<Drawn> generators;
  // A group's rate without a schedule: the leaves set_lr() writes, f64 and f32 (buffer indices),
  // which NAME_load sets from the file's rate and NAME_save writes back as metadata.
  struct Rate {
    size_t group, f64, f32;
  };
  std::vector<Rate> rates;
  bool is_rate(size_t k) const {
    return std::any_of(rates.begin(), rates.end(),
                       [&](const Rate& r) { return r.f64 == k || r.f32 == k; });
  }
};

void add(Named& named, const std::string& name, const Tensor& t) {
  eval({t});
  named.buffers.push_back({t.node()->value, PlanBuffer{name, t.node()->value->dtype, t.shape()}});
}

// The state save_checkpoint would write, by storage (runtime/checkpoint.cpp's layout).
Named checkpoint_names(const Options& o) {
  Named named;
  if (!o.module) return named;
  for (const auto& [name, t] : o.module->state_dict()) add(named, name, t);
  named.metadata.emplace_back("format", "mixtape-checkpoint-1");
  if (o.optimizer) {
    NamedTensors params = o.module->named_parameters();
    std::vector<std::string> param_names;
    for (size_t i = 0; i < o.optimizer->params().size(); ++i) {
      auto found = std::find_if(params.begin(), params.end(),
                                [&](auto& e) { return e.second.same(o.optimizer->params()[i]); });
      if (found == params.end())
        fail("aot: the optimizer holds a parameter that is not part of the module");
      param_names.push_back(found->first);
      for (const auto& [state, value] : o.optimizer->state(i))
        add(named, "optimizer." + found->first + "." + state, value);
    }
    // The kind and rates, as save_checkpoint writes them (NAME_save writes the rates in force).
    for (auto& entry : optimizer_metadata(*o.optimizer, param_names))
      named.metadata.push_back(std::move(entry));
    // The step count is checkpoint metadata ("optimizer.steps"); the artifact keeps it as a
    // tensor of its own weights file.
    add(named, "aot.optimizer.steps", o.optimizer->step_count());
    named.steps = named.buffers.back().first;
    for (size_t g = 0; g < o.optimizer->group_count() && !o.optimizer->computes_own_rate(); ++g) {
      if (o.optimizer->schedule(g)) continue;  // the step computes its rate from the count
      auto [rate, rate_f32] = o.optimizer->rate_leaves(g);
      add(named, fmt::format("aot.optimizer.lr.{}", g), rate);
      add(named, fmt::format("aot.optimizer.lr_f32.{}", g), rate_f32);
      named.rates.push_back({g, named.buffers.size() - 2, named.buffers.size() - 1});
    }
    for (size_t i = 0; i < param_names.size(); ++i)
      if (!o.optimizer->step_count(i).same(o.optimizer->step_count())) {
        add(named, "aot.optimizer." + param_names[i] + ".steps", o.optimizer->step_count(i));
        named.param_steps.emplace_back(param_names[i], named.buffers.size() - 1);
      }
  }
  if (o.scaler && o.scaler->is_enabled()) {
    // The buffers themselves, which the exported step reads and writes (state_dict() copies).
    add(named, "scaler.scale", Tensor(o.scaler->scale_tensor().node()));
    add(named, "scaler.growth_tracker", Tensor(o.scaler->growth_tracker_tensor().node()));
    for (const auto& [name, value] : o.scaler->state_dict())
      if (name != "scale" && name != "growth_tracker")
        named.metadata.emplace_back("scaler." + name, fmt::format("{}", value.item()));
  }
  // A generator's offset is metadata in a checkpoint; the artifact keeps it as a tensor.
  for (const auto& [name, generator] : o.generators) {
    add(named, "aot.generator." + name + ".offset", generator->offset_tensor());
    named.generators.push_back({name, generator->seed(), named.buffers.back().first});
  }
  return named;
}

// The buffers a draw (rand, randn, dropout) reads as its generator's offset.
std::set<const Storage*> drawn_offsets(const Plan& plan) {
  std::set<const Storage*> out;
  for (const PlannedEvaluation& planned : plan.evals) {
    const std::vector<Node*>& externals = planned.eval.executed.sig.externals;
    for (const Node* node : planned.eval.pending_raw) {
      // rand and randn read the offset as their one input, attention's dropout as its last.
      const bool draws = ((node->op == OpCode::RandUniform || node->op == OpCode::RandNormal) ||
                          (op_info(node->op).kind == OpKind::Attention && node->attrs.dropout > 0));
      if (draws && !node->inputs.empty())
        for (size_t x = 0; x < externals.size(); ++x)
          if (node->inputs.back().get() == externals[x] && planned.inputs[x].object)
            out.insert(planned.inputs[x].object.get());
    }
  }
  return out;
}

Value argument_list(const std::vector<std::string>& names, const std::vector<DType>& dtypes,
                    const std::vector<Shape>& shapes) {
  Value out = Value::array();
  for (size_t i = 0; i < names.size(); ++i)
    out.push_back({{"name", names[i]}, {"dtype", name(dtypes[i])}, {"shape", shapes[i]}});
  return out;
}

// The batch sizes traced: the export batch, and for a dynamic batch 1 and one in between, so
// that every shape is checked to grow linearly and every kernel a batch needs is exported.
// The last of them, when there are several, only checks: its kernels are not exported, so the
// check finds a batch whose kernels the exported ones do not serve (a batch dim that is not
// dims[0] of every kernel that depends on it), as the artifact would at run time.
std::vector<int64_t> traced_batches(int64_t batch, int64_t max) {
  std::vector<int64_t> out{batch};
  if (max > 0) {
    for (int64_t b : {int64_t{1}, (max + 1) / 2 + 1, max, max / 3 + 2, max / 5 + 3, int64_t{2}})
      if (b >= 1 && b <= max && std::find(out.begin(), out.end(), b) == out.end() && out.size() < 5)
        out.push_back(b);
  }
  return out;
}

// mt::Error unless the artifact's kernels serve every kernel of `checked`'s programs.
void check_kernels_serve(const std::map<std::string, const kir::Kernel*>& by_key,
                         const TracedPlan& checked) {
  for (const PlannedEvaluation& planned : checked.plan->evals)
    for (const Step& s : planned.eval.executed.program->steps) {
      if (s.kind != FusionGroup::Kind::Kernel) continue;
      auto found = by_key.find(kernel_key(*s.kernel));
      if (found == by_key.end() ||
          (serves_smaller_dim0(*s.kernel) && s.kernel->dims[0] > found->second->dims[0]))
        fail(
            "aot: at batch {} the function needs a kernel the traced batches' kernels do not "
            "serve (its batch dim is not the outermost dim of every kernel that depends on it, "
            "a permute or a reduction over the batch, say), so it cannot take a dynamic batch; "
            "export it at a fixed batch:\n{}",
            checked.batch, kir::to_string(*s.kernel));
    }
}

// The named state's values by name, as they are now.
std::vector<std::pair<std::string, StoragePtr>> snapshot(const Options& o) {
  std::vector<std::pair<std::string, StoragePtr>> values;
  for (const auto& [storage, info] : checkpoint_names(o).buffers)
    values.emplace_back(info.name, host_copy(*storage));
  return values;
}

// Restores the device and eager mode, drops the plans' graphs, and puts the state the traces
// changed back as it was (the traces train on zeros): once traced, and again should the export
// fail. While it lives, loss scalers record no statistics (the traces' updates are not the
// run's).
struct Session {
  const Options& options;
  Device device = current_device();
  bool eager = eager_mode();
  ScalerStatisticsPause statistics;
  std::vector<std::unique_ptr<Plan>> plans;
  std::vector<std::pair<std::string, StoragePtr>> before;
  bool done = false;
  explicit Session(const Options& o, bool step) : options(o) {
    if (step) before = snapshot(o);
    set_device(Device::cpu);
    set_eager_mode(false);
  }
  // Every named value as `before` holds it, state the step only writes included. Optimizer
  // state the traces made (an export without a step before it) is not in `before`: the plan's
  // first values hold it.
  void restore() {
    for (const auto& [storage, info] : checkpoint_names(options).buffers)
      for (const auto& [name, value] : before)
        if (name == info.name && value->size_bytes() == storage->size_bytes() &&
            value->dtype == storage->dtype) {
          std::memcpy(storage->host_data(), value->host_data(),
                      static_cast<size_t>(value->size_bytes()));
          storage->host_written();
        }
  }
  ~Session() {
    for (auto& plan : plans) release(*plan);
    if (!done && !before.empty()) {
      try {
        restore();
      } catch (...) {
        // The export's own error is the one to report.
      }
    }
    set_device(device);
    set_eager_mode(eager);
  }
};

}  // namespace

std::vector<std::string> exportable_devices() {
  std::vector<std::string> devices{"cpu"};
  if (nvrtc_available()) devices.push_back("cuda");
  return devices;
}

Exported export_artifact(const Function& fn, const std::vector<Input>& inputs,
                         const std::vector<std::string>& outputs, const std::string& dir,
                         const Options& o, bool step) {
  static const std::regex identifier("[A-Za-z_][A-Za-z0-9_]*");
  if (!std::regex_match(o.name, identifier))
    fail("aot: the name '{}' is not a C identifier", o.name);
  if (inputs.empty()) fail("aot: {} has no inputs", o.name);
  if (step && !o.module) fail("aot: export_step needs Options::module to name the state it keeps");
  std::set<std::string> generator_names;
  for (const auto& [name, generator] : o.generators)
    if (name.empty() || !generator || !generator_names.insert(name).second)
      fail(
          "aot: Options::generators needs a generator for each name, names not empty nor "
          "repeated ('{}')",
          name);
  // A step's loss is a mean over the batch, and each trace at another batch size would train.
  if (step && o.dynamic_batch.max != 0)
    fail("aot: export_step takes a fixed batch (Options::dynamic_batch is for functions)");
  for (const Input& in : inputs)
    if (!std::regex_match(in.name, identifier) || in.shape.empty())
      fail("aot: input '{}' needs a C identifier for a name and a shape whose dim 0 is the batch",
           in.name);
  int64_t batch = inputs[0].shape[0];
  for (const Input& in : inputs)
    if (in.shape[0] != batch)
      fail("aot: input '{}' has batch {}, input '{}' {}", in.name, in.shape[0], inputs[0].name,
           batch);
  int64_t max = o.dynamic_batch.max;
  if (max < 0 || (max > 0 && batch > max) || batch < 1)
    fail("aot: the export batch {} must be in 1..{}", batch, max > 0 ? max : batch);

  bool cuda = false;
  for (const std::string& device : o.devices) {
    if (device != "cpu" && device != "cuda")
      fail("aot: unknown device '{}' in Options::devices (cpu, cuda)", device);
    cuda = cuda || device == "cuda";
  }

  Session session(o, step);
  std::vector<TracedPlan> traced;
  Function call = fn;
  if (!step)
    call = [&fn](const std::vector<Tensor>& args) {
      NoGradGuard no_grad;
      return fn(args);
    };
  for (int64_t b : traced_batches(batch, max)) {
    std::vector<Tensor> args;
    for (const Input& in : inputs) {
      Shape shape = in.shape;
      shape[0] = b;
      // Zeros as data, as a caller's argument is: a lazy zeros() is a Full node, which the
      // precision pass takes for a scalar constant that does not widen the ops it meets (an
      // f32 input plus a bf16 value would be stored in bf16, unlike in the JIT).
      int64_t count = numel(shape);
      args.push_back(from_storage(std::make_shared<Storage>(in.dtype, count), shape));
    }
    session.plans.push_back(plan_step(args, call));
    if (session.plans.back()->results.size() != outputs.size())
      fail("aot: {} returns {} values, {} output names were given", o.name,
           session.plans.back()->results.size(), outputs.size());
    traced.push_back({b, session.plans.back().get()});
  }
  const Plan& plan = *traced[0].plan;
  session.restore();  // the weights file and the model hold the state from before the traces

  // The state, named as a checkpoint names it; what the checkpoint does not name is a constant.
  Named named = checkpoint_names(o);
  std::vector<std::pair<StoragePtr, PlanBuffer>> buffers = named.buffers;
  PlanDocument plan_doc = plan_to_json(traced, buffers);
  std::map<const Storage*, StoragePtr> first_value;  // the state before the traces ran
  std::set<const Storage*> read;
  for (const PlannedEvaluation& planned : plan.evals)
    for (const Binding& binding : planned.inputs)
      if (binding.object) {
        read.insert(binding.object.get());
        if (binding.first_value && binding.first_value != binding.object)
          first_value.emplace(binding.object.get(), binding.first_value);
      }
  int64_t steps_buffer = -1;
  std::set<const Storage*> drawn = drawn_offsets(plan), offsets;
  for (const Named::Drawn& g : named.generators) offsets.insert(g.offset.get());
  size_t constants = 0;
  Value buffer_list = Value::array();
  safetensors::File weights;
  for (size_t k = 0; k < buffers.size(); ++k) {
    auto& [storage, info] = buffers[k];
    bool named_state = k < named.buffers.size();
    const bool own_steps = std::any_of(named.param_steps.begin(), named.param_steps.end(),
                                       [&](const auto& e) { return e.second == k; });
    bool checkpoint = named_state && storage != named.steps && !own_steps &&
                      !offsets.count(storage.get()) && !named.is_rate(k);
    bool carried = first_value.count(storage.get()) > 0;
    if (!named_state && carried && drawn.count(storage.get()))
      fail(
          "aot: the step draws random numbers (dropout, rand, randn) from a generator that "
          "Options::generators does not name: its offset is state the step carries from call to "
          "call. Name each generator the step draws from in Options::generators, as "
          "CheckpointOptions::generators names it (mt::default_generator() for draws given none)");
    if (!named_state && carried && o.module)
      for (const auto& [path, buffer] : o.module->named_buffers())
        if (buffer.node()->value == storage)  // left out of the checkpoint: non-persistent
          fail(
              "aot: the step updates the module's buffer '{}', which is not persistent, so the "
              "checkpoint leaves it out and NAME_save could not keep what the step carries from "
              "call to call: register it persistent, or do not assign it in the step",
              path);
    if (!named_state && carried)
      fail(
          "aot: the step carries a {} {} value from call to call that {} does not name (state "
          "of a module, optimizer or scaler not given in Options, a generator's offset not in "
          "Options::generators, or a buffer of its own)",
          name(info.dtype), to_string(info.shape), o.module ? "the checkpoint" : "nothing");
    if (!named_state) info.name = fmt::format("constant.{}", constants++);
    if (storage == named.steps) steps_buffer = static_cast<int64_t>(k);
    bool saved = named_state || read.count(storage.get()) > 0;
    if (saved) {
      const Storage& value = carried ? *first_value.at(storage.get()) : *storage;
      safetensors::TensorData data{info.name, info.dtype, info.shape, {}};
      data.bytes.assign(value.host_data(), value.host_data() + value.size_bytes());
      weights.tensors.push_back(std::move(data));
    }
    Value entry = {{"name", info.name},
                   {"dtype", name(info.dtype)},
                   {"shape", info.shape},
                   {"saved", saved},
                   {"checkpoint", checkpoint && step}};
    // A tensor the checkpoint names twice (tied weights) is one buffer under both names.
    for (size_t first = 0; first < k; ++first)
      if (buffers[first].first == storage) {
        entry["same_as"] = static_cast<int64_t>(first);
        break;
      }
    buffer_list.push_back(std::move(entry));
  }
  weights.metadata = named.metadata;
  // The step counts as the traces found them: "optimizer.steps", and a parameter's own where it
  // differs.
  auto count = [&](const StoragePtr& buffer) {
    const StoragePtr& before =
        first_value.count(buffer.get()) ? first_value.at(buffer.get()) : buffer;
    return static_cast<int64_t>(before->as<double>()[0]);
  };
  Value param_steps = Value::array();
  if (named.steps) {
    weights.metadata.emplace_back("optimizer.steps", std::to_string(count(named.steps)));
    for (const auto& [param, k] : named.param_steps) {
      if (int64_t own = count(buffers[k].first); own != count(named.steps))
        weights.metadata.emplace_back("optimizer." + param + ".steps", std::to_string(own));
      param_steps.push_back(Value::array({param, static_cast<int64_t>(k)}));
    }
  }
  Value rate_list = Value::array();
  for (const Named::Rate& r : named.rates)
    rate_list.push_back({{"group", static_cast<int64_t>(r.group)},
                         {"f64", static_cast<int64_t>(r.f64)},
                         {"f32", static_cast<int64_t>(r.f32)}});
  Value generator_list = Value::array();
  for (const Named::Drawn& g : named.generators) {
    const StoragePtr& offset =
        first_value.count(g.offset.get()) ? first_value.at(g.offset.get()) : g.offset;
    weights.metadata.emplace_back("generator." + g.name + ".seed", std::to_string(g.seed));
    weights.metadata.emplace_back(
        "generator." + g.name + ".offset",
        std::to_string(std::bit_cast<uint64_t>(offset->as<int64_t>()[0])));
    auto k = std::find_if(buffers.begin(), buffers.end(),
                          [&](const auto& b) { return b.first == g.offset; }) -
             buffers.begin();
    // The seed as text: JSON numbers here are int64.
    generator_list.push_back(
        {{"name", g.name}, {"seed", std::to_string(g.seed)}, {"buffer", static_cast<int64_t>(k)}});
  }
  // The step ran twice to be traced: its state goes back to where it was.
  for (const auto& [storage, before] : first_value) {
    auto& target = const_cast<Storage&>(*storage);
    std::memcpy(target.host_data(), before->host_data(), static_cast<size_t>(before->size_bytes()));
    target.host_written();
  }

  // The kernels of every traced batch, one per key: the largest dims[0] serves the others.
  std::map<std::string, const kir::Kernel*> by_key;
  std::map<std::string, int> precision;
  std::set<std::string> policies;
  size_t exported_traces = traced.size() > 1 ? traced.size() - 1 : 1;
  for (size_t index = 0; index < exported_traces; ++index)
    for (const PlannedEvaluation& planned : traced[index].plan->evals) {
      const TracedPlan& t = traced[index];
      for (const Step& s : planned.eval.executed.program->steps) {
        if (s.kind != FusionGroup::Kind::Kernel) continue;
        const kir::Kernel*& kept = by_key[kernel_key(*s.kernel)];
        if (!kept || (serves_smaller_dim0(*s.kernel) && s.kernel->dims[0] > kept->dims[0]))
          kept = s.kernel.get();
      }
      if (t.plan == &plan)
        for (Node* node : planned.eval.pending_raw) {
          ++precision[fmt::format("{}/{}", name(node->precision.storage_type),
                                  name(node->precision.compute))];
          if (node->origin.policy) policies.insert(node->origin.policy->name());
        }
    }
  if (traced.size() > 1) check_kernels_serve(by_key, traced.back());
  CudaKernels cuda_kernels;
  std::vector<int64_t> gpu_batches = cuda_batches(batch, max);
  if (cuda) {
    std::vector<StoragePtr> storages;
    for (const auto& [storage, info] : buffers) storages.push_back(storage);
    if (max > 0) {
      std::vector<std::pair<DType, Shape>> shapes;
      for (const Input& in : inputs) shapes.emplace_back(in.dtype, in.shape);
      check_padding_keeps_rows(plan_doc, storages, shapes, outputs, gpu_batches, o.name);
    }
    cuda_kernels = compile_cuda_kernels(plan_doc, storages, gpu_batches, o.cuda_archs, o.name);
  }
  Exported exported;
  exported.dir = dir;
  Value kernel_list = Value::array();
  PackageSpec spec;
  spec.dir = dir;
  spec.name = o.name;
  spec.step = step;
  spec.cuda = cuda;
  spec.max_batch = max;
  spec.variants.push_back({"native", "", host_cpu_features()});
  for (const std::string& cpu : o.cpu_targets) {
    if (!LlvmJit::instance().known_cpu(cpu) || cpu == "native")
      fail(
          "aot: '{}' is not a CPU LLVM knows (cpu_targets takes LLVM CPU names such as "
          "x86-64-v3, x86-64-v2, x86-64 or znver3)",
          cpu);
    spec.variants.push_back(
        {cpu, cpu, LlvmJit::instance().cpu_features(cpu, known_cpu_features())});
  }
  for (const auto& [key, kernel] : by_key) {
    exported.kernels.push_back({kernel->name, key, emit_llvm(*kernel)});
    spec.kernels.push_back({kernel->name, key, exported.kernels.back().llvm_ir});
    kernel_list.push_back({{"symbol", kernel->name},
                           {"key", key},
                           {"dim0", kernel->dims.empty() ? int64_t{0} : kernel->dims[0]}});
  }
  std::vector<std::string> input_names, output_names = outputs;
  std::vector<DType> input_dtypes, output_dtypes;
  std::vector<Shape> input_shapes, output_shapes;
  for (const Input& in : inputs) {
    input_names.push_back(in.name);
    input_dtypes.push_back(in.dtype);
    input_shapes.push_back(in.shape);
    spec.inputs.push_back({in.name, in.dtype, in.shape});
  }
  for (size_t r = 0; r < outputs.size(); ++r) {
    if (!std::regex_match(outputs[r], identifier))
      fail("aot: output '{}' needs a C identifier for a name", outputs[r]);
    auto [e, j] = plan.results[r];
    const Node& node = *plan.evals[e].eval.executed.sig.stored[j];
    // Dim 0 must be the batch at every traced batch, not just equal to it at the export one.
    for (const TracedPlan& t : traced) {
      auto [te, tj] = t.plan->results[r];
      const Node& at = *t.plan->evals[te].eval.executed.sig.stored[tj];
      if (max > 0 && (at.shape.empty() || at.shape[0] != t.batch))
        fail("aot: output '{}' ({} at batch {}) has no batch dim 0, which a dynamic batch needs",
             outputs[r], describe(at), t.batch);
    }
    output_dtypes.push_back(node.dtype);
    output_shapes.push_back(node.shape);
    spec.outputs.push_back({outputs[r], node.dtype, node.shape});
  }

  // Nothing in `dir` changes until the libraries are built: a failed export over an artifact
  // leaves it working. The weights are staged under a hidden name in `dir` (safetensors writes
  // files), so that moving them in is a rename.
  if (std::error_code error; !std::filesystem::create_directories(dir, error) && error)
    fail("aot: cannot create the export folder '{}': {}", dir, error.message());
  auto path = [&](const std::string& file) { return dir + "/" + file; };
  std::string plan_text = plan_doc.text();
  std::string staged = fmt::format("{}/.{}.safetensors.{}.staged", dir, o.name, getpid());
  struct Staged {
    std::string path;
    ~Staged() { std::filesystem::remove(path, ignored); }
    std::error_code ignored;
  } staging{staged, {}};
  safetensors::write(staged, weights);
  auto digest_entry = [](int64_t bytes, std::string xxh3_64) -> Value {
    return {{"bytes", bytes}, {"xxh3_64", std::move(xxh3_64)}};
  };
  Value files = Value::object();
  files[o.name + ".plan"] =
      digest_entry(static_cast<int64_t>(plan_text.size()), digest_bytes(plan_text).xxh3_64);
  FileDigest weights_digest = digest_file(staged);
  files[o.name + ".safetensors"] = digest_entry(weights_digest.bytes, weights_digest.xxh3_64);
  Value cuda_info;
  if (cuda) {
    Value images = Value::array();
    for (const CudaImage& image : cuda_kernels.images) {
      std::string file = cuda_image_file(o.name, image);
      images.push_back({{"arch", image.arch}, {"file", file}});
      files[file] =
          digest_entry(static_cast<int64_t>(image.bytes.size()), digest_bytes(image.bytes).xxh3_64);
    }
    cuda_info = {{"nvrtc", nvrtc_version()},
                 {"batches", gpu_batches},
                 {"images", std::move(images)},
                 {"kernels", cuda_kernels.functions}};
  }
  Value variants = Value::array();
  for (const PackageVariant& variant : spec.variants)
    variants.push_back({{"target", variant.target}, {"features", variant.features}});
  Value precision_counts = Value::object();
  for (const auto& [types, count] : precision) precision_counts[types] = count;
  Value manifest = {{"format", "mixtape-aot-1"},
                    {"mixtape_version", MIXTAPE_VERSION},
                    {"name", o.name},
                    {"kind", step ? "step" : "function"},
                    {"devices", cuda ? Value::array({"cpu", "cuda"}) : Value::array({"cpu"})},
                    {"cpu_variants", std::move(variants)},
                    {"batch", {{"export", batch}, {"max", max}}},
                    {"inputs", argument_list(input_names, input_dtypes, input_shapes)},
                    {"outputs", argument_list(output_names, output_dtypes, output_shapes)},
                    {"precision", {{"policies", policies}, {"storage/compute", precision_counts}}},
                    {"buffers", std::move(buffer_list)},
                    {"kernels", std::move(kernel_list)},
                    {"files", std::move(files)}};
  if (cuda) manifest["cuda"] = std::move(cuda_info);
  if (step) {
    Value metadata = Value::array();
    for (const auto& [k, v] : named.metadata) metadata.push_back(Value::array({k, v}));
    manifest["checkpoint"] = {{"metadata", std::move(metadata)},
                              {"steps_buffer", steps_buffer},
                              {"param_steps", std::move(param_steps)},
                              {"rates", std::move(rate_list)},
                              {"generators", std::move(generator_list)}};
  }
  std::string manifest_text = json::dump(manifest);
  // The library carries the manifest's digest, and the manifest the data files': the library
  // vouches for every file NAME_open reads.
  spec.manifest_xxh3 = exported.manifest_xxh3 = digest_bytes(manifest_text).xxh3_64;
  exported.files = write_package(spec);
  write_file_atomically(path(o.name + ".plan"), [&](int fd) {
    write_all(fd, plan_text.data(), plan_text.size(), path(o.name + ".plan"));
  });
  for (const CudaImage& image : cuda_kernels.images) {
    std::string file = path(cuda_image_file(o.name, image));
    write_file_atomically(
        file, [&](int fd) { write_all(fd, image.bytes.data(), image.bytes.size(), file); });
    exported.files.push_back(std::filesystem::path(file).filename().string());
  }
  std::error_code moved;
  std::filesystem::rename(staged, path(o.name + ".safetensors"), moved);
  if (moved)
    fail("aot: cannot move the weights into place as '{}': {}", path(o.name + ".safetensors"),
         moved.message());
  write_file_atomically(path(o.name + ".json"), [&](int fd) {
    write_all(fd, manifest_text.data(), manifest_text.size(), path(o.name + ".json"));
  });
  exported.files.insert(exported.files.begin(),
                        {o.name + ".json", o.name + ".plan", o.name + ".safetensors"});
  // CUDA images an earlier export of NAME wrote that this one does not list (it has no cuda, or
  // other archs): nothing opens them now, and a copy of the directory should not carry them.
  static const std::regex image_file(R"((sm_\d+\.cubin|compute_\d+\.ptx))");
  std::error_code listing;  // the export succeeded; a folder it cannot list keeps its leftovers
  for (const auto& entry : std::filesystem::directory_iterator(dir, listing)) {
    std::string file = entry.path().filename().string();
    if (file.starts_with(o.name + ".") &&
        std::regex_match(file.substr(o.name.size() + 1), image_file) &&
        std::find(exported.files.begin(), exported.files.end(), file) == exported.files.end()) {
      std::error_code ignored;  // the export succeeded; a file left over does no harm
      std::filesystem::remove(entry.path(), ignored);
    }
  }
  session.done = true;
  return exported;
}

}  // namespace mixtape::aot
