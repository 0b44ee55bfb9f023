"""fxmem.analysis.graph: layout facts the planner reads."""

import torch

from fxmem.analysis.graph import memory_order, merged_channels


def test_merged_channels_counts_the_innermost_dims_that_make_up_a_views_last_dimension():
    per_head = torch.empty(2, 64, 4, 32)  # (batch, tokens, heads, head dim), read as (tokens, 128)
    order = memory_order(per_head)
    assert merged_channels(per_head, order, 128) == 2
    assert merged_channels(per_head, order, 32) == 1  # the innermost alone
    assert merged_channels(per_head, order, 64) == 1  # no run of them multiplies to it
    assert merged_channels(per_head, order, 64 * 128) == 3
    transposed = torch.empty(2, 4, 64, 32).transpose(1, 2)  # heads outside tokens in memory: no run gives 128
    assert merged_channels(transposed, memory_order(transposed), 128) == 1
