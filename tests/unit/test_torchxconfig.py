"""The repository's .torchxconfig, as TorchX reads it: the default scheduler, each scheduler's
run options and the defaults of components.dlrm:train, examples included."""

import configparser
import io
import os
import re
import subprocess

import pytest
from torchx.runner.config import load, load_sections
from torchx.schedulers import get_scheduler_factories
from torchx.specs.builders import materialize_appdef

from components import dlrm
from tests.conftest import BIN, REPO, process_env

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

CONFIG = os.path.join(REPO, ".torchxconfig")
SCHEDULERS = ["slurm", "kubernetes", "kubeflow", "aws_batch"]


def with_examples() -> str:
    """The file with its `# key = value` example lines in use."""
    with open(CONFIG) as f:
        return re.sub(r"^# ([\w-]+ = .*)$", r"\1", f.read(), flags=re.M)


def torchx_in_repo(*args: str, home) -> subprocess.CompletedProcess:
    """`torchx ARGS` in the repository, as a user runs it there: no $TORCHXCONFIG, an empty $HOME."""
    env = process_env(HOME=str(home))
    env.pop("TORCHXCONFIG", None)
    return subprocess.run(
        [os.path.join(BIN, "torchx"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_scheduler_defaults_reach_a_submission(tmp_path):
    # -s kubernetes needs a Volcano queue: the file's `queue = default` provides it.
    result = torchx_in_repo(
        "run",
        "-s",
        "kubernetes",
        "--dryrun",
        "-cfg",
        "validate_spec=False",
        "--workspace",
        "",
        "components.dlrm:train",
        home=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^\s+queue: default$", result.stdout, re.M), result.stdout[-3000:]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_every_scheduler_option_and_example_is_a_run_option_of_that_scheduler(scheduler):
    text = with_examples()
    parser = configparser.ConfigParser()
    parser.optionxform = str  # as TorchX reads it: run options are case-sensitive
    parser.read_string(text)
    names = list(parser[scheduler])
    assert names, f"[{scheduler}] has no option and no example"
    opts = get_scheduler_factories()[scheduler](session_name="test").run_opts()
    unknown = [name for name in names if opts.get(name) is None]
    assert not unknown, f"[{scheduler}] {unknown}: not run options (`torchx runopts {scheduler}`)"
    cfg = {}
    load(scheduler, io.StringIO(text), cfg)  # TorchX's own reading: casts every value to its type
    assert set(cfg) == {opts.canonical_key(name) or name for name in names}
    opts.resolve(cfg)  # raises on a missing required option or a value of the wrong type


def test_component_default_examples_are_arguments_of_the_component(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHXCONFIG", raising=False)
    (tmp_path / ".torchxconfig").write_text(with_examples())
    defaults = load_sections("component", dirs=[str(tmp_path)])["components.dlrm:train"]
    assert {"image", "j", "h", "batch_size", "env"} <= defaults.keys()

    # As `torchx run components.dlrm:train` applies them, with nothing on the command line.
    app = materialize_appdef(dlrm.train, [], defaults)
    (role,) = app.roles
    assert role.image == defaults["image"]
    assert role.num_replicas == 2 and role.resource.gpu == 8  # 2x8 on aws_p4d.24xlarge
    assert "--batch_size 8192" in role.args[-1]
    assert role.env["NCCL_DEBUG"] == "INFO" and role.env["TORCH_SHOW_CPP_STACKTRACES"] == "1"


def test_the_file_as_committed_sets_no_component_default():
    # Only examples: the component's own defaults are the documented ones.
    assert load_sections("component", dirs=[REPO]).get("components.dlrm:train", {}) == {}
