import collections
import importlib
import json

import pytest
import torch

import fxmem
from fxmem.analysis import Role, find_lora_linears
from fxmem.analysis.graph import clean_module_path, layer_of, tensor_val
from fxmem.backend import Backend
from fxmem.cost_model.plan import Action
from fxmem.measure import model_tensors, saved_activation_bytes
from fxmem.passes import PassManager
from fxmem.techniques import default_passes
from tests.conftest import tiny_model

LAYERS = 2


def saved_of(report):
    return [s for r in report.regions for s in r.saved if s.frees_memory]


def details(report, role):
    return collections.Counter(s.detail for s in saved_of(report) if s.role is role)


def inspect_tiny(family, **model_options):
    """Inspect a tiny model; every tensor that frees memory must have a role. Returns report, saved, role counts."""
    model, batch = tiny_model(family, **model_options)
    report = fxmem.inspect(model, **batch)
    saved = saved_of(report)
    assert [s for s in saved if s.role is Role.UNKNOWN] == []
    return report, saved, collections.Counter(s.role for s in saved)


def test_llama_lora_sdpa_roles():
    report, saved, roles = inspect_tiny("llama", lora=True)
    assert roles[Role.LORA_INTERMEDIATE] == 7 * LAYERS  # x@A of q,k,v,o,gate,up,down
    assert details(report, Role.ATTN_QKV) == {"q": LAYERS, "k": LAYERS, "v": LAYERS}
    assert details(report, Role.ATTN_OUT) == {"output": LAYERS, "log-sum-exp": LAYERS}
    assert details(report, Role.ACT_INPUT) == {"silu": LAYERS}
    assert roles[Role.PRODUCT_INPUT] == LAYERS  # up_proj's output in silu(gate) * up
    assert details(report, Role.NORM_INPUT)["input (RMSNorm)"] == 2 * LAYERS
    assert roles[Role.LOSS_INPUT] == 1 and roles[Role.ATTN_MASK] == 0  # proven causal: never built (causal_mask)
    # q/k/v share one input, gate/up another: each saved once; down_proj's input too. o_proj's input is the
    # attention output, saved once for both backward uses.
    assert roles[Role.LINEAR_INPUT] == 3 * LAYERS
    assert {s.detail for s in saved if s.role is Role.LINEAR_INPUT} == {"q_proj, k_proj, v_proj",
                                                                        "gate_proj, up_proj", "down_proj"}
    assert all(Role.LINEAR_INPUT in s.also for s in saved if s.detail == "output")
    assert {s.role for _, s, _ in report.rows() if not s.frees_memory} == {Role.PARAMETER}  # embedding is frozen


def test_a_padding_mask_from_the_batch_is_the_attention_mask_and_rebuilt_from_it_in_backward():
    model, batch = tiny_model("llama", lora=True)
    padding = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    backend = Backend(passes=PassManager([p for p in default_passes() if p.name != "recompute_inputs"]))
    torch.compile(model, backend=backend)(**padding).loss.backward()
    assert collections.Counter(s.role for s in saved_of(backend.report()))[Role.ATTN_MASK] == 1
    torch._dynamo.reset()
    report = fxmem.inspect(model, **padding)  # every preset rebuilds it from the batch's mask (recompute_inputs)
    assert collections.Counter(s.role for s in saved_of(report))[Role.ATTN_MASK] == 0


def test_llama_eager_attention_roles():
    report, _, _ = inspect_tiny("llama", lora=True, attn="eager")
    assert details(report, Role.ATTN_PROBS) == {"probabilities": LAYERS}
    assert details(report, Role.ATTN_QKV) == {"q": LAYERS, "k": LAYERS, "v": LAYERS}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_norm_over_each_head_of_q_and_k_is_a_norm_input_that_feeds_attention(attn):
    # Qwen3's q/k norms normalize a per-head view of the projection's output (they were of unknown role, kept whole);
    # their input reaches attention through the norm and RoPE alone, so it is held at qkv_bits as q and k are: rebuilt
    # in backward from the norm's output, stored at qkv_bits before RoPE for q and k (it was stored beside it)
    _, saved, _ = inspect_tiny("qwen3", lora=True, attn=attn)
    per_head = [s for s in saved if s.role is Role.NORM_INPUT and s.reaches_attention]
    assert sorted(s.reaches_attention for s in per_head) == ["k"] * LAYERS + ["q"] * LAYERS
    assert not [s for s in per_head if s.feeds_attention]  # attention reads the norm's output, not them
    assert {s.module.rsplit(".", 1)[-1] for s in per_head} == {"q_proj", "k_proj"}
    torch._dynamo.reset()
    model, batch = tiny_model("qwen3", lora=True, attn=attn)
    plans = {s.name: p for _, s, p in fxmem.inspect(model, **batch, config=fxmem.Config.from_preset(
        "hyclora-2bit"), guard=False).rows()}
    assert all(plans[s.name].action is Action.PRENORM and plans[s.name].bits == 8 for s in per_head)


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_the_input_of_the_q_k_v_projections_reaches_attention_and_takes_qkv_bits(family):
    # the q/k/v projections' LoRA A gradients read their input, and attention's gradient, concentrated on few
    # positions, averages its rounding less than an MLP's does: it is held at qkv_bits (OPT's layer 0 in bf16 went
    # from 0.9947 to 0.9987 worst cosine); through RoPE (Llama), a scaling (OPT), or a fused projection split in three
    # (GPT-2); no other linear input reaches attention without a matmul between
    model, batch = tiny_model(family, lora=True)
    report = fxmem.inspect(model, **batch, config=fxmem.Config(bits=4, qkv_bits=8))
    inputs = [(s, p) for _, s, p in report.rows() if s.nbytes and Role.LINEAR_INPUT in (s.role, *s.also)]
    projected = [(s, p) for s, p in inputs if s.reaches_attention]
    assert len(projected) == LAYERS and {s.reaches_attention for s, _ in projected} <= {"q", "k", "v"}
    assert all(p.action is Action.QUANTIZE and p.bits == 8 for _, p in projected)
    assert all(p.bits == 4 for s, p in inputs if not s.reaches_attention and p.action is Action.QUANTIZE)


def test_bert_roles_with_dropout_and_layer_norm():
    report, _, roles = inspect_tiny("bert", lora=True)
    assert roles[Role.DROPOUT_MASK] >= 3 * LAYERS  # attention probs, attention output, FFN output
    assert details(report, Role.NORM_INPUT)["normalized x̂ (layer_norm)"] == 2 * LAYERS
    assert details(report, Role.ACT_INPUT)["gelu derivative"] == LAYERS
    assert roles[Role.ATTN_PROBS] >= LAYERS
    assert roles[Role.LORA_INTERMEDIATE] == 6 * LAYERS + 1  # 6 per layer, and the classifier's narrow head


def test_gpt2_hand_written_gelu_is_an_activation_input():
    report, _, _ = inspect_tiny("gpt2", lora=True)
    assert details(report, Role.ACT_INPUT) == {"hand-written pointwise": LAYERS}


def test_tensor_saved_to_recompute_takes_the_recomputed_role():
    # Full fine-tuning: min-cut keeps o_proj's output and recomputes the residual sum, the RMSNorm input.
    _, saved, _ = inspect_tiny("llama", lora=False)
    recomputing = [s for s in saved if s.detail.startswith("recomputes")]
    assert recomputing and all(s.role is Role.NORM_INPUT for s in recomputing)


@pytest.mark.parametrize("family", ["llama", "bert", "gpt2"])
def test_predicted_bytes_equal_measured_compiled_bytes(family):
    model, batch = tiny_model(family, lora=True)
    predicted = fxmem.inspect(model, **batch).activation_bytes
    torch._dynamo.reset()
    backend = fxmem.backend()
    compiled = torch.compile(model, backend=backend)
    measured, loss = saved_activation_bytes(lambda: compiled(**batch).loss,
                                            exclude=model_tensors(model) + list(batch.values()))
    loss.backward()
    assert backend.report().activation_bytes == predicted
    assert abs(measured - predicted) <= 0.01 * measured


def _fw_graph_and_params(monkeypatch, model, batch):
    """The partitioned forward graph and its parameter placeholders, as fxmem's analysis receives them."""
    captured = {}
    pipeline = importlib.import_module("fxmem.pipeline")
    analyze = pipeline.analyze

    def capture(fw, bw, num_fwd_outputs, static_input_indices):
        placeholders = list(fw.graph.find_nodes(op="placeholder"))
        captured["graph"] = fw.graph
        captured["params"] = frozenset(placeholders[i] for i in static_input_indices)
        return analyze(fw, bw, num_fwd_outputs, static_input_indices)

    monkeypatch.setattr(pipeline, "analyze", capture)
    fxmem.inspect(model, **batch)
    return captured["graph"], captured["params"]


def test_lora_matcher_finds_peft_linears_with_their_scaling(monkeypatch):
    model, batch = tiny_model("llama", lora=True)  # r=8, alpha=32
    loras = find_lora_linears(*_fw_graph_and_params(monkeypatch, model, batch))
    assert len(loras) == 7 * LAYERS
    assert {(lora.rank, lora.scaling, lora.dropout) for lora in loras} == {(8, 4.0, False)}
    assert {lora.module.rsplit(".", 1)[-1] for lora in loras} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"}


def test_lora_matcher_reads_a_cast_of_x_as_x_itself(monkeypatch):
    # PEFT on a bf16 model keeps its adapters in fp32 and casts x up for them: not a dropout branch.
    model, batch = tiny_model("llama", lora=True, dtype=torch.bfloat16)
    loras = find_lora_linears(*_fw_graph_and_params(monkeypatch, model, batch))
    assert len(loras) == 7 * LAYERS and not any(lora.dropout for lora in loras)
    assert {(tensor_val(lora.base).dtype, tensor_val(lora.xa).dtype) for lora in loras} == {
        (torch.bfloat16, torch.float32)}
    torch._dynamo.reset()
    model, batch = tiny_model("llama", lora=True, dtype=torch.bfloat16, lora_dropout=0.1)  # a cast, then dropout
    loras = find_lora_linears(*_fw_graph_and_params(monkeypatch, model, batch))
    assert len(loras) == 7 * LAYERS and all(lora.dropout for lora in loras)


def test_lora_matcher_sees_the_dropout_branch(monkeypatch):
    model, batch = tiny_model("llama", lora=True, lora_dropout=0.1)
    loras = find_lora_linears(*_fw_graph_and_params(monkeypatch, model, batch))
    assert len(loras) == 7 * LAYERS and all(lora.dropout for lora in loras)


class HandWrittenLora(torch.nn.Module):
    """LoRA written by hand, no PEFT: the matcher works on structure, not on module names."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(32, 48)
        self.frozen.requires_grad_(False)
        self.down = torch.nn.Parameter(torch.randn(4, 32) / 8)
        self.up = torch.nn.Parameter(torch.randn(48, 4) / 8)

    def forward(self, x):
        y = self.frozen(x) + 0.5 * ((x @ self.down.T) @ self.up.T)
        return torch.nn.functional.gelu(y).square().mean()


def test_lora_matcher_finds_a_hand_written_lora(monkeypatch):
    torch.manual_seed(0)
    graph, params = _fw_graph_and_params(monkeypatch, HandWrittenLora(), {"x": torch.randn(3, 5, 32)})
    [lora] = find_lora_linears(graph, params)
    assert (lora.rank, lora.scaling, lora.dropout) == (4, 0.5, False)


def test_plain_matmul_chain_is_not_a_lora(monkeypatch):
    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 4), torch.nn.Linear(4, 32)

        def forward(self, x):
            return torch.tanh(self.b(self.a(x))).sum()

    graph, params = _fw_graph_and_params(monkeypatch, TwoLinears(), {"x": torch.randn(6, 32)})
    assert find_lora_linears(graph, params) == []


def test_report_totals_and_json_agree():
    model, batch = tiny_model("llama", lora=True)
    report = fxmem.inspect(model, **batch)
    data = json.loads(report.to_json())
    assert data["activation_bytes"] == report.activation_bytes == report.planned_bytes > 0
    assert sum(e["bytes"] for e in data["by_role"].values()) == report.activation_bytes
    assert sum(e["bytes"] for e in data["by_layer"].values()) == report.activation_bytes
    assert {f"base_model.model.model.layers.{i}" for i in range(LAYERS)} <= set(data["by_layer"])
    saved = data["regions"][0]["saved"]
    assert all(s["plan"]["action"] == "keep" and s["planned_bytes"] == s["nbytes"] for s in saved)
    assert {"role", "producer", "backward_consumers", "module", "shape", "dtype", "nbytes"} <= set(saved[0])
    text = report.table()
    assert "lora_intermediate" in text and "By role" in text and "By layer" in text
    assert "parameter" not in text.split("By role")[0]  # parameters are listed only with include_all
    assert "primals" in report.table(include_all=True).split("By role")[0]


def test_module_paths_are_cleaned():
    raw = "L['self'].__dict__['_modules']['base_model'].__dict__['_modules']['model'].model.layers.3.mlp.up_proj"
    assert clean_module_path(raw) == "base_model.model.model.layers.3.mlp.up_proj"
    assert layer_of("base_model.model.model.layers.3.mlp.up_proj") == "base_model.model.model.layers.3"
    assert layer_of("model.norm") == ""


def test_rope_tables_are_recognised_through_scale_cast_and_expand():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxmem.analysis.roles import rope_trig

    def rotary(positions, inv_freq, x):
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * 1.5).to(torch.float32).unsqueeze(0).expand(2, -1, -1)
        sin = emb.sin().unsqueeze(0)
        return x * cos + torch.tanh(x) * sin

    graph = make_fx(rotary)(torch.arange(8.0), torch.rand(4), torch.randn(2, 8, 8)).graph
    by_name = {n.name: n for n in graph.nodes}
    multiplications = [n for n in graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    tables = {rope_trig(n.args[1]) for n in multiplications if n.args[0].name.startswith("x")}
    assert tables == {"cos"}
    assert rope_trig(by_name["tanh"]) is None
    assert {rope_trig(n.args[1]) for n in multiplications if n.args[0].target is torch.ops.aten.tanh.default} \
        == {"sin"}
