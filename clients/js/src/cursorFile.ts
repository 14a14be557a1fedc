/**
 * A change feed consumer's cursor in a file, for Node: one line of hex (what
 * `presenced changes --cursor-file` and the Rust client's `FileCursorStore`
 * read and write too), replaced atomically.
 */
import { open, readFile, rename, rm } from "node:fs/promises";
import { dirname } from "node:path";

import { type CursorStore, cursorFromHex, cursorToHex } from "./changes.js";

/**
 * The cursor in `path`: written to `PATH.tmp`, synced, renamed over the
 * file, and the directory synced, so that a crash leaves the old cursor or
 * the new one, never a torn one. A missing or empty file holds no cursor;
 * one holding anything else is refused, naming the file.
 */
export class FileCursorStore implements CursorStore {
  constructor(readonly path: string) {}

  async load(): Promise<Uint8Array | undefined> {
    let text: string;
    try {
      text = (await readFile(this.path, "utf8")).trim();
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === "ENOENT") return undefined;
      throw err;
    }
    if (text === "") return undefined;
    try {
      return cursorFromHex(text);
    } catch (err) {
      throw new Error(`${this.path}: ${(err as Error).message}`);
    }
  }

  async save(cursor: Uint8Array): Promise<void> {
    const temporary = `${this.path}.tmp`;
    try {
      const file = await open(temporary, "w");
      try {
        await file.writeFile(`${cursorToHex(cursor)}\n`);
        await file.sync();
      } finally {
        await file.close();
      }
      await rename(temporary, this.path);
      // The rename is durable once the directory that holds the name is synced.
      const dir = await open(dirname(this.path), "r");
      try {
        await dir.sync();
      } finally {
        await dir.close();
      }
    } catch (err) {
      await rm(temporary, { force: true });
      throw err;
    }
  }
}
