import io
import math

import pytest
import torch

from fxmem.train import HiFT, layer_units
from tests.conftest import tiny_model


def llama(layers: int = 3, seed: int = 0):
    model, batch = tiny_model("llama", lora=False, layers=layers, seed=seed)
    return model, batch


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(model, batch, hift: HiFT, steps: int, micro_batches: int = 1) -> list[float]:
    losses = []
    for _ in range(steps):
        for _ in range(micro_batches):
            loss = model(**batch).loss / micro_batches
            loss.backward()
        losses.append(loss.item())
        hift.step()
    return losses


def test_units_are_embeddings_each_block_and_head():
    model, _ = llama(layers=3)
    units = layer_units(model)
    assert [u.name for u in units] == ["embeddings", "model.layers.0", "model.layers.1", "model.layers.2", "head"]
    assert units[0].parameters == (model.model.embed_tokens.weight,)
    assert set(map(id, units[-1].parameters)) == {id(model.model.norm.weight), id(model.lm_head.weight)}
    assert sum(len(u.parameters) for u in units) == len(list(model.parameters()))


@pytest.mark.parametrize(("m", "k"), [(1, 5), (2, 3), (3, 2), (5, 1), (9, 1)])
def test_k_groups_of_m_units(m, k):
    model, _ = llama(layers=3)
    hift = HiFT(model, torch.optim.SGD, lr=0.1, layers_per_group=m)
    assert hift.k == k == math.ceil(5 / m)
    assert [len(g.units) for g in hift.groups] == [min(m, 5 - i * m) for i in range(k)]


def test_orders():
    names = [u.name for u in layer_units(llama(layers=3)[0])]

    def order(**kw):  # a fresh model each time: HiFT trains what is trainable when it wraps the model
        return [name for g in HiFT(llama(layers=3)[0], torch.optim.SGD, lr=0.1, **kw).groups for name in g.names]

    assert order(order="bottom2up") == names
    assert order(order="top2down") == names[::-1]
    shuffled = order(order="random", seed=3)
    assert sorted(shuffled) == sorted(names) and shuffled == order(order="random", seed=3)
    assert len({tuple(order(order="random", seed=s)) for s in range(6)}) > 1


def test_only_the_active_group_trains_and_the_next_one_follows():
    model, batch = llama()
    hift = HiFT(model, torch.optim.AdamW, lr=1e-2)
    for expected in [0, 1, 2, 3, 4, 0, 1]:
        assert hift.active.index == expected
        active = {id(p) for p in hift.active.parameters}
        before = params(model)
        model(**batch).loss.backward()
        assert {id(p) for p in model.parameters() if p.grad is not None} == active
        hift.step()
        assert all(p.grad is None for p in model.parameters())
        for name, p in model.named_parameters():
            assert torch.equal(p, before[name]) != (id(p) in active), name


def test_layers_below_the_active_group_run_no_backward():
    model, batch = llama(layers=3)
    hift = HiFT(model, torch.optim.SGD, lr=0.1)
    seen = []
    model.model.layers[1].register_forward_hook(lambda module, args, output: seen.append(output.requires_grad))
    for _ in range(hift.k):
        model(**batch).loss.backward()
        hift.step()
    # groups: embeddings, layer 0, layer 1, layer 2, head: layer 1's output needs a gradient only for groups 0-2
    assert seen == [True, True, True, False, False]


def test_a_step_equals_the_optimizer_on_that_group_alone():
    model, batch = llama()
    reference, _ = llama()
    hift = HiFT(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    train(model, batch, hift, steps=1)  # group 0: the embeddings
    alone = torch.optim.AdamW([reference.model.embed_tokens.weight], lr=1e-2, weight_decay=0.1)
    for p in reference.parameters():
        p.requires_grad_(p is reference.model.embed_tokens.weight)
    reference(**batch).loss.backward()
    alone.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_micro_batches_accumulate_into_one_step_of_one_group():
    one, batch = llama()
    accumulated, _ = llama()
    train(one, batch, HiFT(one, torch.optim.SGD, lr=0.1), steps=7)
    train(accumulated, batch, HiFT(accumulated, torch.optim.SGD, lr=0.1), steps=7, micro_batches=2)
    for (name, p), q in zip(one.named_parameters(), accumulated.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_learning_rate_advances_once_per_full_cycle():
    model, batch = llama()
    hift = HiFT(model, torch.optim.AdamW, lr=1.0,
                scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda cycle: 0.5 ** cycle))
    lrs = []
    for _ in range(2 * hift.k + 1):
        lrs.append(hift.optimizer.param_groups[0]["lr"])
        train(model, batch, hift, steps=1)
    assert lrs == [1.0] * hift.k + [0.5] * hift.k + [0.25]
    assert {g["lr"] for g in hift.optimizer.param_groups} == {0.25}
    assert hift.cycle == 2


def test_each_parameter_is_updated_once_per_cycle():
    model, batch = llama()
    hift = HiFT(model, torch.optim.AdamW, lr=1e-3, layers_per_group=2, order="random", seed=1)
    train(model, batch, hift, steps=2 * hift.k)
    assert {int(hift.optimizer.state[p]["step"]) for p in model.parameters()} == {2}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    if name == "AdamW8bit":
        return pytest.importorskip("bitsandbytes").optim.AdamW8bit
    return getattr(torch.optim, name)


@pytest.mark.parametrize("optimizer", ["SGD", "Adafactor", "AdamW", "AdamW8bit"])
def test_memory_report_counts_gradients_and_state_per_group(optimizer):
    model, batch = llama()
    kwargs = {"lr": 1e-2, "momentum": 0.9} if optimizer == "SGD" else {"lr": 1e-2}
    hift = HiFT(model, optimizer_class(optimizer), **kwargs)
    before = params(model)
    train(model, batch, hift, steps=1)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"model.embed_tokens.weight"}  # the optimizer skipped the groups without gradients
    train(model, batch, hift, steps=hift.k - 1)
    report = hift.memory_report(lambda: model(**batch).loss)
    *groups, full = report.groups
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert report.weight_bytes == full.parameter_bytes == full.gradient_bytes == weights
    assert sum(g.gradient_bytes for g in groups) == weights
    assert sum(g.optimizer_state_bytes for g in groups) == full.optimizer_state_bytes
    if optimizer == "SGD":  # one momentum buffer per weight
        assert full.optimizer_state_bytes == weights
    if optimizer == "AdamW":  # two moments per weight, and a float32 step count per parameter tensor
        assert full.optimizer_state_bytes == 2 * weights + 4 * len(list(model.parameters()))
    if optimizer == "Adafactor":  # factored second moments: far less than one value per weight
        assert 0 < full.optimizer_state_bytes < weights / 4
    if optimizer == "AdamW8bit":  # one byte per moment where a tensor has 4096 values or more
        assert weights / 4 < full.optimizer_state_bytes < 0.6 * weights
    # lower groups save more for backward; full fine-tuning saves the most
    saved = [g.saved_activation_bytes for g in groups]
    assert saved[-1] < saved[1] < full.saved_activation_bytes
    assert max(report.step_bytes(g) for g in groups) < report.step_bytes(full)
    assert "model.layers.0" in report.table()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading moves state off an accelerator")
def test_optimizer_state_waits_in_pinned_cpu_memory_between_its_steps():
    model, batch = llama()
    model.cuda()
    batch = {name: t.cuda() for name, t in batch.items()}
    hift = HiFT(model, torch.optim.AdamW, lr=1e-2)
    train(model, batch, hift, steps=hift.k + 1)  # every group has state; group 0 has stepped twice
    for group in hift.groups:
        for p in group.parameters:
            moments = [hift.optimizer.state[p][key] for key in ("exp_avg", "exp_avg_sq")]
            assert all(m.device.type == "cpu" and m.is_pinned() for m in moments)
            assert hift.optimizer.state[p]["step"].device.type == "cpu"  # AdamW keeps it there itself
    reference, _ = llama()
    reference.cuda()
    plain = HiFT(reference, torch.optim.AdamW, lr=1e-2, offload_optimizer_state=False)
    train(reference, batch, plain, steps=plain.k + 1)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_resumed_mid_cycle_run_is_bitwise_equal():
    def make(seed_model=0):
        model, batch = llama(seed=seed_model)
        hift = HiFT(model, torch.optim.AdamW, lr=1e-2, order="random", seed=5, layers_per_group=2,
                    scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7))
        return model, batch, hift

    model, batch, hift = make()
    train(model, batch, hift, steps=8)  # k=3: two full cycles and two steps into the third

    interrupted, _, first = make()
    train(interrupted, batch, first, steps=5)  # stop mid-cycle
    saved = io.BytesIO()
    torch.save({"model": interrupted.state_dict(), "hift": first.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    resumed, _, second = make(seed_model=1)  # other initial weights: everything must come from the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    second.load_state_dict(checkpoint["hift"])
    assert second.active.index == 5 % 3 and second.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.7)
    train(resumed, batch, second, steps=3)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_resuming_with_other_groups_is_refused():
    model, _ = llama()
    state = HiFT(model, torch.optim.SGD, lr=0.1, order="bottom2up").state_dict()
    with pytest.raises(ValueError, match="same model, layers_per_group, order and seed"):
        HiFT(llama()[0], torch.optim.SGD, lr=0.1, order="top2down").load_state_dict(state)


def test_parameters_frozen_by_the_user_stay_frozen():
    model, batch = llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    hift = HiFT(model, torch.optim.SGD, lr=0.1)
    assert hift.k == 4 and hift.groups[0].names == ("model.layers.0",)
    train(model, batch, hift, steps=hift.k)
    assert not model.model.embed_tokens.weight.requires_grad


def test_units_given_by_hand():
    model, batch = llama(layers=2)
    m = model.model
    hift = HiFT(model, torch.optim.SGD, lr=0.1, units=[m.embed_tokens, list(m.layers), [m.norm, model.lm_head]])
    assert [g.names for g in hift.groups] == [("model.embed_tokens",), ("model.layers.0+model.layers.1",),
                                              ("model.norm+lm_head",)]
    before = params(model)
    train(model, batch, hift, steps=hift.k)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    model, _ = llama(layers=2)  # fresh: the HiFT above froze all but its active group
    m = model.model
    with pytest.raises(ValueError, match=r"2 trainable parameters are in no unit .they would never train., "
                                         r"e.g. model.norm.weight, lm_head.weight"):
        HiFT(model, torch.optim.SGD, lr=0.1, units=[m.embed_tokens, list(m.layers)])
    with pytest.raises(ValueError, match="a parameter is in two units: model and model.embed_tokens"):
        HiFT(model, torch.optim.SGD, lr=0.1, units=[m, m.embed_tokens])
    with pytest.raises(ValueError, match="units must be modules of the model; not in it: Linear"):
        HiFT(model, torch.optim.SGD, lr=0.1, units=[torch.nn.Linear(2, 2)])


def test_bad_input_is_refused_with_the_valid_choices():
    model, _ = llama()
    with pytest.raises(ValueError, match="order must be one of bottom2up, top2down, random; got 'up'"):
        HiFT(model, torch.optim.SGD, lr=0.1, order="up")
    with pytest.raises(ValueError, match="layers_per_group must be an integer >= 1; got 0"):
        HiFT(model, torch.optim.SGD, lr=0.1, layers_per_group=0)
    with pytest.raises(ValueError, match="found no stack of blocks"):
        HiFT(torch.nn.Linear(2, 2), torch.optim.SGD, lr=0.1)
    hift = HiFT(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match=r"no gradient reached the active group 0 \(embeddings\)"):
        hift.step()


def unique_graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def test_block_by_block_compile_needs_three_graphs_for_any_k():
    model, batch = llama(layers=4)
    hift = HiFT(model, torch.optim.SGD, lr=0.1)
    hift.compile(backend="aot_eager")
    before = unique_graphs()
    train(model, batch, hift, steps=2 * hift.k)
    # trained, frozen with gradient flowing through, frozen without backward: one graph each, shared by the blocks
    assert unique_graphs() - before == 3
    assert hift.eager_fallbacks == []


@torch._dynamo.config.patch(recompile_limit=2)
def test_whole_model_compile_past_the_recompile_limit_is_reported():
    model, batch = llama()
    hift = HiFT(model, torch.optim.SGD, lr=0.1)
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):  # two groups, two graphs: the limit
        compiled(**batch).loss.backward()
        hift.step()
    assert hift.eager_fallbacks == []
    compiled(**batch).loss.backward()  # a third graph would be one too many: dynamo runs this forward eagerly
    with pytest.warns(RuntimeWarning, match="hit its recompile limit .2. at HiFT step 3 and now runs 1 compiled"):
        hift.step()
    assert len(hift.eager_fallbacks) == 1


def test_fxmem_compiled_blocks_train_as_eager():
    eager, batch = llama(layers=2)
    compiled, _ = llama(layers=2)
    eager_hift = HiFT(eager, torch.optim.SGD, lr=0.1)
    compiled_hift = HiFT(compiled, torch.optim.SGD, lr=0.1)
    compiled_hift.compile(backend="fxmem")
    eager_losses = train(eager, batch, eager_hift, steps=eager_hift.k + 1)
    compiled_losses = train(compiled, batch, compiled_hift, steps=compiled_hift.k + 1)
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_groups_of_two_train_as_eager(scope):
    # A trained group's upper block takes an input that needs a gradient, like a frozen block above it: its graph
    # must still differ by the parameters' requires_grad (torch 2.11 reused the frozen one unless told not to).
    runs = []
    for compiled in (False, True):
        model, batch = llama(layers=4)
        hift = HiFT(model, torch.optim.SGD, lr=0.1, layers_per_group=2)
        forward = model
        if compiled and scope == "blocks":
            hift.compile(backend="aot_eager")
        elif compiled:
            forward = torch.compile(model, backend="aot_eager")
        for _ in range(2 * hift.k):
            forward(**batch).loss.backward()
            hift.step()
        runs.append(model)
    for (name, p), q in zip(runs[0].named_parameters(), runs[1].parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
