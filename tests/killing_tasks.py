"""A worker task for tests/test_case_memory.py, in a module of its own so that a spawned worker imports only it."""

import os
import signal
import struct
import sys
import time


def square_or_die(task: int) -> int:
    """A worker's task: task 3 kills its own worker process (SIGKILL, as the OOM killer sends), every time."""
    if task == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    return task * task


def square_or_die_writing(task: int) -> int:
    """Task 3 dies as a worker the kernel kills while it writes its result: it takes the result queue's write lock
    and writes the first bytes of a message (a length of 1 MB, then 2 bytes) to the pipe, then SIGKILLs itself; the
    others are `square_or_die`'s."""
    if task == 3:
        frame = sys._getframe()
        while "result_queue" not in frame.f_locals:  # concurrent.futures.process._process_worker's queue
            frame = frame.f_back
        queue = frame.f_locals["result_queue"]
        queue._wlock.acquire()
        queue._writer._send(struct.pack("!i", 2**20) + b"xx")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    return task * task
