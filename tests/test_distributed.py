"""Expert parallelism over several processes (gloo on this machine): the same tokens and logits as one
process on every family's tiny model, over 2 and 3 ranks; ownership planned by 'deltafin place --ranks';
a rank that fails or dies stops the job with an error naming it."""

from __future__ import annotations

import json

import pytest
import torch

from deltafin.errors import ManifestError, UsageError
from deltafin.k3_tiny import write_tiny_k3
from deltafin.store import manifest as mf
from deltafin.store import ranks as rk
from deltafin.store.drives import parse_drives
from deltafin.store.pack import PackOptions, pack
from deltafin.store.place import place_model
from tests.dist_worker import launch, one_process
from tests.tiny import TINY, pack_tiny

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dist")
    out = {fam: pack_tiny(root / fam, fam) for fam in TINY}
    write_tiny_k3(root / "kimi_k3" / "src")
    pack(str(root / "kimi_k3" / "src"), str(root / "kimi_k3" / "model"),
         parse_drives([f"{root}/kimi_k3/d0=2", f"{root}/kimi_k3/d1=1"]), PackOptions(progress=False))
    out["kimi_k3"] = str(root / "kimi_k3" / "model")
    # a copy owned over two ranks by the manifest (each rank reads one drive)
    placed = pack_tiny(root / "placed", "deepseek_v3")
    place_model(placed, None, ranks="d0@0;d1@0")
    out["placed"] = placed
    return out


@pytest.fixture(scope="module")
def reference(models) -> dict[str, dict]:
    return one_process({m: m for name, m in models.items() if name != "placed"}, PROMPT)


def test_two_ranks_match_one_process_then_a_failing_rank_is_named(models, reference, tmp_path):
    names = [m for n, m in models.items() if n != "placed"]
    # the last model: rank 1 raises in its second step (a drive error); rank 0 must name it, not hang
    got = launch(2, names + [models["placed"], names[0]], tmp_path / "out.json", fail=(1, "raise"))
    for m in names:
        assert got["results"][m] == reference[m], m  # tokens and every logit, bit for bit
    assert got["results"][models["placed"]]["tokens"] == reference[models["deepseek_v3"]]["tokens"]
    assert got["error"] and "rank 1 of 2 failed" in got["error"] and "drive d1 stopped answering" in got["error"]


def test_three_ranks_match_one_process_then_a_dead_rank_is_named(models, reference, tmp_path):
    names = [m for n, m in models.items() if n != "placed"]
    # routing broadcast from rank 0 here (the two-rank launch checks the ranks' own routing)
    got = launch(3, names + [names[0]], tmp_path / "out.json", fail=(2, "exit"), routing="broadcast")
    for m in names:
        assert got["results"][m] == reference[m], m
    assert got["error"] and "rank 2" in got["error"] and "stopped answering" in got["error"], got["error"]


def test_placed_manifest_gives_each_rank_its_drives(models):
    doc = mf.load(models["placed"])
    ex = doc["experts"]
    assert ex["ranks"]["world"] == 2 and ex["placement"] == "ranks"
    for L in ex["layers"]:
        for e, r in enumerate(ex["ranks"]["owner"][str(L)]):
            assert ex["locations"][str(L)][e] == [r]  # rank r owns drive d<r>
        assert ex["ranks"]["owner"][str(L)].count(0) == 5  # no memory: by read rate, 8 x 2/3 rounded
    bad = json.loads(json.dumps(doc))
    bad["experts"]["ranks"]["owner"][str(ex["layers"][0])][0] = 1 - ex["ranks"]["owner"][str(ex["layers"][0])][0]
    with pytest.raises(ManifestError, match="lives on a drive of another rank"):
        mf.validate(bad, "m")


def test_quotas_fill_memory_then_split_by_read_rate():
    one = 10 * 1e9  # one expert of every layer: 10 GB
    specs = [rk.RankSpec(("a",), 100), rk.RankSpec(("b",), 0)]
    assert rk.quotas(100, one, specs, [1.0, 1.0]) == [55, 45]  # rank 0 caches 10, the other 90 split evenly
    assert rk.quotas(100, one, [rk.RankSpec(("a",), 0), rk.RankSpec(("b",), 0)], [3.0, 1.0]) == [75, 25]
    big = [rk.RankSpec(("a",), 3000), rk.RankSpec(("b",), 1000)]
    assert rk.quotas(100, one, big, [1.0, 9.0]) == [75, 25]  # all resident: by memory, rates do not matter
    assert sum(rk.quotas(7, one, [rk.RankSpec(("a",), 0)] * 3, [1.0, 1.0, 1.0])) == 7


def test_rank_spec_errors_name_the_problem():
    labels = ["d0", "d1", "d2"]
    assert rk.parse_ranks("3@8", labels) == [rk.RankSpec(("d0",), 8.0), rk.RankSpec(("d1",), 8.0),
                                             rk.RankSpec(("d2",), 8.0)]
    assert rk.parse_ranks("2", labels)[0].drives == ("d0", "d2")
    with pytest.raises(UsageError, match="'d9'"):
        rk.parse_ranks("d0@1;d9@1", labels)
    with pytest.raises(UsageError, match="given to two ranks"):
        rk.parse_ranks("d0,d1;d1", labels)
    with pytest.raises(UsageError, match="not a number of GB"):
        rk.parse_ranks("d0@lots", labels)


def test_place_ranks_cli_moves_experts_to_their_owners_drives(tmp_path, capsys):
    from deltafin.cli import main
    from deltafin.store.model_dir import PackedModel

    model = pack_tiny(tmp_path, "olmoe")
    before = PackedModel.open(model).read_expert(1, 3)
    assert main(["place", model, "--ranks", "d1@0;d0@0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: drives d1" in out and "rank 1: drives d0" in out
    pm = PackedModel.open(model)
    ex = pm.doc["experts"]
    for L in pm.moe_layers:
        for e in range(pm.num_experts):
            assert pm.locations(L, e) == [1 - ex["ranks"]["owner"][str(L)][e]]  # rank 0 reads d1, rank 1 d0
    after = pm.read_expert(1, 3)  # the bytes moved intact (checksum checked on read)
    assert all(torch.equal(before[k].data, after[k].data) for k in before)
    assert main(["place", model, "--policy", "bandwidth", "--no-progress"]) == 0  # back: the section goes
    assert "ranks" not in mf.load(model)["experts"]
    assert main(["place", model]) == 2
    assert "--policy P" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_distributed_runs_both_modes(tmp_path, capsys):
    """The benchmark's paths on CPU: emulated drives split over 2 ranks, and the resident N-vs-one comparison
    (the path the GPU run takes with --device cuda)."""
    from deltafin.cli import main

    common = ["bench", "distributed", "--layers", "1", "--experts", "16", "--k", "4", "--tokens", "1",
              "--warmup", "0", "--dir", str(tmp_path)]
    assert main(common + ["--io-only", "--scale", "0.004", "--json", str(tmp_path / "a.json")]) == 0
    rec = json.loads((tmp_path / "a.json").read_text())["runs"][0]
    assert rec["world"] == 2 and 0 < rec["of_read_bound"] <= 1.05 and rec["bare_allreduce_ms"] > 0
    assert main(common + ["--resident", "--worlds", "1,2", "--json", str(tmp_path / "b.json")]) == 0
    runs = json.loads((tmp_path / "b.json").read_text())["runs"]
    assert [r["world"] for r in runs] == [1, 2] and all(r["tok_s"] > 0 for r in runs)
    assert "x one rank (ideal 2x)" in capsys.readouterr().out


def test_ranks_that_route_differently_are_stopped(monkeypatch):
    """The routing check: the summed ids must be N x each rank's own. A one-process group that claims two
    ranks sums to 1 x, as if the other rank had routed differently."""
    import torch.distributed as dist

    from deltafin.errors import DistributedError
    from deltafin.runtime.cluster import Cluster
    from deltafin.runtime.distributed import DistributedExperts

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cl = Cluster(0, 2, 2, torch.device("cpu"), 5.0, dist.group.WORLD, dist.HashStore())
        src = DistributedExperts(None, cl, {0: [0, 1, 0, 1]})
        ids = torch.tensor([[0, 3]])
        assert src.local(0, [0, 1, 2, 3]) == [0, 2]
        with pytest.raises(DistributedError, match="routed layer 0 differently.*--dist-routing broadcast"):
            src.combine(0, torch.randn(1, 2, 8), ids)
        cl.world = 1
        out = torch.randn(1, 2, 8)
        assert torch.equal(src.combine(0, out, ids), out)  # one rank: the sum is the buffer, bit for bit
    finally:
        dist.destroy_process_group()
