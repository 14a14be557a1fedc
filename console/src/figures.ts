/**
 * The console's arithmetic, kept apart from the page so that it is tested on
 * its own (`test/figures.test.ts`): rates from two readings of the service's
 * totals, the rows of a histogram and its 99th percentile, and what a
 * heartbeat interval and a TTL tolerate.
 */

/** The running totals of one `Stats` reading that the console turns into rates. */
export interface Figures {
  /** The reading's time on the server's own clock (its uptime), ms. */
  atMs: number;
  renewals: number;
  shed: number;
}

/** Per second between two readings; undefined when no time passed between them (or a restart went back). */
export function rates(before: Figures, after: Figures): { renewalsPerSecond: number; shedPerSecond: number } | undefined {
  const seconds = (after.atMs - before.atMs) / 1000;
  if (!(seconds > 0) || after.renewals < before.renewals || after.shed < before.shed) return undefined;
  return {
    renewalsPerSecond: (after.renewals - before.renewals) / seconds,
    shedPerSecond: (after.shed - before.shed) / seconds,
  };
}

/** One bucket of a histogram, labelled by its upper bound. */
export interface HistogramRow {
  label: string;
  count: number;
}

function milliseconds(seconds: number): string {
  const ms = seconds * 1000;
  return ms >= 1000 ? `${+(ms / 1000).toFixed(2)} s` : `${+ms.toFixed(3)} ms`;
}

/**
 * The rows of a histogram given as `Stats` gives it (counts per bucket, one
 * more count than bounds for the observations above every bound), and the
 * upper bound of the bucket that holds its 99th percentile (undefined when
 * empty; `Infinity` when it lies above every bound).
 */
export function histogramRows(boundsSeconds: readonly number[], counts: readonly number[]): { rows: HistogramRow[]; p99Seconds: number | undefined } {
  const rows: HistogramRow[] = boundsSeconds.map((bound, i) => ({ label: `≤ ${milliseconds(bound)}`, count: counts[i] ?? 0 }));
  if (boundsSeconds.length > 0) {
    rows.push({ label: `> ${milliseconds(boundsSeconds[boundsSeconds.length - 1])}`, count: counts[boundsSeconds.length] ?? 0 });
  }
  const total = rows.reduce((sum, row) => sum + row.count, 0);
  let p99Seconds: number | undefined;
  if (total > 0) {
    const rank = Math.ceil(total * 0.99);
    let seen = 0;
    for (let i = 0; i < rows.length; i++) {
      seen += rows[i].count;
      if (seen >= rank) {
        p99Seconds = i < boundsSeconds.length ? boundsSeconds[i] : Infinity;
        break;
      }
    }
  }
  return { rows, p99Seconds };
}

/** What a heartbeat interval and a TTL give, or why they cannot work. */
export type DetectionWindow =
  | { error: undefined; toleratedLostBeats: number; earliestMs: number; latestMs: number }
  | { error: string };

/**
 * For sessions that renew every `heartbeatMs` with leases of `ttlMs`:
 * - how many renewals in a row may be lost with the session still ONLINE: the
 *   largest k for which the renewal after them, (k + 1) heartbeats after the
 *   last one that arrived, still comes before the deadline (a renewal exactly
 *   at the deadline is too late);
 * - how long after a session died its user shows OFFLINE: between TTL − heartbeat
 *   (it died just before a beat) and TTL (just after one), plus the expiry lag
 *   and the offline grace (flap damping) when there is one.
 */
export function detectionWindow(heartbeatMs: number, ttlMs: number, lagSeconds?: number, offlineGraceMs = 0): DetectionWindow {
  if (!Number.isFinite(heartbeatMs) || heartbeatMs <= 0) return { error: "the heartbeat interval must be a positive number of ms" };
  if (!Number.isFinite(ttlMs) || ttlMs <= 0) return { error: "the TTL must be a positive number of ms" };
  if (heartbeatMs >= ttlMs) return { error: "a heartbeat interval of the TTL or more lets every lease run out between beats" };
  const extraMs = (lagSeconds !== undefined && Number.isFinite(lagSeconds) ? lagSeconds * 1000 : 0) + offlineGraceMs;
  return {
    error: undefined,
    toleratedLostBeats: Math.ceil(ttlMs / heartbeatMs) - 2,
    earliestMs: ttlMs - heartbeatMs + extraMs,
    latestMs: ttlMs + extraMs,
  };
}
