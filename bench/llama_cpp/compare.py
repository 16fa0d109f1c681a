"""specdecode on the llama.cpp backend vs llama.cpp's own decoding, side by side.

    python bench/llama_cpp/compare.py --out bench/results/llama-cpp

Builds llama.cpp's tools for this CPU into the cache (`specdecode build-llama-cpp`;
~25 minutes once), starts llama-server up to three times on the default pair's GGUF
files (plain; --spec-type draft-simple -md <draft> --spec-draft-n-max N;
--spec-type ngram-mod) and loads specdecode on the llama.cpp backend (plain;
the adaptive engine with the drafter it chooses; optionally the n-gram or the
suffix drafter alone, adaptive (--ngram, --suffix), and the draft model at a
fixed k), each configuration in its own worker process as each llama-server
runs in its own. Then, for each prompt x temperature, every configuration runs in
turn (interleaved), 128 new tokens, the same prompt token ids (the target's
chat template) and pure temperature sampling (top-k/top-p/min-p off).

Both sides run with flash attention off (llama.cpp's automatic choice turns it
on; on this CPU kind it makes a 49-token batch at 1.8k tokens of context 1.4x
slower: llama-bench pp49 @ d1800 58 t/s off, 41 on); specdecode's default keeps
it on (closer agreement of batches with one-token steps), so this script sets
SPECDECODE_FLASH_ATTN=off unless it is set. Both read the weights into memory
and back them with 2 MiB pages: specdecode by default (see
models/hugepages.py), llama-server with `--load-mode none` and
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (SPECDECODE_HUGE_PAGES=0: neither). With
llama-server's defaults (file mapped, 4 KiB pages) its one-token steps ran 1.1-1.4x
slower here, by where its pages landed. llama-server's ngram-mod
keeps its n-gram hash across requests, so its server restarts before each
request: every configuration starts a request with an empty n-gram memory.

Reported per configuration: decoding tokens/s (prefill excluded everywhere:
llama-server reuses a cached prompt, so its prompt time is not comparable),
median over prompts and per prompt class; speedup over llama.cpp plain paired
per prompt; acceptance and tau (llama-server: draft_n_accepted / draft_n);
greedy exact match against the same engine's plain output; specdecode's rows
in the json also hold each step's (drafted, accepted). Writes
<out>.json and <out>.md. At T > 0 each side decodes its own samples; replay.py
compares the drafting on the same texts. One heavy process: run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specdecode.bench import workloads
from specdecode.bench.load import busy_load, force_wrong_drafts
from specdecode.bench.runner import forget
from specdecode.costs import cpu_name
from specdecode.models import llama_cpp_build, loading, registry
from specdecode.sampling import SamplingParams


@dataclass
class Server:
    label: str
    args: list[str]
    fresh: bool = False  # restart before every request: no memory carried across requests
    port: int = 0
    proc: subprocess.Popen | None = None
    launch: tuple = ()

    def start(self, tools: Path, model: Path, ctx: int, threads: int) -> None:
        self.launch = (tools, model, ctx, threads)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [str(tools / "bin" / "llama-server"), "-m", str(model), "-c", str(ctx), "-t",
               str(threads), "-tb", str(threads), "--port", str(self.port), "-np", "1",
               "-fa", os.environ.get("SPECDECODE_FLASH_ATTN", "auto"),  # as ours: see the doc
               "--load-mode", "none",  # as ours: weights read into memory (huge pages)
               "--no-webui", *self.args]
        env = {"LD_LIBRARY_PATH": str(tools / "lib"), "PATH": "/usr/bin:/bin"}
        if os.environ.get("SPECDECODE_HUGE_PAGES", "1") != "0":  # as ours: see the doc
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health") as r:
                    if r.status == 200:
                        return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server ({self.label}) exited: {cmd}") from None
                time.sleep(0.5)
        raise RuntimeError(f"llama-server ({self.label}) did not become healthy")

    def complete(self, ids: list[int], n: int, temperature: float, seed: int,
                 cold: bool = True) -> dict:
        """cold: the prompt is processed whole (cache_prompt false), as a first turn."""
        body = {"prompt": ids, "n_predict": n, "temperature": temperature, "top_k": 0,
                "top_p": 1.0, "min_p": 0.0, "seed": seed, "cache_prompt": not cold,
                "return_tokens": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            out = json.loads(r.read())
        t = out["timings"]
        drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
        return {"tokens": out["tokens"], "tps": t["predicted_per_second"],
                "drafted": drafted, "accepted": accepted, "steps": None,
                "prefill_seconds": t["prompt_ms"] / 1000,
                "cached_tokens": t.get("cache_n", len(ids) - t["prompt_n"])}

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start(*self.launch)


class Engine:
    """One specdecode configuration in its own worker process, as each llama-server
    runs in its own: in one process, the four llama.cpp models of the three
    configurations decoded 10-25 % slower than each alone (HumanEval/2, adaptive
    n-gram: 18.3 tok/s in the shared process, 22.3 alone)."""

    def __init__(self, label: str, **load_kwargs) -> None:
        self.label = label
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, load_kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.info = self._reply()  # choice, drafter, costs

    def complete(self, ids: list[int], n: int, temperature: float, seed: int,
                 cold: bool = True) -> dict:
        """cold: the worker forgets earlier requests first (bench.runner.forget)."""
        self.conn.send((ids, n, temperature, seed, cold))
        return self._reply()

    def _reply(self) -> dict:
        """The worker's answer; its failure raised here with the worker's message."""
        reply = self.conn.recv()
        if "error" in reply:
            raise RuntimeError(f"{self.label}: {reply['error']}")
        return reply

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(30)


def _serve(conn, load_kwargs: dict) -> None:
    """Worker: load one LLM, then answer (ids, n, temperature, seed) until None."""
    from specdecode.llm import LLM

    wrong = load_kwargs.pop("wrong_drafts", False)
    if "copy" in load_kwargs:  # llama_cpp_prefill's plain-layout copy forced on (1) or off (0)
        os.environ["SPECDECODE_PREFILL_COPY"] = load_kwargs.pop("copy")
    try:
        llm = LLM.load("default", backend="llama.cpp", max_seq_len=4096, **load_kwargs)
    except Exception as e:  # reported to the parent, which stops the run
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    if wrong:
        force_wrong_drafts(llm.decoder)
    conn.send({"choice": llm.info.choice, "drafter": llm.info.drafter,
               "costs": llm.info.costs})
    while (job := conn.recv()) is not None:
        ids, n, temperature, seed, cold = job
        if cold:
            forget(llm)
        try:
            result = llm.generate(ids, SamplingParams(temperature=temperature, max_tokens=n),
                                  seed, speculative=llm.speculative)
        except Exception as e:  # the parent raises it with this message
            conn.send({"error": f"{type(e).__name__}: {e}"})
            continue
        s = result.stats
        decode = s.wall_time - s.prefill_time
        conn.send({"tokens": result.token_ids, "tps": len(result.token_ids) / decode,
                   "drafted": s.drafted, "accepted": s.accepted, "steps": s.steps,
                   "prefill_seconds": s.prefill_time, "cached_tokens": s.cached_tokens,
                   "per_step": [list(x) for x in zip(s.drafted_per_step, s.accepted_per_step,
                                                       strict=True)]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/llama-cpp")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--workload", "-w", action="append", default=None, dest="workloads",
                    help=f"{', '.join(workloads.NAMES)} or a .jsonl file, NAME:N for N prompts "
                         "(repeatable; default humaneval:5, code-edit:2, random:1)")
    ap.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="N busy processes compete for the CPU during the measured runs")
    ap.add_argument("--draft-n-max", type=int, default=8,
                    help="llama.cpp draft-simple's n_max (0: skip that row)")
    ap.add_argument("--draft-k", type=int, default=0,
                    help="also run specdecode's draft model at this fixed k (0: skip)")
    ap.add_argument("--drafter", default="auto",
                    help="specdecode's adaptive configuration: auto (chosen from costs), ngram")
    ap.add_argument("--suffix", action="store_true",
                    help="also run the adaptive engine with the suffix drafter")
    ap.add_argument("--ngram", action="store_true",
                    help="also run the adaptive engine with the n-gram drafter")
    ap.add_argument("--wrong-drafts", action="store_true",
                    help="also run the shipped default with every draft token forced wrong")
    ap.add_argument("--copy-rows", action="store_true",
                    help="also run the shipped default without llama.cpp's plain-layout copy "
                         "(SPECDECODE_PREFILL_COPY=0) and with it for prompts only (=1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1,
                    help="samples per prompt at T > 0 (seeds seed, seed+1, ...)")
    args = ap.parse_args()

    os.environ.setdefault("SPECDECODE_FLASH_ATTN", "off")  # both sides, see the module doc

    tools = llama_cpp_build.build()
    target, draft = (registry.resolve(name) for name in registry.PAIRS["default"])
    tok = loading.load_tokenizer(target)
    prompts = [p for w in args.workloads or ["humaneval:5", "code-edit:2", "random:1"]
               for p in workloads.load(w)]
    temps = [float(t) for t in args.temperatures.split(",")]

    engines = [Engine("specdecode plain", drafter="none")]
    auto = Engine("specdecode adaptive", drafter=args.drafter)
    auto.label = ("specdecode auto (shipped default)" if args.drafter == "auto" else
                  f"specdecode {auto.info['drafter']} adaptive")
    engines.append(auto)
    for lookup in ("ngram", "suffix"):
        if getattr(args, lookup):
            engines.append(Engine(f"specdecode {lookup} adaptive", drafter=lookup, adaptive=True))
    if args.wrong_drafts:
        engines.append(Engine("specdecode auto, drafts forced wrong", drafter=args.drafter,
                              wrong_drafts=True))
    if args.copy_rows:
        engines += [Engine("specdecode auto, no plain-layout copy", drafter=args.drafter,
                           copy="0"),
                    Engine("specdecode auto, copy for prompts only", drafter=args.drafter,
                           copy="1")]
    if args.draft_k:
        engines.append(Engine(f"specdecode draft-model k={args.draft_k}", drafter="draft-model",
                              k=args.draft_k, adaptive=False))
    simple = Server(f"llama.cpp draft-simple n_max={args.draft_n_max}",
                    ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max",
                     str(args.draft_n_max), "-td", str(args.threads)])
    servers = [Server("llama.cpp plain", []), *([simple] if args.draft_n_max else []),
               # ngram-mod's n-gram hash outlives a request (it is shared by all slots and
               # reset only when full): a repeated prompt would be copied from the server's
               # memory of its earlier answer. Ours starts every request empty; so does it.
               Server("llama.cpp ngram-mod", ["--spec-type", "ngram-mod"], fresh=True)]
    rows, load = [], contextlib.ExitStack()
    try:
        for server in servers:
            server.start(tools, target, 4096, args.threads)
        configs = [*servers, *engines]
        for c in configs:  # warm-up: load pages, pick kernels
            c.complete(prompts[0].ids(tok)[:64], 8, 0.0, 0)
        load.enter_context(busy_load(args.background_load))
        for t in temps:
            for p in prompts:
                for seed in range(args.seed, args.seed + (args.seeds if t > 0 else 1)):
                    for c in configs:
                        rows += trajectory(c, p, tok, args.max_tokens, t, seed)
    finally:
        load.close()
        for c in [*servers, *engines]:
            c.stop()
    report = summarise(rows, [c.label for c in configs], temps)
    meta = {"command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
            "cpu": cpu_name(), "threads": args.threads, "llama_cpp_build": str(tools),
            "background_load": args.background_load,
            "choice": auto.info["choice"], "costs": auto.info["costs"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "summary": report,
                                                    "runs": rows}, indent=1))
    text = markdown(meta, report) + turn_table(rows, [c.label for c in configs])
    Path(args.out + ".md").write_text(text)
    print(text)
    return 0


def turn_table(rows: list[dict], labels: list[str]) -> str:
    """Multi-turn prompts: per (workload, T, turn, configuration) medians over the
    trajectories of prefill seconds, prompt tokens reused and decoding tok/s."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "/turn" in r["prompt"]:
            groups.setdefault((r["workload"], r["temperature"], r["turn"], r["config"]),
                              []).append(r)
    if not groups:
        return ""
    lines = ["\nPer turn (each configuration decodes its own trajectory; prefill: the prompt "
             "tokens not reused from the cache):\n",
             "| workload | T | turn | configuration | prompt tokens | reused | prefill s | "
             "tok/s |", "|---|---|---|---|---|---|---|---|"]
    order = {label: i for i, label in enumerate(labels)}
    for (w, t, turn, label), rs in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2], order[kv[0][3]])):
        med = {key: statistics.median(r[key] for r in rs)
               for key in ("prompt_tokens", "cached_tokens", "prefill_seconds", "tps")}
        lines.append(f"| {w} | {t:g} | {turn} | {label} | {med['prompt_tokens']:.0f} | "
                     f"{med['cached_tokens']:.0f} | {med['prefill_seconds']:.2f} | "
                     f"{med['tps']:.2f} |")
    return "\n".join(lines) + "\n"


def trajectory(c, p: workloads.Prompt, tok, max_tokens: int, t: float, seed: int
               ) -> list[dict]:
    """One configuration on a prompt: a row per turn. A prompt with follow-ups is an
    agent trajectory: each next prompt is the conversation so far with this
    configuration's own answers, so each side's prompt cache (llama-server's slot,
    specdecode's prefix cache) and drafting from earlier turns show. Every first turn
    starts cold on both sides (llama-server: cache_prompt off; specdecode: cache and
    store emptied), and a server with memory across requests (fresh: ngram-mod)
    restarts before it."""
    rows = []
    for turn in range(1 + len(p.followups)):
        ids = p.turn_ids(tok, [tok.decode(r["tokens"]) for r in rows])
        if turn == 0 and getattr(c, "fresh", False):
            c.restart()
            c.complete(ids[:64], 1, 0.0, 0)  # warm-up
        out = c.complete(ids, max_tokens, t, seed, cold=turn == 0)
        name = f"{p.name}/turn{turn + 1}" if p.followups else p.name
        rows.append({"workload": p.workload, "prompt": name, "turn": turn + 1, "seed": seed,
                     "temperature": t, "config": c.label, "prompt_tokens": len(ids), **out})
        print(f"{name:14} T={t:<4} seed {seed} {c.label:38} {out['tps']:6.2f} tok/s drafted "
              f"{out['drafted']:4} accepted {out['accepted']:4} prefill "
              f"{out['prefill_seconds']:5.2f} s ({out['cached_tokens']} of {len(ids)} reused)",
              file=sys.stderr, flush=True)
    return rows


def summarise(rows: list[dict], labels: list[str], temps: list[float]) -> list[dict]:
    """Per (prompt class, temperature, config): median decode tok/s over its prompts
    (x seeds), speedup over llama.cpp plain paired per prompt and seed, acceptance,
    tau and greedy exact match vs the same engine's plain decoding."""
    out = []
    by = {((r["prompt"], r.get("seed", 0)), r["temperature"], r["config"]): r for r in rows}
    for t in temps:
        for wl in dict.fromkeys(r["workload"] for r in rows):
            names = list(dict.fromkeys((r["prompt"], r.get("seed", 0)) for r in rows
                                       if r["workload"] == wl and r["temperature"] == t))
            for label in labels:
                runs = [by[(n, t, label)] for n in names]
                base = [by[(n, t, "llama.cpp plain")] for n in names]
                engine_plain = "llama.cpp plain" if label.startswith("llama") else \
                    "specdecode plain"
                ref = [by[(n, t, engine_plain)] for n in names]
                drafted = sum(r["drafted"] for r in runs)
                accepted = sum(r["accepted"] for r in runs)
                steps = [r["steps"] for r in runs if r["steps"]]
                tokens = sum(len(r["tokens"]) for r in runs)
                out.append({
                    "workload": wl, "temperature": t, "config": label,
                    "tps": statistics.median(r["tps"] for r in runs),
                    "speedup_vs_llama_plain": statistics.median(
                        r["tps"] / b["tps"] for r, b in zip(runs, base, strict=True)),
                    "acceptance": accepted / drafted if drafted else None,
                    "tau": tokens / sum(steps) if steps else None,
                    "exact": (sum(r["tokens"] == f["tokens"] for r, f in zip(
                        runs, ref, strict=True)), len(runs))
                    if t == 0 and label != engine_plain else None,
                })
    return out


def markdown(meta: dict, report: list[dict]) -> str:
    lines = ["# specdecode (llama.cpp backend) vs llama.cpp\n", f"`{meta['command']}`\n",
             f"CPU: {meta['cpu']}, {meta['threads']} threads; llama.cpp built at "
             f"`{meta['llama_cpp_build']}`; background load: {meta['background_load']} busy "
             "processes.\n", f"specdecode's choice: {meta['choice']}\n",
             f"Cost curve c(b) in plain steps: {meta['costs']}\n",
             "Decoding tokens/s (prefill excluded), median over the prompts of a class "
             "(x seeds at T > 0); speedup paired per prompt and seed against llama.cpp "
             "plain.\n",
             "| workload | T | configuration | tok/s | vs llama.cpp plain | acceptance | tau "
             "| greedy identical to its plain |", "|---|---|---|---|---|---|---|---|"]
    for r in report:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        exact = "-" if r["exact"] is None else f"{r['exact'][0]}/{r['exact'][1]}"
        lines.append(f"| {r['workload']} | {r['temperature']:g} | {r['config']} | "
                     f"{r['tps']:.2f} | {r['speedup_vs_llama_plain']:.2f}x | {acc} | {tau} | "
                     f"{exact} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
