/**
 * The counts of many rooms (R7): what a viewer holds of them, and a
 * `WatchRoomCounts` stream that survives disconnects (Node and browsers:
 * server streaming only, and unary `UpdateWatchRoomCounts` calls).
 *
 * {@link RoomCountsView} holds, per watched room, the last count applied
 * (version, users, sessions). A stream's first message holds every room and
 * replaces everything held, even at lower versions (a resync, as a room
 * snapshot is); a later message holds only the rooms that changed, and a
 * count is applied only if its room version is not lower than the one held,
 * so that a delayed count never takes a room back. The one exception is a
 * count at version 0: the server counts a room it holds nothing of (one that
 * emptied and was dropped, R2) and a room the caller may no longer read (R4)
 * as an unknown room, version 0 and no one in it, and that is taken as it
 * comes (it is what is true now, never a delayed count of the room's past).
 * Counts of rooms no longer watched are dropped: a count in flight when a
 * room was removed is not applied.
 *
 * {@link RoomCountsWatcher} feeds a view from a `WatchRoomCounts` and, when
 * the stream ends or breaks, reopens it with backoff and jitter with the
 * rooms it watches then, and starts again from the new stream's first
 * message. {@link RoomCountsWatcher.update} adds and removes rooms on the
 * open stream (named by its `watch_id`) and for every reopen after it. A
 * refusal a retry cannot fix ends it: bad input (no room, more than
 * {@link MAX_WATCHED_ROOMS}, a bad interval) or credentials. A room the caller
 * may not read is answered as an unknown one (version 0, no one in it, R4).
 *
 * For a one-off read, call `RoomCounts` with a client:
 * `createClient(Presence, transport).roomCounts({ roomIds })` answers one
 * count per room, in request order.
 */
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import type { Client, Transport } from "@connectrpc/connect";

import { Backoff } from "./backoff.js";
import { authorization, iterate } from "./call.js";
import { Feed } from "./feed.js";
import { Presence, type RoomCount, type RoomCounts } from "./gen/presence/v1/presence_pb.js";
import type { RoomWatchOptions } from "./room.js";

/** The most rooms one `RoomCounts` call or `WatchRoomCounts` stream takes (R7). */
export const MAX_WATCHED_ROOMS = 10_000;

/** What a viewer holds of many rooms: per watched room, the newest count applied. */
export class RoomCountsView {
  private readonly counts = new Map<string, RoomCount>();
  private readonly watched: Set<string>;

  /** A view of `roomIds` (repeated ones count once), holding no count yet. */
  constructor(roomIds: Iterable<string> = []) {
    this.watched = new Set(roomIds);
  }

  /**
   * A stream's first message: replaces every count held, even at lower
   * versions (a resync). Counts of rooms not watched are left out; a watched
   * room it does not carry (one added since its request) holds nothing until
   * its count comes.
   */
  replace(counts: readonly RoomCount[]): void {
    this.counts.clear();
    for (const count of counts) if (this.watched.has(count.roomId)) this.counts.set(count.roomId, count);
  }

  /**
   * A later message: applies each count of a watched room whose version is
   * not lower than the one held (or is 0: the room as an unknown one) and
   * that differs from it. Answers the counts applied, in message order
   * (empty: nothing changed); a stale, repeated or unwatched one changes nothing.
   */
  merge(counts: readonly RoomCount[]): RoomCount[] {
    const applied: RoomCount[] = [];
    for (const count of counts) if (this.apply(count)) applied.push(count);
    return applied;
  }

  /** Applies one count as {@link merge} does; true if it changed what is held. */
  apply(count: RoomCount): boolean {
    if (!this.watched.has(count.roomId)) return false;
    const held = this.counts.get(count.roomId);
    if (held !== undefined) {
      // Version 0: emptied and dropped, or no longer readable; never a delayed count.
      if (count.version < held.version && count.version !== 0n) return false;
      if (count.version === held.version && count.users === held.users && count.sessions === held.sessions) return false;
    }
    this.counts.set(count.roomId, count);
    return true;
  }

  /** Watches `roomIds` too; their counts are applied from now on. */
  add(roomIds: Iterable<string>): void {
    for (const roomId of roomIds) this.watched.add(roomId);
  }

  /** Stops watching `roomIds` and forgets their counts; counts of them that still come are dropped. */
  remove(roomIds: Iterable<string>): void {
    for (const roomId of roomIds) {
      this.watched.delete(roomId);
      this.counts.delete(roomId);
    }
  }

  /** Whether `roomId` is watched. */
  watches(roomId: string): boolean {
    return this.watched.has(roomId);
  }

  /** The rooms watched, in the order they were first watched. */
  get roomIds(): string[] {
    return [...this.watched];
  }

  /** The count held of `roomId`; undefined before its first count, or when not watched. */
  get(roomId: string): RoomCount | undefined {
    return this.counts.get(roomId);
  }

  /** Rooms with a count held. */
  get size(): number {
    return this.counts.size;
  }

  /** Every count held, in no particular order. */
  values(): IterableIterator<RoomCount> {
    return this.counts.values();
  }
}

/** What {@link RoomCountsWatcher.next} reports. */
export type RoomCountsEvent =
  /** Rooms whose counts changed (and rooms just added, with their first count); already applied to the view. */
  | { kind: "counts"; counts: RoomCount[] }
  /** The view was replaced by a (re)opened stream's first message: re-render it whole. */
  | { kind: "resynced" };

/** How a {@link RoomCountsWatcher} (re)opens its stream. */
export interface RoomCountsWatchOptions extends RoomWatchOptions {
  /** The least time between two messages after the first, 100 to 60000; 0 (default): the server's 1000. */
  countIntervalMs?: number;
}

/** What {@link RoomCountsWatcher.update} changes. */
export interface RoomCountsChange {
  add?: readonly string[];
  remove?: readonly string[];
}

/**
 * A `WatchRoomCounts` that survives disconnects: the counts of up to
 * {@link MAX_WATCHED_ROOMS} rooms, held in a {@link RoomCountsView}, with the
 * rooms that changed at most once per interval.
 */
export class RoomCountsWatcher implements AsyncIterable<RoomCountsEvent> {
  /** What the watcher holds of its rooms. */
  readonly view: RoomCountsView;
  private readonly client: Client<typeof Presence>;
  private headers: Record<string, string> | undefined;
  private readonly viewerId: string;
  private readonly countIntervalMs: number;
  private readonly feed: Feed<RoomCounts>;
  /** The rooms asked for: what every (re)open names. */
  private readonly rooms: Set<string>;
  /**
   * What the open stream's server watches: its request's rooms, with the
   * updates sent on it since (counted from when they are sent, so that two
   * updates in flight never send the same room twice).
   */
  private serverRooms = new Set<string>();
  private currentWatchId = "";
  /** Updates on their way to the server. */
  private readonly pending = new Set<Promise<void>>();

  private constructor(transport: Transport, roomIds: readonly string[], options: RoomCountsWatchOptions) {
    this.client = createClient(Presence, transport);
    this.headers = authorization(options.bearerToken);
    this.viewerId = options.viewerId ?? "";
    this.countIntervalMs = options.countIntervalMs ?? 0;
    this.rooms = new Set(roomIds);
    this.view = new RoomCountsView(this.rooms);
    const provider = options.tokenProvider;
    const renew = provider === undefined ? undefined : async (): Promise<void> => {
      this.headers = authorization(await provider());
    };
    this.feed = new Feed((signal) => this.call(signal), options.reconnect ?? new Backoff(), renew);
  }

  /**
   * Opens a watch of `roomIds` (1 to {@link MAX_WATCHED_ROOMS}; a room named
   * twice is watched once) and applies its first message. Rejects with the
   * server's answer if it cannot be opened; only a watch once open is reconnected.
   */
  static async open(transport: Transport, roomIds: readonly string[], options: RoomCountsWatchOptions = {}): Promise<RoomCountsWatcher> {
    const watcher = new RoomCountsWatcher(transport, roomIds, options);
    if (options.tokenProvider !== undefined) watcher.headers = authorization(await options.tokenProvider());
    watcher.opened(await watcher.feed.open());
    return watcher;
  }

  /** The rooms watched: those of the open stream once its updates are through, and of every reopen. */
  get roomIds(): string[] {
    return [...this.rooms];
  }

  /** The open stream's name for `UpdateWatchRoomCounts` (from its first message). */
  get watchId(): string {
    return this.currentWatchId;
  }

  /** Why the watch ended, once {@link next} has returned `undefined`. */
  get lastError(): ConnectError | undefined {
    return this.feed.failed;
  }

  /**
   * The next change applied to the view, or `undefined` once the watch has
   * ended (closed, or a reopen refused for a reason a retry cannot fix). A
   * message that changes nothing held (stale, repeated, or of rooms removed
   * since) is not reported; a (re)opened stream's first message is reported as
   * `resynced`.
   */
  async next(): Promise<RoomCountsEvent | undefined> {
    for (;;) {
      const next = await this.feed.next();
      if (next === undefined) return undefined;
      if (next.reopened) {
        this.opened(next.event);
        return { kind: "resynced" };
      }
      const applied = this.view.merge(next.event.counts);
      if (applied.length > 0) return { kind: "counts", counts: applied };
    }
  }

  [Symbol.asyncIterator](): AsyncIterator<RoomCountsEvent> {
    return iterate(this, () => this.close());
  }

  /**
   * Adds rooms to the watch and removes others without reopening it
   * (`UpdateWatchRoomCounts` with the open stream's `watch_id`): the added
   * rooms' counts arrive at once, as `counts` from {@link next}; removed rooms
   * are forgotten once the server took the update, and whatever still comes
   * of them is dropped. A room both added and removed is removed. While the
   * stream is broken only the rooms of the next reopen change. Rejects
   * without changing anything when the watch would hold no room or more than
   * {@link MAX_WATCHED_ROOMS} (close it, or open another), or with the
   * server's refusal.
   */
  async update(change: RoomCountsChange): Promise<void> {
    const remove = new Set(change.remove ?? []);
    const add = [...new Set(change.add ?? [])].filter((roomId) => !remove.has(roomId) && !this.rooms.has(roomId));
    const removed = [...remove].filter((roomId) => this.rooms.has(roomId));
    const size = this.rooms.size + add.length - removed.length;
    if (size === 0 || size > MAX_WATCHED_ROOMS) {
      throw new ConnectError(
        `a room counts watch holds 1 to ${MAX_WATCHED_ROOMS} rooms; this update would leave ${size}`,
        Code.InvalidArgument,
      );
    }
    if (add.length === 0 && removed.length === 0) return;
    const before = [...this.rooms];
    for (const roomId of add) this.rooms.add(roomId);
    for (const roomId of removed) this.rooms.delete(roomId);
    // Before the call: an added room's count may come on the stream before its answer does.
    this.view.add(add);
    try {
      await this.track(this.send(add, removed));
    } catch (err) {
      // Refused: the watch stays as it was, in its order, with what other updates changed meanwhile
      // (a reopen meanwhile is put right below).
      const added = new Set(add);
      const wasRemoved = new Set(removed);
      const had = new Set(before);
      const restored = [
        ...before.filter((roomId) => this.rooms.has(roomId) || wasRemoved.has(roomId)),
        ...[...this.rooms].filter((roomId) => !had.has(roomId) && !added.has(roomId)),
      ];
      this.rooms.clear();
      for (const roomId of restored) this.rooms.add(roomId);
      this.view.remove(add);
      throw err;
    } finally {
      this.reconcile();
    }
    this.view.remove(removed);
  }

  /** Resolves once every update sent so far has been answered (or has dropped the stream to reopen it). */
  async settled(): Promise<void> {
    while (this.pending.size > 0) await Promise.allSettled([...this.pending]);
  }

  /** Ends the watch: {@link next} returns `undefined` from now on. */
  close(): void {
    this.feed.close();
  }

  /** A (re)opened stream's first message: its name and every room's count. */
  private opened(first: RoomCounts): void {
    if (first.watchId !== "") this.currentWatchId = first.watchId;
    this.view.replace(first.counts);
    // Rooms added or removed while its request was on its way: sent on this stream.
    this.reconcile();
  }

  /** Sends the rooms asked for that the open stream's server does not watch, and those it watches that are not asked for. */
  private reconcile(): void {
    if (this.feed.closed) return;
    const add = [...this.rooms].filter((roomId) => !this.serverRooms.has(roomId));
    const remove = [...this.serverRooms].filter((roomId) => !this.rooms.has(roomId));
    if (add.length === 0 && remove.length === 0) return;
    // Refused: reopen with the rooms asked for rather than follow others.
    this.track(this.send(add, remove)).catch(() => this.feed.drop());
  }

  /**
   * `UpdateWatchRoomCounts` on the open stream. With no stream open there is
   * nothing to send: the reopen names the rooms asked for. An unknown or ended
   * stream (`NOT_FOUND`) is dropped and reopened with them.
   */
  private async send(add: readonly string[], remove: readonly string[]): Promise<void> {
    const watchId = this.currentWatchId;
    if (!this.feed.isOpen || watchId === "") return;
    for (const roomId of add) this.serverRooms.add(roomId);
    for (const roomId of remove) this.serverRooms.delete(roomId);
    try {
      await this.client.updateWatchRoomCounts(
        { watchId, addRoomIds: [...add], removeRoomIds: [...remove], viewerId: this.viewerId },
        this.headers ? { headers: this.headers } : {},
      );
    } catch (err) {
      if (this.currentWatchId !== watchId) return; // another stream by now, opened with the rooms asked for
      if (ConnectError.from(err).code === Code.NotFound) {
        // The stream ended meanwhile: the reopen names the rooms asked for.
        this.feed.drop();
        return;
      }
      for (const roomId of add) this.serverRooms.delete(roomId);
      for (const roomId of remove) this.serverRooms.add(roomId);
      throw err;
    }
  }

  private track(work: Promise<void>): Promise<void> {
    this.pending.add(work);
    const done = (): void => {
      this.pending.delete(work);
    };
    work.then(done, done);
    return work;
  }

  /** The WatchRoomCounts call, sent again on every reopen with the rooms asked for then. */
  private call(signal: AbortSignal): AsyncIterable<RoomCounts> {
    const roomIds = [...this.rooms];
    this.serverRooms = new Set(roomIds);
    // A stream being (re)opened has no name until its first message.
    this.currentWatchId = "";
    const request = { roomIds, viewerId: this.viewerId, countIntervalMs: this.countIntervalMs };
    return this.client.watchRoomCounts(request, { signal, ...(this.headers ? { headers: this.headers } : {}) });
  }
}
