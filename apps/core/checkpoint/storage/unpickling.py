"""The restricted unpickler that every pickle read from a checkpoint goes through.

A checkpoint holds two kinds of pickle (DCP's ``.metadata`` and the header of each
``torch.save`` entry); each has its own unpickler with the globals it admits
(:mod:`apps.core.checkpoint.storage.metadata`, :mod:`apps.core.checkpoint.storage.stored_tensor`),
and both build on this one, which refuses to set state on anything it did not make itself.
"""

import pickle


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler that loads only the globals :meth:`find_class` admits, and sets state (pickle's
    BUILD) only on the objects it made itself, instances of :attr:`buildable`.

    pickle's BUILD sets attributes on whatever object the pickle names: through an admitted class
    or shared object (a dtype, an enum member, a function), a planted file could change it for the
    whole process (``MetadataIndex.__hash__``, say), refused or not, without running any code. It is
    pickle's pure-Python unpickler, whose BUILD can be checked; .metadata loads at ~2 MB/s with it
    (0.2 s for 26 tables in 64 shards, 7x the C unpickler's time), an entry's header in ~30 µs.
    """

    #: The types whose fresh instances a pickle may set state on: nothing else.
    buildable: tuple[type, ...] = ()

    def refused(self, what: str) -> Exception:
        """The error that refuses a pickle that would do ``what``."""
        return pickle.UnpicklingError(f"would {what}")

    # typeshed lists neither the pure-Python unpickler's stack nor its opcode handlers (undocumented,
    # in CPython since Python 3.0), and types its dispatch table with the C unpickler's.
    def _load_build(self) -> None:
        target = self.stack[-2]  # type: ignore[attr-defined]  # under the state
        if type(target) not in self.buildable:
            what = target if isinstance(target, type) else type(target)
            raise self.refused(f"set attributes on {what.__module__}.{what.__qualname__}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _load_build}  # type: ignore[dict-item]
