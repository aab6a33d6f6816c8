// examples/digits_cnn.cpp -- a small ResNet trained on the UCI handwritten digits: the vision
// counterpart of the digits_mlp demo, with the same split, flags and JSON line.
#include "digits_model.h"
#include "digits_train.h"

int main(int argc, char** argv) {
  // >= 97% test accuracy in fp32, autocast-bf16 and autocast-f16 with dynamic scaling.
  return digits::main_of<DigitsCnn>(
      "digits_cnn", {.steps = 3000, .shift = 1, .sgd_lr = 0.1, .cosine = true}, argc, argv);
}
