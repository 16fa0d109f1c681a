"""The memory plan: what a load will hold resident, part by part, before anything loads.

`memory_plan(spec)` resolves a LoadSpec as `LLM.load` will (plan.resolve) and
adds up, from model metadata and file sizes only (limits.py's arithmetic):

- target weights: torch, the parameters in the chosen dtype (+ RoPE tables);
  llama.cpp, the GGUF file (its tensors are read into memory, not mapped);
- the target's KV cache at the configured context (torch: the dtype; llama.cpp:
  its f16 cache type); on llama.cpp, where its plain-layout copy is known to be used
  (models/llama_cpp_prefill.py: forced, or measured to pay before), that copy's
  mapped weights, KV cache and compute buffer too, as optional parts (in the
  predicted peak, not in the total a load must fit: the copy is loaded only
  where twice its memory is free);
- the draft model's weights (torch int8: linears at one byte plus the bf16
  embedding; llama.cpp: its GGUF) and KV cache at the same context, or a
  trained head's files (hidden-head, eagle3);
- activations: torch, one verification pass of k + 1 tokens (logits, layer
  temporaries, attention scores over the whole context; bf16 on a CPU without
  bf16 matrix hardware, models/wide_f32.py's scratch buffer too); llama.cpp, the compute
  buffer it reserves per model for a batch of n_batch tokens (logits of the
  batch dominate: 512 x 151,936 x 4 bytes for the default pair);
- torch on CPU, loading: a model's weights are read from the (converted)
  safetensors file's mapping and copied into an arena (models/arena.py), so
  while the largest one loads its weights are resident twice;
- the process itself: what it holds resident now (interpreter, torch, ...).

`MemoryPlan.check()` refuses, before any weights are read, a plan whose parts
exceed the memory available (limits.available_bytes, or free CUDA memory),
with a message naming the biggest parts and what lowers each. advise, serve
and generate --json print the plan; bench records it beside the measured peak
RSS (`peak_rss_bytes`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from specdecode import limits
from specdecode.models import llama_cpp_prefill, wide_f32
from specdecode.options import LoadSpec, OptionError

LLAMA_CPP_BATCH = 512  # LlamaCppLM's n_batch: the tokens its compute buffer is sized for

# What lowers each kind of part, in OptionError's <option> terms (cli.LOAD_FLAGS names them).
LOWER = {
    "weights": "a smaller <dtype> or a quantized model (GGUF on the llama.cpp <backend>)",
    "draft weights": "<draft_quant> int8 or <drafter> ngram (no draft model)",
    "kv": "a shorter <max_seq_len>",
    "activations": "a smaller <k> or a shorter <max_seq_len>",
    "process": "nothing (the interpreter and libraries)",
    "optional": "SPECDECODE_PREFILL_COPY=0 (loaded only where twice it is free)",
}


@dataclass(frozen=True)
class Part:
    """One resident part: name, bytes, and its kind (a key of LOWER)."""

    name: str
    bytes: int
    kind: str


@dataclass(frozen=True)
class MemoryPlan:
    """The parts a load will hold and the memory available for them (None: unknown).

    `total` is what loading adds (every part but the process's own and the optional
    ones: llama.cpp's plain-layout copy, loaded only where twice it is free); the
    process's peak resident set should come to about `predicted_peak` = every part."""

    parts: tuple[Part, ...]
    available: int | None
    device: str
    context: int

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts if p.kind not in ("process", "optional"))

    @property
    def predicted_peak(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def fits(self) -> bool:
        return self.available is None or self.total <= self.available

    def with_parts(self, extra: list[Part]) -> MemoryPlan:
        """This plan with `extra` parts held beside it (names kept as given)."""
        return MemoryPlan(self.parts + tuple(extra), self.available, self.device, self.context)

    def plus(self, other: MemoryPlan, label: str) -> MemoryPlan:
        """Both loads held at once (other's parts named "label: ...", its process part
        left out: one process); available: this plan's."""
        extra = tuple(Part(f"{label}: {p.name}", p.bytes, p.kind) for p in other.parts
                      if p.kind != "process")
        return MemoryPlan(self.parts + extra, self.available, self.device, self.context)

    def to_dict(self) -> dict[str, object]:
        return {"parts": {p.name: p.bytes for p in self.parts}, "total": self.total,
                "predicted_peak_rss": self.predicted_peak, "available": self.available,
                "device": self.device, "context": self.context, "fits": self.fits}

    def describe(self) -> str:
        """One line: each part in GB, the total against what is available."""
        parts = ", ".join(f"{p.name} {p.bytes / limits.GB:.2f}" for p in self.parts)
        avail = ("unknown" if self.available is None
                 else f"{self.available / limits.GB:.2f} GB available")
        return (f"memory (GB): {parts}; total {self.total / limits.GB:.2f} GB to load, "
                f"{avail} on {self.device}")

    def check(self) -> None:
        """OptionError when the parts do not fit: names the biggest ones and what
        lowers each (options marked <name>, rendered as flags on the CLI)."""
        if self.fits:
            return
        big = sorted((p for p in self.parts if p.kind not in ("process", "optional")),
                     key=lambda p: -p.bytes)
        named = "; ".join(f"{p.name} {p.bytes / limits.GB:.1f} GB (lower it: "
                          f"{LOWER[p.kind]})" for p in big[:3])
        raise OptionError(
            f"this load needs about {self.total / limits.GB:.1f} GB, but only "
            f"{self.available / limits.GB:.1f} GB of memory is available on {self.device} "
            f"at a {self.context}-token context: {named}")


def memory_plan(spec: LoadSpec, facts=None) -> MemoryPlan:
    """The memory plan of `spec` on this machine (see the module doc)."""
    from specdecode.plan import Facts, resolve

    return plan_memory(resolve(spec, facts or Facts.here()))


def plan_memory(plan) -> MemoryPlan:
    """The memory plan of a resolved plan (plan.Plan); sizes from metadata only. A
    model whose metadata cannot be read counts its files only."""
    spec = plan.spec
    target_cfg = limits.model_config(plan.target.path)
    context = _context(spec, target_cfg)
    parts = list(_model_parts("target", plan.target.path, plan.target.backend, target_cfg,
                              spec, context, int8=False))
    copied = [parts[0].bytes] if plan.target.backend == "torch" else []
    if plan.draft is not None:
        cfg = limits.model_config(plan.draft.path)
        draft = _model_parts("draft", plan.draft.path, plan.draft.backend, cfg, spec, context,
                             int8=plan.draft_quant == "int8")
        copied += [draft[0].bytes] if plan.draft.backend == "torch" else []
        parts += draft
    parts += head_parts(plan, context)
    parts.append(_activations(plan.target.backend, target_cfg, spec, context, plan.k,
                              drafted=plan.draft is not None))
    if copied and str(spec.device).startswith("cpu"):
        parts.append(Part("loading (weights file mapped while copied)", max(copied),
                          "weights"))
    parts.append(Part("process now", resident_bytes(), "process"))
    return MemoryPlan(tuple(parts), _available(spec.device), str(spec.device), context)


def head_parts(plan, context: int) -> list[Part]:
    """A resolved plan's trained head (hidden-head, eagle3: spec.head): its files, and
    an eagle3 head's KV cache at `context` tokens; none for a plan without one."""
    spec = plan.spec
    if not ({"hidden-head", "eagle3"} & set(plan.drafters)) or spec.head is None:
        return []
    parts = [Part("head weights", files_bytes(Path(spec.head)), "draft weights")]
    if "eagle3" in plan.drafters:
        parts.append(Part(f"head KV cache ({context} tokens)",
                          _head_cache_bytes(Path(spec.head), context, spec), "kv"))
    return parts


def _context(spec: LoadSpec, cfg) -> int:
    """The context the load will size its caches for (as limits.check_load)."""
    if spec.max_seq_len is not None:
        return spec.max_seq_len
    return min(cfg.max_position_embeddings, 8192) if cfg is not None else 8192


def _head_cache_bytes(folder: Path, context: int, spec: LoadSpec) -> int:
    """An EAGLE-3 head's keys and values at `context` positions (drafters/eagle.py:
    one layer, in the target's dtype on torch), from its config.json in either
    format (ours, or speculators' transformer_layer_config); 0 where unreadable."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    layer = raw.get("transformer_layer_config") or raw
    kv_heads, head_dim = layer.get("num_key_value_heads", layer.get("num_kv_heads")), layer.get(
        "head_dim")
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
        return 0
    elem = limits.DTYPE_BYTES.get(str(spec.dtype).removeprefix("torch."), 4)
    return 2 * kv_heads * head_dim * context * elem


def _model_parts(role: str, path: Path, backend: str, cfg, spec: LoadSpec, context: int,
                 int8: bool) -> list[Part]:
    """Weights and KV cache of one model (role: "target" or "draft")."""
    kind = "weights" if role == "target" else "draft weights"
    if backend == "llama.cpp" or cfg is None:
        weights = files_bytes(path)
        kv = limits.kv_cache_bytes(cfg, context, limits.LLAMA_CPP_KV_BYTES) if cfg else 0
    else:
        elem = limits.DTYPE_BYTES.get(str(spec.dtype).removeprefix("torch."), 4)
        weights = (int8_weight_bytes(cfg, elem) if int8 else limits.weight_bytes(cfg, elem)
                   ) + limits.rope_bytes(cfg, context, elem)
        kv = limits.kv_cache_bytes(cfg, context, elem)
    parts = [Part(f"{role} weights", weights, kind),
             Part(f"{role} KV cache ({context} tokens)", kv, "kv")]
    if backend == "llama.cpp" and path.is_file() and llama_cpp_prefill.planned(path):
        buffer = LLAMA_CPP_BATCH * (cfg.vocab_size + 4 * cfg.hidden_size) * 4 if cfg else 0
        parts += [Part(f"{role} plain-layout copy: weights (mapped)", weights, "optional"),
                  Part(f"{role} plain-layout copy: KV cache and compute buffer", kv + buffer,
                       "optional")]
    return parts


def int8_weight_bytes(cfg, elem: int) -> int:
    """A torch model after models/quant.quantize_int8: every linear (lm_head too) at one
    byte per weight plus a float32 scale per row; embedding and norms in `elem`."""
    one_byte = limits.weight_bytes(cfg, 1)  # linears + embedding(s) + norms at 1 byte
    table = cfg.vocab_size * cfg.hidden_size
    embed = table * (elem - 1)  # the input embedding stays in the activations' dtype
    lm_head = table if cfg.tie_word_embeddings else 0  # tied: lm_head's own int8 copy
    rows = cfg.num_layers * (cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads)
                             + cfg.hidden_size + 2 * cfg.intermediate_size + cfg.hidden_size)
    return one_byte + embed + lm_head + 4 * (rows + cfg.vocab_size)


def _activations(backend: str, cfg, spec: LoadSpec, context: int, k: int,
                 drafted: bool) -> Part:
    """Working memory of the passes: see the module doc."""
    if cfg is None:
        return Part("activations", 0, "activations")
    if backend == "llama.cpp":
        batch = min(LLAMA_CPP_BATCH, context)
        per_model = batch * (cfg.vocab_size + 4 * cfg.hidden_size) * 4
        models = 2 if drafted else 1
        return Part(f"compute buffers ({batch}-token batch)", models * per_model,
                    "activations")
    elem = limits.DTYPE_BYTES.get(str(spec.dtype).removeprefix("torch."), 4)
    t = k + 1
    logits = t * cfg.vocab_size * (elem + 4)  # the model's dtype, then float32 for sampling
    layer = t * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * elem
    scores = cfg.num_heads * t * context * 4
    name, scratch = f"activations (verify k={k})", 0
    if wide_f32.wanted(spec.device, spec.dtype):
        name, scratch = name + " + float32 scratch (models/wide_f32.py)", wide_f32.SCRATCH_BYTES
    return Part(name, logits + layer + scores + scratch, "activations")


def files_bytes(path: Path) -> int:
    """A file's size, or the sum of a folder's files."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def resident_bytes() -> int:
    """This process's resident set now (VmRSS; 0 where /proc is not there)."""
    return _proc_status("VmRSS")


def anon_resident_bytes() -> int:
    """This process's anonymous resident memory now (RssAnon; 0 where /proc lacks it)."""
    return _proc_status("RssAnon")


def peak_resident_bytes() -> int:
    """This process's peak resident set so far (VmHWM, else getrusage's ru_maxrss)."""
    peak = _proc_status("VmHWM")
    if not peak:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


def _proc_status(field: str) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _available(device: str) -> int | None:
    if str(device).startswith("cuda"):
        return limits.cuda_free(device)
    return None if str(device) == "meta" else limits.available_bytes()
