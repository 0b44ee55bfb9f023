"""Mixture-of-experts routers: the scores a top-k chooses experts from are a router's, kept exact."""

import torch

import fxmem
from fxmem.analysis import Role
from fxmem.cost_model.plan import Action
from fxmem.measure import gradient_fidelity
from tests.conftest import compiled_step, randomize_lora_b, tiny_model


def test_a_routers_scores_are_kept_exact_where_attention_probabilities_would_be_pruned():
    # The router's softmax was read as eager attention's probabilities, and attn_sparsity kept the largest quarter
    # of each row (one of 4 experts): backward then saw other routing scores than forward chose from (router LoRA
    # cosine 0.636 here before). Its scores and the chosen weights are the router's now, kept exact.
    model, batch = tiny_model("mixtral", lora=True, layers=1)
    randomize_lora_b(model)
    _, _, exact = compiled_step(model, batch, fxmem.Backend(lowering="eager"))
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-4bit", attn_sparsity=0.25), lowering="eager")
    _, _, grads = compiled_step(model, batch, backend)
    rows = [(s, p) for _, s, p in backend.report().rows() if s.nbytes]
    routers = [(s, p) for s, p in rows if s.role is Role.ROUTER]
    assert {s.detail for s, _ in routers} == {"scores a top-k chooses from", "the chosen experts' weights"}
    assert all(p.action is Action.KEEP and p.reason == "kept exact: router" for _, p in routers)
    assert not [s for s, _ in rows if s.role is Role.ATTN_PROBS]  # the model's attention is fused (sdpa)
    router_grads = [name for name in exact if ".mlp.gate." in name]
    assert len(router_grads) == 2  # the router's LoRA A and B
    assert gradient_fidelity({n: exact[n] for n in router_grads}, {n: grads[n] for n in router_grads}).min_cosine > 0.999


def test_the_experts_input_is_a_linear_input():
    # The experts read their routed rows through a grouped matmul: role unknown before, kept whole by every preset.
    model, batch = tiny_model("mixtral", lora=True, layers=1)
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-4bit"), lowering="eager")
    compiled_step(model, batch, backend)
    inputs = {(s.detail, s.shape): p.action for _, s, p in backend.report().rows()
              if s.nbytes and s.role is Role.LINEAR_INPUT}
    assert inputs["experts", (64, 64)] != "keep"  # 2 x 16 tokens, each routed to 2 experts
