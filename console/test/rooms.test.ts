import assert from "node:assert/strict";
import { test } from "node:test";

import { capMessage, parseRoomIds, roomsChange, roomsSummary } from "../src/rooms.js";

test("room ids come one per line or separated by commas, trimmed, each once in the order given", () => {
  assert.deepEqual(parseRoomIds("doc-1\ndoc-2, doc-3\r\n\n ,doc-1,, lobby 2 \n", 10_000), {
    roomIds: ["doc-1", "doc-2", "doc-3", "lobby 2"],
    over: 0,
  });
  assert.deepEqual(parseRoomIds("  \n , \n", 10_000), { roomIds: [], over: 0 }, "nothing but blanks");
});

test("past the cap the first room ids are kept and the page says how many were left out", () => {
  const text = Array.from({ length: 10_003 }, (_, i) => `room-${i}`).join("\n") + "\nroom-0\n";
  const parsed = parseRoomIds(text, 10_000);
  assert.equal(parsed.roomIds.length, 10_000);
  assert.equal(parsed.roomIds[9_999], "room-9999");
  assert.equal(parsed.over, 3, "a repeated id is not counted twice");
  assert.equal(
    capMessage(parsed, 10_000),
    "10,003 rooms given, more than the 10,000 one watch can follow: the first 10,000 are shown, the last 3 left out.",
  );
  const exactly = parseRoomIds(Array.from({ length: 10_000 }, (_, i) => `r${i}`).join(","), 10_000);
  assert.deepEqual([exactly.roomIds.length, exactly.over], [10_000, 0]);
  assert.equal(capMessage(exactly, 10_000), undefined, "no message at the cap itself");
});

test("a new list changes the open watch by the rooms added and removed", () => {
  assert.deepEqual(roomsChange(["a", "b", "c"], ["c", "d", "a"]), { add: ["d"], remove: ["b"] });
  assert.deepEqual(roomsChange(["a"], ["a"]), { add: [], remove: [] });
});

test("the summary counts the rooms, those with someone in them, and those not counted yet", () => {
  assert.equal(roomsSummary(3, [{ users: 2 }, { users: 0 }, { users: 1 }]), "3 rooms, 2 with someone in them");
  assert.equal(roomsSummary(1, [{ users: 1 }]), "1 room, 1 with someone in it");
  assert.equal(roomsSummary(12_000, [{ users: 0 }]), "12,000 rooms, 0 with someone in them (11,999 not counted yet)");
});
