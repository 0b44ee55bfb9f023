"""Calibration slots: statistics over whole batches, then frozen scales and outlier channels."""

import torch

from fxmem.kernels.calibration import QuantSlot, register
from fxmem.kernels.quantize import quant_params


def _slot(**kw):
    defaults = {"name": "x", "channels": 8, "bits": 4, "outliers": 1, "outlier_values": 0.0, "calibration_steps": 3,
                "mode": "static"}
    return QuantSlot(**(defaults | kw))


def test_static_slot_freezes_scales_from_every_calibration_batch_then_stops_moving():
    slot = _slot()
    batches = [torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(3)]
    batches[1][..., 6] += 50  # channel 6 has the largest norm over the calibration batches
    for batch in batches:
        assert not slot.calibrated
        slot.observe(batch)
    assert slot.calibrated and slot.seen == 3
    rows = torch.cat([b.reshape(-1, 8) for b in batches])
    scale, zero = quant_params(rows.amin(0), rows.amax(0), 4)
    frozen_scale, frozen_zero, ids = slot.frozen
    assert torch.equal(frozen_scale, scale) and torch.equal(frozen_zero, zero) and ids.tolist() == [6]
    later = slot.observe(torch.randn(4, 5, 8) * 1000)
    assert all(a is b for a, b in zip(later, slot.frozen))


def test_dynamic_slot_recomputes_from_each_batch():
    slot = _slot(mode="dynamic", calibration_steps=1)
    small, large = torch.randn(3, 8), torch.randn(3, 8) * 100
    scale_small = slot.observe(small)[0]
    scale_large = slot.observe(large)[0]
    assert not slot.calibrated
    assert torch.equal(scale_large, quant_params(large.amin(0), large.amax(0), 4)[0])
    assert (scale_large > scale_small).all()


def test_non_finite_values_do_not_poison_the_statistics():
    slot = _slot(calibration_steps=1, outliers=0)
    x = torch.randn(6, 8)
    x[0, 0], x[1, 0] = float("nan"), float("inf")
    scale, zero, ids = slot.observe(x)
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all() and ids.numel() == 0


def test_the_op_returns_fresh_parameters_backward_can_keep():
    slot = _slot(calibration_steps=1)
    index = register(slot)
    x = torch.randn(2, 3, 8)
    packed, outliers, scale, zero, ids, positions, values = torch.ops.fxmem.quantize_saved(x, index)
    assert scale is not slot.frozen[0] and torch.equal(scale, slot.frozen[0])
    assert positions.numel() == 0 and values.numel() == 0  # outlier_values=0: none taken out
    restored = torch.ops.fxmem.dequantize(packed, outliers, scale, zero, ids, 4, positions, values)
    assert restored.shape == x.shape and torch.equal(restored[..., ids], x[..., ids])


def test_outlier_values_are_restored_exactly_and_leave_the_rest_a_narrower_grid():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 50, 16, generator=generator)
    x[3, 7, 5], x[10, 2, 9], x[20, 0, 0] = 80.0, -60.0, float("inf")  # spikes that would stretch their channels
    plain = register(_slot(channels=16, outliers=0, mode="dynamic"))
    split = register(_slot(channels=16, outliers=0, mode="dynamic", outlier_values=0.01))
    restored = {}
    for name, index in (("plain", plain), ("split", split)):
        *parts, positions, values = torch.ops.fxmem.quantize_saved(x, index)
        torch.library.opcheck(torch.ops.fxmem.quantize_saved.default, (x, index))
        restored[name] = torch.ops.fxmem.dequantize(*parts, 4, positions, values)
        if name == "split":
            assert positions.dtype == torch.int32 and positions.numel() == 64 * 50 * 16 // 100 == values.numel()
            flat = positions.long()
            assert {3 * 800 + 7 * 16 + 5, 10 * 800 + 2 * 16 + 9, 20 * 800 + 0} <= set(flat.tolist())
            assert torch.equal(restored[name].reshape(-1)[flat], x.reshape(-1)[flat])  # inf included
    finite = torch.isfinite(x)
    error = {name: (r - x)[finite].norm() / x[finite].norm() for name, r in restored.items()}
    assert error["split"] < 0.5 * error["plain"], error
