// mixtape/jit/run_program.cpp -- posix_spawnp with collected output, for the tools the packager
// runs.
#include "mixtape/jit/run_program.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "mixtape/dsl/error.h"

extern char** environ;

namespace mixtape {
namespace {

// Closes a descriptor when the scope ends (every error path included).
struct Descriptor {
  int fd = -1;
  ~Descriptor() {
    if (fd >= 0) ::close(fd);
  }
};

std::string command_line(const std::vector<std::string>& argv) {
  std::string line;
  for (const std::string& arg : argv) {
    if (!line.empty()) line += ' ';
    bool plain = !arg.empty() && arg.find_first_of(" \t\n'\"\\$") == std::string::npos;
    line += plain ? arg : "'" + arg + "'";
  }
  return line;
}

}  // namespace

std::vector<std::string> tool_command(const Tool& tool) {
  std::vector<std::string> words;
  const char* value =
      tool.environment_variable.empty() ? nullptr : std::getenv(tool.environment_variable.c_str());
  if (value) {
    std::string text = value;
    size_t at = 0;
    while ((at = text.find_first_not_of(" \t", at)) != std::string::npos) {
      size_t end = text.find_first_of(" \t", at);
      words.push_back(text.substr(at, end - at));
      at = end;
    }
  }
  if (words.empty()) words.push_back(tool.fallback);
  return words;
}

std::string run_tool(const Tool& tool, const std::vector<std::string>& arguments) {
  std::vector<std::string> argv = tool_command(tool);
  argv.insert(argv.end(), arguments.begin(), arguments.end());
  std::vector<char*> pointers;
  for (std::string& arg : argv) pointers.push_back(arg.data());
  pointers.push_back(nullptr);

  // Close-on-exec ends: a tool spawned by another thread meanwhile must not inherit them, or
  // this read would wait for that tool to exit too.
  int ends[2];
  if (::pipe2(ends, O_CLOEXEC) != 0)
    fail("running {}: cannot make a pipe: {}", argv[0], std::strerror(errno));
  Descriptor read_end{ends[0]}, write_end{ends[1]};

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, write_end.fd, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, write_end.fd, STDERR_FILENO);
  pid_t pid = -1;
  int error = ::posix_spawnp(&pid, argv[0].c_str(), &actions, nullptr, pointers.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (error == ENOENT)
    fail("the tool '{}' was not found on PATH{}; install it ({})", argv[0],
         tool.environment_variable.empty()
             ? ""
             : fmt::format(" (set ${} to use another)", tool.environment_variable),
         tool.install_hint);
  if (error != 0) fail("cannot run '{}': {}", command_line(argv), std::strerror(error));
  ::close(write_end.fd);
  write_end.fd = -1;

  std::string output;
  char buffer[4096];
  for (;;) {
    ssize_t n = ::read(read_end.fd, buffer, sizeof buffer);
    if (n > 0) {
      output.append(buffer, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) fail("waiting for '{}': {}", command_line(argv), std::strerror(errno));
  }
  if (WIFSIGNALED(status))
    fail("'{}' was killed by signal {}:\n{}", command_line(argv), WTERMSIG(status), output);
  if (WEXITSTATUS(status) != 0)
    fail("'{}' failed (exit status {}):\n{}", command_line(argv), WEXITSTATUS(status), output);
  return output;
}

}  // namespace mixtape
