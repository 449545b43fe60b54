"""Tiny random models of every supported family, for CPU tests."""

from __future__ import annotations

import torch
import transformers

import prhs_hf

# family -> (config class, extra kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "glm": ("GlmConfig", {"head_dim": 16, "partial_rotary_factor": 0.5}),
    "glm4": ("Glm4Config", {"head_dim": 16, "partial_rotary_factor": 0.5}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "glm4_moe": (
        "Glm4MoeConfig",
        {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "partial_rotary_factor": 0.5},
    ),
}


def tiny_config(family: str, layers: int = 4, heads: int = 4, kv_heads: int = 2, **overrides):
    cls_name, extra = FAMILIES[family]
    cls = getattr(transformers, cls_name)
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16384,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    config = cls(**kwargs)
    config._attn_implementation = "sdpa"
    return config


def tiny_model(family: str = "llama", dtype=torch.float32, seed: int = 0, **kwargs):
    """A random ``*ForCausalLM`` of ``family`` in eval mode, SDPA attention."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), attn_implementation="sdpa")
    # random init of this size gives near-uniform attention; sharper weights make selection matter
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model.eval().to(dtype)


def padded_batch(lengths, vocab: int = 128, seed: int = 0, device="cpu"):
    """Random token ids, left-padded to the longest length, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, L - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, L - n :] = 1
    return ids.to(device), mask.to(device)


class SelectionRecorder:
    """Wraps a patched model's selector (``model._prhs_runtime.selector``) and records each decode
    selection: ``calls`` holds ``(layer, selection, t_last)``, ``selections`` the selections alone."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def select(self, layer, q, k_cache, v_cache, geom, *args):
        sel = self.inner.select(layer, q, k_cache, v_cache, geom, *args)
        self.calls.append((layer, sel, geom.t_last.clone()))
        return sel

    @property
    def selections(self):
        return [sel for _, sel, _ in self.calls]


#: CIS alone at a budget far below the prompts of :func:`decode_by_backend` (4 + 8 + 16 of 45-70 tokens), blocks of 4;
#: τ 0: on these random models rows both retrieve and share in the same steps (ρ̂ 0.41-0.64 in every family; at
#: τ 0.8 most families retrieve on every step, so the sharing path would go untested)
SMALL_CIS = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4, "tau": 0.0},
             "telemetry": {"enabled": True}}


def decode_by_backend(family: str, device: str = "cpu", new_tokens: int = 8) -> dict:
    """Greedy ``generate()`` of a random fp32 ``family`` model on a left-padded batch under
    :data:`SMALL_CIS`, once per decode backend (``torch``: the PyTorch reference; ``triton``: the
    kernels, through the interpreter on a CPU): ``{backend: (tokens, retrieval_ratio, sparse_sequence_steps)}``."""
    model = tiny_model(family, layers=2).to(device)
    ids, mask = padded_batch([70, 45], device=device)
    runs = {}
    for backend in ("torch", "triton"):
        prhs_hf.patch(model, SMALL_CIS, overrides={"backend": {"decode": backend, "prefill": "torch"}})
        try:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens)
            report = prhs_hf.telemetry(model)
        finally:
            prhs_hf.unpatch(model)
        runs[backend] = (out, report.retrieval_ratio, report.sparse_sequence_steps)
    return runs
