"""Latent attention and shared caches: the caches of frontier models.

- :mod:`attnbook.latent.mla`: multi-head latent attention (DeepSeek-V2/V3), a
  sibling layer of :class:`attnbook.MultiHeadAttention` that caches one
  latent per token;
- :mod:`attnbook.latent.latent_cache`: the cache it keeps;
- :mod:`attnbook.latent.sharing`: which layer reuses which layer's cache
  (cross-layer attention, YOCO, Gemma 4);
- :mod:`attnbook.latent.cost`: flops and bytes of its two paths, and where
  the cheaper one changes;
- :mod:`attnbook.latent.cache_size`: bytes per token of every kind of cache,
  for published configurations.

Chapter 13 (latent attention and shared caches) shows them.
"""
