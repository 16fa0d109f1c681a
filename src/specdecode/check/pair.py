"""The models a check runs on: loaded once, an LLM per (drafter, k) built on them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specdecode.bench import workloads
from specdecode.bench.runner import forget
from specdecode.check.near_tie import judge, threshold
from specdecode.llm import LLM, LoadedModels, load_plan
from specdecode.options import LoadSpec
from specdecode.plan import Facts, resolve
from specdecode.sampling import SamplingParams


@dataclass
class Pair:
    """spec: the user's load options; loaded: its models; plain: plain decoding on them;
    drafters: the drafters in use (the plan's, or the one asked for); limit: the
    near-tie threshold of this backend and dtype (near_tie.py)."""

    spec: LoadSpec
    facts: Facts
    loaded: LoadedModels
    plain: LLM
    drafters: tuple[str, ...]
    limit: float
    answers: dict = field(default_factory=dict)  # (prompt ids, max_tokens) -> plain greedy

    @classmethod
    def load(cls, spec: LoadSpec) -> Pair:
        facts = Facts.here()
        plan = resolve(spec, facts)
        drafters = plan.drafters or ("ngram",)
        wide = resolve(replace(spec, drafter=drafters[-1], adaptive=False), facts)
        loaded = load_plan(wide if wide.draft is not None else plan)
        plain = LLM.build(resolve(replace(spec, drafter="none", k=0, adaptive=False), facts),
                          loaded)
        backend = loaded.info.backend
        return cls(spec, facts, loaded, plain, drafters, threshold(backend, spec.dtype))

    @property
    def backend(self) -> str:
        return self.loaded.info.backend

    def llm(self, drafter: str, k: int) -> LLM:
        """Fixed-k speculation with one drafter, on the loaded models."""
        spec = replace(self.spec, drafter=drafter, k=k, adaptive=False)
        return LLM.build(resolve(spec, self.facts), self.loaded)

    def shipped(self) -> LLM:
        """What the user's options load (the shipped default when they set none)."""
        return LLM.build(resolve(self.spec, self.facts), self.loaded)

    def speculating(self) -> LLM:
        """The shipped configuration, or where it settles on plain decoding (a flat cost
        curve), the closed-loop engine on the last drafter in use: a check of the
        fallback needs drafts to fail."""
        llm = self.shipped()
        if llm.info.drafter not in (None, "none"):
            return llm
        spec = replace(self.spec, drafter=self.drafters[-1], adaptive=True)
        return LLM.build(resolve(spec, self.facts), self.loaded)

    def plain_answer(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Plain greedy decoding of `prompt_ids` (from an empty cache), computed once per
        (prompt, max_tokens) for all the checks that compare with it."""
        key = (tuple(prompt_ids), max_tokens)
        if key not in self.answers:
            self.answers[key] = cold_generate(self.plain, prompt_ids, SamplingParams(
                max_tokens=max_tokens), speculative=False).token_ids
        return self.answers[key]

    def prompts(self, names: list[str], limit: int) -> list[tuple[str, list[int]]]:
        """(name, prompt ids) of the first `limit` prompts of each workload."""
        tok = self.plain.tokenizer
        return [(p.name, p.ids(tok)) for w in names for p in workloads.load(w, limit)]

    def compare(self, prompt_ids: list[int], reference: list[int], other: list[int]
                ) -> tuple[str, dict | None]:
        """(verdict, divergence): near_tie.classify of where `other` parts from
        `reference`, with the target's top-2 margin there (bench/summary.py)."""
        return judge(self.plain.target, prompt_ids, reference, other, self.limit)


def cold_generate(llm: LLM, prompt_ids: list[int], params, seed: int = 0,
                  speculative: bool = True):
    """One request with an empty target cache (no prefix reuse between the runs compared)."""
    forget(llm)
    return llm.generate(prompt_ids, params, seed=seed, speculative=speculative)
