"""Which keys to read: sliding windows, attention sinks and sparse attention.

- :mod:`attnbook.sparse.sinks`: a learned sink logit per head, in the
  softmax's denominator only (gpt-oss), as an attention function and as a
  layer on the ``attention`` hook of :class:`attnbook.MultiHeadAttention`;
- :mod:`attnbook.sparse.indexer`: DeepSeek sparse attention's lightning
  indexer, its causal top-k selection, and attention over the selected keys;
- :mod:`attnbook.sparse.flex`: the masks of chapter 7 and of this chapter as
  PyTorch FlexAttention ``mask_mod`` and ``score_mod`` functions;
- :mod:`attnbook.sparse.layouts`: which layers of a model are sliding and
  which full, how far back the stack reaches, and what a token costs.

Chapter 14 (sparse attention) shows them.
"""
