"""The data-parallel world and the owner of each unit (Note: [The training state is partitioned by unit])."""

import pytest

from lazytrain_hf.planner.world import World, unit_owners


def test_equal_layers_are_dealt_round_robin_and_frozen_units_have_no_owner():
    assert unit_owners([10, 10, 10, 10, 10], 2) == [0, 1, 0, 1, 0]
    assert unit_owners([10, 0, 10, 10], 3) == [0, -1, 1, 2]
    assert unit_owners([10, 10, 10], 1) == [0, 0, 0]


def test_a_large_unit_is_balanced_by_elements():
    # the embedding (40) first: the next three layers go to the other rank until it has as many elements
    assert unit_owners([40, 10, 10, 10, 10, 10], 2) == [0, 1, 1, 1, 1, 0]


def test_a_large_head_does_not_pile_the_layers_onto_one_rank():
    # a streamed embedding and head of 33.5M elements around 12 layers of 3.1M (benchmarks/bench_dp.py's model):
    # dealt in unit order, rank 1 took 11 layers and the head (71.5M) against rank 0's 36.7M, and the optimizer
    # time per rank barely fell. Each rank's load is within the largest layer of the others'.
    units = [33_554_432] + [3_146_240] * 12 + [33_554_432]
    owners = unit_owners(units, 2)
    load = [sum(n for n, r in zip(units, owners) if r == k) for k in range(2)]
    assert abs(load[0] - load[1]) <= 3_146_240, (owners, load)
    assert owners[1:13] == [0, 1] * 6  # equal layers still round-robin, in layer order
    owners4 = unit_owners(units, 4)
    load4 = [sum(n for n, r in zip(units, owners4) if r == k) for k in range(4)]
    assert max(load4) <= 33_554_432 + 3_146_240, (owners4, load4)


def test_world_ranks_and_nodes():
    w = World(4, 2)
    assert w.local_world_size == 2
    assert [w.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [w.local_rank(r) for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("ws,nodes,word", [(0, 1, "world_size=0"), (2, 0, "nodes=0"), (3, 2, "not a multiple")])
def test_bad_world_is_refused_with_the_fix(ws, nodes, word):
    with pytest.raises(ValueError, match=word):
        World(ws, nodes)
