"""Step 4 of a CIS decode step: exact attention over each head's index list
(``sparse_decode_attention.py``), per head, per KV group, or over the union of a group's sets
(``group_union.py``), each with its PyTorch reference."""
