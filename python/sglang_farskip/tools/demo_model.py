"""Tiny FarSkip checkpoints, built locally and cached, for serving on CPU: DeepSeek-V3, and
Instella-MoE (DeepSeek-V3 with q_lora_rank null, one expert group, two shared experts and a
sigmoid gate on the attention output; the key names and config keys of AMD's release).

Nothing is downloaded: the weights are seeded random numbers (Hugging Face transformers'
own DeepseekV3ForCausalLM), the tokenizer is a byte-level BPE trained here on a few built-in
paragraphs. The same seed gives byte-identical files.

    from sglang_farskip.tools.demo_model import ensure_demo_checkpoint
    path = ensure_demo_checkpoint()          # ~/.cache/sglang-farskip/tiny-dsv3-farskip-s0-<hash>
    path = ensure_demo_checkpoint(kind="instella")   # .../tiny-instella-farskip-s0-<hash>
    path = ensure_demo_checkpoint(kind="deepseek-v3-fp8")   # block FP8, requantized from bf16

    python -m sglang_farskip.tools.demo_model [--kind instella] [--cache-dir DIR] [--seed N]   # prints the path

Notes for consumers (transformers 5.19, the pinned version):
- RoPE settings live in `rope_parameters` (with `rope_theta` inside it); transformers 5 no
  longer writes top-level `rope_scaling` / `rope_theta`. `config.rope_scaling` still works
  as a property alias on the loaded config object.
- `dtype` (not `torch_dtype`) names the serving dtype: bfloat16 here, while the weights are
  stored in float32 (SGLang maps a float32 config under `--dtype auto` to float16).
- Experts are saved per expert (`mlp.experts.{i}.gate_proj.weight`, ...), the layout SGLang
  loads, although transformers 5 holds them fused in memory.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from sglang_farskip import checkpoint
from sglang_farskip.config import FarSkipConfig
from sglang_farskip.errors import ArgumentParser

LOG = logging.getLogger("sglang_farskip.demo")

# Bump whenever anything below changes what gets written: cached checkpoints are keyed on it.
BUILDER_VERSION = "2"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
BUILD_INFO = "BUILD_INFO.json"

# DeepSeek-V3's YaRN RoPE, scaled down. transformers 5 reads `rope_type`; `type` is the legacy
# spelling that older readers (and transformers itself, converting a v4 config) keep beside it.
_ROPE = {
    "rope_type": "yarn",
    "type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Overrides of transformers' DeepseekV3Config defaults (the full 671B shape) for a model that
# runs in seconds on CPU but keeps every DeepSeek-V3 feature: MLA with q/kv LoRA, a dense first
# layer, grouped sigmoid routing with a correction bias, a shared expert, YaRN.
TINY = dict(
    architectures=["DeepseekV3ForCausalLM"],
    hidden_size=256,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    moe_intermediate_size=128,
    intermediate_size=512,
    kv_lora_rank=64,
    q_lora_rank=96,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=4096,
    max_position_embeddings=4096,
    rope_parameters=_ROPE,
    # SGLang's DeepseekV2MoE reads these three; transformers 5's DeepseekV3Config has no
    # defaults for them, and without `topk_method: noaux_tc` SGLang drops the correction bias.
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    # One multi-token-prediction ("NextN") layer, as DeepSeek-V3 has, for EAGLE drafts
    # (`_add_mtp_layer`); transformers' model ignores it, SGLang's NextN draft model loads it.
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    # The serving dtype, as in DeepSeek-V3's own config: SGLang's `--dtype auto` follows it (a
    # float32 config would make SGLang pick float16). The weights themselves are stored in float32
    # (exact), so `--dtype float32` / `from_pretrained(dtype=torch.float32)` lose nothing.
    dtype="bfloat16",
)

# Instella-MoE's differences from DeepSeek-V3, at the tiny scale (as AMD's config.json of
# Instella-MoE-16B-A3B has them, docs/instella-moe.md): no query compression, one expert group, a 2-expert-wide shared
# MLP, the attention gate, and only `"farskip": true` (AMD's config class defaults the range).
INSTELLA_TINY = dict(
    architectures=["InstellaMoEForCausalLM"],
    q_lora_rank=None,
    qk_nope_head_dim=48,
    qk_rope_head_dim=16,
    v_head_dim=64,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=1,
    topk_group=1,
    n_shared_experts=2,
    moe_intermediate_size=64,
    gated_attention=True,
    qk_layernorm=True,  # Megatron's name for the kv_a_layernorm that MLA has anyway: no tensors
    # AMD ships remote code for its config class; ours (written here, see _REMOTE_CONFIG) makes
    # `--trust-remote-code` take the same path, float farskip_end_idx default included.
    auto_map={"AutoConfig": "configuration_instella_moe.InstellaMoEConfig"},
    num_nextn_predict_layers=0,  # the released checkpoint has no MTP layer
)
# DeepSeek-V3's proportions at hidden 256 (1/28 of 7168), for benchmarks whose ratios should
# mean something for the real model: one dense layer of 20 (3 of 61), 8 experts per token of
# width 64 (2048/28 is 73; 64 keeps every TP shard a multiple of 32), a dense MLP of 640
# (18432/28 is 658), 8 heads whose query and output widths are 3H and 2H (3.4H and 2.3H in
# DeepSeek-V3). Communication per layer is the demo's (the same hidden size); compute is about
# twice the demo's, and there are five times the layers.
V3_BENCH = dict(
    num_hidden_layers=20,
    first_k_dense_replace=1,
    n_routed_experts=32,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    moe_intermediate_size=64,
    intermediate_size=640,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    num_attention_heads=8,
    num_key_value_heads=8,
    num_nextn_predict_layers=0,
)
# The demo in DeepSeek's block-FP8 layout (sglang_farskip.formats.fp8), built as bf16 and requantized by
# sglang_farskip.formats.quantize. Widths change so that every block-quantized weight SGLang splits keeps
# whole 128-wide blocks per rank up to TP=2 (upstream's validate_block_quant_shapes): q_lora_rank
# 128 (q_a_proj and kv_a_proj_with_mqa are fused along a block edge), 8 heads of 32+32 (q_b_proj
# 512 rows), value heads 32 (o_proj 256 columns), expert and dense widths 256 and 512.
FP8_TINY = dict(
    q_lora_rank=128,
    num_attention_heads=8,
    num_key_value_heads=8,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    moe_intermediate_size=256,
    intermediate_size=512,
)
KINDS = ("deepseek-v3", "deepseek-v3-fp8", "instella", "v3-bench")
FP8_KINDS = ("deepseek-v3-fp8",)

_REMOTE_CONFIG = '''"""Config class for the tiny Instella-MoE demo checkpoint (sglang-farskip). Like the
released checkpoint's own class it is transformers' DeepSeek-V3 config plus the FarSkip and
gate keys, with AMD's defaults: FarSkip on every layer, the end index a float."""

from transformers import DeepseekV3Config


class InstellaMoEConfig(DeepseekV3Config):
    model_type = "deepseek_v3"

    def __init__(self, farskip=False, farskip_start_idx=0, farskip_end_idx=1e4, attn_only_farskip=False,
                 mlp_only_farskip=False, gated_attention=False, qk_layernorm=True, **kwargs):
        self.farskip = farskip
        self.farskip_start_idx = farskip_start_idx
        self.farskip_end_idx = farskip_end_idx
        self.attn_only_farskip = attn_only_farskip
        self.mlp_only_farskip = mlp_only_farskip
        self.gated_attention = gated_attention
        self.qk_layernorm = qk_layernorm
        super().__init__(**kwargs)
'''

# Scales for re-randomised tensors. Inputs to the router and to lm_head are RMS-normalised
# (per-element RMS ~1), so a weight std of c / sqrt(hidden) gives logits of std ~c.
_ROUTER_LOGIT_STD = 2.0  # sigmoid scores spread widely (top-k varies by token) yet rarely saturate into ties
_ROUTER_BIAS_RANGE = 0.1  # e_score_correction_bias ~ U(-0.1, 0.1): the bias visibly shifts choices
_LM_HEAD_LOGIT_STD = 4.0  # top-2 logit gaps well above float32 noise: greedy decode has no ties
_NORM_WEIGHT_RANGE = 0.25  # RMSNorm weights ~ 1 + U(-0.25, 0.25): a swapped norm changes outputs
# Attention gate logits ~ N(0, 1.5^2) on normalised inputs: sigmoids spread over ~(0.05, 0.95), so
# a gate read from the wrong input, skipped on one path or misaligned with the heads shows.
_GATE_LOGIT_STD = 1.5
# Token embeddings of norm ~1 (std 0.06 per element; transformers' 0.02 gives ~0.3): about the size
# of the sum of all layer outputs, so token identity still steers routing in the last layer while
# every sublayer's output (what FarSkip rewires) still moves the result.
_EMBED_STD = 0.06

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and \
predicts the next one, one step at a time, until it writes an end of text token or reaches \
the length limit that the user asked for.

Mixture of experts layers send every token to a few experts chosen by a small router. Each \
expert is a feed-forward network; a shared expert sees every token. Because only some experts \
run for a given token, the model can hold many parameters while each step stays cheap.

When a large model is split across many accelerators, each layer ends with a collective \
operation such as an all-reduce. FarSkip changes which partial sums each block reads, so the \
next block can start before the previous collective has finished. The weights keep their \
shapes and names; only the connections between blocks change.

Serving systems batch requests from many users. They measure the time to the first token, \
the time between tokens, and the number of tokens per second. In 2025 a server might answer \
thousands of requests per minute, and every millisecond saved on each step adds up.

Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris \
is the capital of France. Please write a short poem about the sea, the sky and the wind.
"""


def _filler_words() -> list[str]:
    """Pronounceable made-up words (fixed lists, no RNG) that give BPE enough distinct material
    to fill the model's whole vocabulary, so every id a random model emits decodes to text."""
    onsets = ["", "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "sh"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    codas = ["", "n", "r", "s", "l"]
    syllables = [o + v + c for o, v, c in itertools.product(onsets, vowels, codas)]
    return [a + b for a, b in itertools.product(syllables[:90], syllables[::5][:90])]


def _training_corpus() -> list[str]:
    # English repeated so its merges outrank the filler's: real words become whole tokens.
    filler = _filler_words()
    return [_ENGLISH] * 64 + [" ".join(filler[i : i + 32]) for i in range(0, len(filler), 32)]


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    min_size = 256 + 2  # every byte plus the two special tokens
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer: use >= {min_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],  # ids 0 and 1, as in the config
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    # A vocabulary larger than the corpus can fill gets reserved tokens, so that the tokenizer
    # and the embedding table always agree on size.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    bos_id = tok.token_to_id(BOS_TOKEN)
    # DeepSeek-V3's tokenizer prepends BOS; do the same.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _write_tokenizer(dst: Path, vocab_size: int, max_length: int) -> tuple[int, int]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and the chat
    template. Returns (bos_id, eos_id)."""
    from transformers import PreTrainedTokenizerFast

    tok = _train_tokenizer(vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=max_length,
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(dst))
    # transformers 5 writes tokenizer_class "TokenizersBackend", unknown to transformers 4;
    # PreTrainedTokenizerFast loads in both. It also no longer writes special_tokens_map.json.
    cfg_path = dst / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(cfg_path, tok_cfg)
    _write_json(dst / "special_tokens_map.json", {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN})
    return tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _derived_seed(seed: int, purpose: str) -> int:
    # A stream separate from torch.manual_seed(seed), which transformers' init consumes.
    digest = hashlib.sha256(f"{seed}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _rerandomise(model, seed: int) -> None:
    """Make the random model non-degenerate. transformers initialises router weights with std
    0.02, correction biases to zero and norms to one, which makes routing almost the same for
    every token and hides wiring mistakes (a swapped norm, a dropped bias)."""
    import torch

    gen = torch.Generator().manual_seed(_derived_seed(seed, "rerandomise"))
    hidden = model.config.hidden_size
    with torch.no_grad():
        for module in model.modules():  # definition order: deterministic
            if hasattr(module, "e_score_correction_bias"):  # the MoE router
                module.weight.normal_(0.0, _ROUTER_LOGIT_STD / hidden**0.5, generator=gen)
                bias = module.e_score_correction_bias
                bias.uniform_(-_ROUTER_BIAS_RANGE, _ROUTER_BIAS_RANGE, generator=gen)
            elif type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(1 - _NORM_WEIGHT_RANGE, 1 + _NORM_WEIGHT_RANGE, generator=gen)
        model.lm_head.weight.normal_(0.0, _LM_HEAD_LOGIT_STD / hidden**0.5, generator=gen)
        model.model.embed_tokens.weight.normal_(0.0, _EMBED_STD, generator=gen)


def demo_config(overrides: dict | None = None, farskip: FarSkipConfig | None = None) -> dict:
    """The config.json keys the builder passes to DeepseekV3Config (before transformers adds
    its defaults). `farskip=None` writes no FarSkip keys: a plain DeepSeek-V3 checkpoint. An
    Instella config (overrides from INSTELLA_TINY) with all-layer FarSkip writes only
    `"farskip": true`, as AMD's does."""
    cfg = json.loads(json.dumps(TINY))  # deep copy
    cfg.update(json.loads(json.dumps(overrides or {})))
    if farskip is not None:
        farskip.check_layers(cfg["num_hidden_layers"])
        if cfg.get("gated_attention") and farskip == FarSkipConfig(enabled=True):
            cfg["farskip"] = True
        else:
            cfg.update(farskip.to_hf_keys())
    return cfg


def kind_overrides(kind: str) -> dict:
    if kind not in KINDS:
        raise ValueError(f"unknown demo model {kind!r}: choose one of {', '.join(KINDS)}")
    return {"instella": dict(INSTELLA_TINY), "v3-bench": dict(V3_BENCH),
            "deepseek-v3-fp8": dict(FP8_TINY)}.get(kind, {})


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    # One 22 MB shard: transformers' "Writing model shards" bar is noise in a server's log.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _build_into(tmp: Path, cfg: dict, seed: int) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    bos_id, eos_id = _write_tokenizer(tmp, cfg["vocab_size"], cfg["max_position_embeddings"])
    cfg = dict(cfg, bos_token_id=bos_id, eos_token_id=eos_id)
    config = DeepseekV3Config(**cfg)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config)
    _rerandomise(model, seed)
    with _quiet_progress_bars():
        model.eval().save_pretrained(str(tmp), safe_serialization=True)  # float32 tensors
    # save_pretrained records the in-memory dtype (float32); restore the serving dtype.
    saved = json.loads((tmp / "config.json").read_text())
    saved["dtype"] = cfg["dtype"]
    saved["architectures"] = cfg["architectures"]  # save_pretrained writes the Python class's name
    if cfg.get("num_nextn_predict_layers"):
        _add_mtp_layer(tmp, cfg, seed)
    if cfg.get("gated_attention"):
        _add_attention_gates(tmp, config, seed)
        (tmp / "configuration_instella_moe.py").write_text(_REMOTE_CONFIG)
        for key in ("farskip_start_idx", "farskip_end_idx", "attn_only_farskip", "mlp_only_farskip"):
            if key not in cfg:
                saved.pop(key, None)  # AMD's config.json leaves the range to the class defaults
    _write_json(tmp / "config.json", saved)


def _add_mtp_layer(tmp: Path, cfg: dict, seed: int) -> None:
    """DeepSeek-V3's MTP layer `model.layers.{L}` (L = num_hidden_layers), under the names
    SGLang's NextN loader reads: one MoE decoder layer (taken from a seeded model one layer
    deeper, so it is initialised like the others), `enorm` and `hnorm` on the token embedding
    and the target's hidden state, `eh_proj` [H, 2H] joining them, and `shared_head` (norm and
    head; the head and `embed_tokens` are copies of the target's, as in the released weights).
    Random: its drafts are rarely accepted, which speculative decoding must survive exactly."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_derived_seed(seed, "mtp-layer"))
        deeper = DeepseekV3ForCausalLM(DeepseekV3Config(**{**cfg, "num_hidden_layers": L + 1}))
    _rerandomise(deeper, _derived_seed(seed, "mtp-layer"))
    file = tmp / "model.safetensors"
    state = load_file(str(file))
    mtp = f"model.layers.{L}."
    for name, tensor in deeper.state_dict().items():
        if name.startswith(mtp):
            state[name] = tensor.detach().clone().contiguous()
    gen = torch.Generator().manual_seed(_derived_seed(seed, "mtp-heads"))
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        state[f"{mtp}{norm}.weight"] = torch.empty(H).uniform_(1 - _NORM_WEIGHT_RANGE, 1 + _NORM_WEIGHT_RANGE,
                                                                generator=gen)
    state[f"{mtp}eh_proj.weight"] = torch.empty(H, 2 * H).normal_(0.0, (2 * H) ** -0.5, generator=gen)
    state[f"{mtp}shared_head.head.weight"] = state["lm_head.weight"].clone()
    state[f"{mtp}embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(file), metadata={"format": "pt"})


def _add_attention_gates(tmp: Path, config, seed: int) -> None:
    """transformers' DeepseekV3 has no attention gate: add `self_attn.gate_proj.weight`
    [heads*v_head, hidden] per layer to the saved weights, under the released checkpoint's names."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(_derived_seed(seed, "attention-gate"))
    file = tmp / "model.safetensors"
    state = load_file(str(file))
    shape = (config.num_attention_heads * config.v_head_dim, config.hidden_size)
    for k in range(config.num_hidden_layers):
        gate = torch.empty(shape).normal_(0.0, _GATE_LOGIT_STD / config.hidden_size**0.5, generator=gen)
        state[f"model.layers.{k}.self_attn.gate_proj.weight"] = gate
    save_file(state, str(file), metadata={"format": "pt"})


def build_checkpoint(
    dst: Path,
    *,
    seed: int = 0,
    overrides: dict | None = None,
    farskip: FarSkipConfig | None = FarSkipConfig(enabled=True),
) -> Path:
    """Build the tiny checkpoint into `dst` (which must not exist or be empty) and return it.

    The files are written to a temporary directory beside `dst` and renamed into place, so an
    interrupted build never leaves a half checkpoint at `dst`."""
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists and is not empty: remove it or choose another path")
    cfg = demo_config(overrides, farskip)
    dst.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        _build_into(tmp, cfg, seed)
        info = {
            "builder_version": BUILDER_VERSION,
            "seed": seed,
            "overrides": overrides or {},
            "farskip": farskip.to_hf_keys() if farskip is not None else None,
            "transformers_version": _transformers_version(),
        }
        _write_json(tmp / BUILD_INFO, info)  # written last: its presence marks a whole build
        checkpoint.make_readable(tmp)
        if dst.exists():
            dst.rmdir()  # empty (checked above); rename cannot replace a directory otherwise
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    LOG.info(
        "built tiny %s checkpoint (seed %d, %s) in %.1f s at %s",
        cfg["architectures"][0],
        seed,
        farskip.describe(cfg["num_hidden_layers"]) if farskip is not None else "no FarSkip keys",
        time.monotonic() - start,
        dst,
    )
    return dst


# predictable_mtp: every sub-block's output projection is scaled by this much.
_PREDICTABLE_OUTPUT_SCALE = 0.05
_OUTPUT_PROJECTIONS = re.compile(r"\.(self_attn\.o_proj|(mlp\.)?(experts\.\d+\.|shared_experts\.)?down_proj)\.weight$")


def predictable_mtp(src: Path | str, dst: Path | str) -> Path:
    """Copy the demo checkpoint at `src` (built with an MTP layer) to `dst`, changed so that the
    MTP ("NextN") layer predicts what the target model will: EAGLE drafts are then mostly
    accepted, as a trained MTP layer's are. Returns `dst`. For tests and benchmarks; the demo's
    own MTP layer is random, so its drafts are rarely right.

    Every sub-block's output projection (`o_proj`, every `down_proj`) is scaled down, so the
    target's next token depends mostly on the current token (a bigram model,
    head(norm(embed(t)))), and the MTP layer computes that same bigram: `eh_proj` = [I, 0]
    passes the token's normalised embedding through, its decoder layer (a copy of the target's
    last) adds little, and `shared_head.norm` is the target's final norm. Tensor names are those
    SGLang's DeepseekV3ForCausalLMNextN loads (`sglang/srt/models/deepseek_common/deepseek_weight_loader.py`).
    """
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    L, H = config["num_hidden_layers"], config["hidden_size"]
    if config.get("num_nextn_predict_layers") != 1:
        raise ValueError(f"{src} has no MTP layer (num_nextn_predict_layers is not 1)")
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for name in tensors:
        if _OUTPUT_PROJECTIONS.search(name):
            tensors[name] = tensors[name] * _PREDICTABLE_OUTPUT_SCALE
    last, mtp = f"model.layers.{L - 1}.", f"model.layers.{L}."
    for name in [n for n in tensors if n.startswith(last)]:  # already scaled down like the target's
        tensors[mtp + name[len(last):]] = tensors[name].clone()
    tensors[mtp + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)  # [H, 2H]
    tensors[mtp + "enorm.weight"] = torch.ones(H)
    tensors[mtp + "hnorm.weight"] = torch.ones(H)
    tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def default_demo_dir() -> Path:
    """The cache root: $SGLANG_FARSKIP_CACHE, else $XDG_CACHE_HOME/sglang-farskip, else
    ~/.cache/sglang-farskip."""
    if os.environ.get("SGLANG_FARSKIP_CACHE"):
        return Path(os.environ["SGLANG_FARSKIP_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "sglang-farskip"


def demo_checkpoint_name(seed: int = 0, kind: str = "deepseek-v3") -> str:
    """Directory name of the cached demo checkpoint; the hash changes with the builder version
    and the config, so a changed builder builds afresh instead of reusing stale files."""
    cfg = demo_config(kind_overrides(kind), FarSkipConfig(enabled=True))
    key = json.dumps({"builder": BUILDER_VERSION, "seed": seed, "config": cfg}, sort_keys=True)
    stem = {"instella": "tiny-instella", "v3-bench": "bench-dsv3", "deepseek-v3-fp8": "tiny-dsv3-fp8"}.get(
        kind, "tiny-dsv3")
    return f"{stem}-farskip-s{seed}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _is_complete(path: Path) -> bool:
    return (path / BUILD_INFO).is_file()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_demo_checkpoint(cache_dir: Path | str | None = None, seed: int = 0, kind: str = "deepseek-v3") -> Path:
    """Return the cached demo checkpoint of `kind` (FarSkip on every layer), building it if
    missing. Safe to call from several processes at once: one builds, the others wait and reuse it."""
    root = (Path(cache_dir).expanduser() if cache_dir is not None else default_demo_dir()).absolute()
    dst = root / demo_checkpoint_name(seed, kind)
    if _is_complete(dst):
        LOG.info("using cached demo checkpoint %s", dst)
        return dst
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{dst.name}.lock"):
        if _is_complete(dst):  # another process built it while we waited
            LOG.info("using demo checkpoint %s (built by another process)", dst)
            return dst
        # Holding the lock, anything left over is from a crashed build.
        for stale in root.glob(f".{dst.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if dst.exists():
            shutil.rmtree(dst)
        if kind not in FP8_KINDS:
            return build_checkpoint(dst, seed=seed, overrides=kind_overrides(kind))
        from sglang_farskip.formats.quantize import quantize_checkpoint

        bf16 = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-bf16-", dir=root))
        try:
            build_checkpoint(bf16 / "bf16", seed=seed, overrides=kind_overrides(kind))
            quantize_checkpoint(bf16 / "bf16", dst)  # renamed into place whole, BUILD_INFO.json included
        finally:
            shutil.rmtree(bf16, ignore_errors=True)
        return dst


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m sglang_farskip.tools.demo_model",
        description="Build (once) a tiny FarSkip demo checkpoint and print its path.",
    )
    parser.add_argument("--kind", choices=KINDS, default="deepseek-v3")
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"default: {default_demo_dir()}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    print(ensure_demo_checkpoint(args.cache_dir, args.seed, args.kind))
    return 0


if __name__ == "__main__":
    sys.exit(main())
