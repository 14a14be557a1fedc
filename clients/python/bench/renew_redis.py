"""The same measurement as renew.py for the design presenced replaces: one
Python process renewing sessions the way seed 000's gateway does, calling
its `presence_heartbeat` Lua script with EVALSHA through redis-py's asyncio
client, against a throwaway `redis-server` this starts on a free loopback
port (no persistence). redis-py does not pipeline calls by itself, so the
calls go as pipelines (no MULTI) of PIPELINE heartbeats, CONCURRENCY / PIPELINE
of them in flight on as many connections: the counterpart of LeaseChannel's
batches, and the most generous way to drive Redis from Python.

    python bench/renew_redis.py        # needs redis-server on PATH (Debian: redis-server)
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import resource
import shutil
import socket
import subprocess
import tempfile
import time

import redis.asyncio as redis

SESSIONS = int(os.environ.get("SESSIONS", "100000"))
SECONDS = float(os.environ.get("SECONDS", "10"))
WARMUP = float(os.environ.get("WARMUP", "2"))
CONCURRENCY = int(os.environ.get("CONCURRENCY", "4096"))
PIPELINE = int(os.environ.get("PIPELINE", "512"))
TTL_MS = int(os.environ.get("TTL_MS", "600000"))
LUA = pathlib.Path(__file__).resolve().parents[3] / "tools" / "loadgen" / "lua"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    scratch = tempfile.mkdtemp(prefix="presenced-bench-redis-")
    binary = os.environ.get("REDIS_SERVER", "redis-server")
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", scratch, "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, max_connections=CONCURRENCY // PIPELINE + 1)
        for _ in range(500):
            try:
                await client.ping()
                break
            except redis.ConnectionError:
                await asyncio.sleep(0.02)
        register = await client.script_load((LUA / "presence_register.lua").read_text())
        heartbeat = await client.script_load((LUA / "presence_heartbeat.lua").read_text())
        session_keys = [f"presence:{{bench-{i}}}:s:s" for i in range(SESSIONS)]
        idx_keys = [f"presence:{{bench-{i}}}:idx" for i in range(SESSIONS)]
        generations = [b""] * SESSIONS
        for start in range(0, SESSIONS, PIPELINE):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(SESSIONS, start + PIPELINE)):
                meta = f"presence:{{bench-{i}}}:meta"
                pipe.evalsha(register, 3, session_keys[i], idx_keys[i], meta, "s", "bench", TTL_MS)
            for offset, (generation, _) in enumerate(await pipe.execute()):
                generations[start + offset] = generation
        counted = refused = 0
        counting = False
        running = True
        cursor = 0

        async def renew() -> None:
            nonlocal cursor, counted, refused
            while running:
                pipe = client.pipeline(transaction=False)
                for _ in range(PIPELINE):
                    i = cursor
                    cursor = 0 if cursor + 1 == SESSIONS else cursor + 1
                    pipe.evalsha(heartbeat, 2, session_keys[i], idx_keys[i], "s", generations[i], TTL_MS)
                answers = await pipe.execute()
                if counting:
                    renewed = sum(1 for answer in answers if answer[0] == 1)
                    counted += renewed
                    refused += len(answers) - renewed

        callers = [asyncio.ensure_future(renew()) for _ in range(max(1, CONCURRENCY // PIPELINE))]
        await asyncio.sleep(WARMUP)
        counting, started, cpu = True, time.perf_counter(), cpu_seconds()
        await asyncio.sleep(SECONDS)
        counting = False
        elapsed, cpu = time.perf_counter() - started, cpu_seconds() - cpu
        running = False
        await asyncio.gather(*callers, return_exceptions=True)
        await client.aclose()
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    assert refused == 0, f"{refused} heartbeats were not renewals"
    print(
        f"Redis + Lua (redis-py, pipelines of {PIPELINE}): {counted / elapsed:,.0f} renewals/s over {elapsed:.1f} s; "
        f"python CPU {100 * cpu / elapsed:.0f} % of a core, {1e6 * cpu / counted:.1f} us per renewal"
    )


if __name__ == "__main__":
    asyncio.run(main())
