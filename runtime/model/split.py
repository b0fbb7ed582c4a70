"""Whole-model splitting: one `nn.Module` into pipeline stages, by module names per stage (torchtitan style).

    stages = split_model(model, [["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0",
                                  "transformer.h.1"], ["transformer.h.2", "transformer.h.3", "transformer.ln_f",
                                  "lm_head"]])
    stages = split_model(model, propose_split(model, 4))          # blocks balanced, embeddings first, head last
    stages = split_model(model, partition="partition.json")       # a `pipec partition` file, for this model

Each stage is a `StageModule` that keeps the named modules (the same objects: nothing is copied) under their
own paths, so its parameter names are the model's FQNs (`transformer.h.2.attn.c_attn.weight`: checkpoints
and optimizer groups by name keep working), and drops the rest. Its forward runs the kept modules in the
model's order, as a chain; the common shapes are known:

- Hugging Face GPT-2 (`transformer.wte`, `transformer.wpe`, `transformer.drop`, `transformer.h.N`,
  `transformer.ln_f`, `lm_head`): token embedding, plus position embedding of 0..T-1, blocks with a causal
  mask, final norm, head;
- Llama, Mistral, Qwen2, Qwen3 (`model.embed_tokens`, `model.layers.N`, `model.norm`, `lm_head`): the rotary
  embedding (`model.rotary_emb`, buffers only) is kept by every stage with layers and given to each layer;
- in both, each block gets the mask its model's own forward builds (transformers' mask functions on the
  model's config: Mistral's sliding window, Qwen2's per-layer `layer_types`), and a Hugging Face model of
  another kind, or one with what the split cannot reproduce (chunked attention, an unknown attention type),
  is refused by name (`family`): split into a chain it would silently train another model;
- an `nn.Sequential`, or any model whose forward is a plain chain of its children: each module on the previous
  one's output (a tuple output passes its first element on).

A model whose forward is not a chain takes `forward=fn`: `fn(stage, *args)` is the stage's forward, with
`stage.get_submodule(fqn)` for its modules and `stage.fqns` for their names.

Tied weights (GPT-2's `lm_head.weight` is `transformer.wte.weight`): a Parameter reached by names in two
stages is recorded in each stage's `tied` ({local name: the tie's key}); `PipelineSchedule` sums the copies'
gradients between the ranks that hold them at the end of each step, as Megatron does for its shared
embedding. In one process the stages share the Parameter itself, so the gradients add up by themselves.

torch's own tracer is the other entry: `split_with_pipeline(model, example_args, split_points)` runs
`torch.distributed.pipelining.pipeline` with `SplitPoint.BEGINNING` at each stage's first module.
Errors (names that name no module, an empty stage, overlapping or out-of-order stages, a partition file
for another model, stages whose shapes do not fit) are `ModelError`/`ShapeError` before any training.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipec.runtime.errors import ModelError, ShapeError

# ---- the model's shape ------------------------------------------------------------------------------
# Hugging Face decoders whose forward between the blocks is only: embed the tokens, build the attention masks
# and the rotary embedding from the positions 0..T-1, run the blocks, norm, head. The value says which mask
# each block gets, as the model's own forward chooses it: "full" (every block the causal mask), "window"
# (Mistral: every block the sliding-window mask when `config.sliding_window` is set), "layer_types" (Qwen2,
# Qwen3: `config.layer_types[i]`, from `use_sliding_window` and `max_window_layers`).
DECODERS = {"llama": "full", "mistral": "window", "qwen2": "layer_types", "qwen3": "layer_types"}
ATTENTION = ("full_attention", "sliding_attention")  # the per-layer types whose masks the split builds
_KNOWN = "GPT-2, Llama, Mistral, Qwen2 and Qwen3"


def model_type(model: nn.Module) -> str | None:
    """A Hugging Face model's `config.model_type` ("llama", "gpt2", ...); None for a model without one."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if isinstance(kind, str) and kind else None


def family(model: nn.Module) -> str:
    """Which known forward a model's stages get: "gpt2", "llama" (the decoders of DECODERS), or "chain".
    A Hugging Face model of another kind, or a model laid out as a Llama without a config saying which, is
    refused by name: its forward may compute between its modules what the split would not (a sliding
    window, chunked attention, a scaled embedding), and training it split would silently train another model."""
    names = dict(model.named_modules())
    kind = model_type(model)
    what = type(model).__name__ + (f" (model_type `{kind}`)" if kind else "")
    if "transformer.wte" in names and "transformer.h" in names and kind in (None, "gpt2"):
        return "gpt2"
    if "model.embed_tokens" in names and "model.layers" in names and kind in DECODERS:
        _check_decoder(model, what)
        return "llama"
    if kind == "gpt2" or kind in DECODERS:
        raise ModelError(
            f"{what} is not laid out as split_model knows its kind (GPT-2: transformer.wte, transformer.h; "
            "Llama and the like: model.embed_tokens, model.layers): split the LM-head model "
            "(GPT2LMHeadModel, LlamaForCausalLM, ...), or give forward=fn"
        )
    if kind is not None or ("model.embed_tokens" in names and "model.layers" in names):
        raise ModelError(
            f"split_model knows the forward of {_KNOWN} (Hugging Face); {what} is none of them, and its forward "
            "may compute between its modules what a split into stages would not (masks, windows, scaled "
            "embeddings): give forward=fn, the stage's forward (docs/transformer.md)"
        )
    return "chain"


def _check_decoder(model: nn.Module, what: str) -> None:
    """Refuse what the split cannot reproduce of a known decoder: chunked attention, an attention type per
    layer whose mask it does not build, a layer list longer or shorter than the config's."""
    config = model.config
    if getattr(config, "attention_chunk_size", None):
        raise ModelError(
            f"{what} uses chunked attention (config.attention_chunk_size = {config.attention_chunk_size}), "
            "which split_model does not reproduce: give forward=fn"
        )
    layers = len(model.get_submodule("model.layers"))
    if getattr(config, "num_hidden_layers", layers) != layers:
        raise ModelError(
            f"{what} has {layers} layers but its config says num_hidden_layers={config.num_hidden_layers} "
            "(its forward runs only those): split_model would run another model"
        )
    types = attention_types(model)
    unknown = sorted({t for t in types if t not in ATTENTION})
    if unknown:
        raise ModelError(
            f"{what} has layers with attention `{unknown[0]}` (config.layer_types), whose mask split_model does "
            f"not build (it knows {', '.join(ATTENTION)}): give forward=fn"
        )


def attention_types(model: nn.Module) -> tuple[str, ...]:
    """Each block's attention type ("full_attention", "sliding_attention", ...) in a known decoder, as the
    model's own forward picks its mask (see DECODERS)."""
    config, n = model.config, len(model.get_submodule("model.layers"))
    rule = DECODERS[model_type(model)]
    if rule == "window":
        return ("full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention",) * n
    if rule == "layer_types":
        types = getattr(config, "layer_types", None)
        if not isinstance(types, (list, tuple)) or len(types) < n:
            raise ModelError(f"{type(model).__name__}: config.layer_types must give each of its {n} layers a type")
        return tuple(str(t) for t in types[:n])
    return ("full_attention",) * n


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest ModuleList (or Sequential) of blocks of one type: a transformer's layers."""
    best = None
    for name, mod in model.named_modules():
        if not name or not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) == 0:
            continue
        if len({type(b) for b in mod}) != 1:
            continue
        if best is None or len(mod) > len(best[1]):
            best = (name, mod)
    return best


def propose_split(model: nn.Module, num_stages: int) -> list[list[str]]:
    """An FQN list per stage for a model with a repeated block list: the blocks balanced by count over the
    stages, what comes before the list (embeddings) on the first stage, what comes after (final norm, head)
    on the last. An nn.Sequential model's own children are its blocks."""
    if num_stages < 1:
        raise ModelError(f"propose_split: num_stages must be at least 1, got {num_stages}")
    if isinstance(model, nn.Sequential):
        names = [n for n, _ in model.named_children()]
        pre, blocks, post = [], names, []
    else:
        found = block_list(model)
        if found is None:
            raise ModelError(
                f"propose_split: {type(model).__name__} has no list of repeated blocks (an nn.ModuleList of one "
                "type); give the module names per stage yourself"
            )
        path, mod = found
        blocks = [f"{path}.{i}" for i in range(len(mod))]
        pre, post = _around(model, path)
    n = len(blocks)
    if n < num_stages:
        raise ModelError(f"propose_split: {n} blocks cannot fill {num_stages} stages (a stage would be empty)")
    stages = [blocks[k * n // num_stages : (k + 1) * n // num_stages] for k in range(num_stages)]
    stages[0] = pre + stages[0]
    stages[-1] = stages[-1] + post
    return stages


def _around(model: nn.Module, path: str) -> tuple[list[str], list[str]]:
    """The modules before and after `path` in the model's order: its siblings, and its ancestors' siblings."""
    parts = path.split(".")
    pre: list[str] = []
    post: list[str] = []
    node, prefix = model, ""
    for part in parts:
        names = [n for n, _ in node.named_children()]
        i = names.index(part)
        pre += [prefix + n for n in names[:i]]
        post = [prefix + n for n in names[i + 1 :]] + post
        node, prefix = getattr(node, part), prefix + part + "."
    return pre, post


def model_fingerprint(model: nn.Module, layer_names: Sequence[str]) -> str:
    """The partition format's fingerprint (pipec.formats.partition_files.fingerprint: the layers' names and their
    parameters' names and shapes) of the named modules of `model`; a name that names no module counts as
    a layer without parameters, so the fingerprint differs from the file's and the refusal names it."""
    from pipec.formats.partition_files import fingerprint

    modules = dict(model.named_modules())
    shapes = {n: [(pn, tuple(p.shape)) for pn, p in modules[n].named_parameters()] for n in layer_names if n in modules}
    return fingerprint([(n, shapes.get(n, [])) for n in layer_names])


def read_partition(partition: str | os.PathLike | Mapping, model: nn.Module) -> list[list[str]]:
    """The FQN lists of a partition file (`pipec partition` writes them; a path or the loaded dict), for
    this model: ModelError when the file is malformed, edited by hand (its fingerprint is not that of its
    model, layers and stages, E810) or made for another model (E804), its code in the message."""
    from pipec.errors import PipecError, error
    from pipec.formats.partition_files import coverage, parse_partition
    from pipec.formats.partition_files import read_partition as read_file

    where = "the partition" if isinstance(partition, Mapping) else os.fspath(partition)
    try:
        part = parse_partition(partition) if isinstance(partition, Mapping) else read_file(where)
        modules = dict(model.named_modules())
        missing = [n for n in part.layers if n not in modules]
        if missing:
            raise ModelError(
                f"{where}: the partition was made for another model: layer `{missing[0]}` is not in this one; "
                "run `pipec partition` again for this model"
            )
        order = {n: i for i, n in enumerate(modules)}
        wrong = coverage(part.layers, sorted(part.layers, key=order.__getitem__), type(model).__name__)
        if wrong is not None:  # the model's own order of its modules is the order its forward runs them in
            raise error("E810", f"{part.what} does not split {type(model).__name__} as written: {wrong}")
        part.check_model(model_fingerprint(model, part.layers), part.layers, type(model).__name__)
    except PipecError as e:
        d = e.diagnostics[0]
        notes = "".join(f"; {n}" for n in d.notes)
        head = "" if where in d.message else f"{where}: "
        raise ModelError(f"{head}error[{d.code}]: {d.message}{notes}") from None
    return [list(s) for s in part.stages]


# ---- the stage --------------------------------------------------------------------------------------
class StageModule(nn.Module):
    """One stage of a split model: the kept modules under their model paths, and a forward over them."""

    def __init__(
        self,
        model: nn.Module,
        fqns: Sequence[str],
        stage_index: int,
        num_stages: int,
        kind: str,
        forward: Callable[..., Any] | None,
    ) -> None:
        super().__init__()
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        self.fqns = tuple(sorted(fqns, key=order.__getitem__))
        self.stage_index, self.num_stages, self.kind = stage_index, num_stages, kind
        self.custom = forward
        self.tied: dict[str, str] = {}
        for fqn in self.fqns:
            _graft(self, fqn, model.get_submodule(fqn))
        self.rotary: str | None = None  # the path of Llama's rotary embedding, when this stage needs it
        self.config = getattr(model, "config", None) if model_type(model) is not None else None
        self.attention: dict[str, str] = {}  # each kept block's attention type (its mask), as the model's forward
        if kind == "llama":
            types = attention_types(model)
            self.attention = {f: types[int(f.split(".")[2])] for f in self.fqns if _role(kind, f)[0] == "block"}
        elif kind == "gpt2":
            self.attention = {f: "full_attention" for f in self.fqns if _role(kind, f)[0] == "block"}
        if kind == "llama" and self.attention:
            rot = dict(model.named_modules()).get("model.rotary_emb")
            if rot is not None:
                if "model.rotary_emb" not in self.fqns:
                    _graft(self, "model.rotary_emb", rot)  # registered once: buffers only, no parameters
                self.rotary = "model.rotary_emb"

    def extra_repr(self) -> str:
        return f"stage {self.stage_index} of {self.num_stages}: {', '.join(self.fqns)}"

    def forward(self, *args: Any) -> Any:
        if self.custom is not None:
            return self.custom(self, *args)
        h = args[0] if len(args) == 1 else args
        pos = masks = pe = None
        for fqn in self.fqns:
            mod = self.get_submodule(fqn)
            role, _ = _role(self.kind, fqn)
            if role == "skip":
                continue
            if role == "pos_embed":  # GPT-2's wpe: positions 0..T-1 of the token embedding
                h = h + mod(torch.arange(h.shape[1], device=h.device))
                continue
            if role == "block":
                if masks is None:
                    pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
                    masks = self._masks(h, pos)
                    if self.rotary is not None:
                        pe = self.get_submodule(self.rotary)(h, pos)
                kw: dict[str, Any] = {"attention_mask": masks[self.attention[fqn]], "position_ids": pos}
                if pe is not None:
                    kw["position_embeddings"] = pe
                out = mod(h, **kw)
            else:
                out = mod(*h) if isinstance(h, tuple) else mod(h)
            if isinstance(out, tuple):  # a block's (hidden, ...) or a module's several outputs: the first goes on
                out = out[0]
            elif not isinstance(out, torch.Tensor) and hasattr(out, "logits"):  # a Hugging Face output object
                out = out.logits
            h = out
        return h

    def _masks(self, h: torch.Tensor, pos: torch.Tensor) -> dict[str, Any]:
        """{attention type: the mask its blocks get}, built as the model's own forward builds it: by
        transformers' `create_causal_mask` / `create_sliding_window_causal_mask` from the model's config (its
        attention implementation, its window), for the hidden states `h` and positions `pos` the model's first
        block would see; a model without a config (a GPT-2 of the user's own) gets the additive causal mask."""
        if self.config is None:
            return {"full_attention": causal_mask(h.shape[1], h.dtype, h.device)}
        from transformers import masking_utils

        make = {
            "full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        }
        return {
            t: make[t](config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)
            for t in sorted(set(self.attention.values()))
        }


def causal_mask(t: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive causal mask (1, 1, T, T) that Hugging Face attention takes (eager and sdpa alike)."""
    m = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return m[None, None]


def _role(kind: str, fqn: str) -> tuple[str, str]:
    """What a kept module does in a known family's forward."""
    if kind == "gpt2":
        if fqn == "transformer.wpe":
            return "pos_embed", fqn
        if fqn.startswith("transformer.h."):
            return "block", fqn
    if kind == "llama":
        if fqn == "model.rotary_emb":
            return "skip", fqn
        if fqn.startswith("model.layers."):
            return "block", fqn
    return "chain", fqn


def _graft(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Put `module` at path `fqn` under root, with empty containers on the way (no copy)."""
    *path, last = fqn.split(".")
    node = root
    for part in path:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(last, module)


# ---- splitting --------------------------------------------------------------------------------------
def split_model(
    model: nn.Module,
    stages: Sequence[Sequence[str]] | None = None,
    *,
    partition: str | os.PathLike | Mapping | None = None,
    forward: Callable[..., Any] | None = None,
    only: Sequence[int] | None = None,
    strict: bool = True,
    example: Any = None,
) -> list[StageModule]:
    """The model's stages, one StageModule per FQN list (or per stage of a partition file), checked: every
    name names a module, no stage is empty, no module is in two stages, the stages follow the model's order,
    and (strict) every module with parameters is in some stage. `only`: build just these stage indices
    (the others are None in the list: a rank's own stages, so the rest can be freed). `example`: one
    micro-batch of inputs, run through the stages in order on this process, so a stage whose output does not
    fit the next one is named now (`probe`)."""
    if (stages is None) == (partition is None):
        raise ModelError("split_model takes the FQN lists per stage or partition=, one of the two")
    if partition is not None:
        stages = read_partition(partition, model)
    stages = [list(s) for s in stages]
    kind = family(model) if forward is None else "custom"
    check_split(model, stages, strict=strict)
    num = len(stages)
    want = set(range(num)) if only is None else set(only)
    out = [StageModule(model, fqns, k, num, kind, forward) if k in want else None for k, fqns in enumerate(stages)]
    _mark_ties(model, stages, out)
    if example is not None:
        probe([s for s in out if s is not None], example)
    return out


def check_split(model: nn.Module, stages: list[list[str]], *, strict: bool = True) -> None:
    """Refuse a split that cannot be right, naming the stage and the module."""
    modules = dict(model.named_modules())
    order = {n: i for i, n in enumerate(modules)}
    if not stages:
        raise ModelError("the split has no stages")
    owner: dict[str, int] = {}
    for k, fqns in enumerate(stages):
        if not fqns:
            raise ModelError(f"stage {k} is empty: give it at least one module")
        for n in fqns:
            if not isinstance(n, str) or n not in modules or n == "":
                near = [m for m in modules if m and isinstance(n, str) and m.endswith("." + n.split(".")[-1])][:3]
                hint = f" (did you mean {', '.join(near)}?)" if near else ""
                raise ModelError(f"stage {k}: `{n}` names no module of {type(model).__name__}{hint}")
            for m, j in owner.items():
                if m == n or n.startswith(m + ".") or m.startswith(n + "."):
                    raise ModelError(f"`{n}` of stage {k} overlaps `{m}` of stage {j}: a module belongs to one stage")
            owner[n] = k
    for k in range(len(stages) - 1):
        last = max(stages[k], key=order.__getitem__)
        first = min(stages[k + 1], key=order.__getitem__)
        if order[last] > order[first]:
            raise ModelError(
                f"stage {k}'s `{last}` comes after stage {k + 1}'s `{first}` in the model: stages must follow "
                "the model's order (a chain), or give forward= for another one"
            )
    if strict:
        kept = list(owner)
        for n, mod in modules.items():
            if not n or not list(mod.parameters(recurse=False)):
                continue
            if not any(n == m or n.startswith(m + ".") for m in kept):
                raise ModelError(
                    f"`{n}` has parameters but is in no stage (its training would be dropped silently): add it "
                    "to a stage, or pass strict=False to leave it out"
                )


def _owner(name: str, stages: list[list[str]]) -> int | None:
    for k, fqns in enumerate(stages):
        if any(name == m or name.startswith(m + ".") for m in fqns):
            return k
    return None


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each Parameter reached by more than one name (tied weights), first name first."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [ns for ns in names.values() if len(ns) > 1]


def _mark_ties(model: nn.Module, stages: list[list[str]], out: list[StageModule | None]) -> None:
    """Each stage's share of a weight tied across stages: {its name there: the tie's key (first name)}."""
    for names in tied_parameters(model):
        owners = {n: _owner(n, stages) for n in names}
        if len({k for k in owners.values() if k is not None}) < 2:
            continue
        for n, k in owners.items():
            if k is not None and out[k] is not None:
                out[k].tied[n] = names[0]


def probe(stages: Sequence[nn.Module], example: Any) -> None:
    """Run one micro-batch through the stages in order (no autograd, eval mode): a stage that cannot take
    the previous one's output is a ShapeError naming both stages and the shape."""
    from pipec.runtime.exec.shapes import TensorSpec, fmt, outputs_of

    x = example if isinstance(example, tuple) else (example,)
    with torch.no_grad():
        for i, st in enumerate(stages):
            was = st.training
            st.eval()
            try:
                out = st(*x)
            except Exception as e:
                shape = fmt(tuple(TensorSpec.of(t) for t in x if isinstance(t, torch.Tensor)))
                k = getattr(st, "stage_index", i)
                if i == 0:
                    raise ShapeError(
                        f"stage {k} cannot take the example input {shape}: {type(e).__name__}: {e}"
                    ) from None
                raise ShapeError(
                    f"stage {k - 1} outputs {shape}, which stage {k} cannot take: {type(e).__name__}: {e}"
                ) from None
            finally:
                st.train(was)
            if i < len(stages) - 1:
                x = outputs_of(out, getattr(st, "stage_index", i))


# ---- torch's tracer ---------------------------------------------------------------------------------
def split_points(stages: Sequence[Sequence[str]]) -> dict[str, Any]:
    """torch `pipeline()` split points for FQN lists: SplitPoint.BEGINNING at each later stage's first module."""
    from torch.distributed.pipelining import SplitPoint

    return {list(s)[0]: SplitPoint.BEGINNING for s in list(stages)[1:]}


def split_with_pipeline(
    model: nn.Module, example_args: tuple, split_spec: Mapping[str, Any] | Sequence[Sequence[str]]
) -> list[nn.Module]:
    """The stages torch's tracer makes (`torch.distributed.pipelining.pipeline`), each with `stage_index`
    and `num_stages` set so PipelineSchedule places them. split_spec: {fqn: SplitPoint} or FQN lists."""
    from torch.distributed.pipelining import pipeline

    if not isinstance(split_spec, Mapping):
        check_split(model, [list(s) for s in split_spec], strict=False)
        split_spec = split_points(split_spec)
    names = dict(model.named_modules())
    for n in split_spec:
        if n not in names:
            raise ModelError(f"split point `{n}` names no module of {type(model).__name__}")
    pipe = pipeline(model, mb_args=tuple(example_args), split_spec=dict(split_spec))
    out = []
    for k in range(pipe.num_stages):
        mod = pipe.get_stage_module(k)
        mod.stage_index, mod.num_stages = k, pipe.num_stages
        out.append(mod)
    return out


__all__ = [
    "StageModule",
    "model_fingerprint",
    "probe",
    "propose_split",
    "read_partition",
    "split_model",
    "split_points",
    "split_with_pipeline",
    "tied_parameters",
]
