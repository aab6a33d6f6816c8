// tests/consumer/main.cpp -- trains a tiny model through the installed public header only.
#include <mixtape/mixtape.h>

#include <cstdio>

namespace mt = mixtape;

int main() {
  mt::manual_seed(0);
  mt::Linear layer(3, 1);
  mt::Adam opt(layer.parameters(), {.lr = 0.05});
  mt::Tensor x = mt::tensor(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  mt::Tensor y = mt::tensor(std::vector<float>{1, -1}, {2, 1});
  double first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    opt.zero_grad();
    mt::Tensor loss = mt::mse_loss(layer(x), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item();
  }
  if (!(last < first * 0.1)) {
    std::printf("loss did not fall: %g -> %g\n", first, last);
    return 1;
  }
  std::printf("consumer ok: loss %g -> %g\n", first, last);
  return 0;
}
