"""The exercises (course/exercises, docs/exercises.md) cannot pass vacuously: for every
exercise, its check fails on the stub that `start` writes and passes once the reference
body is put back; for the stage-1 ones, plausible wrong answers fail too, with a message
that names the mismatch. The CLI is run once end to end."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from course.exercises import EXERCISES, get
from course.exercises import base

ROOT = Path(__file__).resolve().parent.parent
# a stub's prange loop cannot run in parallel, and numba says so: not what these tests are about
pytestmark = pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaPerformanceWarning")
IDS = [e.id for e in EXERCISES]


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def test_the_exercises_are_listed_in_course_order_with_sections_that_exist():
    assert len(EXERCISES) >= 9
    for stage in "123":
        ns = [int(e.id.split(".")[1]) for e in EXERCISES if e.id.startswith(stage + ".")]
        assert ns == list(range(1, len(ns) + 1)), f"stage {stage}'s ids are not 1, 2, ... in order: {ns}"
    assert [e.id[0] for e in EXERCISES] == sorted(e.id[0] for e in EXERCISES)
    for e in EXERCISES:
        doc, _, anchor = e.section.partition("#")
        text = (ROOT / doc).read_text()
        anchors = {slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}
        assert anchor in anchors, f"{e.id}: {e.section} is not a heading of {doc}"
        assert base.reference_region(e), f"{e.id}: the region in {e.file} is empty"
        for rel in e.needs:
            assert (ROOT / rel).is_file(), f"{e.id}: needs {rel}, which does not exist"


def test_every_marker_in_the_code_belongs_to_a_listed_exercise():
    found = set()
    for folder in ("stage1_cpu", "stage2_batched", "stage3_optimized", "common"):
        for p in (ROOT / folder).rglob("*"):
            if p.suffix in (".py", ".cu") and p.is_file() and "exercises" not in p.parts:
                for m in re.finditer(r"^\s*(#|//) exercise (\d+\.\d+) (begin|end)$", p.read_text(), flags=re.M):
                    found.add((m.group(2), str(p.relative_to(ROOT))))
    listed = {(e.id, e.file) for e in EXERCISES}
    # a stage-2 region in code that stage 3 keeps has its markers in stage 3's file too, so that
    # the lesson series (docs/lessons) carries them instead of showing them removed
    found -= {(i, f.replace("stage2_batched/", "stage3_optimized/", 1)) for i, f in listed
              if f.startswith("stage2_batched/")}
    assert found == listed, f"markers without an exercise: {found - listed}; exercises without markers: {listed - found}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ex_id", IDS)
def test_check_fails_on_the_stub_and_passes_on_the_reference(ex_id, tmp_path):
    ex = get(ex_id)
    ws = base.start(ex, tmp_path / "ws")
    assert base.is_stub(ex, ws) or ex.file.endswith(".cu")
    stub = base.run_check(ex, ws)
    assert not stub.passed, f"{ex_id}: the check passes on the stub"
    assert stub.message.startswith("not written yet"), f"{ex_id}: {stub.message}"   # .cu stubs too
    base.put_back_reference(ex, ws)
    ref = base.run_check(ex, base.Workspace(ws.root))
    assert ref.passed, f"{ex_id}: the check fails on the reference code: {ref.message}"


# Plausible wrong answers for stage 1: (id, text in the reference region, its replacement,
# words the failure message must contain). Each must fail its check.
WRONG = [
    ("1.1", "ss / np.float32(C)", "ss", "rmsnorm"),                                # sum, not mean
    ("1.1", "ss / np.float32(C) + np.float32(eps))", "ss / np.float32(C)) + np.float32(eps)", "eps"),
    ("1.2", "x2 = x[t, h, half + i]", "x2 = x[t, h, i + 1 if i + 1 < half else i]", "rotate-half"),
    ("1.3", "e = exp_f32(scores[g, j] - mx)", "e = exp_f32(scores[g, j])", "large scores"),
    ("1.4", "n = start_pos + t + 1", "n = start_pos + q.shape[0]", "causal"),  # sees the future
    ("1.4", "h0 = kvh * group", "h0 = kvh", "head"),                          # wrong GQA mapping
    ("1.5", "self.cached_ids = self.cached_ids[:n]", "pass", "turn"),         # keeps a stale tail
    ("1.5", "limit = min(len(self.cached_ids), len(prompt) - 1)",
     "limit = min(len(self.cached_ids), len(prompt))", "turn"),               # nothing left to feed
    ("1.6", "    if norm:\n", "    if False:\n", "renormalis"),
    ("1.6", "(best < 0 or logits[t, e] > logits[t, best])",
     "(best < 0 or logits[t, e] >= logits[t, best])", "tie"),
    ("1.7", "for e in np.unique(flat):", "for e in flat:", "once"),           # one matmul per slot
    ("1.8", "s = _to_f16(np.abs(g).max(axis=-1) / 127.0)", "s = _to_f16(g.max(axis=-1) / 127.0)", "scale"),
    ("1.8", "sf = s.astype(np.float32)[:, :, None]",
     "sf = (np.abs(g).max(axis=-1) / 127.0).astype(np.float32)[:, :, None]", "q"),  # the unrounded scale
    ("1.9", "acc += part * f16_to_f32(s[r, g])", "acc += part * f16_to_f32(s[r, 0])", "row"),
    ("1.10", "packed = q[:, 0::2] | (q[:, 1::2] << 4)", "packed = (q[:, 0::2] << 4) | q[:, 1::2]", "nibble"),
    ("1.10", "m = _to_f16(lo)", "m = _to_f16(lo * 0 + g.mean(axis=-1))", "min"),
    ("1.11", "+ f16_to_f32(m[r, 2 * p]) * xsum[t, p, 0]", "", "row"),        # forgets the minimum
    ("1.12", "logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.astype(np.float32)",
     "logits[ids] -= (params.presence_penalty + params.frequency_penalty) * counts.astype(np.float32)", "presence"),
    ("1.12", "x / params.repetition_penalty, x * params.repetition_penalty",
     "x / params.repetition_penalty, x / params.repetition_penalty", "repetition"),
    ("1.13", "keep_sorted = (cum - probs[order]) < params.top_p", "keep_sorted = cum < params.top_p", "top_p"),
    ("1.13", "(cum - probs[order]) < params.top_p", "(cum - probs[order]) <= params.top_p", "top_p 0.5"),
    ("1.13", "logits[probs < params.min_p * probs.max()] = -np.inf", "logits[probs < params.min_p] = -np.inf",
     "min_p"),
    ("1.14", "if rng.random() * q[x] < p[x]:", "if int(rng.choice(len(p), p=p)) == x:", "distribution"),  # naive
    ("1.14", "if rng.random() * q[x] < p[x]:              # u < p[x] / q[x], without dividing by q[x]\n        return True, x",
     "y = int(rng.choice(len(p), p=p))\n    return y == x, y", "accepted"),         # exact, but accepts less
    ("1.14", "rng.choice(len(p), p=residual / residual.sum())", "rng.choice(len(p), p=p)", "distribution"),
    # stages 2 and 3
    ("2.1", "    if (slot < 0) return;                      // a padding token owns no slot\n", "", "slot -1"),
    ("2.2", "seq.block_table.append(page)", "seq.block_table.insert(0, page)", "stay first"),
    ("2.3", "        seq.block_table = []", "", "block table"),
    ("2.4", "victim = self.running[-1]", "victim = self.running[0]", "preempted"),        # the oldest
    ("2.4", "n = min(seq.num_uncomputed, budget)", "n = seq.num_uncomputed", "budget"),
    ("2.4", "                if victim is seq:\n                    break\n", "", "itself"),  # preempts on for it
    ("2.5", "const int g = h / (H / Hkv);", "const int g = h % Hkv;", "head 1"),          # wrong GQA mapping
    ("3.1", "self._key(parent, chunk)", "self._key(None, chunk)", "parent"),             # an unchained key
    ("3.1", "key.ids != chunk or key.parent is not parent", "key.parent is not parent", "same P ids"),
    ("3.1", "key.ids != chunk or key.parent is not parent", "key.ids != chunk", "parent"),
    ("3.2", "l_all += ml[2 * j + 1] * expf(ml[2 * j] - m_all);", "l_all += ml[2 * j + 1];", "exp(m_j - M)"),
    ("3.3", "(row < count && t <= my_pos)", "(row < count)", "mask"),                    # no causal mask
    ("3.3", "o[kk][j] = o[kk][j] * correction + slice[j];", "o[kk][j] = o[kk][j] + slice[j];", "rescale"),
    ("3.4", "rsqrtf(total / (float)C + eps)", "rsqrtf(total + eps)", "mean"),          # a sum, not a mean
    ("3.5", "slot_mapping=pad(batch.slot_mapping, -1)", "slot_mapping=pad(batch.slot_mapping, 0)", "slot -1"),
    ("3.5", "return pad(tokens, 0), padded", "return tokens, padded", "tokens"),         # the unpadded size
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ex_id,old,new,words", WRONG, ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG)])
def test_a_plausible_wrong_answer_fails_and_the_message_names_it(ex_id, old, new, words, tmp_path):
    if ex_id not in IDS:
        pytest.fail(f"exercise {ex_id} is not listed")
    ex = get(ex_id)
    ws = base.start(ex, tmp_path / "ws")
    body = "\n".join(base.reference_region(ex))
    assert old in body, f"{ex_id}: {old!r} is not in the reference region"
    p = ws.path(ex.file)
    p.write_text(base.replace_region(p.read_text(), ex.id, ex.file, body.replace(old, new, 1).split("\n")))
    out = base.run_check(ex, base.Workspace(ws.root))
    assert not out.passed, f"{ex_id}: the check passes on a wrong answer ({old!r} -> {new!r})"
    assert words.lower() in out.message.lower(), f"{ex_id}: the message does not say {words!r}: {out.message}"
    assert not out.message.startswith("not written yet")


def cli(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "course.exercises", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


@pytest.mark.timeout(600)
def test_the_command_line_lists_starts_refuses_and_checks(tmp_path):
    out = cli("list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().split("\n")
    assert [ln.split()[0] for ln in lines] == IDS
    for ln, e in zip(lines, EXERCISES):
        assert e.title in ln and e.section in ln and ln.rstrip().endswith(e.difficulty)

    ex = get("1.12")                                   # a numpy exercise: no compile, a quick check
    ws = tmp_path / "ws"
    out = cli("start", ex.id, str(ws))
    assert out.returncode == 0, out.stderr
    assert str(ws / ex.file) in out.stdout and f"check {ex.id}" in out.stdout
    assert "NotImplementedError" in (ws / ex.file).read_text()

    again = cli("start", ex.id, str(ws))               # DIR exists and is not empty
    assert again.returncode != 0 and "not empty" in again.stderr

    stub = cli("check", ex.id, str(ws))
    assert stub.returncode == 1 and "fail" in stub.stdout and "not written yet" in stub.stdout, stub.stdout

    base.put_back_reference(ex, base.Workspace(ws))
    ok = cli("check", ex.id, str(ws))
    assert ok.returncode == 0 and "pass" in ok.stdout, ok.stdout + ok.stderr

    unknown = cli("check", "9.99", str(ws))
    assert unknown.returncode == 2 and "no exercise '9.99'" in unknown.stderr
    missing = cli("check", ex.id, str(tmp_path / "absent"))
    assert missing.returncode == 2 and "start" in missing.stderr


def test_a_workspace_module_shadows_only_its_own_files(tmp_path):
    """Two workspaces in one process do not collide, nor touch the real stage1_cpu modules."""
    import stage1_cpu.quant as real
    ex = get("1.8")
    a, b = base.start(ex, tmp_path / "a"), base.start(ex, tmp_path / "b")
    base.put_back_reference(ex, b)
    qa, qb = a.module(ex.file), b.module(ex.file)
    assert qa is not qb and qa is not real and sys.modules["stage1_cpu.quant"] is real
    assert Path(qa.__file__).resolve() == (tmp_path / "a" / ex.file).resolve()
    # the relative import `from . import matmul` found the installed file, under the workspace's package
    assert Path(qa.matmul.__file__).resolve() == (ROOT / "stage1_cpu" / "matmul.py").resolve()
    assert qa.matmul is not sys.modules.get("stage1_cpu.matmul")
    import numpy as np
    g = np.ones((1, 1, 32), np.float32)
    with pytest.raises(NotImplementedError):
        qa._quantize_int8(g)
    assert qb._quantize_int8(g)[0].max() == 127
    a.close()
    b.close()
    assert not [n for n in sys.modules if n.startswith((a.prefix + ".", b.prefix + "."))]


def test_docs_exercises_md_describes_every_exercise_in_course_order():
    text = (ROOT / "docs/exercises.md").read_text()
    headings = re.findall(r"^### (\d+\.\d+) ", text, flags=re.M)
    assert headings == IDS, "docs/exercises.md needs one '### ID title' section per exercise, in course order"
    for e in EXERCISES:
        sec = text.split(f"### {e.id} ", 1)[1].split("\n### ", 1)[0]
        for part in ("**Read first:**", "**Shapes:**", "**Hint:**", "**The check:**"):
            assert part in sec, f"docs/exercises.md, {e.id}: no {part}"


@pytest.mark.parametrize("trouble", ["skip", "missing package", "missing file"])
def test_a_check_that_skips_or_misses_something_is_a_failure_that_says_so(trouble, tmp_path):
    def check(ws):
        if trouble == "skip":
            pytest.skip("no GPU")
        if trouble == "missing package":
            import qs_no_such_package  # noqa: F401
        ws.module("stage1_cpu/not_there.py")
    ex = base.Exercise("1.99", "a check in trouble", "docs/stage1.md#reading-order", "easy", "common/sampling.py",
                       check=check)
    ws = base.Workspace(tmp_path)
    (tmp_path / "common").mkdir()
    (tmp_path / "common/sampling.py").write_text((ROOT / "common/sampling.py").read_text())
    out = base.run_check(ex, ws)
    assert not out.passed
    words = {"skip": "skipped", "missing package": "pip install", "missing file": "not_there.py is missing"}
    assert words[trouble] in out.message, out.message
