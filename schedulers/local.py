"""``-s local_cwd``: TorchX's local scheduler, whose trainers run with the Python that runs torchx.

A role's command is ``python -m ...`` (``bash -c "python -m apps.dlrm.torchrun ..."``), found on the
job's PATH, which is torchx's own. Run as ``.venv/bin/torchx`` without the environment activated, that
``python`` was the system's (``ModuleNotFoundError: No module named 'torch'`` inside the job) or none at
all (``python: command not found``). Here the folder of torchx's interpreter comes first on the job's
PATH (TorchX's ``extra_paths``), so the trainers run with the interpreter that loaded the component,
which imports torch itself: where it cannot, ``torchx run`` fails before launching anything.

Registered in ``torchx_plugins/schedulers/dlrm_0_local_cwd.py`` under TorchX's own name, which it replaces.
"""

import os
import sys
from typing import Any

from torchx.schedulers.local_scheduler import CWDImageProvider, LocalScheduler


def create_scheduler(session_name: str, **kwargs: Any) -> LocalScheduler:
    return LocalScheduler(
        session_name=session_name,
        image_provider_class=CWDImageProvider,
        cache_size=kwargs.get("cache_size", 100),
        extra_paths=[os.path.dirname(sys.executable), *(kwargs.get("extra_paths") or [])],
    )
