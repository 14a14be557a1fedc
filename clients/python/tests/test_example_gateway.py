"""examples/python-gateway against a real presenced: a socket that connects
is ONLINE to a viewer, one that closes goes OFFLINE after the linger, and a
socket watching a user is sent that user's changes."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import aiohttp
import pytest
from aiohttp import web

from conftest import Server, eventually
from presenced import Watcher

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "examples" / "python-gateway"))
import gateway  # noqa: E402


@pytest.fixture
async def gateway_url(server: Server) -> object:
    os.environ["LINGER_MS"] = "300"
    gateway.LINGER_MS = 300
    runner = web.AppRunner(gateway.make_app(server.addr))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"ws://127.0.0.1:{port}/ws"
    await runner.cleanup()


async def test_a_socket_is_online_while_open_and_offline_after_it_closes(server: Server, gateway_url: str) -> None:
    async with Watcher(server.addr, ["alice", "bob"]) as viewer, aiohttp.ClientSession() as http:
        bob = await http.ws_connect(f"{gateway_url}?user=bob&session=tab-1&watch=alice")
        alice = await http.ws_connect(f"{gateway_url}?user=alice&session=tab-1&room=lobby")

        async def both_online() -> bool:
            return viewer.store.online("alice") and viewer.store.online("bob")

        await eventually(both_online, "both sockets' users ONLINE")
        # bob's socket is told of alice (its Watch acts for bob; alice's
        # default audience does not include bob, so it sees her OFFLINE:
        # privacy applies to the socket's user, not the gateway).
        seen = json.loads((await bob.receive(timeout=10)).data)
        assert seen["type"] == "event" and seen["userId"] == "alice"
        await alice.close()

        async def alice_offline() -> bool:
            return not viewer.store.online("alice")

        await eventually(alice_offline, "alice OFFLINE after her socket closed and the linger passed")
        assert viewer.store.online("bob")
        await bob.close()
