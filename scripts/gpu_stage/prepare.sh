#!/usr/bin/env bash
# Packs what the lent GPU machines lack to train -- fbgemm-gpu 1.6.0 and carry.txt's wheels --
# for a machine with torch 2.11 + CUDA 13 on Python 3.12 and no package registry (README: The GPU
# machine's row). The device tool carries < 64 MiB per call, so the pack is split into parts
# .gpu/p1, .gpu/p2, ... (ignored by git): fbgemm-gpu's ~465 MB wheel, recompressed with xz, is
# ~176 MB in three chunks of 59 MB (about 5 minutes of CPU); p1 also holds the small wheels.
#
#   bash scripts/gpu_stage/prepare.sh        # here, from the project root
#   bash .gpu/pN/stage.sh                    # there, from the project root, each part in turn
#
# FBGEMM_DIST=fbgemm-gpu-cpu packs the CPU build instead, and GPU_STAGE_CHUNK_BYTES makes smaller
# chunks: scripts/gpu_row.sh stages such a pack, in several parts, on an image like the machine's,
# to check on CPU that the pack and its staging suffice.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${GPU_STAGE_DIR:-.gpu}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip=(python3 -m pip -q --disable-pip-version-check)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"${pip[@]}" download --no-deps "${plat[@]}" -d "$work/big" "${FBGEMM_DIST:-fbgemm-gpu}==1.6.0"
"${pip[@]}" download --no-deps "${plat[@]}" -d "$work/small" -r "$here/carry.txt" -c requirements.txt
# torchrec's iopath has no wheel on PyPI: built here (pure Python), so that the machine installs
# wheels alone, with no build backend to fetch.
"${pip[@]}" wheel --no-deps -w "$work/small" -c requirements.txt iopath
(cd "$work/big" && unzip -q ./*.whl && rm ./*.whl \
   && tar cf - fbgemm_gpu fbgemm_gpu*.dist-info | xz -6 -T0 | split -b "${GPU_STAGE_CHUNK_BYTES:-59000000}" -d -a 1 - ../fb.)
rm -rf "$dest"
chunks=$(cd "$work" && ls fb.*)
n=1
for chunk in $chunks; do
  mkdir -p "$dest/p$n"
  mv "$work/$chunk" "$dest/p$n/"
  echo "$chunks" > "$dest/p$n/fb.list"  # stage.sh installs once every chunk has arrived
  cp "$here/stage.sh" "$dest/p$n/"
  n=$((n + 1))
done
mv "$work/small" "$dest/p1/"
du -sh "$dest"/p*
