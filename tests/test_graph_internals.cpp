// tests/test_graph_internals.cpp -- the traced path's containers: a node's inline inputs, ordering
// by id, the per-thread node pool, which pending values a signature stores, and how few nodes
// number operands and optimizer steps make.
#include <gtest/gtest.h>
#include <mixtape/mixtape.h>

#include <algorithm>
#include <bit>
#include <map>
#include <numeric>
#include <random>
#include <thread>

#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/node_inputs.h"
#include "mixtape/dsl/pool_allocator.h"
#include "mixtape/dsl/sort_by_id.h"
#include "mixtape/runtime/program.h"

namespace mt = mixtape;

namespace {

std::vector<mt::NodePtr> leaves(int count) {
  std::vector<mt::NodePtr> nodes;
  for (int i = 0; i < count; ++i) nodes.push_back(mt::scalar(i).node());
  return nodes;
}

TEST(NodeInputs, HoldsInOrderAndSpillsPastThree) {
  std::vector<mt::NodePtr> nodes = leaves(6);
  for (size_t n = 0; n <= nodes.size(); ++n) {
    mt::NodeInputs inputs;
    for (size_t i = 0; i < n; ++i) inputs.push_back(nodes[i]);
    ASSERT_EQ(inputs.size(), n);
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(inputs[i], nodes[i]) << n << " inputs, #" << i;
    // Copies and moves keep the order and the references.
    mt::NodeInputs copy = inputs;
    mt::NodeInputs moved = std::move(copy);
    EXPECT_TRUE(copy.empty());  // NOLINT(bugprone-use-after-move): a moved-from list is empty
    EXPECT_EQ(moved.to_vector(), std::vector<mt::NodePtr>(nodes.begin(), nodes.begin() + n));
    mt::NodeInputs assigned{nodes[5]};
    assigned = moved;
    EXPECT_EQ(assigned.to_vector(), moved.to_vector());
  }
  long before = nodes[0].use_count();
  {
    mt::NodeInputs many(std::vector<mt::NodePtr>(5, nodes[0]));
    EXPECT_EQ(nodes[0].use_count(), before + 5);
    many.clear();
    EXPECT_EQ(nodes[0].use_count(), before);
    many.push_back(nodes[0]);
    EXPECT_EQ(nodes[0].use_count(), before + 1);
  }
  EXPECT_EQ(nodes[0].use_count(), before);
}

TEST(NodeInputs, VariadicOpsEvaluate) {
  // concat of five inputs: more than a node holds in itself.
  std::vector<mt::Tensor> parts;
  for (int i = 0; i < 5; ++i) parts.push_back(mt::full({2}, i));
  mt::Tensor joined = mt::concat(parts, 0);
  EXPECT_EQ(joined.node()->inputs.size(), 5u);
  EXPECT_EQ(joined.to_vector<float>(), (std::vector<float>{0, 0, 1, 1, 2, 2, 3, 3, 4, 4}));
}

TEST(SortById, DenseSparseAndRepeatedIds) {
  std::mt19937_64 rng(7);
  auto check = [&](std::vector<uint64_t> ids) {
    std::vector<std::pair<uint64_t, int>> items;
    for (size_t i = 0; i < ids.size(); ++i) items.emplace_back(ids[i], static_cast<int>(i));
    std::shuffle(items.begin(), items.end(), rng);
    std::vector<std::pair<uint64_t, int>> expected = items;
    std::stable_sort(expected.begin(), expected.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    mt::sort_by_id(items);
    ASSERT_EQ(items.size(), expected.size());
    for (size_t i = 0; i < items.size(); ++i) {
      EXPECT_EQ(items[i].first, expected[i].first) << "position " << i;
      // Unique ids carry their own item along.
      auto same_id = [&](const auto& e) { return e.first == expected[i].first; };
      if (std::count_if(expected.begin(), expected.end(), same_id) == 1) {
        EXPECT_EQ(items[i].second, expected[i].second) << "position " << i;
      }
    }
  };
  std::vector<uint64_t> dense(300);
  std::iota(dense.begin(), dense.end(), uint64_t{1} << 40);
  for (size_t i = 0; i < dense.size(); i += 3) dense[i] += 700;  // gaps, still within 4x
  check(dense);
  std::vector<uint64_t> sparse;
  for (uint64_t i = 0; i < 100; ++i) sparse.push_back(i * 1000);
  check(sparse);
  std::vector<uint64_t> repeated(100, 5);
  std::iota(repeated.begin(), repeated.begin() + 60, 10);
  check(repeated);
  check({3, 1, 2});
  check({});
}

struct Counted {
  static inline std::atomic<int> alive{0};
  int64_t payload[6] = {};
  Counted() { ++alive; }
  ~Counted() { --alive; }
};

TEST(PoolAllocator, ObjectsFreedOnAnotherThreadAndAtThreadExit) {
  std::vector<std::shared_ptr<Counted>> made;
  std::thread maker([&] {
    for (int i = 0; i < 1000; ++i)
      made.push_back(std::allocate_shared<Counted>(mt::PoolAllocator<Counted>()));
    // Blocks this thread frees stay in its list until it ends.
    for (int i = 0; i < 100; ++i) made.pop_back();
  });
  maker.join();
  EXPECT_EQ(Counted::alive.load(), 900);
  for (int round = 0; round < 3; ++round) {
    made.clear();  // freed here, then reused by this thread's allocations
    EXPECT_EQ(Counted::alive.load(), 0);
    for (int i = 0; i < 900; ++i) {
      made.push_back(std::allocate_shared<Counted>(mt::PoolAllocator<Counted>()));
      made.back()->payload[5] = i;
    }
    for (int i = 0; i < 900; ++i) ASSERT_EQ(made[i]->payload[5], i);
  }
  made.clear();
  EXPECT_EQ(Counted::alive.load(), 0);
}

TEST(Signature, StoresPendingValuesSomeoneStillHolds) {
  mt::Tensor a = mt::tensor(std::vector<float>{1, 2, 3}, {3});
  mt::Tensor held = a * 2.0f;  // read by `out` and held here: its value is kept
  mt::Tensor out = (held + 1.0f).sum();
  EXPECT_EQ(out.item(), 15.0);
  EXPECT_TRUE(held.node()->evaluated());
  EXPECT_EQ(held.to_vector<float>(), (std::vector<float>{2, 4, 6}));
}

// Counts the nodes made on this thread while it is installed, by op.
class NodeCounter : public mt::TraceObserver {
 public:
  NodeCounter() : previous_(mt::exchange_trace_observer(this)) {}
  ~NodeCounter() override { mt::exchange_trace_observer(previous_); }
  void node_made(const mt::NodePtr& node) override { ++made[node->op]; }
  void side_effect(const char*) override {}
  void each_call(std::shared_ptr<mt::StepHook>, std::vector<mt::NodePtr>) override {}
  void gradient_changing(const std::shared_ptr<mt::TensorImpl>&, bool) override {}
  void assigning(const std::shared_ptr<mt::TensorImpl>&, const mt::NodePtr&) override {}
  void keeping(const std::shared_ptr<const void>&, const std::string&,
               const mt::NodePtr&) override {}
  int count(mt::OpCode op) const {
    auto found = made.find(op);
    return found == made.end() ? 0 : found->second;
  }
  std::map<mt::OpCode, int> made;

 private:
  mt::TraceObserver* previous_;
};

TEST(TracedGraph, ANumberOperandIsOneFillOfTheOtherOperandsShape) {
  mt::Tensor x = mt::tensor(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  mt::Tensor y;
  {
    NodeCounter counter;
    y = 1.5 - x * 0.5;
    EXPECT_EQ(counter.count(mt::OpCode::Full), 2);
    EXPECT_EQ(counter.count(mt::OpCode::BroadcastTo), 0);  // it was a 0-d fill and a broadcast
  }
  std::vector<mt::Node*> pending = mt::pending_nodes({y.node()});
  EXPECT_EQ(pending.size(), 4u);
  for (mt::Node* node : pending)
    if (node->op == mt::OpCode::Full) {
      EXPECT_EQ(node->shape, (mt::Shape{2, 3}));
    }
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{1, 0.5, 0, -0.5, -1, -1.5}));
}

// An Adam step over parameters of one shape: each constant is made once for them all, each
// bias correction cast once, and every parameter ends bit-identical to an Adam of its own.
TEST(TracedGraph, OptimizerStepsShareConstantsAcrossParametersOfOneShape) {
  constexpr int kParams = 4;
  auto make = [](int i) {
    std::vector<float> values(6);
    for (int k = 0; k < 6; ++k) values[k] = 0.25f * static_cast<float>(i + 1) - 0.1f * k;
    return mt::tensor(values, {2, 3}).requires_grad_();
  };
  auto set_grads = [](std::vector<mt::Tensor>& params, int step) {
    for (size_t i = 0; i < params.size(); ++i) {
      mt::Tensor p = params[i];
      p.set_grad((p * p) * (0.5 + 0.125 * static_cast<double>(i + step)));
    }
  };
  std::vector<mt::Tensor> together, alone;
  for (int i = 0; i < kParams; ++i) {
    together.push_back(make(i));
    alone.push_back(make(i));
  }
  mt::AdamW shared(together, {.lr = 0.01, .weight_decay = 0.1});
  std::vector<std::unique_ptr<mt::AdamW>> own;
  for (const mt::Tensor& p : alone)
    own.push_back(std::make_unique<mt::AdamW>(std::vector<mt::Tensor>{p},
                                              mt::AdamOptions{.lr = 0.01, .weight_decay = 0.1}));
  for (int step = 0; step < 3; ++step) {
    set_grads(together, step);
    {
      std::vector<mt::Tensor> grads;  // evaluated first: the count is the step's alone
      for (const mt::Tensor& p : together) grads.push_back(p.grad());
      mt::eval(grads);
      NodeCounter counter;
      shared.step();
      // Eight 0-d fills for the step's scalars (the count's increment, the bias corrections,
      // the decay) and five of the parameters' shape (eps, the betas and their complements),
      // made once for all four parameters; the three scalars are cast once, not per parameter.
      EXPECT_LE(counter.count(mt::OpCode::Full), 8 + 5) << "step " << step;
      EXPECT_EQ(counter.count(mt::OpCode::Cast), 3) << "step " << step;
    }
    for (int i = 0; i < kParams; ++i) {
      std::vector<mt::Tensor> one = {alone[i]};
      set_grads(one, step + i);  // the same gradient as parameter i above
      own[i]->step();
    }
  }
  for (int i = 0; i < kParams; ++i) {
    std::vector<float> a = together[i].to_vector<float>(), b = alone[i].to_vector<float>();
    for (size_t k = 0; k < a.size(); ++k)
      EXPECT_EQ(std::bit_cast<uint32_t>(a[k]), std::bit_cast<uint32_t>(b[k]))
          << "parameter " << i << " element " << k;
  }
}

// Parameters of different shapes share them too: the fused update ops read their 0-d factors at
// every element, so an AdamW step makes three nodes per parameter (its two running averages and
// its update) and broadcasts nothing, and the compiled update stores what the reference does.
TEST(TracedGraph, AnAdamStepIsThreeNodesPerParameterWhateverItsShape) {
  const std::vector<mt::Shape> shapes = {{3}, {2, 5}, {4, 1, 2}, {7}};
  std::vector<float> after[2];
  mt::Device devices[2] = {mt::Device::reference, mt::Device::cpu};
  for (int d = 0; d < 2; ++d) {
    mt::set_device(devices[d]);
    mt::Generator gen(31);
    std::vector<mt::Tensor> params;
    for (const mt::Shape& shape : shapes)
      params.push_back(mt::randn(shape, mt::f32, &gen).requires_grad_());
    mt::AdamW opt(params, {.lr = 0.01, .weight_decay = 0.1});
    for (int step = 0; step < 3; ++step) {
      std::vector<mt::Tensor> grads;
      for (mt::Tensor& p : params) {
        p.set_grad(mt::randn(p.shape(), mt::f32, &gen));
        grads.push_back(p.grad());
      }
      mt::eval(grads);
      NodeCounter counter;
      opt.step();
      EXPECT_EQ(counter.count(mt::OpCode::BroadcastTo), 0) << "step " << step;
      for (mt::OpCode op : {mt::OpCode::Lincomb, mt::OpCode::LincombSquare, mt::OpCode::AdamStep})
        EXPECT_EQ(counter.count(op), 4) << mt::op_name(op) << ", step " << step;
      // The step's scalars, shared by the four shapes as by the test above's one.
      EXPECT_LE(counter.count(mt::OpCode::Full), 8 + 5) << "step " << step;
      EXPECT_EQ(counter.count(mt::OpCode::Cast), 3) << "step " << step;
    }
    for (const mt::Tensor& p : params)
      for (float v : p.to_vector<float>()) after[d].push_back(v);
  }
  mt::set_device(mt::Device::reference);
  ASSERT_EQ(after[0].size(), after[1].size());
  for (size_t i = 0; i < after[0].size(); ++i)
    EXPECT_EQ(std::bit_cast<uint32_t>(after[0][i]), std::bit_cast<uint32_t>(after[1][i])) << i;
}

}  // namespace
