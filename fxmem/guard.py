"""The guard (``Config.guard``): a lossy plan checked on the user's own batch, and mended where it bends the gradient.

A preset's error depends on the model and the data: its published bound comes from fxmem's workloads, not the
user's. So, on a slice of the training batch (its first tokens), the guard compares every trainable gradient under
the plan with eager's, as ``fxmem.check_fidelity`` does. Where the worst cosine is below ``Config.guard_cosine``
(with a margin: the slice is a sample, SLICE_MARGIN), it
measures each layer's compressed tensors alone, then each tensor of the layers that miss it alone (the rest exact,
through fidelity probes: one forward, a backward per layer and per tensor tried), and demotes the tensors that miss
it alone, or else the worst one, by a notch (the planner's
``less_lossy``: more bits, then exact; a replay or a recomputation where the cost model finds one within the new
bytes), then checks again, until the bound is met or nothing lossy is left.

The slice bounds the guard's memory: eager's activations for an eighth of the tokens, beside the plan's for the
same slice with its exact copies. Its compiles run fxmem's graphs without code generation (lowering="eager"), on a
function of their own, so that dynamo's cache for the training model's top frame is not touched (frames after a
graph break share theirs). Under torch.distributed
every rank measures its own slice and the ranks take the worst figure of each, so that they demote the same.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fxmem.backend import Backend
from fxmem.config import Config
from fxmem.fallback import FallbackError, fall_back
from fxmem.fidelity import describe_plan, output_loss
from fxmem.kernels import probe as probe_kernel
from fxmem.measure import gradient_cosines
from fxmem.peft_lora import prepared_for

# The slice: each row's first tokens, an eighth of them and no fewer than these (all where the rows are shorter).
SLICE_SHARE = 8
MIN_SLICE_TOKENS = 64
# Rounds of demotion before the guard gives up: a tensor at 1 bit is exact after four notches.
MAX_ROUNDS = 8
# The slice is a sample of the batch: the guard demotes until the slice's worst cosine is within this share of the
# bound's distance from 1 (0.995 for a bound of 0.99). At the bound itself a rank-2 lowrank on the tiny Llama met 0.99
# on its slice and missed it on the whole batch.
SLICE_MARGIN = 0.5


@dataclass(frozen=True)
class Demotion:
    """One compressed tensor the guard made less lossy."""

    tensor: str  # SavedRecord.key: module, role, forward node
    before: str  # what it was stored as
    after: str  # what it is stored as now
    alone_cosine: float  # the worst gradient cosine with it alone compressed, before


@dataclass(frozen=True)
class GuardCheck:
    """One check of the plan on a slice of a training batch."""

    forward: int  # the training forward it ran before (1: the first)
    why: str
    tokens: int  # per row of the slice
    bound: float
    cosine_before: float  # worst trainable-gradient cosine against eager, the plan as it was
    cosine_after: float  # the same once mended (cosine_before where nothing was demoted)
    worst_parameter: str
    demotions: tuple[Demotion, ...] = ()
    seconds: float = 0.0
    note: str = ""  # why nothing could be checked or mended

    @property
    def met(self) -> bool:
        return not self.note and self.cosine_after >= self.bound

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in vars(self).items() if k != "demotions"}, "met": self.met,
                "demotions": [vars(d) for d in self.demotions]}

    def summary(self) -> str:
        if self.note:
            return f"guard at forward {self.forward} ({self.why}): {self.note}"
        demoted = "; ".join(f"{d.tensor}: {d.before} -> {d.after}" for d in self.demotions) or "nothing demoted"
        return (f"guard at forward {self.forward} ({self.why}), {self.tokens} tokens a row: worst gradient cosine "
                f"{self.cosine_before:.4f} -> {self.cosine_after:.4f} (bound {self.bound}); {demoted}")


@dataclass
class _Round:
    """What one compile of the plan measured."""

    cosine: float
    worst_parameter: str
    alone: list[tuple[float, str, str]] = field(default_factory=list)  # (cosine, tensor key, plan), worst first
    plans: dict[str, str] = field(default_factory=dict)  # every saved tensor's key -> its plan in a few words


def check_plan(model: torch.nn.Module, batch: Mapping[str, Any], config: Config, demotions: dict[str, int], *,
               forward: int = 1, why: str = "first forward", loss: Callable[[Any], torch.Tensor] | None = None,
               probed: dict[tuple, tuple[Backend, Callable]] | None = None) -> GuardCheck:
    """Check ``config``'s plan (with ``demotions``) on a slice of ``batch`` and demote until ``config.guard_cosine``
    is met with SLICE_MARGIN; ``demotions`` is updated only where the check ran to its end. The model's gradients
    (``.grad``) and the global RNG are left as they were. ``probed``: the last plan's probed compile, by its
    demotions and the slice's shapes, kept there for the next check (a re-check of an unchanged plan compiles
    nothing). A check that cannot compare (no supervised token in the slice, no nonzero gradient, a loss that is not
    finite) returns with a note and demotes nothing."""
    probed = {} if probed is None else probed
    start = time.perf_counter()
    loss = loss or output_loss
    sliced, tokens = slice_batch(batch)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    trial = dict(demotions)
    with _rng_kept(), prepared_for(model, config), torch.enable_grad():
        reference = _gradients(lambda: loss(model._call_impl(**sliced)), params)
        compared = {name: g for name, g in reference.items() if g.any()}
        finite = all(bool(g.isfinite().all()) for g in compared.values())
        [comparable] = _agreed([float(bool(compared) and finite)])  # every rank goes on, or none
        if not comparable:
            return GuardCheck(forward, why, tokens, config.guard_cosine, 0.0, 0.0, "",
                              seconds=time.perf_counter() - start,
                              note="not checked: no nonzero, finite gradient on the slice (labels all ignored "
                                   "there, or a loss that is not finite)")
        target = 1 - (1 - config.guard_cosine) * SLICE_MARGIN
        first = measured = _measure(model, sliced, config, trial, compared, params, loss, probed, target)
        demoted: dict[str, float] = {}
        for _ in range(MAX_ROUNDS):
            if measured.cosine >= target or not measured.alone:
                break
            below = [a for a in measured.alone if a[0] < target] or measured.alone[:1]
            for cosine, key, _ in below:
                trial[key] = trial.get(key, 0) + 1
                demoted.setdefault(key, cosine)
            measured = _measure(model, sliced, config, trial, compared, params, loss, probed, target)
    demotions.update(trial)
    after = [Demotion(key, first.plans.get(key, "?"), measured.plans.get(key, "no longer saved as such"), cosine)
             for key, cosine in demoted.items()]
    return GuardCheck(forward, why, tokens, config.guard_cosine, first.cosine, measured.cosine,
                      measured.worst_parameter, tuple(after), time.perf_counter() - start)


def slice_batch(batch: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The batch's first tokens of each row: every tensor of two or more dimensions whose second is the sequence's
    (that of ``input_ids``, else of the first such tensor) is cut there; the rest pass as they are."""
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2]
    ids = batch.get("input_ids")
    if not tensors:
        raise ValueError("the guard slices the batch's tokens: it needs a batch of keyword tensors of (rows, tokens)"
                         ", such as input_ids and labels")
    length = (ids if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else tensors[0]).shape[1]
    # under torch.distributed the ranks' rows may differ in length: every rank slices the shortest's count
    [tokens] = _agreed([min(length, max(MIN_SLICE_TOKENS, length // SLICE_SHARE))])
    tokens = int(tokens)
    return {k: v[:, :tokens] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == length else v
            for k, v in batch.items()}, tokens


def _measure(model: torch.nn.Module, sliced: dict[str, Any], config: Config, demotions: dict[str, int],
             reference: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter],
             loss: Callable[[Any], torch.Tensor], cache: dict[tuple, tuple[Backend, Callable]], target: float
             ) -> _Round:
    """One compile of the plan with fidelity probes (``cache``'s where it has this plan), one forward, a backward with
    everything compressed, and, where that is below ``target``, one with each layer's tensors alone compressed (the
    rest exact), then one with each tensor alone of the layers below it (or of the worst layer); the ranks' figures
    agreed."""
    shapes = tuple((k, tuple(v.shape)) for k, v in sliced.items() if isinstance(v, torch.Tensor))
    plan = (tuple(sorted(demotions.items())), shapes)
    if plan not in cache:
        cache.clear()
        # offload moves the same bytes and back (its copies are not probed), and a diagnostic compile's fallback
        # is the guard's to report, not strict mode's to raise
        probed = config.replace(block_offload=False, strict=False)
        backend = Backend(probed, lowering="eager", fidelity_probes=True, demotions=demotions)
        cache[plan] = backend, torch.compile(_fresh_call(model), backend=backend)
    backend, compiled = cache[plan]
    try:
        torch.manual_seed(0)  # as the reference drew
        output = loss(compiled(sliced))
        probes = [(probe, record.key, describe_plan(plan), record.layer) for region in backend.regions
                  for probe, name in region.probes
                  for record, plan in zip(region.saved, region.plans, strict=True) if record.name == name]

        layer_of = {probe: layer for probe, _, _, layer in probes}

        def worst_with(compressed: Callable[[int], bool], output: torch.Tensor = output) -> tuple[str, float]:
            for probe in layer_of:
                probe_kernel.COMPRESSED[probe] = compressed(probe)
            grads = torch.autograd.grad(output, list(params.values()), retain_graph=True, allow_unused=True)
            return _worst(reference, dict(zip(params, grads, strict=True)))

        worst, cosine = worst_with(lambda probe: True)
        [cosine] = _agreed([cosine])
        alone: list[tuple[float, str, str]] = []
        if cosine < target and probes:  # which tensors: each layer's alone, then each tensor of the worst layers
            layers = sorted(set(layer_of.values()))
            by_layer = _agreed([worst_with(lambda probe, layer=layer: layer_of[probe] == layer)[1]
                                for layer in layers])
            suspects = {layer for layer, c in zip(layers, by_layer, strict=True) if c < target} \
                or {min(zip(by_layer, layers, strict=True))[1]}
            tried = [p for p in probes if p[3] in suspects]
            cosines = _agreed([worst_with(lambda probe, alone=p[0]: probe == alone)[1] for p in tried])
            alone = sorted((c, key, description) for c, (_, key, description, _) in zip(cosines, tried, strict=True))
    finally:  # each run sets every switch: released, a switch reads compressed, as the training step never does
        probe_kernel.release([probe for region in backend.regions for probe, _ in region.probes])
    plans = {record.key: describe_plan(plan) for region in backend.regions
             for record, plan in zip(region.saved, region.plans, strict=True)}
    return _Round(cosine, worst, alone, plans)


def _fresh_call(model: torch.nn.Module) -> Callable[[dict[str, Any]], Any]:
    """A function calling the model's forward (hooks included, not its compiled call), on a code object of its own:
    dynamo keeps its compiled code and its record of shapes seen per code object, so the training model's are left
    as they were, and this one's go with it."""
    def call(batch: dict[str, Any]) -> Any:
        return model._call_impl(**batch)

    return type(call)(call.__code__.replace(), call.__globals__, "fxmem_guard_call", None, call.__closure__)


def _gradients(loss: Callable[[], torch.Tensor], params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the reference and the plan's runs draw the same dropout masks and sketches
    grads = torch.autograd.grad(loss(), list(params.values()), allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(params.items(), grads, strict=True)}


def _worst(reference: dict[str, torch.Tensor], grads: dict[str, torch.Tensor | None]) -> tuple[str, float]:
    """The parameter whose gradient's cosine with the reference's is lowest, and that cosine (0 for a gradient that
    is missing or zero)."""
    cosines = gradient_cosines(reference, grads)
    worst = min(cosines, key=cosines.get)
    return worst, cosines[worst]


def _agreed(values: list[float]) -> list[float]:
    """Each figure the worst over the ranks (torch.distributed), so that every rank demotes the same."""
    if not _distributed():
        return values
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return tensor.tolist()


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """The global RNG as it was after the guard's runs (their dropout draws): the training step draws as it would."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        yield


class GuardedCall:
    """The guard in a training loop: wraps a model's compiled call (``fxmem.compile_``), and checks the plan before
    the first training forward, before the next after a recompile of a training graph (not under torch.distributed,
    where one rank's recompile is its own and every rank must check at the same forwards), and every
    ``guard_every`` training forwards. A demotion made once the model has compiled recompiles it, and warns."""

    def __init__(self, model: torch.nn.Module, backend: Backend) -> None:
        self.model = model
        self.backend = backend
        self.compiled = model._compiled_call_impl
        self.forwards = 0  # training forwards so far
        self.last_check: int | None = None
        self.trained_regions = 0  # the training regions compiled when the last training forward returned
        self.recompiled = False
        self.recompiling = False  # the guard's own recompile, checked already: not one to check again
        self.probed: dict[tuple, tuple[Backend, Callable]] = {}  # the last check's compile (check_plan)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training = self.model.training and torch.is_grad_enabled()
        if training:
            self.forwards += 1
            why = self._due()
            if why is not None:
                self._check(args, kwargs, why)
        output = self.compiled(*args, **kwargs)
        if training:
            trained = sum(r.kind == "training" for r in self.backend.regions)
            grew = 0 < self.trained_regions < trained
            self.recompiled = self.recompiled or (grew and not self.recompiling)
            self.recompiling = self.recompiling and not grew
            self.trained_regions = trained
        return output

    def _due(self) -> str | None:
        every = self.backend.config.guard_every
        if self.last_check is None:
            return "first forward"
        if self.recompiled and not _distributed():
            return "after a recompile"
        if every is not None and self.forwards - self.last_check >= every:
            return f"every {every} forwards"
        return None

    def _check(self, args: tuple, kwargs: dict[str, Any], why: str) -> None:
        self.last_check, self.recompiled = self.forwards, False
        config = self.backend.config
        before = dict(self.backend.demotions)
        try:
            check = check_plan(self.model, _keywords(self.model, args, kwargs), config, self.backend.demotions, forward=self.forwards, why=why,
                               probed=self.probed)
        except FallbackError:
            raise
        except Exception as error:  # noqa: BLE001 - a batch it cannot slice, an output without a loss, a failed
            # compile: the step runs as planned, and the report and a warning (strict mode: an error) say so
            check = GuardCheck(self.forwards, why, 0, config.guard_cosine, 0.0, 0.0, "",
                               note=f"not checked: {type(error).__name__}: {error}")
        self.backend.guard_checks.append(check)
        if check.note:
            fall_back(f"fxmem {check.summary()}", config, stacklevel=3)
            return
        if not check.met:
            fall_back(f"fxmem guard: the worst gradient cosine stays {check.cosine_after:.4f} below the bound "
                      f"{check.bound} after {len(check.demotions)} demotion(s) ({check.worst_parameter}): every "
                      "compressed tensor demoted as far as it goes, or the rounds spent", config, stacklevel=3)
        if self.backend.demotions != before and self.trained_regions:
            warnings.warn(f"fxmem: {check.summary()}; the model compiles again with them", stacklevel=3)
            # dynamo keeps compiled code per backend object: a new callable of the same backend compiles afresh
            self.model.compile(backend=functools.partial(Backend.__call__, self.backend))
            self.compiled = self.model._compiled_call_impl
            self.model._compiled_call_impl = self
            self.recompiling = True


def _keywords(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments as keywords, positional ones named by the model's forward (a PEFT model's takes
    ``*args``: its base model's), as the guard slices and passes them."""
    base = getattr(model, "get_base_model", None)
    forward = base().forward if callable(base) else model.forward
    named = [p.name for p in inspect.signature(forward).parameters.values()
             if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(named):
        raise TypeError(f"{len(args)} positional arguments, and forward names {len(named)}")
    return {**dict(zip(named, args)), **kwargs}


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def guard(model: torch.nn.Module, backend: Backend) -> None:
    """Check ``backend``'s plan on ``model``'s training batches (GuardedCall), the model compiled with it in place."""
    if model._compiled_call_impl is None:
        raise ValueError("the guard wraps a model compiled in place: call model.compile(backend=...) first")
    model._compiled_call_impl = GuardedCall(model, backend)
