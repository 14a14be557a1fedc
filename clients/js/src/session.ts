/**
 * One session's lease, kept alive by a background heartbeat.
 *
 * A {@link Session} is the gateway's handle on one authenticated socket. It
 * renews the lease through a shared {@link LeaseChannel} (or, in a cluster, a
 * `ClusterLeases`: see {@link SessionLeases}): the first beat after
 * a random part of the interval (so that sessions registered together, as
 * after a gateway restart, do not renew in lockstep), then every interval, and
 * at once on {@link Session.touch} unless the last renewal was less than
 * `minRenewIntervalMs` ago (half the heartbeat by default: the seed's gateway
 * throttle). It reacts to the contract's two rejections (L2): `NOT_FOUND`
 * means the lease is gone, so it registers again under a new generation and
 * joins its rooms again (R6: a new generation is in no room);
 * `FAILED_PRECONDITION` means a newer connection owns the session, so it
 * stops. A renewal shed under overload (`RESOURCE_EXHAUSTED`) waits for the
 * next heartbeat, as the server asks. Any other failure is retried with
 * backoff and jitter, never waiting longer than one heartbeat, while the lease
 * may still be alive.
 *
 * A session says what its human is doing with it (A1): `deviceKind` in its
 * options, and {@link Session.setAttention} and {@link Session.focus} as
 * they change, each sent at once on a renewal of its own. It remembers what
 * it said and says it again with every re-register, since a new generation
 * starts with nothing said.
 *
 * {@link Session.close} stops the heartbeat and unregisters (compare-and-delete
 * on the current generation, with the configured linger).
 */
import { Code, ConnectError } from "@connectrpc/connect";

import { jitter } from "./backoff.js";
import { now } from "./call.js";
import {
  type Attention,
  DeviceKind,
  type JoinResponse,
  type LeaveResponse,
  type RenewResponse,
  type SignalResponse,
  type UnregisterResponse,
} from "./gen/presence/v1/presence_pb.js";
import { type LeaseChannel, type LeaseChannelConfig, leaseResult } from "./leaseChannel.js";

/**
 * Where a {@link Session}'s items go: one node's {@link LeaseChannel}, or a
 * cluster's owners through a `ClusterLeases` (C2), which has the same calls.
 */
export type SessionLeases = Pick<LeaseChannel, "register" | "renew" | "unregister" | "join" | "leave" | "signal" | "submitBatch"> & {
  readonly config: Pick<LeaseChannelConfig, "reconnect" | "maxBatch">;
};

/** How a {@link Session} keeps its lease. */
export interface SessionOptions {
  /** Lease time to live asked for on every register and renew; 0 (the default) takes the server's. */
  ttlMs?: number;
  /** Time between renewals; pick it so that the TTL covers two or more lost beats (L5). Default 15 s. */
  heartbeatMs?: number;
  /** The unregister linger on close (L3); 0 (the default) deletes the lease at once. */
  lingerMs?: number;
  /** `touch()` renews only if the last renewal is at least this old. Default half the heartbeat. */
  minRenewIntervalMs?: number;
  /** The device the session is on (A1), sent with every register; unset says nothing. */
  deviceKind?: DeviceKind;
}

/** What a session said of its human's attention (A1): said again with every re-register. */
interface Said {
  attention?: Attention;
  /** `""`: said there is none. */
  focusedRoomId?: string;
}

/** Who a session is: sent again on every re-register. */
export interface SessionIdentity {
  userId: string;
  sessionId: string;
  /** The gateway process that holds the session's socket. */
  gatewayId: string;
  /** Opaque, small; replaced on every register. */
  metadata?: Record<string, string>;
}

/** Where a {@link Session}'s lease stands. */
export type SessionState =
  /** The lease is held at `generation` and renewed. */
  | { kind: "live"; generation: bigint }
  /**
   * The server had lost the lease (`NOT_FOUND`: expired, revoked, or a restart
   * without it); the session registered again and joined its rooms again.
   */
  | { kind: "reregistered"; generation: bigint }
  /** `FAILED_PRECONDITION`: a newer connection owns the session; renewals stopped: close this socket. */
  | { kind: "superseded" }
  /** Renewals fail for another reason (typically an unreachable server); retried with backoff. */
  | { kind: "lost" }
  /** Closed: unregistered (or tried to). */
  | { kind: "closed" };

type Wake = "renew" | "close";

/** One session's lease, kept alive in the background until {@link Session.close}. */
export class Session {
  private readonly channel: SessionLeases;
  private readonly identity: SessionIdentity;
  private readonly ttlMs: number;
  private readonly heartbeatMs: number;
  private readonly lingerMs: number;
  private readonly minRenewIntervalMs: number;
  private readonly deviceKind: DeviceKind;
  private readonly said: Said = {};
  private currentGeneration: bigint;
  private currentState: SessionState;
  private readonly listeners = new Set<(state: SessionState) => void>();
  /** When the last renewal (or register) started: what `touch` is throttled against. */
  private lastRenewal: number;
  /** Wakes the heartbeat from its wait: a touch, or the close. */
  private wake: ((why: "touch" | "close") => void) | undefined;
  private closing = false;
  /** The heartbeat's end: the answer to the unregister. */
  private readonly finished: Promise<UnregisterResponse>;
  /** The rooms the session is in, with its metadata in each: joined again after a re-register. */
  private readonly joined = new Map<string, Record<string, string>>();
  /** Room calls of one session go to the server one at a time, in order; a rejoin never crosses a leave. */
  private roomTurn: Promise<unknown> = Promise.resolve();

  private constructor(channel: SessionLeases, identity: SessionIdentity, options: SessionOptions, generation: bigint, registeredAt: number) {
    this.channel = channel;
    this.identity = { ...identity, metadata: { ...(identity.metadata ?? {}) } };
    this.ttlMs = options.ttlMs ?? 0;
    this.heartbeatMs = options.heartbeatMs ?? 15_000;
    this.lingerMs = options.lingerMs ?? 0;
    this.minRenewIntervalMs = options.minRenewIntervalMs ?? this.heartbeatMs / 2;
    this.deviceKind = options.deviceKind ?? DeviceKind.DEVICE_UNSPECIFIED;
    this.currentGeneration = generation;
    this.currentState = { kind: "live", generation };
    this.lastRenewal = registeredAt;
    this.finished = this.heartbeat();
    // Nobody may be awaiting it yet; the answer is kept for close().
    this.finished.catch(() => undefined);
  }

  /**
   * Registers the session (L1) and starts renewing it in the background.
   * Rejects with the server's answer to the register: nothing runs then.
   */
  static async register(channel: SessionLeases, identity: SessionIdentity, options: SessionOptions = {}): Promise<Session> {
    const started = now();
    const registered = await channel.register(registerRequest(identity, options.ttlMs ?? 0, options.deviceKind, {}));
    return new Session(channel, identity, options, registered.generation, started);
  }

  get userId(): string {
    return this.identity.userId;
  }

  get sessionId(): string {
    return this.identity.sessionId;
  }

  /** The current generation (changes after a re-register). */
  get generation(): bigint {
    return this.currentGeneration;
  }

  /** The current state. */
  get state(): SessionState {
    return this.currentState;
  }

  /** Calls `listener` on every change of state; returns the function that stops it. */
  onState(listener: (state: SessionState) => void): () => void {
    this.listeners.add(listener);
    return () => this.listeners.delete(listener);
  }

  /** Activity seen on the socket (a message, a pong): renew now unless throttled. */
  touch(): void {
    if (this.wake !== undefined && now() - this.lastRenewal >= this.minRenewIntervalMs) this.wake("touch");
  }

  /**
   * Puts this session in `roomId` with its `metadata` there (R1), or replaces
   * its metadata when it is in already. The session remembers the room and
   * joins it again after a re-register. A join the server refuses is
   * forgotten, except `NOT_FOUND`: the lease is gone, the session registers
   * again at its next beat and joins the room then.
   */
  join(roomId: string, metadata: Record<string, string> = {}): Promise<JoinResponse> {
    return this.inTurn(async () => {
      const earlier = this.joined.get(roomId);
      this.joined.set(roomId, { ...metadata });
      try {
        return await this.withGeneration((generation) =>
          this.channel.join({ ...this.sessionCall(roomId, generation), metadata }),
        );
      } catch (err) {
        if (ConnectError.from(err).code !== Code.NotFound) {
          if (earlier === undefined) this.joined.delete(roomId);
          else this.joined.set(roomId, earlier);
        }
        throw err;
      }
    });
  }

  /** Takes this session out of `roomId` and forgets the room. */
  leave(roomId: string): Promise<LeaveResponse> {
    return this.inTurn(() => {
      this.joined.delete(roomId);
      return this.withGeneration((generation) => this.channel.leave(this.sessionCall(roomId, generation)));
    });
  }

  /**
   * Sets (`ttlMs` 1 to 10000) or clears (0) this session's signal of `kind`
   * ("typing") in `roomId`, a room it is in (S3). Signals are not remembered:
   * they end with the generation that set them.
   */
  signal(roomId: string, kind: string, ttlMs: number): Promise<SignalResponse> {
    return this.inTurn(() =>
      this.withGeneration((generation) => this.channel.signal({ ...this.sessionCall(roomId, generation), kind, ttlMs })),
    );
  }

  /**
   * Says what the session's human is doing with it (A1): `ATTENTION_ACTIVE`
   * on input after being idle or hidden, `ATTENTION_IDLE` after a while
   * without input, `ATTENTION_BACKGROUND` when the page is hidden or the
   * screen locks. Sent at once on a renewal of its own (the heartbeat
   * carries nothing), and again with any re-register. In a browser,
   * `watchAttention` (from `@presenced/client/web`) calls it for you.
   */
  setAttention(attention: Attention): Promise<RenewResponse> {
    return this.say({ attention });
  }

  /**
   * Says which room the session has on screen (`undefined`: none): a
   * notification for a room open in the foreground is not pushed (A3).
   */
  focus(roomId: string | undefined): Promise<RenewResponse> {
    return this.say({ focusedRoomId: roomId ?? "" });
  }

  /** Records a change of what the session says and sends it on a renewal, in turn with the room calls. */
  private say(change: Said): Promise<RenewResponse> {
    return this.inTurn(() => {
      Object.assign(this.said, change);
      const said = { ...this.said };
      this.lastRenewal = now();
      return this.withGeneration((generation) =>
        this.channel.renew({ userId: this.userId, sessionId: this.sessionId, generation, ttlMs: this.ttlMs, ...said }),
      );
    });
  }

  /** The rooms the session is in, as it joined them, sorted. */
  rooms(): string[] {
    return [...this.joined.keys()].sort();
  }

  /**
   * Stops renewing and unregisters with the configured linger. A renewal
   * under way finishes first, so that the unregister carries the newest generation.
   */
  close(): Promise<UnregisterResponse> {
    this.closing = true;
    this.wake?.("close");
    return this.finished;
  }

  private setState(state: SessionState): void {
    const current = this.currentState;
    const same =
      current.kind === state.kind &&
      ("generation" in current ? current.generation : undefined) === ("generation" in state ? state.generation : undefined);
    if (same) return;
    this.currentState = state;
    for (const listener of [...this.listeners]) listener(state);
  }

  /** Waits until `at`, a touch that the throttle allows (if `touchable`), or the close. */
  private wait(at: number, touchable: boolean): Promise<Wake> {
    if (this.closing) return Promise.resolve("close");
    return new Promise((resolve) => {
      const done = (why: Wake): void => {
        if (timer !== undefined) clearTimeout(timer);
        this.wake = undefined;
        resolve(why);
      };
      // No timer for "never": setTimeout would take an infinite delay as 1 ms.
      const timer = Number.isFinite(at) ? setTimeout(() => done("renew"), Math.max(0, at - now())) : undefined;
      this.wake = (why) => {
        if (why === "close") done("close");
        else if (touchable) done("renew");
      };
    });
  }

  private async heartbeat(): Promise<UnregisterResponse> {
    const backoff = this.channel.config.reconnect;
    const retryDelay = (failures: number): number => Math.min(backoff.delay(failures), this.heartbeatMs);
    // The first beat is jittered over a whole interval (seed 000).
    let nextBeat = now() + jitter(this.heartbeatMs);
    let failures = 0;
    // Rooms still to be joined again after a re-register (the rejoin could not be sent).
    let rejoinPending = false;
    for (;;) {
      if ((await this.wait(nextBeat, true)) === "close") return this.finish();
      const started = now();
      this.lastRenewal = started;
      const generation = this.currentGeneration;
      try {
        await this.channel.renew({ userId: this.userId, sessionId: this.sessionId, generation, ttlMs: this.ttlMs });
        failures = 0;
        if (rejoinPending) rejoinPending = !(await this.rejoin());
        if (this.currentState.kind === "lost") this.setState({ kind: "live", generation });
        nextBeat = started + this.heartbeatMs;
        continue;
      } catch (err) {
        const error = ConnectError.from(err);
        if (error.code === Code.NotFound) {
          // Register again until it works or the session is closed.
          for (;;) {
            const attempted = now();
            try {
              // What the session said goes with it: the new generation starts with nothing.
              const request = registerRequest(this.identity, this.ttlMs, this.deviceKind, this.said);
              const registered = await this.channel.register(request);
              this.lastRenewal = attempted;
              this.currentGeneration = registered.generation;
              rejoinPending = !(await this.rejoin());
              this.setState({ kind: "reregistered", generation: registered.generation });
              failures = 0;
              nextBeat = attempted + this.heartbeatMs;
              break;
            } catch {
              this.setState({ kind: "lost" });
              const at = now() + retryDelay(failures);
              failures++;
              if ((await this.wait(at, false)) === "close") return this.finish();
            }
          }
        } else if (error.code === Code.FailedPrecondition) {
          this.setState({ kind: "superseded" });
          while ((await this.wait(Number.POSITIVE_INFINITY, false)) !== "close") {
            // Only the close ends a superseded session.
          }
          return this.finish();
        } else if (error.code === Code.ResourceExhausted) {
          // Shed under overload (B2), or refused by a full local queue: the lease is
          // most likely alive, and the next heartbeat carries the same information.
          nextBeat = started + this.heartbeatMs;
        } else {
          this.setState({ kind: "lost" });
          nextBeat = now() + retryDelay(failures);
          failures++;
        }
      }
    }
  }

  /** The heartbeat's last act: unregister. */
  private async finish(): Promise<UnregisterResponse> {
    try {
      return await this.channel.unregister({
        userId: this.userId,
        sessionId: this.sessionId,
        generation: this.currentGeneration,
        lingerMs: this.lingerMs,
      });
    } finally {
      this.setState({ kind: "closed" });
    }
  }

  /**
   * Joins every remembered room again with the current generation, as one
   * batch per `maxBatch` rooms. False when some join could not be sent or was
   * shed, so that it is tried again after the next renewal; a join refused
   * because the lease is gone or superseded is left to the renewals.
   */
  private rejoin(): Promise<boolean> {
    return this.inTurn(async () => {
      const generation = this.currentGeneration;
      const items = [...this.joined].map(([roomId, metadata]) => ({
        op: { case: "join" as const, value: { ...this.sessionCall(roomId, generation), metadata } },
      }));
      let done = true;
      for (let i = 0; i < items.length; i += this.channel.config.maxBatch) {
        let results;
        try {
          results = await this.channel.submitBatch(items.slice(i, i + this.channel.config.maxBatch));
        } catch {
          done = false;
          continue;
        }
        for (const result of results) {
          try {
            leaseResult(result);
          } catch (err) {
            const code = ConnectError.from(err).code;
            if (code === Code.Unavailable || code === Code.ResourceExhausted) done = false;
          }
        }
      }
      return done;
    });
  }

  /**
   * `call` with the current generation; once more with the new one when it was
   * refused as from a lost or older lease while a re-register moved the
   * generation on (the call raced the re-register, not the lease's end).
   */
  private async withGeneration<T>(call: (generation: bigint) => Promise<T>): Promise<T> {
    const generation = this.currentGeneration;
    try {
      return await call(generation);
    } catch (err) {
      const code = ConnectError.from(err).code;
      if ((code === Code.NotFound || code === Code.FailedPrecondition) && this.currentGeneration !== generation) {
        return call(this.currentGeneration);
      }
      throw err;
    }
  }

  /** Runs `call` after every room call made before it has settled. */
  private inTurn<T>(call: () => Promise<T>): Promise<T> {
    const turn = this.roomTurn.then(call, call);
    this.roomTurn = turn.catch(() => undefined);
    return turn;
  }

  /** The user, session and generation a room call names, and its room. */
  private sessionCall(roomId: string, generation: bigint): { userId: string; sessionId: string; generation: bigint; roomId: string } {
    return { userId: this.userId, sessionId: this.sessionId, generation, roomId };
  }
}

/** A register that says again all the session has said of its human (A1). */
function registerRequest(identity: SessionIdentity, ttlMs: number, deviceKind: DeviceKind | undefined, said: Said) {
  return {
    userId: identity.userId,
    sessionId: identity.sessionId,
    gatewayId: identity.gatewayId,
    ttlMs,
    metadata: identity.metadata ?? {},
    deviceKind: deviceKind ?? DeviceKind.DEVICE_UNSPECIFIED,
    attention: said.attention,
    focusedRoomId: said.focusedRoomId === "" ? undefined : said.focusedRoomId,
  };
}
