"""Linear attention that forgets and corrects: the delta-rule family.

A causal linear-attention head keeps a state ``S (d_k, d_v)`` and updates it
once per token. The forms differ in how they write:

- :mod:`attnbook.delta.recurrent`: one recurrence, ``delta_recurrence``,
  with the write strength ``beta`` and the forget gate ``gate`` optional, and
  thin functions for each named form (linear attention, scalar decay, the
  delta rule, the gated delta rule, Kimi Linear's channel-wise gate);
- :mod:`attnbook.delta.chunkwise`: the same outputs and final state, a chunk
  at a time, with the product of the ``(I - beta k k^T)`` factors of a chunk
  in the UT form (one triangular solve);
- :mod:`attnbook.delta.inputs`: the checks every form shares;
- :mod:`attnbook.delta.layer`: :class:`DeltaLayer`, a sibling of
  :class:`attnbook.MultiHeadAttention` that the tiny GPT takes per layer;
- :mod:`attnbook.delta.cost`: flops of the recurrence, of the chunkwise form
  and of softmax attention, and the bytes a decoded token reads.

Chapter 16 (the delta rule) shows them.
"""
