"""FLOPs and bytes moved of every forward and backward order of a LoRA linear, and the choice between them.

A LoRA linear computes Y = X W^T + s (X A^T) B^T with X (n x i), W (o x i),
A (r x i), B (o x r) and n = batch x sequence tokens (torch's Linear layout;
RunLoRA's paper writes the transposes). Its gradients

    dA = s B^T dY^T X          dB = s dY^T (X A^T)          dX = dY W + s dY B A

can be associated in two ways each (RunLoRA, Table 1 and Appendix A): eight
backward orders, two forward orders. No order saves X A^T for backward: the
orders that need it recompute it (its FLOPs are counted here). The default,
what autograd does with the traced graph, saves X A^T instead.

Each order is a set of named matmul products; an output needs some of them and
a product shared by two outputs is computed once. Costing only the products the
needed outputs use extends the table to frozen A (LoRA-FA, LoQT), frozen B, and
an input that needs no gradient (the first layer). Element-wise work (the
scaling, W + s B A's add) is not counted: it is O(io) or O(no) against the
O(nio) matmuls, as in the paper.

Folding s B A into W (forward2, the merged dX) needs the LoRA branch to read X
itself, in W's dtype. With dropout on the LoRA input the two branches read
different inputs; with PEFT's fp32 adapters on a bf16 model, W + s B A would
either round the adapters' product to bf16 or run the base product in fp32. Such
a layer chooses among forward1 and the split-dX backward orders only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from fxmem.kernels.runlora import (  # the orders themselves: the kernel computes them
    BACKWARD_ASSOCIATIONS,
    BACKWARD_ORDERS,
    FORWARD_ORDERS,
    GRADIENTS,
    SPLIT_DX_BACKWARD_ORDERS,
)


@dataclass(frozen=True)
class LoraShape:
    """One LoRA linear's problem: tokens n = batch x sequence, features in and out, rank, dtype (X's and W's).

    ``adapter_dtype``: A's and B's dtype where it is not ``dtype``; ``dropout``: the LoRA branch reads dropout(X).
    """

    tokens: int
    in_features: int
    out_features: int
    rank: int
    dtype: torch.dtype = torch.float32
    adapter_dtype: torch.dtype | None = None
    dropout: bool = False

    def __post_init__(self) -> None:
        for name in ("tokens", "in_features", "out_features", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.adapter_dtype == self.dtype:
            object.__setattr__(self, "adapter_dtype", None)  # one spelling per problem: equal shapes, one cache entry

    @property
    def foldable(self) -> bool:
        """Whether s B A may be folded into W (forward2, the merged dX): see the module's docstring."""
        return self.adapter_dtype is None and not self.dropout

    def candidate_orders(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The forward and the backward orders that compute this layer's output and gradients."""
        if self.foldable:
            return FORWARD_ORDERS, BACKWARD_ORDERS
        return ("forward1",), SPLIT_DX_BACKWARD_ORDERS


@dataclass(frozen=True)
class Product:
    """One matmul (m x k) @ (k x p)."""

    name: str
    m: int
    k: int
    p: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.p

    def bytes_moved(self, element_size: int) -> int:
        """Both operands read once and the result written once."""
        return (self.m * self.k + self.k * self.p + self.m * self.p) * element_size


@dataclass(frozen=True)
class Cost:
    flops: int
    bytes_moved: int


def _forward_products(order: str, shape: LoraShape) -> list[Product]:
    n, i, o, r = shape.tokens, shape.in_features, shape.out_features, shape.rank
    if order == "forward1":  # X W^T + s (X A^T) B^T
        return [Product("X W^T", n, i, o), Product("X A^T", n, i, r), Product("(X A^T) B^T", n, r, o)]
    if order == "forward2":  # X (W + s B A)^T
        return [Product("B A", o, r, i), Product("X (W + s B A)^T", n, i, o)]
    raise ValueError(f"unknown forward order {order!r}; valid orders: {', '.join(FORWARD_ORDERS)}")


def _backward_products(order: str, shape: LoraShape, needs: frozenset[str]) -> list[Product]:
    if order not in BACKWARD_ASSOCIATIONS:
        raise ValueError(f"unknown backward order {order!r}; valid orders: {', '.join(BACKWARD_ORDERS)}")
    n, i, o, r = shape.tokens, shape.in_features, shape.out_features, shape.rank
    d_a, d_b, d_x = BACKWARD_ASSOCIATIONS[order]
    shared = {
        "z1": Product("dY B", n, o, r),
        "xtdy": Product("X^T dY", i, n, o),
        "xa": Product("X A^T (recomputed)", n, i, r),
        "ba": Product("B A", o, r, i),
    }
    used: dict[str, Product] = {}
    if "a" in needs:
        if d_a == "z1":
            used.update(z1=shared["z1"], da=Product("dA = (dY B)^T X", r, n, i))
        else:
            used.update(xtdy=shared["xtdy"], da=Product("dA = B^T (X^T dY)^T", r, o, i))
    if "b" in needs:
        if d_b == "xa":
            used.update(xa=shared["xa"], db=Product("dB = dY^T (X A^T)", o, n, r))
        else:
            used.update(xtdy=shared["xtdy"], db=Product("dB = (X^T dY)^T A^T", o, i, r))
    if "x" in needs:
        if d_x == "split":
            used.update(z1=shared["z1"], dx_base=Product("dY W", n, o, i), dx_lora=Product("(dY B) A", n, r, i))
        else:
            used.update(ba=shared["ba"], dx=Product("dX = dY (W + s B A)", n, o, i))
    return list(used.values())


def _check_needs(needs: frozenset[str] | set[str] | tuple[str, ...]) -> frozenset[str]:
    needs = frozenset(needs)
    unknown = sorted(needs - set(GRADIENTS))
    if unknown:
        raise ValueError(f"unknown gradient(s) {', '.join(unknown)}; valid: {', '.join(GRADIENTS)}")
    return needs


def forward_cost(order: str, shape: LoraShape) -> Cost:
    products = _forward_products(order, shape)
    size = shape.dtype.itemsize
    return Cost(sum(p.flops for p in products), sum(p.bytes_moved(size) for p in products))


def backward_cost(order: str, shape: LoraShape, needs: frozenset[str] | set[str] = frozenset(GRADIENTS)) -> Cost:
    """The matmuls ``order`` runs to produce the gradients in ``needs`` (any of "x", "a", "b")."""
    products = _backward_products(order, shape, _check_needs(needs))
    size = shape.dtype.itemsize
    return Cost(sum(p.flops for p in products), sum(p.bytes_moved(size) for p in products))


def default_cost(shape: LoraShape, needs: frozenset[str] | set[str] = frozenset(GRADIENTS)) -> Cost:
    """Autograd on the traced graph: forward1, then backward1 reading the saved X A^T instead of recomputing it."""
    needs = _check_needs(needs)
    forward = forward_cost("forward1", shape)
    backward = [p for p in _backward_products("backward1", shape, needs) if not p.name.startswith("X A^T")]
    size = shape.dtype.itemsize
    return Cost(forward.flops + sum(p.flops for p in backward),
                forward.bytes_moved + sum(p.bytes_moved(size) for p in backward))


@dataclass(frozen=True)
class OrderChoice:
    """The forward and backward order chosen for one shape, their cost, and the default's."""

    forward: str
    backward: str
    cost: Cost
    default: Cost

    @property
    def flops_saving(self) -> float:
        """Fraction of the default's fwd+bwd FLOPs this choice saves (negative: it costs more)."""
        return 1 - self.cost.flops / self.default.flops


def _cheapest(orders: tuple[str, ...], cost_of) -> str:
    # Fewest FLOPs, then fewest bytes moved, then the lower-numbered (simpler) order.
    return min(orders, key=lambda order: (cost_of(order).flops, cost_of(order).bytes_moved, orders.index(order)))


@cache
def choose_by_flops(shape: LoraShape, needs: frozenset[str] = frozenset(GRADIENTS)) -> OrderChoice:
    """The forward and the backward order with the fewest FLOPs for ``shape`` (chosen independently:
    neither order keeps anything for the other)."""
    needs = _check_needs(needs)
    forwards, backwards = shape.candidate_orders()
    forward = _cheapest(forwards, lambda order: forward_cost(order, shape))
    backward = _cheapest(backwards, lambda order: backward_cost(order, shape, needs))
    return order_choice(forward, backward, shape, needs)


@cache
def choose_for_experts(shape: LoraShape) -> OrderChoice:
    """The orders for one expert's LoRA on stacked experts (``shape``: one expert's rows), which never folds the
    adapter into the experts' weights: forward1, and the backward order with the fewest FLOPs among those whose dX
    leaves it out (what ``fxmem.kernels.grouped_lora`` runs)."""
    return order_choice("forward1", _cheapest(SPLIT_DX_BACKWARD_ORDERS, lambda order: backward_cost(order, shape)),
                        shape)


def order_choice(forward: str, backward: str, shape: LoraShape,
                 needs: frozenset[str] = frozenset(GRADIENTS)) -> OrderChoice:
    """``forward`` and ``backward`` for ``shape``, with their summed cost and the default's."""
    f, b = forward_cost(forward, shape), backward_cost(backward, shape, needs)
    return OrderChoice(forward, backward, Cost(f.flops + b.flops, f.bytes_moved + b.bytes_moved),
                       default_cost(shape, needs))
