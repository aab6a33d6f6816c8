// examples/digits_model.h -- DigitsMLP, the digits demo's model (shared by examples/digits_mlp.cpp
// and tests/test_nvrtc.cpp).
#pragma once

#include <mixtape/mixtape.h>

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
