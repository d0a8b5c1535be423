"""Registers ``-s local_cwd`` as schedulers/local.py makes it: TorchX's own local scheduler, whose trainers
run with torchx's Python (a registered scheduler replaces the built-in one of the same name)."""

from typing import TYPE_CHECKING

from torchx.plugins import register

if TYPE_CHECKING:
    from torchx.schedulers.local_scheduler import LocalScheduler


@register.scheduler(name="local_cwd")
def local_cwd(session_name: str, **kwargs: object) -> "LocalScheduler":
    # Imported on use: TorchX imports every plugin module whenever it lists the schedulers.
    from schedulers.local import create_scheduler

    return create_scheduler(session_name, **kwargs)
