// mixtape/dist/checked_group.h -- MIXTAPE_DIST_DEBUG=1: a process group that checks, before each
// collective, that every process makes the same one.
#pragma once

#include <memory>

#include "mixtape/dsl/process_group.h"

namespace mixtape::dist {

/// `inner` with every collective preceded by an exchange of what each process is about to do
/// (which collective, its byte counts and root, and the graph node it is made for: its op and
/// where it was built, collective_node()), checked alike on every process. Where the processes'
/// calls differ (one process built a node that makes a collective, a logging node, say, and the
/// others did not), every process gets an mt::Error naming both calls, where the collective itself
/// would have paired unrelated buffers or waited for the timeout. It costs one small all_gather per
/// collective: dist::init installs it only where MIXTAPE_DIST_DEBUG=1 on process 0, as PyTorch
/// checks its collectives under TORCH_DISTRIBUTED_DEBUG=DETAIL. What it compares is each call's
/// kind, sizes and node: a collective that one process skips is found at the first later call that
/// differs, the next graph collective's node at the latest, even where the sizes agree (a
/// one-element norm's sum against the loss scaler's one-element found-inf). The description grows
/// with the processes (2 + 2N counts and 128 bytes of node each, all of them gathered everywhere),
/// which is fine for the dozens of processes a CPU run has. The collectives NCCL carries do not
/// pass through a process group and are not checked.
std::shared_ptr<ProcessGroup> checked_process_group(std::shared_ptr<ProcessGroup> inner);

}  // namespace mixtape::dist
