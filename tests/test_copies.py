"""Deliberate copies between algorithm files must not drift, and the files must keep their one shape:
- every top-level function, class or constant defined in more than one script has identical source in all of them;
- the fenced plumbing section is byte-identical in the five scripts;
- no top-level script imports another (they share only gpt2.py and data/; experiments may also use adam_tf.py);
- random streams are keyed by tuples, never `seed + epoch` (which makes seed 2's epoch 0 equal seed 1's epoch 1)."""

import ast
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [
    "sft.py",
    "reward.py",
    "dpo.py",
    "ppo.py",
    "ppo_variants.py",
    "grpo.py",
    "grpo_variants.py",
]
FENCE = "# ---- plumbing: identical in every script (tests/test_copies.py)"
SCRIPT_SPECIFIC = {"Args", "main", "SHOW", "MOVED", "check_args", "make_eval"}  # each its own
# A sibling's versions of its plain file's functions with the variants' branches beside the plain
# formula: the same at the plain file's flags (tests/test_grpo.py pins the metrics bit for bit).
EXTENDED = {
    ("grpo.py", "grpo_variants.py"): {
        "kl_penalty",
        "group_advantages",
        "grpo_loss",
        "sample_responses",
        "no_grad_logprobs",
    },
    ("ppo.py", "ppo_variants.py"): {"policy_loss"},
}
LIBRARIES = {"gpt2", "data"}  # what a script may import from this repository


def definitions(path: Path) -> dict[str, str]:
    src = path.read_text()
    out = {}
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = ast.get_source_segment(src, node)
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            out[node.targets[0].id] = ast.get_source_segment(src, node)
    return {k: v for k, v in out.items() if k not in SCRIPT_SPECIFIC}


def test_shared_helpers_identical():
    sources = defaultdict(dict)
    for name in SCRIPTS:
        for fn, src in definitions(ROOT / name).items():
            sources[fn][name] = src
    # adam_tf.py is the optimizer's reference (with its argument checks); ppo.py's AdamTF is trimmed, its step is not
    sources["adam_tf_step"]["adam_tf.py"] = definitions(ROOT / "adam_tf.py")["adam_tf_step"]
    shared = {fn: files for fn, files in sources.items() if len(files) > 1}
    # first_true_indices, response_mask, greedy_accuracy, get_reward: now in gpt2.py and data/
    for must in (
        "setup_distributed",
        "checkpoint",
        "shard",
        "lr_at",
        "all_reduce_dict",
        "adam_tf_step",
    ):
        assert must in shared, f"{must} is no longer shared: did a script rename it?"
    for (plain, sibling), names in EXTENDED.items():
        for fn in names:
            assert plain in sources[fn] and sibling in sources[fn], f"{fn}: no longer in both"
            del sources[fn][sibling]
    drifted = [
        f"{fn}: {sorted(files)}" for fn, files in shared.items() if len(set(files.values())) > 1
    ]
    assert not drifted, "copies drifted (make them identical): " + "; ".join(drifted)


def test_plumbing_section_is_identical_and_last():
    sections = {}
    for name in SCRIPTS:
        src = (ROOT / name).read_text()
        assert src.count(FENCE) == 1, f"{name}: the plumbing fence must appear exactly once"
        section = src[src.index(FENCE) :]
        last = 'if __name__ == "__main__":\n    try:\n        main(parse_args(sys.argv[1:]))'
        assert last in section and section.index(last) > section.index("def exit_on"), name
        sections[name] = section
    assert len(set(sections.values())) == 1, "plumbing sections differ: " + ", ".join(sections)


def test_the_algorithm_comes_first():
    """Docstring → imports → Args → the math: the first function of every script is within its first 150 lines."""
    for name in SCRIPTS + ["adam_tf.py"]:
        tree = ast.parse((ROOT / name).read_text())
        first_fn = next(
            n
            for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name != "Args"
        )
        assert first_fn.lineno <= 150, (
            f"{name}: first function {first_fn.name} at line {first_fn.lineno}"
        )


def test_no_imports_between_top_level_scripts():
    own = {p.stem for p in ROOT.glob("*.py")}
    for path in [*ROOT.glob("*.py"), *ROOT.glob("experiments/*.py")]:
        allowed = LIBRARIES | ({"adam_tf"} if path.parent.name == "experiments" else set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            bad = {n.split(".")[0] for n in names} & (own - allowed)
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}: copy what it needs instead"


def test_random_streams_are_keyed_by_tuples():
    for path in [*ROOT.glob("*.py"), *ROOT.glob("experiments/*.py")]:
        src = path.read_text()
        assert not re.search(r"default_rng\([^)\[]*seed\s*\+", src), (
            f"{path.name}: use default_rng([seed, ...])"
        )
    # numpy ignores a key's trailing zeros ([seed, 0] == [seed]): the project's keys end in a
    # nonzero stream tag (a literal, a constant or bytes), so no two streams can meet
    for path in [*ROOT.glob("*.py"), ROOT / "data" / "__init__.py"]:
        for key in re.findall(r"default_rng\(\[([^\]]*)\]", path.read_text()):
            last = key.split(",")[-1].strip()
            assert re.fullmatch(r"[1-9]\d*|[A-Z_]+|\*b\"\w+\"", last), f"{path.name}: [{key}]"
    assert np.array_equal(  # the numpy behaviour the rule guards against
        np.random.default_rng([1, 5]).random(3), np.random.default_rng([1, 5, 0]).random(3)
    )
    # the property the rule buys: seed 2's epoch 0 is not seed 1's epoch 1
    a = np.random.default_rng([1, 1]).permutation(100)
    b = np.random.default_rng([2, 0]).permutation(100)
    assert not np.array_equal(a, b)


def test_no_script_redefines_what_gpt2_or_data_provide():
    """The model, its I/O, the masks and the eval live once, in gpt2.py and data/: no script copy."""
    shared = set(definitions(ROOT / "gpt2.py")) | set(definitions(ROOT / "data" / "__init__.py"))
    shared -= {"RunError"}  # the plumbing names gpt2.RunError for its own use
    for name in SCRIPTS:
        again = shared & set(definitions(ROOT / name))
        assert not again, f"{name} redefines {sorted(again)}: use gpt2's or data's"
