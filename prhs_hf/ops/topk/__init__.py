"""Step 2 of a CIS decode step: the exact top-k of the middle region for the retrieving rows.

``topk_retrieval.py`` scores the keys and launches the select, ``topk_select.py`` holds the two
selects (tilemax, radix8); each with its PyTorch reference."""
