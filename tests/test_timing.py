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
