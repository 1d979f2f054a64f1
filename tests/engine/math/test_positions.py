import itertools

import pytest
import torch

from gali_cli.engine.checks.reference_model import alg1_chunk_sizes, alg2_positions
from gali_cli.engine.math.positions import chunk_plan, gali_positions, group_size, interpolate


def test_paper_figure_1():
    # train_len 4, chunk 2, local window 2, prefill 6, then the first generated token.
    assert chunk_plan(0, 6, train_len=4, chunk_size=2) == [(0, 4), (4, 6)]
    assert gali_positions(6, train_len=4, local_window=2).tolist() == [0, 0.5, 1, 1.5, 2, 3]
    assert chunk_plan(6, 7, train_len=4, chunk_size=2) == [(6, 7)]
    expected = torch.tensor([0, 1 / 3, 2 / 3, 1, 4 / 3, 2, 3], dtype=torch.float64)
    torch.testing.assert_close(gali_positions(7, train_len=4, local_window=2), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "train_len, local_window", [(4, 0), (4, 2), (4, 3), (16, 0), (16, 1), (16, 5), (16, 15), (64, 8), (37, 11)]
)
def test_closed_form_matches_algorithm_2_loop(train_len, local_window):
    for total_len in range(train_len + 1, 6 * train_len + 3):
        literal = torch.tensor(alg2_positions(0, train_len, total_len, local_window), dtype=torch.float64)
        torch.testing.assert_close(gali_positions(total_len, train_len, local_window), literal, rtol=0, atol=1e-9)


@pytest.mark.parametrize("train_len, local_window", [(16, 0), (16, 4), (64, 63), (512, 16)])
def test_interpolation_split_is_exact(train_len, local_window):
    for total_len in [train_len - 1, train_len, train_len + 1, 3 * train_len + 7, 8 * train_len]:
        interp = interpolate(total_len, train_len, local_window)
        p = gali_positions(total_len, train_len, local_window)
        assert interp.ceil.dtype == interp.floor.dtype == torch.int64
        assert interp.weight.dtype == torch.float64
        assert torch.equal(interp.ceil, p.ceil().long()) and torch.equal(interp.floor, p.floor().long())
        torch.testing.assert_close(interp.weight, p.ceil() - p, rtol=0, atol=1e-12)
        assert not interp.weight[interp.grouped :].any()
        if total_len <= train_len:
            assert interp.grouped == 0 and torch.equal(p, torch.arange(total_len, dtype=torch.float64))
        else:
            assert interp.weight[: interp.grouped].any()


@pytest.mark.parametrize("train_len, local_window", [(16, 1), (16, 6), (256, 4), (8192, 128)])
def test_structure_of_positions(train_len, local_window):
    for total_len in [train_len + 1, 2 * train_len + 5, 16 * train_len]:
        p = gali_positions(total_len, train_len, local_window)
        assert len(p) == total_len
        assert p[-1] == train_len - 1  # the newest token sits at the end of the training window
        assert torch.all(p[1:] > p[:-1])  # strictly increasing
        assert p.min() == 0 and p.max() <= train_len - 1
        tail = p[-local_window:] if local_window else p[:0]
        assert torch.equal(tail, torch.arange(train_len - local_window, train_len, dtype=torch.float64))
        g = group_size(total_len, train_len, local_window)
        gaps = p[1:] - p[:-1]
        assert torch.all(gaps >= 1 / g - 1e-12)  # at most g tokens per unit interval


def test_without_local_window_alg2_can_end_on_train_len():
    # Alg. 2 leaves no exact tail when total_len is a multiple of train_len: the last ceil is train_len itself.
    interp = interpolate(8, train_len=4, local_window=0)
    assert interp.ceil.max() == 4 and interp.grouped == 8


@pytest.mark.parametrize("train_len, chunk_size", [(4, 2), (16, 5), (16, 16), (64, 7), (10, 1)])
def test_chunk_plan_prefill_is_algorithm_1(train_len, chunk_size):
    for prefill_len in range(1, 5 * train_len):
        pieces = chunk_plan(0, prefill_len, train_len, chunk_size)
        assert [b - a for a, b in pieces] == alg1_chunk_sizes(prefill_len, train_len, chunk_size)


def test_chunk_plan_any_forward_is_cut_at_the_same_boundaries():
    train_len, chunk_size, stop = 16, 5, 60
    whole = chunk_plan(0, stop, train_len, chunk_size)
    boundaries = {b for _, b in whole}
    for start, end in itertools.combinations(range(0, stop + 1, 3), 2):
        pieces = chunk_plan(start, end, train_len, chunk_size)
        assert pieces[0][0] == start and pieces[-1][1] == end
        assert all(a < b for a, b in pieces) and all(pieces[k][1] == pieces[k + 1][0] for k in range(len(pieces) - 1))
        assert {b for _, b in pieces[:-1]} <= boundaries
    assert chunk_plan(40, 41, train_len, chunk_size) == [(40, 41)]  # decoding: one token, one chunk
    with pytest.raises(ValueError):
        chunk_plan(5, 5, train_len, chunk_size)
