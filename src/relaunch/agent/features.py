"""The agent's features that act on its workers, each an attempt hook (``agent.hooks``) made
for a run, in the order they are told of each moment: one line a feature."""

from __future__ import annotations

from relaunch.agent.hook_expiry import ExpiryHook
from relaunch.agent.hook_parking import attach as restart_in_place
from relaunch.agent.hook_preload import attach as preload
from relaunch.agent.hook_progress import ProgressHook
from relaunch.agent.hook_state import attach as kept_state
from relaunch.agent.hook_torch_store import attach as torch_store
from relaunch.agent.hooks import HookFactory

FEATURES: tuple[HookFactory, ...] = (
    ProgressHook,  # the status posts and the node bar
    ExpiryHook,  # expiry timers and hang detection
    torch_store,  # torch's store, bound before --state's agreement lets other nodes start
    kept_state,  # --state
    restart_in_place,  # the parking lot (opened before --preload: the zygote gets its path)
    preload,  # --preload: the zygote
)
