// mixtape/runtime/movement_plan.cpp -- copy boxes for concat and unslice, row lists for index_add.
#include "mixtape/runtime/movement_plan.h"

#include "mixtape/dsl/shape.h"

namespace mixtape {

int64_t CopyBox::count() const {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

CopyBox merged(const CopyBox& box) {
  CopyBox out;
  out.src_base = box.src_base;
  out.dst_base = box.dst_base;
  if (box.count() == 0) {
    out.shape = {0};
    out.src_stride = out.dst_stride = {1};
    return out;
  }
  for (size_t d = 0; d < box.shape.size(); ++d) {
    if (box.shape[d] == 1) continue;
    bool joins = !out.shape.empty() && out.src_stride.back() == box.src_stride[d] * box.shape[d] &&
                 out.dst_stride.back() == box.dst_stride[d] * box.shape[d];
    if (joins) {
      out.shape.back() *= box.shape[d];
      out.src_stride.back() = box.src_stride[d];
      out.dst_stride.back() = box.dst_stride[d];
    } else {
      out.shape.push_back(box.shape[d]);
      out.src_stride.push_back(box.src_stride[d]);
      out.dst_stride.push_back(box.dst_stride[d]);
    }
  }
  if (out.shape.empty()) {  // one element
    out.shape = {1};
    out.src_stride = out.dst_stride = {1};
  }
  return out;
}

std::vector<CopyBox> concat_boxes(const Node& node) {
  std::vector<int64_t> out_strides = strides_of(node.shape);
  int64_t axis = node.attrs.axis, at = 0;
  std::vector<CopyBox> boxes;
  for (const NodePtr& input : node.inputs) {
    CopyBox box;
    box.shape = input->shape;
    box.src_stride = strides_of(input->shape);
    box.dst_stride = out_strides;
    box.dst_base = at * out_strides[axis];
    at += input->shape[axis];
    boxes.push_back(merged(box));
  }
  return boxes;
}

CopyBox unslice_box(const Node& node) {
  const Shape& window = node.inputs[0]->shape;
  std::vector<int64_t> out_strides = strides_of(node.shape);
  CopyBox box;
  box.shape = window;
  box.src_stride = strides_of(window);
  for (size_t d = 0; d < window.size(); ++d) {
    box.dst_stride.push_back(out_strides[d] * node.attrs.steps[d]);
    box.dst_base += node.attrs.starts[d] * out_strides[d];
  }
  return merged(box);
}

IndexAddPlan index_add_plan(const std::vector<int64_t>& index, int64_t dim) {
  IndexAddPlan plan;
  plan.offsets.assign(static_cast<size_t>(dim) + 1, 0);
  for (int64_t row : index) ++plan.offsets[static_cast<size_t>(row) + 1];
  for (size_t r = 0; r < static_cast<size_t>(dim); ++r) plan.offsets[r + 1] += plan.offsets[r];
  std::vector<int64_t> next(plan.offsets.begin(), plan.offsets.end() - 1);
  plan.order.resize(index.size());
  for (size_t j = 0; j < index.size(); ++j)
    plan.order[static_cast<size_t>(next[static_cast<size_t>(index[j])]++)] =
        static_cast<int64_t>(j);
  return plan;
}

}  // namespace mixtape
