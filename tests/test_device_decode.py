"""decode="cuda": workers read bytes and plan the crop, the batch decodes on the device.

Without CUDA the same code runs with the CPU as the device (``decode_device`` patched): the
planning in the workers, the batched ``decode_jpeg``, the crop/resize/flip on the device and
the CPU fallback for what nvJPEG cannot take are all exercised; only nvJPEG itself is not.
"""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
import torch
from conftest import FORMAT_NAMES, resumed_rest, write_dataset
from PIL import Image

import dlpipe
from dlpipe.errors import FieldDecodeError
from dlpipe.loading import stages as stages_module
from dlpipe.loading.config import LoaderConfigError
from dlpipe.loading.device_decode import (
    DecodeDeviceError,
    EncodedImage,
    PlannedTransform,
    collate_planned,
)
from dlpipe.loading.transforms import ImageTransform

CUDA = torch.cuda.is_available()


@pytest.fixture
def cpu_as_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stages_module, "decode_device", lambda: torch.device("cpu"))


def photo(width: int, height: int, seed: int, mode: str = "RGB", fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 / width, y * 255 / height, (x + y) % 97 * 2.6], axis=-1)
    pixels += rng.normal(0, 6, pixels.shape)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 92} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def photo_samples(count: int, kinds=("jpg",)) -> list[dict]:
    samples = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        size = (90 + 37 * (i % 5), 70 + 23 * (i % 4))
        mode = {"grey": "L", "cmyk": "CMYK"}.get(kind, "RGB")
        data = photo(*size, i, mode=mode, fmt="PNG" if kind == "png" else "JPEG")
        samples.append({"__key__": f"s{i:04d}", "jpg": data, "cls": str(i % 3).encode()})
    return samples


def _pairs(
    path: str, decode: str, num_workers: int | None = None, shuffle: bool | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = dlpipe.LoaderConfig(batch_size=4, image_size=48, seed=3, shuffle=shuffle)
    count = {} if num_workers is None else {"num_workers": num_workers}
    loader = dlpipe.make_loader(
        path, "train", config, workers={"decode": decode, **count}, profile=None
    )
    return [(images.cpu().clone(), labels.clone()) for images, labels in loader]


def _compare(device, cpu) -> float:
    assert len(device) == len(cpu) > 0
    diffs = []
    for (a, la), (b, lb) in zip(device, cpu, strict=True):
        assert a.dtype == torch.uint8 and a.shape == b.shape == (len(la), 3, 48, 48)
        for images in (a, b):  # both paths lay batches out channels-last
            assert images.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(la, lb)  # same samples in the same order
        diffs.append(float((a.float() - b.float()).abs().mean()))
    return max(diffs)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("split", ["train", "val"])
def test_device_decode_gives_the_cpu_batches_within_interpolation_error(
    fmt, split, tmp_path, cpu_as_device
) -> None:
    """Same boxes, same flips (the same seeded draws), same samples in the same order; the
    pixels differ by the float against uint8 resize kernels only."""
    samples = photo_samples(20, kinds=("jpg", "grey"))
    path = write_dataset(tmp_path / fmt, fmt, {"train": samples, "val": samples[:10]})
    worst = _compare(_pairs(path, "cuda", num_workers=2), _pairs(path, "cpu", num_workers=2))
    assert worst < 1.0, worst  # of 255; a wrong box or flip gives tens


def test_the_comparison_tells_a_wrong_flip(tmp_path, cpu_as_device, monkeypatch) -> None:
    """The test above has power: planning the opposite flip is caught."""
    samples = photo_samples(12)
    path = write_dataset(tmp_path / "d", "lmdb", {"train": samples})
    real = PlannedTransform._plan

    def flipped(self, *args):
        plan = real(self, *args)
        plan[4] = 1 - plan[4]
        return plan

    monkeypatch.setattr(PlannedTransform, "_plan", flipped)
    assert _compare(_pairs(path, "cuda"), _pairs(path, "cpu", num_workers=0)) > 5


def test_what_the_device_cannot_decode_is_decoded_in_the_worker(tmp_path, cpu_as_device) -> None:
    """PNG and CMYK JPEGs travel as finished crops, exactly the CPU path's; JPEGs as bytes."""
    samples = photo_samples(12, kinds=("jpg", "png", "cmyk"))
    planner = PlannedTransform(ImageTransform("train", 48, "jpg", seed=3))
    kinds = [type(planner(s, 0, i)[0]) for i, s in enumerate(samples[:3])]
    assert kinds == [EncodedImage, torch.Tensor, torch.Tensor]
    path = write_dataset(tmp_path / "d", "hdf5", {"train": samples})
    device, cpu = _pairs(path, "cuda", shuffle=False), _pairs(path, "cpu", shuffle=False)
    assert _compare(device, cpu) < 1.0
    finished = 0
    for batch, ((a, _), (b, _)) in enumerate(zip(device, cpu, strict=True)):
        for k in range(4):
            if (batch * 4 + k) % 3:  # a PNG or a CMYK JPEG: the worker's own crop, exactly
                assert torch.equal(a[k], b[k])
                finished += 1
    assert finished == 8


@pytest.mark.parametrize("count", [3, 12])
def test_a_planned_batch_travels_as_a_few_tensors_whatever_its_size(count) -> None:
    """Every JPEG of the batch end to end in one tensor, the worker-made crops stacked in
    another: the trip to the main process costs the same few tensors for 3 samples or 12."""
    samples = photo_samples(count, kinds=("jpg", "png", "grey"))
    planner = PlannedTransform(ImageTransform("train", 48, "jpg", seed=3))
    planned, labels = collate_planned([planner(s, 0, i) for i, s in enumerate(samples)])
    tensors = [field for field in planned if isinstance(field, torch.Tensor)]
    assert len(tensors) == 6 and labels.tolist() == [i % 3 for i in range(count)]
    jpegs = [i for i in range(count) if i % 3 != 1]
    assert planned.encoded_at.tolist() == jpegs and planned.samples == count
    bounds = planned.offsets.tolist()
    for j, i in enumerate(jpegs):
        assert bytes(planned.data[bounds[j] : bounds[j + 1]].numpy()) == samples[i]["jpg"]
        assert planned.keys[j] == samples[i]["__key__"]
    pngs = [i for i in range(count) if i % 3 == 1]
    assert planned.finished_at.tolist() == pngs and planned.finished.shape == (len(pngs), 3, 48, 48)


@pytest.mark.parametrize("fmt", ["lmdb", "wds"])
def test_a_device_decode_state_resumes_exactly(fmt, tmp_path, cpu_as_device) -> None:
    path = write_dataset(tmp_path / fmt, fmt, {"train": photo_samples(24)}, max_shard_samples=6)
    settings = dlpipe.WorkerSettings(num_workers=2, engine="threads", decode="cuda")

    def loader():
        return dlpipe.make_loader(
            path,
            "train",
            dlpipe.LoaderConfig(batch_size=4, image_size=48, seed=3),
            workers=settings,
        )

    rest, again = resumed_rest(loader, 2)
    assert len(rest) == len(again) == 4
    for (a, la), (b, lb) in zip(rest, again, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_a_jpeg_that_fails_on_the_device_names_its_sample(tmp_path, cpu_as_device) -> None:
    samples = photo_samples(8)
    data = samples[5]["jpg"]
    samples[5]["jpg"] = data[: len(data) * 2 // 3]  # the header reads; the scan is cut short
    path = write_dataset(tmp_path / "d", "lmdb", {"train": samples})
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, image_size=48),
        workers={"num_workers": 0, "decode": "cuda"},
    )
    with pytest.raises(FieldDecodeError, match=r"sample 's0005'.*does not decode on cpu"):
        list(loader)


def test_the_pixel_limit_holds_before_any_bytes_leave_the_worker(tmp_path, monkeypatch):
    from dlpipe.codecs import ImageTooLargeError

    monkeypatch.setenv("DLPIPE_MAX_IMAGE_PIXELS", "5000")
    planner = PlannedTransform(ImageTransform("train", 48, "jpg"))
    with pytest.raises(ImageTooLargeError, match="s0000"):
        planner(photo_samples(1)[0], 0, 0)


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_decode_cuda_without_cuda_is_one_named_error(make_dataset) -> None:
    with pytest.raises(DecodeDeviceError, match="decode='cuda' needs a CUDA device.*decode='cpu'"):
        dlpipe.make_loader(
            make_dataset("lmdb"),
            "train",
            dlpipe.LoaderConfig(batch_size=4),
            workers={"decode": "cuda"},
        )


def test_auto_decodes_on_the_cpu_without_a_gpu_profile(make_dataset) -> None:
    loader = dlpipe.make_loader(
        make_dataset("lmdb"), "train", dlpipe.LoaderConfig(batch_size=4, image_size=32)
    )
    images, _ = next(iter(loader))
    assert images.device.type == "cpu" and images.shape == (4, 3, 32, 32)


def test_decode_cuda_needs_an_image_transform(make_dataset, cpu_as_device) -> None:
    with pytest.raises(LoaderConfigError, match="decode='cuda' with transform=None"):
        dlpipe.make_loader(
            make_dataset("lmdb"),
            "train",
            dlpipe.LoaderConfig(batch_size=4, transform=None),
            workers={"decode": "cuda"},
        )
    with pytest.raises(LoaderConfigError, match="decode='gpu' is not 'cpu' or 'cuda'"):
        dlpipe.make_loader(
            make_dataset("wds"),
            "train",
            dlpipe.LoaderConfig(batch_size=4),
            workers={"decode": "gpu"},
        )


@pytest.mark.skipif(not CUDA, reason="needs CUDA (nvJPEG)")
def test_nvjpeg_batches_are_on_the_gpu_and_match_the_cpu(tmp_path) -> None:
    samples = photo_samples(16, kinds=("jpg", "grey", "png"))
    path = write_dataset(tmp_path / "d", "lmdb", {"train": samples})
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, image_size=48, seed=3),
        workers={"decode": "cuda"},
    )
    images, _ = next(iter(loader))
    assert images.is_cuda and images.dtype == torch.uint8
    # a fresh loader: each iter() is the next epoch, another order
    device = _pairs(path, "cuda", num_workers=2)
    assert _compare(device, _pairs(path, "cpu", num_workers=0)) < 3.0  # nvJPEG's own IDCT


def test_the_next_batch_decodes_on_a_background_thread_while_this_one_is_used(
    tmp_path, cpu_as_device, monkeypatch
) -> None:
    """One batch ahead: when the caller holds batch k, batch k+1 was handed to the decode
    thread (so its decode overlaps the caller's step)."""
    import threading

    from dlpipe.loading.device_decode import DeviceDecoder

    seen: list[str] = []
    real = DeviceDecoder.__call__

    def recorded(self, batch):
        seen.append(threading.current_thread().name)
        return real(self, batch)

    monkeypatch.setattr(DeviceDecoder, "__call__", recorded)
    path = write_dataset(tmp_path / "d", "wds", {"train": photo_samples(16)})
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, image_size=48),
        workers={"num_workers": 0, "decode": "cuda"},
    )
    iterator = iter(loader)
    next(iterator)
    deadline = time.monotonic() + 600  # a bound on a hang only: the state is sure to come
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the second batch was queued before the first was handed over
    assert len(seen) == 2
    assert all(name.startswith("dlpipe-device-decode") for name in seen)
    assert len(list(iterator)) == 3


def test_a_seekable_jpeg_travels_cut_to_its_box_and_decodes_to_the_same_batches(
    tmp_path, cpu_as_device
) -> None:
    """``convert --seekable-jpeg`` data: the workers send only the MCUs around each train box,
    and the device's batches are the whole JPEGs' (libjpeg-turbo here: pixel for pixel)."""
    from test_jpeg_seek import needs_library

    from dlpipe.jpeg_seek import add_restart_markers

    if needs_library.args[0]:
        pytest.skip(needs_library.kwargs["reason"])
    plain = [
        dict(s, jpg=photo(300 + 16 * (i % 4), 240, i)) for i, s in enumerate(photo_samples(12))
    ]
    seekable = [dict(s, jpg=add_restart_markers(s["jpg"])) for s in plain]
    planned = PlannedTransform(ImageTransform("train", 48, "jpg", seed=3))
    sent = [len(planned(s, 0, i)[0].data) for i, s in enumerate(seekable)]
    assert sum(sent) < 0.8 * sum(len(s["jpg"]) for s in seekable)
    paths = [
        write_dataset(tmp_path / n, "lmdb", {"train": d})
        for n, d in (("a", plain), ("b", seekable))
    ]
    device = _pairs(paths[1], "cuda", num_workers=0)
    for (a, la), (b, lb) in zip(device, _pairs(paths[0], "cuda", num_workers=0), strict=True):
        assert torch.equal(la, lb) and torch.equal(a, b)
