"""Host values behind fake tensors (`utils/fake_values.py`): kept tensors, their views, refusals."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from meshforge.utils.fake_values import host_value, keep, on_host


def _nonzero_rows(x: torch.Tensor) -> torch.Tensor:
    return x.nonzero()[:, 0]


def test_a_function_of_kept_values_and_of_their_views_comes_back_as_fakes() -> None:
    host = torch.tensor([[0, 3, 0, 5], [7, 0, 0, 0]])
    mode = FakeTensorMode()
    fake = mode.from_tensor(host)
    keep(fake, host)
    with mode:
        rows = on_host(_nonzero_rows, fake, what="a test")
        assert isinstance(rows, FakeTensor) and rows.shape == (3,)  # three non-zero values
        second = fake[1:]  # a view: its values are the kept tensor's rows
        assert host_value(second) is not None and host_value(second).tolist() == [[7, 0, 0, 0]]
        assert on_host(_nonzero_rows, second, what="a test").shape == (1,)


def test_real_tensors_go_straight_through() -> None:
    values = torch.tensor([[1, 0], [0, 1]])
    assert torch.equal(on_host(_nonzero_rows, values, what="a test"), torch.tensor([0, 1]))


def test_a_fake_without_host_values_is_refused_naming_the_caller() -> None:
    mode = FakeTensorMode()
    with mode:
        derived = mode.from_tensor(torch.ones(2, 2)) * 2
        with pytest.raises(NotImplementedError, match="not supported yet: a dry run of the answer tokens"):
            on_host(_nonzero_rows, derived, what="the answer tokens")
