"""Two probes of libtpu's cost model for an absent TPU (no device needed), behind the long-context
figures in docs/performance.md:

  block-trip  a loop whose trips each read a block of 512 rows from one buffer and write a block
              of another (dynamic-slice + dynamic-update-slice, as the attention loops do), the
              written block an elementwise sum or a matmul's result, priced per trip from loop
              bodies of one and two trips, for buffers of 8k, 32k and 128k rows: whether the cost
              model charges a trip for its block or for the whole buffer it writes into.
  flash-trip  the flash recurrence's forward trip over blocks of 512 queries x 512 keys (32 heads
              in 8 groups of 4, head dim 128, bf16, f32 statistics) for sequences of 8k and 32k,
              priced per trip from bodies of one and two trips, in two loop forms: one flat loop
              whose trips update rows of accumulators as long as the sequence (the form of
              xtrain's and the JAX peer's attention loops), and nested loops whose inner trips
              carry one query block's accumulators, written once per query block.
  splash      JAX's Pallas splash-attention kernel (causal, 32 heads x 8192 tokens x 128, bf16)
              compiled for one v5p chip, forward and forward + backward: whether libtpu compiles
              it for absent hardware, and what its cost analysis says of it.

usage: tools/.venv/bin/python tools/tpu-cost-probes.py block-trip|flash-trip|splash
       (TPU_LIBRARY_PATH and the other variables as tools/aot-bench sets them)
"""
import sys, time

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def one_chip():
    topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
    return Mesh(np.array(topo.devices)[:1], ("x",))


def cost_of(compiled):
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, list) else cost


def block_trip():
    mesh = one_chip()
    tb, d, trips = 512, 128, 64
    for rows in (8192, 32768, 131072):
        priced = {}
        for per_body in (1, 2):
            for through_dot in (False, True):
                def f(src, acc, w):
                    def trip(i, acc):
                        at = (i * tb) % rows
                        block = jax.lax.dynamic_slice_in_dim(src, at, tb, 0)
                        if through_dot:  # the block's update comes out of a matmul, as attention's do
                            new = jnp.dot(block, w, preferred_element_type=jnp.float32)
                        else:
                            new = jax.lax.dynamic_slice_in_dim(acc, at, tb, 0) + 2 * block.astype(jnp.float32)
                        return jax.lax.dynamic_update_slice_in_dim(acc, new, at, 0)
                    return jax.lax.fori_loop(0, trips, trip, acc, unroll=per_body)
                shape = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, P()))
                args = shape((rows, d), jnp.bfloat16), shape((rows, d), jnp.float32), shape((d, d), jnp.bfloat16)
                c = cost_of(jax.jit(f, donate_argnums=1).lower(*args).compile())
                priced[per_body, through_dot] = (c["bytes accessed"], c["optimal_seconds"])
        for through_dot, how in ((False, "block + block"), (True, "block from a matmul")):
            trip_bytes, trip_s = (priced[2, through_dot][k] - priced[1, through_dot][k] for k in (0, 1))
            print(f"buffers of {rows} rows, {how}: one trip priced at {trip_bytes / 1e6:.2f} MB and "
                  f"{trip_s * 1e6:.2f} us (the block: {tb * d * (2 + 4 + 4) / 1e6:.2f} MB read and written; "
                  f"the whole written buffer: {rows * d * 4 / 1e6:.1f} MB)")


def flash_trip():
    mesh = one_chip()
    tb, kv, g, d, key_trips = 512, 8, 4, 128, 64
    shape = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, P()))

    def visit(qb, kb, acc, m):
        """One block pair: scores, running max, rescaled accumulator."""
        s = jnp.einsum("bqhgd,bkhgd->bhgqk", qb, kb, preferred_element_type=jnp.float32)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        acc = acc * jnp.exp(m - m_new)[..., None] + jnp.einsum(
            "bhgqk,bkhgd->bhgqd", p.astype(jnp.bfloat16), kb, preferred_element_type=jnp.float32)
        return acc, m_new

    def flat(rows, per_body):
        def f(q, acc, m):
            def trip(i, c):
                acc, m = c
                at = (i * tb) % rows
                qb = jax.lax.dynamic_slice_in_dim(q, at, tb, 1)
                a, mb = (jax.lax.dynamic_slice_in_dim(x, at, tb, 3) for x in (acc, m))
                a, mb = visit(qb, qb, a, mb)
                return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, at, 3) for x, y in ((acc, a), (m, mb)))
            return jax.lax.fori_loop(0, key_trips, trip, (acc, m), unroll=per_body)
        return f

    def nested(rows, per_body):
        def f(q, acc, m):
            def query_block(i, c):
                acc, m = c
                qb = jax.lax.dynamic_slice_in_dim(q, i * tb, tb, 1)
                kb = lambda j: jax.lax.dynamic_slice_in_dim(q, (j * tb) % rows, tb, 1)
                init = (jnp.zeros((1, kv, g, tb, d), jnp.float32), jnp.full((1, kv, g, tb), -1e30, jnp.float32))
                a, mb = jax.lax.fori_loop(0, key_trips, lambda j, c: visit(qb, kb(j), *c), init, unroll=per_body)
                return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, i * tb, 3) for x, y in ((acc, a), (m, mb)))
            return jax.lax.fori_loop(0, rows // tb, query_block, (acc, m))
        return f

    for rows in (8192, 32768):
        for name, form in (("one flat loop, sequence-long accumulators", flat), ("nested loops, one query block's accumulators", nested)):
            priced = {}
            for per_body in (1, 2):
                args = shape((1, rows, kv, g, d), jnp.bfloat16), shape((1, kv, g, rows, d), jnp.float32), shape((1, kv, g, rows), jnp.float32)
                c = cost_of(jax.jit(form(rows, per_body), donate_argnums=(1, 2)).lower(*args).compile())
                priced[per_body] = (c["bytes accessed"], c["optimal_seconds"])
            trip_bytes, trip_s = (priced[2][k] - priced[1][k] for k in (0, 1))
            print(f"seq {rows}, {name}: one trip priced at {trip_bytes / 1e6:.1f} MB and {trip_s * 1e6:.1f} us")


def splash():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    mesh = one_chip()
    heads, t, d = 32, 8192, 128
    mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(heads)])
    kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1)
    loss = lambda q, k, v: jnp.sum(kernel(q, k, v).astype(jnp.float32))
    shape = lambda: jax.ShapeDtypeStruct((heads, t, d), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    causal_flops = 2 * 2 * heads * t * t * d / 2  # q.k and p.v over the lower triangle
    for name, fn, work in [("forward", jax.jit(loss), causal_flops),
                           ("forward + backward", jax.jit(jax.grad(loss, argnums=(0, 1, 2))), 3.5 * causal_flops)]:
        t0 = time.time()
        compiled = fn.lower(shape(), shape(), shape()).compile()
        c = cost_of(compiled)
        kernels = compiled.as_text().count('custom_call_target="tpu_custom_call"')
        print(f"{name}: compiled in {time.time() - t0:.1f} s, {kernels} Mosaic kernel call(s); cost analysis "
              f"{c['flops'] / 1e9:.3f} GFLOP, {c['bytes accessed'] / 1e6:.1f} MB, {c['optimal_seconds'] * 1e6:.1f} us "
              f"(the attention itself: about {work / 1e9:.0f} GFLOP)")


if __name__ == "__main__":
    probes = {"block-trip": block_trip, "flash-trip": flash_trip, "splash": splash}
    if len(sys.argv) != 2 or sys.argv[1] not in probes:
        sys.exit(__doc__)
    probes[sys.argv[1]]()
