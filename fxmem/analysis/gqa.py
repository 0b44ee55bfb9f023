"""Attention whose key and value heads are repeated for SDPA (grouped-query attention), in the graph dynamo captured.

HF's ``repeat_kv`` copies each of a GQA model's key and value heads to the ``n_rep`` query heads that share it
(``x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)``) before SDPA, unless it passes no mask
(then it asks SDPA for ``enable_gqa``). Under torch.compile HF builds the mask, so the copies are made: n_rep times
the key's and value's bytes, made again in backward (min-cut saves the heads before them), with gradients of the
same size. SDPA's ``enable_gqa`` maps query
head h to key head h // n_rep, the head ``repeat_kv`` copied there: the same attention.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch.fx import Graph, Node

from fxmem.analysis.graph import hint
from fxmem.analysis.loss import example_tensor
from fxmem.analysis.mask import SDPA, sdpa_arguments

_FULL = slice(None, None, None)
_NEW_HEAD_AXIS = (_FULL, _FULL, None, _FULL, _FULL)


@dataclass(frozen=True)
class RepeatedHeadsAttention:
    attention: Node  # the SDPA call
    key: Node  # the key and value before repeat_kv, (batch, kv_heads, tokens, head_dim)
    value: Node
    repeats: int  # n_rep: query heads per key head


def find_repeated_heads_attention(graph: Graph) -> list[RepeatedHeadsAttention]:
    """Every SDPA call without a mask whose key and value are ``repeat_kv`` copies, repeated alike."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not SDPA:
            continue
        arguments = sdpa_arguments(node)
        if arguments.get("attn_mask") is not None or arguments.get("enable_gqa", False):
            continue
        key, value = (repeated_kv(arguments.get(name)) for name in ("key", "value"))
        if key is not None and value is not None and key[1] == value[1]:
            found.append(RepeatedHeadsAttention(node, key[0], value[0], key[1]))
    return found


def repeated_kv(node: object) -> tuple[Node, int] | None:
    """(x, n_rep) when ``node`` is HF's ``repeat_kv(x, n_rep)`` with n_rep > 1, read by nothing but SDPA."""
    if not (isinstance(node, Node) and node.op == "call_method" and node.target == "reshape"
            and all(u.target is SDPA for u in node.users)):
        return None
    expanded = node.args[0]
    if not (isinstance(expanded, Node) and expanded.op == "call_method" and expanded.target == "expand"
            and len(expanded.users) == 1 and len(expanded.args) == 6):
        return None
    unsqueezed = expanded.args[0]
    if not (isinstance(unsqueezed, Node) and unsqueezed.op == "call_function" and unsqueezed.target is operator.getitem
            and unsqueezed.args[1] == _NEW_HEAD_AXIS and len(unsqueezed.users) == 1):
        return None
    x = unsqueezed.args[0]
    x_value, repeated_value = example_tensor(x), example_tensor(node)
    if x_value is None or repeated_value is None or x_value.dim() != 4:
        return None
    repeats = expanded.args[3]
    shape, repeated_shape = [hint(s) for s in x_value.shape], [hint(s) for s in repeated_value.shape]
    if not isinstance(repeats, int) or repeats < 2 or repeated_shape != [shape[0], shape[1] * repeats, *shape[2:]]:
        return None
    return x, repeats
