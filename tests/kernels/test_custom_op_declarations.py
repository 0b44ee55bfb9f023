"""fxmem's custom ops are declared in a form every supported torch accepts (torch 2.11 through 2.13)."""

import ast
import pathlib

import fxmem

PACKAGE = pathlib.Path(fxmem.__file__).parent


def custom_op_tags() -> dict[str, ast.expr]:
    """The ``tags`` argument of every ``torch.library.custom_op(...)`` in the package, by op name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "custom_op":
                tags = next((k.value for k in node.keywords if k.arg == "tags"), None)
                if tags is not None:
                    found[ast.literal_eval(node.args[0])] = tags
    return found


def test_custom_op_tags_are_a_sequence():
    # torch 2.11 unpacks `tags` (`[pt2_compliant_tag, *tags]`): a bare torch.Tag fails at import there, which
    # torch 2.13 accepts. Seen on an H200 with torch 2.11: fxmem did not import.
    tags = custom_op_tags()
    assert {"fxmem::calibrated_params", "fxmem::lowrank_decompose", "fxmem::lowrank_decompose_rows"} <= set(tags)
    assert {name for name, value in tags.items() if not isinstance(value, ast.Tuple | ast.List)} == set()
