"""The Triton kernels of prhs-hf and their PyTorch references, one folder per op.

``cis_match/``, ``topk/``, ``key_index/``, ``compose/`` and ``sparse_attention/`` are the steps of a
CIS decode step, ``prefill/`` the sparse prefill. A decode op folder's ``custom_ops.py`` makes its
launchers ``torch.library`` custom ops and registers each with its reference (``registry.py``);
the backend tables of ``decode_ops.py`` are made from that registry. Each kernel module holds its ``@triton.jit``
kernels, their launcher (the public function) and the pure-PyTorch reference (``*_reference``), in
the layout of the Triton tutorial ``06-fused-attention``; tests compare every launcher with its
reference. A launcher too large for one module keeps its stages apart (``topk_retrieval`` scores,
``topk_select`` selects).

At this level sits what the ops share: ``triton_support`` (the optional Triton import, device
queries), ``map_collect`` (the mark-and-collect passes), ``registry`` (the decode ops: launcher,
reference and custom op of each), ``decode_ops`` (the tables of the decode steps by backend and the
CIS selection that chains them) and ``side_stream`` (that selection on a side CUDA stream).
"""
