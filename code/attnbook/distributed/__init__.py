"""Attention across devices: the sequence split over processes.

- :mod:`attnbook.distributed.ring`: ring attention, forward and backward,
  exact, on ``torch.distributed`` point-to-point transfers, with a
  single-process simulation of the same steps;
- :mod:`attnbook.distributed.ulysses`: DeepSpeed-Ulysses, which re-shards
  from sequence to heads with all-to-all;
- :mod:`attnbook.distributed.launch`: runs a function on P CPU processes
  (gloo) with a time limit, and checks that the ranks' shapes agree.

Chapter 11 (attention across devices) shows them.
"""
