"""Where a TPU cost-model estimate goes, op by op: re-derives libtpu's `optimal_seconds` from an
optimized HLO module (XLA's `*after_optimizations.txt`) as the sum over the entry computation's
instructions of max(FLOPs / matmul rate, bytes accessed / memory rate), and prints it by
instruction kind and by op name (`metadata={op_name=...}`: xtrain's scopes, JAX's paths).

usage: python3 tools/hlo-roofline.py PATH [--target v5p|v6e|v5e] [--by kind|name|both] [--top N]

--target defaults to the chip the dump names (v5p and v6e are recognized; give it for a single
module file or a v5e dump).

PATH is an `XTRAIN_ESTIMATE_DUMP` directory (its `layers-1` and `layers-2` dumps: the figures are
then per layer, c(2) - c(1), as the estimate extrapolates them), one XLA dump directory, or an
optimized module file. A looped step's while loops are not opened up: pricing each body once
per trip this way came out 10% above the cost analysis's own figure for the bodies counted
once (25.6 vs 23.2 ms; slices of the stacks read through bitcasts are counted whole), so the
unrolled dumps are what it reads well.

How it was checked (libtpu 0.0.42.1): single ops compiled for each target give the rates below
(`x * 2` on a [8192, 8192] bf16 array is priced at its 268 MB read and written over the memory
rate; an 8192^3 bf16 matmul at its FLOPs over the matmul rate, which on v5p is 394 TFLOP/s, not
the 459 peak; an op's time is the larger of the two, and a program's is the sum of its ops').
On the 8B LoRA step (remat layer, batch 4, `tpu:v5p:2x2x1`) this script's sums come within 1%
of the cost analysis's for xtrain's unrolled 1- and 2-layer steps (21.59 vs 21.44 ms, 33.07 vs
33.23 ms) and for JAX's (25.85 vs 25.86 ms, 39.43 vs 39.92 ms). On v6e it is not that close:
for one remat-layer batch-16 step it gave 1.221 s where the cost analysis gave 1.115 s (v6e
modules fetch buffers in asynchronous slices, async-start / async-done joined by ConcatBitcast
calls, which it prices as a copy-start / copy-done pair; the cost model evidently does not).
Read v6e's figures for where the time goes, not for totals.

What it counts, as XLA's HloCostAnalysis does:
- bytes accessed: every operand's bytes and the result's, logical shapes (tiling padding not
  counted); a fusion's operand that it reads only through slices counts the slices' bytes. A
  copy-start (the memory-space assignment moving a buffer to or from the TPU's alternate memory,
  `S(1)` in a layout) counts its operand and both buffers of its result; the matching copy-done
  nothing (nor an async-done). Bitcasts, tuples, parameters, constants cost nothing.
- FLOPs: 2 per multiply-add of each convolution and dot inside a fusion, the valid window taps
  only (the TPU compiler writes batched matmuls as convolutions whose batch dims are dilated
  windows). Elementwise FLOPs are left out (they never decide the max here).
"""
import glob
import os
import re
import sys
from collections import Counter

# (matmul FLOP/s, memory bytes/s) per chip as libtpu 0.0.42.1's cost model prices them.
RATES = {"v5p": (394e12, 2.35e12), "v6e": (918e12, 1.638e12), "v5e": (197e12, 0.7377e12)}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
FREE = {"parameter", "constant", "get-tuple-element", "bitcast", "tuple", "copy-done", "async-done",
        "all-gather-done", "all-reduce-done", "collective-permute-done", "opt-barrier",
        "after-all", "partition-id", "replica-id"}

SHAPE = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64)\[([\d,]*)\]")
INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)(.*)$")
COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) [^\n]*\{\n(.*?)^\}", re.S | re.M)


def dims(text):
    return [int(d) for d in text.split(",") if d]


def shape_bytes(text):
    total = 0
    for dtype, d in SHAPE.findall(text):
        n = 1
        for x in dims(d):
            n *= x
        total += n * DTYPE_BYTES[dtype]
    return total


def instructions(body):
    for line in body.split("\n"):
        m = INSTR.match(line)
        if m:
            yield m.groups() + (line,)


def shapes_of(body):
    out = {}
    for name, shape, *_ in instructions(body):
        s = SHAPE.search(shape)
        if s:
            out[name] = dims(s.group(2))
    # A fused computation's parameters are declared in its header, not as instructions.
    return out


def window_taps(out_size, in_size, k, stride, pad_lo, lhs_dilate, rhs_dilate):
    """Kernel taps, summed over output positions, that land on an input element (not padding,
    not a hole of the lhs dilation)."""
    dilated = (in_size - 1) * lhs_dilate + 1
    taps = 0
    for o in range(out_size):
        for j in range(k):
            p = o * stride + j * rhs_dilate - pad_lo
            if 0 <= p < dilated and p % lhs_dilate == 0:
                taps += 1
    return taps


def matmul_flops(body):
    shapes = shapes_of(body)
    flops = 0
    for _, shape, op, args, rest, _ in instructions(body):
        if op not in ("convolution", "dot"):
            continue
        operands = re.findall(r"%([\w.\-]+)", args)
        lhs, rhs = shapes.get(operands[0]), shapes.get(operands[1])
        out = dims(SHAPE.search(shape).group(2))
        if lhs is None or rhs is None:
            continue
        if op == "dot":
            k = 1
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
            for i in dims(m.group(1)) if m else []:
                k *= lhs[i]
            n = 1
            for x in out:
                n *= x
            flops += 2 * n * k
            continue
        labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
        if not labels:
            continue
        ll, kl, ol = labels.groups()
        spatial = sum(c.isdigit() for c in kl)
        window = re.search(r"window=\{([^}]*)\}", rest)

        def field(key, default):
            m = re.search(key + r"=([\dx_]+)", window.group(1)) if window else None
            return m.group(1).split("x") if m else [default] * spatial

        size, stride = field("size", "1"), field("stride", "1")
        pad, lhs_dilate, rhs_dilate = field("pad", "0_0"), field("lhs_dilate", "1"), field("rhs_dilate", "1")
        total = 2 * out[ol.index("b")] * out[ol.index("f")] * rhs[kl.index("i")]
        for d in range(spatial):
            c = str(d)
            total *= window_taps(out[ol.index(c)], lhs[ll.index(c)], rhs[kl.index(c)],
                                 int(stride[d]), int(pad[d].split("_")[0]), int(lhs_dilate[d]),
                                 int(rhs_dilate[d]))
        flops += total
    return flops


# libtpu's code names for the chips, as a dump's `*target_arguments.txt` gives them.
CHIPS = {"TPU_VERSION_VIPERFISH": "v5p", "TPU_VERSION_GHOSTLITE": "v6e"}


def dump_target(d):
    """The target a dump was compiled for, from its `*target_arguments.txt`, or None."""
    for f in glob.glob(os.path.join(d, "**", "*target_arguments.txt"), recursive=True):
        m = re.search(r"version: (\w+)", open(f).read())
        if m:
            return CHIPS.get(m.group(1))
    return None


def module_file(d):
    found = glob.glob(os.path.join(d, "*after_optimizations.txt"))
    if not found:
        sys.exit(f"hlo-roofline: no *after_optimizations.txt in {d} (an XLA dump directory?)")
    return max(found, key=os.path.getsize)


def sliced_parameters(body):
    """{parameter number: bytes read} for a fused computation's parameters that are read only
    through slices (a layer out of a stacked operand): those bytes, not the operand's."""
    params, users, out = {}, {}, {}
    for name, shape, op, args, rest, _ in instructions(body):
        if op == "parameter":
            params[name] = int(args)
            continue
        for i, o in enumerate(re.findall(r"%([\w.\-]+)", args)):
            users.setdefault(o, []).append((op, i, shape_bytes(shape)))
    for name, number in params.items():
        use = users.get(name, [])
        if use and all(op in ("slice", "dynamic-slice") and i == 0 for op, i, _ in use):
            out[number] = sum(b for _, _, b in use)
    return out


def computation_ops(computations, body, rates):
    sizes, rows = {}, []
    for name, shape, op, args, rest, _ in instructions(body):
        sizes[name] = shape_bytes(shape)
        if op in FREE:
            continue
        operands = re.findall(r"%([\w.\-]+)", args)
        called = re.search(r"calls=%([\w.\-]+)", rest)
        fused = computations.get(called.group(1)) if op == "fusion" and called else None
        sliced = sliced_parameters(fused) if fused else {}
        moved = sum(sliced.get(i, sizes.get(o, 0)) for i, o in enumerate(operands)) + sizes[name]
        flops = matmul_flops(fused) if fused else 0
        where = re.search(r'op_name="([^"]*)"', rest)
        kind = ("matmul fusion" if flops else "fusion") if op == "fusion" else op
        rows.append({
            "kind": kind,
            "name": re.sub(r"\.\d+", "", where.group(1)) if where else "",
            "bytes": moved,
            "flops": flops,
            "seconds": max(flops / rates[0], moved / rates[1]),
        })
    return rows


def ops(path, rates):
    """The entry computation's instructions, priced. (A while loop is priced as one op here, not
    as its body: for a looped step use the unrolled dumps an estimate leaves.)"""
    text = open(path).read()
    computations = {m.group(1): m.group(2) for m in COMPUTATION.finditer(text)}
    entry = re.search(r"^ENTRY %([\w.\-]+)", text, re.M)
    if not entry:
        sys.exit(f"hlo-roofline: {path} has no ENTRY computation")
    return computation_ops(computations, computations[entry.group(1)], rates)


def totals(rows, key):
    out = Counter()
    for r in rows:
        out[key(r)] += r["seconds"]
    return out


def main(argv):
    args = argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    opts = {"--target": None, "--by": "both", "--top": "25"}
    path = None
    i = 0
    while i < len(args):
        if args[i] in opts and i + 1 < len(args):
            opts[args[i]] = args[i + 1]
            i += 2
        elif args[i].startswith("-") or path is not None:
            sys.exit(f"hlo-roofline: unexpected argument `{args[i]}` (see --help)")
        else:
            path = args[i]
            i += 1
    if path is None or not os.path.exists(path):
        sys.exit(f"hlo-roofline: {path!r} does not exist (see --help)")
    if opts["--target"] is None:
        found = dump_target(path if os.path.isdir(path) else os.path.dirname(path))
        if found is None:
            sys.exit("hlo-roofline: which TPU the dump is for is not in it (no "
                     "*target_arguments.txt naming a known chip): give --target "
                     f"{'|'.join(RATES)}")
        opts["--target"] = found
    if opts["--target"] not in RATES:
        sys.exit(f"hlo-roofline: --target {opts['--target']}: one of {', '.join(RATES)}")
    if opts["--by"] not in ("kind", "name", "both"):
        sys.exit(f"hlo-roofline: --by {opts['--by']}: kind, name or both")
    try:
        top = int(opts["--top"])
    except ValueError:
        top = 0
    if top < 1:
        sys.exit(f"hlo-roofline: --top {opts['--top']}: a number of rows, 1 or more")
    rates = RATES[opts["--target"]]
    print(f"{opts['--target']}: {rates[0] / 1e12:.0f} TFLOP/s, {rates[1] / 1e12:.3f} TB/s per chip")
    layered = all(os.path.isdir(os.path.join(path, f"layers-{n}")) for n in (1, 2))
    if layered:
        one = ops(module_file(os.path.join(path, "layers-1")), rates)
        two = ops(module_file(os.path.join(path, "layers-2")), rates)
        print(f"unrolled 1 layer: {1e3 * sum(r['seconds'] for r in one):.3f} ms, 2 layers: "
              f"{1e3 * sum(r['seconds'] for r in two):.3f} ms; per layer (2 - 1) below")
    else:
        module = path if os.path.isfile(path) else module_file(path)
        one, two = [], ops(module, rates)
        print(f"module: {1e3 * sum(r['seconds'] for r in two):.3f} ms")
        loops = sum(r["kind"] == "while" for r in two)
        if loops:
            print(f"(it has {loops} while loops, priced here as single ops, not as their bodies: "
                  "read the unrolled dumps of an estimate instead, see --help)")
    keys = {"kind": lambda r: r["kind"], "name": lambda r: f"{r['kind']:<14} {r['name']}"}
    for by in (["kind", "name"] if opts["--by"] == "both" else [opts["--by"]]):
        a, b = totals(one, keys[by]), totals(two, keys[by])
        diff = {k: b[k] - a[k] for k in set(a) | set(b)}
        print(f"\nby {by} (ms{' per layer' if layered else ''}; total {1e3 * sum(diff.values()):.3f}):")
        for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
            print(f"  {1e3 * v:9.3f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
