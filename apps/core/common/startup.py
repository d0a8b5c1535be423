"""A command's start without Python's garbage collector running over its imports.

Importing torch and torchrec makes ~330k objects that live as long as the process. With the
collector on, the import runs its collections over that ever-growing heap again and again: a
trainer of the main job reached step 1 in 4.6 s with it, 3.7 s without (medians of 3, 2 trainers
on a 2-core host). So the commands that torchrun starts import their machinery inside
:func:`imports_uncollected`, which freezes what the imports made (no later collection walks it
again, in the run or at its exit) and turns the collector back on for the run itself.
"""

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def imports_uncollected() -> Iterator[None]:
    """The collector off while the block runs (the command's imports); then what they made is
    frozen, and the collector on again."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
