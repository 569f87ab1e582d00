"""Every KV cache of the package against the one interface they share
(attnbook.cache_protocol).

The caches are found in the sources (tests/package_classes.py: a class named
``...Cache``, or one that defines ``update`` and ``reset``), so a new cache
(paged, latent, one that evicts) is checked here without an edit to this file.
Each is built as ``TinyGPT.new_kv_cache`` builds one, with the standard
arguments it takes by name; a required argument beyond those needs an example
value in ``EXAMPLES``. The reference is the sequence of keys and values fed in:
what a cache returns and holds must be those of the positions it reports.
"""

import inspect

import pytest
import torch

from attnbook.cache_protocol import KVCacheProtocol
from package_classes import cache_classes, required_arguments

CACHES = cache_classes()
BATCH, N_KV_HEADS, MAX_LEN, D_HEAD = 2, 2, 12, 4
STANDARD = {
    "batch": BATCH,
    "n_kv_heads": N_KV_HEADS,
    "max_len": MAX_LEN,
    "d_head": D_HEAD,
    "dtype": torch.float32,
    "device": "cpu",
}
# required arguments beyond the standard ones: a value to build with
EXAMPLES = {"window": 3, "d_latent": D_HEAD, "d_rope": D_HEAD}
# a prefill, decode steps and chunks: MAX_LEN positions in all
CHUNKS = (3, 1, 1, 4, 1, 2)
# of the largest |key|: a lossy (quantised) cache's reconstruction
TOLERANCE = 0.01


def build(cls):
    missing = required_arguments(cls, STANDARD | EXAMPLES)
    assert not missing, (
        f"{cls.__name__} requires {missing}: give each an example value in "
        "EXAMPLES"
    )
    parameters = inspect.signature(cls).parameters
    return cls(
        **{
            name: value
            for name, value in (STANDARD | EXAMPLES).items()
            if name in parameters
        }
    )


def held_tensors(obj, seen=None):
    """Every tensor reachable from ``obj``'s attributes (through plain objects,
    lists, tuples, dicts), once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from held_tensors(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from held_tensors(item, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for item in vars(obj).values():
            yield from held_tensors(item, seen)


def keys_and_values(n=MAX_LEN + 1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(BATCH, N_KV_HEADS, n, D_HEAD, generator=g),
        torch.randn(BATCH, N_KV_HEADS, n, D_HEAD, generator=g),
    )


def assert_near(got, want, scale):
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE * scale)


def feed(cache, k, v):
    """Feed CHUNKS into ``cache``, checking every step against the protocol;
    return what update returned."""
    returned, total, scale = [], 0, float(torch.cat([k, v]).abs().max())
    for n_new in CHUNKS:
        new = slice(total, total + n_new)
        k_out, v_out = cache.update(k[:, :, new], v[:, :, new])
        total += n_new
        assert cache.length == total
        held = cache.positions()
        assert held.dtype == torch.int64 and held.ndim == 1 and len(held) >= 1
        assert (
            held[-1] == total - 1
            and held[0] >= 0
            and bool((held.diff() > 0).all())
        ), held
        for got, fed in ((k_out, k), (v_out, v)):
            assert (
                got.shape[:2] == (BATCH, N_KV_HEADS)
                and got.shape[3] == D_HEAD
                and got.shape[2] >= n_new
            )
            # the new ones last
            assert_near(got[:, :, -n_new:], fed[:, :, new], scale)
            # a decode step: what is held
            if n_new == 1:
                assert_near(got, fed[:, :, held], scale)
        assert cache.nbytes == sum(t.nbytes for t in held_tensors(cache))
        returned.append((k_out.clone(), v_out.clone()))
    return returned


def test_every_cache_of_chapters_8_and_14_is_found():
    assert {
        "KVCache",
        "RollingKVCache",
        "QuantizedKVCache",
        "ConcatKVCache",
        "PagedKVCache",
    } <= {c.__name__ for c in CACHES}


def test_the_cost_model_is_no_home_for_a_cache():
    """attnbook.decoding counts flops and runs the model; the caches live in
    modules of their own."""
    assert [
        c.__name__ for c in CACHES if c.__module__ == "attnbook.decoding"
    ] == []


@pytest.mark.parametrize("cls", CACHES, ids=lambda c: c.__name__)
def test_cache_follows_the_protocol(cls):
    cache = build(cls)
    assert isinstance(cache, KVCacheProtocol)
    assert cache.length == 0 and len(cache.positions()) == 0
    assert cache.max_len == (
        MAX_LEN if "max_len" in inspect.signature(cls).parameters else None
    )
    assert cache.nbytes == sum(t.nbytes for t in held_tensors(cache))
    k, v = keys_and_values()
    first = feed(cache, k, v)
    cache.reset()
    assert cache.length == 0 and len(cache.positions()) == 0
    # a reset cache is as good as new
    for (k1, v1), (k2, v2) in zip(first, feed(cache, k, v)):
        torch.testing.assert_close(k2, k1, rtol=0, atol=0)
        torch.testing.assert_close(v2, v1, rtol=0, atol=0)


@pytest.mark.parametrize("cls", CACHES, ids=lambda c: c.__name__)
def test_cache_keeps_to_its_capacity(cls):
    cache = build(cls)
    k, v = keys_and_values()
    # MAX_LEN positions
    feed(cache, k, v)
    if cache.max_len is None:
        cache.update(k[:, :, -1:], v[:, :, -1:])
        assert cache.length == MAX_LEN + 1
        return
    held = cache.positions()
    with pytest.raises(ValueError):
        cache.update(k[:, :, -1:], v[:, :, -1:])
    assert cache.length == MAX_LEN and torch.equal(cache.positions(), held)
