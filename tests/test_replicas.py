"""A data-parallel replica counted once (``_comm/replicas.py``): the rows kept, the values
reduced, and a replica whose ranks disagree refused. The 4-rank run under model_parallel
(tests/test_model_parallel.py) checks the same through lite.all_reduce and friends."""

from __future__ import annotations

import math

import pytest
import torch

from scopedlite._comm.replicas import ReplicaValuesDifferError, one_per_replica, reduce_rows

# a 2 x 2 mesh: ranks 0, 1 are replica 0; ranks 2, 3 replica 1
REPLICAS = (0, 0, 1, 1)


def test_one_row_per_replica_in_replica_order():
    rows = torch.tensor([[1.0, 2.0], [1.0, 2.0], [5.0, 6.0], [5.0, 6.0]])
    assert one_per_replica(rows, range(4), REPLICAS).tolist() == [[1.0, 2.0], [5.0, 6.0]]
    # inside lite.join only the running ranks send: replica 1 alone
    assert one_per_replica(rows[2:], [2, 3], REPLICAS).tolist() == [[5.0, 6.0]]


def test_a_replica_whose_ranks_disagree_is_refused_naming_them():
    rows = torch.tensor([[1.0], [1.0], [5.0], [5.5]])
    with pytest.raises(ReplicaValuesDifferError, match="ranks 2 and 3 of replica 1") as caught:
        one_per_replica(rows, range(4), REPLICAS)
    assert "rank 2: [5.0] (float32[1])" in str(caught.value) and "rank 3: [5.5]" in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_equal_to_the_bit_so_a_common_nan_is_one_value_and_minus_zero_is_not_zero():
    nan = torch.tensor([[math.nan]] * 4)
    assert math.isnan(one_per_replica(nan, range(4), REPLICAS)[1, 0])
    signed = torch.tensor([[0.0], [-0.0], [1.0], [1.0]])
    with pytest.raises(ReplicaValuesDifferError):
        one_per_replica(signed, range(4), REPLICAS)


@pytest.mark.parametrize(
    ("op", "expected"), [("sum", [6.0, -1.0]), ("mean", [3.0, -0.5]), ("max", [5.0, 0.0]), ("min", [1.0, -1.0])]
)
def test_rows_reduce_as_an_all_reduce_over_replicas(op, expected):
    rows = torch.tensor([[1.0, 0.0], [5.0, -1.0]])
    assert reduce_rows(rows, op, torch.float32).tolist() == expected


def test_bools_reduce_as_the_wire_carries_them():
    # lite.all_reduce sends bools as int64 for sums and uint8 for max/min (_comm/wire.py)
    assert reduce_rows(torch.tensor([[1, 0], [1, 1]]), "sum", torch.bool).tolist() == [2, 1]
    assert reduce_rows(torch.tensor([[1, 0], [0, 0]], dtype=torch.uint8), "max", torch.bool).tolist() == [True, False]
