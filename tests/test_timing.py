import pytest

from fxmem.timing import interleaved_step_times, step_times


def test_step_times_returns_one_sample_per_step():
    calls = []
    times = step_times(lambda: calls.append(1), steps=3, warmup=2)
    assert len(times) == 3 and len(calls) == 5 and all(t >= 0 for t in times)


def test_interleaved_step_times_rotate_the_order():
    calls = []
    samples = interleaved_step_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                     steps=2, warmup=1)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert {name: len(times) for name, times in samples.items()} == {"a": 2, "b": 2}


def test_a_round_ratio_is_the_median_of_the_per_round_ratios_with_their_range():
    from fxmem.timing import round_ratio
    ratio = round_ratio([2.0, 3.0, 1.2], [1.0, 2.0, 1.0])  # rounds: 2.0, 1.5, 1.2
    assert (ratio.median, ratio.low, ratio.high) == (1.5, 1.2, 2.0)
    assert str(ratio) == "1.50x (1.20-2.00)"
    with pytest.raises(ValueError):
        round_ratio([1.0, 2.0], [1.0])  # rounds of two runs: the same count
