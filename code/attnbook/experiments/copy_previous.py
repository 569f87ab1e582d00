"""A task that one attention head cannot solve and two can: fetch the two
previous tokens.

Chapter 5 (multi-head attention) trains one
:class:`attnbook.MultiHeadAttention` layer with one and with two heads on
:func:`copy_previous_task`, over several seeds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _validate
from ..multihead import MultiHeadAttention


def copy_previous_task(batch: int, n: int, d_content: int, generator=None):
    """Inputs and targets of a toy task: every token must fetch the two tokens
    before it.

    Token ``j`` is ``x_j = [c_j, e_j]``: random content ``c_j ~ N(0,
    I_{d_content})`` and the one-hot vector ``e_j`` of its position. The target
    of token ``i`` is ``y_i = [c_{i-1}, c_{i-2}]``, positions counted
    cyclically (token 0 fetches tokens ``n - 1`` and ``n - 2``). Returns ``x
    (batch, n, d_content + n)`` and ``y (batch, n, 2 * d_content)``.
    """
    batch, n, d_content = (
        _validate.positive_int(k, v)
        for k, v in (("batch", batch), ("n", n), ("d_content", d_content))
    )
    content = torch.randn(batch, n, d_content, generator=generator)
    x = torch.cat([content, torch.eye(n).expand(batch, n, n)], dim=-1)
    # row i: c_{i-1}, c_{i-2}
    y = torch.cat([content.roll(1, dims=1), content.roll(2, dims=1)], dim=-1)
    return x, y


def train_copy_previous(
    n_heads: int,
    seed: int = 0,
    n: int = 8,
    d_content: int = 8,
    steps: int = 400,
    batch: int = 64,
    lr: float = 1e-2,
    test_batch: int = 2000,
):
    """Train one ``MultiHeadAttention(d_content + n, n_heads)`` on
    :func:`copy_previous_task`.

    ``seed`` sets the initial weights and the stream of training batches
    (``steps`` batches of ``batch`` sequences, Adam at ``lr``); the test set
    (``test_batch`` sequences) is the same for every seed, so that seeds differ
    only in the training run. A small training run is chaotic in the last bits
    of its arithmetic, so the chapter trains several seeds. Returns ``(layer,
    test_error)``: the trained layer and its mean squared error per output
    coordinate on the test set (float).
    """
    n, d_content = (
        _validate.positive_int("n", n),
        _validate.positive_int("d_content", d_content),
    )
    torch.manual_seed(seed)
    layer = MultiHeadAttention(
        d_content + n, _validate.positive_int("n_heads", n_heads)
    )
    optimizer = torch.optim.Adam(layer.parameters(), lr=lr)
    data = torch.Generator().manual_seed(10_000 + seed)
    for _ in range(_validate.positive_int("steps", steps)):
        x, y = copy_previous_task(batch, n, d_content, generator=data)
        loss = F.mse_loss(layer(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    x_test, y_test = copy_previous_task(
        test_batch, n, d_content, generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        return layer, F.mse_loss(layer(x_test), y_test).item()
