import assert from "node:assert/strict";
import { test } from "node:test";

import { detectionWindow, histogramRows, rates } from "../src/figures.js";

test("rates come from two readings of the totals, per second of the server's clock", () => {
  assert.deepEqual(rates({ atMs: 1_000, renewals: 100, shed: 0 }, { atMs: 3_000, renewals: 500, shed: 10 }), {
    renewalsPerSecond: 200,
    shedPerSecond: 5,
  });
  assert.equal(rates({ atMs: 1_000, renewals: 1, shed: 0 }, { atMs: 1_000, renewals: 2, shed: 0 }), undefined, "no time passed");
  assert.equal(rates({ atMs: 9_000, renewals: 500, shed: 0 }, { atMs: 1_000, renewals: 3, shed: 0 }), undefined, "a restart");
});

test("a histogram has a row per bound and one above them, and its p99 is the bound of the bucket holding it", () => {
  const { rows, p99Seconds } = histogramRows([0.001, 0.0025, 0.005], [90, 9, 1, 0]);
  assert.deepEqual(rows.map((row) => row.label), ["≤ 1 ms", "≤ 2.5 ms", "≤ 5 ms", "> 5 ms"]);
  assert.deepEqual(rows.map((row) => row.count), [90, 9, 1, 0]);
  assert.equal(p99Seconds, 0.0025, "the 99th of 100 observations is in the second bucket");
  assert.equal(histogramRows([0.001], [1, 99]).p99Seconds, Infinity, "above every bound");
  assert.equal(histogramRows([0.001], [0, 0]).p99Seconds, undefined, "empty");
});

test("the calculator counts the beats that may be lost with the next one still before the deadline", () => {
  const window = detectionWindow(15_000, 45_000);
  assert.equal(window.error, undefined);
  if (window.error !== undefined) return;
  // Beats at 15 s and 30 s lost: the one at 45 s comes at the deadline, too late.
  assert.equal(window.toleratedLostBeats, 1);
  assert.deepEqual([window.earliestMs, window.latestMs], [30_000, 45_000]);
  const early = detectionWindow(14_000, 45_000, 0.005, 2_000);
  assert.equal(early.error, undefined);
  if (early.error !== undefined) return;
  assert.equal(early.toleratedLostBeats, 2, "beats at 14 s and 28 s lost, the one at 42 s in time");
  assert.deepEqual([early.earliestMs, early.latestMs], [31_000 + 5 + 2_000, 45_000 + 5 + 2_000]);
  assert.match(detectionWindow(45_000, 45_000).error ?? "", /runs? out between beats/);
  assert.match(detectionWindow(0, 45_000).error ?? "", /heartbeat/);
});
