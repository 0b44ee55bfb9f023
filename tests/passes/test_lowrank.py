"""The loract preset end to end: what is stored as factors, the bytes it frees (exact), and the gradients it gives."""

import pytest
import torch

import fxmem
from fxmem.analysis import Role
from fxmem.cost_model import options
from fxmem.cost_model.plan import Action
from fxmem.measure import gradient_fidelity
from tests.conftest import compiled_step, randomize_lora_b, tiny_model, train_at_sequence_lengths


def _llama(seq: int = 64, **kwargs):
    """The tiny Llama on 2 x ``seq`` tokens: enough rows (128) that rank-k factors of a 64-wide tensor shrink it."""
    model, _ = tiny_model("llama", lora=True, **kwargs)
    randomize_lora_b(model)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(3))
    return model, {"input_ids": ids, "labels": ids}


def _no_byte_limit(monkeypatch):
    """Every candidate 'shrinks' the tensor: full-rank factors get planned, so the rebuild itself is what is tested."""
    monkeypatch.setattr(options, "lowrank_bytes", lambda shape, rank, element_size: 2)
    monkeypatch.setattr(options, "prenorm_bytes", lambda rows, exact, element_size: 1)


def _exact(model, batch):
    return compiled_step(model, batch, fxmem.Backend(lowering="eager"))


def _rebuilt_at_full_rank_as_exact(model, batch, formula: str, count: int = 3) -> None:
    """At full rank (the factors hold every tensor whole), ``count`` norm inputs rebuilt by ``formula`` give exact
    fxmem's gradients."""
    _, _, exact_grads = _exact(model, batch)
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(lowrank=10_000), lowering="eager")  # clamped to the full width
    _, _, grads = compiled_step(model, batch, backend)
    shared = [p for _, s, p in backend.report().rows() if p.action is Action.PRENORM and s.nbytes > 0]
    assert len(shared) == count and all(p.reason.startswith(f"rebuilt as {formula}") for p in shared)
    for name, grad in exact_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)


def _passes(backend):
    records = [p for r in backend.regions for p in r.passes]
    assert not [p for p in records if p.error], "a pass failed and was rolled back"
    return {p.name: p.note for p in records}


def test_loract_saves_what_the_plan_says_and_gradients_stay_close():
    model, batch = _llama()
    exact_saved, exact_loss, exact_grads = _exact(model, batch)
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(lowrank=0.25), lowering="eager")  # the technique alone: q, k, v factored
    saved, loss, grads = compiled_step(model, batch, backend)
    report = backend.report()
    assert saved == report.planned_bytes  # U and V at the planned rank, exact channel columns and ids
    assert saved < 0.5 * exact_saved  # LoRA x@A, the final norm's input and small statistics stay as they are
    passes = _passes(backend)
    assert passes["recompute_logits"].startswith("1 logits tensor")  # recomputed, not saved
    # its output is not saved
    assert passes["recompute_attention"].startswith("2 attention op(s) recomputed in backward (about ")
    assert torch.equal(loss, exact_loss)  # the forward is untouched
    # Random weights and random tokens give activations far from low rank (the worst gradient, layer 0's q_proj
    # LoRA A, reads rank-16 factors of 128 near-random embeddings: cosine 0.63). Checked by hand: a rebuild
    # shifted by one row gives min cosine -0.23, one at half scale a median relative error of 0.52.
    fidelity = gradient_fidelity(exact_grads, grads)
    assert fidelity.min_cosine > 0.5 and fidelity.median_relative_error < 0.2, fidelity
    rows = [(s, p) for _, s, p in report.rows() if s.nbytes > 0]
    # Norm inputs are rebuilt from their output's factors (below), or kept exact: the final norm's, which the
    # logits are recomputed from.
    assert {s.role for s, p in rows if p.action is Action.LOWRANK} == {Role.LINEAR_INPUT, Role.ACT_INPUT,
                                                                   Role.PRODUCT_INPUT, Role.ATTN_QKV}
    for saved_tensor, plan in rows:
        if plan.action is Action.LOWRANK:  # q, k, v as (rows, hidden): the rank is a share of the hidden size, 64
            width = 64 if saved_tensor.role is Role.ATTN_QKV else saved_tensor.shape[-1]
            assert plan.rank == width // 4 and plan.nbytes < saved_tensor.nbytes
        if saved_tensor.role in (Role.LORA_INTERMEDIATE, Role.SMALL, Role.LOSS_INPUT):
            assert plan.action is Action.KEEP
        assert saved_tensor.role is not Role.ATTN_OUT  # recomputed with attention in backward
    # q and k are factored before RoPE, which backward replays; v is a view of its projection's output
    qkv = [(s, p) for s, p in rows if s.role is Role.ATTN_QKV]
    assert sorted(getattr(p, "source", None) is not None for _, p in qkv) == [False] * 2 + [True] * 4
    assert all("rotation replayed in backward" in p.reason for _, p in qkv if getattr(p, "source", None) is not None)
    # Both layers' post-attention norms and layer 1's input norm (layer 0's gets no gradient: embeddings frozen)
    shared = [(s, p) for s, p in rows if p.action is Action.PRENORM]
    assert len(shared) == 3 and all(s.role is Role.NORM_INPUT and p.exact_channels == 1 for s, p in shared)
    assert all(p.nbytes == 128 * 1 * 4 + 8 for _, p in shared)  # 128 rows x 1 exact fp32 channel + its id
    assert passes["lowrank"] == "16 storage(s) stored as low-rank factors; 3 norm input(s) rebuilt " \
                                "from their output's factors"


def test_without_prenorm_sharing_norm_inputs_get_their_own_factors():
    model, batch = _llama()
    backend = fxmem.Backend(fxmem.Config(lowrank=0.25, prenorm_sharing=False), lowering="eager")
    saved, _, _ = compiled_step(model, batch, backend)
    rows = [(s, p) for _, s, p in backend.report().rows() if s.nbytes > 0]
    assert saved == backend.report().planned_bytes
    assert not [p for _, p in rows if p.action is Action.PRENORM]
    # the three norm inputs above, each its own 128 x 64 matrix at rank 16
    norms = [p for s, p in rows if s.role is Role.NORM_INPUT and p.action is Action.LOWRANK]
    assert len(norms) == 3 and all(p.rank == 16 for p in norms)
    assert _passes(backend)["lowrank"] == "19 storage(s) stored as low-rank factors"


def test_gqa_repeat_of_k_and_v_is_undone_and_replayed_in_backward(monkeypatch):
    """GQA's k and v reach attention repeated per query head (expand + clone) where HF passes a mask (here a
    padding mask: gqa_attention reads each head once only without one): the projection's output before the repeat
    (and RoPE) is what gets compressed, n_rep times smaller; at full rank the gradients are torch's."""
    model, batch = _llama(seq=16, kv_heads=2)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][0, 0] = 0
    _, _, exact_grads = _exact(model, batch)
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(bits=8), lowering="eager")
    saved, _, grads = compiled_step(model, batch, backend)
    assert saved == backend.report().planned_bytes
    for _, tensor, plan in backend.report().rows():
        if tensor.role is Role.ATTN_QKV and tensor.detail in ("k", "v") and tensor.nbytes > 0:
            assert plan.reason.endswith("repeat (expand + clone) replayed in backward") and plan.nbytes < tensor.nbytes / 2 / 2
    assert gradient_fidelity(exact_grads, grads).min_cosine > 0.99
    _no_byte_limit(monkeypatch)
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(lowrank=10_000), lowering="eager")
    _, _, grads = compiled_step(model, batch, backend)
    reasons = [p.reason for _, s, p in backend.report().rows() if s.role is Role.ATTN_QKV and s.nbytes > 0]
    assert len(reasons) == 6 and sum("rotation and repeat (expand + clone) replayed" in r for r in reasons) == 2  # k
    for name, grad in exact_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)


def test_per_head_copies_are_not_factored_and_q_k_v_keep_their_qkv_bits(monkeypatch):
    """GPT-2 copies q, k, v per head, (batch x heads, seq, head dim): factors of the head width would share one small
    subspace across all heads, so those are left as they are. (v's copy is of a split of the fused projection,
    which the rewrite cannot replay: it is not traced back.)"""
    model, batch = tiny_model("gpt2", lora=True)
    _no_byte_limit(monkeypatch)
    backend = fxmem.Backend(fxmem.Config(lowrank=0.25), lowering="eager")
    compiled_step(model, batch, backend)
    qkv = [(s.detail, p) for _, s, p in backend.report().rows() if s.role is Role.ATTN_QKV and s.nbytes > 0]
    assert sorted(d for d, _ in qkv) == ["k", "k", "q", "q", "v", "v"]
    assert all(p.reason.startswith("per-head layout (128 x 16)") for _, p in qkv), qkv
    monkeypatch.undo()
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(bits=8), lowering="eager")  # quantizing per channel suits these copies
    compiled_step(model, batch, backend)
    # (or backward rebuilds them element-wise from the projection's saved output, cheaper still)
    actions = [p.action for _, s, p in backend.report().rows() if s.role is Role.ATTN_QKV and s.nbytes > 0]
    assert "quantize" in actions and set(actions) <= {"quantize", "recompute"}, actions
    # with bits on, q, k and v stay quantized at qkv_bits even where rank-8 factors would take fewer bytes
    model, batch = _llama(kv_heads=2)
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(bits=4, lowrank=0.125), lowering="eager")
    compiled_step(model, batch, backend)
    plans = [(s.detail, p) for _, s, p in backend.report().rows() if s.role is Role.ATTN_QKV and s.nbytes > 0]
    assert {getattr(p, "bits", None) for d, p in plans} == {8} and {d for d, _ in plans} == {"q", "k", "v"}
    assert all(p.action is Action.QUANTIZE for _, p in plans)


class TwoLinears(torch.nn.Module):
    """second saves first's output (its input, a 128 x 64 matrix for a 4 x 32 x 64 x) for its weight's gradient."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(64, 64, bias=False).requires_grad_(False)
        self.second = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.second(self.first(x)).square().mean()


def test_an_exactly_low_rank_activation_is_rebuilt_exactly():
    torch.manual_seed(0)
    model = TwoLinears()
    x = torch.randn(4, 32, 5) @ torch.randn(5, 64)  # rank 5: first(x), what second saves, is rank 5 too
    model(x).backward()
    expected = model.second.weight.grad.clone()
    model.zero_grad()
    backend = fxmem.Backend(fxmem.Config(lowrank=8), lowering="eager")
    torch.compile(model, backend=backend)(x).backward()
    plans = [p for _, s, p in backend.report().rows() if s.role is Role.LINEAR_INPUT]
    assert [p.action for p in plans] == ["lowrank"] and plans[0].rank == 8
    torch.testing.assert_close(model.second.weight.grad, expected, rtol=1e-4, atol=1e-5)


def test_a_tensor_whose_factors_would_not_shrink_it_is_kept_and_the_report_says_why():
    torch.manual_seed(0)
    model = TwoLinears()
    backend = fxmem.Backend(fxmem.Config(lowrank=0.9), lowering="eager")
    torch.compile(model, backend=backend)(torch.randn(4, 32, 64)).backward()
    [plan] = [p for _, s, p in backend.report().rows() if s.role is Role.LINEAR_INPUT]
    # rank floor(0.9 * 64) = 57: (128 + 64) x 57 x 4 bytes against 128 x 64 x 4
    assert plan.action is Action.KEEP and plan.reason == "rank-57 factors would not shrink it (43776 >= 32768 bytes)"
    assert "lowrank" not in _passes(backend) or _passes(backend)["lowrank"] == ""


@pytest.mark.parametrize("zero_gammas", [0, 1])
def test_full_rank_rebuild_and_pre_norm_sharing_give_the_exact_gradients(zero_gammas, monkeypatch):
    """At full rank the factors hold the tensors whole: every rebuilt input, including the norm inputs rebuilt
    as output / gamma / rstd and their gamma == 0 channels (saved exactly), must give torch's gradients."""
    _no_byte_limit(monkeypatch)
    model, batch = _llama(seq=16)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            layer.post_attention_layernorm.weight[5:5 + zero_gammas] = 0
            layer.input_layernorm.weight[7:7 + zero_gammas] = 0
    _, _, exact_grads = _exact(model, batch)
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(lowrank=10_000), lowering="eager")  # clamped to the full width
    _, _, grads = compiled_step(model, batch, backend)
    assert _passes(backend)["lowrank"] == "16 storage(s) stored as low-rank factors; 3 norm input(s) rebuilt " \
                                          "from their output's factors"
    for name, grad in exact_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)


def test_gemma_norm_inputs_scaled_by_one_plus_weight_are_rebuilt_to_torch_gradients(monkeypatch):
    """Gemma's RMSNorm scales by 1 + weight, a scale the graph computes (not a graph input): at full rank its inputs
    rebuilt as output / (1 + weight) / rstd, with a channel where 1 + weight == 0, give torch's gradients."""
    _no_byte_limit(monkeypatch)
    model, batch = tiny_model("gemma", lora=True)
    randomize_lora_b(model)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            layer.input_layernorm.weight[3] = -1
    _rebuilt_at_full_rank_as_exact(model, batch, "output / gamma / rstd")


def test_layer_norm_x_hat_is_rebuilt_from_the_output_minus_beta_over_gamma(monkeypatch):
    """GPT-2's decomposed LayerNorm saves x_hat; at full rank, rebuilt as (output - beta) / gamma with a gamma == 0
    channel, the gradients are torch's. Dropout off: the decomposition draws random rows, which would shift the
    dropout masks between the two runs."""
    _no_byte_limit(monkeypatch)
    model, batch = tiny_model("gpt2", lora=True)
    randomize_lora_b(model)
    with torch.no_grad():
        for block in model.base_model.model.transformer.h:
            block.ln_1.weight[3] = 0
            block.ln_2.bias.normal_()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    _rebuilt_at_full_rank_as_exact(model, batch, "(output - beta) / gamma")


def test_a_half_precision_layer_norms_input_is_rebuilt_from_its_output_adding_back_the_mean():
    """In bf16 GPT-2's LayerNorms upcast inside the norm and their backward saves x itself, with mean and rstd: at
    full rank its inputs rebuilt as (output - beta) / gamma / rstd + mean give the gradients of exact fxmem to the
    rounding of the bf16 output they are rebuilt from."""
    model, batch = tiny_model("gpt2", lora=True, dtype=torch.bfloat16)
    randomize_lora_b(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    _, _, exact_grads = _exact(model, batch)
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(bits=8, lora_reorder=True, rebuild_from_x=True), lowering="eager")
    saved, _, grads = compiled_step(model, batch, backend)
    shared = [p for _, s, p in backend.report().rows() if p.action is Action.PRENORM and s.nbytes > 0]
    assert len(shared) == 3 and all(p.reason.startswith("rebuilt as (output - beta) / gamma / rstd + mean")
                                    for p in shared)
    assert saved == backend.report().planned_bytes
    assert gradient_fidelity(exact_grads, grads).min_cosine > 0.999


def test_a_layer_norm_over_rows_flattened_from_the_residual_has_its_input_rebuilt():
    """OPT flattens the residual to rows before its MLP's LayerNorm, which then reads a reshape of the saved storage:
    in bf16 that input (x itself) is rebuilt from the output and reshaped back (it was stored at 4 bits), within
    0.999 of exact fxmem's gradients and with the bytes planned."""
    model, batch = tiny_model("opt", lora=True, dtype=torch.bfloat16)
    randomize_lora_b(model)
    _, _, exact_grads = _exact(model, batch)
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(bits=8, lora_reorder=True, rebuild_from_x=True), lowering="eager")
    saved, _, grads = compiled_step(model, batch, backend)
    norms = [(s, p) for _, s, p in backend.report().rows() if s.role is Role.NORM_INPUT and s.nbytes
             and p.reason != "kept exact: loss_input"]
    assert len(norms) == 3 and all(s.name != s.storage for s, _ in norms)  # each a view of its storage
    assert all(p.action is Action.PRENORM for _, p in norms)
    assert saved == backend.report().planned_bytes
    assert gradient_fidelity(exact_grads, grads).min_cosine > 0.999


def test_under_autocast_norm_inputs_are_rebuilt_from_the_cast_their_linears_read():
    """autocast casts a float32 model's norm output to bf16 before its linears: the norm's input is rebuilt from
    that cast's codes as in a plain model (it was stored at 4 bits), the gradients within the preset's bound."""
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)

    def gradients(forward):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(**batch).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return grads

    reference = gradients(model)
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-4bit"), lowering="eager")
    grads = gradients(torch.compile(model, backend=backend))
    norms = [p for _, s, p in backend.report().rows() if s.role is Role.NORM_INPUT and s.nbytes
             and p.reason != "kept exact: loss_input"]
    assert len(norms) == 3 and all(p.action is Action.PRENORM for p in norms)
    assert gradient_fidelity(reference, grads).min_cosine > 0.995


def test_with_bits_and_lowrank_each_tensor_gets_the_plan_with_fewer_bytes():
    model, batch = _llama()
    plans = {}
    for config in (fxmem.Config(bits=8), fxmem.Config(lowrank=0.125), fxmem.Config(bits=8, lowrank=0.125)):
        torch._dynamo.reset()
        backend = fxmem.Backend(config, lowering="eager")
        compiled_step(model, batch, backend)
        plans[config] = {s.name: (s, p) for _, s, p in backend.report().rows() if s.nbytes > 0}
    quantized, factored, both = ({name: p for name, (_, p) in by_name.items()} for by_name in plans.values())
    assert {p.action for p in both.values()} >= {"quantize", "lowrank"}
    for name, plan in both.items():
        if name not in quantized or name not in factored:  # saved under one of the configs only
            continue
        options = [p for p in (quantized[name], factored[name]) if p.action is not Action.KEEP]
        saved_tensor = plans[fxmem.Config(bits=8, lowrank=0.125)][name][0]
        if saved_tensor.role is Role.ATTN_QKV:
            assert plan == quantized[name], name  # at qkv_bits, never factored
        elif plan.action in (Action.QUANTIZE, Action.LOWRANK):
            assert plan.nbytes == min(p.nbytes for p in options), name
        elif plan.action is Action.KEEP:  # the final norm's input: the logits are recomputed from it
            assert not options or plan.reason == "kept exact: loss_input", name


def test_the_loract_preset_stores_attention_inputs_at_8_bits_and_factors_the_rest():
    model, batch = _llama()
    backend = fxmem.Backend(fxmem.Config.from_preset("loract"), lowering="eager")  # rank 8 of 64: factors win
    compiled_step(model, batch, backend)
    rows = [(s, p) for _, s, p in backend.report().rows() if s.nbytes > 0]
    qkv = [p for s, p in rows if s.role is Role.ATTN_QKV]
    assert qkv and {(p.action, getattr(p, "bits", None)) for p in qkv} == {("quantize", 8)}
    # the rest: whichever of factors and 8-bit codes is smaller (the 64-wide linear inputs: factors)
    assert {p.action for s, p in rows if s.role is Role.LINEAR_INPUT and s.shape[-1] == 64} == {"lowrank"}


def test_varying_sequence_lengths_train_with_rows_fewer_than_the_rank():
    model, _ = tiny_model("llama", lora=True)
    backend = fxmem.Backend(fxmem.Config.from_preset("loract"), lowering="eager")
    # seq 3: 6 rows, below rank 8: factors padded with zeros
    train_at_sequence_lengths(torch.compile(model, backend=backend), model, (16, 24, 3))
    assert len(backend.regions) == 2 and "low-rank factors" in _passes(backend)["lowrank"]


def test_inductor_lowering_compiles_the_rewrite_and_matches_the_eager_lowering():
    model, batch = _llama()
    results = []
    for lowering in ("eager", "inductor"):
        torch._dynamo.reset()
        backend = fxmem.Backend(fxmem.Config(lowrank=0.25), lowering=lowering)
        results.append(compiled_step(model, batch, backend))
        assert "3 norm input(s) rebuilt" in _passes(backend)["lowrank"]
        assert not [n for r in backend.regions for n in r.notes], "inductor fell back to running aten ops"
    (saved_e, loss_e, grads_e), (saved_i, loss_i, grads_i) = results
    assert saved_e == saved_i
    torch.testing.assert_close(loss_i, loss_e, rtol=1e-5, atol=1e-6)
    assert gradient_fidelity(grads_e, grads_i).min_cosine > 0.999  # the same row samples: _run seeds each step
