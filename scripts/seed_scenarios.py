#!/usr/bin/env python3
"""Play seed 000's four timelines against presenced with a client that knows no .proto.

What it shows
-------------
A standard gRPC client that nobody on the team wrote (Python's official grpcio +
grpcio-reflection + protobuf), knowing only what server reflection tells it, can:

* list the services (presence.v1.Presence, grpc.health.v1.Health and both
  grpc.reflection.v1 and grpc.reflection.v1alpha ServerReflection), fetch the
  presence.v1 file descriptors through reflection and build every request and
  response message dynamically (contract O2);
* talk reflection v1 with a raw stream call (the v1 messages are built from the
  v1alpha descriptors' shape, renamed to package grpc.reflection.v1);
* get SERVING from grpc.health.v1.Health/Check;
* play the scenarios of seed 000 ("The delayed disconnect") and see the contract hold,
  with one Watch stream on all scenario users recording every event and its arrival time:
    a. two devices, one closes: one ONLINE event only (L1, L3, M3, E1)
    b. the last device dies silently: exactly one OFFLINE, timer driven, lag measured (L4)
    c. delayed close of the old connection is rejected by the generation check (L1-L3)
    d. renew after revoke is rejected and revives nothing (L2, L6)
    e. bad input gets INVALID_ARGUMENT naming the field, state intact (B1, L5)
  "Exactly one" / "no event" checks use a sentinel user watched by the same stream:
  after the actions the sentinel is flipped, its event awaited, and the assertions are
  made on what arrived before it (events reach one viewer in publication order).

Every check prints one PASS/FAIL line; the exit status is 1 if any check failed.

How to run
----------
    python3 -m venv /tmp/pyg && /tmp/pyg/bin/pip install grpcio grpcio-reflection protobuf
    cargo build
    /tmp/pyg/bin/python scripts/seed_scenarios.py --spawn target/debug/presenced
or against a running server (it must accept a 300 ms TTL, e.g. --min-ttl-ms 50):
    /tmp/pyg/bin/python scripts/seed_scenarios.py --addr 127.0.0.1:50051 [--token TOKEN]

With --spawn the script starts `PATH serve --listen 127.0.0.1:0 --min-ttl-ms 50`, reads
the `listening on ADDR` line, and at the end stops it with SIGTERM and checks exit
status 0. User ids are unique per run, so runs against one server do not interfere.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

try:
    import grpc
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_reflection_pb2
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )
except ImportError as e:  # pragma: no cover
    sys.exit(
        f"missing Python package ({e}); run: python3 -m venv /tmp/pyg && "
        "/tmp/pyg/bin/pip install grpcio grpcio-reflection protobuf"
    )

PRESENCE = "presence.v1.Presence"
HEALTH = "grpc.health.v1.Health"
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"

RPC_TIMEOUT = 5.0  # seconds, for every unary call
EVENT_TIMEOUT = 5.0  # seconds, to await an event that must come
EXPIRY_LAG_MAX_MS = 150  # scenario b: deadline -> OFFLINE arrival


def now_ms():
    return time.time() * 1000.0


# --------------------------------------------------------------------------- checks

class Checks:
    def __init__(self):
        self.failed = 0
        self.passed = 0

    def check(self, name, ok, detail=""):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        line = f"{'PASS' if ok else 'FAIL'} {name}"
        if detail:
            line += f": {detail}"
        print(line, flush=True)
        return ok


def short(msg):
    """A one-line text form of a protobuf message."""
    from google.protobuf import text_format

    return "{" + text_format.MessageToString(msg, as_one_line=True) + "}"


# --------------------------------------------------------------------------- server

class SpawnedServer:
    def __init__(self, path):
        self.log = tempfile.NamedTemporaryFile(prefix="presenced-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [path, "serve", "--listen", "127.0.0.1:0", "--min-ttl-ms", "50"],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        first = []
        got = threading.Event()

        def read_stdout():
            for line in self.proc.stdout:
                if not got.is_set():
                    first.append(line.rstrip("\n"))
                    got.set()
            got.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        if not got.wait(15) or not first or not first[0].startswith("listening on "):
            self.proc.kill()
            raise SystemExit(
                f"server did not print 'listening on ADDR' first (got {first!r}); log: {self.log.name}"
            )
        self.addr = first[0][len("listening on "):].strip()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


# --------------------------------------------------------------------------- dynamic client

class DynamicService:
    """Unary and server-streaming stubs for one service, built from a DescriptorPool."""

    def __init__(self, channel, pool, service_name, metadata):
        self.desc = pool.FindServiceByName(service_name)
        self.metadata = metadata
        self.methods = {}
        for m in self.desc.methods:
            req = message_factory.GetMessageClass(m.input_type)
            resp = message_factory.GetMessageClass(m.output_type)
            path = f"/{self.desc.full_name}/{m.name}"
            if m.client_streaming:
                call = channel.stream_stream(path, req.SerializeToString, resp.FromString) \
                    if m.server_streaming else channel.stream_unary(path, req.SerializeToString, resp.FromString)
            elif m.server_streaming:
                call = channel.unary_stream(path, req.SerializeToString, resp.FromString)
            else:
                call = channel.unary_unary(path, req.SerializeToString, resp.FromString)
            self.methods[m.name] = (req, resp, call, m)

    def request(self, method, **fields):
        req_cls = self.methods[method][0]
        msg = req_cls()
        for k, v in fields.items():
            f = getattr(msg, k)
            if hasattr(f, "extend") and isinstance(v, (list, tuple)):
                f.extend(v)
            elif hasattr(f, "update") and isinstance(v, dict):
                f.update(v)
            else:
                setattr(msg, k, v)
        return msg

    def call(self, method, **fields):
        """Returns (request, response, None) or (request, None, grpc.RpcError)."""
        req = self.request(method, **fields)
        stub = self.methods[method][2]
        try:
            return req, stub(req, timeout=RPC_TIMEOUT, metadata=self.metadata), None
        except grpc.RpcError as e:
            return req, None, e

    def stream(self, method, **fields):
        req = self.request(method, **fields)
        return req, self.methods[method][2](req, metadata=self.metadata)

    def enum_value(self, enum_full_name, value_name, pool):
        return pool.FindEnumTypeByName(enum_full_name).values_by_name[value_name].number


def reflection_v1_classes():
    """grpc.reflection.v1 request/response classes, from the v1alpha descriptors' shape.

    v1 is v1alpha moved to another package (same messages, same field numbers), so the
    v1alpha FileDescriptorProto is copied with its package and type references renamed.
    """
    fdp = descriptor_pb2.FileDescriptorProto()
    v1alpha_reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = "grpc/reflection/v1/reflection.proto"
    fdp.package = "grpc.reflection.v1"

    def rename(msgs):
        for m in msgs:
            for f in m.field:
                if f.type_name.startswith(".grpc.reflection.v1alpha."):
                    f.type_name = ".grpc.reflection.v1." + f.type_name[len(".grpc.reflection.v1alpha."):]
            rename(m.nested_type)

    rename(fdp.message_type)
    for s in fdp.service:
        for m in s.method:
            m.input_type = m.input_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
            m.output_type = m.output_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    req = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
    resp = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))
    return req, resp


# --------------------------------------------------------------------------- watch recorder

class WatchRecorder:
    """Reads one Watch stream in a background thread; records (arrival_ms, event)."""

    def __init__(self, presence, user_ids):
        self.cond = threading.Condition()
        self.events = []  # (arrival_ms, kind, UserPresence or [UserPresence])
        self.error = None
        self.done = False
        _, self.call = presence.stream("Watch", user_ids=user_ids)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for ev in self.call:
                t = now_ms()
                kind = ev.WhichOneof("event")
                if kind == "snapshot":
                    item = list(ev.snapshot.users)
                elif kind == "update":
                    item = ev.update
                else:
                    item = ev
                with self.cond:
                    self.events.append((t, kind, item))
                    self.cond.notify_all()
        except grpc.RpcError as e:
            with self.cond:
                self.error = e
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def wait_for(self, pred, timeout=EVENT_TIMEOUT):
        """Waits until pred(index, arrival_ms, kind, item) holds for some event; returns its index."""
        deadline = time.monotonic() + timeout
        with self.cond:
            start = 0
            while True:
                for i in range(start, len(self.events)):
                    t, kind, item = self.events[i]
                    if pred(i, t, kind, item):
                        return i
                start = len(self.events)
                left = deadline - time.monotonic()
                if left <= 0 or self.done:
                    return None
                self.cond.wait(left)

    def wait_update(self, user_id, state=None, version=None, after=0, timeout=EVENT_TIMEOUT):
        def pred(i, t, kind, item):
            return (i >= after and kind == "update" and item.user_id == user_id
                    and (state is None or item.state == state)
                    and (version is None or item.version == version))
        return self.wait_for(pred, timeout)

    def updates(self, user_id, start, end):
        with self.cond:
            return [(t, item) for (t, kind, item) in self.events[start:end]
                    if kind == "update" and item.user_id == user_id]

    def snapshots(self):
        with self.cond:
            return [(i, t, item) for i, (t, kind, item) in enumerate(self.events) if kind == "snapshot"]

    def count(self):
        with self.cond:
            return len(self.events)

    def stop(self):
        self.call.cancel()
        self.thread.join(5)


# --------------------------------------------------------------------------- scenarios

def run(addr, token, c):
    metadata = [("authorization", f"Bearer {token}")] if token else None
    channel = grpc.insecure_channel(addr)
    try:
        grpc.channel_ready_future(channel).result(timeout=10)
    except grpc.FutureTimeoutError:
        c.check("connect", False, f"no connection to {addr} within 10 s")
        return

    # ---- reflection v1alpha: services and descriptors
    db = ProtoReflectionDescriptorDatabase(channel)
    try:
        services = sorted(db.get_services())
    except grpc.RpcError as e:
        c.check("reflection v1alpha list_services", False, f"{e.code()} {e.details()}")
        return
    need = [PRESENCE, HEALTH, REFLECTION_V1, REFLECTION_V1ALPHA]
    missing = [s for s in need if s not in services]
    c.check("reflection v1alpha list_services", not missing,
            f"services={services}" + (f" missing={missing}" if missing else ""))
    pool = descriptor_pool.DescriptorPool(db)
    try:
        pres_desc = pool.FindServiceByName(PRESENCE)
    except KeyError as e:
        c.check("reflection descriptors for presence.v1.Presence", False, str(e))
        return
    methods = [m.name for m in pres_desc.methods]
    need_methods = ["Register", "Renew", "Unregister", "Revoke", "Snapshot", "Watch"]
    c.check("reflection descriptors for presence.v1.Presence",
            all(m in methods for m in need_methods),
            f"file={pres_desc.file.name} methods={methods}")

    # ---- reflection v1: raw stream call
    v1_req, v1_resp = reflection_v1_classes()
    v1_call = channel.stream_stream(f"/{REFLECTION_V1}/ServerReflectionInfo",
                                    v1_req.SerializeToString, v1_resp.FromString)
    try:
        reqs = [v1_req(list_services=""), v1_req(file_containing_symbol=PRESENCE)]
        resps = list(v1_call(iter(reqs), timeout=RPC_TIMEOUT, metadata=metadata))
        v1_services = sorted(s.name for s in resps[0].list_services_response.service) if resps else []
        missing = [s for s in need if s not in v1_services]
        c.check("reflection v1 list_services (raw stream)", len(resps) == 2 and not missing,
                f"services={v1_services}" + (f" missing={missing}" if missing else ""))
        files = []
        if len(resps) == 2:
            for raw in resps[1].file_descriptor_response.file_descriptor_proto:
                fdp = descriptor_pb2.FileDescriptorProto.FromString(raw)
                files.append(fdp.name)
        c.check("reflection v1 file_containing_symbol presence.v1.Presence",
                pres_desc.file.name in files, f"files={files}")
    except grpc.RpcError as e:
        c.check("reflection v1 list_services (raw stream)", False, f"{e.code()} {e.details()}")

    # ---- health, from the reflected grpc.health.v1 descriptors
    try:
        health = DynamicService(channel, pool, HEALTH, metadata)
        req, resp, err = health.call("Check", service="")
        serving = pool.FindEnumTypeByName(
            "grpc.health.v1.HealthCheckResponse.ServingStatus").values_by_name["SERVING"].number
        c.check("health Check(\"\") SERVING", err is None and resp.status == serving,
                f"{err.code()} {err.details()}" if err else short(resp))
        req, resp, err = health.call("Check", service=PRESENCE)
        c.check(f"health Check({PRESENCE}) SERVING", err is None and resp.status == serving,
                f"{err.code()} {err.details()}" if err else short(resp))
    except KeyError as e:
        c.check("health via reflection", False, f"descriptor missing: {e}")

    presence = DynamicService(channel, pool, PRESENCE, metadata)
    ONLINE = presence.enum_value("presence.v1.State", "STATE_ONLINE", pool)
    OFFLINE = presence.enum_value("presence.v1.State", "STATE_OFFLINE", pool)
    OUTCOME = pool.FindEnumTypeByName("presence.v1.UnregisterOutcome").values_by_name

    def state_name(v):
        return pool.FindEnumTypeByName("presence.v1.State").values_by_number[v].name

    run_id = uuid.uuid4().hex[:10]
    U1, U2, U3, U4, SENT = (f"seed000-{run_id}-{n}" for n in ("u1", "u2", "u3", "u4", "sentinel"))
    users = [U1, U2, U3, U4, SENT]
    print(f"# run {run_id}: users {users}", flush=True)

    w = WatchRecorder(presence, users)
    i0 = w.wait_for(lambda i, t, k, item: k == "snapshot")
    if i0 is None:
        c.check("watch opens with a snapshot", False,
                f"error={w.error.code() if w.error else None} {w.error.details() if w.error else ''}")
        return
    snap = w.snapshots()[0][2]
    # The snapshot's order is not specified for Watch (only Snapshot promises request order).
    c.check("watch opens with a snapshot of the requested users, all OFFLINE",
            sorted(u.user_id for u in snap) == sorted(users) and all(u.state == OFFLINE for u in snap),
            "[" + ", ".join(f"{u.user_id[-8:]}={state_name(u.state)}/v{u.version}" for u in snap) + "]")

    sentinel = {"gen": None, "online": False}

    def barrier():
        """Flips the sentinel and waits for its event; returns the event index (or None)."""
        if sentinel["online"]:
            req, resp, err = presence.call("Revoke", user_id=SENT, session_id="")
        else:
            req, resp, err = presence.call("Register", user_id=SENT, session_id="s",
                                           gateway_id="gw-sentinel", ttl_ms=0)
        if err is not None or not resp.changed:
            c.check("sentinel flip", False, f"request={short(req)} "
                    + (f"error={err.code()} {err.details()}" if err else f"response={short(resp)}"))
            return None
        sentinel["online"] = not sentinel["online"]
        idx = w.wait_update(SENT, state=resp.presence.state, version=resp.presence.version)
        if idx is None:
            c.check("sentinel event arrives", False,
                    f"no update {state_name(resp.presence.state)} v{resp.presence.version} for the sentinel "
                    f"within {EVENT_TIMEOUT}s")
        return idx

    def err_text(err):
        return f"{err.code().name} {err.details()!r}"

    def expect_ok(name, method, **fields):
        req, resp, err = presence.call(method, **fields)
        if err is not None:
            c.check(name, False, f"request={short(req)} error={err_text(err)}")
        return req, resp

    def expect_refused(name, code, method, **fields):
        """A call that must fail with `code`."""
        req, resp, err = presence.call(method, **fields)
        c.check(name, err is not None and err.code() == code,
                err_text(err) if err else f"request={short(req)} response={short(resp)}")

    def expect_state(name, user, state, label):
        """A Snapshot of `user`, which must show it in `state` (checked as `name: label`)."""
        req, s = expect_ok(name, "Snapshot", user_ids=[user])
        if s:
            c.check(f"{name}: {label}", s.users[0].state == state, short(s))

    def fmt_updates(ups, base_t=None):
        return "[" + ", ".join(
            f"{state_name(u.state)}/v{u.version}" + (f"@+{t - base_t:.0f}ms" if base_t else "")
            for t, u in ups) + "]"

    # ================================================================ a. two devices, one closes
    start_a = w.count()
    req, r1 = expect_ok("a. Register U1 phone", "Register", user_id=U1, session_id="phone",
                        gateway_id="gw-a", ttl_ms=0)
    if r1:
        c.check("a. Register U1 phone@gw-a: changed=true, ONLINE",
                r1.changed and r1.presence.state == ONLINE, short(r1))
    req, r2 = expect_ok("a. Register U1 laptop", "Register", user_id=U1, session_id="laptop",
                        gateway_id="gw-b", ttl_ms=0)
    if r2:
        c.check("a. Register U1 laptop@gw-b: changed=false, same version",
                not r2.changed and r2.presence.state == ONLINE
                and (r1 is None or r2.presence.version == r1.presence.version), short(r2))
    if r1:
        req, r3 = expect_ok("a. Unregister U1 phone", "Unregister", user_id=U1, session_id="phone",
                            generation=r1.generation, linger_ms=0)
        if r3:
            c.check("a. Unregister U1 phone(gen): removed=true, changed=false, ONLINE, REMOVED",
                    r3.removed and not r3.changed and r3.presence.state == ONLINE
                    and r3.outcome == OUTCOME["UNREGISTER_OUTCOME_REMOVED"].number, short(r3))
    req, s = expect_ok("a. Snapshot U1", "Snapshot", user_ids=[U1])
    if s:
        c.check("a. Snapshot U1: ONLINE", len(s.users) == 1 and s.users[0].user_id == U1
                and s.users[0].state == ONLINE, short(s))
    b = barrier()
    if b is not None:
        ups = w.updates(U1, start_a, b)
        c.check("a. watch saw exactly one update for U1 (ONLINE, the register's version)",
                len(ups) == 1 and ups[0][1].state == ONLINE
                and (r1 is None or ups[0][1].version == r1.presence.version), fmt_updates(ups))
    u1_before_e = s.users[0] if s else None

    # ================================================================ b. last device dies silently
    start_b = w.count()
    req, r = expect_ok("b. Register U2 laptop", "Register", user_id=U2, session_id="laptop",
                       gateway_id="gw-b", ttl_ms=300)
    if r:
        c.check("b. Register U2 laptop ttl=300ms: changed=true, ONLINE",
                r.changed and r.presence.state == ONLINE, short(r))
        gen = r.generation
        last_expires = r.expires_at_ms
        t0 = time.monotonic()
        renew_errors = []
        renewals = 0
        k = 1
        while True:
            target = t0 + 0.1 * k
            if target > t0 + 1.0 + 1e-6:
                break
            delay = target - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            req, rr, err = presence.call("Renew", user_id=U2, session_id="laptop", generation=gen, ttl_ms=300)
            if err is not None:
                renew_errors.append(f"#{k}: {err_text(err)}")
            else:
                renewals += 1
                last_expires = rr.expires_at_ms
            k += 1
        last_renew_sent = now_ms()
        c.check("b. U2 renewed every 100 ms for 1 s, all accepted", not renew_errors,
                f"{renewals} renewals, last expires_at_ms={last_expires}"
                + (f", errors={renew_errors}" if renew_errors else ""))
        mid = w.count()
        ups_during = w.updates(U2, start_b, mid)
        c.check("b. no OFFLINE for U2 while it renewed",
                all(u.state == ONLINE for _, u in ups_during), fmt_updates(ups_during))
        # The laptop dies silently: no more renewals. Await the OFFLINE.
        idx = w.wait_update(U2, state=OFFLINE, after=start_b, timeout=(last_expires - now_ms()) / 1000 + 3)
        if idx is None:
            c.check("b. OFFLINE for U2 arrives", False,
                    f"none within 3 s of expires_at_ms={last_expires}")
        else:
            arrival = w.events[idx][0]
            lag = arrival - last_expires
            print(f"# b. expiry lag (OFFLINE arrival - last expires_at_ms): {lag:.1f} ms "
                  f"({arrival - last_renew_sent:.1f} ms after the last renewal was answered)", flush=True)
            c.check(f"b. OFFLINE for U2 arrives at/after the deadline and within {EXPIRY_LAG_MAX_MS} ms",
                    0 <= lag <= EXPIRY_LAG_MAX_MS,
                    f"lag={lag:.1f} ms, expires_at_ms={last_expires}, arrival_ms={arrival:.1f}")
        expect_refused("b. Renew after expiry -> NOT_FOUND (revives nothing)", grpc.StatusCode.NOT_FOUND,
                       "Renew", user_id=U2, session_id="laptop", generation=gen, ttl_ms=300)
        expect_state("b. Snapshot U2", U2, OFFLINE, "OFFLINE")
        b = barrier()
        if b is not None:
            ups = w.updates(U2, start_b, b)
            offs = [u for _, u in ups if u.state == OFFLINE]
            c.check("b. watch saw exactly one OFFLINE for U2 (and one ONLINE before it)",
                    len(offs) == 1 and len(ups) == 2 and ups[0][1].state == ONLINE
                    and ups[1][1].version > ups[0][1].version, fmt_updates(ups))

    # ================================================================ c. delayed close of old conn
    start_c = w.count()
    req, g1 = expect_ok("c. Register U3 s@gw-a", "Register", user_id=U3, session_id="s",
                        gateway_id="gw-a", ttl_ms=0)
    req, g2 = expect_ok("c. Register U3 s@gw-b", "Register", user_id=U3, session_id="s",
                        gateway_id="gw-b", ttl_ms=0)
    if g1 and g2:
        c.check("c. reconnect with the same session id: gen2 > gen1, changed=false",
                g2.generation > g1.generation and g1.changed and not g2.changed
                and g2.presence.state == ONLINE,
                f"gen1={g1.generation} gen2={g2.generation} first={short(g1)} second={short(g2)}")
        req, un, err = presence.call("Unregister", user_id=U3, session_id="s",
                                     generation=g1.generation, linger_ms=0)
        c.check("c. late Unregister(gen1) from gw-a: removed=false, STALE_GENERATION, ONLINE",
                err is None and not un.removed and not un.changed
                and un.outcome == OUTCOME["UNREGISTER_OUTCOME_STALE_GENERATION"].number
                and un.presence.state == ONLINE,
                f"request={short(req)} " + (f"error={err_text(err)}" if err else f"response={short(un)}"))
        expect_refused("c. Renew(gen1) -> FAILED_PRECONDITION", grpc.StatusCode.FAILED_PRECONDITION,
                       "Renew", user_id=U3, session_id="s", generation=g1.generation, ttl_ms=0)
        req, rr, err = presence.call("Renew", user_id=U3, session_id="s", generation=g2.generation, ttl_ms=0)
        c.check("c. Renew(gen2) succeeds", err is None and rr.expires_at_ms > 0,
                err_text(err) if err else short(rr))
        expect_state("c. Snapshot U3", U3, ONLINE, "ONLINE")
        b = barrier()
        if b is not None:
            ups = w.updates(U3, start_c, b)
            c.check("c. watch saw one ONLINE and no OFFLINE for U3",
                    len(ups) == 1 and ups[0][1].state == ONLINE, fmt_updates(ups))

    # ================================================================ d. renew after revoke
    start_d = w.count()
    req, r = expect_ok("d. Register U4", "Register", user_id=U4, session_id="s", gateway_id="gw-a", ttl_ms=0)
    if r:
        c.check("d. Register U4: changed=true", r.changed and r.presence.state == ONLINE, short(r))
        req, rv, err = presence.call("Revoke", user_id=U4, session_id="")
        c.check("d. Revoke(U4): revoked=1, changed=true, OFFLINE",
                err is None and rv.revoked == 1 and rv.changed and rv.presence.state == OFFLINE,
                f"request={short(req)} " + (f"error={err_text(err)}" if err else f"response={short(rv)}"))
        if err is None:
            idx = w.wait_update(U4, state=OFFLINE, version=rv.presence.version, after=start_d)
            c.check("d. watch sees OFFLINE for U4 with the revoke's version", idx is not None,
                    f"version {rv.presence.version}")
        expect_refused("d. Renew(old gen) after revoke -> NOT_FOUND", grpc.StatusCode.NOT_FOUND,
                       "Renew", user_id=U4, session_id="s", generation=r.generation, ttl_ms=0)
        expect_state("d. Snapshot U4", U4, OFFLINE, "OFFLINE")
        b = barrier()
        if b is not None:
            ups = w.updates(U4, start_d, b)
            c.check("d. watch saw ONLINE then OFFLINE for U4, no second ONLINE",
                    [u.state for _, u in ups] == [ONLINE, OFFLINE], fmt_updates(ups))

    # ================================================================ e. bad input
    start_e = w.count()
    req, rr, err = presence.call("Register", user_id="", session_id="s", gateway_id="gw-a", ttl_ms=0)
    c.check("e. Register user_id=\"\" -> INVALID_ARGUMENT naming user_id",
            err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT and "user_id" in (err.details() or ""),
            err_text(err) if err else f"request={short(req)} response={short(rr)}")
    req, rr, err = presence.call("Register", user_id=U1, session_id="tablet", gateway_id="gw-a", ttl_ms=1)
    c.check("e. Register ttl_ms=1 -> INVALID_ARGUMENT naming ttl_ms",
            err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_ms" in (err.details() or ""),
            err_text(err) if err else f"request={short(req)} response={short(rr)}")
    req, s = expect_ok("e. Snapshot U1", "Snapshot", user_ids=[U1])
    if s and u1_before_e is not None:
        c.check("e. U1 unchanged after bad input (ONLINE, same version)",
                s.users[0].state == u1_before_e.state and s.users[0].version == u1_before_e.version,
                f"before={short(u1_before_e)} after={short(s.users[0])}")
    expect_refused("e. the rejected register created no lease (Renew -> NOT_FOUND)", grpc.StatusCode.NOT_FOUND,
                   "Renew", user_id=U1, session_id="tablet", generation=1, ttl_ms=0)
    b = barrier()
    if b is not None:
        ups = w.updates(U1, start_e, b)
        c.check("e. no event for U1 after bad input", not ups, fmt_updates(ups))

    # ================================================================ whole stream
    end = barrier()
    if end is not None:
        with w.cond:
            events = list(w.events[: end + 1])
        held = {u.user_id: u.version for u in snap}
        bad = []
        for t, kind, item in events[1:]:
            if kind == "snapshot":
                bad.append("resync snapshot")
            elif item.version <= held.get(item.user_id, 0):
                bad.append(f"{item.user_id[-8:]} v{item.version} not newer than v{held[item.user_id]}")
            else:
                held[item.user_id] = item.version
        c.check("watch: no resync, every update newer than the last held version", not bad, "; ".join(bad))
        expected = {U1: 1, U2: 2, U3: 1, U4: 2}
        counts = {u: len(w.updates(u, 0, end + 1)) for u in expected}
        c.check("watch: total updates per user as expected (nothing arrived out of order)",
                counts == expected, f"{ {u[-2:]: n for u, n in counts.items()} }")
    w.stop()
    # Clean up leases left by this run (matters only with --addr).
    for u in (U1, U3, SENT):
        presence.call("Revoke", user_id=u, session_id="")
    channel.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--addr", help="HOST:PORT of a running presenced")
    g.add_argument("--spawn", metavar="PATH", help="start PATH serve --listen 127.0.0.1:0 --min-ttl-ms 50")
    ap.add_argument("--token", help="sent as 'authorization: Bearer TOKEN' metadata")
    args = ap.parse_args()

    c = Checks()
    server = None
    addr = args.addr
    if args.spawn:
        server = SpawnedServer(args.spawn)
        addr = server.addr
        print(f"# spawned {args.spawn} (pid {server.proc.pid}) listening on {addr}; log {server.log.name}",
              flush=True)
    try:
        run(addr, args.token, c)
    finally:
        if server is not None:
            rc = server.stop()
            c.check("server stops on SIGTERM with exit status 0", rc == 0, f"exit status {rc}")
            if c.failed == 0:
                try:
                    os.unlink(server.log.name)
                except OSError:
                    pass
    print(f"# {c.passed} passed, {c.failed} failed", flush=True)
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    main()
