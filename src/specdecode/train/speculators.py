"""An EAGLE-3 head in the vLLM `speculators` format: export, validate, import.

The format (what vLLM's Eagle-3 loader reads, `vllm serve <dir>`): config.json
with `speculators_model_type: "eagle3"`, a one-layer Llama
`transformer_layer_config` (vocab_size: the target's), `draft_vocab_size`,
`eagle_aux_hidden_state_layer_ids`, and `speculators_config` {algorithm,
proposal_methods [{proposal_type "greedy", speculative_tokens}],
default_proposal_method, verifier {name_or_path, architectures}}; weights in
model.safetensors named fc.weight, layers.0.*, norm.weight, lm_head.weight,
plus d2t ([Vd] int64 offsets: draft token i is target token i + d2t[i]) and
t2d ([V] bool: which target tokens the draft vocabulary has). The embedding
table is left out (vLLM and speculators share the verifier's).

Layer ids: speculators/vLLM count aux layer i as the residual stream entering
decoder layer i (i = L: after the last layer); specdecode counts a layer's
output (models.base), so an exported id is ours + 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdecode.drafters.eagle import FORMAT, Eagle3Config, Eagle3Head
from specdecode.drafters.head_files import WEIGHTS

# Registry targets' names on the model hub and architectures, for the verifier entry.
HUB_NAMES = {"qwen2.5-coder-1.5b": ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen2ForCausalLM"),
             "default": ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen2ForCausalLM"),
             "qwen2.5-coder-0.5b": ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen2ForCausalLM"),
             "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "LlamaForCausalLM")}


def speculators_config(cfg: Eagle3Config, verifier: str, architecture: str, k: int,
                       max_positions: int) -> dict:
    """config.json's contents for a head of `cfg` (module docstring)."""
    layer = {"model_type": "llama", "vocab_size": cfg.target_vocab_size,
             "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_hidden_layers": 1, "num_attention_heads": cfg.num_heads,
             "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
             "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
             "max_position_embeddings": max_positions, "attention_bias": False,
             "mlp_bias": False, "tie_word_embeddings": False,
             "rope_theta": cfg.rope_theta,
             "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
            "norm_before_residual": False, "target_hidden_size": cfg.hidden_size,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layers],
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": [architecture]}}}


def export(folder: str | Path, cfg: Eagle3Config,
           state: dict[str, torch.Tensor],  # Eagle3Head.state_dict() (draft_ids included)
           *, verifier: str, architecture: str, k: int = 3,
           max_positions: int = 32768) -> Path:
    """Write a head (its config and weights) to `folder` in the speculators format."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {name: t.detach().contiguous() for name, t in state.items() if name != "draft_ids"}
    ids = state["draft_ids"]
    out["d2t"] = (ids - torch.arange(len(ids))).contiguous()
    t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    save_file(out, str(folder / WEIGHTS))
    (folder / "config.json").write_text(json.dumps(
        speculators_config(cfg, verifier, architecture, k, max_positions), indent=1))
    return folder


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM's Eagle-3 loader reads from the file, with its shape."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    a = "layers.0.self_attn."
    return {"fc.weight": (h, len(cfg.aux_layers) * h),
            a + "q_proj.weight": (cfg.num_heads * d, 2 * h),
            a + "k_proj.weight": (cfg.num_kv_heads * d, 2 * h),
            a + "v_proj.weight": (cfg.num_kv_heads * d, 2 * h),
            a + "o_proj.weight": (h, cfg.num_heads * d),
            "layers.0.mlp.gate_proj.weight": (i, h), "layers.0.mlp.up_proj.weight": (i, h),
            "layers.0.mlp.down_proj.weight": (h, i),
            "layers.0.input_layernorm.weight": (h,), "layers.0.hidden_norm.weight": (h,),
            "layers.0.post_attention_layernorm.weight": (h,), "norm.weight": (h,),
            "lm_head.weight": (cfg.draft_vocab_size, h),
            "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.target_vocab_size,)}


def config_of(raw: dict) -> Eagle3Config:
    """Our head config from a speculators config.json (ValueError when it is not an
    Eagle-3 checkpoint this engine runs)."""
    if raw.get("speculators_model_type") != "eagle3":
        raise ValueError("not an Eagle-3 speculators checkpoint (speculators_model_type "
                         f"{raw.get('speculators_model_type')!r})")
    layer = raw.get("transformer_layer_config") or {}
    if layer.get("num_hidden_layers", 1) != 1 or raw.get("norm_before_residual") or any(
            raw.get(flag) for flag in ("norm_before_fc", "fc_norm", "norm_output")):
        raise ValueError("only one-layer Eagle-3 heads without the norm variants are "
                         "supported")
    rope = layer.get("rope_parameters") or {}
    heads = layer["num_attention_heads"]
    return Eagle3Config(
        hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
        num_heads=heads, num_kv_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        draft_vocab_size=raw["draft_vocab_size"], target_vocab_size=layer["vocab_size"],
        aux_layers=tuple(i - 1 for i in raw["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)))


def validate(folder: str | Path, *, target_layers: int | None = None,
             target_vocab: int | None = None, hidden_size: int | None = None) -> list[str]:
    """What vLLM's loader would reject in `folder`, one line each ([] when none):
    the config's fields, every tensor's name and shape, the vocabulary mapping
    (d2t lands on distinct target ids, t2d marks exactly those), and where a
    target is given, its layer count, vocabulary and hidden size."""
    from safetensors import safe_open
    folder = Path(folder)
    try:
        raw = json.loads((folder / "config.json").read_text())
        cfg = config_of(raw)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"config.json: {e}"]
    problems = _config_problems(raw, cfg, target_layers, target_vocab, hidden_size)
    try:
        with safe_open(str(folder / WEIGHTS), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except OSError as e:
        return [*problems, f"{WEIGHTS}: {e}"]
    for name, shape in expected_shapes(cfg).items():
        if name not in tensors:
            problems.append(f"{name}: missing")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name}: shape {tuple(tensors[name].shape)}, expected {shape}")
    extra = set(tensors) - set(expected_shapes(cfg)) - {"embed_tokens.weight"}
    problems += [f"{name}: not a tensor of the format" for name in sorted(extra)]
    if not problems:
        problems += _mapping_problems(tensors["d2t"], tensors["t2d"])
    return problems


def _config_problems(raw: dict, cfg: Eagle3Config, layers: int | None, vocab: int | None,
                     hidden: int | None) -> list[str]:
    spec = raw.get("speculators_config") or {}
    out = []
    if spec.get("algorithm") != "eagle3":
        out.append("speculators_config.algorithm must be 'eagle3'")
    methods = spec.get("proposal_methods") or []
    if not any(m.get("proposal_type") == spec.get("default_proposal_method") for m in methods):
        out.append("speculators_config.default_proposal_method names no proposal method")
    if not all(int(m.get("speculative_tokens", 0)) >= 1 for m in methods):
        out.append("speculators_config.proposal_methods: speculative_tokens must be >= 1")
    verifier = spec.get("verifier") or {}
    if not verifier.get("architectures"):
        out.append("speculators_config.verifier.architectures is empty")
    if cfg.num_heads % cfg.num_kv_heads:
        out.append(f"{cfg.num_heads} attention heads do not share {cfg.num_kv_heads} KV heads")
    ids = raw["eagle_aux_hidden_state_layer_ids"]
    if len(set(ids)) != len(ids) or min(ids) < 0 or (layers is not None and max(ids) > layers):
        out.append(f"eagle_aux_hidden_state_layer_ids {ids}: not distinct ids in 0.."
                   f"{layers if layers is not None else 'L'}")
    if vocab is not None and cfg.target_vocab_size != vocab:
        out.append(f"transformer_layer_config.vocab_size {cfg.target_vocab_size} is not the "
                   f"target's {vocab}")
    if hidden is not None and cfg.hidden_size != hidden:
        out.append(f"hidden_size {cfg.hidden_size} is not the target's {hidden}")
    return out


def _mapping_problems(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """d2t: [Vd] int64 offsets; t2d: [V] bool."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        return [f"d2t must be int64 and t2d bool (are {d2t.dtype}, {t2d.dtype})"]
    ids = torch.arange(len(d2t)) + d2t
    if ids.min() < 0 or ids.max() >= len(t2d):
        return ["d2t maps draft tokens outside the target vocabulary"]
    if len(ids.unique()) != len(ids):
        return ["d2t maps two draft tokens to one target token"]
    marked = torch.zeros_like(t2d)
    marked[ids] = True
    return [] if torch.equal(marked, t2d) else ["t2d does not mark exactly d2t's target ids"]


def load(folder: str | Path, embed: torch.Tensor,  # [V, H] the target's table
         dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """A speculators-format head (validated first) as an Eagle3Head."""
    from safetensors.torch import load_file
    problems = validate(folder)
    if problems:
        raise ValueError(f"{folder}: " + "; ".join(problems))
    cfg = config_of(json.loads((Path(folder) / "config.json").read_text()))
    tensors = load_file(str(Path(folder) / WEIGHTS))
    tensors.pop("embed_tokens.weight", None)
    d2t, _ = tensors.pop("d2t"), tensors.pop("t2d")
    tensors["draft_ids"] = torch.arange(len(d2t)) + d2t
    head = Eagle3Head(cfg, embed)
    head.load_state_dict(tensors, strict=True)
    return head.to(dtype).eval()


def load_any(folder: str | Path, embed: torch.Tensor,  # [V, H]
             dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """A head folder of either format: ours (Eagle3Head.save) or speculators'."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    if raw.get("format") == FORMAT:
        return Eagle3Head.load(folder, embed, dtype)
    return load(folder, embed, dtype)


def package_check(folder: str | Path) -> list[str]:
    """The speculators package's own reading of the config ([] when it accepts it,
    or when the package is not installed: package_note says which)."""
    try:
        from speculators.models.eagle3 import Eagle3SpeculatorConfig
    except ImportError:
        return []
    try:
        Eagle3SpeculatorConfig.from_dict(json.loads((Path(folder) / "config.json").read_text()))
    except Exception as e:  # noqa: BLE001 (the package's own errors, whatever they are)
        return [f"speculators rejects config.json: {e}"]
    return []


def package_note() -> str:
    try:
        import speculators  # noqa: F401
    except ImportError:
        return "; the speculators package is not installed, so it did not read it"
    return "; read by the speculators package's Eagle3SpeculatorConfig"


def serve_command(folder: str | Path) -> str:
    """The command a vLLM user runs to serve the target with this head (vLLM reads
    the verifier from the head's config)."""
    return f"vllm serve {Path(folder).resolve()}"
