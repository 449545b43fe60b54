"""No L x L tensor at long prompts: the PyTorch reference prefill stays near dense memory."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import resource, sys
sys.path.insert(0, {tests!r})
import torch, prhs_hf
from tiny_models import tiny_model
torch.set_num_threads(1)
model = tiny_model("llama", layers=4)
ids = torch.randint(1, 128, (1, 8192))
if sys.argv[1] != "dense":
    prhs_hf.patch(model, {config!r}, overrides={{"backend": {{"prefill": "torch", "decode": "torch"}}}})
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    model(ids, logits_to_keep=1)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""


def _script_mib(code: str, mode: str) -> float:
    """The MiB that the script ``code`` prints last, run in a fresh interpreter with argument ``mode``."""
    out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _peak_mib(mode: str) -> float:
    return _script_mib(SCRIPT.format(tests=str(ROOT / "tests"), config=str(ROOT / "configs" / "cpe.yaml")), mode)


@pytest.mark.slow
def test_8k_prompt_reference_prefill_keeps_memory_near_dense():
    dense, cpe = _peak_mib("dense"), _peak_mib("cpe")
    # one 8k x 8k fp32 score matrix of one head is 256 MiB: any L x L tensor breaks this bound
    assert cpe <= dense + 96, f"peak above start: dense {dense:.0f} MiB, CPE reference {cpe:.0f} MiB"


CACHE_SCRIPT = """
import gc, resource, sys
sys.path.insert(0, {tests!r})
import torch, prhs_hf
from tiny_models import tiny_model
torch.set_num_threads(1)
gc.disable()  # what a long generate() loop meets between two runs of the cyclic collector
model = tiny_model("llama", layers=4)
ids = torch.randint(1, 128, (4, 16))
if sys.argv[1] != "dense":
    prhs_hf.patch(model, "cis", overrides={{"policy": {{"decode": "sparse", "prefill": "sparse"}},
                                            "backend": {{"prefill": "torch", "decode": "torch"}}}})
kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2, do_sample=False,
              pad_token_id=0, cache_implementation="static", max_cache_len={slots})
with torch.no_grad():
    model.generate(ids, **kwargs)  # the first cache: its memory counts in the base
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model.generate(ids, **kwargs)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""
# a StaticCache of 4 sequences x 65,536 slots x 4 layers x 2 KV heads x 16 dims x K and V in fp32
CACHE_SLOTS, CACHE_MIB = 65536, 4 * 65536 * 4 * 2 * 16 * 2 * 4 / 2**20


def test_a_finished_generate_frees_its_cache_before_the_next_one_allocates():
    """A patched model's generate() leaves nothing that holds its cache: the next generate() with a
    StaticCache allocates its own where the last one was, as the unpatched model's does, even with
    the cyclic garbage collector off (a cycle through the cache's batch edits held the whole cache:
    two caches at once in the second call, an out-of-memory at B4 x 32k on an 80 GB GPU)."""
    code = CACHE_SCRIPT.format(tests=str(ROOT / "tests"), slots=CACHE_SLOTS)
    grown = {mode: _script_mib(code, mode) for mode in ("dense", "cis")}
    assert grown["cis"] <= grown["dense"] + CACHE_MIB / 2, (
        f"second generate()'s peak above the first: dense {grown['dense']:.0f} MiB, cis {grown['cis']:.0f} MiB "
        f"(one cache is {CACHE_MIB:.0f} MiB)")


def test_batch_edits_on_a_cache_hold_it_weakly():
    """The cache's own batch edits (runtime.FollowBatchEdit, in its ``__dict__``) make no reference
    cycle: dropping the last reference to a patched generate()'s cache frees it at once."""
    import gc
    import weakref

    import torch

    import prhs_hf
    from tiny_models import tiny_model

    model = tiny_model("llama", layers=2)
    prhs_hf.patch(model, "cis", overrides={"policy": {"decode": "sparse", "prefill": "sparse"},
                                           "backend": {"prefill": "torch", "decode": "torch"}})
    ids = torch.randint(1, 128, (2, 32))
    enabled = gc.isenabled()
    gc.disable()
    try:
        for static in (False, True):
            extra = dict(cache_implementation="static", max_cache_len=40) if static else {}
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                                     do_sample=False, pad_token_id=0, return_dict_in_generate=True, **extra)
            cache = weakref.ref(out.past_key_values)
            assert "reorder_cache" in vars(out.past_key_values)  # the edits that follow the batch are there
            del out
            assert cache() is None, f"{'static' if static else 'dynamic'} cache still alive without the cyclic GC"
    finally:
        if enabled:
            gc.enable()
