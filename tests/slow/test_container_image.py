"""The Dockerfile builds an image that runs the main job: a real build of the CPU image, then the
README's `torchx run -s local_cwd components.dlrm:train -j 1x2` inside it.

No Docker engine or container registry can be reached here, so this builds with Podman from a
Debian base that scripts/podman_base.sh makes with debootstrap (the stand-in for
debian:bookworm-slim), and gives the build this machine's pip configuration (its indexes, local
wheels, constraints and CA bundle) through read-only mounts: the image gets the stack that
`make install` gets here. Slow (minutes, root): `make test-slow`.
"""

import ast
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import REPO

# Tier (tests/conftest.py): minutes; `make test-slow`.
TIER = "slow"


# runc, not Podman's default crun (not installed with Debian's podman); ulimits a container here
# may set (Podman's defaults exceed this machine's hard limits).
PODMAN_OPTS = ["--runtime", "runc", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]
WORKDIR = "/workspace/torchrec-dlrm"  # the Dockerfile's
EDIT = "# a source edit by tests/slow/test_container_image.py\n"
EDITED = "apps/dlrm/train.py"


def bounded(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs cmd to its end, or stops its process group (TERM, then KILL) after timeout seconds
    and fails: Podman gets the TERM to clean up after itself."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(proc.pid, sig)
            try:
                out, _ = proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                out = ""
        pytest.fail(f"{' '.join(cmd)} ran past {timeout}s\n{out[-8000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def ok(cmd: list[str], timeout: float) -> str:
    result = bounded(cmd, timeout)
    assert result.returncode == 0, f"{' '.join(cmd)}: exit {result.returncode}\n{result.stdout[-8000:]}"
    return result.stdout


def quick(cmd: list[str]) -> str:
    """The stdout of a command that takes seconds and must succeed."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout


def host_pip_config(tmp) -> list[str]:
    """This machine's pip settings (`pip config list`: its files and PIP_* variables) as one
    pip.conf for the build, and the `-v` mounts of the local paths they name, read-only at the
    same paths. The CA bundle goes to a path of its own: the image's ca-certificates package
    rewrites /etc/ssl/certs, which a mount there would make fail."""
    listing = quick([sys.executable, "-m", "pip", "config", "list"]).splitlines()
    sections: dict[str, dict[str, str]] = {}
    for line in sorted(listing, key=lambda line: line.startswith(":env:")):  # PIP_* vars win
        key, value = line.split("=", 1)
        scope, name = key.rsplit(".", 1)
        section = "install" if scope == "install" else "global"  # global.x, :env:.x
        sections.setdefault(section, {})[name] = ast.literal_eval(value)
    mounts = set()
    settings = sections.get("global", {})
    if "cert" in settings:
        mounts.add(f"{settings['cert']}:/etc/pip-ca.crt")
        settings["cert"] = "/etc/pip-ca.crt"
    for section in sections.values():
        for name, value in section.items():
            for item in value.split() if name != "cert" else ():
                path = item.removeprefix("file://")
                if name.endswith("index-url"):  # a local index links its files beside simple/
                    path = os.path.dirname(path.rstrip("/"))
                if path.startswith("/") and os.path.exists(path):
                    mounts.add(f"{path}:{path}")
    conf = tmp / "pip.conf"
    conf.write_text(
        "".join(
            f"[{section}]\n" + "".join(f"{name} = {value}\n" for name, value in values.items())
            for section, values in sections.items()
        )
    )
    mounts.add(f"{conf}:/etc/pip.conf")
    return [arg for mount in sorted(mounts) for arg in ("-v", mount + ":ro")]


def copy_checkout(dest) -> None:
    """The files git knows here (tracked, and new ones not ignored): the checkout as it stands."""
    names = quick(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    for name in filter(None, names.split("\0")):
        src = os.path.join(REPO, name)
        if os.path.lexists(src):  # a file deleted from the working tree is still in git's index
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, name), follow_symlinks=False)


def build(context, tag: str, base: str, mounts: list[str], timeout: float, *cache: str) -> tuple[float, str]:
    """`podman build` of the CPU image from the local base: seconds taken, and its output."""
    # TORCH_INDEX_URL as for `make install` here: pip's configuration unless the variable is set.
    cmd = [
        "podman",
        "build",
        *PODMAN_OPTS,
        "--layers",
        *cache,
        "--pull=never",
        *mounts,
        "--build-arg",
        "DEVICE=cpu",
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--build-arg",
        f"TORCH_INDEX_URL={os.environ.get('TORCH_INDEX_URL', '')}",
        "-t",
        tag,
        str(context),
    ]
    start = time.monotonic()
    out = ok(cmd, timeout)
    return time.monotonic() - start, out


def steps(output: str) -> dict[str, bool]:
    """A build's steps (the instruction as printed) -> whether it came from the layer cache."""
    found, current = {}, None
    for line in output.splitlines():
        if re.match(r"STEP \d+/\d+: ", line):
            current = line.split(": ", 1)[1]
            found[current] = False
        elif current and line.startswith("--> Using cache"):
            found[current] = True
    return found


def podman_run(image: str, args: list[str], timeout: float, mounts: tuple[str, ...] = ()) -> str:
    """Runs args in a new container without a network; removes the container however it ends."""
    name = f"torchrec-dlrm-test-{uuid.uuid4().hex[:12]}"
    try:
        return ok(
            [
                "podman",
                "run",
                "--rm",
                "--name",
                name,
                *PODMAN_OPTS,
                "--network",
                "none",
                *[arg for mount in mounts for arg in ("-v", mount)],
                image,
                *args,
            ],
            timeout,
        )
    finally:
        bounded(["podman", "rm", "--force", "--ignore", name], 120)


@pytest.fixture(scope="module")
def base() -> str:
    out = ok(["bash", os.path.join(REPO, "scripts", "podman_base.sh")], 1800)
    return out.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def image(base, tmp_path_factory):
    """The CPU image, built twice from a copy of the checkout: as it is, then after a source edit
    (the second build's image is the one tested). Both tags are removed afterwards."""
    tmp = tmp_path_factory.mktemp("image")
    mounts = host_pip_config(tmp)
    context = tmp / "context"
    copy_checkout(context)
    tag = f"localhost/torchrec-dlrm-test:{uuid.uuid4().hex[:12]}"
    tags = [tag + "-first", tag]
    try:
        # From scratch (whatever an earlier run left), keeping its layers for the second.
        first_seconds, first = build(context, tags[0], base, mounts, 2400, "--no-cache")
        with open(context / EDITED, "a") as f:
            f.write(EDIT)
        edit_seconds, edited = build(context, tags[1], base, mounts, 900)
        size = int(ok(["podman", "image", "inspect", "--format", "{{.Size}}", tag], 60))
        yield dict(
            tag=tag, first=first, edited=edited, first_seconds=first_seconds, edit_seconds=edit_seconds, size=size
        )
    finally:
        bounded(["podman", "rmi", "--force", "--ignore", *tags], 300)


def test_a_source_edit_rebuilds_the_project_not_the_dependencies(image, capsys):
    stack = [s for s in steps(image["edited"]) if "scripts/install.sh stack" in s]
    project = [s for s in steps(image["edited"]) if "scripts/install.sh project" in s]
    assert len(stack) == 1 and len(project) == 1, image["edited"][-8000:]
    assert steps(image["edited"])[stack[0]], f"the dependency layer was rebuilt\n{image['edited'][-8000:]}"
    assert not steps(image["edited"])[project[0]], "the edit did not reach the project's layer"
    assert not any(steps(image["first"]).values()), "the --no-cache build took a cached layer"
    # The dependency step is nearly all of a build: without it, a build takes a fraction.
    assert image["edit_seconds"] < image["first_seconds"] / 3, image
    with capsys.disabled():
        print(
            f"\nCPU image: first build {image['first_seconds']:.0f} s, after a source edit "
            f"{image['edit_seconds']:.0f} s, {image['size'] / 1e9:.2f} GB ({image['size']} bytes)"
        )


def test_the_image_holds_the_cpu_stack_and_the_edited_project(image):
    report = podman_run(
        image["tag"],
        [
            "python",
            "-I",
            "-c",
            (
                "import importlib.metadata as m, re, components.dlrm as c; "
                "print(sorted(re.sub(r'[-_.]+', '-', d.metadata['Name']).lower() for d in m.distributions())); "
                "print(c.__file__); print(open('" + f"{WORKDIR}/{EDITED}" + "').read()[-200:])"
            ),
        ],
        120,
    )
    names = ast.literal_eval(report.splitlines()[0])
    assert "fbgemm-gpu-cpu" in names and "fbgemm-gpu" not in names, names
    assert not [name for name in names if name.startswith("nvidia")], names  # no CUDA wheels
    assert report.splitlines()[1] == f"{WORKDIR}/components/dlrm.py"
    assert report.rstrip("\n").endswith(EDIT.rstrip("\n"))


def test_the_default_command_works_without_a_gpu(image):
    out = podman_run(image["tag"], [], 120)  # the image's CMD
    assert "usage: torchx run" in out and "--steps" in out, out[-4000:]


def test_the_main_job_succeeds_and_learns_in_the_image(image, tmp_path):
    # The README's main job, shortened: 100 steps, and fewer batches to validate and test.
    out = tmp_path / "outputs"
    out.mkdir()
    log = podman_run(
        image["tag"],
        [
            "torchx",
            "run",
            "-s",
            "local_cwd",
            "components.dlrm:train",
            "-j",
            "1x2",
            "--steps",
            "100",
            "--val_batches",
            "10",
            "--test_batches",
            "10",
            "--output_dir",
            "/outputs",
        ],
        900,
        mounts=(f"{out}:/outputs",),
    )
    assert "job finished: SUCCEEDED" in log, log[-8000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 100
    assert summary["device"] == "cpu"
    # 100 steps are not the main job's 1500 (tests/integration/test_main_job.py: within 0.05 of the best
    # AUROC), but well past chance (0.5): within 0.1 of the best possible.
    ceiling = summary["auroc_ceiling"]
    assert 0.75 < ceiling < 0.9
    assert summary["val_auroc"] >= ceiling - 0.1, summary
    assert summary["test_auroc"] >= ceiling - 0.1, summary
    ranks = {line.rsplit(" ", 1)[-1] for line in summary["sharding_plan"]}
    assert {"0", "1"} <= set(",".join(ranks).split(","))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))
