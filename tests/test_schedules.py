import math

import pytest
import torch

from prhs_hf.schedules import (
    depth_fraction,
    etf_frozen_count,
    etf_frozen_count_tensor,
    psaw_window_fraction,
    psaw_window_start,
    psaw_window_start_tensor,
)


def test_depth_fraction_hand_values():
    # N = 8, l_s = 4: u = (l - 4) / 4
    assert depth_fraction(3, 8, 4) is None
    assert [depth_fraction(l, 8, 4) for l in range(4, 8)] == [0.0, 0.25, 0.5, 0.75]


def test_psaw_hand_values():
    # phi = 0.7, alpha = 1, N = 8, l_s = 4
    assert psaw_window_fraction(2, 8, 4, 0.7, 1.0) == 1.0
    assert psaw_window_fraction(4, 8, 4, 0.7, 1.0) == 1.0
    assert psaw_window_fraction(6, 8, 4, 0.7, 1.0) == pytest.approx(0.7**0.5)
    # layer 6, t = 100: w = 0.83666, (1 - w) t = 16.33 -> 16; sink 8
    assert psaw_window_start(100, 0.7**0.5, 8) == 16
    # small t: the sinks bound it from below
    assert psaw_window_start(20, 0.7**0.5, 8) == 8
    # alpha = 2 at the last layer (u = 0.75): w = 0.7^1.5 = 0.5857, (1 - w) * 50 = 20.71 -> 20
    w = psaw_window_fraction(7, 8, 4, 0.7, 2.0)
    assert w == pytest.approx(0.7**1.5)
    assert psaw_window_start(50, w, 4) == 20


def test_etf_hand_values():
    # psi = 0.5, gamma = 1, N = 8, l_s = 4, L = 64
    assert etf_frozen_count(64, 3, 8, 4, 0.5, 1.0) == 0
    assert etf_frozen_count(64, 4, 8, 4, 0.5, 1.0) == 0
    assert etf_frozen_count(64, 6, 8, 4, 0.5, 1.0) == math.floor((1 - 0.5**0.5) * 64) == 18
    assert etf_frozen_count(64, 7, 8, 4, 0.5, 1.0) == 25  # (1 - 0.5^0.75) * 64 = 25.94
    # monotone in depth: a frozen row stays frozen
    counts = [etf_frozen_count(1000, l, 8, 4, 0.5, 1.0) for l in range(8)]
    assert counts == sorted(counts)


def test_tensor_versions_equal_scalar_versions():
    t = torch.arange(0, 5000, dtype=torch.int32)
    for w in (1.0, 0.7**0.25, 0.7**0.5, 0.7, 0.3):
        expected = torch.tensor([psaw_window_start(int(x), w, 8) for x in t])
        assert torch.equal(psaw_window_start_tensor(t, w, 8), expected.to(torch.int32))
    for layer in range(12):
        expected = torch.tensor([etf_frozen_count(int(x), layer, 12, 6, 0.5, 1.3) for x in t])
        assert torch.equal(etf_frozen_count_tensor(t, layer, 12, 6, 0.5, 1.3), expected.to(torch.int32))
