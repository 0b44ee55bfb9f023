"""A SwiGLU MLP with a LoRA on each of its three linears, over chunks of tokens: its (tokens x ffn) tensors never
exist whole.

``down(silu(gate(x)) * up(x))`` holds, at its widest, several tensors of the MLP's width (ffn, 3.5x the hidden
size in Llama) for every token: the gate's and up's outputs, their product, and in backward their gradients. At
long context they are the step's largest transients. ``chunked_swiglu_mlp`` runs the MLP ``chunk_rows`` tokens
at a time in forward, saves only its input for backward, and in backward recomputes each chunk's gate and up
outputs and takes its gradients, so that no more than one chunk of MLP-wide tensors lives at once. The price is
the gate and up products run again in backward. The base weights are frozen (PEFT's); the LoRA gradients
accumulate in float32.

A LoRA linear is PEFT's (kernels/chunked_lora_linear.py). ``swiglu_mlp_reference`` is the unchunked torch
computation the op is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxmem.kernels.chunked_lora_linear import LoraLinear, lora_linear, lora_linear_backward


def swiglu_mlp_reference(x: Tensor, gate: LoraLinear, up: LoraLinear, down: LoraLinear) -> Tensor:
    return lora_linear(torch.nn.functional.silu(lora_linear(x, gate)) * lora_linear(x, up), down)


def chunked_swiglu_mlp(x: Tensor, gate: LoraLinear, up: LoraLinear, down: LoraLinear, chunk_rows: int) -> Tensor:
    """``swiglu_mlp_reference`` ``chunk_rows`` tokens at a time. x: (..., hidden)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1; got {chunk_rows}")
    for name, linear in (("gate", gate), ("up", up), ("down", down)):
        if linear.weight.requires_grad:
            raise ValueError(f"the {name} projection's base weight trains: the chunked MLP takes frozen base weights "
                             "(a LoRA's)")
    return _chunked_mlp(x, gate.weight, gate.a, gate.b, gate.scale, up.weight, up.a, up.b, up.scale,
                        down.weight, down.a, down.b, down.scale, chunk_rows)


def workspace_bytes(rows: int, chunk_rows: int, width: int, element_size: int, *, backward: bool) -> int:
    """The most bytes the op holds at once beyond its inputs and outputs: one chunk's MLP-wide tensors. Measured
    (tests/kernels/test_chunked_mlp.py): forward, five of the chunk's float32 sums of a base and a LoRA product (an
    fp32 adapter promotes them); backward, five in the model's dtype and three in float32 (the hidden- and
    rank-wide rows beside them, and the LoRA gradients' accumulators, are within one float32 row of the hidden
    width per token)."""
    chunk = min(rows, chunk_rows)
    if not backward:
        return 5 * chunk * width * 4
    return chunk * width * (5 * element_size + 3 * 4)


def _linears(weights: tuple) -> tuple[LoraLinear, LoraLinear, LoraLinear]:
    return LoraLinear(*weights[0:4]), LoraLinear(*weights[4:8]), LoraLinear(*weights[8:12])


@torch.library.custom_op("fxmem::chunked_swiglu_mlp", mutates_args=())
def _chunked_mlp(x: Tensor, gate_w: Tensor, gate_a: Tensor, gate_b: Tensor, gate_scale: float, up_w: Tensor,
                 up_a: Tensor, up_b: Tensor, up_scale: float, down_w: Tensor, down_a: Tensor, down_b: Tensor,
                 down_scale: float, chunk_rows: int) -> Tensor:
    gate, up, down = _linears((gate_w, gate_a, gate_b, gate_scale, up_w, up_a, up_b, up_scale,
                               down_w, down_a, down_b, down_scale))
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty(rows.shape[0], down_w.shape[0])
    for start in range(0, rows.shape[0], chunk_rows):
        out[start:start + chunk_rows] = swiglu_mlp_reference(rows[start:start + chunk_rows], gate, up, down)
    return out.reshape(*x.shape[:-1], down_w.shape[0])


@_chunked_mlp.register_fake
def _(x, gate_w, gate_a, gate_b, gate_scale, up_w, up_a, up_b, up_scale, down_w, down_a, down_b, down_scale,
      chunk_rows):
    return x.new_empty(*x.shape[:-1], down_w.shape[0])


@torch.library.custom_op("fxmem::chunked_swiglu_mlp_backward", mutates_args=())
def _chunked_mlp_backward(grad_out: Tensor, x: Tensor, gate_w: Tensor, gate_a: Tensor, gate_b: Tensor,
                          gate_scale: float, up_w: Tensor, up_a: Tensor, up_b: Tensor, up_scale: float,
                          down_w: Tensor, down_a: Tensor, down_b: Tensor, down_scale: float, chunk_rows: int
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d x, and d A, d B of gate, up and down)."""
    gate, up, down = _linears((gate_w, gate_a, gate_b, gate_scale, up_w, up_a, up_b, up_scale,
                               down_w, down_a, down_b, down_scale))
    rows, grad_rows = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
    grad_x = torch.empty_like(rows)
    lora_grads = [torch.zeros(t.shape, dtype=torch.float32, device=x.device)
                  for t in (gate_a, gate_b, up_a, up_b, down_a, down_b)]
    for start in range(0, rows.shape[0], chunk_rows):
        end = start + chunk_rows
        _chunk_backward(rows[start:end], grad_rows[start:end], gate, up, down, grad_x[start:end], lora_grads)
    a_like = (gate_a, gate_b, up_a, up_b, down_a, down_b)
    return (grad_x.reshape(x.shape), *(g.to(t.dtype) for g, t in zip(lora_grads, a_like, strict=True)))


def _chunk_backward(x: Tensor, grad_out: Tensor, gate: LoraLinear, up: LoraLinear, down: LoraLinear,
                    grad_x: Tensor, lora_grads: list[Tensor]) -> None:
    """One chunk: writes its rows of ``grad_x``, adds into the LoRA gradients. A function of its own so that its
    MLP-wide tensors are freed before the next chunk's are made."""
    g, u = lora_linear(x, gate), lora_linear(x, up)
    sigmoid = torch.sigmoid(g)
    activated = g * sigmoid
    grad_h = _linear_backward(activated * u, grad_out, down, lora_grads[4:6])
    grad_g = grad_h * u * (sigmoid * (1 + g * (1 - sigmoid)))
    grad_u = grad_h * activated
    del g, u, sigmoid, activated, grad_h
    grad_x.copy_(_linear_backward(x, grad_g, gate, lora_grads[0:2]))
    grad_x.add_(_linear_backward(x, grad_u, up, lora_grads[2:4]))


def _linear_backward(x: Tensor, grad_out: Tensor, linear: LoraLinear, lora_grads: list[Tensor]) -> Tensor:
    """d x of ``lora_linear(x, linear)``; adds d A and d B into ``lora_grads``."""
    base, adapter = lora_linear_backward(x.to(linear.a.dtype), grad_out, linear, lora_grads)
    return base + adapter.to(x.dtype)


@_chunked_mlp_backward.register_fake
def _(grad_out, x, gate_w, gate_a, gate_b, gate_scale, up_w, up_a, up_b, up_scale, down_w, down_a, down_b,
      down_scale, chunk_rows):
    return (torch.empty_like(x), *(torch.empty_like(t) for t in (gate_a, gate_b, up_a, up_b, down_a, down_b)))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*(inputs[i] for i in (0, 1, 2, 3, 5, 6, 7, 9, 10, 11)))
    ctx.scales = (inputs[4], inputs[8], inputs[12])
    ctx.chunk_rows = inputs[13]


def _backward(ctx, grad_out):
    x, gate_w, gate_a, gate_b, up_w, up_a, up_b, down_w, down_a, down_b = ctx.saved_tensors
    gate_scale, up_scale, down_scale = ctx.scales
    grad_x, *lora = _chunked_mlp_backward(grad_out, x, gate_w, gate_a, gate_b, gate_scale, up_w, up_a, up_b,
                                          up_scale, down_w, down_a, down_b, down_scale, ctx.chunk_rows)
    ga, gb, ua, ub, da, db = lora
    return grad_x, None, ga, gb, None, None, ua, ub, None, None, da, db, None, None


_chunked_mlp.register_autograd(_backward, setup_context=_setup_context)
