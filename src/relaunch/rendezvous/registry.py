"""torch's ``torch.distributed.elastic.rendezvous.registry``, at relaunch's path: the handler for
a ``RendezvousParameters`` (its home is ``rendezvous.backends``)."""

from relaunch.rendezvous.backends import get_rendezvous_handler

__all__ = ["get_rendezvous_handler"]
