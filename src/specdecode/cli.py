"""`specdecode` command line: pull, models, generate, demo, serve, bench, advise, check.

Flags mirror vLLM / llama.cpp where they exist. Bad input exits with status 2
and one line on stderr (`specdecode: error: ...`), never a traceback (set
SPECDECODE_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specdecode import argtypes, options
from specdecode.sampling import SamplingParams

DEMO_PROMPT = ("Write a Python function `is_palindrome(s: str) -> bool` that ignores case "
               "and non-alphanumeric characters. Include a docstring with two doctests.")


class UserError(Exception):
    """A mistake in the user's input: reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise UserError(f"{self.prog}: {message}")


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}


def unescape(text: str) -> str:
    r"""The backslash escapes \n, \t, \r, \\, \" and \' (llama.cpp's CLI reads these and
    \xNN), so `--stop "\n\n"` is two newlines; any other backslash stays as it is."""
    out, i = [], 0
    while i < len(text):
        nxt = text[i + 1] if i + 1 < len(text) else ""
        if text[i] == "\\" and nxt in ESCAPES:
            out.append(ESCAPES[nxt])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


# The one table from a load option (LoadSpec field, `LLM.load` keyword) to its flag: the
# flags `add_load_args` defines, and the names OptionError messages use on the CLI.
LOAD_FLAGS = {
    "target": "--target", "draft_model": "--draft-model", "drafter": "--drafter",
    "adaptive": "--adaptive", "k": "-k/--num-speculative-tokens",
    "draft_quant": "--draft-quant", "draft_confidence": "--draft-confidence",
    "ngram_max": "--ngram-max", "ngram_min": "--ngram-min", "dtype": "--dtype",
    "device": "--device", "max_seq_len": "--max-context", "backend": "--backend",
    "head": "--head",
}


def _load_arguments() -> dict[str, tuple[tuple[str, ...], dict]]:
    """Each load option's flags and argparse keywords (dest: the LoadSpec field)."""
    from specdecode.options import BACKENDS, DRAFT_QUANTS, DRAFTERS

    return {
        "target": (("--target", "--model", "-m"), dict(
            default="default",
            help="registry name or path to a GGUF file / HF folder (default: default)")),
        "draft_model": (("--draft-model", "-md"), dict(
            help="draft model: registry name or path (default: the pair's draft)")),
        "drafter": (("--drafter",), dict(
            choices=DRAFTERS, help="how drafts are proposed (default: draft-model if a draft "
            "model is known, else none; auto when adaptive: n-gram and suffix lookup, with the "
            "draft model where the measured costs say it can pay)")),
        "head": (("--head",), dict(
            help="a trained head's folder (generate, serve: with --drafter hidden-head or "
            "eagle3; bench: with --drafters ...,hidden-head or ...,eagle3; advise: measured "
            "beside the other drafters)")),
        "adaptive": (("--adaptive",), dict(
            action=argparse.BooleanOptionalAction, help="draft each step only as many tokens "
            "as pay for their verification (default: when the target's measured cost curve "
            "is steep: on for llama.cpp; off for torch unless a cached curve says so)")),
        "k": (("-k", "--num-speculative-tokens"), dict(
            type=argtypes.non_negative_int, metavar="NUM_SPECULATIVE_TOKENS",
            help="draft tokens per step (0 = plain decoding; default 8 for a draft model; 16 "
                 "for n-gram and suffix lookup, 64 when adaptive and for auto; 3 for a trained "
                 "head, 4 when adaptive: the most it may draft)")),
        "draft_quant": (("--draft-quant",), dict(
            choices=DRAFT_QUANTS, default="auto", help="draft model weights: int8 halves a "
            "bf16 draft's bytes per draft token (auto: int8 on CPU with bfloat16 or float16, "
            "none otherwise; torch backend); never changes the output")),
        "draft_confidence": (("--draft-confidence",), dict(
            type=argtypes.probability, default=0.3,
            help="stop a draft after a token the draft model gave less than this "
                 "probability (0 = always draft k; default %(default)s)")),
        "ngram_max": (("--ngram-max",), dict(
            type=argtypes.positive_int,
            help="longest n-gram to look up (default 3; 8 when adaptive)")),
        "ngram_min": (("--ngram-min",), dict(type=argtypes.positive_int, default=1)),
        "dtype": (("--dtype",), dict(choices=["bfloat16", "float32", "float16"],
                                     default="bfloat16",
                                     help="torch backend weights (default %(default)s)")),
        "device": (("--device",), dict(default="cpu", help="cpu, cuda, cuda:1, ...")),
        "max_seq_len": (("--max-context",), dict(
            type=argtypes.positive_int, metavar="MAX_CONTEXT",
            help="KV cache size in tokens, at least 16 (default: min(model context, "
                 "8192))")),
        "backend": (("--backend",), dict(
            choices=BACKENDS, help="llama.cpp: GGUF files on CPU with their own quantised "
            "weights (specdecode build-llama-cpp); torch: the PyTorch model, any device, "
            "--dtype applies; auto: llama.cpp for GGUF on CPU when installed, else torch "
            "(default: $SPECDECODE_BACKEND, else auto)")),
    }


def add_load_args(p: argparse.ArgumentParser, without: tuple[str, ...] = ()) -> None:
    """The load options (`LLM.load`'s keywords) as flags, but those named in `without`
    (a command that sets them itself): generate, serve, bench and advise share them."""
    for name, (flags, kw) in _load_arguments().items():
        if name not in without:
            p.add_argument(*flags, dest=name, **kw)


def load_spec(args: argparse.Namespace, **overrides):
    """The LoadSpec of parsed load options (`add_load_args`); fields a command left out
    keep the spec's defaults, `overrides` replace any."""
    from dataclasses import fields

    from specdecode.options import LoadSpec

    given = {f.name: getattr(args, f.name) for f in fields(LoadSpec) if hasattr(args, f.name)}
    return LoadSpec(**{**given, **overrides})


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", "--temp", type=argtypes.non_negative_float, default=0.0,
                   help="0 (the default): greedy; > 0 samples")
    p.add_argument("--top-p", type=argtypes.top_p, default=1.0)
    p.add_argument("--top-k", type=argtypes.non_negative_int, default=0)
    p.add_argument("--min-p", type=argtypes.probability, default=0.0)
    p.add_argument("--max-tokens", "-n", type=argtypes.positive_int, default=256)
    p.add_argument("--seed", type=argtypes.seed, default=None)
    p.add_argument("--stop", action="append", default=[], type=unescape,
                   help="stop string (repeatable; \\n, \\t, \\r, \\\\, \\\", \\' are "
                        "escapes, as in llama.cpp)")
    p.add_argument("--ignore-eos", action="store_true")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="distil a hidden-state head from the target on this "
                                      "machine (its own answers to training prompts)")
    add_load_args(p, without=("draft_model", "drafter", "k", "adaptive", "draft_quant",
                              "draft_confidence", "ngram_max", "ngram_min", "head"))
    p.add_argument("--out", type=Path, required=True, help="folder for the trained head")
    p.add_argument("--prompts", type=argtypes.positive_int, default=200)
    p.add_argument("--max-new-tokens", type=argtypes.positive_int, default=192)
    p.add_argument("--steps", type=argtypes.positive_int, default=600)
    p.add_argument("--batch", type=argtypes.positive_int, default=256)
    p.add_argument("--draft-vocab", type=argtypes.positive_int, default=8192)
    p.add_argument("--drafter", choices=("hidden-head", "eagle3"), default="hidden-head",
                   help="hidden-head: reads the final state (any backend); eagle3: one "
                   "decoder layer over three inner layers' states (torch backend)")
    p.add_argument("--context", type=argtypes.positive_int, default=256,
                   help="eagle3: prompt positions kept before each answer")
    p.add_argument("--answer-batch", type=argtypes.positive_int, default=1,
                   help="prompts answered at once (one pass steps them all; the gain is the "
                   "CPU's: 16 at a time 5.7x the tokens/s on an AVX-512 BF16 Zen 5, a "
                   "64-row pass 4.4x a step's on an AVX2 Zen 3)")
    p.add_argument("--lr", type=argtypes.positive_float, default=1e-3,
                   help="AdamW's peak learning rate (cosine schedule); an eagle3 head on a "
                   "1.5B target wants ~2e-4 (1e-3 collapsed to one token here)")
    p.add_argument("--val-prompts", type=argtypes.positive_int, default=None,
                   help="validation prompts, answered first (default: 10%% of --prompts)")
    p.add_argument("--train-minutes", type=argtypes.positive_float, default=None,
                   help="training's time budget (--steps cut to what fits it)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="the training loss in float32 or under bfloat16 autocast "
                   "(float32 weights; bf16 is ~3x faster on CPUs with AVX-512 BF16 or AMX)")
    p.add_argument("--head-intermediate", type=argtypes.positive_int, default=None,
                   help="eagle3: the head's MLP width (default: the target's; a narrower "
                   "head trains more steps in the same time and drafts for less)")
    p.add_argument("--collect-minutes", type=argtypes.positive_float, default=None,
                   help="answer no new prompt after this long (the validation prompts "
                   "come first; the training set is what was answered by then)")
    p.add_argument("--answers-per-prompt", type=argtypes.positive_int, default=1,
                   help="eagle3: answers to each training prompt from one prefill of it: "
                   "the greedy one, then sampled ones (labelled with the target's greedy "
                   "tokens); needs --answer-batch at least this")
    p.add_argument("--sample-temperature", type=argtypes.positive_float, default=0.8,
                   help="the sampled answers' temperature")
    p.add_argument("--self-prompts", type=argtypes.non_negative_int, default=0,
                   help="also train on this many requests the target writes itself from "
                   "its chat template's user turn (writing, role-play, advice...: what the "
                   "training sets lack), answered greedily after the validation prompts")
    p.add_argument("--passages", type=argtypes.non_negative_int, default=0,
                   help="eagle3: also train on this many passages the target did not write "
                   "(standard-library source and the language reference, labelled with the "
                   "target's greedy tokens): one pass each, several times the tokens/s of "
                   "collecting answers")
    p.add_argument("--soft-labels", action="store_true",
                   help="eagle3: train against the target's distribution at each position "
                   "(its 32 most likely tokens, kept while collecting) instead of its greedy "
                   "token alone")
    p = sub.add_parser("export", help="write an eagle3 head in the vLLM speculators format "
                                      "and print the vllm serve command")
    p.add_argument("--head", type=Path, required=True, help="a head trained by train")
    p.add_argument("--out", type=Path, required=True, help="folder for the exported head")
    p.add_argument("--target", default="default",
                   help="the target it was trained for (its hub name goes in the config)")
    p.add_argument("--verifier", default=None,
                   help="the target's name on the model hub or a local HF folder "
                   "(default: the registry target's hub name)")
    p.add_argument("--architecture", default=None,
                   help="the target's HF architecture (default: the registry target's)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=argtypes.positive_int,
                   default=3)


def build_parser() -> Parser:
    parser = Parser(prog="specdecode", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("pull", help="download a registry model (or pair) into the cache")
    p.add_argument("name", help="registry name, e.g. default or smollm2-135m")

    sub.add_parser("models", help="list registry models and whether they are pulled")

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send PROMPT as one user message")
    p.add_argument("--messages", type=Path, default=None,
                   help="JSON file with a list of {role, content} messages")
    add_load_args(p)
    _sampling_args(p)
    p.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding; print both speeds and whether outputs match")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("demo", help="pull the default pair and run a chat prompt vs plain")
    p.add_argument("--max-tokens", "-n", type=argtypes.positive_int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    p.add_argument("-k", "--num-speculative-tokens", type=argtypes.non_negative_int, default=None,
                   help="draft tokens per step at most (default: the backend's default)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server")
    add_load_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=argtypes.port, default=8000, help="default 8000")
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"),
                   help="require this key on every route but /health (default: "
                        "$SPECDECODE_API_KEY; none: no auth)")
    p.add_argument("--max-queue", type=argtypes.non_negative_int, default=16,
                   help="requests that may wait while one generates; more get a 429 "
                        "(default 16)")
    p.add_argument("--prefix-store-mb", type=argtypes.non_negative_int, default=2048,
                   help="memory for earlier conversations' caches, so users taking turns "
                        "each resume their own without a prefill (default 2048; 0: off)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the target's name)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   default="info")

    _train_parser(sub)
    p = sub.add_parser("build-llama-cpp",
                       help="build llama.cpp for this x86-64 CPU (needs AVX2, FMA, F16C, "
                            "BMI2; adds AVX-512 and VNNI where present; never AMX) into the "
                            "cache; the llama.cpp backend then loads it (about 9 min on 2 "
                            "cores, once)")
    p.add_argument("-j", "--jobs", type=argtypes.positive_int, default=None)

    from specdecode.bench import cli as bench_cli

    bench_cli.add_parsers(sub, add_load_args)
    from specdecode.check import cli as check_cli

    check_cli.add_parser(sub, add_load_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError, KeyError, FileNotFoundError, OSError, RuntimeError) as e:
        if os.environ.get("SPECDECODE_DEBUG"):
            raise
        print(error_line(e), file=sys.stderr)
        return 2


def error_line(e: Exception) -> str:
    """The one stderr line for an error: its first line, a load option's error with
    the options named by their flags (LOAD_FLAGS)."""
    from specdecode.options import OptionError

    if isinstance(e, OptionError):
        message = e.render(LOAD_FLAGS)
    else:
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    first = str(message).strip().splitlines()[0] if str(message).strip() else type(e).__name__
    prefix = "" if first.startswith("specdecode") else "specdecode: error: "
    return f"{prefix}{first}"


# -- commands ---------------------------------------------------------------------


def cmd_pull(args) -> int:
    """Download, then read each file's header once (models/gguf_meta.py keeps it), so
    the first load does not pay gguf's slow parse."""
    from specdecode.limits import model_config
    from specdecode.models.registry import pull

    for path in pull(args.name):
        model_config(path)
        print(path)
    return 0


def cmd_models(args) -> int:
    from specdecode.models.registry import MODELS, PAIRS, model_path

    for name, (target, draft) in PAIRS.items():
        print(f"{name:22s} pair: {target} + {draft}")
    for name, entry in MODELS.items():
        state = "pulled" if model_path(name).exists() else "not pulled"
        print(f"{name:22s} {entry.description} [{state}]")
    return 0


def _params(args) -> SamplingParams:
    from specdecode.text import check_stop_strings

    check_stop_strings(args.stop)  # the limits on stop strings, before loading anything
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def _read_messages(path: Path) -> list[dict]:
    """The messages of a JSON file as {role: str, content: str} dicts; content may
    also be a list of text parts ({"type": "text", "text": ...}, joined, as the
    server takes them). Anything else is a UserError naming the message."""
    if not path.is_file():
        raise UserError(f"no such messages file: {path}")
    try:
        messages = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if isinstance(messages, dict) and "messages" in messages:
        messages = messages["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{path} must hold a non-empty list of {{role, content}} messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: object, i: int) -> dict:
    """One message by the tokenizer's rule (text.chat_message: {role, content}, a role
    of text.ROLES, other keys dropped, text parts joined); a malformed one is a
    UserError naming it, before any model is loaded."""
    from specdecode import text

    try:
        return text.chat_message(m, i)
    except ValueError as e:
        raise UserError(str(e)) from None


def _check_prompt(args) -> None:
    """A PROMPT or --messages, not both; the prompt must be valid UTF-8 text."""
    if args.prompt is None and args.messages is None:
        raise UserError("give a PROMPT or --messages FILE")
    if args.prompt is not None and args.messages is not None:
        raise UserError("give a PROMPT or --messages FILE, not both")
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:  # argv bytes that were not UTF-8 (surrogate escapes)
            raise UserError("the prompt is not valid UTF-8 text") from None


def check_port_free(host: str, port: int) -> None:
    """Bind (host, port) once, as the server will, before the model is loaded."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(address)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def cmd_generate(args) -> int:
    from specdecode.llm import LLM

    params = _params(args)  # validate before loading anything
    _check_prompt(args)
    options.check_device(args.device)
    messages = _read_messages(args.messages) if args.messages else None
    llm = LLM.from_spec(load_spec(args))
    prompt_ids = llm.encode(args.prompt, messages, chat=args.chat)
    return run_and_report(llm, prompt_ids, params, args.seed, args.compare_plain, args.json)


def cmd_demo(args) -> int:
    from specdecode.llm import LLM
    from specdecode.models.registry import pull

    pull("default")
    llm = LLM.load("default", k=args.num_speculative_tokens, dtype=args.dtype)
    prompt_ids = llm.encode(DEMO_PROMPT, chat=True)
    if not args.json:
        print(f"backend: {backend_note(llm.info.backend)}", file=sys.stderr)
        print(f"prompt: {DEMO_PROMPT}\n", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens)
    return run_and_report(llm, prompt_ids, params, 0, compare_plain=True, as_json=args.json)


def backend_note(backend: str) -> str:
    """Which backend runs the models, and whether a faster one could."""
    if backend == "llama.cpp":
        return "llama.cpp (the GGUF's own quantised weights; the fastest backend here)"
    return (f"{backend} (llama.cpp is not installed: `specdecode build-llama-cpp` builds it, "
            "about 3x faster on a CPU)")


def run_and_report(llm, prompt_ids, params, seed, compare_plain: bool, as_json: bool) -> int:
    from specdecode.report import divergence, print_report, result_dict

    speculative = llm.speculative
    if as_json:
        result = llm.generate(prompt_ids, params, seed, speculative=speculative)
    else:
        result = _stream_to_stdout(llm, prompt_ids, params, seed, speculative)
    warning = guard_warning(result.stats)
    if warning:
        print(warning, file=sys.stderr)
    plain = parted = None
    if compare_plain:
        llm.target.rollback(0)  # a prefill of its own, as the first run's (no reuse)
        plain = llm.generate(prompt_ids, params, seed, speculative=False)
        parted = divergence(llm, prompt_ids, params, result, plain)
    if as_json:
        print(json.dumps(result_dict(llm, result, plain, parted)))
    else:
        print_report(llm, result, plain, divergence=parted)
    return 0


def guard_warning(stats) -> str | None:
    """One stderr line when the acceptance-collapse guard (collapse.py) made steps
    plain or a drafter raised (None: neither happened)."""
    parts = []
    if stats.guard_plain_steps or stats.guard_engagements:
        parts.append(f"acceptance fell below break-even: speculation was off for "
                     f"{stats.guard_plain_steps} of {stats.steps} steps (plain decoding, "
                     "probes now and then)")
    if stats.drafter_errors:
        parts.append(f"{stats.drafter_errors} drafter(s) raised and were switched off "
                     "(output unchanged; see the log)")
    return "specdecode: warning: " + "; ".join(parts) if parts else None


def _stream_to_stdout(llm, prompt_ids, params, seed, speculative):
    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = llm.generate(prompt_ids, params, seed, speculative, on_text=write)
    sys.stdout.write("\n")
    return result


def served_model_name(target: str) -> str:
    """A registry name as is (a pair's target for a pair), a path's file stem."""
    from specdecode.models.registry import MODELS, PAIRS

    if target in PAIRS:
        return PAIRS[target][0]
    return target if target in MODELS else Path(target).stem


def cmd_serve(args) -> int:
    from specdecode.llm import LLM
    from specdecode.server import serve

    options.check_device(args.device)
    check_port_free(args.host, args.port)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"specdecode: warning: serving on {args.host} without --api-key",
              file=sys.stderr)
    spec = load_spec(args)
    print_memory_plan(spec)
    llm = LLM.from_spec(spec)
    serve(llm, host=args.host, port=args.port, api_key=args.api_key or None,
          max_queue=args.max_queue,
          model_name=args.served_model_name or served_model_name(args.target),
          log_level=args.log_level, prefix_store_mb=args.prefix_store_mb)
    return 0


def print_memory_plan(spec) -> None:
    """The memory plan of `spec` (memory.py) as one stderr line, before loading."""
    from specdecode.memory import memory_plan

    print(f"specdecode: {memory_plan(spec).describe()}", file=sys.stderr)


def cmd_bench(args) -> int:
    from specdecode.bench.cli import cmd_bench as run

    return run(args, load_spec(args))


def cmd_advise(args) -> int:
    from specdecode.bench.cli import cmd_advise as run

    return run(args, load_spec(args))


def cmd_check(args) -> int:
    from specdecode.check.cli import cmd_check as run

    options.check_device(args.device)
    return run(args, load_spec(args))


def cmd_train(args) -> int:
    import json
    from dataclasses import replace

    from specdecode.llm import LLM
    from specdecode.models.registry import cache_dir
    from specdecode.train.run import RunOptions, distil, target_tables

    spec = load_spec(args, drafter="none", max_seq_len=args.max_seq_len or 2048)
    if args.drafter == "eagle3" and spec.backend not in ("torch", None, "auto"):
        raise UserError(f"--drafter eagle3 reads inner layers' states: only --backend torch "
                        f"has them (not {spec.backend})")
    if args.answers_per_prompt > 1 and (args.drafter != "eagle3"
                                        or args.answer_batch < args.answers_per_prompt):
        raise UserError(f"--answers-per-prompt {args.answers_per_prompt} needs --drafter "
                        f"eagle3 and --answer-batch {args.answers_per_prompt} or more")
    if args.passages and args.drafter != "eagle3":
        raise UserError("--passages needs --drafter eagle3")
    if args.soft_labels and args.drafter != "eagle3":
        raise UserError("--soft-labels needs --drafter eagle3")
    if args.drafter == "eagle3":
        spec = replace(spec, backend="torch")
    llm = LLM.from_spec(spec)
    target, path = llm.decoder.target, Path(llm.info.target)
    embed, lm_head = target_tables(target, path)
    cache = cache_dir() / "train" / f"{path.stem}-{llm.info.backend}"  # $SPECDECODE_CACHE
    options = RunOptions(prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                         steps=args.steps, batch=args.batch, draft_vocab=args.draft_vocab,
                         drafter=args.drafter, context=args.context,
                         answer_batch=args.answer_batch, collect_minutes=args.collect_minutes,
                         val_prompts=args.val_prompts, train_minutes=args.train_minutes,
                         lr=args.lr, precision=args.precision,
                         head_intermediate=args.head_intermediate,
                         answers_per_prompt=args.answers_per_prompt,
                         sample_temperature=args.sample_temperature,
                         self_prompts=args.self_prompts, passages=args.passages,
                         soft_labels=args.soft_labels)
    if args.self_prompts:
        _check_self_prompts(llm.tokenizer)
    summary = distil(target, lambda p: llm.encode(p, chat=True), embed, lm_head,
                     llm.decoder.eos_token_ids, cache, args.out, options, tokenizer=llm.tokenizer,
                     report=lambda p: print(f"step {p['step']}: tau {p['tau']:.2f} "
                                            f"(validation)", file=sys.stderr))
    print(json.dumps({k: v for k, v in summary.items() if k != "curve"}, indent=1))
    if args.soft_labels and summary["soft_label_windows"] < summary["train_windows"]:
        print(f"note: {summary['train_windows'] - summary['soft_label_windows']} of "
              f"{summary['train_windows']} training windows were collected before soft labels "
              "were kept (an older cache): those trained on the greedy token", file=sys.stderr)
    print(f"use it: specdecode generate --target {args.target} --drafter {args.drafter} "
          f"--head {args.out} --chat 'your prompt'", file=sys.stderr)
    return 0


def _check_self_prompts(tokenizer) -> None:
    """--self-prompts needs a chat template whose user turn ends in a control token."""
    from specdecode.train.self_prompts import user_turn
    if not tokenizer.has_chat_template:
        raise UserError("--self-prompts needs a target with a chat template")
    try:
        user_turn(tokenizer)
    except ValueError as e:
        raise UserError(f"--self-prompts: {e}") from None


def cmd_export(args) -> int:
    from specdecode.drafters.eagle import read_head
    from specdecode.train import speculators

    cfg, state = read_head(args.head)
    hub = speculators.HUB_NAMES.get(args.target)
    if args.verifier is None and hub is None:
        raise UserError(f"--target {args.target} is not a registry model: give --verifier "
                        "(its hub name or local folder) and --architecture")
    verifier = args.verifier or hub[0]
    architecture = args.architecture or (hub[1] if hub else "LlamaForCausalLM")
    speculators.export(args.out, cfg, state, verifier=verifier, architecture=architecture,
                       k=args.k)
    problems = speculators.validate(args.out) + speculators.package_check(args.out)
    if problems:
        raise UserError(f"the exported head at {args.out} is not valid: " + "; ".join(problems))
    print(f"exported {args.out} (speculators Eagle-3 format; checked: names, shapes and "
          f"the vocabulary mapping{speculators.package_note()})", file=sys.stderr)
    print(speculators.serve_command(args.out))
    return 0


def cmd_build_llama_cpp(args) -> int:
    from specdecode.models import llama_cpp_build

    print(llama_cpp_build.build(args.jobs))
    return 0


COMMANDS = {"build-llama-cpp": cmd_build_llama_cpp, "pull": cmd_pull,
            "models": cmd_models, "generate": cmd_generate, "demo": cmd_demo,
            "serve": cmd_serve, "bench": cmd_bench, "advise": cmd_advise, "train": cmd_train,
            "export": cmd_export, "check": cmd_check}

if __name__ == "__main__":
    sys.exit(main())
