"""The Dockerfile builds the image that container schedulers run components.dlrm:train in.

Docker cannot run here, so these tests read the Dockerfile with BuildKit's own parser (the
`dockerfile` package) and check what the image depends on: its torch / fbgemm-gpu / torchrec come
from scripts/install.sh with DEVICE=cuda, and a role's `torchrun -m apps.dlrm.train` finds both
the venv and the project.
"""

import fnmatch
import os
import re
import shlex

import dockerfile
import pytest

from components.launch import DEFAULT_IMAGE
from tests.conftest import REPO


def read(name: str) -> str:
    with open(os.path.join(REPO, name)) as f:
        return f.read()


@pytest.fixture(scope="module")
def instructions() -> tuple:
    return dockerfile.parse_file(os.path.join(REPO, "Dockerfile"))


def only(instructions, cmd: str):
    found = [i for i in instructions if i.cmd == cmd]
    assert len(found) == 1, f"expected one {cmd}, found {[i.original for i in found]}"
    return found[0]


def install_step(instructions) -> dict[str, str]:
    """The environment of the one RUN that calls scripts/install.sh."""
    (step,) = [i for i in instructions if i.cmd == "RUN" and "scripts/install.sh" in i.value[0]]
    words = shlex.split(step.value[0])
    assert words[-2:] == ["bash", "scripts/install.sh"], step.original
    return dict(word.split("=", 1) for word in words[:-2])


def install_script_stack(device: str) -> dict[str, str]:
    """package -> version that scripts/install.sh installs for DEVICE=device."""
    script = read("scripts/install.sh")
    versions = dict(re.findall(r"^(TORCH|FBGEMM|TORCHREC)_VERSION=(\S+)$", script, re.M))
    fbgemm = re.search(rf"^\s*{device}\) FBGEMM=(\S+) ;;$", script, re.M)
    assert fbgemm and len(versions) == 3, "scripts/install.sh no longer reads as expected"
    return {"torch": versions["TORCH"], fbgemm[1]: versions["FBGEMM"], "torchrec": versions["TORCHREC"]}


def test_the_image_gets_its_stack_from_the_install_script_for_cuda(instructions):
    args = dict(i.value[0].split("=", 1) for i in instructions if i.cmd == "ARG")
    base = only(instructions, "FROM").value[0]
    assert re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], base).startswith("nvidia/cuda:"), base
    assert install_step(instructions)["DEVICE"] == "cuda"
    # ... and from nowhere else: no RUN of its own installs or pins a package of the stack.
    stack = re.compile(r"\b(torch|torchrec|fbgemm[-_]gpu(-cpu)?)\s*[=<>~]=")
    for run in (i for i in instructions if i.cmd == "RUN"):
        assert not stack.search(run.value[0]), run.original


def test_the_image_stack_is_the_readme_matrix_gpu_column():
    rows = {}
    for line in read("README.md").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3:
            rows.setdefault(cells[0], cells[2])  # package | CPU machine | machine with an NVIDIA GPU
    stack = install_script_stack("cuda")
    assert stack.keys() == {"torch", "fbgemm-gpu", "torchrec"}
    assert rows["torch"].startswith(stack["torch"] + " "), rows["torch"]
    assert rows["FBGEMM"] == f"fbgemm-gpu {stack['fbgemm-gpu']}", rows["FBGEMM"]
    assert rows["torchrec"].startswith(stack["torchrec"] + ","), rows["torchrec"]


def test_a_role_finds_the_venv_and_the_project_in_the_image(instructions):
    # TorchX's container schedulers start `bash -c "torchrun ... -m apps.dlrm.train"` in the
    # image's working directory with its PATH: the project must be copied there, and the venv
    # that install.sh builds must come first on PATH.
    workdir = only(instructions, "WORKDIR").value[0]
    assert only(instructions, "COPY").value == (".", "."), "the build context is copied into WORKDIR"
    assert install_step(instructions)["VENV"] + "/bin" == env_of(instructions)["PATH"].split(":")[0]
    assert workdir.startswith("/")
    # The schedulers set the container's command; an ENTRYPOINT would be prepended to it.
    assert not [i for i in instructions if i.cmd == "ENTRYPOINT"]


def env_of(instructions) -> dict[str, str]:
    env = {}
    for i in (i for i in instructions if i.cmd == "ENV"):
        env.update(zip(i.value[::2], i.value[1::2]))
    return env


def test_the_documented_build_tags_the_component_default_image():
    assert f"docker build -t {DEFAULT_IMAGE} ." in read("Dockerfile")


def test_the_build_context_leaves_out_the_local_venv_but_keeps_the_project():
    patterns = [line.strip() for line in read(".dockerignore").splitlines()
                if line.strip() and not line.startswith("#")]
    assert ".venv" in patterns and ".git" in patterns
    needed = ["scripts/install.sh", "requirements.txt", "setup.py", "apps/dlrm/train.py",
              "components/dlrm.py", "schedulers/__init__.py"]
    for path in needed:
        excluded = [p for p in patterns if fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/")]
        assert not excluded, f"{path} is left out of the build context by {excluded}"
