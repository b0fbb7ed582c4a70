"""`pipec plan`: the layers of each stage, the schedule, v, the micro-batch count and size and the memory ops
chosen together under a byte budget (docs/plan.md).

The modules, each importing only those above it in this list: `space` (the candidates, the table scaled to
a micro-batch size, memory ops per stage, Megatron-LM's default split), `bounds` (a lower bound and the
local search where `pipec.partition.search` is too slow), `search` (`plan`: screen, refine, prove), `report`
(the comparison, the Pareto front, why the winner wins, the Megatron-LM and torchtitan settings), `figure`
(the picture), `outputs` (the files and the printed text). Every candidate goes through
`pipec.partition.Problem`, so the one simulator and memory walk judge them all; nothing here prints.
"""

from pipec.planner.search import Inputs, Plan, Point, plan, prove
from pipec.planner.space import LIBRARY, MEMOPS, Candidate, microbatch_counts

__all__ = ["Candidate", "Inputs", "LIBRARY", "MEMOPS", "microbatch_counts", "Plan", "plan", "Point", "prove"]
