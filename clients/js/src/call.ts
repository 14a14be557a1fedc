/**
 * What the client's calls share: the credentials they carry, which refusals
 * end a stream for good instead of being retried, and waiting.
 */
import { Code, ConnectError } from "@connectrpc/connect";

/** The `authorization` header for `bearerToken`, if there is one. */
export function authorization(bearerToken: string | undefined): Record<string, string> | undefined {
  if (bearerToken === undefined) return undefined;
  if (/[\r\n]/.test(bearerToken)) {
    // Refused here, once, rather than by the transport on every reopen.
    throw new ConnectError("bearer token: not valid metadata", Code.InvalidArgument);
  }
  return { authorization: `Bearer ${bearerToken}` };
}

/** The connect code of a gRPC status number (a `LeaseResult`'s, a trailer's); unknown numbers are `UNKNOWN`. */
export function codeOf(status: number): Code {
  return status in Code && status > 0 && status <= 16 ? (status as Code) : Code.Unknown;
}

/** Codes a retry cannot fix: the request or the caller is refused as such. */
export function isPermanent(code: Code): boolean {
  switch (code) {
    case Code.InvalidArgument:
    case Code.Unauthenticated:
    case Code.PermissionDenied:
    case Code.Unimplemented:
    case Code.NotFound:
    case Code.FailedPrecondition:
    case Code.OutOfRange:
    case Code.AlreadyExists:
      return true;
    default:
      return false;
  }
}

/** Resolves after `ms`, or at once (false) when `signal` aborts; true when the time passed. */
export function sleep(ms: number, signal?: AbortSignal): Promise<boolean> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve(false);
    const onAbort = (): void => {
      clearTimeout(timer);
      resolve(false);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve(true);
    }, Math.max(0, ms));
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** Milliseconds on a monotonic clock (the same in Node and browsers). */
export function now(): number {
  return performance.now();
}

/** An async iterator over `source.next()` until it answers `undefined`; `close` runs when a loop breaks off. */
export function iterate<T>(source: { next(): Promise<T | undefined> }, close: () => void): AsyncIterator<T> {
  return {
    next: async (): Promise<IteratorResult<T>> => {
      const value = await source.next();
      return value === undefined ? { value: undefined, done: true } : { value, done: false };
    },
    return: async (): Promise<IteratorResult<T>> => {
      close();
      return { value: undefined, done: true };
    },
  };
}
