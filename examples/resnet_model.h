// examples/resnet_model.h -- torchvision's ResNet BasicBlock and ResNet-18, with torchvision's
// parameter and buffer names (layer1.0.conv1.weight, bn1.running_mean, layer2.0.downsample.0...),
// so that a state_dict saved by PyTorch loads: used by digits_cnn, the parity test and the bench.
#pragma once

#include <memory>

#include <mixtape/mixtape.h>

/// conv3x3-bn-relu-conv3x3-bn plus the identity (or a strided 1x1 conv-bn where the shape
/// changes), then relu.
struct BasicBlock : mixtape::Module {
  mixtape::Conv2d conv1, conv2;
  mixtape::BatchNorm2d bn1, bn2;
  std::unique_ptr<mixtape::Sequential> downsample;

  BasicBlock(int64_t in, int64_t out, int64_t stride, mixtape::Generator* gen = nullptr)
      : conv1(in, out, 3, {.stride = stride, .padding = 1}, false, gen),
        conv2(out, out, 3, {.padding = 1}, false, gen),
        bn1(out),
        bn2(out) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    if (stride != 1 || in != out) {
      downsample = std::make_unique<mixtape::Sequential>();
      downsample->emplace_back<mixtape::Conv2d>(
          in, out, 1, mixtape::Conv2dOptions{.stride = stride}, false, gen);
      downsample->emplace_back<mixtape::BatchNorm2d>(out);
      register_module("downsample", *downsample);
    }
  }
  mixtape::Tensor operator()(const mixtape::Tensor& x) const {
    mixtape::Tensor identity = downsample ? (*downsample)(x) : x;
    mixtape::Tensor y = mixtape::relu(bn1(conv1(x)));
    return mixtape::relu(bn2(conv2(y)) + identity);
  }
};

/// torchvision.models.resnet18: a 7x7 stride-2 stem, max pooling, four stages of two
/// BasicBlocks (64, 128, 256, 512 channels), global average pooling and a linear classifier.
struct ResNet18 : mixtape::Module {
  mixtape::Conv2d conv1;
  mixtape::BatchNorm2d bn1;
  mixtape::ModuleList<BasicBlock> layer1, layer2, layer3, layer4;
  mixtape::Linear fc;

  explicit ResNet18(int64_t classes = 1000, mixtape::Generator* gen = nullptr)
      : conv1(3, 64, 7, {.stride = 2, .padding = 3}, false, gen),
        bn1(64),
        fc(512, classes, true, gen) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    int64_t in = 64;
    mixtape::ModuleList<BasicBlock>* stages[] = {&layer1, &layer2, &layer3, &layer4};
    const char* names[] = {"layer1", "layer2", "layer3", "layer4"};
    for (int s = 0; s < 4; ++s) {
      int64_t out = int64_t{64} << s;
      stages[s]->emplace_back(in, out, s == 0 ? 1 : 2, gen);
      stages[s]->emplace_back(out, out, 1, gen);
      register_module(names[s], *stages[s]);
      in = out;
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
