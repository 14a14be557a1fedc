/**
 * One server-streaming call that survives disconnects: what the user and room
 * watchers share. It opens the call, hands out its events, and when the
 * stream ends or breaks, reopens it with backoff and full jitter (the request
 * is built again for every open, so that it can say what the caller holds).
 * A refusal a retry cannot fix (bad input, credentials, `NOT_FOUND`,
 * `FAILED_PRECONDITION`) ends it for good, with the error in `failed`.
 * It never replays what it missed: the new stream's first event says what is.
 */
import { Code, ConnectError } from "@connectrpc/connect";

import type { Backoff } from "./backoff.js";
import { isPermanent, sleep } from "./call.js";

/** An event, and whether it is the first of a stream reopened after a break. */
export interface FeedEvent<E> {
  event: E;
  reopened: boolean;
}

export class Feed<E> {
  /** Why the feed ended for good, if it did. */
  failed: ConnectError | undefined;
  private stream: AsyncIterator<E> | undefined;
  private streamAbort: AbortController | undefined;
  /** Aborted by `close`: ends waits, opens under way and the stream. */
  private readonly closer = new AbortController();
  /** Failed reopen attempts since a stream last opened. */
  private attempt = 0;

  /** `call(signal)` makes the call; it is called again for every (re)open. */
  constructor(
    private readonly call: (signal: AbortSignal) => AsyncIterable<E>,
    private readonly reconnect: Backoff,
  ) {}

  /** Whether a stream is open now. */
  get isOpen(): boolean {
    return this.stream !== undefined;
  }

  /** Opens a stream; resolves with its first event, rejects with why it could not be opened. */
  async open(): Promise<E> {
    const abort = new AbortController();
    const onClose = (): void => abort.abort();
    this.closer.signal.addEventListener("abort", onClose, { once: true });
    const stream = this.call(abort.signal)[Symbol.asyncIterator]();
    try {
      const first = await stream.next();
      if (first.done) throw new ConnectError("the stream ended before its first event", Code.Unavailable);
      this.stream = stream;
      this.streamAbort = abort;
      this.attempt = 0;
      return first.value;
    } catch (err) {
      abort.abort();
      throw ConnectError.from(err);
    } finally {
      // From here on `close` reaches the stream through `streamAbort`.
      this.closer.signal.removeEventListener("abort", onClose);
    }
  }

  /** The next event, reopening as needed; `undefined` once closed or ended for good. */
  async next(): Promise<FeedEvent<E> | undefined> {
    for (;;) {
      if (this.failed !== undefined || this.closer.signal.aborted) return undefined;
      const stream = this.stream;
      if (stream === undefined) {
        if (!(await sleep(this.reconnect.delay(this.attempt), this.closer.signal))) return undefined;
        this.attempt++;
        try {
          return { event: await this.open(), reopened: true };
        } catch (err) {
          if (this.closer.signal.aborted) return undefined;
          const error = ConnectError.from(err);
          if (isPermanent(error.code)) this.failed = error;
          continue;
        }
      }
      try {
        const step = await stream.next();
        if (!step.done) return { event: step.value, reopened: false };
      } catch (err) {
        // A refusal a retry cannot fix ends the feed as a failed reopen would.
        const error = ConnectError.from(err);
        if (isPermanent(error.code) && !this.closer.signal.aborted) this.failed = error;
      }
      this.drop();
    }
  }

  /** Drops the open stream; the next `next()` reopens it. */
  drop(): void {
    this.streamAbort?.abort();
    this.streamAbort = undefined;
    this.stream = undefined;
  }

  /** Ends the feed: `next()` answers `undefined` from now on. */
  close(): void {
    this.closer.abort();
    this.drop();
  }

  /** Whether `close` was called. */
  get closed(): boolean {
    return this.closer.signal.aborted;
  }
}
