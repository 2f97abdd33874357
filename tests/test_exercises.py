"""The exercises (course/exercises, docs/exercises.md) cannot pass vacuously: for every
exercise, its check fails on the stub that `start` writes and passes once the reference
body is put back; two to four plausible wrong answers planted in each fail too, each with a
message that names its own mistake and no other's. The CLI is run once end to end."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from course.chapter_tests import slug
from course.exercises import EXERCISES, get
from course.exercises import base

ROOT = Path(__file__).resolve().parent.parent
# a stub's prange loop cannot run in parallel, and numba says so: not what these tests are about
pytestmark = pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaPerformanceWarning")
IDS = [e.id for e in EXERCISES]


def test_the_exercises_are_listed_in_course_order_with_sections_that_exist():
    assert len(EXERCISES) >= 9
    for stage in "123":
        ns = [int(e.id.split(".")[1]) for e in EXERCISES if e.id.startswith(stage + ".")]
        assert ns == list(range(1, len(ns) + 1)), (
            f"stage {stage}'s ids are not 1, 2, ... in order: {ns}"
        )
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
                for m in re.finditer(
                    r"^\s*(#|//) exercise (\d+\.\d+) (begin|end)$", p.read_text(), flags=re.M
                ):
                    found.add((m.group(2), str(p.relative_to(ROOT))))
    listed = {(e.id, e.file) for e in EXERCISES}
    # a stage-2 region in code that stage 3 keeps has its markers in stage 3's file too, so that
    # the lesson series (docs/lessons) carries them instead of showing them removed
    found -= {(i, f.replace("stage2_batched/", "stage3_optimized/", 1)) for i, f in listed
              if f.startswith("stage2_batched/")}
    assert found == listed, (
        f"markers without an exercise: {found - listed}; "
        f"exercises without markers: {listed - found}"
    )


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


# Planted mistakes, two to four per exercise: (id, text in the reference region, its replacement,
# the words its message must hold). Each must fail its check with a message that holds its own
# words and none of the other mistakes' of the same exercise: the message points at that mistake.
ROPE = ("x1 * cos[t, i] - x2 * sin[t, i]\n"
        "        out[t, h, half + i] = x2 * cos[t, i] + x1 * sin[t, i]")    # 1.2's two output lines
ROPE_PAIRS = ("x1 = x[t, h, i]\n        x2 = x[t, h, half + i]\n"
              "        out[t, h, i] = x1 * cos[t, i] - x2 * sin[t, i]\n"
              "        out[t, h, half + i] =")
INT4_DOTS = ("lo_part += (byte - np.float32(16.0) * hi) * x4[t, p, {}, j]\n"
             "            hi_part += hi * x4[t, p, {}, j]")
ACCEPT = ("if rng.random() * q[x] < p[x]:              "
          "# u < p[x] / q[x], without dividing by q[x]\n        return True, x")
PENALTY = "params.presence_penalty + params.frequency_penalty"
WRONG = [
    ("1.1", "ss / np.float32(C)", "ss", "divide the sum of squares by C"),          # sum, not mean
    ("1.1", "ss / np.float32(C) + np.float32(eps))", "ss / np.float32(C)) + np.float32(eps)",
     "eps belongs inside"),
    ("1.1", "/ rms * w[c]", "/ rms", "weight w[c]"),
    ("1.2", ROPE_PAIRS,
     ROPE_PAIRS.replace("half + i", "2 * i + 1").replace("[t, h, i]", "[t, h, 2 * i]"),
     "interleaved"),
    ("1.2", ROPE, ROPE.replace("- x2", "+ x2").replace("+ x1", "- x1"), "sign of sin"),
    ("1.2", ROPE, ROPE.replace("cos[", "COS[").replace("sin[", "cos[").replace("COS[", "sin["),
     "cos and sin are swapped"),
    ("1.3", "e = exp_f32(scores[g, j] - mx)", "e = exp_f32(scores[g, j])", "largest score"),
    ("1.3", "ssum[g] = a", "ssum[g] = np.float32(1.0)", "not normalised"),
    ("1.3", "            scores[g, j] = e\n", "", "replace the scores"),
    ("1.4", "scores[g, j] = d * scale", "scores[g, j] = d", "1/sqrt(D) scale"),
    ("1.4", "n = start_pos + t + 1", "n = start_pos + t", "its own position"),      # the off-by-one
    ("1.4", "n = start_pos + t + 1", "n = start_pos + q.shape[0]", "later positions"),  # the future
    ("1.4", "h0 = kvh * group", "h0 = kvh", "KV head"),                           # the GQA mapping
    ("1.5", "self.cached_ids = self.cached_ids[:n]", "pass", "stale"),            # a stale tail
    ("1.5", "limit = min(len(self.cached_ids), len(prompt) - 1)",
     "limit = min(len(self.cached_ids), len(prompt))", "at least its last token"),  # none to feed
    ("1.5", "while n < limit and self.cached_ids[n] == prompt[n]:", "while False:",
     "already in the cache"),                                                    # reuses nothing
    ("1.6", "    if norm:\n", "    if False:\n", "renormalised to sum to 1"),
    ("1.6", "(best < 0 or logits[t, e] > logits[t, best])",
     "(best < 0 or logits[t, e] >= logits[t, best])", "lower expert id"),
    ("1.6", "exp_f32(logits[t, best] - mx) / total", "exp_f32(logits[t, best] - mx)",
     "all E experts"),
    ("1.7", "for e in np.unique(flat):", "for e in flat:", "read once"),         # a matmul per slot
    ("1.7", "x[slots if per_slot else slots // k]", "x[slots // k]", "row t k + j"),
    ("1.7", "w.part(e * n, (e + 1) * n)", "w.part(e, e + n)", "one expert's rows"),
    ("1.8", "_to_f16(np.abs(g).max(axis=-1) / 127.0)", "_to_f16(g.max(axis=-1) / 127.0)",
     "largest |w|"),
    ("1.8", "sf = s.astype(np.float32)[:, :, None]",
     "sf = (np.abs(g).max(axis=-1) / 127.0).astype(np.float32)[:, :, None]", "stored fp16 scale"),
    ("1.8", "np.clip(np.rint(g * inv), -127, 127)", "np.clip(g * inv, -127, 127)",
     "nearest integer"),
    ("1.9", "part * f16_to_f32(s[r, g])", "part * f16_to_f32(s[r, 0])", "its own scale"),
    ("1.9", "acc += part * f16_to_f32(s[r, g])", "acc += part", "no scale"),
    ("1.9", "* x3[t, g, j]", "* x3[t, 0, j]", "group 0's activations"),
    ("1.10", "q[:, 0::2] | (q[:, 1::2] << 4)", "(q[:, 0::2] << 4) | q[:, 1::2]", "swapped"),
    ("1.10", "m = _to_f16(lo)", "m = _to_f16(lo * 0 + g.mean(axis=-1))", "the group's minimum"),
    ("1.10", "s = _to_f16((hi - lo) / 15.0)", "s = _to_f16((hi - lo) / 16.0)", "15 steps"),
    ("1.11", "+ f16_to_f32(m[r, 2 * p]) * xsum[t, p, 0]", "", "minimum m times"),  # forgets m
    ("1.11", INT4_DOTS.format(0, 1), INT4_DOTS.format(1, 0), "low nibble"),
    ("1.11", "f16_to_f32(m[r, 2 * p]) * xsum[t, p, 0]", "f16_to_f32(m[r, 2 * p]) * xsum[t, p, 1]",
     "its own group's inputs"),
    ("1.12", f"{PENALTY} * counts", f"({PENALTY}) * counts", "once per distinct token"),
    ("1.12", "x / params.repetition_penalty, x * params.repetition_penalty",
     "x / params.repetition_penalty, x / params.repetition_penalty", "negative logit"),
    ("1.12", "list(prompt_ids) + list(output_ids)", "list(output_ids)", "prompt's tokens"),
    ("1.13", "keep_sorted = (cum - probs[order]) < params.top_p",
     "keep_sorted = cum < params.top_p", "takes the kept mass past top_p"),
    ("1.13", "(cum - probs[order]) < params.top_p", "(cum - probs[order]) <= params.top_p",
     "equals top_p"),
    ("1.13", "logits[probs < params.min_p * probs.max()]", "logits[probs < params.min_p]",
     "most likely token's"),
    ("1.14", "if rng.random() * q[x] < p[x]:", "if int(rng.choice(len(p), p=p)) == x:",
     "probability min(1"),                                                       # naive
    ("1.14", ACCEPT, "y = int(rng.choice(len(p), p=p))\n    return y == x, y",
     "follow the model's distribution, but"),                           # exact, accepts less
    ("1.14", "p=residual / residual.sum()", "p=p", "residual"),
    # stages 2 and 3
    ("2.1", "    if (slot < 0) return;                      // a padding token owns no slot\n", "",
     "slot -1"),
    ("2.1", "k_cache + (size_t)slot * HkvD;", "k_cache + (size_t)n * HkvD;", "slot_mapping[n]"),
    ("2.1", "vd[j] = vs[j];", "vd[j] = ks[j];", "v_cache holds k"),
    ("2.2", "seq.block_table.append(page)", "seq.block_table.insert(0, page)", "stay first"),
    ("2.2", "self.pages_for(num_tokens) - len(seq.block_table)", "self.pages_for(num_tokens)",
     "pages it holds"),
    ("2.2", "        if need > len(self.free):\n", "        if False:\n", "RuntimeError"),
    ("2.3", "        seq.block_table = []", "", "block table"),
    ("2.3", "            self.free.append(page)\n", "", "free list"),
    ("2.3", "self.owner.pop(page) == seq.id", "self.owner.get(page) == seq.id", "owner"),
    ("2.4", "victim = self.running[-1]", "victim = self.running[0]", "newest"),       # the oldest
    ("2.4", "n = min(seq.num_uncomputed, budget)", "n = seq.num_uncomputed",
     "over the token budget"),
    ("2.4", "                if victim is seq:\n                    break\n", "",
     "preempted itself"),
    ("2.5", "const int g = h / (H / Hkv);", "const int g = h % Hkv;", "kv head h / (H / Hkv)"),
    ("2.5", "qr[r] = d < D ? qs[d] * scale : 0.0f;", "qr[r] = d < D ? qs[d] : 0.0f;", "1/sqrt(D)"),
    ("2.5", "(size_t)table[t / P] * P + t % P", "(size_t)t", "block_tables[s, t / P]"),
    ("3.1", "self._key(parent, chunk)", "self._key(None, chunk)", "ignores the parent"),
    ("3.1", "key.ids != chunk or key.parent is not parent", "key.parent is not parent",
     "same P ids"),
    ("3.1", "key.ids != chunk or key.parent is not parent", "key.ids != chunk", "very same parent"),
    ("3.2", "ml[2 * j + 1] * expf(ml[2 * j] - m_all);", "ml[2 * j + 1];", "l_j exp(m_j - M)"),
    ("3.2", "j < used; j++) m_all", "j < splits; j++) m_all", "past the context"),
    ("3.2", "f32_to_bf16(sum / l_all)", "f32_to_bf16(sum)", "divided by l_all"),
    ("3.3", "(row < count && t <= my_pos)", "(row < count)", "after its own position"),  # no mask
    ("3.3", "o[kk][j] * correction + slice[j];", "o[kk][j] + slice[j];", "several key tiles"),
    ("3.3", "raw[j] * scale : NEG_INF", "raw[j] : NEG_INF", "1/sqrt(D)"),
    ("3.4", "rsqrtf(total / (float)C + eps)", "rsqrtf(total + eps)",
     "divide the sum of squares by C"),
    ("3.4", "r[c] * inv_rms * bf16_to_f32(w[c])", "r[c] * inv_rms", "weight w[c]"),
    ("3.4", "c < C; c += BLOCK) ss", "c < C && c < BLOCK; c += BLOCK) ss", "every channel"),
    ("3.5", "slot_mapping=pad(batch.slot_mapping, -1)", "slot_mapping=pad(batch.slot_mapping, 0)",
     "slot -1"),
    ("3.5", "return pad(tokens, 0), padded", "return tokens, padded", "feed token 0"),  # unpadded
    ("3.5", "context_lens=pad(batch.context_lens, 1)", "context_lens=pad(batch.context_lens, 0)",
     "context length 1"),
]


def planted(ex, old: str, new: str, folder: Path) -> base.Outcome:
    """The check's outcome on the reference region with `old` replaced by `new`."""
    ws = base.start(ex, folder)
    body = "\n".join(base.reference_region(ex))
    assert old in body, f"{ex.id}: {old!r} is not in the reference region"
    p = ws.path(ex.file)
    p.write_text(
        base.replace_region(p.read_text(), ex.id, ex.file, body.replace(old, new, 1).split("\n"))
    )
    return base.run_check(ex, base.Workspace(ws.root))


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("ex_id", IDS)
def test_each_planted_mistake_fails_with_a_message_that_names_it_and_no_other(ex_id, tmp_path):
    mistakes = [w[1:] for w in WRONG if w[0] == ex_id]
    assert len(mistakes) >= 2, f"{ex_id}: plant at least two mistakes in WRONG"
    ex = get(ex_id)
    messages = []
    for i, (old, new, words) in enumerate(mistakes):
        out = planted(ex, old, new, tmp_path / f"ws{i}")
        assert not out.passed, f"{ex_id}: the check passes on a wrong answer ({old!r} -> {new!r})"
        assert not out.message.startswith("not written yet"), out.message
        assert words.lower() in out.message.lower(), \
            f"{ex_id}: the message does not say {words!r}: {out.message}"
        messages.append(out.message.lower())
    for i, message in enumerate(messages):
        others = [w for j, (_, _, w) in enumerate(mistakes) if j != i and w.lower() in message]
        assert not others, f"{ex_id}: the message of mistake {i} also names {others}: {message}"


def cli(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "course.exercises", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


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
    assert stub.returncode == 1 and "fail" in stub.stdout and "not written yet" in stub.stdout, (
        stub.stdout
    )

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
    # the relative import `from . import matmul` found the installed file, under the workspace's
    # package
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
    assert headings == IDS, (
        "docs/exercises.md needs one '### ID title' section per exercise, in course order"
    )
    # its tables: one row per exercise, as the list has it
    rows = re.findall(r"^\| (\d+\.\d+) \| (.+?) \| `(.+?)` \| (\w+) \|$", text, flags=re.M)
    assert rows == [(e.id, e.title, e.file, e.difficulty) for e in EXERCISES]
    stage1 = sum(e.id.startswith("1.") for e in EXERCISES)          # and stage1.md's count of them
    words = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
             "fourteen fifteen sixteen seventeen eighteen nineteen twenty").split()
    assert f"Exercises: {words[stage1]} regions" in (ROOT / "docs/stage1.md").read_text()
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
    ex = base.Exercise("1.99", "a check in trouble", "docs/stage1.md#reading-order", "easy",
                       "common/sampling.py", check=check)
    ws = base.Workspace(tmp_path)
    (tmp_path / "common").mkdir()
    (tmp_path / "common/sampling.py").write_text((ROOT / "common/sampling.py").read_text())
    out = base.run_check(ex, ws)
    assert not out.passed
    words = {"skip": "skipped", "missing package": "pip install",
             "missing file": "not_there.py is missing"}
    assert words[trouble] in out.message, out.message


def test_the_course_maps_exercise_column_holds_every_exercise_once_in_its_chapters_row():
    """docs/README.md's exercises column is what `map-column` writes from the list (bench report
    writes it; `report --check` fails on an edited cell), and read back it holds every exercise
    once: a stage-3 one in the row of its lesson, the others in their stage's chapter."""
    from course.exercises import map_column
    text = (ROOT / "docs/README.md").read_text()
    table = text.split("<!-- report: lines -->\n", 1)[1].split("<!-- /report -->", 1)[0]
    assert map_column(table) == table
    found = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        link = re.search(r"\]\(([^)]+)\)", cells[1]).group(1)
        for run in cells[5].split(", "):
            first, _, last = run.partition("–")
            if first == "—":
                continue
            stage, a = first.split(".")
            for n in range(int(a), int((last or first).split(".")[1]) + 1):
                found[f"{stage}.{n}"] = link
    assert list(found) == IDS
    for e in EXERCISES:
        want = e.section.removeprefix("docs/") if e.id[0] == "3" else f"stage{e.id[0]}.md"
        assert found[e.id] == want, (e.id, found[e.id])


def test_map_column_refuses_an_exercise_without_a_row():
    from course.exercises import map_column
    table = ("| # | chapter | exercises |\n|---|---|---|\n| 1 | [stage 1](stage1.md) | — |\n"
             "| 2 | [stage 2](stage2.md) | — |")
    with pytest.raises(ValueError, match="exercise 3.1 .* has no row in the course map"):
        map_column(table)
    out = map_column(table + "\n| 3 | [stage 3](stage3.md) | — |"
                     + "".join(f"\n| x | [l]({e.section.removeprefix('docs/')}) | — |"
                               for e in EXERCISES if e.id[0] == "3"))
    last = {stage: max(int(e.id.split(".")[1]) for e in EXERCISES if e.id[0] == stage)
            for stage in "12"}
    assert [line.split(" | ")[2].rstrip(" |") for line in out.splitlines()[2:5]] == [
        f"1.1–1.{last['1']}", f"2.1–2.{last['2']}", "—"]
