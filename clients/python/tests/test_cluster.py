"""ClusterLeases against a real cluster: etcd and two presenced nodes. Items
sent to one node reach every user's owner, following the NotOwner refusals,
and a Session keeps its user online through it."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest

from conftest import Server, eventually, free_port
from presenced import ClusterLeases, PresenceError, Session, open_channel, pb, slot_of
from presenced.channel import presence_stub

SLOTS = 64


def test_slots_are_the_servers() -> None:
    # The vectors of presence-core's own test (crates/presence-core/src/slots.rs).
    for user, slot in [("", 453), ("a", 300), ("alice", 999), ("user-42", 939), ("ユーザー", 766), ("room:doc-7", 330)]:
        assert slot_of(user, 1024) == slot, user
    assert slot_of("alice", 0xFFFFFFFF) == 0x872213E7


def etcd_healthy(client_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=1) as answer:
            return b'"true"' in answer.read()
    except OSError:
        return False


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
        # A node that cannot reach etcd when it starts exits: etcd must answer first.
        await eventually(lambda: asyncio.to_thread(etcd_healthy, client_url), "etcd answering /health")
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


async def test_a_node_that_stops_is_forgotten_and_its_users_reach_the_node_that_takes_them_over(
    cluster: list[Server],
) -> None:
    async with ClusterLeases([cluster[0].addr], slots=SLOTS, response_timeout=0.5) as leases:

        async def routed_to_both() -> bool:
            await leases.register("probe", "s1", ttl_ms=30_000)
            return {address for _, address in leases.owners.values()} == {cluster[1].addr} and len(leases.owners) > 0

        await eventually(routed_to_both, "node-b's slots given to it", within=30)
        user = next(f"user-{i}" for i in range(1000) if slot_of(f"user-{i}", SLOTS) in leases.owners)
        await leases.register(user, "s1", ttl_ms=30_000)
        await cluster[1].stop()
        # node-b's items now fail (it does not answer), and its routes are
        # forgotten: the next try goes to the seed, which names node-a once
        # it has taken node-b's slots over (node-b's etcd lease: 2 s).
        with pytest.raises(PresenceError) as unanswered:
            await leases.register(user, "s2", ttl_ms=30_000)
        assert unanswered.value.code == grpc.StatusCode.UNAVAILABLE
        assert slot_of(user, SLOTS) not in leases.owners

        async def registered_at_node_a() -> bool:
            try:
                await leases.register(user, "s2", ttl_ms=30_000)
            except PresenceError:
                return False
            return True

        await eventually(registered_at_node_a, "the user registered after the takeover", within=20)
        assert leases.owners.get(slot_of(user, SLOTS), (0, cluster[0].addr))[1] == cluster[0].addr
