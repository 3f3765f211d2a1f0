"""A worker task for tests/test_case_memory.py, in a module of its own so that a spawned worker imports only it."""

import os
import signal
import time


def square_or_die(task: int) -> int:
    """A worker's task: task 3 kills its own worker process (SIGKILL, as the OOM killer sends), every time."""
    if task == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    return task * task
