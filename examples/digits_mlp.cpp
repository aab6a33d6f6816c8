// examples/digits_mlp.cpp -- the demo: an MLP trained on the UCI handwritten digits.
#include "digits_model.h"
#include "digits_train.h"

int main(int argc, char** argv) {
  // The defaults reach >= 95% on the last 360 digits in 3000 steps.
  return digits::main_of<DigitsMLP>("digits_mlp", {.steps = 3000}, argc, argv);
}
