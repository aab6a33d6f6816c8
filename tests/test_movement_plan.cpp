// tests/test_movement_plan.cpp -- the GPU's data movement plans (runtime/movement_plan.h)
// applied on the host as the fixed kernels apply them, against the reference executor (the
// kernels themselves run on the host in tests/test_cuda_on_host.cpp).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/random.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/movement_plan.h"
#include "mixtape/runtime/reference_executor.h"
#include "tests/test_util.h"

namespace mt = mixtape;

namespace {

using Bytes = std::vector<std::byte>;

Bytes bytes_of(const mt::Storage& s) {
  return Bytes(s.host_data(), s.host_data() + s.size_bytes());
}

// What mt_copy_box does, element by element (any element size).
void apply_box(const mt::CopyBox& box, const mt::Storage& src, Bytes& dst) {
  size_t width = mt::size_of(src.dtype);
  std::vector<int64_t> c(box.shape.size(), 0);
  for (int64_t e = 0; e < box.count(); ++e) {
    int64_t rest = e, s = box.src_base, d = box.dst_base;
    for (size_t k = box.shape.size(); k-- > 0;) {
      int64_t coordinate = rest % box.shape[k];
      rest /= box.shape[k];
      s += coordinate * box.src_stride[k];
      d += coordinate * box.dst_stride[k];
    }
    std::memcpy(dst.data() + d * width, src.host_data() + s * width, width);
  }
}

class Reference : public ::testing::Test {
 protected:
  void SetUp() override {
    previous_ = mt::current_device();
    mt::set_device(mt::Device::reference);
  }
  void TearDown() override { mt::set_device(previous_); }
  mt::Device previous_ = mt::Device::reference;
};

mt::Tensor random_tensor(mt::Shape shape, mt::DType dtype, uint64_t seed) {
  mt::Generator gen(seed);
  mt::Tensor x = mt::cast(mt::randn(shape, mt::f32, &gen), dtype);
  mt::eval({x});
  return x;
}

TEST_F(Reference, ConcatBoxesPlaceEveryInputAsTheReferenceDoes) {
  for (mt::DType dtype : {mt::f32, mt::f16, mt::f64}) {
    for (int64_t axis = 0; axis < 3; ++axis) {
      std::vector<mt::Tensor> inputs;
      for (int64_t k : {3, 0, 1, 5}) {
        mt::Shape shape = {4, 2, 6};
        shape[axis] = k;
        inputs.push_back(random_tensor(shape, dtype, 11 + k));
      }
      mt::Tensor out = mt::concat(inputs, axis);
      std::vector<mt::CopyBox> boxes = mt::concat_boxes(*out.node());
      ASSERT_EQ(boxes.size(), inputs.size());
      for (const mt::CopyBox& box : boxes) EXPECT_LE(box.shape.size(), 2u);  // merged
      Bytes planned(static_cast<size_t>(out.numel()) * mt::size_of(dtype), std::byte{0x5A});
      for (size_t i = 0; i < boxes.size(); ++i)
        apply_box(boxes[i], *inputs[i].node()->value, planned);
      mt::eval({out});
      EXPECT_EQ(planned, bytes_of(*out.node()->value)) << mt::name(dtype) << " axis " << axis;
    }
  }
}

TEST_F(Reference, UnsliceBoxFillsTheWindowOfZeros) {
  struct Case {
    mt::Shape window, full;
    std::vector<int64_t> starts, steps;
  };
  std::vector<Case> cases = {
      {{2, 3, 4}, {5, 7, 4}, {1, 0, 0}, {2, 3, 1}},  // strided rows, whole last dim
      {{3, 2}, {3, 9}, {0, 4}, {1, 3}},              // columns of a matrix
      {{6}, {6}, {0}, {1}},                          // the whole tensor
      {{0, 4}, {3, 4}, {1, 0}, {1, 1}},              // an empty window
      {{2, 1, 5}, {2, 3, 5}, {0, 2, 0}, {1, 1, 1}},  // q/k/v's third
  };
  for (const Case& c : cases) {
    mt::Tensor x = random_tensor(c.window, mt::bf16, 5);
    mt::Tensor out = mt::unslice(x, c.starts, c.steps, c.full);
    if (out.node() == x.node()) continue;  // a window as large as its tensor is x itself
    mt::CopyBox box = mt::unslice_box(*out.node());
    Bytes planned(static_cast<size_t>(out.numel()) * 2, std::byte{0});
    apply_box(box, *x.node()->value, planned);
    mt::eval({out});
    EXPECT_EQ(planned, bytes_of(*out.node()->value)) << mt::to_string(c.window);
  }
}

// What mt_index_add does for one element of the output: the base plus the row's sources in
// plan order, in doubles, rounded once.
TEST_F(Reference, IndexAddPlanSumsInTheReferencesOrderBitForBit) {
  struct Case {
    mt::Shape base;
    int64_t axis;
    std::vector<int64_t> index;
    mt::DType out, source;
  };
  std::vector<Case> cases = {
      {{7, 3}, 0, {4, 0, 4, 6, 4, 1, 0}, mt::f32, mt::f32},  // an embedding's gradient
      {{7, 3}, 0, {2, 2, 2, 2, 2}, mt::f16, mt::f16},        // one row, rounding in f16 once
      {{2, 5, 3}, 1, {0, 4, 4, 1}, mt::bf16, mt::f32},       // a middle axis
      {{4, 2}, 0, {}, mt::f32, mt::f32},                     // nothing added
  };
  for (const Case& c : cases) {
    mt::Tensor base = random_tensor(c.base, c.out, 3);
    mt::Shape source_shape = c.base;
    source_shape[c.axis] = static_cast<int64_t>(c.index.size());
    mt::Tensor source = mt::cast(random_tensor(source_shape, mt::f32, 4) * 1000.0, c.source);
    mt::Tensor index = mt::tensor(c.index, {static_cast<int64_t>(c.index.size())});
    mt::eval({source, index});
    mt::Tensor out = mt::index_add(base, index, source, c.axis);
    const mt::Node& node = *out.node();
    std::vector<int64_t> checked = mt::checked_indices(node);
    EXPECT_EQ(checked, c.index);
    int64_t outer = 1, dim = c.base[c.axis], inner = 1,
            count = static_cast<int64_t>(c.index.size());
    for (int64_t d = 0; d < c.axis; ++d) outer *= c.base[d];
    for (size_t d = c.axis + 1; d < c.base.size(); ++d) inner *= c.base[d];
    mt::IndexAddPlan plan = mt::index_add_plan(checked, dim);
    ASSERT_EQ(plan.offsets.size(), static_cast<size_t>(dim) + 1);
    ASSERT_EQ(plan.order.size(), c.index.size());
    mt::Storage planned(node.precision.storage_type, node.numel());
    const mt::Storage& b = *base.node()->value;
    const mt::Storage& s = *source.node()->value;
    for (int64_t e = 0; e < node.numel(); ++e) {
      int64_t i = e % inner, r = (e / inner) % dim, o = e / inner / dim;
      double acc = mt::load_element<double>(b, e);
      for (int64_t q = plan.offsets[r]; q < plan.offsets[r + 1]; ++q) {
        EXPECT_EQ(c.index[plan.order[q]], r);
        if (q > plan.offsets[r]) {
          EXPECT_LT(plan.order[q - 1], plan.order[q]);
        }
        acc += mt::load_element<double>(s, (o * count + plan.order[q]) * inner + i);
      }
      mt::store_element(planned, e, acc);
    }
    mt::eval({out});
    EXPECT_EQ(bytes_of(planned), bytes_of(*out.node()->value)) << mt::to_string(c.base);
  }
}

TEST_F(Reference, IndicesOutOfRangeAreTheReferencesError) {
  mt::Tensor table = random_tensor({5, 2}, mt::f32, 1);
  mt::Tensor index = mt::tensor(std::vector<int64_t>{1, 5, 0}, {3});
  mt::eval({index});
  mt::Tensor rows = mt::index_select(table, index);
  EXPECT_MT_ERROR(mt::checked_indices(*rows.node()),
                  "index 5 is out of range for axis 0 of size 5");
  EXPECT_MT_ERROR(mt::eval({rows}), "index 5 is out of range for axis 0 of size 5");
  mt::Tensor grad = mt::index_add(table, mt::tensor(std::vector<int64_t>{-1}, {1}),
                                  random_tensor({1, 2}, mt::f32, 2));
  mt::evaluate({grad.node()->inputs[1]});
  EXPECT_MT_ERROR(mt::checked_indices(*grad.node()), "index -1 is out of range");
}

}  // namespace
