"""What every pool worker needs imported, imported once: the pool's processes are forked from a
process that imported this module (tests/dist_pool.py `_context`, multiprocessing's forkserver with
this module preloaded), so a new pool or a replaced worn one costs a fork and a gloo group instead of
importing torch, Megatron-Core and the package again in each process (tens of seconds on the 2-core
CI machine). Only imports here: no process group, no thread pool, nothing a fork would copy half-made.
"""
import os

ENV_BEFORE_IMPORTS = dict(os.environ)  # what the imports below set is kept in the workers (dist_pool)

import torch  # noqa: F401,E402
import torch.distributed  # noqa: F401,E402

import tests.dist_pool as dist_pool  # noqa: E402
from megatron_rlcorr.parallel.cpu import enable_cpu_megatron  # noqa: F401,E402 - and Megatron-Core with it

dist_pool.import_the_package()
