"""Memory that windows' rows are decoded into, reused from window to window.

Why: a window's decoded arrays are tens of MB (262,144 rows of 13 dense features and 26 ids:
41 MB). Fresh ones from the allocator are fresh pages from the kernel, which zeroes every page
on first touch and takes it back when the arrays are freed: a profile of the loader found a
quarter of its CPU time in that zeroing. Reused memory is written over, never zeroed again.

Safety: memory is handed out again only once the :class:`~apps.dlrm.data.parquet.read.Rows`
decoded into it are gone, released by their finalizer when the last reference to them drops
(no batch being cut reads them any more), so no rows are overwritten while a batch still reads
them, however many windows a batch spans. The pool holds no more memory than was ever in use at
once (a window being cut, the next being read, and one a batch still spans).
"""

import threading
import weakref

import numpy as np


class ArrayPool:
    """Memory for arrays of decoded rows, lent to the object that owns them until it is gone."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()  # the reading thread takes memory, the batches' thread frees it

    def arrays(self, rows: int, shapes: list[tuple[int, np.dtype]]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Uninitialised arrays ``[count, rows]`` of each ``(count, dtype)`` of ``shapes`` (widest
        type first: each view then starts aligned to its type), and the memory they are views of,
        to :meth:`lend` to their owner."""
        sizes = [count * rows * np.dtype(dtype).itemsize for count, dtype in shapes]
        with self._lock:
            largest = max(range(len(self._free)), key=lambda k: len(self._free[k]), default=None)
            memory = None if largest is None else self._free.pop(largest)
        if memory is None or len(memory) < sum(sizes):
            memory = np.empty(sum(sizes), dtype=np.uint8)  # a smaller one is dropped: windows grow rarely
        arrays, at = [], 0
        for (count, dtype), size in zip(shapes, sizes):
            arrays.append(memory[at : at + size].view(dtype).reshape(count, rows))
            at += size
        return memory, arrays

    def lend(self, owner: object, memory: np.ndarray) -> None:
        """Takes ``memory`` back once ``owner`` (which holds every view of it) is gone."""
        weakref.finalize(owner, self._give_back, memory).atexit = False

    def _give_back(self, memory: np.ndarray) -> None:
        with self._lock:
            self._free.append(memory)
