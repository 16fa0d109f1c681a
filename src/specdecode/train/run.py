"""One distillation run: collect, split, train, save, summarise (what `specdecode train` does).

The prompts are split before anything is collected: the last `val_share` of
them answer the validation shards the run reports acceptance on (never
trained on). Shards live in `cache / "greedy"`, so a killed or repeated run
reuses the answers it has. The head folder gets the head (HiddenStateHead.save),
`summary.json` and `curve.png` (expected tau against answer tokens seen in training).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.drafters.eagle import Eagle3Config
from specdecode.drafters.hidden_head import HiddenStateHead
from specdecode.models.base import FINAL_LAYER
from specdecode.train import data, eagle_fit, fit, passages, self_prompts
from specdecode.train.heap import release_freed


@dataclass(frozen=True)
class RunOptions:
    """prompts: how many training prompts (the training sets, then prompts made from
    docstrings); max_new_tokens: per answer; steps / batch / lr: the optimiser's
    (batch: windows, or for eagle3 about that many positions); depths: unrolled
    draft steps; draft_vocab: the head's vocabulary size."""

    prompts: int = 200
    max_new_tokens: int = 192
    steps: int = 600
    batch: int = 256
    lr: float = 1e-3
    depths: int = 4
    draft_vocab: int = 8192
    val_share: float = 0.1
    drafter: str = "hidden-head"  # or "eagle3" (torch targets: inner layers' states)
    context: int = 256  # eagle3: prompt positions before each answer kept in its window
    answer_batch: int = 1  # prompts answered at once (data.collect_batched)
    collect_minutes: float | None = None  # no new prompt answered after this long
    val_prompts: int | None = None  # validation prompts (None: val_share of them)
    train_minutes: float | None = None  # training's time budget (fit.fit minutes)
    precision: str = "fp32"  # or "bf16": the loss under torch.autocast (fit.fit)
    head_intermediate: int | None = None  # eagle3: the head's MLP width (None: the target's)
    answers_per_prompt: int = 1  # eagle3: the greedy answer + sampled ones (data.BatchPlan)
    sample_temperature: float = 0.8  # the sampled answers' temperature
    self_prompts: int = 0  # prompts the target writes itself (self_prompts.py), answered greedily
    passages: int = 0  # eagle3: teacher-forced passages (passages.py), training only
    soft_labels: bool = False  # eagle3: the loss against the target's distribution (eagle_fit)


def prompt_set(n: int) -> list[str]:
    """n training prompts: the shared training sets when present, then docstrings."""
    try:
        shared = data.training_prompts(limit=n)
    except OSError:
        shared = []
    return (shared + data.docstring_prompts(max(0, n - len(shared))))[:n]


def target_tables(target, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, H], lm_head [V, H]) of the target: a torch model's own tensors,
    else read from its GGUF file (float16; a tied model's lm_head is the embedding)."""
    if hasattr(target, "embed_tokens"):
        return target.embed_tokens.weight, target.lm_head.weight
    from specdecode.models.loading import gguf_tensors
    tables = gguf_tensors(path, ["token_embd.weight", "output.weight"])
    embed = tables["token_embd.weight"]
    return embed, tables.get("output.weight", embed)


def distil(target, encode: Callable[[str], list[int]], embed: torch.Tensor,  # [V, H]
           lm_head: torch.Tensor,  # [V, H]
           stop_ids: tuple[int, ...], cache: Path, out: Path, options: RunOptions,
           *, progress: bool = True, report: Callable[[dict], None] | None = None,
           tokenizer: self_prompts.ChatTokenizer | None = None) -> dict:
    """Train a head for `target` (a CausalLM exposing the states the head reads) and
    save it to out: a HiddenStateHead, or with options.drafter "eagle3" an Eagle3Head.
    options.self_prompts needs the target's `tokenizer`: the prompts it writes are
    kept in cache/self-prompts.jsonl (written before the collection budget starts),
    their answers in `<folder>-self`. options.passages (eagle3; the tokenizer too):
    that many teacher-forced passages' windows, after the collection budget, in
    `<folder>-passages-a<max_new_tokens>` (answers cut to that)."""
    if options.passages and (options.drafter != "eagle3" or tokenizer is None):
        raise ValueError("passages need an eagle3 run and the target's tokenizer")
    prompts = prompt_set(options.prompts)
    n_val = options.val_prompts or max(1, round(len(prompts) * options.val_share))
    start = time.perf_counter()
    eagle = options.drafter == "eagle3"
    layers = Eagle3Config.default_layers(target.config.num_layers) if eagle else (FINAL_LAYER,)
    folder = (cache / f"eagle3-{'-'.join(map(str, layers))}-ctx{options.context}" if eagle
              else cache / "greedy")
    extra = _self_written(target, tokenizer, cache, options, stop_ids)
    self_s = time.perf_counter() - start
    extra_folder = folder.with_name(folder.name + "-self")
    paths, extra_paths = _collect(target, encode, (prompts, extra), (folder, extra_folder),
                                  n_val, layers, stop_ids, options, progress)
    collect_s = time.perf_counter() - start
    passage_paths = _passages(target, encode, tokenizer,
                              folder.with_name(f"{folder.name}-passages-a{options.max_new_tokens}"),
                              layers, options, progress)
    passages_s = time.perf_counter() - start - collect_s
    release_freed()  # the collection's batches (train/heap.py)
    trained_on = _existing(paths[:-n_val]) + _existing(extra_paths) + passage_paths
    check_memory(trained_on + _existing(paths[-n_val:]), embed.shape[1], options)
    if eagle:
        head, wt, wv, scale, tokens = _eagle_setup(trained_on, paths[-n_val:], embed, lm_head,
                                                   stop_ids, target.config, layers, options)
    else:
        head, wt, wv, tokens = _hidden_setup(trained_on, paths[-n_val:], embed, lm_head,
                                             stop_ids, options)
    untrained = wv.acceptance(head)
    with data.StepBar(progress) as on_step:
        result = fit.fit(head, wt, wv, steps=options.steps, batch=options.batch,
                         lr=options.lr, evals=8, report=report,
                         minutes=options.train_minutes, on_step=on_step,
                         autocast=torch.bfloat16 if options.precision == "bf16" else None)
    if eagle:
        eagle_fit.fold_scale(head, scale)  # the saved head reads raw states
    head.save(out)
    summary = {"drafter": options.drafter, "prompts": len(prompts), "validation_prompts": n_val,
               "self_prompts": len(extra), "self_prompts_s": self_s,
               "self_prompt_answers": len(_existing(extra_paths)),
               "passages": len(passage_paths), "passages_s": passages_s,
               "train_tokens": int(tokens), "train_windows": len(wt), "steps": result.steps,
               "soft_label_windows": (sum(w.top_ids is not None for w in wt.shards)
                                      if eagle else 0),
               "collect_s": collect_s, "train_s": result.seconds,
               "untrained_accept": untrained, "accept": result.curve[-1]["accept"],
               "tau": result.tau, "curve": result.curve, "options": vars(options)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot_curve(result.curve, out / "curve.png")
    return summary


def _hidden_setup(trained_on: list[Path], val_paths: list[Path], embed: torch.Tensor,  # [V, H]
                  lm_head: torch.Tensor,  # [V, H]
                  stop_ids: tuple[int, ...], options: RunOptions,
                  ) -> tuple[HiddenStateHead, fit.Windows, fit.Windows, int]:
    """(head, training windows, validation windows, training tokens) of a final-state
    head: its draft vocabulary from the training answers' token frequencies."""
    train = data.load_shards(trained_on)
    val = data.load_shards(val_paths)
    d2t = fit.draft_vocabulary(train, options.draft_vocab, embed.shape[0], always=stop_ids)
    head = fit.new_head(embed, lm_head.float(), d2t)
    wt, wv = fit.Windows.of(train, options.depths), fit.Windows.of(val, options.depths)
    return head, wt, wv, int(sum(len(t) for t, _ in train))


# Beside the shards: the head's weights, gradients and Adam's two moments (4x the
# head) and the kernels' buffers: on the default target's data the training loop
# levelled off ~2.1 GB above the data and the target with a 0.32 GB head
# (train/heap.py).
TRAINING_OVERHEAD = 1 << 30


def check_memory(paths: Sequence[Path], hidden: int, options: RunOptions) -> None:
    """ValueError (before anything is loaded) when the shards, held in memory while
    training (about their files' size), and the training state do not fit in the
    memory available now (limits.available_bytes; the target is loaded already):
    an error naming what lowers it, where loading them would end in the kernel
    killing the run."""
    from specdecode import limits

    available = limits.available_bytes()
    if available is None:
        return
    data_bytes = sum(p.stat().st_size for p in paths)
    width = (options.head_intermediate or 3 * hidden) if options.drafter == "eagle3" else hidden
    head_bytes = 4 * (options.draft_vocab * hidden + 8 * hidden * hidden + 3 * hidden * width)
    need = data_bytes + 4 * head_bytes + TRAINING_OVERHEAD
    if need > available:
        raise ValueError(
            f"training needs about {need / limits.GB:.1f} GB (its {len(paths)} shards "
            f"{data_bytes / limits.GB:.1f} GB, the head's training state "
            f"{(4 * head_bytes + TRAINING_OVERHEAD) / limits.GB:.1f} GB) but "
            f"{available / limits.GB:.1f} GB is available: fewer --prompts, --passages, "
            f"--self-prompts or --answers-per-prompt, or a shorter --max-new-tokens")


def _eagle_setup(trained_on: list[Path], val: list[Path], embed: torch.Tensor,  # [V, H]
                 lm_head: torch.Tensor,  # [V, H]
                 stop_ids: tuple[int, ...], target_cfg, layers: tuple[int, ...],
                 options: RunOptions):
    """(a new Eagle3Head, training and validation Sequences scaled by input_scale,
    the scale, answer tokens): the draft vocabulary from the tokens the head must
    draft, the labels (a window's greedy tokens where it has them: sampled answers,
    passages; else its answer)."""
    train = eagle_fit.load_windows(trained_on)
    answers = [(w.ids[w.answer_start:] if w.greedy is None else w.greedy[w.answer_start - 1:],
                None) for w in train]
    d2t = fit.draft_vocabulary(answers, options.draft_vocab, embed.shape[0], always=stop_ids)
    head = eagle_fit.new_head(embed, lm_head.float(), d2t, target_cfg, layers,
                              options.head_intermediate)
    wt = eagle_fit.Sequences(train, options.depths, options.soft_labels)
    wv = eagle_fit.Sequences(eagle_fit.load_windows(val), options.depths, options.soft_labels)
    scale = eagle_fit.input_scale(train)
    eagle_fit.scale_windows(wt.shards + wv.shards, scale)
    return head, wt, wv, scale, sum(len(a) for a, _ in answers)


def _self_written(target, tokenizer: self_prompts.ChatTokenizer | None, cache: Path,
                  options: RunOptions, stop_ids: tuple[int, ...]) -> list[str]:
    """options.self_prompts prompts the target writes itself (self_prompts.ensure,
    options.answer_batch at a time), or none."""
    if not options.self_prompts:
        return []
    if tokenizer is None:
        raise ValueError("self_prompts needs the target's tokenizer")
    return self_prompts.ensure(target, tokenizer, cache / "self-prompts.jsonl",
                               options.self_prompts, batch=options.answer_batch,
                               stop_ids=stop_ids)


def _passages(target, encode: Callable[[str], list[int]],
              tokenizer: self_prompts.ChatTokenizer | None, folder: Path,
              layers: tuple[int, ...], options: RunOptions, progress: bool) -> list[Path]:
    """options.passages teacher-forced windows (passages.collect; answers cut to
    options.max_new_tokens), or none."""
    if not options.passages:
        return []
    return passages.collect(target, encode,
                            lambda text: tokenizer.hf.encode(text, add_special_tokens=False),
                            passages.passages(options.passages), folder, layers,
                            context=options.context, max_answer_tokens=options.max_new_tokens,
                            progress=progress)


def _collect(target, encode: Callable[[str], list[int]], prompts: tuple[list[str], list[str]],
             folders: tuple[Path, Path], n_val: int, layers: tuple[int, ...],
             stop_ids: tuple[int, ...], options: RunOptions, progress: bool
             ) -> tuple[list[Path], list[Path]]:
    """The shards of the training sets' prompts and of the self-written ones
    (prompts[1], greedy answers only, into folders[1]): every prompt answered
    (data.collect), or options.answer_batch at a time within options.collect_minutes
    (data.collect_batched): the validation prompts first, then the self-written
    ones, then the rest; prompts not reached get no shard. The validation prompts
    are answered greedily only and hold the last n_val paths of the first list."""
    eagle = options.drafter == "eagle3"
    (main, extra), (folder, extra_folder) = prompts, folders
    if (options.answer_batch <= 1 and options.collect_minutes is None
            and options.answers_per_prompt == 1):
        answer = (lambda ids: data.answer_with_context(  # noqa: E731
            target, ids, options.max_new_tokens, stop_ids, layers, options.context)
            ) if eagle else None
        return tuple(data.collect(target, encode, p, f, max_new_tokens=options.max_new_tokens,
                                  stop_ids=stop_ids, progress=progress, answer=answer)
                     if p else [] for p, f in ((main, folder), (extra, extra_folder)))
    deadline = (None if options.collect_minutes is None
                else time.monotonic() + 60 * options.collect_minutes)
    plan = data.BatchPlan(options.answer_batch, layers, options.context if eagle else None,
                          deadline, options.answers_per_prompt, options.sample_temperature)
    n = len(main)
    val = range(n - n_val, n)

    def batched(p: list[str], f: Path, order: Sequence[int], greedy_only: Sequence[int]
                ) -> list[Path]:
        return data.collect_batched(target, encode, p, f, plan,
                                    max_new_tokens=options.max_new_tokens, stop_ids=stop_ids,
                                    order=order, greedy_only=greedy_only, progress=progress)

    batched(main, folder, val, val)
    extra_paths = (batched(extra, extra_folder, range(len(extra)), range(len(extra)))
                   if extra else [])
    return batched(main, folder, list(val) + list(range(n - n_val)), val), extra_paths


def _existing(paths: list[Path]) -> list[Path]:
    return [p for p in paths if p.is_file()]


def plot_curve(curve: list[dict], path: Path) -> None:
    """Expected tau (validation) against answer tokens seen in training, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([p["tokens"] for p in curve], [p["tau"] for p in curve], marker="o")
    ax.set_xlabel("answer tokens seen in training")
    ax.set_ylabel("expected tau (validation)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
