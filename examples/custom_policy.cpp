// examples/custom_policy.cpp -- extending mixtape with a precision policy of one's own: the first
// and last layer and every softmax in f32, everything else in bf16, on a small attention model
// trained on the UCI digits. Prints the precision report's f32 rows, its per-module summary and a
// JSON line; --logdir DIR writes the run's TensorBoard event files.
#include <mixtape/mixtape.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "example_cli.h"
#include "progress_line.h"

namespace mt = mixtape;

namespace {

// Each 8x8 digit is read as 8 tokens (its rows) of 8 pixels: embed them, attend (causally, so
// token order matters), keep a residual, flatten and classify.
struct DigitsAttention : mt::Module {
  mt::Linear embed{8, 32};
  mt::CausalSelfAttention attn{32, 4};
  mt::Linear head{8 * 32, 10};
  DigitsAttention() {
    register_module("embed", embed);
    register_module("attn", attn);
    register_module("head", head);
  }
  mt::Tensor operator()(const mt::Tensor& pixels) const {
    int64_t batch = pixels.size(0);
    mt::Tensor tokens = embed(mt::reshape(pixels, {batch, 8, 8}));
    mt::Tensor h = tokens + attn(tokens);
    return head(mt::reshape(h, {batch, 8 * 32}));
  }
};

// A policy is one virtual function from what the pass knows about a node (op, category, input
// storage, module path, enclosing composite, forward or backward) to its storage, compute and
// accumulate types plus the rule that reports will show. Backward nodes arrive with the module
// path and composite of the forward node they differentiate, so gradients follow the same rules.
class FirstLastAndSoftmaxInF32 : public mt::Policy {
 public:
  FirstLastAndSoftmaxInF32() : mt::Policy("first-last-softmax-f32") {}

  mt::Precision decide(const mt::PrecisionQuery& q) const override {
    // Leaves (data, constants, random draws) and casts the user wrote keep their types.
    if (mt::op_info(q.op).kind == mt::OpKind::Leaf || (q.op == mt::OpCode::Cast && !q.backward))
      return {q.traced, q.traced, mt::f32, "custom: keeps its own type"};
    // The input embedding sees raw pixels and the head makes the logits: both stay f32.
    if (mt::module_path_matches("embed", q.module_path) ||
        mt::module_path_matches("head", q.module_path))
      return {mt::f32, mt::f32, mt::f32, "custom: first and last layer in f32"};
    // Fused attention holds its softmax inside (CausalSelfAttention runs it): it too stays f32.
    if ((q.composite && std::strcmp(q.composite, "softmax") == 0) ||
        mt::op_info(q.op).kind == mt::OpKind::Attention)
      return {mt::f32, mt::f32, mt::f32, "custom: softmax in f32"};
    return {mt::bf16, mt::bf16, mt::f32, "custom: bf16, accumulating in f32"};
  }
};

mt::TensorDataset split(const mt::Digits& digits, int64_t begin, int64_t end) {
  std::vector<float> pixels(digits.pixels.begin() + begin * 64, digits.pixels.begin() + end * 64);
  for (float& p : pixels) p /= 16.0f;
  std::vector<int64_t> labels(digits.labels.begin() + begin, digits.labels.begin() + end);
  return mt::TensorDataset(std::move(pixels), {64}, std::move(labels));
}

// The storage type the report gives to the forward nodes of `op` in `module` ("mixed" if they
// differ).
std::string storage_of(const mt::PrecisionReport& report, const std::string& module,
                       const std::string& op) {
  std::set<std::string> types;
  for (const mt::PrecisionRow& row : report.rows)
    if (!row.backward && row.module_path == module && row.op == op)
      types.insert(std::string(mt::name(row.storage)));
  if (types.empty()) return "none";
  return types.size() == 1 ? *types.begin() : "mixed";
}

int run(int64_t steps, const std::string& logdir) {
  mt::manual_seed(0);
  mt::Digits digits = mt::load_digits(mt::default_data_dir() + "/digits.csv.gz");
  mt::TensorDataset train = split(digits, 0, 1437), test = split(digits, 1437, digits.count());
  DigitsAttention net;
  mt::AdamW optimizer(net.parameters(), {.lr = 3e-3, .weight_decay = 0.01});
  mt::DataLoader loader(train, 64, true, 0);
  auto policy = std::make_shared<FirstLastAndSoftmaxInF32>();

  double first_loss = 0, final_loss = 0;
  mt::PrecisionReport report;
  std::unique_ptr<mt::SummaryWriter> writer = examples::open_logdir(logdir);
  for (int64_t step = 1; step <= steps; ++step) {
    if (writer) writer->set_step(step);
    mt::Batch batch = loader.next();
    optimizer.zero_grad();
    mt::Tensor logits;
    {
      mt::autocast guard(policy);
      logits = net(batch.inputs);
    }
    // The loss is outside the guard: no policy there, so it is computed as traced (f32).
    mt::Tensor loss = mt::cross_entropy(logits, batch.targets);
    loss.backward();
    if (step == 1) {
      // Ask before the step evaluates the graph: the report decides without running anything.
      std::vector<mt::Tensor> outputs{loss};
      for (const mt::Tensor& p : net.parameters()) outputs.push_back(p.grad());
      report = mt::precision_report(outputs);
    }
    optimizer.step();
    if (writer) {
      writer->add_scalar("loss", loss);
      writer->log_grad_norm(net.parameters());
      writer->log_learning_rate(optimizer);
      writer->log_gradient_health(net, 10);
    }
    final_loss = loss.item();
    if (step == 1) first_loss = final_loss;
    if (step % 20 == 0 || step == steps)
      std::printf("step %lld loss %.4f\n", static_cast<long long>(step), final_loss);
  }

  // The excerpt: the forward nodes that the policy put in f32; then the tally of every node.
  mt::PrecisionReport excerpt;
  for (const mt::PrecisionRow& row : report.rows) {
    bool f32_rule = row.rule.starts_with("custom: first") || row.rule.starts_with("custom: soft");
    if (!row.backward && f32_rule) excerpt.rows.push_back(row);
  }
  std::printf("\nprecision report, forward nodes the policy keeps in f32:\n%s",
              excerpt.table().c_str());
  std::printf("\nper module and (storage, compute) pair:\n%s", report.summary().c_str());

  net.eval();
  mt::NoGradGuard no_grad;
  std::vector<int64_t> all(static_cast<size_t>(test.size()));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  mt::Batch test_batch = test.get_batch(all);
  mt::Tensor predicted;
  {
    mt::autocast guard(policy);
    predicted = mt::argmax(net(test_batch.inputs), -1);
  }
  std::vector<int64_t> guesses = predicted.to_vector<int64_t>();
  std::vector<int64_t> labels = test_batch.targets.to_vector<int64_t>();
  int64_t correct = 0;
  for (size_t i = 0; i < labels.size(); ++i) correct += guesses[i] == labels[i];
  double accuracy = static_cast<double>(correct) / static_cast<double>(labels.size());
  std::printf("test accuracy %.2f%% (%lld/%zu)\n", accuracy * 100, static_cast<long long>(correct),
              labels.size());

  nlohmann::ordered_json storage{{"embed", storage_of(report, "embed", "matmul")},
                                 {"attn", storage_of(report, "attn.qkv", "matmul")},
                                 {"softmax", storage_of(report, "attn", "attention_forward")},
                                 {"head", storage_of(report, "head", "matmul")}};
  nlohmann::ordered_json line{{"example", "custom_policy"},
                              {"policy", policy->name()},
                              {"steps", steps},
                              {"first_loss", first_loss},
                              {"final_loss", final_loss},
                              {"loss_decreased", final_loss < first_loss},
                              {"test_accuracy", accuracy},
                              {"storage", std::move(storage)},
                              {"peak_bytes", mt::execution_stats().memory_peak_bytes}};
  std::printf("%s\n", line.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 200;
  std::string logdir;
  CLI::App app(
      "A precision policy of one's own (first and last layer and softmax in f32, the "
      "rest in bf16) on a small attention model of the UCI digits.",
      "custom_policy");
  examples::add_steps(app, steps);
  examples::add_logdir(app, logdir);
  examples::parse(app, argc, argv);
  try {
    return run(steps, logdir);
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "custom_policy: error: %s\n", e.what());
    return 1;
  }
}
