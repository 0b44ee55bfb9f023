import itertools
import random

import pytest
import torch

from fxmem.cost_model.lora_orders import (
    BACKWARD_ORDERS,
    FORWARD_ORDERS,
    LoraShape,
    backward_cost,
    choose_by_flops,
    default_cost,
    forward_cost,
)
from fxmem.kernels.runlora import runlora_linear

ALL = frozenset({"x", "a", "b"})


def paper_table_1(order: str, b: int, s: int, i: int, o: int, r: int) -> int:
    """RunLoRA Table 1, transcribed."""
    return {
        "forward1": 2 * b * s * (i * o + r * i + o * r),
        "forward2": 2 * (i * o * r + b * s * o * i),
        "backward1": 2 * b * s * (2 * o * r + 3 * i * r + o * i),
        "backward2": 2 * b * s * (o * r + 2 * i * r + 2 * i * o) + 2 * i * o * r,
        "backward3": 2 * b * s * (2 * i * o + o * r + i * r) + 4 * i * r * o,
        "backward4": 2 * (2 * b * s * i * o + 3 * i * o * r),
        "backward5": 2 * b * s * (2 * o * r + 2 * i * r + o * i) + 2 * i * o * r,
        "backward7": 2 * b * s * (o * r + i * r + 2 * o * i) + 4 * i * o * r,
        "backward8": 2 * b * s * (o * r + i * r + 2 * o * i) + 4 * i * o * r,
    }[order]


@pytest.mark.parametrize("b,s,i,o,r", [(2, 100, 768, 768, 8), (4, 512, 4096, 11008, 128), (1, 7, 13, 29, 3)])
def test_flops_match_runlora_table_1(b, s, i, o, r):
    shape = LoraShape(b * s, i, o, r)
    for order in FORWARD_ORDERS:
        assert forward_cost(order, shape).flops == paper_table_1(order, b, s, i, o, r), order
    for order in set(BACKWARD_ORDERS) - {"backward6"}:
        assert backward_cost(order, shape).flops == paper_table_1(order, b, s, i, o, r), order


def test_backward6_is_counted_by_hand():
    # dA = (X^T dY) B: 2nio + 2ior; dB = (X A^T)^T dY: 2nir + 2nro; dX = dY W + (dY B) A: 2nor + 2noi + 2nri.
    # The paper's table has + 4ior for it; its own Appendix A algorithm forms B A nowhere, so + 2ior.
    n, i, o, r = 1000, 64, 96, 8
    hand = 2 * n * i * o + 2 * i * o * r + 2 * n * i * r + 2 * n * r * o + 2 * n * o * r + 2 * n * o * i + 2 * n * r * i
    assert backward_cost("backward6", LoraShape(n, i, o, r)).flops == hand


def test_frozen_a_and_no_input_gradient_drop_their_products():
    n, i, o, r = 300, 40, 50, 4
    shape = LoraShape(n, i, o, r)
    # Only dB: backward1 recomputes X A^T (2nir) and multiplies (2nro); backward2 does X^T dY (2nio) then (2ior).
    assert backward_cost("backward1", shape, {"b"}).flops == 2 * n * i * r + 2 * n * r * o
    assert backward_cost("backward2", shape, {"b"}).flops == 2 * n * i * o + 2 * i * o * r
    # Frozen A (LoRA-FA): backward1's dY B is now used by dX alone.
    assert backward_cost("backward1", shape, {"x", "b"}).flops == (
        2 * n * o * r + 2 * n * i * r + 2 * n * r * o + 2 * n * o * i + 2 * n * r * i)
    # The first layer: no dX, so the merged and split dX orders cost the same.
    assert backward_cost("backward1", shape, {"a", "b"}) == backward_cost("backward5", shape, {"a", "b"})
    # The default saves X A^T: one n x i x r product fewer than backward1.
    assert default_cost(shape).flops == (forward_cost("forward1", shape).flops
                                         + backward_cost("backward1", shape).flops - 2 * n * i * r)


def test_bad_order_and_gradient_names_are_refused_naming_the_valid_ones():
    shape = LoraShape(8, 8, 8, 2)
    with pytest.raises(ValueError, match="backward1, backward2"):
        backward_cost("backward9", shape)
    with pytest.raises(ValueError, match="forward1, forward2"):
        forward_cost("forward3", shape)
    with pytest.raises(ValueError, match="valid: x, a, b"):
        backward_cost("backward1", shape, {"w"})
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        LoraShape(8, 8, 8, 0)


def test_chooser_reproduces_figure_3_regions_for_llama_mlp():
    """RunLoRA Figure 3: LlamaMLP, i=4096, o=11008, r=128, over batch x sequence length.

    With Table 1, forward2 wins exactly when b s > i o / (i + o) (= 2985.2 tokens) and, among the backward
    orders, backward5 beats backward1 exactly when b s > o (B A costs 2ior, recomputing X A^T 2nir) while
    backward4 never wins since i o > 2 r (i + o): the figure's two regions each, bounded by hyperbolas b s = c.
    """
    i, o, r = 4096, 11008, 128
    for batch, seq in itertools.product(range(1, 65), (32, 64, 100, 128, 256, 512, 600, 1000, 1024, 2048, 4096)):
        n = batch * seq
        choice = choose_by_flops(LoraShape(n, i, o, r))
        assert choice.forward == ("forward2" if n > i * o / (i + o) else "forward1"), (batch, seq)
        assert choice.backward == ("backward5" if n > o else "backward1"), (batch, seq)


def test_backward2_3_6_7_8_never_win_when_lora_has_fewer_parameters():
    """The paper's proof (Section 2): under r (i + o) < i o, only backward1, 4 or 5 can be cheapest."""
    rng = random.Random(0)
    seen = set()
    for _ in range(2000):
        i, o = rng.randint(8, 8192), rng.randint(8, 8192)
        r = rng.randint(1, max(1, i * o // (i + o) - 1))
        if r * (i + o) >= i * o:
            continue
        choice = choose_by_flops(LoraShape(rng.randint(1, 65536), i, o, r))
        seen.add(choice.backward)
    assert seen <= {"backward1", "backward4", "backward5"}
    assert {"backward1", "backward5"} <= seen


@pytest.mark.parametrize("needs", [ALL, frozenset({"x", "b"}), frozenset({"a", "b"}), frozenset({"b"})])
@pytest.mark.parametrize("forward_order", FORWARD_ORDERS)
@pytest.mark.parametrize("backward_order", BACKWARD_ORDERS)
def test_every_order_gives_the_default_gradients(forward_order, backward_order, needs):
    torch.manual_seed(0)
    i, o, r, scaling = 24, 40, 4, 2.0
    x = torch.randn(3, 5, i, dtype=torch.float64)
    weight, bias = torch.randn(o, i, dtype=torch.float64), torch.randn(o, dtype=torch.float64)
    lora_a, lora_b = torch.randn(r, i, dtype=torch.float64), torch.randn(o, r, dtype=torch.float64)
    grad_out = torch.randn(3, 5, o, dtype=torch.float64)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_(name in needs) for name, t in (("x", x), ("a", lora_a),
                                                                                 ("b", lora_b))]
        y = fn(leaves[0], leaves[1], leaves[2])
        y.backward(grad_out)
        return y.detach(), [t.grad for t in leaves]

    reference = grads(lambda x_, a_, b_: torch.nn.functional.linear(x_, weight, bias)
                      + scaling * torch.nn.functional.linear(torch.nn.functional.linear(x_, a_), b_))
    candidate = grads(lambda x_, a_, b_: runlora_linear(x_, weight, bias, a_, b_, scaling, forward_order,
                                                        backward_order))
    torch.testing.assert_close(candidate[0], reference[0])
    for name, ref, got in zip("xab", reference[1], candidate[1], strict=True):
        if name in needs:
            torch.testing.assert_close(got, ref, msg=name)
        else:
            assert got is None and ref is None


def test_runlora_linear_refuses_a_trainable_base_weight_and_unknown_orders():
    x, w = torch.randn(2, 4), torch.randn(3, 4, requires_grad=True)
    a, b = torch.randn(1, 4), torch.randn(3, 1)
    with pytest.raises(ValueError, match="freeze it"):
        runlora_linear(x, w, None, a, b, 1.0)
    with pytest.raises(ValueError, match="valid orders: backward1"):
        runlora_linear(x, w.detach(), None, a, b, 1.0, "forward1", "backward0")
    with pytest.raises(ValueError, match="two of aten, onednn"):
        runlora_linear(x, w.detach(), None, a, b, 1.0, "forward1", "backward1", ("aten", "mkl"))


def test_runlora_linear_saves_x_but_not_x_a():
    x = torch.randn(64, 32, requires_grad=True)
    w, a, b = torch.randn(48, 32), torch.randn(4, 32, requires_grad=True), torch.randn(48, 4, requires_grad=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        runlora_linear(x, w, None, a, b, 1.0)
    assert (64, 32) in shapes and (64, 4) not in shapes


def test_dropout_or_adapters_in_another_dtype_keep_s_b_a_out_of_w():
    # LlamaMLP at 16384 tokens: forward2 and backward5 (both fold s B A into W) are the cheapest where foldable.
    n, i, o, r = 16384, 4096, 11008, 128
    foldable = choose_by_flops(LoraShape(n, i, o, r, torch.bfloat16))
    assert (foldable.forward, foldable.backward) == ("forward2", "backward5")
    split = ("backward1", "backward2", "backward3", "backward6")  # dX = dY W + (dY B) A (Appendix A)
    for shape in (LoraShape(n, i, o, r, torch.bfloat16, adapter_dtype=torch.float32),
                  LoraShape(n, i, o, r, torch.bfloat16, dropout=True)):
        assert not shape.foldable and shape.candidate_orders() == (("forward1",), split)
        choice = choose_by_flops(shape)
        assert choice.forward == "forward1" and choice.backward in split
    # Adapters in the model's own dtype are the same problem as no adapter dtype given.
    assert LoraShape(n, i, o, r, torch.bfloat16, adapter_dtype=torch.bfloat16) == LoraShape(n, i, o, r, torch.bfloat16)


@pytest.mark.parametrize("backward_order", ["backward1", "backward2", "backward3", "backward6"])
def test_fp32_adapters_on_a_bf16_weight_give_peft_s_gradients(backward_order):
    torch.manual_seed(0)
    i, o, r, scaling = 24, 40, 4, 2.0
    x = torch.randn(3, 5, i, dtype=torch.bfloat16)
    weight = torch.randn(o, i, dtype=torch.bfloat16)
    lora_a, lora_b = torch.randn(r, i), torch.randn(o, r)
    grad_out = torch.randn(3, 5, o, dtype=torch.bfloat16)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, lora_a, lora_b)]
        y = fn(*leaves)
        y.backward(grad_out)
        return [y.detach(), *(t.grad for t in leaves)]

    def peft(x_, a_, b_):  # PEFT's Linear.forward with autocast_adapter_dtype
        result = torch.nn.functional.linear(x_, weight)
        lora = torch.nn.functional.linear(torch.nn.functional.linear(x_.to(a_.dtype), a_), b_) * scaling
        return (result + lora).to(result.dtype)

    reference = grads(peft)
    candidate = grads(lambda x_, a_, b_: runlora_linear(x_, weight, None, a_, b_, scaling, "forward1", backward_order))
    for name, ref, got in zip(("y", "x", "a", "b"), reference, candidate, strict=True):
        assert got.dtype == ref.dtype, name
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)


def test_folding_orders_refuse_adapters_in_another_dtype_naming_the_ones_that_apply():
    x, w = torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(3, 4, dtype=torch.bfloat16)
    a, b = torch.randn(1, 4, requires_grad=True), torch.randn(3, 1, requires_grad=True)
    with pytest.raises(ValueError, match=r"forward2 folds s B A into W.*forward1 and one of backward1, backward2, "
                                         r"backward3, backward6"):
        runlora_linear(x, w, None, a, b, 1.0, "forward2", "backward1")
    y = runlora_linear(x.requires_grad_(), w, None, a, b, 1.0, "forward1", "backward5")
    with pytest.raises(ValueError, match="backward5 folds s B A into W"):
        y.sum().backward()
