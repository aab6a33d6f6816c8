// mixtape/dsl/in_place.h -- the buffers that replay plans update in place, which assign() copies
// rather than shares.
#pragma once

namespace mixtape {

struct Storage;

/// Counts `buffer` as one a replay plan (mt::compile's) updates in place, or stops counting it;
/// the plan holds the buffer while it counts.
void hold_in_place(const Storage* buffer);
void release_in_place(const Storage* buffer);

/// Whether a replay plan updates `buffer` in place: a tensor assigned from it gets a copy, so
/// that later replays do not change it, as tracing would not.
bool written_in_place(const Storage* buffer);

}  // namespace mixtape
