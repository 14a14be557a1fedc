"""presenced's Python client (asyncio, on grpcio's ``grpc.aio``).

Gateway side: :class:`LeaseChannel` (every lease item of a gateway on one
``Leases`` stream, batched, with a bounded queue that sheds renewals first)
and :class:`Session` (one connection of a user, renewed with jitter,
registered again when the server lost its lease, closed when superseded).

In a cluster, :class:`ClusterLeases` sends each item to its user's owner,
following the ``NotOwner`` refusals and waiting out a slot between owners.

Viewer side: :class:`ViewerStore` (users at their highest version) and
:class:`Watcher` (a Watch that reopens itself, resuming with the versions held).

The messages and the raw stub are ``presenced.pb`` and ``presenced.PresenceStub``.
"""

from presenced._proto.presence.v1 import presence_pb2 as pb
from presenced._proto.presence.v1.presence_pb2_grpc import PresenceStub
from presenced.channel import open_channel
from presenced.errors import PresenceError
from presenced.cluster import ClusterLeases, slot_of
from presenced.leases import LeaseChannel, Leases, Session
from presenced.viewer import ViewerStore, Watcher

__all__ = [
    "ClusterLeases",
    "LeaseChannel",
    "Leases",
    "PresenceError",
    "PresenceStub",
    "Session",
    "ViewerStore",
    "Watcher",
    "open_channel",
    "slot_of",
    "pb",
]
