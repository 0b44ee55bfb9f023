"""`fxmem bench lowrank-error`: each way of rebuilding a low-rank factorization against the optimum."""

import pytest
import torch

from fxmem import cli
from fxmem_bench.lowrank_error import measure, rebuild_methods
from tests.kernels.test_lowrank import low_rank_plus_noise


def test_the_error_benchmark_compares_every_method_against_the_optimum():
    matrices = [("wide", low_rank_plus_noise(48, 96, 8, 0.2, seed=0)), ("tall", low_rank_plus_noise(96, 48, 8, 0.2, 1)),
                ("all of it", torch.randn(4, 64))]  # rank 8 of a 4-row matrix: skipped, nothing to compress
    rows = measure(matrices, 8, niter=1, repeats=2)
    assert [r.matrix for r in rows] == ["wide"] * 4 + ["tall"] * 4
    assert {r.method for r in rows} == set(rebuild_methods(1))
    for r in rows:
        assert r.rank == 8 and r.seconds > 0
        assert r.vs_optimal == 1.0 if r.method.startswith("truncated") else r.vs_optimal >= 1 - 1e-5


def test_the_error_command_refuses_a_bad_rank(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "lowrank-error", "--rank", "1.5"])
    assert "an integer rank >= 1; got 1.5" in capsys.readouterr().err
