"""Stage 1 reads in a weekend, what it imports included (DESIGN.md, "Floors").

The reading set (tests/reading_set.py) is every project file plain stage 1 imports to run a
safetensors folder: it stays under 3,000 lines, it holds none of the code that loads only
where it is used (GGUF, the default-model fetcher, numba's widened cache stamps, the fast
path, speculative decoding, the help for a --model that names no model), and docs/stage1.md's
reading list names exactly its files. The core itself, stage1_cpu/*.py but the speculative
decoding its flags load, stays within DESIGN.md's 1,500 lines at 100 columns.
"""
from __future__ import annotations

import re

import pytest
from bench.testbed.models import make_model
from reading_set import BOUND, ROOT, reading_set

# what a safetensors folder with --kernels plain must not load: each behind the boundary where it
# is used
NOT_READ = ("common/chat_template.py", "common/gguf.py", "common/gguf_convert.py",
            "common/gguf_quant.py", "common/gguf_write.py", "common/fetch.py",
            "stage1_cpu/jit/numba_stamps.py", "stage1_cpu/fast/",
            "stage1_cpu/speculative.py", "stage1_cpu/draft.py", "common/model_help.py")


@pytest.fixture(scope="module")
def files() -> dict[str, int]:
    return reading_set(make_model("qwen3", tokenizer=True))


def test_plain_stage1_reads_under_3000_lines(files):
    # it ran the whole path
    assert "stage1_cpu/model.py" in files and "common/tokenizer.py" in files
    assert sum(files.values()) <= BOUND, sorted(files.items(), key=lambda kv: -kv[1])


def test_gguf_fetcher_stamps_and_fast_path_stay_out_of_the_reading_set(files):
    assert [f for f in files if f.startswith(NOT_READ)] == []


def test_docs_reading_list_is_the_reading_set(files):
    text = (ROOT / "docs" / "stage1.md").read_text()
    section = text.split("### The reading set", 1)[1]
    # the bullet list that follows
    the_list = section[section.index("\n- "):].split("\n\n", 1)[0]
    listed = set(re.findall(r"`((?:common|stage1_cpu)/[\w/]+\.py)`", the_list))
    assert listed == set(files), (sorted(set(files) - listed), sorted(listed - set(files)))


def test_the_core_stays_within_1500_lines():
    # speculative.py and draft.py load only with --speculative / --draft-model, as fast/ only with
    # its kernels; jit/ (numba's housekeeping) stands beside the core, in the reading set
    later = ("speculative.py", "draft.py")
    core = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "stage1_cpu").glob("*.py")
            if p.name not in later}
    assert 1000 < sum(core.values()) <= 1500, core


def test_no_line_of_the_reading_set_is_over_100_columns(files):
    """The bound counts lines: a long line would read as one. ruff checks the whole project
    (tests/test_lint.py); this says so for the set, with the lines."""
    long = [f"{f}:{i}" for f in files
            for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if len(line) > 100]
    assert long == [], long
