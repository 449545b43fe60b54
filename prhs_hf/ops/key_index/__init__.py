"""The key index (``cis.index``): a compressed copy of the key cache, its writes and the two-stage
top-k retrieval on it (``key_index.py``: kernels, launchers and PyTorch references)."""
