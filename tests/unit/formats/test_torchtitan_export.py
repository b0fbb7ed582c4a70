"""`pipec export --to torchtitan`: the compute-only CSV and torchtitan's settings, for every library schedule
torchtitan can place; the placement torchtitan would build from the written `pipeline_parallel_schedule`
equals pipec's; refusals (E620, E621, misuse) say where. No torchtitan here: its placement rule is restated
from torchtitan 0.2.2's `pipeline_module_split` (docs/interop.md has the run that loaded these files in
torchtitan itself)."""

from __future__ import annotations

import tomllib

import pytest
from cli_helpers import run_cli

from pipec.api import load
from pipec.errors import PipecError, Source
from pipec.formats.torch_csv_reader import read_csv
from pipec.formats.torch_csv_writer import export_csv
from pipec.formats.torchtitan import export_torchtitan, output_paths
from pipec.frontend.library import names

# torch's schedule classes by kind: single-stage ones build one stage per rank, ZBVZeroBubble and DualPipeV
# the V, every other multi-stage class the loop (torchtitan/distributed/pipeline_parallel.py, v0.2.2)
SINGLE_STAGE = {"1F1B", "GPipe", "PipelineScheduleSingle"}
V_STYLE = {"ZBVZeroBubble", "DualPipeV"}


def torchtitan_stages(cls: str, rank: int, p: int, num_stages: int) -> tuple[int, ...]:
    """The stage indices torchtitan 0.2.2 builds on `rank` for schedule class `cls`."""
    if cls in SINGLE_STAGE:
        assert num_stages == p, "torchtitan builds one stage per rank for a single-stage class"
        return (rank,)
    per_rank = num_stages // p
    if cls in V_STYLE:
        assert per_rank == 2
        return list(zip(range(p), range(num_stages - 1, p - 1, -1), strict=True))[rank]
    return tuple(rank + s * p for s in range(per_rank))


# schedules with memory ops (recompute, offload) have no torch form: the torch writer refuses them (below);
# nor have token slices (E615, tests/features/test_terapipe_schedule.py)
PLAIN = [n for n in names() if not any(load(n, p=2, m=4).memops) and load(n).slicing is None]
CASES = [(n, p) for n in PLAIN for p in (2, 4)]


@pytest.mark.parametrize(("name", "p"), CASES, ids=[f"{n}-p{p}" for n, p in CASES])
def test_placement_matches_torchtitan(name, p):
    s = load(name, p=p, m=2 * p)
    out = export_torchtitan(s, "s.csv")
    assert out.csv == export_csv(s)  # the torch writer's compute-only CSV, byte for byte
    back = read_csv(Source("s.csv", out.csv))
    assert [back.ops(r) for r in range(p)] == [s.ops(r) for r in range(p)]
    cfg = tomllib.loads(out.toml)
    par = cfg["parallelism"]
    assert par["pipeline_parallel_degree"] == p
    assert par["pipeline_parallel_schedule"] == out.schedule_class
    assert par["pipeline_parallel_schedule_csv"] == "s.csv"
    assert cfg["training"]["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == s.num_microbatches
    for r in range(p):
        built = torchtitan_stages(out.schedule_class, r, p, s.num_stages)
        assert sorted(built) == sorted(s.stages_of(r)), (r, built, s.stages_of(r))


def test_memory_ops_refused_as_by_the_torch_writer():
    with_memops = sorted(n for n in set(names()) - set(PLAIN) if load(n).slicing is None)
    assert with_memops  # the library has some: 1f1b-recompute, 1f1b-offload, zb-v-recompute
    for name in with_memops:
        s = load(name, p=2, m=4)
        with pytest.raises(PipecError):
            export_torchtitan(s, "x.csv")
        assert export_torchtitan(s, "x.csv", drop_memops=True).csv == export_csv(s, drop_memops=True)


def test_classes_by_placement():
    assert export_torchtitan(load("zb-h1", p=4, m=8), "x.csv").schedule_class == "1F1B"
    assert export_torchtitan(load("interleaved-1f1b", p=4, v=2, m=8), "x.csv").schedule_class == "Interleaved1F1B"
    assert export_torchtitan(load("zb-v", p=4, m=8), "x.csv").schedule_class == "ZBVZeroBubble"
    assert export_torchtitan(load("dualpipe-v", p=4, m=8), "x.csv").schedule_class == "DualPipeV"


def test_three_chunks_per_rank_say_how_many_stages():
    toml = export_torchtitan(load("interleaved-1f1b", p=2, v=3, m=6), "x.csv").toml
    assert "module_fqns_per_model_part to the 6 stages' module names" in toml
    assert "module_fqns_per_model_part" not in export_torchtitan(load("zb-v", p=2, m=4), "x.csv").toml


def test_cli_writes_csv_and_toml(tmp_path):
    out = tmp_path / "zbv"
    rc, stdout, err = run_cli("export", "zb-v", "-D", "p=2", "-D", "m=6", "--to", "torchtitan", "-o", str(out),
                              "--microbatch-size", "3")  # fmt: skip
    assert rc == 0, err
    assert "ZBVZeroBubble" in stdout
    s = load("zb-v", p=2, m=6)
    assert (tmp_path / "zbv.csv").read_text() == export_csv(s)
    cfg = tomllib.loads((tmp_path / "zbv.toml").read_text())
    assert cfg["parallelism"]["pipeline_parallel_schedule_csv"] == str(tmp_path / "zbv.csv")
    assert cfg["parallelism"]["pipeline_parallel_microbatch_size"] == 3
    assert cfg["training"]["local_batch_size"] == 18


def test_output_paths():
    assert output_paths("a/run") == ("a/run.csv", "a/run.toml")
    assert output_paths("a/run.csv") == ("a/run.csv", "a/run.toml")
    assert output_paths("a/run.toml") == ("a/run.csv", "a/run.toml")
    assert output_paths("a/run.v2") == ("a/run.v2.csv", "a/run.v2.toml")


BAD_PLACE = """schedule "t" (p: int = 2, m: int = 2) {
    stages 2
    place s -> 1 - s
    rank r {
        for i in 0 .. m { F(i, stage: 1 - r) }
        for i in 0 .. m { B(i, stage: 1 - r) }
    }
}
"""


def test_e620_placement_torchtitan_cannot_build(tmp_path):
    f = tmp_path / "t.pipe"
    f.write_text(BAD_PLACE)
    rc, out, err = run_cli("export", str(f), "--to", "torchtitan", "-o", str(tmp_path / "o"))
    assert rc == 1
    assert f"{f}:3:5: error[E620]: torchtitan cannot place these 2 stages on 2 ranks (0->1, 1->0)" in err
    assert "   3 |     place s -> 1 - s\n           ^^^^^^^^^^^^^^^^" in err
    assert not (tmp_path / "o.csv").exists() and not (tmp_path / "o.toml").exists()


def test_e620_one_rank(tmp_path):
    rc, _, err = run_cli("export", "gpipe", "-D", "p=1", "--to", "torchtitan", "-o", str(tmp_path / "o"))
    assert rc == 1 and "error[E620]: the schedule has 1 rank" in err
    assert "never reads the CSV" in err


def test_e621_comms(tmp_path):
    rc, _, err = run_cli("export", "zb-h1", "-D", "p=2", "--to", "torchtitan", "--comms", "-o", str(tmp_path / "o"))
    assert rc == 1
    assert "error[E621]: torchtitan loads only the compute-only CSV" in err
    assert not (tmp_path / "o.csv").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ((), "give -o OUT"),
        (("-o", "x", "--dp", "2"), "torchtitan sets data parallelism itself"),
        (("-o", "x", "--microbatch-size", "0"), "--microbatch-size must be at least 1"),
    ],
)
def test_misuse(extra, message):
    rc, _, err = run_cli("export", "1f1b", "-D", "p=2", "--to", "torchtitan", *extra)
    assert rc == 2 and message in err, err
