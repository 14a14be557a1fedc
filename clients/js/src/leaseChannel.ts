/**
 * Batching, pipelined access to the `Leases` stream (L8).
 *
 * A {@link LeaseChannel} owns one long-lived `Leases` stream. Single register,
 * renew, unregister, join, leave and signal calls are queued, coalesced into
 * `LeaseBatch`es of at most `maxBatch` items (a batch leaves when full, or
 * `maxDelayMs` after its first item arrived), and sent with at most
 * `maxInFlightBatches` of them unanswered. Each `LeaseResults` is matched to
 * its batch by `batch_id` and every caller gets its own item's result.
 *
 * Nothing grows without bound: at most `maxQueued` items wait to be sent, and
 * a call past that is refused at once with `RESOURCE_EXHAUSTED`, so a gateway
 * that outruns the server (or a server that is down) is told so instead of
 * buffering its memory away.
 *
 * A broken stream fails the items it carried with `UNAVAILABLE` (the server
 * may or may not have applied them) and is reopened with backoff and jitter
 * when the next batch is ready: queued items ride on the new stream, and fail
 * with it if it cannot be opened. A stream that leaves a batch unanswered for
 * `responseTimeoutMs` counts as broken too.
 *
 * The stream itself is a {@link LeaseWire}'s: `connectLeaseChannel` of
 * `@presenced/client/node` uses the fast `node:http2` one, a channel built on
 * a connect `Transport` goes through that transport.
 */
import type { MessageInitShape } from "@bufbuild/protobuf";
import { create, isMessage } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import type { Transport } from "@connectrpc/connect";

import { Backoff } from "./backoff.js";
import { authorization, codeOf, now } from "./call.js";
import { transportLeaseWire, type LeaseStream, type LeaseWire } from "./leaseWire.js";
import {
  LeaseItemSchema,
  type JoinRequestSchema,
  type JoinResponse,
  type LeaseItem,
  type LeaseResult,
  type LeaveRequestSchema,
  type LeaveResponse,
  type RegisterRequestSchema,
  type RegisterResponse,
  RenewRequestSchema,
  type RenewRequest,
  type RenewResponse,
  type SignalRequestSchema,
  type SignalResponse,
  type UnregisterRequestSchema,
  type UnregisterResponse,
} from "./gen/presence/v1/presence_pb.js";

/** How a {@link LeaseChannel} batches, pipelines, bounds and reconnects. */
export interface LeaseChannelOptions {
  /** Items per `LeaseBatch`; a batch is sent as soon as it holds this many. Default 512. */
  maxBatch?: number;
  /** How long an item may wait for its batch to fill before the batch is sent anyway. Default 1 ms. */
  maxDelayMs?: number;
  /** Batches sent and not yet answered; beyond it items wait in the queue. Default 8. */
  maxInFlightBatches?: number;
  /** Items waiting to be sent; a call past it is refused with `RESOURCE_EXHAUSTED`. Default 8 × maxBatch. */
  maxQueued?: number;
  /** Delays between attempts to reopen a broken stream. */
  reconnect?: Backoff;
  /**
   * A stream whose oldest unanswered batch has waited this long is taken as
   * broken and reopened: a server that stopped answering without closing the
   * connection must not hold callers for ever. Default 10 s.
   */
  responseTimeoutMs?: number;
  /** Sent as `authorization: Bearer <token>` when the stream opens: the gateway's service token. */
  bearerToken?: string;
}

/** The options in force, with defaults filled in and limits raised to at least 1. */
export interface LeaseChannelConfig {
  readonly maxBatch: number;
  readonly maxDelayMs: number;
  readonly maxInFlightBatches: number;
  readonly maxQueued: number;
  readonly reconnect: Backoff;
  readonly responseTimeoutMs: number;
  readonly bearerToken: string | undefined;
}

/** Counters of a {@link LeaseChannel} since it was created. */
export interface LeaseChannelStats {
  /** `LeaseBatch` messages sent. */
  batchesSent: number;
  /** Items sent, over all batches. */
  itemsSent: number;
  /** `Leases` streams opened (the first one included). */
  streamsOpened: number;
  /** Streams that broke or could not be opened. */
  streamsBroken: number;
  /** Calls refused at once because the queue was full. */
  rejected: number;
}

export type RegisterInit = MessageInitShape<typeof RegisterRequestSchema>;
export type RenewInit = MessageInitShape<typeof RenewRequestSchema>;
export type UnregisterInit = MessageInitShape<typeof UnregisterRequestSchema>;
export type JoinInit = MessageInitShape<typeof JoinRequestSchema>;
export type LeaveInit = MessageInitShape<typeof LeaveRequestSchema>;
export type SignalInit = MessageInitShape<typeof SignalRequestSchema>;

/** The payload of an OK `LeaseResult`. */
export type LeaseResultValue = Exclude<LeaseResult["result"], { case: undefined }>;

/**
 * One item's `LeaseResult` as its payload when `code` is OK; otherwise throws
 * a `ConnectError` with the code and message a unary call would have answered.
 */
export function leaseResult(result: LeaseResult): LeaseResultValue {
  if (result.code !== 0) {
    throw new ConnectError(result.message, codeOf(result.code));
  }
  if (result.result.case === undefined) {
    throw new ConnectError("presenced answered OK with no result", Code.Internal);
  }
  return result.result;
}

/** Who waits for one item: settled with its `LeaseResult`, or with the batch's failure. */
interface ItemWaiter {
  resolve(result: LeaseResult): void;
  reject(error: ConnectError): void;
}

/** A whole batch handed in by {@link LeaseChannel.submitBatch}: sent as it is, answered as a whole. */
interface WholeBatch {
  items: LeaseItem[];
  resolve(results: LeaseResult[]): void;
  reject(error: ConnectError): void;
}

/** What waits in the queue: a single item to coalesce, or a whole batch. */
type Queued = { item: LeaseItem; waiter: ItemWaiter } | { batch: WholeBatch };

/** A batch on the wire, and who waits for its results. */
interface InFlight {
  sentAt: number;
  count: number;
  /** One per item (coalesced), or the whole batch's submitter. */
  waiters: ItemWaiter[] | WholeBatch;
}

/** One `Leases` stream, and whether it is still the channel's. */
interface Conn {
  stream: LeaseStream | undefined;
}

/**
 * Batching, pipelined access to the `Leases` stream; share one per gateway
 * process. It needs a wire that streams both ways: `connectLeaseChannel` of
 * `@presenced/client/node` makes one over `node:http2`; a connect `Transport`
 * will do if it can client-stream (a browser's cannot).
 */
export class LeaseChannel {
  /** The options in force. */
  readonly config: LeaseChannelConfig;
  private readonly wire: LeaseWire;
  private readonly headers: Record<string, string> | undefined;
  private readonly counters: LeaseChannelStats = {
    batchesSent: 0,
    itemsSent: 0,
    streamsOpened: 0,
    streamsBroken: 0,
    rejected: 0,
  };
  /** Waiting to be sent, oldest first, from `head` on (shifting an array of thousands costs too much). */
  private queue: Queued[] = [];
  private head = 0;
  /** Items (not entries) waiting: what `maxQueued` bounds. */
  private queuedItems = 0;
  /** When the oldest queued item arrived: a part-filled batch leaves `maxDelayMs` after it. */
  private firstQueuedAt = 0;
  private fillTimer: ReturnType<typeof setTimeout> | undefined;
  private retryTimer: ReturnType<typeof setTimeout> | undefined;
  private answerTimer: ReturnType<typeof setTimeout> | undefined;
  private conn: Conn | undefined;
  /** Batches on `conn` not yet answered, by batch id, oldest first (a Map keeps insertion order). */
  private readonly inFlight = new Map<number, InFlight>();
  private nextBatchId = 1;
  /** Failed attempts since a stream last delivered results; drives the backoff. */
  private attempt = 0;
  /** No new stream is opened before this (set when one breaks). */
  private retryAt = 0;
  private closed = false;

  /** A channel over `wire`, or through `transport` (see {@link transportLeaseWire}). */
  constructor(wire: LeaseWire | Transport, options: LeaseChannelOptions = {}) {
    const maxBatch = Math.max(1, options.maxBatch ?? 512);
    this.config = {
      maxBatch,
      maxDelayMs: Math.max(0, options.maxDelayMs ?? 1),
      maxInFlightBatches: Math.max(1, options.maxInFlightBatches ?? 8),
      // A whole batch of `maxBatch` items must always fit (a session's rejoin sends one).
      maxQueued: Math.max(maxBatch, options.maxQueued ?? 8 * maxBatch),
      reconnect: options.reconnect ?? new Backoff(),
      responseTimeoutMs: Math.max(1, options.responseTimeoutMs ?? 10_000),
      bearerToken: options.bearerToken,
    };
    this.headers = authorization(options.bearerToken);
    this.wire = "open" in wire ? wire : transportLeaseWire(wire);
  }

  /** Counters since the channel was created (a copy). */
  stats(): LeaseChannelStats {
    return { ...this.counters };
  }

  /** Registers a session (L1) as one item of a batch. */
  register(request: RegisterInit): Promise<RegisterResponse> {
    return this.submitItem(create(LeaseItemSchema, { op: { case: "register", value: request } }), "register");
  }

  /**
   * Renews a lease (L2) as one item of a batch: `NOT_FOUND` when the lease is
   * gone, `FAILED_PRECONDITION` when a newer generation owns the session.
   */
  renew(request: RenewInit): Promise<RenewResponse> {
    const item: LeaseItem = { $typeName: LeaseItemSchema.typeName, op: { case: "renew", value: renewMessage(request) } };
    return this.submitItem(item, "renew");
  }

  /** Unregisters a session (L3) as one item of a batch; an older generation changes nothing. */
  unregister(request: UnregisterInit): Promise<UnregisterResponse> {
    return this.submitItem(create(LeaseItemSchema, { op: { case: "unregister", value: request } }), "unregister");
  }

  /** Puts a session in a room (R1) as one item of a batch. */
  join(request: JoinInit): Promise<JoinResponse> {
    return this.submitItem(create(LeaseItemSchema, { op: { case: "join", value: request } }), "join");
  }

  /** Takes a session out of a room as one item of a batch. */
  leave(request: LeaveInit): Promise<LeaveResponse> {
    return this.submitItem(create(LeaseItemSchema, { op: { case: "leave", value: request } }), "leave");
  }

  /** Sets or clears a session's signal in a room (S3) as one item of a batch. */
  signal(request: SignalInit): Promise<SignalResponse> {
    return this.submitItem(create(LeaseItemSchema, { op: { case: "signal", value: request } }), "signal");
  }

  /**
   * Sends these items as one batch of their own (no coalescing); results in
   * item order. Rejects with the batch's failure (the stream broke, or could
   * not be opened); each item's own outcome is in its `LeaseResult` (see
   * {@link leaseResult}). At most `maxBatch` items.
   */
  submitBatch(items: MessageInitShape<typeof LeaseItemSchema>[]): Promise<LeaseResult[]> {
    if (items.length === 0) return Promise.resolve([]);
    if (items.length > this.config.maxBatch) {
      return Promise.reject(
        new ConnectError(`items: at most ${this.config.maxBatch} per batch, got ${items.length}`, Code.InvalidArgument),
      );
    }
    return new Promise((resolve, reject) => {
      const refused = this.refusal(items.length);
      if (refused !== undefined) return reject(refused);
      const batch = { items: items.map((item) => create(LeaseItemSchema, item)), resolve, reject };
      this.enqueue({ batch }, items.length);
    });
  }

  /**
   * Ends the stream and refuses every call from now on: what waits, and what
   * is in flight, fails with `CANCELED`. A gateway closes its sessions first.
   */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    const error = new ConnectError("the lease channel was closed", Code.Canceled);
    this.dropStream(error);
    this.wire.close?.();
    for (let i = this.head; i < this.queue.length; i++) fail(this.queue[i]!, error);
    this.queue = [];
    this.head = 0;
    this.queuedItems = 0;
    clearTimeout(this.fillTimer);
    clearTimeout(this.retryTimer);
    this.fillTimer = this.retryTimer = undefined;
  }

  /**
   * Queues one item; its promise settles with the payload of the item's result,
   * or with the refusal it carries. One promise per call: a gateway makes
   * hundreds of thousands of these a second.
   */
  private submitItem<C extends LeaseResultValue["case"]>(item: LeaseItem, expected: C): Promise<ResultOf<C>> {
    // `unknown` inside: `expect` checked that the payload is of the case asked for.
    return new Promise<unknown>((resolve, reject) => {
      const refused = this.refusal(1);
      if (refused !== undefined) return reject(refused);
      const settle = (result: LeaseResult): void => {
        try {
          resolve(expect(leaseResult(result), expected));
        } catch (err) {
          reject(err);
        }
      };
      this.enqueue({ item, waiter: { resolve: settle, reject } }, 1);
    }) as Promise<ResultOf<C>>;
  }

  /** Why `count` more items cannot be queued, if they cannot. */
  private refusal(count: number): ConnectError | undefined {
    if (this.closed) return new ConnectError("the lease channel was closed", Code.Canceled);
    if (this.queuedItems + count > this.config.maxQueued) {
      this.counters.rejected++;
      return new ConnectError(
        `the lease channel's queue is full (${this.config.maxQueued} items wait to be sent)`,
        Code.ResourceExhausted,
      );
    }
    return undefined;
  }

  private enqueue(entry: Queued, count: number): void {
    if (this.queuedItems === 0) this.firstQueuedAt = now();
    this.queue.push(entry);
    this.queuedItems += count;
    this.pump();
  }

  /**
   * Makes every move that needs no waiting: cuts batches from the queue and
   * sends them while there is room in flight, opening a stream when allowed;
   * otherwise arms the timer that will.
   */
  private pump(): void {
    while (this.queuedItems > 0 && this.inFlight.size < this.config.maxInFlightBatches) {
      const t = now();
      const front = this.queue[this.head]!;
      // A part-filled batch waits for more items until `maxDelayMs` after its first one.
      if (!("batch" in front) && this.queuedItems < this.config.maxBatch && t < this.firstQueuedAt + this.config.maxDelayMs) {
        this.armFill(this.firstQueuedAt + this.config.maxDelayMs - t);
        return;
      }
      if (this.conn === undefined) {
        if (t < this.retryAt) {
          this.armRetry(this.retryAt - t);
          return;
        }
        this.open();
      }
      this.send(this.cut(), t);
    }
  }

  /** Takes the next batch off the queue: a whole batch, or up to `maxBatch` single items. */
  private cut(): { items: LeaseItem[]; waiters: ItemWaiter[] | WholeBatch } {
    const front = this.queue[this.head]!;
    let taken: { items: LeaseItem[]; waiters: ItemWaiter[] | WholeBatch };
    if ("batch" in front) {
      this.head++;
      taken = { items: front.batch.items, waiters: front.batch };
    } else {
      const items: LeaseItem[] = [];
      const waiters: ItemWaiter[] = [];
      while (items.length < this.config.maxBatch && this.head < this.queue.length) {
        const entry = this.queue[this.head]!;
        if ("batch" in entry) break;
        items.push(entry.item);
        waiters.push(entry.waiter);
        this.head++;
      }
      taken = { items, waiters };
    }
    this.queuedItems -= taken.items.length;
    if (this.head === this.queue.length) {
      this.queue = [];
      this.head = 0;
    } else if (this.head > 4096) {
      this.queue = this.queue.slice(this.head);
      this.head = 0;
    }
    // What is left starts a new batch's delay now.
    this.firstQueuedAt = now();
    return taken;
  }

  private send(batch: { items: LeaseItem[]; waiters: ItemWaiter[] | WholeBatch }, t: number): void {
    const conn = this.conn!;
    const batchId = this.nextBatchId++;
    this.inFlight.set(batchId, { sentAt: t, count: batch.items.length, waiters: batch.waiters });
    this.counters.batchesSent++;
    this.counters.itemsSent += batch.items.length;
    conn.stream!.send(batchId, batch.items);
    if (this.answerTimer === undefined) this.armAnswer(this.config.responseTimeoutMs);
  }

  /** Starts a new `Leases` call; batches can be queued on it at once. */
  private open(): void {
    const conn: Conn = { stream: undefined };
    this.conn = conn;
    this.counters.streamsOpened++;
    conn.stream = this.wire.open(this.headers, {
      results: (batchId, results) => {
        if (this.conn !== conn) return;
        this.attempt = 0;
        this.answer(batchId, results);
      },
      ended: (error) => {
        if (this.conn !== conn) return;
        if (error === undefined) return this.broke(new ConnectError("presenced ended the lease stream", Code.Unavailable));
        switch (error.code) {
          // The server's own refusals keep their code (UNIMPLEMENTED from an older
          // server, UNAUTHENTICATED...); anything else is the stream failing.
          case Code.Unimplemented:
          case Code.Unauthenticated:
          case Code.PermissionDenied:
          case Code.InvalidArgument:
            this.broke(error);
            break;
          default:
            this.broke(new ConnectError(`the lease stream broke: ${error.rawMessage}`, Code.Unavailable));
        }
      },
    });
  }

  private answer(batchId: number, results: LeaseResult[]): void {
    const batch = this.inFlight.get(batchId);
    if (batch === undefined) return; // not ours (any more): nobody waits for it
    this.inFlight.delete(batchId);
    if (Array.isArray(batch.waiters)) {
      const waiters = batch.waiters;
      for (let i = 0; i < waiters.length; i++) {
        const result = results[i];
        if (result !== undefined) waiters[i]!.resolve(result);
        else waiters[i]!.reject(countMismatch(batch.count, results.length));
      }
    } else if (results.length === batch.count) {
      batch.waiters.resolve(results);
    } else {
      batch.waiters.reject(countMismatch(batch.count, results.length));
    }
    this.pump();
  }

  /** Drops the stream, fails what it carried and schedules the next attempt. */
  private broke(error: ConnectError): void {
    this.dropStream(error);
    this.counters.streamsBroken++;
    this.retryAt = now() + this.config.reconnect.delay(this.attempt);
    this.attempt++;
    this.pump();
  }

  private dropStream(error: ConnectError): void {
    const conn = this.conn;
    this.conn = undefined;
    conn?.stream?.abort();
    clearTimeout(this.answerTimer);
    this.answerTimer = undefined;
    const lost = [...this.inFlight.values()];
    this.inFlight.clear();
    for (const batch of lost) {
      if (Array.isArray(batch.waiters)) for (const waiter of batch.waiters) waiter.reject(error);
      else batch.waiters.reject(error);
    }
  }

  private armFill(ms: number): void {
    if (this.fillTimer !== undefined) return;
    this.fillTimer = setTimeout(() => {
      this.fillTimer = undefined;
      this.pump();
    }, ms);
  }

  private armRetry(ms: number): void {
    if (this.retryTimer !== undefined) return;
    this.retryTimer = setTimeout(() => {
      this.retryTimer = undefined;
      this.pump();
    }, ms);
  }

  /** Checks, when it may first be due, that the oldest batch in flight has been answered in time. */
  private armAnswer(ms: number): void {
    this.answerTimer = setTimeout(() => {
      this.answerTimer = undefined;
      const oldest = this.inFlight.values().next();
      if (oldest.done) return;
      const due = oldest.value.sentAt + this.config.responseTimeoutMs;
      const t = now();
      if (t >= due) {
        this.broke(
          new ConnectError(`presenced did not answer a lease batch within ${this.config.responseTimeoutMs} ms`, Code.Unavailable),
        );
      } else {
        this.armAnswer(due - t);
      }
    }, ms);
  }
}

/**
 * `request` as a message, built directly: renewals are the hot path, and the
 * reflective `create` of each one was a large part of a gateway's CPU. Typed as the
 * generated `RenewRequest`, so that a required field the proto gains and this
 * misses fails to compile (an optional one does not: see below).
 */
function renewMessage(request: RenewInit): RenewRequest {
  if (isMessage(request, RenewRequestSchema)) return request;
  const message: RenewRequest = {
    $typeName: RenewRequestSchema.typeName,
    userId: request.userId ?? "",
    sessionId: request.sessionId ?? "",
    generation: request.generation ?? 0n,
    ttlMs: request.ttlMs ?? 0,
  };
  // Optional fields (A1's attention) are not required by the type: copied when set.
  if (request.attention !== undefined) message.attention = request.attention;
  if (request.focusedRoomId !== undefined) message.focusedRoomId = request.focusedRoomId;
  return message;
}

function fail(entry: Queued, error: ConnectError): void {
  if ("batch" in entry) entry.batch.reject(error);
  else entry.waiter.reject(error);
}

function countMismatch(count: number, got: number): ConnectError {
  return new ConnectError(`presenced answered ${got} results for a batch of ${count} items`, Code.Internal);
}

type ResultOf<C extends LeaseResultValue["case"]> = Extract<LeaseResultValue, { case: C }>["value"];

function expect<C extends LeaseResultValue["case"]>(result: LeaseResultValue, op: C): ResultOf<C> {
  if (result.case !== op) {
    throw new ConnectError(`presenced answered a ${op} item with a ${result.case} result`, Code.Internal);
  }
  return result.value as ResultOf<C>;
}
