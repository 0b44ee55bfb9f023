"""The one solver (cost_model/solve.py) on plain lists, as torch's knapsack solvers are tested: no graph, no model."""

import pytest

from fxmem.cost_model.solve import Budget, Ceilings, Option, option_key, solve


def _option(unit, saves, seconds, error=0):
    return Option(unit, saves, seconds, error)


def _fit(target, offered, again=None):
    """Solves over ``offered`` (unit -> its options, fixed); returns each unit's last chosen option, in order."""
    chosen = []

    def apply(option):
        chosen.append(option)
        return (again or {}).pop(option.unit, ())

    solve(target, list(offered), lambda unit: offered[unit], apply)
    return chosen


def test_the_key_orders_by_error_class_then_seconds_per_byte_then_bytes():
    exact_dear, coded_cheap = _option("a", 100, 10.0, error=0), _option("a", 100, 0.0, error=1)
    assert option_key(exact_dear) < option_key(coded_cheap)
    cheap_per_byte, dear_per_byte = _option("a", 100, 1.0), _option("a", 10, 1.0)
    assert option_key(cheap_per_byte) < option_key(dear_per_byte)
    more, fewer = _option("a", 100, 0.0), _option("a", 10, 0.0)
    assert option_key(more) < option_key(fewer)
    assert option_key(_option("a", 0, 1.0)) == (0, float("inf"), 0)  # frees nothing: priced last in its class


def test_under_ceilings_each_unit_takes_its_best_option_within_its_own():
    offered = {"a": [_option("a", 50, 0.1, error=1), _option("a", 80, 5.0), _option("a", 30, 0.0)],
               "b": [_option("b", 10, 0.0), _option("b", 20, 0.0, error=2)]}
    chosen = _fit(Ceilings({"a": 40, "b": 15}), offered)
    # a: the exact 80 beats the coded 50 however dear; 30 frees too little. b: only the factored 20 is within
    assert chosen == [offered["a"][1], offered["b"][1]]


def test_under_ceilings_a_unit_with_nothing_within_takes_what_frees_most():
    offered = {"a": [_option("a", 10, 0.0), _option("a", 30, 9.0, error=3), _option("a", 30, 0.0)]}
    assert _fit(Ceilings({"a": 100}), offered) == [offered["a"][1]]  # the first of the two that free most


def test_under_ceilings_the_units_apply_names_are_chosen_again():
    offered = {"a": [_option("a", 10, 0.0)], "b": [_option("b", 10, 0.0)]}
    chosen = _fit(Ceilings({"a": 0, "b": 0}), offered, again={"b": ["a"]})
    assert [o.unit for o in chosen] == ["a", "b", "a"]


def test_under_a_budget_moves_are_taken_best_first_until_the_total_fits():
    offered = {"a": [_option("a", 40, 4.0, error=1)], "b": [_option("b", 40, 8.0)], "c": [_option("c", 40, 1.0)]}
    chosen = _fit(Budget(total=100, target=30), offered)
    assert [o.unit for o in chosen] == ["c", "b"]  # exact first, the cheaper per byte first: 100 - 80 fits


def test_under_a_budget_nothing_is_taken_once_it_fits_and_options_freeing_nothing_never():
    offered = {"a": [_option("a", 40, 0.0)], "b": [_option("b", 0, 0.0), _option("b", -5, -1.0)]}
    assert _fit(Budget(total=100, target=100), offered) == []
    assert _fit(Budget(total=100, target=0), offered) == [offered["a"][0]]


def test_under_a_budget_a_move_priced_before_another_changed_it_is_priced_again():
    prices = {"a": [_option("a", 50, 1.0)], "b": [_option("b", 50, 2.0)]}
    chosen = []

    def apply(option):
        chosen.append(option)
        if option.unit == "a":  # taking a makes b's move dearer than c's
            prices["b"] = [_option("b", 50, 9.0)]
            prices["c"] = [_option("c", 50, 3.0)]
            return ["c"]
        return []

    prices["c"] = []
    solve(Budget(total=150, target=50), ["a", "b", "c"], lambda unit: prices[unit], apply)
    assert [(o.unit, o.seconds) for o in chosen] == [("a", 1.0), ("c", 3.0)]


def test_under_a_budget_equal_keys_are_taken_in_the_units_order():
    offered = {unit: [_option(unit, 10, 1.0)] for unit in ("z", "a", "m")}
    assert [o.unit for o in _fit(Budget(total=30, target=0), offered)] == ["z", "a", "m"]


def test_a_target_of_another_type_is_refused_naming_the_two():
    with pytest.raises(TypeError, match="target must be Ceilings or Budget, not int"):
        solve(5, [], lambda unit: [], lambda option: [])
