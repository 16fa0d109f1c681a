"""The side-by-side runner: every configuration on every prompt, interleaved.

One process, one set of weights. For each repeat, prompt and temperature,
every configuration runs in turn (plain, drafters at each k, peers), after a
warm-up of each; so slow drift of the machine hits all configurations alike.
Each run records its output ids, wall time (prefill included) and, for
specdecode, its SpecStats; `summary.summarise` turns the rows into medians,
speedups, costs and exact-match rates.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from specdecode.bench import hf_peer, workloads
from specdecode.bench.load import busy_load
from specdecode.bench.summary import margin_at_divergence, summarise, summarise_turns
from specdecode.llm import LLM, LoadedModels, load_plan
from specdecode.memory import head_parts, memory_plan, peak_resident_bytes, plan_memory
from specdecode.options import LoadSpec
from specdecode.plan import LOOKUPS, Facts, Plan, draft_model, resolve
from specdecode.sampling import SamplingParams

SCHEMA = "specdecode.bench/1"
HEADS = ("eagle3", "hidden-head")  # drafters that run the trained head of --head


@dataclass(frozen=True)
class Config:
    """One way of decoding. engine: specdecode | hf; method: plain | draft-model | ngram |
    auto (the shipped default: `LLM.load` with no drafter options) | assisted |
    prompt-lookup; k: draft tokens per step (0 for plain and auto)."""

    engine: str
    method: str
    k: int = 0

    @property
    def label(self) -> str:
        name = "specdecode" if self.engine == "specdecode" else "HF"
        if self.method == "auto":
            return f"{name} auto (shipped default)"
        return f"{name} {self.method}" + (f" k={self.k}" if self.k else "")

    @property
    def plain_label(self) -> str:
        """The plain configuration this one's speedup and exactness are measured against."""
        return Config(self.engine, "plain").label

    def spec(self, base: LoadSpec) -> LoadSpec:
        """The load spec of this (specdecode) configuration on the run's load options:
        auto is `base` as given (what a user who sets no drafter options runs); the
        others set their drafter and k, fixed (not adaptive), as labelled."""
        if self.method == "auto":
            return base if base.head is None else replace(base, head=None)
        drafter = "none" if self.method == "plain" else self.method
        return replace(base, drafter=drafter, k=self.k, adaptive=False,
                       head=base.head if self.method in HEADS else None)


@dataclass
class BenchOptions:
    target: str = "default"
    draft_model: str | None = None
    workloads: list[str] = field(default_factory=lambda: ["humaneval", "code-edit"])
    limit: int | None = None
    max_tokens: int = 128
    drafters: list[str] = field(default_factory=lambda: ["auto", "draft-model", "ngram"])
    draft_k: list[int] = field(default_factory=lambda: [8])
    ngram_k: list[int] = field(default_factory=lambda: [16])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    dtype: str = "bfloat16"
    device: str = "cpu"
    backend: str | None = None  # auto | torch | llama.cpp; None: $SPECDECODE_BACKEND or auto
    background_load: int = 0  # busy processes competing for the CPU during the runs
    peers: list[str] = field(default_factory=lambda: ["hf"])
    repeats: int = 1
    warmup: bool = True
    draft_quant: str = "auto"
    draft_confidence: float = 0.3
    max_seq_len: int | None = None
    ngram_max: int | None = None
    ngram_min: int = 1
    prompt_lookup_k: int = 10
    seed: int = 0
    head: str | None = None  # a trained head's folder: the eagle3 / hidden-head rows'

    @staticmethod
    def load_fields(spec: LoadSpec) -> dict:
        """The fields of `spec` a bench run takes (all but the per-row drafter, k, adaptive)."""
        return {f.name: getattr(spec, f.name) for f in fields(LoadSpec)
                if f.name in BenchOptions.__dataclass_fields__}

    def spec(self) -> LoadSpec:
        """The run's load options as a LoadSpec (drafter, k and adaptive unset)."""
        return LoadSpec(**{f.name: getattr(self, f.name) for f in fields(LoadSpec)
                           if f.name in BenchOptions.__dataclass_fields__})


@dataclass
class Models:
    """What a bench runs on; `load` builds it from registry names or paths."""

    llms: dict[str, LLM]  # specdecode configurations by label
    target_path: Path | None = None
    draft_path: Path | None = None
    memory: dict[str, int] = field(default_factory=dict)
    memory_plan: dict | None = None  # predicted before loading (memory.py)

    @property
    def plain(self) -> LLM:
        return self.llms[Config("specdecode", "plain").label]


def forget(llm: LLM) -> None:
    """Empty what an LLM carries from earlier requests into the next: the target's
    KV cache (prefix reuse) and the suffix drafter's store."""
    llm.target.rollback(0)
    for drafter in llm.decoder.drafters:
        store = getattr(drafter, "store", None)
        if store is not None:
            store.clear()


def tensor_bytes(model) -> int:
    """Bytes of a torch model's weights, buffers and KV cache (shared tensors once)."""
    return sum(_storages(model).values())


def _storages(model) -> dict[tuple[int, int], int]:
    """A torch model's tensor storages (weights, buffers, KV cache): bytes by storage."""
    tensors = [*model.parameters(), *model.buffers(), *getattr(model, "k_cache", []),
               *getattr(model, "v_cache", [])]
    return {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()):
            t.untyped_storage().nbytes() for t in tensors}


def head_bytes(llms: dict[str, LLM], target) -> int | None:
    """Resident bytes of a trained head's own tensors (drafters with a `head` module:
    eagle3, hidden-head), the target's tensors it reads (the embedding table) left
    out; None without such a drafter or for a target that is not a torch module."""
    if not isinstance(target, torch.nn.Module):
        return None
    shared = _storages(target)
    for llm in llms.values():
        for drafter in llm.decoder.drafters:
            head = getattr(drafter, "head", None)
            if isinstance(head, torch.nn.Module):
                return sum(n for key, n in _storages(head).items() if key not in shared)
    return None


def specdecode_configs(options: BenchOptions, has_draft: bool) -> list[Config]:
    configs = [Config("specdecode", "plain")]
    if "auto" in options.drafters:
        configs.append(Config("specdecode", "auto"))
    if "draft-model" in options.drafters and has_draft:
        configs += [Config("specdecode", "draft-model", k) for k in options.draft_k]
    for lookup in LOOKUPS:
        if lookup in options.drafters:
            configs += [Config("specdecode", lookup, k) for k in options.ngram_k]
    for head in HEADS:  # a trained head (--head), at each -k as the draft model
        if head in options.drafters:
            configs += [Config("specdecode", head, k) for k in options.draft_k]
    return configs


def load_models(options: BenchOptions) -> Models:
    """Every configuration's plan (`Config.spec`, resolved as `LLM.load` resolves it), the
    models loaded once and each fixed configuration built on them; the shipped default
    (auto) in a load of its own, as a user who sets nothing gets it."""
    facts = Facts.here()
    options.draft_model = draft_model(options.spec(), facts)  # reported as run
    base = options.spec()
    has_draft = "draft-model" in options.drafters and options.draft_model is not None
    plans = {c.label: resolve(c.spec(base), facts)
             for c in specdecode_configs(options, has_draft) if c.method != "auto"}
    biggest = max(plans.values(), key=lambda p: p.draft is not None)
    predicted = plan_memory(biggest)
    if not head_parts(biggest, predicted.context):  # a head row beside the draft model's
        heads = (head_parts(p, predicted.context) for p in plans.values())
        predicted = predicted.with_parts(next((h for h in heads if h), []))
    predicted.check()
    loaded = load_plan(biggest)
    memory = {"target": model_bytes(loaded.target.model, loaded.files[0])}
    if loaded.draft is not None:
        memory["draft"] = model_bytes(loaded.draft.model, loaded.files[1])
    llms = build_llms(plans, loaded)
    if "auto" in options.drafters:  # a load of its own: both are held at once
        auto = Config("specdecode", "auto").spec(base)
        predicted = predicted.plus(memory_plan(auto, facts), "auto")
        llms[Config("specdecode", "auto").label] = LLM.from_spec(auto, facts)
    head = head_bytes(llms, loaded.target.model)
    if head is not None:
        memory["head"] = head
    return Models(llms, loaded.files[0], loaded.files[1], memory, predicted.to_dict())


def model_bytes(model, path: Path) -> int:
    """Weights + KV cache of a torch model; the GGUF file's size for other backends."""
    return tensor_bytes(model) if isinstance(model, torch.nn.Module) else path.stat().st_size


def build_llms(plans: dict[str, Plan], loaded: LoadedModels) -> dict[str, LLM]:
    """One LLM per planned configuration, all on one load: the draft-model drafter (and
    its KV cache) is shared between k values, which run one at a time."""
    return {label: LLM.build(plan, loaded) for label, plan in plans.items()}


def machine(options: BenchOptions, backend: str | None = None) -> dict:
    """The machine and settings of a run; backend: the one that ran (default: as asked)."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "dtype": options.dtype, "device": options.device,
            "backend": backend or options.backend or "auto",
            "background_load": options.background_load}


class Bench:
    """Runs the configurations of `options` on `models`, interleaved; see the module doc."""

    def __init__(self, options: BenchOptions, models: Models) -> None:
        self.options, self.models = options, models
        self.notes: list[str] = []
        self.configs = [c for c in specdecode_configs(options, has_draft=True)
                        if c.label in models.llms]
        self.peer = self._load_peers()

    def _load_peers(self):
        o = self.options
        if "hf" not in o.peers:
            return None
        if not hf_peer.available():
            self.notes.append("HF transformers peer skipped: transformers/accelerate not "
                              "installed (pip install -e '.[bench]')")
            return None
        if self.models.target_path is None:
            self.notes.append("HF transformers peer skipped: no model file to load it from")
            return None
        try:
            peer = hf_peer.Peer.load(self.models.target_path, self.models.draft_path, o.dtype,
                                     self.models.plain.decoder.eos_token_ids)
        except Exception as e:  # a peer that cannot load is a note, not a failure
            self.notes.append(f"HF transformers peer skipped: {type(e).__name__}: {e}")
            return None
        self.models.memory["hf_target"] = peer.target_bytes
        if peer.draft is not None:
            self.models.memory["hf_draft"] = peer.draft_bytes
        self.configs.append(Config("hf", "plain"))
        if peer.draft is not None:
            self.configs.append(Config("hf", "assisted", 0))
        if "ngram" in o.drafters:
            self.configs.append(Config("hf", "prompt-lookup", o.prompt_lookup_k))
        return peer

    def run_one(self, config: Config, ids: list[int], temperature: float, seed: int,
                max_tokens: int, cold: bool = True) -> dict:
        """One generation. cold: the target's KV cache and the suffix drafter's store
        of earlier requests are emptied first, so every configuration prefills the
        whole prompt and drafts from nothing it ran before (a later turn of a
        trajectory runs warm: what its own earlier turns left is reused). The draft
        model's own cache is not emptied: its reuse of a prefix costs only its
        prefill time, which a cold target pays first anyway."""
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
        if config.engine == "specdecode":
            llm = self.models.llms[config.label]
            if cold:
                forget(llm)
            first: list[float] = []
            start = time.perf_counter()
            r = llm.generate(ids, params, seed=seed, on_text=lambda _: first.append(
                time.perf_counter()) if not first else None)
            s = r.stats
            return {"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                    "seconds": r.seconds, "prefill_seconds": s.prefill_time,
                    "ttft_seconds": first[0] - start if first else None,
                    "cached_tokens": s.cached_tokens,
                    "stats": {**s.to_dict(), "position_tried": s.position_tried,
                              "position_accepted": s.position_accepted}}
        r = self.peer.generate(ids, config.method, max_tokens, temperature, seed,
                               prompt_lookup=config.k)
        return {"token_ids": r.token_ids, "finish_reason": r.finish_reason,
                "seconds": r.seconds, "text": self.models.plain.tokenizer.decode(r.token_ids)}

    def run(self, progress: bool = True) -> dict:
        o = self.options
        tok = self.models.plain.tokenizer
        prompts = [p for w in o.workloads for p in workloads.load(w, o.limit)]
        total = o.repeats * len(prompts) * len(o.temperatures) * len(self.configs)
        from rich.console import Console
        from rich.progress import Progress

        with Progress(disable=not progress, transient=False,
                      console=Console(stderr=True)) as bar:
            task = bar.add_task("warm-up", total=total)
            if o.warmup:
                warm = workloads.Prompt("warm-up", "warm-up", (
                    {"role": "user", "content": "Say hello in one short sentence."},)).ids(tok)
                for c in self.configs:
                    for t in o.temperatures:
                        self.run_one(c, warm, t, o.seed, 8)
            with busy_load(o.background_load):  # after the warm-up, for every run alike
                rows = self._timed_runs(prompts, bar, task, progress)
        self._margins(rows)
        self.models.memory["peak_rss"] = peak_resident_bytes()
        plan = self.models.memory_plan
        if plan is not None:
            self.models.memory["predicted_peak_rss"] = plan["predicted_peak_rss"]
        return {"schema": SCHEMA, "date": time.strftime("%Y-%m-%d %H:%M"),
                "machine": machine(o, self.models.plain.info.backend), "options": asdict(o),
                "configs": [c.label for c in self.configs], "memory": self.models.memory,
                "memory_plan": self.models.memory_plan,
                "notes": self.notes, "summary": summarise(rows, self.configs),
                "turns": summarise_turns(rows),
                "runs": rows}

    def _timed_runs(self, prompts: list, bar, task, progress: bool) -> list[dict]:
        """Every configuration on every prompt and temperature, interleaved."""
        o, rows = self.options, []
        for repeat in range(o.repeats):
            for i, prompt in enumerate(prompts):
                for temperature in o.temperatures:
                    for c in self.configs:
                        bar.update(task, description=f"{prompt.name} T={temperature} {c.label}")
                        for row in self._trajectory(c, prompt, temperature,
                                                    o.seed + 1000 * repeat + i):
                            row.update(repeat=repeat)
                            rows.append(row)
                            if progress and not bar.console.is_terminal:  # a log, not a bar
                                bar.console.print(
                                    f"{row['prompt']} T={temperature:g} {c.label}: "
                                    f"{row['new_tokens']} tokens, "
                                    f"{row['tokens_per_second']:.2f} tok/s")
                        bar.advance(task)
        return rows

    def _trajectory(self, c: Config, prompt: workloads.Prompt, temperature: float,
                    seed: int) -> list[dict]:
        """One configuration on a prompt: a row per turn (one turn unless the prompt has
        follow-ups; then each next prompt is the conversation so far, with this
        configuration's own answers, and only the first turn starts cold)."""
        tok, rows = self.models.plain.tokenizer, []
        for turn in range(1 + len(prompt.followups)):
            ids = prompt.turn_ids(tok, [r["text"] for r in rows])
            row = self.run_one(c, ids, temperature, seed, self.options.max_tokens,
                               cold=turn == 0)
            n = len(row["token_ids"])
            name = f"{prompt.name}/turn{turn + 1}" if prompt.followups else prompt.name
            row.update(workload=prompt.workload, prompt=name, turn=turn + 1, prompt_ids=ids,
                       temperature=temperature, config=c.label, engine=c.engine,
                       method=c.method, k=c.k, prompt_tokens=len(ids), new_tokens=n,
                       tokens_per_second=n / row["seconds"])
            rows.append(row)
        return rows

    def _margins(self, rows: list[dict]) -> None:
        """At T=0: first divergence from the engine's plain output and the target's top-2
        logit margin there (a near-tie, or a bug)."""
        target = self.models.plain.target
        plain = {(r["prompt"], r["repeat"], r["engine"]): r for r in rows
                 if r["method"] == "plain" and r["temperature"] == 0}
        for r in rows:
            ref = plain.get((r["prompt"], r["repeat"], r["engine"]))
            if r["temperature"] != 0 or r["method"] == "plain" or ref is None:
                continue
            if r["prompt_ids"] != ref["prompt_ids"]:  # a later turn after parted answers
                r["divergence"] = {"index": None, "note": "an earlier turn's answer differed"}
                continue
            r["divergence"] = margin_at_divergence(target, r["prompt_ids"], ref["token_ids"],
                                                   r["token_ids"])
        for r in rows:
            del r["prompt_ids"]


def run(options: BenchOptions, models: Models | None = None, progress: bool = True) -> dict:
    """Load (unless given) and run a benchmark; returns the JSON-ready result."""
    return Bench(options, models or load_models(options)).run(progress)
