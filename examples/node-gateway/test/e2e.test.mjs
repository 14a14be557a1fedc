// The example gateway end to end: a real presenced, the gateway as its own
// process, users' sockets as processes of their own, and a viewer watching
// through the TypeScript client; in plaintext, and over mutual TLS with
// certificates made by openssl (the repository's tests/certs.mjs).
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import path from "node:path";
import { createInterface } from "node:readline";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { Watcher } from "@presenced/client";
import { nodeTransport } from "@presenced/client/node";

import { Pki, tlsFlags } from "../../../tests/certs.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.join(here, "..", "..", "..");
const BINARY = process.env.PRESENCED_BIN ?? path.join(repo, "target", "debug", "presenced");
const PATIENCE_MS = 15_000;
const TTL_MS = 2_000;
const HEARTBEAT_MS = 500;

/** Spawns `command`; resolves with the child and the first stdout match of `pattern`. */
async function spawnUntil(command, args, env, pattern, what) {
  const child = spawn(command, args, { stdio: ["ignore", "pipe", "inherit"], env: { ...process.env, ...env } });
  const lines = createInterface({ input: child.stdout });
  const match = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no ${what} within ${PATIENCE_MS} ms`)), PATIENCE_MS);
    lines.on("line", (line) => {
      const found = pattern.exec(line);
      if (found) {
        clearTimeout(timer);
        resolve(found);
      }
    });
    child.once("exit", () => reject(new Error(`${what}: the process ended first`)));
  });
  return { child, match };
}

function stop(child) {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve();
  child.kill("SIGKILL");
  return new Promise((resolve) => child.once("exit", resolve));
}

/** Resolves with the watcher's first update satisfying `predicate`, or rejects at the deadline. */
async function until(watcher, predicate, what) {
  const deadline = Date.now() + PATIENCE_MS;
  for (const user of watcher.store.values()) if (predicate(user)) return user;
  while (Date.now() < deadline) {
    const event = await Promise.race([watcher.next(), new Promise((resolve) => setTimeout(() => resolve("wait"), deadline - Date.now()))]);
    if (event === "wait" || event === undefined) break;
    if (event.kind === "update" && predicate(event.user)) return event.user;
    if (event.kind === "resynced") for (const user of watcher.store.values()) if (predicate(user)) return user;
  }
  throw new Error(`not seen within ${PATIENCE_MS} ms: ${what}`);
}

/**
 * presenced (`serve` with `presencedArgs`, over https when `tls`) and the
 * gateway (with `gatewayEnv` beside its URL and timings), both stopped after `t`.
 */
async function start(t, { presencedArgs = [], tls = false, gatewayEnv = {} } = {}) {
  assert.ok(existsSync(BINARY), `${BINARY} is missing: build it with \`cargo build -p presenced\` (or set PRESENCED_BIN)`);
  const args = ["serve", "--listen", "127.0.0.1:0", ...presencedArgs];
  const server = await spawnUntil(BINARY, args, { RUST_LOG: "warn" }, /listening on (\S+)/, "presenced");
  t.after(() => stop(server.child));
  const presencedUrl = `${tls ? "https" : "http"}://${server.match[1]}`;
  const gateway = await spawnUntil(
    process.execPath,
    [path.join(here, "..", "gateway.mjs")],
    { PRESENCED_URL: presencedUrl, PORT: "0", TTL_MS: String(TTL_MS), HEARTBEAT_MS: String(HEARTBEAT_MS), ...gatewayEnv },
    /listening on (\S+)/,
    "the gateway",
  );
  t.after(() => stop(gateway.child));
  return { presencedUrl, gatewayUrl: gateway.match[1] };
}

/** A user's socket (client.mjs), ready once it prints a line matching `ready`. */
async function connectUser(t, gatewayUrl, userId, sessionId, roomId = "", ready = /^registered/) {
  const client = await spawnUntil(
    process.execPath,
    [path.join(here, "client.mjs")],
    { GATEWAY_URL: gatewayUrl, USER_ID: userId, SESSION_ID: sessionId, ROOM_ID: roomId },
    ready,
    `${userId}'s socket`,
  );
  t.after(() => stop(client.child));
  return client.child;
}

test("a socket that connects is ONLINE to a watcher, and one that vanishes without a close frame goes OFFLINE within the TTL plus the expiry lag", async (t) => {
  const { presencedUrl, gatewayUrl } = await start(t);
  const watcher = await Watcher.open(nodeTransport(presencedUrl), ["alice"]);
  t.after(() => watcher.close());
  assert.equal(watcher.store.get("alice")?.version ?? 0n, 0n);

  const socket = await connectUser(t, gatewayUrl, "alice", "laptop");
  const online = await until(watcher, (user) => user.userId === "alice" && user.state === 2, "alice ONLINE");

  // The laptop sleeps: its process stops, the TCP connection stays open, no
  // close frame, no pong, no message. Renewals stop with the evidence of life.
  const vanishedAt = Date.now();
  socket.kill("SIGSTOP");
  const offline = await until(watcher, (user) => user.userId === "alice" && user.state === 1, "alice OFFLINE");
  const after = Date.now() - vanishedAt;
  assert.ok(after <= TTL_MS + 1_000, `OFFLINE ${after} ms after the socket went silent (TTL ${TTL_MS} ms)`);
  assert.ok(offline.version > online.version);
});

test("a user stays ONLINE while its socket answers pings, and a second tab closing leaves it ONLINE", async (t) => {
  const { presencedUrl, gatewayUrl } = await start(t);
  const watcher = await Watcher.open(nodeTransport(presencedUrl), ["bob"]);
  t.after(() => watcher.close());
  const first = await connectUser(t, gatewayUrl, "bob", "tab-1", "lobby");
  const online = await until(watcher, (user) => user.userId === "bob" && user.state === 2, "bob ONLINE");
  const second = await connectUser(t, gatewayUrl, "bob", "tab-2", "lobby");
  // Longer than two TTLs on pongs alone: no flip.
  await new Promise((resolve) => setTimeout(resolve, 2 * TTL_MS + 500));
  second.kill("SIGTERM"); // closes its socket (a close frame): tab-2 unregisters
  await new Promise((resolve) => setTimeout(resolve, TTL_MS));
  assert.equal(watcher.store.get("bob")?.state, 2, "bob is still ONLINE through tab-1");
  assert.equal(watcher.store.get("bob")?.version, online.version, "and no flip happened");
  first.kill("SIGTERM");
  await until(watcher, (user) => user.userId === "bob" && user.state === 1, "bob OFFLINE once his last tab closed");
});

test("over mutual TLS: the gateway reaches presenced with its CA and a client certificate, and registers, joins and relays rooms without a token", async (t) => {
  const pki = new Pki("server");
  const server = pki.issue("server", ["localhost", "127.0.0.1"]);
  const clients = new Pki("clients");
  const gateway = clients.issue("gateway", ["gateway.internal", "spiffe://example.org/node-gateway"]);
  const viewer = clients.issue("viewer", ["viewer.internal"]);
  const token = "e2e-service-token";
  const { presencedUrl, gatewayUrl } = await start(t, {
    tls: true,
    // Credentials are required: the gateway, which has no token, is a service caller by its certificate alone.
    presencedArgs: [
      ...tlsFlags(server),
      "--tls-client-ca", clients.caPath,
      "--tls-service-identity", "spiffe://example.org/node-gateway",
      "--service-token", token,
    ],
    gatewayEnv: { PRESENCED_CA: pki.caPath, PRESENCED_CERT: gateway.cert, PRESENCED_KEY: gateway.key },
  });
  assert.match(presencedUrl, /^https:\/\//);
  // The test's viewer: a certificate of the clients' CA (the handshake needs one), and the service token.
  const tls = { ca: pki.ca, cert: viewer.certPem, key: viewer.keyPem };
  const watcher = await Watcher.open(nodeTransport(presencedUrl, { tls }), ["carol"], { bearerToken: token });
  t.after(() => watcher.close());

  // Ready once the gateway relayed carol's room, with her in it: its Watch of the room runs over TLS too.
  const socket = await connectUser(t, gatewayUrl, "carol", "laptop", "lobby", /^room lobby: carol$/);
  const online = await until(watcher, (user) => user.userId === "carol" && user.state === 2, "carol ONLINE");
  socket.kill("SIGTERM"); // a close frame: the gateway unregisters her over TLS
  const offline = await until(watcher, (user) => user.userId === "carol" && user.state === 1, "carol OFFLINE once her socket closed");
  assert.ok(offline.version > online.version);
});
