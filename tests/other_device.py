"""A second device on a CPU machine, on which a tensor left on the CPU fails as it does on a GPU.

A GPU job dies at the first op that mixes a CUDA tensor with a CPU one ("Expected all tensors to
be on the same device, but got self is on cuda:0, different from other tensors on cpu"); a CPU
job, with every tensor on the CPU, never meets that error. Neither the ``meta`` device nor
torch's ``FakeTensorMode`` can stand in for the GPU: they hold no values, so the data sources'
data-dependent steps (a batch's longest user, ``nonzero``, ``item()``) cannot run on them; meta
kernels check devices for some ops only (``searchsorted`` and ``mm`` take a CPU tensor beside a
meta one); and TorchRec takes shortcuts for meta tensors (a KeyedJaggedTensor on ``meta`` makes
up its lengths per key).

:class:`OtherDevice` gives every op real values and CUDA's device rule: under it, a tensor made
for the device ``DEVICE`` or moved there is an :class:`OnDevice` tensor, whose values are on the
CPU but whose ``device`` is ``DEVICE``; every op on such tensors runs on their values and gives
``OnDevice`` results, and an op that mixes them with a CPU tensor raises the error a CUDA kernel
raises. As on CUDA, CPU scalars (0-dim tensors) mix with any device, copies go between devices,
and a device tensor may be indexed with CPU indices, not a CPU tensor with device indices.
``DEVICE`` is torch's ``lazy`` device: one that CPU builds of torch know (a device guard, a
name), that no code here or in TorchRec treats apart, and that has no kernels of its own, so
nothing but this module's dispatch ever runs on it.
"""

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

#: The device that stands in for the GPU.
DEVICE = torch.device("lazy")
CPU = torch.device("cpu")

aten = torch.ops.aten
#: Copies between devices: the only ops that take tensors of two devices by design.
_COPIES = {aten._to_copy.default, aten.copy_.default, aten.copy.default}
#: Indexing: the indexed tensor on the device may take CPU indices (CUDA moves them).
_INDEXING = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten._unsafe_index.Tensor,
}


class OnDevice(torch.Tensor):
    """A tensor on ``DEVICE`` whose values (``values``, a CPU tensor) are real."""

    values: torch.Tensor

    @staticmethod
    def __new__(cls, values: torch.Tensor) -> "OnDevice":
        return torch.Tensor._make_wrapper_subclass(
            cls,
            values.shape,
            strides=values.stride(),
            storage_offset=values.storage_offset(),
            dtype=values.dtype,
            layout=values.layout,
            device=DEVICE,
            requires_grad=False,
        )

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"OnDevice({self.values!r})"

    def tolist(self) -> Any:  # a copy to the host, as of a CUDA tensor (torch's reads no subclass)
        return self.values.tolist()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Outside the mode too (autograd's engine may run backward on a thread of its own).
        return run_op(func, args, kwargs or {})


class OtherDevice(TorchDispatchMode):
    """While active, ``DEVICE`` is a second device with real values (see the module's docstring)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return run_op(func, args, kwargs or {})

    def __enter__(self) -> "OtherDevice":
        self._from_data = _FromData()
        self._from_data.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._from_data.__exit__(*exc)


class _FromData(TorchFunctionMode):
    """Tensors made from Python data for ``DEVICE`` get the data: torch would copy it there in
    C++, out of the dispatch mode's sight."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func is torch.Tensor.new_tensor and device is None:
            device = args[0].device
        if func in _FROM_DATA and device is not None and torch.device(device).type == DEVICE.type:
            return func(*args, **{**kwargs, "device": CPU}).to(DEVICE)
        return func(*args, **kwargs)


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


def run_op(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``func`` on the values of ``args``, after the device check a CUDA kernel makes."""
    flat, _ = tree_flatten((args, kwargs))
    made_there = any(isinstance(x, torch.device) and x.type == DEVICE.type for x in flat)
    if not made_there and not any(isinstance(x, OnDevice) for x in flat):
        return func(*args, **kwargs)
    _check_devices(func, args, kwargs, flat)
    out = func(*tree_map(_values, args), **tree_map(_values, kwargs))
    # A copy goes where its device argument says; every other op stays on the device.
    target = kwargs.get("device")
    stays = func not in _COPIES or target is None or target.type == DEVICE.type
    if func in {aten.copy_.default, aten.copy.default}:
        stays = isinstance(args[0], OnDevice)
    by_values = {id(x.values): x for x in flat if isinstance(x, OnDevice)}

    def on_device(result: Any) -> Any:
        if not isinstance(result, torch.Tensor):
            return result
        if id(result) in by_values:  # an in-place op returns its own argument
            return by_values[id(result)]
        return OnDevice(result) if stays else result

    return tree_map(on_device, out)


def _values(x: Any) -> Any:
    if isinstance(x, OnDevice):
        return x.values
    if isinstance(x, torch.device) and x.type == DEVICE.type:
        return CPU
    return x


def _check_devices(func: Any, args: Any, kwargs: dict[str, Any], flat: list[Any]) -> None:
    """Raises torch's error of a CUDA op given a CPU tensor beside device ones (CPU scalars aside)."""
    if func in _COPIES or "device" in kwargs:  # a copy, or a tensor made (like another) on a device
        return
    if func in _INDEXING:
        indexed = args[0]
        if not isinstance(indexed, OnDevice) and indexed.dim() > 0:
            raise RuntimeError(
                "indices should be either on cpu or on the same device as the indexed tensor (cpu), "
                f"but got indices on {DEVICE} (when checking argument in method {func})"
            )
        flat, _ = tree_flatten([args[0], *args[2:]])  # the indices may stay on the CPU
    for x in flat:
        if isinstance(x, torch.Tensor) and not isinstance(x, OnDevice) and x.dim() > 0:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but got a tensor of shape {list(x.shape)} on "
                f"cpu, different from other tensors on {DEVICE} (when checking argument in method {func})"
            )
