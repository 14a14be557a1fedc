/**
 * One server-streaming call that survives disconnects: what the user and room
 * watchers share. It opens the call, hands out its events, and when the
 * stream ends or breaks, reopens it with backoff and full jitter (the request
 * is built again for every open, so that it can say what the caller holds).
 * A refusal a retry cannot fix (bad input, credentials, `NOT_FOUND`,
 * `FAILED_PRECONDITION`) ends it for good, with the error in `failed`; but
 * with `renewCredentials`, a stream the server ended for its credentials
 * (`UNAUTHENTICATED`: the token expired or was revoked) is reopened at once
 * with fresh ones, and only fresh credentials refused
 * {@link MAX_REFUSED_FRESH_CREDENTIALS} times in a row end it.
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

/** Reopens in a row refused `UNAUTHENTICATED` despite fresh credentials before the feed gives up. */
export const MAX_REFUSED_FRESH_CREDENTIALS = 3;

export class Feed<E> {
  /** Why the feed ended for good, if it did. */
  failed: ConnectError | undefined;
  private stream: AsyncIterator<E> | undefined;
  private streamAbort: AbortController | undefined;
  /** Aborted by `close`: ends waits, opens under way and the stream. */
  private readonly closer = new AbortController();
  /** Failed reopen attempts since a stream last opened. */
  private attempt = 0;
  /** The credentials were refused or spent: renew them before the next open. */
  private spent = false;
  /** The next reopen goes without waiting its backoff (once). */
  private reopenNow = false;
  /** Reopens refused `UNAUTHENTICATED` in a row despite fresh credentials. */
  private refusedFresh = 0;

  /**
   * `call(signal)` makes the call; it is called again for every (re)open.
   * `renewCredentials`, when given, fetches fresh credentials for the calls
   * that follow.
   */
  constructor(
    private readonly call: (signal: AbortSignal) => AsyncIterable<E>,
    private readonly reconnect: Backoff,
    private readonly renewCredentials?: () => Promise<void>,
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
      this.refusedFresh = 0;
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
        if (this.reopenNow) this.reopenNow = false;
        else {
          if (!(await sleep(this.reconnect.delay(this.attempt), this.closer.signal))) return undefined;
          this.attempt++;
        }
        try {
          if (this.spent && this.renewCredentials !== undefined) {
            await this.renewCredentials();
            this.spent = false;
          }
          return { event: await this.open(), reopened: true };
        } catch (err) {
          if (this.closer.signal.aborted) return undefined;
          const error = ConnectError.from(err);
          if (this.mayRenew(error)) {
            this.refusedFresh++;
            this.spent = true;
          } else if (isPermanent(error.code)) this.failed = error;
          continue;
        }
      }
      try {
        const step = await stream.next();
        if (!step.done) return { event: step.value, reopened: false };
      } catch (err) {
        const error = ConnectError.from(err);
        if (this.mayRenew(error)) {
          // Ended for its credentials: fresh ones, and at once, so the viewer sees no gap.
          this.spent = true;
          this.reopenNow = true;
        } else if (isPermanent(error.code) && !this.closer.signal.aborted) {
          // A refusal a retry cannot fix ends the feed as a failed reopen would.
          this.failed = error;
        }
      }
      this.drop();
    }
  }

  /** Whether `error` is one fresh credentials may cure, and there are more to try. */
  private mayRenew(error: ConnectError): boolean {
    return (
      error.code === Code.Unauthenticated &&
      this.renewCredentials !== undefined &&
      this.refusedFresh < MAX_REFUSED_FRESH_CREDENTIALS &&
      !this.closer.signal.aborted
    );
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
