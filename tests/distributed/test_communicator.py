"""Collectives over 2 gloo ranks, the one-rank fast path, and the spawn harness's failure handling."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed import TPGroup, all_gather, all_reduce
from tests.distributed import workers
from tests.distributed.launch import run_ranks


def test_single_rank_is_a_no_op() -> None:
    tp = TPGroup.single()
    x = torch.randn(3, 4)
    assert all_reduce(x, tp) is x
    assert all_gather(x, tp, dim=0) is x


def test_all_reduce_and_all_gather_two_ranks() -> None:
    run_ranks(workers.check_collectives, 2, timeout=90)


def test_child_error_fails_the_test_with_its_traceback() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"(?s)Traceback.*boom from rank 1"):
        run_ranks(workers.raise_on_rank1, 2, timeout=90)


def test_hung_child_times_out() -> None:
    with pytest.raises(pytest.fail.Exception, match="did not finish in 5 s"):
        run_ranks(workers.hang_on_rank1, 2, timeout=5)
