"""recompute_attention on eager attention: the probabilities rebuilt in backward from q and k, never saved and never
pruned by a fixed count a row."""

import torch

import fxmem
from fxmem.analysis import Role
from fxmem.analysis.eager_attention import eager_attention_chains
from fxmem.cost_model.plan import Action
from fxmem.measure import gradient_fidelity
from fxmem.passes import GraphPass, PassManager, PassResult
from tests.conftest import loss_and_grads, pass_summary, randomize_lora_b, tiny_model
from tests.models import text_batch

SEQ = 64


def _gemma2():
    """A Gemma-2-like model as its fine-tunes run: eager attention (soft-capped scores), a sliding window shorter than
    the batch, PEFT LoRA on every linear with B past its zero init, a batch of real text as bytes."""
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=256, sliding_window=16, query_pre_attn_scalar=16, attn_implementation="eager",
        use_cache=False))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    randomize_lora_b(model)
    return model.train(), text_batch(2, SEQ)


def test_soft_capped_sliding_window_attention_keeps_the_gradient_and_saves_no_probabilities_or_logits():
    model, batch = _gemma2()
    _, reference = loss_and_grads(model, model, batch)
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-4bit"), lowering="eager")
    _, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    rows = backend.report().rows()
    roles = {s.role for _, s, _ in rows if s.frees_memory}
    assert Role.ATTN_PROBS not in roles  # nothing tokens x tokens is saved
    # q and k, what the probabilities are rebuilt from, planned as q and k (through the soft-capping's tanh)
    assert {s.detail for _, s, p in rows if p.action is Action.QUANTIZE and "rebuilt for" in s.detail} >= {
        "output rebuilt for q", "output rebuilt for k"}
    assert Role.UNKNOWN not in roles
    # the soft-capped logits (tanh(logits / 30) * 30) recomputed from the final norm's output, not saved
    assert Role.LOSS_INPUT not in roles or all(s.nbytes < 4096 for _, s, _ in rows if s.role is Role.LOSS_INPUT)
    assert "2 eager attention probabilities rebuilt in backward from q and k" in pass_summary(
        backend, "recompute_attention")
    assert pass_summary(backend, "recompute_logits").startswith("1 logits tensor")
    # 5% of each row's values kept, HyC-LoRA's pruning and this preset's before, gave -0.06 here; what is left is
    # the 4-bit linear inputs' error (a Llama of this size: 0.9968)
    assert gradient_fidelity(reference, grads).min_cosine >= 0.99


def test_attn_sparsity_set_keeps_the_probabilities_for_it_to_prune_and_says_the_mass_is_unbounded():
    model, batch = tiny_model("llama", lora=True, attn="eager")
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-4bit", attn_sparsity=0.25), lowering="eager")
    loss_and_grads(torch.compile(model, backend=backend), model, batch)
    plans = [p for _, s, p in backend.report().rows() if s.role is Role.ATTN_PROBS]
    assert [p.action for p in plans] == ["sparsify", "sparsify"]
    assert all("the probability mass each row drops is not bounded" in p.reason for p in plans)


def _joint_graph(model, batch):
    """The joint forward-backward graph AOTAutograd traces for ``model`` (torch.compile, eager lowering)."""
    graphs = []

    class Capture(GraphPass):
        name = "capture_joint"
        stage = "joint"

        def run(self, state):
            graphs.append(state.joint.graph)
            return PassResult(False)

    manager = PassManager([Capture()])
    torch.compile(model, backend=fxmem.Backend(fxmem.Config(), lowering="eager", passes=manager))(**batch)
    return graphs[0]


def test_the_chain_runs_from_the_scores_matmul_to_the_softmax_and_redraws_dropout_from_the_step_seed():
    model, batch = tiny_model("llama", lora=True, attn="eager")
    chains, unreplayable = eager_attention_chains(_joint_graph(model, batch))
    assert len(chains) == 2 and unreplayable == 0  # one a layer
    for chain in chains:
        assert chain.scores in chain.chain and chain.probabilities in chain.chain
        assert chain.scores.target is torch.ops.aten.bmm.default
    torch._dynamo.reset()
    model, batch = tiny_model("llama", lora=True, attn="eager")
    for layer in model.base_model.model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    chains, unreplayable = eager_attention_chains(_joint_graph(model, batch))
    assert len(chains) == 2 and unreplayable == 0
    for chain in chains:  # the mask drawn again: the draw from the step's seeds is in the chain
        assert [n.target for n in chain.chain if n.target is torch.ops.prims.inductor_random.default]


def test_eager_attention_with_dropout_rebuilds_the_same_masks(lenient):
    model, batch = tiny_model("llama", lora=True, attn="eager")
    randomize_lora_b(model)
    for layer in model.base_model.model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    exact = fxmem.Backend(fxmem.Config(), lowering="eager")
    _, reference = loss_and_grads(torch.compile(model, backend=exact), model, batch, seed=3)
    torch._dynamo.reset()
    # rebuilt from q and k at their 8 bits alone (linear inputs exact): only the scores move, the masks must not
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-4bit", linear_input_bits=None, bits=8),
                            lowering="eager")
    _, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch, seed=3)
    assert "2 eager attention probabilities rebuilt" in pass_summary(backend, "recompute_attention")
    assert not [s for _, s, _ in backend.report().rows() if s.role is Role.ATTN_PROBS and s.frees_memory]
    assert gradient_fidelity(reference, grads).min_cosine > 0.999  # another mask would give unrelated gradients
