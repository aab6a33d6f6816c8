// mixtape/autograd/saved_values.cpp -- the scope through which the gradient rules read the
// forward values.
#include "mixtape/autograd/saved_values.h"

namespace mixtape {
namespace {
thread_local SavedValues* current = nullptr;
}  // namespace

SavedValuesScope::SavedValuesScope(SavedValues* saved) : previous_(current) { current = saved; }
SavedValuesScope::~SavedValuesScope() { current = previous_; }

NodePtr saved_value(const NodePtr& value) { return current ? current->read(value) : value; }

}  // namespace mixtape
