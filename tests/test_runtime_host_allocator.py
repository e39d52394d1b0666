"""``runtime.host_allocator``: for ``python -m launch.starpo`` a large block freed by a worker thread is reused
without page faults; other scripts and a user's own malloc setting keep glibc's behaviour."""

import importlib.util
import os
import subprocess
import sys

import pytest

from runtime.host_allocator import USER_SETTINGS, _is_glibc, launched_module

BLOCK_PAGES = 32768  # 128 MiB of 4 KiB pages, above a thread arena's 64 MiB heap

# In a fresh process started as ``python -m MODULE`` (``sys.orig_argv`` as the interpreter would set it):
# ``import launch``, then a worker thread, as XLA:CPU's, allocates, touches and frees the block twice; prints the
# minor page faults of the second round.
PROBE = """
import ctypes, resource, sys, threading
sys.orig_argv = [sys.executable, "-m", MODULE]
import launch
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = PAGES * 4096
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
print(faults[1])
"""


def second_round_faults(module: str, **env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    code = PROBE.replace("MODULE", repr(module)).replace("PAGES", str(BLOCK_PAGES))
    out = subprocess.run([sys.executable, "-c", code], env={**clean, "JAX_PLATFORMS": "cpu", **env},
                         capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not _is_glibc(), reason="the setting is glibc's")
def test_the_starpo_launch_reuses_a_freed_large_block_other_scripts_and_a_users_setting_do_not():
    assert second_round_faults("launch.starpo") < BLOCK_PAGES // 100
    # the TDD script keeps glibc's arenas (one arena serialised its convolution threads): mapped and faulted again
    assert second_round_faults("launch.tdd") > BLOCK_PAGES // 2
    # the user's own glibc setting (any value) stands
    assert second_round_faults("launch.starpo", MALLOC_ARENA_MAX="8") > BLOCK_PAGES // 2
    # on an accelerator the programs do not run on XLA:CPU (libtpu is installed with the test requirements)
    if importlib.util.find_spec("libtpu") is not None:
        assert second_round_faults("launch.starpo", JAX_PLATFORMS="") > BLOCK_PAGES // 2


@pytest.mark.parametrize("argv, module", [
    (["python", "-m", "launch.starpo", "--out", "x"], "launch.starpo"),
    (["python", "-X", "dev", "-W", "ignore", "-m", "launch.tdd"], "launch.tdd"),
    (["python", "-mlaunch.starpo"], "launch.starpo"),
    (["python", "-u", "-c", "import launch"], None),
    (["python", "script.py", "-m", "launch.starpo"], None),
    (["python", "-m"], None),
])
def test_launched_module_reads_the_module_of_a_python_dash_m_command_line(argv, module):
    assert launched_module(argv) == module
