// mixtape/dsl/process_group.cpp -- the installed process group (none: one process).
#include "mixtape/dsl/process_group.h"

#include <utility>

namespace mixtape {
namespace {

// Installed once by dist::init before any step runs, and kept to exit: steps read it unlocked.
std::shared_ptr<ProcessGroup>& installed() {
  static std::shared_ptr<ProcessGroup>* group = new std::shared_ptr<ProcessGroup>;
  return *group;
}

}  // namespace

ProcessGroup* process_group() { return installed().get(); }
void set_process_group(std::shared_ptr<ProcessGroup> group) { installed() = std::move(group); }
int process_rank() { return installed() ? installed()->rank() : 0; }
int process_count() { return installed() ? installed()->size() : 1; }

}  // namespace mixtape
