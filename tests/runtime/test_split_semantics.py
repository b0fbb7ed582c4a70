"""`split_model` keeps the model's own semantics (issue 32): each block runs with the mask and position data
the model's own forward would give it (Mistral's sliding window, Qwen2's and Qwen3's per-layer
`layer_types`), built by transformers' own mask functions from the model's config; a model whose forward it
cannot reproduce (chunked attention, an unknown attention type, a Hugging Face model of another kind) is
refused by name before any step. Before, a Mistral whose window is shorter than the sequence trained through
the split to other numbers (every block got a full causal mask), with no word.

Each model: built from a config with random weights (nothing downloaded), tiny (3 layers, hidden 16,
sequence 16), in float64; the stages run in sequence in this process equal the unsplit model's own forward
and backward to 1e-10, the logits and every parameter's gradient."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from torch import nn  # noqa: E402

import pipec  # noqa: E402
from pipec.runtime import LocalPipeline  # noqa: E402
from pipec.runtime.errors import ModelError  # noqa: E402
from pipec.runtime.model.split import propose_split, split_model  # noqa: E402

V, T, WINDOW = 64, 16, 4  # the window is a quarter of the sequence: it changes every position past the 4th
SIZES = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=32)  # fmt: skip


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=16, n_layer=3, n_head=2, bos_token_id=0,
                                      eos_token_id=0, **drop)  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg).double()
    family, _, window = name.partition("-")
    if family == "llama":
        cfg = transformers.LlamaConfig(**SIZES, tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(cfg).double()
    if family == "mistral":
        cfg = transformers.MistralConfig(**SIZES, sliding_window=WINDOW if window else None)
        return transformers.MistralForCausalLM(cfg).double()
    config, causal = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                      "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]  # fmt: skip
    # with the window: layer 0 full, layers 1 and 2 sliding (max_window_layers=1), as `layer_types` says
    cfg = config(**SIZES, use_sliding_window=bool(window), sliding_window=WINDOW, max_window_layers=1)
    return causal(cfg).double()


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _whole(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = _logits(model(x))
    _loss(logits, y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max().clamp_min(1e-300))


MODELS = ["llama", "mistral", "mistral-window", "qwen2", "qwen2-window", "qwen3", "qwen3-window", "gpt2"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_stages_in_sequence_equal_the_model(name, attn):
    model = _build(name)
    model.config._attn_implementation = attn
    x, y = torch.randint(0, V, (2, T)), torch.randint(0, V, (2, T))
    logits, grads = _whole(model, x, y)
    for S in (1, 3):
        h = x
        for stage in split_model(model, propose_split(model, S)):
            h = stage(h)
        assert _close(h, logits) <= 1e-10, (name, S)
        _loss(h, y).backward()
        for n, p in model.named_parameters():
            assert _close(p.grad, grads[n]) <= 1e-10, (name, S, n)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window"])
def test_the_window_matters_here(name):
    """The windowed models above are a test of the window: with a full causal mask instead, their logits
    differ (what the split computed before)."""
    from pipec.runtime.model.split import causal_mask

    model = _build(name).eval()
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        logits = model(x).logits
        h = model.model.embed_tokens(x)
        pos = torch.arange(T).unsqueeze(0)
        pe = model.model.rotary_emb(h, pos)
        mask = causal_mask(T, h.dtype, h.device)
        for layer in model.model.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        full = model.lm_head(model.model.norm(h))
    assert _close(full, logits) > 1e-3


def test_windowed_mistral_through_the_pipeline_runtime():
    """The sliding-window Mistral on zb-v, 2 ranks in one process (4 stages, split backward through its
    attention), trained 3 steps of SGD: each step's loss and every gradient equal the unsplit model's
    (1e-10, float64). Before, the loss was off by 1e-2 at the first step."""
    import copy

    model = _build("mistral-window")
    whole = copy.deepcopy(model)
    pipe = LocalPipeline(pipec.compile("zb-v", p=2, m=4), dict(enumerate(split_model(model, _four(model)))), _loss)
    for step in range(3):
        x, y = torch.randint(0, V, (4, T)), torch.randint(0, V, (4, T))
        logits, grads = _whole(whole, x, y)
        loss = float(_loss(logits, y))
        model.zero_grad(set_to_none=True)
        got = float(pipe.step(x, y).loss)
        assert abs(got - loss) <= 1e-10 * abs(loss), (step, got, loss)
        with torch.no_grad():
            for (n, p), q in zip(model.named_parameters(), whole.parameters(), strict=True):
                assert _close(p.grad, grads[n]) <= 1e-10, (step, n)
                p -= 0.5 * p.grad
                q -= 0.5 * grads[n]


def _four(model: nn.Module) -> list[list[str]]:
    """Four stages of a 3-layer decoder: the embedding alone first, one layer each, norm and head last."""
    return [["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"], ["model.layers.2", "model.norm", "lm_head"]]


# ---- what the split cannot reproduce is refused by name ---------------------------------------------
def test_chunked_attention_is_refused():
    model = _build("llama")
    model.config.attention_chunk_size = 8
    with pytest.raises(ModelError, match=r"LlamaForCausalLM \(model_type `llama`\) uses chunked attention"):
        split_model(model, propose_split(model, 2))


def test_an_unknown_layer_type_is_refused():
    model = _build("qwen2-window")
    model.config.layer_types = ["full_attention", "linear_attention", "sliding_attention"]
    with pytest.raises(ModelError, match=r"Qwen2ForCausalLM .* attention `linear_attention`"):
        split_model(model, propose_split(model, 2))


def test_other_hugging_face_models_are_refused_by_name():
    """GPT-Neo has GPT-2's layout (transformer.wte, .wpe, .h) but local attention in every other layer:
    taken for a GPT-2 it would train another model."""
    cfg = transformers.GPTNeoConfig(vocab_size=V, max_position_embeddings=32, hidden_size=16, num_layers=2,
                                    num_heads=2, attention_types=[[["global", "local"], 1]], window_size=4)  # fmt: skip
    model = transformers.GPTNeoForCausalLM(cfg)
    with pytest.raises(ModelError, match=r"GPTNeoForCausalLM \(model_type `gpt_neo`\) is none of them"):
        split_model(model, propose_split(model, 2))
    split_model(model, propose_split(model, 2), forward=lambda stage, h: h)  # its own forward: accepted


def test_a_known_kind_laid_out_otherwise_is_refused():
    model = transformers.LlamaModel(transformers.LlamaConfig(**SIZES))  # no `model.` prefix, no head
    with pytest.raises(ModelError, match=r"LlamaModel \(model_type `llama`\) is not laid out as split_model knows"):
        split_model(model, [["embed_tokens", "layers.0"], ["layers.1", "layers.2", "norm"]])


def test_a_llama_layout_without_a_config_is_refused():
    class Block(nn.Linear):
        def forward(self, h, **kw):
            return super().forward(h)

    inner = nn.Module()
    inner.embed_tokens, inner.layers, inner.norm = (
        nn.Embedding(V, 4),
        nn.ModuleList(Block(4, 4) for _ in range(2)),
        nn.LayerNorm(4),
    )
    model = nn.Module()
    model.model, model.lm_head = inner, nn.Linear(4, V)
    with pytest.raises(ModelError, match=r"Module is none of them.*give forward=fn"):
        split_model(model, propose_split(model, 2))


# ---- a data-parallel kind or mesh that disagrees with the Program: refused in the caller's words --------
def test_a_dp_kind_the_program_lacks_is_refused():
    """PipelineSchedule(program, ..., dp_kind="fsdp") with a Program compiled for ddp replicated the
    parameters silently; now the kinds are named. dp_kind left out is the Program's own."""
    from pipec.ir.dataparallel import DataParallel
    from pipec.runtime.errors import PipelineError
    from pipec.runtime.pipeline_schedule import compile_for

    ddp = pipec.compile("1f1b", p=2, m=2, data_parallel=DataParallel(size=2))
    fsdp = pipec.compile("1f1b", p=2, m=2, data_parallel=DataParallel(size=2, kind="fsdp"))
    with pytest.raises(PipelineError, match=r"dp_kind='fsdp', but the Program .* dp_kind='ddp' \(dp=2\)"):
        compile_for(ddp, None, num_ranks=2, num_stages=None, n_microbatches=None, dp=2, dp_kind="fsdp")
    with pytest.raises(PipelineError, match=r"dp_kind='ddp', but the Program .* dp_kind='fsdp'"):
        compile_for(fsdp, None, num_ranks=2, num_stages=None, n_microbatches=None, dp=2, dp_kind="ddp")
    for prog in (ddp, fsdp):
        assert compile_for(prog, None, num_ranks=2, num_stages=None, n_microbatches=None, dp=2) is prog
        assert compile_for(prog, None, num_ranks=2, num_stages=None, n_microbatches=None, dp_kind=prog.dp_kind) is prog
    assert compile_for("1f1b", {"m": 2}, num_ranks=2, num_stages=None, n_microbatches=None, dp=2).dp_kind == "ddp"


def test_a_mesh_the_program_was_not_compiled_for_speaks_python():
    """The refusal of a mesh whose "dp" disagrees with the Program is read by a Python caller (pipec run
    builds its mesh from the Program): it names the keyword, not a command-line flag."""
    from pipec.runtime.errors import PipelineError
    from pipec.runtime.exec.replicas import ReplicaMesh, check_mesh

    prog = pipec.compile("1f1b", p=2, m=2)
    with pytest.raises(PipelineError, match=r"data_parallel=DataParallel\(size=2, kind='ddp'\)") as e:
        check_mesh(prog, ReplicaMesh(None, None, None, 0, 0, 2, 2))
    assert "--dp" not in str(e.value)
