"""Every library schedule runs over a stage graph (issue 42, part 4): its file with `edge` declarations added,
the stage numbers a topological order of the graph. Here the graph is U-Net's (the chain plus a long skip from
each encoder level s to decoder level S - 1 - s), which gives every rank pair of a V or looped placement
several edges to share. Each must compile (every check, the lowering, the dry run's channel proof), and the
Program must carry one send and one receive of each message of every edge between two ranks.
"""

from __future__ import annotations

import re

import pytest

import pipec
from pipec.frontend import library

SCHEDULES = library.names()


def _with_skips(name: str) -> str:
    src = library.read(name).text
    m = re.search(r"^(\s*)stages (.+)$", src, flags=re.M)
    assert m, f"{name}: no `stages` line"
    S, ind = f"({m.group(2).split('#')[0].strip()})", m.group(1)
    edges = (
        f"\n{ind}edge s -> if s < {S} - 1 then s + 1 else -1"
        f"\n{ind}edge s -> if s < {S} / 2 - 1 then {S} - 1 - s else -1"
    )
    return src[: m.end()] + edges + src[m.end() :]


@pytest.mark.parametrize("name", SCHEDULES)
def test_library_schedule_on_a_unet_graph(name, tmp_path):
    path = tmp_path / f"{name}.pipe"
    path.write_text(_with_skips(name))
    prog = pipec.compile(str(path), p=4, m=8)
    g = prog.graph
    assert g is not None and (0, prog.num_stages - 1) in g.edges, g
    place = prog.placement
    sent = {}
    for rp in prog.ranks:
        for ins in rp.instructions():
            if ins.op in ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"):
                down = ins.op in ("SEND_ACT", "RECV_GRAD")
                edge = (ins.stage, ins.other) if down else (ins.other, ins.stage)
                key = (ins.op, ins.mb, edge)
                assert key not in sent, f"{name}: {key} twice"
                sent[key] = True
    units = prog.num_microbatches
    remote = [e for e in g.edges if place[e[0]] != place[e[1]]]
    assert len(sent) == 4 * units * len(remote), name
