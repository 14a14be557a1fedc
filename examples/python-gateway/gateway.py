"""A WebSocket gateway on presenced, in Python (aiohttp and the presenced client).

Each socket at ``/ws?user=alice&session=tab-1&watch=bob,carol&room=lobby``
is one session of its user: registered when it connects (and kept alive by
the client's renewals), in ``room`` if given, unregistered with a linger
when it closes, so that a reload within the linger shows no flip. aiohttp
pings the socket every ``HEARTBEAT`` seconds and closes one that does not
answer: a laptop that went to sleep is unregistered at once, and a gateway
that dies leaves leases that run out by themselves. The socket is sent
``{"type": "event", "userId", "state", "version"}`` for each change of the
users it watches, as its user may see them (a Watch acting for it).

    PRESENCED=127.0.0.1:50051 PORT=8080 python gateway.py
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator

from aiohttp import WSMsgType, web

from presenced import LeaseChannel, Session, Watcher, pb

HEARTBEAT = float(os.environ.get("HEARTBEAT_S", "10"))
TTL_MS = int(os.environ.get("TTL_MS", "30000"))
LINGER_MS = int(os.environ.get("LINGER_MS", "3000"))

LEASES = web.AppKey("leases", LeaseChannel)
PRESENCED = web.AppKey("presenced", str)


async def on_socket(request: web.Request) -> web.WebSocketResponse:
    user = request.query.get("user", "")
    session_id = request.query.get("session", "")
    if not user or not session_id:
        raise web.HTTPBadRequest(text="user and session are required")
    watched = [name for name in request.query.get("watch", "").split(",") if name]
    room = request.query.get("room")
    socket = web.WebSocketResponse(heartbeat=HEARTBEAT)
    await socket.prepare(request)

    async def superseded(reason: str) -> None:
        # A newer connection of the same session holds the lease.
        await socket.close(code=4401, message=b"superseded")

    session = Session(request.app[LEASES], user, session_id, ttl_ms=TTL_MS, on_closed=superseded)
    await session.open()
    if room:
        await session.join(room)

    def relay(_: object, event: pb.WatchEvent) -> None:
        users = (
            list(event.snapshot.users)
            if event.HasField("snapshot")
            else [event.update]
            if event.HasField("update")
            else list(event.updates.users)
        )
        for presence in users:
            message = {
                "type": "event",
                "userId": presence.user_id,
                "state": pb.State.Name(presence.state),
                "version": str(presence.version),
            }
            asyncio.ensure_future(socket.send_str(json.dumps(message)))

    watcher = None
    if watched:
        watcher = Watcher(
            request.app[PRESENCED], watched, token=os.environ.get("PRESENCED_TOKEN"), viewer_id=user, on_change=relay
        )
        watcher.start()
    try:
        async for message in socket:
            if message.type == WSMsgType.ERROR:
                break
    finally:
        if watcher is not None:
            await watcher.close()
        await session.close(linger_ms=LINGER_MS)
    return socket


def make_app(presenced: str, token: str | None = None) -> web.Application:
    app = web.Application()
    app[PRESENCED] = presenced

    async def leases(app: web.Application) -> AsyncIterator[None]:
        async with LeaseChannel(presenced, token=token) as channel:
            app[LEASES] = channel
            yield

    app.cleanup_ctx.append(leases)
    app.router.add_get("/ws", on_socket)
    return app


if __name__ == "__main__":
    web.run_app(
        make_app(os.environ.get("PRESENCED", "127.0.0.1:50051"), os.environ.get("PRESENCED_TOKEN")),
        port=int(os.environ.get("PORT", "8080")),
    )
