#!/usr/bin/env python3
"""The copies inside loop bodies of a compiler's optimized HLO (XLA's `*after_optimizations.txt`
or a program dir's `*.optimized.txt`): for each while loop, named by its op_name, the copy
instructions of its body computation with their shapes and bytes, and whether the copied value
is as large as one of the loop's carried buffers (a copy of loop-carried state every trip, the
thing nested attention loops must not do). Copies inside fusions are not listed: they are not
kernels of their own.

    tools/hlo-loop-copies.py FILE [--all]     (--all: every loop, not only the attention's)
"""
import re
import sys

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def shape_bytes(text):
    total = 0
    for ty, dims in re.findall(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]", text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * BYTES.get(ty, 4)
    return total


def computations(lines):
    comps, name, body = {}, None, []
    for line in lines:
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            name, body = m.group(1), []
            comps[name] = body
        elif line.startswith("}"):
            name = None
        elif name:
            body.append(line)
    return comps


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    lines = open(sys.argv[1]).read().splitlines()
    every = "--all" in sys.argv
    comps = computations(lines)
    found = 0
    for line in lines:
        m = re.search(r"= (\(.*?\)) while\(.*body=%?([\w.\-]+).*op_name=\"([^\"]*)\"", line)
        if not m:
            continue
        carried, body, op = m.groups()
        if not every and "attention" not in op:
            continue
        largest = max((shape_bytes(t) for t in carried.split(", ")), default=0)
        copies = [l for l in comps.get(body, []) if re.search(r"\scopy\(", l)]
        big = [l for l in copies if shape_bytes(l.split(" copy(")[0]) >= largest > 0]
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        print(f"{op} ({trips.group(1) if trips else '?'} trips, largest carried buffer "
              f"{largest} bytes): {len(copies)} copies, {len(big)} of a carried buffer's size")
        for l in copies:
            head = l.split(" copy(")[0].strip()
            print(f"    {head}  [{shape_bytes(head)} bytes]")
        found += len(big)
    print(f"copies of a loop-carried buffer's size inside attention loop bodies: {found}")


if __name__ == "__main__":
    main()
