// examples/digits_cnn.cpp -- a small ResNet trained on the UCI handwritten digits: the vision
// counterpart of the digits_mlp demo, with the same split, flags and JSON line.
#include "digits_train.h"
#include "resnet_model.h"

namespace {

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

}  // namespace

int main(int argc, char** argv) {
  // >= 97% test accuracy in fp32, autocast-bf16 and autocast-f16 with dynamic scaling.
  return digits::main_of<DigitsCnn>(
      "digits_cnn", {.steps = 2500, .shift = 1, .sgd_lr = 0.1, .cosine = true}, argc, argv);
}
