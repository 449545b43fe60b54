"""The sparse (PSAW/ETF) prefill: the plan of which keys each row sees (``prefill_plan.py``) and
its backends, Triton (``prefill_attention.py``, with the PyTorch reference), FlexAttention
(``flex_prefill.py``) and FlashAttention-4 (``flash_prefill.py``)."""
