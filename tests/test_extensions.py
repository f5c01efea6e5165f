"""Extensions are complete records (issue 43 item 3): a caller asks a vision-language family what
it needs (``megatrain.planner.trace.vlm_family.VisionFamily``) instead of testing which family it
is, so adding a family touches the family's own module and its registry line, not the callers."""

import ast
from pathlib import Path

import megatrain

ROOT = Path(megatrain.__file__).parent

#: The modules that define a family record, where a test of its class is the family's own business.
FAMILY_MODULES = {"planner/trace/vlm.py", "planner/trace/qwen_vl.py", "planner/trace/vlm_family.py"}


def family_classes() -> set[str]:
    """The names of the classes the family modules define that end in ``Family``."""
    names = set()
    for rel in FAMILY_MODULES:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Family"):
                names.add(node.name)
    return names


def isinstance_tests(tree: ast.AST, classes: set[str]) -> list[int]:
    """Line numbers of ``isinstance(x, C)`` (C or a tuple holding C, by name or attribute) for C in ``classes``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(getattr(k, "id", getattr(k, "attr", None)) in classes for k in kinds):
                lines.append(node.lineno)
    return lines


def test_no_caller_tests_a_vision_language_familys_class():
    classes = family_classes()
    assert {"VisionLanguageFamily", "PatchGridFamily"} <= classes
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in FAMILY_MODULES:
            found += [f"megatrain/{rel}:{n}" for n in isinstance_tests(ast.parse(path.read_text()), classes)]
    assert not found, ("isinstance tests of a vision-language family outside its record; ask the family "
                       f"(vlm_family.VisionFamily) instead: {found}")


def test_the_check_sees_an_isinstance_branch():
    """The walk finds the branch the record replaced, so the test above could fail."""
    src = "def f(fam):\n    from x import PatchGridFamily\n    return isinstance(fam, (int, PatchGridFamily))\n"
    assert isinstance_tests(ast.parse(src), {"PatchGridFamily"}) == [3]
    assert isinstance_tests(ast.parse("isinstance(f, m.VisionLanguageFamily)"), {"VisionLanguageFamily"}) == [1]
