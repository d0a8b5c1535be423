"""``torchx log`` for the schedulers whose replicas each have one log, stdout and stderr together:
an AWS Batch node's CloudWatch stream, a Kubeflow pod's log.

TorchX asks for a stream with ``torchx log --streams stdout|stderr|combined``; these schedulers can
give only the combined one, so they refuse the others in one line that names the fix, and filter the
replica's lines by ``--regex`` (which TorchX leaves to each scheduler's ``log_iter``).
"""

import abc
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterable, TypeAlias

from torchx.schedulers.api import Scheduler, Stream, filter_regex

if TYPE_CHECKING:
    _Base: TypeAlias = Scheduler[Any]
else:  # TorchX reads a scheduler's run options' type from its first Scheduler[...] base
    _Base = abc.ABC


@dataclass(frozen=True)
class LogRequest:
    """What ``torchx log`` asks of one replica: the lines of replica ``k`` of role ``role_name`` of
    ``app_id`` logged between ``since`` and ``until`` (either None: no bound), followed until the
    replica ends if ``should_tail``."""

    app_id: str
    role_name: str
    k: int
    since: datetime | None
    until: datetime | None
    should_tail: bool


class CombinedLogs(_Base):
    """Mixin of a scheduler (before its Scheduler base) whose replicas each have one log: TorchX's
    ``log_iter`` over the scheduler's :meth:`_replica_log`."""

    #: Why there is one stream, the start of the refusal of another (e.g. "a pod's log has stdout
    #: and stderr together").
    ONE_STREAM: str

    def log_iter(
        self,
        app_id: str,
        role_name: str,
        k: int = 0,
        regex: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
    ) -> Iterable[str]:
        if streams is not None and streams != Stream.COMBINED:
            raise ValueError(
                f"{self.ONE_STREAM}: use --streams {Stream.COMBINED.value} or leave it out, not {streams.value}"
            )
        lines = self._replica_log(LogRequest(app_id, role_name, k, since, until, should_tail))
        return filter_regex(regex, lines) if regex else lines

    @abc.abstractmethod
    def _replica_log(self, asked: LogRequest) -> Iterable[str]:
        """The lines ``asked`` for; raises ValueError naming what is not there (the app, the role,
        the replica)."""
