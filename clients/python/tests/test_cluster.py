"""ClusterLeases against a real cluster: etcd and two presenced nodes. Items
sent to one node reach every user's owner, following the NotOwner refusals,
and a Session keeps its user online through it."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator

import pytest

from conftest import Server, eventually, free_port
from presenced import ClusterLeases, Session, open_channel, pb, slot_of
from presenced.channel import presence_stub

SLOTS = 64


def test_slots_are_the_servers() -> None:
    # The vectors of presence-core's own test (crates/presence-core/src/slots.rs).
    for user, slot in [("", 453), ("a", 300), ("alice", 999), ("user-42", 939), ("ユーザー", 766), ("room:doc-7", 330)]:
        assert slot_of(user, 1024) == slot, user
    assert slot_of("alice", 0xFFFFFFFF) == 0x872213E7


@pytest.fixture
async def cluster() -> AsyncIterator[list[Server]]:
    data = tempfile.mkdtemp(prefix="presenced-py-etcd-")
    client_url = f"http://127.0.0.1:{free_port()}"
    peer_url = f"http://127.0.0.1:{free_port()}"
    etcd = subprocess.Popen(
        [os.environ.get("PRESENCED_ETCD_BIN", "etcd"), "--name", "test", "--data-dir", data,
         "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
         "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
         "--initial-cluster", f"test={peer_url}", "--heartbeat-interval", "10", "--election-timeout", "50"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    nodes: list[Server] = []
    try:
        for name in ("node-a", "node-b"):
            node = Server("--etcd", client_url, "--node-id", name, "--slots", str(SLOTS),
                          "--etcd-prefix", "/py-test/", "--etcd-lease-ttl-ms", "2000", "--cluster-settle-ms", "500")  # fmt: skip
            node.args += ["--advertise", node.addr]
            await node.start()
            nodes.append(node)
        yield nodes
    finally:
        for node in nodes:
            await node.stop()
        etcd.terminate()
        await asyncio.to_thread(etcd.wait, 10)
        shutil.rmtree(data, ignore_errors=True)


async def test_items_reach_each_users_owner_from_one_seed(cluster: list[Server]) -> None:
    users = [f"user-{i}" for i in range(40)]
    async with ClusterLeases([cluster[0].addr], slots=SLOTS, move_budget=10) as leases:

        async def both_own_slots() -> bool:
            # Until the coordinator has given node-b its slots, every slot is
            # node-a's; then node-a refuses node-b's users, naming node-b.
            for user in users:
                await leases.register(user, "s1", ttl_ms=30_000, gateway_id="gw")
            return leases.redirected > 0

        await eventually(both_own_slots, "items sent on to node-b as node-a named it", within=30)
        assert {address for _, address in leases.owners.values()} == {cluster[1].addr}
        session = Session(leases, "carol", "tab-1", ttl_ms=600)
        await session.open()
        await asyncio.sleep(1.5)
        for node in cluster:
            channel, _ = open_channel(node.addr)
            async with channel:
                seen = await presence_stub(channel).Snapshot(pb.SnapshotRequest(user_ids=[*users, "carol"]))
                offline = [user.user_id for user in seen.users if user.state != pb.STATE_ONLINE]
                assert offline == [], f"every user ONLINE as {node.addr} answers"
        await session.close()
