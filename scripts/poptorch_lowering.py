"""Write ``ipu_standins/poptorch/_lowering_table.py``: what PopTorch lowers each ATen op
of this project's models to, read from a poptorch checkout.

    python scripts/poptorch_lowering.py PATH_TO_POPTORCH_CHECKOUT [--check]

1. Traces the project's models as PopTorch sees them (under ``ipu_tracing()``, in-place ops as
   their out-of-place op, dropout as one op): the example GPT (plain, unit-scaled and u-μP, in
   every precision, with dropout and without), the BERT-style encoder in every regime it has,
   and, where transformers has PyTorch models, a Hugging Face Llama and BERT converted by
   ``unit_scale``. The ops already in the table are kept, so a run on a torch without
   transformers' models keeps the Hugging Face rows.
2. Finds each op's handler, ``registerHandler(c10::aten::<op>, <handler>)`` under
   ``poptorch/source/popart_canonicalization/``, and the PopART builders (``create*``) its body
   calls; reads which PopART op each ``approximate`` branch of ``geluHandler`` builds.
3. Joins what a reading of each handler concluded (``REVIEWS`` below). A review records a hash
   of the handler body it was made on: an op without a review, or a handler whose body changed
   since, stops the script with the handler to read.

``--check`` compares the result with the file instead of writing it.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "ipu_standins" / "poptorch" / "_lowering_table.py"
CANONICALIZATION = "poptorch/source/popart_canonicalization"

VERDICTS = ("same", "differs", "random", "stochastic-rounding", "constant")


class Review(NamedTuple):
    """What reading one handler concluded.

    ``verdict``: ``same`` (PopART computes what eager torch computes), ``differs`` (it computes
    another function, which the emulator computes instead), ``random`` (the same distribution,
    drawn from the IPU's random generator), ``stochastic-rounding`` (the same unless
    ``Precision.enableStochasticRounding`` is on, then float to half rounds stochastically),
    ``constant`` (accepted only where PopTorch folds it into a constant at compile time).
    ``body_hash``: of the handler body reviewed (see :func:`body_hash`).
    ``source``: where the lowering lives when it is not the op's own registered handler: the
    ATen op whose handler applies (``"copy_"``), or ``"path/to/File.cpp:function"``.
    """

    verdict: str
    note: str
    body_hash: str
    source: Optional[str] = None


# One entry per ATen op the models trace to. Notes say what runs on the IPU.
REVIEWS: Dict[str, Review] = {
    "_log_softmax": Review(
        "same", "PopART LogSoftmax over the last axis (another axis is transposed there and "
        "back)", "e0d7d2b6ea04"),
    "_softmax": Review(
        "same", "PopART Softmax over the last axis (another axis is transposed there and "
        "back)", "304c95b79e19"),
    "_to_copy": Review(
        "stochastic-rounding", "torch's _to_copy is an empty tensor and copy_; copy_ of another "
        "dtype is a PopART Cast. Float to half rounds to nearest even, or stochastically "
        "(unbiased, to one of the two neighbouring halves) under "
        "Precision.enableStochasticRounding; the cast's gradient is the cast back",
        "0e6a49a53243", "copy_"),
    "_unsafe_view": Review("same", "PopART Reshape", "a1a8464ae938"),
    "add": Review(
        "same", "PopART Add; alpha other than 1 multiplies the second input first; two bool "
        "inputs: LogicalOr", "fbc32e8a618f"),
    "addmm": Review("same", "PopART Gemm(mat1, mat2, input, alpha, beta)", "8fba7a8b867e"),
    "alias": Review(
        "same", "removed before lowering: its users read the input",
        "c99189a5e6d7", "poptorch/source/AliasProcessing.cpp:resolveAliases"),
    "arange": Review(
        "same", "an int32 constant computed at compile time from constant start, end and step",
        "98c27ccd76a2"),
    "bitwise_and": Review(
        "same", "bool inputs: PopART LogicalAnd; integer inputs: BitwiseAnd", "8700d6833fea"),
    "bmm": Review(
        "same", "PopART MatMul (accumulating in float unless Precision.setPartialsType(half))",
        "9966caddf0a5"),
    "cat": Review("same", "PopART Concat", "5f555e2ed0f4"),
    "clamp": Review(
        "same", "PopART Max with the lower bound, then Min with the upper bound",
        "203a29bb6c49"),
    "clone": Review("same", "PopART Identity", "877f1a4e300f"),
    "constant_pad_nd": Review("same", "PopART ConstantPad", "2189dda604c3"),
    "cos": Review("same", "PopART Cos", "10be04b6d0e1"),
    "cumsum": Review(
        "same", "a 1-D convolution with a kernel of ones, in float (the input cast to the "
        "result's dtype first, as torch does): exact for integers below 2**24",
        "1a5308d89e62"),
    "detach": Review("same", "PopART Detach", "485771d8c165"),
    "dropout": Review(
        "random", "training: PopART Dropout, its mask from the IPU's random generator, kept "
        "values scaled by 1/(1-p); otherwise Identity. The emulator keeps torch's draw",
        "30c1d857db4c"),
    "embedding": Review(
        "same", "no padding_idx: PopART Gather; a padding_idx: poptorch's Embedding custom op; "
        "scale_grad_by_freq and sparse are refused",
        "723aa8ef1e4b"),
    "eq": Review("same", "PopART Equal", "326a3ecc7609"),
    "expand": Review("same", "PopART Expand (after a Reshape adding leading ones)",
                     "ddc7423374de"),
    "ge": Review("same", "PopART Greater or Equal", "5ab03d045ed0"),
    "gelu": Review(
        "differs", "both approximate='none' and 'tanh' build PopART Gelu (createGeluErf is "
        "left as a TODO): forward 0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3))), the tanh "
        "approximation, where eager 'none' is x Phi(x); its gradient (GeluGradOpx, popnn's GELU "
        "gradient) is 0.5(1+tanh(sqrt(2/pi)(x+0.044715x^3))+sqrt(2/pi) x exp(-x^2/2)), which is "
        "not the derivative of that forward",
        "7b244ea8d913"),
    "index": Review("same", "PopART Gather on the partially flattened input", "64d30b2f3bf1"),
    "le": Review("same", "PopART Less or Equal", "744371e52c86"),
    "logical_not": Review("same", "PopART Not", "317435f8d298"),
    "masked_fill": Review("same", "PopART Where(mask, value, input)", "1db1d5ebc77f"),
    "mean": Review("same", "PopART ReduceMean (bool inputs cast to int first)", "518fb73f480b"),
    "mm": Review(
        "same", "PopART MatMul (accumulating in float unless Precision.setPartialsType(half))",
        "9966caddf0a5"),
    "mul": Review("same", "PopART Mul; two bool inputs: LogicalAnd", "e0ff7afa19a5"),
    "native_layer_norm": Review(
        "same", "PopART GroupNormalization with one group over the input flattened to "
        "[rows, normalized size], with the same eps", "c1e37e236899"),
    "ne": Review("same", "PopART Not(Equal)", "debf3943f58e"),
    "neg": Review("same", "PopART Neg", "4e8e5e5fcc1e"),
    "new_ones": Review("same", "a constant of ones (the shape must be constant)",
                       "93b65acaa17f"),
    "nll_loss_forward": Review(
        "same", "PopART Nll on log-probabilities with ignore_index; mean reduction divides "
        "by the number of targets not ignored, as torch does; class weights are refused",
        "2bf54f644eb2"),
    "ones": Review("same", "a constant of ones", "93b65acaa17f"),
    "permute": Review("same", "PopART Transpose", "5ac638eeb644"),
    "pow": Review("same", "PopART Pow", "9f790825a4a4"),
    "reciprocal": Review("same", "PopART Reciprocal (integer inputs cast to float first)",
                         "e0c226098544"),
    "rsqrt": Review("same", "PopART Reciprocal(Sqrt)", "119d14029847"),
    "silu": Review("same", "PopART Swish, x sigmoid(x)", "eb1b0f389ed1"),
    "sin": Review("same", "PopART Sin", "e0e7f4af8592"),
    "slice": Review("same", "PopART Slice (the step must be a constant of at least 1)",
                    "0bb80f2202a5"),
    "sqrt": Review("same", "PopART Sqrt", "88a3e5232c87"),
    "sub": Review("same", "PopART Sub; alpha other than 1 multiplies the second input first",
                  "fbf39445273d"),
    "sum": Review("same", "PopART ReduceSum (bool inputs cast to int first)", "518fb73f480b"),
    "t": Review("same", "PopART Transpose", "48c5a0446875"),
    "transpose": Review("same", "PopART Transpose", "bfad61fe3ac4"),
    "triu": Review(
        "constant", "refused unless PopTorch folds it into a constant (e.g. "
        "torch.ones(n, n).triu(1)), whose values it computes at compile time",
        "b4482a91637a"),
    "unbind": Review("same", "PopART Gather and Squeeze per output", "778584e93414"),
    "unsqueeze": Review("same", "PopART Reshape", "a1a8464ae938"),
    "view": Review("same", "PopART Reshape", "a1a8464ae938"),
}

# What each PopART op that geluHandler can build computes, read from PopART (willow/src/popx/
# op/gelux.cpp, geluerfx.cpp) and poplibs (popnn NonLinearity GELU / GELU_ERF, forward and
# gradient codelets): the emulator's name for it.
GELU_OPS = {"createGelu": "Gelu", "createGeluErf": "GeluErf"}


# ---------------------------------------------------------------- reading poptorch's source


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def function_body(source: str, name: str) -> Optional[str]:
    """The body (braces included) of the C++ function ``name`` defined in ``source``."""
    text = _strip_comments(source)
    match = re.search(r"[\w:*&<> ]\b" + re.escape(name) + r"\s*\([^;{)]*(?:\)[^;{]*)?\{", text)
    if match is None:
        return None
    start = match.end() - 1
    depth = 0
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start:position + 1]
    return None


def body_hash(body: str) -> str:
    """12 hex digits of the SHA-256 of ``body`` with comments and whitespace removed."""
    compact = re.sub(r"\s+", "", _strip_comments(body))
    return hashlib.sha256(compact.encode()).hexdigest()[:12]


def builders(body: str) -> Tuple[str, ...]:
    """The PopART builders (``create*``) a handler body calls or passes on, sorted."""
    return tuple(sorted(set(re.findall(r"\b(create[A-Z]\w*)\b", body))))


class Handler(NamedTuple):
    path: str  # relative to the checkout
    name: str
    body: str


def registered_handlers(root: Path) -> Dict[str, Handler]:
    """ATen op -> its handler, from every ``registerHandler(c10::aten::<op>, <handler>)``."""
    found: Dict[str, Handler] = {}
    pattern = re.compile(r"registerHandler\(\s*c10::aten::(\w+)\s*,\s*(\w+)\s*\)")
    for path in sorted((root / CANONICALIZATION).rglob("*.cpp")):
        source = path.read_text(encoding="utf-8")
        for op, name in pattern.findall(_strip_comments(source)):
            body = function_body(source, name)
            if body is not None:
                found[op] = Handler(str(path.relative_to(root)), name, body)
    return found


def gelu_lowering(handler: Handler) -> Dict[str, str]:
    """``approximate`` -> the PopART op each branch of geluHandler builds."""
    result: Dict[str, str] = {}
    for value, branch in re.findall(r'approximate\s*==\s*"(\w+)"\s*\)\s*\{([^}]*)\}',
                                    handler.body):
        built = [GELU_OPS[b] for b in builders(branch) if b in GELU_OPS]
        if len(built) != 1:
            raise SystemExit(f"geluHandler's approximate={value!r} branch builds {built}: read "
                             f"{handler.path} and update GELU_OPS")
        result[value] = built[0]
    if set(result) != {"none", "tanh"}:
        raise SystemExit(f"geluHandler handles approximate {sorted(result)}, not none and tanh: "
                         f"read {handler.path}")
    return result


class Row(NamedTuple):
    op: str
    handler: str
    popart: Tuple[str, ...]
    verdict: str
    note: str


def lowering_rows(root: Path, ops: Sequence[str],
                  reviews: Dict[str, Review] = REVIEWS) -> List[Row]:
    """One row per op, from the checkout and the reviews; SystemExit naming what to read."""
    handlers = registered_handlers(root)
    rows, problems = [], []
    for op in sorted(ops):
        review = reviews.get(op)
        source = review.source if review is not None else None
        handler: Optional[Handler]
        if source is not None and ":" in source:
            path, name = source.split(":")
            body = function_body((root / path).read_text(encoding="utf-8"), name)
            handler = None if body is None else Handler(path, name, body)
        else:
            handler = handlers.get(source or op)
        if handler is None:
            problems.append(f"{op}: no handler found ({source or 'registerHandler'})")
            continue
        where = f"{Path(handler.path).name}:{handler.name}"
        if review is None:
            problems.append(f"{op}: not reviewed; read {handler.path}:{handler.name} (body hash "
                            f"{body_hash(handler.body)}) and add it to REVIEWS")
            continue
        if review.verdict not in VERDICTS:
            problems.append(f"{op}: verdict {review.verdict!r} is not one of {VERDICTS}")
        if body_hash(handler.body) != review.body_hash:
            problems.append(f"{op}: {handler.path}:{handler.name} changed since it was reviewed "
                            f"(body hash {body_hash(handler.body)}, reviewed "
                            f"{review.body_hash}); read it and update REVIEWS")
            continue
        via = f" (via aten::{source})" if source is not None and ":" not in source else ""
        rows.append(Row(op, where + via, builders(handler.body), review.verdict, review.note))
    if problems:
        raise SystemExit("\n".join(problems))
    return rows


def checkout_commit(root: Path) -> str:
    result = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{root} is not a git checkout of poptorch: {result.stderr.strip()}")
    return result.stdout.strip()


# ---------------------------------------------------------------- the ops the models trace to


def _out_of_place(name: str) -> str:
    # PopTorch's in-place pass lowers `mul_` as `mul`.
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def ops_poptorch_sees(module: Any, *inputs: Any) -> Set[str]:
    """The ATen ops that reach PopTorch when ``module(*inputs)`` is traced under
    ``ipu_tracing()``: overload packet names, in-place ops as their out-of-place op, dropout as
    one op (PopTorch's dispatcher takes aten::dropout whole)."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from ipu_unit_scaling.ops.trace_switch import ipu_tracing

    dropouts = {F.dropout: "dropout", torch.dropout: "dropout",
                torch.ops.aten.dropout.default: "dropout",
                F.dropout1d: "feature_dropout", F.dropout2d: "feature_dropout",
                F.dropout3d: "feature_dropout", torch.feature_dropout: "feature_dropout"}
    seen: Set[str] = set()
    inside = [0]

    class Dropouts(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = dropouts.get(func)
            if name is None:
                return func(*args, **(kwargs or {}))
            seen.add(name)
            inside[0] += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                inside[0] -= 1

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.namespace == "aten" and not inside[0]:
                seen.add(_out_of_place(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), ipu_tracing(), Ops(), Dropouts():
        module(*inputs)
    return seen


def project_models(hugging_face: bool = True) -> Iterator[Tuple[str, Any, Tuple[Any, ...]]]:
    """(name, module, inputs) for every model whose ops the table covers; ``hugging_face``
    False leaves out the Hugging Face models."""
    import torch

    from ipu_unit_scaling.apps.mlm import MLM_ALLOWED_REGIMES, MLMConfig, build_encoder
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.models import GPTConfig, build_gpt
    from ipu_unit_scaling.training.precision import simulate_fp16
    from ipu_unit_scaling.transforms import simulate_fp8

    precisions = {"fp32": None, "fp16": "fp16", "fp8-amax": FP8Config(),
                  "fp8-static": FP8Config(scaling="static"),
                  "fp8-attention": FP8Config(attention=True)}
    kinds = {"plain": dict(unit_scaled=False), "unit": dict(unit_scaled=True),
             "u-mup": dict(unit_scaled=True, parametrization="u-mup", attn_softmax_mult=2.0,
                           ffn_act_mult=0.5, loss_softmax_mult=3.0, residual_mult=1.5)}
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    for kind, keys in kinds.items():
        for precision, setting in precisions.items():
            for dropout in (0.0, 0.1):
                torch.manual_seed(0)
                model: Any = build_gpt(GPTConfig(vocab_size=32, seq_len=8, depth=2,
                                                 hidden_size=16, heads=2, dropout=dropout,
                                                 **keys))  # type: ignore[arg-type]
                if setting == "fp16":
                    model = simulate_fp16(model)
                elif isinstance(setting, FP8Config):
                    model = simulate_fp8(model, setting)
                name = f"gpt {kind} {precision} dropout {dropout}"
                yield name, model.train(), (ids, ids)
                yield name + " eval", model.eval(), (ids,)
    config = MLMConfig()
    tokens = torch.randint(0, 40, (2, config.seq_len), generator=torch.Generator().manual_seed(0))
    tokens[0, -3:] = 40  # padding
    for regime in MLM_ALLOWED_REGIMES:
        encoder = build_encoder(config, 40, regime)
        yield f"encoder {regime}", encoder.train(), (tokens, tokens)
        yield f"encoder {regime} eval", encoder.eval(), (tokens,)
    if hugging_face:
        yield from hugging_face_models()


def hugging_face_models() -> Iterator[Tuple[str, Any, Tuple[Any, ...]]]:
    """A Llama and a BERT from transformers, converted by ``unit_scale`` (none where
    transformers has no PyTorch models)."""
    try:
        import transformers
    except ImportError:
        return
    if not transformers.utils.is_torch_available():
        return
    import torch
    from torch import nn

    from ipu_unit_scaling.transforms import unit_scale

    class KeywordCall(nn.Module):
        def __init__(self, model: nn.Module, names: List[str], **fixed: Any) -> None:
            super().__init__()
            self.model, self.names, self.fixed = model, names, fixed

        def forward(self, *tensors: Any) -> Any:
            return self.model(**dict(zip(self.names, tensors)), **self.fixed).loss

    vocab, seq = 64, 16
    ids = torch.randint(5, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = unit_scale(llama, (ids,), {"labels": ids, "use_cache": False})
    yield "llama", KeywordCall(converted, ["input_ids", "labels"], use_cache=False), (ids, ids)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=seq))
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    call = dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                labels=torch.where(torch.arange(seq) % 5 == 0, ids, torch.full_like(ids, -100)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = unit_scale(bert, (ids,), {k: v for k, v in call.items() if k != "input_ids"})
    yield "bert", KeywordCall(converted.train(), list(call)), tuple(call.values())
    yield "bert eval", KeywordCall(converted.eval(), list(call)), tuple(call.values())


def traced_ops() -> Set[str]:
    ops: Set[str] = set()
    for _, module, inputs in project_models():
        ops |= ops_poptorch_sees(module, *inputs)
    try:
        from ipu_standins.poptorch._lowering_table import LOWERINGS
    except ImportError:
        return ops
    return ops | set(LOWERINGS)


# ---------------------------------------------------------------- the table module


def render(rows: Sequence[Row], gelu: Dict[str, str], commit: str) -> str:
    lines = [
        '"""What PopTorch lowers each ATen op of this project\'s models to, and whether PopART',
        "then computes what eager torch computes. Generated by ``scripts/poptorch_lowering.py``",
        f"from graphcore/poptorch at commit {commit[:12]}; do not edit.",
        "",
        "Each row names the op's handler (``poptorch/source/popart_canonicalization/``), the",
        "PopART builders it calls, and a verdict: ``same`` (PopART computes what eager torch",
        "computes), ``differs`` (another function: the stand-in computes it, see",
        ":mod:`._lowering`), ``random`` (the same distribution, drawn from the IPU's random",
        "generator), ``stochastic-rounding`` (the same unless",
        "``Precision.enableStochasticRounding`` is on, then float to half rounds",
        "stochastically) and ``constant`` (accepted only where PopTorch folds it into a",
        "constant at compile time).",
        '"""',
        "from __future__ import annotations",
        "",
        "from typing import Dict, NamedTuple, Tuple",
        "",
        '__all__ = ["POPTORCH_COMMIT", "Lowering", "LOWERINGS", "GELU_LOWERING"]',
        "",
        f'POPTORCH_COMMIT = "{commit}"',
        "",
        "",
        "class Lowering(NamedTuple):",
        "    handler: str  # file:function in popart_canonicalization",
        "    popart: Tuple[str, ...]  # the PopART builders the handler calls",
        "    verdict: str",
        "    note: str",
        "",
        "",
        "LOWERINGS: Dict[str, Lowering] = {",
    ]
    for row in rows:
        lines.append(f"    {row.op!r}: Lowering(")
        lines.append(f"        {row.handler!r},")
        lines.extend(_wrapped_tuple(row.popart, indent=8))
        lines.append(f"        {row.verdict!r},")
        lines.extend(_wrapped_string(row.note, indent=8, suffix="),"))
    lines.append("}")
    lines.append("")
    lines.append("# aten::gelu's `approximate` -> the PopART op geluHandler builds for it.")
    lines.append(f"GELU_LOWERING: Dict[str, str] = {dict(sorted(gelu.items()))!r}")
    return "\n".join(lines) + "\n"


def _wrapped_tuple(items: Sequence[str], indent: int, width: int = 99) -> List[str]:
    one_line = " " * indent + repr(tuple(items)) + ","
    if len(one_line) <= width:
        return [one_line]
    lines, current = [], " " * indent + "("
    for item in items:
        piece = repr(item) + ", "
        if len(current) + len(piece.rstrip()) > width:
            lines.append(current.rstrip())
            current = " " * (indent + 1)
        current += piece
    lines.append(current.rstrip().rstrip(",") + "),")
    return lines


def _wrapped_string(text: str, indent: int, suffix: str, width: int = 99) -> List[str]:
    pad = " " * indent
    words, lines, current = text.split(" "), [], ""
    for word in words:
        candidate = f"{current} {word}" if current else word
        if len(pad) + len(repr(candidate + " ")) + len(suffix) > width and current:
            lines.append(current + " ")
            current = word
        else:
            current = candidate
    lines.append(current)
    rendered = [pad + repr(part) for part in lines]
    rendered[-1] += suffix
    return rendered


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("poptorch", type=Path, help="a checkout of graphcore/poptorch")
    parser.add_argument("--check", action="store_true",
                        help="compare with the checked-in table instead of writing it")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    root = args.poptorch
    rows = lowering_rows(root, sorted(traced_ops()))
    handlers = registered_handlers(root)
    text = render(rows, gelu_lowering(handlers["gelu"]), checkout_commit(root))
    if args.check:
        if TABLE.read_text(encoding="utf-8") != text:
            print(f"{TABLE} differs from what {root} gives; run without --check", file=sys.stderr)
            return 1
        return 0
    TABLE.write_text(text, encoding="utf-8")
    print(f"wrote {TABLE.relative_to(REPO)}: {len(rows)} ops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
