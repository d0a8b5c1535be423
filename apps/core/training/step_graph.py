"""The lean step captured whole in one CUDA graph (GPU): the batch copied into static buffers,
forward, loss, backward with FBGEMM's fused table update, the dense optimizers' step, all
replayed by one ``CUDAGraph.replay()``; validation and test replay a forward-only graph.

At small and medium shapes the lean step is bound by host work (Python, dispatch, kernel
launches), not the GPU: a replay launches the step's hundreds of kernels in one call. Built on
torch's documented API (``torch.cuda.graph``, ``torch.cuda.CUDAGraph``): eager warm-up steps on a
side stream first (lazy state: optimizer states, cuBLAS workspaces, FBGEMM's host iteration
counter), gradients set to None before capture (the graph's backward then writes, not adds,
them), ``capture_error_mode="thread_local"`` (the data loader's and checkpoint writer's threads
may use CUDA meanwhile).

What FBGEMM's TBE (``split_table_batched_embeddings_ops_training``, fbgemm-gpu 1.6 and 1.8) does
on the host per call, and how each is handled:

- the learning rate is ``learning_rate_tensor``, a CPU tensor read at launch (TorchRec's fused
  optimizer sets it in ``zero_grad``/``step``): baked into a capture. The graph is captured
  again whenever a learning rate changes; while the schedule changes it every step (linear
  warm-up, polynomial decay) the step runs eager (:func:`lr_holds_for`). Every step trains at
  its scheduled rate: the schedule stays exact.
- ``iter_cpu.add_(1).item()`` (row-wise Adagrad, Adam, ...; not SGD or Adagrad): a CPU tensor,
  no sync, but it advances only at capture, not per replay. Row-wise Adagrad without weight
  decay does not use it (the device counter ``iter``, which checkpoints hold, is advanced in the
  graph); FBGEMM's Adam takes its bias correction from it: ``--embedding_optimizer adam`` runs
  eager. Its first call reads the device ``iter`` (a sync): in warm-up, never in capture.
- ``_prefetch`` of UVM-cached rows (host-side cache bookkeeping, ``current_stream``): tables
  not wholly in HBM (any kernel but ``fused``/``dense``) run eager.
- ``self.step += 1`` and the stats reporters (off unless configured): host counters only.

torch's Adagrad (and TorchRec's ``RowWiseAdagrad`` for data-parallel tables) keep their step
count in a CPU tensor and compute the step size on the host: baked like the TBE's rate (captured
again on a change), their counts advanced on the host after each replay so that checkpoints
hold what eager steps hold. torch's Adam built without ``capturable`` refuses capture:
``--dense_optimizer adam`` runs eager. SGD has nothing on the host.

The KJT's per-key sizes (``length_per_key``) are host values its permute and split need: the
static batch keeps the first batch's, and a batch is replayed only when its shapes and, where its
data gave them (Criteo, Parquet), its per-key sizes are the static batch's (:func:`batch_signature`);
data that gives none (synthetic) makes fixed sizes by construction. Batches of another shape (a
last partial batch) run eager; data whose shapes vary from step to step (variable-length
Parquet lists) runs eager from the warm-up on, said in one line.

The loss guard (``TrainingLog.check``, apps/core/training/train_log.py) reads each step's loss
on the device at log steps, as for eager steps: a replay's loss is copied out of the graph's
memory (a device copy, no sync), so the guard and its one sync per log step are unchanged.
"""

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from apps.core.config import LaunchConfig, TrainingConfig
from apps.core.training.lean import LeanPipeline
from apps.core.training.optim import LRShape, lr_scale

#: Eager steps on a side stream before the first capture (torch's docs: "a few").
WARMUP_STEPS = 3
#: A learning rate must hold for this many steps to be captured at (a capture costs about as
#: much host time as a few eager steps); under it, the step runs eager.
MIN_STEPS_PER_CAPTURE = 20
#: Compute kernels of tables wholly in this GPU's memory (the others prefetch on the host).
GRAPH_KERNELS = ("fused", "dense")


def step_graph_refusal(
    launch: LaunchConfig, training: TrainingConfig, device_type: str, not_lean: str, kernels: list[str]
) -> str:
    """Why the training step is not captured in a CUDA graph, in a few words for the log; empty
    when it is (the batches' shapes decide the rest at run time). ``not_lean``: why the lean
    step does not run (empty: it does); ``kernels``: the plan's compute kernel of each table."""
    if launch.step_graph == "false":
        return "--step_graph false"
    if device_type != "cuda":
        return f"CUDA graphs need a GPU, this run is on {device_type}"
    if not_lean:
        return "TorchRec's sharded step runs"
    if launch.compile_dense != "none":
        return f"--compile_dense {launch.compile_dense} compiles the dense part apart"
    if training.embedding_optimizer == "adam":
        return "FBGEMM's Adam reads its step on the host (--embedding_optimizer adam)"
    if training.dense_optimizer == "adam":
        return "torch's Adam as built here is not capturable (--dense_optimizer adam)"
    others = sorted(set(kernels) - set(GRAPH_KERNELS))
    if others:
        return f"{'/'.join(others)} tables prefetch rows on the host"
    return ""


def graph_kind(refusal: str) -> str:
    """The log's line of whether the step is a CUDA graph (``refusal``: :func:`step_graph_refusal`'s)."""
    if not refusal:
        return (
            "one CUDA graph (captured after warm-up, again when the learning rate changes; eager while "
            "it changes every step, and for batches of another shape)"
        )
    return f"eager, not a CUDA graph: {refusal}"


def lr_holds_for(shape: LRShape, step: int, horizon: int = MIN_STEPS_PER_CAPTURE) -> int:
    """How many steps from 0-based ``step`` on train at ``step``'s learning rate, counted up to
    ``horizon``: the schedule is a pure function of the step (:func:`lr_scale`)."""
    scale = lr_scale(shape, step)
    held = 1
    while held < horizon and lr_scale(shape, step + held) == scale:
        held += 1
    return held


def batch_signature(batch: Pipelineable) -> tuple:
    """What must match for ``batch`` to be copied into a static batch made from another: each
    tensor's shape and dtype, each KJT's keys, and its per-key sizes where the batch carries them
    on the host (never computed here: that would be a device sync per step)."""
    signature: list[Any] = []
    for name, value in _fields(batch):
        if isinstance(value, KeyedJaggedTensor):
            per_key = value._length_per_key  # the data's host values, if it gave them
            signature.append(
                (name, tuple(value.keys()), *_shapes(_kjt_inputs(value)), tuple(per_key) if per_key else None)
            )
        else:
            signature.append((name, *_shapes([value])))
    return tuple(signature)


@dataclasses.dataclass
class GraphPolicy:
    """Which way each training step runs: pure bookkeeping of what was seen and captured, so
    that the choice is tested without a GPU. :meth:`action` answers, for the next step:

    - ``"warm"``: an eager step on the side stream, one of the first :data:`WARMUP_STEPS`;
    - ``"eager"``: an eager step (learning rate changing every step, a batch of another shape,
      or shapes that vary: then ``varying`` is set and every step is eager);
    - ``"capture"``: capture the step at this learning rate and shape, then replay it;
    - ``"replay"``: replay the captured step.
    """

    warm_signatures: list[tuple] = dataclasses.field(default_factory=list)
    captured: tuple[tuple, tuple[float, ...]] | None = None
    varying: bool = False

    def action(self, signature: tuple, lrs: tuple[float, ...], lr_holds: int) -> str:
        if self.varying:
            return "eager"
        if len(self.warm_signatures) < WARMUP_STEPS:
            self.warm_signatures.append(signature)
            return "warm"
        if len(set(self.warm_signatures)) > 1:
            self.varying = True
            return "eager"
        if signature != self.warm_signatures[0]:
            return "eager"
        if self.captured == (signature, lrs):
            return "replay"
        if lr_holds < MIN_STEPS_PER_CAPTURE:
            return "eager"
        self.captured = (signature, lrs)
        return "capture"

    def forget(self) -> None:
        """The captured graph is gone (the model's state was loaded): capture again."""
        self.captured = None


class GraphedLeanPipeline(LeanPipeline):
    """:class:`LeanPipeline`'s step, replayed from a CUDA graph where :class:`GraphPolicy` says
    so. ``lrs_hold``: how many steps the current learning rates hold (the trainer's schedule);
    ``log``: a line for the run's log at each change of how the step runs."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        lrs_hold: Callable[[], int],
        log: Callable[[str], None],
    ) -> None:
        super().__init__(model, optimizer, device)
        self._lrs_hold, self._log = lrs_hold, log
        self.policy = GraphPolicy()
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_batch: Any = None
        self._static_outputs: Any = None
        self._host_steps: list[torch.Tensor] = []
        self._side_stream = torch.cuda.Stream(device)
        #: What validation and test call in place of the model.
        self.forward_graph = GraphedForward(model, device)
        self._last_action = ""

    def progress(self, dataloader_iter: Iterator[Pipelineable]) -> Any:
        batch = next(dataloader_iter)
        lrs = tuple(float(group["lr"]) for group in self._optimizer.param_groups)
        action = self.policy.action(batch_signature(batch), lrs, self._lrs_hold())
        self._say(action)
        if action == "warm":
            with _on(self._side_stream):
                return self._eager(batch)
        if action == "eager":
            return self._eager(batch)
        if action == "capture":
            self._capture(batch)
        assert self._graph is not None
        _copy_into(self._static_batch, batch, self._device)
        self._graph.replay()
        if self._host_steps:
            torch._foreach_add_(self._host_steps, 1.0)
        loss, *rest = self._static_outputs
        return (loss.clone(), *rest)  # the trainer keeps each step's loss; the next replay overwrites it

    def _eager(self, batch: Pipelineable) -> Any:
        return LeanPipeline.progress(self, iter([batch]))

    def _capture(self, batch: Pipelineable) -> None:
        """Captures the step on a static copy of ``batch`` (captured kernels do not run: the
        caller replays them)."""
        self._graph = self._static_batch = self._static_outputs = None  # their memory goes back first
        self._static_batch = _static_copy(batch, self._device)
        self._optimizer.zero_grad()  # sets the tables' learning rate; gradients None: backward writes them
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            loss, outputs = self._model(self._static_batch)
            loss.backward()
            self._optimizer.step()
        self._graph, self._static_outputs = graph, outputs
        self._host_steps = _host_step_counts(self._optimizer)
        if self._host_steps:  # the capture counted a step on the host; the replay that follows counts it
            torch._foreach_add_(self._host_steps, -1.0)

    def forget(self) -> None:
        """Drops the captured graphs: the model's or optimizers' state was loaded (an
        optimizer's ``load_state_dict`` puts new tensors in place of those the graph reads)."""
        self._graph = self._static_batch = self._static_outputs = None
        self.policy.forget()
        self.forward_graph.forget()

    def _say(self, action: str) -> None:
        """Logs each capture, and how steps run when that changes."""
        if action == self._last_action and action != "capture":
            return
        self._last_action = "replay" if action == "capture" else action
        if action == "warm":
            self._log(f"the first {WARMUP_STEPS} training steps warm up eager on a side stream, before the capture")
        elif action == "capture":
            lrs = ", ".join(f"{group['lr']:.6g}" for group in self._optimizer.param_groups)
            self._log(f"training steps now replay one CUDA graph, captured at learning rates {lrs}")
        elif action == "replay":
            self._log("training steps replay the CUDA graph again")
        elif self.policy.varying:
            self._log("training steps run eager: the batches' shapes vary (variable-length lists)")
        else:
            self._log("training steps run eager (the learning rate changes every step, or the batch's shape)")


class GraphedForward(nn.Module):
    """The model's forward for validation and test (no gradients): a batch with the shapes of
    the batch before it is replayed from a forward-only graph of those shapes, its outputs in
    the graph's memory (the app copies them out: ``eval_outputs``); another runs eager (and
    makes the next batch like it capture). Stands in for the model in ``evaluate``; no state of
    its own (it is never saved)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.model, self._device = model, device
        self._graph: torch.cuda.CUDAGraph | None = None
        self._captured: tuple | None = None
        self._previous: tuple | None = None
        self._static_batch: Any = None
        self._static_outputs: Any = None

    def forward(self, batch: Pipelineable) -> Any:
        signature = batch_signature(batch)
        if signature != self._captured and signature == self._previous:
            self._capture(batch, signature)
        self._previous = signature
        if signature != self._captured:
            return self.model(batch)
        assert self._graph is not None
        _copy_into(self._static_batch, batch, self._device)
        self._graph.replay()
        return self._static_outputs

    def _capture(self, batch: Pipelineable, signature: tuple) -> None:
        self.forget()  # the old graph's memory goes back before the new one takes its own
        self._static_batch = _static_copy(batch, self._device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._static_outputs = self.model(self._static_batch)
        self._graph, self._captured = graph, signature

    def forget(self) -> None:
        """Drops the graph (the model's state was loaded)."""
        self._graph = self._static_batch = self._static_outputs = None
        self._captured = self._previous = None


def _host_step_counts(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizers' step counts kept in CPU tensors (torch's Adagrad, TorchRec's
    RowWiseAdagrad), which a replay does not advance."""
    return [
        state["step"]
        for state in optimizer.state.values()
        if isinstance(state.get("step"), torch.Tensor) and state["step"].device.type == "cpu"
    ]


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream) -> Iterator[None]:
    """Work on ``stream`` that starts after, and ends before, the current stream's next work
    (torch's docs' warm-up: eager iterations on a side stream before capture)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def _fields(batch: Pipelineable) -> list[tuple[str, Any]]:
    """The batch's (a dataclass's) tensors and KJTs, by field name."""
    return [
        (field.name, getattr(batch, field.name))
        for field in dataclasses.fields(batch)
        if isinstance(getattr(batch, field.name), (torch.Tensor, KeyedJaggedTensor))
    ]


def _kjt_inputs(kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
    """The tensors a KJT is made of (its offsets follow from its lengths)."""
    weights = kjt.weights_or_none()
    return [kjt.values(), kjt.lengths(), *([] if weights is None else [weights])]


def _kjt_tensors(kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
    """What a static KJT holds: its inputs and its offsets (computed on the device if the
    batch came without them, no sync)."""
    return [*_kjt_inputs(kjt), kjt.offsets()]


def _shapes(tensors: list[torch.Tensor]) -> list[tuple]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def _static_copy(batch: Pipelineable, device: torch.device) -> Pipelineable:
    """A copy of ``batch`` on ``device`` in tensors of its own, its KJTs with their per-key
    sizes on the host (one sync here, at capture): what the graph reads."""
    copies: dict[str, Any] = {}
    for name, value in _fields(_ready(batch, device)):
        if isinstance(value, KeyedJaggedTensor):
            weights = value.weights_or_none()
            copies[name] = KeyedJaggedTensor(
                keys=value.keys(),
                values=value.values().to(device, copy=True),
                weights=None if weights is None else weights.to(device, copy=True),
                lengths=value.lengths().to(device, copy=True),
                offsets=value.offsets().to(device, copy=True),
                stride=value.stride(),
                length_per_key=value.length_per_key(),
                offset_per_key=value.offset_per_key(),
            )
        else:
            copies[name] = value.to(device, copy=True)
    return dataclasses.replace(batch, **copies)


def _copy_into(static: Pipelineable, batch: Pipelineable, device: torch.device) -> None:
    """``batch``'s tensors copied into ``static``'s (same signature), on the current stream:
    from the host without a sync, or after the kernels still making a batch on the device."""
    for (_, dst), (_, src) in zip(_fields(static), _fields(_ready(batch, device))):
        pairs = zip(_kjt_tensors(dst), _kjt_tensors(src)) if isinstance(dst, KeyedJaggedTensor) else [(dst, src)]
        for to, source in pairs:
            to.copy_(source, non_blocking=True)


def _ready(batch: Pipelineable, device: torch.device) -> Pipelineable:
    """``batch`` once the current stream may read it: one made on ``device`` (synthetic
    batches) is taken "to the device", which waits for the kernels still making it; one on the
    host is copied from where it is (non-blocking copies from pinned memory, no sync)."""
    if any(value.device == device for _, value in _fields(batch) if isinstance(value, torch.Tensor)):
        return batch.to(device, non_blocking=True)
    return batch
