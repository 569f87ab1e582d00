"""Attention across devices: context parallelism.

- :mod:`attnbook.distributed.ring`: ring attention, forward and backward,
  exact, on ``torch.distributed`` point-to-point transfers, with a
  single-process simulation of the same steps;
- :mod:`attnbook.distributed.ulysses`: DeepSpeed-Ulysses, which re-shards
  from sequence to heads with all-to-all;
- :mod:`attnbook.distributed.launch`: runs a function on P CPU processes
  (gloo) with a time limit, and checks that the ranks' shapes agree;
- :mod:`attnbook.distributed.layouts`: which tokens each device holds
  (contiguous, striped, zigzag) and the causal work that gives it;
- :mod:`attnbook.distributed.cost`: tokens, bytes moved, memory and the
  overlap condition at scale, from published rates.

Chapter 11 (attention across devices) shows them.
"""
