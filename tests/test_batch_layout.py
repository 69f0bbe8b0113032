"""Train batches are channels-last in memory, as the resize kernel writes each crop: stacking
them keeps that order (a copy of contiguous blocks) on every engine, in DataLoader workers,
and in a stream's workers; the pixels are the samples' own."""

from __future__ import annotations

import pytest
import torch
from conftest import batch_list, per_sample, write_dataset

import dlpipe
from dlpipe.loading.transforms import CropBox, ImageTransform
from dlpipe.loading.views import collate, memory_order

CHANNELS_LAST = torch.channels_last


def hwc_image(seed: int) -> torch.Tensor:
    """A (3, 6, 5) image stored (6, 5, 3): a train crop's layout."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (6, 5, 3), dtype=torch.uint8, generator=generator).permute(2, 0, 1)


@pytest.mark.parametrize("layout", ["(3, H, W)", "(H, W, 3)"])
@pytest.mark.parametrize("box", [CropBox(7, 5, 30, 22), CropBox(10, 0, 30, 40)])  # full width
def test_a_train_crop_is_channels_last_with_torchvisions_pixels(layout, box) -> None:
    from torchvision.transforms.v2 import functional as F

    transform = ImageTransform("train", 24, "jpg")
    image = torch.randint(0, 256, (3, 50, 40), dtype=torch.uint8)
    if layout == "(H, W, 3)":
        image = image.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    crop = transform.crop_flip(image, box, torch.Generator().manual_seed(1))  # no flip drawn
    assert crop.shape == (3, 24, 24) and crop.permute(1, 2, 0).is_contiguous()
    assert torch.equal(crop, F.resized_crop(image, *box, size=[24, 24], antialias=True))


def test_memory_order_names_the_layout() -> None:
    assert memory_order(hwc_image(0)) == (1, 2, 0)
    assert memory_order(torch.zeros(3, 6, 5)) == (0, 1, 2)
    assert memory_order(torch.zeros(2, 3, 4, 5).transpose(1, 3)) == (0, 3, 2, 1)


def test_channels_last_samples_make_a_channels_last_batch_of_their_pixels() -> None:
    crop = torch.ones(6, 7, 3, dtype=torch.uint8).permute(2, 0, 1)[:, :, 1:6]  # rows apart
    samples = [(hwc_image(i), i) for i in range(3)] + [(crop, 3)]
    images, labels = collate(samples)
    assert images.shape == (4, 3, 6, 5) and images.is_contiguous(memory_format=CHANNELS_LAST)
    assert torch.equal(images, torch.stack([image.contiguous() for image, _ in samples]))
    assert labels.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "second",
    [
        lambda: hwc_image(1).contiguous(),  # another layout: torch's order
        lambda: torch.zeros(5, 6, 3, dtype=torch.uint8).permute(2, 1, 0),  # another order
    ],
)
def test_mixed_layouts_stack_as_torch_stacks_them(second) -> None:
    """Samples in different memory orders: torch's order, as default_collate gives it."""
    samples = [hwc_image(0), second()]
    batch = collate(samples)
    assert batch.is_contiguous()
    assert torch.equal(batch, torch.stack(samples))


def test_other_tensors_collate_as_default_collate_does() -> None:
    batch = [(torch.arange(4.0).reshape(2, 2).t(), 1.5, {"n": torch.tensor(i)}) for i in range(3)]
    (x, y, z), (x_ref, y_ref, z_ref) = collate(batch), torch.utils.data.default_collate(batch)
    assert torch.equal(x, x_ref) and x.stride() == (4, 1, 2)  # the transposed order kept
    assert torch.equal(y, y_ref) and torch.equal(z["n"], z_ref["n"])
    with pytest.raises(RuntimeError, match="sparse"):
        collate([torch.eye(2).to_sparse()] * 2)


@pytest.mark.parametrize(
    ("fmt", "workers"),
    [
        ("lmdb", dlpipe.WorkerSettings(num_workers=0)),
        ("lmdb", dlpipe.WorkerSettings(num_workers=2)),
        ("lmdb", dlpipe.WorkerSettings(num_workers=2, engine="threads")),
        ("wds", dlpipe.WorkerSettings(num_workers=2)),
    ],
)
def test_loader_train_batches_are_channels_last_with_each_samples_crop(
    fmt, workers, tmp_path, samples
) -> None:
    """Full batches from workers (shared memory), from threads, and a wds stream's workers
    (shards of 5, batches of 8, a partial last one): each a channels-last batch, with the
    pixels the loading process makes alone; eval crops (views of channels-last decodes) too."""
    path = write_dataset(tmp_path / "data", fmt, {"train": samples}, max_shard_samples=5)
    for transform in ("train", "eval"):
        config = dlpipe.LoaderConfig(
            batch_size=8, transform=transform, image_size=16, drop_last=False, seed=4
        )
        loader = dlpipe.make_loader(path, "train", config, workers=workers, profile=None)
        batches = batch_list(loader)
        inline = dlpipe.make_loader(path, "train", config, workers=0, profile=None)
        assert per_sample(batches) == per_sample(batch_list(inline))
        assert all(images.is_contiguous(memory_format=CHANNELS_LAST) for images, _ in batches)


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_trainer_feeds_the_model_the_layout_it_is_configured_for(channels_last) -> None:
    """A channels-last batch from the loader reaches the model as `channels_last` says: the
    model's layout is a training choice, not the loader's."""
    from dlpipe.train.distributed import Distributed
    from dlpipe.train.step import Precision, StepRunner

    seen: list[torch.Tensor] = []
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(2))
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    model(torch.zeros(1, 3, 6, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dist = Distributed(0, 1, 0, torch.device("cpu"))
    runner = StepRunner(
        model, optimizer, scheduler, dist, Precision("fp32", None), channels_last=channels_last
    )
    images, labels = collate([(hwc_image(i), i % 2) for i in range(4)])
    runner.logits(model, images, labels)
    layout = CHANNELS_LAST if channels_last else torch.contiguous_format
    assert seen[-1].is_contiguous(memory_format=layout)
