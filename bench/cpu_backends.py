"""CPU verification backends side by side: what one step and a verification of b tokens cost.

    python bench/cpu_backends.py --out bench/results/cpu-backends

Candidates (each measured in its own process, one after another, so memory is
its own and nothing else runs meanwhile):
- llama.cpp on the default target's GGUF as shipped (Q4_K_M) and re-quantized
  from it by llama.cpp's own quantizer to layouts with batched CPU kernels
  (Q4_0: repacked 8x8 GEMM on AVX2; Q8_0), cached under the cache folder;
- torch (our Transformer) on the same weights in bfloat16 and float32;
- OpenVINO with int4 / int8 weight compression: every projection of the target
  (q, k, v, o, gate, up, down in each layer, and the lm_head) at its real shape
  with random weights, as one compiled graph; attention, norms and the KV cache
  are left out, so its times are a LOWER bound of a whole step (if even that is
  slower than llama.cpp's whole step at b = 1, the candidate cannot win here).

Reported per candidate: b = 1 step ms (after a 256-token context), c(b) =
t(b) / t(1) for b up to 33, prefill tokens/s (a 512-token prompt), peak
resident memory, and for whole models how far the last row of a b-token pass
is from the same token run one at a time (max |logit difference|, argmax
agreement): what batched verification does to exactness on that backend.
Medians of repeated passes (costs.measure_curve); the machine is named in the
output. Compare numbers only within one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33)
CANDIDATES = ("llama.cpp:Q4_K_M", "llama.cpp:Q4_0", "llama.cpp:Q8_0", "torch:bfloat16",
              "torch:float32", "openvino:int4", "openvino:int8")


def requantized(ftype: str) -> Path:
    """The default target re-quantized to `ftype` by llama.cpp (cached; the shipped
    Q4_K_M file itself for "Q4_K_M")."""
    from specdecode.models import llama_cpp
    from specdecode.models.registry import model_path
    src = model_path("qwen2.5-coder-1.5b")
    if ftype == "Q4_K_M":
        return src
    out = src.parent.parent / "requantized" / f"{src.stem}-{ftype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lib = llama_cpp._lib()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    start = time.perf_counter()
    tmp = out.with_suffix(".part")
    if lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
    tmp.rename(out)
    print(f"re-quantized to {ftype} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return out


def whole_model(name: str):
    """(model, what it is) for a whole-model candidate."""
    backend, variant = name.split(":")
    if backend == "llama.cpp":
        from specdecode.models.llama_cpp import LlamaCppLM
        path = requantized(variant)
        return LlamaCppLM(path, max_seq_len=1024), path.name
    from specdecode.models import loading
    from specdecode.models.registry import model_path
    path = model_path("qwen2.5-coder-1.5b")
    return loading.load(path, dtype=variant, max_seq_len=1024).model, f"{path.name} as {variant}"


def batch_exactness(model, context: list[int], b: int = 9) -> dict:
    """The b rows of one pass against the same tokens fed one at a time."""
    import torch
    feed = torch.tensor(context[-b:])  # [b] int64
    model.prefill(torch.tensor(context))
    base = model.cached_len
    batched = model.forward(feed, last_n=b).logits.float()  # [b, vocab]
    model.rollback(base)
    single = torch.cat([model.forward(feed[i:i + 1], last_n=1).logits.float()
                        for i in range(b)])  # [b, vocab]
    model.rollback(base)
    return {"rows": b, "max_abs_diff": float((batched - single).abs().max()),
            "argmax_agree": int((batched.argmax(-1) == single.argmax(-1)).sum())}


def measure_whole(name: str) -> dict:
    import torch

    from specdecode.costs import measure_curve
    model, what = whole_model(name)
    context = list(range(1000, 1256))
    curve, clean = measure_curve(model, context, SIZES)
    prompt = torch.tensor(list(range(2000, 2512)))  # [512] int64
    model.rollback(0)
    start = time.perf_counter()
    model.prefill(prompt)
    prefill = len(prompt) / (time.perf_counter() - start)
    model.rollback(0)
    return {"what": what, "curve_s": curve, "clean": clean, "prefill_tps": prefill,
            "exactness": batch_exactness(model, context)}


def projection_graph(bits: int, cfg) -> object:
    """One OpenVINO graph: every projection of the model, weight-compressed (int4
    groups of 128 or int8 per channel, asymmetric), chained so none is skipped."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as op
    rng = np.random.default_rng(0)

    def weight(n: int, k: int):
        group = 128 if bits == 4 else k
        kind = ov.Type.u4 if bits == 4 else ov.Type.u8
        shape = [n, k // group, group]
        q = ov.Tensor(kind, ov.Shape(shape))
        q.data.view(np.uint8)[...] = rng.integers(0, 256, q.data.view(np.uint8).shape,
                                                  dtype=np.uint8)
        zp = ov.Tensor(kind, ov.Shape([n, k // group, 1]))
        zp.data.view(np.uint8)[...] = 0x88 if bits == 4 else 128
        scale = op.constant((rng.random((n, k // group, 1)) * 0.01).astype(np.float16))
        w = op.multiply(op.subtract(op.convert(op.constant(q), ov.Type.f16),
                                    op.convert(op.constant(zp), ov.Type.f16)), scale)
        w = op.reshape(w, op.constant(np.array([n, k], np.int64)), False)
        return op.convert(w, ov.Type.f32)

    h, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    x = op.parameter([-1, h], ov.Type.f32, name="x")
    y = x
    for _ in range(cfg.num_layers):
        q = op.matmul(y, weight(h, h), False, True)
        k = op.matmul(y, weight(kv, h), False, True)
        v = op.matmul(y, weight(kv, h), False, True)
        mixed = op.add(q, op.reduce_sum(op.add(k, v), op.constant(np.int64(-1)), True))
        y = op.add(y, op.matmul(mixed, weight(h, h), False, True))
        g = op.matmul(y, weight(f, h), False, True)
        u = op.matmul(y, weight(f, h), False, True)
        y = op.add(y, op.matmul(op.multiply(op.swish(g), u), weight(h, f), False, True))
    logits = op.matmul(y, weight(cfg.vocab_size, h), False, True)
    return ov.Model([logits], [x])


def measure_projections(name: str) -> dict:
    import statistics

    import numpy as np
    import openvino as ov

    from specdecode.models.loading import read_config
    from specdecode.models.registry import model_path
    cfg = read_config(model_path("qwen2.5-coder-1.5b"))
    bits = int(name.split(":")[1].removeprefix("int"))
    compiled = ov.Core().compile_model(projection_graph(bits, cfg), "CPU", {
        "INFERENCE_NUM_THREADS": 2, "PERFORMANCE_HINT": "LATENCY",
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"})
    request, curve = compiled.create_infer_request(), {}
    for b in SIZES:
        x = np.random.default_rng(b).random((b, cfg.hidden_size), dtype=np.float32)
        times = []
        for r in range(6):
            start = time.perf_counter()
            request.infer({0: x})
            if r:
                times.append(time.perf_counter() - start)
        curve[b] = statistics.median(times)
    return {"what": f"projections only (lower bound), int{bits}, OpenVINO {ov.__version__}",
            "curve_s": curve, "clean": None, "prefill_tps": None, "exactness": None}


def measure_one(name: str) -> dict:
    """One candidate, measured in this process."""
    out = (measure_projections if name.startswith("openvino") else measure_whole)(name)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"candidate": name, **out}


def table(rows: list[dict]) -> str:
    head = "| candidate | b=1 ms | " + " | ".join(f"c({b})" for b in SIZES[1:]) + \
        " | prefill tok/s | peak RSS MB | batched vs 1-token |"
    lines = [head, "|" + "---|" * (len(SIZES) + 4)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['candidate']} | {r['error']} |")
            continue
        c = {int(b): t for b, t in r["curve_s"].items()}
        ex = r["exactness"]
        exact = "-" if ex is None else \
            f"max diff {ex['max_abs_diff']:.2g}, argmax {ex['argmax_agree']}/{ex['rows']}"
        prefill = "-" if r["prefill_tps"] is None else f"{r['prefill_tps']:.0f}"
        lines.append(f"| {r['candidate']} | {c[1] * 1e3:.1f} | "
                     + " | ".join(f"{c[b] / c[1]:.2f}" for b in SIZES[1:])
                     + f" | {prefill} | {r['peak_rss_mb']:.0f} | {exact} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/cpu-backends")
    ap.add_argument("--only", action="append", choices=CANDIDATES, help="candidates to run")
    ap.add_argument("--one", choices=CANDIDATES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one)))
        return 0
    from specdecode.costs import cpu_name
    rows = []
    for name in args.only or CANDIDATES:
        done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                              text=True)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["failed"])[-1]
            rows.append({"candidate": name, "error": last[:200]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    meta = {"command": " ".join(sys.argv), "cpu": cpu_name(), "threads": 2}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(f"Machine: {meta['cpu']}; `{meta['command']}`\n\n"
                                      + table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
