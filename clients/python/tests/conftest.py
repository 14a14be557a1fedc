"""A real presenced for the tests: the binary built from this repository
(``PRESENCED_BIN``, else ``target/release`` or ``target/debug``, the newer),
started on a free loopback port and stopped after each test."""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
T = TypeVar("T")


def binary() -> str:
    given = os.environ.get("PRESENCED_BIN")
    if given:
        return given
    built = [ROOT / "target" / kind / "presenced" for kind in ("release", "debug")]
    found = [path for path in built if path.exists()]
    if not found:
        raise RuntimeError("no presenced binary: run `cargo build` first, or set PRESENCED_BIN")
    return str(max(found, key=lambda path: path.stat().st_mtime))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """One presenced process; :meth:`restart` starts a fresh one on the same port."""

    def __init__(self, *args: str) -> None:
        self.args = ["--min-ttl-ms", "100", *args]
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.process: subprocess.Popen[str] | None = None

    async def start(self) -> None:
        # In a thread: the test's event loop must go on serving the client's
        # connections while presenced starts and stops (it waits for them to close).
        await asyncio.to_thread(self._start)

    def _start(self) -> None:
        self.process = subprocess.Popen(
            [binary(), "serve", "--listen", self.addr, *self.args],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "RUST_LOG": "warn"},
        )
        assert self.process.stdout is not None
        first = self.process.stdout.readline()
        assert first.startswith("listening on "), f"presenced did not start: {first!r}"

    async def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            await asyncio.to_thread(self.process.wait, 30)
            self.process = None

    async def restart(self) -> None:
        await self.stop()
        await self.start()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    running = Server()
    await running.start()
    yield running
    await running.stop()


SERVICE_TOKEN = "python-test-service-token"
JWT_SECRET = "a-python-test-hs256-secret-of-at-least-32-bytes"


@pytest.fixture
async def secured() -> AsyncIterator[Server]:
    running = Server("--service-token", SERVICE_TOKEN, "--viewer-jwt-hs256-secret", JWT_SECRET)
    await running.start()
    yield running
    await running.stop()


async def eventually(check: Callable[[], Awaitable[T | None]], what: str, within: float = 10.0) -> T:
    """Awaits ``check`` until it gives something, or fails naming ``what``."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        found = await check()
        if found is not None and found is not False:
            return found
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not within {within} s")
        await asyncio.sleep(0.02)
