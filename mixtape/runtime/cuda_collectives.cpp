// mixtape/runtime/cuda_collectives.cpp -- all_reduce.h's collective steps with device buffers:
// NCCL's grouped sends and receives for the byte transfers, a fixed kernel for the sums.
#include "mixtape/runtime/cuda_collectives.h"

#include <vector>

#include "mixtape/dsl/process_group.h"
#include "mixtape/runtime/all_reduce.h"
#include "mixtape/runtime/cuda_fixed_kernels.h"
#include "mixtape/runtime/cuda_values.h"
#include "mixtape/runtime/nccl.h"

namespace mixtape {
namespace {

// Device memory moved by NCCL; the input already in the node's storage dtype.
class DeviceTransport : public CollectiveTransport {
 public:
  explicit DeviceTransport(std::shared_ptr<Storage> input) : input_(std::move(input)) {}
  int rank() const override { return process_rank(); }
  int size() const override { return nccl::communicator_size(); }
  std::shared_ptr<Storage> input(const Node&, DType) override { return input_; }
  std::shared_ptr<Storage> allocate(const Node&, DType dtype, int64_t count) override {
    return device_value(dtype, count);
  }
  void all_to_all(Storage& send, std::span<const int64_t> send_count,
                  std::span<const int64_t> send_at, Storage& recv,
                  std::span<const int64_t> recv_count, std::span<const int64_t> recv_at) override {
    const cuda::CUdeviceptr from = device_address(send), to = device_address(recv);
    std::vector<nccl::Transfer> sends, receives;
    for (int q = 0; q < size(); ++q) {
      sends.push_back({from + static_cast<uint64_t>(send_at[q]), send_count[q], q});
      receives.push_back({to + static_cast<uint64_t>(recv_at[q]), recv_count[q], q});
    }
    nccl::exchange(sends, receives);
  }
  void all_gather(Storage& send, int64_t bytes, Storage& recv, std::span<const int64_t> counts,
                  std::span<const int64_t> at) override {
    const cuda::CUdeviceptr from = device_address(send), to = device_address(recv);
    std::vector<nccl::Transfer> sends, receives;
    for (int q = 0; q < size(); ++q) {
      sends.push_back({from, bytes, q});
      receives.push_back({to + static_cast<uint64_t>(at[q]), counts[q], q});
    }
    nccl::exchange(sends, receives);
  }
  void sum_in_rank_order(Storage& pieces, int processes, int64_t width, DType accum,
                         Storage& out) override {
    if (width > 0) add_pieces_on_device(pieces, processes, width, accum, out);
  }

 private:
  std::shared_ptr<Storage> input_;
};

}  // namespace

bool run_collective_on_device(Node& node) {
  if (op_info(node.op).kind != OpKind::Collective) return false;
  const int processes = nccl::communicator_size();
  if (processes < 2 || processes != process_count()) return false;
  std::shared_ptr<Storage> input = input_on_device(node, 0);
  if (!input) return false;
  DeviceTransport transport(std::move(input));
  node.value = collective_value(node, transport);
  return true;
}

}  // namespace mixtape
