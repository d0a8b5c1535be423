"""Registers ``-s aws_batch`` (schedulers/aws_batch.py) with TorchX's plugin registry."""

from typing import TYPE_CHECKING

from torchx.plugins import register

if TYPE_CHECKING:
    from schedulers.aws_batch import AWSBatchScheduler


@register.scheduler(name="aws_batch")
def aws_batch(session_name: str, **kwargs: object) -> "AWSBatchScheduler":
    # Imported on use: TorchX imports every plugin module whenever it lists the schedulers (every
    # `torchx` command), and boto3 with TorchX's Docker workspace adds about 0.3 s to each.
    from schedulers.aws_batch import AWSBatchScheduler

    return AWSBatchScheduler(session_name)
