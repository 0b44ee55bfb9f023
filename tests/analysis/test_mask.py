import pytest
import torch
import torch.nn.functional as F

from fxmem.analysis.mask import CausalMask, UnprovenMask, find_attention_masks

S = 8


def _dynamo_graph(module, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=capture, fullgraph=True)(*args)
    return graphs[0]


class _Attention(torch.nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, q, *extra):
        mask = self.mask(q.shape[-2], q.device, *extra)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def _positions(n, device):
    return torch.arange(n, device=device)


def _found(mask, *extra):
    q = torch.randn(2, 2, S, 4)
    (found,) = find_attention_masks(_dynamo_graph(_Attention(mask), q, *extra))
    return found


def test_a_mask_of_positions_kv_le_q_is_proven_causal_with_any_true_terms_beside_it():
    def hf_like(n, device):  # HF's shape: a scalar True, the causal term, a packed-sequence term true everywhere
        q, kv = _positions(n, device), _positions(n, device)
        ids = torch.zeros(1, n, dtype=torch.long, device=device)
        causal = kv[None, None, None, :] <= q[None, None, :, None]
        same_document = ids[:, None, :, None] == ids[:, None, None, :]
        return (q.new_ones((), dtype=torch.bool) & causal & same_document).expand(2, 1, n, n)

    found = _found(hf_like)
    assert isinstance(found, CausalMask) and found.shape == (2, 1, S, S)
    assert _found(lambda n, d: _positions(n, d)[:, None] >= _positions(n, d)[None, :]).shape == (S, S)


@pytest.mark.parametrize("mask, reason", [
    (lambda n, d: _positions(n, d)[None, :] < _positions(n, d)[:, None], "a lt comparison neither causal nor true"),
    (lambda n, d: _positions(n, d)[None, :] >= _positions(n, d)[:, None], "a ge comparison neither causal nor true"),
    # kv <= q over decreasing positions: the upper triangle
    (lambda n, d: (-_positions(n, d))[None, :] <= (-_positions(n, d))[:, None], "a le comparison neither causal"),
    (lambda n, d: (_positions(n, d)[None, :] <= _positions(n, d)[:, None])  # a sliding window
     & (_positions(n, d)[None, :] > _positions(n, d)[:, None] - 3), "a gt comparison neither causal nor true"),
    (lambda n, d: torch.zeros(n, 1, device=d) == torch.zeros(1, n, device=d), "no term orders keys before queries"),
    (lambda n, d: torch.ones(n, n, dtype=torch.bool, device=d).tril(), "is not a comparison of positions"),
    (lambda n, d: torch.zeros(n, n, device=d), "not a boolean mask"),
])
def test_a_mask_that_is_not_causal_everywhere_is_not_proven(mask, reason):
    found = _found(mask)
    assert isinstance(found, UnprovenMask)
    assert reason in found.reason


def test_a_mask_read_from_the_batch_is_not_proven():
    def padded(n, device, keep):
        causal = _positions(n, device)[None, None, None, :] <= _positions(n, device)[None, None, :, None]
        return causal & keep[:, None, None, :]

    keep = torch.ones(2, S, dtype=torch.bool)
    found = _found(padded, keep)
    assert isinstance(found, UnprovenMask) and "it reads the input" in found.reason
