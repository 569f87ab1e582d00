"""Caches shared across layers: which layer attends with which layer's keys
and values.

A layer that reuses the keys and values of an earlier layer computes no keys
or values of its own and adds nothing to the cache. Each rule below returns
``sources``, a list with one entry per layer: ``sources[i]`` is the layer whose
cache layer ``i`` attends with (``i`` itself for a layer that makes its own).

- :func:`cla_sources`: cross-layer attention (Brandon et al. 2024), groups of
  ``share`` adjacent layers in which the first layer's keys and values serve
  the group (CLA2 is ``share=2``);
- :func:`yoco_sources`: You Only Cache Once (Sun et al. 2024), whose second
  half of layers (the cross-decoder) all attend to one global cache made once
  from the first half's output;
- :func:`reuse_last_of_type`: Gemma 3n and Gemma 4, whose last
  ``n_shared`` layers each reuse the cache of the last earlier layer of the
  same attention type (sliding-window or full), the rule of ``transformers``'
  ``Gemma4TextConfig.kv_sharing_modes``.

:func:`producers` lists the layers that make a cache. Chapter 13 (latent
attention and shared caches) shows :func:`reuse_last_of_type`.
"""

from __future__ import annotations

from .. import _validate


def cla_sources(n_layers: int, share: int) -> list[int]:
    """Cross-layer attention: layer ``i`` uses the cache of the first layer of
    its group of ``share`` adjacent layers, ``i - i % share``."""
    n_layers = _validate.positive_int("n_layers", n_layers)
    share = _validate.positive_int("share", share)
    return [i - i % share for i in range(n_layers)]


def yoco_sources(n_layers: int) -> list[int]:
    """YOCO: the first ``n_layers // 2`` layers (the self-decoder) keep their
    own caches (sliding-window or recurrent, of fixed size in the paper); the
    others (the cross-decoder) all attend to the one global cache, made from
    the self-decoder's output and counted here as layer ``n_layers // 2``'s."""
    n_layers = _validate.int_in_range("n_layers", n_layers, 2)
    half = n_layers // 2
    return [i if i < half else half for i in range(n_layers)]


def reuse_last_of_type(layer_types, n_shared: int) -> list[int]:
    """Gemma's rule: the last ``n_shared`` layers reuse the cache of the last
    layer before them of the same type.

    layer_types: one entry per layer (``"sliding_attention"``,
    ``"full_attention"``); n_shared: how many layers at the end reuse, from 0
    to ``len(layer_types) - 1``.
    """
    first = check_sharing(layer_types, n_shared)
    last_of = {kind: i for i, kind in enumerate(layer_types[:first])}
    return [
        i if i < first else last_of[kind] for i, kind in enumerate(layer_types)
    ]


def check_sharing(layer_types, n_shared: int) -> int:
    """Raise unless the last ``n_shared`` layers can each find an earlier
    layer of their type that makes a cache; return the first sharing
    layer."""
    n_layers = len(layer_types)
    n_shared = _validate.int_in_range(
        "n_shared", n_shared, 0, n_layers - 1 if n_layers else 0
    )
    first = n_layers - n_shared
    missing = sorted(set(layer_types[first:]) - set(layer_types[:first]))
    if missing:
        raise ValueError(
            f"with n_shared={n_shared} of {n_layers} layers, no layer before "
            f"layer {first} has type {missing} to share its cache"
        )
    return first


def producers(sources) -> list[int]:
    """The layers that make a cache of their own: ``sources[i] == i``."""
    return [i for i, source in enumerate(sources) if source == i]
