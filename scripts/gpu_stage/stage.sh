#!/usr/bin/env bash
# Runs on the GPU machine, from the project root (scripts/gpu_stage/check.sh runs it first):
# unpacks prepare.sh's pack under $STAGE_ROOT (default /tmp) -- fbgemm-gpu into $STAGE_ROOT/site,
# the wheels installed there -- and writes $STAGE_ROOT/gpu_env.sh, which puts them and the project
# on PYTHONPATH (`. /tmp/gpu_env.sh`). ~25 s on the lent H200.
#
#   bash scripts/gpu_stage/stage.sh [PACK]          # default .gpu/stack.tar.xz
set -euo pipefail
pack=${1:-.gpu/stack.tar.xz}
root=${STAGE_ROOT:-/tmp}
if [ ! -f "$pack" ]; then
  echo "stage.sh: no pack at $pack: build it with 'bash scripts/gpu_stage/prepare.sh' and carry .gpu with the call" >&2
  exit 1
fi
rm -rf "$root/site" "$root/stack" && mkdir -p "$root/site" "$root/stack"
xz -d -T0 < "$pack" | tar xf - -C "$root/stack"
mv "$root"/stack/fbgemm_gpu* "$root/site/"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$root/site" "$root"/stack/wheels/*.whl
rm -rf "$root/stack"
echo "export PYTHONPATH=$root/site:$PWD\${PYTHONPATH:+:\$PYTHONPATH} PATH=$root/site/bin:\$PATH PYTHONUNBUFFERED=1" \
  > "$root/gpu_env.sh"
. "$root/gpu_env.sh"
# The training path's imports, here, where a missing package is cheapest to find.
python3 -c "import torch, fbgemm_gpu, torchrec, apps.dlrm.train, apps.hstu.train, components.dlrm, benchmarks.gpu_call
print('stage.sh: ready: torch', torch.__version__, 'torchrec', torchrec.__version__, 'sees a GPU:', torch.cuda.is_available())"
