// bench/attention.cpp -- bench_attention: one attention forward + backward ([B, H, T, D], causal)
// with the fused op and with the materialized composite, f32 and autocast-bf16: steps/s, CPU time
// and the peak bytes of stored values (execution_stats), then PyTorch's attention as the peer in
// the same run (bench/peer_torch_attention.py). JSON lines; not a CTest test.
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "bench/timing.h"
#include "mixtape/dsl/attention.h"

namespace {

namespace mt = mixtape;

constexpr const char* kUsage =
    "usage: bench_attention [--batch B] [--heads H] [--t T] [--d D] [--dropout P]\n"
    "                       [--window-seconds S] [--no-peer]\n"
    "  causal attention over q, k, v [B, H, T, D] (defaults 1 4 1024 64), its weights dropped\n"
    "  with probability P (default 0), the gradients of sum(out * w): mixtape fused and\n"
    "  composite, f32 and autocast-bf16, then PyTorch's.\n";

struct Shape {
  int64_t batch = 1, heads = 4, t = 1024, d = 64;
  double dropout = 0;
};

mt::json::Value run(const Shape& s, bool fused, std::optional<mt::DType> autocast,
                    const bench::TimingOptions& timing) {
  mt::Generator gen(1);
  const mt::Shape shape{s.batch, s.heads, s.t, s.d};
  mt::Tensor q = mt::randn(shape, mt::f32, &gen).requires_grad_();
  mt::Tensor k = mt::randn(shape, mt::f32, &gen).requires_grad_();
  mt::Tensor v = mt::randn(shape, mt::f32, &gen).requires_grad_();
  mt::Tensor w = mt::randn(shape, mt::f32, &gen);
  mt::eval({q, k, v, w});
  int64_t peak = 0;
  auto step = [&] {
    for (mt::Tensor* x : {&q, &k, &v}) x->zero_grad();
    mt::Tensor out;
    {
      std::optional<mt::autocast> guard;
      if (autocast) guard.emplace(*autocast);
      out = mt::detail::attention(q, k, v, mt::Tensor(), true, std::nullopt, fused,
                                  mt::Loc::current(), s.dropout, &gen);
    }
    mt::sum(mt::cast(out, mt::f32) * w).backward();
    mt::reset_execution_stats();
    mt::eval({q.grad(), k.grad(), v.grad()});
    peak = mt::execution_stats().peak_bytes;
  };
  mt::json::Value record{{"bench", "attention"},
                         {"system", fused ? "mixtape_fused" : "mixtape_composite"},
                         {"precision", autocast ? "bf16" : "f32"},
                         {"batch", s.batch},
                         {"heads", s.heads},
                         {"t", s.t},
                         {"d", s.d},
                         {"dropout", s.dropout}};
  bench::append(record, bench::measure(step, timing));
  record.emplace("peak_stored_bytes", peak);
  return record;
}

}  // namespace

int main(int argc, char** argv) {
  Shape s;
  bench::TimingOptions timing;
  timing.warmup = 2;
  timing.windows = 3;
  timing.budget_seconds = 20.0;
  bool peer = true;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fputs(kUsage, stderr);
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--batch")
      s.batch = std::atoll(next());
    else if (arg == "--heads")
      s.heads = std::atoll(next());
    else if (arg == "--t")
      s.t = std::atoll(next());
    else if (arg == "--d")
      s.d = std::atoll(next());
    else if (arg == "--dropout")
      s.dropout = std::atof(next());
    else if (arg == "--window-seconds")
      timing.window_seconds = std::atof(next());
    else if (arg == "--no-peer")
      peer = false;
    else {
      std::fputs(kUsage, stderr);
      return 2;
    }
  }
  if (s.batch <= 0 || s.heads <= 0 || s.t <= 0 || s.d <= 0 || !(s.dropout >= 0 && s.dropout < 1)) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  try {
    for (std::optional<mt::DType> precision : {std::optional<mt::DType>(), std::optional(mt::bf16)})
      for (bool fused : {true, false}) bench::emit(run(s, fused, precision, timing));
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 1;
  }
  if (!peer) return 0;
  const std::string command = std::string("/usr/bin/python3 ") + MIXTAPE_BENCH_DIR +
                              "/peer_torch_attention.py " + std::to_string(s.batch) + " " +
                              std::to_string(s.heads) + " " + std::to_string(s.t) + " " +
                              std::to_string(s.d) + " " + std::to_string(timing.window_seconds) +
                              " " + std::to_string(s.dropout);
  return std::system(command.c_str()) == 0 ? 0 : 1;
}
