"""The plot in docs/benchmarks.md: loader throughput per contender against the physical
limit, drawn from ``benchmarks/results/loader.json`` with Pillow (no plotting library needed)::

    python benchmarks/plot.py          # writes benchmarks/results/loader.png
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

RESULTS = Path(__file__).resolve().parent / "results"
WIDTH, ROW, LEFT, RIGHT, TOP = 900, 46, 330, 90, 56
COLOURS = {"baseline": (150, 150, 150), "dlpipe": (40, 110, 190), "peer": (120, 160, 90)}


def draw(result: dict) -> Image.Image:
    """Horizontal bars of samples/s, best num_workers each, with the limit as a dashed line."""
    rows = result["summary"]["best"]
    limit = result["summary"]["limit"]["samples_per_s"]
    top = max(limit, *(r["samples_per_s"] for r in rows)) * 1.05
    height = TOP + ROW * len(rows) + 50
    image = Image.new("RGB", (WIDTH, height), "white")
    pen = ImageDraw.Draw(image)
    span = WIDTH - LEFT - RIGHT
    cfg = result["config"]
    pen.text(
        (12, 12),
        f"make_loader samples/s, {cfg['images']} JPEGs, {cfg['image_size']} px train transform, "
        f"batch {cfg['batch_size']}, {result['machine']['cpu_count']} cores "
        f"(best workers or threads each, side by side: medians of {cfg['rounds']} whole "
        "epochs; x baseline: median round-by-round ratio)",
        fill="black",
    )
    for i, row in enumerate(rows):
        y = TOP + i * ROW
        length = int(span * row["samples_per_s"] / top)
        pen.text((12, y + 10), row["contender"][:48], fill="black")
        pen.rectangle((LEFT, y + 4, LEFT + length, y + ROW - 10), fill=COLOURS[row["kind"]])
        label = f"{row['samples_per_s']:,.0f}  ({row['x_baseline']:.2f}x)"
        pen.text((LEFT + length + 6, y + 10), label, fill="black")
    x = LEFT + int(span * limit / top)
    bottom = TOP + ROW * len(rows)
    for y in range(TOP - 6, bottom, 8):
        pen.line((x, y, x, y + 4), fill=(200, 60, 40), width=2)
    label = f"2-core full-decode limit {limit:,.0f} samples/s"
    pen.text((x - 180, bottom + 8), label, fill=(200, 60, 40))
    return image


def main() -> None:
    result = json.loads((RESULTS / "loader.json").read_text())
    draw(result).save(RESULTS / "loader.png")
    print(RESULTS / "loader.png")


if __name__ == "__main__":
    main()
