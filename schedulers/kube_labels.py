"""Kubernetes label values made of TorchX's names, for every Kubernetes scheduler.

TorchX writes an app's name into its jobs' and pods' labels as it is (``torchx.pytorch.org/app-name``,
``app.kubernetes.io/name``), but a label value holds at most 63 letters, digits, '-', '_' and '.',
with a letter or digit at each end: a job named ``run.`` or ``ctr/run-`` would be refused by the
API server at submission.
"""

import re

#: What a label value may not hold (the rest: at most 63, a letter or digit at each end).
_NOT_IN_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]")


def label_value(text: str) -> str:
    """``text`` as a Kubernetes label value: at most 63 letters, digits, '-', '_' and '.', with a letter
    or digit at each end (``run_`` becomes ``run``)."""
    return _NOT_IN_LABEL_VALUE.sub(".", text)[:63].strip("-_.")
