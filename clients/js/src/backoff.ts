/**
 * Exponential backoff with full jitter, for reconnects and retries.
 *
 * A fleet of gateways restarted together must not come back in lockstep
 * (seed 000, "Two classic production failures"): every delay is drawn
 * uniformly from `[0, cap(attempt)]` ("full jitter"), where the cap grows by
 * `factor` per attempt up to `maxMs`. This module only computes delays; it
 * never sleeps.
 */

/** The shape of a {@link Backoff}; every field is optional where one is accepted. */
export interface BackoffOptions {
  /** The cap of the first attempt (attempt 0), in ms. Default 50. */
  initialMs: number;
  /** No delay is ever longer than this, in ms. Default 5000. */
  maxMs: number;
  /** How much the cap grows per attempt; values below 1 (or NaN) are taken as 1. Default 2. */
  factor: number;
}

/** Attempt `n` waits a uniformly random time in `[0, min(maxMs, initialMs * factor^n)]`. */
export class Backoff implements BackoffOptions {
  readonly initialMs: number;
  readonly maxMs: number;
  readonly factor: number;

  /** 50 ms, doubling, at most 5 s, unless told otherwise. */
  constructor(options: Partial<BackoffOptions> = {}) {
    this.initialMs = options.initialMs ?? 50;
    this.maxMs = options.maxMs ?? 5000;
    this.factor = options.factor ?? 2;
  }

  /** The longest delay of attempt `attempt` (0-based): `min(maxMs, initialMs * factor^attempt)`. */
  cap(attempt: number): number {
    const factor = this.factor >= 1 ? this.factor : 1;
    // `min` also absorbs an infinite product.
    const grown = this.initialMs * Math.pow(factor, Math.max(0, attempt));
    return Math.min(this.maxMs, grown);
  }

  /** A delay for attempt `attempt` (0-based), drawn uniformly from `[0, cap(attempt)]`. */
  delay(attempt: number): number {
    return this.delayAt(attempt, Math.random());
  }

  /** The delay at position `unit` (in `[0, 1]`) of attempt `attempt`'s range: `delay` with the randomness passed in. */
  delayAt(attempt: number, unit: number): number {
    const u = Number.isNaN(unit) ? 0 : Math.min(1, Math.max(0, unit));
    return this.cap(attempt) * u;
  }
}

/**
 * A uniformly random time in `[0, spanMs)`: the first-beat jitter that keeps
 * sessions registered together from renewing in lockstep.
 */
export function jitter(spanMs: number): number {
  return spanMs * Math.random();
}
