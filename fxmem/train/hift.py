"""Hierarchical full-parameter fine-tuning (HiFT: "A Hierarchical Full Parameter Fine-Tuning Strategy", Algorithm 1).

The model is cut into units (the embeddings, each block, the final norm and
head), the units into ``k`` groups of ``layers_per_group``. Each optimizer step
trains one group: only its parameters require gradients, so only they get
gradients, and layers below it need no backward at all. The optimizer state of
the other groups waits in CPU memory (pinned on CUDA). The learning rate advances
once per full cycle of ``k`` steps, so that every group is updated at the same
rate.

    hift = HiFT(model, torch.optim.AdamW, lr=1e-5, order="bottom2up")
    for batch in batches:
        model(**batch).loss.backward()     # micro-batches accumulate into the active group
        hift.step()                        # update it, offload its state, activate the next group
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch._dynamo.utils import counters
from torch.optim.lr_scheduler import LRScheduler

from fxmem.choices import HIFT_ORDERS as ORDERS
from fxmem.measure import format_bytes, saved_activation_bytes

_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])


@dataclass(frozen=True)
class Unit:
    """A layer in HiFT's sense: the embeddings, one block, or the head (final norm included)."""

    name: str
    parameters: tuple[torch.nn.Parameter, ...]


@dataclass(frozen=True)
class LayerGroup:
    """The units trained together in one step."""

    index: int
    units: tuple[Unit, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(unit.name for unit in self.units)

    @property
    def parameters(self) -> tuple[torch.nn.Parameter, ...]:
        return tuple(p for unit in self.units for p in unit.parameters)


def block_list(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The model's stack of blocks: the ModuleList of same-class modules holding the most parameters."""
    candidates = [(name, module) for name, module in model.named_modules()
                  if isinstance(module, torch.nn.ModuleList) and len(module) > 0
                  and len({type(child) for child in module}) == 1]
    if not candidates:
        raise ValueError(f"found no stack of blocks (an nn.ModuleList of same-class modules) in "
                         f"{type(model).__name__}; pass units=[...] (lists of modules, bottom to top)")
    return max(candidates, key=lambda c: sum(p.numel() for p in c[1].parameters()))


def layer_units(model: torch.nn.Module) -> list[Unit]:
    """The model's units bottom to top: what precedes the blocks, each block, what follows them.

    Parameters are taken in registration order, each once (a tied head weight
    belongs to the embeddings). Frozen parameters are left out: HiFT trains what
    the user left trainable.
    """
    prefix, blocks = block_list(model)
    in_blocks = {id(p) for p in blocks.parameters()}
    below: list[torch.nn.Parameter] = []
    above: list[torch.nn.Parameter] = []
    blocks_seen = False
    for p in model.parameters():
        if id(p) in in_blocks:
            blocks_seen = True
        elif p.requires_grad:
            (above if blocks_seen else below).append(p)
    units = [Unit("embeddings", tuple(below))]
    units += [Unit(f"{prefix}.{i}", tuple(p for p in block.parameters() if p.requires_grad))
              for i, block in enumerate(blocks)]
    units.append(Unit("head", tuple(above)))
    return [unit for unit in units if unit.parameters]


def given_units(model: torch.nn.Module, modules: list[torch.nn.Module | list[torch.nn.Module]]) -> list[Unit]:
    """Units from the user's modules (bottom to top); every trainable parameter must be in exactly one."""
    names = {id(module): name for name, module in model.named_modules()}
    units, owner = [], {}
    for entry in modules:
        group = entry if isinstance(entry, list | tuple) else [entry]
        missing = [type(m).__name__ for m in group if id(m) not in names]
        if missing:
            raise ValueError(f"units must be modules of the model; not in it: {', '.join(missing)}")
        name = "+".join(names[id(m)] or "<model>" for m in group)
        params = tuple({id(p): p for m in group for p in m.parameters() if p.requires_grad}.values())
        for p in params:
            if id(p) in owner:
                raise ValueError(f"a parameter is in two units: {owner[id(p)]} and {name}")
            owner[id(p)] = name
        units.append(Unit(name, params))
    left_out = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if left_out:
        raise ValueError(f"{len(left_out)} trainable parameters are in no unit (they would never train), "
                         f"e.g. {', '.join(left_out[:3])}; add their modules to units or freeze them")
    return [unit for unit in units if unit.parameters]


def recompile_limit_hits() -> int:
    """Code objects dynamo has given up recompiling and now runs eagerly, in this process."""
    return sum(count for message, count in counters["unimplemented"].items()
               if "recompile limit exceeded" in message.lower())


class HiFT:
    """Trains one layer group per optimizer step; see the module docstring.

    ``optimizer_class`` is any torch optimizer (AdamW, SGD, Adafactor, the
    bitsandbytes ones) built with ``optimizer_kwargs`` over one parameter group per
    layer group; it skips the parameters that have no gradient, so the inactive
    groups' state is never touched while it sits in CPU memory. ``scheduler``
    builds an LR scheduler on that optimizer; HiFT steps it once per full cycle.
    """

    def __init__(self, model: torch.nn.Module, optimizer_class: type[torch.optim.Optimizer], *,
                 layers_per_group: int = 1, order: str = "bottom2up", seed: int = 0,
                 scheduler: Callable[[torch.optim.Optimizer], LRScheduler] | None = None,
                 offload_optimizer_state: bool = True,
                 units: list[torch.nn.Module | list[torch.nn.Module]] | None = None,
                 **optimizer_kwargs: Any) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}; got {order!r}")
        if not isinstance(layers_per_group, int) or layers_per_group < 1:
            raise ValueError(f"layers_per_group must be an integer >= 1; got {layers_per_group!r}")
        if _TORCH_VERSION < (2, 13):
            # torch 2.11 skips the tensor guards of module parameters while the module's dict is unchanged, so a
            # flipped requires_grad reuses a graph compiled without that parameter's gradient: silently none.
            torch._dynamo.config.skip_tensor_guards_with_matching_dict_tags = False
        found = given_units(model, units) if units is not None else layer_units(model)
        if not found:
            raise ValueError("the model has no trainable parameters")
        queue = _ordered(found, order, seed)
        self.groups = [LayerGroup(i, tuple(queue[start:start + layers_per_group]))
                       for i, start in enumerate(range(0, len(queue), layers_per_group))]
        self.model, self.order, self.seed = model, order, seed
        self.offload_optimizer_state = offload_optimizer_state
        self.optimizer = optimizer_class([{"params": list(g.parameters)} for g in self.groups], **optimizer_kwargs)
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.steps = 0  # optimizer steps taken; the active group is steps % k
        self.eager_fallbacks: list[str] = []
        self._fallbacks_seen = recompile_limit_hits()
        self._homes: dict[tuple[int, str], torch.Tensor] = {}  # CPU copy of each offloaded state tensor
        self._train_only(self.active.parameters)

    @property
    def k(self) -> int:
        """Number of groups: steps in one full cycle."""
        return len(self.groups)

    @property
    def active(self) -> LayerGroup:
        return self.groups[self.steps % self.k]

    @property
    def cycle(self) -> int:
        """Full cycles completed."""
        return self.steps // self.k

    def step(self) -> None:
        """Update the active group with its accumulated gradients, then activate the next group."""
        group = self.active
        if all(p.grad is None for p in group.parameters):
            raise RuntimeError(f"no gradient reached the active group {group.index} ({', '.join(group.names)}): "
                               "run loss.backward() before hift.step()")
        self._bring_state(group)
        self.optimizer.step()
        self._offload_state(group)
        for p in group.parameters:
            p.grad = None
        self.steps += 1
        if self.steps % self.k == 0 and self.scheduler is not None:
            self.scheduler.step()
        self._train_only(self.active.parameters)
        self._check_eager_fallback()

    def _bring_state(self, group: LayerGroup) -> None:
        """Copy the offloaded optimizer state of ``group`` back to its parameters' device."""
        for p in group.parameters:
            state = self.optimizer.state.get(p, {})
            for key, value in state.items():
                if value is self._homes.get((id(p), key)):
                    state[key] = value.to(p.device, non_blocking=True)

    def _offload_state(self, group: LayerGroup) -> None:
        """Send ``group``'s optimizer state that lives on an accelerator to (pinned) CPU memory.

        Only tensors on the parameter's device move: optimizers keep some (AdamW's
        step count) on the CPU on purpose. Each tensor gets one CPU home, reused.
        """
        if not self.offload_optimizer_state:
            return
        for p in group.parameters:
            state = self.optimizer.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device.type != "cpu" and value.device == p.device:
                    home = self._homes.get((id(p), key))
                    if home is None or home.shape != value.shape or home.dtype != value.dtype:
                        home = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                        self._homes[(id(p), key)] = home
                    state[key] = home.copy_(value, non_blocking=True)

    def _check_eager_fallback(self) -> None:
        hits = recompile_limit_hits()
        if hits > self._fallbacks_seen:
            message = (f"torch.compile hit its recompile limit ({torch._dynamo.config.recompile_limit}) at HiFT step "
                       f"{self.steps} and now runs {hits - self._fallbacks_seen} compiled function(s) eagerly. A "
                       f"whole-model compile needs one graph per group ({self.k}); compile block by block instead "
                       "(hift.compile(...): at most 3 graphs per block class, whatever k), or raise "
                       f"torch._dynamo.config.recompile_limit to at least {self.k}")
            self.eager_fallbacks.append(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        self._fallbacks_seen = hits

    def compile(self, **compile_kwargs: Any) -> None:
        """Compile each block in place with ``torch.compile(**compile_kwargs)`` (e.g. ``backend="fxmem"``).

        A block is trained, frozen with gradients flowing through it, or frozen
        below the active group with no backward at all: three graphs per block
        class for any k, where a whole-model compile needs one per group.
        """
        _, blocks = block_list(self.model)
        for block in blocks:
            block.compile(**compile_kwargs)

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume mid-cycle exactly: optimizer state of all groups, position, scheduler."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # offloaded state arrives in pinned memory asynchronously
        return {"steps": self.steps, "order": self.order, "seed": self.seed,
                "groups": [list(g.names) for g in self.groups], "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        groups = [list(g.names) for g in self.groups]
        if state["groups"] != groups:
            raise ValueError(f"the saved HiFT state has groups {state['groups']}; this one has {groups} "
                             "(same model, layers_per_group, order and seed are needed to resume)")
        if (state["scheduler"] is None) != (self.scheduler is None):
            raise ValueError("the saved HiFT state and this one differ in having a scheduler")
        self.optimizer.load_state_dict(state["optimizer"])  # puts every state tensor on its parameter's device
        for group in self.groups:
            self._offload_state(group)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]
        self._train_only(self.active.parameters)

    def memory_report(self, loss: Callable[[], torch.Tensor] | None = None) -> HiFTMemoryReport:
        """Bytes per group: parameters, gradients, optimizer state (as far as the optimizer has built it), and,
        when ``loss`` (a forward on a representative batch) is given, the saved activations with that group
        active. Plain full fine-tuning is the row 'all'."""
        rows = []
        for group in [*self.groups, None]:
            params = group.parameters if group is not None else tuple(p for g in self.groups for p in g.parameters)
            saved = None
            if loss is not None:
                self._train_only(params)
                saved, _ = saved_activation_bytes(loss, exclude=[*self.model.parameters(), *self.model.buffers()])
            rows.append(GroupMemory("all" if group is None else str(group.index),
                                    group.names if group is not None else ("every unit",),
                                    tensor_bytes(params), tensor_bytes(params), optimizer_state_bytes(self.optimizer, params), saved))
        self._train_only(self.active.parameters)
        return HiFTMemoryReport(rows, tensor_bytes(self.model.parameters()))

    def _train_only(self, params: tuple[torch.nn.Parameter, ...]) -> None:
        chosen = {id(p) for p in params}
        for g in self.groups:
            for p in g.parameters:
                p.requires_grad_(id(p) in chosen)



def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> int:
    """Bytes of the optimizer's state tensors for ``params``, wherever they live."""
    return tensor_bytes(v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))


def _ordered(units: list[Unit], order: str, seed: int) -> list[Unit]:
    if order == "bottom2up":
        return list(units)
    if order == "top2down":
        return units[::-1]
    permutation = torch.randperm(len(units), generator=torch.Generator().manual_seed(seed)).tolist()
    return [units[i] for i in permutation]


@dataclass(frozen=True)
class GroupMemory:
    group: str
    units: tuple[str, ...]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    saved_activation_bytes: int | None


@dataclass(frozen=True)
class HiFTMemoryReport:
    """Per group, what its step holds beside the model's weights; the peak is the largest group's."""

    groups: list[GroupMemory]
    weight_bytes: int

    def step_bytes(self, row: GroupMemory) -> int:
        """Device bytes while ``row``'s group is stepped: all weights, its gradients, its optimizer state, and
        its saved activations when measured."""
        return self.weight_bytes + row.gradient_bytes + row.optimizer_state_bytes + (row.saved_activation_bytes or 0)

    def renderable(self) -> Table:
        table = Table(title="HiFT memory per group (bytes a step holds)", title_justify="left")
        for column in ("group", "units", "params", "grads", "optimizer state", "saved activations", "step total"):
            table.add_column(column, justify="left" if column in ("group", "units") else "right")
        for row in self.groups:
            saved = format_bytes(row.saved_activation_bytes) if row.saved_activation_bytes is not None else "-"
            table.add_row(row.group, ", ".join(row.units), format_bytes(row.parameter_bytes),
                          format_bytes(row.gradient_bytes), format_bytes(row.optimizer_state_bytes), saved,
                          format_bytes(self.step_bytes(row)))
        return table

    def table(self, width: int = 160) -> str:
        console = Console(file=io.StringIO(), width=width, color_system=None)
        console.print(self.renderable())
        return console.file.getvalue()
