# tests/examples/checks.sh -- what the example tests share (sourced): a field of the examples'
# JSON line, and a checked condition that prints ok or FAIL and stops the test on FAIL.

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
