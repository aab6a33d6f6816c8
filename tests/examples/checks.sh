# tests/examples/checks.sh -- what the example tests share (sourced): a field of the examples'
# JSON line, a checked condition that prints ok or FAIL and stops the test on FAIL, and the
# flags the deployment tests build their C programs with.

field() {  # field NAME JSONLINE
  python3 -c "import json,sys; print(json.loads(sys.argv[2])['$1'])" x "$2"
}

check() {  # check CONDITION MESSAGE (a Python expression; math is imported)
  if ! python3 -c "import math, sys; sys.exit(0 if ($1) else 1)"; then
    echo "FAIL: $2"
    exit 1
  fi
  echo "ok: $2"
}

fail() { echo "FAIL: $*"; exit 1; }
ok() { echo "ok: $*"; }

# deploy_cflags SANITIZE FLAGS: FLAGS, plus the sanitizers where SANITIZE is on. The sanitizer
# build's artifacts carry an instrumented runtime (their .pc and CMake files add the sanitizer
# link flags); the C programs are instrumented too, so ASan checks them as well.
deploy_cflags() {
  local flags="$2"
  if [[ "$1" == ON || "$1" == 1 || "$1" == TRUE ]]; then
    flags+=" -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
  fi
  echo "$flags"
}
