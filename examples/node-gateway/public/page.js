// The browser side of seed 000: one WebSocket to the gateway, an application
// heartbeat with a jittered first beat (the gateway's pings renew the lease
// too, and browsers answer them even in hidden tabs), reconnects with
// exponential backoff and jitter, and the seed's viewer store that drops
// stale events by version.
const params = new URLSearchParams(location.search);
const user = params.get("user") ?? "guest";
const watch = (params.get("watch") ?? "").split(",").filter((id) => id !== "");
const room = params.get("room") ?? "";
// One session per tab, kept across reloads of the tab (a reconnect is a new
// generation of the same session: no OFFLINE/ONLINE pair for the others).
const session = sessionStorage.getItem("session") ?? `tab-${crypto.randomUUID()}`;
sessionStorage.setItem("session", session);

const HEARTBEAT_MS = 15_000;

// ---- the seed's viewer store ----
const known = new Map(); // userId -> { state, ver }

export function applySnapshot(entries) {
  known.clear();
  for (const e of entries) known.set(e.userId, { state: e.state, ver: BigInt(e.ver) });
}

export function applyEvent(ev) {
  const cur = known.get(ev.userId);
  if (cur && BigInt(ev.ver) <= cur.ver) return false; // delayed or duplicate event
  known.set(ev.userId, { state: ev.state, ver: BigInt(ev.ver) });
  return true; // caller re-renders this user's dot
}

// ---- rendering ----
function item(userId, state, ver) {
  const li = document.createElement("li");
  li.dataset.user = userId;
  li.dataset.state = state;
  if (ver !== undefined) li.dataset.version = String(ver);
  const dot = document.createElement("span");
  dot.className = "dot";
  li.append(dot, userId);
  return li;
}

function renderWatched() {
  document.getElementById("watched").replaceChildren(
    ...watch.map((userId) => {
      const held = known.get(userId) ?? { state: "offline", ver: 0n };
      return item(userId, held.state, held.ver);
    }),
  );
}

function renderRoom(members) {
  document.getElementById("room").replaceChildren(...members.map((userId) => item(userId, "online")));
}

// ---- the socket ----
function startHeartbeats(ws) {
  let timer;
  const beat = () => {
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "hb" }));
    timer = setTimeout(beat, HEARTBEAT_MS);
  };
  timer = setTimeout(beat, Math.random() * HEARTBEAT_MS);
  ws.addEventListener("close", () => clearTimeout(timer));
}

let attempt = 0;
function connect() {
  const url = new URL("/ws", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  url.search = new URLSearchParams({ user, session, room }).toString();
  const ws = new WebSocket(url);
  const status = document.getElementById("socket");
  ws.addEventListener("open", () => {
    attempt = 0;
    status.dataset.state = "open";
    status.textContent = "open";
    startHeartbeats(ws);
    if (watch.length > 0) ws.send(JSON.stringify({ type: "watch", userIds: watch }));
  });
  ws.addEventListener("message", (message) => {
    const data = JSON.parse(message.data);
    if (data.type === "snapshot") {
      applySnapshot(data.entries);
      renderWatched();
    } else if (data.type === "event") {
      if (applyEvent(data)) renderWatched();
    } else if (data.type === "room") {
      renderRoom(data.members);
    }
  });
  ws.addEventListener("close", (event) => {
    status.dataset.state = "closed";
    status.textContent = `closed (${event.code})`;
    // 4401: a newer connection of this session took over; do not fight it.
    if (event.code === 4401) return;
    const delay = Math.min(30_000, 500 * 2 ** attempt++);
    setTimeout(connect, delay / 2 + Math.random() * (delay / 2));
  });
}

document.getElementById("me").textContent = user;
document.getElementById("room-id").textContent = room;
renderWatched();
connect();
