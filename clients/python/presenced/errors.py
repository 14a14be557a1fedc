"""What a call to presenced can fail with, as one exception type."""

from __future__ import annotations

import grpc

from presenced._proto.presence.v1 import presence_pb2 as pb


class PresenceError(Exception):
    """A call refused by presenced (or never answered): its gRPC status code,
    the server's message, and, when a cluster node does not own the user's
    slot, the owner it named (``not_owner``)."""

    def __init__(self, code: grpc.StatusCode, message: str, not_owner: pb.NotOwner | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.not_owner = not_owner

    @property
    def shed(self) -> bool:
        """A renewal shed under overload (or by the client's full queue):
        the session is kept; the next beat carries the renewal again."""
        return self.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def lease_lost(self) -> bool:
        """The lease is gone (expired, revoked, or the node restarted without
        it): register again, with a new generation."""
        return self.code == grpc.StatusCode.NOT_FOUND

    @property
    def superseded(self) -> bool:
        """A newer registration of the session holds the lease (a stale
        generation): this one must stop, and never retry."""
        return self.code == grpc.StatusCode.FAILED_PRECONDITION


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The status code numbered ``number`` (a Leases result carries numbers)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)
