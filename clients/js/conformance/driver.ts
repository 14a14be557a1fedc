/**
 * The TypeScript client's driver of the client conformance suite
 * (`clients/conformance/README.md`): `node dist/conformance/driver.js RUN_FILE`
 * does what the run file's `client` section says with the client's public
 * API only, and prints its report as the last stdout line, one JSON object.
 * Exit status 0 with a report, 1 with `{"error": "..."}`.
 */
import { readFileSync } from "node:fs";

import {
  ChangesConsumer,
  ChangesOutOfRangeError,
  ConnectError,
  cursorFromHex,
  cursorToHex,
  MemoryCursorStore,
  pb,
  Session,
  Watcher,
} from "../src/index.js";
import { connectClusterLeases, connectLeaseChannel, nodeTransport } from "../src/node.js";

type Report = Record<string, unknown>;

/** What a driver hands back: the report, and whether it is a failure (exit 1). */
interface Outcome {
  report: Report;
  failed?: boolean;
}

interface RunFile {
  scenario?: string;
  target: string;
  tokens?: string[];
  client: { kind: string } & Record<string, unknown>;
}

/** Every client names the gateway it runs in; the suite checks none. */
const GATEWAY_ID = "conformance-typescript";

/** gRPC's canonical status names, by number: connect's `Code` uses the same numbers. */
const CANONICAL = [
  "OK",
  "CANCELLED",
  "UNKNOWN",
  "INVALID_ARGUMENT",
  "DEADLINE_EXCEEDED",
  "NOT_FOUND",
  "ALREADY_EXISTS",
  "PERMISSION_DENIED",
  "RESOURCE_EXHAUSTED",
  "FAILED_PRECONDITION",
  "ABORTED",
  "OUT_OF_RANGE",
  "UNIMPLEMENTED",
  "INTERNAL",
  "UNAVAILABLE",
  "DATA_LOSS",
  "UNAUTHENTICATED",
];

function canonical(err: unknown): string {
  return CANONICAL[ConnectError.from(err).code] ?? "UNKNOWN";
}

function describe(err: unknown): string {
  if (err instanceof ConnectError) return `${canonical(err)}: ${err.rawMessage}`;
  return err instanceof Error ? err.message : String(err);
}

/**
 * `JSON.stringify`, with bigints (generations and versions are u64, past
 * 2^53) written as exact JSON numbers: through a marker string, since Node 20
 * has no `JSON.rawJSON`.
 */
function toJson(value: unknown): string {
  const marker = "\u0000bigint:";
  const text = JSON.stringify(value, (_key, v: unknown) => (typeof v === "bigint" ? `${marker}${v}` : v));
  return text.replace(/"\\u0000bigint:(\d+)"/g, "$1");
}

const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms));

/** A field of the `client` section, refused by name when it is missing or of another type. */
function field<T>(client: Record<string, unknown>, name: string, type: "number" | "string" | "object"): T {
  const value = client[name];
  if (typeof value !== type || value === null) throw new Error(`client.${name}: expected a ${type}`);
  return value as T;
}

async function session(run: RunFile): Promise<Outcome> {
  const c = run.client;
  const channel = connectLeaseChannel(run.target);
  try {
    const s = await Session.register(
      channel,
      { userId: field(c, "user_id", "string"), sessionId: field(c, "session_id", "string"), gatewayId: GATEWAY_ID },
      // The first beat is still jittered over one heartbeat: the API has no way to turn that off.
      { ttlMs: field(c, "ttl_ms", "number"), heartbeatMs: field(c, "renew_every_ms", "number") },
    );
    const generations = [s.generation];
    let ended = false;
    s.onState((state) => {
      if (state.kind === "superseded" || state.kind === "closed") ended = true;
      // Every state that names a generation; a "live" after "lost" names the one held already.
      if ("generation" in state && state.generation !== generations.at(-1)) generations.push(state.generation);
    });
    await sleep(field(c, "run_ms", "number"));
    if (c.close === true) {
      // Closed whatever the unregister is answered: the session stops either way.
      await s.close().catch(() => undefined);
      ended = true;
    }
    return { report: { state: ended ? "closed" : "open", generations } };
  } finally {
    channel.close();
  }
}

async function clusterItems(run: RunFile): Promise<Outcome> {
  const c = run.client;
  const cluster = connectClusterLeases(run.target, field(c, "slots", "number")).withMoveWait(field(c, "move_wait_ms", "number"));
  try {
    const results: Report[] = [];
    for (const item of field<Record<string, unknown>[]>(c, "items", "object")) {
      try {
        const registered = await cluster.register({
          userId: field(item, "user_id", "string"),
          sessionId: field(item, "session_id", "string"),
          gatewayId: GATEWAY_ID,
          ttlMs: field(item, "ttl_ms", "number"),
        });
        results.push({ code: "OK", generation: registered.generation });
      } catch (err) {
        results.push({ code: canonical(err) });
      }
    }
    return { report: { results } };
  } finally {
    cluster.close();
  }
}

const STATE_NAMES: Record<number, string> = { [pb.State.ONLINE]: "ONLINE", [pb.State.OFFLINE]: "OFFLINE" };

async function watch(run: RunFile): Promise<Outcome> {
  const c = run.client;
  const tokens = run.tokens;
  let openings = 0;
  // The first token at the first opening, the next at each reopening, the last for ever after.
  const tokenProvider =
    tokens === undefined || tokens.length === 0
      ? undefined
      : async (): Promise<string> => tokens[Math.min(openings++, tokens.length - 1)];
  const watcher = await Watcher.open(nodeTransport(run.target), field<string[]>(c, "user_ids", "object"), {
    ...(tokenProvider === undefined ? {} : { tokenProvider }),
  });
  // Iterating is what applies events to the store and reopens a broken stream.
  const iterating = (async () => {
    while ((await watcher.next()) !== undefined) {
      // The store is the report; the events themselves are not.
    }
  })();
  await sleep(field(c, "run_ms", "number"));
  const endedEarly = watcher.lastError;
  watcher.close();
  await iterating;
  const users: Report = {};
  for (const user of watcher.store.values()) {
    users[user.userId] = { state: STATE_NAMES[user.state] ?? `STATE_${user.state}`, version: user.version };
  }
  // A watch the client gave up on did not stay open for run_ms: a failure, with what it held.
  if (endedEarly !== undefined) return { report: { users, error: `the watch ended: ${describe(endedEarly)}` }, failed: true };
  return { report: { users } };
}

async function feed(run: RunFile): Promise<Outcome> {
  const c = run.client;
  const hex = c.cursor_hex;
  const store = new MemoryCursorStore(typeof hex === "string" && hex !== "" ? cursorFromHex(hex) : undefined);
  const consumer = await ChangesConsumer.open(nodeTransport(run.target), store);
  // Closing the consumer makes a pending nextBatch resolve undefined: that ends the loop.
  const timer = setTimeout(() => consumer.close(), field(c, "run_ms", "number"));
  let events = 0;
  try {
    for (;;) {
      const batch = await consumer.nextBatch();
      if (batch === undefined) return { report: { events } };
      events += batch.events.length;
      await consumer.commit();
    }
  } catch (err) {
    if (err instanceof ChangesOutOfRangeError) {
      // Being told is the required reaction: a report, not a failure.
      return { report: { events, error: { code: "OUT_OF_RANGE", oldest_cursor_hex: cursorToHex(err.oldestCursor) } } };
    }
    return { report: { events, error: describe(err) }, failed: true };
  } finally {
    clearTimeout(timer);
    consumer.close();
  }
}

const KINDS: Record<string, (run: RunFile) => Promise<Outcome>> = {
  session,
  cluster_items: clusterItems,
  watch,
  feed,
};

async function main(): Promise<Outcome> {
  const path = process.argv[2];
  if (path === undefined) throw new Error("usage: driver.js RUN_FILE");
  const run = JSON.parse(readFileSync(path, "utf8")) as RunFile;
  if (typeof run.target !== "string") throw new Error("the run file names no target");
  const kind = KINDS[run.client?.kind];
  if (kind === undefined) throw new Error(`unknown client.kind: ${JSON.stringify(run.client?.kind)}`);
  return kind(run);
}

/** Prints the report as the last line and exits once it is flushed: background timers (a session's heartbeat) would keep the process alive. */
function finish({ report, failed }: Outcome): void {
  process.stdout.write(`${toJson(report)}\n`, () => process.exit(failed ? 1 : 0));
}

main().then(finish, (err: unknown) => finish({ report: { error: describe(err) }, failed: true }));
