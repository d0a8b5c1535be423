"""Preprocessing all days: settings check, resume, parallel workers, progress and the report.

Days are independent, so a pool of worker processes converts one input file each. A day is
complete once its ``<day>_report.json`` exists; a rerun skips complete days and redoes the
others from the start (their partial files were never given final names). The folder's
``manifest.json`` records the settings, so a rerun with other settings is refused instead of
mixing days that do not fit together; it is written first (a folder that is not empty and has no
manifest of ours is refused before anything is written into it) and again at the end, with the
checksums of every complete day.
"""

import concurrent.futures as futures
import functools
import logging
import multiprocessing
import os
import queue
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.queues import Queue
from typing import Callable, TypeVar

import pyarrow as pa
from tqdm import tqdm

from apps.core.common.errors import ConfigError
from apps.dlrm.data.criteo import convert, vocabulary
from apps.dlrm.data.criteo.config import PreprocessConfig
from apps.dlrm.data.criteo.layout import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    REPORT,
    VOCABULARY_DIR,
    checksums,
    day_report_file,
    parse_manifest,
    read_json,
    write_json,
)
from apps.dlrm.data.criteo.parse import REPAIRED_KINDS, SKIPPED_KINDS, LineCounts
from apps.dlrm.data.criteo.sources import Source, find_sources, natural_key

logger = logging.getLogger("apps.dlrm.preprocess")

VOCABULARY_DONE = "vocabulary.json"

# Workers report progress in steps of this many bytes (fewer messages to the parent).
_PROGRESS_STEP = 8 << 20


class PreprocessFailed(Exception):
    """Some days could not be converted; the others are complete. Names every failed file."""


def preprocess(cfg: PreprocessConfig) -> dict:
    """Converts every input file of ``cfg`` that is not complete yet; returns the report."""
    output = cfg.output.removeprefix("file://")
    sources = find_sources(cfg.input)
    _refuse_output_among_inputs(output, sources)
    manifest = _check_or_write_manifest(output, cfg, [s.day for s in sources])
    if cfg.categorical_ids == "vocabulary":
        os.makedirs(os.path.join(output, VOCABULARY_DIR), exist_ok=True)
    pending = [s for s in sources if not os.path.exists(os.path.join(output, day_report_file(s.day)))]
    logger.info(
        "%d input files -> %s: %d already complete, %d to convert",
        len(sources),
        output,
        len(sources) - len(pending),
        len(pending),
    )
    failures: list[str] = []
    if cfg.categorical_ids == "hash":
        convert_day = functools.partial(convert.convert_day, output_format=cfg.output_format)
        failures += _run(
            cfg, pending, "convert", lambda s: (convert_day, s, output, cfg.table_sizes), sum(s.size for s in pending)
        )
    else:
        failures += _vocabulary_passes(cfg, output, manifest["days"], pending)
    report = _write_report(output, manifest["days"])
    write_json(
        os.path.join(output, MANIFEST), {**manifest, "files": checksums(output, manifest["days"], cfg.output_format)}
    )
    if failures:
        raise PreprocessFailed(
            f"{len(failures)} of {len(sources)} input files failed (the others are complete; a "
            "rerun converts only what is missing):\n  " + "\n  ".join(failures)
        )
    return report


def _refuse_output_among_inputs(output: str, sources: list[Source]) -> None:
    out = os.path.realpath(output)
    for source in sources:
        path = source.url.removeprefix("file://")
        if "://" not in path and os.path.dirname(os.path.realpath(path)) == out:
            raise ConfigError(
                f"--output {output} is the folder of the input {source.url}: a rerun would take "
                "the outputs for inputs; write to another folder"
            )


def _settings(cfg: PreprocessConfig) -> dict:
    settings = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "categorical_ids": cfg.categorical_ids,
        "num_embeddings_per_feature": cfg.table_sizes,
    }
    if cfg.categorical_ids == "vocabulary":
        settings["frequency_threshold"] = cfg.frequency_threshold
    if cfg.output_format != "npy":  # npy folders keep the manifest they had before Parquet existed
        settings["output_format"] = cfg.output_format
    return settings


def _check_or_write_manifest(output: str, cfg: PreprocessConfig, days: list[str]) -> dict:
    """Refuses an --output that holds anything but days of these settings; writes the manifest
    (creating the folder) with the days of this run added."""
    path = os.path.join(output, MANIFEST)
    settings = _settings(cfg)
    if os.path.exists(path):
        with open(path, "rb") as f:
            manifest = parse_manifest(f.read(), path, "write to another --output")
        old = {k: v for k, v in manifest.items() if k not in ("days", "files")}
        if old != settings:
            differences = ", ".join(
                f"{k}: {old.get(k)!r} there, {settings.get(k)!r} now"
                for k in sorted(set(old) | set(settings))
                if old.get(k) != settings.get(k)
            )
            raise ConfigError(
                f"--output {output} holds days written with other settings ({differences}): "
                "rerun with the same settings, or write to another --output"
            )
        if cfg.categorical_ids == "vocabulary" and sorted(manifest["days"]) != sorted(days):
            raise ConfigError(
                f"--output {output} holds a vocabulary built from the days "
                f"{', '.join(manifest['days'])}; with --categorical_ids vocabulary every day "
                "depends on all inputs: give the same inputs, or write to another --output"
            )
        days = sorted(set(manifest["days"]) | set(days), key=natural_key)
    elif os.path.isdir(output) and os.listdir(output):
        raise ConfigError(
            f"--output {output} is not empty and has no {MANIFEST}: it was not written by this "
            f"preprocessing, and its files could be overwritten; give an empty or new folder "
            f"(e.g. {os.path.join(output, 'criteo_npy')})"
        )
    os.makedirs(output, exist_ok=True)
    manifest = {**settings, "days": days, "files": checksums(output, days, cfg.output_format)}
    write_json(path, manifest)
    return manifest


def _vocabulary_passes(cfg: PreprocessConfig, output: str, days: list[str], pending: list[Source]) -> list[str]:
    vocab_dir = os.path.join(output, VOCABULARY_DIR)
    # A day needs the first pass again unless both its counts and its raw values are there.
    first = [
        s
        for s in pending
        if not (
            os.path.exists(convert.lines_file(output, s.day))
            and os.path.exists(vocabulary.values_file(vocab_dir, s.day))
        )
    ]
    failures = _run(cfg, first, "count", lambda s: (convert.convert_day, s, output, None), sum(s.size for s in first))
    if failures:
        return failures
    done_path = os.path.join(vocab_dir, VOCABULARY_DONE)
    if not os.path.exists(done_path):
        logger.info("building the vocabularies of %d days (frequency threshold %d)", len(days), cfg.frequency_threshold)
        distinct = vocabulary.build_vocabulary(
            [vocabulary.counts_file(vocab_dir, day) for day in days],
            cfg.frequency_threshold,
            cfg.table_sizes,
            vocab_dir,
        )
        write_json(done_path, {"days": days, "distinct_values": distinct})
        logger.info("distinct values per feature: %s", ", ".join(map(str, distinct)))
    finish_day = functools.partial(convert.finish_day, output_format=cfg.output_format)
    return _run(
        cfg,
        pending,
        "ids",
        lambda s: (finish_day, output, s.day),
        sum(os.path.getsize(vocabulary.values_file(vocab_dir, s.day)) for s in pending),
    )


def _run(
    cfg: PreprocessConfig, sources: list[Source], what: str, task: Callable[[Source], tuple], total_bytes: int
) -> list[str]:
    """Runs ``task(source)`` (a function and its arguments) for every source in a process pool;
    returns the failures."""
    if not sources:
        return []
    cores = len(os.sched_getaffinity(0))
    workers = min(cfg.workers or cores, len(sources))
    context = multiprocessing.get_context("spawn")  # no fork: the parent may hold I/O threads
    progress: "Queue[int]" = context.Queue()
    failures = []
    logger.info("%s: %d files on %d worker processes", what, len(sources), workers)
    with (
        tqdm(total=total_bytes, unit="B", unit_scale=True, desc=what, mininterval=1.0) as bar,
        futures.ProcessPoolExecutor(
            workers, mp_context=context, initializer=_init_worker, initargs=(progress, max(1, cores // workers))
        ) as pool,
    ):
        running = {pool.submit(_in_worker, *task(source)): source for source in sources}
        while running:
            done, _ = futures.wait(running, timeout=0.5, return_when=futures.FIRST_COMPLETED)
            _drain(progress, bar)
            for future in done:
                source = running.pop(future)
                try:
                    report = future.result()
                except convert.DayFailed as e:
                    logger.error("%s failed: %s", source.day, e)
                    failures.append(str(e))
                    continue
                except BrokenProcessPool as e:  # a worker was killed (out of memory?)
                    logger.error("%s failed: %s", source.day, e)
                    failures.append(f"{source.url}: a worker process died (out of memory?): {e}")
                    continue
                if report is not None:
                    _log_day(source.day, report)
        _drain(progress, bar)
    return failures


_progress_queue: "Queue[int] | None" = None

R = TypeVar("R")


def _init_worker(progress_queue: "Queue[int]", arrow_threads: int) -> None:
    global _progress_queue
    _progress_queue = progress_queue
    pa.set_cpu_count(arrow_threads)


def _in_worker(fn: Callable[..., R], *args: object) -> R:
    progress_queue = _progress_queue
    assert progress_queue is not None, "runs in a pool worker, which _init_worker set up"
    pending = 0

    def progress(nbytes: int) -> None:
        nonlocal pending
        pending += nbytes
        if pending >= _PROGRESS_STEP:
            progress_queue.put(pending)
            pending = 0

    result = fn(*args, progress)
    progress_queue.put(pending)
    return result


def _drain(progress_queue: "Queue[int]", bar: tqdm) -> None:
    while True:
        try:
            bar.update(progress_queue.get_nowait())
        except queue.Empty:
            return


def _log_day(day: str, report: dict) -> None:
    problems = "; ".join(
        f"{action} {', '.join(f'{kind} {n:,}' for kind, n in report[action].items() if n)}"
        for action in ("skipped", "repaired")
        if any(report[action].values())
    )
    logger.info(
        "%s: %s rows read, %s written%s",
        day,
        f"{report['rows_read']:,}",
        f"{report['rows_written']:,}",
        f" ({problems})" if problems else "",
    )
    if report["rows_read"] and not report["rows_written"]:
        logger.warning("%s: no row was kept: is it a Criteo click log with labels?", day)


POLICY = {
    **{kind: "line skipped" for kind in SKIPPED_KINDS},
    **{kind: "field treated as missing, line kept" for kind in REPAIRED_KINDS},
}


def _write_report(output: str, days: list[str]) -> dict:
    """report.json: the counts of every complete day, and of all of them together."""
    total = LineCounts()
    per_day = {}
    for day in days:
        path = os.path.join(output, day_report_file(day))
        if os.path.exists(path):
            counts = LineCounts.from_json(read_json(path))  # without the day's checksums
            per_day[day] = counts.to_json()
            total.add(counts)
    report = {
        **total.to_json(),
        "policy": POLICY,
        "days": per_day,
        "incomplete_days": [day for day in days if day not in per_day],
    }
    write_json(os.path.join(output, REPORT), report)
    logger.info(
        "%s rows read, %s written, %s skipped, %s repaired; wrote %s",
        f"{total.read:,}",
        f"{total.written:,}",
        f"{sum(total.skipped.values()):,}",
        f"{sum(total.repaired.values()):,}",
        os.path.join(output, REPORT),
    )
    return report
