"""xxh3-64 on the GPU (``kernels/triton_xxh3.py``) and reads checked there (``--verify-on gpu``).

The decomposition's numpy reference and the Triton kernel (under Triton's interpreter without a GPU, on small
rows) must give ``xxhash.xxh3_64_intdigest`` bit for bit, at lengths on and off the stripe (64) and block
(1,024) boundaries. The failover a mismatch found after landing takes (``LayerReads.reread``) runs here on the
CPU. On a GPU machine (``-m gpu``): Kimi K3-size rows, a tiny model decoded with checks on the GPU against
checks on the host (bit-identical logits), and a corrupted expert file caught on the GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xxhash

if not torch.cuda.is_available():  # the interpreter must be chosen before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deltafin.errors import ExpertChecksumError, UsageError  # noqa: E402
from deltafin.kernels import xxh3_ref  # noqa: E402
from tests import tiny_families as tf  # noqa: E402

LENGTHS = [241, 255, 256, 1023, 1024, 1025, 1088, 16 * 1024, 16 * 1024 + 1, 17 * 1024 - 1, 64 * 1024 + 37]
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rows(n_rows: int, stride: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n_rows, stride), dtype=np.uint8)


@pytest.mark.parametrize("n", LENGTHS + [240 + 64 * 16 * 3, 4096 * 5])
def test_reference_decomposition_equals_xxhash(n):
    buf = _rows(1, n, n)[0]
    assert xxh3_ref.digest(buf) == xxhash.xxh3_64_intdigest(buf.tobytes())
    buf[n // 2] ^= 0x10  # and a byte changed anywhere changes it
    assert xxh3_ref.digest(buf) == xxhash.xxh3_64_intdigest(buf.tobytes())


def test_reference_refuses_short_inputs():
    with pytest.raises(AssertionError, match="240"):
        xxh3_ref.shape(240)


def _kernel_rows(dev: str, data: np.ndarray, rows: list[int], lengths: list[int]) -> list[int]:
    pytest.importorskip("triton")
    from deltafin.kernels import triton_xxh3

    return triton_xxh3.xxh3_64_rows(torch.from_numpy(data).to(dev), rows, lengths)


def test_kernel_digests_equal_xxhash_rows_of_different_lengths_in_one_launch():
    """Every row its own length (boundaries, one past, odd tails), rows out of order and one row skipped."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    stride = 64 * 1024 + 64
    data = _rows(len(LENGTHS) + 1, stride, 7)
    rows = list(range(len(LENGTHS), 0, -1))  # row 0 is not hashed
    got = _kernel_rows(dev, data, rows, LENGTHS)
    assert got == [xxhash.xxh3_64_intdigest(data[r, :n].tobytes()) for r, n in zip(rows, LENGTHS, strict=True)]


def test_dispatch_hashes_short_rows_on_the_host_and_says_it_ran(monkeypatch):
    pytest.importorskip("triton")
    from deltafin import kernels
    from deltafin.kernels import cuda as kc

    if not torch.cuda.is_available():
        monkeypatch.setenv("DELTAFIN_KERNELS", "interpret")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = _rows(3, 4096, 3)
    lengths, marks = [4096, 17, 3000], []
    got = kernels.xxh3_64_rows(torch.from_numpy(data).to(dev), [2, 0, 1], lengths, lambda: marks.append(1))
    assert got == [xxhash.xxh3_64_intdigest(data[r, :n].tobytes()) for r, n in zip([2, 0, 1], lengths, strict=True)]
    assert marks == [1] and "triton:xxh3_64" in kc.USED
    monkeypatch.setenv("DELTAFIN_KERNELS", "torch")  # the kernel turned off: None, and the caller hashes
    assert kernels.xxh3_64_rows(torch.from_numpy(data).to(dev), [0], [4096]) is None


def test_verify_on_is_checked_before_the_model_opens():
    from deltafin.runtime.source import _gpu_checks

    assert _gpu_checks("auto", torch.device("cpu")) is False
    assert _gpu_checks("host", torch.device("cpu")) is False
    with pytest.raises(UsageError, match="--verify-on gpu: no xxh3 kernel for cpu"):
        _gpu_checks("gpu", torch.device("cpu"))
    with pytest.raises(UsageError, match="--verify-on sometimes: not one of auto, host, gpu"):
        _gpu_checks("sometimes", torch.device("cpu"))


# ---------------------------------------------------------------- a mismatch found after landing


def _copy(k3_model, tmp_path, replicas: bool):
    """A copy of the packed model (every expert with a replica on the other drive if ``replicas``)."""
    return tf.copy_packed(k3_model, tmp_path / "copy", replicas)


def _flip(path: str) -> None:
    """One byte in the middle of the file (past its header) flipped on disk."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


def _unchecked_read(root, e: int):
    """A source whose whole reads the reader threads do not check (as with checks on the GPU), and the landed
    primary copy of layer L's expert e, unchecked."""
    from deltafin.runtime.layer_reads import LayerReads
    from deltafin.runtime.source import StreamingExperts
    from deltafin.store.model_dir import PackedModel

    pm = PackedModel.open(str(root / "model"))
    src = StreamingExperts(pm, 0, 2, "cpu", reserve=False)
    src.gpu_checks = True
    L = pm.moe_layers[0]
    reads = LayerReads(src, L, [e])
    return pm, src, L, reads, reads.next()


def test_mismatch_after_landing_reads_the_replica(k3_model, tmp_path):
    root = _copy(k3_model, tmp_path, replicas=True)
    from deltafin.store.model_dir import PackedModel

    pm0 = PackedModel.open(str(root / "model"))
    L, e = pm0.moe_layers[0], 1
    _flip(pm0.expert_path(L, e, pm0.locations(L, e)[0]))
    pm, src, L, reads, (got_e, buf, n, where) = _unchecked_read(root, e)
    try:
        assert got_e == e and xxhash.xxh3_64_hexdigest(buf[:n]) != pm.checksum(L, e)  # the bad copy landed
        good, n2, where2 = src._host_checked(L, e, buf, n, where, reads)
        assert xxhash.xxh3_64_hexdigest(good[:n2]) == pm.checksum(L, e) and where2 != where
        assert src.stats.failed_reads == 1
    finally:
        src.close()


def test_mismatch_after_landing_without_a_replica_is_the_hosts_error(k3_model, tmp_path):
    root = _copy(k3_model, tmp_path, replicas=False)
    from deltafin.store.model_dir import PackedModel

    pm0 = PackedModel.open(str(root / "model"))
    L, e = pm0.moe_layers[0], 2
    bad = pm0.expert_path(L, e, pm0.locations(L, e)[0])
    _flip(bad)
    pm, src, L, reads, (_, buf, n, where) = _unchecked_read(root, e)
    try:
        with pytest.raises(ExpertChecksumError) as err:
            src._host_checked(L, e, buf, n, where, reads)
    finally:
        src.close()
    msg = str(err.value)
    assert bad in msg and "checksum mismatch" in msg and src.repair_fix in msg and "\n" not in msg


# ---------------------------------------------------------------- on a GPU (-m gpu)

K3_FILE = 17_551_360  # a Kimi K3 expert file, bytes


@pytest.mark.parametrize("lengths", [[K3_FILE] * 8, [K3_FILE - 13, K3_FILE - 4095, 241, 1025, 16 * 1024 + 1,
                                                      5 * 1024 * 1024 + 37, K3_FILE - 1, K3_FILE]])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernel_on_k3_size_rows(lengths):
    from deltafin.kernels import triton_xxh3

    data = torch.randint(0, 256, (len(lengths) + 1, K3_FILE), dtype=torch.uint8, device="cuda")
    host = data.cpu().numpy()
    rows = list(range(1, len(lengths) + 1))
    got = triton_xxh3.xxh3_64_rows(data, rows, lengths)
    assert got == [xxhash.xxh3_64_intdigest(host[r, :n].tobytes()) for r, n in zip(rows, lengths, strict=True)]


PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]


def _cuda_logits(root, verify_on: str, verify: bool = True):
    from deltafin.runtime.engine import Engine, EngineOptions

    eng = Engine(str(root / "model"), EngineOptions(device="cuda", cache_gb=0.0, verify_on=verify_on,
                                                    verify_reads=verify))
    try:
        logits = eng.model.forward(torch.tensor(PROMPT, device="cuda"), eng.new_state(), eng.source).cpu()
        return logits, eng.source
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_checks_give_the_logits_of_host_checks(k3_model):
    host, hsrc = _cuda_logits(k3_model, "host")
    gpu_, gsrc = _cuda_logits(k3_model, "gpu")
    assert torch.equal(gpu_, host)
    assert gsrc.checks_where == "gpu" and gsrc.stats.gpu_checked > 0 and gsrc.stats.gpu_check_s > 0
    assert hsrc.checks_where == "host" and hsrc.stats.gpu_checked == 0
    assert sum(d["check_s"] for d in gsrc.per_drive().values()) == 0  # no read hashed by the reader threads
    _, auto = _cuda_logits(k3_model, "auto")
    assert auto.checks_where == "gpu"
    _, off = _cuda_logits(k3_model, "auto", verify=False)
    assert off.checks_where == "off" and off.stats.gpu_checked == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_checks_catch_a_corrupted_expert(k3_model, tmp_path):
    from deltafin.store.model_dir import PackedModel

    ref, _ = _cuda_logits(k3_model, "host")
    for replicas in (True, False):
        root = _copy(k3_model, tmp_path / str(replicas), replicas)
        pm = PackedModel.open(str(root / "model"))
        bad = [pm.expert_path(L, e, pm.locations(L, e)[0]) for L in pm.moe_layers for e in range(pm.num_experts)]
        for p in bad:
            _flip(p)
        if replicas:
            got, src = _cuda_logits(root, "gpu")
            assert torch.equal(got, ref) and src.stats.failed_reads > 0 and src.stats.gpu_checked > 0
        else:
            with pytest.raises(ExpertChecksumError, match="checksum mismatch") as err:
                _cuda_logits(root, "gpu")
            assert any(p in str(err.value) for p in bad)


def test_cli_verify_on_gpu_on_the_cpu_is_one_line_before_the_model_opens(k3_model, capsys):
    from deltafin import cli

    rc = cli.main(["run", str(k3_model / "model"), "-p", "hi", "--device", "cpu", "--verify-on", "gpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "--verify-on gpu: reads are checked on the GPU only with --device cuda" in err
    with pytest.raises(SystemExit) as bad:  # argparse's choices
        cli.main(["run", str(k3_model / "model"), "-p", "hi", "--verify-on", "sometimes"])
    assert bad.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err
