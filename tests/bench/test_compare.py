import dataclasses
import importlib.util

import pytest
import torch
import transformers
from functorch.compile import make_boxed_func
from torch._dynamo.utils import counters
from torch._inductor.compile_fx import compile_fx
from torch.utils.checkpoint import CheckpointPolicy

from fxmem import Config, cli
from fxmem.measure import gradient_fidelity, model_tensors, saved_activation_bytes, trainable_gradients
from fxmem_bench import compare
from fxmem_bench.compare import (
    _sac_policy,
    budget_bracket,
    default_methods,
    forward_for_method,
    inductor_saved_bytes,
    left_out_by_default,
    prepare_method,
    run_workload,
)
from tests.bench.conftest import TINY_LLAMA
from tests.conftest import tiny_model

ONE_LAYER = dataclasses.replace(TINY_LLAMA, llama=dataclasses.replace(TINY_LLAMA.llama, layers=1))


@pytest.fixture
def aot_eager(monkeypatch):
    """torch.compile without inductor's code generation (seconds, not the minute inductor takes here): the graphs
    dynamo captures, and so the graph breaks and what AOTAutograd saves, are the methods' own."""
    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **options: compile_with(model, **{"backend": "aot_eager",
                                                                                         **options}))


def test_budget_bracket_has_one_setting_at_or_below_the_target_and_one_above():
    full = inductor_saved_bytes(ONE_LAYER, torch.device("cpu"), 16, budget=1.0)
    target = full // 2
    bracket = budget_bracket(ONE_LAYER, target, torch.device("cpu"), 16, iterations=2)
    assert 0.0 <= bracket.below < bracket.above <= 1.0 and bracket.above - bracket.below == 1 / 4
    below, above = (inductor_saved_bytes(ONE_LAYER, torch.device("cpu"), 16, b) for b in bracket.budgets)
    assert below <= target < above
    # measured as prepare_method measures every method: what the real inductor compile saves at 1.0
    compiled_setup = ONE_LAYER.build()
    next(compiled_setup.batches)
    batch = next(compiled_setup.batches)
    compiled = forward_for_method("compile-budget", compiled_setup.model, Config(), budget=1.0)
    exclude = model_tensors(compiled_setup.model) + list(batch.values())
    assert saved_activation_bytes(lambda: compiled_setup.loss(compiled, batch), exclude)[0] == full


def test_run_workload_refuses_unknown_methods_and_what_cannot_run():
    with pytest.raises(ValueError, match="unknown method.*valid methods: eager, compile"):
        run_workload(TINY_LLAMA, methods=["eager", "deepspeed"])
    with pytest.raises(ValueError, match="compile-offload runs on CUDA only.*got device cpu"):
        run_workload(TINY_LLAMA, methods=["eager", "compile-offload"])
    with pytest.raises(ValueError, match=r"compile-checkpointing-liger runs on CUDA only \(Liger-Kernel's kernels are "
                                         r"Triton GPU kernels\); compile-checkpointing-offload runs on CUDA only "
                                         r"\(host offload saves no memory on a CPU\); got device cpu"):
        run_workload(TINY_LLAMA, methods=["compile-checkpointing-liger", "compile-checkpointing-offload"])
    with pytest.raises(ValueError, match="compile-budget is matched to fxmem's measured saved bytes: add fxmem"):
        run_workload(TINY_LLAMA, methods=["eager", "compile-budget"])
    assert "compile-offload" not in default_methods("cpu") and "compile-offload" in default_methods("cuda")


def test_offload_baseline_copies_the_saved_activations_out_and_back(monkeypatch):
    """The mechanics on CPU (a copy to the same device): the saved activations leave the forward graph through
    inductor's offload copies and come back in backward; gradients are torch's."""
    graphs = []

    def keep_graph(gm, example_inputs, **kwargs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    monkeypatch.setattr(compare, "compile_fx", lambda gm, inputs: compile_fx(gm, inputs, inner_compile=keep_graph))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 16)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    forward_for_method("compile-offload", model, Config())(x).square().sum().backward()
    forward, backward = graphs
    assert forward.count("device_put") >= 2 and "cpu_offload_" in forward
    assert backward.count("device_put") == forward.count("device_put")
    for parameter, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad)


def test_checkpointing_baselines_are_hf_checkpointing_compiled_and_sac_saving_the_matmuls():
    assert _sac_policy(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert _sac_policy(None, torch.ops.aten.mul.Tensor) is CheckpointPolicy.PREFER_RECOMPUTE

    def saved(method: str) -> int:
        torch._dynamo.reset()
        setup = ONE_LAYER.build()
        batch = next(setup.batches)
        forward = forward_for_method(method, setup.model, Config())
        assert isinstance(forward, torch._dynamo.eval_frame.OptimizedModule) and forward._orig_mod is setup.model
        # the policy the method put on the model, compiled without inductor's code generation (seconds, not a
        # minute): what SAC stores becomes the compiled graph's saved tensors, which eager SAC's storage hides
        compiled = torch.compile(setup.model, backend="aot_eager")
        exclude = model_tensors(setup.model) + list(batch.values())
        return saved_activation_bytes(lambda: setup.loss(compiled, batch), exclude)[0]

    whole, selective = saved("compile-checkpointing"), saved("compile-sac")
    # checkpointing keeps each layer's input; SAC also every matmul's output (measured with inductor: 0.11 against
    # 0.80 MiB, torch.compile alone 0.63)
    assert 2 * whole < selective


def test_linear_cross_entropy_baseline_is_hf_causal_lm_loss_and_gradients(monkeypatch):
    """The method's loss function, run eagerly (compiled, below): HF's loss, to float rounding, where some labels are
    ignored too."""
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    setup = ONE_LAYER.build()
    batch = next(setup.batches)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][:, :5] = -100  # a prompt left out of the loss: the mean is over the other tokens
    reference = setup.model(**batch).loss
    reference.backward()
    reference_grads = trainable_gradients(setup.model)
    setup.model.zero_grad(set_to_none=True)
    loss = setup.loss(forward_for_method("compile-checkpointing-lce", setup.model, Config()), batch)
    loss.backward()
    assert setup.model.is_gradient_checkpointing
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    assert gradient_fidelity(reference_grads, trainable_gradients(setup.model)).min_cosine > 0.99999


def test_linear_cross_entropy_baseline_compiled_saves_no_logits_and_matches_eager(aot_eager):
    """Measured as every method is (prepare_method): its loss in the compiled graph, the logits never saved."""
    device = torch.device("cpu")

    def prepare(method: str, reference_grads: dict | None = None):
        counters.clear()
        return prepare_method(ONE_LAYER, method, config=Config(), device=device, lora_rank=16, budget=None,
                              reference_grads=reference_grads)

    eager = prepare("eager")
    checkpointed = prepare("hf-checkpointing").result
    chunked = prepare("compile-checkpointing-lce", eager.grads).result
    # dynamo traces linear_cross_entropy: the only graph breaks are HF's, at the requires_grad_ hook that
    # checkpointing puts on the embedding
    assert counters["graph_break"] and all("requires_grad_" in reason for reason in counters["graph_break"])
    assert chunked.fidelity.min_cosine > 0.99999 and chunked.first_loss == pytest.approx(eager.result.first_loss)
    # the same checkpointing with HF's loss keeps the logits' fp32 log-softmax, tokens x vocab; the chunked loss keeps
    # a gradient of the hidden states in its place, tokens x hidden
    tokens, shape = ONE_LAYER.batch * ONE_LAYER.seq, ONE_LAYER.llama
    assert checkpointed.saved_bytes - chunked.saved_bytes >= tokens * (shape.vocab - shape.hidden) * 4
    assert 0 < chunked.saved_bytes < eager.result.saved_bytes and chunked.peak_bytes > 0


def test_hidden_state_loss_baselines_are_refused_on_bert_and_left_out_of_its_defaults():
    bert, _ = tiny_model("bert", lora=True)
    with pytest.raises(ValueError, match="compile-checkpointing-lce takes the loss from a causal LM's final hidden "
                                         "states: it supports the llama family only, not bert"):
        forward_for_method("compile-checkpointing-lce", bert, Config())
    assert not bert.is_gradient_checkpointing  # refused before the model is touched
    bert_workload = dataclasses.replace(TINY_LLAMA, family="bert")
    with pytest.raises(ValueError, match="compile-checkpointing-lce .* supports the llama family only, not bert"):
        run_workload(bert_workload, methods=["eager", "compile-checkpointing-lce"])
    assert "compile-checkpointing-lce" in default_methods("cpu", "llama")
    assert "compile-checkpointing-lce" not in default_methods("cpu", "bert")
    assert "llama family only" in left_out_by_default(compare.METHODS, "cpu", "bert")["compile-checkpointing-lce"]


def test_cuda_baselines_whose_library_is_missing_are_left_out_of_the_defaults_and_refused(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "liger_kernel"
                        else find_spec(name, *args))
    # a transformers without offloaded checkpointing (before activation_checkpointing_enable's offload)
    monkeypatch.setattr(transformers.PreTrainedModel, "activation_checkpointing_enable",
                        lambda self, activation_checkpointing_kwargs=None: None)
    reasons = left_out_by_default(compare.METHODS, "cuda", "llama")
    assert reasons == {
        "compile-checkpointing-liger": "Liger-Kernel is not installed (pip install liger-kernel)",
        "compile-checkpointing-offload": f"transformers {transformers.__version__} has no offloaded checkpointing "
                                         "(activation_checkpointing_enable(offload=True))"}
    assert not set(reasons) & set(default_methods("cuda")) and "compile-offload" in default_methods("cuda")
    assert left_out_by_default(compare.METHODS, "cpu", "llama") == {}  # off CUDA they are left out as CUDA-only
    with pytest.raises(ValueError, match=r"compile-checkpointing-liger cannot run: Liger-Kernel is not installed"):
        run_workload(TINY_LLAMA, device="cuda", methods=["eager", "compile-checkpointing-liger"])


def test_offloaded_checkpointing_baseline_holds_the_layer_inputs_on_the_host_with_eager_gradients(aot_eager,
                                                                                                   monkeypatch):
    """The mechanics on CPU: HF's offload packs each checkpointed layer's inputs through save_on_cpu, pinned (which
    needs an accelerator: unpinned here); dynamo breaks the graph at save_on_cpu, so that each layer's checkpoint
    runs eagerly around its compiled body. Gradients are eager's."""
    packed = []

    def unpinned_save_on_cpu(pin_memory: bool, device_type: str):
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=False, device_type=device_type)
        pack = hooks.pack_hook
        hooks.pack_hook = lambda tensor: packed.append(tensor.shape) or pack(tensor)
        return hooks

    monkeypatch.setattr(transformers.modeling_utils, "save_on_cpu", unpinned_save_on_cpu)
    setup = TINY_LLAMA.build()
    batch = next(setup.batches)
    setup.model(**batch).loss.backward()
    reference_grads = trainable_gradients(setup.model)
    setup.model.zero_grad(set_to_none=True)
    forward = forward_for_method("compile-checkpointing-offload", setup.model, Config())
    setup.loss(forward, batch).backward()
    hidden = (TINY_LLAMA.batch, TINY_LLAMA.seq, TINY_LLAMA.llama.hidden)
    assert packed.count(hidden) >= TINY_LLAMA.llama.layers  # each layer's input, at least
    assert gradient_fidelity(reference_grads, trainable_gradients(setup.model)).min_cosine > 0.99999


def test_bench_compare_command_refuses_what_cannot_run_before_running_anything(capsys):
    assert cli.main(["bench", "compare", "--workloads", "llama-tiny", "--methods", "eager",
                     "compile-checkpointing-liger", "--device", "cpu"]) == 2
    assert "compile-checkpointing-liger runs on CUDA only" in capsys.readouterr().out
    assert cli.main(["bench", "compare", "--workloads", "minilm-real", "--methods", "eager",
                     "compile-checkpointing-lce", "--device", "cpu"]) == 2
    assert "supports the llama family only, not bert" in capsys.readouterr().out
