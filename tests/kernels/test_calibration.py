"""Static calibration slots: statistics over whole batches, then frozen scales and outlier channels."""

import torch

from fxmem.kernels import quantize as q
from fxmem.kernels.calibration import QuantSlot, register


def _slot(**kw):
    return QuantSlot(**({"name": "x", "channels": 8, "bits": 4, "outliers": 1, "calibration_steps": 3} | kw))


def _stats(x):
    low, high, _, _, square_norm = q.channel_stats(x)
    return low, high, square_norm


def test_a_slot_freezes_scales_from_every_calibration_batch_then_stops_moving():
    slot = _slot()
    batches = [torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(3)]
    batches[1][..., 6] += 50  # channel 6 has the largest norm over the calibration batches
    for batch in batches:
        assert not slot.calibrated
        slot.observe(*_stats(batch))
    assert slot.calibrated and slot.seen == 3
    rows = torch.cat([b.reshape(-1, 8) for b in batches])
    scale, zero = q.quant_params(rows.amin(0), rows.amax(0), 4)
    frozen_scale, frozen_zero, ids = slot.frozen
    assert torch.equal(frozen_scale, scale) and torch.equal(frozen_zero, zero) and ids.tolist() == [6]
    later = slot.observe(*_stats(torch.randn(4, 5, 8) * 1000))
    assert all(a is b for a, b in zip(later, slot.frozen, strict=True))


def test_a_slot_keeps_copies_of_the_statistics_the_compiled_forward_may_overwrite():
    slot = _slot()
    stats = _stats(torch.randn(4, 5, 8))
    kept = [t.clone() for t in stats]
    slot.observe(*stats)
    for t in stats:  # inductor reuses a buffer once the op that read it returns
        t.fill_(float("nan"))
    assert all(torch.equal(a, b) for a, b in zip((slot.low, slot.high, slot.square_norm), kept, strict=True))


def test_non_finite_values_do_not_poison_the_statistics():
    slot = _slot(calibration_steps=1, outliers=0)
    x = torch.randn(6, 8)
    x[0, 0], x[1, 0] = float("nan"), float("inf")
    scale, zero, ids = slot.observe(*_stats(x))
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all() and ids.numel() == 0


def test_the_op_returns_fresh_parameters_backward_can_keep_and_quantizes_with_them():
    slot = _slot(calibration_steps=1)
    index = register(slot)
    x = torch.randn(2, 3, 8)
    torch.library.opcheck(torch.ops.fxmem.calibrated_params.default, (*_stats(x), register(_slot())))
    scale, zero, ids = torch.ops.fxmem.calibrated_params(*_stats(x), index)
    assert scale is not slot.frozen[0] and torch.equal(scale, slot.frozen[0])
    spec = q.QuantSpec(8, 4, outliers=1)
    parts = q.quantize(x * 100, spec, slot=index)  # frozen: the scales stay the first batch's, values clamp
    assert torch.equal(parts[1], slot.frozen[0]) and slot.seen == 2
    restored = q.dequantize(parts, spec, x.dtype)
    assert restored.shape == x.shape and torch.equal(restored[..., ids], (x * 100)[..., ids])
