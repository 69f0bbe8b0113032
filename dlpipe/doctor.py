"""``dlpipe doctor``: what on this machine will cost a training run time, and how to fix it.

Each check is a pure function of facts a `Probe` gathers (torch and its CUDA build, the GPUs,
``nvidia-smi``, memory, ``/dev/shm``, limits, the data disk), so tests give a fake probe what a
machine without GPUs lacks and the checks run exactly as they do for real.

``dlpipe doctor --data URL`` adds the dataset's storage (`data_checks`): whether it answers,
the manifest found there, the read bandwidth of one shard (at most `BANDWIDTH_BYTES`), and the
free space of the folder its shard cache would use; storage that does not answer is one
`DataUnreachableError`.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.markup import escape

from dlpipe import storage, turbojpeg
from dlpipe.errors import DlpipeError
from dlpipe.machine import usable_cpus
from dlpipe.manifest import MANIFEST_NAME, Manifest, read_manifest
from dlpipe.shard_fetch import open_url
from dlpipe.shard_store import cache_folder

__all__ = [
    "BANDWIDTH_BYTES",
    "Check",
    "DataUnreachableError",
    "GpuInfo",
    "Probe",
    "data_checks",
    "print_checks",
    "run_checks",
    "to_json",
]

GiB = 1 << 30
SHM_MIN_BYTES = 1 * GiB
OPEN_FILES_MIN = 4096
RAM_PER_GPU_MEMORY = 1.5
BANDWIDTH_BYTES = 32 << 20
"""``doctor --data`` reads at most this much of one shard to measure the read bandwidth."""


class DataUnreachableError(DlpipeError, OSError):
    """``doctor --data``: the storage at the URL did not answer a listing."""


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | info | warning | problem
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class GpuInfo:
    name: str
    memory_bytes: int
    capability: tuple[int, int]


@dataclass
class Probe:
    """The facts the checks read; the defaults ask this machine (fields override, for tests)."""

    data_dir: str = field(default_factory=lambda: os.environ.get("DLPIPE_DATA_DIR", "."))

    def torch_version(self) -> str:
        import torch

        return str(torch.__version__)

    def torch_cuda_version(self) -> str | None:
        """The CUDA version torch was built for (None: a CPU-only build)."""
        import torch

        return torch.version.cuda

    def gpus(self) -> list[GpuInfo]:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(GpuInfo(props.name, props.total_memory, (props.major, props.minor)))
        return out

    def nccl_version(self) -> str | None:
        import torch

        if not torch.cuda.is_available():
            return None
        try:
            version = torch.cuda.nccl.version()
        except (AttributeError, RuntimeError):
            return None
        return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)

    def nvidia_smi(self, *args: str) -> str | None:
        """``nvidia-smi``'s output, or None when it is not installed or fails."""
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None
        try:
            done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    def ram_bytes(self) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def cpu_count(self) -> int:
        return usable_cpus()

    def shm_bytes(self) -> int | None:
        try:
            stat = os.statvfs("/dev/shm")
        except OSError:
            return None
        return stat.f_frsize * stat.f_blocks

    def open_files_limit(self) -> int:
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    def disk_free_bytes(self, path: str) -> int:
        return shutil.disk_usage(storage.existing_ancestor(path)).free

    def on_system_disk(self, path: str) -> bool:
        return storage.on_system_disk(path)

    def jpeg_region_library(self) -> str | None:
        """The file of the libjpeg-turbo 3 library train crops decode regions with, or None."""
        library = turbojpeg.region_library()
        return None if library is None else str(getattr(library, "_name", "libturbojpeg"))

    def rotational(self, path: str) -> bool | None:
        """True for a spinning disk, False for solid state, None when the OS does not say."""
        dev = os.stat(storage.existing_ancestor(path)).st_dev
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for candidate in (f"{base}/queue/rotational", f"{base}/../queue/rotational"):
            try:
                with open(candidate) as f:
                    return f.read().strip() == "1"
            except OSError:
                continue
        return None


def run_checks(probe: Probe) -> list[Check]:
    """Every check, in the order a person reads them."""
    gpus = probe.gpus()
    checks = [_torch_build(probe, gpus), *_gpu_checks(gpus)]
    checks += _driver_checks(probe, gpus)
    checks += [
        _ram(probe, gpus),
        _cores(probe, gpus),
        _shm(probe),
        _open_files(probe),
        _jpeg_decode(probe),
        *_data_disk(probe),
    ]
    return checks


def _torch_build(probe: Probe, gpus: list[GpuInfo]) -> Check:
    version, cuda = probe.torch_version(), probe.torch_cuda_version()
    build = f"torch {version} ({f'CUDA {cuda} build' if cuda else 'CPU-only build'})"
    if gpus:
        return Check("torch", "ok", f"{build}; {len(gpus)} GPU(s) usable")
    if cuda is None and probe.nvidia_smi("-L"):
        return Check(
            "torch",
            "problem",
            f"{build}, but nvidia-smi lists GPUs",
            "install a CUDA build of torch (the PyTorch install selector gives the command)",
        )
    if probe.nvidia_smi("-L"):
        return Check(
            "torch",
            "problem",
            f"{build}: nvidia-smi lists GPUs but torch cannot use them",
            "see the CUDA driver check below; CUDA_VISIBLE_DEVICES may also hide them",
        )
    return Check("torch", "info", f"{build}; no GPU on this machine: dlpipe train runs on CPU")


def _gpu_checks(gpus: list[GpuInfo]) -> list[Check]:
    out = []
    for i, gpu in enumerate(gpus):
        major, minor = gpu.capability
        memory = f"{gpu.memory_bytes / GiB:.0f} GiB"
        detail = f"{gpu.name}, {memory}, compute capability {major}.{minor}"
        if major >= 8:
            out.append(Check(f"gpu {i}", "ok", f"{detail}; bf16 supported"))
        else:
            out.append(
                Check(
                    f"gpu {i}",
                    "warning",
                    f"{detail}; no bf16 (needs 8.0)",
                    "dlpipe train uses fp16 with a GradScaler here (--precision auto)",
                )
            )
    return out


def _driver_checks(probe: Probe, gpus: list[GpuInfo]) -> list[Check]:
    smi = probe.nvidia_smi()
    torch_cuda = probe.torch_cuda_version()
    if smi is None:
        return []
    out = []
    match = re.search(r"CUDA Version:\s*([\d.]+)", smi)
    if match and torch_cuda:
        driver = match.group(1)
        if _version(driver) < _version(torch_cuda)[:2]:
            out.append(
                Check(
                    "cuda driver",
                    "problem",
                    f"the driver supports CUDA up to {driver}, torch is built for {torch_cuda}: "
                    "torch fails with 'CUDA driver version is insufficient for CUDA runtime "
                    "version'",
                    f"update the NVIDIA driver to one for CUDA {torch_cuda}, or install the torch "
                    f"build for CUDA {driver} or older",
                )
            )
        else:
            out.append(Check("cuda driver", "ok", f"driver CUDA {driver} >= torch's {torch_cuda}"))
    nccl = probe.nccl_version()
    if gpus and nccl:
        out.append(Check("nccl", "ok", f"NCCL {nccl}"))
    if len(gpus) > 1:
        out.append(_topology(probe.nvidia_smi("topo", "-m")))
    return out


def _topology(text: str | None) -> Check:
    """Read ``nvidia-smi topo -m``: NV# links are fast; SYS/NODE/PHB go through the CPU."""
    if not text:
        return Check("interconnect", "info", "nvidia-smi topo -m gave nothing to read")
    rows = [line.split() for line in text.splitlines() if re.match(r"^GPU\d+\s", line)]
    count = len(rows)
    links = {r[1 + j] for r in rows for j in range(count) if len(r) > count and r[1 + j] != "X"}
    slow = sorted(links & {"SYS", "NODE", "PHB", "PXB", "PIX"})
    if not slow:
        return Check("interconnect", "ok", f"GPUs linked by {', '.join(sorted(links))} (NVLink)")
    return Check(
        "interconnect",
        "warning",
        f"some GPU pairs talk through {', '.join(slow)} (PCIe or the CPU), not NVLink",
        "gradient all-reduce will be slower; a larger --batch-size with --micro-batch "
        "(more accumulation) syncs less often",
    )


def _ram(probe: Probe, gpus: list[GpuInfo]) -> Check:
    ram = probe.ram_bytes()
    gpu_total = sum(g.memory_bytes for g in gpus)
    detail = f"{ram / GiB:.0f} GiB system RAM"
    if not gpus:
        return Check("memory", "ok", detail)
    ratio = ram / gpu_total
    detail += f", {ratio:.1f}x the GPUs' {gpu_total / GiB:.0f} GiB"
    if ratio < RAM_PER_GPU_MEMORY:
        return Check(
            "memory",
            "warning",
            detail,
            "at least 1.5-2x the total GPU memory is recommended (pinned buffers, loader "
            "workers, checkpoints); use fewer workers or a smaller prefetch_factor",
        )
    return Check("memory", "ok", detail)


def _cores(probe: Probe, gpus: list[GpuInfo]) -> Check:
    cores = probe.cpu_count()
    ranks = max(1, len(gpus))
    workers = max(0, cores // ranks - 1)
    detail = f"{cores} CPU cores: about {workers} loader workers per {'GPU' if gpus else 'process'}"
    if workers < 2 and gpus:
        return Check(
            "cpu",
            "warning",
            detail,
            "decoding may not keep the GPUs busy: run dlpipe bench-loader, convert with "
            "--max-side near your --image-size",
        )
    return Check("cpu", "ok", detail)


def _shm(probe: Probe) -> Check:
    size = probe.shm_bytes()
    if size is None:
        return Check("/dev/shm", "warning", "no /dev/shm", "DataLoader workers need shared memory")
    detail = f"/dev/shm is {size / GiB:.2f} GiB"
    if size < SHM_MIN_BYTES:
        return Check(
            "/dev/shm",
            "problem",
            detail + ": DataLoader workers pass batches through it and die with 'bus error' or "
            "'DataLoader worker ... killed'",
            "in Docker run with --shm-size=8g (or --ipc=host); on Kubernetes mount an emptyDir "
            "with medium: Memory at /dev/shm",
        )
    return Check("/dev/shm", "ok", detail)


def _open_files(probe: Probe) -> Check:
    limit = probe.open_files_limit()
    detail = f"open-file limit {limit}"
    if limit < OPEN_FILES_MIN:
        return Check(
            "open files",
            "warning",
            detail + ": many shards x workers can exhaust it ('Too many open files')",
            "raise it: ulimit -n 65536 (or nofile in /etc/security/limits.conf)",
        )
    return Check("open files", "ok", detail)


def _jpeg_decode(probe: Probe) -> Check:
    library = probe.jpeg_region_library()
    if library is not None:
        name = os.path.basename(library)
        return Check("jpeg decode", "ok", f"train crops decode only the box's region ({name})")
    detail = "train crops decode whole JPEGs: no libjpeg-turbo 3 with a cropping region here"
    return Check("jpeg decode", "info", detail, turbojpeg.INSTALL_HINT)


def _data_disk(probe: Probe) -> list[Check]:
    path = probe.data_dir
    where = f"data dir {os.path.abspath(path)}"
    free = probe.disk_free_bytes(path)
    out = [Check("data disk", "ok", f"{where}: {free / 1e9:.0f} GB free")]
    if free < 10e9:
        out[0] = Check(
            "data disk",
            "warning",
            f"{where}: only {free / 1e9:.1f} GB free",
            "point --data-dir or DLPIPE_DATA_DIR at a bigger disk",
        )
    if probe.on_system_disk(path):
        out.append(
            Check(
                "system disk",
                "warning",
                f"{where} is on the system disk (the one holding /)",
                "put datasets on a data disk: set DLPIPE_DATA_DIR (or --out) to its mount",
            )
        )
    spinning = probe.rotational(path)
    if spinning is not None:
        kind = "a rotational disk (HDD)" if spinning else "solid state"
        fix: str | None = None
        if spinning:
            fix = "random reads are slow on HDDs: prefer wds (sequential) or local SSD/NVMe"
        status = "warning" if spinning else "ok"
        out.append(Check("disk kind", status, f"{where} is {kind}", fix))
    return out


def data_checks(url: str, cache_dir: str | None = None) -> list[Check]:
    """The dataset storage at `url`, one check each: it answers (a listing), the manifest
    found there, the read bandwidth of its first shard, and (a URL) its cache's free space.

    Raises:
        DataUnreachableError: the storage does not answer (named, with the fix).
    """
    names, seconds = _listing(url)
    where = f"{url}: {len(names)} entries listed in {seconds * 1000:.0f} ms"
    checks = [Check("data reachable", "ok", where)]
    manifest, check = _manifest(url, names)
    checks.append(check)
    if manifest is None:
        return checks
    shards = [s for split in manifest.splits.values() for s in split.shards]
    if shards:
        checks.append(_bandwidth(storage.join(url, shards[0].name), shards[0].bytes))
    if storage.is_url(url):
        checks.append(_cache_space(url, cache_dir, sum(s.bytes for s in shards)))
    return checks


def _listing(url: str) -> tuple[list[str], float]:
    import fsspec

    started = time.monotonic()
    try:
        fs, path = fsspec.core.url_to_fs(url)
        names = sorted(os.path.basename(str(n).rstrip("/")) for n in fs.ls(path, detail=False))
    except Exception as exc:  # fsspec, botocore and aiohttp errors alike
        raise DataUnreachableError(
            f"{url} cannot be listed ({type(exc).__name__}: {exc}); check the URL, the "
            "endpoint (AWS_ENDPOINT_URL or the fsspec options) and the credentials"
        ) from None
    return names, time.monotonic() - started


def _manifest(url: str, names: list[str]) -> tuple[Manifest | None, Check]:
    if MANIFEST_NAME not in names:
        found = f"{len(names)} entries" if names else "nothing"
        fix = "point --data at the folder holding dlpipe.json (a finished dlpipe convert)"
        return None, Check("data manifest", "problem", f"{url} holds {found}, no dlpipe.json", fix)
    try:
        manifest = read_manifest(url)
    except DlpipeError as exc:
        return None, Check("data manifest", "problem", str(exc), "re-run the conversion")
    splits = ", ".join(
        f"{name} {split.samples} samples in {len(split.shards)} shards"
        for name, split in manifest.splits.items()
    )
    return manifest, Check("data manifest", "ok", f"{manifest.format}: {splits}")


def _bandwidth(url: str, size: int) -> Check:
    wanted, read, started = min(size, BANDWIDTH_BYTES), 0, time.monotonic()
    try:
        with open_url(url) as f:
            while read < wanted and (chunk := f.read(min(8 << 20, wanted - read))):
                read += len(chunk)
    except Exception as exc:
        detail = f"{url} cannot be read ({type(exc).__name__}: {exc})"
        return Check("data read", "problem", detail, "check read permission on the shards")
    seconds = max(time.monotonic() - started, 1e-9)
    detail = f"{read / seconds / 1e6:.1f} MB/s ({read / 1e6:.1f} MB of {url} in {seconds:.2f} s)"
    return Check("data read", "ok", detail)


def _cache_space(url: str, cache_dir: str | None, dataset_bytes: int) -> Check:
    folder = cache_folder(url, cache_dir)
    free = shutil.disk_usage(storage.existing_ancestor(folder)).free
    detail = f"{folder}: {free / 1e9:.1f} GB free for a {dataset_bytes / 1e9:.2f} GB dataset"
    if free < dataset_bytes:
        fix = "shards are evicted and downloaded again each epoch: point cache_dir at a bigger disk"
        return Check("shard cache", "warning", detail, fix)
    return Check("shard cache", "ok", detail)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def to_json(checks: list[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in checks]


_STYLE = {"ok": "green", "info": "cyan", "warning": "yellow", "problem": "red"}


def print_checks(checks: list[Check], console: Any) -> None:
    """One line per check (status, name, what was found), the fix indented under it."""
    for check in checks:  # details hold paths and GPU names: printed escaped, not as markup
        style = _STYLE[check.status]
        console.print(
            f"[{style}]{check.status:<8}[/{style}] {escape(check.name)}: {escape(check.detail)}"
        )
        if check.fix:
            console.print(f"         fix: {escape(check.fix)}")
    problems = sum(c.status == "problem" for c in checks)
    warnings = sum(c.status == "warning" for c in checks)
    console.print(f"{problems} problems, {warnings} warnings")
