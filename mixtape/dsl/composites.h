// mixtape/dsl/composites.h -- the composites' names and autocast categories, from
// dsl/composites.def.
#pragma once

#include "mixtape/dsl/node.h"

namespace mixtape::composite {

// One object per name: every node a composite makes points to the same characters.
#define MT_COMPOSITE(name, category) inline constexpr char name[] = #name;
#include "mixtape/dsl/composites.def"

/// The category autocast gives the composite named `name` as a whole: Follow for a composite
/// that leaves each node to its op's category, and for null or a name not in the table.
Category category(const char* name);

/// Every composite's name, in table order.
const std::vector<const char*>& names();

}  // namespace mixtape::composite
