"""The README's picture: the default config's decode speed against the fastest dense, one heat map
drawn from a speed-map JSON (``prhs-hf bench``'s) with :func:`prhs_hf.evaluation.speed_map.draw_heatmap`.

    python scripts/readme_speed_map.py docs/results/speed_map_h200_qwen_1bcf41c.json docs/results/speed_map_default.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prhs_hf.cli import DEFAULT_CONFIG
from prhs_hf.evaluation.speed_map import draw_heatmap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="a speed-map JSON (prhs-hf bench --out)")
    parser.add_argument("png", type=Path)
    parser.add_argument("--configs", default=DEFAULT_CONFIG, help="configs to draw, comma-separated (default: %(default)s)")
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text(encoding="utf-8"))
    rows = data["rows"]
    models = ", ".join(dict.fromkeys(r["model"] for r in rows))
    title = (f"decode speed against the fastest dense, generate() after patch()\n"
             f"{models}, {data.get('gpu', 'GPU not recorded')}, {data.get('date', '')}")
    note = draw_heatmap(rows, args.png, args.configs.split(","), title=title)
    print(note or f"wrote {args.png}")
    return 1 if note else 0


if __name__ == "__main__":
    sys.exit(main())
