/**
 * The cluster's slot map and node registrations, read from etcd and kept
 * current through a watch (C2), as the nodes themselves follow them.
 *
 * It speaks etcd's JSON gateway (`/v3/kv/range`, `/v3/watch`, served by
 * every etcd 3.4+ on its client port) with `fetch`, so it needs no gRPC
 * stack of its own. The keys are the nodes': `PREFIX/slots/N` holds slot N's
 * owning node id, and its `mod_revision` is the epoch of that ownership;
 * `PREFIX/nodes/ID` holds node ID's advertised `host:port` while its etcd
 * lease lives.
 *
 * Loaded with one range read over the prefix (one revision for both), then
 * followed from the revision after it; a broken watch (etcd down, a
 * compaction) is followed by a fresh load, tried every second, and until
 * then the view stays as it was.
 */
import { sleep } from "./call.js";

/** A slot's owner and the epoch of its ownership. */
export interface SlotOwner {
  node: string;
  epoch: bigint;
}

/** The slot map and the registered nodes, as of one etcd revision. */
export interface ClusterView {
  /** Per slot, its owner, if it has one. */
  owners: (SlotOwner | undefined)[];
  /** Node id → advertised `host:port`. */
  nodes: Map<string, string>;
  /** The etcd revision the view is as of. */
  revision: bigint;
}

/** How long a broken watch waits before loading again. */
const RELOAD_AFTER_MS = 1000;

/** How long one load may take before the next endpoint is tried. */
const LOAD_TIMEOUT_MS = 3000;

interface KeyValue {
  key: string;
  value?: string;
  mod_revision?: string;
}

interface RangeAnswer {
  header?: { revision?: string };
  kvs?: KeyValue[];
}

interface WatchAnswer {
  result?: {
    header?: { revision?: string };
    created?: boolean;
    canceled?: boolean;
    compact_revision?: string;
    events?: { type?: string; kv: KeyValue }[];
  };
  error?: { message?: string };
}

// etcd's JSON carries keys and values as base64 of their bytes; these work
// on Node and in browsers alike.
const bytesToBase64 = (bytes: Uint8Array) => btoa(String.fromCharCode(...bytes));
const toBase64 = (text: string) => bytesToBase64(new TextEncoder().encode(text));
const fromBase64 = (text: string | undefined) =>
  new TextDecoder().decode(Uint8Array.from(atob(text ?? ""), (char) => char.charCodeAt(0)));

/** The first key after every key that starts with `prefix` (etcd's `range_end` for a prefix). */
function prefixEnd(prefix: string): string {
  const bytes = new TextEncoder().encode(prefix);
  for (let i = bytes.length - 1; i >= 0; i--) {
    if (bytes[i]! < 0xff) {
      bytes[i]! += 1;
      return bytesToBase64(bytes.subarray(0, i + 1));
    }
  }
  return toBase64("\0");
}

/** Follows the slot map of `slots` slots under `prefix` in etcd until {@link EtcdFollower.close}. */
export class EtcdFollower {
  private readonly abort = new AbortController();
  private view: ClusterView;

  private constructor(
    private readonly endpoints: string[],
    private readonly prefix: string,
    private readonly slots: number,
    private readonly onChange: (view: ClusterView) => void,
  ) {
    this.view = { owners: new Array<SlotOwner | undefined>(slots).fill(undefined), nodes: new Map(), revision: 0n };
  }

  /**
   * Loads the view from the first of `endpoints` (`http://host:port`) that
   * answers, hands it to `onChange`, then follows it, handing every later
   * view to `onChange` too. Rejects, naming the endpoints, if none answers.
   */
  static async start(
    endpoints: string[],
    prefix: string,
    slots: number,
    onChange: (view: ClusterView) => void,
  ): Promise<EtcdFollower> {
    if (endpoints.length === 0) throw new Error("no etcd endpoint given");
    const follower = new EtcdFollower(endpoints, prefix, slots, onChange);
    const endpoint = await follower.load();
    onChange(follower.view);
    void follower.run(endpoint);
    return follower;
  }

  /** The view as last seen. */
  current(): ClusterView {
    return this.view;
  }

  /** Stops following. */
  close(): void {
    this.abort.abort();
  }

  /** Loads the view afresh; returns the endpoint that answered. */
  private async load(): Promise<string> {
    const failures: string[] = [];
    for (const endpoint of this.endpoints) {
      // Given up after the timeout, or at close (AbortSignal.any needs Node 20.3).
      const load = new AbortController();
      const timer = setTimeout(() => load.abort(), LOAD_TIMEOUT_MS);
      const onClose = () => load.abort();
      this.abort.signal.addEventListener("abort", onClose);
      try {
        const response = await fetch(`${endpoint}/v3/kv/range`, {
          method: "POST",
          body: JSON.stringify({ key: toBase64(this.prefix), range_end: prefixEnd(this.prefix) }),
          signal: load.signal,
        });
        if (!response.ok) throw new Error(`HTTP ${response.status}: ${await response.text()}`);
        const answer = (await response.json()) as RangeAnswer;
        const view: ClusterView = {
          owners: new Array<SlotOwner | undefined>(this.slots).fill(undefined),
          nodes: new Map(),
          revision: BigInt(answer.header?.revision ?? "0"),
        };
        for (const kv of answer.kvs ?? []) this.apply(view, kv, false);
        this.view = view;
        return endpoint;
      } catch (error) {
        failures.push(`${endpoint}: ${error instanceof Error ? error.message : String(error)}`);
      } finally {
        clearTimeout(timer);
        this.abort.signal.removeEventListener("abort", onClose);
      }
    }
    throw new Error(`cannot read the slot map from etcd (${failures.join("; ")})`);
  }

  /** Follows from the view's revision on; loads again whenever the watch breaks. */
  private async run(endpoint: string): Promise<void> {
    while (!this.abort.signal.aborted) {
      try {
        await this.watch(endpoint);
      } catch {
        // Whatever broke the watch, the view is loaded again before it is followed again.
      }
      while (!this.abort.signal.aborted) {
        await sleep(RELOAD_AFTER_MS);
        if (this.abort.signal.aborted) return;
        try {
          endpoint = await this.load();
          this.onChange(this.view);
          break;
        } catch {
          // etcd is away: the view stays as it was.
        }
      }
    }
  }

  /** One watch from the revision after the view's; returns or throws when it ends. */
  private async watch(endpoint: string): Promise<void> {
    const create = {
      create_request: {
        key: toBase64(this.prefix),
        range_end: prefixEnd(this.prefix),
        start_revision: (this.view.revision + 1n).toString(),
      },
    };
    const response = await fetch(`${endpoint}/v3/watch`, {
      method: "POST",
      body: JSON.stringify(create),
      signal: this.abort.signal,
    });
    if (!response.ok || response.body === null) throw new Error(`watch: HTTP ${response.status}`);
    const decoder = new TextDecoder();
    let buffered = "";
    for await (const chunk of response.body as unknown as AsyncIterable<Uint8Array>) {
      buffered += decoder.decode(chunk, { stream: true });
      let newline: number;
      while ((newline = buffered.indexOf("\n")) >= 0) {
        const line = buffered.slice(0, newline).trim();
        buffered = buffered.slice(newline + 1);
        if (line !== "") this.take(JSON.parse(line) as WatchAnswer);
      }
    }
  }

  /** Applies one watch answer; throws when the watch cannot go on. */
  private take(answer: WatchAnswer): void {
    const result = answer.result;
    if (result === undefined) throw new Error(answer.error?.message ?? "a watch answer without a result");
    if (result.canceled || result.compact_revision !== undefined) throw new Error("the watch was cancelled");
    const events = result.events ?? [];
    if (events.length === 0) return;
    const view: ClusterView = { owners: [...this.view.owners], nodes: new Map(this.view.nodes), revision: this.view.revision };
    for (const event of events) this.apply(view, event.kv, event.type === "DELETE");
    view.revision = BigInt(result.header?.revision ?? view.revision.toString());
    this.view = view;
    this.onChange(view);
  }

  /** Applies one key's new value (or its deletion) to `view`; keys of neither kind change nothing. */
  private apply(view: ClusterView, kv: KeyValue, deleted: boolean): void {
    const key = fromBase64(kv.key);
    const slots = `${this.prefix}slots/`;
    const nodes = `${this.prefix}nodes/`;
    if (key.startsWith(slots)) {
      const name = key.slice(slots.length);
      const slot = Number(name);
      if (!/^\d+$/.test(name) || slot >= this.slots) return;
      view.owners[slot] = deleted ? undefined : { node: fromBase64(kv.value), epoch: BigInt(kv.mod_revision ?? "0") };
    } else if (key.startsWith(nodes)) {
      const node = key.slice(nodes.length);
      if (deleted) view.nodes.delete(node);
      else view.nodes.set(node, fromBase64(kv.value));
    }
  }
}
