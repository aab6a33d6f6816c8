// tests/test_storage.cpp -- Storage's host accessor: a device-resident value is fetched once, on
// its first host read, by every kind of host reader (without a GPU: a stand-in fetch function).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/runtime/checkpoint.h"
#include "mixtape/runtime/device.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

// The "device memory" of the stand-in back end, and how often a value was fetched from it.
std::map<const mt::Storage*, std::vector<float>>& device_side() {
  static std::map<const mt::Storage*, std::vector<float>> values;
  return values;
}
int fetches = 0;

void fetch_from_device_side(mt::Storage& storage) {
  const std::vector<float>& values = device_side().at(&storage);
  storage.bytes.resize(static_cast<size_t>(storage.size_bytes()));
  std::memcpy(storage.bytes.data(), values.data(), storage.bytes.size());
  storage.host_stale = false;
  ++fetches;
}

// A tensor whose value exists only on the stand-in device: no host bytes until fetched.
mt::Tensor device_only(const std::vector<float>& values, mt::Shape shape) {
  mt::Storage::set_host_fetch(fetch_from_device_side);
  auto storage = std::make_shared<mt::Storage>(mt::f32, static_cast<int64_t>(values.size()),
                                               std::shared_ptr<mt::DeviceCopy>());
  device_side()[storage.get()] = values;
  EXPECT_TRUE(storage->bytes.empty());
  return mt::from_storage(std::move(storage), std::move(shape));
}

class DeviceScope {
 public:
  explicit DeviceScope(mt::Device device) : previous_(mt::current_device()) {
    mt::set_device(device);
  }
  ~DeviceScope() { mt::set_device(previous_); }

 private:
  mt::Device previous_;
};

TEST(Storage, ReadsFetchADeviceValueOnceOnFirstUse) {
  fetches = 0;
  mt::Tensor x = device_only({1.5f, -2.0f, 4.0f}, {3});
  EXPECT_EQ(fetches, 0);
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{1.5f, -2.0f, 4.0f}));
  EXPECT_EQ(fetches, 1);
  EXPECT_EQ(x.to_vector<double>()[1], -2.0);  // the host copy is kept
  EXPECT_DOUBLE_EQ(mt::sum(x).item(), 3.5);
  EXPECT_EQ(fetches, 1);
  EXPECT_DOUBLE_EQ(device_only({7.0f}, {}).item(), 7.0);
  EXPECT_EQ(fetches, 2);
}

TEST(Storage, BothBackEndsFetchTheirInputs) {
  for (mt::Device device : {mt::Device::cpu, mt::Device::reference}) {
    DeviceScope scope(device);
    fetches = 0;
    mt::Tensor x = device_only({1, 2, 3, 4, 5, 6}, {2, 3});
    mt::Tensor index = mt::tensor(std::vector<int64_t>{2, 0}, {2});
    mt::Tensor y = mt::index_select(x * 2.0 + 1.0, index, 1);  // a kernel, then a host op
    EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{7, 3, 13, 9})) << mt::device_name(device);
    EXPECT_EQ(fetches, 1) << mt::device_name(device);
    mt::Tensor z = mt::matmul(device_only({1, 2, 3, 4}, {2, 2}), device_only({1, 0, 0, 1}, {2, 2}));
    EXPECT_EQ(z.to_vector<float>(), (std::vector<float>{1, 2, 3, 4})) << mt::device_name(device);
    EXPECT_EQ(fetches, 3) << mt::device_name(device);
  }
}

TEST(Storage, CheckpointsSaveTheFetchedBytes) {
  fetches = 0;
  std::string path = ::testing::TempDir() + "mixtape_test_storage.safetensors";
  mt::save_tensors(path, {{"w", device_only({0.25f, -8.0f}, {2})}});
  EXPECT_EQ(fetches, 1);
  mt::NamedTensors loaded = mt::load_tensors(path);
  ASSERT_EQ(loaded.size(), 1u);
  EXPECT_EQ(loaded[0].second.to_vector<float>(), (std::vector<float>{0.25f, -8.0f}));
  std::remove(path.c_str());
}

TEST(Storage, WithoutAFetchFunctionAHostReadIsAClearError) {
  mt::Tensor x = device_only({1.0f}, {1});
  mt::Storage::set_host_fetch(nullptr);
  EXPECT_MT_ERROR(x.to_vector<float>(), "lives on a device", "no device back end");
  mt::Storage::set_host_fetch(fetch_from_device_side);
  EXPECT_EQ(x.to_vector<float>(), std::vector<float>{1.0f});
}

}  // namespace
