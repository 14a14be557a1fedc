/**
 * `npm run bench`: how many renewals a second one Node process sustains
 * through one LeaseChannel against `target/release/presenced`, and what CPU
 * it and the server spend on them.
 *
 * It starts the release binary on a free port (`PRESENCED_BENCH_BIN` to use
 * another), registers SESSIONS sessions, then keeps CONCURRENCY renewals
 * outstanding at all times (each caller renews the next session as soon as
 * its last renewal is answered), and counts the renewals answered OK during
 * SECONDS seconds after a warm-up. The server runs with
 * `--min-renew-interval-ms 0` so that every renewal is a real one, not one
 * acknowledged as throttled.
 *
 * Environment: SESSIONS (100000), SECONDS (10), WARMUP (2), MAX_BATCH (512),
 * IN_FLIGHT (8), CONCURRENCY (IN_FLIGHT × MAX_BATCH: enough to fill every
 * batch in flight), QUEUE (the channel's maxQueued: 2 × CONCURRENCY, so that
 * the queue never refuses one of them), WIRE (`http2`, what
 * `connectLeaseChannel` uses, or `transport`: through connect's Node
 * transport and protobuf-es, for comparison).
 */
import { join } from "node:path";

import { LeaseChannel } from "../src/index.js";
import { connectLeaseChannel } from "../src/node.js";
import { Server, TARGET } from "../test/helpers.js";
import { procCpuSeconds } from "./cpu.js";

const env = (name: string, fallback: number): number => Number(process.env[name] ?? fallback);

const SESSIONS = env("SESSIONS", 100_000);
const SECONDS = env("SECONDS", 10);
const WARMUP = env("WARMUP", 2);
const MAX_BATCH = env("MAX_BATCH", 512);
const IN_FLIGHT = env("IN_FLIGHT", 8);
const CONCURRENCY = env("CONCURRENCY", IN_FLIGHT * MAX_BATCH);
const QUEUE = env("QUEUE", 2 * CONCURRENCY);
const WIRE = process.env.WIRE ?? "http2";

async function main(): Promise<void> {
  const binary = process.env.PRESENCED_BENCH_BIN ?? join(TARGET, "release", "presenced");
  const server = await Server.start(["--min-renew-interval-ms", "0", "--default-ttl-ms", "600000"], { binary });
  const options = { maxBatch: MAX_BATCH, maxInFlightBatches: IN_FLIGHT, maxQueued: QUEUE };
  const channel =
    WIRE === "transport" ? new LeaseChannel(server.transport, options) : connectLeaseChannel(server.url, options);
  const concurrency = Math.min(CONCURRENCY, channel.config.maxQueued);
  try {
    const generations: bigint[] = new Array(SESSIONS);
    // Each session keeps its ids, as a gateway's `Session` does: none is built per renewal.
    const userIds = Array.from({ length: SESSIONS }, (_, i) => `bench-${i}`);
    // Registered `concurrency` at a time, as the renewals below are sent.
    let nextToRegister = 0;
    await Promise.all(
      Array.from({ length: Math.min(concurrency, SESSIONS) }, async () => {
        for (let i = nextToRegister++; i < SESSIONS; i = nextToRegister++) {
          const registered = await channel.register({ userId: userIds[i]!, sessionId: "s", gatewayId: "bench" });
          generations[i] = registered.generation;
        }
      }),
    );

    let ok = 0;
    let refused = 0;
    let running = true;
    let cursor = 0;
    const caller = async (): Promise<void> => {
      while (running) {
        const i = cursor;
        cursor = cursor + 1 === SESSIONS ? 0 : cursor + 1;
        try {
          await channel.renew({ userId: userIds[i]!, sessionId: "s", generation: generations[i]! });
          ok++;
        } catch {
          refused++;
        }
      }
    };
    const callers = Array.from({ length: concurrency }, caller);

    await new Promise((resolve) => setTimeout(resolve, WARMUP * 1000));
    const okBefore = ok;
    const batchesBefore = channel.stats().batchesSent;
    const itemsBefore = channel.stats().itemsSent;
    const cpuBefore = process.cpuUsage();
    const serverBefore = procCpuSeconds(server.child.pid!);
    const started = performance.now();
    await new Promise((resolve) => setTimeout(resolve, SECONDS * 1000));
    const wall = (performance.now() - started) / 1000;
    const cpu = process.cpuUsage(cpuBefore);
    const serverAfter = procCpuSeconds(server.child.pid!);
    const renewals = ok - okBefore;
    const batches = channel.stats().batchesSent - batchesBefore;
    const items = channel.stats().itemsSent - itemsBefore;
    running = false;
    await Promise.all(callers);

    const nodeCpu = (cpu.user + cpu.system) / 1e6;
    const lines = [
      `wire ${WIRE}, sessions ${SESSIONS}, ${concurrency} renewals outstanding, maxBatch ${MAX_BATCH}, ${IN_FLIGHT} batches in flight`,
      `renewals/s sustained: ${Math.round(renewals / wall)} (${renewals} OK in ${wall.toFixed(2)} s; ${refused} refused in all)`,
      `items per batch: ${(items / Math.max(1, batches)).toFixed(1)}`,
      `node CPU: ${nodeCpu.toFixed(2)} s user+sys = ${((100 * nodeCpu) / wall).toFixed(0)}% of one core ` +
        `(user ${(cpu.user / 1e6).toFixed(2)} s, sys ${(cpu.system / 1e6).toFixed(2)} s)`,
    ];
    if (serverBefore !== undefined && serverAfter !== undefined) {
      const serverCpu = serverAfter - serverBefore;
      lines.push(`server CPU: ${serverCpu.toFixed(2)} s user+sys = ${((100 * serverCpu) / wall).toFixed(0)}% of one core`);
    }
    console.log(lines.join("\n"));
  } finally {
    channel.close();
    await server.kill();
  }
}

await main();
