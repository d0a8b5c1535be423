"""An app, whole, as the shared commands take it: :class:`AppSpec` (torchtitan's ``TrainSpec``).

Each app declares one (``apps/<app>/spec.py``: its name, its configuration classes and parser,
and what trains it) and its commands are a few lines that hand it over: ``python -m
apps.<app>.train`` to :func:`apps.core.training.command.main`, ``apps.<app>.plan`` to
:func:`apps.core.training.plan.main`, ``apps.<app>.torchrun`` to :func:`apps.core.torchrun.main`;
its TorchX components read it too. Core code takes everything that names an app from it.

Torch-free: the components read a spec at submission, which imports no torch, and the launcher
(torchrun) needs only its name; what trains the app (the TrainingApp, its data factory
``make_data`` among it, and the Trainer) is imported on use (:attr:`AppSpec.training`).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from apps.core.options import Options

if TYPE_CHECKING:  # torch and torchrec: only where the app trains
    from apps.core.training.app import TrainingApp
    from apps.core.training.trainer import Trainer


class AppTraining(NamedTuple):
    """What trains an app: its :class:`~apps.core.training.app.TrainingApp` (model, tables, data
    factory, metrics, summary) of a config, and what builds its run's Trainer from a config and a
    process group. The TrainingApp is the config's, as its tables may depend on the options (the
    DLRM's managed-collision tables with --categorical_ids zch)."""

    app_for: "Callable[[Any], TrainingApp[Any]]"
    trainer: "Callable[[Any, Any], Trainer[Any]]"


@dataclass(frozen=True)
class AppSpec:
    """One app of the registry.

    ``name`` is the app's name: its modules are ``apps.<name>.*`` and its components
    ``components.<name>``; its jobs, and so its run folders (``outputs/<name>-<id>``), are named
    after it where the user names them not, and its commands' lines and help say it.
    """

    name: str
    #: The app's whole configuration (the shared sections and its own), as training takes it.
    job_config: type[Options]
    #: The part of it that the sharding plan depends on (``python -m apps.<name>.plan``).
    plan_config: type[Options]
    #: ``python -m apps.<name>.train``'s command line into a validated ``job_config`` (exits 2 on
    #: a bad value, with the app's own help).
    parse_train_config: Callable[[list[str] | None], Any]
    #: What trains it, imported when called (torch and torchrec take seconds to import).
    training: Callable[[], AppTraining]

    def module(self, command: str) -> str:
        """The module of the app's ``command`` (``train``, ``plan``, ``torchrun``): ``apps.<name>.<command>``."""
        return f"apps.{self.name}.{command}"
