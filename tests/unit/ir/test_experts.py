"""The expert options and the overlapped pair's turn order (pipec/ir/experts.py)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipec.errors import PipecError
from pipec.ir.experts import Experts, all_to_alls, pair_order


def test_segments_alternate_and_the_longer_op_finishes_alone():
    assert pair_order(2, 2) == ((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2))
    # An odd count against an even one (Megatron-LM 1852's odd MoE layer count): the leftover runs alone.
    assert pair_order(1, 4) == ((0, 0), (1, 0), (0, 1), (1, 1), (1, 2), (1, 3), (1, 4))
    assert pair_order(0, 0) == ((0, 0), (1, 0))


@given(st.integers(0, 12), st.integers(0, 12))
def test_every_segment_runs_once_in_its_own_order(a, b):
    order = pair_order(a, b)
    assert [k for op, k in order if op == 0] == list(range(a + 1))
    assert [k for op, k in order if op == 1] == list(range(b + 1))
    # While both ops have an all-to-all to hide, no op runs two segments in a row.
    both = 2 * min(a, b) + 1
    assert all(order[i][0] != order[i + 1][0] for i in range(both))


def test_weight_gradients_issue_no_all_to_all():
    assert (all_to_alls("F", 3), all_to_alls("B", 3), all_to_alls("W", 3)) == (6, 6, 0)


@pytest.mark.parametrize(
    ("size", "num", "says"),
    [(0, 4, "--ep"), (2, 3, "multiple of --ep"), (True, 2, "--ep"), (1, -1, "--experts")],
)
def test_bad_expert_options_are_diagnostics(size, num, says):
    with pytest.raises(PipecError, match="E425") as e:
        Experts(size=size, num=num)
    assert says in str(e.value)


def test_the_group_folds_into_dp():
    assert Experts(2, 8).fits(4) is None and Experts(2, 8).per_rank == 4
    assert "must divide" in Experts(4, 8).fits(2)
