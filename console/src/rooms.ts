/**
 * What the console's Rooms list decides on its own, kept apart from the page
 * so that it is tested on its own (`test/rooms.test.ts`): the room ids an
 * operator typed or pasted, past the cap or not, what an update of the open
 * watch changes, and the line above the table.
 */

/** The room ids in `text` and how many distinct ones were left out past `cap`. */
export interface ParsedRooms {
  /** Distinct, in the order given, at most `cap`. */
  roomIds: string[];
  /** Distinct room ids past the cap, left out. */
  over: number;
}

/**
 * The room ids of `text`: one per line or separated by commas (a room id may
 * hold spaces; those around it are trimmed), blanks skipped, each once in the
 * order first given, at most `cap` of them.
 */
export function parseRoomIds(text: string, cap: number): ParsedRooms {
  const distinct = [...new Set(text.split(/[\r\n,]+/).map((id) => id.trim()).filter((id) => id !== ""))];
  return { roomIds: distinct.slice(0, Math.max(0, cap)), over: Math.max(0, distinct.length - Math.max(0, cap)) };
}

/** What the page says when room ids were left out past the cap; undefined when none were. */
export function capMessage(parsed: ParsedRooms, cap: number): string | undefined {
  if (parsed.over === 0) return undefined;
  const given = parsed.roomIds.length + parsed.over;
  return (
    `${given.toLocaleString("en")} rooms given, more than the ${cap.toLocaleString("en")} one watch can follow: ` +
    `the first ${cap.toLocaleString("en")} are shown, the last ${parsed.over.toLocaleString("en")} left out.`
  );
}

/** What changes from the rooms watched to `next`: the rooms to add and those to remove. */
export function roomsChange(current: readonly string[], next: readonly string[]): { add: string[]; remove: string[] } {
  const now = new Set(current);
  const wanted = new Set(next);
  return {
    add: next.filter((roomId) => !now.has(roomId)),
    remove: current.filter((roomId) => !wanted.has(roomId)),
  };
}

/** The line above the table: how many rooms, how many with someone in them, and how many not counted yet. */
export function roomsSummary(watched: number, counts: Iterable<{ users: number }>): string {
  let counted = 0;
  let occupied = 0;
  for (const count of counts) {
    counted++;
    if (count.users > 0) occupied++;
  }
  const rooms = `${watched.toLocaleString("en")} room${watched === 1 ? "" : "s"}`;
  const waiting = watched - counted;
  return `${rooms}, ${occupied.toLocaleString("en")} with someone in ${occupied === 1 ? "it" : "them"}` +
    (waiting > 0 ? ` (${waiting.toLocaleString("en")} not counted yet)` : "");
}
