"""Triton kernels of prhs-hf, installed as ``prhs_hf.kernels``.

Each kernel module holds its ``@triton.jit`` kernels, their launcher (the public function) and
the pure-PyTorch reference (``*_reference``), in the layout of the Triton tutorial
``06-fused-attention``; tests compare every launcher with its reference. A launcher too large for
one module keeps its stages apart (``topk_retrieval`` scores, ``topk_select`` selects), and
``triton_support`` holds what they all share (the optional Triton import, device queries).
"""
