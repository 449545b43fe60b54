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


def _peak_mib(mode: str) -> float:
    code = SCRIPT.format(tests=str(ROOT / "tests"), config=str(ROOT / "configs" / "cpe.yaml"))
    out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_8k_prompt_reference_prefill_keeps_memory_near_dense():
    dense, cpe = _peak_mib("dense"), _peak_mib("cpe")
    # one 8k x 8k fp32 score matrix of one head is 256 MiB: any L x L tensor breaks this bound
    assert cpe <= dense + 96, f"peak above start: dense {dense:.0f} MiB, CPE reference {cpe:.0f} MiB"
