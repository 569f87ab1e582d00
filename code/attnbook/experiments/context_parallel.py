"""Chapter 11's exactness runs: ring attention and Ulysses on P processes
against single-process attention, many cases per launch.

Each case is a dict (``method``: "ring" or "ulysses"; ``n``, ``batch``,
``n_heads``, ``n_kv_heads``, ``d``, ``causal``, ``layout``, ``seed``). Every
rank builds the same float64 inputs from the seed, keeps its shard, runs the
method forward and backward, and returns its shards of the output and of the
gradients of q, k, v; :func:`case_errors` puts the shards back in place and
compares them with :func:`attnbook.attend` over the whole sequence, and with
the single-process simulation of the ring.
"""

from __future__ import annotations

import torch

from ..distributed import layouts, ring, ulysses
from ..torch_attention import attend, repeat_kv


def shard_positions(n: int, world_size: int, layout: str):
    """The global positions each rank holds under ``layout``
    (:func:`attnbook.distributed.layouts.layout_positions`)."""
    return layouts.layout_positions(n, world_size, layout)


def case(method="ring", n=10, batch=1, n_heads=4, n_kv_heads=None, d=8, **kw):
    """A case with defaults: contiguous, not causal, seed 0."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    base = dict(method=method, n=n, batch=batch, n_heads=n_heads)
    base.update(n_kv_heads=n_kv_heads, d=d, causal=False, layout="contiguous")
    base.update(seed=0, dtype="float64")
    base.update(kw)
    return base


def make_inputs(c):
    """q, k, v and the output's gradient d_out from the case's seed, rounded
    to the case's dtype and held in float64: q, d_out (b, h, n, d); k, v (b,
    n_kv_heads, n, d)."""
    g = torch.Generator().manual_seed(c["seed"])
    b, n, d = c["batch"], c["n"], c["d"]

    def draw(h):
        x = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
        return x.to(getattr(torch, c["dtype"])).double()

    return (
        draw(c["n_heads"]),
        draw(c["n_kv_heads"]),
        draw(c["n_kv_heads"]),
        draw(c["n_heads"]),
    )


def shards_of(c, world_size):
    """Each rank's positions and its shards of q, k, v, d_out, in the case's
    dtype."""
    positions = shard_positions(c["n"], world_size, c["layout"])
    full = [x.to(getattr(torch, c["dtype"])) for x in make_inputs(c)]
    return positions, [[x[:, :, p] for x in full] for p in positions]


def run_case(rank, world_size, c):
    """One case on this rank: its shards of out, dq, dk, dv."""
    positions, shards = shards_of(c, world_size)
    q, k, v, d_out = (x.clone().requires_grad_(True) for x in shards[rank])
    d_out = d_out.detach()
    method = {
        "ring": ring.ring_attention,
        "ulysses": ulysses.ulysses_attention,
    }
    out = method[c["method"]](q, k, v, positions[rank], causal=c["causal"])
    out.backward(d_out)
    return [x.detach() for x in (out, q.grad, k.grad, v.grad)]


def run_cases(rank, world_size, cases):
    """Every case on this rank (what :func:`attnbook.distributed.launch.launch`
    runs); an error is returned as its message, not raised."""
    results = []
    for c in cases:
        try:
            results.append(run_case(rank, world_size, c))
        except ValueError as e:
            results.append(f"ValueError: {e}")
    return results


def reference(c):
    """out, dq, dk, dv of single-process attention (:func:`attnbook.attend`)
    over the whole sequence."""
    q, k, v, d_out = (x.requires_grad_(True) for x in make_inputs(c))
    d_out = d_out.detach()
    group = c["n_heads"] // c["n_kv_heads"]
    n = c["n"]
    mask = torch.ones(n, n, dtype=torch.bool).tril() if c["causal"] else None
    out = attend(q, repeat_kv(k, group), repeat_kv(v, group), mask=mask)
    out.backward(d_out)
    return [x.detach() for x in (out, q.grad, k.grad, v.grad)]


def assemble(c, world_size, per_rank):
    """Shards (one list [out, dq, dk, dv] per rank) -> whole tensors."""
    positions = shard_positions(c["n"], world_size, c["layout"])
    wholes = []
    for i, like in enumerate(reference_shapes(c)):
        whole = torch.zeros(like, dtype=torch.float64)
        for p, shards in zip(positions, per_rank):
            whole[:, :, p] = shards[i].double()
        wholes.append(whole)
    return wholes


def reference_shapes(c):
    b, n, d = c["batch"], c["n"], c["d"]
    h, n_kv_heads = c["n_heads"], c["n_kv_heads"]
    return [
        (b, h, n, d),
        (b, h, n, d),
        (b, n_kv_heads, n, d),
        (b, n_kv_heads, n, d),
    ]


def simulate_case(c, world_size):
    """The ring's single-process simulation of the case: per rank [out, dq,
    dk, dv], in the case's dtype."""
    positions, shards = shards_of(c, world_size)
    qs, ks, vs, d_outs = (list(x) for x in zip(*shards))
    outs, lses = ring.simulate_ring(qs, ks, vs, positions, c["causal"])
    dqs, dks, dvs = ring.simulate_ring_backward(
        qs, ks, vs, positions, outs, lses, d_outs, c["causal"]
    )
    # the processes return the case's dtype (the simulation, float32 work)
    dtype = getattr(torch, c["dtype"])
    return [[x.to(dtype) for x in r] for r in zip(outs, dqs, dks, dvs)]


def max_error(xs, ys) -> float:
    return max(
        (float((x.double() - y.double()).abs().max()) if x.numel() else 0.0)
        for x, y in zip(xs, ys)
    )


def case_errors(cases, world_size, results):
    """For each case, the largest error of out, dq, dk, dv against
    single-process attention (``"reference"``) and, for the ring, between
    the processes and the simulation (``"simulation"``); or the case's error
    message (``"error"``)."""
    rows = []
    for i, c in enumerate(cases):
        per_rank = [r[i] for r in results]
        if isinstance(per_rank[0], str):
            rows.append(dict(c, error=per_rank[0]))
            continue
        row = dict(c, reference=max_error(
            assemble(c, world_size, per_rank), reference(c)
        ))  # fmt: skip
        if c["method"] == "ring":
            simulated = simulate_case(c, world_size)
            row["simulation"] = max(
                max_error(a, b) for a, b in zip(per_rank, simulated)
            )
        rows.append(row)
    return rows


def first_line(e: BaseException) -> str:
    """``Type: first line of the message``."""
    return f"{type(e).__name__}: {str(e).splitlines()[0]}"


def torch_context_parallel(rank, world_size, n=8, causal=False, backend=None):
    """PyTorch's own context parallelism on this rank against
    :func:`attnbook.distributed.ring.ring_attention`, float64.

    ``torch.distributed.tensor.experimental.context_parallel`` shards q, k,
    v, the output's gradient and the positions (its load balancer decides who
    holds what); then ``scaled_dot_product_attention`` runs inside it (under
    ``backend``, a name of ``torch.nn.attention.SDPBackend``, if given) and
    backward. Returns a dict: the positions this rank held, and for the
    forward and the backward either the largest difference from the ring on
    the same shards or the error torch raised.
    """
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    c = case(n=n, n_heads=2, d=4, causal=causal, seed=8)
    q, k, v, d_out = make_inputs(c)
    pos = torch.arange(n, dtype=torch.float64).expand(1, 1, n).clone()
    mesh = init_device_mesh("cpu", (world_size,))
    report = {}
    with context_parallel(
        mesh, buffers=[q, k, v, d_out, pos], buffer_seq_dims=[2, 2, 2, 2, 2]
    ):
        # the buffers are now this rank's shards
        positions = pos.flatten().to(torch.int64)
        report["positions"] = positions.tolist()
        shards = [x.clone() for x in (q, k, v, d_out)]
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        try:
            if backend is None:
                out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            else:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    out = F.scaled_dot_product_attention(
                        *leaves, is_causal=causal
                    )
        except Exception as e:  # noqa: BLE001 - the behaviour we record
            report["forward"] = first_line(e)
            out = None
        if out is not None:
            try:
                out.backward(shards[3])
                grads = [x.grad for x in leaves]
            except Exception as e:  # noqa: BLE001
                report["backward"] = first_line(e)
                grads = None
    # the same shards through the ring (outside torch's context, which has
    # put the whole buffers back)
    mine = [x.requires_grad_(True) for x in shards[:3]]
    ring_out = ring.ring_attention(*mine, positions, causal=causal)
    ring_out.backward(shards[3])
    if out is not None:
        report["forward"] = float(
            (out.detach() - ring_out.detach()).abs().max()
        )
        if grads is not None:
            report["backward"] = max(
                float((g - x.grad).abs().max()) for g, x in zip(grads, mine)
            )
    return report


def torch_context_parallel_table(rank, world_size, n=8):
    """:func:`torch_context_parallel` for sdpa's default backend and for
    its math backend, causal and not: {(backend, causal): report}."""
    return {
        (backend, causal): torch_context_parallel(
            rank, world_size, n, causal, backend
        )
        for backend in (None, "MATH")
        for causal in (False, True)
    }


def chapter_run(rank, world_size, cases, n_torch=16):
    """Everything chapter 11 runs on processes, in one launch (a process
    start costs seconds): :func:`run_cases`, then PyTorch's context
    parallelism causal with sdpa's default backend and not causal with its
    math backend (:func:`torch_context_parallel`)."""
    return {
        "cases": run_cases(rank, world_size, cases),
        "torch": {
            (backend, causal): torch_context_parallel(
                rank, world_size, n_torch, causal, backend
            )
            for backend, causal in ((None, True), ("MATH", False))
        },
    }
