import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.cost_model import prices


@pytest.mark.parametrize("causal, flops", [(False, 4 * 2 * 8 * 128 * 256 * 64), (True, 2 * 2 * 8 * 128 * 256 * 64)])
def test_an_attention_forward_is_priced_by_its_two_products_at_the_matmul_rate(monkeypatch, causal, flops):
    monkeypatch.setattr(prices, "matmul_rate", lambda device: 1e9)
    seconds = prices.attention_seconds(2, 8, 128, 256, 64, causal=causal, device="cpu")
    assert seconds == pytest.approx(flops / 1e9)


@torch.library.custom_op("fxmem_test::apply_matrices", mutates_args=())
def _apply_matrices(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return x @ first.T @ second.T


@_apply_matrices.register_fake
def _(x, first, second):
    return x.new_empty(x.shape[0], second.shape[0])


def test_a_replayed_forward_is_priced_by_its_flops_and_its_other_ops_bytes_views_free(monkeypatch):
    monkeypatch.setattr(prices, "matmul_rate", lambda device: 1e9)
    monkeypatch.setattr(prices, "memory_bandwidth", lambda device: 1e6)

    def forward(x, w, first, second, q):
        y = torch.relu(x @ w.t())  # w.t() a view: free; a (64 x 32) by (32 x 16) product; 64 x 16 written and read
        z = torch.ops.fxmem_test.apply_matrices(y.view(64, 16), first, second)  # 64 rows through 8 x 16 and 4 x 8
        mean, var = torch.var_mean(z, dim=-1)  # two outputs of 64, each written and read
        attention = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return z, mean, var, attention

    gm = make_fx(forward, tracing_mode="fake")(torch.randn(64, 32), torch.randn(16, 32), torch.randn(8, 16),
                                              torch.randn(4, 8), torch.randn(1, 2, 16, 8))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    flops = 2 * 64 * 32 * 16 + 2 * 64 * (8 * 16 + 4 * 8) + 4 * 1 * 2 * 16 * 16 * 8 // 2
    traffic = 2 * 64 * 16 * 4 + 2 * 2 * 64 * 4
    # fused attention (causal: half the flops) is priced by its flops alone, not its outputs' bytes
    assert any("flash_attention" in str(n.target) for n in nodes)
    assert prices.forward_seconds(nodes) == pytest.approx(flops / 1e9 + traffic / 1e6)
