"""A background thread that builds a data source's batches a few ahead of the training loop.

Both file-backed sources (:mod:`apps.dlrm.data.criteo.loader`, :mod:`apps.dlrm.data.parquet.loader`) make a
batch as a pure function of its index (a step, or an evaluation batch's number), so the thread
only has to call that function in order; the loop then never waits on page faults, disk or
object-store reads that the thread could do while the model computes.
"""

import queue
import threading
from typing import Callable, Generator, Iterable

from torchrec.datasets.utils import Batch

# Batches the background thread keeps ready.
PREFETCH_BATCHES = 4

_END = object()


class _Failed:
    """The exception the thread raised, handed to the consumer to raise in its own thread."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetched(make: Callable[[int], Batch], indices: Iterable[int], name: str) -> Generator[Batch, None, None]:
    """``make(i)`` for every ``i``, computed by a background thread (named ``name``) a few
    batches ahead.

    Closing the iterator (``close()``, or exhausting it) stops and joins the thread: callers
    must close it before the process exits. A thread left building a batch while the
    interpreter shuts down is killed as it takes the GIL back inside a torch call, and that
    aborts the whole process ("terminate called without an active exception", SIGABRT) after
    its work is done, so the job ends FAILED.
    """
    ready: queue.Queue = queue.Queue(maxsize=PREFETCH_BATCHES)
    stop = threading.Event()

    def put(item: object) -> bool:  # a batch, _END or a _Failed
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for i in indices:
                if not put(make(i)):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer, which raises it
            put(_Failed(e))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()  # at most one batch to finish: put() gives up within 0.1 s once stopped
