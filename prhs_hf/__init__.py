"""prhs-hf: Pre-hoc Sparsity (PrHS) KV selection for Hugging Face Transformers."""
