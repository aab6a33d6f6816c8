#!/usr/bin/env bash
# tests/examples/char_gpt_deploy_test.sh -- char_gpt --export, then examples/deploy/sample_text.c
# built with only the artifact (cc + pkg-config) and run as a user would: greedy text equal to
# what char_gpt itself generates, seeded sampling that repeats, no LLVM / NVRTC / mixtape library
# in the program, and one clear line plus a non-zero exit for bad input.
# Usage: char_gpt_deploy_test.sh CHAR_GPT SOURCE_DIR SANITIZE(ON|OFF). C compiler: $CC or cc.
set -euo pipefail
bin="$1" source="$2" sanitize="${3:-OFF}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cc="${CC:-cc}"
source "$(dirname "$0")/checks.sh"
cflags=$(deploy_cflags "$sanitize" "-std=c11 -O2 -Wall -Wextra -Werror")

# ---- train a small model, generate greedily, export ----
prompt="The "
"$bin" --steps 120 --layers 1 --width 32 --context 16 --batch 8 --lr 3e-3 --eval-batches 2 \
  --sample 40 --temperature 0 --prompt "$prompt" --export "$work/export" > "$work/train.txt" ||
  { cat "$work/train.txt"; fail "char_gpt --export runs"; }
cat "$work/train.txt"
grep -q "^exported to $work/export: char_gpt (logits f32 \[batch, 16, [0-9]*\] from tokens i64 \[batch, 16\], batch 1..256" \
  "$work/train.txt" || fail "char_gpt --export says what it wrote"
for f in char_gpt.h libchar_gpt.so libchar_gpt.a char_gpt.pc char_gpt.json char_gpt_vocab.txt; do
  [[ -s "$work/export/$f" ]] || fail "--export wrote $f"
done
ok "char_gpt --export wrote the artifact and its vocabulary"

# ---- build the C program with only the artifact ----
# shellcheck disable=SC2086,SC2046
"$cc" $cflags "$source/examples/deploy/sample_text.c" -o "$work/sample_text" \
  $(PKG_CONFIG_PATH="$work/export" pkg-config --cflags --libs char_gpt) -lm ||
  fail "sample_text.c builds with cc and pkg-config char_gpt"
if ldd "$work/sample_text" | grep -Ei 'libLLVM|libnvrtc|libmixtape'; then
  fail "sample_text links no LLVM, NVRTC or mixtape library"
fi
ok "sample_text builds against the artifact alone (ldd: no libLLVM, libnvrtc, libmixtape)"

# ---- greedy text equals char_gpt's own ----
# 40 characters after a 4-character prompt: the window of 16 slides, and shorter windows are
# padded at the end. Greedy picks are the argmax of the same logits (the artifact equals the JIT
# bit for bit, test_aot_models; a padded window only adds exact zeros to the attention).
"$work/sample_text" "$work/export" --prompt "$prompt" --count 40 --temperature 0 > "$work/greedy.txt"
expected=$(python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])['sample'])" \
  "$work/train.txt")
python3 - "$work/greedy.txt" "$prompt" "$expected" <<'EOF' || fail "greedy text equals char_gpt's sample"
import sys
got = open(sys.argv[1], "rb").read().decode("utf-8", "replace")
want = sys.argv[2] + sys.argv[3] + "\n"
if got != want:
    print(f"sample_text: {got!r}\nchar_gpt:    {want!r}")
    sys.exit(1)
EOF
ok "greedy: sample_text prints what char_gpt generated ($(head -c 44 "$work/greedy.txt" | tr '\n' ' '))"

# ---- seeded sampling ----
"$work/sample_text" "$work/export" --count 300 --seed 7 --temperature 0.8 > "$work/a.txt"
"$work/sample_text" "$work/export" --count 300 --seed 7 --temperature 0.8 > "$work/b.txt"
"$work/sample_text" "$work/export" --count 300 --seed 8 --temperature 0.8 > "$work/c.txt"
cmp -s "$work/a.txt" "$work/b.txt" || fail "the same seed gives the same text"
cmp -s "$work/a.txt" "$work/c.txt" && fail "another seed gives another text"
python3 - "$work/a.txt" "$work/export/char_gpt_vocab.txt" <<'EOF' || fail "300 characters of the vocabulary"
import sys
text = open(sys.argv[1], "rb").read()
vocab = open(sys.argv[2], "rb").read().split(b"\n", 1)[1]
# The default prompt "\n", 300 characters, a newline.
assert len(text) == 302, len(text)
assert all(b in vocab for b in text[:-1])
EOF
ok "seeded sampling repeats, another seed differs, 300 characters of the vocabulary"

# ---- bad input: one line and a non-zero exit ----
expect_error() {  # expect_error WORDS ARGS...
  local words="$1"
  shift
  if "$work/sample_text" "$@" > "$work/out.txt" 2> "$work/err.txt"; then
    fail "sample_text $* was accepted"
  fi
  grep -q -- "$words" "$work/err.txt" || { cat "$work/err.txt"; fail "sample_text $*: '$words'"; }
  ok "sample_text $*: $(head -n 1 "$work/err.txt")"
}
expect_error "cannot open $work/nowhere/char_gpt_vocab.txt" "$work/nowhere"
expect_error "not in the model's vocabulary" "$work/export" --prompt $'\x01'
expect_error "--temperature needs" "$work/export" --temperature -1
expect_error "unknown flag" "$work/export" --top-k 3
# A vocabulary of another model (a shorter context): its sizes would have sized the buffers the
# model reads and writes (a heap overflow); the header's shapes refuse it.
cp "$work/export/char_gpt_vocab.txt" "$work/vocab.txt"
sed -i '1s/^mixtape-char-vocab-1 16 /mixtape-char-vocab-1 8 /' "$work/export/char_gpt_vocab.txt"
expect_error "is not the vocabulary of the model" "$work/export"
cp "$work/vocab.txt" "$work/export/char_gpt_vocab.txt"
rm "$work/export/char_gpt.plan"
expect_error "char_gpt.plan" "$work/export"
echo "char_gpt deploy: all checks passed"
