#!/usr/bin/env bash
# Runs on the GPU machine, from the project root, once per part that scripts/gpu_stage/prepare.sh
# packed (bash .gpu/pN/stage.sh): collects the part under $STAGE_ROOT/fb (default /tmp/fb); once
# every chunk of fbgemm-gpu is there, unpacks it and installs the small wheels into
# $STAGE_ROOT/site, and writes $STAGE_ROOT/gpu_env.sh. `source /tmp/gpu_env.sh` then puts them
# and the project on PYTHONPATH, and their scripts (torchx) on PATH.
set -euo pipefail
part=$(cd "$(dirname "$0")" && pwd)
root=${STAGE_ROOT:-/tmp}
mkdir -p "$root/fb" && cp -r "$part"/. "$root/fb/"
for chunk in $(cat "$root/fb/fb.list"); do
  if [ ! -f "$root/fb/$chunk" ]; then echo "stage.sh: $(basename "$part") collected; carry the part with $chunk next"; exit 0; fi
done
if [ ! -d "$root/site/fbgemm_gpu" ]; then
  mkdir -p "$root/site"
  (cd "$root/fb" && cat $(cat fb.list)) | xz -d -T0 | tar xf - -C "$root/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$root/site" "$root"/fb/small/*.whl
fi
echo "export PYTHONPATH=$root/site:$PWD\${PYTHONPATH:+:\$PYTHONPATH} PATH=$root/site/bin:\$PATH PYTHONUNBUFFERED=1" \
  > "$root/gpu_env.sh"
. "$root/gpu_env.sh"
# The training path's imports, here, where a missing package is cheapest to find.
python3 -c "import torch, apps.dlrm.train, apps.dlrm.torchrun, benchmarks.gpu_check, components.dlrm
print('stage.sh: ready: torch', torch.__version__, 'sees a GPU:', torch.cuda.is_available())"
