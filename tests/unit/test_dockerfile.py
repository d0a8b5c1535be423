"""The Dockerfile builds the image that container schedulers run components.dlrm:train in.

These tests read the Dockerfile with BuildKit's own parser (the `dockerfile` package) and check
what the image depends on: its torch / fbgemm-gpu / torchrec come from scripts/install.sh
(DEVICE=cuda unless told otherwise) in a layer that a source edit does not rebuild, its CUDA
base is torch's CUDA, and a role's `torchrun -m apps.dlrm.train` finds both the venv and the
project. tests/slow/test_container_image.py builds the CPU image for real (slow).
"""

import fnmatch
import os
import re
import shlex
import stat
import subprocess

import dockerfile
import pytest

from components.launch import DEFAULT_IMAGE
from tests.conftest import REPO

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

# The oldest NVIDIA driver of each CUDA release (NVIDIA's CUDA Toolkit release notes, "CUDA
# Toolkit and Corresponding Driver Versions", Linux).
DRIVER_FOR_CUDA = {"13.0": "580"}
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


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


def build_args(instructions) -> dict[str, str | None]:
    """ARG name -> its default (None: unset unless given with --build-arg)."""
    args = {}
    for i in (i for i in instructions if i.cmd == "ARG"):
        name, eq, default = i.value[0].partition("=")
        args[name] = default if eq else None
    return args


def install_steps(instructions) -> dict[str, tuple[int, object]]:
    """part (stack, project) -> (position, the RUN that calls `scripts/install.sh part`)."""
    steps = {}
    for n, i in enumerate(instructions):
        if i.cmd == "RUN" and "scripts/install.sh" in i.value[0]:
            words = shlex.split(i.value[0].rsplit(";", 1)[-1])  # the command after any set-up
            assert words[-3:-1] == ["bash", "scripts/install.sh"], i.original
            steps[words[-1]] = (n, i)
    assert steps.keys() == {"stack", "project"}, steps
    return steps


def step_env(step) -> dict[str, str]:
    words = shlex.split(step.value[0].rsplit(";", 1)[-1])
    return dict(word.split("=", 1) for word in words[:-3])


def install_script_stack(device: str) -> dict[str, str]:
    """package -> version that scripts/install.sh installs for DEVICE=device (its default row)."""
    script = read("scripts/install.sh")
    default = re.search(r"VERSION_ROW:=([\d.]+)\}", script)
    row = default and re.search(rf"^\s*{re.escape(default[1])}\) (.*) ;;$", script, re.M)
    versions = dict(re.findall(r"\b(TORCH|FBGEMM|TORCHREC)_VERSION=(\S+)", row[1])) if row else {}
    fbgemm = re.search(rf"^\s*{device}\) FBGEMM=(\S+) ;;$", script, re.M)
    assert fbgemm and len(versions) == 3, "scripts/install.sh no longer reads as expected"
    return {"torch": versions["TORCH"], fbgemm[1]: versions["FBGEMM"], "torchrec": versions["TORCHREC"]}


def torch_cuda() -> str:
    """The CUDA of PyPI's torch build, as scripts/install.sh checks it (TORCH_CUDA)."""
    found = re.search(r"^TORCH_CUDA=(\d+\.\d+)$", read("scripts/install.sh"), re.M)
    assert found, "scripts/install.sh no longer names torch's CUDA (TORCH_CUDA=)"
    return found[1]


def test_the_image_gets_its_stack_from_the_install_script_for_cuda(instructions):
    args = build_args(instructions)
    base = only(instructions, "FROM").value[0]
    assert re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], base).startswith("nvidia/cuda:"), base
    assert args["DEVICE"] == "cuda"
    assert step_env(install_steps(instructions)["stack"][1])["DEVICE"] == "$DEVICE"
    # ... and from nowhere else: no RUN of its own installs or pins a package of the stack.
    stack = re.compile(r"\b(torch|torchrec|fbgemm[-_]gpu(-cpu)?)\s*[=<>~]=")
    for run in (i for i in instructions if i.cmd == "RUN"):
        assert not stack.search(run.value[0]), run.original


def test_the_cuda_base_is_torchs_cuda_and_the_driver_it_needs_is_stated(instructions):
    # The base's NVIDIA_REQUIRE_CUDA makes the NVIDIA runtime refuse a host whose driver is too
    # old for it: that only protects torch if the base's CUDA is torch's.
    cuda = torch_cuda()
    base = build_args(instructions)["BASE_IMAGE"]
    assert re.fullmatch(rf"nvidia/cuda:{re.escape(cuda)}\.\d+-base-\S+", base), (base, cuda)
    assert cuda in DRIVER_FOR_CUDA, f"add the oldest driver for CUDA {cuda} to DRIVER_FOR_CUDA"
    driver = f"{DRIVER_FOR_CUDA[cuda]} or newer"
    assert re.search(rf"\b{driver}\b", " ".join(read("Dockerfile").split())), driver
    assert f"driver >= {DRIVER_FOR_CUDA[cuda]}" in container_image_section(), cuda


def container_image_section() -> str:
    readme = read("docs/clusters.md")
    start = readme.index("### Container image")
    return readme[start : readme.index("\n#", start + 1)]


def test_the_image_stack_is_the_readme_matrix_gpu_column():
    rows = {}
    for line in read("docs/development.md").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3:
            rows.setdefault(cells[0], cells[2])  # package | CPU machine | machine with an NVIDIA GPU
    stack = install_script_stack("cuda")
    assert stack.keys() == {"torch", "fbgemm-gpu", "torchrec"}
    assert rows["torch"].startswith(stack["torch"] + " "), rows["torch"]
    assert rows["FBGEMM"] == f"fbgemm-gpu {stack['fbgemm-gpu']}", rows["FBGEMM"]
    assert rows["torchrec"].startswith(stack["torchrec"] + ","), rows["torchrec"]


def test_a_source_edit_does_not_rebuild_the_dependency_layer(instructions):
    # Docker reuses a layer while the files copied before it are unchanged: before the stack's
    # step only the files it reads are copied; the sources come after it.
    steps = install_steps(instructions)
    stack_at, project_at = steps["stack"][0], steps["project"][0]
    copies = [(n, i.value) for n, i in enumerate(instructions) if i.cmd == "COPY"]
    before = {src for n, value in copies if n < stack_at for src in value[:-1]}
    assert before == {"scripts/install.sh", "requirements.txt"}, before
    sources = [n for n, value in copies if value == (".", ".")]
    assert len(sources) == 1 and stack_at < sources[0] < project_at, copies


def run_stack_step(tmp_path, **env: str) -> dict[str, str]:
    """The stack step's shell command, run with a stand-in install.sh that reports what it got;
    env holds the build args as Docker passes them (an ARG without a value is unset)."""
    stub = tmp_path / "scripts" / "install.sh"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text('echo "DEVICE=$DEVICE TORCH_INDEX_URL=${TORCH_INDEX_URL-(unset)} VENV=$VENV part=$1"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    step = install_steps(dockerfile.parse_file(os.path.join(REPO, "Dockerfile")))["stack"][1]
    out = subprocess.run(
        ["sh", "-c", step.value[0]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], **env},
        timeout=30,
        check=True,
    ).stdout
    return dict(word.split("=", 1) for word in out.split())


@pytest.mark.parametrize(
    "given, index",
    [
        (None, CPU_INDEX),  # the CPU image's torch: PyTorch's CPU build, not PyPI's CUDA one
        ("", ""),  # empty: pip's configuration (tests/slow/test_container_image.py: a local wheel)
        ("https://mirror.example/whl/cpu", "https://mirror.example/whl/cpu"),
    ],
)
def test_the_cpu_image_takes_torch_from_pytorchs_cpu_index_unless_told(tmp_path, given, index):
    env = {"DEVICE": "cpu"} | ({} if given is None else {"TORCH_INDEX_URL": given})
    assert run_stack_step(tmp_path, **env) == {
        "DEVICE": "cpu",
        "TORCH_INDEX_URL": index,
        "VENV": "/opt/venv",
        "part": "stack",
    }


def test_the_cuda_image_takes_pypis_torch_unless_told(tmp_path):
    assert run_stack_step(tmp_path, DEVICE="cuda")["TORCH_INDEX_URL"] == ""
    given = "https://mirror.example/whl/cu130"
    assert run_stack_step(tmp_path, DEVICE="cuda", TORCH_INDEX_URL=given)["TORCH_INDEX_URL"] == given


def test_no_syntax_directive_that_would_fetch_a_frontend():
    # `# syntax=...` makes BuildKit pull that frontend image from a registry before building;
    # the built-in one reads this Dockerfile (RUN --mount included) without any.
    assert not re.search(r"^#\s*syntax\s*=", read("Dockerfile"), re.M | re.I)


def test_a_role_finds_the_venv_and_the_project_in_the_image(instructions):
    # TorchX's container schedulers start `bash -c "torchrun ... -m apps.dlrm.train"` in the
    # image's working directory with its PATH: the project must be copied there, and the venv
    # that install.sh builds must come first on PATH.
    workdir = only(instructions, "WORKDIR")
    copies = [i for i in instructions if i.cmd == "COPY"]
    assert (".", ".") in [i.value for i in copies], "the build context is copied into WORKDIR"
    assert workdir.start_line < copies[0].start_line, "relative COPY destinations are WORKDIR's"
    venvs = {step_env(step)["VENV"] for _, step in install_steps(instructions).values()}
    assert len(venvs) == 1 and venvs.pop() + "/bin" == env_of(instructions)["PATH"].split(":")[0]
    assert workdir.value[0].startswith("/")
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
    patterns = [
        line.strip() for line in read(".dockerignore").splitlines() if line.strip() and not line.startswith("#")
    ]
    assert ".venv" in patterns and ".git" in patterns
    needed = [
        "scripts/install.sh",
        "requirements.txt",
        "setup.py",
        "apps/dlrm/train.py",
        "components/dlrm.py",
        "schedulers/__init__.py",
    ]
    for path in needed:
        excluded = [p for p in patterns if fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/")]
        assert not excluded, f"{path} is left out of the build context by {excluded}"
