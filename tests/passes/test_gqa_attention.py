import functools
import json

import pytest
import torch
from torch.nn.attention import SDPBackend

import fxmem
from fxmem.analysis.roles import Role
from fxmem.passes.dynamo import gqa_attention
from fxmem.passes.dynamo.gqa_attention import fused_gqa_backend
from fxmem.region import Region
from fxmem.whatif import hf_config, traced_activation_bytes
from tests.conftest import assert_matches_eager, loss_and_grads, pass_summary, randomize_lora_b, tiny_model
from tests.test_whatif import TINY

_summary = functools.partial(pass_summary, name="gqa_attention")


def test_gqa_attention_reads_each_head_once_with_the_gradients_of_eager():
    model, batch = tiny_model("llama", lora=True, kv_heads=2)
    randomize_lora_b(model)
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact")
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    assert _summary(backend) == ("2 attention call(s) read each key and value head once with enable_gqa "
                                 "(flash_attention), not 2 copies of it")
    assert_matches_eager(reference, loss, grads)


def test_attention_saves_the_key_and_value_heads_not_their_copies():
    model, batch = tiny_model("llama", lora=True, layers=1, kv_heads=1)
    [region] = fxmem.inspect(model, **batch, config=fxmem.Config()).regions
    shapes = {s.detail: s.shape for s in region.saved if s.role is Role.ATTN_QKV and s.nbytes}
    # (batch, heads, tokens, head size): q has 4 heads, k and v their one (torch's min-cut saved the heads too,
    # before the copies, and copied them again in backward)
    assert shapes == {"q": (2, 4, 16, 16), "k": (2, 1, 16, 16), "v": (2, 1, 16, 16)}


def test_a_recomputed_gqa_block_holds_less_at_its_peak(tmp_path, monkeypatch):
    # traced on fake tensors as whatif traces: backward makes neither the copies nor their gradients. Counted in the
    # graphs' own order with the saved tensors held (the eager lowering), where the copies are at the peak; as
    # inductor runs it the peak of this block is elsewhere
    monkeypatch.setattr(Region, "compiled_transient_bytes", property(lambda region: region.transient_bytes))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
                                "num_key_value_heads": 2}))
    config = fxmem.Config(return_logits=False, mlp_chunk=256, norm_chunk=256, block_checkpoint=True)

    def traced():
        return traced_activation_bytes(hf_config(str(path)), layers=2, rank=8, dtype=torch.bfloat16, batch=1,
                                       seq=4096, preset=config)

    with_pass = traced()
    monkeypatch.setattr(gqa_attention, "find_repeated_heads_attention", lambda graph: [])
    without = traced()
    hidden_wide = 4096 * 256 * 2
    assert with_pass.saved == without.saved
    assert without.transient - with_pass.transient >= 1.4 * hidden_wide  # measured: 1.5


def test_a_padding_mask_keeps_the_copies():
    # SDPA's flash kernel on a GPU refuses an explicit mask, and HF repeats the heads only where it passes one
    model, batch = tiny_model("llama", lora=True, layers=1, kv_heads=2)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][0, 0] = 0
    backend = fxmem.backend("exact")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    assert _summary(backend) == "no attention with repeated key and value heads (and no mask)"


def test_without_a_fused_kernel_for_it_the_copies_stay(monkeypatch):
    # torch's math kernel would build the tokens x tokens scores: worse than the copies
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *args, **kwargs: SDPBackend.MATH.value)
    model, batch = tiny_model("llama", lora=True, layers=1, kv_heads=2)
    backend = fxmem.backend("exact")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    assert _summary(backend) == ("1 attention call(s) keep their repeated key and value heads: SDPA has no fused "
                                 "kernel with enable_gqa for their device, dtype and head size")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_runs_grouped_heads_in_its_flash_kernel(dtype):
    query, key = torch.empty(1, 8, 64, 64, dtype=dtype), torch.empty(1, 2, 64, 64, dtype=dtype)
    assert fused_gqa_backend(query, key, 0.0, True) == "flash_attention"
