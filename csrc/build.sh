#!/usr/bin/env bash
# Builds csrc/build/libtessera_kernels.so for sm_90a with nvcc and the CUTLASS headers.
# No GPU and no torch needed. Usage: bash csrc/build.sh [--clean]
#
# Environment:
#   CUTLASS_DIR         CUTLASS checkout or the nvidia-cutlass package's `source` folder
#                       (must hold include/cutlass); default: found through Python, else the
#                       copy .ci/run installs in csrc/build/cutlass.
#   PYTHON              interpreter used to find the nvidia-cutlass package (default: the
#                       repository's .venv/bin/python, else python3).
#   NVCC                compiler (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc).
#   JOBS                parallel compilations (default: number of CPUs).
#   TESSERA_GG_CONFIGS  bf16 grouped GEMM configurations to build, e.g. "0" (default: all, the
#                       kNumConfigs of grouped_gemm_bf16.cu).
#   TESSERA_FP8_CONFIGS FP8 blockwise GEMM configurations to build (default "0 1 2 3 4"; each
#                       source builds those below its kNumConfigs).
#   TESSERA_PTXAS_VERBOSE=1  print registers / spills of every kernel.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
out="$here/build"
obj="$out/obj"

if [[ "${1:-}" == "--clean" ]]; then rm -rf "$out"; fi
mkdir -p "$obj"

die() { echo "csrc/build.sh: $*" >&2; exit 2; }

nvcc_bin="${NVCC:-$(command -v nvcc || true)}"
[[ -z "$nvcc_bin" && -x /usr/local/cuda/bin/nvcc ]] && nvcc_bin=/usr/local/cuda/bin/nvcc
[[ -n "$nvcc_bin" ]] || die "nvcc not found: install the CUDA toolkit (>= 12.3) or set NVCC=/path/to/nvcc"

if [[ -z "${CUTLASS_DIR:-}" ]]; then
  py="${PYTHON:-}"
  [[ -z "$py" && -x "$root/.venv/bin/python" ]] && py="$root/.venv/bin/python"
  py="${py:-python3}"
  # find_spec locates the package without importing it (its import needs extra packages).
  CUTLASS_DIR="$("$py" -c 'import importlib.util as u, os; s = u.find_spec("cutlass_library"); print(os.path.join(os.path.dirname(s.origin), "source") if s else "")' 2>/dev/null || true)"
  [[ -z "$CUTLASS_DIR" && -d "$out/cutlass/cutlass_library/source" ]] && CUTLASS_DIR="$out/cutlass/cutlass_library/source"
fi
[[ -n "${CUTLASS_DIR:-}" && -f "$CUTLASS_DIR/include/cutlass/cutlass.h" ]] ||
  die "CUTLASS headers not found: pip install nvidia-cutlass (e.g. .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl) or set CUTLASS_DIR to a folder with include/cutlass (now '${CUTLASS_DIR:-}')"

jobs="${JOBS:-$(nproc)}"
gg_count="$(sed -n 's/^constexpr int kNumConfigs = \([0-9]*\);.*/\1/p' "$here/grouped_gemm_bf16.cu")"
[[ -n "$gg_count" ]] || die "grouped_gemm_bf16.cu: no 'constexpr int kNumConfigs = N;' line"
gg_configs="${TESSERA_GG_CONFIGS:-$(seq -s ' ' 0 $(( gg_count - 1 )))}"
fp8_configs="${TESSERA_FP8_CONFIGS:-0 1 2 3 4}"

flags=(-gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr
       -Xcompiler=-fPIC,-fvisibility=hidden -DNDEBUG
       -I"$here" -I"$CUTLASS_DIR/include" -I"$CUTLASS_DIR/tools/util/include")
[[ "${TESSERA_PTXAS_VERBOSE:-0}" == 1 ]] && flags+=(-Xptxas=-v)

# One line per object: "<object> <source> <extra flags...>".
units=("api.o api.cu")
for op in 0 1 2 3 4; do
  for c in $gg_configs; do
    if (( c < gg_count )); then
      units+=("gg_bf16_op${op}_c${c}.o grouped_gemm_bf16.cu -DTESSERA_GG_OP=$op -DTESSERA_GG_CONFIG=$c")
    fi
  done
done
for src in "$here"/fp8_*.cu; do
  [[ -e "$src" ]] || continue
  base="$(basename "$src" .cu)"
  if grep -q TESSERA_FP8_CONFIG "$src"; then
    count="$(sed -n 's/^constexpr int kNumConfigs = \([0-9]*\);.*/\1/p' "$src")"
    [[ -n "$count" ]] || die "$src: no 'constexpr int kNumConfigs = N;' line"
    for c in $fp8_configs; do
      if (( c < count )); then units+=("${base}_c${c}.o $(basename "$src") -DTESSERA_FP8_CONFIG=$c"); fi
      if (( c < count )) && grep -q TESSERA_FP8_WGRAD_F32 "$src"; then
        units+=("${base}_f32_c${c}.o $(basename "$src") -DTESSERA_FP8_CONFIG=$c -DTESSERA_FP8_WGRAD_F32=1")
      fi
    done
  else
    units+=("${base}.o $(basename "$src")")
  fi
done

# An object is rebuilt when it is older than its source, this script, or a csrc/ header it
# includes (from the dependency file nvcc writes next to it).
mtime() { stat -c %Y "$1"; }
stale() {
  local o="$obj/$1" t dep
  [[ -f "$o" && -f "$o.d" ]] || return 0
  t=$(mtime "$o")
  for dep in "$here/$2" "$here/build.sh" $(sed -e 's/\\$//' -e 's/^[^:]*://' "$o.d" | tr ' ' '\n' | grep "^$here/"); do
    [[ -f "$dep" ]] && (( $(mtime "$dep") <= t )) || return 0
  done
  return 1
}
todo=()
for u in "${units[@]}"; do
  read -r o src _ <<< "$u"
  if stale "$o" "$src"; then todo+=("$u"); fi
done

start=$(date +%s)
echo "csrc/build.sh: nvcc $("$nvcc_bin" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), CUTLASS $CUTLASS_DIR, ${#todo[@]}/${#units[@]} objects to build, $jobs jobs"
export nvcc_bin obj here
(( ${#todo[@]} == 0 )) || printf '%s\n' "${todo[@]}" | xargs -P "$jobs" -I{} bash -c '
  set -f; read -r o src extra <<< "$1"; shift
  t0=$(date +%s)
  if ! "$nvcc_bin" "$@" $extra -MD -MF "$obj/$o.d" -c "$here/$src" -o "$obj/$o.tmp" > "$obj/$o.log" 2>&1; then
    cat "$obj/$o.log" >&2; echo "csrc/build.sh: FAILED $o" >&2; exit 255
  fi
  mv "$obj/$o.tmp" "$obj/$o"; echo "  $o ($(( $(date +%s) - t0 )) s)"
  grep -E "spill|registers" "$obj/$o.log" | grep -v " 0 bytes spill" | sed "s/^/    /" || true
' _ {} "${flags[@]}" || die "compilation failed"

objects=()
for u in "${units[@]}"; do objects+=("$obj/${u%% *}"); done
# cudart is linked statically: at run time the library needs the CUDA driver, glibc >= 2.34
# and the system libstdc++ (GLIBCXX 3.4.11), whatever torch or CUDA toolkit the machine has.
# (A static libstdc++/libgcc would pull arc4random and _dl_find_object: glibc 2.36.)
"$nvcc_bin" -shared -cudart=static -gencode=arch=compute_90a,code=sm_90a -o "$out/libtessera_kernels.so.tmp" "${objects[@]}" \
  -Xlinker=--exclude-libs,ALL
mv "$out/libtessera_kernels.so.tmp" "$out/libtessera_kernels.so"
echo "csrc/build.sh: built $out/libtessera_kernels.so in $(( $(date +%s) - start )) s"
