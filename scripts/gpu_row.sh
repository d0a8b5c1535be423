#!/usr/bin/env bash
# The GPU machine's version row -- torch 2.11, fbgemm-gpu 1.6.0, torchrec 1.6.1 on Python 3.12
# (README: The GPU machine's row) -- built and run on this CPU machine: the cheap place to find
# what breaks there before GPU time is spent on it. `make test-gpu-row` runs it.
#
#   bash scripts/gpu_row.sh           # build the row's venv (once), then check the project on it
#   bash scripts/gpu_row.sh install   # only build it
#
# The venv (GPU_ROW_VENV, default .venv-gpu-row) is rebuilt only when what builds it changes.
# PyPI's torch 2.11 is its CUDA 13 build (~530 MB to download, ~5 GB installed), as on the GPU
# machine; it runs on CPU. fbgemm-gpu-cpu 1.6.0 stands in for fbgemm-gpu 1.6.0.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_ROW_VENV:-.venv-gpu-row}
# The GPU machine's Python (the system python3 here is 3.11).
PYTHON312=${PYTHON312:-/root/.pyenv/versions/3.12.1/bin/python3}

install_row() {
  local stamp
  stamp=$(cat scripts/install.sh requirements.txt requirements-test.txt setup.py scripts/gpu_stage/* | sha256sum)
  if [ "$(cat "$VENV/.installed" 2>/dev/null)" = "$stamp" ]; then return; fi
  VERSION_ROW=2.11 DEVICE=cpu WITH_TESTS=1 VENV="$VENV" PYTHON="$PYTHON312" bash scripts/install.sh
  build_image
  echo "$stamp" > "$VENV/.installed"
}

# An image like the GPU machine's: a bare venv of the row's Python holding only the image's
# packages (scripts/gpu_stage/image.txt, linked from the row's venv), and what prepare.sh packs
# for the machine, in its one part, fbgemm-gpu-cpu standing in for fbgemm-gpu.
build_image() {
  rm -rf "$VENV/image" "$VENV/gpu"
  "$PYTHON312" -m venv "$VENV/image"
  "$VENV/bin/python" scripts/gpu_stage/image_like.py \
    "$("$VENV/image/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  GPU_STAGE_DIR="$VENV/gpu" FBGEMM_DIST=fbgemm-gpu-cpu bash scripts/gpu_stage/prepare.sh
}

# The one device call of the machine (scripts/gpu_stage/check.sh) on that image: it stages the
# pack as there, then runs every step's command line, quick, on CPU. A package the pack lacks, or
# an option a step's command line gets wrong, fails here.
check_staged() (
  export PATH="$PWD/$VENV/image/bin:$PATH"
  GPU_STAGE_PACK="$VENV/gpu/stack.tar.xz" STAGE_ROOT="$work/stage" OUT="$work/call" GPU_CALL_DIR="$work/steps" \
    bash scripts/gpu_stage/check.sh --on_cpu || {
      # The work folder goes on exit: keep the steps' logs of a failure to read.
      mkdir -p outputs && cp "$work/call/gpu_call.tar.gz" outputs/gpu_row_failed.tar.gz
      echo "gpu_row.sh: a step failed; its logs: outputs/gpu_row_failed.tar.gz" >&2
      return 1
    }
  echo "gpu_row.sh: the staged pack suffices on an image like the GPU machine's, and every step of check.sh ran on it"
)

# On the row, as a user runs them: the unit tier; the main job, short, with a checkpoint; the same
# job again, longer, which must resume from that checkpoint; the plan preview, for CPU ranks and
# (the planner's HBM and UVM-caching path) for a GPU.
check_row() {
  export PATH="$PWD/$VENV/bin:$PATH"
  python -m pytest -m unit tests
  local job=(torchx run -s local_cwd components.dlrm:train -j 1x2 --checkpoint_dir "$work/ckpt"
             --output_dir "$work/outputs/{run}" --log_every 20)
  "${job[@]}" --steps 40
  "${job[@]}" --steps 60
  python - "$work/outputs/latest/summary.json" <<'PY'
import json, sys

summary = json.load(open(sys.argv[1]))
assert (summary["resumed_from_step"], summary["steps"]) == (40, 60), summary
print("gpu_row.sh: the second job resumed from step 40 and trained to 60")
PY
  python -m apps.dlrm.plan -j 1x2
  torchx run -s local_cwd components.dlrm:plan -j 1x1 --gpu 1 --memMB 65536 --hbm_gb 8 \
    --num_sparse_features 8 --num_embeddings 10000000 --embedding_dim 128 --dense_arch_layer_sizes 512,256,128
  echo "gpu_row.sh: the GPU machine's row passed on $VENV"
}

export OMP_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
install_row
[ "${1:-}" = install ] && exit
check_staged
check_row
