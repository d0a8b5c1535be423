"""A rank's end without the interpreter's teardown, which can abort a job that succeeded.

Why: a Gloo process group's worker threads (``pt_gloo_runloop``) free each finished collective
themselves. When the last reference to a tensor that Python has seen goes there, the thread takes
the GIL to free its Python object. If the main thread has begun the interpreter's teardown by then,
CPython (3.11 to 3.13) ends the asking thread with ``pthread_exit``, whose unwinding through a C++
destructor aborts the process: "terminate called without an active exception", SIGABRT, after all
the rank's work was done and written, so the job ends FAILED. It struck about one 2-rank job in a
hundred on a loaded 2-core host (a core dump showed the gloo thread freeing an
``AsyncAllreduceWork`` while ``Py_FinalizeEx`` collected; pytorch/pytorch#190489, open).
``destroy_process_group`` does not stop those threads (Gloo has no shutdown); they end with the
last reference to the group, which models, optimizers and metrics hold until the teardown.

So a rank ends as Python's exit would, up to the teardown: the exit handlers run and the other
Python threads are joined while the interpreter is whole (a Gloo thread can take the GIL then), the
streams are flushed, and the process exits. The teardown would only free memory the exit frees.
"""

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn


def exit_without_teardown(main: Callable[[], object]) -> NoReturn:
    """Runs ``main``, then ends the process with the status Python would give it: 0; a
    ``SystemExit``'s code (a message printed, status 1); 1 after printing an exception's
    traceback, as Python does. A ``KeyboardInterrupt`` is left to Python."""
    try:
        main()
        status = 0
    except SystemExit as e:
        status = _exit_status(e.code)
    except KeyboardInterrupt:
        raise
    except BaseException:  # printed as an uncaught exception is
        sys.excepthook(*sys.exc_info())
        status = 1
    # What the interpreter's exit does before its teardown, in its order: wake idle thread pools
    # and join the other threads (threading's own exit step: a pool left open would otherwise
    # keep its workers waiting forever), then the exit handlers (logging's flush among them).
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
