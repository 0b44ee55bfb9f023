"""Eager attention in a joint graph: softmax(q k^T, scaled, masked, soft-capped) then its product with v.

Eager attention (a model's own matmul + softmax + matmul, as Gemma-2's soft-capped logits need) saves its
probabilities for backward, a (heads x tokens x tokens) tensor per layer. Backward can rebuild them exactly from the q
and k it keeps anyway for their own gradients, at the price of the scores' matmul and the element-wise chain once
more, as fused attention does; ``eager_attention_chains`` finds what that takes. Recognised by structure alone: a
softmax whose output is the left operand of a batched matmul (P v), traced back through element-wise ops (scale,
mask, soft-capping's tanh, a sliding window's where), views, casts, a cat (gpt-oss's sink column joined to the scores)
and a row's max (subtracted before the softmax) to the batched matmul that made its scores (q k^T). Dropout
between the probabilities and P v is drawn again in backward from the step's seeds (inductor's ``inductor_random``,
as passes/joint/replay_dropout.py replays a LoRA input's): the same mask; a draw from a stateful generator would not be,
and leaves that attention as it is.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fxmem.analysis.blocks import draws_from_step_seed, draws_random_numbers
from fxmem.analysis.graph import (
    DTYPE_CASTS,
    is_replayable_pointwise,
    is_view,
    original_op,
    tensor_args,
    tensor_val,
)
from fxmem.analysis.ops import BATCHED_MATMULS, SOFTMAXES

aten = torch.ops.aten


@dataclass(frozen=True)
class EagerAttention:
    probabilities: Node  # the softmax's output
    scores: Node  # the batched matmul q k^T
    chain: tuple[Node, ...]  # every node from the scores' matmul (and the mask) to the probabilities, in graph order


def eager_attention_chains(graph: Graph) -> tuple[list[EagerAttention], int]:
    """Every eager attention of ``graph`` whose probabilities backward can rebuild from q and k; and how many others
    it has (dropout on the probabilities drawn other than from the step's seeds: it would not draw the same mask)."""
    found, unreplayable = [], 0
    for node in graph.nodes:
        if not _softmax_output(node):
            continue
        product = _path_to_product(node)
        if product is None:
            continue
        scores, mask = _scores_chain(node), _dropout_mask(node, product)
        if mask is None:
            unreplayable += 1
        elif scores is not None:
            order = {n: i for i, n in enumerate(graph.nodes)}
            chain = sorted({*scores[1], *product, *mask}, key=order.__getitem__)
            found.append(EagerAttention(node, scores[0], tuple(chain)))
    return found, unreplayable


def _softmax_output(node: Node) -> bool:
    """The last node of a (decomposed) softmax: a softmax node read by a node that is not part of it."""
    return (node.op == "call_function" and original_op(node) in SOFTMAXES
            and any(original_op(user) not in SOFTMAXES for user in node.users))


def _path_to_product(probabilities: Node) -> set[Node] | None:
    """The forward nodes between ``probabilities`` and the batched matmul that reads them as its left operand (P v):
    views, casts and element-wise ops (dropout's mask and scale); None where no batched matmul reads them so (a
    router's softmax). Backward's products read them too, later in the graph: the first is forward's."""
    order = {node: i for i, node in enumerate(probabilities.graph.nodes)}
    paths: dict[Node, tuple[Node, ...]] = {}
    stack: list[tuple[Node, tuple[Node, ...]]] = [(probabilities, ())]
    while stack:
        node, trail = stack.pop()
        for user in node.users:
            if user.target in BATCHED_MATMULS and user.args[0] is node:
                paths.setdefault(user, trail)
            elif "backward" not in original_op(user) and (
                    is_view(user) or user.target in DTYPE_CASTS or is_replayable_pointwise(user)):
                stack.append((user, (*trail, user)))
    if not paths:
        return None
    return set(paths[min(paths, key=order.__getitem__)])


def _dropout_mask(probabilities: Node, path: set[Node]) -> set[Node] | None:
    """What the ops on ``path`` read besides the probabilities and builds from random numbers (dropout's mask, back
    to its draw), to be drawn again in backward; None where a draw is not from the step's seeds."""
    mask: set[Node] = set()
    stack = [arg for node in path for arg in tensor_args(node) if arg is not probabilities and arg not in path]
    while stack:
        node = stack.pop()
        if node in mask or node.op != "call_function":
            continue
        if draws_random_numbers(node):
            if not draws_from_step_seed(node):
                return None
            mask.add(node)
        elif is_view(node) or is_replayable_pointwise(node):
            mask.add(node)
            stack.extend(tensor_args(node))
    return mask


def _row_max(node: Node) -> bool:
    """A row's maximum (``max(dim, keepdim=True)`` or its values), as a stabilizer subtracts before the softmax."""
    if node.target is operator.getitem:
        node = node.args[0]
    if not (isinstance(node, Node) and node.target is aten.max.dim and len(node.args) > 2 and node.args[2]):
        return False
    return node.args[1] in (-1, tensor_val(node.args[0]).dim() - 1)


def _inputs(node: Node) -> list[Node]:
    """The tensors ``node`` reads, a cat's list included (the scores joined with a sink's column)."""
    if node.target is aten.cat.default:
        return [arg for arg in node.args[0] if isinstance(arg, Node)]
    if node.target is operator.getitem:
        return [node.args[0]]
    return tensor_args(node)


def _scores_chain(probabilities: Node) -> tuple[Node, tuple[Node, ...]] | None:
    """The scores' batched matmul, and every node between it and ``probabilities`` (both included, with the
    element-wise ops that build a mask from the positions); None where the softmax's input comes from no one batched
    matmul through element-wise ops, views and casts."""
    chain: set[Node] = set()
    matmuls: set[Node] = set()
    stack = [probabilities]
    while stack:
        current = stack.pop()
        if current in chain or current.op != "call_function":
            continue
        if current.target in BATCHED_MATMULS:
            matmuls.add(current)
            chain.add(current)
            continue
        if not (original_op(current) in SOFTMAXES or is_view(current) or is_replayable_pointwise(current)
                or current.target is aten.cat.default or _row_max(current)):
            continue  # an input of the chain (a mask built elsewhere, a constant): read, not rebuilt
        chain.add(current)
        if current.target is aten.max.dim:  # its indices too: max's backward reads them
            chain.update(user for user in current.users if user.target is operator.getitem)
        stack.extend(_inputs(current))
    if len(matmuls) != 1:
        return None
    return next(iter(matmuls)), tuple(chain)
