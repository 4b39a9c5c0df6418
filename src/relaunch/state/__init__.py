"""State a worker keeps in its agent's memory across its death (``relaunch.save_state``): the
slot files both sides read and write (``files``) and the worker's calls (``api``)."""
