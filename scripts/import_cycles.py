#!/usr/bin/env python3
"""The import graph of one crate's modules, and the cycles in it.

    scripts/import_cycles.py [SRC]     (default crates/presence-server/src)

Every `crate::x::...` path in a file (on `use` lines and inline; comment
lines and `#[cfg(test)]` modules at the end of a file left out) is an arrow
from that file's module to module `x` (for `crate::x::y` where `x/y.rs`
exists, to `x::y`); so are `super::x` paths, and a folder module's
(`x/mod.rs`) paths to its own children (`y::...`). Prints the arrows'
count, every strongly connected set of more than one module (an import
circle), every two-module cycle, and the arrows between the server's
folders against the one direction `api -> cluster -> node`.
Exit status 0 whatever it finds: it measures, it does not judge.
"""

import os
import re
import sys
from collections import defaultdict


def modules(src):
    """Module path -> file, for every .rs file below `src`."""
    found = {}
    for root, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)[:-3].split(os.sep)
            if rel[-1] == "mod":
                rel = rel[:-1]
            module = "::".join(rel)
            if module in ("lib", "main"):
                module = "crate"
            found[module] = path
    return found


def code_of(path):
    """The file's lines that are code: no comments, no trailing test module."""
    lines = open(path, encoding="utf-8").read().split("\n")
    for index, line in enumerate(lines):
        if line.startswith("#[cfg(test)]") and index + 1 < len(lines) and lines[index + 1].startswith("mod tests"):
            lines = lines[:index]
            break
    return [line for line in lines if not line.lstrip().startswith("//")]


def resolve(found, parts):
    """The longest prefix of `parts` that names a module of the crate."""
    for length in range(len(parts), 0, -1):
        target = "::".join(parts[:length])
        if target in found:
            return target
    return None


def arrows(found):
    graph = defaultdict(set)
    for module, path in found.items():
        folder = path.endswith(os.sep + "mod.rs")
        parent = module.rsplit("::", 1)[0] if "::" in module else "crate"
        for line in code_of(path):
            relative = []
            for match in re.finditer(r"(?<![\w:])super::((?:\w+::)*\w+)", line):
                relative.append(([] if parent == "crate" else parent.split("::")) + match.group(1).split("::"))
            if folder:
                for match in re.finditer(r"(?<![\w:])(\w+)::", line):
                    if f"{module}::{match.group(1)}" in found:
                        relative.append(module.split("::") + [match.group(1)])
            for parts in relative:
                target = resolve(found, parts)
                if target and target != module:
                    graph[module].add(target)
            for match in re.finditer(r"crate::((?:\w+::)*\w+)", line):
                parts = match.group(1).split("::")
                # The longest prefix that names a module of the crate.
                for length in range(len(parts), 0, -1):
                    target = "::".join(parts[:length])
                    if target in found:
                        break
                else:
                    continue
                # `use crate::{a, b}` names several: count each.
                if target != module and target != "crate":
                    graph[module].add(target)
            for group in re.finditer(r"crate::\{([^}]*)\}", line):
                for name in re.findall(r"\b(\w+)\b(?:::|,|\s|$)", group.group(1)):
                    if name in found and name != module:
                        graph[module].add(name)
    return graph


def strongly_connected(graph, nodes):
    """Tarjan's algorithm, iterative."""
    index, low, on_stack, stack, sets = {}, {}, set(), [], []
    counter = [0]

    def visit(start):
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                sets.append(sorted(members))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return sets


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "crates/presence-server/src"
    found = modules(src)
    graph = arrows(found)
    count = sum(len(targets) for targets in graph.values())
    print(f"{len(found)} modules, {count} arrows (module -> module it names)")
    circles = [members for members in strongly_connected(graph, found) if len(members) > 1]
    for members in sorted(circles, key=len, reverse=True):
        print(f"circle of {len(members)}: {' '.join(members)}")
    pairs = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())})
    for a, b in pairs:
        print(f"two-module cycle: {a} <-> {b}")
    print(f"{len(circles)} circles, {len(pairs)} two-module cycles")
    # The folders' one direction: api -> cluster -> node, never back.
    rank = {"node": 0, "cluster": 1, "api": 2}
    folder_of = lambda module: module.split("::")[0]
    against = sorted(
        (a, b) for a in graph for b in graph[a]
        if folder_of(a) in rank and folder_of(b) in rank and rank[folder_of(a)] < rank[folder_of(b)]
    )
    for a, b in against:
        print(f"against api -> cluster -> node: {a} -> {b}")
    print(f"{len(against)} arrows against the folders' direction")


if __name__ == "__main__":
    main()
