"""Opening a channel to presenced: plain, or TLS as the other clients take it."""

from __future__ import annotations

import pathlib
from typing import Any, Union

import grpc

#: A lost node is tried again soon and then every few seconds at most:
#: grpc's default backoff grows to two minutes, far past any session's TTL.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]

#: An address (``host:port``; ``https://host:port`` for TLS) or an open channel.
Target = Union[str, grpc.aio.Channel]


def open_channel(
    target: Target, *, ca: str | None = None, cert: str | None = None, key: str | None = None
) -> tuple[grpc.aio.Channel, bool]:
    """The channel for ``target``, and whether it was opened here (and so is
    closed with its user). ``https://`` or a ``ca`` means TLS, verified
    against ``ca`` (the system's roots without it); ``cert`` and ``key`` are
    a client certificate, for a server that asks for one."""
    if not isinstance(target, str):
        return target, False
    if (cert is None) != (key is None):
        raise ValueError("cert and key go together: give both or neither")
    tls = target.startswith("https://") or ca is not None
    address = target.removeprefix("https://").removeprefix("http://").rstrip("/")
    if not tls:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS), True

    def read(path: str | None) -> bytes | None:
        return pathlib.Path(path).read_bytes() if path is not None else None

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert)
    )
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS), True


def presence_stub(channel: grpc.aio.Channel) -> Any:
    """The generated ``Presence`` stub (grpcio-tools writes it untyped; the
    messages it takes and gives are typed, in ``presence_pb2.pyi``)."""
    from presenced._proto.presence.v1 import presence_pb2_grpc as pb_grpc

    return pb_grpc.PresenceStub(channel)  # type: ignore[no-untyped-call]
