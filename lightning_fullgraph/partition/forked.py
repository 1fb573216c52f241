"""A function call run in a forked child process, its int64 result returned through shared memory.

The planner numbers every part with one METIS call (:func:`~lightning_fullgraph.partition.planner.
locality_order`), the largest share of planning a big graph.  ``pymetis`` holds the GIL for
the whole call, and the METIS it ships draws its random numbers from the C library's
process-wide ``rand()`` state, so even a GIL-free call could not run in two threads and stay
deterministic.  A forked child has its own copy of that state and of the address space: it
reads the parent's arrays without copying or pickling them (copy-on-write) and writes its
result into an anonymous shared mapping the parent created before the fork.  The result is
therefore exactly what the same call returns in the parent.

The child runs one call with one torch thread and exits, never collects the garbage it
inherited (:func:`gc.freeze`) and hands the free heap memory it inherited back to the kernel
before the call (:func:`~lightning_fullgraph._os.release_free_heap`); it takes no lock the parent's other
threads might hold at the fork beyond what numpy, torch and METIS use inside the call.  (From
Python 3.12 on, forking a process with threads, such as torch's, raises a
``DeprecationWarning``, which Python hides by default.)

Memory: the child's own allocations (METIS's graph and work arrays) come on top of the
parent's; :attr:`ForkedCall.private_peak_bytes` reports them (the child's peak resident
set minus what it shared with the parent at the fork, after the inherited free heap is
released), so callers can account for them.  Pages of the parent's live objects that the
child writes (copy-on-write copies) are not in it: the calls it serves only read their
arguments.
"""

from __future__ import annotations

import gc
import mmap
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fullgraph._os import release_free_heap, reset_peak_rss, status_kib

__all__ = ["ForkedCall", "can_fork"]

# Header words of the shared buffer: status (0 running, 1 done, 2 failed), the child's private
# peak in bytes, the result's length.
_HEADER = 3
_DONE, _FAILED = 1, 2
# Bytes kept for a failing child's message, after the header.
_MESSAGE_BYTES = 4096


def can_fork() -> bool:
    """Whether calls are forked here: on Linux only, where ``fork`` is the default start method
    and ``/proc`` reports a child's memory (macOS offers ``fork`` but makes ``spawn`` the
    default because forking a process with threads is unsafe there)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _child(fn: Callable[..., Tensor], args: tuple[Any, ...], buf: mmap.mmap, length: int) -> None:
    words = np.frombuffer(buf, dtype=np.int64)
    try:
        # Nothing the fork inherited is collected here: the child exits after one call, and
        # collecting the parent's garbage would copy the pages the collector touches and unmap
        # memory the parent still holds, which would hide as much of the child's own
        # allocations from the peak below.
        gc.freeze()
        # The parent's freed heap chunks are still resident here; an allocation served from
        # them would copy pages the baseline counts, and the peak would miss it.
        if release_free_heap():
            reset_peak_rss()  # the peak so far counts the pages just released
        shared_kib = status_kib("VmRSS") or 0  # what the fork left mapped, shared with the parent
        torch.set_num_threads(1)  # one core per child: the parent runs the others
        out = fn(*args)
        if out.dtype != torch.int64 or out.shape != (length,):
            raise ValueError(f"the call returned {out.dtype} {list(out.shape)}, expected int64 [{length}]")
        words[_HEADER : _HEADER + length] = out.numpy()
        words[1] = max(0, (status_kib("VmHWM") or 0) - shared_kib) * 1024
        words[0] = _DONE
    except BaseException:
        message = traceback.format_exc().encode()[-_MESSAGE_BYTES:]
        start = 8 * (_HEADER + length)
        buf[start : start + len(message)] = message
        words[2] = len(message)
        words[0] = _FAILED
        os._exit(1)


class ForkedCall:
    """Runs ``fn(*args)``, which returns an int64 tensor of ``length`` elements, in a forked
    child; :meth:`result` waits for it.

    ``args`` are not copied or pickled: the child sees them through the fork.  They must not
    be modified until :meth:`result` returns (the child reads them while it runs).

    Attributes:
        private_peak_bytes: After :meth:`result`, the child's peak resident memory beyond
            what it shared with this process at the fork.
    """

    def __init__(self, fn: Callable[..., Tensor], args: tuple[Any, ...], length: int) -> None:
        self.length = length
        self.private_peak_bytes = 0
        self._buf = mmap.mmap(-1, 8 * (_HEADER + length) + _MESSAGE_BYTES)  # MAP_SHARED | MAP_ANONYMOUS
        self._proc = multiprocessing.get_context("fork").Process(
            target=_child, args=(fn, args, self._buf, length), daemon=True
        )
        self._proc.start()
        self._result: Tensor | None = None

    def result(self) -> Tensor:
        """The call's result ``[length]`` int64; raises ``RuntimeError`` if the child failed."""
        if self._result is not None:
            return self._result
        self._proc.join()
        words = np.frombuffer(self._buf, dtype=np.int64)
        status, exitcode = int(words[0]), self._proc.exitcode
        if status != _DONE or exitcode != 0:
            message = ""
            if status == _FAILED:
                start = 8 * (_HEADER + self.length)
                message = ":\n" + self._buf[start : start + int(words[2])].decode(errors="replace")
            del words
            self._buf.close()
            raise RuntimeError(f"the forked call failed (exit code {exitcode}){message}")
        self.private_peak_bytes = int(words[1])
        self._result = torch.from_numpy(words[_HEADER : _HEADER + self.length].copy())
        del words
        self._buf.close()
        self._proc.close()
        return self._result
