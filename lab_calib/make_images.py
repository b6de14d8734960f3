"""Draw the images of lab_calib/calibImages/images/ (procedural, deterministic; the PNGs are committed).

    .venv/bin/python lab_calib/make_images.py            # rewrites the 16 PNGs

Each image is 224x224 RGB, made of shapes, gradients, charts and rendered text, so the calibration set exercises
the vision tower with varied content while staying small (< 20 KB per file). The texts in index.jsonl describe
what is drawn here; keep them in sync when changing a drawing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

SIZE = 224
OUT = Path(__file__).resolve().parent / "calibImages" / "images"


def font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def canvas(color: tuple[int, int, int] = (255, 255, 255)) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    img = Image.new("RGB", (SIZE, SIZE), color)
    return img, ImageDraw.Draw(img)


def sunset() -> Image.Image:
    img, d = canvas()
    top, bottom = (255, 140, 40), (90, 30, 120)
    for y in range(150):
        t = y / 149
        d.line([(0, y), (SIZE, y)], fill=tuple(round(a + (b - a) * t) for a, b in zip(top, bottom)))
    d.ellipse([82, 100, 142, 160], fill=(255, 220, 90))
    d.rectangle([0, 150, SIZE, SIZE], fill=(20, 50, 110))
    for y in range(160, SIZE, 12):
        d.line([(40, y), (184, y)], fill=(230, 170, 80), width=2)
    return img


def bar_chart() -> Image.Image:
    img, d = canvas()
    d.text((50, 8), "Sales per quarter", fill=(0, 0, 0), font=font(14))
    d.line([(30, 190), (210, 190)], fill=(0, 0, 0), width=2)
    d.line([(30, 30), (30, 190)], fill=(0, 0, 0), width=2)
    colors = [(66, 133, 244), (219, 68, 55), (244, 180, 0), (15, 157, 88)]
    for i, (label, value) in enumerate(zip(["Q1", "Q2", "Q3", "Q4"], [3, 7, 5, 9])):
        x = 45 + i * 42
        d.rectangle([x, 190 - value * 16, x + 28, 190], fill=colors[i])
        d.text((x + 5, 196), label, fill=(0, 0, 0), font=font(12))
    return img


def line_chart() -> Image.Image:
    img, d = canvas()
    d.text((60, 8), "Loss per epoch", fill=(0, 0, 0), font=font(14))
    d.line([(30, 190), (210, 190)], fill=(0, 0, 0), width=2)
    d.line([(30, 30), (30, 190)], fill=(0, 0, 0), width=2)
    train = [(30 + i * 18, 190 - round(150 * math.exp(-i / 3))) for i in range(11)]
    val = [(30 + i * 18, 190 - round(40 + 110 * math.exp(-i / 3))) for i in range(11)]
    d.line(train, fill=(30, 90, 200), width=3)
    d.line(val, fill=(220, 80, 30), width=3)
    d.text((140, 40), "train", fill=(30, 90, 200), font=font(12))
    d.text((140, 56), "val", fill=(220, 80, 30), font=font(12))
    return img


def pie_chart() -> Image.Image:
    img, d = canvas()
    box = [20, 40, 160, 180]
    start = -90.0
    for share, color in [(0.5, (52, 120, 200)), (0.3, (240, 150, 40)), (0.2, (90, 180, 90))]:
        end = start + 360 * share
        d.pieslice(box, start, end, fill=color, outline=(255, 255, 255), width=2)
        start = end
    for i, (label, color) in enumerate([("50% A", (52, 120, 200)), ("30% B", (240, 150, 40)),
                                        ("20% C", (90, 180, 90))]):
        d.rectangle([168, 70 + i * 24, 180, 82 + i * 24], fill=color)
        d.text((184, 68 + i * 24), label, fill=(0, 0, 0), font=font(11))
    return img


def traffic_light() -> Image.Image:
    img, d = canvas((170, 210, 240))
    d.rectangle([104, 150, 120, SIZE], fill=(60, 60, 60))
    d.rounded_rectangle([77, 20, 147, 160], radius=12, fill=(30, 30, 30))
    for i, (on, off) in enumerate([((255, 40, 40), (90, 20, 20)), ((255, 210, 0), (90, 75, 10)),
                                   ((40, 230, 80), (15, 80, 30))]):
        d.ellipse([92, 30 + i * 42, 132, 70 + i * 42], fill=on if i == 2 else off)
    return img


def chessboard() -> Image.Image:
    img, d = canvas()
    cell = SIZE // 8
    for r in range(8):
        for c in range(8):
            if (r + c) % 2:
                d.rectangle([c * cell, r * cell, (c + 1) * cell - 1, (r + 1) * cell - 1], fill=(40, 40, 40))
    d.ellipse([3 * cell + 4, 4 * cell + 4, 4 * cell - 4, 5 * cell - 4], fill=(200, 30, 30))
    return img


def shapes() -> Image.Image:
    img, d = canvas()
    d.ellipse([15, 20, 95, 100], fill=(220, 40, 40))
    d.rectangle([125, 20, 205, 100], fill=(40, 80, 220))
    d.polygon([(112, 120), (62, 205), (162, 205)], fill=(40, 170, 60))
    return img


def sign() -> Image.Image:
    img, d = canvas((200, 230, 200))
    d.rectangle([104, 130, 120, SIZE], fill=(110, 110, 110))
    d.regular_polygon((112, 80, 70), 8, rotation=22.5, fill=(200, 20, 20), outline=(255, 255, 255))
    d.text((112, 80), "STOP", fill=(255, 255, 255), font=font(30), anchor="mm")
    return img


def receipt() -> Image.Image:
    img, d = canvas((235, 235, 235))
    d.rectangle([40, 10, 184, 214], fill=(255, 255, 255))
    lines = ["CORNER CAFE", "", "Coffee      3.50", "Bagel       2.25", "Juice       4.00", "",
             "Total       9.75", "", "Thank you!"]
    for i, line in enumerate(lines):
        d.text((50, 20 + i * 20), line, fill=(0, 0, 0), font=font(13))
    return img


def clock() -> Image.Image:
    img, d = canvas((250, 245, 230))
    cx = cy = SIZE // 2
    d.ellipse([20, 20, 204, 204], fill=(255, 255, 255), outline=(0, 0, 0), width=4)
    for h in range(12):
        a = math.radians(h * 30)
        r0, r1 = (72, 86) if h % 3 else (64, 86)
        d.line([(cx + r0 * math.sin(a), cy - r0 * math.cos(a)), (cx + r1 * math.sin(a), cy - r1 * math.cos(a))],
               fill=(0, 0, 0), width=3)
    d.line([(cx, cy), (cx + 45, cy)], fill=(0, 0, 0), width=6)  # hour hand at 3
    d.line([(cx, cy), (cx, cy - 70)], fill=(0, 0, 0), width=3)  # minute hand at 12
    d.ellipse([cx - 5, cy - 5, cx + 5, cy + 5], fill=(200, 0, 0))
    return img


def table() -> Image.Image:
    img, d = canvas()
    rows = [["City", "Jan", "Jul"], ["Oslo", "-4", "17"], ["Rome", "8", "25"], ["Cairo", "14", "28"],
            ["Lima", "23", "17"]]
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            x0, y0 = 12 + c * 67, 20 + r * 36
            d.rectangle([x0, y0, x0 + 67, y0 + 36], fill=(220, 230, 250) if r == 0 else (255, 255, 255),
                        outline=(0, 0, 0))
            d.text((x0 + 8, y0 + 10), cell, fill=(0, 0, 0), font=font(14))
    d.text((12, 204), "Mean temperature (C)", fill=(60, 60, 60), font=font(12))
    return img


def maze() -> Image.Image:
    img, d = canvas()
    rng = random.Random(7)
    n, cell, off = 10, 20, 12
    walls = {(r, c, side) for r in range(n) for c in range(n) for side in "rb"}
    seen, stack = {(0, 0)}, [(0, 0)]
    while stack:  # depth-first carving: a perfect maze, same every run (seeded)
        r, c = stack[-1]
        nbrs = [(r + dr, c + dc) for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0))
                if 0 <= r + dr < n and 0 <= c + dc < n and (r + dr, c + dc) not in seen]
        if not nbrs:
            stack.pop()
            continue
        nr, nc = rng.choice(nbrs)
        if nr == r:
            walls.discard((r, min(c, nc), "r"))
        else:
            walls.discard((min(r, nr), c, "b"))
        seen.add((nr, nc))
        stack.append((nr, nc))
    d.rectangle([off, off, off + n * cell, off + n * cell], outline=(0, 0, 0), width=2)
    for r, c, side in walls:
        x, y = off + c * cell, off + r * cell
        if side == "r" and c < n - 1:
            d.line([(x + cell, y), (x + cell, y + cell)], fill=(0, 0, 0), width=2)
        if side == "b" and r < n - 1:
            d.line([(x, y + cell), (x + cell, y + cell)], fill=(0, 0, 0), width=2)
    d.rectangle([off + 4, off + 4, off + 15, off + 15], fill=(40, 170, 60))
    d.rectangle([off + (n - 1) * cell + 4, off + (n - 1) * cell + 4, off + n * cell - 5, off + n * cell - 5],
                fill=(220, 40, 40))
    return img


def house() -> Image.Image:
    img, d = canvas((150, 200, 255))
    d.rectangle([0, 170, SIZE, SIZE], fill=(90, 170, 70))
    d.ellipse([170, 15, 210, 55], fill=(255, 220, 50))
    d.rectangle([40, 100, 140, 175], fill=(230, 200, 160))
    d.polygon([(30, 100), (90, 50), (150, 100)], fill=(170, 50, 40))
    d.rectangle([80, 135, 100, 175], fill=(110, 70, 40))
    d.rectangle([52, 115, 72, 135], fill=(200, 230, 255), outline=(80, 80, 80))
    d.rectangle([108, 115, 128, 135], fill=(200, 230, 255), outline=(80, 80, 80))
    d.rectangle([175, 120, 185, 175], fill=(110, 70, 40))
    d.ellipse([155, 80, 205, 130], fill=(40, 130, 50))
    return img


def scatter() -> Image.Image:
    img, d = canvas()
    rng = random.Random(11)
    d.line([(25, 200), (210, 200)], fill=(0, 0, 0), width=2)
    d.line([(25, 15), (25, 200)], fill=(0, 0, 0), width=2)
    for _ in range(40):
        x = rng.uniform(0, 1)
        y = 0.8 * x + 0.1 + rng.gauss(0, 0.06)
        px, py = 30 + x * 175, 195 - y * 175
        d.ellipse([px - 3, py - 3, px + 3, py + 3], fill=(120, 60, 200))
    d.line([(30, 195 - 0.1 * 175), (205, 195 - 0.9 * 175)], fill=(230, 60, 60), width=2)
    d.text((35, 205), "hours studied -> score", fill=(0, 0, 0), font=font(11))
    return img


def code() -> Image.Image:
    img, d = canvas((30, 32, 40))
    lines = [("def mean(xs):", (120, 200, 255)), ('    """Average."""', (150, 200, 120)),
             ("    total = 0", (230, 230, 230)), ("    for x in xs:", (230, 230, 230)),
             ("        total += x", (230, 230, 230)), ("    return total / len(xs)", (255, 170, 90)),
             ("", (0, 0, 0)), ("print(mean([2, 4, 9]))", (230, 230, 230))]
    for i, (line, color) in enumerate(lines):
        d.text((10, 14 + i * 24), line, fill=color, font=font(13))
    return img


def target() -> Image.Image:
    img, d = canvas((240, 240, 240))
    colors = [(255, 255, 255), (20, 20, 20), (40, 120, 220), (220, 40, 40), (250, 210, 30)]
    for i, color in enumerate(colors):
        r = 100 - i * 20
        d.ellipse([112 - r, 112 - r, 112 + r, 112 + r], fill=color, outline=(0, 0, 0))
    d.line([(150, 60), (118, 106)], fill=(90, 60, 30), width=4)
    return img


DRAWINGS: dict[str, Callable[[], Image.Image]] = {
    "sunset": sunset, "bar_chart": bar_chart, "line_chart": line_chart, "pie_chart": pie_chart,
    "traffic_light": traffic_light, "chessboard": chessboard, "shapes": shapes, "stop_sign": sign,
    "receipt": receipt, "clock": clock, "table": table, "maze": maze, "house": house, "scatter": scatter,
    "code": code, "target": target,
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, draw in DRAWINGS.items():
        draw().save(OUT / f"{name}.png", optimize=True)


if __name__ == "__main__":
    main()
