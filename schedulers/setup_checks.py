"""Setup mistakes of the submitting machine (a command not on PATH, no cloud region or credentials,
no kubeconfig, no Docker, the wrong Python), refused in one line before a submission writes anything.

``torchx run`` prints a ComponentValidationException raised while it dry-runs or submits as its
message alone, after a line ``Failed to run component `...` got errors:``; any other exception
reaches the user as a traceback through TorchX's frames and the client library's. So each refusal
here is a SetupError whose message is one line: what is missing (the value) and the fix.
"""

import shutil

from torchx.specs.finder import ComponentValidationException


class SetupError(ComponentValidationException):
    """The submitting machine lacks something the scheduler needs; the message names it and the fix."""


def require_command(command: str, scheduler: str, fix: str, use: str = "submits jobs") -> None:
    """Refuses, before anything is submitted (or read, or cancelled: ``use``), a scheduler whose
    client command is not on PATH."""
    if shutil.which(command) is None:
        raise SetupError(f"{command} is not on PATH (-s {scheduler} {use} with it): {fix}")


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name if it has none): a reason to quote in
    a one-line message, where client libraries write several."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
