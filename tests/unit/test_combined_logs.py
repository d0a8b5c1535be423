"""The schedulers whose replicas have one log each (stdout and stderr together) refuse another
``torchx log --streams`` in one line that names the fix, before they reach for the cluster."""

import pytest
from torchx.schedulers.api import Stream

from schedulers.aws_batch import AWSBatchScheduler
from schedulers.combined_logs import CombinedLogs
from schedulers.kubeflow.scheduler import KubeflowScheduler

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

SCHEDULERS = {
    "aws_batch has one log stream per node (stdout and stderr together)": lambda: AWSBatchScheduler("torchx"),
    "a pod's log has stdout and stderr together": lambda: KubeflowScheduler("torchx"),
}
APPS = {AWSBatchScheduler: "queue:dlrm-x7k2p", KubeflowScheduler: "default:pytorchjob:dlrm-x7k2p"}


@pytest.mark.parametrize("why", SCHEDULERS)
@pytest.mark.parametrize("stream", [Stream.STDOUT, Stream.STDERR])
def test_a_stream_other_than_the_combined_one_is_refused_naming_the_fix(why, stream):
    scheduler = SCHEDULERS[why]()
    with pytest.raises(ValueError) as refused:
        scheduler.log_iter(APPS[type(scheduler)], "train", 0, streams=stream)
    assert str(refused.value) == f"{why}: use --streams combined or leave it out, not {stream.value}"


def test_a_scheduler_that_cannot_read_a_replicas_log_cannot_be_made():
    class NoLog(CombinedLogs):
        ONE_STREAM = "one stream"

    with pytest.raises(TypeError, match="_replica_log"):
        NoLog()
