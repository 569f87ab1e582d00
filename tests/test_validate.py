"""attnbook._validate: the one home of the package's checks.

Every check that more than one module needs is written once here: the positive
(and non-negative) integers, the ranges, "n_q <= n_k" for causal attention. One
test reads the sources for copies written out again elsewhere. The checks that
read a tensor's values force a GPU sync; one flag, ``skip_sync_checks``, turns
them off for timing code, and the decoding step is tested both ways.
"""

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from attnbook import _validate
from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.torch_attention import attend, fused_attention

PACKAGE = Path(__file__).resolve().parent.parent / "code" / "attnbook"
LIBRARY = sorted(
    p
    for p in PACKAGE.rglob("*.py")
    if p.name != "_validate.py"
    and not {"exercises", "experiments"} & set(p.relative_to(PACKAGE).parts)
)

# What an open-coded copy of a shared check looks like: its error message.
COPIES = re.compile(
    r"must be (a positive|a non-negative|an) integer|needs n_q <= n_k"
)
# Copies in modules that another branch of issue 32 rewrites (the kernels move
# into attnbook/kernels/, which calls _validate); delete an entry once its
# module has none.
AWAITING: dict[str, int] = {}


def open_coded_checks(source: str) -> list[int]:
    """Lines of the ``if`` statements in ``source`` that test or raise what a
    shared check does."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.If)
        and COPIES.search(
            ast.get_source_segment(source, node).split("\n")[0]
            + "\n".join(
                ast.get_source_segment(source, n)
                for n in node.body
                if isinstance(n, ast.Raise)
            )
        )
    ]


def test_no_module_writes_a_shared_check_again():
    found = {
        p.relative_to(PACKAGE).as_posix(): open_coded_checks(p.read_text())
        for p in LIBRARY
    }
    found = {rel: lines for rel, lines in found.items() if lines}
    extra = {
        rel: lines
        for rel, lines in found.items()
        if len(lines) != AWAITING.get(rel, 0)
    }
    assert not extra, (
        "checks written out again instead of calling attnbook._validate "
        "(positive_int, "
        f"nonnegative_int, int_in_range, queries_fit), file: lines: {extra}"
    )
    assert set(found) == set(AWAITING), (
        f"delete from AWAITING: {sorted(set(AWAITING) - set(found))}"
    )


@pytest.mark.parametrize(
    "source, lines",
    [
        # the copies this test replaced, as they were written in embeddings.py,
        # flash.py and windows.py
        (
            "if isinstance(window, bool) or not isinstance(window, (int, "
            "np.integer)) or window < 1:\n"
            "    raise ValueError(f'window must be a positive integer; got "
            "{window!r}')\n",
            [1],
        ),
        (
            "if causal and n_q > n_k:\n    raise ValueError(f'causal "
            "attention needs n_q <= n_k; got {n_q}')\n",
            [1],
        ),
        (
            "if n_sinks < 0:\n    raise ValueError(f'n_sinks must be a "
            "non-negative integer; got {n_sinks!r}')\n",
            [1],
        ),
        (
            "n = _validate.positive_int('n', n)\nif n > 3:\n    raise "
            "ValueError('too long')\n",
            [],
        ),
    ],
)
def test_an_open_coded_check_is_found(source, lines):
    assert open_coded_checks(source) == lines


@pytest.mark.parametrize(
    "check, value, message",
    [
        (
            lambda v: _validate.positive_int("n", v),
            0,
            "n must be a positive integer; got 0",
        ),
        (
            lambda v: _validate.positive_int("n", v),
            True,
            "n must be a positive integer; got True",
        ),
        (
            lambda v: _validate.positive_int("n", v),
            2.0,
            "n must be a positive integer; got 2.0",
        ),
        (
            lambda v: _validate.nonnegative_int("n_past", v),
            -1,
            "n_past must be a non-negative integer; got -1",
        ),
        (
            lambda v: _validate.int_in_range("prefix", v, 0, 6),
            7,
            r"prefix must be an integer in \[0, 6\]; got 7",
        ),
        (
            lambda v: _validate.int_in_range("n_blocks", v, 2),
            1,
            r"n_blocks must be an integer >= 2; got 1",
        ),
        (
            lambda v: _validate.queries_last("causal_mask", v, 3),
            4,
            r"needs n_q <= n_k .*got n_q=4, n_k=3",
        ),
    ],
)
def test_each_check_names_the_value_at_fault(check, value, message):
    with pytest.raises(ValueError, match=message):
        check(value)


def test_the_checks_return_plain_ints():
    assert (
        _validate.nonnegative_int("n", np.int64(0)) == 0
        and type(_validate.nonnegative_int("n", np.int64(0))) is int
    )
    assert _validate.int_in_range("d", 3, 1, 3) == 3
    assert _validate.queries_last("m", 2) == (2, 2)
    _validate.queries_fit("causal attention", 3, 3)


# --- the checks that sync, behind one flag -----------------------------------


@pytest.fixture
def host_reads(monkeypatch):
    """Count the reads of a tensor's value on the host (each a GPU sync on a
    GPU)."""
    count = {"n": 0}
    for name in (
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "item",
        "tolist",
    ):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return count


def decode_step(model, cache, ids):
    """One step of KV-cache decoding: the newest token in, its logits out."""
    return model(ids[:, -1:], cache, start_pos=ids.shape[1] - 1)


@pytest.mark.parametrize("use_sdpa", [True, False])
def test_a_decoding_step_syncs_only_while_the_checks_are_on(
    host_reads, use_sdpa
):
    torch.manual_seed(0)
    model = TinyGPT(
        GPTConfig(
            vocab_size=11,
            context_length=16,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_model=16,
        ),
        use_sdpa=use_sdpa,
    ).eval()
    ids = torch.randint(0, 11, (2, 5))
    cache = model.new_kv_cache(2, 16)
    with torch.no_grad():
        model(ids[:, :-1], cache)
        host_reads["n"] = 0
        with _validate.skip_sync_checks():
            assert not _validate.sync_checks_enabled()
            fast = decode_step(model, cache, ids)
        assert host_reads["n"] == 0, (
            f"{host_reads['n']} host reads in a decoding step with the checks "
            "off"
        )
        for c in cache:
            # drop the step, and run it again with the checks on
            c.length -= 1
        checked = decode_step(model, cache, ids)
    assert _validate.sync_checks_enabled()
    # the old code read ids.min() and ids.max() at every step
    assert host_reads["n"] > 0
    torch.testing.assert_close(fast, checked, rtol=0, atol=0)


def test_skipped_checks_no_longer_catch_a_bad_id():
    model = TinyGPT(
        GPTConfig(
            vocab_size=11, context_length=16, n_layers=1, n_heads=2, d_model=8
        )
    )
    bad = torch.tensor([[3, 11]])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 11\)"):
        model(bad)
    with _validate.skip_sync_checks(), pytest.raises(IndexError):
        # caught by the embedding instead, without a message of ours
        model(bad)


def test_fused_attention_trusts_the_mask_when_the_checks_are_off(host_reads):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen) for _ in range(3))
    mask = torch.ones(1, 2, 3, 3, dtype=torch.bool)
    mask[0, 1, 2, 1] = False
    checked = fused_attention(q, k, v, mask)
    assert host_reads["n"] > 0  # it looked for a fully masked row
    host_reads["n"] = 0
    with _validate.skip_sync_checks():
        trusted = fused_attention(q, k, v, mask)
    assert host_reads["n"] == 0
    for out in (checked, trusted):
        torch.testing.assert_close(out, attend(q, k, v, mask))
