// bench/vision_ops.cpp -- bench_vision_ops: steps/s of the image ops a PyTorch user reaches for
// beyond convolution and pooling (unfold + fold, affine_grid + grid_sample, bilinear and bicubic
// interpolate, take_along_dim, sort, a 'same' reflect-padded convolution, the volume ops),
// forward and backward through mt::compile, against PyTorch eager in the same run
// (bench/peer_torch_vision.py). JSON lines; not a CTest test.
#include <mixtape/mixtape.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bench/peak.h"
#include "bench/timing.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/json.h"

namespace mt = mixtape;

namespace {

constexpr const char* kUsage =
    "usage: bench_vision_ops [--window-seconds S] [--no-peer]\n"
    "  Each op on x [8, 64, 32, 32] f32, the step computing x's gradient of sum(op(x)^2) through\n"
    "  mt::compile: unfold_fold (kernel 3, padding 1, and back), affine_grid_sample (bilinear,\n"
    "  zeros), interpolate_bilinear and interpolate_bicubic (to 64 x 64), take_along_dim (x as\n"
    "  [8, 64, 1024], positions uniform in the last axis), sort (its values along that axis),\n"
    "  conv2d_same_reflect (64 -> 64 channels, 3 x 3); and on x as a volume [8, 16, 16, 16, 16]:\n"
    "  conv3d (16 -> 16 channels, 3 x 3 x 3, padding 1), conv_transpose3d (16 -> 16, kernel 2,\n"
    "  stride 2), max_pool3d (3, stride 2, padding 1), avg_pool3d (2).\n"
    "  Then PyTorch eager on the same ops (bench/peer_torch_vision.py) unless --no-peer.\n";

using Op = std::function<mt::Tensor(const mt::Tensor&)>;

mt::json::Value run(const std::string& name, const Op& op, const mt::Tensor& x,
                    const bench::TimingOptions& timing) {
  auto step = mt::compile([&](const mt::Tensor& input) {
    mt::Tensor w = input.detach();
    w.requires_grad_();
    mt::sum(mt::square(op(w))).backward();
    return w.grad();
  });
  mt::json::Value record{{"bench", "vision_ops"},
                         {"system", "mixtape"},
                         {"op", name},
                         {"cpu_model", bench::cpu_model()}};
  bench::append(record, bench::measure([&] { mt::eval({step(x)}); }, timing));
  return record;
}

}  // namespace

int main(int argc, char** argv) {
  bench::TimingOptions timing;
  timing.windows = 3;
  timing.budget_seconds = 20;
  bool peer = true;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--window-seconds" && i + 1 < argc) {
      timing.window_seconds = std::atof(argv[++i]);
    } else if (arg == "--no-peer") {
      peer = false;
    } else {
      std::fputs(kUsage, arg == "--help" ? stdout : stderr);
      return arg == "--help" ? 0 : 2;
    }
  }
  try {
    mt::Generator gen(3);
    const mt::Tensor x = mt::randn({8, 64, 32, 32}, mt::f32, &gen);
    const mt::Tensor identity = mt::tensor(std::vector<float>{1, 0, 0, 0, 1, 0}, {1, 2, 3});
    const mt::Tensor theta = mt::randn({8, 2, 3}, mt::f32, &gen) * 0.1 + identity;
    const mt::Tensor weight = mt::randn({64, 64, 3, 3}, mt::f32, &gen) * 0.05;
    const mt::Tensor positions = mt::randint(0, 1024, {8, 64, 1024}, &gen);
    const mt::Tensor weight3 = mt::randn({16, 16, 3, 3, 3}, mt::f32, &gen) * 0.05;
    const mt::Tensor weight_up = mt::randn({16, 16, 2, 2, 2}, mt::f32, &gen) * 0.1;
    mt::eval({x, theta, weight, positions, weight3, weight_up});
    const auto volume = [](const mt::Tensor& t) { return mt::reshape(t, {8, 16, 16, 16, 16}); };
    const std::vector<std::pair<std::string, Op>> ops = {
        {"unfold_fold",
         [](const mt::Tensor& t) {
           return mt::fold(mt::unfold(t, 3, 1, 1), {32, 32}, 3, 1, 1);
         }},
        {"affine_grid_sample",
         [&](const mt::Tensor& t) {
           return mt::grid_sample(t, mt::affine_grid(theta, {8, 64, 32, 32}));
         }},
        {"interpolate_bilinear",
         [](const mt::Tensor& t) {
           return mt::interpolate(t, {.size = {64, 64}, .mode = mt::InterpolateMode::Bilinear});
         }},
        {"take_along_dim",
         [&](const mt::Tensor& t) {
           return mt::take_along_dim(mt::reshape(t, {8, 64, 1024}), positions, 2);
         }},
        {"sort",
         [](const mt::Tensor& t) {
           return mt::sort(mt::reshape(t, {8, 64, 1024}), 2).values;
         }},
        {"interpolate_bicubic",
         [](const mt::Tensor& t) {
           return mt::interpolate(t, {.size = {64, 64}, .mode = mt::InterpolateMode::Bicubic});
         }},
        {"conv2d_same_reflect",
         [&](const mt::Tensor& t) {
           return mt::conv2d(t, weight, {},
                             {.padding = mt::Padding::Same, .padding_mode = mt::PadMode::Reflect});
         }},
        {"conv3d",
         [&](const mt::Tensor& t) { return mt::conv3d(volume(t), weight3, {}, {.padding = 1}); }},
        {"conv_transpose3d",
         [&](const mt::Tensor& t) {
           return mt::conv_transpose3d(volume(t), weight_up, {}, {.stride = 2});
         }},
        {"max_pool3d", [&](const mt::Tensor& t) { return mt::max_pool3d(volume(t), 3, 2, 1); }},
        {"avg_pool3d", [&](const mt::Tensor& t) { return mt::avg_pool3d(volume(t), 2); }}};
    for (const auto& [name, op] : ops) bench::emit(run(name, op, x, timing));
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "bench_vision_ops: %s\n", e.what());
    return 1;
  }
  if (!peer) return 0;
  const std::string command = std::string("/usr/bin/python3 ") + MIXTAPE_BENCH_DIR +
                              "/peer_torch_vision.py " + std::to_string(timing.window_seconds);
  return std::system(command.c_str()) == 0 ? 0 : 1;
}
