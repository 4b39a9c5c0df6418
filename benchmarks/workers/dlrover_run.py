"""``dlrover-run`` (DLRover 0.6.1) under torch 2.13: python dlrover_run.py [dlrover-run args].

DLRover 0.6.1 builds torch's ``SubprocessHandler`` with the arguments of torch 2.3 to 2.9; torch
2.13's takes one more, ``numa_options``, with no default. Give it one (None: no NUMA binding,
what torchrun passes when no binding is asked for), then run dlrover-run's ``main``.
"""

from __future__ import annotations

import importlib
import sys

from torch.distributed.elastic.multiprocessing import subprocess_handler as handler_module

handler = handler_module.SubprocessHandler
original_init = handler.__init__
if "numa_options" in original_init.__code__.co_varnames[: original_init.__code__.co_argcount]:
    defaults = original_init.__defaults__ or ()
    if len(defaults) < 1:
        original_init.__defaults__ = (*defaults, None)

if __name__ == "__main__":
    sys.argv[0] = "dlrover-run"
    sys.exit(importlib.import_module("dlrover.trainer.torch.main").main())
