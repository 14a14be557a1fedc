// A WebSocket gateway on presenced: seed 000's Node gateway (ioredis + ws),
// with every Redis call replaced by the TypeScript client and the sweeper
// gone (presenced expires leases itself). Its three handlers keep the seed's
// names and shape:
//
// - onConnected: register the session (a new generation every time: a
//   reconnect of the same session id is no OFFLINE/ONLINE pair), join its room;
// - onLivenessSignal: a pong to the gateway's ping, or any message, renews the
//   lease, at most once per half heartbeat, so a chatty client cannot turn
//   traffic into writes; NOT_FOUND (the lease ran out, or the server lost it)
//   registers again, FAILED_PRECONDITION (a newer connection owns the session)
//   closes the socket with 4401, as the seed does;
// - onClosed: unregister with linger; a late close of an older generation
//   changes nothing.
//
// Renewals happen only on evidence that the socket is alive: a socket that
// goes silent without a close frame (a sleeping laptop) stops renewing, and
// its lease runs out by itself.
//
// Every call of every socket goes over one `Leases` stream (the LeaseChannel),
// in batches. The page's dots come back over the same socket: per socket, a
// Watch of the users it asks for and a member watch of its room, both acting
// for the socket's user (so privacy applies), relayed as JSON with versions.
//
// presenced may be reached over TLS: an https:// PRESENCED_URL, with the
// server's CA (PRESENCED_CA) and, under mutual TLS, the gateway's certificate
// and key (PRESENCED_CERT, PRESENCED_KEY), files read at start. A certificate
// whose identity presenced lists with --tls-service-identity makes the
// gateway a service caller without PRESENCED_TOKEN.
//
// Authentication is out of scope here: the user comes from the URL
// (`/ws?user=alice&session=tab-1&room=lobby`). A real gateway takes the user
// from its authenticated handshake and the session id from the auth session
// (stable per device login), never from the client.
import { readFileSync } from "node:fs";
import { readFile } from "node:fs/promises";
import http from "node:http";
import path from "node:path";
import { fileURLToPath } from "node:url";

import { Code, ConnectError, Presence, RoomWatcher, Watcher, createClient } from "@presenced/client";
import { connectLeaseChannel, nodeTransport } from "@presenced/client/node";
import { WebSocketServer } from "ws";

const PRESENCED_URL = process.env.PRESENCED_URL ?? "http://127.0.0.1:50051";
const PRESENCED_TOKEN = process.env.PRESENCED_TOKEN; // a service token, if the server has credentials
const GATEWAY_ID = process.env.GATEWAY_ID ?? `node-gateway-${process.pid}`;
const TTL_MS = Number(process.env.TTL_MS ?? 45_000);
const HEARTBEAT_MS = Number(process.env.HEARTBEAT_MS ?? 15_000);
const LINGER_MS = Number(process.env.LINGER_MS ?? 0);
const LISTEN_PORT = Number(process.env.PORT ?? 8080);
const MAX_WATCHED = 1_000; // users one page may watch
const TLS = presencedTls(); // for an https:// PRESENCED_URL

const channel = connectLeaseChannel(PRESENCED_URL, { bearerToken: PRESENCED_TOKEN, tls: TLS });
const transport = nodeTransport(PRESENCED_URL, { tls: TLS });
const presence = createClient(Presence, transport);
const serviceHeaders = PRESENCED_TOKEN === undefined ? undefined : { authorization: `Bearer ${PRESENCED_TOKEN}` };

/**
 * The client's TLS settings from the environment: PRESENCED_CA (the CA that
 * issued presenced's certificate; without it, Node's own roots),
 * PRESENCED_CERT and PRESENCED_KEY (a client certificate, for mutual TLS),
 * PRESENCED_SERVER_NAME (the name presenced's certificate carries, when it
 * is not PRESENCED_URL's host). None set: no settings (an https:// URL then
 * trusts Node's roots).
 */
function presencedTls() {
  const { PRESENCED_CA: ca, PRESENCED_CERT: cert, PRESENCED_KEY: key, PRESENCED_SERVER_NAME: servername } = process.env;
  if (!ca && !cert && !key && !servername) return undefined;
  const file = (variable, path) => {
    if (!path) return undefined;
    try {
      return readFileSync(path);
    } catch (err) {
      throw new Error(`${variable}=${path}: ${err.message}`);
    }
  };
  return {
    ca: file("PRESENCED_CA", ca),
    cert: file("PRESENCED_CERT", cert),
    key: file("PRESENCED_KEY", key),
    servername: servername || undefined,
  };
}

const send = (ws, message) => {
  if (ws.readyState === ws.OPEN) ws.send(JSON.stringify(message, (_, value) => (typeof value === "bigint" ? value.toString() : value)));
};
const stateName = (state) => (state === 2 ? "online" : "offline");
const entry = (user) => ({ userId: user.userId, state: stateName(user.state), ver: user.version });

export async function onConnected(ws, userId, sessionId, roomId) {
  const { generation } = await channel.register({ userId, sessionId, gatewayId: GATEWAY_ID, ttlMs: TTL_MS });
  ws.presence = { userId, sessionId, roomId, generation, lastRenew: Date.now() };
  if (roomId) await channel.join({ userId, sessionId, generation, roomId });
}

// Who may see whom is presenced's to enforce (P2): by default a user is seen
// only by its audience. Here the people of one room are one team, as seed
// 003's `team:T:subscribers` sets were: a group, whose members see each other.
// A real application writes its contacts and teams when they change, not on
// every connect.
async function joinTeam(userId, roomId) {
  if (roomId) await presence.joinGroup({ groupId: `room:${roomId}`, userIds: [userId] }, { headers: serviceHeaders });
}

export async function onLivenessSignal(ws) {
  const p = ws.presence;
  if (!p || Date.now() - p.lastRenew < HEARTBEAT_MS / 2) return;
  p.lastRenew = Date.now();
  try {
    await channel.renew({ userId: p.userId, sessionId: p.sessionId, generation: p.generation, ttlMs: TTL_MS });
  } catch (err) {
    const code = ConnectError.from(err).code;
    if (code === Code.NotFound) {
      // The lease ran out (the socket was silent for a TTL) or the server lost
      // it: the socket is alive now, so the session is registered again.
      await onConnected(ws, p.userId, p.sessionId, p.roomId);
    } else if (code === Code.FailedPrecondition) {
      ws.close(4401, "a newer connection owns this session");
    }
  }
}

export async function onClosed(ws) {
  const p = ws.presence;
  if (!p) return;
  ws.presence = undefined;
  ws.watcher?.close();
  ws.roomWatcher?.close();
  // An older generation (a reconnect registered meanwhile) answers
  // STALE_GENERATION and changes nothing.
  await channel.unregister({ userId: p.userId, sessionId: p.sessionId, generation: p.generation, lingerMs: LINGER_MS });
}

/** Relays a Watch of `userIds`, acting for the socket's user, as the seed's snapshot and events. */
async function relayWatch(ws, userIds) {
  ws.watcher?.close();
  const watcher = await Watcher.open(transport, userIds, { bearerToken: PRESENCED_TOKEN, viewerId: ws.presence.userId });
  ws.watcher = watcher;
  send(ws, { type: "snapshot", entries: [...watcher.store.values()].map(entry) });
  for (;;) {
    const event = await watcher.next();
    if (event === undefined || ws.watcher !== watcher) return;
    if (event.kind === "update") send(ws, { type: "event", ...entry(event.user) });
    else send(ws, { type: "snapshot", entries: [...watcher.store.values()].map(entry) });
  }
}

/** Relays the members of the socket's room, as whole lists. */
async function relayRoom(ws, roomId) {
  const watcher = await RoomWatcher.open(transport, roomId, { bearerToken: PRESENCED_TOKEN, viewerId: ws.presence.userId });
  ws.roomWatcher = watcher;
  const members = () => [...watcher.view.members()].map((member) => member.userId).sort();
  send(ws, { type: "room", roomId, members: members() });
  while ((await watcher.next()) !== undefined) send(ws, { type: "room", roomId, members: members() });
}

const here = path.dirname(fileURLToPath(import.meta.url));
const pages = { "/": ["index.html", "text/html; charset=utf-8"], "/page.js": ["page.js", "text/javascript; charset=utf-8"] };
const server = http.createServer(async (request, response) => {
  const page = pages[new URL(request.url, "http://gateway").pathname];
  if (page === undefined) return response.writeHead(404).end("not found\n");
  response.writeHead(200, { "content-type": page[1], "cache-control": "no-cache" });
  response.end(await readFile(path.join(here, "public", page[0])));
});

const wss = new WebSocketServer({ server, path: "/ws", maxPayload: 64 * 1024 });
wss.on("connection", (ws, request) => {
  const params = new URL(request.url, "http://gateway").searchParams;
  const userId = params.get("user") ?? "";
  const sessionId = params.get("session") ?? "";
  const roomId = params.get("room") ?? "";
  ws.isAlive = true;
  // Messages before the register finished renew nothing and are not lost: the
  // register itself is the first renewal.
  const ready = joinTeam(userId, roomId).then(() => onConnected(ws, userId, sessionId, roomId)).then(
    () => {
      send(ws, { type: "registered", userId, sessionId });
      if (roomId) relayRoom(ws, roomId).catch((err) => send(ws, { type: "error", message: ConnectError.from(err).message }));
      return true;
    },
    (err) => {
      // Bad ids come back as INVALID_ARGUMENT naming the field.
      ws.close(4400, ConnectError.from(err).rawMessage.slice(0, 120));
      return false;
    },
  );
  ws.on("pong", () => {
    ws.isAlive = true;
    void onLivenessSignal(ws);
  });
  ws.on("message", async (data) => {
    ws.isAlive = true;
    if (!(await ready)) return;
    void onLivenessSignal(ws);
    let message;
    try {
      message = JSON.parse(data.toString());
    } catch {
      return;
    }
    if (message.type === "watch" && Array.isArray(message.userIds)) {
      const userIds = message.userIds.filter((id) => typeof id === "string").slice(0, MAX_WATCHED);
      relayWatch(ws, userIds).catch((err) => send(ws, { type: "error", message: ConnectError.from(err).message }));
    }
  });
  ws.on("close", async () => {
    if (await ready) await onClosed(ws).catch((err) => console.error("unregister failed:", err));
  });
});

// The gateway's own liveness probe: a ping every heartbeat, answered by every
// browser even in a hidden tab. A socket that answered nothing since the last
// one is dead (no close frame came): it is terminated, and its close unregisters.
const probe = setInterval(() => {
  for (const ws of wss.clients) {
    if (!ws.isAlive) {
      ws.terminate();
      continue;
    }
    ws.isAlive = false;
    ws.ping();
  }
}, HEARTBEAT_MS);
probe.unref();

server.listen(LISTEN_PORT, "127.0.0.1", () => {
  console.log(`listening on http://127.0.0.1:${server.address().port} (presenced at ${PRESENCED_URL})`);
});

const shutdown = () => {
  wss.close();
  server.close();
  for (const ws of wss.clients) ws.close(1001, "gateway shutting down");
  setTimeout(() => {
    channel.close();
    process.exit(0);
  }, 200).unref();
};
process.on("SIGTERM", shutdown);
process.on("SIGINT", shutdown);
