"""What installing this project registers with TorchX: components, schedulers, named resources."""

import inspect
import json
import os

import pytest
from torchx import plugins
from torchx.schedulers import get_default_scheduler_name, get_scheduler_factories
from torchx.specs.finder import ModuleComponentsFinder

from components import dlrm, hstu
from tests.conftest import BIN, REPO, run

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"


def torchx(*args: str, cwd: str = REPO, **env: str):
    return run([os.path.join(BIN, "torchx"), *args], timeout=120, cwd=cwd, **env)


def test_builtins_lists_our_components_beside_torchxs_own(tmp_path):
    result = torchx("builtins", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    listed = [line.split(". ", 1)[1] for line in result.stdout.splitlines()[1:]]
    torchx_own = [c.name for c in ModuleComponentsFinder("torchx.components", "").find(None) if not c.validation_errors]
    assert "dist.ddp" in torchx_own
    ours = [
        f"{module.__name__.rsplit('.', 1)[1]}.{name}"
        for module in (dlrm, hstu)
        for name, fn in inspect.getmembers(module, inspect.isfunction)
        if fn.__module__ == module.__name__ and not name.startswith("_")
    ]
    assert {"dlrm.train", "hstu.train", "hstu.plan"} <= set(ours)
    # Every public component of components/dlrm.py and hstu.py, none of their helpers, and all of TorchX's.
    assert sorted(listed) == sorted(torchx_own + ours)


def test_registered_component_runs_by_its_short_name(tmp_path):
    result = torchx("run", "--dryrun", "--json", "-s", "local_cwd", "dlrm.train", "--steps", "7", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    (role,) = json.loads(result.stdout)["app"]["roles"]
    assert "-m apps.dlrm.train --steps 7" in role["args"][1]


@pytest.mark.unit
def test_plugins_load_without_errors():
    registry = plugins.registry()
    assert registry.load_errors() == []
    assert "aws_batch" in registry.get(plugins.PluginType.SCHEDULER)


def test_default_scheduler_is_local_cwd_in_any_directory(tmp_path):
    # TorchX's default is the first plugin scheduler: ours re-registers local_cwd ahead of the rest...
    assert list(get_scheduler_factories())[0] == get_default_scheduler_name() == "local_cwd"
    # ...so a missing -s runs here from the repository, from any other folder, and from apps/.
    for cwd in (REPO, str(tmp_path), os.path.join(REPO, "apps")):
        result = torchx("run", "--dryrun", "--json", "components.dlrm:train", cwd=cwd)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["scheduler"] == "local_cwd", cwd
