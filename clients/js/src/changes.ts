/**
 * The change feed's resumable consumer (F1, F2), for Node and browsers:
 * `Changes` read in batches, each batch's cursor saved to a store the caller
 * provides once the caller has processed the batch, and every reopen
 * resuming after the cursor saved last. The same design as the Rust
 * client's `ChangesConsumer`.
 *
 * Delivery is at least once, identified by cursor: a batch is handed out
 * again until it is committed, so a consumer that dies (or fails) between
 * processing a batch and committing it sees that batch again, with the same
 * cursors, and nothing that was committed. Processing made idempotent by
 * cursor (or by user and version) is then exactly once.
 *
 * A cursor the feed no longer retains is not retried: it is a
 * {@link ChangesOutOfRangeError} with the oldest cursor the feed holds, for the
 * caller to resync from a `Snapshot` and {@link ChangesConsumer.resumeFrom}
 * it. A `gap` (changes the feed lost) is an event like the others.
 */
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import type { Client, Transport } from "@connectrpc/connect";

import { Backoff } from "./backoff.js";
import { authorization, iterate } from "./call.js";
import { Feed, type FeedEvent } from "./feed.js";
import {
  type ChangeEvent,
  ChangeKind,
  ChangesFrom,
  ChangesOutOfRangeSchema,
  Presence,
} from "./gen/presence/v1/presence_pb.js";

/**
 * Where a consumer keeps the cursor of the last batch it processed. A store
 * that saves to where the processing writes (a row of the database the
 * consumer updates, in the same transaction) makes processing and cursor
 * one step. `FileCursorStore` (from `@presenced/client/node`) keeps it in a file.
 */
export interface CursorStore {
  /** The cursor saved last, or `undefined` when none ever was. */
  load(): Promise<Uint8Array | undefined>;
  /** Saves `cursor` in place of the one before; once it resolved, a load (here or in a later process) returns it. */
  save(cursor: Uint8Array): Promise<void>;
}

/** A cursor in memory: for a consumer whose process keeps it, and for tests. */
export class MemoryCursorStore implements CursorStore {
  /** The cursor saved last. */
  cursor: Uint8Array | undefined;

  constructor(cursor?: Uint8Array) {
    this.cursor = cursor;
  }

  async load(): Promise<Uint8Array | undefined> {
    return this.cursor;
  }

  async save(cursor: Uint8Array): Promise<void> {
    this.cursor = cursor;
  }
}

/**
 * A cursor as text: lowercase hex. What `presenced changes` prints and its
 * `--from` takes, and what the file stores (this client's and the Rust
 * client's) write.
 */
export function cursorToHex(cursor: Uint8Array): string {
  return Array.from(cursor, (byte) => byte.toString(16).padStart(2, "0")).join("");
}

/** A cursor from its text form ({@link cursorToHex}; upper case is taken too); throws on anything else. */
export function cursorFromHex(text: string): Uint8Array {
  if (text === "") throw new TypeError("not a cursor: empty");
  if (text.length % 2 !== 0) throw new TypeError("not a cursor: an odd number of hex digits");
  if (!/^[0-9a-fA-F]*$/.test(text)) throw new TypeError("not a cursor: only hex digits (0-9, a-f) make one");
  const cursor = new Uint8Array(text.length / 2);
  for (let i = 0; i < cursor.length; i++) cursor[i] = parseInt(text.slice(2 * i, 2 * i + 2), 16);
  return cursor;
}

/**
 * The feed refused a cursor older than the oldest change it retains (or not
 * one of its own: another server's, or from before its data directory was
 * replaced). Not retried: resync what matters with a `Snapshot`, then
 * {@link ChangesConsumer.resumeFrom} `oldestCursor`.
 */
export class ChangesOutOfRangeError extends Error {
  override readonly name = "ChangesOutOfRangeError";

  constructor(
    /** Resumes at the oldest change the feed holds (the refusal's `ChangesOutOfRange` detail). */
    readonly oldestCursor: Uint8Array,
    /** The refusal, `OUT_OF_RANGE`. */
    readonly refusal: ConnectError,
  ) {
    super(`${refusal.rawMessage}; the oldest cursor is ${cursorToHex(oldestCursor)}`);
  }
}

/** Events that arrived together, to process and then commit as one. */
export interface ChangeBatch {
  /**
   * In feed order: flips, status changes, room occupancy changes, and gaps
   * (resync what matters on one); never empty. Progress events are left
   * out, their cursors kept in `cursor`.
   */
  events: ChangeEvent[];
  /** Where the feed resumes once this batch is committed: its last event's cursor, or a later progress event's. */
  cursor: Uint8Array;
}

/** What a {@link ChangesConsumer} reads, and how. */
export interface ChangesOptions {
  /** Where to start while the store holds no cursor: `"now"` (the default), `"oldest"` (the oldest change retained), or after a cursor. */
  from?: "now" | "oldest" | Uint8Array;
  /** Only these kinds; every kind without. */
  kinds?: ChangeKind[];
  /** Only users and rooms whose id starts with this. */
  idPrefix?: string;
  /** Only users and rooms of these slots (0 to 1023 on a single node), for consumers that share the feed. */
  slots?: number[];
  /** The most events in one batch. Default 1000. */
  maxBatch?: number;
  /** Delays between reopen attempts after the stream broke. */
  reconnect?: Backoff;
  /** Sent as `authorization: Bearer <token>` on every (re)open: a service token with the `feed` scope. */
  bearerToken?: string;
  /**
   * Where fresh tokens come from: asked when the feed opens and whenever the
   * server ends it for its credentials; the feed then reopens at once after
   * the committed cursor. Takes the place of `bearerToken`.
   */
  tokenProvider?: () => Promise<string>;
}

/** Resolves on the next turn of the event loop: what is already there comes first. */
const IO_TURN = Symbol("io turn");
function ioTurn(): Promise<typeof IO_TURN> {
  return new Promise((resolve) => setTimeout(() => resolve(IO_TURN), 0));
}

/**
 * A `Changes` consumer that resumes where its caller's processing got to.
 *
 * It opens the feed after the cursor its {@link CursorStore} holds (or as its
 * options say, when the store holds none), hands out the events that
 * arrived together as a {@link ChangeBatch} ({@link nextBatch}), and saves
 * the batch's cursor once the caller {@link commit}s it ({@link run} does
 * both around a handler, and `for await` hands out batches too). A stream
 * that breaks is reopened with backoff and jitter after the committed
 * cursor; with a `tokenProvider`, one the server ended for its credentials is
 * reopened at once with a fresh token. A batch handed out and not committed
 * is handed out again by the next `nextBatch`.
 *
 * Progress events are not handed out: a batch of nothing but progress is
 * saved at once, which keeps a narrowly filtered consumer's cursor fresh.
 *
 * Until the first cursor is saved, a reopen starts as the options say: a
 * consumer started from `"now"` that breaks before its first commit misses
 * what happened while it was away. Start from a stored cursor (or
 * `"oldest"`) where that matters.
 */
export class ChangesConsumer implements AsyncIterable<ChangeBatch> {
  private readonly client: Client<typeof Presence>;
  private readonly reconnect: Backoff;
  private readonly maxBatch: number;
  private headers: Record<string, string> | undefined;
  private readonly renew: (() => Promise<void>) | undefined;
  private feed: Feed<ChangeEvent>;
  /** Whether the current feed ever opened: its first open fails fast, later ones are retried. */
  private opened = false;
  /** The feed's next event, asked for while a batch was gathered and not there yet. */
  private pending: Promise<FeedEvent<ChangeEvent> | undefined> | undefined;
  /** The cursor the store holds. */
  private committed: Uint8Array | undefined;
  /** The cursor of the batch handed out and not committed yet. */
  private uncommitted: Uint8Array | undefined;
  /**
   * Where a reopen resumes: the committed cursor, or that of the last event
   * gathered (a stream that breaks while the caller processes a batch is
   * reopened after it; if the batch is not committed, the next `nextBatch`
   * starts again from the committed cursor anyway).
   */
  private position: Uint8Array | undefined;
  private closed = false;

  private constructor(
    transport: Transport,
    private readonly store: CursorStore,
    private readonly options: ChangesOptions,
    committed: Uint8Array | undefined,
  ) {
    this.client = createClient(Presence, transport);
    this.reconnect = options.reconnect ?? new Backoff();
    this.maxBatch = Math.max(1, options.maxBatch ?? 1000);
    this.headers = authorization(options.bearerToken);
    const provider = options.tokenProvider;
    this.renew = provider === undefined ? undefined : async (): Promise<void> => {
      this.headers = authorization(await provider());
    };
    this.committed = committed;
    this.position = committed;
    this.feed = this.newFeed();
  }

  /**
   * A consumer of the feed after the cursor `store` holds, or where
   * `options.from` says when it holds none. Nothing is sent before the first
   * {@link nextBatch}, which rejects with the server's answer if the feed
   * cannot be opened (only a feed once open is reopened).
   */
  static async open(transport: Transport, store: CursorStore, options: ChangesOptions = {}): Promise<ChangesConsumer> {
    const consumer = new ChangesConsumer(transport, store, options, await store.load());
    if (options.tokenProvider !== undefined) consumer.headers = authorization(await options.tokenProvider());
    return consumer;
  }

  /** The cursor the store holds, as this consumer last loaded or saved it. */
  get committedCursor(): Uint8Array | undefined {
    return this.committed;
  }

  /**
   * The next batch: the events that arrived together (at most `maxBatch`),
   * waiting for the first; `undefined` once closed. If the batch handed out
   * before was not committed, it is handed out again first. Rejects with a
   * {@link ChangesOutOfRangeError}, a `ConnectError` the server refused the
   * feed with (bad input, credentials), or the store's error; a later call
   * tries again.
   */
  async nextBatch(): Promise<ChangeBatch | undefined> {
    if (this.uncommitted !== undefined) {
      // Not committed: what came after the committed cursor comes again.
      this.uncommitted = undefined;
      this.restart();
    }
    for (;;) {
      const first = await this.nextEvent();
      if (first === undefined) return undefined;
      const batch = await this.gather(first);
      if (batch.events.length === 0) {
        // Nothing but progress: nothing to process, so saved now.
        if (batch.cursor.length > 0) await this.save(batch.cursor);
        continue;
      }
      this.uncommitted = batch.cursor;
      return batch;
    }
  }

  /**
   * Saves the cursor of the batch handed out last: the caller has processed
   * it, and no later consumer of this store sees it again. If the store
   * fails, the batch stays uncommitted (and is handed out again).
   */
  async commit(): Promise<void> {
    const cursor = this.uncommitted;
    if (cursor === undefined) return;
    await this.store.save(cursor);
    this.committed = cursor;
    if (this.uncommitted === cursor) this.uncommitted = undefined;
  }

  /**
   * Saves `cursor` as the committed one and resumes after it: after a
   * {@link ChangesOutOfRangeError}, once the caller has resynced from a
   * `Snapshot`, with its `oldestCursor`. A batch handed out and not
   * committed is dropped.
   */
  async resumeFrom(cursor: Uint8Array): Promise<void> {
    this.uncommitted = undefined;
    await this.save(cursor);
    this.restart();
  }

  /**
   * Hands every batch to `handler` and commits it once `handler` is done,
   * until the consumer is closed (it resolves) or something fails (it
   * rejects): the handler (its batch is not committed), a refusal, a
   * {@link ChangesOutOfRangeError}, or the store. Calling it again goes on,
   * from the uncommitted batch if there is one.
   */
  async run(handler: (batch: ChangeBatch) => Promise<void> | void): Promise<void> {
    for (;;) {
      const batch = await this.nextBatch();
      if (batch === undefined) return;
      await handler(batch);
      await this.commit();
    }
  }

  /** Batches, as {@link nextBatch} hands them out: commit each once processed. */
  [Symbol.asyncIterator](): AsyncIterator<ChangeBatch> {
    return iterate({ next: () => this.nextBatch() }, () => this.close());
  }

  /** Ends the consumer: {@link nextBatch} resolves `undefined` from now on. */
  close(): void {
    this.closed = true;
    this.feed.close();
  }

  /** The next event of the feed, or `undefined` once closed. */
  private async nextEvent(): Promise<ChangeEvent | undefined> {
    if (this.closed) return undefined;
    if (!this.opened) {
      try {
        const first = await this.feed.open();
        this.opened = true;
        return first;
      } catch (err) {
        if (this.closed) return undefined;
        throw refusal(ConnectError.from(err));
      }
    }
    const pending = this.pending ?? this.feed.next();
    this.pending = undefined;
    const next = await pending;
    if (next !== undefined) return next.event;
    if (this.closed || this.feed.failed === undefined) return undefined;
    const failed = this.feed.failed;
    // A refused feed stays refused until asked again: a fresh one retries then.
    this.restart();
    this.opened = true;
    throw refusal(failed);
  }

  /** `first` and the events that arrived with it, up to `maxBatch`. */
  private async gather(first: ChangeEvent): Promise<ChangeBatch> {
    const batch: ChangeBatch = { events: [], cursor: new Uint8Array() };
    let event: ChangeEvent | undefined = first;
    while (event !== undefined) {
      if (event.cursor.length > 0) {
        batch.cursor = event.cursor;
        // A stream that breaks from here on is reopened after this event.
        this.position = event.cursor;
      }
      if (event.event.case !== "progress") batch.events.push(event);
      if (batch.events.length >= this.maxBatch) break;
      // Only what is there already: an event not in by the next turn of the
      // event loop starts the next batch.
      const next = this.feed.next();
      const ready = await Promise.race([next, ioTurn()]);
      if (ready === IO_TURN) {
        this.pending = next;
        break;
      }
      // The feed ended or failed: the next call says why.
      if (ready === undefined) this.pending = next;
      event = ready?.event;
    }
    return batch;
  }

  /** A new feed, reopened after the committed cursor; whatever the old one was doing is dropped. */
  private restart(): void {
    this.position = this.committed;
    this.feed.close();
    this.pending = undefined;
    this.feed = this.newFeed();
  }

  private newFeed(): Feed<ChangeEvent> {
    return new Feed((signal) => this.call(signal), this.reconnect, this.renew);
  }

  private async save(cursor: Uint8Array): Promise<void> {
    await this.store.save(cursor);
    this.committed = cursor;
    this.position = cursor;
  }

  /** The Changes call, sent again on every reopen: after {@link position}, or as the options say before the first commit. */
  private call(signal: AbortSignal): AsyncIterable<ChangeEvent> {
    const from = this.options.from ?? "now";
    const start =
      this.position !== undefined
        ? { from: ChangesFrom.CURSOR, cursor: this.position }
        : from === "now"
          ? { from: ChangesFrom.NOW }
          : from === "oldest"
            ? { from: ChangesFrom.OLDEST }
            : { from: ChangesFrom.CURSOR, cursor: from };
    const request = {
      ...start,
      kinds: this.options.kinds ?? [],
      idPrefix: this.options.idPrefix ?? "",
      slots: this.options.slots ?? [],
    };
    return this.client.changes(request, { signal, ...(this.headers ? { headers: this.headers } : {}) });
  }
}

/** The server's refusal as the consumer reports it: OUT_OF_RANGE with its oldest cursor, or the refusal itself. */
function refusal(error: ConnectError): Error {
  if (error.code !== Code.OutOfRange) return error;
  const [detail] = error.findDetails(ChangesOutOfRangeSchema);
  return detail === undefined ? error : new ChangesOutOfRangeError(detail.oldestCursor, error);
}
