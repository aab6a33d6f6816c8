#!/usr/bin/env bash
# tools/gpu_bundle.sh -- packs the GPU test and benchmark binaries of a build, with the shared
# libraries they load, into one archive for a GPU machine that lacks mixtape's build dependencies.
# usage: tools/gpu_bundle.sh BUILD_DIR OUT_DIR   (writes OUT_DIR/bundle.tar.xz)
# tests/gpu/run.sh OUTDIR with MIXTAPE_GPU_BUNDLE=OUT_DIR/bundle.tar.xz runs them there.
set -euo pipefail
build=${1:?usage: tools/gpu_bundle.sh BUILD_DIR OUT_DIR}
out=${2:?usage: tools/gpu_bundle.sh BUILD_DIR OUT_DIR}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib/compat" "$out"
binaries=()
for f in "$build"/test_gpu_* "$build"/bench_gpu_* "$build"/test_nvrtc "$build"/test_compile \
  "$build"/test_memory_report; do
  [[ -x "$f" ]] && binaries+=("$f")
done
if ((${#binaries[@]} == 0)); then
  echo "gpu_bundle: no test_gpu_*, bench_gpu_* or test_nvrtc binaries in $build" >&2
  exit 1
fi
cp "${binaries[@]}" "$stage/bin/"
# The runtime archive AOT exports link into every artifact (test_gpu_aot exports).
[[ -f "$build/libmixtape_runtime.a" ]] && cp "$build/libmixtape_runtime.a" "$stage/lib/"
# Every library the binaries load, except the C library's own, which the target's must provide.
# The C++ runtime goes to lib/compat, used only where the target's is too old.
for f in "${binaries[@]}"; do ldd "$f"; done | awk '/=> \//{print $3}' | sort -u |
  while read -r lib; do
    case "$(basename "$lib")" in
      libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*) ;;
      libstdc++.so.*|libgcc_s.so.*) cp -L "$lib" "$stage/lib/compat/" ;;
      *) cp -L "$lib" "$stage/lib/" ;;
    esac
  done
# The linker names (libdnnl.so -> libdnnl.so.2) an AOT export's `cc -shared ... -ldnnl` looks for
# there: run.sh puts lib on LIBRARY_PATH.
for lib in "$stage"/lib/*.so.*; do
  linker_name=${lib%%.so.*}.so
  [[ -e "$linker_name" ]] || ln -s "$(basename "$lib")" "$linker_name"
done
tar -C "$stage" -cf - bin lib | xz -T"$(nproc)" -6 > "$out/bundle.tar.xz"
echo "gpu_bundle: $(du -h "$out/bundle.tar.xz" | cut -f1) in $out/bundle.tar.xz (${#binaries[@]} binaries)"
