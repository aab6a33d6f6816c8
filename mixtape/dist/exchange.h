// mixtape/dist/exchange.h -- host messages between the processes of a run, outside the steps:
// every process's text on every process, and an error on one process failing all of them.
#pragma once

#include <string>
#include <vector>

#include "mixtape/dsl/module.h"
#include "mixtape/dsl/process_group.h"

namespace mixtape::dist {

/// One line per entry, "name shape dtype": what every process (or a checkpoint and the module it
/// is loaded into) must agree on.
std::vector<std::string> describe_entries(const NamedTensors& entries);

/// Every process's `mine` (any bytes), on every process, in rank order.
std::vector<std::string> gather_text(ProcessGroup& group, const std::string& mine);

/// Every process says whether it failed (`error` not empty); the first that did sends its message
/// and every process throws it as an mt::Error (the others name that process and `call`), so
/// that none goes on to a collective the others never join. Without a group of several
/// processes, throws `error` if there is one.
void fail_together(const std::string& error, const char* call);

}  // namespace mixtape::dist
