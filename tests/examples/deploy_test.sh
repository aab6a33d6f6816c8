#!/usr/bin/env bash
# tests/examples/deploy_test.sh -- the deployment story end to end, as a user runs it: digits_mlp
# --export, then the plain C programs of examples/deploy built against the artifact with its
# Makefile (pkg-config) and its CMake project (find_package). Checks: accuracy and batch-360 vs
# one-at-a-time agreement, training continued from C (loss goes down, the checkpoint loads back
# into digits_mlp), no LLVM / NVRTC / mixtape library in the programs, an artifact that still
# runs after it is moved, and bad input answered with a code and a message (deploy_bad_input.c).
# Usage: deploy_test.sh DIGITS_MLP SOURCE_DIR CMAKE SANITIZE(ON|OFF). C compiler: $CC or cc, the
# one the exporter compiles the artifact's glue with.
set -euo pipefail
bin="$1" source="$2" cmake="$3" sanitize="$4"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data="$source/examples/data/digits.csv.gz"
deploy="$source/examples/deploy"
cc="${CC:-cc}"
source "$(dirname "$0")/checks.sh"
cflags=$(deploy_cflags "$sanitize" "-O2 -Wall -Wextra -Werror")

# ---- export ----
"$bin" --steps 400 --seed 0 --export "$work/export" > "$work/export.txt"
cat "$work/export.txt"
grep -q "^exported to $work/export: digits_mlp .* and digits_mlp_train " "$work/export.txt" ||
  fail "digits_mlp --export says what it wrote"
# With --json the JSON line is all it prints (a consumer reads the whole of stdout).
"$bin" --steps 50 --seed 0 --export "$work/export_json" --json > "$work/export_json.txt"
[[ $(wc -l < "$work/export_json.txt") == 1 ]] && python3 -c 'import json,sys; json.load(sys.stdin)' \
  < "$work/export_json.txt" || fail "digits_mlp --json --export prints more than the JSON line"
[[ -f "$work/export_json/digits_mlp.json" ]] || fail "digits_mlp --json --export wrote no artifact"
for f in digits_mlp.h libdigits_mlp.so libdigits_mlp.a digits_mlp.pc digits_mlpConfig.cmake \
  digits_mlp.json digits_mlp_train.h libdigits_mlp_train.so digits_mlp_train.pc; do
  [[ -s "$work/export/$f" ]] || fail "--export wrote $f"
done
grep -q '"policies":\["fp32"\]' "$work/export/digits_mlp.json" || fail "the manifest names the policy"
ok "digits_mlp --export wrote both artifacts"

# ---- build both programs both ways ----
build_make() {  # build_make OUTDIR ARTIFACTDIR
  mkdir -p "$1"
  make -s -C "$1" -f "$deploy/Makefile" DIR="$2" CC="$cc" CFLAGS="$cflags" > "$1/build.log" 2>&1 ||
    { cat "$1/build.log"; fail "the Makefile builds against $2"; }
}
build_make "$work/make" "$work/export"
if ! { "$cmake" -S "$deploy" -B "$work/cmake" -DDIR="$work/export" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_C_FLAGS="$cflags" && "$cmake" --build "$work/cmake"; } > "$work/cmake.log" 2>&1; then
  cat "$work/cmake.log"
  fail "the CMake project builds against the artifact"
fi
ok "the Makefile and the CMake project build classify_digits and train_digits"

# ---- no JIT in the programs ----
for program in "$work/make/classify_digits" "$work/make/train_digits" \
  "$work/cmake/classify_digits" "$work/cmake/train_digits" "$work/cmake/classify_digits_static" \
  "$work/export/libdigits_mlp.so" "$work/export/libdigits_mlp_train.so"; do
  libraries=$(ldd "$program")
  if grep -Ei 'libLLVM|libnvrtc|libmixtape' <<< "$libraries"; then
    fail "$program links no LLVM, NVRTC or mixtape library"
  fi
done
ok "ldd: no libLLVM, libnvrtc or libmixtape in the programs or the artifacts' libraries"

# ---- classify ----
# What digits_mlp itself measured on the test digits, with the JIT: C must classify the same.
trained_accuracy=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['test_accuracy'])" \
  "$(tail -n 1 "$work/export.txt")")
classify() {  # classify PROGRAM DIR
  "$1" "$2" "$data" > "$work/classify.txt" || { cat "$work/classify.txt"; fail "$1 runs"; }
  cat "$work/classify.txt"
  grep -q "agree on every digit" "$work/classify.txt" || fail "$1: batch 360 and one at a time agree"
  awk -v jit="$trained_accuracy" \
    '{ for (i = 1; i < NF; i++) if ($i == "accuracy") {
         n++; a = $(i + 1) + 0; if (a < 0.9 || a - jit > 1e-4 || jit - a > 1e-4) bad = 1 } }
     END { exit !(n == 2 && !bad) }' "$work/classify.txt" ||
    fail "$1: accuracy >= 0.9 at batch 360 and one at a time, equal to digits_mlp's ($trained_accuracy)"
  ok "$1 $2: accuracy >= 0.9 both ways, equal to digits_mlp's, and they agree"
}
classify "$work/make/classify_digits" "$work/export"
classify "$work/cmake/classify_digits" "$work/export"
classify "$work/cmake/classify_digits_static" "$work/export"

# ---- continue training from C, then back into C++ ----
for program in "$work/make/train_digits" "$work/cmake/train_digits"; do
  "$program" "$work/export" "$data" 300 "$work/from_c.safetensors" > "$work/train.txt" ||
    { cat "$work/train.txt"; fail "$program trains"; }
  cat "$work/train.txt"
  # "mean loss: first 30 steps A, last 30 steps B"
  awk '/^mean loss/ { found = 1; gsub(",", ""); down = $10 + 0 < $6 + 0 }
       END { exit !(found && down) }' "$work/train.txt" ||
    fail "$program: the mean loss of the last 30 steps is below the first 30's"
  [[ -s "$work/from_c.safetensors" ]] || fail "$program saves a checkpoint"
done
ok "train_digits continues training (the loss goes down) and saves"
"$bin" --json --steps 1 --lr 0 --load "$work/from_c.safetensors" > "$work/reload.txt"
tail -n 1 "$work/reload.txt"
python3 -c "import json,sys; sys.exit(0 if json.loads(sys.argv[1])['test_accuracy'] >= 0.9 else 1)" \
  "$(tail -n 1 "$work/reload.txt")" || fail "digits_mlp --load reads the checkpoint C saved"
ok "the checkpoint trained from C loads back into digits_mlp (C++)"

# ---- bad input from C ----
mkdir -p "$work/bad"
cp -r "$work/export" "$work/bad/missing"
rm "$work/bad/missing/digits_mlp.safetensors"
cp -r "$work/export" "$work/bad/corrupt"
# One more hex digit in the weights' recorded checksum: the manifest no longer matches the file.
sed -i 's/\("digits_mlp.safetensors":{"bytes":[0-9]*,"xxh3_64":"\)/\10/' \
  "$work/bad/corrupt/digits_mlp.json"
cp -r "$work/export" "$work/bad/version"
sed -i 's/"mixtape_version":"[^"]*"/"mixtape_version":"0.0.0-other"/' \
  "$work/bad/version/digits_mlp.json"
cmp -s "$work/export/digits_mlp.json" "$work/bad/corrupt/digits_mlp.json" &&
  fail "the corrupt copy's manifest differs"
cmp -s "$work/export/digits_mlp.json" "$work/bad/version/digits_mlp.json" &&
  fail "the other version's manifest differs"
read -ra flags <<< "$cflags $(PKG_CONFIG_PATH="$work/export" pkg-config --cflags digits_mlp \
  digits_mlp_train)"
read -ra libs <<< "$(PKG_CONFIG_PATH="$work/export" pkg-config --libs digits_mlp digits_mlp_train)"
"$cc" -std=c11 "${flags[@]}" "$source/tests/examples/deploy_bad_input.c" -o "$work/bad/bad_input" \
  "${libs[@]}"
"$work/bad/bad_input" "$work/export" "$work/bad/missing" "$work/bad/corrupt" "$work/bad/version" ||
  fail "deploy_bad_input: every bad input gets its code and a message"

# ---- artifacts move ----
cp -r "$work/export" "$work/moved"
rm -rf "$work/export"
classify "$work/cmake/classify_digits_static" "$work/moved"
build_make "$work/make_moved" "$work/moved"
if ldd "$work/make_moved/classify_digits" | grep -q "$work/export"; then
  fail "a program built against the moved artifact uses only the moved copy"
fi
classify "$work/make_moved/classify_digits" "$work/moved"
"$work/make_moved/train_digits" "$work/moved" "$data" 10 "$work/moved.safetensors" > /dev/null ||
  fail "the moved training step runs"
ok "the artifact runs after it is copied elsewhere and the original is deleted"
echo "deploy: all checks passed"
