import pytest
import torch

from fxmem.measure import (
    Fidelity,
    ZeroGradientError,
    gradient_fidelity,
    peak_memory,
    saved_activation_bytes,
    static_bytes,
)


def test_saved_bytes_count_each_storage_once_and_skip_excluded():
    x = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(32, 16, requires_grad=True)
    # sin saves its input (x * 2: 64*32 floats); mm saves sin's output and the weight (excluded).
    saved, out = saved_activation_bytes(lambda: ((x * 2).sin() @ weight).sum(), exclude=[x, weight])
    assert saved == 2 * 64 * 32 * 4
    out.backward()
    # x.sin() saves x itself: an excluded input, so nothing is counted.
    saved, _ = saved_activation_bytes(lambda: x.sin().sum(), exclude=[x])
    assert saved == 0


def test_saved_bytes_count_a_storage_once_through_views():
    x = torch.randn(8, 16, requires_grad=True)

    def forward():
        y = x.exp()  # exp saves its output y
        return (y.view(16, 8).sin() + y.t().cos().t().reshape(16, 8)).sum()  # sin/cos save views of y

    saved, _ = saved_activation_bytes(forward, exclude=[x])
    assert saved == 8 * 16 * 4


def test_cpu_peak_sees_a_transient_allocation():
    size = 4 << 20

    def step():
        buffer = torch.empty(size, dtype=torch.uint8)
        buffer.fill_(1)
        del buffer

    peak = peak_memory(step, "cpu")
    assert size <= peak < size + (1 << 20)


def test_gradient_fidelity():
    reference = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, 2.0])}
    same = gradient_fidelity(reference, {k: v.clone() for k, v in reference.items()})
    assert same.min_cosine == pytest.approx(1.0) and same.median_relative_error == 0.0
    assert (same.compared, same.zero_in_reference) == (2, 0)
    scaled = gradient_fidelity(reference, {"a": reference["a"] * 1.1, "b": reference["b"]})
    assert scaled.min_cosine == pytest.approx(1.0) and scaled.median_relative_error == pytest.approx(0.05)
    rotated = gradient_fidelity(reference, {"a": torch.tensor([0.0, 1.0]), "b": reference["b"]})
    assert rotated.min_cosine == pytest.approx(0.0) and rotated.worst_parameter == "a"
    vanished = gradient_fidelity(reference, {"a": torch.zeros(2), "b": reference["b"]})
    assert vanished.min_cosine == 0.0 and vanished.worst_parameter == "a"
    with pytest.raises(ValueError, match="candidate has no gradient for b"):
        gradient_fidelity(reference, {"a": reference["a"]})


def test_a_zero_reference_gradient_is_refused_not_counted_as_cosine_one():
    reference = {"lora_A": torch.zeros(2), "lora_B": torch.tensor([1.0, 2.0])}
    with pytest.raises(ZeroGradientError, match=r"1 of 2 reference gradients are zero \(e.g. lora_A\).*zero init"):
        gradient_fidelity(reference, {k: v.clone() for k, v in reference.items()})


def test_a_fidelity_written_before_the_counts_reads_back_without_them():
    old = {"min_cosine": 0.99, "median_relative_error": 0.01, "worst_parameter": "p"}
    assert Fidelity.from_dict(old) == Fidelity(0.99, 0.01, "p", None, 0)
    fidelity = Fidelity(0.99, 0.01, "p", 14, 0)
    assert Fidelity.from_dict(fidelity.to_dict()) == fidelity


def test_static_bytes_count_weights_and_optimizer_state_once():
    model = torch.nn.Linear(10, 20)  # 220 parameters
    optimizer = torch.optim.AdamW(model.parameters())
    assert static_bytes(model) == 220 * 4
    model(torch.randn(3, 10)).sum().backward()
    optimizer.step()
    # AdamW adds exp_avg and exp_avg_sq per parameter, and a step counter per parameter tensor
    assert static_bytes(model, optimizer) == 220 * 4 * 3 + 2 * 4


def test_a_tensor_a_custom_function_stashes_on_its_ctx_is_counted_as_saved():
    class Stashing(torch.autograd.Function):  # as bitsandbytes' 4-bit matmul keeps its input: ctx.tensors = (x,)
        @staticmethod
        def forward(ctx, x):
            ctx.tensors = (x * 2,)
            return x * 3

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.tensors[0] / ctx.tensors[0]

    x = torch.randn(64, requires_grad=True)
    saved, y = saved_activation_bytes(lambda: Stashing.apply(x).sin(), exclude=[x])
    assert saved == 64 * 4 * 2  # x * 2 on the ctx, and sin's input through the hooks
    y.sum().backward()
