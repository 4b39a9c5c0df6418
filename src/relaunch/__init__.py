"""relaunch: a fast, lean, orphan-proof, torchrun-compatible launcher for distributed jobs.

The public names follow ``torch.distributed.elastic``, so code moves over by changing an import.
Importing relaunch never imports torch or any other framework.
"""

from relaunch import procs
from relaunch.procs import *  # noqa: F403

__version__ = "0.1.0"

__all__ = [*procs.__all__]
