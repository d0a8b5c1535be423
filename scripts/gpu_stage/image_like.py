"""Makes SITE, the site-packages of a bare venv, hold the GPU machine's image's packages and nothing
else: those named in image.txt, linked from the environment of the Python that runs this (the 2.11
row's venv, whose torch is the image's).

    .venv-gpu-row/bin/python scripts/gpu_stage/image_like.py SITE

scripts/gpu_row.sh stages prepare.sh's pack on it: whatever the training path needs beyond the
image and the pack is then missing there too, as it would be on the machine. The versions are the
row's, not the image's: this checks which packages are there, not which versions.
"""

import importlib.metadata as metadata
import os
import re
import sys

IMAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "image.txt")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    with open(IMAGE) as f:
        return {normalize(name) for line in f if not line.startswith("#") for name in line.split()}


def link_image(site: str) -> list[str]:
    """Links each top-level entry (package, module, .dist-info) of the image's distributions into
    ``site``; returns the distributions linked. Scripts (bin/) are left out: the training path
    runs everything as ``python -m``."""
    wanted, linked = image_packages(), []
    for dist in metadata.distributions():
        if normalize(dist.metadata["Name"]) not in wanted:
            continue
        linked.append(dist.metadata["Name"])
        for top in {file.parts[0] for file in dist.files or ()} - {".."}:
            target = os.path.join(site, top)
            if not os.path.lexists(target):  # a namespace (nvidia/) once; the venv's own pip kept
                os.symlink(str(dist.locate_file(top)), target)
    return linked


if __name__ == "__main__":
    print(f"image_like.py: linked {len(link_image(sys.argv[1]))} of the image's packages into {sys.argv[1]}")
