"""The Triton kernels of prhs-hf and their PyTorch references, one folder per op.

``cis_match/``, ``topk/``, ``key_index/``, ``compose/`` and ``sparse_attention/`` are the steps of a
CIS decode step, ``prefill/`` the sparse prefill. Each kernel module holds its ``@triton.jit``
kernels, their launcher (the public function) and the pure-PyTorch reference (``*_reference``), in
the layout of the Triton tutorial ``06-fused-attention``; tests compare every launcher with its
reference. A launcher too large for one module keeps its stages apart (``topk_retrieval`` scores,
``topk_select`` selects).

At this level sits what the ops share: ``triton_support`` (the optional Triton import, device
queries), ``map_collect`` (the mark-and-collect passes), ``library_ops`` (the launchers as
``torch.library`` custom ops), ``decode_ops`` (the tables of the decode steps by backend and the CIS
selection that chains them) and ``side_stream`` (that selection on a side CUDA stream).
"""
