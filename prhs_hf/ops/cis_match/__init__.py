"""Step 1 of a CIS decode step: match each query head against its block's anchors (``cis_match.py``:
the Triton kernel, its launcher and its PyTorch reference)."""
