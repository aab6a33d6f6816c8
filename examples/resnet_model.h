// examples/resnet_model.h -- torchvision's ResNets (BasicBlock: ResNet-18; Bottleneck: ResNet-50),
// with torchvision's parameter and buffer names (layer1.0.conv1.weight, bn1.running_mean,
// layer2.0.downsample.0...), so that a state_dict saved by PyTorch loads: used by digits_cnn, the
// parity test and the benches.
#pragma once

#include <array>
#include <memory>

#include <mixtape/mixtape.h>

/// A block's shortcut where its shape changes: a strided 1x1 conv (no bias) and batch norm.
inline std::unique_ptr<mixtape::Sequential> resnet_downsample(int64_t in, int64_t out,
                                                              int64_t stride,
                                                              mixtape::Generator* gen) {
  auto downsample = std::make_unique<mixtape::Sequential>();
  downsample->emplace_back<mixtape::Conv2d>(in, out, 1, mixtape::Conv2dOptions{.stride = stride},
                                            false, gen);
  downsample->emplace_back<mixtape::BatchNorm2d>(out);
  return downsample;
}

/// conv3x3-bn-relu-conv3x3-bn plus the identity (or a strided 1x1 conv-bn where the shape
/// changes), then relu.
struct BasicBlock : mixtape::Module {
  static constexpr int64_t kExpansion = 1;  // output channels per `planes`
  mixtape::Conv2d conv1, conv2;
  mixtape::BatchNorm2d bn1, bn2;
  std::unique_ptr<mixtape::Sequential> downsample;

  BasicBlock(int64_t in, int64_t planes, int64_t stride, mixtape::Generator* gen = nullptr)
      : conv1(in, planes, 3, {.stride = stride, .padding = 1}, false, gen),
        conv2(planes, planes, 3, {.padding = 1}, false, gen),
        bn1(planes),
        bn2(planes) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    if (stride != 1 || in != planes) {
      downsample = resnet_downsample(in, planes, stride, gen);
      register_module("downsample", *downsample);
    }
  }
  mixtape::Tensor operator()(const mixtape::Tensor& x) const {
    mixtape::Tensor identity = downsample ? (*downsample)(x) : x;
    mixtape::Tensor y = mixtape::relu(bn1(conv1(x)));
    return mixtape::relu(bn2(conv2(y)) + identity);
  }
};

/// torchvision's Bottleneck (ResNet v1.5, the stride on the 3x3): conv1x1-bn-relu,
/// conv3x3-bn-relu, conv1x1 to 4 x planes channels-bn, plus the identity (or a strided 1x1
/// conv-bn where the shape changes), then relu.
struct Bottleneck : mixtape::Module {
  static constexpr int64_t kExpansion = 4;
  mixtape::Conv2d conv1, conv2, conv3;
  mixtape::BatchNorm2d bn1, bn2, bn3;
  std::unique_ptr<mixtape::Sequential> downsample;

  Bottleneck(int64_t in, int64_t planes, int64_t stride, mixtape::Generator* gen = nullptr)
      : conv1(in, planes, 1, {}, false, gen),
        conv2(planes, planes, 3, {.stride = stride, .padding = 1}, false, gen),
        conv3(planes, planes * kExpansion, 1, {}, false, gen),
        bn1(planes),
        bn2(planes),
        bn3(planes * kExpansion) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    register_module("conv3", conv3);
    register_module("bn3", bn3);
    if (stride != 1 || in != planes * kExpansion) {
      downsample = resnet_downsample(in, planes * kExpansion, stride, gen);
      register_module("downsample", *downsample);
    }
  }
  mixtape::Tensor operator()(const mixtape::Tensor& x) const {
    mixtape::Tensor identity = downsample ? (*downsample)(x) : x;
    mixtape::Tensor y = mixtape::relu(bn1(conv1(x)));
    y = mixtape::relu(bn2(conv2(y)));
    return mixtape::relu(bn3(conv3(y)) + identity);
  }
};

/// torchvision.models.ResNet: a 7x7 stride-2 stem, max pooling, four stages of `blocks[s]`
/// blocks (64, 128, 256, 512 planes; the first block of each stage after the first at stride 2),
/// global average pooling and a linear classifier.
template <typename Block>
struct ResNet : mixtape::Module {
  mixtape::Conv2d conv1;
  mixtape::BatchNorm2d bn1;
  mixtape::ModuleList<Block> layer1, layer2, layer3, layer4;
  mixtape::Linear fc;

  ResNet(const std::array<int, 4>& blocks, int64_t classes, mixtape::Generator* gen)
      : conv1(3, 64, 7, {.stride = 2, .padding = 3}, false, gen),
        bn1(64),
        fc(512 * Block::kExpansion, classes, true, gen) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    int64_t in = 64;
    mixtape::ModuleList<Block>* stages[] = {&layer1, &layer2, &layer3, &layer4};
    const char* names[] = {"layer1", "layer2", "layer3", "layer4"};
    for (int s = 0; s < 4; ++s) {
      const int64_t planes = int64_t{64} << s;
      for (int b = 0; b < blocks[s]; ++b) {
        stages[s]->emplace_back(in, planes, s > 0 && b == 0 ? 2 : 1, gen);
        in = planes * Block::kExpansion;
      }
      register_module(names[s], *stages[s]);
    }
    register_module("fc", fc);
  }
  mixtape::Tensor operator()(const mixtape::Tensor& x) const {
    mixtape::Tensor y = mixtape::max_pool2d(mixtape::relu(bn1(conv1(x))), 3, 2, 1);
    for (const auto* stage : {&layer1, &layer2, &layer3, &layer4})
      for (size_t i = 0; i < stage->size(); ++i) y = (*stage)[i](y);
    return fc(mixtape::flatten(mixtape::adaptive_avg_pool2d(y, 1), 1));
  }
};

/// torchvision.models.resnet18: two BasicBlocks a stage (11,689,512 parameters at 1000 classes).
struct ResNet18 : ResNet<BasicBlock> {
  explicit ResNet18(int64_t classes = 1000, mixtape::Generator* gen = nullptr)
      : ResNet({2, 2, 2, 2}, classes, gen) {}
};

/// torchvision.models.resnet50: 3, 4, 6 and 3 Bottlenecks a stage (25,557,032 parameters at 1000
/// classes), the reference workload of mixed-precision training on GPUs.
struct ResNet50 : ResNet<Bottleneck> {
  explicit ResNet50(int64_t classes = 1000, mixtape::Generator* gen = nullptr)
      : ResNet({3, 4, 6, 3}, classes, gen) {}
};
