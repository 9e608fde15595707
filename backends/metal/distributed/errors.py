"""The errors of distributed loading and running."""
from __future__ import annotations


class ShardingError(ValueError):
    """A model cannot be split over the group as asked; the message names the layer or the sizes."""


class PeerLostError(RuntimeError):
    """Another rank of the group died or stopped answering; the message says which and when."""
