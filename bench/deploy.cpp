// bench/deploy.cpp -- the deployment benchmark's mixtape side: exports the digits MLP and the char
// GPT as artifacts, builds bench/deploy_driver.c against each through its pkg-config file and
// times it (open to first result, batch-1 latency, batch-256 throughput, peak RSS), times the JIT'd
// forward (traced and mt::compile) in a child process of its own, and prints JSON lines.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "examples/char_gpt_model.h"
#include "examples/digits_model.h"
#include "jit/aot_export.h"
#include "jit/run_program.h"
#include "timing.h"

namespace fs = std::filesystem;
namespace json = mt::json;

namespace {

const char* const kUsage =
    "usage: bench_deploy [--models digits_mlp,char_gpt] [--threads 1,2] [--dir DIR]\n"
    "                    [--max-batch 256] [--latency-seconds S] [--window-seconds S]\n"
    "                    [--windows N] [--cold-runs N] [--driver deploy_driver.c]\n"
    "  Exports each model into DIR/<model> (default: a temporary directory, removed at the end),\n"
    "  writes DIR/<model>_weights.safetensors and DIR/<model>_reference.safetensors for the "
    "Python\n"
    "  peers (bench/peer_deploy.py), and prints one JSON line per measurement.\n";

struct Flags {
  std::vector<std::string> models{"digits_mlp", "char_gpt"};
  std::vector<std::string> threads{"1", "2"};
  std::string dir, driver, jit_child;
  int64_t max_batch = 256;
  double latency_seconds = 1.0, window_seconds = 0.5;
  int windows = 5, cold_runs = 5;
};

constexpr uint64_t kSeed = 0;
constexpr int64_t kVocab = 110;  // fortunes.txt's bytes, as bench_training's char_gpt

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
json::Object time_calls(const std::function<void(int64_t)>& call, const Flags& flags) {
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
  json::Object traced{{"system", "mixtape_jit"},
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
  json::Object replayed{{"system", "mixtape_jit"},
                        {"model", m.name},
                        {"mode", "compiled"},
                        {"threads", threads_setting()}};
  bench::append(replayed, time_calls(
                              [&](int64_t batch) {
                                mt::Tensor y = compiled(batch == 1 ? x1 : xmax);
                                mt::eval({y});
                              },
                              flags));
  replayed.emplace_back("replays", compiled.stats().replays);
  long rss = peak_rss_kb();
  traced.emplace_back("peak_rss_kb", static_cast<int64_t>(rss));
  replayed.emplace_back("peak_rss_kb", static_cast<int64_t>(rss));
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
  json::Object files;
  int64_t total = 0;
  for (const auto& entry : fs::directory_iterator(artifact)) {
    int64_t size = static_cast<int64_t>(entry.file_size());
    files.emplace_back(entry.path().filename().string(), size);
    total += size;
  }
  std::sort(files.begin(), files.end(), [](auto& a, auto& b) { return a.first < b.first; });
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

  // Build the C driver as a user would: the header and library found through NAME.pc.
  setenv("PKG_CONFIG_PATH", artifact.c_str(), 1);
  std::vector<std::string> pkg =
      split_words(mt::run_tool(kPkgConfig, {"--cflags", "--libs", name}));
  std::string driver = dir + "/" + name + "_driver";
  std::vector<std::string> cc{
      "-O2",
      "-std=c11",
      "-o",
      driver,
      flags.driver,
      "-DDEPLOY_NAME=" + name,
      "-DDEPLOY_HEADER=<" + name + ".h>",
      std::string("-DDEPLOY_IN_T=") + (m.input_dtype == mt::f32 ? "float" : "int64_t"),
      "-DDEPLOY_IN_ROW=" + std::to_string(mt::numel(m.row)),
      "-DDEPLOY_OUT_ROW=" + std::to_string(m.out_row),
      "-DDEPLOY_TOKENS=" + std::to_string(m.input_dtype == mt::f32 ? 0 : kVocab)};
  cc.insert(cc.end(), pkg.begin(), pkg.end());
  mt::run_tool(kCc, cc);
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
      open_to_first.push_back(record.at("open_to_first_result_ms").as_double());
      open.push_back(record.at("open_ms").as_double());
    }
    json::Value warm =
        child_record(mt::run_tool(run_driver, {artifact, "warm", std::to_string(flags.max_batch),
                                               std::to_string(flags.latency_seconds),
                                               std::to_string(flags.window_seconds),
                                               std::to_string(flags.windows)}),
                     "deploy_driver warm");
    json::Object record{{"system", "mixtape_artifact"},
                        {"model", name},
                        {"mode", "driver"},
                        {"threads", threads},
                        {"cold_runs", flags.cold_runs},
                        {"open_to_first_result_ms", bench::median(open_to_first)},
                        {"open_to_first_result_ms_min",
                         *std::min_element(open_to_first.begin(), open_to_first.end())},
                        {"open_ms", bench::median(open)},
                        {"process_wall_ms", bench::median(process)}};
    for (const auto& [key, value] : warm.as_object())
      if (key != "system" && key != "mode" && key.rfind("open", 0) != 0 && key != "first_run_ms")
        record.emplace_back(key, value);
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

Flags parse(int argc, char** argv) {
  Flags flags;
  // Next to this source: __FILE__ is relative to the build directory, where the program is.
  fs::path source = fs::path(__FILE__).parent_path() / "deploy_driver.c";
  if (source.is_relative()) source = fs::path(self_path()).parent_path() / source;
  flags.driver = source.lexically_normal().string();
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
    if (!fs::exists(flags.driver))
      mt::fail("bench_deploy: {} not found (pass --driver bench/deploy_driver.c)", flags.driver);
    bool temporary = flags.dir.empty();
    std::string dir =
        temporary
            ? (fs::temp_directory_path() / ("mixtape_bench_deploy_" + std::to_string(getpid())))
                  .string()
            : fs::absolute(flags.dir).string();
    fs::create_directories(dir);
    for (const std::string& name : flags.models) bench_model(name, flags, dir);
    if (temporary) fs::remove_all(dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_deploy: %s\n", e.what());
    return 1;
  }
  return 0;
}
