"""Speculative decoding under grammars.

- ``tree_builder.py``: ``Draft`` (parent-pointer tree, node 0 = root), deduplicating trie,
  reranking, tree attention mask, first-child/next-sibling links.
- ``base.py``: the ``Drafter`` protocol. Drafters: ``ngram.py`` (prompt lookup),
  ``forced.py`` (grammar-forced chains), ``draft_model.py`` (EAGLE-2 dynamic trees from a small
  model with its own paged KV), ``eagle.py`` + ``eagle_drafter.py`` (EAGLE / EAGLE-3 heads).
- ``combine.py``: forced chain at the root, other drafters grafted at its end, rerank, forced
  chains below leaves.
- ``masks.py``: tree masks on CPU threads overlapping the verify forward.
- ``verify.py``: tree inputs, masked greedy verification, KV compaction.
- ``decoder.py``: one speculative step (draft, masks ∥ forward, verify or tree sampling,
  compaction, drafter features); ``strategy.py``: the engine's ``StepStrategy``;
  ``setup.py``: drafters from settings. (The tests' batch loop: ``tests/fixtures/spec_loop.py``.)
"""
