// tests/gpu/test_gpu_nccl.cpp -- NCCL on a device: a one-process communicator's grouped sends and
// receives (the transfers of runtime/cuda_collectives.cpp), and the rank-order sum kernel
// against the host path's bits. Two processes need two GPUs: tests/mpi runs those where present.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "mixtape/dsl/convert.h"
#include "mixtape/runtime/all_reduce.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/cuda_driver.h"
#include "mixtape/runtime/cuda_fixed_kernels.h"
#include "mixtape/runtime/cuda_values.h"
#include "mixtape/runtime/nccl.h"

namespace mt = mixtape;
namespace cu = mixtape::cuda;

namespace {

std::vector<unsigned char> downloaded(mt::Storage& value) {
  std::vector<unsigned char> bytes(static_cast<size_t>(value.size_bytes()));
  cu::download(bytes.data(), mt::device_address(value), value.size_bytes());
  return bytes;
}

std::vector<unsigned char> host_bytes(const mt::Storage& value) {
  const auto* data = reinterpret_cast<const unsigned char*>(value.host_data());
  return {data, data + value.size_bytes()};
}

// One communicator for the process: NCCL allows one per device and process here.
bool joined() {
  static const bool ok = [] {
    if (!mt::nccl::unavailable_reason().empty()) return false;
    mt::nccl::init_communicator(1, 0, mt::nccl::unique_id());
    return true;
  }();
  return ok;
}

TEST(GpuNccl, AGroupOfSendsAndReceivesMovesTheBytes) {
  if (!joined()) GTEST_SKIP() << "NCCL unavailable: " << mt::nccl::unavailable_reason();
  EXPECT_EQ(mt::nccl::communicator_size(), 1);
  std::printf("NCCL %d on %s\n", mt::nccl::version(), cu::device_name().c_str());
  // 3 MB of bytes, sent to this process in three pieces at odd offsets, received in another
  // order: what all_to_all and all_gather do with one peer per piece.
  mt::Storage from(mt::f32, 750001), to(mt::f32, 750001);
  std::mt19937 gen(3);
  for (int64_t i = 0; i < from.count; ++i) from.as<float>()[i] = static_cast<float>(gen());
  const uint64_t a = mt::device_address(from), b = mt::device_address(to);
  const int64_t total = from.size_bytes(), cut1 = 1001, cut2 = total - 7;
  std::vector<mt::nccl::Transfer> sends = {
      {a, cut1, 0}, {a + cut1, cut2 - cut1, 0}, {a + cut2, total - cut2, 0}};
  std::vector<mt::nccl::Transfer> receives = {
      {b, cut1, 0}, {b + cut1, cut2 - cut1, 0}, {b + cut2, total - cut2, 0}};
  mt::nccl::exchange(sends, receives);
  EXPECT_EQ(downloaded(to), host_bytes(from));
}

// mt_rank_order_sum on the GPU: the bits of the host's rank-order sum, every dtype.
TEST(GpuNccl, TheRankOrderSumHasTheHostsBits) {
  if (!cu::available()) GTEST_SKIP() << "CUDA unavailable: " << cu::unavailable_reason();
  constexpr int processes = 4;
  constexpr int64_t width = 100003;
  std::mt19937 gen(5);
  std::normal_distribution<double> normal(0, 3);
  for (auto [dtype, accum] : {std::pair{mt::f32, mt::f32},
                              {mt::bf16, mt::f32},
                              {mt::f16, mt::f32},
                              {mt::f64, mt::f64},
                              {mt::i64, mt::i64}}) {
    mt::Storage pieces(dtype, processes * width);
    for (int64_t i = 0; i < pieces.count; ++i) {
      const double v = normal(gen) * (i % 7 == 0 ? 1e5 : 1);
      if (mt::is_floating(dtype))
        mt::store_element(pieces, i, v);
      else
        mt::store_element(pieces, i, static_cast<int64_t>(v));
    }
    mt::Storage want(dtype, width);
    mt::add_pieces_on_host(pieces, processes, width, accum, want);
    auto got = mt::device_value(dtype, width);
    mt::add_pieces_on_device(pieces, processes, width, accum, *got);
    EXPECT_EQ(downloaded(*got), host_bytes(want)) << mt::name(dtype);
  }
}

}  // namespace
