"""Registers ``-s slurm`` as schedulers/slurm.py's SlurmScheduler: TorchX's own, working on
Slurm 22.05 and later (a registered scheduler replaces the built-in one of the same name)."""

from typing import TYPE_CHECKING

from torchx.plugins import register

if TYPE_CHECKING:
    from schedulers.slurm import SlurmScheduler


@register.scheduler(name="slurm")
def slurm(session_name: str, **kwargs: object) -> "SlurmScheduler":
    # Imported on use: TorchX imports every plugin module whenever it lists the schedulers.
    from schedulers.slurm import create_scheduler

    return create_scheduler(session_name, **kwargs)
