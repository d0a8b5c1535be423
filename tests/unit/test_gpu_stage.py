"""What scripts/gpu_stage/ and benchmarks/gpu_call.py decide without a GPU: which of fbgemm-gpu's
kernels the pack zeroes (on a fatbin laid out as fbgemm-gpu 1.6.0's are), and how the one-call
check turns its GPU command lines into the quick CPU ones that check them here."""

import importlib.util
import struct
from pathlib import Path

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from apps.core.config import EMBEDDING_OPTIMIZERS
from benchmarks.gpu_call import TORCHX_RUN, dryrun, on_cpu, steps
from benchmarks.train_profile import busy_seconds, device_figures

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("slim_fbgemm", REPO / "scripts" / "gpu_stage" / "slim_fbgemm.py")
assert _spec and _spec.loader
slim_fbgemm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slim_fbgemm)

ENTRY_HEADER = 64  # bytes, as in fbgemm-gpu 1.6.0's fatbins


def entry(arch: int, payload: bytes, flags: int = 0) -> bytes:
    header = bytearray(ENTRY_HEADER)
    struct.pack_into("<HHIQ", header, 0, 2, 0x101, ENTRY_HEADER, len(payload))  # kind 2: a cubin
    struct.pack_into("<I", header, slim_fbgemm.ENTRY_ARCH_AT, arch)
    struct.pack_into("<Q", header, slim_fbgemm.ENTRY_FLAGS_AT, flags)
    return bytes(header) + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", slim_fbgemm.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(fatbin: bytes) -> bytes:
    """A 64-bit little-endian ELF file of three sections: none, .shstrtab and .nv_fatbin."""
    names = b"\0.shstrtab\0.nv_fatbin\0"
    data_at = 64
    fatbin_at = data_at + len(names)
    shoff = fatbin_at + len(fatbin)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 1)

    def section(name: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 1, 0)

    return (
        bytes(header)
        + names
        + fatbin
        + bytes(64)
        + section(1, data_at, len(names))
        + section(11, fatbin_at, len(fatbin))
    )


def kernel(optimizer: str) -> bytes:
    return f"\0_Z52split_embedding_backward_codegen_{optimizer}_unweighted_kernel_cta_per_row_1\0".encode()


PAYLOADS = {
    "sm_80": (80, kernel("rowwise_adagrad"), 0),
    "sm_100": (100, kernel("adam"), 0),
    "rowwise_adagrad": (90, kernel("rowwise_adagrad"), 0),
    "adagrad": (90, kernel("adagrad"), 0),
    "sgd": (90, kernel("sgd"), 0),
    "adam": (90, kernel("adam"), 0),
    "lamb": (90, kernel("lamb"), 0),
    "lamb and adam": (90, kernel("lamb") + kernel("adam"), 0),
    "lamb, compressed": (90, kernel("lamb"), slim_fbgemm.COMPRESSED),
    "no optimizer": (90, b"\0_Z20radix_sort_kernel\0", 0),
}


def tagged(name: str) -> bytes:
    """The payload of PAYLOADS[name], told apart from the others that hold the same kernel."""
    return PAYLOADS[name][1] + f"<{name}>".encode()


def library(tmp_path: Path, name: str) -> tuple[Path, bytes]:
    fatbin = container(*(entry(arch, tagged(entry_name), flags) for entry_name, (arch, _, flags) in PAYLOADS.items()))
    path = tmp_path / name
    path.write_bytes(elf(fatbin))
    return path, path.read_bytes()


def kept(before: bytes, after: bytes) -> set[str]:
    """The PAYLOADS whose bytes are still in ``after`` where they were in ``before``."""
    found = set()
    for name in PAYLOADS:
        payload = tagged(name)
        at = before.index(payload)
        if after[at : at + len(payload)] == payload:
            found.add(name)
    return found


def test_only_what_an_sm_90_gpu_training_with_the_apps_optimizers_loads_is_kept(tmp_path):
    path, before = library(tmp_path, "fbgemm_gpu_tbe_training_backward.so")
    zeroed = slim_fbgemm.slim(path)
    after = path.read_bytes()
    assert len(after) == len(before)  # the layout the loader reads does not move
    assert kept(before, after) == {
        "rowwise_adagrad",
        "adagrad",
        "sgd",
        "adam",
        "lamb and adam",
        "lamb, compressed",
        "no optimizer",
    }
    assert set(zeroed) == {"sm_80", "sm_100", "unused optimizer"}
    # Only payloads change: every header, and every byte outside the fatbin, is as it was.
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    zeroed_payloads = [tagged(name) for name in ("sm_80", "sm_100", "lamb")]
    spans = [(before.index(p), before.index(p) + len(p)) for p in zeroed_payloads]
    assert changed and all(any(start <= i < end for start, end in spans) for i in changed)


def test_an_unused_library_keeps_no_kernel(tmp_path):
    path, before = library(tmp_path, "fbgemm_gpu_tbe_training_backward_vbe.so")
    slim_fbgemm.slim(path)
    assert kept(before, path.read_bytes()) == set()


def test_a_section_laid_out_otherwise_is_refused_and_left_as_it_was(tmp_path):
    path = tmp_path / "fbgemm_gpu_py.so"
    path.write_bytes(elf(b"\x01" * 16 + container(entry(80, kernel("adam")))))
    before = path.read_bytes()
    with pytest.raises(slim_fbgemm.NotAFatbin, match="no fatbin container at"):
        slim_fbgemm.slim(path)
    assert path.read_bytes() == before


def test_every_optimizer_the_apps_offer_keeps_its_kernels():
    assert not set(EMBEDDING_OPTIMIZERS) & slim_fbgemm.UNUSED_OPTIMIZERS


def test_on_cpu_a_step_swaps_its_gpu_only_options_and_sets_its_quick_ones(tmp_path):
    by_name = {step.name: step for step in steps(tmp_path)}
    cuda_graphs = on_cpu(by_name["cuda_graphs"])
    assert cuda_graphs[: len(TORCHX_RUN) + 3] == [*TORCHX_RUN, "components.dlrm:train", "-j", "1x1"]
    assert "--gpu" not in cuda_graphs
    # Set where the GPU line has them (torchx refuses an option given twice), added where not.
    for option, value in [("--compile_dense", "none"), ("--steps", "6"), ("--val_every_steps", "3")]:
        assert cuda_graphs.count(option) == 1 and cuda_graphs[cuda_graphs.index(option) + 1] == value
    uvm = on_cpu(by_name["uvm_caching"])
    assert "--hbm_gb" not in uvm and uvm[uvm.index("--num_embeddings") + 1] == "1000"
    loader = on_cpu(by_name["loader"])
    assert loader[loader.index("--device") + 1] == "cpu"
    profile = on_cpu(by_name["profile"])
    assert profile[profile.index("--") :] == ["--", "--num_embeddings", "1000", "--batch_size", "128"]


def test_the_dryrun_builds_the_exact_gpu_command_line(tmp_path):
    main_job = next(step for step in steps(tmp_path) if step.name == "main_job")
    assert dryrun(main_job) == [*TORCHX_RUN[:-2], "--dryrun", *main_job.argv[len(TORCHX_RUN) - 2 :]]


def test_busy_time_counts_overlapping_kernels_once():
    assert busy_seconds([(0, 4), (2, 6), (10, 11), (10.5, 10.7)]) == 7
    assert busy_seconds([]) == 0


def device_event(name: str, start: float, end: float, annotation: bool = False) -> FunctionEvent:
    return FunctionEvent(
        id=0,
        name=name,
        thread=0,
        start_us=start,
        end_us=end,
        device_type=DeviceType.CUDA,
        is_user_annotation=annotation,
    )


def test_the_profile_counts_kernels_not_the_annotations_that_span_their_gaps():
    events = [
        device_event("## sdd_forward ##", 0, 100, annotation=True),  # TorchRec's range, on the GPU's timeline
        device_event("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", 0, 30),
        device_event("split_embedding_codegen_forward_kernel", 20, 40),
        device_event("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", 60, 70),
        FunctionEvent(id=1, name="aten::mm", thread=0, start_us=0, end_us=100),  # the host's side
    ]
    figures = device_figures(events, wall_s=100e-6, top=5)
    assert figures["gpu_busy_s"] == pytest.approx(50e-6) and figures["gpu_busy_fraction"] == pytest.approx(0.5)
    assert figures["tf32_kernel_share"] == pytest.approx(40 / 60)
    assert [(row["name"][:13], row["calls"], row["total_ms"]) for row in figures["top"]] == [
        ("sm90_xmma_gem", 2, pytest.approx(0.04)),
        ("split_embeddi", 1, pytest.approx(0.02)),
    ]
