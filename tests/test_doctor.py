"""dlpipe doctor: each check fed the facts of machines this one is not, through a fake Probe."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dlpipe.cli import main
from dlpipe.doctor import GiB, GpuInfo, Probe, run_checks

SMI = """+-----------------------------------------------------------------------------+
| NVIDIA-SMI 525.60.13    Driver Version: 525.60.13    CUDA Version: {cuda}     |
+-----------------------------------------------------------------------------+"""
TOPO_NVLINK = """\tGPU0\tGPU1\tCPU Affinity
GPU0\t X \tNV12\t0-31
GPU1\tNV12\t X \t0-31
"""
TOPO_PCIE = """\tGPU0\tGPU1\tCPU Affinity
GPU0\t X \tSYS\t0-15
GPU1\tSYS\t X \t16-31
"""


@dataclass
class FakeProbe(Probe):
    """A machine described by its fields; every check reads it through the Probe methods."""

    fake_gpus: list[GpuInfo] = field(default_factory=list)
    cuda_build: str | None = "12.4"
    driver_cuda: str | None = None
    topo: str | None = None
    ram: int = 64 * GiB
    cores: int = 32
    shm: int | None = 16 * GiB
    nofile: int = 65536
    free: int = 500 * 10**9
    system_disk: bool = False
    spinning: bool | None = False
    region_library: str | None = "/site-packages/turbojpeg.libs/libturbojpeg-dd00d054.so.0.3.0"

    def torch_version(self) -> str:
        return "2.5.1"

    def torch_cuda_version(self) -> str | None:
        return self.cuda_build

    def gpus(self) -> list[GpuInfo]:
        return self.fake_gpus

    def nccl_version(self) -> str | None:
        return "2.21.5" if self.fake_gpus else None

    def nvidia_smi(self, *args: str) -> str | None:
        if self.driver_cuda is None:
            return None
        if args == ("topo", "-m"):
            return self.topo
        if args == ("-L",):
            return "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1)"
        return SMI.format(cuda=self.driver_cuda)

    def ram_bytes(self) -> int:
        return self.ram

    def cpu_count(self) -> int:
        return self.cores

    def shm_bytes(self) -> int | None:
        return self.shm

    def open_files_limit(self) -> int:
        return self.nofile

    def disk_free_bytes(self, path: str) -> int:
        return self.free

    def on_system_disk(self, path: str) -> bool:
        return self.system_disk

    def rotational(self, path: str) -> bool | None:
        return self.spinning

    def jpeg_region_library(self) -> str | None:
        return self.region_library


A100 = GpuInfo("NVIDIA A100-SXM4-80GB", 80 * GiB, (8, 0))
V100 = GpuInfo("Tesla V100-SXM2-16GB", 16 * GiB, (7, 0))


def by_name(probe: Probe) -> dict[str, object]:
    return {c.name: c for c in run_checks(probe)}


def test_a_healthy_gpu_node_is_all_ok() -> None:
    probe = FakeProbe(fake_gpus=[A100] * 2, driver_cuda="12.4", topo=TOPO_NVLINK, ram=400 * GiB)
    checks = by_name(probe)
    assert {c.status for c in checks.values()} == {"ok"}, checks
    assert (
        "bf16 supported" in checks["gpu 0"].detail
        and "compute capability 8.0" in checks["gpu 0"].detail
    )
    assert checks["nccl"].detail == "NCCL 2.21.5"
    assert "NV12" in checks["interconnect"].detail


def test_an_old_driver_is_explained_with_the_fix() -> None:
    check = by_name(FakeProbe(fake_gpus=[A100], driver_cuda="11.8", ram=200 * GiB))["cuda driver"]
    assert check.status == "problem"
    assert "CUDA driver version is insufficient" in check.detail and "11.8" in check.detail
    assert "update the NVIDIA driver" in check.fix


def test_gpus_torch_cannot_see_are_a_problem() -> None:
    check = by_name(FakeProbe(cuda_build=None, driver_cuda="12.4"))["torch"]
    assert check.status == "problem" and "CPU-only build" in check.detail
    assert "CUDA build of torch" in check.fix


def test_no_bf16_pcie_little_ram_few_cores() -> None:
    probe = FakeProbe(
        fake_gpus=[V100] * 2, driver_cuda="12.4", topo=TOPO_PCIE, ram=24 * GiB, cores=4
    )
    checks = by_name(probe)
    assert checks["gpu 0"].status == "warning" and "fp16" in checks["gpu 0"].fix
    assert checks["interconnect"].status == "warning" and "SYS" in checks["interconnect"].detail
    assert checks["memory"].status == "warning" and "0.8x" in checks["memory"].detail
    assert checks["cpu"].status == "warning" and "about 1 loader workers" in checks["cpu"].detail


def test_a_docker_default_shm_and_low_limits() -> None:
    probe = FakeProbe(shm=64 << 20, nofile=1024, free=2 * 10**9, system_disk=True, spinning=True)
    checks = by_name(probe)
    assert checks["/dev/shm"].status == "problem" and "--shm-size" in checks["/dev/shm"].fix
    assert checks["open files"].status == "warning" and "ulimit -n" in checks["open files"].fix
    assert checks["data disk"].status == "warning" and "2.0 GB free" in checks["data disk"].detail
    assert checks["system disk"].status == "warning"
    assert checks["disk kind"].status == "warning" and "HDD" in checks["disk kind"].detail


def test_without_a_gpu_it_says_so_and_checks_the_rest() -> None:
    checks = by_name(FakeProbe())
    assert checks["torch"].status == "info" and "no GPU" in checks["torch"].detail
    assert {"memory", "cpu", "/dev/shm", "open files", "data disk"} <= set(checks)


def test_the_command_on_this_machine(tmp_path, capsys) -> None:
    assert main(["doctor", "--data-dir", str(tmp_path), "--json"]) in (0, 1)
    checks = json.loads(capsys.readouterr().out)
    assert {c["status"] for c in checks} <= {"ok", "info", "warning", "problem"}
    assert any(c["name"] == "data disk" and str(tmp_path) in c["detail"] for c in checks)


def test_a_problem_makes_the_exit_code_1(monkeypatch, capsys) -> None:
    monkeypatch.setattr("dlpipe.doctor.Probe.shm_bytes", lambda self: 64 << 20)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "problem" in out and "--shm-size=8g" in out


@pytest.mark.parametrize("text", ["", None])
def test_an_unreadable_topology_is_only_information(text) -> None:
    probe = FakeProbe(fake_gpus=[A100] * 2, driver_cuda="12.4", topo=text, ram=400 * GiB)
    assert by_name(probe)["interconnect"].status == "info"


def test_a_machine_without_region_decode_is_told_the_extra_that_gives_it() -> None:
    with_it = by_name(FakeProbe())["jpeg decode"]
    assert with_it.status == "ok" and "libturbojpeg-dd00d054.so.0.3.0" in with_it.detail
    without = by_name(FakeProbe(region_library=None))["jpeg decode"]
    assert without.status == "info" and "pip install 'dlpipe[jpeg-region]'" in without.fix


def test_the_real_probe_finds_what_the_loader_decodes_with(monkeypatch) -> None:
    from dlpipe import turbojpeg

    found = Probe().jpeg_region_library()
    assert (found is None) == (turbojpeg.region_library() is None)
    monkeypatch.setenv(turbojpeg.REGION_ENV, "0")
    assert Probe().jpeg_region_library() is None


# --- doctor --data: a dataset's storage ----------------------------------------------------------


@pytest.fixture
def on_s3(s3_env, tmp_path, monkeypatch) -> str:
    """A small lmdb dataset on the S3 server (this process's clients pointed at it)."""
    import s3fs
    from conftest import write_dataset

    from dlpipe.synthetic import synthetic_samples

    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("DLPIPE_DATA_DIR", raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    folder = Path(write_dataset(tmp_path / "lmdb", "lmdb", {"train": list(synthetic_samples(16))}))
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    if not fs.exists("doctor"):
        fs.mkdir("doctor")
    for path in folder.iterdir():
        if path.is_file() and not path.name.startswith("."):
            fs.put_file(str(path), f"doctor/data/{path.name}")
    return "s3://doctor/data"


def test_doctor_data_reports_reach_manifest_bandwidth_and_cache(on_s3, tmp_path, capsys) -> None:
    main(["doctor", "--data", on_s3, "--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["data reachable"]["status"] == "ok"
    assert checks["data manifest"]["detail"] == "lmdb: train 16 samples in 2 shards"
    assert checks["data read"]["status"] == "ok" and " MB/s (" in checks["data read"]["detail"]
    cache = checks["shard cache"]
    assert (
        cache["status"] == "ok" and str(tmp_path / "xdg" / "dlpipe" / "shards") in cache["detail"]
    )


def test_doctor_data_without_a_manifest_is_a_problem(on_s3, capsys) -> None:
    assert main(["doctor", "--data", on_s3.rsplit("/", 1)[0]]) == 1
    out = capsys.readouterr().out
    assert "no dlpipe.json" in out and "finished dlpipe convert" in out


def test_doctor_data_unreachable_is_one_error_line(monkeypatch, capsys) -> None:
    from conftest import one_error

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    assert main(["doctor", "--data", "s3://nowhere/data"]) == 2
    line = one_error(capsys)
    assert "s3://nowhere/data cannot be listed" in line and "AWS_ENDPOINT_URL" in line
    s3fs.S3FileSystem.clear_instance_cache()
