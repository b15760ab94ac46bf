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


# ------------------------------------------------------------------ tile plans
@pytest.mark.parametrize("lengths,tile", [([5, 1, 0, 17, 40], 4), ([12, 12], 12), ([3], 8), ([], 4), ([0, 0], 2)])
def test_tile_plan_covers_each_causal_pair_once(lengths, tile):
    from gr_functional.jagged import tile_counts

    lay = Jagged.from_sequences([np.arange(1, n + 1) for n in lengths], max_len=40).with_tiles(tile)
    plan = lay.tiles
    chunks, pairs = tile_counts(lengths, tile)
    pq, pk = np.asarray(plan.pair_q), np.asarray(plan.pair_k)
    assert (pq < plan.nc_cap).sum() == pairs and (pq == plan.nc_cap).sum() >= 1
    assert (np.diff(pq) >= 0).all()                                # sorted for segment sums
    rows = np.asarray(plan.chunk_rows)
    assert (rows[plan.nc_cap] == lay.t_cap).all()                  # the dummy chunk is empty
    # every causal (i, j) of every sequence appears in exactly one pair
    seen = {}
    for q, k in zip(pq[:pairs], pk[:pairs]):
        for i in rows[q][rows[q] < lay.t_cap]:
            for j in rows[k][rows[k] < lay.t_cap]:
                if j <= i:
                    seen[(i, j)] = seen.get((i, j), 0) + 1
    want = {(o + a, o + b) for o, n in zip(np.concatenate([[0], np.cumsum(lengths)]), lengths)
            for a in range(n) for b in range(a + 1)}
    assert set(seen) == want and set(seen.values()) <= {1}
    # token_cell inverts chunk_rows
    flat = rows.reshape(-1)
    cell = np.asarray(plan.token_cell)
    assert (flat[cell[: lay.num_tokens()]] == np.arange(lay.num_tokens())).all()
    assert (cell[lay.num_tokens():] // tile == plan.nc_cap).all()


def test_tile_plan_explicit_capacities_and_errors():
    lay = Jagged.from_sequences([np.arange(1, 9)], max_len=8)
    plan = lay.with_tiles(4, p_cap=16, nc_cap=6).tiles
    assert plan.pair_q.shape == (16,) and plan.chunk_rows.shape == (7, 4) and plan.nc_cap == 6
    with pytest.raises(JaggedError, match="p_cap >= 4"):
        lay.with_tiles(4, p_cap=3)
    with pytest.raises(JaggedError, match="tile must be >= 1"):
        lay.with_tiles(0)


def test_auto_tile():
    from gr_functional.config import ModelConfig

    assert [ModelConfig(max_len=n).tile for n in (50, 200, 1024, 4096)] == [32, 32, 128, 256]
    assert ModelConfig(max_len=200, attention_tile=0).tile == 0
    assert ModelConfig(max_len=200, attention_tile=48).tile == 48
