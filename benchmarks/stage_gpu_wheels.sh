#!/usr/bin/env bash
# Downloads here, into .whl/ (git-ignored), the wheels the lent GPU machine lacks for the stages of
# benchmarks/run_on_gpu.sh beyond MLX itself (MLX's CUDA wheel comes through .device-stage/, see
# ../shared/tools/device-mlx-cuda/README.md): the server's stack for `serve` (FastAPI and what it
# needs beyond the machine's packages: OpenTelemetry's API among them), llguidance, and the `gguf`
# package that the GGUF tests import. The versions are the ones the test venv resolves.
#
#   bash benchmarks/stage_gpu_wheels.sh            # once, from the checkout's root
#   device call: carry [".device-stage/b", ".whl"], command starting with
#     source .device-stage/b/install.sh && python3 -m pip install -q --no-index --no-deps \
#       --no-compile --no-cache-dir --target /tmp/site .whl/*.whl; ...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-python3}
# Each as installed in this checkout's venv (pip show), so the GPU side runs what the tests ran.
names=(fastapi starlette sse-starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
       opentelemetry-api llguidance gguf)
specs=()
for name in "${names[@]}"; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "stage_gpu_wheels: $name is not installed here (pip install -e '.[test]')" >&2; exit 1; }
  specs+=("$name==$version")
done
platforms=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
           manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${tag}_x86_64")
done
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${specs[@]}"
du -sh .whl
