"""What a training job prints, piece by piece: the trainers' thread count (no torchrun banner), the
agent's one line about a failure, TorchX's notices left out, the plan in one line, no progress bar
in a log, and a term explained once. The whole output of real jobs is checked in test_main_job.py
(a success) and test_checkpoint.py (a restart)."""

import io
import json
import logging
import os
import shlex
import signal
import warnings

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torchrec.distributed.types import ParameterSharding, ShardingPlan

from apps.core.common import library_warnings
from apps.core.common.distributed import REFUSALS_FOLDER, DistEnv, exit_refused
from apps.core.common.errors import ConfigError
from apps.core.common.library_warnings import filter_known_warnings
from apps.core.launch import agent
from apps.core.launch.torchrun_args import available_cores, trainer_threads
from apps.core.training.report import Reporter
from apps.core.training.sharding import summarize_plan
from apps.dlrm.model import EBC_PATH
from components import torchx_logs

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"


def test_the_trainers_share_the_cores_unless_the_user_set_their_threads(tmp_path, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    no_quota = str(tmp_path / "none")
    assert trainer_threads("2", {}, no_quota) == {"OMP_NUM_THREADS": "8"}
    assert trainer_threads("32", {}, no_quota) == {"OMP_NUM_THREADS": "1"}  # at least one each
    assert trainer_threads("2", {"OMP_NUM_THREADS": "3"}, no_quota) == {}  # the user's, kept
    assert trainer_threads("gpu", {}, no_quota) == {}  # torchrun counts: its own default then
    assert trainer_threads("1", {}, no_quota) == {}  # one trainer: PyTorch's own default
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("400000 100000\n")  # a container limited to 4 CPUs of the 16
    assert available_cores(str(cpu_max)) == 4 and trainer_threads("2", {}, str(cpu_max)) == {"OMP_NUM_THREADS": "2"}
    cpu_max.write_text("max 100000\n")
    assert available_cores(str(cpu_max)) == 16


def failure(tmp_path, rank: int, exitcode: int, message: str | None = None, at: int = 0) -> ProcessFailure:
    """A failed rank as torchrun sees it, with the error file ``@record`` writes where ``message``."""
    error_file = tmp_path / f"error-{rank}-{exitcode}.json"
    if message is not None:
        info = {"py_callstack": "Traceback ...", "timestamp": str(at)}
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file))


def test_the_agent_names_the_rank_that_failed_first_and_how(tmp_path):
    reset = "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:37535: Connection reset by peer. " + "x" * 300
    killed = {
        0: failure(tmp_path, 0, 1, reset, at=1),  # failed on the lost rank's absence, recorded first
        1: failure(tmp_path, 1, -signal.SIGKILL),
    }
    assert agent.describe_failure(*agent.root_failure(killed)) == "rank 1 died (SIGKILL)"
    stopped = {0: failure(tmp_path, 0, -signal.SIGTERM), 1: failure(tmp_path, 1, 1, reset)}  # torchrun's SIGTERM
    line = agent.describe_failure(*agent.root_failure(stopped))
    assert line.startswith("rank 1 exited with 1: RuntimeError: [pair.cc:537]") and line.endswith("...")
    assert len(line) == len("rank 1 exited with 1: ") + agent.MESSAGE_CHARS
    assert agent.describe_failure(*agent.root_failure({0: failure(tmp_path, 0, 2)})) == "rank 0 exited with 2"


def test_a_refusal_is_quoted_whole_from_whichever_rank_stopped_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv(REFUSALS_FOLDER, str(tmp_path))
    reason = "--data_path s3://clicks/train/ cannot be reached: " + "y" * 300
    with pytest.raises(SystemExit) as exited:
        exit_refused(ConfigError(reason), DistEnv(1, 2, 1, 2, torch.device("cpu"), "gloo"))  # no grace wait
    assert exited.value.code == 2
    rank1 = ProcessFailure(local_rank=1, pid=os.getpid(), exitcode=2, error_file="<N/A>")
    stopped = failure(tmp_path, 0, -signal.SIGTERM)
    assert agent.describe_failure(*agent.root_failure({0: stopped, 1: rank1})) == f"rank 1 exited with 2: {reason}"


def test_torchrun_lines_about_a_failure_are_dropped_and_its_others_kept(monkeypatch):
    monkeypatch.setattr(agent.launcher, "LocalElasticAgent", agent.LocalElasticAgent)
    torch_logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    monkeypatch.setattr(torch_logger, "filters", [])
    agent.report_restarts()
    assert agent.launcher.LocalElasticAgent is agent.ReportingAgent
    said = records_of(torch_logger, lambda: torch_logger.warning("Sending process %s closing signal %s", 7, "SIGTERM"))
    said += records_of(torch_logger, lambda: torch_logger.warning("Unable to shutdown process %s", 7))
    assert said == ["Unable to shutdown process 7"]


def records_of(target: logging.Logger, emit) -> list[str]:
    """The messages ``emit`` logs on ``target`` that pass its filters."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    target.addHandler(handler)
    try:
        emit()
    finally:
        target.removeHandler(handler)
    return stream.getvalue().splitlines()


@pytest.mark.parametrize(
    "name, message, args, shown",
    [
        ("torchx.runner.api", "tracker configurations: %s", ({},), False),
        ("torchx.runner.api", "tracker configurations: %s", ({"fsspec": "/tmp/t"},), True),  # a tracker: said
        ("torchx.schedulers.local_scheduler", torchx_logs.NOTICES["torchx.schedulers.local_scheduler"][0], (), False),
        ("torchx.schedulers.local_scheduler", "log directory is: `%s`", ("/tmp/torchx_x",), False),
        ("torchx.schedulers.local_scheduler", "launched %s", ("app",), True),
    ],
)
def test_torchx_notices_are_left_out_once_the_components_are_loaded(name, message, args, shown):
    torchx_logs.drop_notices()
    torchx_logs.drop_notices()  # once, however often
    target = logging.getLogger(name)
    assert target.filters.count(torchx_logs._keep) == 1
    assert bool(records_of(target, lambda: target.warning(message, *args))) == shown


def test_the_plan_in_a_few_words():
    def table(kind: str, ranks: list[int]) -> ParameterSharding:
        return ParameterSharding(sharding_type=kind, compute_kernel="fused", ranks=ranks)

    tables = {f"t_cat_{i}": table("table_wise", [i % 2]) for i in range(4)}
    tables["t_cat_4"] = table("row_wise", [0, 1])
    plan = ShardingPlan({EBC_PATH: tables})
    assert summarize_plan(plan, 2) == "5 tables (4 table_wise, 1 row_wise) on 2 ranks, 3 per rank"
    assert summarize_plan(plan, 3) == "5 tables (4 table_wise, 1 row_wise) on 3 ranks, 0 to 3 per rank"


def test_no_progress_bar_in_a_log_and_a_note_once(tmp_path, caplog, monkeypatch):
    log = io.StringIO()  # a log file, not a terminal
    monkeypatch.setattr("sys.stderr", log)
    reporter = Reporter(str(tmp_path), enabled=True)
    reporter.progress(total=10, initial=0)
    reporter.step(loss=0.5)
    reporter.close_progress()
    with caplog.at_level(logging.INFO, logger="apps"):
        for _ in range(2):
            reporter.note("auroc_ceiling: what it is")
    reporter.close()
    assert log.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == ["auroc_ceiling: what it is"]


def test_fbgemm_s_missing_compat_entry_is_filtered_and_its_other_version_warning_still_shows():
    # Through FBGEMM's own check, as its import runs it for each library it loads: a release its
    # table lacks (fbgemm-gpu 1.6.0 lacks its own), then one it pairs with another torch.
    import fbgemm_gpu

    root = logging.getLogger()
    filter_known_warnings()
    filter_known_warnings()  # once, however often
    assert root.filters.count(library_warnings._keep) == 1
    missing = records_of(root, lambda: fbgemm_gpu._load_library("no_such_library.so", "9.9.0", no_throw=True))
    assert not [line for line in missing if "_fbgemm_torch_compat_table" in line]
    assert [line for line in missing if "Could not load the library 'no_such_library.so'" in line]
    other = records_of(root, lambda: fbgemm_gpu._load_library("no_such_library.so", "1.0.0", no_throw=True))
    assert [line for line in other if "which is not guaranteed to be" in line]


def test_fbgemm_s_b200_debugging_warning_is_filtered_and_its_other_warnings_still_show():
    # As torch raises FBGEMM 1.6.0's TORCH_WARN_ONCE in the embedding backward: a UserWarning
    # with the C++ source appended.
    b200 = (
        "TBE B200 optimization: device_major=9, feature_enabled=0, segment_length=1024 (Triggered "
        "internally at fbgemm_gpu/codegen/training/backward/embedding_backward_split_template.cu:1002.)"
    )
    # FBGEMM's other warnings, that its embedding kernels failed to load, say (Deprecation here).
    failed = "Failed to import: fbgemm_gpu.split_embedding_codegen_lookup_invokers.lookup_adagrad"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_known_warnings()
        warnings.warn(b200, UserWarning, stacklevel=1)
        warnings.warn(failed, DeprecationWarning, stacklevel=1)
        warnings.warn(failed, UserWarning, stacklevel=1)
        warnings.warn(b200, DeprecationWarning, stacklevel=1)  # the text alone is not enough
    assert [(w.category, str(w.message)) for w in caught] == [
        (DeprecationWarning, failed),
        (UserWarning, failed),
        (DeprecationWarning, b200),
    ]


def test_the_tensorboard_command_pastes_into_a_shell_whatever_the_folder_is_named(tmp_path, caplog):
    folder = tmp_path / "my runs" / "dlrm $HOME's"
    with caplog.at_level(logging.INFO, logger="apps"):
        Reporter(str(folder), enabled=True).log_results()
    (command,) = [m.removeprefix("TensorBoard: ") for m in caplog.messages if m.startswith("TensorBoard: ")]
    assert shlex.split(command) == ["tensorboard", "--logdir", str(folder)]
