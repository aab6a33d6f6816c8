// bench/deploy.cpp -- the deployment benchmark's mixtape side: exports the digits MLP and the char
// GPT as artifacts, builds bench/deploy_driver.c against each through its pkg-config file and
// times it (open to first result, batch-1 latency, batch-256 throughput, peak RSS), times the JIT'd
// forward (traced and mt::compile) in a child process of its own, and prints JSON lines. Then the
// same for their training steps: export_step's artifact driven by bench/deploy_step_driver.c
// against the same step under mt::compile (steps/s, open to the first step's loss).
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/gpt_step.h"
#include "examples/char_gpt_model.h"
#include "examples/digits_model.h"
#include "mixtape/dsl/error.h"
#include "mixtape/jit/aot_export.h"
#include "mixtape/jit/run_program.h"
#include "timing.h"

namespace fs = std::filesystem;
namespace json = mt::json;

namespace {

const char* const kUsage =
    "usage: bench_deploy [--models digits_mlp,char_gpt] [--threads 1,2] [--dir DIR]\n"
    "                    [--max-batch 256] [--latency-seconds S] [--window-seconds S]\n"
    "                    [--windows N] [--cold-runs N] [--driver deploy_driver.c]\n"
    "                    [--steps digits_mlp:fp32,digits_mlp:bf16,char_gpt:bf16 | none]\n"
    "                    [--step-window-seconds S] [--step-warmup N] [--step-driver FILE]\n"
    "  Exports each model into DIR/<model> (default: a temporary directory, removed at the end),\n"
    "  writes DIR/<model>_weights.safetensors and DIR/<model>_reference.safetensors for the "
    "Python\n"
    "  peers (bench/peer_deploy.py), and prints one JSON line per measurement.\n"
    "  --steps: the training steps (MODEL:fp32|bf16) exported and timed against mt::compile, for\n"
    "  the models of --models.\n";

struct Flags {
  std::vector<std::string> models{"digits_mlp", "char_gpt"};
  std::vector<std::string> threads{"1", "2"};
  std::vector<std::string> steps{"digits_mlp:fp32", "digits_mlp:bf16", "char_gpt:bf16"};
  std::string dir, driver, step_driver, jit_child, step_child, step_state;
  int64_t max_batch = 256;
  double latency_seconds = 1.0, window_seconds = 0.5, step_window_seconds = 1.0;
  int windows = 5, cold_runs = 5, step_warmup = 5;
};

constexpr uint64_t kSeed = 0;
constexpr int64_t kVocab = 110;  // fortunes.txt's bytes, as bench_training's char_gpt
constexpr int kCheckSteps = 3;   // steps whose losses the artifact and mt::compile compare

// One model: what it is called, its input's shape per row and dtype, its output's values per row.
struct Model {
  std::string name;
  std::unique_ptr<mt::Module> module;
  std::function<mt::Tensor(const mt::Tensor&)> forward;
  mt::Shape row;  // the input's shape without the batch
  mt::DType input_dtype;
  int64_t out_row;  // output values per row
  std::string weights;
};

Model make_model(const std::string& name) {
  mt::Generator gen(kSeed);
  Model m;
  m.name = name;
  if (name == "digits_mlp") {
    mt::manual_seed(kSeed);
    auto net = std::make_unique<DigitsMLP>();
    const DigitsMLP* raw = net.get();
    m.forward = [raw](const mt::Tensor& x) { return (*raw)(x); };
    m.module = std::move(net);
    m.row = {64};
    m.input_dtype = mt::f32;
    m.out_row = 10;
  } else if (name == "char_gpt") {
    GptConfig config;
    config.vocab = kVocab;
    auto net = std::make_unique<CharGpt>(config, &gen);
    net->eval();
    const CharGpt* raw = net.get();
    m.forward = [raw](const mt::Tensor& x) { return (*raw)(x); };
    m.module = std::move(net);
    m.row = {config.context};
    m.input_dtype = mt::i64;
    m.out_row = config.context * config.vocab;
  } else {
    mt::fail("bench_deploy: unknown model '{}' (digits_mlp, char_gpt)", name);
  }
  m.weights = "random (seeded " + std::to_string(kSeed) + ", the model's own initialization)";
  return m;
}

mt::Shape batch_shape(const Model& m, int64_t batch) {
  mt::Shape shape{batch};
  shape.insert(shape.end(), m.row.begin(), m.row.end());
  return shape;
}

// Seeded inputs: pixels in [0, 1) or tokens in [0, vocab), made on the host.
mt::Tensor make_input(const Model& m, int64_t batch, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t count = static_cast<size_t>(batch * mt::numel(m.row));
  if (m.input_dtype == mt::f32) {
    std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
    std::vector<float> values(count);
    for (float& v : values) v = pixel(rng);
    return mt::tensor(values, batch_shape(m, batch));
  }
  std::uniform_int_distribution<int64_t> token(0, kVocab - 1);
  std::vector<int64_t> values(count);
  for (int64_t& v : values) v = token(rng);
  return mt::tensor(values, batch_shape(m, batch), mt::i64);
}

mt::Tensor run_forward(const Model& m, const mt::Tensor& x) {
  mt::NoGradGuard no_grad;
  mt::Tensor y = m.forward(x);
  mt::eval({y});
  return y;
}

// VmHWM, as deploy_driver.c reads it (ru_maxrss would report the parent's peak: see there).
long peak_rss_kb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atol(line.c_str() + 6);
  return -1;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return bench::seconds_since(start);
}

// The C driver's rules, in C++: batch 1 timed call by call (median), batch max as the median of
// windows whose length the warm-up calls set.
json::Value time_calls(const std::function<void(int64_t)>& call, const Flags& flags) {
  for (int i = 0; i < 20; ++i) call(1);
  std::vector<double> times;
  auto began = std::chrono::steady_clock::now();
  while (times.size() < 50 || seconds_since(began) < flags.latency_seconds) {
    auto t0 = std::chrono::steady_clock::now();
    call(1);
    times.push_back(seconds_since(t0));
  }
  std::sort(times.begin(), times.end());
  size_t n = times.size();
  double warm = 0;
  for (int i = 0; i < 3; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    call(flags.max_batch);
    warm = seconds_since(t0);
  }
  int64_t per_window = std::max<int64_t>(1, std::llround(flags.window_seconds / warm));
  std::vector<double> rates;
  for (int w = 0; w < flags.windows; ++w) {
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < per_window; ++i) call(flags.max_batch);
    rates.push_back(static_cast<double>(per_window * flags.max_batch) / seconds_since(t0));
  }
  double rows_per_s = bench::median(rates);
  return {{"batch1_calls", static_cast<int64_t>(n)},
          {"batch1_latency_us", 1e6 * times[n / 2]},
          {"batch1_p10_us", 1e6 * times[n / 10]},
          {"batch1_p90_us", 1e6 * times[n * 9 / 10]},
          {"max_batch", flags.max_batch},
          {"calls_per_window", per_window},
          {"windows", flags.windows},
          {"batch_max_rows_per_s", rows_per_s},
          {"batch_max_ms_per_call", 1e3 * static_cast<double>(flags.max_batch) / rows_per_s}};
}

std::string threads_setting() {
  const char* value = std::getenv("OMP_NUM_THREADS");
  return value ? value : "default";
}

// The JIT program (a child of its own, so its peak RSS is its own): builds the model, the first
// result with an empty kernel cache (the parent points MIXTAPE_CACHE_DIR at one), then the
// forward traced on every call and through mt::compile.
void jit_child(const Flags& flags) {
  auto start = std::chrono::steady_clock::now();
  Model m = make_model(flags.jit_child);
  mt::Tensor x1 = make_input(m, 1, 1), xmax = make_input(m, flags.max_batch, 2);
  double built = seconds_since(start);
  auto t0 = std::chrono::steady_clock::now();
  run_forward(m, x1);
  double first = seconds_since(t0);
  json::Value traced{{"system", "mixtape_jit"},
                     {"model", m.name},
                     {"mode", "traced"},
                     {"threads", threads_setting()},
                     {"backend", bench::backend()},
                     {"build_model_ms", 1e3 * built},
                     {"first_result_ms_cold_kernel_cache", 1e3 * first}};
  bench::append(traced,
                time_calls([&](int64_t batch) { run_forward(m, batch == 1 ? x1 : xmax); }, flags));
  auto compiled = mt::compile([&](const mt::Tensor& x) {
    mt::NoGradGuard no_grad;
    return m.forward(x);
  });
  json::Value replayed{{"system", "mixtape_jit"},
                       {"model", m.name},
                       {"mode", "compiled"},
                       {"threads", threads_setting()}};
  bench::append(replayed, time_calls(
                              [&](int64_t batch) {
                                mt::Tensor y = compiled(batch == 1 ? x1 : xmax);
                                mt::eval({y});
                              },
                              flags));
  replayed.emplace("replays", compiled.stats().replays);
  long rss = peak_rss_kb();
  traced.emplace("peak_rss_kb", static_cast<int64_t>(rss));
  replayed.emplace("peak_rss_kb", static_cast<int64_t>(rss));
  bench::emit(traced);
  bench::emit(replayed);
}

std::string self_path() { return fs::read_symlink("/proc/self/exe").string(); }

std::vector<std::string> split_words(const std::string& text) {
  std::vector<std::string> words;
  std::string word;
  for (char c : text) {
    if (c == ' ' || c == '\n' || c == '\t') {
      if (!word.empty()) words.push_back(word);
      word.clear();
    } else {
      word += c;
    }
  }
  if (!word.empty()) words.push_back(word);
  return words;
}

// The JSON line a child printed (the last line starting with '{').
json::Value child_record(const std::string& output, const std::string& what) {
  std::string found;
  size_t at = 0;
  while (at < output.size()) {
    size_t end = output.find('\n', at);
    if (end == std::string::npos) end = output.size();
    if (output[at] == '{') found = output.substr(at, end - at);
    at = end + 1;
  }
  if (found.empty()) mt::fail("bench_deploy: {} printed no JSON: {}", what, output);
  return json::parse(found);
}

std::vector<json::Value> child_records(const std::string& output) {
  std::vector<json::Value> records;
  size_t at = 0;
  while (at < output.size()) {
    size_t end = output.find('\n', at);
    if (end == std::string::npos) end = output.size();
    if (output[at] == '{') records.push_back(json::parse(output.substr(at, end - at)));
    at = end + 1;
  }
  return records;
}

const mt::Tool kCc{"CC", "cc", "apt-get install gcc"};
const mt::Tool kPkgConfig{"", "pkg-config", "apt-get install pkg-config"};

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) mt::fail("bench_deploy: cannot read {}", path);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), {});
}

// The files of an exported artifact with their sizes, by name; `total` gets their sum.
json::Value artifact_files(const std::string& artifact, int64_t& total) {
  std::map<std::string, int64_t> sizes;
  for (const auto& entry : fs::directory_iterator(artifact)) {
    int64_t size = static_cast<int64_t>(entry.file_size());
    sizes.emplace(entry.path().filename().string(), size);
    total += size;
  }
  return sizes;
}

// Builds the C program `source` against the artifact `name` in `artifact` as a user would, its
// header and library found through NAME.pc; `defines` say what the program is driving. Returns
// the program's path, `program`.
std::string build_driver(const std::string& name, const std::string& artifact,
                         const std::string& source, const std::string& program,
                         const std::vector<std::string>& defines) {
  setenv("PKG_CONFIG_PATH", artifact.c_str(), 1);
  std::vector<std::string> pkg =
      split_words(mt::run_tool(kPkgConfig, {"--cflags", "--libs", name}));
  std::vector<std::string> cc{"-O2",
                              "-std=c11",
                              "-o",
                              program,
                              source,
                              "-DDEPLOY_NAME=" + name,
                              "-DDEPLOY_HEADER=<" + name + ".h>"};
  cc.insert(cc.end(), defines.begin(), defines.end());
  cc.insert(cc.end(), pkg.begin(), pkg.end());
  mt::run_tool(kCc, cc);
  return program;
}

void bench_model(const std::string& name, const Flags& flags, const std::string& dir) {
  Model m = make_model(name);
  std::string artifact = dir + "/" + name;
  fs::remove_all(artifact);

  // The peers' copies: the weights under the module's names, and a reference input and output.
  mt::save_tensors(dir + "/" + name + "_weights.safetensors", m.module->named_parameters());
  mt::Tensor reference_x = make_input(m, 3, 7);
  mt::save_tensors(dir + "/" + name + "_reference.safetensors",
                   {{"x", reference_x}, {"logits", run_forward(m, reference_x)}});

  auto start = std::chrono::steady_clock::now();
  mt::aot::Options options{.name = name, .dynamic_batch = {.max = flags.max_batch}};
  options.module = m.module.get();
  mt::aot::Exported exported = mt::aot::export_function(
      [&](const mt::Tensor& x) { return m.forward(x); },
      {mt::aot::input("x", batch_shape(m, flags.max_batch), m.input_dtype)}, {"logits"}, artifact,
      options);
  double export_s = seconds_since(start);
  int64_t total = 0;
  json::Value files = artifact_files(artifact, total);
  int64_t parameters = 0;
  for (const mt::Tensor& p : m.module->parameters()) parameters += p.numel();
  bench::emit({{"system", "mixtape_artifact"},
               {"model", name},
               {"mode", "export"},
               {"parameters", parameters},
               {"weights", m.weights},
               {"export_s", export_s},
               {"kernels", static_cast<int64_t>(exported.kernels.size())},
               {"files_bytes", files},
               {"total_bytes", total}});

  std::string driver = build_driver(
      name, artifact, flags.driver, dir + "/" + name + "_driver",
      {std::string("-DDEPLOY_IN_T=") + (m.input_dtype == mt::f32 ? "float" : "int64_t"),
       "-DDEPLOY_IN_ROW=" + std::to_string(mt::numel(m.row)),
       "-DDEPLOY_OUT_ROW=" + std::to_string(m.out_row),
       "-DDEPLOY_TOKENS=" + std::to_string(m.input_dtype == mt::f32 ? 0 : kVocab)});
  const mt::Tool run_driver{"", driver, ""};

  // The driver's batch-max output against the JIT's on its input: the same numbers?
  {
    std::string in = dir + "/" + name + "_in.bin", out = dir + "/" + name + "_out.bin";
    mt::run_tool(run_driver,
                 {artifact, "warm", std::to_string(flags.max_batch), "0", "0", "1", in, out});
    std::vector<char> x = read_bytes(in), y = read_bytes(out);
    mt::Tensor input =
        m.input_dtype == mt::f32
            ? mt::tensor(std::vector<float>(reinterpret_cast<float*>(x.data()),
                                            reinterpret_cast<float*>(x.data() + x.size())),
                         batch_shape(m, flags.max_batch))
            : mt::tensor(std::vector<int64_t>(reinterpret_cast<int64_t*>(x.data()),
                                              reinterpret_cast<int64_t*>(x.data() + x.size())),
                         batch_shape(m, flags.max_batch), mt::i64);
    std::vector<float> want = run_forward(m, input).to_vector<float>();
    const float* got = reinterpret_cast<const float*>(y.data());
    if (y.size() != want.size() * sizeof(float))
      mt::fail("bench_deploy: {} wrote {} bytes, expected {}", out, y.size(),
               want.size() * sizeof(float));
    double max_diff = 0;
    for (size_t i = 0; i < want.size(); ++i)
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    bench::emit({{"system", "mixtape_artifact"},
                 {"model", name},
                 {"mode", "check"},
                 {"batch", flags.max_batch},
                 {"bit_identical_to_jit", std::memcmp(got, want.data(), y.size()) == 0},
                 {"max_abs_diff_vs_jit", max_diff}});
    fs::remove(in);
    fs::remove(out);
  }

  for (const std::string& threads : flags.threads) {
    setenv("OMP_NUM_THREADS", threads.c_str(), 1);
    // Cold: a new process per run; the median run counts (the page cache is warm after the
    // first, as on a server that restarts).
    std::vector<double> open_to_first, open, process;
    for (int r = 0; r < flags.cold_runs; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      std::string output = mt::run_tool(run_driver, {artifact, "cold"});
      process.push_back(1e3 * seconds_since(t0));
      json::Value record = child_record(output, "deploy_driver cold");
      open_to_first.push_back(record.at("open_to_first_result_ms").get<double>());
      open.push_back(record.at("open_ms").get<double>());
    }
    json::Value warm =
        child_record(mt::run_tool(run_driver, {artifact, "warm", std::to_string(flags.max_batch),
                                               std::to_string(flags.latency_seconds),
                                               std::to_string(flags.window_seconds),
                                               std::to_string(flags.windows)}),
                     "deploy_driver warm");
    json::Value record{{"system", "mixtape_artifact"},
                       {"model", name},
                       {"mode", "driver"},
                       {"threads", threads},
                       {"cold_runs", flags.cold_runs},
                       {"open_to_first_result_ms", bench::median(open_to_first)},
                       {"open_to_first_result_ms_min",
                        *std::min_element(open_to_first.begin(), open_to_first.end())},
                       {"open_ms", bench::median(open)},
                       {"process_wall_ms", bench::median(process)}};
    for (const auto& [key, value] : warm.items())
      if (key != "system" && key != "mode" && key.rfind("open", 0) != 0 && key != "first_run_ms")
        record[key] = value;
    bench::emit(record);

    // The JIT program, with an empty kernel cache for its first result.
    std::string cache = dir + "/jit_cache_" + name + "_" + threads;
    fs::remove_all(cache);
    fs::create_directories(cache);
    setenv("MIXTAPE_CACHE_DIR", cache.c_str(), 1);
    std::string output = mt::run_tool(
        {"", self_path(), ""},
        {"--jit-child", name, "--max-batch", std::to_string(flags.max_batch), "--latency-seconds",
         std::to_string(flags.latency_seconds), "--window-seconds",
         std::to_string(flags.window_seconds), "--windows", std::to_string(flags.windows)});
    unsetenv("MIXTAPE_CACHE_DIR");
    fs::remove_all(cache);
    for (const json::Value& r : child_records(output)) std::printf("%s\n", json::dump(r).c_str());
    std::fflush(stdout);
  }
  unsetenv("OMP_NUM_THREADS");
}

// ---- the training step: export_step's artifact against mt::compile ----

// One training step to time: the model, its optimizer (and scaler), the step function that both
// export_step and mt::compile get, and the one batch every step trains on.
struct Trainer {
  std::string model, policy;
  int64_t batch = 0;
  int64_t tokens = 0;      // input tokens lie in [0, tokens); 0: the input is f32 pixels
  int64_t target_row = 0;  // i64 targets per row
  int64_t classes = 0;     // targets lie in [0, classes)
  std::unique_ptr<mt::Module> module;
  std::unique_ptr<mt::Optimizer> optimizer;
  std::unique_ptr<mt::GradScaler> scaler;  // null: the step has none
  std::function<mt::Tensor(const mt::Tensor&, const mt::Tensor&)> step;
  mt::Tensor x, y;
  mt::aot::Input x_input, y_input;
};

// deploy_driver.h's lcg_next in C++: the step driver's inputs (pixels seeded 12345 as bits / 2^31,
// tokens and targets as bits % count, targets seeded 54321) made here for mt::compile.
constexpr uint64_t kInputSeed = 12345, kTargetSeed = 54321;
std::vector<uint32_t> lcg_bits(size_t count, uint64_t state) {
  std::vector<uint32_t> bits(count);
  for (uint32_t& b : bits) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    b = static_cast<uint32_t>(state >> 33);
  }
  return bits;
}
mt::Tensor lcg_tokens(mt::Shape shape, int64_t count, uint64_t seed) {
  std::vector<int64_t> values;
  for (uint32_t b : lcg_bits(static_cast<size_t>(mt::numel(shape)), seed))
    values.push_back(static_cast<int64_t>(b % static_cast<uint32_t>(count)));
  return mt::tensor(values, std::move(shape), mt::i64);
}
mt::Tensor lcg_pixels(mt::Shape shape, uint64_t seed) {
  std::vector<float> values;
  for (uint32_t b : lcg_bits(static_cast<size_t>(mt::numel(shape)), seed))
    values.push_back(static_cast<float>(static_cast<double>(b) / 2147483648.0));
  return mt::tensor(values, std::move(shape));
}

// "digits_mlp:bf16": the digits MLP at batch 64 (cross-entropy, AdamW 1e-3, a dynamic GradScaler
// from 1024) or the char GPT of bench_training at batch 16 (bench/gpt_step.h: AdamW 1e-3, beta2
// 0.99, weight decay 0.1, clipping at 1), under fp32 or autocast-bf16.
std::unique_ptr<Trainer> make_trainer(const std::string& spec) {
  size_t colon = spec.find(':');
  auto t = std::make_unique<Trainer>();
  t->model = spec.substr(0, colon);
  t->policy = colon == std::string::npos ? "" : spec.substr(colon + 1);
  if (t->policy != "fp32" && t->policy != "bf16")
    mt::fail("bench_deploy: step '{}' is not MODEL:fp32 or MODEL:bf16", spec);
  mt::PolicyPtr policy = mt::policy_by_name(t->policy == "bf16" ? "autocast-bf16" : "fp32");
  if (t->model == "digits_mlp") {
    mt::manual_seed(kSeed);
    auto net = std::make_unique<DigitsMLP>();
    auto opt = std::make_unique<mt::AdamW>(net->parameters(), mt::AdamOptions{.lr = 1e-3});
    auto scaler = std::make_unique<mt::GradScaler>(mt::GradScalerOptions{.init_scale = 1024});
    t->step = [net = net.get(), opt = opt.get(), scaler = scaler.get(), policy](
                  const mt::Tensor& x, const mt::Tensor& y) {
      opt->zero_grad();
      mt::Tensor loss;
      {
        mt::autocast guard(policy);
        loss = mt::cross_entropy((*net)(x), y);
      }
      scaler->scale(loss).backward();
      scaler->step(*opt);
      scaler->update();
      return loss;
    };
    t->batch = 64;
    t->target_row = 1;
    t->classes = 10;
    t->x = lcg_pixels({t->batch, 64}, kInputSeed);
    t->y = lcg_tokens({t->batch}, t->classes, kTargetSeed);
    t->x_input = mt::aot::input("x", {t->batch, 64}, mt::f32);
    t->y_input = mt::aot::input("y", {t->batch}, mt::i64);
    t->module = std::move(net);
    t->optimizer = std::move(opt);
    t->scaler = std::move(scaler);
  } else if (t->model == "char_gpt") {
    GptConfig config;
    config.vocab = kVocab;
    mt::Generator gen(kSeed);
    auto net = std::make_unique<CharGpt>(config, &gen);
    auto opt = std::make_unique<mt::AdamW>(
        net->parameters(), mt::AdamOptions{.lr = 1e-3, .beta2 = 0.99, .weight_decay = 0.1});
    struct State {
      CharGpt* model;
      mt::AdamW* optimizer;
    };
    t->step = bench::gpt_train_step(std::make_shared<State>(State{net.get(), opt.get()}), policy);
    t->batch = 16;
    t->tokens = kVocab;
    t->target_row = config.context;
    t->classes = kVocab;
    t->x = lcg_tokens({t->batch, config.context}, kVocab, kInputSeed);
    t->y = lcg_tokens({t->batch, config.context}, kVocab, kTargetSeed);
    t->x_input = mt::aot::input("tokens", {t->batch, config.context}, mt::i64);
    t->y_input = mt::aot::input("targets", {t->batch, config.context}, mt::i64);
    t->module = std::move(net);
    t->optimizer = std::move(opt);
  } else {
    mt::fail("bench_deploy: unknown model in step '{}' (digits_mlp, char_gpt)", spec);
  }
  return t;
}

uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// The step under mt::compile (a child of its own, with the driver's thread count): from the
// state the artifact starts from (flags.step_state), the first losses, then the driver's timing
// rules (bench::measure: warm-up steps, then the median window).
void step_child(const Flags& flags) {
  std::unique_ptr<Trainer> t = make_trainer(flags.step_child);
  t->step(t->x, t->y);  // makes the optimizer's state, which the checkpoint then overwrites
  mt::load_checkpoint(flags.step_state, *t->module, t->optimizer.get(), nullptr, t->scaler.get());
  auto compiled = mt::compile(t->step);
  json::Value check = json::Value::array();
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kCheckSteps; ++i)
    check.push_back(int64_t{float_bits(compiled(t->x, t->y).to_vector<float>()[0])});
  double check_s = seconds_since(start);
  bench::TimingOptions timing{.warmup = flags.step_warmup,
                              .windows = flags.windows,
                              .window_seconds = flags.step_window_seconds,
                              .budget_seconds = 1e9,  // no cut: the C driver has none
                              .agree = {}};
  json::Value record{{"system", "mixtape_jit"},  {"model", t->model},
                     {"mode", "step_compiled"},  {"policy", t->policy},
                     {"batch", t->batch},        {"threads", threads_setting()},
                     {"check_loss_bits", check}, {"check_steps_s", check_s}};
  bench::append(record, bench::measure(
                            [&] {
                              mt::Tensor loss = compiled(t->x, t->y);
                              mt::eval({loss});
                            },
                            timing));
  record.emplace("replays", compiled.stats().replays);
  record.emplace("traces", compiled.stats().traces);
  record.emplace("peak_rss_kb", static_cast<int64_t>(peak_rss_kb()));
  bench::emit(record);
}

void bench_step(const std::string& spec, const Flags& flags, const std::string& dir) {
  std::unique_ptr<Trainer> t = make_trainer(spec);
  // One step first: the optimizer makes its state at its first step (see export_step).
  t->step(t->x, t->y);
  std::string name = t->model + "_train_" + t->policy, artifact = dir + "/" + name;
  std::string state = dir + "/" + name + "_start.safetensors";
  mt::save_checkpoint(state, *t->module, t->optimizer.get(), {}, t->scaler.get());
  fs::remove_all(artifact);
  auto start = std::chrono::steady_clock::now();
  mt::aot::Options options{.name = name,
                           .module = t->module.get(),
                           .optimizer = t->optimizer.get(),
                           .scaler = t->scaler.get()};
  mt::aot::Exported exported =
      mt::aot::export_step(t->step, {t->x_input, t->y_input}, {"loss"}, artifact, options);
  double export_s = seconds_since(start);
  int64_t total = 0;
  json::Value files = artifact_files(artifact, total);
  bench::emit({{"system", "mixtape_artifact"},
               {"model", t->model},
               {"mode", "step_export"},
               {"policy", t->policy},
               {"batch", t->batch},
               {"export_s", export_s},
               {"kernels", static_cast<int64_t>(exported.kernels.size())},
               {"files_bytes", files},
               {"total_bytes", total}});

  std::string driver =
      build_driver(name, artifact, flags.step_driver, dir + "/" + name + "_driver",
                   {"-DDEPLOY_BATCH=" + std::to_string(t->batch),
                    std::string("-DDEPLOY_IN_T=") + (t->tokens ? "int64_t" : "float"),
                    "-DDEPLOY_IN_ROW=" + std::to_string(mt::numel(t->x_input.shape) / t->batch),
                    "-DDEPLOY_TOKENS=" + std::to_string(t->tokens),
                    "-DDEPLOY_TARGET_ROW=" + std::to_string(t->target_row),
                    "-DDEPLOY_CLASSES=" + std::to_string(t->classes)});
  const mt::Tool run_driver{"", driver, ""};
  const std::string windows = std::to_string(flags.windows),
                    window_s = std::to_string(flags.step_window_seconds),
                    warmup = std::to_string(flags.step_warmup),
                    checks = std::to_string(kCheckSteps);

  for (const std::string& threads : flags.threads) {
    setenv("OMP_NUM_THREADS", threads.c_str(), 1);
    std::vector<double> open_to_first, open;
    for (int r = 0; r < flags.cold_runs; ++r) {
      json::Value cold =
          child_record(mt::run_tool(run_driver, {artifact, "cold"}), "deploy_step_driver cold");
      open_to_first.push_back(cold.at("open_to_first_step_ms").get<double>());
      open.push_back(cold.at("open_ms").get<double>());
    }
    json::Value warm = child_record(
        mt::run_tool(run_driver, {artifact, "warm", checks, warmup, window_s, windows}),
        "deploy_step_driver warm");
    json::Value artifact_record{{"system", "mixtape_artifact"},
                                {"model", t->model},
                                {"mode", "step_driver"},
                                {"policy", t->policy},
                                {"threads", threads},
                                {"cold_runs", flags.cold_runs},
                                {"open_to_first_step_ms", bench::median(open_to_first)},
                                {"open_to_first_step_ms_min",
                                 *std::min_element(open_to_first.begin(), open_to_first.end())},
                                {"open_ms", bench::median(open)}};
    for (const auto& [key, value] : warm.items())
      if (key != "system" && key != "mode") artifact_record[key] = value;
    bench::emit(artifact_record);

    json::Value compiled = child_record(
        mt::run_tool({"", self_path(), ""},
                     {"--step-child", spec, "--step-state", state, "--step-warmup", warmup,
                      "--step-window-seconds", window_s, "--windows", windows}),
        "bench_deploy --step-child");
    std::printf("%s\n", json::dump(compiled).c_str());
    double ratio = warm.at("steps_per_s").get<double>() / compiled.at("steps_per_s").get<double>();
    bench::emit({{"system", "mixtape_artifact"},
                 {"model", t->model},
                 {"mode", "step_vs_compile"},
                 {"policy", t->policy},
                 {"batch", t->batch},
                 {"threads", threads},
                 {"steps_per_s_artifact", warm.at("steps_per_s")},
                 {"steps_per_s_compile", compiled.at("steps_per_s")},
                 {"ratio_artifact_to_compile", ratio},
                 {"within_5_percent", ratio >= 0.95},
                 {"check_steps", kCheckSteps},
                 {"losses_bit_identical", json::dump(warm.at("check_loss_bits")) ==
                                              json::dump(compiled.at("check_loss_bits"))}});
  }
  unsetenv("OMP_NUM_THREADS");
  fs::remove(state);
}

Flags parse(int argc, char** argv) {
  Flags flags;
  // Next to this source: __FILE__ is relative to the build directory, where the program is.
  fs::path bench = fs::path(__FILE__).parent_path();
  if (bench.is_relative()) bench = fs::path(self_path()).parent_path() / bench;
  flags.driver = (bench / "deploy_driver.c").lexically_normal().string();
  flags.step_driver = (bench / "deploy_step_driver.c").lexically_normal().string();
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    }
    if (i + 1 >= argc) bench::usage_error("bench_deploy", flag + " needs a value", kUsage);
    std::string value = argv[++i];
    auto number = [&] {
      char* end = nullptr;
      double v = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end || !(v > 0))
        bench::usage_error("bench_deploy", flag + " needs a positive number", kUsage);
      return v;
    };
    if (flag == "--models")
      flags.models = bench::split_list(value);
    else if (flag == "--threads")
      flags.threads = bench::split_list(value);
    else if (flag == "--dir")
      flags.dir = value;
    else if (flag == "--driver")
      flags.driver = value;
    else if (flag == "--step-driver")
      flags.step_driver = value;
    else if (flag == "--steps")
      flags.steps = value == "none" ? std::vector<std::string>{} : bench::split_list(value);
    else if (flag == "--step-child")
      flags.step_child = value;
    else if (flag == "--step-state")
      flags.step_state = value;
    else if (flag == "--step-window-seconds")
      flags.step_window_seconds = number();
    else if (flag == "--step-warmup")
      flags.step_warmup = static_cast<int>(number());
    else if (flag == "--jit-child")
      flags.jit_child = value;
    else if (flag == "--max-batch")
      flags.max_batch = static_cast<int64_t>(number());
    else if (flag == "--latency-seconds")
      flags.latency_seconds = number();
    else if (flag == "--window-seconds")
      flags.window_seconds = number();
    else if (flag == "--windows")
      flags.windows = static_cast<int>(number());
    else if (flag == "--cold-runs")
      flags.cold_runs = static_cast<int>(number());
    else
      bench::usage_error("bench_deploy", "unknown flag " + flag, kUsage);
  }
  return flags;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags = parse(argc, argv);
  try {
    if (!flags.jit_child.empty()) {
      jit_child(flags);
      return 0;
    }
    if (!flags.step_child.empty()) {
      step_child(flags);
      return 0;
    }
    if (!fs::exists(flags.driver))
      mt::fail("bench_deploy: {} not found (pass --driver bench/deploy_driver.c)", flags.driver);
    if (!flags.steps.empty() && !fs::exists(flags.step_driver))
      mt::fail("bench_deploy: {} not found (pass --step-driver bench/deploy_step_driver.c)",
               flags.step_driver);
    bool temporary = flags.dir.empty();
    std::string dir =
        temporary
            ? (fs::temp_directory_path() / ("mixtape_bench_deploy_" + std::to_string(getpid())))
                  .string()
            : fs::absolute(flags.dir).string();
    fs::create_directories(dir);
    for (const std::string& name : flags.models) {
      bench_model(name, flags, dir);
      for (const std::string& step : flags.steps)
        if (step.substr(0, step.find(':')) == name) bench_step(step, flags, dir);
    }
    if (temporary) fs::remove_all(dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_deploy: %s\n", e.what());
    return 1;
  }
  return 0;
}
