/**
 * Lease batches routed over a cluster's nodes (C2), as the Rust client's
 * `ClusterLeases` does.
 *
 * In a cluster every user belongs to one of a fixed number of slots
 * (`slotOf`: FNV-1a-32 of the user id's UTF-8 bytes, modulo the slot count),
 * and one node at a time owns each slot. A node that does not own an item's
 * user refuses it with `UNAVAILABLE` and a `NotOwner` naming the slot, the
 * epoch of the ownership it knows and the owner's address. {@link ClusterLeases}
 * learns the slot map from those refusals: it sends each item to the node it
 * last learned owns the item's slot (at first, to the node it was given),
 * splits a batch by node, and sends refused items on to the owner named, a
 * few hops at most; a refusal that names no owner (none may act right now:
 * the slot is moving, or a node is being replaced) is retried after a short
 * backoff, again and again for up to {@link MOVE_WAIT_MS}: a move is waited
 * out by time, not by a count of tries. Of two routes for one slot it keeps the
 * one of the higher epoch: etcd's revisions only grow; a refusal of an older
 * epoch than the route known comes from a node a moment behind etcd, and is
 * retried after the backoff too.
 *
 * Given etcd ({@link ClusterLeases.followEtcd}), it also keeps the routes
 * current by watching the slot map and the node registrations there, as the
 * nodes do: an item then goes straight to its owner, even the first one, and
 * after a move or a takeover the new owner is known as soon as etcd says so.
 * Refusals are still followed (the watch may be a moment behind, or etcd
 * away); a route is only ever replaced by one of an epoch not older.
 *
 * A node that cannot be reached (it stopped, it died) is forgotten, and not
 * routed to for a second whatever refusals name it: its
 * users' items go to the node given (or, if that is the one gone, to another
 * node learned), which names their new owner. Of a batch that failed there,
 * the renewals are sent again (a renewal applied twice is one); any other
 * item is answered `UNAVAILABLE`, since it may have been applied.
 */
import type { MessageInitShape } from "@bufbuild/protobuf";
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";

import { sleep } from "./call.js";
import { type ClusterView, EtcdFollower } from "./etcd.js";
import {
  type JoinResponse,
  type LeaseItem,
  LeaseItemSchema,
  type LeaseResult,
  LeaseResultSchema,
  type LeaveResponse,
  type NotOwner,
  type RegisterResponse,
  type RenewResponse,
  type SignalResponse,
  type UnregisterResponse,
} from "./gen/presence/v1/presence_pb.js";
import {
  type JoinInit,
  type LeaseChannel,
  type LeaseChannelConfig,
  type LeaveInit,
  leaseResult,
  type RegisterInit,
  type RenewInit,
  type SignalInit,
  type UnregisterInit,
} from "./leaseChannel.js";

/** How many times one item is sent on to an owner a refusal named before its last refusal is its result. */
const MAX_HOPS = 5;

/**
 * How long items whose slot has no owner that may act are sent again, a
 * backoff apart, before their last refusal is their result: longer than a
 * planned move or a takeover keeps a slot without one (C7, C4), well within
 * a session's TTL. The Rust client's `MOVE_WAIT`.
 */
export const MOVE_WAIT_MS = 3_000;

/** The first wait before an item whose slot has no owner is sent again; it doubles per try, up to the next. */
const NO_OWNER_BACKOFF_MS = 25;
const MAX_NO_OWNER_BACKOFF_MS = 200;

/**
 * How long a node that could not be reached is not routed to, whatever
 * refusals name it: until etcd's lease of a dead node expires, the other
 * nodes still name it as its slots' owner, and every item sent there would
 * wait out a reconnect instead of being refused at once. An ownership given
 * to it after it was found unreachable (a higher epoch than any known then)
 * ends this at once: etcd gives slots only to a live, registered node, so it
 * is back (a node restarted in a rolling upgrade is given its share again
 * within moments, D1).
 */
const UNREACHABLE_FOR_MS = 1000;

/** A node that could not be reached: until when, and the highest epoch known then. */
interface Shunned {
  until: number;
  epoch: bigint;
}

/** Whether an ownership of `epoch` naming a node `shunned` still goes elsewhere. */
function holdsAgainst(shunned: Shunned | undefined, epoch: bigint): boolean {
  return shunned !== undefined && Date.now() < shunned.until && epoch <= shunned.epoch;
}

const utf8 = new TextEncoder();

/**
 * The slot of `id` (a user id, or a room id) among `slots`: 32-bit FNV-1a
 * over the id's UTF-8 bytes, modulo `slots`, exactly as the server computes it.
 */
export function slotOf(id: string, slots: number): number {
  let hash = 0x811c9dc5;
  for (const byte of utf8.encode(id)) {
    hash = Math.imul(hash ^ byte, 0x01000193);
  }
  return (hash >>> 0) % Math.max(1, slots);
}

/** Each kind of lease item's answer. */
interface Answers {
  register: RegisterResponse;
  renew: RenewResponse;
  unregister: UnregisterResponse;
  join: JoinResponse;
  leave: LeaveResponse;
  signal: SignalResponse;
}

/** A slot's owner, as the highest-epoch refusal about it named it. */
interface Route {
  epoch: bigint;
  url: string;
}

/** Lease batches to a cluster, each item sent to its user's owner. */
export class ClusterLeases {
  private readonly routes: (Route | undefined)[];
  private readonly channels = new Map<string, LeaseChannel>();
  /** Nodes that could not be reached, and until when (ms) they are not routed to. */
  private readonly unreachable = new Map<string, Shunned>();
  /** `http://` or `https://`, as the seed was given: owners are advertised as host:port. */
  private readonly scheme: string;
  /** The slot map followed in etcd, once {@link followEtcd} was called. */
  private follower: EtcdFollower | undefined;
  /** How long (ms) refusals naming no owner are sent again: {@link MOVE_WAIT_MS} unless set. */
  private moveWaitMs = MOVE_WAIT_MS;

  /**
   * Routes over the cluster of `slots` slots (the nodes' `--slots`) that the
   * node at `seed` (`http://host:port`) belongs to; `open` makes the channel
   * to one node (`connectLeaseChannel` of `@presenced/client/node`, with the
   * gateway's options), called once per node as they are learned.
   */
  constructor(
    private seed: string,
    private readonly slots: number,
    private readonly open: (url: string) => LeaseChannel,
  ) {
    this.slots = Math.max(1, slots);
    this.routes = new Array<Route | undefined>(this.slots).fill(undefined);
    this.scheme = seed.startsWith("https://") ? "https://" : "http://";
  }

  /**
   * Sends items refused for a slot with no owner that may act again for up
   * to `ms` instead of {@link MOVE_WAIT_MS}; 0 never sends them again, as a
   * gateway that waits for its next heartbeat would not (their refusal is
   * their result). Refusals that name an owner are still followed there:
   * that is routing, not a retry. Returns this client.
   */
  withMoveWait(ms: number): this {
    this.moveWaitMs = Math.max(0, ms);
    return this;
  }

  /** The node (its URL) this client sends `userId`'s items to now. */
  routeOf(userId: string): string {
    return this.routes[slotOf(userId, this.slots)]?.url ?? this.seed;
  }

  /** How many slots have a learned owner. */
  knownSlots(): number {
    return this.routes.filter((route) => route !== undefined).length;
  }

  /**
   * Keeps the routes current from the slot map in etcd: `endpoints` are the
   * nodes' `--etcd` URLs, `prefix` their `--etcd-prefix`. Resolves once the
   * map is loaded (every owner known), then follows it until {@link close};
   * rejects, naming the endpoints, if etcd cannot be read now. An etcd that
   * goes away later leaves the routes as they were, and refusals keep them
   * current until it is back.
   */
  async followEtcd(endpoints: string[], prefix = "/presenced/"): Promise<void> {
    this.follower?.close();
    this.follower = await EtcdFollower.start(endpoints, prefix, this.slots, (view) => this.follow(view));
  }

  /**
   * Takes every route of `view` whose owner is registered and whose epoch is
   * not older than the route known. An owner etcd no longer registers (it
   * died, its slots are being taken over) keeps the route known: refusals
   * name the new owner as soon as there is one.
   */
  private follow(view: ClusterView): void {
    view.owners.forEach((owner, slot) => {
      const address = owner === undefined ? undefined : view.nodes.get(owner.node);
      if (owner === undefined || address === undefined || slot >= this.slots) return;
      const url = `${this.scheme}${address}`;
      if (holdsAgainst(this.unreachable.get(url), owner.epoch)) return;
      const known = this.routes[slot];
      if (known === undefined || known.epoch <= owner.epoch) this.routes[slot] = { epoch: owner.epoch, url };
    });
  }

  /** Registers a session (L1) at its user's owner. */
  register(request: RegisterInit): Promise<RegisterResponse> {
    return this.answer({ case: "register", value: request }, "register");
  }

  /** Renews a lease (L2) at its user's owner. */
  renew(request: RenewInit): Promise<RenewResponse> {
    return this.answer({ case: "renew", value: request }, "renew");
  }

  /** Unregisters a session (L3) at its user's owner. */
  unregister(request: UnregisterInit): Promise<UnregisterResponse> {
    return this.answer({ case: "unregister", value: request }, "unregister");
  }

  /** Puts a session in a room (R1), at its user's owner. */
  join(request: JoinInit): Promise<JoinResponse> {
    return this.answer({ case: "join", value: request }, "join");
  }

  /** Takes a session out of a room, at its user's owner. */
  leave(request: LeaveInit): Promise<LeaveResponse> {
    return this.answer({ case: "leave", value: request }, "leave");
  }

  /** Sets or clears a session's signal in a room (S3), at its user's owner. */
  signal(request: SignalInit): Promise<SignalResponse> {
    return this.answer({ case: "signal", value: request }, "signal");
  }

  /** The settings of the channels it opens (those of the seed's). */
  get config(): LeaseChannelConfig {
    return this.channel(this.seed).config;
  }

  /** One item's answer of the kind `kind`, or its refusal. */
  private async answer<K extends keyof Answers>(op: MessageInitShape<typeof LeaseItemSchema>["op"], kind: K): Promise<Answers[K]> {
    const [item] = await this.submitBatch([{ op }]);
    const result = leaseResult(item!);
    if (result.case !== kind) throw new ConnectError(`a ${kind} item answered with another result`, Code.Internal);
    return result.value as Answers[K];
  }

  /**
   * Sends `items`, each to its user's owner, and resolves one result per
   * item in item order. Items of one user keep their order (they travel
   * together); items for different nodes go in parallel. An item whose node
   * could not be reached is answered `UNAVAILABLE` (it may or may not have
   * been applied), like an item of a broken stream.
   */
  async submitBatch(init: MessageInitShape<typeof LeaseItemSchema>[]): Promise<LeaseResult[]> {
    const items = init.map((item) => create(LeaseItemSchema, item));
    const results: (LeaseResult | undefined)[] = new Array(items.length).fill(undefined);
    let pending = items.map((_, index) => index);
    let backoff = NO_OWNER_BACKOFF_MS;
    const giveUpAt = Date.now() + this.moveWaitMs;
    let hops = 0;
    while (pending.length > 0) {
      const byNode = new Map<string, number[]>();
      for (const index of pending) {
        const url = this.routeOf(userOf(items[index]!));
        const indices = byNode.get(url);
        if (indices === undefined) byNode.set(url, [index]);
        else indices.push(index);
      }
      const again: number[] = [];
      let ownerless = false;
      await Promise.all(
        [...byNode].map(async ([url, indices]) => {
          let answers: LeaseResult[];
          try {
            answers = await this.channel(url).submitBatch(indices.map((index) => items[index]!));
          } catch (error) {
            const message = error instanceof ConnectError ? error.rawMessage : String(error);
            for (const index of indices) results[index] = unavailable(`${url}: ${message}`);
            if (this.forget(url)) {
              again.push(...indices.filter((index) => items[index]!.op.case === "renew"));
            }
            return;
          }
          indices.forEach((index, i) => {
            const result = answers[i]!;
            results[index] = result;
            const notOwner = result.code === Code.Unavailable ? result.notOwner : undefined;
            if (notOwner !== undefined) {
              const behind = !this.learn(notOwner);
              ownerless ||= notOwner.ownerAddr === "" || behind;
              again.push(index);
            }
          });
        }),
      );
      pending = again;
      if (pending.length === 0) break;
      if (ownerless) {
        // A slot without an owner that may act: waited out by time.
        if (Date.now() + backoff > giveUpAt) break;
        await sleep(backoff);
        backoff = Math.min(backoff * 2, MAX_NO_OWNER_BACKOFF_MS);
      } else if (++hops === MAX_HOPS) {
        break;
      }
    }
    return results.map((result) => result ?? unavailable("not sent"));
  }

  /** Closes every node's channel, and stops following etcd. */
  close(): void {
    this.follower?.close();
    for (const channel of this.channels.values()) channel.close();
  }

  /**
   * Keeps the route a refusal names, unless one of a higher epoch is known.
   * Returns false for a refusal naming an older epoch than the route known:
   * the node refusing has not seen its ownership in etcd yet, so the item is
   * retried after the backoff.
   */
  private learn(notOwner: NotOwner): boolean {
    if (notOwner.ownerAddr === "" || notOwner.slot >= this.slots) return true;
    const url = `${this.scheme}${notOwner.ownerAddr}`;
    if (holdsAgainst(this.unreachable.get(url), notOwner.epoch)) return true;
    const known = this.routes[notOwner.slot];
    if (known === undefined || known.epoch <= notOwner.epoch) {
      this.routes[notOwner.slot] = { epoch: notOwner.epoch, url };
      return true;
    }
    return false;
  }

  /**
   * Forgets `url`, which could not be reached: the routes to it, and if it
   * is where unrouted items go, it stops being so for another node learned.
   * Returns whether its items have somewhere else to go.
   */
  private forget(url: string): boolean {
    const epoch = this.routes.reduce((max, route) => (route !== undefined && route.epoch > max ? route.epoch : max), 0n);
    this.unreachable.set(url, { until: Date.now() + UNREACHABLE_FOR_MS, epoch });
    // A new channel, when the node is routed to again, starts afresh.
    this.channels.get(url)?.close();
    this.channels.delete(url);
    for (let slot = 0; slot < this.routes.length; slot++) {
      if (this.routes[slot]?.url === url) this.routes[slot] = undefined;
    }
    if (this.seed !== url) return true;
    const other = this.routes.find((route) => route !== undefined);
    if (other === undefined) return false;
    this.seed = other.url;
    return true;
  }

  /** The channel to `url`, opened the first time. */
  private channel(url: string): LeaseChannel {
    let channel = this.channels.get(url);
    if (channel === undefined) {
      channel = this.open(url);
      this.channels.set(url, channel);
    }
    return channel;
  }
}

function unavailable(message: string): LeaseResult {
  return create(LeaseResultSchema, { code: Code.Unavailable, message });
}

/** The user an item acts for. */
function userOf(item: LeaseItem): string {
  return item.op.case === undefined ? "" : item.op.value.userId;
}
