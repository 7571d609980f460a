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


def test_world_ranks_and_nodes():
    w = World(4, 2)
    assert w.local_world_size == 2
    assert [w.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [w.local_rank(r) for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("ws,nodes,word", [(0, 1, "world_size=0"), (2, 0, "nodes=0"), (3, 2, "not a multiple")])
def test_bad_world_is_refused_with_the_fix(ws, nodes, word):
    with pytest.raises(ValueError, match=word):
        World(ws, nodes)
