// mixtape/dsl/node_inputs.h -- NodeInputs, a node's input list: up to three held in the node
// itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

namespace mixtape {

struct Node;
using NodePtr = std::shared_ptr<Node>;

/// Drops `input`. Where that was the last hold on its node, the node's own inputs are dropped in
/// a loop, not by the recursion of their destructors (dsl/graph.cpp): a chain of 100k nodes (a
/// long unrolled loop, a running sum kept across steps, the backward pass of either) overflowed
/// the stack.
void release_input(NodePtr& input) noexcept;

/// The inputs of a node, in order. Every op but the variadic ones (concat, custom ops) has at
/// most three, and those live inside the node: the traced loop makes a few hundred nodes every
/// step, and a heap block per input list was one of each node's allocations. The interface is
/// the part of std::vector's that graph code uses.
class NodeInputs {
 public:
  static constexpr uint32_t kInline = 3;

  NodeInputs() = default;
  NodeInputs(std::initializer_list<NodePtr> inputs) {
    reserve(inputs.size());
    for (const NodePtr& input : inputs) push_back(input);
  }
  // Implicit, as the std::vector<NodePtr> it stands for was: builders hand their lists over.
  NodeInputs(std::vector<NodePtr>&& inputs) {  // NOLINT(google-explicit-constructor)
    reserve(inputs.size());
    for (NodePtr& input : inputs) push_back(std::move(input));
  }
  NodeInputs(const std::vector<NodePtr>& inputs) {  // NOLINT(google-explicit-constructor)
    reserve(inputs.size());
    for (const NodePtr& input : inputs) push_back(input);
  }
  NodeInputs(const NodeInputs& other) {
    reserve(other.size_);
    for (const NodePtr& input : other) push_back(input);
  }
  NodeInputs(NodeInputs&& other) noexcept { take(other); }
  NodeInputs& operator=(const NodeInputs& other) {
    if (this != &other) {
      NodeInputs copy(other);
      clear_and_free();
      take(copy);
    }
    return *this;
  }
  NodeInputs& operator=(NodeInputs&& other) noexcept {
    if (this != &other) {
      clear_and_free();
      take(other);
    }
    return *this;
  }
  ~NodeInputs() { clear_and_free(); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  NodePtr* begin() { return data_; }
  NodePtr* end() { return data_ + size_; }
  const NodePtr* begin() const { return data_; }
  const NodePtr* end() const { return data_ + size_; }
  NodePtr& operator[](size_t i) { return data_[i]; }
  const NodePtr& operator[](size_t i) const { return data_[i]; }
  const NodePtr& at(size_t i) const {
    if (i >= size_) throw std::out_of_range("NodeInputs::at");
    return data_[i];
  }
  const NodePtr& front() const { return data_[0]; }
  const NodePtr& back() const { return data_[size_ - 1]; }

  void reserve(size_t capacity) {
    if (capacity <= capacity_) return;
    NodePtr* grown = std::allocator<NodePtr>().allocate(capacity);
    for (uint32_t i = 0; i < size_; ++i) {
      new (grown + i) NodePtr(std::move(data_[i]));
      data_[i].~NodePtr();
    }
    release_heap();
    data_ = grown;
    capacity_ = static_cast<uint32_t>(capacity);
  }
  template <typename... Args>
  NodePtr& emplace_back(Args&&... args) {
    if (size_ == capacity_) reserve(size_t{capacity_} * 2);
    return *new (data_ + size_++) NodePtr(std::forward<Args>(args)...);
  }
  void push_back(const NodePtr& input) { emplace_back(input); }
  void push_back(NodePtr&& input) { emplace_back(std::move(input)); }
  /// Drops every input (a node whose producers are no longer needed keeps its capacity).
  void clear() {
    for (uint32_t i = 0; i < size_; ++i) {
      release_input(data_[i]);
      data_[i].~NodePtr();
    }
    size_ = 0;
  }

  /// The inputs as a vector, for code that keeps or passes one.
  std::vector<NodePtr> to_vector() const { return {begin(), end()}; }

 private:
  bool on_heap() const { return data_ != inline_data(); }
  NodePtr* inline_data() { return std::launder(reinterpret_cast<NodePtr*>(inline_)); }
  const NodePtr* inline_data() const {
    return std::launder(reinterpret_cast<const NodePtr*>(inline_));
  }
  void release_heap() {
    if (on_heap()) std::allocator<NodePtr>().deallocate(data_, capacity_);
  }
  void clear_and_free() {
    clear();
    release_heap();
    data_ = inline_data();
    capacity_ = kInline;
  }
  // Takes other's inputs, leaving it empty; this one is empty and inline.
  void take(NodeInputs& other) noexcept {
    if (other.on_heap()) {
      data_ = other.data_;
      capacity_ = other.capacity_;
      size_ = other.size_;
      other.data_ = other.inline_data();
      other.capacity_ = kInline;
      other.size_ = 0;
      return;
    }
    for (uint32_t i = 0; i < other.size_; ++i) {
      new (data_ + i) NodePtr(std::move(other.data_[i]));
      other.data_[i].~NodePtr();
    }
    size_ = other.size_;
    other.size_ = 0;
  }

  alignas(NodePtr) std::byte inline_[kInline * sizeof(NodePtr)];
  NodePtr* data_ = inline_data();
  uint32_t size_ = 0;
  uint32_t capacity_ = kInline;
};

}  // namespace mixtape
