"""Triton kernels of prhs-hf, installed as ``prhs_hf.kernels``.

Each module holds one kernel: the ``@triton.jit`` kernel, its launcher (the public function)
and its pure-PyTorch reference (``*_reference``), in the layout of the Triton tutorial
``06-fused-attention``. Tests compare every launcher with its reference.
"""
