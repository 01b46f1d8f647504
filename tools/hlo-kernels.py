"""What a GPU compiler made of a training step, read from its optimized HLO text (XLA's
`*after_optimizations.txt`, or JAX's `compiled.as_text()`): per layer, the kernels the layer
loops launch, by kind (fusions by their emitter, library calls, collectives, copies), how the
matmuls and attention are lowered, and the bytes the fusions read and write.

usage: python3 hlo-kernels.py OPTIMIZED_HLO.txt [--layers L] [--json]

A layer is one trip of a while loop that runs L times (the forward and the backward layer loops
of a remat step; a scan's loops in JAX); loops nested in a layer loop count with their trip
counts. Instructions that launch nothing (parameters, tuples, bitcasts, constants, ...) are not
counted.

The bytes a fusion reads are its operands' whole shapes: a fusion that dynamic-slices one layer
out of a stacked [L, ...] operand counts all L layers, so the figure is an upper bound on what
moves, dominated by the stacked weights and saved activations.
"""
import json
import re
import sys
from collections import Counter

NO_KERNEL = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain",
}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}

INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
SHAPE = re.compile(r"\b(pred|[sufb]f?\d+|f8e4m3fn|f8e5m2)\[([\d,]*)\]")


def shape_bytes(text):
    """Bytes of every array shape in a (possibly tuple) shape string."""
    total = 0
    for ty, dims in SHAPE.findall(text):
        if ty not in DTYPE_BYTES:
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * DTYPE_BYTES[ty]
    return total


def parse(text):
    """Computations: name -> list of (name, shape, opcode, rest)."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$", line)
        if m:
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = cur
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is None:
            continue
        m = INSTR.match(line)
        if m:
            comps[cur].append(m.groups())
    return comps


def kernel_kind(name, opcode, rest):
    if opcode == "async-start":
        # e.g. %all-gather-start.3, %dynamic-slice-start.1 (a host -> device copy when offloaded)
        op = re.sub(r"[.\d]+$", "", name).replace("-start", "")
        if op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
            return "collective: " + op
        return "async: " + op
    if opcode == "fusion":
        m = re.search(r'"kind":"(__[\w$]+)"', rest)
        if m:
            kind = m.group(1)
            if "gemm" in kind:
                return "matmul: " + kind
            return "fusion: " + kind
        m = re.search(r"kind=(k\w+)", rest)
        return "fusion: " + (m.group(1) if m else "?")
    if opcode == "custom-call":
        m = re.search(r'custom_call_target="([^"]+)"', rest)
        target = m.group(1) if m else "?"
        if "cublas" in target or "gemm" in target.lower():
            return "matmul: " + target
        if "fmha" in target or "cudnn" in target:
            return "attention: " + target
        return "custom-call: " + target
    if opcode.endswith("-start") or opcode in ("all-gather", "all-reduce", "reduce-scatter",
                                                "all-to-all", "collective-permute"):
        return "collective: " + opcode.replace("-start", "")
    if opcode.endswith("-done"):
        return None
    if opcode in ("copy",):
        return "copy"
    if opcode in ("while", "conditional", "call"):
        return None
    return "other: " + opcode


def trip_count(rest):
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
    return int(m.group(1)) if m else None


def count(comps, comp, mult, kinds, io, seen=()):
    """Add the kernels of computation `comp` (run `mult` times) to `kinds`, and the bytes its
    fusions read and write to `io`; recurse into nested loops."""
    shapes = {name: shape for name, shape, _, _ in comps.get(comp, [])}
    for name, shape, opcode, rest in comps.get(comp, []):
        if opcode in NO_KERNEL:
            continue
        if opcode == "while":
            body = re.search(r"body=%([\w.\-]+)", rest).group(1)
            n = trip_count(rest) or 1
            if body not in seen:
                count(comps, body, mult * n, kinds, io, seen + (body,))
            continue
        kind = kernel_kind(name, opcode, rest)
        if kind is None:
            continue
        kinds[kind] += mult
        if opcode == "fusion" or kind.startswith(("matmul", "attention")):
            args = rest.split(")", 1)[0]
            read = sum(shape_bytes(shapes.get(a.strip().lstrip("%"), "")) for a in args.split(","))
            io["read"] += mult * read
            io["written"] += mult * shape_bytes(shape)


def analyse(text, layers):
    comps = parse(text)
    entry = comps.get("__entry__")
    loops = []
    for name, shape, opcode, rest in comps[entry]:
        if opcode == "while" and trip_count(rest) == layers:
            loops.append(re.search(r"body=%([\w.\-]+)", rest).group(1))
    kinds, io = Counter(), Counter()
    for body in loops:
        count(comps, body, 1, kinds, io, (body,))
    whole, whole_io = Counter(), Counter()
    count(comps, entry, 1, whole, whole_io)
    layout = re.search(r"entry_computation_layout", text) is not None
    return {
        "layer_loops": len(loops),
        "kernels_per_layer": sum(kinds.values()),
        "per_layer": dict(sorted(kinds.items())),
        "fusion_bytes_per_layer": {"read": io["read"], "written": io["written"]},
        "kernels_per_step": sum(whole.values()),
        "fusion_bytes_per_step": {"read": whole_io["read"], "written": whole_io["written"]},
        "parsed": layout,
    }


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        sys.exit(2)
    layers = int(args[args.index("--layers") + 1]) if "--layers" in args else None
    text = open(args[0]).read()
    if layers is None:
        counts = Counter(int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', text))
        layers = max(counts, key=lambda n: (counts[n], n)) if counts else 1
    r = analyse(text, layers)
    r["layers"] = layers
    if "--json" in args:
        print(json.dumps(r))
        return
    print(f"{r['layer_loops']} layer loops of {layers} trips; {r['kernels_per_layer']} kernels per layer, "
          f"{r['kernels_per_step']} per step")
    for k, v in r["per_layer"].items():
        print(f"  {v:5d}  {k}")
    b = r["fusion_bytes_per_layer"]
    print(f"  fusions and library calls per layer read {b['read'] / 1e9:.2f} GB, write {b['written'] / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
