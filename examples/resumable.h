// examples/resumable.h -- --save, --save-every and --resume for the training examples: the flags,
// the metadata a resumable checkpoint holds besides mt::save_checkpoint's, and its checks.
#pragma once

#include <mixtape/dsl/error.h>
#include <mixtape/mixtape.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "example_cli.h"

namespace examples {

struct ResumeFlags {
  std::string save;
  int64_t save_every = 0;  // --save-every: also save --save's checkpoint every N steps
  std::string resume;      // --resume: go on from a checkpoint --save (--save-every) wrote
};

/// --save, --save-every and --resume; `resumed` says what a resumed run takes up again.
inline void add_resume_flags(CLI::App& app, ResumeFlags& f, const std::string& resumed) {
  app.add_option("--save", f.save, "save the trained weights to this checkpoint")
      ->check(output_file())
      ->type_name("FILE");
  app.add_option("--save-every", f.save_every,
                 "also save the --save checkpoint every N steps, with what --resume needs")
      ->check(at_least(1))
      ->type_name("N")
      ->needs("--save");
  app.add_option("--resume", f.resume,
                 "go on from a checkpoint that --save wrote: " + resumed +
                     " and the step, so that the run ends as one never stopped")
      ->check(path_value())
      ->type_name("FILE");
}

/// The flags that shape a run after its start, by name without the dashes, as text: a resume
/// under others would not go on as the saved run did.
using RunFlags = std::vector<std::pair<std::string, std::string>>;

/// A metadata value, or "" where the checkpoint has none.
inline std::string metadata_entry(const mt::Metadata& meta, const std::string& key) {
  for (const auto& [name, value] : meta)
    if (name == key) return value;
  return std::string();
}

/// What a checkpoint saved after `step` holds besides save_checkpoint's own: the step, the
/// run's flags as "flag.<name>", and `extra`.
inline mt::Metadata resumable_metadata(int64_t step, const RunFlags& flags, mt::Metadata extra) {
  mt::Metadata meta{{"step", std::to_string(step)}};
  for (const auto& [flag, value] : flags) meta.emplace_back("flag." + flag, value);
  for (auto& entry : extra) meta.push_back(std::move(entry));
  return meta;
}

/// Checks what load_checkpoint read from `path` (into `meta` and `loader`) for a run of these
/// flags and `steps` steps, and returns the step it was saved after: the step must be there,
/// every flag as saved, the loader at that step's batch (two records of one count), and the
/// step short of `steps`. Each problem is an mt::Error naming the file.
inline int64_t resumed_step(const std::string& path, const mt::Metadata& meta,
                            const RunFlags& flags, const mt::DataLoader& loader, int64_t steps) {
  const std::string step = metadata_entry(meta, "step");
  char* end = nullptr;
  const long long saved_step = step.empty() ? -1 : std::strtoll(step.c_str(), &end, 10);
  if (saved_step < 1 || *end != '\0')
    mt::fail("{}: not a checkpoint that --save wrote during training (it has no step)", path);
  for (const auto& [flag, value] : flags) {
    const std::string saved = metadata_entry(meta, "flag." + flag);
    if (saved != value)
      mt::fail(
          "{}: saved with --{} {}, resumed with --{} {}: resume with the flags it was saved with",
          path, flag, saved.empty() ? "(not recorded)" : saved, flag, value);
  }
  const int64_t drawn = loader.epoch() * loader.batches_per_epoch() + loader.state().position;
  if (drawn != saved_step)
    mt::fail(
        "{}: its step {} and its data loader's {} batches disagree: saved with another --batch "
        "or number of processes",
        path, saved_step, drawn);
  if (saved_step >= steps)
    mt::fail("{}: saved at step {}, which --steps {} does not go past", path, saved_step, steps);
  return saved_step;
}

}  // namespace examples
