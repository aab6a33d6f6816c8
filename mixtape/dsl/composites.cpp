// mixtape/dsl/composites.cpp -- lookups in the composite table (dsl/composites.def).
#include "mixtape/dsl/composites.h"

#include <cstring>

namespace mixtape::composite {
namespace {

struct Row {
  const char* name;
  Category category;
};
constexpr Row kRows[] = {
#define MT_COMPOSITE(name, category) {name, Category::category},
#include "mixtape/dsl/composites.def"
};

}  // namespace

Category category(const char* name) {
  if (name)
    for (const Row& row : kRows)
      if (name == row.name || std::strcmp(name, row.name) == 0) return row.category;
  return Category::Follow;
}

DType statistics_type(DType input) { return input == f64 ? f64 : f32; }

const std::vector<const char*>& names() {
  static const std::vector<const char*> all = [] {
    std::vector<const char*> out;
    for (const Row& row : kRows) out.push_back(row.name);
    return out;
  }();
  return all;
}

}  // namespace mixtape::composite
