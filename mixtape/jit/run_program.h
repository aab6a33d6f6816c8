// mixtape/jit/run_program.h -- runs an external program (a compiler, the linker) with an argument
// vector, never through a shell.
#pragma once

#include <string>
#include <vector>

namespace mixtape {

/// An external tool: the command that names it ($CC, say: split on blanks, so "ccache gcc"
/// works) or its default when that is unset or empty, and what to tell a user who lacks it.
struct Tool {
  std::string environment_variable;  // "" => always `fallback`
  std::string fallback;              // "cc"
  std::string install_hint;          // "apt-get install gcc"
};

/// The argument vector a tool starts with: $environment_variable split on blanks and tabs, or
/// {fallback}.
std::vector<std::string> tool_command(const Tool& tool);

/// Runs tool_command(tool) followed by `arguments`, found on PATH, with posix_spawnp: arguments
/// are passed as they are, so paths may hold blanks, quotes or dollars. Stdin is /dev/null;
/// stdout and stderr are collected. Throws mt::Error when the tool is not found (saying which and
/// how to install it), cannot start, is killed, or exits nonzero (with its command line and
/// output); returns the output otherwise.
std::string run_tool(const Tool& tool, const std::vector<std::string>& arguments);

}  // namespace mixtape
