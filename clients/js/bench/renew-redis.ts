/**
 * `npm run bench:redis`: the same measurement as `npm run bench`, for the
 * design presenced replaces. One Node process renews sessions the way seed
 * 000's gateway does: ioredis calling the seed's `presence_heartbeat` script
 * with EVALSHA, against a throwaway `redis-server` this starts on a free
 * loopback port (no persistence). ioredis pipelines every call made in one
 * turn of the event loop (`enableAutoPipelining`), which is the Redis
 * counterpart of the LeaseChannel's batches.
 *
 * It registers SESSIONS sessions with the seed's `presence_register`, then
 * keeps CONCURRENCY heartbeats outstanding (each caller sends the next as soon
 * as its last one is answered) and counts those answered "renewed" during
 * SECONDS seconds after a warm-up. Each session's keys are built once, as the
 * generous reading of the seed (its gateway builds them on every call).
 *
 * Environment: SESSIONS (100000), SECONDS (10), WARMUP (2), CONCURRENCY
 * (4096, as `npm run bench`), TTL_MS (600000), REDIS_SERVER (`redis-server`).
 */
import { spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { connect } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { Redis } from "ioredis";

import { freePort } from "../test/helpers.js";
import { procCpuSeconds } from "./cpu.js";

const env = (name: string, fallback: number): number => Number(process.env[name] ?? fallback);

const SESSIONS = env("SESSIONS", 100_000);
const SECONDS = env("SECONDS", 10);
const WARMUP = env("WARMUP", 2);
const CONCURRENCY = env("CONCURRENCY", 4096);
const TTL_MS = env("TTL_MS", 600_000);

/** The seed's scripts, as the Rust load generator runs them. */
const LUA = new URL("../../../../tools/loadgen/lua/", import.meta.url);
const script = (name: string): string => readFileSync(new URL(`${name}.lua`, LUA), "utf8");

/** Resolves once something accepts connections on loopback `port`. */
async function listening(port: number, withinMs: number): Promise<void> {
  const deadline = performance.now() + withinMs;
  for (;;) {
    const open = await new Promise<boolean>((resolve) => {
      const socket = connect(port, "127.0.0.1");
      socket.once("connect", () => (socket.destroy(), resolve(true)));
      socket.once("error", () => resolve(false));
    });
    if (open) return;
    if (performance.now() > deadline) throw new Error(`redis-server did not listen on port ${port} within ${withinMs} ms`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

async function main(): Promise<void> {
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), "presenced-bench-redis-"));
  const binary = process.env.REDIS_SERVER ?? "redis-server";
  const server = spawn(binary, ["--port", String(port), "--bind", "127.0.0.1", "--dir", dir, "--save", "", "--appendonly", "no"], {
    stdio: ["ignore", "ignore", "inherit"],
  });
  server.once("error", (err) => {
    console.error(`could not start ${binary} (${err.message}): install it (Debian: apt-get install redis-server) or set REDIS_SERVER`);
    process.exit(2);
  });
  const redis = new Redis({ port, host: "127.0.0.1", enableAutoPipelining: true, lazyConnect: true, retryStrategy: (n) => (n > 50 ? null : 100) });
  try {
    await listening(port, 10_000);
    await redis.connect();
    const register = (await redis.script("LOAD", script("presence_register"))) as string;
    const heartbeat = (await redis.script("LOAD", script("presence_heartbeat"))) as string;

    const sessionKeys = Array.from({ length: SESSIONS }, (_, i) => `presence:{bench-${i}}:s:s`);
    const idxKeys = Array.from({ length: SESSIONS }, (_, i) => `presence:{bench-${i}}:idx`);
    const generations: string[] = new Array(SESSIONS);
    let nextToRegister = 0;
    await Promise.all(
      Array.from({ length: Math.min(CONCURRENCY, SESSIONS) }, async () => {
        for (let i = nextToRegister++; i < SESSIONS; i = nextToRegister++) {
          const meta = `presence:{bench-${i}}:meta`;
          const [generation] = (await redis.evalsha(register, 3, sessionKeys[i]!, idxKeys[i]!, meta, "s", "bench", TTL_MS)) as [number, number];
          generations[i] = String(generation);
        }
      }),
    );

    let ok = 0;
    let refused = 0;
    let running = true;
    let cursor = 0;
    const ttl = String(TTL_MS);
    const caller = async (): Promise<void> => {
      while (running) {
        const i = cursor;
        cursor = cursor + 1 === SESSIONS ? 0 : cursor + 1;
        try {
          const [renewed] = (await redis.evalsha(heartbeat, 2, sessionKeys[i]!, idxKeys[i]!, "s", generations[i]!, ttl)) as [number, number];
          if (renewed === 1) ok++;
          else refused++;
        } catch {
          refused++;
        }
      }
    };
    const callers = Array.from({ length: CONCURRENCY }, caller);

    await new Promise((resolve) => setTimeout(resolve, WARMUP * 1000));
    const okBefore = ok;
    const cpuBefore = process.cpuUsage();
    const serverBefore = procCpuSeconds(server.pid!);
    const started = performance.now();
    await new Promise((resolve) => setTimeout(resolve, SECONDS * 1000));
    const wall = (performance.now() - started) / 1000;
    const cpu = process.cpuUsage(cpuBefore);
    const serverAfter = procCpuSeconds(server.pid!);
    const renewals = ok - okBefore;
    running = false;
    await Promise.all(callers);

    const nodeCpu = (cpu.user + cpu.system) / 1e6;
    const lines = [
      `redis + lua (ioredis, auto-pipelining), sessions ${SESSIONS}, ${CONCURRENCY} heartbeats outstanding`,
      `renewals/s sustained: ${Math.round(renewals / wall)} (${renewals} renewed in ${wall.toFixed(2)} s; ${refused} refused in all)`,
      `node CPU: ${nodeCpu.toFixed(2)} s user+sys = ${((100 * nodeCpu) / wall).toFixed(0)}% of one core ` +
        `(user ${(cpu.user / 1e6).toFixed(2)} s, sys ${(cpu.system / 1e6).toFixed(2)} s)`,
    ];
    if (serverBefore !== undefined && serverAfter !== undefined) {
      const serverCpu = serverAfter - serverBefore;
      lines.push(`redis-server CPU: ${serverCpu.toFixed(2)} s user+sys = ${((100 * serverCpu) / wall).toFixed(0)}% of one core`);
    }
    console.log(lines.join("\n"));
  } finally {
    redis.disconnect();
    server.kill("SIGKILL");
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
