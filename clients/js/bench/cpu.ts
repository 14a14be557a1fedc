/** What the benchmarks share: the CPU time another process has used. */
import { execFileSync } from "node:child_process";
import { readFileSync } from "node:fs";

/** Clock ticks per second, the unit of /proc's CPU times. */
export const clockTicks = (() => {
  try {
    return Number(execFileSync("getconf", ["CLK_TCK"], { encoding: "utf8" }).trim()) || 100;
  } catch {
    return 100;
  }
})();

/** user+system CPU seconds of a process, from /proc (Linux only; undefined elsewhere). */
export function procCpuSeconds(pid: number): number | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    // Fields after the command name, which may itself hold spaces: utime and stime are 14 and 15.
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    const ticks = Number(fields[11]) + Number(fields[12]);
    return ticks / clockTicks;
  } catch {
    return undefined;
  }
}
