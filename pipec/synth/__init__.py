"""Schedule search: from sizes, costs and a memory limit to a schedule, written back as a `.pipe` file.

Two phases, both under the simulator's machine and cost model (`pipec.passes.policy`):

1. a heuristic: a grid over the policy space of `pipec.passes.policy` (which kind a
   rank prefers among its ready ops, how many micro-batches it keeps in
   flight, when a W may fill an idle gap), every point list-scheduled under
   the memory limit, then a local search on per-rank in-flight limits around
   the best point (seconds);
2. an exact improvement for small cases: the per-rank order as a constraint
   program (OR-Tools CP-SAT: one interval per op, no overlap per rank, the
   data dependencies with their message delays, a cumulative memory profile
   per rank), warm-started from the heuristic's schedule, under a time limit.
   Without OR-Tools installed (`pip install pipec[synth]`) the heuristic's
   result stands and `Result.solver_note` says why.

Under a memory limit below 1F1B's peak (or one no plain policy meets), the search may also place memory ops
(`Spec.memops`: recomputation, offload to the host; docs/memory.md): seeds list-scheduled with every forward
of some ranks recomputed (`recompute_candidates`), library and heuristic orders with offloads (or
recomputations) added at their peaks until pipec's memory check and the simulated memory curve both fit
(`repair`), and, in the solver, a choice per (micro-batch, stage) of a RECOMPUTE interval on the rank's
compute, or an OFFLOAD and a RELOAD on its host link, with the device and host pools as cumulative
profiles. Candidates then rank by (makespan, number of memory ops, cost), so memory ops appear only where
they shorten the step or are needed to fit. The least memory any such schedule reaches is `memory_floor`
(one micro-batch at a time); a limit below it is E703.

The objective is the simulated makespan, then Zero Bubble's cost (the longest
rank's span): among schedules with the same step time, and so the same bubble
(`Stats.bubble_rate` is on the makespan), the one whose ranks are busy over the
shortest span wins. `write_pipe` turns the per-rank orders into a readable
schedule file (`pipec.formats.pipe_text`, the writer `pipec import` uses too)
whose header records the inputs and figures; the file declares its whole cost
model (topology included), memory model and limit, and `expect`s its figures,
so `pipec check` re-proves them and `pipec simulate` reproduces them.

Pure: nothing here prints; progress goes to a callback (`pipec synth` prints it).

The modules, each importing only those above it in this list: `spec` (the input and its Schedule),
`evaluate` (simulated figures of fixed orders and of the library), `seeds` (the policy grid and the
library seeds), `memops` (recomputation, offload, repair, the memory floor), `solver` (CP-SAT), `search`
(`synthesize`, the phases in order), `write` (the `.pipe` file, the comparison table, the JSON). This
package's namespace is the public API; the steps' helpers stay in their modules.
"""

from pipec.synth.evaluate import Figures, below_1f1b, evaluate_orders, library_comparison, peak_of
from pipec.synth.memops import memops_of, memory_floor, recompute_candidates, repair
from pipec.synth.search import Result, synthesize
from pipec.synth.seeds import Candidate, heuristic
from pipec.synth.solver import SolveResult, improve, memory_demands, solver_available
from pipec.synth.spec import MEMOP_KINDS, Spec, shape, spec_machine, to_schedule, topology_of
from pipec.synth.write import comparison_text, order_steps, to_json, write_pipe

__all__ = [
    "below_1f1b",
    "Candidate",
    "comparison_text",
    "evaluate_orders",
    "Figures",
    "heuristic",
    "improve",
    "library_comparison",
    "MEMOP_KINDS",
    "memops_of",
    "memory_demands",
    "memory_floor",
    "order_steps",
    "peak_of",
    "recompute_candidates",
    "repair",
    "Result",
    "shape",
    "solver_available",
    "SolveResult",
    "Spec",
    "spec_machine",
    "synthesize",
    "to_json",
    "to_schedule",
    "topology_of",
    "write_pipe",
]
