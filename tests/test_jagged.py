"""Jagged: construction, derived index arrays, validation errors, pytree behaviour."""
import numpy as np
import pytest

from gr_functional.jagged import Jagged, JaggedError, round_up_capacity


def test_derived_arrays():
    j = Jagged.from_sequences([np.array([5, 6, 7]), np.array([], np.int64), np.array([8])], max_len=4)
    assert j.b_cap == 3 and j.t_cap == 8
    np.testing.assert_array_equal(j.offsets, [0, 3, 3, 4])
    np.testing.assert_array_equal(j.lengths, [3, 0, 1])
    np.testing.assert_array_equal(j.seq_id, [0, 0, 0, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(j.pos, [0, 1, 2, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(j.last_index, [2, 8, 3])
    np.testing.assert_array_equal(j.to_padded(), [[5, 6, 7, 0], [0, 0, 0, 0], [8, 0, 0, 0]])
    assert j.values.dtype == np.int32 and j.offsets.dtype == np.int32
    assert [s.tolist() for s in j.to_sequences()] == [[5, 6, 7], [], [8]]


def test_capacities_and_empty_slots():
    j = Jagged.from_offsets(np.ones((5, 2), np.float32), [0, 2, 5], max_len=3, t_cap=16, b_cap=4)
    np.testing.assert_array_equal(j.offsets, [0, 2, 5, 5, 5])
    assert j.values.shape == (16, 2) and (j.values[5:] == 0).all()
    assert (j.seq_id[5:] == 4).all()


@pytest.mark.parametrize("n", [1, 7, 8, 9, 100, 1000, 5000])
def test_capacity_ladder(n):
    cap = round_up_capacity(n)
    assert cap >= n and cap < max(8, n) * 1.5 + 1


@pytest.mark.parametrize("offsets,message", [
    ([0, 3, 2, 5], "non-decreasing"),
    ([1, 3, 5], "offsets[0] must be 0"),
    ([0, 2, 4], "offsets[-1]=4 but values has 5 rows"),
    ([0, 5], "length 5 > max_len=4"),
])
def test_bad_offsets(offsets, message):
    with pytest.raises(JaggedError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Jagged.from_offsets(np.arange(5), offsets, max_len=4)


def test_wrong_offset_dtype():
    with pytest.raises(JaggedError, match="offsets must be integers"):
        Jagged.from_offsets(np.arange(4), np.array([0.0, 4.0]), max_len=4)


def test_ids_beyond_int32_are_rejected():
    with pytest.raises(JaggedError, match="does not fit the int32 index dtype"):
        Jagged.from_sequences([np.array([1, 2**40 + 7])], max_len=4)


def test_capacity_too_small():
    with pytest.raises(JaggedError, match="t_cap=2 < number of tokens 3"):
        Jagged.from_sequences([np.array([1, 2, 3])], max_len=4, t_cap=2)


def test_jax_pytree_and_jit_compiles_once_per_capacity():
    import jax

    from backends import get_backend

    B = get_backend("jax")
    traces = []

    @jax.jit
    def total(j):
        traces.append(1)
        return B.xp.sum(j.values * (j.seq_id < j.b_cap))

    a = B.asarray_tree(Jagged.from_sequences([np.array([1, 2]), np.array([3])], max_len=4, t_cap=8, b_cap=4))
    b = B.asarray_tree(Jagged.from_sequences([np.array([4, 5, 6])], max_len=4, t_cap=8, b_cap=4))
    assert int(total(a)) == 6 and int(total(b)) == 15
    assert len(traces) == 1
    leaves = jax.tree_util.tree_leaves(a)
    assert len(leaves) == 7  # values, offsets, lengths, seq_id, pos, dense_index, last_index; max_len static


def test_torch_container():
    import torch

    from backends import get_backend

    j = get_backend("torch").asarray_tree(Jagged.from_sequences([np.array([1, 2])], max_len=4))
    assert isinstance(j.values, torch.Tensor) and j.values.dtype == torch.int32 and j.max_len == 4
