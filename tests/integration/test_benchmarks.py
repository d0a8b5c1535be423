"""The benchmarks run and report what the GPU check reads: their --json figures are there and
positive, and a resharded checkpoint loads equal. Outcomes only: timings are never asserted."""

import json
import sys

import pytest
import torch

from tests.conftest import REPO, assert_ok, run

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

LOADER = f"{REPO}/benchmarks/criteo_loader.py"
CHECKPOINT_IO = f"{REPO}/benchmarks/checkpoint_io.py"
PREDICT_THROUGHPUT = f"{REPO}/benchmarks/predict_throughput.py"
STARTUP = f"{REPO}/benchmarks/startup.py"
HSTU = f"{REPO}/benchmarks/hstu_throughput.py"
PARQUET = f"{REPO}/benchmarks/parquet_loader.py"
STEP_OVERHEAD = f"{REPO}/benchmarks/step_overhead.py"
TRAIN_THROUGHPUT = f"{REPO}/benchmarks/train_throughput.py"
#: The h100 preset's model at the tiny shapes of step_overhead.py, 3 windows of 4 steps.
TINY_H100 = ["--num_embeddings", "64", "--embedding_dim", "8", "--batch_size", "8", "--dense_arch_layer_sizes", "64,8"]
TINY_H100 += ["--over_arch_layer_sizes", "16,1", "--steps", "12"]
RATES = ("train_samples_per_sec", "train_samples_per_cpu_sec", "eval_samples_per_sec", "eval_samples_per_cpu_sec")


def run_loader(tmp_path, device: str) -> dict:
    report = tmp_path / "loader.json"
    result = run(
        [
            sys.executable,
            LOADER,
            "--rows",
            "200000",
            "--batch_size",
            "4096",
            "--repeats",
            "1",
            "--device",
            device,
            "--json",
            str(report),
        ]
    )
    assert_ok(result)
    assert "train:" in result.stdout and "eval :" in result.stdout
    return json.loads(report.read_text())


def test_loader_reports_positive_rates(tmp_path):
    figures = run_loader(tmp_path, "cpu")
    assert figures["device"] == "cpu" and figures["rows"] == 200000 and figures["batch_size"] == 4096
    assert all(figures[name] > 0 for name in RATES), figures


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_loader_refuses_cuda_without_a_gpu():
    result = run([sys.executable, LOADER, "--device", "cuda"])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("criteo_loader: --device cuda needs a CUDA GPU"), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies batches into a CUDA GPU")
def test_loader_delivers_into_the_gpu(tmp_path):
    figures = run_loader(tmp_path, "cuda")
    assert figures["device"] == "cuda"
    assert all(figures[name] > 0 for name in RATES), figures


def test_checkpoint_io_reshards_local_checkpoint_equal(tmp_path):
    report = tmp_path / "checkpoint.json"
    result = run(
        [
            sys.executable,
            CHECKPOINT_IO,
            "--targets",
            "local",
            "--rows",
            "20000",
            "--nproc",
            "2",
            "--repeats",
            "1",
            "--reshard_to",
            "row_wise",
            "--json",
            str(report),
        ],
        BENCH_DIR=str(tmp_path),
    )
    assert_ok(result)
    figures = json.loads(report.read_text())
    assert list(figures) == ["local"]
    local = figures["local"]
    assert local["gb"] > 0 and local["repeats"] == 1
    rates = ("save_gbps", "load_gbps", "raw_write_gbps", "raw_read_gbps", "reshard_load_gbps")
    checksums = ("summed_save_gbps", "unsummed_save_gbps", "checked_load_gbps", "unchecked_load_gbps")
    assert all(local[name] > 0 for name in rates + checksums), local
    assert all(local["samples"][name] == [local[name]] for name in rates + checksums), local
    assert local["checksum_save_cost"] > 0 and local["checksum_load_cost"] > 0, local
    assert local["reshard_to"] == "row_wise" and local["reshard_equal"] is True


def test_predict_throughput_prints_its_ratios_against_the_evaluation_loop(tmp_path):
    report = tmp_path / "predict.json"
    tiny = ["--files", "2", "--rows_per_file", "4096", "--num_embeddings", "2000", "--batch_size", "512"]
    result = run([sys.executable, PREDICT_THROUGHPUT, *tiny, "--repeats", "1", "--json", str(report)])
    assert_ok(result)
    figures = json.loads(report.read_text())
    assert figures["rows_scored"] == 2048 and figures["batch_size"] == 512
    models = ("package_fp32", "package_int8", "checkpoint_eager", "torchscript_fp32", "torchscript_int8")
    for name in models:
        ratio = f"{name}_over_eval_loop_per_cpu_sec"
        assert figures[ratio] > 0 and ratio in result.stdout, figures
    assert figures["int8_table_reduction"] > 1 and figures["export_none_seconds_per_trained_gb"] > 0, figures
    assert figures["predict_job_1_rank_rows_per_sec"] > 0, figures


def test_parquet_loader_reports_ours_over_both_baselines_locally_and_from_s3(tmp_path):
    report = tmp_path / "parquet.json"
    tiny = ["--rows", "40000", "--row_group_rows", "5000", "--batch_size", "1024", "--repeats", "1", "--passes", "1"]
    result = run([sys.executable, PARQUET, *tiny, "--json", str(report)])
    assert_ok(result)
    figures = json.loads(report.read_text())
    for target in ("local", "s3"):
        rates = {side: figures[target][f"{side}_samples_per_cpu_sec"] for side in ("ours", "scanner", "row_groups")}
        assert all(rate > 0 for rate in rates.values()), figures
        for baseline in ("scanner", "row_groups"):
            assert figures[target][f"ours_over_{baseline}_samples_per_cpu_sec"] == rates["ours"] / rates[baseline]
            assert f"{target:5s} ours / {baseline}: " in result.stdout


def test_startup_times_both_sides_to_their_first_step(tmp_path):
    report = tmp_path / "startup.json"
    result = run([sys.executable, STARTUP, "--repeats", "1", "--json", str(report)], BENCH_DIR=str(tmp_path))
    assert_ok(result)
    figures = json.loads(report.read_text())
    assert figures["nproc"] == 2 and figures["repeats"] == 1
    assert figures["samples"] == {"ours": [figures["ours_s"]], "plain": [figures["plain_s"]]}
    assert figures["ours_s"] > 0 and figures["plain_s"] > 0
    assert figures["ratio"] == figures["ours_s"] / figures["plain_s"]
    assert "time to step 1, 2 ranks, medians of 1" in result.stdout
    assert list(tmp_path.iterdir()) == [report]  # the run folders and logs went with the benchmark's folder


def test_hstu_throughput_reports_both_sides_computing_the_same_layers(tmp_path):
    report = tmp_path / "hstu.json"
    tiny = ["--users", "4", "--max_seq_len", "16", "--embedding_dim", "16", "--attention_dim", "8", "--linear_dim", "8"]
    result = run([sys.executable, HSTU, *tiny, "--iters", "1", "--repeats", "1", "--json", str(report)])
    assert_ok(result)
    assert "ratio (ours / padded dense reference):" in result.stdout
    figures = json.loads(report.read_text())
    assert figures["max_abs_diff"] < 1e-4, figures  # the reference computes the same function
    assert 4 <= figures["tokens"] <= figures["padded_tokens"] <= 4 * 16
    rates = [f"{side}_{unit}_per_sec" for side in ("ours", "reference") for unit in ("tokens", "sequences")]
    assert all(figures[name] > 0 for name in rates), figures
    assert figures["ratio"] == figures["ours_tokens_per_sec"] / figures["reference_tokens_per_sec"]


def test_step_overhead_measures_the_three_steps_and_ends_with_lean_over_plain(tmp_path):
    report = tmp_path / "steps.json"
    counts = ["--steps", "5", "--warmup", "2", "--count_steps", "1", "--repeats", "1"]
    result = run([sys.executable, STEP_OVERHEAD, *counts, "--json", str(report)])
    assert_ok(result)
    figures = json.loads(report.read_text())
    medians = figures["medians"]
    assert list(medians) == ["lean", "sharded", "plain"] and figures["repeats"] == 1
    assert all(side[name] > 0 for side in medians.values() for name in side), medians
    # Operators are counted, not timed: the lean step dispatches fewer than the sharded one (no
    # all-to-alls, no DDP).
    assert medians["lean"]["ops_per_step"] < medians["sharded"]["ops_per_step"], medians
    ratio = medians["lean"]["host_ms_per_step"] / medians["plain"]["host_ms_per_step"]
    assert figures["lean_over_plain"] == ratio
    assert result.stdout.strip().splitlines()[-1] == f"lean/plain host time per step: {ratio:.3f}"


def test_train_throughput_h100_reports_steady_lean_sharded_and_pooled_rows(tmp_path):
    report = tmp_path / "throughput.json"
    options = ["--preset", "h100", "--nproc", "1", "--repeats", "1", "--window", "4", "--levers", "sharded_step"]
    result = run([sys.executable, TRAIN_THROUGHPUT, *options, "--json", str(report), "--", *TINY_H100])
    assert_ok(result)
    figures = json.loads(report.read_text())
    assert figures["steady_window"] == 4
    # Batches made in the loop: plain first (what the GPU check reads), then the app's lean step
    # (one rank, whole tables) and its sharded one; the same from a pool made before the loop.
    assert [row["config"] for row in figures["rows"]] == [
        "plain TorchRec",
        "app (lean step)",
        "app +sharded_step (sharded step)",
    ]
    assert [row["config"] for row in figures["pooled_rows"]] == [
        "plain TorchRec, pooled batches",
        "app, pooled batches (lean step)",
    ]
    for rows in (figures["rows"], figures["pooled_rows"]):
        assert rows[0]["ratio"] == 1.0 and all(row["samples_per_sec"] > 0 for row in rows), rows
    assert "steady: medians of 4-step windows after the first" in result.stdout


def test_train_throughput_refuses_steady_rows_without_two_windows():
    result = run([sys.executable, TRAIN_THROUGHPUT, "--preset", "h100", "--window", "100", "--", "--steps", "150"])
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "--steps 150: the steady rows need two windows of --window 100 steps at least (the first is "
        "left out); raise --steps or lower --window"
    )
