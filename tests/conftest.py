"""Shared fixtures: the test session gets its own Deltafin home (catalog, chat history), so nothing lands in the
user's; ``one_thread`` for modules of tiny tensors; ``timing`` for the wall-clock tests; ``gemm_build`` for the int16
GEMM's builds; ``k3_model``, a tiny Kimi K3 packed over two drives, once per module."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _deltafin_home(tmp_path_factory):
    old = os.environ.get("DELTAFIN_HOME")
    os.environ["DELTAFIN_HOME"] = str(tmp_path_factory.mktemp("deltafin-home"))
    yield
    if old is None:
        os.environ.pop("DELTAFIN_HOME", None)
    else:
        os.environ["DELTAFIN_HOME"] = old


@pytest.fixture(params=["native", "avx2", "avx2-novnni"])
def gemm_build(request, monkeypatch):
    """Each build of the CPU kernels' int16 GEMM this machine can run, selected for the test's kernel calls through
    DELTAFIN_CPU_ISA: its own (AVX-512 where present) and, on x86, those of machines without AVX-512 (AVX2 with and
    without AVX-VNNI). Skipped where the build has no GEMM."""
    import platform

    from deltafin.kernels import cpu

    if request.param != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 builds are x86's")
    monkeypatch.setenv("DELTAFIN_CPU_ISA", request.param)
    if not cpu.available() or not cpu.gemm_enabled():
        pytest.skip(f"the {request.param} build here has no int16 GEMM")
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: thread start-up costs more than it saves, and spinning threads stall a busy CI box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def busy_reason() -> str | None:
    """Why this machine is too busy for timing tests (other jobs competing for its CPUs), or None."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > cpus:
        return f"load average {load:.1f} on {cpus} CPUs"
    try:
        with open("/proc/pressure/cpu") as f:
            some = float(f.readline().split()[1].split("=")[1])  # "some avg10=12.34 ..."
    except (OSError, IndexError, ValueError):
        return None
    return f"CPU pressure {some:.0f}% (tasks waiting for a CPU)" if some > 25 else None


@pytest.fixture
def timing():
    """Wall-clock tests measure the machine as much as the code: they are marked ``timing`` (out of the default
    run: ``python -m pytest -m timing``) and skip while other jobs compete for the CPUs."""
    reason = busy_reason()
    if reason:
        pytest.skip(f"{reason}: timing would measure other jobs, not the code")


@pytest.fixture(scope="module")
def k3_model(tmp_path_factory):
    """A folder holding a tiny Kimi K3 checkpoint (src) and its default pack over two drives (model)."""
    from deltafin.k3_tiny import write_tiny_k3
    from deltafin.store.drives import parse_drives
    from deltafin.store.pack import PackOptions, pack

    root = tmp_path_factory.mktemp("k3")
    write_tiny_k3(root / "src")
    pack(str(root / "src"), str(root / "model"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]),
         PackOptions(progress=False))
    return root
