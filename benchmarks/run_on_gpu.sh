#!/usr/bin/env bash
# Runs pymlxc's GPU checks and benchmarks in stages, each sized for one 10-minute call on a lent GPU
# machine: build libmlxc against MLX's CUDA wheel, smoke-test the binding, run the binding and model
# parity tests, then benchmarks/compare_mlx_lm.py at full size and the profiling probes.
#
# Run from the repo root after the CUDA wheel is installed (see ../shared/tools/device-mlx-cuda/README.md):
#
#   device call 1:  bash .device-stage/a/stash.sh                          carry [".device-stage/a"]
#   device call 2:  source .device-stage/b/install.sh && bash benchmarks/run_on_gpu.sh setup tests
#                                                                          carry [".device-stage/b"]
#   device call 3:  source .device-stage/b/install.sh --no-install && bash benchmarks/run_on_gpu.sh targets
#
# The cuda-tests and serve stages need wheels the machine lacks (gguf; FastAPI and its stack):
# `bash benchmarks/stage_gpu_wheels.sh` puts them in .whl/; carry ".whl" with call 2 and install them
# right after install.sh: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#
# What the stages took on one H100 (MLX 0.32.4), for sizing calls: wheel install 20 s; libmlxc 15 s;
# the Qwen3.5-35B-A3B model written in 20-30 s, loaded in 21 s (pymlxc) and 26 s (mlx-lm); its
# 128-token case about 3 minutes; serve for one shape and both servers at 1,4,16,64 clients about
# 2 minutes; llama.cpp's CUDA build (gpu_llama_cpp.sh build) 188 s on 32 cores. The machine goes
# back 30 s after a call: have the next command ready.
#
# A stage that needs libmlxc builds it first when the machine went cold (about a minute); the random
# models stay in /tmp/pymlxc-bench-models while the machine is warm. Results go to $OUT:
# $OUT/<stage>/compare_mlx_lm.{json,png} and log.txt, $OUT/tests/pytest.txt. `report` merges the
# bench results present in this call's $OUT. To update the results page from several calls' parts,
# run here afterwards (the latest run of each case is kept, with its commit, date and command):
#   python benchmarks/compare_mlx_lm.py --merge benchmarks/results/h100.json <part>/compare_mlx_lm.json ... \
#       --out benchmarks/results/h100.json
#
# The lent machine's copy of the checkout may carry stale git metadata: give compare_mlx_lm.py
# --git-rev <this checkout's commit> (GIT_REV=<commit> for the stages) so that the JSON names the code that ran.
#
# Stages:
#   setup, smoke, tests   build libmlxc, a binding smoke test, the binding and model parity tests
#   targets               the results page's cases: the 1B-class shapes (bf16, 4-bit) and Llama-3.1-8B 4-bit
#   bench-1b, bench-gemma, bench-8b
#                         the same cases with more sides (uncompiled decode, no evaluation thread)
#   variants              Llama-3.2-1B and Qwen3-0.6B with the whole-step graph, segmented and uncompiled sides
#   profile, probe        benchmarks/profile/profile_generation.py and probe_decode.py: where a token's time goes
#   matvec, matvec-bench  the 4-bit CUDA matvec kernel (backends/metal/kernels/matvec.py): its GPU tests,
#                         benchmarks/profile/probe_matvec.py, the 8B shape without it and the 1B shapes forced onto it
#   graphs                CUDA kernels per decode step of both sides (benchmarks/profile/probe_cuda_graphs.py)
#   cuda-tests            every CUDA kernel's test against its MLX-ops version, bounded by CUDA_TESTS_TIMEOUT
#   qwen35                the Qwen3.5-35B-A3B shape in 4-bit against mlx-lm (decode, prefill of 2048)
#   serve                 benchmarks/serve_load.py against mlx_lm.server (SERVE_SHAPES, SERVE_CLIENTS), after
#                         benchmarks/profile/probe_batch_step.py (the batch's decode step without HTTP)
#   distributed           benchmarks/compare_distributed.py over NCCL on 1..all GPUs (DIST_QUANTS: 4 and/or 16)
#   report                merge this call's bench results;  all = setup smoke tests bench-1b bench-gemma bench-8b report
# Options: --dry-run (print the commands only), --cpu-check (run every stage on this machine's CPU
# with tiny shapes: checks the plumbing, not the numbers).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/pymlxc-gpu-out}
LIB_DIR=${PYMLXC_LIB_DIR:-/tmp/pymlxc_lib}
MODELS=${PYMLXC_BENCH_MODELS:-/tmp/pymlxc-bench-models}
PY=${PYTHON:-python3}
DRY=0
CPU=0
stages=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --cpu-check) CPU=1 ;;
    setup|smoke|tests|cuda-tests|bench-1b|bench-gemma|bench-8b|variants|profile|probe|matvec|matvec-bench|targets|qwen35|serve|distributed|graphs|report) stages+=("$arg") ;;
    all) stages+=(setup smoke tests bench-1b bench-gemma bench-8b report) ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "run_on_gpu.sh: unknown stage or option: $arg" >&2; exit 2 ;;
  esac
done
[ ${#stages[@]} -gt 0 ] || { echo "run_on_gpu.sh: name at least one stage (or all); --help lists them" >&2; exit 2; }

if [ "$CPU" = 1 ]; then
  # Plumbing check on a CPU: the venv's MLX and libmlxc, tiny shapes, a scratch output folder.
  LIB_DIR=${PYMLXC_LIB_DIR:-$ROOT/pymlxc/_lib}
  OUT=${OUT_CPU_CHECK:-/tmp/pymlxc-gpu-cpu-check}
  MODELS=/tmp/pymlxc-gpu-cpu-check-models
fi
export PYMLXC_LIB_DIR="$LIB_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

run() {  # echo, then run unless --dry-run; the log of the stage keeps both
  echo "+ $*"
  if [ "$DRY" = 0 ]; then "$@"; fi
}

stamp() { echo "=== $1 $(date -u +%H:%M:%S) (${SECONDS}s into this call)"; }

ensure_lib() {
  if [ -f "$LIB_DIR/stamp.json" ] && [ -f "$LIB_DIR/cdef.h" ]; then
    return 0
  fi
  run "$PY" build_mlxc.py --output "$LIB_DIR"
}

bench_args=()
if [ "$CPU" = 1 ]; then
  # Tiny stand-ins: the same code paths on the CPU in a couple of minutes.
  bench_args=(--cpu --layers 2 --prompt-lengths 16 --max-tokens 8 --runs 3 --load-runs 1 --quant f32)
fi

bench() {  # bench <stage name> <compare_mlx_lm arguments...>
  local name=$1; shift
  ensure_lib
  mkdir -p "$OUT/$name"
  # A failed part does not stop the later ones (their device minutes are not wasted); its log says why.
  run "$PY" benchmarks/compare_mlx_lm.py --models-dir "$MODELS" --out "$OUT/$name" "$@" "${bench_args[@]}" \
    ${GIT_REV:+--git-rev "$GIT_REV"} \
    2>&1 | tee "$OUT/$name/log.txt" || echo "!!! $name failed (see $OUT/$name/log.txt)"
}

for stage in "${stages[@]}"; do
  stamp "$stage"
  case "$stage" in
    setup)
      run "$PY" -c "import mlx.core as mx, sys; print('mlx', mx.__version__, mx.default_device(), sys.version.split()[0])"
      if [ "$DRY" = 0 ] && [ "$CPU" = 0 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true; fi
      ensure_lib
      if [ "$DRY" = 0 ] && [ -f "$LIB_DIR/stamp.json" ]; then cat "$LIB_DIR/stamp.json" > "$OUT/libmlxc_stamp.json"; fi
      ;;
    smoke)
      ensure_lib
      run "$PY" - <<'PY'
import benchmarks._path  # noqa: F401 - backends as pymlxc.backends
import pymlxc.core as mx
import mlx.core as mlx
print("pymlxc default device:", mx.default_device(), "| mlx:", mlx.default_device())
a = mx.random.normal((256, 256), key=mx.random.key(0))
b = (a @ a.T).sum()
ref = mlx.array(a.tolist())
want = float((ref @ ref.T).sum())
print("matmul sum", b.item(), "mlx", want)
assert abs(b.item() - want) <= 1e-3 * max(1.0, abs(want)), "binding and mlx disagree"
f = mx.compile(lambda x: [mx.exp(x[0]) * 2.0 + 1.0])
print("compiled", f([mx.ones((4,))])[0].tolist())
from pymlxc import settings
print("settings:", settings.current())
PY
      ;;
    tests)
      ensure_lib
      tests=(tests/metal/test_models_parity.py tests/metal/test_compiled_decode.py)
      if [ -d tests/binding ]; then tests=(tests/binding "${tests[@]}"); fi
      mkdir -p "$OUT/tests"
      # -p no:cacheprovider: the checkout may be read-only for .pytest_cache; a failure stops the stage
      # but its log comes back.
      run "$PY" -m pytest "${tests[@]}" -x -q -p no:cacheprovider 2>&1 | tee "$OUT/tests/pytest.txt" \
        || echo "!!! tests failed (see $OUT/tests/pytest.txt)"
      ;;
    bench-1b)
      # Llama-3.2-1B and Qwen3-0.6B, bfloat16 and 4-bit, prompts of 128 and 2048, 256 tokens.
      if [ "$CPU" = 1 ]; then bench bench-1b --shapes llama-3.2-1b-narrow qwen3-0.6b-narrow --uncompiled
      else bench bench-1b --shapes llama-3.2-1b qwen3-0.6b --quant bf16 4bit --uncompiled --nothread; fi
      ;;
    bench-gemma)
      if [ "$CPU" = 1 ]; then bench bench-gemma --shapes gemma-3-1b-narrow
      else bench bench-gemma --shapes gemma-3-1b --quant bf16 4bit --nothread; fi
      ;;
    bench-8b)
      if [ "$CPU" = 1 ]; then bench bench-8b --shapes llama-3.2-1b-narrow --layers 4
      else bench bench-8b --shapes llama-3.1-8b --quant 4bit --nothread; fi
      ;;
    variants)
      if [ "$CPU" = 1 ]; then bench variants --shapes llama-3.2-1b-narrow qwen3-0.6b-narrow --uncompiled --segmented
      else bench variants --shapes llama-3.2-1b qwen3-0.6b --quant bf16 4bit --uncompiled --segmented; fi
      ;;
    profile)
      ensure_lib
      mkdir -p "$OUT/profile"
      if [ "$CPU" = 1 ]; then prof_args=(--cpu --shape llama-3.2-1b-narrow --quant f32 --layers 2 --prompt 16 --max-tokens 8)
      else prof_args=(--shape llama-3.2-1b --quant bf16 --prompt 128 --max-tokens 128); fi
      run "$PY" benchmarks/profile/profile_generation.py --models-dir "$MODELS" --out "$OUT/profile" "${prof_args[@]}" \
        2>&1 | tee "$OUT/profile/log.txt" || echo "!!! profile failed (see $OUT/profile/log.txt)"
      ;;
    probe)
      # Where a token's time goes (host build, MLX encode, device), per decode path, with and
      # without the evaluation thread; MLX's per-op cost; cuDNN vs sdpa_vector; peak memory.
      ensure_lib
      mkdir -p "$OUT/probe"
      if [ "$CPU" = 1 ]; then probe_args=(--cpu --shape llama-3.2-1b-narrow --quant f32 --layers 2 --prompts 16 --max-tokens 8 --runs 2)
      else probe_args=(--shape llama-3.2-1b --quant bf16 --prompts 128 2048 --max-tokens 128 --runs 3); fi
      run "$PY" benchmarks/profile/probe_decode.py --models-dir "$MODELS" --out "$OUT/probe" "${probe_args[@]}" \
        2>&1 | tee "$OUT/probe/log.txt" || echo "!!! probe failed (see $OUT/probe/log.txt)"
      ;;
    matvec)
      ensure_lib
      mkdir -p "$OUT/matvec-tests"
      run "$PY" -m pytest tests/metal/test_cuda_matvec.py tests/metal/test_prefill_segments.py -q -p no:cacheprovider \
        2>&1 | tee "$OUT/matvec-tests/pytest.txt" || echo "!!! matvec tests failed (see $OUT/matvec-tests/pytest.txt)"
      if [ "$CPU" = 1 ]; then bench matvec-8b --shapes llama-3.2-1b-narrow --layers 4 --cuda-matvec 0
      else
        run "$PY" benchmarks/profile/probe_matvec.py --out "$OUT/matvec-probe" 2>&1 | tail -30 \
          || echo "!!! probe_matvec failed"
        bench matvec-8b --shapes llama-3.1-8b --quant 4bit --cuda-matvec 0
      fi
      ;;
    matvec-bench)
      if [ "$CPU" = 1 ]; then bench matvec-1b --shapes llama-3.2-1b-narrow qwen3-0.6b-narrow --cuda-matvec 1
      else
        bench matvec-1b --shapes llama-3.2-1b qwen3-0.6b --quant bf16 4bit --cuda-matvec 1
        bench matvec-gemma --shapes gemma-3-1b --quant bf16 4bit --cuda-matvec 1
      fi
      ;;
    targets)
      if [ "$CPU" = 1 ]; then bench targets --shapes llama-3.2-1b-narrow qwen3-0.6b-narrow
      else
        bench targets-1b --shapes llama-3.2-1b qwen3-0.6b gemma-3-1b --quant bf16 4bit
        bench targets-8b --shapes llama-3.1-8b --quant 4bit --cuda-matvec 0
      fi
      ;;
    graphs)
      ensure_lib
      mkdir -p "$OUT/graphs"
      for shape in llama-3.2-1b qwen3-0.6b; do
        for side in pymlxc mlx_lm; do
          run "$PY" benchmarks/profile/probe_cuda_graphs.py --side "$side" --shape "$shape" --quant bf16 \
            --models-dir "$MODELS" --out "$OUT/graphs" 2>&1 | tee -a "$OUT/graphs/log.txt" || echo "!!! graphs $side $shape failed"
        done
      done
      ;;
    cuda-tests)
      # The CUDA kernels (matvec, argmax, add+norm, RoPE+KV, the GGUF block kernels, gated delta) against
      # their MLX-ops versions, the compiled and segmented decode paths, and Qwen3-Next/3.5 parity;
      # bounded, so that a hang cannot take the call's later stages with it.
      ensure_lib
      mkdir -p "$OUT/cuda-tests"
      # Compiling a kernel template (NVRTC) takes a second or more, and the matvec tests compile one per
      # row count, group and dtype: give the stage minutes, and each test a bound (pytest-timeout is on
      # the GPU machine) so that one slow test is named rather than stopping the stage.
      per_test=()
      if "$PY" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout "${CUDA_TEST_TIMEOUT:-180}"); fi
      run timeout "${CUDA_TESTS_TIMEOUT:-480}" "$PY" -m pytest "${per_test[@]}" -rfE \
        tests/metal/test_cuda_matvec.py \
        tests/metal/test_cuda_argmax.py tests/metal/test_cuda_norm.py tests/metal/test_cuda_rope_kv.py \
        tests/metal/test_gguf_kernels.py tests/metal/test_gated_delta.py tests/metal/test_compiled_decode.py \
        tests/metal/test_prefill_segments.py tests/metal/test_qwen3_next.py -q -p no:cacheprovider \
        2>&1 | tee "$OUT/cuda-tests/pytest.txt" || echo "!!! cuda tests failed or timed out (see $OUT/cuda-tests/pytest.txt)"
      ;;
    qwen35)
      # The Qwen3.5-35B-A3B shape in 4-bit (Gated DeltaNet + 256 experts): decode and 2048-token prefill.
      # Two runs, so that the decode numbers survive a prefill run cut short by the call's limit.
      saved=("${bench_args[@]}")
      if [ "$CPU" = 1 ]; then  # 4 layers: one of them full attention (every fourth), as mlx-lm needs
        q35=(--shapes qwen3.5-35b-a3b-narrow); bench_args=("${bench_args[@]}" --layers 4)
      else q35=(--shapes qwen3.5-35b-a3b --quant 4bit --load-runs 1); fi
      bench qwen35-decode "${q35[@]}" --prompt-lengths 128
      # 1024 beside 2048, few tokens (prefill is timed to the first token): how prefill grows with the prompt.
      bench qwen35-prefill "${q35[@]}" --prompt-lengths 1024 2048 --max-tokens 16
      bench_args=("${saved[@]}")
      ;;
    serve)
      # benchmarks/serve_load.py: streaming clients against pymlxc serve and mlx_lm.server, per shape in
      # SERVE_SHAPES (4-bit, with a byte-level tokenizer so that both servers take text).
      ensure_lib
      mkdir -p "$OUT/serve"
      if [ "$CPU" = 1 ]; then serve_shapes=(llama-3.2-1b-narrow); serve_extra=(--layers 2)
      else read -r -a serve_shapes <<< "${SERVE_SHAPES:-llama-3.2-1b llama-3.1-8b}"; serve_extra=(); fi
      for shape in "${serve_shapes[@]}"; do
        dir="$MODELS/serve-$shape-4bit"
        [ -f "$dir/config.json" ] || run "$PY" -m pymlxc.testing.shapes "$shape" "$dir" --bits 4 --tokenizer "${serve_extra[@]}"
        # The batch's decode step without HTTP, per batch size: what serve_load's latencies build on.
        # shellcheck disable=SC2086  # SERVE_PROBE_BATCH is a list of words
        run "$PY" benchmarks/profile/probe_batch_step.py "$dir" --batch ${SERVE_PROBE_BATCH:-1 4 8 16 32 64} \
          --out "$OUT/serve/probe_batch_step-$shape.json" 2>&1 | tee -a "$OUT/serve/log.txt" || echo "!!! probe $shape failed"
        run "$PY" benchmarks/serve_load.py --model "$dir" --clients "${SERVE_CLIENTS:-1,4,16,64}" \
          --out "$OUT/serve/serve_load-$shape.json" 2>&1 | tee -a "$OUT/serve/log.txt" || echo "!!! serve $shape failed"
      done
      ;;
    distributed)
      # benchmarks/compare_distributed.py over NCCL on this machine's GPUs (one rank a GPU): the
      # Llama-3.1-8B shape, tensor and pipeline, against mlx-lm's sharded generation.
      ensure_lib
      mkdir -p "$OUT/distributed"
      gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
      ranks=(1); for n in 2 4 8; do [ "$gpus" -ge "$n" ] && ranks+=("$n"); done
      for q in ${DIST_QUANTS:-4}; do
        dir="$MODELS/dist-llama-3.1-8b-${q}bit"
        [ -f "$dir/config.json" ] || run "$PY" -m pymlxc.testing.shapes llama-3.1-8b "$dir" --bits "$q" --tokenizer
        run "$PY" benchmarks/compare_distributed.py "$dir" --ranks "${ranks[@]}" --backend nccl --timeout 400 \
          > "$OUT/distributed/compare_distributed-${q}bit.jsonl" 2> >(tee -a "$OUT/distributed/log.txt" >&2) \
          || echo "!!! distributed ${q}bit failed"
      done
      ;;
    report)
      mkdir -p "$OUT/report"
      parts=()
      for part in bench-1b bench-gemma bench-8b variants targets-1b targets-8b; do
        if [ -f "$OUT/$part/compare_mlx_lm.json" ]; then parts+=("$OUT/$part/compare_mlx_lm.json"); fi
      done
      if [ ${#parts[@]} -eq 0 ] && [ "$DRY" = 0 ]; then echo "no bench results in $OUT yet" >&2; exit 1; fi
      run "$PY" benchmarks/compare_mlx_lm.py --merge "${parts[@]}" --out "$OUT/report" 2>&1 | tee "$OUT/report/results.md"
      ;;
  esac
done
stamp done
