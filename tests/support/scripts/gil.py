"""Hold the GIL in one C call for a while, as graph compilation does, whatever signals come.

    hold_gil(60)   # returns after 60 s; no other Python thread of the process ran meanwhile

`ctypes.PyDLL` keeps the GIL during the call. libc's `sleep` would end early when a signal
handler runs (the node agent's stack capture: SIGURG, faulthandler), and the process would
answer its probes again; `pthread_mutex_timedlock` on a mutex this thread holds waits for its
deadline, and glibc resumes that wait after a handler ran, as a compiling rank's C code carries
on after the dump.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time

_LIBC = ctypes.util.find_library("c")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def hold_gil(seconds: float) -> None:
    mutex = ctypes.create_string_buffer(64)   # zeros: PTHREAD_MUTEX_INITIALIZER (40 B, x86-64)
    ctypes.CDLL(_LIBC).pthread_mutex_lock(mutex)
    deadline = time.time() + seconds
    until = _Timespec(int(deadline), int(deadline % 1 * 1e9))
    # CLOCK_REALTIME deadline; ETIMEDOUT then, never EINTR
    ctypes.PyDLL(_LIBC).pthread_mutex_timedlock(mutex, ctypes.byref(until))
