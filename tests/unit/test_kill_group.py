"""A process group killed with SIGKILL leaves no shared-memory segment behind (their owners unlink them only
on a clean exit)."""

import subprocess
import sys

from services.launcher.processes import SHARED_MEMORY, group_shared_memory, kill_group

HOLDER = """
import sys, time
from multiprocessing import shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
segment.buf[0] = 1  # mapped
print(segment.name, flush=True)
time.sleep(120)
"""


def test_a_killed_group_is_gone_with_the_segments_it_mapped():
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        name = proc.stdout.readline().strip()
        segment = SHARED_MEMORY / name
        assert segment.exists() and segment in group_shared_memory(proc.pid)
        kill_group(proc.pid)
        proc.wait(timeout=30)
        assert not segment.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -9


def test_a_group_that_is_gone_is_no_error():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait(timeout=30)
    kill_group(proc.pid)
