"""What an int8 KV cache does to the tiny GPT's output, measured against the
exact cache.

Chapter 8 (the KV cache) runs the model on held-out passages with
:class:`attnbook.KVCache` and with
:class:`attnbook.quantized_cache.QuantizedKVCache` and compares the two
(:func:`compare_caches`). Which entries land exactly between two integers, and
so round up or down, depends on the last bits of the keys and values, which
differ between CPUs; the errors therefore move a little from one machine to
another, and the top-1 choice flips only where two characters were nearly tied.
The chapter's checked claims are phrased so that they do not depend on that
(:meth:`CacheComparison.top1_kept`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..decoding import recording_attention_outputs, teacher_forced_logits
from ..seeds import TooCloseToCall


def top2_margin(logits):
    """Largest minus second-largest logit along the last dimension: how far the
    top-1 choice is from a tie."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def run_with_caches(model, ids, caches, one_pass: bool = True):
    """Logits and each layer's attention output for ``ids`` (batch, n), run
    through ``caches``.

    ``one_pass``: a single prefill over all of ``ids``; otherwise token by
    token (:func:`attnbook.decoding.teacher_forced_logits`), as generation
    feeds the cache. Returns ``(logits (batch, n, vocab), [attention output
    (batch, n, d_model) per layer])``.
    """
    with (
        torch.inference_mode(),
        recording_attention_outputs(model) as recorded,
    ):
        logits = (
            model(ids, caches)
            if one_pass
            else teacher_forced_logits(model, ids, caches)
        )
    return logits, [torch.cat(r, dim=1) for r in recorded]


@dataclass(frozen=True)
class CacheComparison:
    """A cache's run against the exact cache's run on the same tokens; one row
    per sequence.

    attention: (batch, n_layers), ``||a - a_exact|| / ||a_exact||`` of each
    layer's attention output;
    max_dlogit: (batch,), the largest ``|logit - exact logit|``; kl: (batch,),
    the mean over positions of ``KL(p_exact || p)`` in nats; exact_margin:
    (batch, n), the exact run's :func:`top2_margin`;
    kept_margin: (batch, n), the cache run's logit of the exact top-1 character
    minus its largest other logit: positive where the top-1 choice is kept,
    negative where it flipped.
    """

    attention: np.ndarray
    max_dlogit: np.ndarray
    kl: np.ndarray
    exact_margin: np.ndarray
    kept_margin: np.ndarray

    @property
    def same_top1(self) -> np.ndarray:
        """(batch, n) bool: the cache's most likely next token is the exact
        one's."""
        return self.kept_margin > 0

    @property
    def flips(self) -> np.ndarray:
        """(batch,) how many positions changed their top-1 token."""
        return (~self.same_top1).sum(axis=-1)

    def top1_kept(self, min_exact_margin: float, margin: float = 0.0) -> bool:
        """Whether the top-1 token is kept at every position whose exact top-2
        margin exceeds ``min_exact_margin``. False as soon as one such position
        lost its top-1 by more than ``margin`` (``kept_margin`` at or below
        ``-margin``), whatever the near-ties elsewhere. Otherwise raises
        :class:`attnbook.seeds.TooCloseToCall` if at such a position the
        cache's ``kept_margin`` lies within ``margin`` of 0: which way that one
        goes, and so the verdict, is rounding."""
        kept = self.kept_margin[self.exact_margin > min_exact_margin]
        if margin > 0 and (kept <= -margin).any():
            return False
        near = kept[np.abs(kept) < margin]
        if near.size:
            raise TooCloseToCall(
                f"{near.size} position(s) with an exact margin above "
                f"{min_exact_margin} keep "
                f"their top-1 by only {near.tolist()}, within {margin} of a "
                "flip"
            )
        return bool((kept > 0).all())


def compare_caches(run, exact) -> CacheComparison:
    """Compare two :func:`run_with_caches` results, ``run`` against ``exact``
    (same ids)."""
    (logits, attn), (exact_logits, exact_attn) = run, exact
    if logits.shape != exact_logits.shape or len(attn) != len(exact_attn):
        raise ValueError(
            f"the runs differ in shape: {tuple(logits.shape)} and "
            f"{tuple(exact_logits.shape)}"
        )
    attention = np.stack(
        [
            ((a - e).flatten(1).norm(dim=1) / e.flatten(1).norm(dim=1)).numpy()
            # (batch, layers)
            for a, e in zip(attn, exact_attn)
        ],
        axis=1,
    )
    log_p, log_q = exact_logits.log_softmax(-1), logits.log_softmax(-1)
    # (batch,)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean(-1)
    # (batch, n, 1)
    top = exact_logits.argmax(-1, keepdim=True)
    chosen = logits.gather(-1, top)[..., 0]
    others = logits.scatter(-1, top, float("-inf")).amax(-1)
    return CacheComparison(
        attention=attention,
        max_dlogit=(logits - exact_logits).abs().flatten(1).amax(1).numpy(),
        kl=kl.numpy(),
        exact_margin=top2_margin(exact_logits).numpy(),
        kept_margin=(chosen - others).numpy(),
    )


def first_difference(ids, exact_ids, n_prompt: int) -> np.ndarray:
    """(batch,) index of the first generated token where ``ids`` leaves
    ``exact_ids`` (both (batch, n_prompt + n_new)); ``n_new`` where they agree
    throughout."""
    same = (ids == exact_ids)[:, n_prompt:]
    n_new = same.shape[1]
    return np.array(
        [
            int((~row).nonzero()[0]) if not bool(row.all()) else n_new
            for row in same
        ]
    )
