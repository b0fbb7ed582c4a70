"""examples/moe.py with one replica that differs (a refusal test of expert parallelism): MOE_MISMATCH=layers
gives job rank 1's stage an extra MoE layer (caught before any step, by the expert group's exchange of its
MoE layers); MOE_MISMATCH=calls makes job rank 1's MoE layers call their experts twice (one op issues
more all-to-alls than its stage's layers imply: caught at that all-to-all, naming the instruction)."""

import importlib.util
import os
from pathlib import Path

_spec = importlib.util.spec_from_file_location("pipec_moe_example", Path(__file__).parents[2] / "examples" / "moe.py")
moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe)

MODE = os.environ.get("MOE_MISMATCH", "")
ODD = os.environ.get("RANK") == "1"
dtype = moe.dtype
loss_fn, batch, optimizer = moe.loss_fn, moe.batch, moe.optimizer


class Twice(moe.MoE):
    def forward(self, x):
        y, aux = super().forward(x)
        z, _ = super().forward(x)
        return y + z, aux


def build_stage(stage: int, num_stages: int):
    module = moe.build_stage(stage, num_stages)
    if ODD and MODE == "layers":
        module.blocks[-1] = moe.Block(moe=True)
    if ODD and MODE == "calls":
        for block in module.blocks:
            if block.moe is not None:
                twice = Twice(moe.WIDTH, moe.HIDDEN, moe.EXPERTS, moe.TOPK)
                twice.load_state_dict(block.moe.state_dict())
                block.moe = twice
    return module
