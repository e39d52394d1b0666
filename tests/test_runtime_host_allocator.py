"""``runtime.host_allocator``: a large block freed by a worker thread is reused without page faults."""

import os
import subprocess
import sys

import pytest

from runtime.host_allocator import USER_SETTINGS, _is_glibc

BLOCK_PAGES = 32768  # 128 MiB of 4 KiB pages, above a thread arena's 64 MiB heap

# In a fresh process: ``import launch`` (which applies the setting unless the environment sets malloc), then a
# worker thread, as XLA:CPU's, allocates, touches and frees the block twice; prints whether the setting was
# applied and the minor page faults of the second round.
PROBE = f"""
import ctypes, resource, threading
import launch
from runtime.host_allocator import keep_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = {BLOCK_PAGES} * 4096
faults = []
def rounds():
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(keep_freed_memory(), faults[1])
"""


def probe(**env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not _is_glibc(), reason="the setting is glibc's")
def test_a_freed_large_block_is_reused_without_faults_and_a_users_malloc_setting_stands():
    # ``import launch`` applied it, so the call in the probe (after the thread made its arena) reports success too
    applied, faults = probe()
    assert applied == "True"
    assert faults < BLOCK_PAGES // 100
    # the user's own glibc setting (any value) stands: the block is mapped and faulted in again
    applied, faults_default = probe(MALLOC_ARENA_MAX="8")
    assert applied == "False"
    assert faults_default > BLOCK_PAGES // 2
