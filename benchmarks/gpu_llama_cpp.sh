#!/usr/bin/env bash
# The GPU runs behind BENCHMARKS.md's llama.cpp table: the GGUF GPU tests and
# benchmarks/compare_llama_cpp.py, Llama-3.2-1B and Llama-3.1-8B on Q4_0, Q4_K_M, Q6_K and Q8_0,
# in four device calls of at most 10 minutes (the machine has no network: MLX's CUDA wheel comes in
# .device-stage/, llama.cpp's source as .lcp/llama.cpp-src.tar.gz; the machine must stay warm
# between calls, its /tmp holds the build and the 8B files):
#
#   call 1: bash .device-stage/a/stash.sh && bash benchmarks/gpu_llama_cpp.sh build
#                                                       carry [".device-stage/a", ".lcp"]
#   call 2: source .device-stage/b/install.sh && bash benchmarks/gpu_llama_cpp.sh tests prep-8b
#                                                       carry [".device-stage/b"]
#   call 3: source .device-stage/b/install.sh --no-install && bash benchmarks/gpu_llama_cpp.sh bench-8b
#   call 4: source .device-stage/b/install.sh --no-install && BENCH_1B_ARGS="--rounds 9" \
#             bash benchmarks/gpu_llama_cpp.sh bench-1b
#   then, for Q6_K and Q8_0: FORMATS_8B="q6_k q8_0" ... clean-8b prep-8b, then bench-8b.
#
# The machine must stay warm between the calls: one left idle past the lender's release comes back
# bare (no wheel, no build, no files), and bench-8b then stops at once rather than wait for files.
# Keep the benchmarks apart from the CPU work of the build and of prep-8b: pymlxc's 1B decode is
# bound by host work, and a run beside them (prep-8b-bg during bench-1b) moved it by 20% and more.
# Export GIT_REV=<commit> in each call where the lent copy's git metadata is stale.
# build starts llama.cpp's CUDA build in the background (a few minutes; bench-* wait for it);
# prep-8b-bg writes the 8B files of FORMATS_8B in the background (niced, for a call that only
# tests: a benchmark beside it is slowed, see above), and bench-8b waits for it. The 8B
# files come two formats at a time (disk: 64 GiB): the float16 source goes once its F16 GGUF is
# written, which later formats are quantized from; clean-8b removes the formats benchmarked before.
# What the runs measure since the compute-dtype change: quantized GGUF files of Llama compute in
# float16 (docs/gguf.md), so their Q4_0/Q4_K layers take pymlxc's 4-bit matvec kernel (the GGUF
# side) or MLX's quantized_matmul (the pymlxc_gguf_matvec0 side, --matvec-off), Q6_K/Q8_0 layers the
# block kernels and MLX's 8-bit kernel; the earlier float32 runs are in BENCHMARKS.md's git history.
# probe: benchmarks/profile/probe_gguf_blocks.py (the block kernels' time per decode shape).
# planes-ab: the Q4_K_M files' prefill and decode with and without the Q6_K planes, alternated.
# prefill-blocks: the Q4_K_M files' prefill compiled (block layers' rows dequantized outside the
# trace) against op by op, beside the native checkpoints of their bit widths and the 1B bfloat16 one,
# with the compiled prefill's host split (--split; after bench-1b / prep-8b).
# save-cache: the load-time check results and MLX's PTX into $OUT/user-cache.tar.gz (a fresh machine's
# first load of a 1B Q4_K_M file ran past 150 s in load-time checks and first compiles, docs/performance.md); unpacked into
# .device-stage/b/cache/pymlxc/, install.sh gives them to the next machine.
# Results go to $OUT: tests.txt, probe.log, <stage>/compare_llama_cpp.{json,md,png}, <stage>.log.
# Pass --git-rev <commit> to the benchmark scripts when the lent copy's git metadata is stale.
# PEAK_MEMORY=1: bench-* also measure each side's peak GPU memory (nvidia-smi) over one generation at
# the longest prompt, each side in a process of its own (benchmarks/gpu_memory.py).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/gguf-gpu-out}
LCP=${LCP:-/tmp/lcp}
MODELS=${MODELS:-/tmp/pymlxc-llama-cpp-models}
LCP_SRC=${LCP_SRC:-.lcp/llama.cpp-src.tar.gz}  # llama.cpp's source tarball
STATE=/tmp/gguf-gpu-state  # outlives a call's $OUT: the background 8B preparation's log and done mark
export PYMLXC_LIB_DIR=${PYMLXC_LIB_DIR:-/tmp/pymlxc_lib}
# The gguf package from llama.cpp's own source (gguf-py), where pip cannot reach a registry.
export PYTHONPATH="$ROOT:$LCP/src/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
FORMATS_8B=${FORMATS_8B:-q4_0 q4_k_m}
mkdir -p "$OUT" "$STATE"

ensure_lib() {
  [ -f "$PYMLXC_LIB_DIR/stamp.json" ] || python3 build_mlxc.py --output "$PYMLXC_LIB_DIR"
}

wait_build() {  # until the background build has left the tools (or stopped)
  for _ in $(seq 1 120); do
    if grep -q "llama.cpp tools in" "$LCP/build.log" 2>/dev/null; then return 0; fi
    if ! pgrep -f "compare_llama_cpp.py --build-only" >/dev/null; then
      echo "llama.cpp build stopped:"; tail -30 "$LCP/build.log"; return 1
    fi
    sleep 5
  done
  echo "llama.cpp build still running after 10 minutes"; return 1
}

bench() {  # bench <name> <compare_llama_cpp arguments...>
  local name=$1; shift
  ensure_lib
  wait_build
  python3 benchmarks/compare_llama_cpp.py --llama-cpp "$LCP" --models-dir "$MODELS" --out "$OUT/$name" "$@" \
    ${GIT_REV:+--git-rev "$GIT_REV"} ${PEAK_MEMORY:+--peak-memory} \
    2>&1 | tee "$OUT/$name.log" || echo "!!! $name failed (see $name.log)"
}

for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S) (${SECONDS}s into this call)"
  case "$stage" in
    build)
      mkdir -p "$LCP"
      if [ ! -f "$LCP/src/CMakeLists.txt" ]; then
        tar xzf "$LCP_SRC" -C "$LCP" && mv "$LCP/llama.cpp" "$LCP/src"
      fi
      setsid nohup python3 benchmarks/compare_llama_cpp.py --build-only --llama-cpp "$LCP" \
        --llama-cpp-src "$LCP_SRC" > "$LCP/build.log" 2>&1 < /dev/null &
      sleep 20; tail -5 "$LCP/build.log"
      ;;
    tests)
      ensure_lib
      # The mixed-precision checkpoint first: its children run the compiled path a crash would end.
      python3 -m pytest tests/reliability/test_mixed_precision.py tests/metal/test_gguf_kernels.py \
        tests/metal/test_gguf_quants.py tests/metal/test_gguf_dtype.py tests/metal/test_cuda_matvec.py \
        tests/metal/test_prefill_segments.py \
        -q -p no:cacheprovider -x 2>&1 | tee "$OUT/tests.txt" | tail -30 || true
      ;;
    prep-8b-bg)
      setsid nohup nice -n 19 bash "$0" prep-8b > "$STATE/prep-8b.log" 2>&1 < /dev/null &
      ;;
    prep-8b)  # FORMATS_8B's files; the F16 GGUF stays for the next formats, the float16 source goes
      ensure_lib
      wait_build
      rm -f "$STATE/prep-8b.done"
      # shellcheck disable=SC2086  # FORMATS_8B is a list of words
      python3 benchmarks/compare_llama_cpp.py --llama-cpp "$LCP" --models-dir "$MODELS" --out "$OUT/bench-8b" \
        --shapes llama-3.1-8b --formats $FORMATS_8B --prepare-only --threads 8 \
        && rm -rf "$MODELS/llama-3.1-8b-f16-src" && touch "$STATE/prep-8b.done"
      df -h /tmp | tail -1
      ;;
    clean-8b)  # the 8B files of the formats not in FORMATS_8B (benchmarked in an earlier call)
      for fmt in q4_0 q4_k_m q6_k q8_0; do
        case " $FORMATS_8B " in *" $fmt "*) ;; *) rm -f "$MODELS/llama-3.1-8b-$fmt.gguf" ;; esac
      done
      for bits in 4 6 8; do
        keep=0
        for fmt in $FORMATS_8B; do
          case "$fmt:$bits" in q4_0:4|q4_k_m:4|q6_k:6|q8_0:8) keep=1 ;; esac
        done
        [ "$keep" = 1 ] || rm -rf "$MODELS/llama-3.1-8b-${bits}bit"
      done
      case " $FORMATS_8B " in *" q4_k_m "*) ;; *) rm -rf "$MODELS/llama-3.1-8b-4bit-q4_k_m-mix" ;; esac
      df -h /tmp | tail -1
      ;;
    probe)  # the block kernels against MLX ops, MLX 4-bit and dense float16 per decode shape
      ensure_lib
      python3 benchmarks/profile/probe_gguf_blocks.py --out "$OUT/probe" 2>&1 | tee "$OUT/probe.log" || echo "!!! probe failed"
      ;;
    prefill-blocks)  # the Q4_K_M files' prefill through the compiled segments (their Q6_K layers'
      # rows dequantized outside the trace) against op by op, and the native format of the same shape
      ensure_lib
      # (--split: the compiled prefill's runner, graph build and one eval beside its time)
      for f in "$MODELS"/llama-3.2-1b-bf16 "$MODELS"/llama-3.2-1b-q4_k_m.gguf "$MODELS"/llama-3.2-1b-4bit-q4_k_m-mix \
               "$MODELS"/llama-3.1-8b-q4_k_m.gguf "$MODELS"/llama-3.1-8b-4bit-q4_k_m-mix; do
        [ -e "$f" ] || { echo "no $f"; continue; }
        python3 benchmarks/profile/probe_prefill.py "$f" --lengths 128 2048 --modes segmented off --repeats 5 --split \
          --out "$OUT/prefill-blocks-$(basename "$f" .gguf).json" 2>&1 | grep -E "tok/s|runner" || echo "!!! probe_prefill failed"
      done
      ;;
    save-cache)  # the machine's load-time check results and MLX's compiled kernels (ptx_cache.py), for
      # the next machine (same GPU, driver, MLX: both are keyed on them): unpack user-cache.tar.gz into
      # .device-stage/b/cache/pymlxc/, which install.sh copies over
      # shellcheck disable=SC2046  # the entries are a list of words
      tar czf "$OUT/user-cache.tar.gz" -C "$HOME/.cache/pymlxc" \
        $(cd "$HOME/.cache/pymlxc" && ls -d checks-* mlx-ptx 2>/dev/null) && ls -la "$OUT/user-cache.tar.gz"
      ;;
    planes-ab)  # the Q4_K_M files with the Q6_K planes against the file's layout (PYMLXC_CUDA_Q6K_PLANES),
      # alternated: prefill by probe_prefill.py, decode by ab.py (after bench-1b / prep-8b wrote them)
      ensure_lib
      for f in "$MODELS"/llama-3.2-1b-q4_k_m.gguf "$MODELS"/llama-3.1-8b-q4_k_m.gguf; do
        [ -f "$f" ] || { echo "no $f"; continue; }
        name=$(basename "$f" .gguf)
        for v in 0 auto 0 auto; do
          PYMLXC_CUDA_Q6K_PLANES=$v python3 benchmarks/profile/probe_prefill.py "$f" --lengths 128 2048 \
            --modes segmented --repeats 5 > "$OUT/prefill-$name-planes-$v.log" 2>&1 || echo "!!! probe_prefill failed"
          echo "--- $name PYMLXC_CUDA_Q6K_PLANES=$v"; tail -4 "$OUT/prefill-$name-planes-$v.log"
        done
        python3 benchmarks/profile/ab.py "$f" --case planes PYMLXC_CUDA_Q6K_PLANES=auto \
          --case file PYMLXC_CUDA_Q6K_PLANES=0 --rounds 2 --runs 2 --out "$OUT/ab-planes-$name.json" 2>&1 | tail -4
      done
      ;;
    bench-1b)
      # shellcheck disable=SC2086  # FORMATS_1B is a list of words
      bench bench-1b --shapes llama-3.2-1b --formats ${FORMATS_1B:-q4_0 q4_k_m q6_k q8_0} --matvec-off --drop-source ${BENCH_1B_ARGS:-}
      ;;
    bench-8b)
      # A machine handed back between calls (idle past the lender's release) comes back bare: no
      # files and no preparation running, so there is nothing to wait for.
      if [ ! -f "$STATE/prep-8b.done" ] && ! pgrep -f 'gpu_llama_cpp[.]sh prep-8b$' >/dev/null; then
        echo "no 8B files and no prep-8b running on this machine: run prep-8b first"; exit 1
      fi
      for _ in $(seq 1 100); do [ -f "$STATE/prep-8b.done" ] && break; sleep 5; done
      tail -5 "$STATE/prep-8b.log" 2>/dev/null || true; df -h /tmp | tail -1
      # shellcheck disable=SC2086
      bench "bench-8b-${FORMATS_8B// /-}" --shapes llama-3.1-8b --formats $FORMATS_8B --rounds 3 --matvec-off
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S) (${SECONDS}s)"
