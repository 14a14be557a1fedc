// The push worker end to end: a real presenced with a data directory, the
// worker as its own process, users going ONLINE and OFFLINE through the
// TypeScript client's lease channel. The worker is killed (SIGKILL) while
// it pushes and started again: every OFFLINE is pushed, none twice except
// those of the batch whose cursor was not saved when it died (at least
// once, identified by cursor), no ONLINE is pushed; then presenced is
// killed (SIGKILL) and restarted, and the worker logs the gap as a resync
// warning.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { createInterface } from "node:readline";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { connectLeaseChannel } from "@presenced/client/node";

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.join(here, "..", "..", "..");
const BINARY = process.env.PRESENCED_BIN ?? path.join(repo, "target", "debug", "presenced");
const PATIENCE_MS = 15_000;
const USERS = 100;

/** A child process whose stdout and stderr lines are kept, with a way to wait for one. */
function run(command, args, env) {
  const child = spawn(command, args, { stdio: ["ignore", "pipe", "pipe"], env: { ...process.env, ...env } });
  const lines = [];
  const waiters = new Set();
  for (const stream of [child.stdout, child.stderr]) {
    createInterface({ input: stream }).on("line", (line) => {
      lines.push(line);
      for (const waiter of waiters) waiter();
    });
  }
  const exited = new Promise((resolve) => child.once("exit", (code, signal) => resolve(code ?? signal)));
  /** Resolves once `condition(lines)` holds, or rejects naming `what` at the deadline. */
  const until = (what, condition) =>
    new Promise((resolve, reject) => {
      const check = () => {
        if (!condition(lines)) return;
        clearTimeout(timer);
        waiters.delete(check);
        resolve(lines);
      };
      const timer = setTimeout(() => {
        waiters.delete(check);
        reject(new Error(`${what}: not within ${PATIENCE_MS} ms; output:\n${lines.join("\n")}`));
      }, PATIENCE_MS);
      waiters.add(check);
      void exited.then((status) => {
        if (!waiters.has(check)) return;
        waiters.delete(check);
        clearTimeout(timer);
        reject(new Error(`${what}: ${command} exited (${status}) first; output:\n${lines.join("\n")}`));
      });
      check();
    });
  const kill = async () => {
    if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
    await exited;
  };
  return { child, lines, until, kill };
}

function freePort() {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** presenced on `listen` with its data in `dataDir`, once it listens. */
async function presenced(listen, dataDir) {
  const server = run(BINARY, ["serve", "--listen", listen, "--data-dir", dataDir], { RUST_LOG: "warn" });
  await server.until("presenced listening", (lines) => lines.some((line) => line.startsWith("listening on ")));
  return server;
}

/** The worker, following `url` from the oldest change on a first run, with its cursor in `cursorFile`. */
function worker(url, cursorFile) {
  return run(process.execPath, [path.join(here, "..", "worker.mjs")], { PRESENCED_URL: url, CURSOR_FILE: cursorFile, FROM: "oldest" });
}

const PUSH = /^push: (\S+) went OFFLINE at (\S+) \(cursor ([0-9a-f]+)\)$/;

/** The pushes among `lines`: user, time and cursor. */
function pushes(lines) {
  return lines.flatMap((line) => {
    const match = PUSH.exec(line);
    return match ? [{ user: match[1], at: match[2], cursor: match[3] }] : [];
  });
}

test("every OFFLINE is pushed across a kill -9 of the worker, none twice but the unsaved batch's, and a gap is a resync warning", async (t) => {
  assert.ok(existsSync(BINARY), `${BINARY} is missing: build it with \`cargo build -p presenced\` (or set PRESENCED_BIN)`);
  const dir = mkdtempSync(path.join(tmpdir(), "presenced-push-worker-"));
  // Undone last first: the processes stop before their directory goes.
  const cleanups = [() => rmSync(dir, { recursive: true, force: true })];
  t.after(async () => {
    for (const cleanup of cleanups.reverse()) await cleanup();
  });
  const listen = `127.0.0.1:${await freePort()}`;
  const url = `http://${listen}`;
  const dataDir = path.join(dir, "data");
  const cursorFile = path.join(dir, "push-worker.cursor");
  let server = await presenced(listen, dataDir);
  cleanups.push(() => server.kill());
  const channel = connectLeaseChannel(url);
  cleanups.push(() => channel.close());

  // 100 users go ONLINE and OFFLINE one after another, while the worker pushes.
  const users = Array.from({ length: USERS }, (_, i) => `user-${String(i).padStart(3, "0")}`);
  const first = worker(url, cursorFile);
  cleanups.push(() => first.kill());
  await first.until("the worker started", (lines) => lines.some((line) => line.startsWith("push-worker: following")));
  const flipping = (async () => {
    for (const userId of users) {
      const registered = await channel.register({ userId, sessionId: "phone", gatewayId: "gw", ttlMs: 60_000 });
      await channel.unregister({ userId, sessionId: "phone", generation: registered.generation });
    }
  })();

  // Killed mid-way: once it pushed a third of them and saved a cursor.
  await first.until("a third of the pushes, and a cursor saved", (lines) => pushes(lines).length >= USERS / 3 && existsSync(cursorFile));
  await first.kill();
  const beforeKill = pushes(first.lines);
  assert.ok(beforeKill.length < USERS, `killed mid-way, not after all ${beforeKill.length} pushes`);
  // The cursor file is replaced atomically: it holds the cursor of the last batch the worker finished.
  const saved = readFileSync(cursorFile, "utf8").trim();
  assert.match(saved, /^([0-9a-f]{2})+$/, "the cursor file is whole");
  await flipping;

  const second = worker(url, cursorFile);
  cleanups.push(() => second.kill());
  await second.until("the last user's push", (lines) => pushes(lines).some((push) => push.user === users.at(-1)));
  const afterRestart = pushes(second.lines);

  // Every OFFLINE pushed, in order, each user once per run, and no ONLINE.
  const pushed = new Set([...beforeKill, ...afterRestart].map((push) => push.user));
  assert.deepEqual([...pushed].sort(), users, "every user's OFFLINE was pushed");
  for (const run of [beforeKill, afterRestart]) {
    assert.equal(new Set(run.map((push) => push.user)).size, run.length, "each user once per run: it went OFFLINE once");
    for (let i = 1; i < run.length; i++) assert.ok(run[i - 1].cursor < run[i].cursor, "in feed order");
  }
  // At least once, identified by cursor: what the restarted worker pushed
  // again is exactly what the first one pushed after its saved cursor.
  const again = afterRestart.filter((push) => beforeKill.some((before) => before.cursor === push.cursor));
  const unsaved = beforeKill.filter((push) => push.cursor > saved);
  assert.deepEqual(again, unsaved, `pushed twice: only the batch after the saved cursor ${saved}`);
  assert.ok(afterRestart.every((push) => push.cursor > saved), "nothing the first run saved is pushed again");
  assert.match(second.lines[0], new RegExp(`after ${saved} `), "the restart says where it resumed");

  // presenced dies without closing its feed: the worker reconnects by itself and warns of the gap.
  await server.kill();
  server = await presenced(listen, dataDir);
  await second.until("the resync warning", (lines) => lines.some((line) => line.startsWith("push-worker: resync: presenced lost")));
  const gap = second.lines.find((line) => line.startsWith("push-worker: resync: presenced lost"));
  assert.match(gap, /\(restart\); users who went OFFLINE then were not notified$/);
});
