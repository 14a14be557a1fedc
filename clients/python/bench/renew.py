"""Renewals per second from one Python process through one LeaseChannel.

The same measurement as clients/js's `npm run bench`: SESSIONS registered
sessions, CONCURRENCY renewals outstanding at all times (each caller renews
the next session as soon as its last renewal is answered), counted over
SECONDS after WARMUP, against presenced at PRESENCED (started by the caller
with `--min-renew-interval-ms 0`, so that every renewal is a real one).

    PRESENCED=127.0.0.1:50051 python bench/renew.py
"""

from __future__ import annotations

import asyncio
import os
import resource
import time

from presenced import LeaseChannel

SESSIONS = int(os.environ.get("SESSIONS", "100000"))
SECONDS = float(os.environ.get("SECONDS", "10"))
WARMUP = float(os.environ.get("WARMUP", "2"))
CONCURRENCY = int(os.environ.get("CONCURRENCY", "4096"))
TTL_MS = int(os.environ.get("TTL_MS", "600000"))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main() -> None:
    async with LeaseChannel(os.environ.get("PRESENCED", "127.0.0.1:50051"), max_queued=CONCURRENCY * 2) as leases:
        generations = [0] * SESSIONS
        cursor = 0

        async def register() -> None:
            nonlocal cursor
            while cursor < SESSIONS:
                i = cursor
                cursor += 1
                answer = await leases.register(f"bench-{i}", "s", ttl_ms=TTL_MS, gateway_id="bench")
                generations[i] = answer.generation

        await asyncio.gather(*(register() for _ in range(min(CONCURRENCY, SESSIONS))))
        counted = 0
        counting = False
        running = True
        cursor = 0

        async def renew() -> None:
            nonlocal cursor, counted
            while running:
                i = cursor
                cursor = 0 if cursor + 1 == SESSIONS else cursor + 1
                await leases.renew(f"bench-{i}", "s", generations[i], ttl_ms=TTL_MS)
                if counting:
                    counted += 1

        callers = [asyncio.ensure_future(renew()) for _ in range(CONCURRENCY)]
        await asyncio.sleep(WARMUP)
        counting, started, cpu = True, time.perf_counter(), cpu_seconds()
        await asyncio.sleep(SECONDS)
        counting = False
        elapsed, cpu = time.perf_counter() - started, cpu_seconds() - cpu
        running = False
        await asyncio.gather(*callers, return_exceptions=True)
    rate = counted / elapsed
    print(
        f"presenced LeaseChannel (python): {rate:,.0f} renewals/s over {elapsed:.1f} s; "
        f"python CPU {100 * cpu / elapsed:.0f} % of a core, {1e6 * cpu / counted:.1f} us per renewal"
    )


if __name__ == "__main__":
    asyncio.run(main())
