/**
 * The room side of a viewer: what it holds of a room, and `WatchRoom` streams
 * that survive disconnects (Node and browsers: server streaming only).
 *
 * {@link RoomView} holds one room as its member-mode watcher sees it (R2, R3,
 * S3): the members by user id, the set of signalling users per kind, and the
 * room version. A change of one member (or one signal kind) is applied only if
 * its version is greater than that of the last change applied for that member
 * (or kind) and than the snapshot's: the check keeps a delayed or repeated one
 * from undoing a newer one. A snapshot is a resync that replaces everything.
 *
 * {@link RoomWatcher} feeds a view from a member-mode `WatchRoom`, and
 * {@link RoomCountWatcher} follows a count-mode one (R3, for rooms too big to
 * list). Both reopen a broken stream with backoff and jitter and start again
 * from what the new stream opens with. A refusal a retry cannot fix ends them:
 * `NOT_FOUND` (the room is not readable by this caller), `FAILED_PRECONDITION`
 * (past the server's member cap: watch the counts instead), bad input or credentials.
 */
import { createClient, type ConnectError } from "@connectrpc/connect";
import type { Client, Transport } from "@connectrpc/connect";

import { Backoff } from "./backoff.js";
import { authorization, iterate } from "./call.js";
import { Feed } from "./feed.js";
import {
  Presence,
  RoomChangeKind,
  RoomWatchMode,
  type RoomCount,
  type RoomEvent,
  type RoomMember,
  type RoomMemberChange,
  type RoomSnapshot,
  type SignalSet,
} from "./gen/presence/v1/presence_pb.js";

/** One room as a member-mode watcher holds it. */
export class RoomView {
  private currentRoomId: string;
  /** The highest room version applied: the snapshot's, or a later change's. */
  private currentVersion = 0n;
  /** The version of the snapshot held: a change not newer than it is in it. */
  private floor = 0n;
  private readonly memberMap = new Map<string, RoomMember>();
  /**
   * The version of the last change applied per user, members and users who
   * left since the snapshot alike, so that a delayed join cannot bring back a
   * user whose leave was applied. Cleared by every snapshot.
   */
  private readonly memberVersions = new Map<string, bigint>();
  /** The last set applied per signal kind, empty ones included (for their version). */
  private readonly signalSets = new Map<string, SignalSet>();

  constructor(roomId: string) {
    this.currentRoomId = roomId;
  }

  /** Replaces everything held with `snapshot`: a resync, authoritative even at a lower version. */
  applySnapshot(snapshot: RoomSnapshot): void {
    this.currentRoomId = snapshot.roomId;
    this.currentVersion = snapshot.version;
    this.floor = snapshot.version;
    this.memberMap.clear();
    for (const member of snapshot.members) this.memberMap.set(member.userId, member);
    this.memberVersions.clear();
    this.signalSets.clear();
    for (const set of snapshot.signals) this.signalSets.set(set.kind, set);
  }

  /**
   * Applies a member's join, leave or update. True if newer than what is held
   * of that member; false for a stale or repeated change, or one without a
   * member or a known kind, which changes nothing.
   */
  applyChange(change: RoomMemberChange): boolean {
    const member = change.member;
    if (member === undefined) return false;
    const known =
      change.kind === RoomChangeKind.ROOM_CHANGE_JOINED ||
      change.kind === RoomChangeKind.ROOM_CHANGE_LEFT ||
      change.kind === RoomChangeKind.ROOM_CHANGE_UPDATED;
    if (!known || change.version <= this.floor || change.version <= (this.memberVersions.get(member.userId) ?? 0n)) {
      return false;
    }
    this.memberVersions.set(member.userId, change.version);
    if (change.kind === RoomChangeKind.ROOM_CHANGE_LEFT) this.memberMap.delete(member.userId);
    else this.memberMap.set(member.userId, member);
    if (change.version > this.currentVersion) this.currentVersion = change.version;
    return true;
  }

  /** Applies a kind's new set of signalling users. True if newer than the set held of that kind. */
  applySignals(set: SignalSet): boolean {
    const held = this.signalSets.get(set.kind)?.version ?? 0n;
    if (set.version <= this.floor || set.version <= held) return false;
    this.signalSets.set(set.kind, set);
    if (set.version > this.currentVersion) this.currentVersion = set.version;
    return true;
  }

  /** The room watched. */
  get roomId(): string {
    return this.currentRoomId;
  }

  /** The newest room version held. */
  get version(): bigint {
    return this.currentVersion;
  }

  /** A member with its shown metadata; undefined if not in the room (or not listed to this watcher). */
  member(userId: string): RoomMember | undefined {
    return this.memberMap.get(userId);
  }

  /** Every member held, in no particular order. */
  members(): IterableIterator<RoomMember> {
    return this.memberMap.values();
  }

  /** Members held. */
  get size(): number {
    return this.memberMap.size;
  }

  /** The users signalling `kind` now (at most the server's cap of them; see {@link signalCount}). */
  signalling(kind: string): readonly string[] {
    return this.signalSets.get(kind)?.userIds ?? [];
  }

  /** How many users signal `kind` now. */
  signalCount(kind: string): number {
    return this.signalSets.get(kind)?.count ?? 0;
  }

  /** The sets of every kind someone signals now. */
  signals(): SignalSet[] {
    return [...this.signalSets.values()].filter((set) => set.count > 0);
  }
}

/** What {@link RoomWatcher.next} reports. */
export type RoomWatcherEvent =
  /** A member joined, left or changed its metadata; already applied to the view. */
  | { kind: "change"; change: RoomMemberChange }
  /** A kind's set of signalling users changed; already applied to the view. */
  | { kind: "signals"; signals: SignalSet }
  /** The view was replaced by a fresh snapshot: re-render it whole. */
  | { kind: "resynced" };

/** How a room watcher (re)opens its stream. */
export interface RoomWatchOptions {
  reconnect?: Backoff;
  /** Sent as `authorization: Bearer <token>` on every (re)open. */
  bearerToken?: string;
  /**
   * Where fresh tokens come from, for short-lived viewer tokens: asked when the
   * watch opens and whenever the server ends it for its credentials; the watch
   * then reopens at once. Takes the place of `bearerToken`.
   */
  tokenProvider?: () => Promise<string>;
  /** A service watching for a viewer names it here. */
  viewerId?: string;
}

/** A `WatchRoom` feed: the request, sent again on every reopen, and its reconnecting stream. */
async function roomFeed(
  transport: Transport,
  roomId: string,
  mode: RoomWatchMode,
  countIntervalMs: number,
  options: RoomWatchOptions,
): Promise<Feed<RoomEvent>> {
  const client: Client<typeof Presence> = createClient(Presence, transport);
  const provider = options.tokenProvider;
  let headers = authorization(provider === undefined ? options.bearerToken : await provider());
  const renew = provider === undefined ? undefined : async (): Promise<void> => {
    headers = authorization(await provider());
  };
  const request = { roomId, viewerId: options.viewerId ?? "", mode, countIntervalMs };
  return new Feed(
    (signal) => client.watchRoom(request, { signal, ...(headers ? { headers } : {}) }),
    options.reconnect ?? new Backoff(),
    renew,
  );
}

/** A member-mode `WatchRoom` that survives disconnects, holding the room as a {@link RoomView}. */
export class RoomWatcher implements AsyncIterable<RoomWatcherEvent> {
  /** What the watcher holds of the room. */
  readonly view: RoomView;

  private constructor(
    private readonly feed: Feed<RoomEvent>,
    roomId: string,
  ) {
    this.view = new RoomView(roomId);
  }

  /**
   * Opens a member watch of `roomId` and applies its snapshot. Rejects with the
   * server's answer if it cannot be opened (`NOT_FOUND`: not readable;
   * `FAILED_PRECONDITION`: past the member cap, see {@link RoomCountWatcher}).
   */
  static async open(transport: Transport, roomId: string, options: RoomWatchOptions = {}): Promise<RoomWatcher> {
    const feed = await roomFeed(transport, roomId, RoomWatchMode.ROOM_WATCH_MEMBERS, 0, options);
    const watcher = new RoomWatcher(feed, roomId);
    const first = (await feed.open()).event;
    if (first.case === "snapshot") watcher.view.applySnapshot(first.value);
    return watcher;
  }

  /** Why the watch ended, once {@link next} has returned `undefined`. */
  get lastError(): ConnectError | undefined {
    return this.feed.failed;
  }

  /** The next change applied to the view; stale and repeated ones are dropped, never reported. */
  async next(): Promise<RoomWatcherEvent | undefined> {
    for (;;) {
      const next = await this.feed.next();
      if (next === undefined) return undefined;
      const event = next.event.event;
      switch (event.case) {
        case "snapshot":
          this.view.applySnapshot(event.value);
          return { kind: "resynced" };
        case "change":
          if (this.view.applyChange(event.value)) return { kind: "change", change: event.value };
          break;
        case "signals":
          if (this.view.applySignals(event.value)) return { kind: "signals", signals: event.value };
          break;
        default:
          // Counts come in count mode only.
          break;
      }
    }
  }

  [Symbol.asyncIterator](): AsyncIterator<RoomWatcherEvent> {
    return iterate(this, () => this.close());
  }

  /** Ends the watch. */
  close(): void {
    this.feed.close();
  }
}

/**
 * A count-mode `WatchRoom` that survives disconnects: the users and sessions
 * of a room too big to list, when they change, at most once per interval (R3).
 */
export class RoomCountWatcher implements AsyncIterable<RoomCount> {
  private current: RoomCount | undefined;

  private constructor(private readonly feed: Feed<RoomEvent>) {}

  /** Opens a count watch of `roomId`, at most one count per `countIntervalMs` (100 to 60000; 0: the server's 1000). */
  static async open(
    transport: Transport,
    roomId: string,
    countIntervalMs = 0,
    options: RoomWatchOptions = {},
  ): Promise<RoomCountWatcher> {
    const feed = await roomFeed(transport, roomId, RoomWatchMode.ROOM_WATCH_COUNT, countIntervalMs, options);
    const watcher = new RoomCountWatcher(feed);
    const first = (await feed.open()).event;
    if (first.case === "count") watcher.current = first.value;
    return watcher;
  }

  /** The counts last reported, or those the watch opened with. */
  get latest(): RoomCount | undefined {
    return this.current;
  }

  /** Why the watch ended, once {@link next} has returned `undefined`. */
  get lastError(): ConnectError | undefined {
    return this.feed.failed;
  }

  /** The next counts that differ from the last ones reported; after a reconnect, only if they differ. */
  async next(): Promise<RoomCount | undefined> {
    for (;;) {
      const next = await this.feed.next();
      if (next === undefined) return undefined;
      const event = next.event.event;
      if (event.case !== "count") continue;
      const count = event.value;
      if (this.current !== undefined && count.users === this.current.users && count.sessions === this.current.sessions) {
        continue;
      }
      this.current = count;
      return count;
    }
  }

  [Symbol.asyncIterator](): AsyncIterator<RoomCount> {
    return iterate(this, () => this.close());
  }

  /** Ends the watch. */
  close(): void {
    this.feed.close();
  }
}
