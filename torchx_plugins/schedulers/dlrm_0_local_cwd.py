"""Registers ``-s local_cwd`` again, as TorchX's own local scheduler, so that it stays ``torchx run``'s
default, made by schedulers/local.py so that its trainers run with torchx's Python.

TorchX makes the first registered plugin scheduler the default ``-s``; plugin modules load in
name order, and without this one ``-s aws_batch`` (dlrm_aws_batch) would come first wherever no
``.torchxconfig`` names a scheduler: any directory but the repository's root. The ``0`` in this
module's name sorts it before our other scheduler plugins, so a missing ``-s`` runs on this machine.
"""

from typing import TYPE_CHECKING

from torchx.plugins import register

if TYPE_CHECKING:
    from torchx.schedulers.local_scheduler import LocalScheduler


@register.scheduler(name="local_cwd")
def local_cwd(session_name: str, **kwargs: object) -> "LocalScheduler":
    # Imported on use, as TorchX imports its built-ins (every `torchx` command lists the schedulers).
    from schedulers.local import create_scheduler

    return create_scheduler(session_name, **kwargs)
