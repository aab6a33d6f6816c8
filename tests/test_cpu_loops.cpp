// tests/test_cpu_loops.cpp -- the CPU back end's indexing and sorting loops
// (runtime/cpu_indexing.h, runtime/cpu_sort.h) against the reference executor: the same bits for
// every op, dtype and axis, threaded or not, the same error for an index out of range.
#include <gtest/gtest.h>
#include <omp.h>
#include <xmmintrin.h>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

// One case: the data (what is read, or the base written into), the index and, for the writes,
// the source; `op` makes the result from tensors of those values.
struct IndexCase {
  std::string label;
  mt::Shape data, index, source;  // source: empty for the reads
  int64_t axis;
  int64_t index_range;  // indices are drawn from [0, index_range)
  std::function<mt::Tensor(const mt::Tensor&, const mt::Tensor&, const mt::Tensor&, int64_t)> op;
};

mt::Tensor read_select(const mt::Tensor& x, const mt::Tensor& i, const mt::Tensor&, int64_t a) {
  return mt::index_select(x, i, a);
}
mt::Tensor read_gather(const mt::Tensor& x, const mt::Tensor& i, const mt::Tensor&, int64_t a) {
  return mt::gather(x, i, a);
}
mt::Tensor add_rows(const mt::Tensor& b, const mt::Tensor& i, const mt::Tensor& s, int64_t a) {
  return mt::index_add(b, i, s, a);
}
mt::Tensor add_scattered(const mt::Tensor& b, const mt::Tensor& i, const mt::Tensor& s, int64_t a) {
  return mt::scatter_add(b, i, s, a);
}
mt::Tensor write_scattered(const mt::Tensor& b, const mt::Tensor& i, const mt::Tensor& s,
                           int64_t a) {
  return mt::scatter(b, a, i, s);
}

// Small cases on every axis (gather's and scatter's indices smaller than the data outside the
// axis, many repeated positions), and large ones that the team splits: by outer coordinates, and
// with one outer coordinate by inner ones (an embedding table's rows, a last-axis gather).
std::vector<IndexCase> cases() {
  std::vector<IndexCase> all;
  for (int64_t axis : {0, 1, 2}) {
    const std::string on = " axis " + std::to_string(axis);
    mt::Shape data{5, 7, 3}, rows = data, index{4, 6, 2};
    rows[static_cast<size_t>(axis)] = 9;
    index[static_cast<size_t>(axis)] = 11;
    const int64_t range = data[static_cast<size_t>(axis)];
    all.push_back({"index_select" + on, data, {9}, {}, axis, range, read_select});
    all.push_back({"index_add" + on, data, {9}, rows, axis, range, add_rows});
    all.push_back({"gather" + on, data, index, {}, axis, range, read_gather});
    all.push_back({"scatter_add" + on, data, index, index, axis, range, add_scattered});
    all.push_back({"scatter" + on, data, index, index, axis, range, write_scattered});
  }
  // An index of any rank names rows (an embedding's lookup and its gradient).
  all.push_back({"index_select 2-D index", {50, 8}, {6, 7}, {}, 0, 50, read_select});
  all.push_back({"index_add 2-D index", {50, 8}, {6, 7}, {6, 7, 8}, 0, 50, add_rows});
  all.push_back({"index_select 2-D index axis 1", {5, 9, 3}, {2, 4}, {}, 1, 9, read_select});
  all.push_back({"index_select embedding", {1000, 64}, {16, 128}, {}, 0, 1000, read_select});
  all.push_back(
      {"index_add embedding gradient", {1000, 64}, {16, 128}, {16, 128, 64}, 0, 1000, add_rows});
  // Rows cut into blocks of 64 with one element left over (a block of one that is not a whole
  // row), with one and with a few outer coordinates.
  all.push_back({"index_select 65 wide", {3, 65}, {3}, {}, 0, 3, read_select});
  all.push_back({"index_add 65 wide", {3, 65}, {5}, {5, 65}, 0, 3, add_rows});
  all.push_back({"index_select 129 wide axis 1", {4, 4, 129}, {6}, {}, 1, 4, read_select});
  all.push_back({"index_add 129 wide axis 1", {4, 4, 129}, {6}, {4, 6, 129}, 1, 4, add_rows});
  all.push_back({"index_select rows", {300, 256}, {700}, {}, 0, 300, read_select});
  all.push_back({"index_add rows", {300, 256}, {700}, {700, 256}, 0, 300, add_rows});
  all.push_back({"index_select height", {4, 16, 32, 32}, {64}, {}, 2, 32, read_select});
  all.push_back({"index_add width", {4, 16, 32, 32}, {64}, {4, 16, 32, 64}, 3, 32, add_rows});
  all.push_back({"gather last", {8, 16, 512}, {8, 16, 512}, {}, 2, 512, read_gather});
  all.push_back({"gather first", {300, 200}, {600, 150}, {}, 0, 300, read_gather});
  all.push_back(
      {"scatter_add last", {8, 16, 512}, {8, 16, 512}, {8, 16, 512}, 2, 512, add_scattered});
  all.push_back({"scatter_add first", {300, 200}, {600, 150}, {600, 150}, 0, 300, add_scattered});
  all.push_back({"scatter first", {300, 200}, {600, 150}, {600, 150}, 0, 300, write_scattered});
  return all;
}

// Values with NaN, infinities and signed zeros among them, which the copies keep.
std::vector<double> values_of(const mt::Shape& shape, uint64_t seed) {
  mt::Generator gen(seed);
  std::vector<double> v = mt::randn(shape, mt::f64, &gen).to_vector<double>();
  if (v.size() > 4) {
    v[1] = std::numeric_limits<double>::quiet_NaN();
    v[2] = std::numeric_limits<double>::infinity();
    v[3] = -0.0;
  }
  return v;
}

struct Result {
  std::vector<double> result;
  int64_t host_ops;  // steps the reference loops ran
};

Result run_case(const IndexCase& c, mt::DType dtype, mt::Device device,
                std::optional<mt::DType> autocast = std::nullopt) {
  mt::Device previous = mt::current_device();
  mt::set_device(device);
  std::optional<mt::autocast> guard;
  if (autocast) guard.emplace(*autocast);
  mt::Generator gen(5);
  const mt::Tensor index = mt::randint(0, c.index_range, c.index, &gen);
  const mt::Tensor data = mt::tensor(values_of(c.data, 1), c.data, dtype);
  const mt::Tensor source =
      c.source.empty() ? mt::Tensor() : mt::tensor(values_of(c.source, 2), c.source, dtype);
  mt::eval({index, data});
  if (source.defined()) mt::eval({source});
  mt::reset_execution_stats();
  mt::Tensor y = c.op(data, index, source, c.axis);
  mt::eval({y});
  Result run{y.to_vector<double>(), mt::execution_stats().host_ops};
  mt::set_device(previous);
  return run;
}

bool same_value(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b));
}

void expect_same(const Result& got, const Result& want) {
  ASSERT_EQ(got.result.size(), want.result.size());
  for (size_t i = 0; i < want.result.size(); ++i)
    ASSERT_TRUE(same_value(got.result[i], want.result[i]))
        << "[" << i << "] " << got.result[i] << " vs " << want.result[i];
}

TEST(IndexingLoops, CpuLoopsStoreTheReferencesBits) {
  for (const IndexCase& c : cases())
    for (mt::DType dtype : {mt::f32, mt::bf16, mt::f16, mt::f64}) {
      SCOPED_TRACE(c.label + " " + std::string(mt::name(dtype)));
      const Result got = run_case(c, dtype, mt::Device::cpu);
      expect_same(got, run_case(c, dtype, mt::Device::reference));
      EXPECT_EQ(got.host_ops, 0);  // the CPU's loops ran it
    }
}

TEST(IndexingLoops, MixedStorageTypesUnderAutocast) {
  for (const IndexCase& c : cases()) {
    SCOPED_TRACE(c.label);
    expect_same(run_case(c, mt::f32, mt::Device::cpu, mt::bf16),
                run_case(c, mt::f32, mt::Device::reference, mt::bf16));
  }
}

// Integers and booleans move as bytes; integer sums take the reference's loops.
TEST(IndexingLoops, IntegersAndBooleans) {
  for (const IndexCase& c : cases())
    for (mt::DType dtype : {mt::i64, mt::i32, mt::boolean}) {
      if (dtype == mt::boolean && c.label.starts_with("scatter_add")) continue;
      if (dtype == mt::boolean && c.label.starts_with("index_add")) continue;
      SCOPED_TRACE(c.label + " " + std::string(mt::name(dtype)));
      const Result got = run_case(c, dtype, mt::Device::cpu);
      expect_same(got, run_case(c, dtype, mt::Device::reference));
      const bool sums = c.label.starts_with("scatter_add") || c.label.starts_with("index_add");
      EXPECT_EQ(got.host_ops, sums ? 1 : 0);
    }
}

TEST(IndexingLoops, AnIndexOutOfRangeIsTheReferencesError) {
  for (mt::Device device : {mt::Device::cpu, mt::Device::reference}) {
    mt::set_device(device);
    const mt::Tensor x = mt::ones({3, 4});
    // The first bad index in the index's order is named, on either side of the axis's size.
    const mt::Tensor index = mt::tensor(std::vector<double>{0, 1, 4, -1, 2, 9}, {2, 3}, mt::i64);
    EXPECT_MT_ERROR(mt::eval({mt::gather(x, index, 1)}), "gather",
                    "index 4 is out of range for axis 1 of size 4");
    EXPECT_MT_ERROR(mt::eval({mt::scatter_add(x, index, mt::ones({2, 3}), 1)}), "scatter_add",
                    "index 4 is out of range for axis 1 of size 4");
    EXPECT_MT_ERROR(mt::eval({mt::scatter(x, 1, index, mt::ones({2, 3}))}), "scatter",
                    "index 4 is out of range for axis 1 of size 4");
    const mt::Tensor rows = mt::tensor(std::vector<double>{2, -1, 3}, {3}, mt::i64);
    EXPECT_MT_ERROR(mt::eval({mt::index_select(x, rows, 0)}), "index_select",
                    "index -1 is out of range for axis 0 of size 3");
    EXPECT_MT_ERROR(mt::eval({mt::index_add(x, rows, mt::ones({3, 4}), 0)}), "index_add",
                    "index -1 is out of range for axis 0 of size 3");
  }
  mt::set_device(mt::Device::cpu);
}

// Empty indices and empty data: no element is visited, the base is the result.
TEST(IndexingLoops, EmptyTensors) {
  mt::set_device(mt::Device::cpu);
  const mt::Tensor x = mt::ones({3, 4});
  const mt::Tensor none = mt::zeros({0}, mt::i64);
  EXPECT_EQ(mt::index_select(x, none, 1).shape(), (mt::Shape{3, 0}));
  mt::eval({mt::index_select(x, none, 1)});
  EXPECT_EQ(mt::index_add(x, none, mt::ones({3, 0}), 1).to_vector<float>(),
            std::vector<float>(12, 1.f));
  const mt::Tensor no_rows = mt::zeros({0, 4}, mt::i64);
  EXPECT_EQ(mt::scatter_add(x, no_rows, mt::ones({0, 4}), 0).to_vector<float>(),
            std::vector<float>(12, 1.f));
  EXPECT_EQ(mt::gather(x, no_rows, 0).shape(), (mt::Shape{0, 4}));
}

// ---- argsort ----

struct SortCase {
  mt::Shape shape;
  int64_t axis;
};

// Values on five levels (ties everywhere) with NaNs of both signs, infinities and both zeros.
std::vector<double> tie_heavy(const mt::Shape& shape, uint32_t seed) {
  std::vector<double> v(static_cast<size_t>(mt::numel(shape)));
  uint32_t state = seed;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double specials[] = {
      nan, -nan, std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
      0.0, -0.0};
  for (double& e : v) {
    state = state * 1664525u + 1013904223u;
    const uint32_t pick = state >> 27;  // 0..31
    e = pick < 6 ? specials[pick] : static_cast<double>(static_cast<int>(pick % 5) - 2) * 1.5;
  }
  return v;
}

std::vector<int64_t> argsort_on(mt::Device device, const SortCase& c, mt::DType dtype,
                                bool descending, int64_t* host_ops) {
  mt::Device previous = mt::current_device();
  mt::set_device(device);
  const mt::Tensor x = mt::tensor(tie_heavy(c.shape, 3), c.shape, dtype);
  mt::eval({x});
  mt::reset_execution_stats();
  const mt::Tensor order = mt::argsort(x, c.axis, descending);
  mt::eval({order});
  *host_ops = mt::execution_stats().host_ops;
  std::vector<int64_t> result = order.to_vector<int64_t>();
  mt::set_device(previous);
  return result;
}

// Every axis of a small tensor, long lines the team splits, and many short lines along the first
// axis (strided lines); each in both directions and every dtype.
TEST(SortLoops, CpuArgsortIsTheReferencesStableOrder) {
  const std::vector<SortCase> cases = {{{5, 7, 3}, 0},     {{5, 7, 3}, 1},    {{5, 7, 3}, 2},
                                       {{8, 64, 1024}, 2}, {{300, 2, 70}, 0}, {{9}, 0}};
  for (const SortCase& c : cases)
    for (mt::DType dtype : {mt::f32, mt::bf16, mt::f16, mt::f64, mt::i64, mt::i32, mt::boolean})
      for (bool descending : {false, true}) {
        SCOPED_TRACE(testing::Message() << mt::to_string(c.shape) << " axis " << c.axis << " "
                                        << mt::name(dtype) << (descending ? " descending" : ""));
        int64_t cpu_host_ops = 0, reference_host_ops = 0;
        const std::vector<int64_t> got =
            argsort_on(mt::Device::cpu, c, dtype, descending, &cpu_host_ops);
        const std::vector<int64_t> want =
            argsort_on(mt::Device::reference, c, dtype, descending, &reference_host_ops);
        ASSERT_EQ(got, want);
        EXPECT_EQ(cpu_host_ops, 0);  // the CPU's loops ran it
      }
}

// ---- the caller's float mode ----

// Sets (or clears) flush-to-zero and denormals-are-zero on the calling thread and on every
// thread of the OpenMP team, as a program built with -ffast-math runs them.
void set_team_float_mode(bool flush) {
  constexpr unsigned kFtzDaz = 0x8040;
#pragma omp parallel
  { _mm_setcsr(flush ? _mm_getcsr() | kFtzDaz : _mm_getcsr() & ~kFtzDaz); }
  _mm_setcsr(flush ? _mm_getcsr() | kFtzDaz : _mm_getcsr() & ~kFtzDaz);
}

// The loops' team threads take mixtape's float mode (IEEE unless mt::set_flush_denormal), not
// the one the caller left on them (runtime/device.h): subnormals of both signs sort apart and
// sums of subnormals stay subnormal, threaded as on one thread.
TEST(CpuLoops, ResultsDoNotDependOnTheCallersFloatMode) {
  mt::set_device(mt::Device::cpu);
  const int64_t rows = 4, n = 8192;  // enough for the team to split the lines
  std::vector<float> tiny(static_cast<size_t>(rows * n));
  for (size_t i = 0; i < tiny.size(); ++i) tiny[i] = (i % 2 ? -1e-40f : 1e-40f) * (1 + i % 3);
  const mt::Tensor x = mt::tensor(tiny, {rows, n});
  const mt::Tensor index =
      mt::tensor(std::vector<double>(static_cast<size_t>(n), 1.0), {n}, mt::i64);
  auto run = [&] {
    return std::make_pair(mt::argsort(x, 1).to_vector<int64_t>(),
                          mt::index_add(mt::zeros({rows, 2}), index, x, 1).to_vector<float>());
  };
  const auto ieee = run();
  set_team_float_mode(true);
  const auto flushing_caller = run();
  set_team_float_mode(false);
  EXPECT_EQ(flushing_caller.first, ieee.first);
  EXPECT_EQ(flushing_caller.second, ieee.second);
  EXPECT_NE(ieee.second[1], 0.f);  // a sum of subnormals: subnormal, not flushed
}

}  // namespace
