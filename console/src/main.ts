/**
 * The web console (O4): served by presenced at `/console/` and calling it over
 * gRPC-Web on the same origin, through the TypeScript client's viewer side.
 *
 * - Users: a `Watcher` over the ids typed in; each row's dot follows the
 *   version-ordered store, so a late or repeated event never shows.
 * - A room: a `RoomWatcher` (member mode), or a `RoomCountWatcher` for a room
 *   past the server's member cap.
 * - Rooms: the counts of up to 10,000 rooms typed or pasted in, through one
 *   `RoomCountsWatcher`; a new list changes the open watch's rooms in place.
 * - The service: `Stats` once a second; rates come from two readings.
 * - The heartbeat calculator: what a heartbeat interval and a TTL tolerate,
 *   beside what the server is configured with.
 *
 * A server with credentials answers `UNAUTHENTICATED` until a token is given;
 * the console then asks for one and keeps it in this tab's session storage.
 */
import { MAX_WATCHED_ROOMS, RoomCountWatcher, RoomCountsWatcher, RoomWatcher, Watcher, pb } from "@presenced/client";
import { Code, ConnectError, createClient, webTransport } from "@presenced/client/web";

import { detectionWindow, type Figures, histogramRows, rates } from "./figures.js";
import { capMessage, parseRoomIds, roomsChange, roomsSummary } from "./rooms.js";

const transport = webTransport(location.origin);
const presence = createClient(pb.Presence, transport);
const TOKEN_KEY = "presenced.token";
/** Where a list of rooms too long for the URL is kept instead (this tab only). */
const ROOMS_KEY = "presenced.rooms";
/** The longest list of rooms the URL keeps. */
const ROOMS_IN_URL_CHARS = 2_000;
const STATS_INTERVAL_MS = 1_000;

const byId = <T extends HTMLElement>(id: string): T => {
  const element = document.getElementById(id);
  if (element === null) throw new Error(`the page has no #${id}`);
  return element as T;
};

function token(): string | undefined {
  return sessionStorage.getItem(TOKEN_KEY) ?? undefined;
}

function headers(): Record<string, string> | undefined {
  const bearer = token();
  return bearer === undefined ? undefined : { authorization: `Bearer ${bearer}` };
}

function stateName(state: pb.State): "ONLINE" | "OFFLINE" {
  return state === pb.State.ONLINE ? "ONLINE" : "OFFLINE";
}

function describe(err: unknown): string {
  const error = ConnectError.from(err);
  return `${Code[error.code] ?? error.code}: ${error.rawMessage}`;
}

/** Asks for a token when the server wants one; resolves once the user answered. */
let askingForToken: Promise<void> | undefined;
function askForToken(reason: string): Promise<void> {
  if (askingForToken !== undefined) return askingForToken;
  const dialog = byId<HTMLDialogElement>("token-dialog");
  byId("token-reason").textContent = reason;
  byId<HTMLInputElement>("token-input").value = token() ?? "";
  askingForToken = new Promise<void>((resolve) => {
    dialog.addEventListener(
      "close",
      () => {
        if (dialog.returnValue === "save") {
          const value = byId<HTMLInputElement>("token-input").value.trim();
          if (value === "") sessionStorage.removeItem(TOKEN_KEY);
          else sessionStorage.setItem(TOKEN_KEY, value);
        }
        askingForToken = undefined;
        resolve();
        restart();
      },
      { once: true },
    );
  });
  dialog.showModal();
  return askingForToken;
}

function needsToken(err: unknown): boolean {
  const code = ConnectError.from(err).code;
  return code === Code.Unauthenticated || code === Code.PermissionDenied;
}

function setConnection(state: "connecting" | "connected" | "failed", text: string): void {
  const badge = byId("connection");
  badge.dataset.state = state;
  badge.textContent = text;
}

function showError(id: string, message: string | undefined): void {
  const element = byId(id);
  element.hidden = message === undefined;
  element.textContent = message ?? "";
}

function ago(ms: bigint | number, nowMs: number): string {
  const at = Number(ms);
  if (at === 0) return "";
  const seconds = Math.max(0, Math.round((nowMs - at) / 1000));
  if (seconds < 90) return `${seconds} s ago`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min ago`;
  return `${Math.round(seconds / 3600)} h ago`;
}

function statusText(status: pb.Status | undefined): string {
  if (status === undefined) return "";
  const availability = pb.Availability[status.availability]?.toLowerCase().replaceAll("_", " ") ?? "";
  return [availability === "unspecified" ? "" : availability, status.text].filter((part) => part !== "").join(": ");
}

function dot(state: "ONLINE" | "OFFLINE"): HTMLSpanElement {
  const span = document.createElement("span");
  span.className = "dot";
  span.dataset.state = state;
  span.title = state;
  return span;
}

// ---- users ----------------------------------------------------------------

let usersWatcher: Watcher | undefined;
let watchedUsers: string[] = [];

function renderUser(user: pb.UserPresence): void {
  const body = byId<HTMLTableElement>("users-table").tBodies[0];
  let row = body.querySelector<HTMLTableRowElement>(`tr[data-user="${CSS.escape(user.userId)}"]`);
  if (row === null) {
    row = document.createElement("tr");
    row.dataset.user = user.userId;
    for (let i = 0; i < 6; i++) row.insertCell();
    body.append(row);
  }
  const state = stateName(user.state);
  row.dataset.state = state;
  row.dataset.version = user.version.toString();
  row.cells[0].replaceChildren(dot(state));
  row.cells[1].textContent = user.userId;
  row.cells[2].textContent = state;
  row.cells[3].textContent = user.version.toString();
  row.cells[4].textContent = statusText(user.status);
  row.cells[5].textContent = state === "OFFLINE" ? ago(user.lastSeenMs, Date.now()) : "";
}

function renderAllUsers(watcher: Watcher): void {
  byId<HTMLTableElement>("users-table").tBodies[0].replaceChildren();
  for (const userId of watchedUsers) {
    const held = watcher.store.get(userId);
    renderUser(held ?? ({ userId, state: pb.State.OFFLINE, version: 0n, lastSeenMs: 0n } as pb.UserPresence));
  }
}

async function watchUsers(userIds: string[]): Promise<void> {
  usersWatcher?.close();
  usersWatcher = undefined;
  watchedUsers = userIds;
  showError("users-error", undefined);
  byId<HTMLTableElement>("users-table").tBodies[0].replaceChildren();
  if (userIds.length === 0) return;
  let watcher: Watcher;
  try {
    watcher = await Watcher.open(transport, userIds, { bearerToken: token() });
  } catch (err) {
    showError("users-error", describe(err));
    if (needsToken(err)) void askForToken("Watching users needs a token: " + describe(err));
    return;
  }
  usersWatcher = watcher;
  setConnection("connected", "connected");
  renderAllUsers(watcher);
  for (;;) {
    const event = await watcher.next();
    if (usersWatcher !== watcher) return; // replaced by another watch
    if (event === undefined) {
      const error = watcher.lastError;
      showError("users-error", error === undefined ? undefined : describe(error));
      if (error !== undefined && needsToken(error)) void askForToken("The watch was refused: " + describe(error));
      return;
    }
    if (event.kind === "update") renderUser(event.user);
    else renderAllUsers(watcher);
  }
}

// ---- a room ---------------------------------------------------------------

let roomWatcher: RoomWatcher | RoomCountWatcher | undefined;

function renderRoom(watcher: RoomWatcher): void {
  const view = watcher.view;
  const members = [...view.members()].sort((a, b) => a.userId.localeCompare(b.userId));
  byId("room-summary").textContent =
    `${view.roomId}: ${members.length} member${members.length === 1 ? "" : "s"}, version ${view.version}`;
  byId("room-members").replaceChildren(
    ...members.map((member) => {
      const item = document.createElement("li");
      item.dataset.user = member.userId;
      const metadata = Object.entries(member.metadata)
        .map(([key, value]) => `${key}=${value}`)
        .join(" ");
      item.append(
        dot("ONLINE"),
        ` ${member.userId}`,
        member.sessions > 1 ? ` (${member.sessions} sessions)` : "",
        metadata === "" ? "" : ` ${metadata}`,
      );
      return item;
    }),
  );
  const signals = [...view.signals()].filter((set) => set.count > 0);
  byId("room-signals").textContent = signals
    .map((set) => `${set.kind}: ${set.userIds.join(", ")}${set.count > set.userIds.length ? ` and ${set.count - set.userIds.length} more` : ""}`)
    .join("; ");
}

function renderCount(roomId: string, count: pb.RoomCount): void {
  byId("room-summary").textContent =
    `${roomId}: ${count.users} users, ${count.sessions} sessions (counts only: past the member cap), version ${count.version}`;
  byId("room-members").replaceChildren();
  byId("room-signals").textContent = "";
}

async function watchRoom(roomId: string): Promise<void> {
  roomWatcher?.close();
  roomWatcher = undefined;
  showError("room-error", undefined);
  byId("room-summary").textContent = "";
  byId("room-members").replaceChildren();
  byId("room-signals").textContent = "";
  if (roomId === "") return;
  const options = { bearerToken: token() };
  try {
    const watcher = await RoomWatcher.open(transport, roomId, options);
    roomWatcher = watcher;
    renderRoom(watcher);
    while ((await watcher.next()) !== undefined) {
      if (roomWatcher !== watcher) return;
      renderRoom(watcher);
    }
    if (roomWatcher === watcher && watcher.lastError !== undefined) throw watcher.lastError;
  } catch (err) {
    if (ConnectError.from(err).code === Code.FailedPrecondition) {
      await watchCount(roomId, options);
      return;
    }
    showError("room-error", describe(err));
    if (needsToken(err)) void askForToken("Watching the room needs a token: " + describe(err));
  }
}

async function watchCount(roomId: string, options: { bearerToken?: string }): Promise<void> {
  const watcher = await RoomCountWatcher.open(transport, roomId, 1_000, options);
  roomWatcher = watcher;
  for (;;) {
    const count = watcher.latest;
    if (count !== undefined) renderCount(roomId, count);
    if ((await watcher.next()) === undefined || roomWatcher !== watcher) break;
  }
  if (roomWatcher === watcher && watcher.lastError !== undefined) showError("room-error", describe(watcher.lastError));
}

// ---- rooms' counts --------------------------------------------------------

let roomsWatcher: RoomCountsWatcher | undefined;
/** The rooms listed, in the order given: what the table shows. */
let listedRooms: string[] = [];

function roomRow(body: ParentNode, roomId: string): HTMLTableRowElement {
  const row = document.createElement("tr");
  row.dataset.room = roomId;
  for (let i = 0; i < 4; i++) row.insertCell();
  row.cells[0].textContent = roomId;
  for (let i = 1; i < 4; i++) row.cells[i].className = "number";
  body.append(row);
  return row;
}

function renderRoomCount(row: HTMLTableRowElement, count: pb.RoomCount | undefined): void {
  if (count === undefined) {
    row.dataset.counted = "false";
    for (let i = 1; i < 4; i++) row.cells[i].textContent = "…";
    return;
  }
  row.dataset.counted = "true";
  row.dataset.users = String(count.users);
  row.dataset.sessions = String(count.sessions);
  row.dataset.version = count.version.toString();
  row.cells[1].textContent = count.users.toLocaleString();
  row.cells[2].textContent = count.sessions.toLocaleString();
  row.cells[3].textContent = count.version.toString();
}

/** The table rows by room id, in the order of `listedRooms`. */
const roomRows = new Map<string, HTMLTableRowElement>();

function renderAllRooms(watcher: RoomCountsWatcher | undefined): void {
  const body = byId<HTMLTableElement>("rooms-table").tBodies[0];
  roomRows.clear();
  const rows = document.createDocumentFragment();
  for (const roomId of listedRooms) {
    const row = roomRow(rows, roomId);
    roomRows.set(roomId, row);
    renderRoomCount(row, watcher?.view.get(roomId));
  }
  body.replaceChildren(rows);
  renderRoomsSummary(watcher);
}

function renderRoomsSummary(watcher: RoomCountsWatcher | undefined): void {
  byId("rooms-summary").textContent =
    watcher === undefined || listedRooms.length === 0 ? "" : roomsSummary(listedRooms.length, watcher.view.values());
}

/** Follows the counts of `roomIds`: in place on the open watch when there is one, else on a new one. */
async function watchRooms(roomIds: string[]): Promise<void> {
  showError("rooms-error", undefined);
  const open = roomsWatcher;
  if (open !== undefined && roomIds.length > 0 && open.lastError === undefined) {
    const change = roomsChange(open.roomIds, roomIds);
    try {
      await open.update(change);
      if (roomsWatcher !== open) return;
      listedRooms = roomIds;
      renderAllRooms(open);
      return;
    } catch (err) {
      if (roomsWatcher !== open) return;
      // Refused as a change (a room id the server will not take): say so, and keep what is shown.
      showError("rooms-error", describe(err));
      if (needsToken(err)) void askForToken("Watching rooms needs a token: " + describe(err));
      return;
    }
  }
  roomsWatcher?.close();
  roomsWatcher = undefined;
  listedRooms = roomIds;
  renderAllRooms(undefined);
  if (roomIds.length === 0) return;
  let watcher: RoomCountsWatcher;
  try {
    watcher = await RoomCountsWatcher.open(transport, roomIds, { bearerToken: token(), countIntervalMs: 1_000 });
  } catch (err) {
    if (listedRooms !== roomIds) return; // another list meanwhile
    showError("rooms-error", describe(err));
    if (needsToken(err)) void askForToken("Watching rooms needs a token: " + describe(err));
    return;
  }
  if (listedRooms !== roomIds) {
    watcher.close();
    return;
  }
  roomsWatcher = watcher;
  renderAllRooms(watcher);
  for (;;) {
    const event = await watcher.next();
    if (roomsWatcher !== watcher) return; // replaced by another watch
    if (event === undefined) {
      const error = watcher.lastError;
      showError("rooms-error", error === undefined ? undefined : describe(error));
      if (error !== undefined && needsToken(error)) void askForToken("The rooms' watch was refused: " + describe(error));
      return;
    }
    if (event.kind === "resynced") renderAllRooms(watcher);
    else {
      for (const count of event.counts) {
        const row = roomRows.get(count.roomId);
        if (row !== undefined) renderRoomCount(row, count);
      }
      renderRoomsSummary(watcher);
    }
  }
}

/** Reads the rooms' input: the ids to watch, with the cap's message shown when some were left out. */
function readRoomsInput(text: string): string[] {
  const parsed = parseRoomIds(text, MAX_WATCHED_ROOMS);
  const message = capMessage(parsed, MAX_WATCHED_ROOMS);
  const note = byId("rooms-cap");
  note.hidden = message === undefined;
  note.textContent = message ?? "";
  return parsed.roomIds;
}

/** Keeps the list for a reload: in the URL when short, else in this tab's session storage. */
function keepRooms(roomIds: string[]): void {
  const joined = roomIds.join(",");
  if (joined.length <= ROOMS_IN_URL_CHARS) {
    sessionStorage.removeItem(ROOMS_KEY);
    keepInUrl("rooms", joined);
  } else {
    sessionStorage.setItem(ROOMS_KEY, roomIds.join("\n"));
    keepInUrl("rooms", "");
  }
}

function keptRooms(): string {
  const params = new URLSearchParams(location.search);
  return params.get("rooms")?.split(",").join("\n") ?? sessionStorage.getItem(ROOMS_KEY) ?? "";
}

// ---- the service's figures ------------------------------------------------

let previous: Figures | undefined;
let configuredTtl: pb.TtlSettings | undefined;
let lagP99Seconds: number | undefined;

function renderStats(stats: pb.StatsResponse): void {
  const figures: Figures = {
    atMs: Number(stats.uptimeMs),
    renewals: Number(stats.renewalsTotal),
    shed: Number(stats.renewalsShedTotal),
  };
  const rate = previous === undefined ? undefined : rates(previous, figures);
  previous = figures;
  const rows: [string, string][] = [
    ["sessions", stats.sessions.toLocaleString()],
    ["online users", stats.onlineUsers.toLocaleString()],
    ["users held", stats.users.toLocaleString()],
    ["renewals/s", rate === undefined ? "…" : Math.round(rate.renewalsPerSecond).toLocaleString()],
    ["shed renewals", `${stats.renewalsShedTotal.toLocaleString()}${rate === undefined ? "" : ` (${Math.round(rate.shedPerSecond).toLocaleString()}/s)`}`],
    ["viewers (Watch)", stats.viewers.toLocaleString()],
    ["room watchers", stats.roomWatchers.toLocaleString()],
    ["room count streams", stats.roomCountStreams.toLocaleString()],
    ["rooms", stats.rooms.toLocaleString()],
    ["version", stats.version],
    ["up", ago(Date.now() - Number(stats.uptimeMs), Date.now()).replace(" ago", "")],
  ];
  byId("stats").replaceChildren(
    ...rows.flatMap(([name, value]) => {
      const term = document.createElement("dt");
      term.textContent = name;
      const definition = document.createElement("dd");
      definition.textContent = value;
      definition.dataset.figure = name;
      return [term, definition];
    }),
  );
  const lag = stats.expiryLag;
  if (lag !== undefined) {
    const histogram = histogramRows(lag.boundsSeconds, lag.counts.map(Number));
    lagP99Seconds = histogram.p99Seconds;
    const widest = Math.max(1, ...histogram.rows.map((row) => row.count));
    byId("expiry-lag").replaceChildren(
      ...histogram.rows.flatMap((row) => {
        const label = document.createElement("span");
        label.textContent = row.label;
        const bar = document.createElement("div");
        bar.className = "bar";
        bar.style.width = `${(100 * row.count) / widest}%`;
        const count = document.createElement("span");
        count.textContent = row.count.toLocaleString();
        return [label, bar, count];
      }),
    );
  }
  if (stats.ttl !== undefined) {
    const first = configuredTtl === undefined;
    configuredTtl = stats.ttl;
    if (first) {
      byId<HTMLInputElement>("calc-ttl").value = String(stats.ttl.defaultTtlMs);
      byId<HTMLInputElement>("calc-heartbeat").value = String(stats.ttl.suggestedHeartbeatMs);
    }
  }
  renderCalculator();
}

async function pollStats(generation: number): Promise<void> {
  while (generation === restarts) {
    try {
      renderStats(await presence.stats({}, { headers: headers() }));
      showError("stats-error", undefined);
      setConnection("connected", "connected");
    } catch (err) {
      const error = ConnectError.from(err);
      if (error.code === Code.PermissionDenied) {
        showError("stats-error", "The service's figures need a service token: " + describe(err));
      } else if (error.code === Code.Unauthenticated) {
        showError("stats-error", describe(err));
        void askForToken("This server needs a token: " + describe(err));
      } else {
        showError("stats-error", describe(err));
        setConnection("failed", "unreachable");
      }
    }
    await new Promise((resolve) => setTimeout(resolve, STATS_INTERVAL_MS));
  }
}

// ---- the heartbeat calculator --------------------------------------------

function renderCalculator(): void {
  const heartbeatMs = Number(byId<HTMLInputElement>("calc-heartbeat").value);
  const ttlMs = Number(byId<HTMLInputElement>("calc-ttl").value);
  const results = detectionWindow(heartbeatMs, ttlMs, lagP99Seconds, Number(configuredTtl?.offlineGraceMs ?? 0n));
  const rows: [string, string][] = results.error !== undefined
    ? [["", results.error]]
    : [
        ["lost beats tolerated", String(results.toleratedLostBeats)],
        ["dead session noticed", `${(results.earliestMs / 1000).toFixed(1)} to ${(results.latestMs / 1000).toFixed(1)} s after its last beat`],
        ["renewals per session", `${(60_000 / heartbeatMs).toFixed(1)} a minute`],
      ];
  if (configuredTtl !== undefined && results.error === undefined) {
    if (ttlMs < configuredTtl.minTtlMs || ttlMs > configuredTtl.maxTtlMs) {
      rows.push(["refused", `this server takes TTLs from ${configuredTtl.minTtlMs} to ${configuredTtl.maxTtlMs} ms`]);
    }
  }
  byId("calc-results").replaceChildren(
    ...rows.flatMap(([name, value]) => {
      const term = document.createElement("dt");
      term.textContent = name;
      const definition = document.createElement("dd");
      definition.textContent = value;
      return [term, definition];
    }),
  );
  const ttl = configuredTtl;
  byId("calc-configured").textContent =
    ttl === undefined
      ? ""
      : `Configured: TTL ${ttl.minTtlMs} to ${ttl.maxTtlMs} ms (default ${ttl.defaultTtlMs}), suggested heartbeat ${ttl.suggestedHeartbeatMs} ms` +
        (ttl.minRenewIntervalMs > 0 ? `, renewals closer than ${ttl.minRenewIntervalMs} ms are not written` : "") +
        (ttl.offlineGraceMs > 0n ? `, offline grace ${ttl.offlineGraceMs} ms (added to the window)` : "") +
        (lagP99Seconds === undefined
          ? "."
          : Number.isFinite(lagP99Seconds)
            ? `; expiry lag p99 so far at most ${(lagP99Seconds * 1000).toFixed(1)} ms (included).`
            : "; expiry lag p99 so far above the largest bucket (not included).");
}

// ---- wiring ---------------------------------------------------------------

let restarts = 0;

function parseUsers(text: string): string[] {
  return [...new Set(text.split(/[\s,]+/).filter((id) => id !== ""))];
}

/** (Re)starts everything with the current token and inputs; the URL keeps the inputs. */
function restart(): void {
  restarts++;
  previous = undefined;
  void pollStats(restarts);
  const params = new URLSearchParams(location.search);
  void watchUsers(parseUsers(params.get("users") ?? ""));
  void watchRoom((params.get("room") ?? "").trim());
  // A new token: the rooms' watch opens again with it.
  roomsWatcher?.close();
  roomsWatcher = undefined;
  void watchRooms(readRoomsInput(keptRooms()));
}

function keepInUrl(name: string, value: string): void {
  const params = new URLSearchParams(location.search);
  if (value === "") params.delete(name);
  else params.set(name, value);
  history.replaceState(null, "", `${location.pathname}${params.size > 0 ? `?${params}` : ""}`);
}

function start(): void {
  const params = new URLSearchParams(location.search);
  byId<HTMLInputElement>("users-input").value = params.get("users") ?? "";
  byId<HTMLInputElement>("room-input").value = params.get("room") ?? "";
  byId<HTMLTextAreaElement>("rooms-input").value = keptRooms();
  byId("users-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const userIds = parseUsers(byId<HTMLInputElement>("users-input").value);
    keepInUrl("users", userIds.join(","));
    void watchUsers(userIds);
  });
  byId("room-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const roomId = byId<HTMLInputElement>("room-input").value.trim();
    keepInUrl("room", roomId);
    void watchRoom(roomId);
  });
  byId("rooms-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const roomIds = readRoomsInput(byId<HTMLTextAreaElement>("rooms-input").value);
    keepRooms(roomIds);
    void watchRooms(roomIds);
  });
  byId("token-button").addEventListener("click", () => void askForToken("A token for this server."));
  byId("token-cancel").addEventListener("click", () => byId<HTMLDialogElement>("token-dialog").close("cancel"));
  byId("calculator").addEventListener("input", renderCalculator);
  restart();
}

start();
