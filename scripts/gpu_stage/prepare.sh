#!/usr/bin/env bash
# Packs what the lent GPU machines lack to train -- fbgemm-gpu 1.6.0 and carry.txt's wheels -- into
# ONE file, .gpu/stack.tar.xz (ignored by git), for a machine with torch 2.11 + CUDA 13 on Python
# 3.12 and no package registry (docs/development.md: The GPU machine's row). The device tool
# carries 64 MiB per call, the project's files included: fbgemm-gpu's 465 MB wheel fits because
# slim_fbgemm.py zeroes the kernels an sm_90 GPU never loads first (xz then packs ~52 MiB).
#
#   bash scripts/gpu_stage/prepare.sh        # here, from the project root: ~1.5-3 min of xz on 2 cores
#   bash scripts/gpu_stage/check.sh          # there (carry .gpu): stages it, then checks the GPU path
#
# FBGEMM_DIST=fbgemm-gpu-cpu packs the CPU build instead (it has no kernels to zero), and
# GPU_STAGE_DIR another folder: scripts/gpu_row.sh stages such a pack on an image like the
# machine's, to check on CPU that the pack and its staging suffice.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${GPU_STAGE_DIR:-.gpu}
#: The device tool's limit per call is 64 MiB; this keeps room for the project's files to grow.
limit_mib=60
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip=(python3 -m pip -q --disable-pip-version-check)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"${pip[@]}" download --no-deps "${plat[@]}" -d "$work/big" "${FBGEMM_DIST:-fbgemm-gpu}==1.6.0"
mkdir -p "$work/stack/wheels"
"${pip[@]}" download --no-deps "${plat[@]}" -d "$work/stack/wheels" -r "$here/carry.txt" -c requirements.txt
# torchrec's iopath has no wheel on PyPI: built here (pure Python), so that the machine installs
# wheels alone, with no build backend to fetch.
"${pip[@]}" wheel --no-deps -w "$work/stack/wheels" -c requirements.txt iopath
(cd "$work/stack" && unzip -q "$work"/big/*.whl)
python3 "$here/slim_fbgemm.py" "$work/stack"
(cd "$work/stack" && tar cf - fbgemm_gpu fbgemm_gpu*.dist-info wheels) | xz -6 -T0 > "$work/stack.tar.xz"
# The size the device call carries: the pack and the files that travel with it (tracked, and
# untracked ones that git does not ignore).
pack=$(stat -c %s "$work/stack.tar.xz")
project=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total_mib=$(( (pack + project + 1048575) / 1048576 ))
if [ "$total_mib" -gt "$limit_mib" ]; then
  echo "prepare.sh: the pack ($((pack / 1048576)) MiB) and the project ($((project / 1048576)) MiB) make ${total_mib} MiB, over the ${limit_mib} MiB one device call may carry: zero more in slim_fbgemm.py or carry less" >&2
  exit 1
fi
rm -rf "$dest" && mkdir -p "$dest" && mv "$work/stack.tar.xz" "$dest/"
echo "prepare.sh: $dest/stack.tar.xz $(awk "BEGIN {printf \"%.1f\", $pack / 1048576}") MiB; with the project $(awk "BEGIN {printf \"%.1f\", ($pack + $project) / 1048576}") MiB of the ${limit_mib} MiB a device call may carry"
