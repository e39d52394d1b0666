"""Launch scripts (``python -m launch.<script>``).

Importing the package joins a multi-process launch described by the environment
(``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, SLURM, TPU pod,
Open MPI; see ``runtime.distributed``) before any script's imports run: ``jax.distributed``
must start before the XLA backend, and importing gymnax (through ``envs``) starts it.
On one process this does nothing. It also sets up the terminal (``runtime.console``) before
``transformers`` is first imported, and, first of all, for ``python -m launch.starpo`` on the CPU, glibc's malloc
to keep freed memory for reuse (``runtime.host_allocator``: XLA:CPU's temporaries are otherwise page-faulted in again at
every execution), which must happen before any thread starts.
"""

from runtime.host_allocator import SCRIPTS, keep_freed_memory, launched_module, runs_on_cpu

if launched_module() in SCRIPTS and runs_on_cpu():
    keep_freed_memory()

from runtime.console import setup_terminal  # noqa: E402  (after the allocator: these imports may start threads)
from runtime.distributed import initialize  # noqa: E402

setup_terminal()
initialize()
