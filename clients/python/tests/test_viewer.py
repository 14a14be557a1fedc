"""The viewer side: the store's ordering rules, and a Watch that follows a
real presenced, reopens when it restarts, and refreshes its token."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import grpc
import pytest

from conftest import JWT_SECRET, SERVICE_TOKEN, Server, eventually
from presenced import LeaseChannel, PresenceError, ViewerStore, Watcher, pb
from presenced.channel import presence_stub


def user(user_id: str, state: int, version: int) -> pb.UserPresence:
    return pb.UserPresence(user_id=user_id, state=state, version=version)  # type: ignore[arg-type]


def viewer_token(subject: str, expires_in: float) -> str:
    """An HS256 JWT, as an app's login service would mint one."""

    def encode(part: bytes) -> str:
        return base64.urlsafe_b64encode(part).rstrip(b"=").decode()

    header = encode(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    claims = encode(json.dumps({"sub": subject, "exp": int(time.time() + expires_in)}).encode())
    signature = hmac.new(JWT_SECRET.encode(), f"{header}.{claims}".encode(), hashlib.sha256).digest()
    return f"{header}.{claims}.{encode(signature)}"


def test_an_older_version_after_a_newer_one_is_dropped() -> None:
    store = ViewerStore()
    assert store.apply_update(user("alice", pb.STATE_ONLINE, 20))
    assert not store.apply_update(user("alice", pb.STATE_OFFLINE, 10))
    assert not store.apply_update(user("alice", pb.STATE_OFFLINE, 20))
    assert store.online("alice") and store.dropped == 2


def test_a_resync_replaces_and_never_merges_stale_versions() -> None:
    store = ViewerStore()
    store.apply_update(user("alice", pb.STATE_ONLINE, 30))
    store.apply_update(user("bob", pb.STATE_ONLINE, 5))
    # A resync that says alice is OFFLINE at a lower version (a restarted
    # node, new stamps) and omits bob: the store becomes the snapshot.
    store.apply(pb.WatchEvent(snapshot=pb.Snapshot(users=[user("alice", pb.STATE_OFFLINE, 7)])))
    assert store.get("alice") == user("alice", pb.STATE_OFFLINE, 7)
    assert store.get("bob") is None


def test_a_partial_resync_keeps_the_versions_it_confirmed() -> None:
    store = ViewerStore()
    store.apply_update(user("alice", pb.STATE_ONLINE, 30))
    store.apply_update(user("bob", pb.STATE_ONLINE, 5))
    partial = pb.Snapshot(users=[user("bob", pb.STATE_OFFLINE, 6)], partial=True)
    store.apply(pb.WatchEvent(snapshot=partial), watched=["alice", "bob"])
    assert store.get("alice") == user("alice", pb.STATE_ONLINE, 30), "left out: confirmed current"
    assert store.get("bob") == user("bob", pb.STATE_OFFLINE, 6)


async def test_a_watcher_follows_flips_and_resumes_after_the_node_restarts(server: Server) -> None:
    async with Watcher(server.addr, ["alice", "bob"]) as watcher:
        assert not watcher.store.online("alice")
        async with LeaseChannel(server.addr) as leases:
            await leases.register("alice", "s1", ttl_ms=30_000)

            async def online() -> bool:
                return watcher.store.online("alice")

            await eventually(online, "alice shown online")
            await server.restart()
            # The restarted node (in memory) holds nobody: the reopened
            # Watch's snapshot replaces what the viewer held.

            async def offline_after_reopen() -> bool:
                return watcher.opened >= 2 and not watcher.store.online("alice")

            await eventually(offline_after_reopen, "the Watch reopened and showed the restarted node")
            await leases.register("alice", "s1", ttl_ms=30_000)
            await eventually(online, "alice online again on the reopened Watch")


async def test_a_watcher_refreshes_its_token_when_the_stream_ends_at_its_expiry(secured: Server) -> None:
    minted: list[str] = []

    def token() -> str:
        # Short-lived: the server ends the stream when it expires.
        minted.append(viewer_token("viewer-1", expires_in=2 if not minted else 600))
        return minted[-1]

    async with LeaseChannel(secured.addr, token=SERVICE_TOKEN) as leases:
        await leases.register("alice", "s1", ttl_ms=30_000)
        # Seen by every viewer (by default only its audience sees a user).
        everyone = pb.SetVisibilityRequest(user_id="alice", visibility=pb.VISIBILITY_EVERYONE)
        await presence_stub(leases._channel).SetVisibility(everyone, metadata=(("authorization", f"Bearer {SERVICE_TOKEN}"),))
        async with Watcher(secured.addr, ["alice"], token=token) as watcher:

            async def reopened() -> bool:
                return watcher.opened >= 2 and len(minted) >= 2

            await eventually(reopened, "the Watch reopened with a fresh token", within=15)
            assert watcher.store.online("alice")


async def test_a_watcher_with_a_fixed_expired_token_stops_with_the_refusal(secured: Server) -> None:
    watcher = Watcher(secured.addr, ["alice"], token=viewer_token("viewer-1", expires_in=-60))
    watcher.start()
    with pytest.raises(PresenceError) as refused:
        await watcher.ready()
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert watcher.last_error is refused.value and not watcher.running
    await watcher.close()
