import pytest
import torch

from fxmem.analysis.rms_norm import find_rms_norms
from tests.analysis.test_mask import _dynamo_graph


class _LlamaNorm(torch.nn.Module):
    """LlamaRMSNorm's forward, with a variant switch."""

    def __init__(self, variant: str = "llama"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))
        self.variant = variant

    def forward(self, x):
        upcast = x.to(torch.float32)
        variance = upcast.pow(2).mean(-1, keepdim=True)
        normalized = upcast * torch.rsqrt(variance + 1e-5)
        if self.variant == "gemma":  # Gemma's scale: 1 + weight, in float32
            return (normalized * (1.0 + self.weight.float())).to(x.dtype)
        if self.variant == "upcast read elsewhere":
            return self.weight * normalized.to(x.dtype) + upcast.to(x.dtype)
        return self.weight * normalized.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llamas_norm_is_found_with_its_epsilon_and_width(dtype):
    [norm] = find_rms_norms(_dynamo_graph(_LlamaNorm(), torch.randn(2, 5, 8).to(dtype)).graph)
    assert (norm.eps, norm.tokens, norm.hidden, norm.element_size) == (1e-5, 10, 8, dtype.itemsize)
    assert norm.weight.op == "placeholder" and norm.x.op == "placeholder"


@pytest.mark.parametrize("variant, shape", [("gemma", (2, 5, 8)), ("upcast read elsewhere", (2, 5, 8)),
                                            ("llama", (2, 5, 3, 8))])
def test_other_norms_are_not_matched(variant, shape):
    # the chunked op would make neither Gemma's scale nor a second reader's upcast; a norm over each head (Qwen3's
    # q_norm, x of (batch, tokens, heads, head size)) would be chunked by heads, not tokens
    assert find_rms_norms(_dynamo_graph(_LlamaNorm(variant), torch.randn(*shape)).graph) == []
