"""Fuse rebuilt LoRA outputs with their activation: one kernel for SwiGLU (gate, up), one for GELU.

After lora_reorder and quantize, backward rebuilds each reordered LoRA output
as view(deq(X W^T)) + s view((X A^T) B^T) and runs the activation's derivative
on it element by element; forward computes the same sum from the unquantized
X W^T. This pass finds those sums, grows the element-wise region computed from
them (plus, in backward, the one incoming gradient), and replaces the region's
activation output and gradients by one call to fxmem::lora_swiglu_forward /
_backward or fxmem::lora_gelu_forward / _backward (fxmem/kernels/lora_epilogue.py).
On CUDA the dequantized X W^T, the (X A^T) B^T product and the rebuilt output
then never reach memory.

Which region node is h = silu(gate) up, dL/dgate, dL/dup (or gelu(y), dL/dy)
is decided by evaluating the region on sample values against the kernels' own
torch reference, not by matching op spellings: torch's decompositions of SiLU
and GELU and their derivatives differ between versions, the values do not. A
region whose values match no kernel (RoPE after q and k, a lone SiLU) is left
to inductor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._inductor.pattern_matcher import stable_topological_sort
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq
from torch.utils._pytree import tree_map_only

import fxmem.kernels.lora_epilogue as epilogue
from fxmem.analysis.graph import CONSTANT_FILLS, DTYPE_CASTS, is_replayable_pointwise, is_view, numel_hint, tensor_val
from fxmem.analysis.lora import LoraSum, lora_sums
from fxmem.cost_model.memory import epilogue_traffic_saved
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, pass_result
from fxmem.passes.saved_rewrite import call

aten = torch.ops.aten
_SAMPLES = 257  # random values per sample tensor, besides a fixed tail


@dataclass(frozen=True)
class KernelOperands:
    """What the fused kernels read of a LoRA sum base + s (X A^T) B^T, base = X W^T or its dequantized copy."""

    node: Node  # the add
    base: Node  # the frozen side as the add reads it (a view of the matmul or of the dequantize)
    xa: Node  # X A^T, (n, r)
    b: Node  # B, (o, r)
    scaling: float
    quantized: tuple[Node, Node, Node, int] | None  # (packed, scale, zero, bits) when base is dequantized


class FuseEpilogue(GraphPass):
    """Fuses where the kernels run as Triton (CUDA) and Config.fused_epilogue asks for them. On CPU their torch
    reference materializes the same tensors as inductor's unfused code, so CPU graphs are left to inductor unless
    ``on_reference`` (tests use it)."""

    name = "fuse_epilogue"
    stage = "partitioned"

    def __init__(self, *, on_reference: bool = False) -> None:
        self.on_reference = on_reference

    def run(self, state: PipelineState) -> PassResult:
        found = [(f"{e.kind} ({side})", e) for side, gm in (("forward", state.fw), ("backward", state.bw))
                 for e in fuse_graph(gm, backward=side == "backward", on_reference=self.on_reference,
                                     dequantized=state.dequantized, triton=state.config.fused_epilogue)]
        parts = []
        left = ("{kinds} left to inductor: the fused kernels are Triton (CUDA), where they would save {traffic} of "
                "memory traffic; their CPU path, the torch reference, does not")
        if not state.config.fused_epilogue:
            left = ("{kinds} left to inductor (Config.fused_epilogue is off: on an H200 inductor's code measured "
                    "faster than the fused Triton kernels, which would save {traffic} of memory traffic)")
        done = "fused with the LoRA rebuild: {kinds}, {traffic} less memory traffic"
        for fused, text in ((True, done), (False, left)):
            kinds = Counter(what for what, e in found if e.fused is fused)
            if kinds:
                traffic = _mib(sum(e.traffic_saved for _, e in found if e.fused is fused))
                parts.append(text.format(kinds=", ".join(f"{count}x {what}" for what, count in sorted(kinds.items())),
                                         traffic=traffic))
        return pass_result(any(e.fused for _, e in found), *parts)


@dataclass(frozen=True)
class Epilogue:
    kind: str  # 'swiglu' or 'gelu'
    fused: bool
    traffic_saved: int  # bytes, under the cost model, when fused


def fuse_graph(gm: GraphModule, *, backward: bool, on_reference: bool,
               dequantized: dict[Node, tuple] | None = None, triton: bool = True) -> list[Epilogue]:
    """Find every SwiGLU and GELU epilogue of a LoRA sum in ``gm``; fuse those the Triton kernels would run if
    ``triton`` (all of them with ``on_reference``)."""
    graph = gm.graph
    operands = (kernel_operands(node, dequantized or {}) for node in graph.nodes)
    sums = {s.node: s for s in operands if s is not None}
    if backward:  # backward rebuilds from the quantized copy; an exact one is a saved output, nothing to fuse
        sums = {node: s for node, s in sums.items() if s.quantized is not None}
    found = []
    for group in _groups(graph, list(sums)):
        if len(group) > 2:
            continue  # no kernel takes three LoRA sums (o_proj and down_proj meet in the residual stream)
        region = Region.grow(graph, group, backward)
        rewrite = _rewrite(region, [sums[node] for node in group], backward) if region is not None else None
        if rewrite is None:
            continue
        val = tensor_val(group[0])
        fuse = on_reference or (triton and epilogue.uses_triton(val))
        if fuse:
            rewrite(graph)
        found.append(Epilogue(rewrite.kind, fuse, epilogue_traffic_saved(
            numel_hint(val), val.element_size(), len(group), backward=backward)))
    if any(e.fused for e in found):
        stable_topological_sort(graph)  # a kernel call goes after its last operand; its outputs' users may precede it
        graph.eliminate_dead_code()
    return found


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _with_static_channels(node: Node) -> torch.Tensor | None:
    """``node``'s value if it is one tensor whose channels (last dimension) are a number: the kernels' tiles and
    the packed layout need them. Its rows may be symbolic (a dynamic sequence length)."""
    val = tensor_val(node)
    return val if val is not None and val.dim() and isinstance(val.shape[-1], int) else None


def _row_major(val: torch.Tensor) -> bool:
    """Contiguous, provably (a dimension of size 1 may have any stride), without a guard."""
    expected = 1
    for size, stride in reversed(list(zip(val.shape, val.stride(), strict=True))):
        if not (statically_known_true(sym_eq(size, 1)) or statically_known_true(sym_eq(stride, expected))):
            return False
        expected = expected * size
    return True


def _same_shape(a: Sequence, b: Sequence) -> bool:
    """Sizes provably equal, symbolic ones included; never a guard (dynamo is done when fxmem runs)."""
    return statically_known_true(sym_eq(tuple(a), tuple(b)))


def kernel_operands(node: Node, dequantized: dict[Node, tuple]) -> KernelOperands | None:
    """The fused kernels' operands if ``node`` is a LoRA sum (analysis.lora.lora_sums) of their form;
    ``dequantized``: the quantize pass's restored tensors and the saved parts they read."""
    out = _with_static_channels(node)
    if out is None:
        return None
    for joined in lora_sums(node):
        base, lora = _with_static_channels(joined.base), _with_static_channels(joined.lora)
        # No broadcasting: the kernels write the sum's shape. The sides may differ in dtype as PEFT's fp32 adapters
        # on a half-precision model do; the sum is then in fp32 (their promotion), as the kernels compute it.
        if any(v is None or not _same_shape(v.shape, out.shape) for v in (base, lora)) or (
                out.dtype != torch.promote_types(base.dtype, lora.dtype)):
            continue
        factors = _lora_factors(joined)
        frozen = _reshaped_from(joined.base)
        if factors is None or frozen is None:
            continue
        xa, b = factors
        channels = tensor_val(b).shape[0]
        if not _same_shape(tensor_val(frozen).shape, (tensor_val(xa).shape[0], channels)):
            continue
        if frozen in dequantized:
            packed, scale, zero, spec = dequantized[frozen]
            if spec.outliers or spec.chunk or spec.rotation:
                continue  # outliers and rotated codes are not the kernels' input
            return KernelOperands(node, joined.base, xa, b, joined.scaling, (packed, scale, zero, spec.bits))
        if frozen.target in (aten.mm.default, aten.addmm.default):
            return KernelOperands(node, joined.base, xa, b, joined.scaling, None)
    return None


def _reshaped_from(node: Node) -> Node | None:
    """The 2-D tensor ``node`` is a row-major reshape of (through view ops that keep the last dim), else None."""
    val = _with_static_channels(node)
    if val is None:
        return None
    last = val.shape[-1]
    while is_view(node):
        if node.target not in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            return None
        node = node.args[0]
        val = _with_static_channels(node)
        if val is None or val.shape[-1] != last:
            return None
    return node if val.dim() == 2 and _row_major(val) else None


def _lora_factors(joined: LoraSum) -> tuple[Node, Node] | None:
    """(X A^T, B) where the sum's LoRA side is a reshape of mm(X A^T, permute(B, [1, 0]))."""
    product = joined.product
    if product.target is not aten.mm.default or _reshaped_from(joined.lora) is not product:
        return None
    xa, b_t = product.args
    if not (b_t.target is aten.permute.default and list(b_t.args[1]) == [1, 0]):
        return None
    b = b_t.args[0]
    if b.op != "placeholder" or tensor_val(b).dim() != 2 or not _row_major(tensor_val(xa)):
        return None
    if tensor_val(xa).shape[1] > epilogue.MAX_RANK:
        return None  # not a LoRA bottleneck
    return xa, b


def _pointwise(node: Node) -> bool:
    # In-place ops would overwrite the sample tensors the region is evaluated on.
    return is_replayable_pointwise(node) and not node.target._schema.is_mutable


def _scalar_constant(node: Node) -> bool:
    val = tensor_val(node)
    return node.target in CONSTANT_FILLS and val is not None and val.dim() == 0 and not node.all_input_nodes


def _groups(graph: Graph, seeds: list[Node]) -> list[list[Node]]:
    """Seeds whose element-wise consumers meet (SwiGLU's gate and up), each group in graph order."""
    reach: dict[Node, set[Node]] = {}
    for seed in seeds:
        found, stack = {seed}, [seed]
        while stack:
            for user in stack.pop().users:
                if user not in found and _pointwise(user):
                    found.add(user)
                    stack.append(user)
        reach[seed] = found
    groups: list[list[Node]] = []
    for seed in seeds:
        joined = [g for g in groups if any(reach[seed] & reach[other] for other in g)]
        merged = [seed] + [s for g in joined for s in g]
        groups = [g for g in groups if g not in joined] + [merged]
    order = {node: i for i, node in enumerate(graph.nodes)}
    return [sorted(g, key=order.__getitem__) for g in groups]


@dataclass
class Region:
    """The element-wise nodes computed from ``seeds`` and at most one other full-size tensor, in graph order."""

    seeds: list[Node]
    nodes: list[Node]
    incoming: Node | None  # the one other full-size input (backward: the gradient arriving at the activation)

    @classmethod
    def grow(cls, graph: Graph, seeds: list[Node], allow_incoming: bool) -> Region | None:
        shape = tensor_val(seeds[0]).shape
        if any(not _same_shape(tensor_val(s).shape, shape) or tensor_val(s).dtype != tensor_val(seeds[0]).dtype
               for s in seeds):
            return None
        inside, nodes, incoming = set(seeds), [], None
        for node in graph.nodes:
            if node in inside or not _pointwise(node) or not any(i in inside for i in node.all_input_nodes):
                continue
            others = {i for i in node.all_input_nodes if i not in inside and not _scalar_constant(i)}
            if incoming is not None:
                others.discard(incoming)
            if len(others) > 1 or (others and (not allow_incoming or incoming is not None)):
                continue
            values = [_with_static_channels(n) for n in (node, *others)]
            if any(v is None or not _same_shape(v.shape, shape) for v in values):
                continue
            if others:
                (incoming,) = others
            inside.add(node)
            nodes.append(node)
        return cls(seeds, nodes, incoming) if nodes else None

    def evaluate(self, inputs: dict[Node, torch.Tensor]) -> dict[Node, torch.Tensor]:
        """Run the region's ops in float64 on CPU sample tensors standing for its seeds and incoming tensor.

        Casts are skipped and constants made float64: what is compared is the formula, not the rounding of
        the graph's dtypes, which in bf16 is coarse enough to pass a GELU lookalike as GELU."""
        values = dict(inputs)

        def value(node: Node) -> torch.Tensor:
            if node not in values:  # a scalar constant
                constant = node.target(*node.args, **{**node.kwargs, "device": torch.device("cpu")})
                values[node] = constant.double() if constant.is_floating_point() else constant
            return values[node]

        for node in self.nodes:
            args, kwargs = tree_map_only(Node, value, (node.args, node.kwargs))
            if node.target in DTYPE_CASTS:
                values[node] = args[0] if tensor_val(node).dtype.is_floating_point else node.target(*args, **kwargs)
            else:
                values[node] = node.target(*args, **kwargs)
        return values


def _samples(generator: torch.Generator, spread: float) -> torch.Tensor:
    """Normal values, plus a few far out where clamps and saturations show."""
    tail = torch.tensor([-40.0, -12.0, -6.0, 0.0, 6.0, 12.0, 40.0], dtype=torch.float64)
    return torch.cat([torch.randn(_SAMPLES, generator=generator, dtype=torch.float64) * spread, tail])


def _matches(value: torch.Tensor, target: torch.Tensor) -> bool:
    """Equal up to float64 formula differences (~1e-12), far below the gap between GELU's erf and tanh forms
    (~5e-5 of the largest value) or between GELU and x sigmoid(1.702 x) (~2e-3)."""
    if value.shape != target.shape or not value.is_floating_point():
        return False
    return bool((value - target).abs().max() <= 1e-7 * target.abs().max().clamp_min(1.0))


def _match(region: Region, values: dict[Node, torch.Tensor], targets: dict[str, torch.Tensor],
           dtype: torch.dtype) -> dict[str, Node]:
    """For each target, the first region node with its value and the kernel's output dtype ``dtype``."""
    found: dict[str, Node] = {}
    for node in region.nodes:
        if tensor_val(node).dtype == dtype:
            for name, target in targets.items():
                if name not in found and _matches(values[node], target):
                    found[name] = node
    return found


def _swiglu_targets(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor | None) -> dict[str, torch.Tensor]:
    grad_gate, grad_up, h = epilogue._swiglu_grads(grad if grad is not None else torch.zeros_like(gate), gate, up)
    return {"h": h} if grad is None else {"grad_gate": grad_gate, "grad_up": grad_up, "h": h}


def _gelu_targets(y: torch.Tensor, grad: torch.Tensor | None, approximate: str) -> dict[str, torch.Tensor]:
    targets = {"a": torch.nn.functional.gelu(y, approximate=approximate)}
    if grad is not None:
        targets["grad_y"] = torch.ops.aten.gelu_backward(grad, y, approximate=approximate)
    return targets


def _identify(region: Region, backward: bool, dtype: torch.dtype) -> tuple[str, tuple, dict[str, Node]] | None:
    """(kernel kind, kernel-specific layout, matched nodes) for the region, or None if no kernel computes it;
    ``dtype``: the kernel's outputs'."""
    generator = torch.Generator().manual_seed(0)
    with unset_fake_temporarily():  # the partitioner runs under fake mode; the samples are real values
        seeds = {seed: _samples(generator, 3.0) for seed in region.seeds}
        grad = _samples(generator, 1.0) if region.incoming is not None else None
        try:
            values = region.evaluate({**seeds, region.incoming: grad} if grad is not None else seeds)
        except Exception:  # noqa: BLE001  an op with no float64 CPU kernel: not an epilogue the kernels know
            return None
        if len(region.seeds) == 2:
            required = {"grad_gate", "grad_up"} if backward else {"h"}
            candidates = [("swiglu", (gate, up), _match(region, values, _swiglu_targets(seeds[gate], seeds[up], grad),
                                                   dtype))
                          for gate, up in (region.seeds, region.seeds[::-1])]
        else:
            required = {"grad_y"} if backward else {"a"}
            y = seeds[region.seeds[0]]
            candidates = [("gelu", (approximate,), _match(region, values, _gelu_targets(y, grad, approximate), dtype))
                          for approximate in epilogue.GELU_APPROXIMATIONS]
    return next(((kind, layout, found) for kind, layout, found in candidates if required <= found.keys()), None)


def _needs_seed(region: Region, matched: set[Node]) -> set[Node]:
    """Region nodes that still read a seed when the matched nodes come from the kernel."""
    needing = set(region.seeds)
    for node in region.nodes:
        if node not in matched and any(i in needing for i in node.all_input_nodes):
            needing.add(node)
    return needing


def _depends_on(node: Node, targets: set[Node]) -> bool:
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in targets:
            return True
        for i in current.all_input_nodes:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return False


@dataclass(frozen=True)
class KernelCall:
    """The kernel call replacing a region: ``op(*args)``, whose outputs ``names`` stand for ``found``'s nodes."""

    kind: str
    op: torch._ops.OpOverload
    args: tuple
    names: tuple[str, ...]
    found: dict[str, Node]

    def __call__(self, graph: Graph) -> None:
        with graph.inserting_after(_last(graph, [a for a in self.args if isinstance(a, Node)])):
            outputs = call(graph, self.op, self.args, outputs=len(self.names)) if len(self.names) > 1 else [
                call(graph, self.op, self.args)]
        for name, output in zip(self.names, outputs, strict=True):
            if name in self.found:
                self.found[name].replace_all_uses_with(output)


def _rewrite(region: Region, sums: list[KernelOperands], backward: bool) -> KernelCall | None:
    """The kernel call that computes what the rest of the graph reads from ``region``, if there is one."""
    # The kernels return the dtype of their first tensor: the incoming gradient in backward (a bf16 model's
    # backward may upcast it to fp32 for the activation's derivative), the frozen product in forward (the sum is
    # in fp32 when PEFT's adapters are, and cast back to the base's dtype before the activation).
    if len({tensor_val(s.base).dtype for s in sums}) != 1:
        return None
    dtype = tensor_val(region.incoming if region.incoming is not None else sums[0].base).dtype
    identified = _identify(region, backward, dtype)
    if identified is None:
        return None
    kind, layout, found = identified
    matched = set(found.values())
    inside = set(region.nodes) | set(region.seeds)
    needing = _needs_seed(region, matched)
    if any(user not in inside for node in needing for user in node.users):
        return None  # something outside still reads the rebuilt output: fusing would only duplicate the work
    if region.incoming is not None and _depends_on(region.incoming, matched):
        return None
    by_node = {s.node: s for s in sums}
    if kind == "swiglu":
        gate, up = (by_node[n] for n in layout)
        if not backward:
            return KernelCall(kind, torch.ops.fxmem.lora_swiglu_forward.default,
                              (gate.base, gate.xa, gate.b, gate.scaling, up.base, up.xa, up.b, up.scaling),
                              ("h",), found)
        if gate.quantized[3] != up.quantized[3]:
            return None
        return KernelCall(kind, torch.ops.fxmem.lora_swiglu_backward.default,
                          (region.incoming, *_quantized_args(gate), *_quantized_args(up), gate.quantized[3]),
                          ("grad_gate", "grad_up", "h"), found)
    (y,), (approximate,) = sums, layout
    if not backward:
        return KernelCall(kind, torch.ops.fxmem.lora_gelu_forward.default,
                          (y.base, y.xa, y.b, y.scaling, approximate), ("a",), found)
    return KernelCall(kind, torch.ops.fxmem.lora_gelu_backward.default,
                      (region.incoming, *_quantized_args(y), y.quantized[3], approximate), ("grad_y", "a"), found)


def _quantized_args(s: KernelOperands) -> tuple:
    packed, scale, zero, _ = s.quantized
    return packed, scale, zero, s.xa, s.b, s.scaling


def _last(graph: Graph, nodes: list[Node]) -> Node:
    wanted = set(nodes)
    last = None
    for node in graph.nodes:
        if node in wanted:
            last = node
    return last

