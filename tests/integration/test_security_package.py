"""Hostile inference packages and export's output place: nothing planted in a package's program
runs when ``load_model``, ``predict`` or ``check_archive`` reads it (pickles, guards, symbolic
sizes that torch hands to ``sympy.sympify``, a second zip entry of one name), and ``export``
writes a whole package or nothing, saying in one line why not (a read-only or full disk, a place
it cannot write), into the folder an ``--output`` link points to.

Once per module: a small Parquet run trained by one process, and its float32 package."""

import hashlib
import io
import json
import logging
import os
import shlex
import sys
import zipfile
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from apps.core.common.errors import ConfigError
from apps.dlrm.serving.api import load_model
from apps.dlrm.serving.config import ExportConfig
from apps.dlrm.serving.export import export
from apps.dlrm.serving.package import MANIFEST_FILE, PROGRAM_FILE, check_archive
from testing.click_parquet import write_click_parquet
from tests.conftest import assert_ok, run
from tests.integration.test_security_checkpoint import RunsCode

# Tier (tests/conftest.py): real processes (training, predict, export in a mount namespace).
TIER = "integration"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("package")
    paths = SimpleNamespace(**{name: str(root / name) for name in ("data", "ckpt", "out", "package")})
    write_click_parquet(paths.data, files=2, rows_per_file=1024)
    train = ["--data", "parquet", "--data_path", paths.data, "--num_embeddings", "200", "--batch_size", "128"]
    train += ["--steps", "8", "--val_batches", "1", "--test_batches", "1", "--checkpoint_dir", paths.ckpt]
    assert_ok(run([sys.executable, "-m", "apps.dlrm.train", *train, "--output_dir", paths.out]))
    export(ExportConfig(checkpoint_dir=paths.ckpt, output=paths.package))
    return paths


def test_a_package_export_wrote_loads_and_scores_any_number_of_rows(job):
    """Its symbolic sizes (the rows, the ids) pass the checks and keep the batch dynamic."""
    rows = pq.read_table(job.data)
    package, checkpoint = load_model(job.package), load_model(job.ckpt)
    for count in (2, 7, 300):
        assert np.abs(package(rows.slice(0, count)) - checkpoint(rows.slice(0, count))).max() <= 1e-6


# --- planted programs: refused unread, nothing runs -----------------------------------------------


def plant_pickled_weight(entries: list[tuple[str, bytes]], marker) -> None:
    """Makes an archive's first weight a pickle that runs ``touch marker`` when torch loads it."""
    config = _config_entry(entries)
    planted, path_name = _pickled_config(entries[config][1])
    entries[config] = (entries[config][0], planted)
    weight = entries[config][0].rsplit("/", 1)[0] + "/" + path_name
    entries[[name for name, _ in entries].index(weight)] = (weight, runs_code(marker))


def plant_twin_config(entries: list[tuple[str, bytes]], marker) -> None:
    """Puts before the weights' config a second one of the same name whose first weight is a new
    file, a pickle that runs ``touch marker``: torch reads the first entry of a name, Python's
    zipfile the last."""
    name, benign = entries[_config_entry(entries)]
    planted, path_name = _pickled_config(benign, path_name=f"weight_{len(entries)}")
    entries.insert(0, (name, planted))
    entries.append((name.rsplit("/", 1)[0] + "/" + path_name, runs_code(marker)))


def plant_guard(entries: list[tuple[str, bytes]], marker) -> None:
    """Makes an archive's guard Python code that runs ``touch marker`` when the program is built."""
    _change_program(
        entries, lambda program: program.update(guards_code=[f"__import__('os').system('touch {marker}') == 0"])
    )


def plant_size_expression(entries: list[tuple[str, bytes]], marker) -> None:
    """Wraps the symbolic size of the input's rows (``expr_str``, which torch's deserializer hands
    to ``sympy.sympify``) in a call that runs ``touch marker`` and adds 0: the program still loads
    and scores as before."""

    def plant(program: dict) -> None:
        size = program["graph_module"]["graph"]["tensor_values"]["dense"]["sizes"][0]["as_expr"]
        size["expr_str"] = f"Add(Integer(0 * __import__('os').system('touch {marker}')), {size['expr_str']})"

    _change_program(entries, plant)


def plant_range_key(entries: list[tuple[str, bytes]], marker) -> None:
    """Names a range constraint by Python code (torch reads these names as symbols')."""
    key = f"__import__('os').system('touch {marker}')"
    _change_program(entries, lambda program: program["range_constraints"].update({key: {"min_val": 0, "max_val": 1}}))


def runs_code(marker) -> bytes:
    """A file that torch's loader unpickles (``torch.load``, ``weights_only=False``) as ``touch marker``."""
    buffer = io.BytesIO()
    torch.save(RunsCode(marker), buffer)
    return buffer.getvalue()


def _config_entry(entries: list[tuple[str, bytes]]) -> int:
    (index,) = [i for i, (name, _) in enumerate(entries) if name.endswith("weights_config.json")]
    return index


def _pickled_config(config_bytes: bytes, path_name: str | None = None) -> tuple[bytes, str]:
    """The weights' config with its first weight marked ``use_pickle`` (in file ``path_name``)."""
    config = json.loads(config_bytes)
    first = next(iter(config["config"].values()))
    first["use_pickle"] = True
    first["path_name"] = path_name or first["path_name"]
    return json.dumps(config).encode(), first["path_name"]


def _change_program(entries: list[tuple[str, bytes]], change) -> None:
    (index,) = [i for i, (name, _) in enumerate(entries) if name.endswith("models/model.json")]
    program = json.loads(entries[index][1])
    change(program)
    entries[index] = (entries[index][0], json.dumps(program).encode())


def planted_package(job, tmp_path, plant, marker) -> str:
    """A copy of the package whose program ``plant`` changed, its manifest's SHA-256 made to match
    (as a planter would make it)."""
    package = tmp_path / "package"
    package.mkdir()
    with zipfile.ZipFile(os.path.join(job.package, PROGRAM_FILE)) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    plant(entries, marker)
    program = package / PROGRAM_FILE
    with zipfile.ZipFile(program, "w") as archive:
        for name, data in entries:
            archive.writestr(zipfile.ZipInfo(name), data)  # a second entry of a name too (zipfile warns)
    manifest = json.loads(open(os.path.join(job.package, MANIFEST_FILE)).read())
    manifest["program"]["sha256"] = hashlib.sha256(program.read_bytes()).hexdigest()
    (package / MANIFEST_FILE).write_text(json.dumps(manifest))
    return str(package)


@pytest.mark.filterwarnings("ignore:Duplicate name:UserWarning")
@pytest.mark.parametrize(
    "plant, what",
    [
        (plant_pickled_weight, "a pickled object, not raw tensor bytes"),
        (plant_twin_config, "a second entry of the name"),
        (plant_guard, "a guard that is not arithmetic on the inputs' sizes"),
        (plant_size_expression, "graph_module.graph.tensor_values.dense.sizes.0.as_expr.expr_str"),
        (plant_range_key, "range_constraints"),
    ],
)
def test_a_planted_program_is_refused_unread_by_every_reader_and_runs_nothing(job, tmp_path, plant, what):
    marker = tmp_path / "ran"
    package = planted_package(job, tmp_path, plant, marker)
    with pytest.raises(ConfigError) as refused:
        load_model(package)
    said = str(refused.value)
    assert (
        what in said and "refused unread, nothing in it ran" in said and "not written by components.dlrm:export" in said
    )
    assert f"{package}/{PROGRAM_FILE}" in said and "\n" not in said
    with open(os.path.join(package, PROGRAM_FILE), "rb") as f, pytest.raises(ConfigError, match="refused unread"):
        check_archive(f, PROGRAM_FILE)
    predict = [sys.executable, "-m", "apps.dlrm.predict", "--model", package, "--data_path", job.data]
    result = run([*predict, "--output", str(tmp_path / "scores")])
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert what in line and "refused unread" in line and "Traceback" not in result.stderr
    assert not marker.exists()


def test_entries_whose_names_differ_only_in_case_are_refused(job, tmp_path):
    """torch's reader finds a name ignoring case: one of two such entries would go unchecked."""

    def twin(entries: list[tuple[str, bytes]], marker) -> None:
        name, data = entries[_config_entry(entries)]
        folder, base = name.rsplit("/", 1)
        entries.insert(0, (f"{folder}/{base.replace('model', 'MODEL')}", data))

    package = planted_package(job, tmp_path, twin, None)
    with pytest.raises(ConfigError) as refused:
        load_model(package)
    said = str(refused.value)
    assert "weights/model_weights_config.json', a second entry of the name" in said
    assert "weights/MODEL_weights_config.json'" in said and "refused unread" in said


# --- export's output place -------------------------------------------------------------------------


def test_an_output_that_is_a_link_to_an_empty_folder_receives_the_package(job, tmp_path):
    """As ``cp -r`` or ``torch.save`` into a linked folder would: the link is kept, the package is
    in the folder it points to."""
    target, link = tmp_path / "elsewhere", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    export(ExportConfig(checkpoint_dir=job.ckpt, output=str(link)))
    assert link.is_symlink() and sorted(os.listdir(target)) == [MANIFEST_FILE, PROGRAM_FILE]
    rows = pq.read_table(job.data).slice(0, 5)
    assert np.array_equal(load_model(str(link))(rows), load_model(job.package)(rows))


def test_an_output_that_cannot_be_written_is_refused_before_the_checkpoint_is_read(job, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError) as refused:
        export(ExportConfig(checkpoint_dir=job.ckpt, output=str(blocker / "package")))
    said = str(refused.value)
    assert f"--output {blocker / 'package'} cannot be written" in said and "give an --output" in said, said
    assert not any("whole into this process" in record.getMessage() for record in caplog.records)


def export_on_a_disk(job, tmp_path, mount_options: str) -> SimpleNamespace:
    """``python -m apps.dlrm.export`` into a tmpfs mounted with ``mount_options`` in a mount
    namespace of its own: its --output, its ERROR line, its log, and what it left on the disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    output = disk / "package"
    command = [sys.executable, "-m", "apps.dlrm.export", "--checkpoint_dir", job.ckpt, "--output", str(output)]
    script = f"mount -t tmpfs -o {mount_options} tmpfs {disk} && {shlex.join(command)}; echo left: $(ls -A {disk})"
    result = run(["unshare", "--mount", "sh", "-c", script])
    log = result.stdout + result.stderr
    assert "Traceback" not in log and "Aborted" not in log and "terminate" not in log, log[-3000:]
    (left,) = [line for line in result.stdout.splitlines() if line.startswith("left:")]
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, log[-3000:]
    return SimpleNamespace(output=str(output), error=errors[0], log=log, left=left.split()[1:])


@needs_root
def test_a_full_disk_during_export_is_said_in_one_line_and_leaves_nothing(job, tmp_path):
    # 512 KiB: the checkpoint loads and exports; the 1.6 MB program does not fit.
    exported = export_on_a_disk(job, tmp_path, "size=512k")
    assert f"--output {exported.output}: the package could not be written" in exported.error, exported.error
    assert "No space left on device" in exported.error and exported.left == []


@needs_root
def test_a_read_only_disk_is_refused_before_the_checkpoint_is_read(job, tmp_path):
    exported = export_on_a_disk(job, tmp_path, "ro,size=512k")
    assert f"--output {exported.output} cannot be written" in exported.error, exported.error
    assert "Read-only file system" in exported.error and exported.left == []
    assert "whole into this process" not in exported.log
