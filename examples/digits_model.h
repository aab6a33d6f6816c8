// examples/digits_model.h -- the digits examples' models: DigitsMLP (examples/digits_mlp.cpp,
// tests/test_nvrtc.cpp) and DigitsCnn (examples/digits_cnn.cpp, the bench).
#pragma once

#include <mixtape/mixtape.h>

#include "resnet_model.h"

/// 8x8 pixels -> 128 -> 128 -> 10 digit logits, ReLU between the layers.
struct DigitsMLP : mixtape::Module {
  mixtape::Linear fc1{64, 128}, fc2{128, 128}, fc3{128, 10};
  DigitsMLP() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    register_module("fc3", fc3);
  }
  mixtape::Tensor operator()(const mixtape::Tensor& x) const {
    return fc3(mixtape::relu(fc2(mixtape::relu(fc1(x)))));
  }
};

/// 8x8 pixels as a 1-channel image: a conv-BN-ReLU stem (16 channels), a BasicBlock at 8x8, a
/// strided one to 32 channels at 4x4, global average pooling and a linear layer to 10 logits.
struct DigitsCnn : mixtape::Module {
  mixtape::Conv2d conv1{1, 16, 3, {.padding = 1}, false};
  mixtape::BatchNorm2d bn1{16};
  BasicBlock layer1{16, 16, 1}, layer2{16, 32, 2};
  mixtape::Linear fc{32, 10};
  DigitsCnn() {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("layer1", layer1);
    register_module("layer2", layer2);
    register_module("fc", fc);
  }
  mixtape::Tensor operator()(const mixtape::Tensor& pixels) const {
    mixtape::Tensor x = mixtape::reshape(pixels, {-1, 1, 8, 8});
    x = layer2(layer1(mixtape::relu(bn1(conv1(x)))));
    return fc(mixtape::mean(x, {2, 3}));
  }
};
