"""``python scripts/speed_map.py ARGS`` is ``prhs-hf bench ARGS``: the speed map (decode ms/step of
``model.generate()`` over batch × length, PrHS configs against the fastest dense baseline). The code
lives in :mod:`prhs_hf.evaluation.speed_map`; this wrapper only runs it from a checkout."""

import sys

from prhs_hf.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
