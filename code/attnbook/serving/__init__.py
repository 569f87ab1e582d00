"""Serving many requests at once: a paged KV cache, continuous batching and
prefix sharing.

- :mod:`attnbook.serving.allocator`: fixed-size blocks of cache memory, a
  free list and reference counts, with copy-on-write;
- :mod:`attnbook.serving.block_table`: positions to blocks, and the gather of
  keys and values through a block table (numpy);
- :mod:`attnbook.serving.paged_cache`: the same gather and paged attention in
  torch, and :class:`~attnbook.serving.paged_cache.PagedKVCache`, a KV cache
  of the protocol of chapter 8 kept in blocks;
- :mod:`attnbook.serving.prefix`: hashes of full blocks that include their
  prefix, so that requests with a common prompt share its blocks;
- :mod:`attnbook.serving.fragmentation`: how much of a cache holds real
  tokens, contiguous against paged, over a simulated request mix;
- :mod:`attnbook.serving.engine`: an iteration-level scheduler (continuous
  batching) that runs the tiny GPT over all running sequences in one forward
  pass per step, through the block tables.

Chapter 15 (serving) shows them.
"""
