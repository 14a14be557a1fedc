/**
 * The viewer side: what a viewer holds, and a Watch that survives disconnects.
 * It runs in Node and in browsers alike: it needs only server streaming, so
 * any connect `Transport` carries it (gRPC over HTTP/2 in Node, gRPC-Web in a page).
 *
 * {@link ViewerStore} is the seed's `known` map (000, "Reordered events"): per
 * user the newest presence seen, where an event not newer than what is held is
 * a delayed or duplicate one and is dropped, and a snapshot is a resync that
 * replaces everything. A user the viewer may not see is answered as one never
 * seen (P3: OFFLINE, version 0, nothing else); hiding a user from an open
 * watch sends one OFFLINE update in that shape with a fresh version (P4), so
 * the store takes it like any newer event, and the reveal that may follow
 * comes newer again.
 *
 * {@link Watcher} feeds a store from a `Watch` stream and, when the stream
 * ends, reopens it with backoff and jitter and resyncs from the fresh snapshot
 * instead of trying to replay what it missed. A reopen says which version it
 * holds of each user (E8, `known_versions`), so the server sends only the
 * users that changed meanwhile. {@link Watcher.update} changes the watched
 * users of the open stream (E7) and of every reopen after it.
 */
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import type { Client, Transport } from "@connectrpc/connect";

import { Backoff } from "./backoff.js";
import { authorization, iterate } from "./call.js";
import { Feed } from "./feed.js";
import { Presence, type Snapshot, type UserPresence, type WatchEvent } from "./gen/presence/v1/presence_pb.js";

/** What a viewer holds: per user, the newest presence seen. */
export class ViewerStore {
  private readonly users = new Map<string, UserPresence>();

  /** Replaces everything held with these users, and forgets others: a snapshot is a resync. */
  applySnapshot(users: readonly UserPresence[]): void {
    this.users.clear();
    for (const user of users) this.users.set(user.userId, user);
  }

  /**
   * Applies one change. True if newer than what is held (the caller
   * re-renders); false for a stale or duplicate event, which changes nothing.
   */
  applyEvent(update: UserPresence): boolean {
    const held = this.users.get(update.userId);
    if (held !== undefined && update.version <= held.version) return false;
    this.users.set(update.userId, update);
    return true;
  }

  /**
   * Applies a resumed snapshot (`partial`: it left out users whose version the
   * viewer said it holds): the users sent replace what is held of them, the
   * others held and still in `watched` stay, the rest are forgotten.
   */
  applyPartialSnapshot(users: readonly UserPresence[], watched: readonly string[]): void {
    const keep = new Set(watched);
    for (const userId of [...this.users.keys()]) if (!keep.has(userId)) this.users.delete(userId);
    for (const user of users) this.users.set(user.userId, user);
  }

  /** Forgets users no longer watched. */
  remove(userIds: readonly string[]): void {
    for (const userId of userIds) this.users.delete(userId);
  }

  /** The version held of each of `userIds` that is held: a resume's `known_versions`. */
  versions(userIds: readonly string[]): Record<string, bigint> {
    const versions: Record<string, bigint> = {};
    for (const userId of userIds) {
      const held = this.users.get(userId);
      if (held !== undefined) versions[userId] = held.version;
    }
    return versions;
  }

  /** The newest presence held for `userId`. */
  get(userId: string): UserPresence | undefined {
    return this.users.get(userId);
  }

  /** Users held. */
  get size(): number {
    return this.users.size;
  }

  /** Every user held, in no particular order. */
  values(): IterableIterator<UserPresence> {
    return this.users.values();
  }
}

/** What {@link Watcher.next} reports. */
export type WatcherEvent =
  /** A user's change, newer than what the store held; already applied. */
  | { kind: "update"; user: UserPresence }
  /** The store was replaced by a fresh snapshot (a reconnect, or a resync the server sent): re-render it whole. */
  | { kind: "resynced" };

/** What a {@link Watcher} watches. */
export interface WatchOptions {
  /** Delays between reopen attempts. */
  reconnect?: Backoff;
  /** Sent as `authorization: Bearer <token>` on every (re)open: a viewer's JWT or a service token. */
  bearerToken?: string;
  /**
   * Where fresh tokens come from, for short-lived viewer tokens: asked when the
   * watch opens and whenever the server ends it for its credentials (the
   * token expired, `CREDENTIALS_EXPIRED`, or was revoked); the watch then
   * reopens at once with the versions it holds (E8), so the viewer sees no
   * gap and nothing goes blank. Takes the place of `bearerToken`.
   */
  tokenProvider?: () => Promise<string>;
  /** A service watching for a viewer names it here. */
  viewerId?: string;
  /** 0 (default): every change its own event; 1 to 1000: changes come in batches of this window. */
  batchWindowMs?: number;
  /** Whether a reopen sends the versions held (E8). Default true. */
  resume?: boolean;
}

/** A Watch that survives disconnects: reconnects with backoff and jitter and resyncs from a fresh snapshot. */
export class Watcher implements AsyncIterable<WatcherEvent> {
  /** What the viewer holds. */
  readonly store = new ViewerStore();
  private readonly client: Client<typeof Presence>;
  private headers: Record<string, string> | undefined;
  private readonly viewerId: string;
  private readonly batchWindowMs: number;
  private readonly resume: boolean;
  private watched: string[];
  private readonly feed: Feed<WatchEvent>;
  /** Updates of a batch already applied to the store and not yet reported. */
  private readonly unreported: UserPresence[] = [];
  private currentWatchId = "";
  private lastPartial = false;

  private constructor(transport: Transport, userIds: readonly string[], options: WatchOptions) {
    this.client = createClient(Presence, transport);
    this.headers = authorization(options.bearerToken);
    this.viewerId = options.viewerId ?? "";
    this.batchWindowMs = options.batchWindowMs ?? 0;
    this.resume = options.resume ?? true;
    this.watched = [...userIds];
    const provider = options.tokenProvider;
    const renew = provider === undefined ? undefined : async (): Promise<void> => {
      this.headers = authorization(await provider());
    };
    this.feed = new Feed((signal) => this.call(signal), options.reconnect ?? new Backoff(), renew);
  }

  /**
   * Opens a watch of `userIds` and applies its first snapshot. Rejects with the
   * server's answer if it cannot be opened; only a watch once open is reconnected.
   */
  static async open(transport: Transport, userIds: readonly string[], options: WatchOptions = {}): Promise<Watcher> {
    const watcher = new Watcher(transport, userIds, options);
    if (options.tokenProvider !== undefined) watcher.headers = authorization(await options.tokenProvider());
    const first = await watcher.feed.open();
    if (first.event.case !== "snapshot") {
      watcher.close();
      throw new ConnectError(`a watch must open with a snapshot, got ${first.event.case}`, Code.Internal);
    }
    watcher.applySnapshot(first.event.value);
    return watcher;
  }

  /** The users watched. */
  get userIds(): readonly string[] {
    return this.watched;
  }

  /** The open stream's name for `UpdateWatch`. */
  get watchId(): string {
    return this.currentWatchId;
  }

  /** Whether the last opening snapshot was a resumed one that left out users the store held unchanged. */
  get resumed(): boolean {
    return this.lastPartial;
  }

  /** Why the watch ended, once {@link next} has returned `undefined`. */
  get lastError(): ConnectError | undefined {
    return this.feed.failed;
  }

  /**
   * The next change applied to the store, or `undefined` once the watch has
   * ended (closed, or a reopen refused for a reason a retry cannot fix).
   * Stale and duplicate updates are dropped here and never reported; a
   * reconnect is reported as `resynced`.
   */
  async next(): Promise<WatcherEvent | undefined> {
    for (;;) {
      const pending = this.unreported.shift();
      if (pending !== undefined) return { kind: "update", user: pending };
      const next = await this.feed.next();
      if (next === undefined) return undefined;
      const event = next.event.event;
      switch (event.case) {
        case "update":
          if (this.store.applyEvent(event.value)) return { kind: "update", user: event.value };
          break;
        // A batch, or the users an update added: applied at once, in order, so the
        // store is current with it; reported one by one.
        case "updates":
        case "added":
          for (const user of event.value.users) if (this.store.applyEvent(user)) this.unreported.push(user);
          break;
        // First on every stream; a later one is a resync the server sent.
        case "snapshot":
          this.applySnapshot(event.value);
          return { kind: "resynced" };
        default:
          break;
      }
    }
  }

  [Symbol.asyncIterator](): AsyncIterator<WatcherEvent> {
    return iterate(this, () => this.close());
  }

  /**
   * Adds users to the watch and removes others (E7) without reopening it:
   * added users arrive (as updates from {@link next}) with their presence,
   * removed ones are forgotten and send nothing more. While the stream is
   * broken only the set for the next reopen changes.
   */
  async update(add: readonly string[], remove: readonly string[]): Promise<void> {
    if (this.feed.isOpen) {
      try {
        await this.client.updateWatch(
          { watchId: this.currentWatchId, addUserIds: [...add], removeUserIds: [...remove], viewerId: this.viewerId },
          this.headers ? { headers: this.headers } : {},
        );
      } catch (err) {
        // The stream ended meanwhile; the reopen watches the new set.
        if (ConnectError.from(err).code !== Code.NotFound) throw err;
        this.feed.drop();
      }
    }
    const removed = new Set(remove);
    this.watched = this.watched.filter((userId) => !removed.has(userId));
    for (const userId of add) if (!removed.has(userId) && !this.watched.includes(userId)) this.watched.push(userId);
    this.store.remove([...remove]);
  }

  /** Ends the watch: {@link next} returns `undefined` from now on. */
  close(): void {
    this.feed.close();
  }

  private applySnapshot(snapshot: Snapshot): void {
    if (snapshot.watchId !== "") this.currentWatchId = snapshot.watchId;
    this.lastPartial = snapshot.partial;
    if (snapshot.partial) this.store.applyPartialSnapshot(snapshot.users, this.watched);
    else this.store.applySnapshot(snapshot.users);
  }

  /** The Watch call, sent again on every reopen with the versions the store holds (E8). */
  private call(signal: AbortSignal): AsyncIterable<WatchEvent> {
    const request = {
      userIds: this.watched,
      viewerId: this.viewerId,
      batchWindowMs: this.batchWindowMs,
      knownVersions: this.resume ? this.store.versions(this.watched) : {},
    };
    return this.client.watch(request, { signal, ...(this.headers ? { headers: this.headers } : {}) });
  }
}
