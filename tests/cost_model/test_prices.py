import pytest

from fxmem.cost_model import prices


@pytest.mark.parametrize("causal, flops", [(False, 4 * 2 * 8 * 128 * 256 * 64), (True, 2 * 2 * 8 * 128 * 256 * 64)])
def test_an_attention_forward_is_priced_by_its_two_products_at_the_matmul_rate(monkeypatch, causal, flops):
    monkeypatch.setattr(prices, "matmul_rate", lambda device: 1e9)
    seconds = prices.attention_seconds(2, 8, 128, 256, 64, causal=causal, device="cpu")
    assert seconds == pytest.approx(flops / 1e9)
