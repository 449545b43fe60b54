"""Step 3 of a CIS decode step and the anchors' bookkeeping: the dilated sets (``dilated_set.py``),
the composed index lists (``compose_indices.py``) and the anchors recorded into the state
(``record_anchors.py``), each with its PyTorch reference."""
