"""The folder a run writes its results to (``--output_dir``), one per run.

Where ``--output_dir``'s last folder is ``{run}`` (the default: ``outputs/{run}``), each run gets
a folder of its own, named by :func:`run_folder_name`: the TorchX app id (``dlrm-k3x9f2`` on
``local_cwd``; ``dlrm-1234`` on Slurm, whose app ids are job numbers), the same for every
attempt of the job, else the job's name and start time. A job that TorchX did not name (``python
-m apps.hstu.train``, a bare torchrun) is named after its app (``hstu-20250601-120000``). ``latest`` beside it links to the
newest run that trains or evaluates, from the moment it starts to (:func:`point_latest_at`): a run
that fails at start-up, or has nothing left to do, leaves it at the last run with results. Any
folder, made here or given, records the run that writes it in ``RUN`` (the run id of
:mod:`apps.core.checkpoint.checkpointer`), and a folder of another run is refused, as is one
holding the summary.json of a run that ended, unless this run resumes it, and one holding files
of no run (the user's): two runs never share a folder, and no run writes over another's results
or the user's files.

torchrun makes its log folder (:data:`TORCHRUN_LOGS`) in the run's folder before the trainers
start, so its launcher checks a given folder first (:func:`torchrun_log_dir`).

Only rank 0 writes the folder; every rank learns its name from rank 0.
"""

import contextlib
import datetime
import logging
import os
import re
import uuid
from typing import TYPE_CHECKING, Iterator, Mapping, NoReturn

from apps.core.common.errors import ConfigError
from apps.core.config import RUN_PLACEHOLDER
from apps.core.training.report import SUMMARY_FILE

if TYPE_CHECKING:  # torch: the component names run folders at submission without it
    from apps.core.common.distributed import DistEnv

logger = logging.getLogger(__name__)

#: The file that names the run a folder belongs to.
RUN_FILE = "RUN"
#: The folder in a run's folder where torchrun keeps each attempt's logs and error files (its
#: ``--log_dir``, which the training component sets).
TORCHRUN_LOGS = "torchrun"
#: The link beside the runs' folders that points at the newest.
LATEST = "latest"

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def run_folder_name(job_name: str, app_id: str | None, started: datetime.datetime | None = None) -> str:
    """The name of a run's folder: its app id, with the job's name in front where the id does not
    start with it; without an app id, the job's name and the time it ``started``."""
    if app_id:
        return app_id if app_id.startswith(f"{job_name}-") else f"{job_name}-{app_id}"
    assert started is not None, "a run without an app id is named by its start time"
    return f"{job_name}-{started:%Y%m%d-%H%M%S}"


def output_folder(output_dir: str, job_name: str, app_id: str) -> str:
    """``output_dir`` with ``{run}`` replaced by the folder name of app ``app_id``: where the run
    of a TorchX job writes (``app_id`` may be TorchX's macro, for the scheduler to fill in)."""
    head, last = os.path.split(output_dir.rstrip("/"))
    if last != RUN_PLACEHOLDER:
        return output_dir
    return os.path.join(head, run_folder_name(job_name, app_id))


def is_restart(environ: Mapping[str, str]) -> bool:
    """Whether this is a later attempt of the job: torchrun restarted its trainers, or Slurm requeued it."""
    return any(int(environ.get(name) or 0) > 0 for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def open_output_dir(
    output_dir: str, run_id: str, resuming: bool, env: "DistEnv", app: str, checkpoint_dir: str = ""
) -> str:
    """Collective. The folder this run of the app named ``app`` writes its results to ('' for
    none), made this run's by rank 0 (:func:`claim`), or the ConfigError that refuses it, on every
    rank. ``checkpoint_dir``:
    the run's --checkpoint_dir, which may lie inside that folder (``--output_dir D
    --checkpoint_dir D/ckpt``, torchtitan's layout) and is made before it is claimed."""
    # Imported here, in the job: torch takes seconds to import, which every `torchx run` of the
    # component (which imports this module for the folders' names) would wait for.
    from apps.core.common.distributed import decided_by_main

    if not output_dir:
        return ""
    return decided_by_main(
        lambda: make_run_folder(output_dir, run_id, resuming, os.environ, datetime.datetime.now(), app, checkpoint_dir),
        env,
    )


def make_run_folder(
    output_dir: str,
    run_id: str,
    resuming: bool,
    environ: Mapping[str, str],
    now: datetime.datetime,
    app: str,
    checkpoint_dir: str = "",
) -> str:
    """Rank 0: the folder ``output_dir`` names, made and claimed for ``run_id``; with ``{run}``, a
    folder of this run's own (the app id's, else a new one named after the job, which is named
    after the app ``app`` where TorchX did not name it). ``latest`` moves later, once the run
    trains or evaluates (:func:`point_latest_at`). A ``checkpoint_dir`` inside the folder is the
    run's own, not a file of the user's."""
    resuming = resuming or is_restart(environ)
    head, last = os.path.split(output_dir.rstrip("/"))
    if last != RUN_PLACEHOLDER:
        with writing(output_dir):
            claim(output_dir, run_id, resuming, environ, _entry_inside(output_dir, checkpoint_dir))
        return output_dir
    with writing(head or "."):
        os.makedirs(head or ".", exist_ok=True)
        # Every attempt of a TorchX job: the same folder. Otherwise a new one, named by the time.
        folder = job_folder(output_dir, environ, app, _torchx_app_id(environ)) or _new_folder(
            head, run_folder_name(_job_name(environ, app), None, now)
        )
        claim(folder, run_id, resuming, environ)
    return folder


@contextlib.contextmanager
def writing(folder: str) -> Iterator[None]:
    """Making and claiming the run's ``folder``: a folder this job cannot write (read-only, not
    its user's, a file in its path) is refused in one line (ConfigError), not a traceback."""
    try:
        yield
    except OSError as e:
        raise ConfigError(
            f"--output_dir {folder} cannot be written ({e.strerror or e}): give a folder this job can write "
            "to, or leave --output_dir at its default (a new folder per run under outputs/)"
        ) from None


def point_latest_at(output_dir: str, folder: str) -> None:
    """Rank 0, when the run in ``folder`` (made from ``output_dir``) starts training or evaluating:
    ``latest`` beside a ``{run}`` folder points at it. Not sooner, so that ``latest`` always
    leads to a run with results: one that fails at start-up (its data, its checkpoint) or finds
    nothing left to do leaves it where it was."""
    head, last = os.path.split(output_dir.rstrip("/"))
    if folder and last == RUN_PLACEHOLDER:
        point_latest(head, os.path.basename(folder))


def job_folder(output_dir: str, environ: Mapping[str, str], app: str, app_id: str | None) -> str | None:
    """The folder that the run of TorchX app ``app_id`` (of the app named ``app``) writes to, as
    :func:`make_run_folder` names it, and before it does; None for a ``{run}`` folder without an
    app id (named when made)."""
    head, last = os.path.split(output_dir.rstrip("/"))
    if last != RUN_PLACEHOLDER:
        return output_dir
    return os.path.join(head, run_folder_name(_job_name(environ, app), app_id)) if app_id else None


def torchrun_log_dir(log_dir: str, environ: Mapping[str, str], rdzv_id: str, app: str) -> str:
    """torchrun's ``--log_dir`` for a job of the app named ``app``, checked and with its run folder
    named, before torchrun writes into it. The training component gives it as ``<--output_dir>/torchrun`` (TORCHRUN_LOGS):

    - a ``{run}`` folder, which only the job can name, by its app id (torchrun's rendezvous id);
      empty (torchrun's temporary folder) where the job cannot;
    - a folder given: refused (ConfigError) where the trainers would refuse it whatever run they
      are (:func:`check_unowned`); empty where it belongs to a run other than this job's first
      one, whose trainers alone can tell whether they resume that run (from its checkpoint) or
      must refuse its folder: nothing is written into another run's folder meanwhile.

    Any other ``log_dir`` (the user's PET_LOG_DIR) is kept as it is.
    """
    output_dir, logs = os.path.split(log_dir)
    if logs != TORCHRUN_LOGS:
        return log_dir
    if os.path.basename(output_dir) == RUN_PLACEHOLDER:
        folder = job_folder(output_dir, environ, app, _torchx_app_id({**environ, "TORCHELASTIC_RUN_ID": rdzv_id}))
        return _made(os.path.join(folder, logs), folder) if folder else ""
    owner = _owner(output_dir) if os.path.isdir(output_dir) else None
    if owner is None:
        check_unowned(output_dir, environ)
        return _made(log_dir, output_dir)
    return log_dir if owner == rdzv_id else ""


def _made(log_dir: str, folder: str) -> str:
    """``log_dir``, once the run's ``folder`` that holds it is made: torchrun would fail on one it
    cannot write with a traceback; here it is refused in one line before torchrun starts."""
    with writing(folder):
        os.makedirs(folder, exist_ok=True)
    return log_dir


def claim(folder: str, run_id: str, resuming: bool, environ: Mapping[str, str], own: str | None = None) -> None:
    """Makes ``folder`` run ``run_id``'s (its RUN file), or refuses it, writing nothing: a folder
    of another run, one holding the summary.json of a run that ended, unless ``resuming`` that
    same run, and one holding files of no run (:func:`check_unowned`) other than ``own``, the
    name of the run's checkpoint folder in it."""
    owner = _owner(folder) if os.path.isdir(folder) else None
    if owner is None:
        check_unowned(folder, environ, own)
        os.makedirs(folder, exist_ok=True)
        owner = _write_owner(folder, run_id)  # the first run to write RUN has the folder
    elif owner == run_id and not resuming and os.path.exists(os.path.join(folder, SUMMARY_FILE)):
        _refuse_ended(folder, f"run {owner}, which ended")
    if owner != run_id:
        raise ConfigError(
            f"--output_dir {folder} belongs to run {owner} (its {RUN_FILE} file), not to this run "
            f"({run_id}): two runs never share a folder. Leave --output_dir at its default (a new "
            "folder per run under outputs/), give another folder, or delete that one if its run is over"
        )


def check_unowned(folder: str, environ: Mapping[str, str], own: str | None = None) -> None:
    """Refuses (ConfigError) a ``folder`` that no run owns (no RUN file) but holds anything other
    than what this job wrote before its trainers claim it: its launchers' files
    (:func:`_launcher_files`) and ``own``, the name of its checkpoint folder there. Anything else
    is the summary.json of a run that ended (before RUN files) or the user's: a run's results
    never mix with them. A new or empty folder is taken."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"--output_dir {folder} is not a folder: give a folder, or leave --output_dir at its default")
    if not os.path.isdir(folder):
        return
    if os.path.exists(os.path.join(folder, SUMMARY_FILE)):
        _refuse_ended(folder, "a run that ended")
    launchers = _launcher_files(environ)
    theirs = sorted(name for name in os.listdir(folder) if not launchers.fullmatch(name) and not _owns(own, name))
    if theirs:
        shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
        raise ConfigError(
            f"--output_dir {folder} is not a run's folder (it has no {RUN_FILE} file) and holds files "
            f"({shown}) that no run wrote: a run's results go into a folder of their own; give a new or "
            "empty folder, or leave --output_dir at its default (a new folder per run under outputs/)"
        )


def _entry_inside(folder: str, path: str) -> str | None:
    """The name of the entry of ``folder`` that holds the local ``path`` (``D/ckpt/x``: ``ckpt``;
    ``D`` itself: ``.``), or None where ``path`` is not inside it (a URL, another folder)."""
    path = path.removeprefix("file://")
    if not path or "://" in path:
        return None
    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(folder))
    first = relative.split(os.sep, 1)[0]
    return None if first == os.pardir else first


def _owns(own: str | None, name: str) -> bool:
    """Whether the run's checkpoint folder ``own`` (an entry's name, or ``.``: the run's folder
    itself) accounts for the entry ``name``."""
    if own != os.curdir:
        return name == own
    # Imported here: the components check run folders at submission, which imports no torch.
    from apps.core.checkpoint.folder import is_checkpoint_entry

    return is_checkpoint_entry(name)


def _launcher_files(environ: Mapping[str, str]) -> re.Pattern[str]:
    """The names that a job writes into its run's folder before its trainers claim it: torchrun's
    logs, Slurm's logs of this job (``slurm-<id>.out``, ``slurm-<id>-<replica>.err``, ...), and
    the RUN file that a run claiming the folder at the same time is writing."""
    slurm_job = re.escape(environ.get("SLURM_JOB_ID", ""))
    slurm_logs = rf"|slurm-{slurm_job}(-.*)?\.(out|err)" if slurm_job else ""
    return re.compile(rf"{TORCHRUN_LOGS}|\.{RUN_FILE}\..*\.tmp{slurm_logs}")


def _refuse_ended(folder: str, whose: str) -> NoReturn:
    raise ConfigError(
        f"--output_dir {folder} holds the summary.json of {whose}: a new run never writes "
        "over it. Leave --output_dir at its default (a new folder per run under outputs/), "
        "give another folder, or resume that run from its --checkpoint_dir"
    )


def results_of(folder: str, run_id: str) -> str | None:
    """The summary.json of run ``run_id``, newest first, in ``folder`` or a run folder beside it:
    where a resumed run that has nothing left to do tells its user to look."""
    if not folder:
        return None
    head = os.path.dirname(folder) or "."
    beside = [os.path.join(head, name) for name in os.listdir(head)]
    ended = [
        os.path.join(other, SUMMARY_FILE)
        for other in [folder, *beside]
        if not os.path.islink(other) and os.path.isfile(os.path.join(other, SUMMARY_FILE)) and _owner(other) == run_id
    ]
    return max(ended, key=os.path.getmtime) if ended else None


def point_latest(head: str, name: str) -> None:
    """Points ``head/latest`` at ``name`` (a relative link, replaced in one step). Anything there
    that is not a link is the user's: left as it is."""
    link = os.path.join(head, LATEST)
    if os.path.lexists(link) and not os.path.islink(link):
        logger.warning("%s is not a link: left as it is, not pointed at %s", link, name)
        return
    tmp = os.path.join(head, f".{LATEST}.{uuid.uuid4().hex}.tmp")
    try:
        os.symlink(name, tmp)
        os.replace(tmp, link)  # fails on a folder made there meanwhile: never replaces one
    except OSError as e:
        logger.warning("could not point %s at %s: %s", link, name, e)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def _torchx_app_id(environ: Mapping[str, str]) -> str | None:
    """The app id of a job that TorchX started: its torchrun rendezvous id (``--rdzv_id
    ${app_id}``). None for a bare torchrun, whose id the user picks or is random."""
    rendezvous = _safe(environ.get("TORCHELASTIC_RUN_ID", ""))
    if "TORCHX_JOB_ID" not in environ or rendezvous in ("", "none"):
        return None
    return rendezvous


def _job_name(environ: Mapping[str, str], app: str) -> str:
    """The job's name that TorchX gave it, made safe for a folder's name; else the name of its ``app``."""
    return _safe(environ.get("TORCHX_TRACKING_RUN_NAME", "")) or app


def _safe(text: str) -> str:
    """``text`` as one folder name: characters other than letters, digits, '_', '-' and '.' as '_'."""
    return _UNSAFE.sub("_", text).strip(".")


def _new_folder(head: str, name: str) -> str:
    """A folder made now under ``head``: ``name``, else ``name-2``, ``name-3``, ..."""
    for attempt in range(1, 1000):
        folder = os.path.join(head, name if attempt == 1 else f"{name}-{attempt}")
        try:
            os.mkdir(folder)
            return folder
        except FileExistsError:
            continue
    raise ConfigError(f"--output_dir: {os.path.join(head, name)} and 998 more exist; give another --output_dir")


def _owner(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, RUN_FILE)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _write_owner(folder: str, run_id: str) -> str:
    """Writes ``folder``'s RUN file unless it has one; returns the run it names. Written whole
    under a unique name, then linked into place: a reader never sees half of it, and of two runs
    claiming the folder at once, one gets it."""
    tmp = os.path.join(folder, f".{RUN_FILE}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "x") as f:
        f.write(run_id + "\n")
    try:
        os.link(tmp, os.path.join(folder, RUN_FILE))
    except FileExistsError:
        pass
    finally:
        os.remove(tmp)
    owner = _owner(folder)
    assert owner is not None
    return owner
