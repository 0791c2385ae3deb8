"""Small helpers of the client tests (not a test module)."""

from __future__ import annotations

import ctypes
import threading


def interrupt(thread: threading.Thread) -> None:
    """Ctrl-C in ``thread`` (as the main thread gets it: at its next bytecode)."""
    assert thread.ident is not None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt)
    )
