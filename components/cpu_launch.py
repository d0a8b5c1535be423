"""Where and how a single-process CPU role runs (components.dlrm:preprocess and :export).

``CpuLaunch`` has the arguments of :class:`components.launch.Launch` that mean something for one
process without GPUs. Its fields are Launch's own (names, defaults, help) and Launch validates
them, so the two cannot drift apart.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchx import specs
from torchx.components import utils

from apps.core.options import to_argv
from components.launch import Launch
from components.signature import reject_unknown, take

_LAUNCH = {f.name: f for f in dataclasses.fields(Launch)}


def _same_as_launch(name: str, help: str | None = None) -> Any:
    # Any, as dataclasses.field() is typed: the call stands for the field's default, a value of the field's type.
    field = _LAUNCH[name]
    metadata = {**field.metadata, "help": help} if help else field.metadata
    if field.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=field.default_factory, metadata=metadata)
    return dataclasses.field(default=field.default, metadata=metadata)


@dataclass
class CpuLaunch:
    name: str = _same_as_launch("name")
    image: str = _same_as_launch("image")
    h: str | None = _same_as_launch("h")
    cpu: int = _same_as_launch("cpu")
    memMB: int = _same_as_launch("memMB")
    env: dict[str, str] = _same_as_launch("env")
    mounts: list[str] = _same_as_launch("mounts")
    max_retries: int = _same_as_launch(
        "max_retries", "Times the scheduler restarts the job if it fails; a restart resumes it."
    )

    def __post_init__(self) -> None:
        self.launch()  # Launch's checks: a bad value fails before anything is submitted

    def launch(self) -> Launch:
        """The Launch these arguments stand for: one process, no GPU."""
        return Launch(j="1x1", gpu=0, **dataclasses.asdict(self))

    @classmethod
    def component_app(cls, kwargs: dict[str, Any], config: type, module: str) -> specs.AppDef:
        """The app of a component whose arguments (``kwargs``, as TorchX hands them over) are
        CpuLaunch's and ``config``'s: ``python -m module`` with ``config``'s options.

        A method rather than a function, which TorchX would list as a component wherever a
        component module imports it.
        """
        reject_unknown(kwargs, cls, config)
        return take(cls, kwargs).python_app(module, to_argv(take(config, kwargs)))

    def python_app(self, module: str, app_args: list[str]) -> specs.AppDef:
        """The app that runs ``python -m module app_args`` as one process (TorchX's utils.python)."""
        launch = self.launch()
        app = utils.python(*app_args, m=module, **launch.node_args)
        (role,) = app.roles
        role.env.update(launch.merged_env)
        role.max_retries = launch.max_retries
        return app
