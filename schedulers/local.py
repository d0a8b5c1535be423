"""``-s local_cwd``: TorchX's local scheduler, whose trainers run with the Python that runs torchx.

A role's command is ``python -m ...`` (``bash -c "python -m apps.dlrm.torchrun ..."``), found on the
job's PATH, which is torchx's own. Run as ``.venv/bin/torchx`` without the environment activated, that
``python`` was the system's (``ModuleNotFoundError: No module named 'torch'`` inside the job) or none at
all (``python: command not found``). Here the folder of torchx's interpreter comes first on the job's
PATH (TorchX's ``extra_paths``), so the trainers run with the interpreter that loaded the component,
which imports torch itself: where it cannot, ``torchx run`` fails before launching anything.

A job that reads a local path this machine lacks (the components mark it: :data:`MISSING_HERE`) is
refused before it starts, where its trainers would refuse it seconds later.

TorchX keeps a local app only in the memory of the ``torchx run`` that started it, so no other
command can list it: ``torchx list -s local_cwd`` says so in one line, and where the runs' results
are, instead of raising a bare ``Exception``.

Registered in ``torchx_plugins/schedulers/dlrm_0_local_cwd.py`` under TorchX's own name, which it replaces.
"""

import os
import sys
from typing import Any

from torchx.schedulers.api import ListAppResponse
from torchx.schedulers.local_scheduler import CWDImageProvider, LocalScheduler
from torchx.specs import AppDef

from schedulers.setup_checks import SetupError

#: Where a local app's results and logs are, for the one-line answers about local apps.
RUN_FOLDERS = "each run's folder (outputs/<app id>/ by default, outputs/latest the newest) holds its results and logs"


#: Role metadata the components set: the paths the job reads that the submitting machine lacks.
MISSING_HERE = "dlrm/missing_here"


class _LocalCwdScheduler(LocalScheduler):
    def list(self, cfg: Any = None) -> list[ListAppResponse]:
        raise SetupError(f"-s local_cwd keeps no list of its apps (each lives in its `torchx run`): {RUN_FOLDERS}")

    def _pre_build_validate(self, app: AppDef, scheduler: str, cfg: Any) -> None:
        """Refuses a job reading a path this machine lacks, which its trainers here would refuse
        only once started (a cluster's nodes may have it: the components only mark it)."""
        for role in app.roles:
            for missing in role.metadata.get(MISSING_HERE, []):
                raise SetupError(
                    f"{missing} does not exist on this machine, where -s local_cwd runs the job: fix the path "
                    "(a folder, file or glob here), or give a URL"
                )
        super()._pre_build_validate(app, scheduler, cfg)


def create_scheduler(session_name: str, **kwargs: Any) -> LocalScheduler:
    return _LocalCwdScheduler(
        session_name=session_name,
        image_provider_class=CWDImageProvider,
        cache_size=kwargs.get("cache_size", 100),
        extra_paths=[os.path.dirname(sys.executable), *(kwargs.get("extra_paths") or [])],
    )
