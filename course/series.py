"""The stage 2 -> stage 3 lesson series: patches that turn stage2_batched/ into stage3_optimized/.

The patches in docs/lessons/stage3/NN-name.patch are the source of truth. Applied in
order to a copy of stage2_batched/, patch k gives rung k (a working engine: stage 2 plus
the first k lessons) and the last one gives stage3_optimized/ byte for byte. Each patch
starts with a header (what it changes, saves and costs, its docs/stage3.md section) that
`git apply` skips: it reads from the first `diff --git` line.

    python course/series.py check          # do the patches still give stage3_optimized/?
    python course/series.py unpack DIR     # DIR/00-stage2, DIR/01-entry-points, ... (the rungs)
    python course/series.py packages DIR   # the same as packages DIR/rung00 ... DIR/rung17, so
                                           # PYTHONPATH=$PWD:DIR python -m rung02.chat --device cpu
    python course/series.py pack DIR       # rewrite the patches from edited rung trees
    python course/series.py rebase         # after an edit to stage 3: the last patch absorbs it

After an edit to stage3_optimized/, `check` fails (tests/test_stage3_lessons.py runs it)
and names the patch. Two ways to bring the series up to date:
  * `rebase`: the rungs before the last stay as they are and the last patch is
    regenerated against the new stage 3, so the edit lands in the last lesson;
  * to put the edit in the lesson it belongs to: `unpack DIR`, make the same edit in
    DIR/NN-name and every later rung, copy stage3_optimized/ over the last rung, `pack DIR`.
Then run tests/test_stage3_lessons.py: it also runs every rung against transformers.

Needs git (for `git diff --no-index` and `git apply`); no other tool.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERIES = ROOT / "docs" / "lessons" / "stage3"
STAGE2 = ROOT / "stage2_batched"
STAGE3 = ROOT / "stage3_optimized"
BASE = "00-stage2"
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def patches(series: Path = SERIES) -> list[Path]:
    """The patch files in order (NN-name.patch)."""
    found = sorted(series.glob("[0-9][0-9]-*.patch"))
    if not found:
        raise FileNotFoundError(f"no NN-name.patch files in {series}")
    return found


def header(patch: Path) -> str:
    """The text before the first `diff --git` line."""
    text = patch.read_text()
    i = text.find("diff --git ")
    return text if i < 0 else text[:i]


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=IGNORE)


def _git_env(tree: Path) -> dict:
    # keep git from finding an enclosing repository: apply relative to `tree` itself
    return dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent), LC_ALL="C")


def apply(patch: Path, tree: Path) -> None:
    """Apply one patch to the tree in place; RuntimeError (with git's message) if it does not
    apply."""
    r = subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch)], cwd=tree,
                       env=_git_env(tree), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{patch.name} does not apply: {r.stderr.strip()}")


def diff(old: Path, new: Path) -> str:
    """The git-style diff from tree `old` to tree `new`, paths relative to each tree's root."""
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        copy_tree(old, a)
        copy_tree(new, b)
        r = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "--no-color",
                            "--no-ext-diff", "--no-renames", "a", "b"],
                           cwd=tmp, env=_git_env(Path(tmp) / "a"),
                           capture_output=True, text=True)
        if r.returncode not in (0, 1):
            raise RuntimeError(f"git diff failed: {r.stderr.strip()}")
        return r.stdout


def tree_differences(a: Path, b: Path) -> list[str]:
    """Relative paths that differ between two trees (missing on one side, or other bytes)."""
    out = []

    def walk(cmp: filecmp.dircmp, rel: str) -> None:
        for name in cmp.left_only + cmp.right_only + cmp.common_funny:
            if name != "__pycache__":
                out.append(rel + name)
        _, mismatch, errors = filecmp.cmpfiles(cmp.left, cmp.right, cmp.common_files, shallow=False)
        out.extend(rel + n for n in mismatch + errors)
        for name, sub in cmp.subdirs.items():
            if name != "__pycache__":
                walk(sub, rel + name + "/")

    walk(filecmp.dircmp(a, b), "")
    return sorted(out)


def unpack(out: Path, series: Path = SERIES, stage2: Path = STAGE2) -> list[Path]:
    """Write the rungs: out/00-stage2 (a copy of stage 2), then out/NN-name = the previous rung
    plus patch NN. -> the rung directories, stage 2 first."""
    out.mkdir(parents=True, exist_ok=True)
    rungs = [out / BASE]
    copy_tree(stage2, rungs[0])
    for p in patches(series):
        nxt = out / p.stem
        copy_tree(rungs[-1], nxt)
        apply(p, nxt)
        rungs.append(nxt)
    return rungs


def check(series: Path = SERIES, stage2: Path = STAGE2, stage3: Path = STAGE3) -> None:
    """RuntimeError naming the first patch that does not apply, or the files where the last
    rung differs from stage 3."""
    with tempfile.TemporaryDirectory() as tmp:
        rungs = unpack(Path(tmp), series, stage2)
        bad = tree_differences(rungs[-1], stage3)
        if bad:
            raise RuntimeError(f"stage 2 + every patch differs from {stage3.name}/ in {bad}; the "
                               f"last patch, {rungs[-1].name}.patch, no longer matches (see "
                               "course/series.py: rebase)")


def pack(rung_dir: Path, series: Path = SERIES) -> list[Path]:
    """Rewrite the patches from rung trees rung_dir/00-stage2, rung_dir/NN-name, ...: patch NN is
    the diff from the rung before it to rung NN, after the header the patch file has now
    (or rung_dir/NN-name.header for a new rung)."""
    rungs = sorted(d for d in rung_dir.iterdir() if d.is_dir() and d.name[:2].isdigit())
    if not rungs or rungs[0].name != BASE:
        raise ValueError(f"{rung_dir} must hold {BASE}/ and the rungs NN-name/ after it")
    written = []
    old = {p.name: p for p in series.glob("[0-9][0-9]-*.patch")}
    for prev, cur in zip(rungs, rungs[1:]):
        name = cur.name + ".patch"
        head_file = rung_dir / (cur.name + ".header")
        head = (head_file.read_text() if head_file.exists()
                else header(old[name]) if name in old else None)
        if head is None:
            raise ValueError(f"no header for {name}: write {head_file}")
        body = diff(prev, cur)
        if not body:
            raise ValueError(f"rung {cur.name} equals the one before it")
        (series / name).write_text(head.rstrip("\n") + "\n\n" + body)
        written.append(series / name)
    for name, p in old.items():
        if name not in {w.name for w in written}:
            p.unlink()
    return written


def rebase(series: Path = SERIES, stage2: Path = STAGE2, stage3: Path = STAGE3) -> Path:
    """Regenerate the last patch against the current stage 3 (the earlier rungs stay)."""
    ps = patches(series)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        prev = out / BASE
        copy_tree(stage2, prev)
        for p in ps[:-1]:
            nxt = out / p.stem
            copy_tree(prev, nxt)
            apply(p, nxt)
            prev = nxt
        last = ps[-1]
        last.write_text(header(last).rstrip("\n") + "\n\n" + diff(prev, stage3))
        return last


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python course/series.py",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="stage 2 + every patch == stage3_optimized/ ?")
    u = sub.add_parser("unpack", help="write the rung trees into DIR")
    u.add_argument("dir", type=Path)
    p = sub.add_parser("pack", help="rewrite the patches from the rung trees in DIR")
    p.add_argument("dir", type=Path)
    g = sub.add_parser("packages", help="write the rungs as importable packages DIR/rungNN")
    g.add_argument("dir", type=Path)
    sub.add_parser("rebase", help="regenerate the last patch against the current stage3_optimized/")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "check":
            check()
            print(f"ok: stage2_batched/ + {len(patches())} patches == stage3_optimized/")
        elif args.cmd == "unpack":
            for r in unpack(args.dir):
                print(r)
        elif args.cmd == "packages":
            with tempfile.TemporaryDirectory() as tmp:
                for k, r in enumerate(unpack(Path(tmp))):
                    dst = args.dir / f"rung{k:02d}"
                    if dst.exists():
                        shutil.rmtree(dst)
                    copy_tree(r, dst)
                    print(f"{dst}  ({r.name})")
        elif args.cmd == "pack":
            for w in pack(args.dir):
                print(w)
        else:
            print(rebase())
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
