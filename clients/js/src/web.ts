/**
 * `@presenced/client/web`: the browser's transport (gRPC-Web, server streaming
 * only), which the viewer side needs, and the connect names a page uses with
 * it, from the same copy of connect as the rest of the client (so that
 * `instanceof ConnectError` and `Code` agree in a bundle); and what a page
 * tells its gateway of its human's attention ({@link watchAttention}).
 */
import type { Transport } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-web";

import { Attention } from "./gen/presence/v1/presence_pb.js";

export { Code, ConnectError, createClient } from "@connectrpc/connect";
export { Attention } from "./gen/presence/v1/presence_pb.js";

/** A gRPC-Web transport to `baseUrl` (a page served by presenced passes `location.origin`). */
export function webTransport(baseUrl: string): Transport {
  return createGrpcWebTransport({ baseUrl, useBinaryFormat: true });
}

/** The part of `document` that {@link watchAttention} reads. */
export interface AttentionDocument {
  readonly visibilityState: string;
  addEventListener(type: string, listener: () => void, options?: { passive?: boolean; capture?: boolean }): void;
  removeEventListener(type: string, listener: () => void, options?: { capture?: boolean }): void;
}

/** How {@link watchAttention} reads the page. */
export interface AttentionWatchOptions {
  /** No input for this long is `ATTENTION_IDLE`. Default a minute. */
  idleMs?: number;
  /** The page; default `globalThis.document`. */
  document?: AttentionDocument;
  /** Milliseconds now; default `Date.now`. */
  now?: () => number;
}

/** The input that says a human is at the page. */
const INPUT_EVENTS = ["pointerdown", "pointermove", "keydown", "wheel", "touchstart"] as const;

/**
 * Reports what the page's human is doing (A1): `ATTENTION_BACKGROUND` while
 * the page is hidden (`visibilitychange`: another tab, a minimised window, a
 * locked screen), `ATTENTION_IDLE` after `idleMs` without input, and
 * `ATTENTION_ACTIVE` otherwise. Calls `report` with the attention at once
 * and then on every change only, never on every input; the page sends it to
 * its gateway over the socket it already has, and the gateway's `Session`
 * passes it on (`Session.setAttention`). Returns the function that stops it.
 */
export function watchAttention(report: (attention: Attention) => void, options: AttentionWatchOptions = {}): () => void {
  const page = options.document ?? (globalThis as unknown as { document: AttentionDocument }).document;
  const clock = options.now ?? Date.now;
  const idleMs = options.idleMs ?? 60_000;
  let lastInput = clock();
  let shown: Attention | undefined;
  let idleTimer: ReturnType<typeof setTimeout> | undefined;
  const current = (): Attention => {
    if (page.visibilityState === "hidden") return Attention.BACKGROUND;
    return clock() - lastInput >= idleMs ? Attention.IDLE : Attention.ACTIVE;
  };
  const update = (): void => {
    const attention = current();
    if (idleTimer !== undefined) clearTimeout(idleTimer);
    idleTimer = undefined;
    if (attention === Attention.ACTIVE) {
      // Looked at again when the idle time would run out.
      idleTimer = setTimeout(update, Math.max(0, lastInput + idleMs - clock()));
    }
    if (attention !== shown) {
      shown = attention;
      report(attention);
    }
  };
  const input = (): void => {
    lastInput = clock();
    // Only a change is worth a look: input while active costs a comparison.
    if (shown !== Attention.ACTIVE) update();
  };
  page.addEventListener("visibilitychange", update);
  for (const type of INPUT_EVENTS) page.addEventListener(type, input, { passive: true, capture: true });
  update();
  return () => {
    if (idleTimer !== undefined) clearTimeout(idleTimer);
    page.removeEventListener("visibilitychange", update);
    for (const type of INPUT_EVENTS) page.removeEventListener(type, input, { capture: true });
  };
}
