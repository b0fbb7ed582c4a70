"""`pipec partition`: choose each stage's layers so that the chosen schedule's simulated step is shortest.

    pipec partition 1f1b -D p=4 -D m=8 --model examples/uneven.py -o part.json
    pipec partition zb-v -D p=4 -D m=8 --layers-cost layers.json --ranks "speed=1,1,0.5,0.5" -o part.json
    pipec run 1f1b -D p=4 -D m=8 --model examples/uneven.py --partition part.json --check

The model's layers are profiled one by one (`pipec.runtime.profile.layers`, which needs torch) or read from
a layer table (`pipec.formats.partition_files`); the search (`pipec.partition.search` and its parts beside it,
numpy and OR-Tools, no torch) finds the contiguous split of minimum simulated step under the ranks' memory
limits, on ranks of different speeds, and proves it optimal or says how far its bound reached. The result is
printed beside the uniform split and written as a partition file that `pipec run --partition` builds its
stages from.
"""

from typing import TYPE_CHECKING

__all__ = ["Outcome", "partition", "report_lines", "to_doc"]

if TYPE_CHECKING:
    from pipec.partition.plan import Outcome, partition, report_lines, to_doc


def __getattr__(name: str):
    """The names of `pipec.partition.plan`, imported on first use: the command line builds every
    subcommand's parser, and `pipec partition`'s options (`pipec.cli.partition`) need no search code."""
    if name in __all__:
        from pipec.partition import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'pipec.partition' has no attribute {name!r}")
