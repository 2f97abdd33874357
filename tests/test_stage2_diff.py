"""Stage 2 reads as a diff of stage 1 (docs/stage2.md, "The lesson in one diff"): the
functions stage 2 does not claim to change are stage 1's, compared as parsed code, and
the layer loop of model.forward is stage 1's with T renamed N and each call's output
buffer (`out=b.NAME`, the step's Scratch) set aside, except for the lines docs/stage2.md
lists as changed."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
from test_stage3_diff import functions

ROOT = Path(__file__).resolve().parent.parent
S1, S2 = ROOT / "stage1_cpu", ROOT / "stage2_batched"

# functions and methods that stage 2 does not change
UNCHANGED = {
    "ops.py": ["rmsnorm", "rope_tables", "llama3_inv_freq", "rope", "softmax"],
    "chat.py": ["build_engine"],
}

# what docs/stage2.md says changes inside the layer loop, as words that mark those lines
CLAIMED = {
    "wqkv": "stage 1 stacks q/k/v into one matrix (a CPU optimisation), stage 2 keeps them apart",
    "bqkv": "the biases follow the projections",
    "qkv": "the stacked projection is sliced into q, k, v",
    "w_gate_up": "gate and up stacked in stage 1, apart in stage 2",
    "cache.store": "store through the slot mapping",
    "kern.attention": "self.attention(q, layer, batch): paged decode and prefill kernels",
    "x = x +": "kern.residual_add: the residual add is a kernel on the device",
    "lw.router": "stage 1 tells a MoE layer by its router (its experts are two stacks), stage 2 by "
                 "its list of experts",
}


def layer_loop(path: Path) -> list[str]:
    """The code lines of the `for layer, lw in enumerate(w.layers)` loop in Model.forward,
    comments, indentation and output buffers (`, out=b.h`) dropped."""
    tree = ast.parse(path.read_text())
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    forward = next(n for n in model.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    loop = next(n for n in ast.walk(forward) if isinstance(n, ast.For))
    lines = path.read_text().split("\n")[loop.lineno - 1:loop.end_lineno]
    code = [re.sub(r", out=b\.\w+", "", re.sub(r"\s+#.*$", "", ln)).strip() for ln in lines]
    return [c for c in code if c and not c.startswith("#")]


@pytest.mark.parametrize("name", sorted(UNCHANGED))
def test_untouched_functions_are_stage1s(name):
    one, two = functions(S1 / name), functions(S2 / name)
    for fn in UNCHANGED[name]:
        assert fn in one and fn in two, f"{name}: {fn} is missing"
        assert one[fn] == two[fn], f"{name}: {fn} differs from stage 1's"


def test_layer_loop_is_stage1s_with_T_renamed_N_but_for_the_claimed_lines():
    one = [re.sub(r"\bT\b", "N", ln) for ln in layer_loop(S1 / "model.py")]
    two = set(layer_loop(S2 / "model.py"))
    assert len(one) > 15, "the layer loop was not found"
    changed = [ln for ln in one if ln not in two]
    unclaimed = [ln for ln in changed if not any(word in ln for word in CLAIMED)]
    assert not unclaimed, f"stage 2 changes lines docs/stage2.md does not mention: {unclaimed}"
    # and the claim is not vacuous: the norms, q/k norm, RoPE and the MLP are the same lines
    assert len(one) - len(changed) >= 9, changed


def test_the_model_diff_names_no_package():
    out = subprocess.run(["diff", "-u", str(S1 / "model.py"), str(S2 / "model.py")],
                         capture_output=True, text=True).stdout
    changed = [ln for ln in out.split("\n") if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert changed, "the two model.py files should differ"
    assert not [ln for ln in changed if re.search(r"stage[123]_\w+", ln)]
