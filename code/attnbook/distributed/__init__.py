"""Attention across devices: context parallelism (chapter 11).

- :mod:`attnbook.distributed.layouts`: which tokens each device holds
  (contiguous, striped, zigzag) and the causal work that gives it;
- :mod:`attnbook.distributed.cost`: tokens, bytes moved, memory and the
  overlap condition at scale, from published rates.

Chapter 11 (attention across devices) shows them.
"""
