"""A seeded mutation fuzzer of model files: a broken file gets a clean error, never a traceback.

An input is a tiny model of one architecture, as a Hugging Face folder or a GGUF file. A
mutant is a copy of it with one file changed in one way:

  flip      a byte of the file's header set to a random value (the GGUF metadata and tensor
            table, a JSON file's text, the safetensors header)
  huge      one field set huge: a number of the GGUF header (a count, a length, a dim, an
            offset, a hyper-parameter) to 2^63, 10^12, ...; a JSON value (config.json, the
            tokenizer files, generation_config.json, the safetensors header) to 10^12, 2^62,
            -1, 1e308, NaN, a string, null, a list, ...
  zero      the same field set to zero
  drop      a JSON key removed, or a key renamed (a token of the vocabulary)
  truncate  the file cut at a random byte
  poison    a weight made NaN or inf (a float, or a quantized block's scale)

Each mutant then runs as `python -m stage1_cpu.generate` does, in this process: resolve the
model, read its tokenizer, chat template and sampling defaults, build stage 1's engine with the
numpy definitions of its kernels (the same loader and forward pass; nothing compiles), generate
a few tokens and decode them. The outcome is one of

  clean     one of the project's errors for a bad model, its message naming the broken file
  ran       tokens came out, or the request ended with finish_reason "error" (non-finite
            logits; counted apart as "non-finite")
  traceback any other exception (or a project error that names no file)
  hang      over the time limit of one mutant

and the caller counts a crash when this process dies (the memory cap: --mem-gb).

    python tests/model_fuzz.py INPUTS --count N [--seed S] [--json OUT] [--mem-gb G]

INPUTS is a folder of inputs: each *.gguf file and each folder with a config.json.
tests/test_model_fuzz.py writes them and runs this file in a subprocess.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

# Single-threaded BLAS, and (main) the memory cap, come before numpy and the engine load: a thread
# pool sized for a large machine reserves gigabytes of address space by itself. So the project's
# modules are imported inside the functions that use them, not here.
if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OUTCOMES = ("clean", "ran", "non-finite", "traceback", "hang", "crash")
HOSTILE = [0, -1, 1, 10**12, 2**62, 2**64, -(2**63), 1e308, -1e308, 0.5, 1.5, float("nan"),
           float("inf"), "x", "", None, True, False, [], {}, [1, 2], {"a": 1}]
PROMPT = "Hello, how are you today?"


class Hang(Exception):
    """A mutant ran past its time limit."""


class Refused(Exception):
    """The engine refused the prompt (engine.check_prompt: an id past its vocabulary, which a
    tokenizer.json with a changed id gives): a clear error for that request, not a broken load."""


# ----------------------------------------------------------------------------- GGUF fields

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}                                 # GGUF's value types


def gguf_fields(buf: bytes) -> tuple[list[tuple[int, str, str]], list[tuple[int, int, int]], int]:
    """The numbers of a GGUF header, where they are: ([(offset, struct format, what)],
    [(data offset, GGML type, elements) per tensor], the end of the header)."""
    fields, tensors, at = [], [], 8

    def take(fmt: str, what: str):
        nonlocal at
        fields.append((at, fmt, what))
        (v,) = struct.unpack_from(fmt, buf, at)
        at += struct.calcsize(fmt)
        return v

    def string(what: str) -> str:
        nonlocal at
        n = take("<Q", what + " length")
        s = buf[at:at + n].decode("utf-8", "replace")
        at += n
        return s

    def value(kind: int, what: str, depth: int = 0):
        nonlocal at
        if kind == 8:
            return string(what)
        if kind == 9:
            item, n = take("<I", what + " item type"), take("<Q", what + " count")
            if item in _SCALARS:                          # a number array: its first items only
                width = struct.calcsize(_SCALARS[item])
                for i in range(min(n, 4)):
                    fields.append((at + i * width, _SCALARS[item], f"{what}[{i}]"))
                at += n * width
                return None
            for i in range(n):
                value(item, f"{what}[]" if i > 3 else f"{what}[{i}]", depth + 1)
            return None
        return take(_SCALARS[kind], what)

    n_tensors, n_kv = take("<Q", "tensor count"), take("<Q", "key count")
    for _ in range(n_kv):
        key = string("key")
        value(take("<I", f"{key} type"), key)
    table = []
    for _ in range(n_tensors):
        name = string("tensor name")
        dims = [take("<Q", f"{name} dim") for _ in range(take("<I", f"{name} dims"))]
        kind = take("<I", f"{name} type")
        table.append((take("<Q", f"{name} offset"), kind, math.prod(dims)))
    end = at
    start = -(-end // 32) * 32
    tensors = [(start + off, kind, n) for off, kind, n in table]
    return fields, tensors, end


def _huge(fmt: str, rng: random.Random):
    if fmt in ("<f", "<d"):
        return rng.choice([float("nan"), float("inf"), -1.0, 1e30, -1e30])
    bits = 8 * struct.calcsize(fmt)
    signed = fmt[1].islower() and fmt != "<?"
    top = 2 ** (bits - 1) - 1 if signed else 2 ** bits - 1
    choices = [top, top // 2 + 1, min(top, 10**12), min(top, 2**40), min(top, 2**31)]
    if signed:
        choices += [-1, -top - 1]
    return rng.choice(choices)


def mutate_gguf(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    fields, tensors, end = gguf_fields(data)
    buf = bytearray(data)
    kind = rng.choices(["huge", "zero", "flip", "truncate", "poison"], [25, 15, 30, 15, 15])[0]
    if kind in ("huge", "zero"):
        # each sort of field as likely as another: the token strings' lengths would outnumber all
        groups: dict[str, list] = {}
        for f in fields:
            groups.setdefault(f[2].split("[")[0].rsplit(" ", 1)[-1], []).append(f)
        at, fmt, what = rng.choice(rng.choice(list(groups.values())))
        v = _huge(fmt, rng) if kind == "huge" else 0
        if fmt == "<?":
            v = bool(v)
        struct.pack_into(fmt, buf, at, v)
        return bytes(buf), f"{kind} {what} = {v}"
    if kind == "flip":
        at = rng.randrange(8, end)
        buf[at] = rng.randrange(256)
        return bytes(buf), f"flip header byte {at}"
    if kind == "truncate":
        at = rng.randrange(0, len(data))
        return data[:at], f"truncate at {at} of {len(data)}"
    off, ggml_type, n = rng.choice(tensors)
    if ggml_type == 0:                                    # F32: one weight
        struct.pack_into("<f", buf, off + 4 * rng.randrange(n), rng.choice([math.nan, math.inf]))
    elif ggml_type == 8:                                  # Q8_0: a block's fp16 scale
        block = off + 34 * rng.randrange(max(1, n // 32))
        struct.pack_into("<H", buf, block, rng.choice([0x7C00, 0x7E00]))      # fp16 inf, NaN
    else:
        return bytes(buf), "poison: a tensor of another type, left as it is"
    return bytes(buf), f"poison a tensor at byte {off}"


# ----------------------------------------------------------------------------- JSON and safetensors

def _leaves(obj, path=()):
    """Paths to every value of a JSON document (containers included, the root not)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if type(obj) is list else []
    for k, v in items:
        yield path + (k,)
        yield from _leaves(v, path + (k,))


def _set(obj, path, value=None, drop=False, rename=None):
    for k in path[:-1]:
        obj = obj[k]
    k = path[-1]
    if rename is not None and isinstance(obj, dict):
        obj[rename] = obj.pop(k)
    elif drop:
        obj.pop(k) if isinstance(obj, (dict, list)) else None
    else:
        obj[k] = value


def mutate_json(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    kind = rng.choices(["huge", "zero", "drop", "flip", "truncate"], [35, 10, 15, 25, 15])[0]
    if kind in ("flip", "truncate"):
        buf = bytearray(raw)
        at = rng.randrange(len(buf))
        if kind == "truncate":
            return bytes(buf[:at]), f"truncate at {at} of {len(buf)}"
        buf[at] = rng.randrange(32, 127) if rng.random() < 0.7 else rng.randrange(256)
        return bytes(buf), f"flip byte {at} to {buf[at]}"
    doc = json.loads(raw)
    paths = list(_leaves(doc))
    if not paths:
        return raw[:-1], "truncate the last byte"
    path = rng.choice(paths)
    if kind == "drop":
        renamed = rng.random() < 0.5 and isinstance(path[-1], str)
        _set(doc, path, drop=True, rename=(path[-1] + "~") if renamed else None)
        what = "rename" if renamed else "drop"
    else:
        value = rng.choice(HOSTILE) if kind == "huge" else 0
        _set(doc, path, value)
        what = f"{kind} = {value!r}"
    return json.dumps(doc).encode(), f"{what} at {'/'.join(map(str, path))[:80]}"


def mutate_safetensors(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    (n,) = struct.unpack_from("<Q", data)
    header, body = data[8:8 + n], data[8 + n:]
    kind = rng.choices(["field", "length", "flip", "truncate", "poison"], [35, 10, 25, 15, 15])[0]
    if kind == "field":
        new, what = mutate_json(header, rng)
        return struct.pack("<Q", len(new)) + new + body, f"header: {what}"
    if kind == "length":
        v = rng.choice([0, 1, n - 1, n + 1, 2**63, 2**64 - 1, 10**12])
        return struct.pack("<Q", v) + data[8:], f"header length = {v}"
    if kind == "flip":
        at = rng.randrange(8 + n)
        buf = bytearray(data)
        buf[at] = rng.randrange(256)
        return bytes(buf), f"flip header byte {at}"
    if kind == "truncate":
        at = rng.randrange(len(data))
        return data[:at], f"truncate at {at} of {len(data)}"
    info = json.loads(header)
    name = rng.choice([k for k in info if k != "__metadata__"])
    begin, end = info[name]["data_offsets"]
    buf = bytearray(data)
    at = 8 + n + begin + 4 * rng.randrange(max(1, (end - begin) // 4))
    struct.pack_into("<f", buf, at, rng.choice([math.nan, math.inf, -math.inf]))
    return bytes(buf), f"poison {name}"


def make_mutant(source: Path, work: Path, rng: random.Random) -> tuple[Path, str, str]:
    """-> (the model to run, the file changed, what was done)."""
    if source.suffix == ".gguf":
        data, what = mutate_gguf(source.read_bytes(), rng)
        out = work / source.name
        out.write_bytes(data)
        return out, source.name, what
    out = work / source.name
    out.mkdir()
    files = sorted(p.name for p in source.iterdir())
    weights = {"config.json": 30, "tokenizer.json": 15, "tokenizer_config.json": 10,
               "generation_config.json": 10, "model.safetensors.index.json": 10}
    weights.update({f: 35 // sum(f.endswith(".safetensors") for f in files)
                    for f in files if f.endswith(".safetensors")})
    present = [f for f in weights if f in files]
    target = rng.choices(present, [weights[f] for f in present])[0]
    for name in files:
        if name != target:
            (out / name).symlink_to(source / name)
    mutate = mutate_safetensors if target.endswith(".safetensors") else mutate_json
    data, what = mutate((source / target).read_bytes(), rng)
    (out / target).write_bytes(data)
    return out, target, what


# ----------------------------------------------------------------------------- one run

def run_model(path: Path) -> str:
    """What `python -m stage1_cpu.generate --model PATH` does, here -> "ran" or "non-finite"."""
    from common.chat_template import ChatTemplate
    from common.engine import Request
    from common.models import resolve_model
    from common.sampling import SamplingParams
    from common.tokenizer import Tokenizer
    from stage1_cpu.engine import LLMEngine

    folder = resolve_model(str(path), progress=False)
    tok = Tokenizer(folder)
    text = ChatTemplate.from_folder(folder).render([{"role": "user", "content": PROMPT}],
                                                   add_generation_prompt=True)
    params = SamplingParams.from_generation_config(folder, max_tokens=4, seed=0)
    quant = "stored" if path.suffix == ".gguf" else "none"
    engine = LLMEngine(folder, quant=quant, max_ctx=256, progress=False, use_numba=False,
                       kernels="plain")
    try:
        engine.add_request(Request("fuzz", tok.encode(text), params))
    except ValueError as e:
        raise Refused(str(e)) from None
    out, finish = [], None
    while engine.has_work():
        for ev in engine.step():
            finish = ev.finish_reason
            if ev.token_id >= 0:
                if not 0 <= ev.token_id < engine.config.vocab_size:
                    raise AssertionError(f"token id {ev.token_id} outside the vocabulary")
                out.append(ev.token_id)
    tok.decode(out)
    return "non-finite" if finish == "error" else "ran"


def project_errors() -> tuple[type, ...]:
    """The errors the project raises for a bad model, each a ValueError that says what is wrong."""
    from common.chat_template import ChatTemplateError
    from common.config import ConfigError
    from common.gguf import GGUFError
    from common.gguf_quant import GGUFTypeError
    from common.loader import LoaderError
    from common.models import ModelResolveError
    from common.tokenizer import TokenizerError
    return (ChatTemplateError, ConfigError, GGUFError, GGUFTypeError, LoaderError,
            ModelResolveError, TokenizerError)


def outcome(path: Path, target: str, limit: float, errors: tuple[type, ...]) -> tuple[str, str]:
    """Run one mutant -> (outcome, detail)."""
    def alarm(signum, frame):
        raise Hang(f"over {limit} s")

    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        try:
            return run_model(path), ""
        except (KeyboardInterrupt, Hang):
            raise
        except Refused as e:
            return "clean", f"the engine refused the prompt: {e}"
        except errors as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if target not in str(e):
                return "traceback", f"the message names no {target}: {type(e).__name__}: {e}"
            return "clean", f"{type(e).__name__}: {e}"
        except BaseException:       # the tokenizers library's PanicException is a BaseException
            signal.setitimer(signal.ITIMER_REAL, 0)
            return "traceback", traceback.format_exc(limit=-6)
    except Hang as e:
        return "hang", str(e)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def fuzz(inputs: list[Path], count: int, seed: int, limit: float, log=None) -> dict:
    """count mutants of each input -> {"table": {kind: Counter}, "failures": [...]}."""
    import common.gguf as gguf_module

    warnings.simplefilter("ignore")          # numpy's notes on NaN, requantized blocks, ...
    errors = project_errors()
    table: dict[str, Counter] = {}
    failures, examples = [], {}
    with tempfile.TemporaryDirectory(prefix="model-fuzz-") as tmp:
        for source in inputs:
            kind = "gguf" if source.suffix == ".gguf" else "hf"
            for i in range(count):
                rng = random.Random(f"{seed}/{source.name}/{i}")
                work = Path(tmp) / f"{source.stem}-{i}"
                work.mkdir()
                path, target, what = make_mutant(source, work, rng)
                if log:
                    print(f"{source.name} #{i}: {target}: {what}", file=log, flush=True)
                result, detail = outcome(path, target, limit, errors)
                table.setdefault(kind, Counter())[result] += 1
                example = f"{what} -> {detail[:300]}"
                examples.setdefault(f"{kind} {target} {result}", []).append(example)
                if result in ("traceback", "hang"):
                    failures.append(dict(input=source.name, mutant=i, file=target, mutation=what,
                                         outcome=result, detail=detail))
                gguf_module._OPEN.clear()             # each mutant is a new file
                shutil.rmtree(work)
    return {"table": {k: dict(v) for k, v in table.items()}, "failures": failures,
            "examples": {k: v[:5] for k, v in examples.items()}}


def describe(failure: dict) -> str:
    """One failure: which input and mutant, what was changed, what came of it."""
    f = failure
    where = f"{f['input']} #{f['mutant']} {f['file']}"
    return f"{where}: {f['mutation']} -> {f['outcome']}\n{f['detail']}"


def format_table(table: dict) -> str:
    """The outcome table, in Markdown."""
    rows = ["| input | mutants | " + " | ".join(OUTCOMES) + " |",
            "|---" * (len(OUTCOMES) + 2) + "|"]
    for kind, counts in sorted(table.items()):
        cells = [str(counts.get(o, 0)) for o in OUTCOMES]
        rows.append(f"| {kind} | {sum(counts.values())} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def inputs_in(folder: Path) -> list[Path]:
    """The inputs in a folder: its *.gguf files and its model folders."""
    return sorted(p for p in folder.iterdir()
                  if p.suffix == ".gguf" or (p / "config.json").is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Mutate tiny model files: each outcome must be a "
                                             "clean error or a run.")
    ap.add_argument("inputs", type=Path, help="a folder of *.gguf files and model folders")
    ap.add_argument("--count", type=int, default=20, help="mutants of each input")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=float, default=20.0, help="seconds one mutant may take")
    ap.add_argument("--mem-gb", type=float, default=4.0, help="address-space cap of this process")
    ap.add_argument("--json", type=Path, default=None, help="write the table and the failures here")
    ap.add_argument("--log", action="store_true", help="print each mutant before it runs (stderr)")
    args = ap.parse_args(argv)
    cap = int(args.mem_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    t0 = time.perf_counter()
    log = sys.stderr if args.log else None
    result = fuzz(inputs_in(args.inputs), args.count, args.seed, args.limit, log)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(format_table(result["table"]))
    for f in result["failures"][:20]:
        print(f"\n{describe(f)}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
