"""Launch scripts (``python -m launch.<script>``).

Importing the package joins a multi-process launch described by the environment
(``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, SLURM, TPU pod,
Open MPI; see ``runtime.distributed``) before any script's imports run: ``jax.distributed``
must start before the XLA backend, and importing gymnax (through ``envs``) starts it.
On one process this does nothing. It also sets up the terminal (``runtime.console``) before
``transformers`` is first imported.
"""

from runtime.console import setup_terminal
from runtime.distributed import initialize

setup_terminal()
initialize()
