"""The torch-native schedule API and whole-model splitting (pipec.runtime.pipeline_schedule, .split_model).

One process: proposed splits for the common model shapes, every refusal before training (names that name
no module, an empty stage, overlapping or out-of-order stages, a module with parameters left out, a
partition file for another model, a stage count the schedule does not have, stages whose shapes do not
fit), and a split model's gradients through LocalPipeline against the unsplit model (float64, tied weights).
Two gloo processes: examples/train_loop.py's own loop (GPT-2 from transformers' config, AdamW, LR schedule,
global-norm clipping) on interleaved 1F1B, its tied embedding and head on different ranks, against the same
loop on the unsplit model in one process: parameters, gradients, losses and eval output to 1e-10.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from repo import ROOT
from torch import nn

import pipec
from pipec.formats.partition_files import split_fingerprint
from pipec.runtime import LocalPipeline, propose_split
from pipec.runtime.errors import ModelError, PipelineError, ShapeError
from pipec.runtime.model.split import model_fingerprint, probe, split_model
from pipec.runtime.pipeline_schedule import _as_stage_map, compile_for

V, D = 11, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class Toy(nn.Module):
    """embed, a block list, a norm, a head tied to the embedding: the shape of a small language model."""

    def __init__(self, blocks: int = 4, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for b in self.layers:
            h = b(h)
        return self.head(self.norm(h))


def named(**children: nn.Module) -> nn.Module:
    m = nn.Module()
    for k, v in children.items():
        m.add_module(k, v)
    return m


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def test_propose_split_common_shapes():
    assert propose_split(Toy(5), 2) == [
        ["embed", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "layers.4", "norm", "head"],
    ]
    gpt2 = named(
        transformer=named(
            wte=nn.Embedding(V, D), wpe=nn.Embedding(8, D), drop=nn.Dropout(0.0),
            h=nn.ModuleList(Block() for _ in range(4)), ln_f=nn.LayerNorm(D),
        ),
        lm_head=nn.Linear(D, V),
    )  # fmt: skip
    assert propose_split(gpt2, 2) == [
        ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1"],
        ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"],
    ]
    llama = named(
        model=named(
            embed_tokens=nn.Embedding(V, D), layers=nn.ModuleList(Block() for _ in range(3)), norm=nn.LayerNorm(D)
        ),
        lm_head=nn.Linear(D, V),
    )  # fmt: skip
    assert propose_split(llama, 3) == [
        ["model.embed_tokens", "model.layers.0"], ["model.layers.1"], ["model.layers.2", "model.norm", "lm_head"]
    ]  # fmt: skip
    assert propose_split(nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]), 2) == [["0", "1"], ["2", "3"]]
    with pytest.raises(ModelError, match="4 blocks cannot fill 5 stages"):
        propose_split(Toy(4), 5)


@pytest.mark.parametrize(
    "stages, message",
    [
        ([["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "haed"]], r"`haed` names no module"),
        ([["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"], []], r"stage 1 is empty"),
        ([["embed", "layers"], ["layers.3", "norm", "head"]], r"`layers.3` of stage 1 overlaps `layers` of stage 0"),
        (
            [["embed", "layers.2", "layers.3"], ["layers.0", "layers.1", "norm", "head"]],
            r"stage 0's `layers.3` comes after",
        ),
        (
            [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]],
            r"`norm` has parameters but is in no stage",
        ),
    ],
)
def test_split_refusals(stages, message):
    with pytest.raises(ModelError, match=message):
        split_model(Toy(), stages)


def test_partition_file_fingerprint(tmp_path):
    model = Toy()
    layers = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]
    fp = model_fingerprint(model, layers)
    doc = {
        "format": "pipec-partition",
        "version": 2,
        "fingerprint": split_fingerprint(fp, layers, [layers[:2], layers[2:]]),
        "model": {"fingerprint": fp, "layers": layers},
        "schedule": {"name": "1f1b", "params": {"p": 2, "m": 4}},
        "stages": [layers[:2], layers[2:]],
        "predicted": {},
    }
    path = tmp_path / "partition.json"
    path.write_text(json.dumps(doc))
    stages = split_model(model, partition=str(path))
    assert [s.fqns for s in stages] == [tuple(layers[:2]), tuple(layers[2:])]
    wider = Toy()
    wider.norm = nn.LayerNorm(D + 1)  # one parameter shape differs: another model
    with pytest.raises(ModelError, match="made for another model.*same layer names with other parameter shapes"):
        split_model(wider, partition=doc)


def test_stage_count_the_schedule_lacks():
    with pytest.raises(PipelineError, match="split into 3 stages, but `1f1b` .* has 2 stages"):
        compile_for("1f1b", {"m": 4}, num_ranks=2, num_stages=3, n_microbatches=4)
    program = compile_for("interleaved-1f1b", {"m": 4}, num_ranks=2, num_stages=4, n_microbatches=4)
    assert program.num_stages == 4 and program.placement == (0, 1, 0, 1)  # v from the stages per rank


def test_stages_given_as_torch_stages_modules_or_a_list():
    """torch PipelineStages are taken by their submod, stage_index and num_stages; split_model's stages
    by their own; a plain list is every stage in order; other ranks' stages (None from only=) are skipped."""

    class FakeTorchStage:  # the attributes of torch.distributed.pipelining.PipelineStage that are read
        def __init__(self, submod, stage_index, num_stages):
            self.submod, self.stage_index, self.num_stages = submod, stage_index, num_stages

    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert _as_stage_map([FakeTorchStage(a, 1, 4), FakeTorchStage(b, 3, 4)]) == ({1: a, 3: b}, 4)
    stages = split_model(Toy(), propose_split(Toy(), 2), only=[1])
    got, count = _as_stage_map(stages)
    assert list(got) == [1] and got[1] is stages[1] and count == 2
    assert _as_stage_map([a, b]) == ({0: a, 1: b}, 2)
    with pytest.raises(PipelineError, match="plain nn.Modules carry no stage index"):
        _as_stage_map(a)


def test_shapes_that_do_not_fit_are_named():
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(5, 2))  # 6 features out, 5 expected
    stages = split_model(model, [["0", "1"], ["2"]])
    with pytest.raises(ShapeError, match=r"stage 0 outputs .*3, 6.*, which stage 1 cannot take"):
        probe(stages, torch.zeros(3, 4))


def test_split_gradients_equal_unsplit_model_float64():
    """zb-v on 2 ranks in one process: 4 stages, the embedding's stage and the tied head's on rank 0; the
    split keeps the model's names, and every gradient equals the unsplit model's."""
    torch.manual_seed(0)
    model = Toy(6).double()
    x, y = torch.randint(0, V, (8, 5)), torch.randint(0, V, (8, 5))
    loss_fn(model(x), y).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stages = split_model(model, propose_split(model, 4), example=x[:2])
    assert stages[0].tied == {"embed.weight": "embed.weight"} and stages[3].tied == {"head.weight": "embed.weight"}
    names = {n for s in stages for n, _ in s.named_parameters()}
    assert names == set(dict(model.named_parameters(remove_duplicate=False)))  # the model's own names
    pipe = LocalPipeline(pipec.compile("zb-v", p=2, m=4), dict(enumerate(stages)), loss_fn)
    pipe.step(x, y)
    for n, p in model.named_parameters():  # the tied weight's gradient: the embedding's and the head's, summed
        err = float((p.grad - ref[n]).abs().max() / ref[n].abs().max())
        assert err <= 1e-10, (n, err)


def test_eval_is_the_forward_only_program_and_equals_the_unsplit_model_float64():
    """zb-v on 2 ranks in one process, each rank a PipelineSchedule over in-memory queues on its own thread:
    eval runs the schedule's forward-only Program (lowered, validated, proven; no backward, REDUCE_GRAD or
    STEP) on the executor, and its output and micro-batch losses equal the unsplit model's forward, at
    two batch sizes (each eval exchanges its own shapes), with and without a target."""
    import threading

    from pipec.runtime.local import LocalComm, LocalHub, LocalKV
    from pipec.runtime.pipeline_schedule import PipelineSchedule

    torch.manual_seed(0)
    model = Toy(6, tied=False).double()  # a tie across ranks needs torch.distributed (test_train_loop_* has one)
    x = torch.randint(0, V, (8, 5))
    stages = split_model(model, propose_split(model, 4), example=x[:2])
    program = pipec.compile("zb-v", p=2, m=4)
    hub, kv = LocalHub(), LocalKV()
    scheds = [PipelineSchedule(program, stages, loss_fn, rank=r, comm=LocalComm(hub, r), kv=kv) for r in range(2)]
    last = next(s for s in scheds if s.has_last)

    def evaluate(x, y):
        out: dict[int, tuple] = {}

        def run(r: int) -> None:
            losses: list = []
            out[r] = (scheds[r].eval(x, target=y, losses=losses), losses)

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(out) == [0, 1], "an eval did not finish"
        return out[last.rank]

    for rows in (8, 12):
        x, y = torch.randint(0, V, (rows, 5)), torch.randint(0, V, (rows, 5))
        with torch.no_grad():
            want = model(x)
        got, losses = evaluate(x, y)
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-10
        per_mb = [loss_fn(o, t) for o, t in zip(want.chunk(4), y.chunk(4))]
        assert len(losses) == 4 and max(abs(float(a - b)) for a, b in zip(losses, per_mb)) <= 1e-10
        got, losses = evaluate(x, None)
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-10 and losses == []
    ev = last._evaluator.program
    assert ev.forward_only and {i.op for rp in ev.ranks for i in rp.instructions()} <= {"FWD", "SEND_ACT", "RECV_ACT"}
    assert all(p.grad is None for p in model.parameters())  # no graph was built, nothing accumulated


def test_llama_split_gradients_equal_unsplit_model_float64():
    """A Llama from transformers' config (rotary embedding, grouped-query attention, tied head): proposed
    split, zb-v in one process, gradients equal to the unsplit model's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).double()
    x, y = torch.randint(0, 32, (4, 6)), torch.randint(0, 32, (4, 6))
    loss_fn(model(x).logits, y).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fqns = propose_split(model, 4)
    assert fqns[0] == ["model.embed_tokens", "model.layers.0"] and fqns[3][-1] == "lm_head"
    stages = split_model(model, fqns)
    LocalPipeline(pipec.compile("zb-v", p=2, m=4), dict(enumerate(stages)), loss_fn).step(x, y)
    for n, p in model.named_parameters():
        err = float((p.grad - ref[n]).abs().max() / ref[n].abs().max())
        assert err <= 1e-10, (n, err)


# ---- two gloo processes: the example's loop ----------------------------------------------------------
def _rank(rank: int, out: str) -> None:
    """One rank: examples/train_loop.py's `train`, then the same loop on the unsplit model, compared."""
    os.environ.update(TRAIN_DTYPE="float64", TRAIN_LAYERS="4", TRAIN_WIDTH="16", TRAIN_CONTEXT="12", TRAIN_BATCH="8")
    import importlib.util

    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  (before the group: see docs/runtime.md)

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("train_loop", ROOT / "examples" / "train_loop.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    dist.init_process_group("gloo")
    steps = 2
    schedule, history = ex.train(steps=steps, schedule_name="interleaved-1f1b", m=4, log=lambda _: None)
    x, y = ex.batch(steps)
    evaluated = schedule.eval(x, target=y, losses=(ev_losses := []))
    model = ex.build_model()  # the reference: the same loop on the whole model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: ex.lr_at(s, steps))
    ref_history = []
    for step in range(steps):
        xs, ys = ex.batch(step)
        opt.zero_grad()
        loss = ex.loss_fn(model(xs).logits, ys)
        loss.backward()
        ref_history.append(float(loss))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lr.step()
    ref = dict(model.named_parameters(remove_duplicate=False))  # lm_head.weight is wte's
    worst = {"param": 0.0, "grad": 0.0}
    mine = list(schedule.named_parameters())
    for n, p in mine:
        worst["param"] = max(worst["param"], float((p - ref[n]).abs().max() / ref[n].abs().max()))
        worst["grad"] = max(worst["grad"], float((p.grad - ref[n].grad).abs().max() / ref[n].grad.abs().max()))
    result = {"worst": worst, "names": [n for n, _ in mine], "stages": sorted(schedule.stages)}
    if schedule.has_last:
        with torch.no_grad():
            logits = model(x).logits
        result["loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(history, ref_history))
        result["eval_diff"] = float((evaluated - logits).abs().max() / logits.abs().max())
        result["eval_loss_diff"] = abs(float(torch.stack(ev_losses).mean()) - float(ex.loss_fn(logits, y)))
        result["ties"] = [t.ranks for t in schedule.ties]
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def test_train_loop_two_gloo_ranks_equals_whole_model(tmp_path):
    pytest.importorskip("transformers")  # the example's GPT-2 (pip install transformers: it installs no torch)
    from runtime_harness import json_ranks

    res = json_ranks(_rank, 2, tmp_path, timeout=120.0)
    assert [r["stages"] for r in res] == [[0, 2], [1, 3]]  # interleaved v=2: each rank its two chunks
    assert "transformer.wte.weight" in res[0]["names"] and "lm_head.weight" in res[1]["names"]
    for r in res:
        assert r["worst"]["param"] <= 1e-10 and r["worst"]["grad"] <= 1e-10, r["worst"]
    last = res[1]
    assert last["ties"] == [[0, 1]]  # the embedding (stage 0, rank 0) and the head (stage 3, rank 1)
    assert last["loss_diff"] <= 1e-10 and last["eval_diff"] <= 1e-10 and last["eval_loss_diff"] <= 1e-10
