"""A batch of differently sized images resized as matrix products gives what torch's
antialiased bilinear ``interpolate`` gives each image alone: train crops with flips, eval
resizes with their centre window, up- and downscaling, in one chunk or many."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import interpolate

from dlpipe.loading.resample import antialias_weights, resize_many

SIZE = 24


def reference(image: torch.Tensor, out_h: int, out_w: int, top: int, left: int, flip: bool):
    resized = interpolate(
        image[None].float(), size=(out_h, out_w), mode="bilinear", antialias=True
    )[0, :, top : top + SIZE, left : left + SIZE]
    return resized.flip(-1) if flip else resized


def cases() -> list[tuple[torch.Tensor, tuple[int, int, int], tuple[int, int, int], bool]]:
    """(image, rows, cols, flip): train crops of every scale, eval windows, odd sizes."""
    generator = torch.Generator().manual_seed(0)
    found = []
    sizes = [(1, 1), (1, 37), (5, 9), (24, 24), (23, 25), (48, 96), (131, 77), (300, 260)]
    for k, (h, w) in enumerate(sizes):
        image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator)
        found.append((image, (h, SIZE, 0), (w, SIZE, 0), k % 2 == 1))
    for h, w in [(40, 90), (97, 31), (28, 28)]:  # eval: short side to 27, the centre 24
        image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator)
        out_h, out_w = (27, int(27 * w / h)) if h <= w else (int(27 * h / w), 27)
        top, left = round((out_h - SIZE) / 2), round((out_w - SIZE) / 2)
        found.append((image, (h, out_h, top), (w, out_w, left), False))
    return found


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 16, 256 << 20])  # one image a chunk .. all
def test_a_batch_resizes_as_interpolate_resizes_each_image(chunk_bytes) -> None:
    images, rows, cols, flips = zip(*cases(), strict=True)
    out = resize_many(
        list(images),
        torch.tensor(rows),
        torch.tensor(cols),
        torch.tensor(flips),
        SIZE,
        chunk_bytes=chunk_bytes,
    )
    expected = torch.stack(
        [
            reference(image, r[1], c[1], r[2], c[2], flip)
            for image, r, c, flip in zip(images, rows, cols, flips, strict=True)
        ]
    )
    assert out.shape == (len(images), 3, SIZE, SIZE)
    assert float((out - expected).abs().max()) < 2e-3  # of 255: float rounding only
    wrong = torch.stack([e.flip(-1) for e in expected])
    assert float((out - wrong).abs().mean()) > 10  # the comparison tells a flip


def test_each_weight_row_is_torchs_window_and_sums_to_one() -> None:
    """Downscaling 10 → 4 (scale 2.5): output pixel 1's centre is 3.75, its window the
    input pixels 1..5 (trunc(3.75 ± 2.5 + 0.5) = 1 and 6, the end excluded), triangle
    weights 2.5 wide over it."""
    weights = antialias_weights(torch.tensor([[10, 4, 0]]), torch.tensor([False]), 4, 12)
    assert weights.shape == (1, 4, 12)
    assert torch.allclose(weights.sum(-1), torch.ones(1, 4))
    row = weights[0, 1]
    assert torch.nonzero(row).flatten().tolist() == [1, 2, 3, 4, 5]
    raw = torch.tensor([1 - abs(x - 3.75 + 0.5) / 2.5 for x in range(1, 6)])
    assert torch.allclose(row[1:6], raw / raw.sum())
    assert not row[10:].any()  # past the image: padding weighs nothing
    flipped = antialias_weights(torch.tensor([[10, 4, 0]]), torch.tensor([True]), 4, 12)
    assert torch.equal(flipped[0], weights[0].flip(0))


def test_a_large_image_pads_only_its_own_chunk() -> None:
    """Chunks are runs within the byte budget, each padded to its own largest image: one big
    image does not make every small one a big float stack."""
    from dlpipe.loading.resample import _chunks

    small, big = torch.zeros(3, 10, 12), torch.zeros(3, 100, 90)
    images = [small, small, small, big, small, small]
    budget = 3 * 3 * 10 * 12 * 4  # three small images
    assert _chunks(images, budget) == [
        (slice(0, 3), 10, 12),
        (slice(3, 4), 100, 90),  # over the budget alone: a chunk of its own
        (slice(4, 6), 10, 12),
    ]
    assert _chunks(images, 1 << 30) == [(slice(0, 6), 100, 90)]
